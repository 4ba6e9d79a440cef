// The plain arithmetic of the CUDA split-KV decode kernel: launch geometry, split planning, the
// causal limit, and how a thread block's index and a thread's lane map onto tokens, heads,
// query rows and state records. No CUDA headers: everything here is TREEATTN_HD (host and
// device) or host-only planning, and the host unit tests (tests/cuda/test_cuda_geometry.cpp)
// check every formula that the kernel (decode_kernel.cuh) and the executor (cuda_executor.cpp)
// use, on a machine without a GPU.
//
// Vocabulary (the kernel's variable names):
//   item     one thread block (CTA): one batch row b, one KV head kvh, one row group rg and one
//            split s. blockIdx.x = rg + row_groups * (s + splits * (kvh + kv_heads * bl)), where
//            bl is b's index inside the launch (a launch covers at most kMaxBatchPerLaunch rows,
//            whose lengths travel in the kernel parameters). The row group is the fastest index:
//            the row groups of one split read the same K/V tokens at about the same time, so the
//            second one finds them in L2. The decode is 32-bit (a grid has < 2^31 blocks).
//   ticket   one counter per (bl, kvh, rg) (ticket_index): every block of the item takes one
//            after writing its split record; the one that takes the last (splits - 1) merges
//            the splits' records into the final state and sets the counter back to 0, so that
//            every counter is 0 between launches (also across CUDA graph replays).
//   rows     the query rows of one KV head: G query heads x Q query positions, row r = i * G + g
//            for query i and head kvh * G + g (grouped-query attention: the KV head's tokens are
//            read once for all its rows). A CTA serves up to max_rows_per_cta rows (a row
//            group: 8, 4 for 8-bit K/V); its compile-time row count is rows_template(rows), the
//            next of 1, 2, 4, 8.
//   split    the token slots [s * chunk, (s + 1) * chunk) of the row; every CTA writes one state
//            record per row to split s's record array (empty when it sees no token), and the
//            merge kernel folds the splits in order 0..splits-1 with state_merge.
//   lanes    a warp reads kVecBytes (16) bytes of each of tokens_per_warp tokens at once: lane l
//            works on token slot l / lanes_per_token and the head_dim elements
//            [(l % lanes_per_token) * vec, + vec) (vec 4 for f32, 8 for f16 / bf16, 16 for fp8 /
//            int8). A "token group" (one slot of one warp) keeps its own online-softmax state;
//            groups are merged at the end of the item. 8-bit scales: each loaded by one lane of
//            the token group and shuffled to the lanes that need it (scale_of_lane).
//   slots    token slots are addressed relative to the split's first slot t0, in 32 bits
//            (slot_offsets_fit); the iterations whose slots every row sees run unguarded.
//   values   per loop iteration a lane has partial dot products of N = U * ROWS (token, row)
//            values, v = r * U + u (u the unrolled load, r the row). A reduce-scatter over the
//            token's lanes (rs_reduce) leaves each lane with whole logits of P = rs_per_lane
//            values (and each value in rs_replicas lanes), so that the softmax's exp2 runs once
//            per value instead of once per lane; the weights are then broadcast back.
//   visible  query i of a row with N context tokens sees global positions p <= N - Q + i;
//            local slot j sits at pos_start + j * pos_stride, so it sees slots j < visible_count.
//
// The split plan depends on the shape, the lengths, DecodeOptions::chunk_tokens and, when
// chunk_tokens is 0, the device's wave (SMs x resident blocks of the kernel instance): splits are
// sized so that the blocks fill whole waves. The same inputs give the same bits on every device
// of the same kind; ring-kv (every rank computes the partial of every shard, and the results must
// agree) passes chunk_tokens > 0 (strategies/common.hpp fixed_split_options), which fixes the
// plan on every device, so GPUs of different models agree.
#pragma once

#include <cstdint>

#include "treeattn/dtype.hpp"
#include "treeattn/state.hpp"  // TREEATTN_HD

// Loop unrolling in host-and-device functions (a pragma only in the device compilation, where the
// host compiler never sees it), and nvcc's check that a __host__ __device__ template calls only
// functions of both kinds switched off for templates that take a device-only functor (the
// kernel's warp shuffles; the host tests pass a simulated warp).
#if defined(__CUDA_ARCH__)
#define TREEATTN_UNROLL _Pragma("unroll")
#else
#define TREEATTN_UNROLL
#endif
#if defined(__CUDACC__)
#define TREEATTN_HD_FUNCTOR _Pragma("nv_exec_check_disable")
#else
#define TREEATTN_HD_FUNCTOR
#endif

namespace treeattn::gpu {

inline constexpr int kWarpSize = 32;
inline constexpr int kDecodeWarps = 4;
inline constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
inline constexpr int kMaxRowsPerCta = 8;
// Batch rows whose (len, pos_start, total_len) fit in one launch's kernel parameters
// (3 * 8 * 64 = 1536 bytes, well inside the 4 KiB every CUDA version accepts).
inline constexpr int kMaxBatchPerLaunch = 64;
// Without a device wave (wave_slots 0) the planner aims at this many thread blocks per call (a
// few waves on a 132-SM H100/H200 at 3-4 resident blocks per SM); with one it fills whole waves
// (at most kMaxWaves of them). It never makes a split shorter than kMinSplitTokens.
inline constexpr int64_t kTargetCtas = 2048;
inline constexpr int64_t kMaxWaves = 4;
inline constexpr int64_t kMinSplitTokens = 256;
inline constexpr int64_t kSplitAlign = 64;  // split lengths are multiples of this
static_assert(kMinSplitTokens % kSplitAlign == 0);
inline constexpr int64_t kMaxSplits = 1024;
// Head dims with a compiled CUDA kernel.
inline constexpr int kCudaHeadDims[] = {64, 128};

// ---- per-dtype lane geometry -------------------------------------------------------------------

// fp8 and int8 K/V: one byte a code, a float scale per (token, KV head) for K and for V.
TREEATTN_HD constexpr bool kv_8bit(DType t) { return t == DType::kFP8 || t == DType::kInt8; }
#if !defined(__CUDA_ARCH__)
static_assert(kv_8bit(DType::kF32) == dtype_is_quantized(DType::kF32) &&
                  kv_8bit(DType::kF16) == dtype_is_quantized(DType::kF16) &&
                  kv_8bit(DType::kBF16) == dtype_is_quantized(DType::kBF16) &&
                  kv_8bit(DType::kFP8) == dtype_is_quantized(DType::kFP8) &&
                  kv_8bit(DType::kInt8) == dtype_is_quantized(DType::kInt8),
              "kv_8bit is dtype_is_quantized (dtype.hpp) in host-and-device form");
#endif

// Whether x is a power of 2 (x > 0).
TREEATTN_HD constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// Every lane loads kVecBytes of one token per tensor: 4 elements of f32, 8 of f16 / bf16 and 16
// consecutive codes of fp8 / int8.
inline constexpr int kVecBytes = 16;
TREEATTN_HD constexpr int elem_bytes(DType t) { return t == DType::kF32 ? 4 : kv_8bit(t) ? 1 : 2; }
TREEATTN_HD constexpr int vec_elems(DType t) { return kVecBytes / elem_bytes(t); }
TREEATTN_HD constexpr int vec_bytes(DType t) { return vec_elems(t) * elem_bytes(t); }
static_assert(vec_bytes(DType::kF32) == kVecBytes && vec_bytes(DType::kF16) == kVecBytes &&
              vec_bytes(DType::kBF16) == kVecBytes && vec_bytes(DType::kFP8) == kVecBytes &&
              vec_bytes(DType::kInt8) == kVecBytes);
static_assert(vec_elems(DType::kFP8) == 16 && vec_elems(DType::kInt8) == 16,
              "8-bit K/V: 16 consecutive codes a lane");
TREEATTN_HD constexpr int lanes_per_token(DType t, int head_dim) { return head_dim / vec_elems(t); }
TREEATTN_HD constexpr int tokens_per_warp(DType t, int head_dim) {
  return kWarpSize / lanes_per_token(t, head_dim);
}
// Token groups per CTA (each with its own online-softmax state).
TREEATTN_HD constexpr int token_groups(DType t, int head_dim) {
  return kDecodeWarps * tokens_per_warp(t, head_dim);
}
// The most query rows one CTA serves: 8, and 4 for 8-bit K/V, whose lanes hold 16 elements of q
// and of the accumulators per row (8 rows would take 256 registers for those alone).
TREEATTN_HD constexpr int max_rows_per_cta(DType t) { return kv_8bit(t) ? 4 : kMaxRowsPerCta; }
static_assert(max_rows_per_cta(DType::kF32) <= kMaxRowsPerCta &&
              max_rows_per_cta(DType::kF16) <= kMaxRowsPerCta &&
              max_rows_per_cta(DType::kBF16) <= kMaxRowsPerCta &&
              max_rows_per_cta(DType::kFP8) <= kMaxRowsPerCta &&
              max_rows_per_cta(DType::kInt8) <= kMaxRowsPerCta);
// Tokens each group loads per loop iteration (more loads in flight; fewer for 8 rows, whose
// registers are the limit; 8-bit K/V never has more than 4 rows). The loads of the next iteration
// are issued before this one's math (two sets of U loads in registers).
TREEATTN_HD constexpr int unroll_tokens(int rows_tpl) { return rows_tpl >= 8 ? 2 : 4; }

// __launch_bounds__'s minimum of resident blocks per SM (kDecodeThreads threads each), which caps
// the registers per thread at 65536 / (blocks * kDecodeThreads): 128 at 4 blocks, 170 at 3, 255
// at 2. q and the accumulators take 2 * rows * vec registers, the two load sets 2 * 2 * U * 4:
// 8-bit K/V (vec 16) fit 1-2 rows in 170 and 4 rows in 255. ptxas's figures for every instance:
// decode_kernel.cuh.
TREEATTN_HD constexpr int min_blocks_per_sm(DType t, int rows_tpl) {
  if (kv_8bit(t)) return rows_tpl >= 4 ? 2 : 3;
  return rows_tpl >= 8 ? 2 : rows_tpl >= 4 ? 3 : 4;
}
TREEATTN_HD constexpr int register_cap(DType t, int rows_tpl) {
  const int r = 65536 / (min_blocks_per_sm(t, rows_tpl) * kDecodeThreads);
  return r > 255 ? 255 : r;
}

// Whether the lane geometry works for this dtype and head dim: a token's head_dim elements are a
// whole number of vectors and a warp holds a whole number of tokens.
TREEATTN_HD constexpr bool geometry_valid(DType t, int head_dim) {
  const int v = vec_elems(t);
  if (head_dim <= 0 || head_dim % v != 0) return false;
  const int lanes = head_dim / v;
  return lanes >= 1 && lanes <= kWarpSize && kWarpSize % lanes == 0;
}

// ---- 8-bit scales: each loaded by one lane of the token -----------------------------------------
//
// An iteration of a token group uses 2 * U scales of its lanes' token slot: scale s < U is the K
// scale of unrolled load s, scale U + s its V scale. Lane t of the token's LPT lanes loads the
// scales scale_of_lane(t, k) for k < scale_loads_per_lane into its register k (a lane past 2 * U
// loads a copy of another lane's, from the same address), and the lanes that need scale s read it
// with a shuffle from lane scale_lane(s), register scale_reg(s).
TREEATTN_HD constexpr int scale_loads_per_lane(int u_count, int lpt) {
  return 2 * u_count > lpt ? 2 * u_count / lpt : 1;
}
TREEATTN_HD constexpr int scale_of_lane(int t, int k, int u_count, int lpt) {
  return (t + k * lpt) % (2 * u_count);
}
TREEATTN_HD constexpr int k_scale_index(int u) { return u; }
TREEATTN_HD constexpr int v_scale_index(int u, int u_count) { return u_count + u; }
TREEATTN_HD constexpr int scale_lane(int s, int lpt) { return s % lpt; }
TREEATTN_HD constexpr int scale_reg(int s, int lpt) { return s / lpt; }
// Whether that works: powers of 2, and every K scale in register 0 (U <= LPT: the K scale of a
// lane's held value, whose load index is not a compile-time constant, comes from register 0).
TREEATTN_HD constexpr bool scales_valid(int u_count, int lpt) {
  return is_pow2(u_count) && is_pow2(lpt) && u_count <= lpt;
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
// The row groups of a KV head of K/V dtype t (at most max_rows_per_cta(t) rows a CTA).
TREEATTN_HD constexpr RowSplit split_rows(DType t, int64_t group, int64_t q_len) {
  RowSplit s;
  s.rows_total = group * q_len;
  const int most = max_rows_per_cta(t);
  s.rows_tpl = rows_template(s.rows_total < most ? s.rows_total : most);
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
  uint32_t split = 0;
  uint32_t row_group = 0;
  uint32_t kv_head = 0;
  uint32_t batch_in_launch = 0;
};
// blockIdx.x -> item, in 32-bit arithmetic (grids have < 2^31 blocks; the executor checks).
TREEATTN_HD constexpr ItemIndex decode_item(uint32_t block, uint32_t splits, uint32_t row_groups,
                                            uint32_t kv_heads) {
  ItemIndex it;
  it.row_group = block % row_groups;
  uint32_t rest = block / row_groups;
  it.split = rest % splits;
  rest /= splits;
  it.kv_head = rest % kv_heads;
  it.batch_in_launch = rest / kv_heads;
  return it;
}
TREEATTN_HD constexpr uint32_t encode_item(const ItemIndex& it, uint32_t splits,
                                           uint32_t row_groups, uint32_t kv_heads) {
  return it.row_group +
         row_groups * (it.split + splits * (it.kv_head + kv_heads * it.batch_in_launch));
}
// The item's ticket counter (one per (bl, kvh, rg), shared by its splits), and how many counters
// a launch of nb batch rows uses.
TREEATTN_HD constexpr uint32_t ticket_index(const ItemIndex& it, uint32_t row_groups,
                                            uint32_t kv_heads) {
  return it.row_group + row_groups * (it.kv_head + kv_heads * it.batch_in_launch);
}
TREEATTN_HD constexpr int64_t tickets_per_launch(int64_t nb, int64_t kv_heads, int64_t row_groups) {
  return nb * kv_heads * row_groups;
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

// The token walk of an item over its slots [t0, t1), in 32-bit slot indices relative to t0 (a
// split has at most kMaxSplitSlots slots): warp w starts at local slot warp_first_slot and
// advances by cta_slot_step (all token groups times the unroll) per iteration; inside an
// iteration, unrolled load u of the lane's token slot reads lane_slot. Every slot of [t0, t1) is
// read by exactly one (warp, slot, iteration, u) (tested).
TREEATTN_HD constexpr int warp_first_slot(int warp, int tpw) { return warp * tpw; }
TREEATTN_HD constexpr int cta_slot_step(int groups, int unroll) { return groups * unroll; }
TREEATTN_HD constexpr int lane_slot(int wl, int token_slot, int u, int groups) {
  return wl + token_slot + u * groups;
}
// A warp's iteration from wl reads slots in [wl, wl + warp_span). The main loop runs the
// iterations whose slots every row of the block sees (below n_main) without a guard: no bound
// check and no zero fill of the loads, no causal check of the values; the guarded tail runs the
// rest, up to the slots any row sees (n1).
TREEATTN_HD constexpr int warp_span(int tpw, int unroll, int groups) {
  return (unroll - 1) * groups + tpw;
}
TREEATTN_HD constexpr bool unguarded_iteration(int wl, int span, int n_main) {
  return wl + span <= n_main;
}
// A global slot limit (a row's visible count, the slots any row sees) as a local one: clamped to
// [0, n] slots after t0.
TREEATTN_HD constexpr int local_limit(int64_t limit, int64_t t0, int n) {
  const int64_t r = limit - t0;
  return r <= 0 ? 0 : r >= n ? n : static_cast<int>(r);
}

// ---- 32-bit slot offsets ---------------------------------------------------------------------
//
// The kernel adds t0's element offset to its K, V and scale pointers once (64 bits) and reaches
// the split's slots by 32-bit offsets from there: local slot j is j * stride elements (or floats
// of scales) on. That holds for every slot of a split of `chunk` slots when (chunk - 1) * stride
// < 2^32, and keeps local slot arithmetic (up to chunk plus two iterations' steps) inside int32
// for chunk <= kMaxSplitSlots. max_split_slots is the largest such chunk at a stride; the planner
// keeps its automatic splits within it, and the executor refuses a plan whose split does not fit
// (slot_offsets_fit).
inline constexpr int64_t kMaxSplitSlots = int64_t{1} << 30;
inline constexpr int64_t kMaxSlotOffset = 0xffffffffLL;
// The most slots a split may span at a token stride of `stride` elements (or floats of scales);
// a negative stride reaches no slot (0).
TREEATTN_HD constexpr int64_t max_split_slots(int64_t stride) {
  if (stride < 0) return 0;
  if (stride == 0) return kMaxSplitSlots;
  const int64_t n = kMaxSlotOffset / stride + 1;
  return n < kMaxSplitSlots ? n : kMaxSplitSlots;
}
TREEATTN_HD constexpr bool slot_offsets_fit(int64_t chunk, int64_t stride) {
  return chunk >= 1 && chunk <= max_split_slots(stride);
}
// The same for a shard of dtype t: its K/V token stride and, for 8-bit K/V, its scales'.
TREEATTN_HD constexpr int64_t max_split_slots(DType t, int64_t stride_token,
                                              int64_t scale_stride_token) {
  const int64_t kv = max_split_slots(stride_token);
  if (!kv_8bit(t)) return kv;
  const int64_t sc = max_split_slots(scale_stride_token);
  return sc < kv ? sc : kv;
}
TREEATTN_HD constexpr uint32_t slot_offset(int j, uint32_t stride) {
  return static_cast<uint32_t>(j) * stride;
}

// Element offset of (b, h, slot j, element d) in a KV view with element strides.
TREEATTN_HD constexpr int64_t kv_offset(int64_t b, int64_t h, int64_t j, int64_t d,
                                        int64_t stride_batch, int64_t stride_head,
                                        int64_t stride_token) {
  return b * stride_batch + h * stride_head + j * stride_token + d;
}

// ---- the logits' reduce-scatter over a token's lanes ------------------------------------------
//
// N = U * ROWS values (v = r * U + u) of partial dot products in each of a token's LPT lanes
// (sub-lane t = lane % LPT; N and LPT powers of 2). rs_reduce runs the butterfly over the xor
// offsets LPT / 2, ..., 1: while a lane holds k > 1 values, the lane whose offset bit is set
// keeps the upper half and sends the lower (its partner the reverse), so each stage costs k / 2
// shuffles and halves k; once k is 1 the remaining stages all-reduce that value. Afterwards
// sub-lane t holds the whole sums of values rs_value(t, 0..P-1), P = rs_per_lane; each value is
// held by rs_replicas consecutive sub-lanes with the same bits (a + b == b + a). Shuffles: 15 for
// N = LPT = 16, where a plain all-reduce of every value takes N * log2(LPT) = 64.
TREEATTN_HD constexpr int rs_per_lane(int n, int lpt) { return n > lpt ? n / lpt : 1; }
TREEATTN_HD constexpr int rs_replicas(int n, int lpt) { return lpt > n ? lpt / n : 1; }
TREEATTN_HD constexpr int rs_value(int t, int i, int n, int lpt) {
  return (t / rs_replicas(n, lpt)) * rs_per_lane(n, lpt) + i;
}
// The first sub-lane that holds value v, and v's place among that lane's P values.
TREEATTN_HD constexpr int rs_holder(int v, int n, int lpt) {
  return (v / rs_per_lane(n, lpt)) * rs_replicas(n, lpt);
}
TREEATTN_HD constexpr int rs_slot(int v, int n, int lpt) { return v % rs_per_lane(n, lpt); }
// Whether sub-lane t keeps the upper half of its values at the stage of offset off.
TREEATTN_HD constexpr bool rs_keeps_upper(int t, int off) { return (t & off) != 0; }
// The row and the unrolled load of value v.
TREEATTN_HD constexpr int value_row(int v, int u_count) { return v / u_count; }
TREEATTN_HD constexpr int value_load(int v, int u_count) { return v % u_count; }
// The values of one row lie in rs_row_lanes consecutive sub-lanes starting at a multiple of it
// (P divides U): a max over the row is a butterfly over the offsets rs_replicas .. < this.
TREEATTN_HD constexpr int rs_row_lanes(int u_count, int n, int lpt) {
  return u_count / rs_per_lane(n, lpt) * rs_replicas(n, lpt);
}
// Whether the reduce-scatter's assumptions hold: powers of 2, P dividing U.
TREEATTN_HD constexpr bool rs_valid(int u_count, int rows, int lpt) {
  const int n = u_count * rows;
  return is_pow2(u_count) && is_pow2(rows) && is_pow2(lpt) && u_count % rs_per_lane(n, lpt) == 0;
}

// The reduce-scatter itself. xor_fn(x, off) returns the value x of sub-lane t ^ off at the same
// step (the kernel: __shfl_xor_sync over the token's lanes; the host test: a simulated warp).
// Every index is a compile-time constant once the loops are unrolled (no local memory).
TREEATTN_HD_FUNCTOR
template <int N, int LPT, class Xor>
TREEATTN_HD inline void rs_reduce(float (&a)[N], int t, Xor&& xor_fn) {
  int k = N;
  TREEATTN_UNROLL
  for (int off = LPT / 2; off > 0; off >>= 1) {
    if (k > 1) {
      const bool upper = rs_keeps_upper(t, off);
      const int h = k / 2;
      TREEATTN_UNROLL
      for (int i = 0; i < (N > 1 ? N / 2 : 1); ++i) {
        if (i < h) {
          const float send = upper ? a[i] : a[i + h];
          const float keep = upper ? a[i + h] : a[i];
          a[i] = keep + xor_fn(send, off);
        }
      }
      k = h;
    } else {
      a[0] += xor_fn(a[0], off);
    }
  }
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

// Blocks of one launch over the slots resident at once (wave_slots): the last wave's share of
// whole waves, 1 for whole waves.
inline double wave_fill(int64_t blocks, int64_t wave_slots) {
  if (blocks <= 0 || wave_slots <= 0) return 1.0;
  const int64_t waves = ceil_div(blocks, wave_slots);
  return static_cast<double>(blocks) / static_cast<double>(waves * wave_slots);
}

// The plan of decode_partial on the device for K/V dtype t: `max_visible` is the largest
// visible_count over the batch rows for the last query. chunk_tokens > 0
// (DecodeOptions::chunk_tokens) fixes the split length. 0 with wave_slots > 0 (the device's SMs x
// resident blocks of the instance) picks, among the split counts up to kMaxWaves waves' worth of
// blocks (and up to the count without a wave), the one whose blocks fill their last wave best (the
// fewest splits on a tie); 0 without a wave aims at kTargetCtas blocks. Either way splits are at
// least kMinSplitTokens slots, a multiple of kSplitAlign, at most kMaxSplits of them, and at most
// max_chunk slots (max_split_slots of the shard's strides: where that is below kMinSplitTokens
// the splits are shorter, and more than kMaxSplits where the slots need them). A chunk_tokens of
// max_visible or more plans one split of max_visible slots (the kernel reads no slot past it).
inline SplitPlan plan_decode(DType t, int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len,
                             int64_t max_visible, int64_t chunk_tokens, int64_t wave_slots = 0,
                             int64_t max_chunk = kMaxSplitSlots) {
  SplitPlan p;
  p.rows = split_rows(t, group, q_len);
  p.launches = ceil_div(batch, kMaxBatchPerLaunch);
  const int64_t per_split = batch * kv_heads * p.rows.row_groups;  // blocks of one split index
  // Blocks of one split index in one (the largest) launch.
  const int64_t per_launch =
      (batch < kMaxBatchPerLaunch ? batch : kMaxBatchPerLaunch) * kv_heads * p.rows.row_groups;
  const auto splits_of = [&](int64_t want) {
    int64_t most = ceil_div(max_visible, kMinSplitTokens);
    if (most > kMaxSplits) most = kMaxSplits;
    if (want > most) want = most;
    if (want < 1) want = 1;
    int64_t chunk = ceil_div(ceil_div(max_visible, want), kSplitAlign) * kSplitAlign;
    if (chunk < kMinSplitTokens) chunk = kMinSplitTokens;
    if (chunk > max_chunk)
      chunk = max_chunk >= kSplitAlign ? max_chunk / kSplitAlign * kSplitAlign
              : max_chunk > 1          ? max_chunk
                                       : 1;
    return chunk;
  };
  if (max_visible <= 0) {
    p.chunk = 1;
    p.splits = 1;
  } else if (chunk_tokens > 0) {
    p.chunk = chunk_tokens < max_visible ? chunk_tokens : max_visible;
    p.splits = ceil_div(max_visible, p.chunk);
  } else if (wave_slots > 0) {
    double best = -1.0;
    // Up to kMaxWaves waves, and at least as many splits as the device-independent plan.
    int64_t last = ceil_div(kMaxWaves * wave_slots, per_launch);
    if (last < ceil_div(kTargetCtas, per_split)) last = ceil_div(kTargetCtas, per_split);
    if (last > kMaxSplits) last = kMaxSplits;
    for (int64_t want = 1; want <= last; ++want) {
      const int64_t chunk = splits_of(want);
      const int64_t splits = ceil_div(max_visible, chunk);
      const double fill = wave_fill(splits * per_launch, wave_slots);
      if (fill > best + 1e-9) {
        best = fill;
        p.chunk = chunk;
        p.splits = splits;
      }
    }
  } else {
    p.chunk = splits_of(ceil_div(kTargetCtas, per_split));
    p.splits = ceil_div(max_visible, p.chunk);
  }
  p.blocks_per_batch_row = p.splits * p.rows.row_groups * kv_heads;
  return p;
}

// The plan of partial_chunks: one split per chunk of chunk_tokens slots, ceil(max len / chunk)
// of them (the executor contract counts chunks by length, not by visibility); a chunk_tokens past
// max_len is one split of max_len slots.
inline SplitPlan plan_chunks(DType t, int64_t batch, int64_t kv_heads, int64_t group, int64_t q_len,
                             int64_t max_len, int64_t chunk_tokens) {
  SplitPlan p;
  p.rows = split_rows(t, group, q_len);
  p.launches = ceil_div(batch, kMaxBatchPerLaunch);
  p.chunk = chunk_tokens < max_len ? chunk_tokens : max_len;
  p.splits = ceil_div(max_len, p.chunk);
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
