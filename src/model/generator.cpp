// Generator: the prefill across ranks (balanced block compute placement, per-layer all-gather of
// the prompt's K/V, causal attention by query blocks with the decode kernel) and the decode step
// through a DecodeSession. See include/treeattn/generate.hpp for the algorithm and its
// guarantees.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "treeattn/dtype.hpp"
#include "treeattn/generate.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/state.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn::model {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string rank_prefix(const Communicator& c) { return "rank " + std::to_string(c.rank()) + ": "; }

// Tokens per piece of the projections and the feed-forward network in the prefill: bounds the
// scratch (gate and up are n_ff floats per token) without changing any bit (model.hpp).
constexpr int64_t kPrefillPiece = 256;

uint64_t sent_bytes(const Communicator& c) {
  return c.counters().p2p_bytes + c.counters().collective_payload_bytes;
}

}  // namespace

double prefill_position_weight(const LlamaConfig& c) {
  const double qd = static_cast<double>(c.n_head * c.head_dim);
  const double kvd = static_cast<double>(c.n_head_kv * c.head_dim);
  const double e = static_cast<double>(c.n_embd), ff = static_cast<double>(c.n_ff);
  const double per_token = e * (2 * qd + 2 * kvd) + 3 * e * ff;  // q, o, k, v, gate, up, down
  return 2.0 * qd / per_token;                                   // q.k and p.v per earlier position
}

std::vector<int64_t> prefill_positions(int64_t n, int ranks, int rank, double position_weight) {
  const int64_t nb = (n + kPrefillBlock - 1) / kPrefillBlock;
  std::vector<double> load(static_cast<std::size_t>(ranks), 0.0);
  std::vector<int64_t> mine;
  // Longest processing time first: the costliest (latest) block goes to the least loaded rank,
  // the lowest rank on a tie. Every rank computes the same assignment.
  for (int64_t b = nb - 1; b >= 0; --b) {
    const int64_t t0 = b * kPrefillBlock, t1 = std::min(n, t0 + kPrefillBlock);
    const auto len = static_cast<double>(t1 - t0);
    const double cost = len * (1.0 + position_weight * 0.5 * static_cast<double>(t0 + t1 - 1));
    const auto it = std::min_element(load.begin(), load.end());
    *it += cost;
    if (it - load.begin() == rank) mine.push_back(b);
  }
  std::vector<int64_t> pos;
  for (auto b = mine.rbegin(); b != mine.rend(); ++b)
    for (int64_t t = *b * kPrefillBlock; t < std::min(n, (*b + 1) * kPrefillBlock); ++t)
      pos.push_back(t);
  return pos;  // ascending
}

MemoryEstimate estimate_memory(const LlamaConfig& cfg, const GeneratorConfig& gen, int ranks,
                               int64_t prompt, int64_t new_tokens) {
  MemoryEstimate e;
  const auto ds = static_cast<double>(dtype_size(gen.kv_dtype));
  const double per_token = static_cast<double>(cfg.kv_values_per_token()) * ds;
  const int64_t total = prompt + new_tokens;
  const StrategyRegistry& reg = StrategyRegistry::for_backend(CommCapabilities{});
  for (const std::string& m : gen.methods) {
    // A strategy that needs the whole cache on rank 0 (single): everything there. Contiguous
    // placements: the last rank also gets the new tokens; capacity is its part plus the reserve.
    const StrategyInfo* info = reg.info(m);
    const bool on_root = info != nullptr && info->placement == PlacementNeed::kAllOnRoot;
    const int64_t tokens = on_root ? total : (prompt + ranks - 1) / ranks + new_tokens + 1;
    e.kv_bytes += static_cast<std::size_t>(per_token * static_cast<double>(tokens));
    // Receive buffers the size of a shard of one layer (ring-kv: two, one at two ranks);
    // single's extra cache is its own placement, counted above.
    auto extra = strategy_extra_kv_caches(m, ranks);
    if (!on_root && extra.is_ok())
      e.kv_bytes += static_cast<std::size_t>(*extra * per_token / cfg.n_layers *
                                             static_cast<double>(tokens));
  }
  // Prefill: hidden states and queries of this rank's positions (balanced by cost, so a rank
  // with early positions holds more of them: at most 1.5 n / p plus a block), the send and
  // receive buffers and the whole layer's K/V, the pieces.
  const double mine = 1.5 * static_cast<double>(prompt) / ranks + kPrefillBlock;
  const double kv_layer = per_token / cfg.n_layers;
  e.prefill_bytes = static_cast<std::size_t>(
      mine * static_cast<double>(cfg.n_embd + 2 * cfg.n_head * cfg.head_dim) * 4.0 +
      mine * kv_layer * 2.0 + static_cast<double>(prompt) * kv_layer * 2.0 +
      static_cast<double>(kPrefillPiece) * static_cast<double>(4 * cfg.n_embd + 2 * cfg.n_ff) *
          4.0);
  return e;
}

Generator::~Generator() = default;

Result<std::unique_ptr<Generator>> Generator::create(Communicator& comm, const LlamaModel& model,
                                                     const GeneratorConfig& config) {
  std::unique_ptr<Generator> g(new Generator());
  g->comm_ = &comm;
  g->model_ = &model;
  g->config_ = config;
  g->mv_.threads = config.threads;
  g->mv_.isa = config.isa;
  g->mv_.mode = config.matmul;
  const LlamaConfig& mc = model.config();
  if (config.methods.empty())
    return invalid_argument(rank_prefix(comm) + "generate: no decode method given");
  if (dtype_is_quantized(config.kv_dtype))
    return unsupported(rank_prefix(comm) +
                       "generate: the KV cache dtype must be f32, f16 or "
                       "bf16, not " +
                       std::string(dtype_name(config.kv_dtype)));
  for (const std::string& m : config.methods) {
    SessionConfig sc;
    sc.shape = AttnShape{1, mc.n_head, mc.n_head_kv, mc.head_dim, 1};
    sc.dtype = config.kv_dtype;
    sc.layers = mc.n_layers;
    sc.placement = config.placement;  // initial_plan() gives single its own
    sc.layout = config.kv_layout;
    sc.reserve_tokens = config.reserve_tokens + 1;
    sc.strategy = m;
    sc.options.fanout = config.fanout;
    sc.options.kernel.threads = config.threads;
    sc.options.kernel.isa = config.isa;
    sc.timeout = config.timeout;
    sc.agree_also = {{"model", mc.to_string()},
                     {"model_bytes", std::to_string(model.file().file_size())},
                     {"methods", std::to_string(config.methods.size())}};
    auto s = DecodeSession::create(comm, sc);
    if (!s.is_ok()) return s.status();
    g->sessions_.push_back(std::move(s).value());
  }
  return g;
}

Status Generator::prefill_layer_attention(const float* q, const std::vector<int64_t>& pos,
                                          const void* k, const void* v, int64_t n, float* out) {
  const LlamaConfig& mc = model_->config();
  const int64_t qd = mc.n_head * mc.head_dim;
  // The query blocks of this rank: runs of positions inside one aligned block.
  struct QBlock {
    int64_t first;  // index into pos
    int64_t count;
  };
  std::vector<QBlock> blocks;
  for (std::size_t i = 0; i < pos.size();) {
    std::size_t j = i + 1;
    while (j < pos.size() && pos[j] / kPrefillBlock == pos[i] / kPrefillBlock) ++j;
    blocks.push_back({static_cast<int64_t>(i), static_cast<int64_t>(j - i)});
    i = j;
  }
  const int threads = config_.threads > 0 ? config_.threads : omp_get_max_threads();
  const bool per_block = static_cast<int64_t>(blocks.size()) >= threads;
  const auto nblocks = static_cast<int64_t>(blocks.size());
  std::vector<Status> errors(blocks.size());
  const std::size_t rec = static_cast<std::size_t>(mc.head_dim) + 2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (per_block && threads > 1)
  for (int64_t bi = 0; bi < nblocks; ++bi) {
    const QBlock& b = blocks[static_cast<std::size_t>(bi)];
    const int64_t end = pos[static_cast<std::size_t>(b.first + b.count - 1)] + 1;
    const AttnShape shape{1, mc.n_head, mc.n_head_kv, mc.head_dim, b.count};
    const int64_t len[1] = {end}, start[1] = {0}, total[1] = {end};
    KVShard kv;
    kv.dtype = config_.kv_dtype;
    kv.k = k;
    kv.v = v;
    kv.stride_head = n * mc.head_dim;
    kv.stride_batch = mc.n_head_kv * kv.stride_head;
    kv.stride_token = mc.head_dim;
    kv.len = len;
    kv.pos_start = start;
    kv.total_len = total;
    DecodeOptions opt;
    opt.threads = per_block ? 1 : threads;
    opt.isa = config_.isa;
    thread_local std::vector<float> states;
    states.resize(static_cast<std::size_t>(b.count * mc.n_head) * rec);
    const float* qb = q + b.first * qd;
    Status s = decode_partial(shape, qb, kv, states.data(), opt);
    if (!s.is_ok()) {
      errors[static_cast<std::size_t>(bi)] = s;
      continue;
    }
    float* ob = out + b.first * qd;
    for (int64_t r = 0; r < b.count * mc.n_head; ++r)
      state_normalize(states.data() + static_cast<std::size_t>(r) * rec,
                      static_cast<std::size_t>(mc.head_dim), ob + r * mc.head_dim,
                      static_cast<float*>(nullptr));
  }
  for (const Status& s : errors)
    if (!s.is_ok())
      return Status(s.code(), rank_prefix(*comm_) + "prefill attention: " + s.message());
  return Status::ok();
}

Status Generator::prefill(std::span<const TokenId> prompt, std::vector<float>& logits,
                          const std::function<void(int, int)>& progress) {
  const auto t_start = Clock::now();
  const uint64_t sent0 = sent_bytes(*comm_);
  prefill_stats_ = PrefillStats{};
  const LlamaConfig& mc = model_->config();
  const auto n = static_cast<int64_t>(prompt.size());
  const int p = comm_->size(), me = comm_->rank();
  if (n == 0) return invalid_argument(rank_prefix(*comm_) + "prefill: the prompt is empty");
  if (mc.sliding_window > 0 && n + config_.reserve_tokens > mc.sliding_window)
    return invalid_argument(
        rank_prefix(*comm_) + "prefill: the prompt has " + std::to_string(n) + " tokens and " +
        std::to_string(config_.reserve_tokens) + " more are reserved, but " + mc.architecture +
        "'s sliding-window layers (window " + std::to_string(mc.sliding_window) +
        ") are applied by the engine only: this DecodeSession path takes at most " +
        std::to_string(mc.sliding_window) + " positions (use generate without --session, or serve)");
  for (auto& s : sessions_)
    if (s->length(0) != 0)
      return invalid_argument(rank_prefix(*comm_) + "prefill: the session already holds " +
                              std::to_string(s->length(0)) + " tokens");
  for (const TokenId id : prompt)
    if (id < 0 || id >= mc.n_vocab)
      return invalid_argument(rank_prefix(*comm_) + "prefill: token id " + std::to_string(id) +
                              " is outside the vocabulary [0, " + std::to_string(mc.n_vocab) + ")");
  for (auto& s : sessions_) TREEATTN_RETURN_IF_ERROR(s->extend(n));

  std::vector<std::vector<int64_t>> all_pos(static_cast<std::size_t>(p));
  const double weight = prefill_position_weight(mc);
  std::size_t max_t = 0;
  int last_owner = 0;
  for (int r = 0; r < p; ++r) {
    all_pos[static_cast<std::size_t>(r)] = prefill_positions(n, p, r, weight);
    const auto& v = all_pos[static_cast<std::size_t>(r)];
    max_t = std::max(max_t, v.size());
    if (!v.empty() && v.back() == n - 1) last_owner = r;
  }
  const std::vector<int64_t>& pos = all_pos[static_cast<std::size_t>(me)];
  const auto t = static_cast<int64_t>(pos.size());
  prefill_stats_.positions_computed = t;

  const int64_t qd = mc.n_head * mc.head_dim, kvd = mc.n_head_kv * mc.head_dim;
  const int64_t hd = mc.head_dim;
  const DType dt = config_.kv_dtype;
  const std::size_t ds = dtype_size(dt);
  const std::size_t tok_bytes = static_cast<std::size_t>(2 * kvd) * ds;  // K then V
  std::vector<TokenId> ids(pos.size());
  for (std::size_t i = 0; i < pos.size(); ++i) ids[i] = prompt[static_cast<std::size_t>(pos[i])];
  std::vector<float> x(static_cast<std::size_t>(t * mc.n_embd));
  TREEATTN_RETURN_IF_ERROR(model_->embed(ids, x.data()));
  std::vector<float> q(static_cast<std::size_t>(t * qd)), kf(static_cast<std::size_t>(t * kvd)),
      vf(kf.size()), attn(q.size());
  std::vector<uint8_t> send(max_t * tok_bytes),
      recv(static_cast<std::size_t>(p) * max_t * tok_bytes);
  std::vector<uint8_t> klayer(static_cast<std::size_t>(n * kvd) * ds), vlayer(klayer.size());
  std::vector<float> kst(static_cast<std::size_t>(kvd)), vst(kst.size());

  for (int l = 0; l < mc.n_layers; ++l) {
    for (int64_t t0 = 0; t0 < t; t0 += kPrefillPiece) {
      const int64_t c = std::min(kPrefillPiece, t - t0);
      TREEATTN_RETURN_IF_ERROR(model_->attention_inputs(
          l, x.data() + t0 * mc.n_embd, c, pos.data() + t0, q.data() + t0 * qd,
          kf.data() + t0 * kvd, vf.data() + t0 * kvd, scratch_, mv_));
    }
    // K and V of this rank's positions, narrowed to the cache dtype, then every rank's.
    for (int64_t i = 0; i < t; ++i) {
      uint8_t* dst = send.data() + static_cast<std::size_t>(i) * tok_bytes;
      for (int64_t e = 0; e < kvd; ++e) {
        store_from_float(dst, dt, static_cast<std::size_t>(e),
                         kf[static_cast<std::size_t>(i * kvd + e)]);
        store_from_float(dst, dt, static_cast<std::size_t>(kvd + e),
                         vf[static_cast<std::size_t>(i * kvd + e)]);
      }
    }
    const auto tw = Clock::now();
    TREEATTN_RETURN_IF_ERROR(comm_->allgather(send.data(), send.size(), recv.data()));
    prefill_stats_.wait_seconds += seconds_since(tw);
    // Into [kv_head][position][head_dim] for the kernel.
    for (int r = 0; r < p; ++r) {
      const auto& rp = all_pos[static_cast<std::size_t>(r)];
      for (std::size_t j = 0; j < rp.size(); ++j) {
        const uint8_t* src = recv.data() + (static_cast<std::size_t>(r) * max_t + j) * tok_bytes;
        for (int64_t h = 0; h < mc.n_head_kv; ++h) {
          const std::size_t off = static_cast<std::size_t>((h * n + rp[j]) * hd) * ds;
          std::memcpy(klayer.data() + off, src + static_cast<std::size_t>(h * hd) * ds,
                      static_cast<std::size_t>(hd) * ds);
          std::memcpy(vlayer.data() + off, src + static_cast<std::size_t>(kvd + h * hd) * ds,
                      static_cast<std::size_t>(hd) * ds);
        }
      }
    }
    // The owners keep their positions.
    for (auto& s : sessions_) {
      for (int64_t ps = 0; ps < n; ++ps) {
        if (!s->owns(0, ps)) continue;
        for (int64_t h = 0; h < mc.n_head_kv; ++h)
          for (int64_t d = 0; d < hd; ++d) {
            const auto src = static_cast<std::size_t>((h * n + ps) * hd + d);
            kst[static_cast<std::size_t>(h * hd + d)] = load_as_float(klayer.data(), dt, src);
            vst[static_cast<std::size_t>(h * hd + d)] = load_as_float(vlayer.data(), dt, src);
          }
        TREEATTN_RETURN_IF_ERROR(s->store(l, 0, ps, kst.data(), vst.data()));
      }
    }
    const auto ta = Clock::now();
    TREEATTN_RETURN_IF_ERROR(
        prefill_layer_attention(q.data(), pos, klayer.data(), vlayer.data(), n, attn.data()));
    prefill_stats_.attention_seconds += seconds_since(ta);
    for (int64_t t0 = 0; t0 < t; t0 += kPrefillPiece) {
      const int64_t c = std::min(kPrefillPiece, t - t0);
      TREEATTN_RETURN_IF_ERROR(model_->attention_output_and_ffn(
          l, attn.data() + t0 * qd, c, x.data() + t0 * mc.n_embd, scratch_, mv_));
    }
    if (progress) progress(l + 1, mc.n_layers);
  }
  // The last position's hidden state, from the rank that computed it.
  std::vector<float> last(static_cast<std::size_t>(mc.n_embd));
  if (me == last_owner) std::memcpy(last.data(), x.data() + (t - 1) * mc.n_embd, last.size() * 4);
  const auto tb = Clock::now();
  TREEATTN_RETURN_IF_ERROR(comm_->broadcast(last.data(), last.size() * 4, last_owner));
  prefill_stats_.wait_seconds += seconds_since(tb);
  logits.resize(static_cast<std::size_t>(mc.n_vocab));
  TREEATTN_RETURN_IF_ERROR(model_->logits(last.data(), logits.data(), scratch_, mv_));
  prefill_stats_.bytes_sent = sent_bytes(*comm_) - sent0;
  prefill_stats_.seconds = seconds_since(t_start);
  return Status::ok();
}

Status Generator::prefill_synthetic(int64_t n, uint64_t seed) {
  const auto t_start = Clock::now();
  prefill_stats_ = PrefillStats{};
  const LlamaConfig& mc = model_->config();
  if (n < 1) return invalid_argument(rank_prefix(*comm_) + "prefill_synthetic: n must be >= 1");
  const int64_t kvd = mc.n_head_kv * mc.head_dim;
  std::vector<float> k(static_cast<std::size_t>(kvd)), v(k.size());
  for (auto& s : sessions_) {
    if (s->length(0) != 0)
      return invalid_argument(rank_prefix(*comm_) + "prefill_synthetic: the session is not empty");
    TREEATTN_RETURN_IF_ERROR(s->extend(n));
    for (int l = 0; l < mc.n_layers; ++l)
      for (int64_t ps = 0; ps < n; ++ps) {
        if (!s->owns(0, ps)) continue;
        uint64_t z = seed ^ (static_cast<uint64_t>(l) << 48) ^ (static_cast<uint64_t>(ps) << 8);
        for (int64_t i = 0; i < 2 * kvd; ++i) {
          z += 0x9e3779b97f4a7c15ull;
          uint64_t r = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
          r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
          const float val =
              static_cast<float>(static_cast<int64_t>((r ^ (r >> 31)) >> 40) - (int64_t{1} << 23)) *
              0x1p-23f;
          (i < kvd ? k[static_cast<std::size_t>(i)] : v[static_cast<std::size_t>(i - kvd)]) = val;
        }
        TREEATTN_RETURN_IF_ERROR(s->store(l, 0, ps, k.data(), v.data()));
      }
  }
  prefill_stats_.seconds = seconds_since(t_start);
  return Status::ok();
}

Status Generator::step(TokenId token, std::vector<float>& logits, int method) {
  if (method < 0 || method >= methods())
    return invalid_argument(rank_prefix(*comm_) + "step: method index " + std::to_string(method));
  DecodeSession& s = *sessions_[static_cast<std::size_t>(method)];
  const LlamaConfig& mc = model_->config();
  const int64_t pos = s.length(0);
  if (pos == 0) return invalid_argument(rank_prefix(*comm_) + "step: prefill first");
  x_.resize(static_cast<std::size_t>(mc.n_embd));
  q_.resize(static_cast<std::size_t>(mc.n_head * mc.head_dim));
  attn_.resize(q_.size());
  k_.resize(static_cast<std::size_t>(mc.n_head_kv * mc.head_dim));
  v_.resize(k_.size());
  const TokenId ids[1] = {token};
  TREEATTN_RETURN_IF_ERROR(model_->embed(ids, x_.data()));
  TREEATTN_RETURN_IF_ERROR(s.extend(1));
  const bool mine = s.owns(0, pos);
  for (int l = 0; l < mc.n_layers; ++l) {
    TREEATTN_RETURN_IF_ERROR(model_->attention_inputs(l, x_.data(), 1, &pos, q_.data(), k_.data(),
                                                      v_.data(), scratch_, mv_));
    if (mine) TREEATTN_RETURN_IF_ERROR(s.store(l, 0, pos, k_.data(), v_.data()));
    TREEATTN_RETURN_IF_ERROR(s.attend(l, q_.data(), attn_.data(), nullptr));
    TREEATTN_RETURN_IF_ERROR(
        model_->attention_output_and_ffn(l, attn_.data(), 1, x_.data(), scratch_, mv_));
  }
  logits.resize(static_cast<std::size_t>(mc.n_vocab));
  return model_->logits(x_.data(), logits.data(), scratch_, mv_);
}

}  // namespace treeattn::model
