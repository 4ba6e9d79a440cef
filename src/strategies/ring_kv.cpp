// ring-kv: the baseline the paper measured against: the KV shards travel around the ring.
//
// The query is on every rank. In hop k = 0..p-1 rank r holds the shard that originated on rank
// o = (r - k) mod p (its own at k = 0). While it computes the partial state of the query
// against that shard, it sends the shard to rank r + 1 and receives shard (r - k - 1) mod p from
// rank r - 1 with non-blocking messages (no transfer after the last hop: p - 1 transfers, not
// the p of the paper's JAX loop). The computation is cut into pieces of at least 4096 tokens
// and the transfers are driven between pieces (Communicator::test_all), so a rendezvous
// transfer progresses while the kernel runs. After p hops every rank has all p partials and
// merges them in origin order 0..p-1, so every rank gets the same bits.
//
// A shard travels as one metadata message (per batch row: length, global position of the first
// token, context length; and the position stride) followed by one message per (batch row, KV
// head) for K and one for V. The positions travel with the data, so the causal limit for
// q_len > 1 is right on whichever rank computes the shard; the receiver checks the lengths
// against the replicated plan. Receive buffers are dense [batch][kv_heads][max_len][head_dim];
// two are needed when p >= 3 (one is forwarded while the next arrives), one when p = 2.
//
// Cost per rank and step: sends (p - 1) KV shards (2 t n_kv d_h s bytes each for t tokens per
// shard: the paper's V_ring, independent of p in total) and reads p shards from memory.
#include <algorithm>
#include <cstring>

#include "strategies/common.hpp"

namespace treeattn::strategies {
namespace {

constexpr int kTagMeta = 600;
constexpr int kTagData = 601;
constexpr int64_t kMinPiece = 4096;
constexpr int kMaxPieces = 8;

struct ShardBuffer {
  std::vector<uint8_t> k, v;
  std::vector<int64_t> meta;  // [len[B], pos_start[B], total_len[B], pos_stride]
  int64_t max_len = 0;        // token slots per (batch, head) in k and v
};

class RingKV final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "ring-kv"; }

  Status setup_more(const ShardPlan&) override {
    const int64_t last_tag = kTagData + 2 * shape_.batch * shape_.kv_heads;
    if (last_tag > comm_->max_tag())
      return unsupported(who() + "ring-kv needs message tags up to " + std::to_string(last_tag) +
                         " (2 x batch x kv_heads), the backend allows " +
                         std::to_string(comm_->max_tag()));
    return Status::ok();
  }

  Status step(const float* q, const KVShard& local, const ShardPlan& plan,
              StateBuffer& out) override {
    ensure_shape(out);
    const int p = comm_->size(), r = comm_->rank();
    const int64_t B = shape_.batch, H = shape_.kv_heads, D = shape_.head_dim;
    const std::size_t es = dtype_size(dtype_);
    if (local.dtype != dtype_)
      return invalid_argument(who() + "ring-kv: local shard dtype " +
                              std::string(dtype_name(local.dtype)) + " differs from the run's " +
                              std::string(dtype_name(dtype_)));
    if (plan.total_tokens(r) > 0 && local.stride_token != D)
      return unsupported(who() +
                         "ring-kv sends tokens as contiguous rows and needs a token "
                         "stride equal to head_dim (" +
                         std::to_string(D) + "), got " + std::to_string(local.stride_token));

    // Buffers sized for the longest shard that will arrive.
    int64_t max_len = 0;
    for (int o = 0; o < p; ++o)
      if (o != r) max_len = std::max(max_len, plan.max_len(o));
    const int nbuf = p >= 3 ? 2 : (p == 2 ? 1 : 0);
    const auto buf_bytes = static_cast<std::size_t>(B * H * max_len * D) * es;
    for (int i = 0; i < nbuf; ++i) {
      bufs_[i].max_len = max_len;
      bufs_[i].k.resize(buf_bytes);
      bufs_[i].v.resize(buf_bytes);
      bufs_[i].meta.resize(static_cast<std::size_t>(3 * B + 1));
    }
    partials_.resize(static_cast<std::size_t>(p) * state_floats());
    piece_.resize(state_floats());
    note_buffers(2 * buf_bytes * static_cast<std::size_t>(nbuf) +
                 (partials_.size() + piece_.size()) * sizeof(float) +
                 static_cast<std::size_t>(nbuf + 1) * bufs_[0].meta.size() * sizeof(int64_t));

    // Metadata of our own shard.
    own_meta_.assign(static_cast<std::size_t>(3 * B + 1), 0);
    for (int64_t b = 0; b < B; ++b) {
      own_meta_[static_cast<std::size_t>(b)] = local.len[static_cast<std::size_t>(b)];
      own_meta_[static_cast<std::size_t>(B + b)] = local.pos_start[static_cast<std::size_t>(b)];
      own_meta_[static_cast<std::size_t>(2 * B + b)] = local.total_len[static_cast<std::size_t>(b)];
    }
    own_meta_[static_cast<std::size_t>(3 * B)] = local.pos_stride;

    const int next = (r + 1) % p, prev = (r + p - 1) % p;
    KVShard cur = local;
    ShardBuffer* cur_buf = nullptr;
    for (int k = 0; k < p; ++k) {
      const int origin = ((r - k) % p + p) % p;
      std::vector<CommRequest> reqs;
      ShardBuffer* nxt = nullptr;
      if (k + 1 < p) {
        nxt = &bufs_[k % 2];
        const int recv_origin = ((r - k - 1) % p + p) % p;
        TREEATTN_RETURN_IF_ERROR(post_recv(*nxt, plan, recv_origin, prev, reqs));
        const std::vector<int64_t>& meta = cur_buf ? cur_buf->meta : own_meta_;
        TREEATTN_RETURN_IF_ERROR(post_send(cur, meta, next, reqs));
      }
      TREEATTN_RETURN_IF_ERROR(compute(q, cur, partial(origin), reqs));
      TREEATTN_RETURN_IF_ERROR(comm_->wait_all(reqs));
      if (nxt) {
        const int recv_origin = ((r - k - 1) % p + p) % p;
        TREEATTN_RETURN_IF_ERROR(check_meta(*nxt, plan, recv_origin));
        cur = buffer_view(*nxt);
        cur_buf = nxt;
      }
    }
    if (!delivers_result(r)) return Status::ok();
    merge_in_rank_order(partials_.data(), p, out.data());
    return Status::ok();
  }

 private:
  float* partial(int origin) {
    return partials_.data() + static_cast<std::size_t>(origin) * state_floats();
  }

  std::size_t segment_bytes(int64_t len) const {
    return static_cast<std::size_t>(len * shape_.head_dim) * dtype_size(dtype_);
  }

  Status post_recv(ShardBuffer& buf, const ShardPlan& plan, int origin, int from,
                   std::vector<CommRequest>& reqs) {
    auto m = comm_->irecv(buf.meta.data(), buf.meta.size() * sizeof(int64_t), from, kTagMeta);
    TREEATTN_RETURN_IF_ERROR(m.status());
    reqs.push_back(*m);
    const int64_t H = shape_.kv_heads;
    for (int64_t b = 0; b < shape_.batch; ++b) {
      const int64_t len = plan.len(origin, b);
      if (len == 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const std::size_t off = segment_bytes((b * H + h) * buf.max_len);
        const int tag = kTagData + static_cast<int>(2 * (b * H + h));
        auto rk = comm_->irecv(buf.k.data() + off, segment_bytes(len), from, tag);
        TREEATTN_RETURN_IF_ERROR(rk.status());
        auto rv = comm_->irecv(buf.v.data() + off, segment_bytes(len), from, tag + 1);
        TREEATTN_RETURN_IF_ERROR(rv.status());
        reqs.push_back(*rk);
        reqs.push_back(*rv);
      }
    }
    return Status::ok();
  }

  Status post_send(const KVShard& kv, const std::vector<int64_t>& meta, int to,
                   std::vector<CommRequest>& reqs) {
    auto m = comm_->isend(meta.data(), meta.size() * sizeof(int64_t), to, kTagMeta);
    TREEATTN_RETURN_IF_ERROR(m.status());
    reqs.push_back(*m);
    const int64_t H = shape_.kv_heads;
    const std::size_t es = dtype_size(dtype_);
    for (int64_t b = 0; b < shape_.batch; ++b) {
      const int64_t len = kv.len[static_cast<std::size_t>(b)];
      if (len == 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const auto off = static_cast<std::size_t>(b * kv.stride_batch + h * kv.stride_head) * es;
        const int tag = kTagData + static_cast<int>(2 * (b * H + h));
        auto sk =
            comm_->isend(static_cast<const uint8_t*>(kv.k) + off, segment_bytes(len), to, tag);
        TREEATTN_RETURN_IF_ERROR(sk.status());
        auto sv =
            comm_->isend(static_cast<const uint8_t*>(kv.v) + off, segment_bytes(len), to, tag + 1);
        TREEATTN_RETURN_IF_ERROR(sv.status());
        reqs.push_back(*sk);
        reqs.push_back(*sv);
      }
    }
    return Status::ok();
  }

  Status check_meta(const ShardBuffer& buf, const ShardPlan& plan, int origin) const {
    const int64_t B = shape_.batch;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t got = buf.meta[static_cast<std::size_t>(b)];
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
    s.k = buf.k.data();
    s.v = buf.v.data();
    s.stride_token = shape_.head_dim;
    s.stride_head = buf.max_len * shape_.head_dim;
    s.stride_batch = shape_.kv_heads * s.stride_head;
    const std::span<const int64_t> m(buf.meta);
    s.len = m.subspan(0, B);
    s.pos_start = m.subspan(B, B);
    s.total_len = m.subspan(2 * B, B);
    s.pos_stride = buf.meta[3 * B];
    return s;
  }

  // The partial of the query against kv, in pieces of token slots with transfers driven
  // between pieces. The cut depends only on the shard's lengths, so every rank computes the
  // same partial of the same shard bit for bit.
  Status compute(const float* q, const KVShard& kv, float* dst,
                 const std::vector<CommRequest>& reqs) {
    int64_t longest = 0;
    for (int64_t v : kv.len) longest = std::max(longest, v);
    const int64_t piece = std::max(kMinPiece, (longest + kMaxPieces - 1) / kMaxPieces);
    if (longest <= piece) return local_partial(q, kv, dst);
    for (std::size_t i = 0; i < records(); ++i) state_set_empty(dst + i * rec_floats(), head_dim());
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
      const auto off = static_cast<std::size_t>(j0 * kv.stride_token) * es;
      part.k = static_cast<const uint8_t*>(kv.k) + off;
      part.v = static_cast<const uint8_t*>(kv.v) + off;
      part.len = piece_len_;
      part.pos_start = piece_pos_;
      TREEATTN_RETURN_IF_ERROR(local_partial(q, part, piece_.data()));
      state_merge_n(dst, piece_.data(), records(), head_dim());
      if (!reqs.empty()) TREEATTN_RETURN_IF_ERROR(comm_->test_all(reqs).status());
    }
    return Status::ok();
  }

  ShardBuffer bufs_[2];
  std::vector<int64_t> own_meta_, piece_len_, piece_pos_;
  std::vector<float> partials_, piece_;
};

}  // namespace

std::unique_ptr<Strategy> make_ring_kv(const StrategyOptions& o) {
  return std::make_unique<RingKV>(o);
}

}  // namespace treeattn::strategies
