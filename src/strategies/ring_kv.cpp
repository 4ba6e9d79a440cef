// ring-kv: the baseline the paper measured against: the KV shards travel around the ring.
//
// The query is on every rank. In hop k = 0..p-1 rank r holds the shard that originated on rank
// o = (r - k) mod p (its own at k = 0). While it computes the partial state of the query
// against that shard, it sends the shard to rank r + 1 and receives shard (r - k - 1) mod p from
// rank r - 1 with non-blocking messages (no transfer after the last hop: p - 1 transfers, not
// the p of the paper's JAX loop). The computation is cut into pieces of at least 4096 tokens
// and the transfers are driven between pieces (Communicator::test_all), so a rendezvous
// transfer progresses while the kernel runs; each piece's split length is fixed
// (fixed_split_options), not the device's own plan, so that GPUs of different models compute the
// same partial of a shard. After p hops every rank has all p partials and merges them in origin
// order 0..p-1, so every rank gets the same bits.
//
// A shard travels as one metadata message (per batch row: length, global position of the first
// token, context length; and the position stride) followed by one message per (batch row, KV
// head) for K and one for V (and, for quantized dtypes, one each for their per-token scales).
// On the tiled layout (kv_tiles.hpp) the tiles travel, not rows: per (batch row, KV head) its
// first ceil(len / T) tiles, one message when tiles are records (K, V and scales in each, the
// default), else K tiles, V tiles and the scales; the receive buffers are tiled caches of the
// same geometry, and the kernel reads them as it reads the local shard. The last tile's unused
// slots travel too (at most T - 1 tokens per row and head, and the records' 64-byte padding),
// which the analytic model, counting rows, leaves out. The
// positions travel with the data, so the causal limit for q_len > 1 is right on whichever rank
// computes the shard; the receiver checks the lengths against the replicated plan. Receive buffers
// are dense [batch][kv_heads][max_len][head_dim]; two are needed when p >= 3 (one is forwarded
// while the next arrives), one when p = 2.
//
// Cost per rank and step: sends (p - 1) KV shards (2 t n_kv d_h s bytes each for t tokens per
// shard: the paper's V_ring, independent of p in total) and reads p shards from memory. The
// analytic model counts exactly the payload posted (each forwarded shard and its metadata
// message); the cost model leaves out the metadata (a few bytes per hop).
//
// Message ordering (comm.hpp): in each hop a rank posts to rank + 1 (and from rank - 1) the
// metadata message, then per (batch row, KV head) K, V and, quantized, their scales, with the
// lengths taken from the replicated plan on both sides; tags 600/601/602 are labels, and every
// request of a hop completes before the next hop is posted.
#include <algorithm>
#include <cstring>

#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"
#include "treeattn/kv_tiles.hpp"

namespace treeattn::strategies {
namespace {

// Tags are labels only (comm.hpp: messages match in posting order per pair of ranks).
constexpr int kTagMeta = 600;
constexpr int kTagData = 601;
constexpr int kTagScale = 602;
constexpr int64_t kMinPiece = 4096;
constexpr int kMaxPieces = 8;

// Bytes of the metadata message that precedes each shard: per batch row its length, global
// position of the first token and context length, then the position stride.
std::size_t shard_meta_bytes(int64_t batch) {
  return static_cast<std::size_t>(3 * batch + 1) * sizeof(int64_t);
}

// One shard in flight: K and V (and their scales for quantized dtypes) in the executor's memory,
// dense [batch][kv_heads][max_len][...]; the metadata travels in executor memory too (a device
// communicator can only send that) and is copied to the host, where the kernel's view reads it.
struct ShardBuffer {
  Buffer k, v, k_scale, v_scale, meta;
  std::vector<int64_t> meta_host;  // [len[B], pos_start[B], total_len[B], pos_stride]
  int64_t max_len = 0;             // token slots per (batch, head)
  TiledKVCache tiles;              // the tiled layout's receive buffer (host)
  TiledKVShard tiled_view;         // the received shard, as the kernel reads it
};

// The byte ranges that hold the first n_tiles tiles of (b, h) in a tiled shard: one when tiles
// are records (V and the scales inside each tile's stride from K), else the K tiles, the V
// tiles and, quantized, the two scale arrays.
struct TileSpan {
  const uint8_t* at;
  std::size_t bytes;
};
std::vector<TileSpan> tile_spans(const TiledKVShard& t, int64_t b, int64_t h, int64_t n_tiles,
                                 bool quant) {
  const auto* k = static_cast<const uint8_t*>(t.k);
  const auto* v = static_cast<const uint8_t*>(t.v);
  const int64_t base = b * t.batch_stride + h * t.head_stride;
  const auto bytes = static_cast<std::size_t>(n_tiles * t.tile_stride);
  if (v >= k && v - k < t.tile_stride) return {{k + base, bytes}};
  std::vector<TileSpan> s = {{k + base, bytes}, {v + base, bytes}};
  if (quant) {
    const int64_t sbase = b * t.scale_batch_stride + h * t.scale_head_stride;
    const auto sbytes = static_cast<std::size_t>(n_tiles * t.scale_tile_stride) * sizeof(bf16_t);
    s.push_back({reinterpret_cast<const uint8_t*>(t.k_scale + sbase), sbytes});
    s.push_back({reinterpret_cast<const uint8_t*>(t.v_scale + sbase), sbytes});
  }
  return s;
}

int64_t tiles_for(int64_t len, int64_t tile_tokens) { return (len + tile_tokens - 1) / tile_tokens; }

class RingKV final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "ring-kv"; }

  Status run(const float* q, const KVShard& local, const ShardPlan& plan, float* out) override {
    const int p = comm_->size(), r = comm_->rank();
    const int64_t B = shape_.batch, H = shape_.kv_heads, D = shape_.head_dim;
    const std::size_t es = dtype_size(dtype_);
    const bool quant = dtype_is_quantized(dtype_);
    const bool tiled = local.tiled != nullptr;
    if (local.dtype != dtype_)
      return invalid_argument(who() + "ring-kv: local shard dtype " +
                              std::string(dtype_name(local.dtype)) + " differs from the run's " +
                              std::string(dtype_name(dtype_)));
    if (!tiled && plan.total_tokens(r) > 0 && local.stride_token != D)
      return unsupported(who() +
                         "ring-kv sends tokens as contiguous rows and needs a token "
                         "stride equal to head_dim (" +
                         std::to_string(D) + "), got " + std::to_string(local.stride_token));
    if (!tiled && quant && plan.total_tokens(r) > 0 && local.scale_stride_token != 1)
      return unsupported(who() +
                         "ring-kv sends scales as contiguous rows and needs a scale "
                         "token stride of 1, got " +
                         std::to_string(local.scale_stride_token));

    // Buffers sized for the longest shard that will arrive.
    int64_t max_len = 0;
    for (int o = 0; o < p; ++o)
      if (o != r) max_len = std::max(max_len, plan.max_len(o));
    const int nbuf = p >= 3 ? 2 : (p == 2 ? 1 : 0);
    const auto buf_bytes = tiled ? 0 : static_cast<std::size_t>(B * H * max_len * D) * es;
    const auto scale_bytes =
        quant && !tiled ? static_cast<std::size_t>(B * H * max_len) * sizeof(float) : 0;
    const std::size_t meta_bytes = shard_meta_bytes(B);
    std::size_t tile_bytes = 0;
    for (int i = 0; i < nbuf; ++i) {
      ShardBuffer& sb = bufs_[i];
      sb.max_len = max_len;
      TREEATTN_RETURN_IF_ERROR(ensure(sb.k, buf_bytes));
      TREEATTN_RETURN_IF_ERROR(ensure(sb.v, buf_bytes));
      TREEATTN_RETURN_IF_ERROR(ensure(sb.k_scale, scale_bytes));
      TREEATTN_RETURN_IF_ERROR(ensure(sb.v_scale, scale_bytes));
      TREEATTN_RETURN_IF_ERROR(ensure(sb.meta, meta_bytes));
      sb.meta_host.assign(static_cast<std::size_t>(3 * B + 1), 0);
      if (tiled) {
        TREEATTN_RETURN_IF_ERROR(ensure_tiles(sb, *local.tiled, max_len));
        tile_bytes += sb.tiles.bytes();
      }
    }
    TREEATTN_RETURN_IF_ERROR(ensure(partials_, static_cast<std::size_t>(p) * state_bytes()));
    TREEATTN_RETURN_IF_ERROR(ensure(piece_, state_bytes()));
    TREEATTN_RETURN_IF_ERROR(ensure(own_meta_, meta_bytes));
    note_buffers(tile_bytes + 2 * (buf_bytes + scale_bytes) * static_cast<std::size_t>(nbuf) +
                 static_cast<std::size_t>(p + 1) * state_bytes() +
                 static_cast<std::size_t>(nbuf + 1) * meta_bytes);

    // Metadata of our own shard.
    std::vector<int64_t> own(static_cast<std::size_t>(3 * B + 1), 0);
    for (int64_t b = 0; b < B; ++b) {
      own[static_cast<std::size_t>(b)] = local.len[static_cast<std::size_t>(b)];
      own[static_cast<std::size_t>(B + b)] = local.pos_start[static_cast<std::size_t>(b)];
      own[static_cast<std::size_t>(2 * B + b)] = local.total_len[static_cast<std::size_t>(b)];
    }
    own[static_cast<std::size_t>(3 * B)] = local.pos_stride;
    TREEATTN_RETURN_IF_ERROR(exec_->from_host(own_meta_.data(), own.data(), meta_bytes));

    const int next = (r + 1) % p, prev = (r + p - 1) % p;
    KVShard cur = local;
    const Buffer* cur_meta = &own_meta_;
    for (int k = 0; k < p; ++k) {
      const int origin = ((r - k) % p + p) % p;
      std::vector<CommRequest> reqs;
      ShardBuffer* nxt = nullptr;
      if (k + 1 < p) {
        nxt = &bufs_[k % 2];
        const int recv_origin = ((r - k - 1) % p + p) % p;
        // Receives first, then sends, in the same (meta, per (b, h): K, V, scales) order on
        // both sides, decided by the replicated plan.
        TREEATTN_RETURN_IF_ERROR(post_recv(*nxt, plan, recv_origin, prev, reqs, tiled));
        TREEATTN_RETURN_IF_ERROR(post_send(cur, *cur_meta, next, reqs));
      }
      TREEATTN_RETURN_IF_ERROR(compute(q, cur, partial(origin), reqs));
      TREEATTN_RETURN_IF_ERROR(comm_->wait_all(reqs));
      if (nxt) {
        const int recv_origin = ((r - k - 1) % p + p) % p;
        TREEATTN_RETURN_IF_ERROR(
            exec_->to_host(nxt->meta_host.data(), nxt->meta.data(), meta_bytes));
        TREEATTN_RETURN_IF_ERROR(check_meta(*nxt, plan, recv_origin));
        cur = tiled ? tiled_buffer_view(*nxt) : buffer_view(*nxt);
        cur_meta = &nxt->meta;
      }
    }
    if (!delivers_result(r)) return Status::ok();
    return merge_in_rank_order(partials_.as<float>(), p, out);
  }

 private:
  float* partial(int origin) {
    return partials_.as<float>() + static_cast<std::size_t>(origin) * state_floats();
  }

  std::size_t segment_bytes(int64_t len) const {
    return static_cast<std::size_t>(len * shape_.head_dim) * dtype_size(dtype_);
  }

  Status post_recv(ShardBuffer& buf, const ShardPlan& plan, int origin, int from,
                   std::vector<CommRequest>& reqs, bool tiled) {
    auto m = comm_->irecv(buf.meta.data(), buf.meta_host.size() * sizeof(int64_t), from, kTagMeta);
    TREEATTN_RETURN_IF_ERROR(m.status());
    reqs.push_back(*m);
    const int64_t H = shape_.kv_heads;
    const bool quant = dtype_is_quantized(dtype_);
    if (tiled) {
      const TiledKVShard t = buf.tiles.view({}, {}, {});
      for (int64_t b = 0; b < shape_.batch; ++b) {
        const int64_t n = tiles_for(plan.len(origin, b), t.tile_tokens);
        for (int64_t h = 0; n > 0 && h < H; ++h)
          for (const TileSpan& s : tile_spans(t, b, h, n, quant)) {
            // The receive buffer is ours (a view hands out const pointers).
            auto rq = comm_->irecv(const_cast<uint8_t*>(s.at), s.bytes, from, kTagData);
            TREEATTN_RETURN_IF_ERROR(rq.status());
            reqs.push_back(*rq);
          }
      }
      return Status::ok();
    }
    for (int64_t b = 0; b < shape_.batch; ++b) {
      const int64_t len = plan.len(origin, b);
      if (len == 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t slot = (b * H + h) * buf.max_len;
        const std::size_t off = segment_bytes(slot);
        for (const Buffer* dst : {&buf.k, &buf.v}) {
          auto rq = comm_->irecv(dst->as<uint8_t>() + off, segment_bytes(len), from, kTagData);
          TREEATTN_RETURN_IF_ERROR(rq.status());
          reqs.push_back(*rq);
        }
        if (!quant) continue;
        for (const Buffer* dst : {&buf.k_scale, &buf.v_scale}) {
          auto rq = comm_->irecv(dst->as<float>() + slot,
                                 static_cast<std::size_t>(len) * sizeof(float), from, kTagScale);
          TREEATTN_RETURN_IF_ERROR(rq.status());
          reqs.push_back(*rq);
        }
      }
    }
    return Status::ok();
  }

  Status post_send(const KVShard& kv, const Buffer& meta, int to, std::vector<CommRequest>& reqs) {
    const std::size_t meta_bytes = shard_meta_bytes(shape_.batch);
    auto m = comm_->isend(meta.data(), meta_bytes, to, kTagMeta);
    TREEATTN_RETURN_IF_ERROR(m.status());
    reqs.push_back(*m);
    const int64_t H = shape_.kv_heads;
    const std::size_t es = dtype_size(dtype_);
    const bool quant = dtype_is_quantized(dtype_);
    if (kv.tiled != nullptr) {
      const TiledKVShard& t = *kv.tiled;
      for (int64_t b = 0; b < shape_.batch; ++b) {
        const int64_t n = tiles_for(kv.len[static_cast<std::size_t>(b)], t.tile_tokens);
        for (int64_t h = 0; n > 0 && h < H; ++h)
          for (const TileSpan& s : tile_spans(t, b, h, n, quant)) {
            auto sq = comm_->isend(s.at, s.bytes, to, kTagData);
            TREEATTN_RETURN_IF_ERROR(sq.status());
            reqs.push_back(*sq);
          }
      }
      return Status::ok();
    }
    for (int64_t b = 0; b < shape_.batch; ++b) {
      const int64_t len = kv.len[static_cast<std::size_t>(b)];
      if (len == 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const auto off = static_cast<std::size_t>(b * kv.stride_batch + h * kv.stride_head) * es;
        for (const void* src : {kv.k, kv.v}) {
          auto sq = comm_->isend(static_cast<const uint8_t*>(src) + off, segment_bytes(len), to,
                                 kTagData);
          TREEATTN_RETURN_IF_ERROR(sq.status());
          reqs.push_back(*sq);
        }
        if (!quant) continue;
        const auto soff =
            static_cast<std::size_t>(b * kv.scale_stride_batch + h * kv.scale_stride_head);
        for (const float* src : {kv.k_scale, kv.v_scale}) {
          auto sq = comm_->isend(src + soff, static_cast<std::size_t>(len) * sizeof(float), to,
                                 kTagScale);
          TREEATTN_RETURN_IF_ERROR(sq.status());
          reqs.push_back(*sq);
        }
      }
    }
    return Status::ok();
  }

  Status check_meta(const ShardBuffer& buf, const ShardPlan& plan, int origin) const {
    const int64_t B = shape_.batch;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t got = buf.meta_host[static_cast<std::size_t>(b)];
      if (got != plan.len(origin, b))
        return {Code::kMismatch, who() + "ring-kv received the shard of rank " +
                                     std::to_string(origin) + " with " + std::to_string(got) +
                                     " tokens in batch row " + std::to_string(b) +
                                     ", but the plan says " + std::to_string(plan.len(origin, b))};
    }
    return Status::ok();
  }

  KVShard buffer_view(const ShardBuffer& buf) const {
    const auto B = static_cast<std::size_t>(shape_.batch);
    KVShard s;
    s.dtype = dtype_;
    s.memory = exec_->memory();
    s.k = buf.k.data();
    s.v = buf.v.data();
    s.stride_token = shape_.head_dim;
    s.stride_head = buf.max_len * shape_.head_dim;
    s.stride_batch = shape_.kv_heads * s.stride_head;
    if (dtype_is_quantized(dtype_)) {
      s.k_scale = buf.k_scale.as<float>();
      s.v_scale = buf.v_scale.as<float>();
      s.scale_stride_token = 1;
      s.scale_stride_head = buf.max_len;
      s.scale_stride_batch = shape_.kv_heads * buf.max_len;
    }
    const std::span<const int64_t> m(buf.meta_host);
    s.len = m.subspan(0, B);
    s.pos_start = m.subspan(B, B);
    s.total_len = m.subspan(2 * B, B);
    s.pos_stride = buf.meta_host[3 * B];
    return s;
  }

  // A tiled receive buffer of the local shard's geometry with room for max_len tokens.
  Status ensure_tiles(ShardBuffer& sb, const TiledKVShard& local, int64_t max_len) const {
    const AttnShape& have = sb.tiles.shape();
    if (sb.tiles.bytes() == 0 || sb.tiles.capacity() < max_len ||
        sb.tiles.tile_tokens() != local.tile_tokens || sb.tiles.dtype() != dtype_ ||
        have.batch != shape_.batch || have.kv_heads != shape_.kv_heads ||
        have.head_dim != shape_.head_dim) {
      auto c = TiledKVCache::create(shape_, dtype_, max_len, kKVTileLayout, local.tile_tokens);
      TREEATTN_RETURN_IF_ERROR(c.status());
      sb.tiles = std::move(*c);
    }
    const TiledKVShard t = sb.tiles.view({}, {}, {});
    if (t.tile_stride != local.tile_stride)
      return unsupported(who() + "ring-kv: the tiled shard's tile geometry (" +
                         std::to_string(local.tile_stride) +
                         " bytes per tile) is not the library's default; ring-kv sends tiles "
                         "into caches of the default geometry");
    return Status::ok();
  }

  KVShard tiled_buffer_view(ShardBuffer& buf) const {
    const auto B = static_cast<std::size_t>(shape_.batch);
    const std::span<const int64_t> m(buf.meta_host);
    buf.tiled_view = buf.tiles.view(m.subspan(0, B), m.subspan(B, B), m.subspan(2 * B, B),
                                    buf.meta_host[3 * B]);
    KVShard s;
    s.dtype = dtype_;
    s.memory = MemorySpace::kHost;
    s.len = buf.tiled_view.len;
    s.pos_start = buf.tiled_view.pos_start;
    s.total_len = buf.tiled_view.total_len;
    s.pos_stride = buf.tiled_view.pos_stride;
    s.tiled = &buf.tiled_view;
    return s;
  }

  // The partial of the query against kv, in pieces of token slots with transfers driven
  // between pieces. The cut depends only on the shard's lengths and each piece's split length is
  // fixed (shared_partial), so every rank computes the same partial of the same shard bit for
  // bit, whatever its device.
  Status compute(const float* q, const KVShard& kv, float* dst,
                 const std::vector<CommRequest>& reqs) {
    int64_t longest = 0;
    for (int64_t v : kv.len) longest = std::max(longest, v);
    int64_t piece = std::max(kMinPiece, (longest + kMaxPieces - 1) / kMaxPieces);
    if (kv.tiled != nullptr)  // whole tiles
      piece = tiles_for(piece, kv.tiled->tile_tokens) * kv.tiled->tile_tokens;
    if (longest <= piece) return shared_partial(q, kv, dst);
    TREEATTN_RETURN_IF_ERROR(exec_->set_empty(dst, records(), head_dim()));
    const auto B = static_cast<std::size_t>(shape_.batch);
    piece_len_.resize(B);
    piece_pos_.resize(B);
    const std::size_t es = dtype_size(kv.dtype);
    for (int64_t j0 = 0; j0 < longest; j0 += piece) {
      for (std::size_t b = 0; b < B; ++b) {
        piece_len_[b] = std::clamp<int64_t>(kv.len[b] - j0, 0, piece);
        piece_pos_[b] = kv.pos_start[b] + j0 * kv.pos_stride;
      }
      KVShard part = kv;
      if (kv.tiled != nullptr) {
        const TiledKVShard& t = *kv.tiled;
        const int64_t tile0 = j0 / t.tile_tokens;
        piece_tiled_ = t;
        piece_tiled_.k = static_cast<const uint8_t*>(t.k) + tile0 * t.tile_stride;
        piece_tiled_.v = static_cast<const uint8_t*>(t.v) + tile0 * t.tile_stride;
        if (t.k_scale) {
          piece_tiled_.k_scale = t.k_scale + tile0 * t.scale_tile_stride;
          piece_tiled_.v_scale = t.v_scale + tile0 * t.scale_tile_stride;
        }
        piece_tiled_.len = piece_len_;
        piece_tiled_.pos_start = piece_pos_;
        part.tiled = &piece_tiled_;
        part.len = piece_len_;
        part.pos_start = piece_pos_;
        TREEATTN_RETURN_IF_ERROR(shared_partial(q, part, piece_.as<float>()));
        TREEATTN_RETURN_IF_ERROR(exec_->merge(dst, piece_.as<float>(), records(), head_dim()));
        if (!reqs.empty()) TREEATTN_RETURN_IF_ERROR(comm_->test_all(reqs).status());
        continue;
      }
      const auto off = static_cast<std::size_t>(j0 * kv.stride_token) * es;
      part.k = static_cast<const uint8_t*>(kv.k) + off;
      part.v = static_cast<const uint8_t*>(kv.v) + off;
      if (kv.k_scale) {
        const auto soff = static_cast<std::size_t>(j0 * kv.scale_stride_token);
        part.k_scale = kv.k_scale + soff;
        part.v_scale = kv.v_scale + soff;
      }
      part.len = piece_len_;
      part.pos_start = piece_pos_;
      TREEATTN_RETURN_IF_ERROR(shared_partial(q, part, piece_.as<float>()));
      TREEATTN_RETURN_IF_ERROR(exec_->merge(dst, piece_.as<float>(), records(), head_dim()));
      if (!reqs.empty()) TREEATTN_RETURN_IF_ERROR(comm_->test_all(reqs).status());
    }
    return Status::ok();
  }

  ShardBuffer bufs_[2];
  Buffer own_meta_, partials_, piece_;
  std::vector<int64_t> piece_len_, piece_pos_;
  TiledKVShard piece_tiled_;  // compute(): one piece of a tiled shard
};

std::unique_ptr<Strategy> make_ring_kv(const StrategyOptions& o) {
  return std::make_unique<RingKV>(o);
}

CostEstimate analytic(const AnalyticInput& in) {
  const int p = in.p, rank = in.rank;
  const double P = p;
  double sent = 0;
  for (int k = 0; k + 1 < p; ++k) sent += in.kv_bytes(((rank - k) % p + p) % p);
  sent += (P - 1) * static_cast<double>(shard_meta_bytes(in.shape.batch));
  int64_t max_len = 0;
  for (int o = 0; o < p; ++o)
    if (o != rank) max_len = std::max(max_len, in.plan.max_len(o));
  const double buf = static_cast<double>(in.shape.batch * max_len) * in.kv_per_token;
  const int nbuf = p >= 3 ? 2 : (p == 2 ? 1 : 0);
  CostEstimate c;
  c.bytes_sent = sent;
  c.working_set_bytes = in.base_ws() + nbuf * buf + P * in.S;
  c.formula =
      "sent = sum of the p-1 KV shards forwarded (paper: 2btd per hop); "
      "ws = KV + q + S + (1 or 2) receive buffers + p S (paper eq. 8: 4btd + 2bd)";
  return c;
}

// The cost model: p-1 steps; in each, every rank
// sends the KV shard it holds to rank + 1 (nonblocking, progressed between pieces of the
// kernel) while computing attention on it. A step costs max(local, transfer); the last shard
// is computed after the loop, then the p partials are merged. Buffers: the own shard plus two
// receive buffers (one when p = 2) and p partial states.
Prediction model(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  const double loc = c.local_us(c.shard_tokens, c.p);
  double total = loc;
  if (c.p > 1) {
    cost::Round r;
    const double kv = c.kv_bytes(c.shard_tokens);
    for (int i = 0; i < c.p; ++i) r.push_back({i, (i + 1) % c.p, kv, false});
    const double k = c.p - 1;
    const double step_comm = c.call(c.n > 1) + sim.round(r, k);
    total += k * (c.oversubscribed() ? loc + step_comm : std::max(loc, step_comm));
    comm.calls = c.p - 1;
    comm.algorithm =
        std::to_string(c.p - 1) +
        " ring steps of KV(t) = " + std::to_string(static_cast<int64_t>(kv)) +
        (c.oversubscribed() ? " B, not overlapped (ranks > cores)" : " B, overlapped with compute");
  }
  // total >= p * loc, so the exposed communication is what is left over.
  const double local_all = loc * c.p;
  comm.us = total - local_all;
  const double merge = c.p > 1 ? c.merge_us(c.p) : 0.0;
  const double buffers = c.p >= 3 ? 2.0 : (c.p == 2 ? 1.0 : 0.0);
  return cost::finish(c, local_all + merge, comm, sim,
                      buffers * c.kv_bytes(c.shard_tokens) + (c.p > 1 ? c.p * c.state_bytes : 0.0));
}

// The receive buffers, each the size of a shard: two per rank (one at p = 2), i.e. two copies
// of the cache over the job.
double extra_kv_caches(int ranks) { return ranks >= 3 ? 2.0 : (ranks == 2 ? 1.0 : 0.0); }

}  // namespace

constinit const StrategyDescriptor kRingKVDescriptor{
    .info = {.name = "ring-kv",
             .summary = "KV shards rotate around the ring, overlapped with local attention",
             .reads_every_shard = true,
             .holds_every_state = true},
    .create = make_ring_kv,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = extra_kv_caches,
};

}  // namespace treeattn::strategies
