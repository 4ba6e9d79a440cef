// tree-det: the deterministic merge. Output and LSE are the same bits whatever the rank count,
// the (contiguous) placement and the kernel's thread count.
//
// Why the other strategies are not: each rank's partial state folds its own tokens, and the
// ranks' partials are merged along a tree whose shape follows the ranks; float rounding depends
// on both, so moving one token to another rank changes the last bits, and a model's greedy
// token can flip at a near-tie between runs on 2 and 4 ranks.
//
// The canonical computation, a function of the sequence alone:
//   1. Leaves: the sequence of each batch row is cut into chunks of kChunk tokens aligned on
//      global positions ([k C, (k + 1) C)); a leaf is the kernel's partial state of exactly one
//      chunk (Executor::partial_chunks: a single kernel work item per KV head and chunk, so
//      independent of the thread count and of where the chunk sits in memory).
//   2. Tree: a perfect binary tree over the chunk indices (padded with empty leaves to a power
//      of two); every node is merge(left, right), and the empty state is the identity bit for bit,
//      so the padding changes nothing.
// Distribution: chunk k belongs to the rank holding its first position. A chunk that runs past
// the end of that rank's tokens (at most one per rank and row) is completed with the tokens
// of the following ranks, sent to the owner (fewer than kChunk tokens per boundary). Each rank
// reduces the largest aligned subtrees inside its range of chunks (at most 2 log2(chunks) of
// them), all ranks all-gather these subtree roots, and every rank merges the top of the tree
// identically. The placement must be contiguous (even, uneven, explicit, single): with striped
// placement no rank holds a whole chunk, and the strategy says so.
//
// The tiled layout (kv_tiles.hpp): the leaves are the rows kernel's partials of the same chunks,
// so the bits do not depend on the layout either. The tokens a step reads are copied out of the
// tiles into rows, kGroup chunks at a time (a buffer of kGroup chunks, not a copy of the shard),
// and the boundary tokens are sent from such copies.
//
// Cost per step and rank: the kernel over its tokens (kChunk-token calls), the boundary tokens
// (< kChunk per rank and row, K and V, plus scales for quantized dtypes), and one all-gather of
// p x max-roots state blocks (a few state records per rank instead of tree's one allreduce).
//
// Message ordering (comm.hpp): boundary pieces are posted, on both sides, for senders in rank
// order, rows in order, then per KV head K, V (and their scales); the plan decides who sends
// what, so both sides post the same sequence.
#include <algorithm>
#include <cstring>

#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"
#include "treeattn/kv_tiles.hpp"

namespace treeattn::strategies {
namespace {

constexpr int64_t kChunk = 256;  // tokens per leaf, aligned on global positions
constexpr int64_t kGroup = 16;   // tiled layout: chunks copied into rows per kernel call
constexpr int kTagBoundary = 700;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The aligned dyadic blocks [lo, lo + size) tiling [k0, k1): the subtrees a rank reduces alone.
struct Block {
  int64_t lo = 0, size = 0;
};
std::vector<Block> dyadic_cover(int64_t k0, int64_t k1) {
  std::vector<Block> out;
  while (k0 < k1) {
    int64_t size = k0 == 0 ? int64_t{1} << 62 : (k0 & -k0);
    while (size > k1 - k0) size >>= 1;
    out.push_back({k0, size});
    k0 += size;
  }
  return out;
}

// Chunks [k0, k1) of row b whose first position rank r holds (contiguous placements).
struct OwnedChunks {
  int64_t k0 = 0, k1 = 0;
};
OwnedChunks owned_chunk_range(const ShardPlan& plan, int r, int64_t b) {
  const int64_t a = plan.pos_start(r, b), n = plan.len(r, b);
  if (n == 0) return {};
  return {ceil_div(a, kChunk), ceil_div(a + n, kChunk)};
}

// Subtree roots rank r sends (over all rows), and the most any rank sends (the all-gather's
// slot count).
std::size_t roots_of(const ShardPlan& plan, int r) {
  std::size_t n = 0;
  for (int64_t b = 0; b < plan.batch(); ++b) {
    const OwnedChunks c = owned_chunk_range(plan, r, b);
    n += dyadic_cover(c.k0, c.k1).size();
  }
  return n;
}
std::size_t max_roots(const ShardPlan& plan) {
  std::size_t m = 0;
  for (int r = 0; r < plan.ranks(); ++r) m = std::max(m, roots_of(plan, r));
  return std::max<std::size_t>(m, 1);
}

class TreeDet final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "tree-det"; }

  Status setup_more(const ShardPlan& plan) override { return check_plan(plan); }

  // The merge stage alone (the serving engine): the ranks' partials are the leaves, merged along
  // a perfect binary tree over the ranks, the shape of the top of run()'s tree. Batch invariant;
  // the bits do depend on the rank count here, since the leaves are whatever each rank computed
  // (run() builds rank-independent chunk leaves, which a merge of given partials cannot).
  bool merge_batch_invariant() const override { return true; }
  bool merge_local_supported(int) const override { return true; }
  Status merge_local(const float* const* parts, int p, std::size_t n, float* out) override {
    twin_.resize(static_cast<std::size_t>(p) * floats_of(n));
    for (int r = 0; r < p; ++r)
      std::copy(parts[r], parts[r] + floats_of(n), twin_.data() + r * floats_of(n));
    TREEATTN_RETURN_IF_ERROR(fold_binary_in_place(twin_.data(), p, n));
    std::copy(twin_.data(), twin_.data() + floats_of(n), out);
    return Status::ok();
  }

  Status merge_n(float* out, std::size_t n) override {
    const int p = comm_->size();
    if (p == 1) return Status::ok();
    const std::size_t bytes = static_cast<std::size_t>(p) * bytes_of(n);
    TREEATTN_RETURN_IF_ERROR(ensure(leaves_, bytes));
    note_buffers(bytes);
    TREEATTN_RETURN_IF_ERROR(comm_->allgather(out, bytes_of(n), leaves_.as<float>()));
    TREEATTN_RETURN_IF_ERROR(fold_binary_in_place(leaves_.as<float>(), p, n));
    return exec_->copy(out, leaves_.as<float>(), bytes_of(n));
  }

  Status run(const float* q, const KVShard& local, const ShardPlan& plan, float* out) override {
    TREEATTN_RETURN_IF_ERROR(check_plan(plan));
    const int p = comm_->size(), me = comm_->rank();
    const int64_t B = shape_.batch, Hkv = shape_.kv_heads, D = shape_.head_dim;
    const std::size_t D_ = head_dim(), row_recs = row_records(), row_floats = row_recs * rec_floats();
    const std::size_t es = dtype_size(dtype_);
    const bool quant = dtype_is_quantized(dtype_);

    // ---- 1. boundary tokens: the owner of a chunk that crosses into later ranks gets them.
    // Buffers: one chunk of KV per row [Hkv][kChunk][D] (and scales [Hkv][kChunk]).
    const auto chunk_bytes = static_cast<std::size_t>(Hkv * kChunk * D) * es;
    const auto chunk_scale_bytes = quant ? static_cast<std::size_t>(Hkv * kChunk) * sizeof(float) : 0;
    TREEATTN_RETURN_IF_ERROR(ensure(bk_, chunk_bytes * static_cast<std::size_t>(B)));
    TREEATTN_RETURN_IF_ERROR(ensure(bv_, chunk_bytes * static_cast<std::size_t>(B)));
    TREEATTN_RETURN_IF_ERROR(ensure(bks_, chunk_scale_bytes * static_cast<std::size_t>(B)));
    TREEATTN_RETURN_IF_ERROR(ensure(bvs_, chunk_scale_bytes * static_cast<std::size_t>(B)));
    std::vector<CommRequest> reqs;
    // Receives, senders in rank order (then rows, heads): pieces of my boundary chunk.
    for (int src = me + 1; src < p; ++src)
      for (int64_t b = 0; b < B; ++b) {
        const Piece pc = piece(plan, src, b);
        if (pc.len == 0 || pc.owner != me) continue;
        const int64_t at = pc.pos - pc.chunk * kChunk;  // slot inside the chunk
        for (int64_t h = 0; h < Hkv; ++h) {
          const std::size_t off = static_cast<std::size_t>(b) * chunk_bytes +
                                  static_cast<std::size_t>((h * kChunk + at) * D) * es;
          const std::size_t n = static_cast<std::size_t>(pc.len * D) * es;
          TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->irecv(bk_.as<uint8_t>() + off, n, src, kTagBoundary)));
          TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->irecv(bv_.as<uint8_t>() + off, n, src, kTagBoundary)));
          if (!quant) continue;
          const std::size_t soff = static_cast<std::size_t>(b) * chunk_scale_bytes +
                                   static_cast<std::size_t>(h * kChunk + at) * sizeof(float);
          const std::size_t sn = static_cast<std::size_t>(pc.len) * sizeof(float);
          TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->irecv(bks_.as<uint8_t>() + soff, sn, src, kTagBoundary)));
          TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->irecv(bvs_.as<uint8_t>() + soff, sn, src, kTagBoundary)));
        }
      }
    // Sends: my head tokens (before my first chunk start) to the owner of their chunk (on the
    // tiled layout from a rows copy per row, kept until the sends complete).
    if (local.tiled != nullptr && head_rows_.size() < static_cast<std::size_t>(B))
      head_rows_.resize(static_cast<std::size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      const Piece pc = piece(plan, me, b);
      if (pc.len == 0 || pc.owner == me) continue;
      auto rows = rows_of(local, b, 0, pc.len, head_rows_.empty() ? nullptr : &head_rows_[static_cast<std::size_t>(b)]);
      TREEATTN_RETURN_IF_ERROR(rows.status());
      const KVShard& src = rows->kv;
      for (int64_t h = 0; h < Hkv; ++h) {
        const auto off = static_cast<std::size_t>(rows->b * src.stride_batch + h * src.stride_head +
                                                  rows->slot0 * src.stride_token) * es;
        const std::size_t n = static_cast<std::size_t>(pc.len * D) * es;
        TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->isend(static_cast<const uint8_t*>(src.k) + off, n, pc.owner, kTagBoundary)));
        TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->isend(static_cast<const uint8_t*>(src.v) + off, n, pc.owner, kTagBoundary)));
        if (!quant) continue;
        const auto soff = static_cast<std::size_t>(rows->b * src.scale_stride_batch + h * src.scale_stride_head +
                                                   rows->slot0 * src.scale_stride_token);
        const std::size_t sn = static_cast<std::size_t>(pc.len) * sizeof(float);
        TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->isend(src.k_scale + soff, sn, pc.owner, kTagBoundary)));
        TREEATTN_RETURN_IF_ERROR(post(reqs, comm_->isend(src.v_scale + soff, sn, pc.owner, kTagBoundary)));
      }
    }
    // My own tokens of my boundary chunk go to the front of the buffer.
    for (int64_t b = 0; b < B; ++b) {
      const Range rg = owned_chunks(plan, me, b);
      if (rg.k1 <= rg.k0 || !crosses(plan, me, b, rg.k1 - 1)) continue;
      const int64_t first = (rg.k1 - 1) * kChunk - plan.pos_start(me, b);  // local slot
      const int64_t n = plan.pos_start(me, b) + plan.len(me, b) - (rg.k1 - 1) * kChunk;
      auto rows = rows_of(local, b, first, n, &tail_rows_);
      TREEATTN_RETURN_IF_ERROR(rows.status());
      const KVShard& src_kv = rows->kv;
      if (src_kv.stride_token != D)
        return unsupported(who() + "tree-det needs a token stride equal to head_dim");
      for (int64_t h = 0; h < Hkv; ++h) {
        const auto src = static_cast<std::size_t>(rows->b * src_kv.stride_batch + h * src_kv.stride_head +
                                                  rows->slot0 * src_kv.stride_token) * es;
        const std::size_t dst = static_cast<std::size_t>(b) * chunk_bytes +
                                static_cast<std::size_t>(h * kChunk * D) * es;
        const std::size_t bytes = static_cast<std::size_t>(n * D) * es;
        TREEATTN_RETURN_IF_ERROR(exec_->copy(bk_.as<uint8_t>() + dst, static_cast<const uint8_t*>(src_kv.k) + src, bytes));
        TREEATTN_RETURN_IF_ERROR(exec_->copy(bv_.as<uint8_t>() + dst, static_cast<const uint8_t*>(src_kv.v) + src, bytes));
        if (!quant) continue;
        const auto ssrc = static_cast<std::size_t>(rows->b * src_kv.scale_stride_batch + h * src_kv.scale_stride_head +
                                                   rows->slot0 * src_kv.scale_stride_token);
        const std::size_t sdst = static_cast<std::size_t>(b) * chunk_scale_bytes +
                                 static_cast<std::size_t>(h * kChunk) * sizeof(float);
        TREEATTN_RETURN_IF_ERROR(exec_->copy(bks_.as<uint8_t>() + sdst, src_kv.k_scale + ssrc, static_cast<std::size_t>(n) * sizeof(float)));
        TREEATTN_RETURN_IF_ERROR(exec_->copy(bvs_.as<uint8_t>() + sdst, src_kv.v_scale + ssrc, static_cast<std::size_t>(n) * sizeof(float)));
      }
    }
    TREEATTN_RETURN_IF_ERROR(comm_->wait_all(reqs));

    // ---- 2. leaves and this rank's subtrees, per row.
    // Root slots: every rank's blocks are known from the plan; slot counts padded to the max.
    std::vector<std::vector<std::vector<Block>>> blocks(static_cast<std::size_t>(p));
    std::size_t max_roots = 0;
    for (int r = 0; r < p; ++r) {
      std::size_t n = 0;
      for (int64_t b = 0; b < B; ++b) {
        const Range rg = owned_chunks(plan, r, b);
        blocks[static_cast<std::size_t>(r)].push_back(dyadic_cover(rg.k0, rg.k1));
        n += blocks[static_cast<std::size_t>(r)].back().size();
      }
      max_roots = std::max(max_roots, n);
    }
    const std::size_t slot_floats = row_floats;  // one root: the records of one row
    const std::size_t mine_floats = std::max<std::size_t>(1, max_roots) * slot_floats;
    TREEATTN_RETURN_IF_ERROR(ensure(roots_, mine_floats * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(ensure(all_roots_, static_cast<std::size_t>(p) * mine_floats * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(exec_->set_empty(roots_.as<float>(), std::max<std::size_t>(1, max_roots) * row_recs, D_));

    std::size_t slot = 0;
    for (int64_t b = 0; b < B; ++b) {
      const auto& mine = blocks[static_cast<std::size_t>(me)][static_cast<std::size_t>(b)];
      if (mine.empty()) continue;
      const Range rg = owned_chunks(plan, me, b);
      const auto n_leaves = static_cast<std::size_t>(rg.k1 - rg.k0);
      TREEATTN_RETURN_IF_ERROR(ensure(leaves_, n_leaves * slot_floats * sizeof(float)));
      std::size_t copies = copy_bytes(tail_rows_) + copy_bytes(group_rows_);
      for (const RowsCopy& c : head_rows_) copies += copy_bytes(c);
      note_buffers(bk_.bytes() + bv_.bytes() + bks_.bytes() + bvs_.bytes() + roots_.bytes() +
                   all_roots_.bytes() + leaves_.bytes() + copies);
      TREEATTN_RETURN_IF_ERROR(leaves(q, local, plan, b, rg, leaves_.as<float>()));
      // Each aligned block reduced in place along the canonical tree: at width w, leaf i absorbs
      // leaf i + w/2 for i a multiple of w (the perfect binary tree over the block).
      for (const Block& blk : mine) {
        float* base = leaves_.as<float>() + static_cast<std::size_t>(blk.lo - rg.k0) * slot_floats;
        for (int64_t w = 2; w <= blk.size; w *= 2)
          for (int64_t i = 0; i < blk.size; i += w)
            TREEATTN_RETURN_IF_ERROR(exec_->merge(base + static_cast<std::size_t>(i) * slot_floats,
                                                  base + static_cast<std::size_t>(i + w / 2) * slot_floats,
                                                  row_recs, D_));
        TREEATTN_RETURN_IF_ERROR(exec_->copy(roots_.as<float>() + slot++ * slot_floats, base,
                                             slot_floats * sizeof(float)));
      }
    }

    // ---- 3. all ranks' roots everywhere, and the top of the tree merged identically.
    TREEATTN_RETURN_IF_ERROR(comm_->allgather(roots_.as<float>(), mine_floats * sizeof(float),
                                              all_roots_.as<float>()));
    for (int64_t b = 0; b < B; ++b) {
      // Where each block root of row b sits in the gathered buffer.
      std::vector<std::pair<Block, const float*>> found;
      for (int r = 0; r < p; ++r) {
        std::size_t s = 0;
        for (int64_t bb = 0; bb < B; ++bb)
          for (const Block& blk : blocks[static_cast<std::size_t>(r)][static_cast<std::size_t>(bb)]) {
            if (bb == b)
              found.push_back({blk, all_roots_.as<float>() + static_cast<std::size_t>(r) * mine_floats + s * slot_floats});
            ++s;
          }
      }
      const int64_t chunks = ceil_div(plan.total_len(b), kChunk);
      int64_t top = 1;
      while (top < chunks) top <<= 1;
      float* dst = out + static_cast<std::size_t>(b) * row_floats;
      TREEATTN_RETURN_IF_ERROR(top_of_tree(found, 0, chunks == 0 ? 0 : top, dst));
    }
    return Status::ok();
  }

 private:
  struct Range {
    int64_t k0 = 0, k1 = 0;  // owned chunks [k0, k1)
  };
  // A rank's head tokens that belong to a chunk owned by an earlier rank.
  struct Piece {
    int owner = -1;
    int64_t chunk = 0, pos = 0, len = 0;
  };

  std::size_t row_records() const {
    return static_cast<std::size_t>(shape_.q_len * shape_.heads);
  }

  Status check_plan(const ShardPlan& plan) const {
    if (plan.pos_stride() != 1)
      return unsupported(who() + "tree-det needs a contiguous placement (even, uneven, explicit "
                                 "or single), got " + plan.to_string() +
                         ": with striped placement no rank holds a whole chunk of " +
                         std::to_string(kChunk) + " tokens");
    return Status::ok();
  }

  static Status post(std::vector<CommRequest>& reqs, Result<CommRequest> r) {
    TREEATTN_RETURN_IF_ERROR(r.status());
    reqs.push_back(*r);
    return Status::ok();
  }

  // Chunks whose first position rank r holds, in row b.
  static Range owned_chunks(const ShardPlan& plan, int r, int64_t b) {
    const OwnedChunks c = owned_chunk_range(plan, r, b);
    return {c.k0, c.k1};
  }
  // Whether chunk k (owned by r) extends past the end of r's tokens.
  static bool crosses(const ShardPlan& plan, int r, int64_t b, int64_t k) {
    const int64_t end = std::min((k + 1) * kChunk, plan.total_len(b));
    return end > plan.pos_start(r, b) + plan.len(r, b);
  }
  // Rank r's tokens before its first chunk start (they complete an earlier rank's chunk).
  static Piece piece(const ShardPlan& plan, int r, int64_t b) {
    Piece pc;
    const int64_t a = plan.pos_start(r, b), n = plan.len(r, b);
    if (n == 0 || a % kChunk == 0) return pc;
    pc.chunk = a / kChunk;
    pc.pos = a;
    pc.len = std::min(n, (pc.chunk + 1) * kChunk - a);
    pc.owner = plan.owner(b, pc.chunk * kChunk);
    return pc;
  }

  // The leaves of row b's owned chunks [rg.k0, rg.k1), one row of records each, into dst: the
  // chunks inside this rank's tokens in one partial_chunks call over a view starting at the
  // first chunk's position (aligned), the chunk that crosses into later ranks (if any) from the
  // assembled boundary buffer.
  Status leaves(const float* q, const KVShard& local, const ShardPlan& plan, int64_t b,
                const Range& rg, float* dst) {
    const int me = comm_->rank();
    const std::size_t es = dtype_size(dtype_);
    const bool quant = dtype_is_quantized(dtype_);
    const int64_t N = plan.total_len(b);
    const bool boundary = crosses(plan, me, b, rg.k1 - 1);
    const int64_t inner_end = boundary ? rg.k1 - 1 : rg.k1;  // chunks [k0, inner_end) are local
    AttnShape one = shape_;
    one.batch = 1;
    const float* qb = q + static_cast<std::size_t>(b * shape_.q_len * shape_.heads * shape_.head_dim);
    const std::size_t slot_floats = row_records() * rec_floats();
    leaf_total_ = {N};
    if (inner_end > rg.k0 && local.tiled != nullptr) {
      // Tiles: kGroup chunks at a time copied into rows, the same partials chunk by chunk.
      for (int64_t k0 = rg.k0; k0 < inner_end; k0 += kGroup) {
        const int64_t k1 = std::min(inner_end, k0 + kGroup);
        const int64_t start = k0 * kChunk, end = std::min(k1 * kChunk, N);
        auto rows = rows_of(local, b, start - plan.pos_start(me, b), end - start, &group_rows_);
        TREEATTN_RETURN_IF_ERROR(rows.status());
        KVShard v = rows->kv;
        as_leaf(v, start, end);
        TREEATTN_RETURN_IF_ERROR(exec_->partial_chunks(
            one, qb, v, kChunk, dst + static_cast<std::size_t>(k0 - rg.k0) * slot_floats,
            options_.kernel));
      }
    } else if (inner_end > rg.k0) {
      const int64_t start = rg.k0 * kChunk;
      const int64_t end = std::min(inner_end * kChunk, N);
      const int64_t slot = start - plan.pos_start(me, b);
      KVShard v = local;
      as_leaf(v, start, end);
      const auto off = static_cast<std::size_t>(b * local.stride_batch + slot * local.stride_token) * es;
      v.k = static_cast<const uint8_t*>(local.k) + off;
      v.v = static_cast<const uint8_t*>(local.v) + off;
      if (quant) {
        const auto soff = static_cast<std::size_t>(b * local.scale_stride_batch + slot * local.scale_stride_token);
        v.k_scale = local.k_scale + soff;
        v.v_scale = local.v_scale + soff;
      }
      TREEATTN_RETURN_IF_ERROR(exec_->partial_chunks(one, qb, v, kChunk, dst, options_.kernel));
    }
    if (!boundary) return Status::ok();
    const int64_t start = (rg.k1 - 1) * kChunk;
    KVShard v;
    v.dtype = dtype_;
    v.memory = local.memory;
    as_leaf(v, start, std::min(start + kChunk, N));
    const auto chunk_bytes = static_cast<std::size_t>(shape_.kv_heads * kChunk * shape_.head_dim) * es;
    v.k = bk_.as<uint8_t>() + static_cast<std::size_t>(b) * chunk_bytes;
    v.v = bv_.as<uint8_t>() + static_cast<std::size_t>(b) * chunk_bytes;
    v.stride_token = shape_.head_dim;
    v.stride_head = kChunk * shape_.head_dim;
    v.stride_batch = shape_.kv_heads * v.stride_head;
    if (quant) {
      const auto sb = static_cast<std::size_t>(shape_.kv_heads * kChunk);
      v.k_scale = bks_.as<float>() + static_cast<std::size_t>(b) * sb;
      v.v_scale = bvs_.as<float>() + static_cast<std::size_t>(b) * sb;
      v.scale_stride_token = 1;
      v.scale_stride_head = kChunk;
      v.scale_stride_batch = static_cast<int64_t>(sb);
    }
    float* last = dst + static_cast<std::size_t>(rg.k1 - 1 - rg.k0) * slot_floats;
    return exec_->partial_chunks(one, qb, v, kChunk, last, options_.kernel);
  }

  // Rows of one batch row copied out of a tiled shard: K and V [kv_heads][n][head_dim] (the
  // dtype's codes), and for quantized dtypes their scales [kv_heads][n] (the tiles' bfloat16
  // scales widened to the rows layout's float32, exactly).
  struct RowsCopy {
    Buffer k, v, k_scale, v_scale;
  };
  static std::size_t copy_bytes(const RowsCopy& c) {
    return c.k.bytes() + c.v.bytes() + c.k_scale.bytes() + c.v_scale.bytes();
  }
  // Slots [slot0, slot0 + n) of row b of `local` as rows: the shard itself on the rows layout
  // (row b, starting at slot0), a copy into `copy` on the tiled layout (its row 0, slot 0).
  struct RowsView {
    KVShard kv;
    int64_t b = 0, slot0 = 0;
  };
  Result<RowsView> rows_of(const KVShard& local, int64_t b, int64_t slot0, int64_t n,
                           RowsCopy* copy) {
    if (local.tiled == nullptr) return RowsView{local, b, slot0};
    const TiledKVShard& t = *local.tiled;
    const int64_t H = shape_.kv_heads, D = shape_.head_dim, T = t.tile_tokens;
    const std::size_t es = dtype_size(dtype_);
    const bool quant = dtype_is_quantized(dtype_);
    const auto n_elems = static_cast<std::size_t>(H * std::max<int64_t>(n, 1) * D);
    TREEATTN_RETURN_IF_ERROR(ensure(copy->k, n_elems * es));
    TREEATTN_RETURN_IF_ERROR(ensure(copy->v, n_elems * es));
    const auto n_scales = quant ? static_cast<std::size_t>(H * std::max<int64_t>(n, 1)) : 0;
    TREEATTN_RETURN_IF_ERROR(ensure(copy->k_scale, n_scales * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(ensure(copy->v_scale, n_scales * sizeof(float)));
    auto* kd = copy->k.as<uint8_t>();
    auto* vd = copy->v.as<uint8_t>();
    const auto* ks = static_cast<const uint8_t*>(t.k);
    const auto* vs = static_cast<const uint8_t*>(t.v);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = slot0 + j, tile = slot / T, l = slot % T;
        const int64_t base = b * t.batch_stride + h * t.head_stride + tile * t.tile_stride;
        kv_tile_get_k(ks + base, T, D, l, kd + static_cast<std::size_t>((h * n + j) * D) * es, es);
        kv_tile_get_v(vs + base, T, D, l, vd + static_cast<std::size_t>((h * n + j) * D) * es, es);
        if (!quant) continue;
        const int64_t s = b * t.scale_batch_stride + h * t.scale_head_stride +
                          tile * t.scale_tile_stride + l;
        copy->k_scale.as<float>()[h * n + j] = bf16_value(t.k_scale[s]);  // exact widening
        copy->v_scale.as<float>()[h * n + j] = bf16_value(t.v_scale[s]);
      }
    RowsView r;
    r.kv.dtype = dtype_;
    r.kv.memory = MemorySpace::kHost;
    r.kv.k = kd;
    r.kv.v = vd;
    r.kv.stride_token = D;
    r.kv.stride_head = n * D;
    r.kv.stride_batch = H * n * D;
    if (quant) {
      r.kv.k_scale = copy->k_scale.as<float>();
      r.kv.v_scale = copy->v_scale.as<float>();
      r.kv.scale_stride_token = 1;
      r.kv.scale_stride_head = n;
      r.kv.scale_stride_batch = H * n;
    }
    return r;
  }

  // Node [lo, lo + size) of the canonical tree from the ranks' subtree roots.
  Status top_of_tree(const std::vector<std::pair<Block, const float*>>& found, int64_t lo,
                     int64_t size, float* dst) {
    const std::size_t n = row_records(), floats = n * rec_floats();
    if (size == 0) return exec_->set_empty(dst, n, head_dim());
    for (const auto& [blk, data] : found)
      if (blk.lo == lo && blk.size == size) return exec_->copy(dst, data, floats * sizeof(float));
    int64_t covered_end = 0;  // is anything of [lo, lo + size) present? (padding is empty)
    for (const auto& [blk, data] : found)
      if (blk.lo < lo + size && blk.lo + blk.size > lo) covered_end = 1;
    if (!covered_end || size == 1) return exec_->set_empty(dst, n, head_dim());
    TREEATTN_RETURN_IF_ERROR(top_of_tree(found, lo, size / 2, dst));
    auto r = exec_->allocate(floats * sizeof(float));
    TREEATTN_RETURN_IF_ERROR(r.status());
    Buffer right = std::move(*r);
    TREEATTN_RETURN_IF_ERROR(top_of_tree(found, lo + size / 2, size / 2, right.as<float>()));
    return exec_->merge(dst, right.as<float>(), n, head_dim());
  }

  Buffer bk_, bv_, bks_, bvs_, roots_, all_roots_, leaves_;
  std::vector<float> twin_;  // merge_local's leaves
  std::vector<RowsCopy> head_rows_;  // tiled layout: the head tokens sent, per row
  RowsCopy tail_rows_, group_rows_;  // tiled layout: a boundary chunk's own part, kGroup chunks
  std::vector<int64_t> leaf_len_, leaf_pos_, leaf_total_;

  // v reads tokens [start, end) of the sequence (leaf_total_ long) as one row of consecutive
  // positions; its spans are leaf_len_ / leaf_pos_, valid until the next call.
  void as_leaf(KVShard& v, int64_t start, int64_t end) {
    leaf_len_ = {end - start};
    leaf_pos_ = {start};
    v.len = leaf_len_;
    v.pos_start = leaf_pos_;
    v.total_len = leaf_total_;
    v.pos_stride = 1;
  }
};

std::unique_ptr<Strategy> make_tree_det(const StrategyOptions& o) {
  return std::make_unique<TreeDet>(o);
}

// Bytes rank r sends in one step: its head tokens to an earlier chunk owner, and its slots
// of the all-gather of subtree roots (a ring all-gather: p - 1 slots of the padded size).
CostEstimate analytic(const AnalyticInput& in) {
  const ShardPlan& plan = in.plan;
  const double row_S = in.S / static_cast<double>(std::max<int64_t>(1, in.shape.batch));
  const double roots = static_cast<double>(max_roots(plan));
  double boundary = 0;
  for (int64_t b = 0; b < plan.batch(); ++b) {
    const int64_t a = plan.pos_start(in.rank, b), n = plan.len(in.rank, b);
    if (n == 0 || a % kChunk == 0) continue;
    boundary += static_cast<double>(std::min(n, (a / kChunk + 1) * kChunk - a)) * in.kv_per_token;
  }
  int64_t leaves = 0;
  for (int64_t b = 0; b < plan.batch(); ++b) {
    const OwnedChunks c = owned_chunk_range(plan, in.rank, b);
    leaves = std::max(leaves, c.k1 - c.k0);
  }
  const double chunk_buffers = 2.0 * static_cast<double>(in.shape.batch * kChunk) * in.kv_per_token / 2.0;
  CostEstimate c;
  c.bytes_sent = in.p == 1 ? 0.0 : boundary + (in.p - 1.0) * roots * row_S;
  c.working_set_bytes = in.base_ws() + chunk_buffers + (in.p + 1.0) * roots * row_S +
                        static_cast<double>(leaves) * row_S;
  c.formula = "sent = head tokens before the first chunk start (< 256 per row) + (p-1) R S_row "
              "(all-gather of R subtree roots); ws = KV + q + S + boundary chunk + (p+1) R S_row "
              "+ leaves";
  return c;
}

// The cost model: the local kernel over the shard plus merging its chunk leaves, then one
// all-gather of R subtree roots per rank (R = 1 on an even split of aligned chunks); the boundary
// tokens (< 256 per rank and row) are left out.
Prediction model(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  const double rows = static_cast<double>(std::max<int64_t>(1, c.shape.batch));
  const double chunks = std::ceil(static_cast<double>(c.shard_tokens) / kChunk);
  const double roots = c.p > 1 ? std::max(1.0, std::ceil(std::log2(std::max(1.0, chunks))) / 2.0)
                               : 1.0;
  const double payload = c.state_bytes * roots;
  if (c.p > 1) {
    if (c.nccl()) {
      const cost::ClosedForm f = cost::nccl_allgather(c.topo, c.p, c.r, payload);
      sim.add_sent_all(f.bytes_per_rank);
      sim.add_rounds(f.hops);
      comm.add(c.call(c.n > 1) + f.us, "NCCL ring allgather of subtree roots");
    } else {
      std::string algo;
      const double t = cost::mpi_allgather(sim, payload, algo);
      comm.add(c.call(c.n > 1) + t, "allgather of subtree roots " + algo);
    }
  }
  const double local = c.local_us(c.shard_tokens, c.p) + c.merge_us(chunks / rows) +
                       (c.p > 1 ? c.merge_us(static_cast<double>(c.p) * roots) : 0.0);
  return cost::finish(c, local, comm, sim, static_cast<double>(c.p) * payload);
}

}  // namespace

constinit const StrategyDescriptor kTreeDetDescriptor{
    .info = {.name = "tree-det",
             .summary = "deterministic: the same bits for any rank count, placement and thread "
                        "count (canonical tree over 256-token chunks)",
             .placement = PlacementNeed::kContiguous,
             .holds_every_state = true,
             .rank_count_invariant = true,
             .merges_states = true,
             .listed = false},
    .create = make_tree_det,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = no_extra_kv,
};


}  // namespace treeattn::strategies
