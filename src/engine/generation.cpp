// One generation run (generation.hpp): the engine path and the DecodeSession path of
// `treeattn generate`.
#include "treeattn/generation.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "treeattn/engine.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/session.hpp"

namespace treeattn::generation {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t fnv1a(uint64_t h, TokenId t) {
  for (int i = 0; i < 4; ++i) {
    h ^= static_cast<uint64_t>(static_cast<uint32_t>(t) >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t sent(const Communicator& c) {
  return c.counters().p2p_bytes + c.counters().collective_payload_bytes;
}

// h extended by the bits of v, 8 bytes at a time (a multiply-xorshift mix: fast enough for a
// vocabulary of logits per token).
uint64_t hash_floats(uint64_t h, const std::vector<float>& v) {
  const auto* b = reinterpret_cast<const unsigned char*>(v.data());
  const std::size_t n = v.size() * sizeof(float);
  std::size_t i = 0;
  auto mix = [&h](uint64_t w) {
    h = (h ^ w) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 29;
  };
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    mix(w);
  }
  uint64_t rest = 0;
  if (i < n) std::memcpy(&rest, b + i, n - i);
  mix(rest ^ (static_cast<uint64_t>(n) << 3));
  return h;
}

// Holds back an incomplete UTF-8 sequence at the end of the streamed bytes.
std::size_t complete_utf8_prefix(const std::string& s) {
  std::size_t n = s.size();
  for (std::size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xc0) == 0x80) continue;  // continuation byte
    const std::size_t len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

// Method 0's text as it is produced: whole UTF-8 characters to hooks.text (rank 0), the rest at
// flush(). With stop strings (a base model's chat transcript, chat_stop_strings) every rank
// follows the text, the same on each, and add() says when the answer has ended; the stop string
// is never shown.
class TextStream {
 public:
  TextStream(const Tokenizer& tok, const Hooks& hooks, bool lead, std::vector<std::string> stops)
      : tok_(tok), hooks_(hooks), on_(lead && hooks.text), stop_(std::move(stops)) {}
  // True when the text now holds a stop string.
  bool add(TokenId t) {
    if ((!on_ && stop_.empty()) || stopped_) return stopped_;
    auto piece = tok_.token_to_piece(t);
    if (!piece.is_ok()) return false;
    streamed_ += *piece;
    const std::size_t upto = complete_utf8_prefix(streamed_);
    if (upto > taken_) {
      const StopMatcher::Out o =
          stop_.push(std::string_view(streamed_).substr(taken_, upto - taken_));
      taken_ = upto;
      show(o.text);
      stopped_ = o.stopped;
    }
    return stopped_;
  }
  void flush() {
    if (stopped_) return;
    show(stop_.flush());
    show(std::string_view(streamed_).substr(taken_));
    taken_ = streamed_.size();
  }
  bool stopped() const { return stopped_; }

 private:
  void show(std::string_view text) {
    if (on_ && !text.empty()) hooks_.text(text);
  }
  const Tokenizer& tok_;
  const Hooks& hooks_;
  bool on_;
  StopMatcher stop_;
  bool stopped_ = false;
  std::string streamed_;
  std::size_t taken_ = 0;
};

// The stop strings of a chat request (none when the end-of-generation tokens are ignored).
std::vector<std::string> stops_of(const Request& req, const Tokenizer& tok) {
  if (!req.prompt.chat || req.ignore_eos) return {};
  return chat_stop_strings(tok.chat_format());
}

// The decoded text up to the first stop string.
std::string answer_text(const Tokenizer& tok, const std::vector<TokenId>& tokens,
                        const std::vector<std::string>& stops) {
  auto text = tok.decode(tokens);
  if (!text.is_ok()) return "";
  std::size_t cut = std::string::npos;
  for (const std::string& s : stops) cut = std::min(cut, text->find(s));
  return cut == std::string::npos ? *text : text->substr(0, cut);
}

void phase(const Hooks& h, const std::string& what) {
  if (h.phase) h.phase(what);
}

Output failed(Output out, Status s, bool abort = false) {
  out.status = std::move(s);
  out.must_abort = abort;
  return out;
}

// The pages in use over the ranks after the engine's last step (its snapshot), if more than
// seen so far.
void note_pages_in_use(const engine::EngineMetrics& m, Output& out) {
  int64_t used = 0, wused = 0;
  for (const int64_t u : m.pages_used) used += u;
  for (const int64_t u : m.window_pages_used) wused += u;
  out.pages_used_peak = std::max(out.pages_used_peak, used);
  out.window_pages_used_peak = std::max(out.window_pages_used_peak, wused);
}

// The pools' sizes and the bytes of the most pages in use: a page holds page_tokens positions
// of K and V in each layer of its group.
void page_figures(const engine::EngineMetrics& m, const engine::EngineConfig& ec,
                  const model::LlamaConfig& mc, Output& out) {
  out.page_tokens = ec.page_tokens;
  out.pages_per_rank = m.pages_per_rank;
  out.window_pages_per_rank = m.window_pages_per_rank;
  int64_t window_layers = 0;
  for (const uint8_t w : m.layer_in_window) window_layers += w;
  const auto layer_page = static_cast<uint64_t>(ec.page_tokens * mc.n_head_kv) *
                          kv_head_token_bytes(static_cast<std::size_t>(mc.head_dim), ec.kv_dtype);
  out.kv_bytes_used_peak = static_cast<uint64_t>(out.pages_used_peak) *
                           static_cast<uint64_t>(mc.n_layers - window_layers) * layer_page;
  out.window_kv_bytes_used_peak = static_cast<uint64_t>(out.window_pages_used_peak) *
                                  static_cast<uint64_t>(window_layers) * layer_page;
}

// The engine's configuration for one request of n prompt tokens on P ranks.
engine::EngineConfig engine_config_of(const Request& req, const model::LlamaModel& model, int P,
                                      int64_t n) {
  engine::EngineConfig ec;
  ec.kv_dtype = req.kv_dtype;
  ec.threads = req.threads;
  ec.isa = req.isa;
  ec.matmul = req.matmul;
  ec.merge = req.methods.empty() ? "auto" : req.methods.front();
  ec.topology = req.topology_file;
  ec.fanout = req.fanout;
  ec.prefill_exchange = req.prefill_exchange;
  ec.dense = req.dense;
  ec.rows8 = req.rows8;  // the engine copies the rows it computes with
  ec.timeout = req.timeout;
  ec.kv_window_pages = req.kv_window_pages;
  if (ec.kv_window_pages == -1)  // auto: one request, one sequence's window
    if (const int64_t w = engine::lone_sequence_window_pages(ec, model, P); w > 0)
      ec.kv_window_pages = w;
  if (req.kv_memory > 0)
    ec.kv_memory = req.kv_memory;
  else  // the pages this prompt needs on each rank, and a few more
    ec.kv_pages = (n + req.new_tokens + ec.page_tokens - 1) / ec.page_tokens / P + 2;
  return ec;
}

// Per rank, per decode step: the dense part, the paged attention, and the merge with the
// all-gathers (EngineMetrics' seconds between the prefill's last step, `begin`, and the end).
void decode_breakdown(const engine::EngineMetrics& begin, const engine::EngineMetrics& end,
                      Output& out) {
  const auto steps = static_cast<double>(begin.steps > 0 ? end.steps - begin.steps : 0);
  auto per_step = [&](const std::vector<double>& e, const std::vector<double>& b) {
    std::vector<double> v;
    for (std::size_t r = 0; r < e.size() && steps > 0; ++r)
      v.push_back(1e3 * (e[r] - (r < b.size() ? b[r] : 0.0)) / steps);
    return v;
  };
  out.decode_dense_ms_by_rank = per_step(end.dense_seconds, begin.dense_seconds);
  out.decode_attention_ms_by_rank = per_step(end.attention_seconds, begin.attention_seconds);
  out.decode_comm_ms_by_rank = per_step(end.merge_seconds, begin.merge_seconds);
}

Output run_engine(Communicator& comm, const Request& req, const Hooks& hooks,
                  const model::LlamaModel& model, const Tokenizer& tok, Output out) {
  const bool lead = comm.rank() == 0;
  const int P = comm.size();
  const auto n = static_cast<int64_t>(out.prompt.size());
  const engine::EngineConfig ec = engine_config_of(req, model, P, n);
  auto e = engine::Engine::create(comm, model, ec);
  if (!e.is_ok()) return failed(std::move(out), e.status());
  engine::Engine& eng = **e;
  out.merge_choice = eng.merge_choice();
  out.dense_choice = eng.dense_choice();
  if (lead && hooks.started) {
    Start s;
    s.config = &model.config();
    s.ranks = P;
    s.threads = req.threads;
    s.prompt_tokens = n;
    s.methods = {eng.merge_choice().strategy};
    s.merge_description = engine::describe_merge(eng.merge_choice());
    s.dense_description = engine::describe_dense(eng.dense_choice());
    s.page_tokens = ec.page_tokens;
    s.pages_per_rank = eng.metrics().pages_per_rank;
    hooks.started(s);
  }
  const std::vector<std::string> stops = stops_of(req, tok);
  TextStream stream(tok, hooks, lead, stops);
  Clock::time_point last_token;
  uint64_t sent_at_first = 0;
  uint64_t logits_hash = 0xcbf29ce484222325ull;
  engine::EngineMetrics at_first;
  engine::RequestTimings timings;
  Status failure;
  const auto t0 = Clock::now();
  if (lead) {
    engine::Request r;
    r.prompt = out.prompt;
    r.max_new_tokens = req.new_tokens;
    r.sampling = req.sampling;
    r.return_logits = req.hash_logits;
    if (!req.ignore_eos)
      for (TokenId id = 0; id < tok.n_vocab(); ++id)
        if (tok.is_end_of_generation(id)) r.stop_tokens.push_back(id);
    auto id = eng.submit(std::move(r), [&](const engine::TokenEvent& ev) {
      if (ev.token >= 0 && !stream.stopped()) {
        const auto now = Clock::now();
        // The per-rank times up to the step that ended the prefill: the snapshot a callback sees
        // is of the step before its own, whose times (all-gathered as a step starts) end one
        // step earlier still, so the third token's is the prefill's end.
        if (out.tokens.size() == 2) at_first = eng.metrics();
        if (out.tokens.empty()) {
          out.ttft_ms = std::chrono::duration<double, std::milli>(now - t0).count();
          sent_at_first = sent(comm);
        } else {
          out.token_ms.push_back(
              std::chrono::duration<double, std::milli>(now - last_token).count());
        }
        last_token = now;
        out.tokens.push_back(ev.token);
        logits_hash = hash_floats(logits_hash, ev.logits);
        // A stop string ends the answer: the request is cancelled at the next step.
        if (ev.finish != engine::FinishReason::kStop && stream.add(ev.token)) eng.stop(false);
      }
      timings = ev.timings;
      note_pages_in_use(eng.metrics(), out);
      if (ev.finish == engine::FinishReason::kError) failure = ev.error;
      if (ev.finish != engine::FinishReason::kNone) eng.stop(true);
    });
    if (!id.is_ok()) {
      failure = id.status();
      eng.stop(false);
    }
  }
  if (Status st = eng.run(); !st.is_ok()) return failed(std::move(out), st, true);
  // Every rank's peak RSS, bytes sent and resident weights, for the report.
  const std::array<double, 3> mine = {
      static_cast<double>(peak_rss_bytes()), static_cast<double>(sent(comm)),
      static_cast<double>(mapped_file_rss(model.path()) + eng.dense_choice().rows8_bytes)};
  std::vector<std::array<double, 3>> all(static_cast<std::size_t>(P));
  if (Status g = comm.allgather(mine.data(), sizeof mine, all.data()); !g.is_ok())
    return failed(std::move(out), g, true);
  if (!lead) return out;
  if (!failure.is_ok()) return failed(std::move(out), failure);
  stream.flush();
  for (const auto& a : all) {
    out.peak_rss_by_rank.push_back(static_cast<uint64_t>(a[0]));
    out.bytes_sent_by_rank.push_back(static_cast<uint64_t>(a[1]));
    out.weights_resident_by_rank.push_back(static_cast<uint64_t>(a[2]));
  }
  const engine::EngineMetrics mt = eng.metrics();
  decode_breakdown(at_first, mt, out);
  out.cached_tokens = timings.cached_tokens;
  out.prefill_seconds = timings.prefill_seconds;
  out.decode_seconds = timings.decode_seconds;
  // Rank 0's bytes per decode step (the merges' fan-in and fan-out; the other ranks' totals are
  // in bytes_sent_by_rank).
  out.bytes_per_token = out.tokens.size() > 1
                            ? static_cast<double>(sent(comm) - sent_at_first) /
                                  static_cast<double>(out.tokens.size() - 1)
                            : 0.0;
  page_figures(mt, ec, model.config(), out);
  out.merges = mt.merges;
  out.rows_pass_q = mt.rows_pass_q;
  out.rows_kv_exchange = mt.rows_kv_exchange;
  out.bytes_sent_rank0 = mt.bytes_sent;
  out.text = answer_text(tok, out.tokens, stops);
  if (req.hash_logits) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(logits_hash));
    out.logits_hash = hex;
  }
  return out;
}

// --methods with "auto" replaced by the cost model's choice for this prompt and rank count.
Result<std::vector<std::string>> resolve_methods(Communicator& comm, const Request& req,
                                                 const Hooks& hooks, const model::LlamaConfig& cfg,
                                                 int64_t n) {
  const int P = comm.size();
  const bool lead = comm.rank() == 0;
  std::vector<std::string> methods = req.methods;
  if (std::find(methods.begin(), methods.end(), "auto") == methods.end()) return methods;
  CostQuery q;
  q.shape = AttnShape{1, cfg.n_head, cfg.n_head_kv, cfg.head_dim, 1};
  q.kv_dtype = req.kv_dtype;
  q.context = n + req.new_tokens;
  q.ranks = P;
  q.ranks_per_node = req.ranks_per_node;
  q.hier_fanout = req.fanout;
  Result<Topology> topo = req.topology ? Result<Topology>(*req.topology)
                                       : job_topology_of(comm, cpu_executor());
  if (!topo.is_ok()) return invalid_argument("--methods auto: " + topo.status().message());
  if (!req.topology) q.ranks_per_node = topo->ranks_per_node;
  auto c = choose_strategy(q, *topo);
  if (!c.is_ok()) return invalid_argument("--methods auto: " + c.status().message());
  if (lead && hooks.planned) hooks.planned(*c);
  return replace_auto(methods, c->strategy);
}

// Every rank's token hash, peak RSS, prefill figures and bytes per token, into out.
Status gather_rank_stats(Communicator& comm, uint64_t hash, const model::PrefillStats& p,
                         const std::vector<uint64_t>& bytes_sent, Output& out) {
  constexpr std::size_t kMaxMethods = 8;  // bytes per token reported for the first 8
  struct RankStats {
    uint64_t hash, rss;
    double bytes_per_token[kMaxMethods];
    double prefill_busy_s, prefill_attention_s;
    int64_t prefill_positions;
  } mine{};
  mine.hash = hash;
  mine.prefill_busy_s = p.seconds - p.wait_seconds;  // computing, not waiting for the others
  mine.prefill_attention_s = p.attention_seconds;
  mine.prefill_positions = p.positions_computed;
  mine.rss = static_cast<uint64_t>(peak_rss_bytes());
  for (std::size_t k = 0; k < out.methods.size() && k < kMaxMethods; ++k)
    mine.bytes_per_token[k] =
        out.methods[k].step_ms.empty()
            ? 0.0
            : static_cast<double>(bytes_sent[k]) / static_cast<double>(out.methods[k].step_ms.size());
  std::vector<RankStats> all(static_cast<std::size_t>(comm.size()));
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, all.data()));
  out.prefill = p;
  out.token_hash = hash;
  for (const RankStats& a : all) {
    out.token_hash_by_rank.push_back(a.hash);
    out.ranks_agree = out.ranks_agree && a.hash == all[0].hash;
    out.peak_rss_by_rank.push_back(a.rss);
    out.prefill_busy_s_by_rank.push_back(a.prefill_busy_s);
    out.prefill_attention_s_by_rank.push_back(a.prefill_attention_s);
    out.prefill_positions_by_rank.push_back(a.prefill_positions);
  }
  for (std::size_t k = 0; k < out.methods.size(); ++k)
    for (const RankStats& a : all)
      out.methods[k].bytes_sent_per_token_by_rank.push_back(k < kMaxMethods ? a.bytes_per_token[k]
                                                                            : 0.0);
  return Status::ok();
}

Output run_session(Communicator& comm, const Request& req, const Hooks& hooks,
                   const model::LlamaModel& model, const Tokenizer& tok, Output out) {
  const bool lead = comm.rank() == 0;
  const int P = comm.size();
  const auto n = static_cast<int64_t>(out.prompt.size());
  const auto& cfg = model.config();
  auto resolved = resolve_methods(comm, req, hooks, cfg, n);
  if (!resolved.is_ok()) return failed(std::move(out), resolved.status());
  const std::vector<std::string> methods = std::move(resolved).value();
  phase(hooks, "generate: set-up");
  model::GeneratorConfig gc = generator_config(req);
  gc.methods = methods;
  auto g = model::Generator::create(comm, model, gc);
  if (!g.is_ok())
    return failed(std::move(out), g.status(), g.status().code() == Code::kTimeout);
  if (lead && hooks.started) {
    Start s;
    s.config = &cfg;
    s.ranks = P;
    s.threads = req.threads;
    s.prompt_tokens = n;
    s.methods = methods;
    hooks.started(s);
  }

  // ---- prefill ----
  phase(hooks, "generate: prefill");
  const auto t0 = Clock::now();
  std::vector<float> logits;
  Status st = req.synthetic_kv ? (*g)->prefill_synthetic(n - 1, req.prompt.seed) : Status::ok();
  if (req.synthetic_kv && st.is_ok())  // the prompt's last token runs as a decode step
    st = (*g)->step(out.prompt.back(), logits, 0);
  if (!req.synthetic_kv)
    st = (*g)->prefill(out.prompt, logits, [&](int l, int layers) {
      if (lead && hooks.prefill_layer)
        hooks.prefill_layer(l, layers, std::chrono::duration<double>(Clock::now() - t0).count());
    });
  if (!st.is_ok()) return failed(std::move(out), st, true);
  model::Sampler sampler(req.sampling);
  const std::vector<float> first_logits = logits;
  const TokenId first = sampler.sample(logits);
  out.ttft_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  out.prefill_s = (*g)->prefill_stats().seconds;

  // ---- decode, method 0 streams ----
  const std::vector<std::string> stops = stops_of(req, tok);
  TextStream stream(tok, hooks, lead, stops);
  uint64_t hash = 0xcbf29ce484222325ull;
  std::vector<uint64_t> bytes_sent;  // this rank's, per method, over its decode steps
  for (int k = 0; k < (*g)->methods(); ++k) {
    MethodResult r;
    r.method = (*g)->method(k);
    model::Sampler smp(req.sampling);
    logits = first_logits;
    if (req.synthetic_kv && k > 0) {  // this session's copy of the step that ended the "prefill"
      st = (*g)->step(out.prompt.back(), logits, k);
      if (!st.is_ok()) return failed(std::move(out), st, true);
    }
    TokenId t = k == 0 ? first : smp.sample(logits);  // the same draws as method 0
    r.tokens.push_back(t);
    if (k == 0) {
      stream.add(t);
      hash = fnv1a(hash, t);
    }
    const int64_t steps_wanted =
        k == 0 ? req.new_tokens - 1 : static_cast<int64_t>(out.methods[0].tokens.size()) - 1;
    phase(hooks, "generate: decode " + r.method);
    const uint64_t sent0 = sent(comm);
    const auto d0 = Clock::now();
    for (int64_t i = 0; i < steps_wanted; ++i) {
      if (k == 0 && ((!req.ignore_eos && tok.is_end_of_generation(t)) || stream.stopped())) break;
      if (hooks.step) hooks.step(i);
      const auto s0 = Clock::now();
      st = (*g)->step(t, logits, k);
      if (!st.is_ok()) return failed(std::move(out), st, true);
      t = (k == 0 ? sampler : smp).sample(logits);
      r.step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
      r.tokens.push_back(t);
      if (k == 0) {
        stream.add(t);
        hash = fnv1a(hash, t);
        if (req.check) {  // every rank's stream so far, compared at every step
          std::vector<uint64_t> all(static_cast<std::size_t>(P));
          st = comm.allgather(&hash, sizeof hash, all.data());
          if (!st.is_ok()) return failed(std::move(out), st, true);
          for (int q = 1; q < P; ++q)
            if (all[static_cast<std::size_t>(q)] != all[0]) {
              out.check_divergence =
                  Divergence{r.tokens.size(), q, all[static_cast<std::size_t>(q)], all[0]};
              out.ranks_agree = false;
              return out;
            }
        }
      }
    }
    r.decode_s = std::chrono::duration<double>(Clock::now() - d0).count();
    bytes_sent.push_back(sent(comm) - sent0);
    if (k > 0) {
      const auto& a = out.methods[0].tokens;
      for (std::size_t i = 0; i < std::min(a.size(), r.tokens.size()); ++i)
        if (a[i] != r.tokens[i]) {
          r.first_diff = static_cast<int>(i);
          break;
        }
    }
    out.methods.push_back(std::move(r));
  }
  stream.flush();

  // ---- every rank's numbers, and whether the ranks agree ----
  st = gather_rank_stats(comm, hash, (*g)->prefill_stats(), bytes_sent, out);
  if (!st.is_ok()) return failed(std::move(out), st, true);
  if (lead) out.text = answer_text(tok, out.methods[0].tokens, stops);
  return out;
}

}  // namespace

Status check_prompt_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument("--prompt-file " + path +
                            " is a directory; give the text file to read the prompt from");
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    return invalid_argument("--prompt-file " + path + " is not a regular file");
  return Status::ok();
}

Result<std::vector<TokenId>> make_prompt(const PromptSpec& spec, const Tokenizer& tok) {
  if (spec.synthetic_tokens > 0) {
    // A synthetic prompt for timing: seeded draws among the normal tokens.
    std::vector<TokenId> normal;
    for (TokenId id = 0; id < tok.n_vocab(); ++id)
      if (tok.token_type(id) == TokenType::kNormal) normal.push_back(id);
    if (normal.empty())
      return invalid_argument("--prompt-tokens: the vocabulary has no normal tokens");
    std::vector<TokenId> ids;
    if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    uint64_t s = spec.seed * 0x9e3779b97f4a7c15ull + 12345;
    while (static_cast<int64_t>(ids.size()) < spec.synthetic_tokens) {
      uint64_t z = (s += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      ids.push_back(normal[static_cast<std::size_t>(z % normal.size())]);
    }
    return ids;
  }
  std::string text = spec.text;
  if (!spec.file.empty()) {
    TREEATTN_RETURN_IF_ERROR(check_prompt_file(spec.file));
    std::ifstream in(spec.file, std::ios::binary);
    if (!in) return invalid_argument("--prompt-file " + spec.file + ": cannot read it");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  // --chat: the file's own chat template (Tokenizer::encode_chat), special tokens only in its
  // markup; a file without one: the plain transcript.
  auto ids = spec.chat ? tok.encode_chat(std::span<const ChatTurn>(std::array{ChatTurn{"user", text}}),
                                         spec.system ? std::optional<std::string_view>(*spec.system)
                                                     : std::nullopt)
                       : tok.encode(text, true, false);
  if (!ids.is_ok()) return ids.status();
  if (ids->empty()) return invalid_argument("the prompt is empty after tokenization");
  return ids;
}

model::GeneratorConfig generator_config(const Request& req) {
  model::GeneratorConfig gc;
  gc.methods = req.methods;
  gc.kv_dtype = req.kv_dtype;
  gc.placement = req.placement;
  gc.kv_layout = req.kv_layout;
  gc.threads = req.threads;
  gc.isa = req.isa;
  gc.matmul = req.matmul;
  gc.reserve_tokens = req.new_tokens;
  gc.fanout = req.fanout;
  gc.timeout = req.timeout;
  return gc;
}

Output run_generation(Communicator& comm, const Request& req, const Hooks& hooks) {
  Output out;
  auto m = model::LlamaModel::load(req.model_path);
  if (!m.is_ok()) return failed(std::move(out), m.status());
  auto tok = Tokenizer::from_gguf((*m)->file());
  if (!tok.is_ok()) return failed(std::move(out), tok.status());
  auto prompt = make_prompt(req.prompt, *tok);
  if (!prompt.is_ok()) return failed(std::move(out), prompt.status());
  out.prompt = std::move(prompt).value();
  out.config_text = (*m)->config().to_string();
  if (req.engine) return run_engine(comm, req, hooks, **m, *tok, std::move(out));
  if (req.rows8) (*m)->pack_rows8(req.matmul, req.threads);  // the decode steps' layout
  return run_session(comm, req, hooks, **m, *tok, std::move(out));
}

}  // namespace treeattn::generation
