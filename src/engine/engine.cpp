// The serving engine: scheduling on rank 0, replicated step descriptions, the batched forward
// pass over paged, sequence-sharded KV. See include/treeattn/engine.hpp.
#include "treeattn/engine.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "engine/exchange.hpp"
#include "engine/layer_merge.hpp"
#include "engine/page_table.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/paged_kv.hpp"
#include "treeattn/state.hpp"

namespace treeattn::engine {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string rank_prefix(const Communicator& c) { return "rank " + std::to_string(c.rank()) + ": "; }

// Step description kinds.
constexpr int64_t kStepRun = 1;
constexpr int64_t kStepStop = 2;
constexpr int64_t kStepFail = 3;  // rank 0 could not plan: every rank ends with an error

int64_t bits_of(double d) { return std::bit_cast<int64_t>(d); }
double double_of(int64_t v) { return std::bit_cast<double>(v); }

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
  model::MatvecOptions mv;
  std::unique_ptr<LayerMerge> merge;  // the per-layer merge (a strategy's merge stage)
  ExchangePolicy exchange = ExchangePolicy::kAuto;
  ExchangeShape xshape;
  int p = 1, me = 0;
  int64_t T = 64;
  std::vector<TiledKVCache> pools;  // one per layer: this rank's pages
  std::unique_ptr<PageTable> table;

  struct Seq {
    RequestId id = 0;
    Request req;
    std::vector<TokenId> tokens;  // prompt, then generated
    int64_t prompt_len = 0;
    int64_t computed = 0;               // positions whose K/V are stored
    std::vector<PageRef> pages;         // logical page j
    std::vector<uint64_t> hashes;       // chain hash of full pages 0 .. hashes.size() - 1
    std::vector<int64_t> reserve_left;  // per rank
    int64_t generated = 0;
    int64_t cached_tokens = 0;
    model::Sampler sampler{model::SamplingParams{}};
    // rank 0 only
    TokenCallback cb;
    Clock::time_point submitted, admitted, first_token;
  };
  std::vector<std::unique_ptr<Seq>> running;  // admission order, replicated

  // ---- rank 0: the inbox ----
  struct Pending {
    RequestId id = 0;
    Request req;
    TokenCallback cb;
    Clock::time_point submitted;
  };
  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Pending> waiting;
  std::vector<RequestId> cancel_ids;
  bool stop_now = false, stop_drain = false;
  RequestId next_id = 1;
  bool failed = false;
  std::string failure;
  Code failure_code = Code::kInternal;
  EngineMetrics snapshot;  // guarded by mu

  // The pages of one kernel entry (PagedEntry points into these).
  struct EntryPages {
    std::vector<int32_t> ids;
    std::vector<int64_t> pos;
    std::vector<int32_t> len;
  };
  DecodeOptions dopt;  // the paged kernel's threads and ISA (create)

  // ---- step scratch ----
  model::ForwardScratch fs;
  std::vector<float> x, q, k, v, attn, states, merge_scratch, xs, xs_all, logits, logits_all;
  std::vector<float> qkv_send, qkv_recv, qkv_local;
  std::vector<int64_t> row_off;  // a row's offset (floats) in its rank's all-gather slot
  std::vector<uint8_t> page_send, page_recv;  // the K/V exchange's cached pages
  std::vector<float> kv_states;               // [owner rank][this rank's K/V rows][heads] records
  TiledKVCache xpool;  // the K/V exchange's copies of the pages its rows read
  int64_t xpool_pages = 0;
  int64_t rows_pass_q = 0, rows_kv = 0, kv_bytes_sent = 0;
  std::vector<TokenId> row_tok;
  std::vector<int64_t> row_pos;
  std::vector<double> rank_times;  // gather of per-rank timings on rank 0
  double merge_s = 0, attn_s = 0, dense_s = 0;
  int64_t merges = 0, steps = 0;
  int64_t requests_total = 0, prompt_total = 0, cached_total = 0, generated_total = 0;
  std::vector<double> rank_merge_s, rank_attn_s, rank_dense_s;

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
    TREEATTN_RETURN_IF_ERROR(r.sampling.validate());
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

  // Full pages of an n-token prompt that can come from the prefix cache: all before its last
  // token, whose logits start the generation.
  int64_t reusable_pages(int64_t n) const { return (n - 1) / T; }

  int64_t max_sequence_tokens() const {
    // Logical page j on rank j mod p: with P pages per rank, p * P pages in all.
    return static_cast<int64_t>(p) * table->pages_per_rank() * T;
  }

  Seq* find(RequestId id) {
    for (auto& s : running)
      if (s->id == id) return s.get();
    return nullptr;
  }

  void emit(Seq& s, TokenEvent ev) {
    if (me != 0 || !s.cb) return;
    ev.id = s.id;
    ev.timings.prompt_tokens = s.prompt_len;
    ev.timings.cached_tokens = s.cached_tokens;
    ev.timings.generated_tokens = s.generated;
    ev.timings.queue_seconds = seconds(s.admitted - s.submitted);
    if (s.generated > 0) {
      ev.timings.prefill_seconds = seconds(s.first_token - s.admitted);
      ev.timings.decode_seconds = seconds(Clock::now() - s.first_token);
    }
    s.cb(ev);
  }

  // Releases a sequence's pages and reservation (replicated) and drops it.
  void retire(RequestId id) {
    for (auto it = running.begin(); it != running.end(); ++it) {
      if ((*it)->id != id) continue;
      Seq& s = **it;
      for (const PageRef& pg : s.pages) table->release(pg);
      table->unreserve(s.reserve_left);
      running.erase(it);
      return;
    }
  }

  // Admission of one request on every rank. decide (rank 0): returns false when it does not fit
  // now; other ranks: it must fit (rank 0 decided on the same state).
  Result<bool> admit(RequestId id, Request req, bool decide, TokenCallback cb,
                     Clock::time_point submitted) {
    auto s = std::make_unique<Seq>();
    s->id = id;
    s->prompt_len = static_cast<int64_t>(req.prompt.size());
    s->tokens = req.prompt;
    s->sampler = model::Sampler(req.sampling);
    const int64_t n = s->prompt_len;
    // Prefix hits: full pages of the prompt, leaving at least the last prompt token to compute.
    std::vector<PageRef> hits;
    std::vector<uint64_t> hashes;
    uint64_t parent = PageTable::kRootHash;
    if (cfg.prefix_cache) {
      const int64_t max_hits = reusable_pages(n);
      for (int64_t j = 0; j < max_hits; ++j) {
        const std::span<const TokenId> toks(req.prompt.data() + j * T, static_cast<std::size_t>(T));
        const uint64_t h = PageTable::chain_hash(parent, toks);
        const PageRef ref = table->lookup(h, parent, toks);
        if (ref.rank < 0) break;
        hits.push_back(ref);
        hashes.push_back(h);
        parent = h;
      }
    }
    const int64_t positions = n + req.max_new_tokens - 1;
    const int64_t end_page = (positions + T - 1) / T;
    std::vector<int64_t> need = table->pages_needed(static_cast<int64_t>(hits.size()), end_page);
    std::vector<int64_t> extra(static_cast<std::size_t>(p), 0);  // cached hits leave the LRU
    for (const PageRef& h : hits)
      if (table->refcount(h) == 0) ++extra[static_cast<std::size_t>(h.rank)];
    for (int r = 0; r < p; ++r)
      if (need[static_cast<std::size_t>(r)] + extra[static_cast<std::size_t>(r)] >
          table->available(r)) {
        if (decide) return false;
        return internal_error(rank_prefix(*comm) + "request " + std::to_string(id) +
                              " admitted by rank 0 does not fit rank " + std::to_string(r) +
                              "'s pages here: the replicated page tables diverged");
      }
    for (const PageRef& h : hits) table->acquire(h);
    table->reserve(need);
    s->reserve_left = need;
    s->pages = hits;
    s->hashes = hashes;
    s->computed = static_cast<int64_t>(hits.size()) * T;
    s->cached_tokens = s->computed;
    s->req = std::move(req);
    s->cb = std::move(cb);
    s->submitted = submitted;
    s->admitted = Clock::now();
    running.push_back(std::move(s));
    ++requests_total;
    prompt_total += n;
    cached_total += running.back()->cached_tokens;
    return true;
  }

  // ---- step descriptions ----
  struct Plan {
    int64_t kind = kStepRun;
    int64_t waiting_after = 0;
    std::vector<RequestId> cancels;
    struct Admit {
      RequestId id;
      Request req;
    };
    std::vector<Admit> admits;
    std::vector<std::pair<RequestId, int64_t>> work;
  };

  static void put_request(std::vector<int64_t>& w, RequestId id, const Request& r) {
    w.push_back(static_cast<int64_t>(id));
    w.push_back(static_cast<int64_t>(r.prompt.size()));
    w.push_back(r.max_new_tokens);
    w.push_back(bits_of(r.sampling.temperature));
    w.push_back(r.sampling.top_k);
    w.push_back(bits_of(r.sampling.top_p));
    w.push_back(static_cast<int64_t>(r.sampling.seed));
    w.push_back(r.return_logits ? 1 : 0);
    w.push_back(static_cast<int64_t>(r.stop_tokens.size()));
    for (TokenId t : r.stop_tokens) w.push_back(t);
    for (TokenId t : r.prompt) w.push_back(t);
  }

  static std::vector<int64_t> encode(const Plan& pl) {
    std::vector<int64_t> w = {pl.kind, pl.waiting_after, static_cast<int64_t>(pl.cancels.size()),
                              static_cast<int64_t>(pl.admits.size()),
                              static_cast<int64_t>(pl.work.size())};
    for (RequestId id : pl.cancels) w.push_back(static_cast<int64_t>(id));
    for (const auto& a : pl.admits) put_request(w, a.id, a.req);
    for (const auto& [id, n] : pl.work) {
      w.push_back(static_cast<int64_t>(id));
      w.push_back(n);
    }
    return w;
  }

  Result<Plan> decode_plan(const std::vector<int64_t>& w) const {
    std::size_t i = 0;
    auto next = [&](int64_t& out) {
      if (i >= w.size()) return false;
      out = w[i++];
      return true;
    };
    const auto bad = [&] {
      return internal_error(rank_prefix(*comm) + "malformed step description from rank 0 (word " +
                            std::to_string(i) + " of " + std::to_string(w.size()) + ")");
    };
    Plan pl;
    int64_t nc = 0, na = 0, nw = 0;
    if (!next(pl.kind) || !next(pl.waiting_after) || !next(nc) || !next(na) || !next(nw))
      return bad();
    for (int64_t c = 0; c < nc; ++c) {
      int64_t id;
      if (!next(id)) return bad();
      pl.cancels.push_back(static_cast<RequestId>(id));
    }
    for (int64_t a = 0; a < na; ++a) {
      Plan::Admit ad;
      int64_t id, np, temp, topk, topp, seed, rl, ns;
      if (!next(id) || !next(np) || !next(ad.req.max_new_tokens) || !next(temp) || !next(topk) ||
          !next(topp) || !next(seed) || !next(rl) || !next(ns))
        return bad();
      if (np < 0 || ns < 0 || static_cast<std::size_t>(np + ns) > w.size() - i) return bad();
      ad.id = static_cast<RequestId>(id);
      ad.req.sampling.temperature = double_of(temp);
      ad.req.sampling.top_k = static_cast<int>(topk);
      ad.req.sampling.top_p = double_of(topp);
      ad.req.sampling.seed = static_cast<uint64_t>(seed);
      ad.req.return_logits = rl != 0;
      for (int64_t j = 0; j < ns; ++j) ad.req.stop_tokens.push_back(static_cast<TokenId>(w[i++]));
      for (int64_t j = 0; j < np; ++j) ad.req.prompt.push_back(static_cast<TokenId>(w[i++]));
      pl.admits.push_back(std::move(ad));
    }
    for (int64_t j = 0; j < nw; ++j) {
      int64_t id, n;
      if (!next(id) || !next(n)) return bad();
      pl.work.emplace_back(static_cast<RequestId>(id), n);
    }
    if (i != w.size()) return bad();
    return pl;
  }

  // Rank 0: what this step does. Applies cancels and admissions to the replicated state as it
  // decides them (the other ranks apply the same from the description).
  Result<Plan> make_plan() {
    Plan pl;
    // Under the lock: take the cancels and the stop flag, and pull cancelled waiting requests
    // out of the queue; their callbacks run after the lock is released (a callback may call
    // cancel() or submit()).
    std::vector<Pending> dropped;
    {
      std::unique_lock lk(mu);
      if (running.empty() && waiting.empty() && cancel_ids.empty() && !stop_now && !stop_drain)
        cv.wait_for(lk, cfg.idle_tick);
      std::vector<RequestId> ids;
      ids.swap(cancel_ids);
      for (RequestId id : ids) {
        auto it = std::find_if(waiting.begin(), waiting.end(),
                               [&](const Pending& pend) { return pend.id == id; });
        if (it != waiting.end()) {
          dropped.push_back(std::move(*it));
          waiting.erase(it);
        } else if (find(id) != nullptr &&
                   std::find(pl.cancels.begin(), pl.cancels.end(), id) == pl.cancels.end()) {
          pl.cancels.push_back(id);
        }
      }
      if (stop_now) {
        for (auto& s : running)
          if (std::find(pl.cancels.begin(), pl.cancels.end(), s->id) == pl.cancels.end())
            pl.cancels.push_back(s->id);
        for (Pending& pd : waiting) dropped.push_back(std::move(pd));
        waiting.clear();
        pl.kind = kStepStop;
      }
    }
    for (Pending& pd : dropped)
      if (pd.cb) {
        TokenEvent ev;
        ev.id = pd.id;
        ev.finish = FinishReason::kCancelled;
        pd.cb(ev);
      }
    for (RequestId id : pl.cancels) cancel_running(id);
    if (pl.kind == kStepStop) return pl;
    // Admissions, first come first served: the first request that does not fit waits for pages
    // rather than being overtaken. A request whose prompt shares full pages with a sequence
    // still prefilling them waits until they are computed and indexed, then takes them from the
    // prefix cache (requests behind it may go first meanwhile): otherwise N clients sending the
    // same long document at once would prefill it N times, each at 1/N of the chunk budget.
    for (std::size_t at = 0;;) {
      Pending pd;
      {
        std::lock_guard lk(mu);
        if (at >= waiting.size() || static_cast<int>(running.size()) >= cfg.max_batch) break;
        pd = waiting[at];
      }
      if (prefix_in_flight(pd.req.prompt)) {
        ++at;
        continue;
      }
      auto ok = admit(pd.id, pd.req, true, pd.cb, pd.submitted);
      TREEATTN_RETURN_IF_ERROR(ok.status());
      if (!*ok) break;
      {
        std::lock_guard lk(mu);
        waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(at));
      }
      pl.admits.push_back({pd.id, std::move(pd.req)});
    }
    pl.work = choose_work();
    {
      std::lock_guard lk(mu);
      pl.waiting_after = static_cast<int64_t>(waiting.size());
      if (stop_drain && running.empty() && waiting.empty()) pl.kind = kStepStop;
    }
    return pl;
  }

  // Rank 0, admission: whether a running sequence has not yet computed full pages that this
  // prompt could take from the prefix cache once they are (the pages a prompt can reuse: those
  // before its last token, as admit()).
  bool prefix_in_flight(const std::vector<TokenId>& prompt) const {
    if (!cfg.prefix_cache) return false;
    const int64_t reusable = reusable_pages(static_cast<int64_t>(prompt.size()));
    for (const auto& s : running) {
      if (s->computed >= reusable * T) continue;  // what it shares is indexed already
      const int64_t limit = std::min<int64_t>(reusable * T, static_cast<int64_t>(s->tokens.size()));
      int64_t same = 0;
      while (same < limit &&
             s->tokens[static_cast<std::size_t>(same)] == prompt[static_cast<std::size_t>(same)])
        ++same;
      if (same / T * T > s->computed) return true;
    }
    return false;
  }

  void cancel_running(RequestId id) {
    Seq* s = find(id);
    if (s == nullptr) return;
    TokenEvent ev;
    ev.finish = FinishReason::kCancelled;
    emit(*s, ev);
    retire(id);
  }

  // Decoding sequences always take their one token; prefilling ones share prefill_chunk tokens
  // in admission order.
  std::vector<std::pair<RequestId, int64_t>> choose_work() const {
    std::vector<std::pair<RequestId, int64_t>> work;
    int64_t budget = cfg.prefill_chunk;
    for (const auto& s : running) {
      const int64_t pending = static_cast<int64_t>(s->tokens.size()) - s->computed;
      if (s->computed >= s->prompt_len) {
        work.emplace_back(s->id, pending);  // 1
      } else if (budget > 0) {
        const int64_t n = std::min(pending, budget);
        budget -= n;
        work.emplace_back(s->id, n);
      }
    }
    return work;
  }

  void poison(PageRef pg) {
    const auto& mc = model->config();
    const std::vector<float> nan(static_cast<std::size_t>(mc.n_head_kv * mc.head_dim),
                                 std::numeric_limits<float>::quiet_NaN());
    for (TiledKVCache& pool : pools)
      for (int64_t t = 0; t < T; ++t)
        pool.set_tokens(0, static_cast<int64_t>(pg.id) * T + t, nan.data(), nan.data());
  }

  // The step scratch of the largest step, allocated and written once at creation so that the
  // first request does not pay for it (llama.cpp's servers run a warm-up batch for the same
  // reason): prefill_chunk prompt rows (at most what the KV pool holds) and a decode row for
  // each other sequence of the batch, split over the ranks as forward() splits them. A fresh
  // allocation's pages are mapped on first write, ~2-5 us a page on the VMs here: ~40 MB, 1-2%
  // of Qwen2.5-1.5B's first 512-token prefill (README). Without the memory for it, the steps
  // grow their buffers as before.
  void reserve_step_scratch() {
    const auto& mc = model->config();
    const int64_t E = mc.n_embd, H = mc.n_head, D = mc.head_dim, F = mc.n_ff;
    const int64_t qd = H * D, kvd = mc.n_head_kv * D, packed = qd + 2 * kvd;
    const int64_t rows = std::min(cfg.prefill_chunk, max_sequence_tokens()) + cfg.max_batch - 1;
    const int64_t mine = p > 1 ? (rows + p - 1) / p : rows;
    const auto z = [](auto& buf, int64_t n) { buf.assign(static_cast<std::size_t>(n), {}); };
    z(x, mine * E);
    z(q, rows * qd);
    z(k, rows * kvd);
    z(v, rows * kvd);
    z(attn, mine * qd);
    z(states, rows * H * (D + 2));
    if (p > 1) {
      z(qkv_send, mine * packed);
      z(qkv_recv, p * mine * packed);
    }
    z(qkv_local, mine * packed);
    z(fs.xn, mine * E);
    z(fs.tmp, mine * E);
    z(fs.gate, mine * F);
    z(fs.up, mine * F);
    model->reserve_forward(mine,
                           mv);  // this thread's: create and run share one (generation, serve)
  }
  void try_reserve_step_scratch() {
    try {
      reserve_step_scratch();
    } catch (const std::bad_alloc&) {
      for (auto* buf : {&x, &q, &k, &v, &attn, &states, &qkv_send, &qkv_recv, &qkv_local, &fs.xn,
                        &fs.tmp, &fs.gate, &fs.up})
        std::vector<float>().swap(*buf);
    }
  }

  // ---- the batched forward pass ----
  Status forward(const std::vector<std::pair<RequestId, int64_t>>& planned) {
    const auto& mc = model->config();
    const int64_t E = mc.n_embd, H = mc.n_head, Hkv = mc.n_head_kv, D = mc.head_dim;
    const int64_t qd = H * D, kvd = Hkv * D;
    const std::size_t rec = static_cast<std::size_t>(D + 2);
    // Pass-Q items first, then those computed by the K/V exchange (exchange.hpp), decided from
    // the replicated state alone, so identically on every rank. The order of the items only
    // changes which rank computes a row's dense part, never its bits.
    std::vector<std::pair<RequestId, int64_t>> work;
    std::vector<std::pair<RequestId, int64_t>> kv_work;
    for (const auto& item : planned) {
      const Seq* s = find(item.first);
      if (use_kv_exchange(exchange, xshape, item.second, s->computed))
        kv_work.push_back(item);
      else
        work.push_back(item);
    }
    const std::size_t n_passq = work.size();
    work.insert(work.end(), kv_work.begin(), kv_work.end());
    // Rows, and pages for the positions they store (allocated on every rank's table).
    std::vector<Seq*> seqs;
    std::vector<int64_t> first_row;
    int64_t rows = 0;
    row_tok.clear();
    row_pos.clear();
    for (const auto& [id, n] : work) {  // checked by check_work() before the step's agreement
      Seq* s = find(id);
      seqs.push_back(s);
      first_row.push_back(rows);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = s->computed + i;
        row_tok.push_back(s->tokens[static_cast<std::size_t>(pos)]);
        row_pos.push_back(pos);
        const int64_t j = pos / T;
        if (j == static_cast<int64_t>(s->pages.size())) {
          const int owner = table->owner(j);
          auto pg = table->allocate(owner);
          TREEATTN_RETURN_IF_ERROR(pg.status());
          --s->reserve_left[static_cast<std::size_t>(owner)];
          s->pages.push_back(*pg);
          if (cfg.poison_pages && owner == me) poison(*pg);
        }
      }
      rows += n;
    }
    if (rows == 0) return Status::ok();
    const int64_t rows_q = n_passq < work.size() ? first_row[n_passq] : rows;  // pass-Q rows
    rows_pass_q += rows_q;
    rows_kv += rows - rows_q;
    // The dense part is split: rank r computes rows [lo, lo + mine) (embedding, projections,
    // output projection, FFN); per layer the ranks all-gather q, k and v of every row, so that
    // the owners store K/V and every rank computes its pages' partial states for every row. A
    // row's bits do not depend on which rank computes it or on how many rows it is computed with
    // (matmul per token, model.hpp), so the split changes no bit.
    // One row (a lone decode step) is computed by every rank instead: splitting it would only
    // add an all-gather (a synchronisation per layer) without shortening any rank's work.
    const bool split = p > 1 && rows > 1;
    const int64_t per = split ? (rows + p - 1) / p : rows;  // rows per rank (slots)
    const int64_t lo = split ? std::min(rows, me * per) : 0;
    const int64_t mine = std::min(rows, lo + per) - lo;
    const int64_t packed = qd + 2 * kvd;  // floats of one pass-Q row's q, k, v
    // A rank's slot of the all-gather: its rows' q, k, v (pass-Q rows) or k, v (K/V rows),
    // padded to the largest slot.
    row_off.assign(static_cast<std::size_t>(rows), 0);
    int64_t gslot = 0;  // floats
    for (int r = 0; r < p && split; ++r) {
      int64_t off = 0;
      for (int64_t row = std::min(rows, r * per); row < std::min(rows, (r + 1) * per); ++row) {
        row_off[static_cast<std::size_t>(row)] = off;
        off += row < rows_q ? packed : 2 * kvd;
      }
      gslot = std::max(gslot, off);
    }
    x.resize(static_cast<std::size_t>(std::max<int64_t>(mine, 1) * E));
    q.resize(static_cast<std::size_t>(rows * qd));
    k.resize(static_cast<std::size_t>(rows * kvd));
    v.resize(k.size());
    attn.resize(static_cast<std::size_t>(std::max<int64_t>(mine, 1) * qd));
    states.resize(static_cast<std::size_t>(rows * H) * rec);
    qkv_send.resize(static_cast<std::size_t>(std::max<int64_t>(gslot, 1)));
    qkv_recv.resize(static_cast<std::size_t>(p * std::max<int64_t>(gslot, 1)));
    qkv_local.resize(static_cast<std::size_t>(std::max<int64_t>(mine, 1) * packed));
    if (mine > 0)
      TREEATTN_RETURN_IF_ERROR(model->embed(
          std::span<const TokenId>(row_tok.data() + lo, static_cast<std::size_t>(mine)), x.data()));

    // This rank's pages of each work item's sequence, as the kernel reads them.
    std::vector<EntryPages> ep(n_passq);
    std::vector<PagedEntry> entries(n_passq);
    for (std::size_t w = 0; w < n_passq; ++w) {
      const Seq& s = *seqs[w];
      const int64_t end = s.computed + work[w].second;  // length after this step
      for (int64_t j = 0; j * T < end; ++j) {
        const PageRef& pg = s.pages[static_cast<std::size_t>(j)];
        if (pg.rank != me) continue;
        ep[w].ids.push_back(pg.id);
        ep[w].pos.push_back(j * T);
        ep[w].len.push_back(static_cast<int32_t>(std::min(T, end - j * T)));
      }
      PagedEntry& e = entries[w];
      e.q = q.data() + first_row[w] * qd;
      e.n_q = work[w].second;
      e.first_pos = s.computed;
      e.pages = ep[w].ids;
      e.page_pos = ep[w].pos;
      e.page_len = ep[w].len;
      e.states = states.data() + static_cast<std::size_t>(first_row[w] * H) * rec;
    }
    const AttnShape shape{1, H, Hkv, D, 1};
    const int64_t pool_pages = table->pages_per_rank();
    const std::vector<int64_t> no_len;
    float* ql = qkv_local.data();
    float* kl = ql + std::max<int64_t>(mine, 1) * qd;
    float* vl = kl + std::max<int64_t>(mine, 1) * kvd;

    for (int l = 0; l < mc.n_layers; ++l) {
      const auto td = Clock::now();
      if (mine > 0)
        TREEATTN_RETURN_IF_ERROR(
            model->attention_inputs(l, x.data(), mine, row_pos.data() + lo, ql, kl, vl, fs, mv));
      dense_s += seconds(Clock::now() - td);
      if (!split) {
        std::memcpy(q.data(), ql, static_cast<std::size_t>(rows * qd) * sizeof(float));
        std::memcpy(k.data(), kl, static_cast<std::size_t>(rows * kvd) * sizeof(float));
        std::memcpy(v.data(), vl, static_cast<std::size_t>(rows * kvd) * sizeof(float));
      } else {
        const auto fb = static_cast<std::size_t>(sizeof(float));
        for (int64_t i = 0; i < mine; ++i) {
          float* dst = qkv_send.data() + row_off[static_cast<std::size_t>(lo + i)];
          if (lo + i < rows_q) {
            std::memcpy(dst, ql + i * qd, static_cast<std::size_t>(qd) * fb);
            dst += qd;
          }
          std::memcpy(dst, kl + i * kvd, static_cast<std::size_t>(kvd) * fb);
          std::memcpy(dst + kvd, vl + i * kvd, static_cast<std::size_t>(kvd) * fb);
        }
        const auto tg = Clock::now();
        TREEATTN_RETURN_IF_ERROR(comm->allgather(
            qkv_send.data(), static_cast<std::size_t>(gslot) * fb, qkv_recv.data()));
        merge_s += seconds(Clock::now() - tg);
        for (int64_t row = 0; row < rows; ++row) {
          const float* src =
              qkv_recv.data() + (row / per) * gslot + row_off[static_cast<std::size_t>(row)];
          if (row < rows_q) {
            std::memcpy(q.data() + row * qd, src, static_cast<std::size_t>(qd) * fb);
            src += qd;
          } else if (row >= lo && row < lo + mine) {  // a K/V row's q stays on its rank
            std::memcpy(q.data() + row * qd, ql + (row - lo) * qd,
                        static_cast<std::size_t>(qd) * fb);
          }
          std::memcpy(k.data() + row * kvd, src, static_cast<std::size_t>(kvd) * fb);
          std::memcpy(v.data() + row * kvd, src + kvd, static_cast<std::size_t>(kvd) * fb);
        }
      }
      // The owners store K and V.
      TiledKVCache& pool = pools[static_cast<std::size_t>(l)];
      for (std::size_t w = 0; w < work.size(); ++w) {
        const Seq& s = *seqs[w];
        for (int64_t i = 0; i < work[w].second; ++i) {
          const int64_t row = first_row[w] + i, pos = s.computed + i;
          const PageRef& pg = s.pages[static_cast<std::size_t>(pos / T)];
          if (pg.rank != me) continue;
          pool.set_tokens(0, static_cast<int64_t>(pg.id) * T + pos % T, k.data() + row * kvd,
                          v.data() + row * kvd);
        }
      }
      // Sliding-window layers (gemma3): each rank attends to the window's part of its pages,
      // and the merge below is the same as for a global layer (a rank with no page in the
      // window contributes the identity); the window's pages stay where the placement put them.
      const int64_t window =
          mc.sliding_window > 0 && mc.local_layer[static_cast<std::size_t>(l)] != 0
              ? mc.sliding_window
              : 0;
      for (PagedEntry& e : entries) e.window = window;
      const auto ta = Clock::now();
      const TiledKVShard view = pool.view(no_len, no_len, no_len, 1);
      if (!entries.empty())
        TREEATTN_RETURN_IF_ERROR(decode_partial_paged(shape, view, pool_pages, entries, dopt));
      const auto tm = Clock::now();
      attn_s += seconds(tm - ta);
      if (rows_q > 0) {
        TREEATTN_RETURN_IF_ERROR(
            merge->merge(states.data(), static_cast<std::size_t>(rows_q * H)));
        ++merges;
      }
      merge_s += seconds(Clock::now() - tm);
      if (rows_q < rows)
        TREEATTN_RETURN_IF_ERROR(
            kv_exchange_attention(pool, seqs, first_row, work, n_passq, lo, mine, window));
      for (int64_t r = 0; r < mine * H; ++r)
        state_normalize(states.data() + static_cast<std::size_t>(lo * H + r) * rec,
                        static_cast<std::size_t>(D), attn.data() + r * D,
                        static_cast<float*>(nullptr));
      const auto tf = Clock::now();
      if (mine > 0)
        TREEATTN_RETURN_IF_ERROR(
            model->attention_output_and_ffn(l, attn.data(), mine, x.data(), fs, mv));
      dense_s += seconds(Clock::now() - tf);
    }

    // Bookkeeping: positions stored, full pages indexed.
    for (std::size_t w = 0; w < work.size(); ++w) {
      Seq& s = *seqs[w];
      s.computed += work[w].second;
      while (static_cast<int64_t>(s.hashes.size() + 1) * T <= s.computed) {
        const int64_t j = static_cast<int64_t>(s.hashes.size());
        const uint64_t parent = j == 0 ? PageTable::kRootHash : s.hashes.back();
        const std::span<const TokenId> toks(s.tokens.data() + j * T, static_cast<std::size_t>(T));
        const uint64_t h = PageTable::chain_hash(parent, toks);
        s.hashes.push_back(h);
        if (cfg.prefix_cache) table->insert(h, parent, toks, s.pages[static_cast<std::size_t>(j)]);
      }
    }

    // Logits of the rows that end a sequence's known tokens; sampling, identical on every rank.
    std::vector<std::size_t> sample_w;
    for (std::size_t w = 0; w < work.size(); ++w)
      if (seqs[w]->computed == static_cast<int64_t>(seqs[w]->tokens.size())) sample_w.push_back(w);
    if (sample_w.empty()) return Status::ok();
    const auto S = static_cast<int64_t>(sample_w.size());
    const int64_t V = mc.n_vocab;
    logits.resize(static_cast<std::size_t>(S * V));
    if (!split) {  // every rank computed every row: the same logits everywhere
      xs.resize(static_cast<std::size_t>(S * E));
      for (int64_t i = 0; i < S; ++i) {
        const std::size_t w = sample_w[static_cast<std::size_t>(i)];
        const int64_t row = first_row[w] + work[w].second - 1;
        std::memcpy(xs.data() + i * E, x.data() + row * E,
                    static_cast<std::size_t>(E) * sizeof(float));
      }
      TREEATTN_RETURN_IF_ERROR(model->logits(xs.data(), S, logits.data(), fs, mv));
    } else {
      // Each rank computes the logits of the sampled rows it computed, and an all-gather gives
      // every rank all of them, so every rank samples the same tokens. The output projection
      // (vocab x embd) is the step's largest matrix: computing it for every row on every rank
      // cost each rank as much as all the ranks' shares together. The bits are those of any
      // other split (a row's logits do not depend on the rows computed with it, model.hpp).
      std::vector<int64_t> owner(static_cast<std::size_t>(S)), slot(static_cast<std::size_t>(S));
      std::vector<int64_t> count(static_cast<std::size_t>(p), 0);
      for (int64_t i = 0; i < S; ++i) {
        const std::size_t w = sample_w[static_cast<std::size_t>(i)];
        const int64_t o = (first_row[w] + work[w].second - 1) / per;
        owner[static_cast<std::size_t>(i)] = o;
        slot[static_cast<std::size_t>(i)] = count[static_cast<std::size_t>(o)]++;
      }
      const int64_t most = *std::max_element(count.begin(), count.end());
      const int64_t have = count[static_cast<std::size_t>(me)];
      xs.resize(static_cast<std::size_t>(std::max<int64_t>(have, 1) * E));
      for (int64_t i = 0; i < S; ++i) {
        if (owner[static_cast<std::size_t>(i)] != me) continue;
        const std::size_t w = sample_w[static_cast<std::size_t>(i)];
        const int64_t row = first_row[w] + work[w].second - 1;
        std::memcpy(xs.data() + slot[static_cast<std::size_t>(i)] * E, x.data() + (row - lo) * E,
                    static_cast<std::size_t>(E) * sizeof(float));
      }
      // This rank's rows, then padding up to `most` rows that no rank reads (not cleared).
      xs_all.resize(static_cast<std::size_t>(most * V));
      if (have > 0) TREEATTN_RETURN_IF_ERROR(model->logits(xs.data(), have, xs_all.data(), fs, mv));
      logits_all.resize(static_cast<std::size_t>(p * most * V));
      TREEATTN_RETURN_IF_ERROR(comm->allgather(
          xs_all.data(), static_cast<std::size_t>(most * V) * sizeof(float), logits_all.data()));
      for (int64_t i = 0; i < S; ++i)
        std::memcpy(
            logits.data() + i * V,
            logits_all.data() +
                (owner[static_cast<std::size_t>(i)] * most + slot[static_cast<std::size_t>(i)]) * V,
            static_cast<std::size_t>(V) * sizeof(float));
    }
    std::vector<RequestId> done;
    for (int64_t i = 0; i < S; ++i) {
      Seq& s = *seqs[sample_w[static_cast<std::size_t>(i)]];
      const std::span<const float> lg(logits.data() + i * mc.n_vocab,
                                      static_cast<std::size_t>(mc.n_vocab));
      const TokenId tok = s.sampler.sample(lg);
      s.tokens.push_back(tok);
      ++s.generated;
      ++generated_total;
      if (s.generated == 1) s.first_token = Clock::now();
      TokenEvent ev;
      ev.token = tok;
      ev.index = s.generated - 1;
      if (std::find(s.req.stop_tokens.begin(), s.req.stop_tokens.end(), tok) !=
          s.req.stop_tokens.end())
        ev.finish = FinishReason::kStop;
      else if (s.generated >= s.req.max_new_tokens)
        ev.finish = FinishReason::kLength;
      if (s.req.return_logits && me == 0) ev.logits.assign(lg.begin(), lg.end());
      emit(s, ev);
      if (ev.finish != FinishReason::kNone) done.push_back(s.id);
    }
    for (RequestId id : done) retire(id);
    return Status::ok();
  }

  // The K/V exchange for work items [n_passq, work.size()) (exchange.hpp), in layer `pool`:
  // every rank sends its pages' cached tokens of those sequences (positions before this step)
  // to every rank; each rank copies the pages its own rows read into xpool (cached tokens from
  // their owners, this step's from the all-gathered k and v, narrowed as the owners store
  // them), computes per owner rank the partial states over that rank's pages (the entries the
  // owner would have computed under pass-Q, so the same bits), and merges them locally in the
  // merge collective's association into `states`.
  Status kv_exchange_attention(const TiledKVCache& pool, const std::vector<Seq*>& seqs,
                               const std::vector<int64_t>& first_row,
                               const std::vector<std::pair<RequestId, int64_t>>& work,
                               std::size_t n_passq, int64_t lo, int64_t mine, int64_t window) {
    const auto& mc = model->config();
    const int64_t H = mc.n_head, Hkv = mc.n_head_kv, D = mc.head_dim;
    const int64_t qd = H * D, kvd = Hkv * D;
    const std::size_t rec = static_cast<std::size_t>(D + 2);
    const std::size_t head_bytes = static_cast<std::size_t>(D) * dtype_size(cfg.kv_dtype);
    const std::size_t tok_bytes = 2 * static_cast<std::size_t>(Hkv) * head_bytes;
    const auto up = static_cast<std::size_t>(p);
    // 1. Every rank's cached tokens of these sequences, item by item, page by page.
    std::vector<std::size_t> bytes_of(up, 0);
    for (std::size_t w = n_passq; w < work.size(); ++w) {
      const Seq& s = *seqs[w];
      for (int64_t j = 0; j * T < s.computed; ++j)
        bytes_of[static_cast<std::size_t>(s.pages[static_cast<std::size_t>(j)].rank)] +=
            static_cast<std::size_t>(std::min(T, s.computed - j * T)) * tok_bytes;
    }
    const std::size_t slot = *std::max_element(bytes_of.begin(), bytes_of.end());
    const auto ta = Clock::now();
    if (slot > 0) {
      page_send.resize(slot);
      page_recv.resize(slot * up);
      uint8_t* dst = page_send.data();
      float ks = 0, vs = 0;
      for (std::size_t w = n_passq; w < work.size(); ++w) {
        const Seq& s = *seqs[w];
        for (int64_t j = 0; j * T < s.computed; ++j) {
          const PageRef& pg = s.pages[static_cast<std::size_t>(j)];
          if (pg.rank != me) continue;
          for (int64_t t = 0; t < std::min(T, s.computed - j * T); ++t)
            for (int64_t h = 0; h < Hkv; ++h, dst += 2 * head_bytes)
              pool.read_token_raw(0, h, static_cast<int64_t>(pg.id) * T + t, dst, dst + head_bytes,
                                  &ks, &vs);
        }
      }
      const auto tg = Clock::now();
      attn_s += seconds(tg - ta);
      TREEATTN_RETURN_IF_ERROR(comm->allgather(page_send.data(), slot, page_recv.data()));
      merge_s += seconds(Clock::now() - tg);
      kv_bytes_sent += static_cast<int64_t>(slot);
    }
    const auto tc = Clock::now();
    // 2. The pages this rank's rows read, copied into xpool; per (item, owner) one entry.
    struct Span {
      std::size_t w;
      int64_t a, b;  // this rank's rows of item w
    };
    std::vector<Span> spans;
    int64_t need_pages = 0;
    for (std::size_t w = n_passq; w < work.size(); ++w) {
      const int64_t a = std::max(lo, first_row[w]);
      const int64_t b = std::min(lo + mine, first_row[w] + work[w].second);
      if (a >= b) continue;
      spans.push_back({w, a, b});
      const int64_t end = seqs[w]->computed + work[w].second;
      need_pages += (end + T - 1) / T;
    }
    if (need_pages > xpool_pages) {
      auto c = TiledKVCache::create(AttnShape{1, H, Hkv, D, 1}, cfg.kv_dtype, need_pages * T,
                                    kKVTileLayout, T);
      TREEATTN_RETURN_IF_ERROR(c.status());
      xpool = std::move(c).value();
      xpool_pages = need_pages;
    }
    std::vector<EntryPages> ep(spans.size() * up);
    std::vector<int64_t> cursor(up, 0);  // read offset in each rank's part of page_recv
    int32_t xid = 0;
    std::size_t si = 0;
    for (std::size_t w = n_passq; w < work.size(); ++w) {
      const Seq& s = *seqs[w];
      const int64_t C = s.computed, end = C + work[w].second;
      const bool read = si < spans.size() && spans[si].w == w;
      for (int64_t j = 0; j * T < end; ++j) {
        const auto o = static_cast<std::size_t>(s.pages[static_cast<std::size_t>(j)].rank);
        const int64_t cached = j * T < C ? std::min(T, C - j * T) : 0;
        if (read) {
          const int32_t id = xid++;
          const uint8_t* src = page_recv.data() + o * slot + static_cast<std::size_t>(cursor[o]);
          for (int64_t t = 0; t < cached; ++t)
            for (int64_t h = 0; h < Hkv; ++h, src += 2 * head_bytes)
              xpool.set_token_raw(0, h, static_cast<int64_t>(id) * T + t, src, src + head_bytes);
          for (int64_t pos = std::max(j * T, C); pos < std::min(end, (j + 1) * T); ++pos) {
            const int64_t row = first_row[w] + pos - C;
            xpool.set_tokens(0, static_cast<int64_t>(id) * T + pos - j * T, k.data() + row * kvd,
                             v.data() + row * kvd);
          }
          EntryPages& e = ep[si * up + o];
          e.ids.push_back(id);
          e.pos.push_back(j * T);
          e.len.push_back(static_cast<int32_t>(std::min(T, end - j * T)));
        }
        cursor[o] += cached * static_cast<int64_t>(tok_bytes);
      }
      if (read) ++si;
    }
    kv_states.resize(up * static_cast<std::size_t>(std::max<int64_t>(mine, 1) * H) * rec);
    std::vector<PagedEntry> entries(spans.size() * up);
    for (std::size_t i = 0; i < spans.size(); ++i) {
      const Span& sp = spans[i];
      for (std::size_t o = 0; o < up; ++o) {
        PagedEntry& e = entries[i * up + o];
        const EntryPages& pages = ep[i * up + o];
        e.q = q.data() + sp.a * qd;
        e.n_q = sp.b - sp.a;
        e.first_pos = seqs[sp.w]->computed + (sp.a - first_row[sp.w]);
        e.pages = pages.ids;
        e.page_pos = pages.pos;
        e.page_len = pages.len;
        e.window = window;
        e.states = kv_states.data() +
                   (o * static_cast<std::size_t>(mine) + static_cast<std::size_t>(sp.a - lo)) *
                       static_cast<std::size_t>(H) * rec;
      }
    }
    const std::vector<int64_t> no_len;
    if (!entries.empty())
      TREEATTN_RETURN_IF_ERROR(decode_partial_paged(AttnShape{1, H, Hkv, D, 1},
                                                    xpool.view(no_len, no_len, no_len, 1),
                                                    xpool_pages, entries, dopt));
    // 3. The owners' states of each row, merged as the merge collective would.
    std::vector<const float*> parts(up);
    for (const Span& sp : spans)
      for (int64_t row = sp.a; row < sp.b; ++row) {
        for (std::size_t o = 0; o < up; ++o)
          parts[o] = kv_states.data() +
                     (o * static_cast<std::size_t>(mine) + static_cast<std::size_t>(row - lo)) *
                         static_cast<std::size_t>(H) * rec;
        TREEATTN_RETURN_IF_ERROR(merge->merge_local(
            parts.data(), p, static_cast<std::size_t>(H),
            states.data() + static_cast<std::size_t>(row * H) * rec));
      }
    attn_s += seconds(Clock::now() - tc);
    return Status::ok();
  }

  void update_snapshot() {
    EngineMetrics m;
    m.running = static_cast<int64_t>(running.size());
    m.requests_total = requests_total;
    m.prompt_tokens_total = prompt_total;
    m.cached_tokens_total = cached_total;
    m.generated_tokens_total = generated_total;
    m.steps = steps;
    m.pages_per_rank = table->pages_per_rank();
    for (int r = 0; r < p; ++r) {
      m.pages_used.push_back(table->used_pages(r));
      m.pages_cached.push_back(table->cached_pages(r));
      m.pages_free.push_back(table->free_pages(r));
    }
    m.merge_seconds = rank_merge_s;
    m.attention_seconds = rank_attn_s;
    m.dense_seconds = rank_dense_s;
    m.merges = merges;
    m.rows_pass_q = rows_pass_q;
    m.rows_kv_exchange = rows_kv;
    m.kv_exchange_bytes = kv_bytes_sent;
    m.bytes_sent = comm->counters().p2p_bytes + comm->counters().collective_payload_bytes;
    std::lock_guard lk(mu);
    m.waiting = static_cast<int64_t>(waiting.size());
    m.failed = failed;
    m.error = failure;
    snapshot = std::move(m);
  }

  // One step on every rank. *stop: the step was a stop step.
  Result<bool> step(bool* stop) {
    {
      std::lock_guard lk(mu);
      if (failed) return Status(failure_code, failure);
    }
    Plan pl;
    std::vector<int64_t> words;
    int64_t header[2] = {0, 0};
    Status planned;
    if (me == 0) {
      auto r = make_plan();
      if (r.is_ok()) {
        pl = std::move(r).value();
      } else {  // the others learn it from the description instead of waiting for a timeout
        planned = r.status();
        pl = Plan{};
        pl.kind = kStepFail;
      }
      words = encode(pl);
      header[0] = static_cast<int64_t>(words.size());
    }
    comm->set_context("engine step " + std::to_string(steps));
    TREEATTN_RETURN_IF_ERROR(comm->broadcast(header, sizeof(header), 0));
    if (me != 0) {
      if (header[0] < 5 || header[0] > (int64_t{1} << 40))
        return internal_error(rank_prefix(*comm) + "malformed step description length " +
                              std::to_string(header[0]) + " from rank 0");
      words.resize(static_cast<std::size_t>(header[0]));
    }
    TREEATTN_RETURN_IF_ERROR(comm->broadcast(words.data(), words.size() * sizeof(int64_t), 0));
    if (me == 0 && !planned.is_ok()) return planned;
    // Apply the description; then every rank learns whether every rank could (one all-gather,
    // which also carries each rank's timings for the metrics), so a rank that cannot apply it
    // is named everywhere instead of leaving the others waiting in a merge.
    Status applied;
    if (me != 0) {
      auto r = decode_plan(words);
      if (!r.is_ok()) {
        applied = r.status();
      } else {
        pl = std::move(r).value();
        if (pl.kind == kStepFail)
          return internal_error(rank_prefix(*comm) + "rank 0 failed while planning engine step " +
                                std::to_string(steps) + " (its message says why)");
        for (RequestId id : pl.cancels) cancel_running(id);
        for (auto& a : pl.admits) {
          auto ok = admit(a.id, std::move(a.req), false, {}, Clock::now());
          if (!ok.is_ok()) {
            applied = ok.status();
            break;
          }
        }
      }
    }
    if (applied.is_ok()) applied = check_work(pl.work);
    double mine[4] = {applied.is_ok() ? 1.0 : 0.0, merge_s, attn_s, dense_s};
    rank_times.resize(static_cast<std::size_t>(4 * p));
    TREEATTN_RETURN_IF_ERROR(comm->allgather(mine, sizeof(mine), rank_times.data()));
    if (!applied.is_ok()) return applied;
    for (int r = 0; r < p; ++r)
      if (rank_times[static_cast<std::size_t>(4 * r)] != 1.0)
        return internal_error(rank_prefix(*comm) + "rank " + std::to_string(r) +
                              " could not apply engine step " + std::to_string(steps) +
                              " (its message says why)");
    rank_merge_s.assign(static_cast<std::size_t>(p), 0.0);
    rank_attn_s.assign(static_cast<std::size_t>(p), 0.0);
    rank_dense_s.assign(static_cast<std::size_t>(p), 0.0);
    for (int r = 0; r < p; ++r) {
      rank_merge_s[static_cast<std::size_t>(r)] = rank_times[static_cast<std::size_t>(4 * r + 1)];
      rank_attn_s[static_cast<std::size_t>(r)] = rank_times[static_cast<std::size_t>(4 * r + 2)];
      rank_dense_s[static_cast<std::size_t>(r)] = rank_times[static_cast<std::size_t>(4 * r + 3)];
    }
    ++steps;
    if (pl.kind == kStepStop) {
      *stop = true;
      if (me == 0) update_snapshot();
      return false;
    }
    TREEATTN_RETURN_IF_ERROR(forward(pl.work));
    if (me == 0) update_snapshot();
    return !running.empty() || pl.waiting_after > 0;
  }

  // Whether this rank can run the work of a description (every named request is live and has
  // the tokens to feed): the local half of the step agreement.
  Status check_work(const std::vector<std::pair<RequestId, int64_t>>& work) {
    for (const auto& [id, n] : work) {
      Seq* s = find(id);
      if (s == nullptr || n < 1 || s->computed + n > static_cast<int64_t>(s->tokens.size()))
        return internal_error(rank_prefix(*comm) + "step description names request " +
                              std::to_string(id) + " with " + std::to_string(n) +
                              " tokens, which this rank cannot run");
    }
    return Status::ok();
  }

  // Every request in flight ends with an error event (rank 0); the sequences' pages are
  // released; later steps return the same error.
  void fail_all(const Status& st) {
    std::deque<Pending> drop;
    {
      std::lock_guard lk(mu);
      if (!failed) {
        failed = true;
        failure = st.message();
        failure_code = st.code();
      }
      drop.swap(waiting);
    }
    TokenEvent ev;
    ev.finish = FinishReason::kError;
    ev.error = st;
    for (auto& s : running) emit(*s, ev);
    while (!running.empty()) retire(running.front()->id);
    if (me != 0) return;
    for (Pending& pd : drop)
      if (pd.cb) {
        ev.id = pd.id;
        pd.cb(ev);
      }
    update_snapshot();
  }

  // The engine goes away: whatever is still queued or running ends with kCancelled (rank 0).
  void end_everything() {
    std::deque<Pending> drop;
    {
      std::lock_guard lk(mu);
      drop.swap(waiting);
      stop_now = true;
    }
    TokenEvent ev;
    ev.finish = FinishReason::kCancelled;
    for (auto& s : running) emit(*s, ev);
    running.clear();
    if (me != 0) return;
    for (Pending& pd : drop)
      if (pd.cb) {
        ev.id = pd.id;
        pd.cb(ev);
      }
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() {
  if (impl_) impl_->end_everything();
}

Result<std::unique_ptr<Engine>> Engine::create(Communicator& comm, const model::LlamaModel& model,
                                               const EngineConfig& config) {
  auto impl = std::make_unique<Impl>();
  Impl& e = *impl;
  e.comm = &comm;
  e.model = &model;
  e.cfg = config;
  e.p = comm.size();
  e.me = comm.rank();
  e.T = config.page_tokens;
  e.mv.threads = config.threads;
  e.mv.isa = config.isa;
  e.dopt.threads = config.threads;
  e.dopt.isa = config.isa;
  e.mv.mode = config.matmul;
  const auto& mc = model.config();
  const std::string who = rank_prefix(comm) + "engine: ";
  // Local checks first; every rank then learns every rank's verdict, so a rank with a bad
  // configuration is named on all of them and none waits for it.
  // Ranks sharing this host split its memory (collective, so every rank calls it).
  comm.set_timeout(config.timeout);
  comm.set_context("engine create");
  int local_ranks = 1;
  {
    auto shared = comm.split_shared(comm.rank());
    if (shared.is_ok() && *shared) local_ranks = (*shared)->size();
  }
  Status local;
  {
    auto x = parse_exchange(config.prefill_exchange);
    if (!x.is_ok())
      local = x.status();
    else
      e.exchange = *x;
  }
  if (local.is_ok() && config.fanout < 1)
    local = invalid_argument("fanout must be >= 1, got " + std::to_string(config.fanout));
  if (local.is_ok()) local = check_isa_supported(config.isa, "engine isa");
  if (local.is_ok() && !valid_page_tokens(config.page_tokens))
    local = invalid_argument("page_tokens " + std::to_string(config.page_tokens) +
                             " must be 16 or a multiple of 32 up to 256");
  if (local.is_ok() && config.kv_dtype != DType::kF32 && config.kv_dtype != DType::kF16 &&
      config.kv_dtype != DType::kBF16)
    local = unsupported("the KV dtype must be f32, f16 or bf16, not " +
                        std::string(dtype_name(config.kv_dtype)));
  if (local.is_ok() && config.max_batch < 1) local = invalid_argument("max_batch must be >= 1");
  if (local.is_ok() && config.prefill_chunk < 1)
    local = invalid_argument("prefill_chunk must be >= 1");
  if (local.is_ok() && config.max_queue < 0) local = invalid_argument("max_queue must be >= 0");
  if (local.is_ok() && config.kv_pages > std::numeric_limits<int32_t>::max())
    local = invalid_argument("kv_pages " + std::to_string(config.kv_pages) + " is more than " +
                             std::to_string(std::numeric_limits<int32_t>::max()) + " pages");
  // Pages: per-layer page bytes from a one-page pool.
  const AttnShape pool_shape{1, mc.n_head, mc.n_head_kv, mc.head_dim, 1};
  int64_t pages = config.kv_pages;
  if (local.is_ok()) {
    auto probe = TiledKVCache::create(pool_shape, config.kv_dtype, e.T, kKVTileLayout, e.T);
    if (!probe.is_ok()) {
      local = probe.status();
    } else if (pages <= 0) {
      const std::size_t per_page = probe->bytes() * static_cast<std::size_t>(mc.n_layers);
      std::size_t budget = config.kv_memory;
      if (budget == 0) {
        budget = static_cast<std::size_t>(mem_available_bytes() / 2 /
                                          static_cast<uint64_t>(local_ranks));
      }
      pages = static_cast<int64_t>(std::min<std::size_t>(
          budget / per_page, static_cast<std::size_t>(std::numeric_limits<int32_t>::max())));
      if (pages < 1)
        local = invalid_argument("the KV memory (" + std::to_string(budget) +
                                 " bytes per rank) holds no page of " + std::to_string(e.T) +
                                 " tokens (" + std::to_string(per_page) + " bytes over " +
                                 std::to_string(mc.n_layers) + " layers)");
    }
  }
  // Agreement: configuration, model and local verdicts, from every rank.
  const std::string desc =
      mc.to_string() + "|" + std::to_string(model.file().file_size()) + "|" +
      std::string(dtype_name(config.kv_dtype)) + "|" + std::to_string(config.page_tokens) + "|" +
      std::to_string(config.max_batch) + "|" + std::to_string(config.prefill_chunk) + "|" +
      config.merge + "|" + config.prefill_exchange + "|" + (config.prefix_cache ? "1" : "0") + "|" +
      std::to_string(config.max_queue) +
      // Ranks compute replicated values (a lone row, the logits) and must
      // get the same bits: the same kernels on every rank.
      "|" + std::string(isa_name(model::matmul_isa(e.mv))) + "|" +
      std::string(model::matmul_mode_name(e.mv.mode)) + "|" +
      std::string(isa_name(config.isa == Isa::kAuto ? best_isa() : config.isa));
  struct Verdict {
    uint64_t hash;
    int64_t pages;
    int32_t ok;
    int32_t pad;
  };
  Verdict mine{std::hash<std::string>{}(desc), pages, local.is_ok() ? 1 : 0, 0};
  std::vector<Verdict> all(static_cast<std::size_t>(e.p));
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof(mine), all.data()));
  if (!local.is_ok()) return Status(local.code(), who + local.message());
  int64_t min_pages = pages;
  for (int r = 0; r < e.p; ++r) {
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
  // Every rank uses the smallest pool (the replicated table assumes one size).
  pages = min_pages;
  // The merge: by name or the planner's (rank 0's choice on every rank), priced for one layer's
  // states of a full batch at the context a batch slot's share of the pools holds.
  {
    MergeRequest mr;
    mr.method = config.merge;
    mr.shape = AttnShape{config.max_batch, mc.n_head, mc.n_head_kv, mc.head_dim, 1};
    mr.kv_dtype = config.kv_dtype;
    mr.context = std::max<int64_t>(1, pages * e.T * e.p / config.max_batch);
    mr.topology = config.topology;
    mr.fanout = config.fanout;
    auto lm = LayerMerge::create(comm, mr);
    TREEATTN_RETURN_IF_ERROR(lm.status());
    e.merge = std::move(*lm);
  }
  const StrategyInfo* merge_info =
      StrategyRegistry::for_backend(comm.capabilities()).info(e.merge->choice().strategy);
  e.xshape = ExchangeShape{
      e.p,
      mc.n_head,
      mc.n_head_kv,
      mc.head_dim,
      2 * static_cast<std::size_t>(mc.n_head_kv * mc.head_dim) * dtype_size(config.kv_dtype),
      merge_info != nullptr && merge_info->holds_every_state,
      e.merge->choice().local_twin};
  TREEATTN_RETURN_IF_ERROR(check_exchange(e.exchange, e.xshape, e.merge->choice().strategy));
  e.pools.reserve(static_cast<std::size_t>(mc.n_layers));
  Status alloc;
  for (int l = 0; l < mc.n_layers && alloc.is_ok(); ++l) {
    auto c = TiledKVCache::create(pool_shape, config.kv_dtype, pages * e.T, kKVTileLayout, e.T);
    if (!c.is_ok())
      alloc = c.status();
    else
      e.pools.push_back(std::move(c).value());
  }
  int32_t ok = alloc.is_ok() ? 1 : 0;
  std::vector<int32_t> oks(static_cast<std::size_t>(e.p));
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&ok, sizeof(ok), oks.data()));
  if (!alloc.is_ok()) return Status(alloc.code(), who + "KV pools: " + alloc.message());
  for (int r = 0; r < e.p; ++r)
    if (oks[static_cast<std::size_t>(r)] == 0)
      return Status(Code::kOutOfMemory,
                    who + "rank " + std::to_string(r) + " could not allocate its KV pools");
  e.table = std::make_unique<PageTable>(e.p, pages, e.T);
  e.rank_merge_s.assign(static_cast<std::size_t>(e.p), 0.0);
  e.rank_attn_s.assign(static_cast<std::size_t>(e.p), 0.0);
  e.rank_dense_s.assign(static_cast<std::size_t>(e.p), 0.0);
  e.try_reserve_step_scratch();
  e.update_snapshot();
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Result<RequestId> Engine::submit(Request request, TokenCallback callback) {
  Impl& e = *impl_;
  if (e.me != 0)
    return invalid_argument(rank_prefix(*e.comm) + "submit: only rank 0 takes requests");
  TREEATTN_RETURN_IF_ERROR(e.check_request(request));
  std::lock_guard lk(e.mu);
  if (e.failed) return internal_error("the engine failed: " + e.failure);
  if (e.stop_now || e.stop_drain) return internal_error("the engine is stopping");
  if (static_cast<int>(e.waiting.size()) >= e.cfg.max_queue)
    return Status(Code::kOutOfMemory,
                  "the request queue is full (" + std::to_string(e.waiting.size()) + " waiting)");
  const RequestId id = e.next_id++;
  e.waiting.push_back({id, std::move(request), std::move(callback), Clock::now()});
  e.cv.notify_all();
  return id;
}

void Engine::cancel(RequestId id) {
  Impl& e = *impl_;
  std::lock_guard lk(e.mu);
  e.cancel_ids.push_back(id);
  e.cv.notify_all();
}

void Engine::stop(bool drain) {
  Impl& e = *impl_;
  std::lock_guard lk(e.mu);
  if (drain)
    e.stop_drain = true;
  else
    e.stop_now = true;
  e.cv.notify_all();
}

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

EngineMetrics Engine::metrics() const {
  std::lock_guard lk(impl_->mu);
  return impl_->snapshot;
}
const EngineConfig& Engine::config() const { return impl_->cfg; }
const MergeChoice& Engine::merge_choice() const { return impl_->merge->choice(); }
const model::LlamaModel& Engine::model() const { return *impl_->model; }
Communicator& Engine::comm() const { return *impl_->comm; }

}  // namespace treeattn::engine
