// The plain arithmetic of the CUDA split-KV decode kernel: launch geometry, split planning, the
// causal limit, and how a thread block's index and a thread's lane map onto tokens, heads,
// query rows and state records. No CUDA headers: everything here is TREEATTN_HD (host and
// device) or host-only planning, and the host unit tests (tests/cuda/test_cuda_geometry.cpp)
// check every formula that the kernel (decode_kernel.cuh) and the executor (cuda_executor.cpp)
// use, on a machine without a GPU.
//
// Vocabulary (the kernel's variable names):
//   item     one thread block (CTA): one batch row b, one KV head kvh, one row group rg and one
//            split s. blockIdx.x = s + splits * (rg + row_groups * (kvh + kv_heads * bl)), where
//            bl is b's index inside the launch (a launch covers at most kMaxBatchPerLaunch rows,
//            whose lengths travel in the kernel parameters).
//   rows     the query rows of one KV head: G query heads x Q query positions, row r = i * G + g
//            for query i and head kvh * G + g (grouped-query attention: the KV head's tokens are
//            read once for all its rows). A CTA serves up to kMaxRowsPerCta rows (a row group);
//            its compile-time row count is rows_template(rows), the next of 1, 2, 4, 8.
//   split    the token slots [s * chunk, (s + 1) * chunk) of the row; every CTA writes one state
//            record per row to split s's record array (empty when it sees no token), and the
//            merge kernel folds the splits in order 0..splits-1 with state_merge.
//   lanes    a warp reads kVecBytes-wide pieces of kTokensPerWarp tokens at once: lane l works
//            on token slot l / lanes_per_token and the head_dim elements
//            [(l % lanes_per_token) * vec, + vec). A "token group" (one slot of one warp) keeps its
//            own online-softmax state; groups are merged at the end of the item.
//   visible  query i of a row with N context tokens sees global positions p <= N - Q + i;
//            local slot j sits at pos_start + j * pos_stride, so it sees slots j < visible_count.
//
// The split plan depends only on the shape, the lengths and DecodeOptions::chunk_tokens, never on
// the GPU (SM count): the same inputs give the same bits on every device, which ring-kv needs
// (every rank computes the partial of every shard and the results must agree).
#pragma once

#include <cstdint>

#include "treeattn/dtype.hpp"
#include "treeattn/state.hpp"  // TREEATTN_HD

namespace treeattn::gpu {

inline constexpr int kWarpSize = 32;
inline constexpr int kDecodeWarps = 4;
inline constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
inline constexpr int kMaxRowsPerCta = 8;
// Batch rows whose (len, pos_start, total_len) fit in one launch's kernel parameters
// (3 * 8 * 64 = 1536 bytes, well inside the 4 KiB every CUDA version accepts).
inline constexpr int kMaxBatchPerLaunch = 64;
// The planner aims at this many thread blocks per call (a few waves on a 132-SM H100/H200 at
// 3-4 resident blocks per SM), and never makes a split shorter than kMinSplitTokens.
inline constexpr int64_t kTargetCtas = 2048;
inline constexpr int64_t kMinSplitTokens = 256;
inline constexpr int64_t kSplitAlign = 64;  // split lengths are multiples of this
static_assert(kMinSplitTokens % kSplitAlign == 0);
inline constexpr int64_t kMaxSplits = 1024;
// Head dims with a compiled CUDA kernel.
inline constexpr int kCudaHeadDims[] = {64, 128};

// ---- per-dtype lane geometry -------------------------------------------------------------------

// Elements one lane loads per token and tensor: 16 bytes of f32 / f16 / bf16, 8 bytes of fp8 /
// int8 (eight codes, so that the registers per lane stay those of the 16-bit types).
TREEATTN_HD constexpr int vec_elems(DType t) { return t == DType::kF32 ? 4 : 8; }
TREEATTN_HD constexpr int elem_bytes(DType t) {
  return t == DType::kF32 ? 4 : (t == DType::kFP8 || t == DType::kInt8) ? 1 : 2;
}
TREEATTN_HD constexpr int vec_bytes(DType t) { return vec_elems(t) * elem_bytes(t); }
TREEATTN_HD constexpr int lanes_per_token(DType t, int head_dim) { return head_dim / vec_elems(t); }
TREEATTN_HD constexpr int tokens_per_warp(DType t, int head_dim) {
  return kWarpSize / lanes_per_token(t, head_dim);
}
// Token groups per CTA (each with its own online-softmax state).
TREEATTN_HD constexpr int token_groups(DType t, int head_dim) {
  return kDecodeWarps * tokens_per_warp(t, head_dim);
}
// Tokens each group loads per loop iteration (more loads in flight; fewer for 8 rows, whose
// registers are the limit).
TREEATTN_HD constexpr int unroll_tokens(int rows_tpl) { return rows_tpl >= 8 ? 2 : 4; }

// Whether the lane geometry works for this dtype and head dim: a token's head_dim elements are a
// whole number of vectors and a warp holds a whole number of tokens.
TREEATTN_HD constexpr bool geometry_valid(DType t, int head_dim) {
  const int v = vec_elems(t);
  if (head_dim <= 0 || head_dim % v != 0) return false;
  const int lanes = head_dim / v;
  return lanes >= 1 && lanes <= kWarpSize && kWarpSize % lanes == 0;
}

// ---- query rows ------------------------------------------------------------------------------

// The compile-time row count of a CTA serving `rows` rows (rows >= 1): 1, 2, 4 or 8.
TREEATTN_HD constexpr int rows_template(int64_t rows) {
  return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
}

struct RowSplit {
  int64_t rows_total = 0;  // G * Q
  int rows_tpl = 1;        // rows per CTA (template value)
  int64_t row_groups = 1;  // ceil(rows_total / rows_tpl)
};
TREEATTN_HD constexpr RowSplit split_rows(int64_t group, int64_t q_len) {
  RowSplit s;
  s.rows_total = group * q_len;
  s.rows_tpl = rows_template(s.rows_total < kMaxRowsPerCta ? s.rows_total : kMaxRowsPerCta);
  s.row_groups = (s.rows_total + s.rows_tpl - 1) / s.rows_tpl;
  return s;
}

// Row r (0 <= r < G * Q) of KV head kvh: its query position and query head.
struct RowTarget {
  int64_t query = 0;  // i
  int64_t head = 0;   // query head kvh * G + g
};
TREEATTN_HD constexpr RowTarget row_target(int64_t r, int64_t group, int64_t kvh) {
  return {r / group, kvh * group + r % group};
}

// Index of the state record of (batch row b, query i, head h) in [batch][query][head] order.
TREEATTN_HD constexpr int64_t record_index(int64_t b, int64_t i, int64_t h, int64_t q_len,
                                           int64_t heads) {
  return (b * q_len + i) * heads + h;
}

// ---- the causal limit -------------------------------------------------------------------------

// Number of leading local slots of a row that query i (0 <= i < q_len) may see: slot j sits at
// global position pos_start + j * pos_stride and is visible iff that is <= total_len - q_len + i.
TREEATTN_HD constexpr int64_t visible_count(int64_t len, int64_t pos_start, int64_t total_len,
                                            int64_t pos_stride, int64_t q_len, int64_t i) {
  const int64_t last = total_len - q_len + i;  // the last visible global position
  if (len <= 0 || last < pos_start) return 0;
  const int64_t n = (last - pos_start) / pos_stride + 1;
  return n < len ? n : len;
}

// ---- thread blocks -----------------------------------------------------------------------------

struct ItemIndex {
  int64_t split = 0;
  int64_t row_group = 0;
  int64_t kv_head = 0;
  int64_t batch_in_launch = 0;
};
TREEATTN_HD constexpr ItemIndex decode_item(int64_t block, int64_t splits, int64_t row_groups,
                                            int64_t kv_heads) {
  ItemIndex it;
  it.split = block % splits;
  int64_t rest = block / splits;
  it.row_group = rest % row_groups;
  rest /= row_groups;
  it.kv_head = rest % kv_heads;
  it.batch_in_launch = rest / kv_heads;
  return it;
}
TREEATTN_HD constexpr int64_t encode_item(const ItemIndex& it, int64_t splits, int64_t row_groups,
                                          int64_t kv_heads) {
  return it.split +
         splits * (it.row_group + row_groups * (it.kv_head + kv_heads * it.batch_in_launch));
}

// Where lane `lane` of a warp works: its token slot in the warp and its first head_dim element.
struct LaneRole {
  int token_slot = 0;
  int dim0 = 0;
};
TREEATTN_HD constexpr LaneRole lane_role(int lane, DType t, int head_dim) {
  const int lanes = lanes_per_token(t, head_dim);
  return {lane / lanes, (lane % lanes) * vec_elems(t)};
}

// The token walk of an item over its slots [t0, t1): warp w starts at warp_first_token and
// advances by cta_token_step (all token groups times the unroll) per iteration; inside an
// iteration, unrolled load u of the lane's token slot reads lane_token (only if < t1). Every
// slot of [t0, t1) is read by exactly one (warp, slot, iteration, u) (tested).
TREEATTN_HD constexpr int64_t warp_first_token(int64_t t0, int warp, int tpw) {
  return t0 + static_cast<int64_t>(warp) * tpw;
}
TREEATTN_HD constexpr int64_t cta_token_step(int groups, int unroll) {
  return static_cast<int64_t>(groups) * unroll;
}
TREEATTN_HD constexpr int64_t lane_token(int64_t w0, int token_slot, int u, int groups) {
  return w0 + token_slot + static_cast<int64_t>(u) * groups;
}

// Element offset of (b, h, slot j, element d) in a KV view with element strides.
TREEATTN_HD constexpr int64_t kv_offset(int64_t b, int64_t h, int64_t j, int64_t d,
                                        int64_t stride_batch, int64_t stride_head,
                                        int64_t stride_token) {
  return b * stride_batch + h * stride_head + j * stride_token + d;
}

// ---- split planning (host) ---------------------------------------------------------------------

struct SplitPlan {
  int64_t chunk = 1;                 // token slots per split
  int64_t splits = 1;                // splits per (row, KV head, row group)
  RowSplit rows;                     // row groups per KV head
  int64_t launches = 1;              // ceil(batch / kMaxBatchPerLaunch)
  int64_t blocks_per_batch_row = 1;  // splits * row_groups * kv_heads
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The plan of decode_partial on the device: `max_visible` is the largest visible_count over the
// batch rows for the last query. chunk_tokens > 0 (DecodeOptions::chunk_tokens) fixes the split
// length; 0 lets the planner aim at kTargetCtas blocks with splits of at least kMinSplitTokens
// slots, a multiple of kSplitAlign, at most kMaxSplits of them.
inline SplitPlan plan_decode(int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len,
                             int64_t max_visible, int64_t chunk_tokens) {
  SplitPlan p;
  p.rows = split_rows(group, q_len);
  p.launches = ceil_div(batch, kMaxBatchPerLaunch);
  const int64_t per_split = batch * kv_heads * p.rows.row_groups;  // blocks of one split index
  if (max_visible <= 0) {
    p.chunk = 1;
    p.splits = 1;
  } else if (chunk_tokens > 0) {
    p.chunk = chunk_tokens;
    p.splits = ceil_div(max_visible, chunk_tokens);
  } else {
    int64_t want = ceil_div(kTargetCtas, per_split);
    const int64_t most = ceil_div(max_visible, kMinSplitTokens);
    if (want > most) want = most;
    if (want > kMaxSplits) want = kMaxSplits;
    if (want < 1) want = 1;
    p.chunk = ceil_div(ceil_div(max_visible, want), kSplitAlign) * kSplitAlign;
    if (p.chunk < kMinSplitTokens) p.chunk = kMinSplitTokens;
    p.splits = ceil_div(max_visible, p.chunk);
  }
  p.blocks_per_batch_row = p.splits * p.rows.row_groups * kv_heads;
  return p;
}

// The plan of partial_chunks: one split per chunk of chunk_tokens slots, ceil(max len / chunk)
// of them (the executor contract counts chunks by length, not by visibility).
inline SplitPlan plan_chunks(int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len,
                             int64_t max_len, int64_t chunk_tokens) {
  SplitPlan p;
  p.rows = split_rows(group, q_len);
  p.launches = ceil_div(batch, kMaxBatchPerLaunch);
  p.chunk = chunk_tokens;
  p.splits = ceil_div(max_len, chunk_tokens);
  p.blocks_per_batch_row = p.splits * p.rows.row_groups * kv_heads;
  return p;
}

// ---- the state-record kernels ------------------------------------------------------------------

// The state kernels (merge, normalize, sum form) give one warp to each record; lane l holds the
// elements l, l + 32, ... of o. Elements per lane, padded to 2, 4 or 8 (0 for head_dim > 256).
TREEATTN_HD constexpr int state_lane_elems(int64_t head_dim) {
  return head_dim <= 64 ? 2 : head_dim <= 128 ? 4 : head_dim <= 256 ? 8 : 0;
}
inline constexpr int kStateWarpsPerBlock = 4;

}  // namespace treeattn::gpu
