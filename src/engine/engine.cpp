// The serving engine (include/treeattn/engine.hpp) from its parts: the scheduler (scheduler.hpp:
// the inbox, admission, each step's work), the KV manager (kv_manager.hpp: pages and the prefix
// index), the step description and its wire format (step_plan.hpp) and the model runner
// (model_runner.hpp: the forward pass). Here: creation and the ranks' agreement on the
// configuration, one step on every rank (plan, broadcast, apply, agree, forward, sample), and
// the metrics.
#include "treeattn/engine.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <mutex>
#include <string>

#include "engine/dense_plan.hpp"
#include "engine/exchange.hpp"
#include "engine/kv_manager.hpp"
#include "engine/model_runner.hpp"
#include "engine/scheduler.hpp"
#include "engine/step_plan.hpp"
#include "model/structured/constraint.hpp"
#include "treeattn/host_memory.hpp"
#include "treeattn/kv_tiles.hpp"

namespace treeattn::engine {
namespace {

std::string rank_prefix(const Communicator& c) { return "rank " + std::to_string(c.rank()) + ": "; }

bool valid_page_tokens(int64_t t) { return t == 16 || (t >= 32 && t <= 256 && t % 32 == 0); }

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

struct Engine::Impl {
  Communicator* comm = nullptr;
  const model::LlamaModel* model = nullptr;
  EngineConfig cfg;
  int p = 1, me = 0;
  std::unique_ptr<KVManager> kv;
  std::unique_ptr<Scheduler> sched;
  std::unique_ptr<ModelRunner> runner;
  DenseChoice dense;
  int64_t steps = 0, generated_total = 0;
  std::atomic<int64_t> progress{0};  // steps completed (Engine::progress)
  std::vector<double> rank_times;  // all-gather of per-rank timings
  std::vector<double> rank_merge_s, rank_attn_s, rank_dense_s;
  mutable std::mutex snapshot_mu;
  EngineMetrics snapshot;  // guarded by snapshot_mu
  // Structured output: every token's bytes and the end-of-generation tokens, built at the
  // first constrained draw (the same on every rank); the logits a constrained draw samples from.
  std::shared_ptr<const structured::Vocabulary> vocabulary;
  std::vector<float> masked;

  // ------------------------------------------------------------------------------------------
  Status check_request(const Request& r) const {
    const auto& mc = model->config();
    if (r.prompt.empty()) return invalid_argument("the prompt is empty");
    for (std::size_t i = 0; i < r.prompt.size(); ++i)
      if (r.prompt[i] < 0 || r.prompt[i] >= mc.n_vocab)
        return invalid_argument("prompt token " + std::to_string(i) + " is id " +
                                std::to_string(r.prompt[i]) + ", outside the vocabulary [0, " +
                                std::to_string(mc.n_vocab) + ")");
    for (const TokenId t : r.stop_tokens)
      if (t < 0 || t >= mc.n_vocab)
        return invalid_argument("stop token id " + std::to_string(t) +
                                " is outside the vocabulary [0, " + std::to_string(mc.n_vocab) +
                                ")");
    if (r.max_new_tokens < 1)
      return invalid_argument("max_new_tokens is " + std::to_string(r.max_new_tokens) +
                              "; it must be >= 1");
    TREEATTN_RETURN_IF_ERROR(r.sampling.validate(mc.n_vocab));
    if (r.logprobs < -1 || r.logprobs > model::kMaxTopLogprobs)
      return invalid_argument("logprobs is " + std::to_string(r.logprobs) +
                              "; it must be -1 (none) or in [0, " +
                              std::to_string(model::kMaxTopLogprobs) + "]");
    if (!r.response_format.empty())
      TREEATTN_RETURN_IF_ERROR(structured::compile_response_format(r.response_format).status());
    if (r.max_new_tokens > max_sequence_tokens())  // also keeps the sum below from overflowing
      return invalid_argument("max_new_tokens is " + std::to_string(r.max_new_tokens) +
                              ", but the KV pools hold at most " +
                              std::to_string(max_sequence_tokens()) +
                              " positions for one sequence");
    const int64_t need = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens - 1;
    if (need > max_sequence_tokens())
      return invalid_argument(
          "the prompt has " + std::to_string(r.prompt.size()) + " tokens and max_new_tokens is " +
          std::to_string(r.max_new_tokens) + ": " + std::to_string(need) +
          " positions to store, but the KV pools hold at most " +
          std::to_string(max_sequence_tokens()) + " positions for one sequence");
    return Status::ok();
  }

  int64_t max_sequence_tokens() const { return kv->max_sequence_tokens(); }

  // The sequence's structured-output constraint, made at its first draw (null: free text).
  Result<structured::TokenConstraint*> constraint_of(Sequence& s) {
    if (s.req.response_format.empty()) return nullptr;
    if (s.constraint) return s.constraint.get();
    auto grammar = structured::compile_response_format(s.req.response_format);
    TREEATTN_RETURN_IF_ERROR(grammar.status());
    if (!vocabulary) {
      auto tok = Tokenizer::from_gguf(model->file());
      TREEATTN_RETURN_IF_ERROR(tok.status());
      vocabulary =
          structured::vocabulary_of(*tok, static_cast<int32_t>(model->config().n_vocab));
    }
    s.constraint = std::make_shared<structured::TokenConstraint>(*grammar, vocabulary);
    return s.constraint.get();
  }

  // Samples the step's tokens (identical on every rank) and sends rank 0's events.
  Status sample(const StepLogits& out) {
    const auto V = static_cast<std::size_t>(model->config().n_vocab);
    std::vector<RequestId> done;
    for (std::size_t i = 0; i < out.seqs.size(); ++i) {
      Sequence& s = *out.seqs[i];
      // The processed logits (logit_bias, penalties), then a constrained request's mask: what
      // the token is drawn from and its logprobs are of. return_logits gives the model's own.
      const std::span<const float> lg = out.logits.subspan(i * V, V);
      std::span<const float> processed = s.sampler.process(lg, s.tokens, s.prompt_len);
      auto constraint = constraint_of(s);
      TREEATTN_RETURN_IF_ERROR(constraint.status());
      if (*constraint != nullptr) {
        masked.assign(processed.begin(), processed.end());
        (*constraint)->mask(masked);
        processed = masked;
      }
      const TokenId tok = s.sampler.sample(processed);
      const bool ended = *constraint != nullptr && (*constraint)->accept(tok) !=
                                                       structured::TokenConstraint::Step::kContinue;
      s.tokens.push_back(tok);
      ++s.generated;
      ++generated_total;
      if (s.generated == 1) s.first_token = Clock::now();
      TokenEvent ev;
      ev.token = tok;
      ev.index = s.generated - 1;
      if (ended || std::find(s.req.stop_tokens.begin(), s.req.stop_tokens.end(), tok) !=
                       s.req.stop_tokens.end())
        ev.finish = FinishReason::kStop;
      else if (s.generated >= s.req.max_new_tokens)
        ev.finish = FinishReason::kLength;
      if (s.req.return_logits && me == 0) ev.logits.assign(lg.begin(), lg.end());
      if (s.req.logprobs >= 0 && me == 0)
        ev.logprobs = model::token_logprobs(processed, tok, s.req.logprobs);
      Scheduler::emit(s, ev);
      if (ev.finish != FinishReason::kNone) done.push_back(s.id);
    }
    for (RequestId id : done) sched->retire(id);
    return Status::ok();
  }

  void update_snapshot() {
    EngineMetrics m;
    m.running = static_cast<int64_t>(sched->running().size());
    m.requests_total = sched->requests_total();
    m.prompt_tokens_total = sched->prompt_tokens_total();
    m.cached_tokens_total = sched->cached_tokens_total();
    m.generated_tokens_total = generated_total;
    m.steps = steps;
    const PageTable& table = kv->table();
    m.pages_per_rank = table.pages_per_rank();
    for (int r = 0; r < p; ++r) {
      m.pages_used.push_back(table.used_pages(r));
      m.pages_cached.push_back(table.cached_pages(r));
      m.pages_free.push_back(table.free_pages(r));
    }
    if (kv->has_window()) {
      const PageTable& wt = kv->window_table();
      m.window_pages_per_rank = wt.pages_per_rank();
      for (int r = 0; r < p; ++r) {
        m.window_pages_used.push_back(wt.used_pages(r));
        m.window_pages_cached.push_back(wt.cached_pages(r));
        m.window_pages_free.push_back(wt.free_pages(r));
      }
    }
    const auto& mc = model->config();
    for (int l = 0; l < mc.n_layers; ++l)
      m.layer_in_window.push_back(kv->has_window() && mc.local_layer[static_cast<std::size_t>(l)]);
    m.merge_seconds = rank_merge_s;
    m.attention_seconds = rank_attn_s;
    m.dense_seconds = rank_dense_s;
    const RunnerTimes& t = runner->times();
    m.merges = t.merges;
    m.rows_pass_q = t.rows_pass_q;
    m.rows_kv_exchange = t.rows_kv;
    m.kv_exchange_bytes = t.kv_bytes_sent;
    m.bytes_sent = comm->counters().p2p_bytes + comm->counters().collective_payload_bytes;
    m.preempted = static_cast<int64_t>(sched->preempted().size());
    m.waiting = sched->waiting() + m.preempted;
    m.preemptions_total = sched->preemptions_total();
    const Status failure = sched->failure();
    m.failed = !failure.is_ok();
    m.error = failure.message();
    std::lock_guard lk(snapshot_mu);
    snapshot = std::move(m);
  }

  // Rank 0 plans the step and broadcasts its description; the others receive it in `words`.
  // A planning failure on rank 0 is broadcast as a kFail step, then returned.
  Status broadcast_plan(Plan& pl, std::vector<int64_t>& words) {
    int64_t header[2] = {0, 0};
    Status planned;
    if (me == 0) {
      auto r = sched->make_plan();
      if (r.is_ok()) {
        pl = std::move(r).value();
      } else {  // the others learn it from the description instead of waiting for a timeout
        planned = r.status();
        pl = Plan{};
        pl.kind = StepKind::kFail;
      }
      words = encode_plan(pl);
      header[0] = static_cast<int64_t>(words.size());
    }
    comm->set_context("engine step " + std::to_string(steps));
    TREEATTN_RETURN_IF_ERROR(comm->broadcast(header, sizeof(header), 0));
    if (me != 0) {
      if (header[0] < static_cast<int64_t>(kPlanHeaderWords) || header[0] > (int64_t{1} << 40))
        return internal_error(rank_prefix(*comm) + "malformed step description length " +
                              std::to_string(header[0]) + " from rank 0");
      words.resize(static_cast<std::size_t>(header[0]));
    }
    TREEATTN_RETURN_IF_ERROR(comm->broadcast(words.data(), words.size() * sizeof(int64_t), 0));
    return planned;
  }

  // Other ranks: decode rank 0's description and apply its cancels and admissions. *applied
  // says whether this rank could (it goes on to the step's agreement either way); an error
  // return (rank 0 failed to plan) ends the step at once.
  Status receive_plan(const std::vector<int64_t>& words, Plan& pl, Status* applied) {
    auto r = decode_plan(words);
    if (!r.is_ok()) {
      *applied = Status(r.status().code(), rank_prefix(*comm) + r.status().message());
      return Status::ok();
    }
    pl = std::move(r).value();
    if (pl.kind == StepKind::kFail)
      return internal_error(rank_prefix(*comm) + "rank 0 failed while planning engine step " +
                            std::to_string(steps) + " (its message says why)");
    *applied = sched->apply_plan(pl);
    return Status::ok();
  }

  // Every rank learns whether every rank could apply the description (one all-gather, which
  // also carries each rank's timings for the metrics), so a rank that cannot is named everywhere
  // instead of leaving the others waiting in a merge.
  Status agree(const Status& applied) {
    const RunnerTimes& t = runner->times();
    double mine[4] = {applied.is_ok() ? 1.0 : 0.0, t.merge_s, t.attn_s, t.dense_s};
    rank_times.resize(static_cast<std::size_t>(4 * p));
    TREEATTN_RETURN_IF_ERROR(comm->allgather(mine, sizeof(mine), rank_times.data()));
    if (!applied.is_ok()) return applied;
    for (int r = 0; r < p; ++r)
      if (rank_times[static_cast<std::size_t>(4 * r)] != 1.0)
        return internal_error(rank_prefix(*comm) + "rank " + std::to_string(r) +
                              " could not apply engine step " + std::to_string(steps) +
                              " (its message says why)");
    for (auto* v : {&rank_merge_s, &rank_attn_s, &rank_dense_s})
      v->assign(static_cast<std::size_t>(p), 0.0);
    for (int r = 0; r < p; ++r) {
      rank_merge_s[static_cast<std::size_t>(r)] = rank_times[static_cast<std::size_t>(4 * r + 1)];
      rank_attn_s[static_cast<std::size_t>(r)] = rank_times[static_cast<std::size_t>(4 * r + 2)];
      rank_dense_s[static_cast<std::size_t>(r)] = rank_times[static_cast<std::size_t>(4 * r + 3)];
    }
    return Status::ok();
  }

  // One step on every rank. *stop: the step was a stop step.
  Result<bool> step(bool* stop) {
    if (sched->failed()) return sched->failure();
    Plan pl;
    std::vector<int64_t> words;
    TREEATTN_RETURN_IF_ERROR(broadcast_plan(pl, words));
    Status applied;
    if (me != 0) TREEATTN_RETURN_IF_ERROR(receive_plan(words, pl, &applied));
    if (applied.is_ok()) applied = sched->check_work(pl.work);
    TREEATTN_RETURN_IF_ERROR(agree(applied));
    ++steps;
    if (pl.kind == StepKind::kStop) {
      *stop = true;
      if (me == 0) update_snapshot();
      return false;
    }
    auto out = runner->forward(*sched, pl.work);
    TREEATTN_RETURN_IF_ERROR(out.status());
    TREEATTN_RETURN_IF_ERROR(sample(*out));
    progress.fetch_add(1);
    if (me == 0) update_snapshot();
    return !sched->running().empty() || pl.waiting_after > 0;
  }

  // Every request in flight ends with an error event (rank 0); the sequences' pages are
  // released; later steps return the same error.
  void fail_all(const Status& st) {
    sched->fail_all(st);
    if (me == 0) update_snapshot();
  }
};

namespace {

// This rank's verdict on the configuration, before any agreement.
Status check_config(const EngineConfig& config, ExchangePolicy* exchange) {
  auto x = parse_exchange(config.prefill_exchange);
  TREEATTN_RETURN_IF_ERROR(x.status());
  *exchange = *x;
  TREEATTN_RETURN_IF_ERROR(check_dense_name(config.dense));
  if (config.fanout < 1)
    return invalid_argument("fanout must be >= 1, got " + std::to_string(config.fanout));
  TREEATTN_RETURN_IF_ERROR(check_isa_supported(config.isa, "engine isa"));
  if (!valid_page_tokens(config.page_tokens))
    return invalid_argument("page_tokens " + std::to_string(config.page_tokens) +
                            " must be 16 or a multiple of 32 up to 256");
  if (config.max_batch < 1) return invalid_argument("max_batch must be >= 1");
  if (config.prefill_chunk < 1) return invalid_argument("prefill_chunk must be >= 1");
  if (config.max_queue < 0) return invalid_argument("max_queue must be >= 0");
  if (config.kv_window_pages < -1)
    return invalid_argument("kv_window_pages must be -1 (auto), 0 (none) or a page count, got " +
                            std::to_string(config.kv_window_pages));
  if (config.kv_window_pages > std::numeric_limits<int32_t>::max())
    return invalid_argument("kv_window_pages " + std::to_string(config.kv_window_pages) +
                            " is more than " +
                            std::to_string(std::numeric_limits<int32_t>::max()) + " pages");
  if (config.kv_pages > std::numeric_limits<int32_t>::max())
    return invalid_argument("kv_pages " + std::to_string(config.kv_pages) + " is more than " +
                            std::to_string(std::numeric_limits<int32_t>::max()) + " pages");
  return Status::ok();
}

// The window pages' layers: local layers of a model with a sliding window and at least one
// global layer (one whose layers are all windowed keeps every position: its one group is the
// full one).
int window_layer_count(const EngineConfig& config, const model::LlamaModel& model) {
  const auto& mc = model.config();
  if (config.kv_window_pages == 0 || mc.sliding_window <= 0) return 0;
  int n = 0;
  for (int l = 0; l < mc.n_layers; ++l) n += mc.local_layer[static_cast<std::size_t>(l)] != 0;
  return n == mc.n_layers ? 0 : n;
}

// Window pages per rank that one sequence alone may need: the pages of a step's positions
// [c, c + n) (n <= prefill_chunk) and of the window before them (W - 1 positions), over p ranks,
// plus the partial pages at both ends.
int64_t lone_window_pages(const EngineConfig& config, int64_t window, int p) {
  const int64_t T = config.page_tokens;
  return (config.prefill_chunk + window - 1 + 2 * T + T * p - 1) / (T * p) + 1;
}

}  // namespace

int64_t lone_sequence_window_pages(const EngineConfig& config, const model::LlamaModel& model,
                                   int ranks) {
  if (window_layer_count(config, model) == 0) return 0;
  return lone_window_pages(config, model.config().sliding_window, ranks);
}

namespace {

// Window pages per rank before the full pages' count caps them: kv_window_pages, or (auto) the
// windows of max_batch sequences and one step's prefill chunk.
int64_t wanted_window_pages(const EngineConfig& config, const model::LlamaModel& model, int p) {
  if (window_layer_count(config, model) == 0) return 0;
  if (config.kv_window_pages > 0) return config.kv_window_pages;
  const int64_t T = config.page_tokens, W = model.config().sliding_window;
  const int64_t B = config.max_batch;
  return (config.prefill_chunk + B * (W - 1 + 2 * T) + T * p - 1) / (T * p) + B;
}

// The window pages per rank once the ranks agreed on `pages` full pages: never more (a
// sequence's window pages are a subset of its full ones, so `pages` of them always hold one
// sequence alone).
int64_t window_pages(const EngineConfig& config, const model::LlamaModel& model, int p,
                     int64_t pages) {
  return std::min(pages, wanted_window_pages(config, model, p));
}

// Full pages per rank this rank can hold: kv_pages, else kv_memory (else half of MemAvailable
// over the ranks sharing this host) less the window pages, over the bytes of one page in every
// layer that keeps every position.
Result<int64_t> local_pages(const EngineConfig& config, const model::LlamaModel& model,
                            int local_ranks, int p) {
  const auto& mc = model.config();
  const int64_t T = config.page_tokens;
  const AttnShape pool_shape{1, mc.n_head, mc.n_head_kv, mc.head_dim, 1};
  auto probe = TiledKVCache::create(pool_shape, config.kv_dtype, T, kKVTileLayout, T);
  TREEATTN_RETURN_IF_ERROR(probe.status());
  const int64_t wanted = wanted_window_pages(config, model, p);
  if (config.kv_window_pages > 0 && wanted < lone_window_pages(config, mc.sliding_window, p))
    return invalid_argument(
        "kv_window_pages " + std::to_string(wanted) + " cannot hold one sequence's window (" +
        std::to_string(mc.sliding_window) + " positions) and a prefill chunk of " +
        std::to_string(config.prefill_chunk) + " over " + std::to_string(p) + " ranks: " +
        std::to_string(lone_window_pages(config, mc.sliding_window, p)) + " pages at least");
  if (config.kv_pages > 0) return config.kv_pages;
  const int n_window = window_layer_count(config, model);
  const std::size_t full_page = probe->bytes() * static_cast<std::size_t>(mc.n_layers - n_window);
  const std::size_t window_bytes =
      probe->bytes() * static_cast<std::size_t>(n_window) * static_cast<std::size_t>(wanted);
  std::size_t budget = config.kv_memory;
  if (budget == 0)
    budget = static_cast<std::size_t>(mem_available_bytes() / 2 /
                                      static_cast<uint64_t>(local_ranks));
  // Where the window pages would leave fewer full pages than themselves, both get the same
  // count (window_pages caps them at it).
  const std::size_t all_layers = probe->bytes() * static_cast<std::size_t>(mc.n_layers);
  std::size_t count = budget > window_bytes ? (budget - window_bytes) / full_page : 0;
  if (count < static_cast<std::size_t>(wanted)) count = budget / all_layers;
  const auto pages = static_cast<int64_t>(
      std::min<std::size_t>(count, static_cast<std::size_t>(std::numeric_limits<int32_t>::max())));
  if (pages < 1)
    return invalid_argument("the KV memory (" + std::to_string(budget) +
                            " bytes per rank) holds no page of " + std::to_string(T) + " tokens (" +
                            std::to_string(all_layers) + " bytes over " +
                            std::to_string(mc.n_layers) + " layers)");
  return pages;
}

// What every rank must agree on: the model, the configuration, and the kernels' ISAs (ranks
// compute replicated values, a lone row and the logits, and must get the same bits).
std::string config_description(const EngineConfig& config, const model::LlamaModel& model) {
  model::MatvecOptions mv;
  mv.threads = config.threads;
  mv.isa = config.isa;
  mv.mode = config.matmul;
  return model.config().to_string() + "|" + std::to_string(model.file().file_size()) + "|" +
         std::string(dtype_name(config.kv_dtype)) + "|" + std::to_string(config.page_tokens) + "|" +
         std::to_string(config.max_batch) + "|" + std::to_string(config.prefill_chunk) + "|" +
         config.merge + "|" + config.prefill_exchange + "|" + config.dense + "|" +
         (config.rows8 ? "1" : "0") + "|" + (config.prefix_cache ? "1" : "0") + "|" +
         std::to_string(config.kv_window_pages) + "|" + std::to_string(config.max_queue) + "|" +
         std::string(isa_name(model::matmul_isa(mv))) + "|" +
         std::string(model::matmul_mode_name(mv.mode)) + "|" +
         std::string(isa_name(config.isa == Isa::kAuto ? best_isa() : config.isa));
}

// Every rank learns every rank's verdict, description hash and pages; returns the smallest
// pool (the replicated table assumes one size) or the first refusal, named on every rank.
Result<int64_t> agree_on_config(Communicator& comm, const std::string& who, const Status& local,
                                const std::string& desc, int64_t pages) {
  struct Verdict {
    uint64_t hash;
    int64_t pages;
    int32_t ok;
    int32_t pad;
  };
  Verdict mine{std::hash<std::string>{}(desc), pages, local.is_ok() ? 1 : 0, 0};
  std::vector<Verdict> all(static_cast<std::size_t>(comm.size()));
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof(mine), all.data()));
  if (!local.is_ok()) return Status(local.code(), who + local.message());
  int64_t min_pages = pages;
  for (int r = 0; r < comm.size(); ++r) {
    const Verdict& vr = all[static_cast<std::size_t>(r)];
    if (vr.ok == 0)
      return invalid_argument(who + "rank " + std::to_string(r) +
                              " refused the engine configuration (its own message names why)");
    if (vr.hash != all[0].hash)
      return Status(Code::kMismatch,
                    who + "rank " + std::to_string(r) +
                        "'s model or engine configuration (or its CPU's kernel ISA: mixed ISAs "
                        "give different bits; force one with isa) differs from rank 0's");
    min_pages = std::min(min_pages, vr.pages);
  }
  return min_pages;
}

// Every layer's pool on this rank: `pages` pages, or `wpages` for a window layer; every rank
// learns whether every rank could.
Result<std::vector<TiledKVCache>> allocate_pools(Communicator& comm, const std::string& who,
                                                 const EngineConfig& config,
                                                 const model::LlamaModel& model, int64_t pages,
                                                 int64_t wpages) {
  const auto& mc = model.config();
  const int64_t T = config.page_tokens;
  const AttnShape pool_shape{1, mc.n_head, mc.n_head_kv, mc.head_dim, 1};
  std::vector<TiledKVCache> pools;
  pools.reserve(static_cast<std::size_t>(mc.n_layers));
  Status alloc;
  for (int l = 0; l < mc.n_layers && alloc.is_ok(); ++l) {
    const bool window = wpages > 0 && mc.local_layer[static_cast<std::size_t>(l)] != 0;
    auto c = TiledKVCache::create(pool_shape, config.kv_dtype, (window ? wpages : pages) * T,
                                  kKVTileLayout, T);
    if (!c.is_ok())
      alloc = c.status();
    else
      pools.push_back(std::move(c).value());
  }
  int32_t ok = alloc.is_ok() ? 1 : 0;
  std::vector<int32_t> oks(static_cast<std::size_t>(comm.size()));
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&ok, sizeof(ok), oks.data()));
  if (!alloc.is_ok()) return Status(alloc.code(), who + "KV pools: " + alloc.message());
  for (int r = 0; r < comm.size(); ++r)
    if (oks[static_cast<std::size_t>(r)] == 0)
      return Status(Code::kOutOfMemory,
                    who + "rank " + std::to_string(r) + " could not allocate its KV pools");
  return pools;
}

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() {
  if (impl_ && impl_->sched) impl_->sched->end_everything();
}

// Local checks first; every rank then learns every rank's verdict, so a rank with a bad
// configuration is named on all of them and none waits for it.
Result<std::unique_ptr<Engine>> Engine::create(Communicator& comm, const model::LlamaModel& model,
                                               const EngineConfig& config) {
  const std::string who = rank_prefix(comm) + "engine: ";
  comm.set_timeout(config.timeout);
  comm.set_context("engine create");
  // Ranks sharing this host split its memory (collective, so every rank calls it).
  int local_ranks = 1;
  {
    auto shared = comm.split_shared(comm.rank());
    if (shared.is_ok() && *shared) local_ranks = (*shared)->size();
  }
  ExchangePolicy exchange = ExchangePolicy::kAuto;
  Status local = check_config(config, &exchange);
  int64_t pages = config.kv_pages;
  if (local.is_ok()) {
    auto lp = local_pages(config, model, local_ranks, comm.size());
    if (lp.is_ok())
      pages = *lp;
    else
      local = lp.status();
  }
  auto agreed = agree_on_config(comm, who, local, config_description(config, model), pages);
  TREEATTN_RETURN_IF_ERROR(agreed.status());
  auto merge = engine_merge(comm, config, model.config(), *agreed);
  TREEATTN_RETURN_IF_ERROR(merge.status());
  auto dense = plan_dense(comm, config, model);
  TREEATTN_RETURN_IF_ERROR(dense.status());
  const int64_t wpages = window_pages(config, model, comm.size(), *agreed);
  auto pools = allocate_pools(comm, who, config, model, *agreed, wpages);
  TREEATTN_RETURN_IF_ERROR(pools.status());

  auto impl = std::make_unique<Impl>();
  Impl& e = *impl;
  e.comm = &comm;
  e.model = &model;
  e.cfg = config;
  e.p = comm.size();
  e.me = comm.rank();
  WindowGroup wg;
  if (wpages > 0) wg = {model.config().sliding_window, wpages, config.prefill_chunk};
  e.kv = std::make_unique<KVManager>(e.p, *agreed, config.page_tokens, config.prefix_cache, wg);
  e.sched = std::make_unique<Scheduler>(
      SchedulerConfig{config.max_batch, config.prefill_chunk, config.max_queue, config.idle_tick,
                      rank_prefix(comm)},
      *e.kv);
  e.dense = dense->choice;
  e.runner = std::make_unique<ModelRunner>(comm, model, e.cfg, std::move(merge).value(), exchange,
                                           std::move(pools).value(), *e.kv,
                                           std::move(dense->weights), e.dense.split);
  TREEATTN_RETURN_IF_ERROR(e.runner->check_exchange_policy());
  for (auto* v : {&e.rank_merge_s, &e.rank_attn_s, &e.rank_dense_s})
    v->assign(static_cast<std::size_t>(e.p), 0.0);
  e.runner->try_reserve_step_scratch();
  e.update_snapshot();
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Result<RequestId> Engine::submit(Request request, TokenCallback callback) {
  Impl& e = *impl_;
  if (e.me != 0)
    return invalid_argument(rank_prefix(*e.comm) + "submit: only rank 0 takes requests");
  TREEATTN_RETURN_IF_ERROR(e.check_request(request));
  return e.sched->submit(std::move(request), std::move(callback));
}

void Engine::cancel(RequestId id) { impl_->sched->cancel(id); }

void Engine::stop(bool drain) { impl_->sched->stop(drain); }

Status Engine::run() {
  for (;;) {
    bool stop = false;
    auto r = impl_->step(&stop);
    if (!r.is_ok()) {
      impl_->fail_all(r.status());
      return r.status();
    }
    if (stop) return Status::ok();
  }
}

Result<bool> Engine::step() {
  bool stop = false;
  auto r = impl_->step(&stop);
  if (!r.is_ok()) impl_->fail_all(r.status());
  return r;
}

int64_t Engine::max_sequence_tokens() const { return impl_->max_sequence_tokens(); }

int64_t Engine::progress() const { return impl_->progress.load() + impl_->runner->layers_done(); }

EngineMetrics Engine::metrics() const {
  std::lock_guard lk(impl_->snapshot_mu);
  return impl_->snapshot;
}
const EngineConfig& Engine::config() const { return impl_->cfg; }
const MergeChoice& Engine::merge_choice() const { return impl_->runner->merge_choice(); }
const DenseChoice& Engine::dense_choice() const { return impl_->dense; }
const model::LlamaModel& Engine::model() const { return *impl_->model; }
Communicator& Engine::comm() const { return *impl_->comm; }

}  // namespace treeattn::engine
