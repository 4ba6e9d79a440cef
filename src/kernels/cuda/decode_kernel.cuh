// The CUDA split-KV decode kernel (flash-decoding): partial attention states of the queries of
// one KV head against one split of a KV shard in device memory, and the merge of the splits.
//
// One thread block (CTA, kDecodeThreads threads) serves one item (decode_geometry.hpp): batch
// row b, KV head kvh, a group of up to 8 query rows (4 for 8-bit K/V; G heads x Q positions: the
// KV head is read once for all of them) and the token slots [split * chunk, (split + 1) * chunk),
// addressed by 32-bit offsets from the split's first. Each warp reads tokens_per_warp tokens per
// load (lane l: token slot l / lanes_per_token, 16 bytes of head_dim: 4, 8 or 16 elements), U
// loads per iteration, and issues the next iteration's loads before this one's math (software
// pipelining in registers); 8-bit scales are loaded by one lane of the token each and shuffled
// to the lanes that use them. The iterations whose slots every row of the block sees run without
// bound or causal checks; a guarded tail takes the rest. Each such token group keeps its own
// online-softmax state per row (rescaled only when its maximum changes); the partial dot products
// of the U x ROWS (token, row) values are reduce-scattered over the token's lanes (rs_reduce), so
// each lane computes whole logits of its own values and their exp2 once, and the weights are
// broadcast back for the V accumulation. The groups are merged
// (warp shuffles, then shared memory across warps) into one record per row, written to the
// split's record array. With more than one split, the last block of each (batch row, KV head,
// row group) to finish (an atomic ticket) merges the splits' records into the final state
// (merge_item_splits); there is no second launch.
//
// Numerics: K and V are widened exactly to float (fp8 / int8: the code, times the token's scale
// once per logit and once per weight); q is pre-multiplied by scale * log2(e) so that the
// softmax runs on exp2; the record's m is converted back to natural-log units (m * ln 2) when it
// is written, with l and o relative to it (state.hpp). A key hidden from a query by the causal
// rule, or past the shard's length, never enters its sums (its weight is skipped, not multiplied
// by 0, so a NaN in a hidden value stays out as on the CPU). A NaN logit makes the row's state NaN
// (as decode_partial on the CPU does); a row that sees no key gets the empty state.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/decode_geometry.hpp"

namespace treeattn::gpu {

// ---- loading and widening one lane's vector of K or V -----------------------------------------

template <DType T>
struct KvVec;

template <>
struct KvVec<DType::kF32> {
  static constexpr int kVec = 4;
  using Elem = float;
  using Raw = float4;
  __device__ static Raw zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ static void widen(const Raw& r, float (&f)[kVec]) {
    f[0] = r.x;
    f[1] = r.y;
    f[2] = r.z;
    f[3] = r.w;
  }
};

__device__ inline void widen_f16_pair(uint32_t w, float* f) {
  __half2_raw raw;
  raw.x = static_cast<unsigned short>(w & 0xffffu);
  raw.y = static_cast<unsigned short>(w >> 16);
  const float2 x = __half22float2(__half2(raw));
  f[0] = x.x;
  f[1] = x.y;
}

template <>
struct KvVec<DType::kF16> {
  static constexpr int kVec = 8;
  using Elem = uint16_t;
  using Raw = uint4;
  __device__ static Raw zero() { return make_uint4(0u, 0u, 0u, 0u); }
  __device__ static void widen(const Raw& r, float (&f)[kVec]) {
    widen_f16_pair(r.x, f + 0);
    widen_f16_pair(r.y, f + 2);
    widen_f16_pair(r.z, f + 4);
    widen_f16_pair(r.w, f + 6);
  }
};

template <>
struct KvVec<DType::kBF16> {
  static constexpr int kVec = 8;
  using Elem = uint16_t;
  using Raw = uint4;
  __device__ static Raw zero() { return make_uint4(0u, 0u, 0u, 0u); }
  __device__ static void widen(const Raw& r, float (&f)[kVec]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

// FP8 E4M3 (e4m3fn): two codes -> two halves (exact: every e4m3 value is a half) -> floats.
__device__ inline void widen_fp8_pair(uint32_t two, float* f) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  const float2 x = __half22float2(__half2(h));
  f[0] = x.x;
  f[1] = x.y;
}

// fp8 and int8: 16 consecutive codes in one 16-byte load.
template <>
struct KvVec<DType::kFP8> {
  static constexpr int kVec = 16;
  using Elem = uint8_t;
  using Raw = uint4;
  __device__ static Raw zero() { return make_uint4(0u, 0u, 0u, 0u); }
  __device__ static void widen(const Raw& r, float (&f)[kVec]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      widen_fp8_pair(w[i], f + 4 * i);
      widen_fp8_pair(w[i] >> 16, f + 4 * i + 2);
    }
  }
};

template <>
struct KvVec<DType::kInt8> {
  static constexpr int kVec = 16;
  using Elem = int8_t;
  using Raw = uint4;
  __device__ static Raw zero() { return make_uint4(0u, 0u, 0u, 0u); }
  __device__ static void widen(const Raw& r, float (&f)[kVec]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k)  // arithmetic shift: the sign-extended byte k
        f[4 * i + k] = static_cast<float>(static_cast<int32_t>(w[i] << (24 - 8 * k)) >> 24);
  }
};

// max that keeps NaN (fmaxf would drop it), as the CPU kernels do.
__device__ inline float nan_max(float a, float b) {
  return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

constexpr float kNegInfF = -__builtin_huge_valf();

// (m, l, acc) <- (m, l, acc) (+) (mo, lo, ao) in base 2 (the token groups' states).
template <int VEC>
__device__ inline void combine2(float& m, float& l, float (&acc)[VEC], float mo, float lo,
                                const float (&ao)[VEC]) {
  if (mo == kNegInfF) return;
  if (m == kNegInfF) {
    m = mo;
    l = lo;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = ao[e];
    return;
  }
  const float mn = nan_max(m, mo);
  const float a = exp2f(m - mn), b = exp2f(mo - mn);
  l = a * l + b * lo;
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = a * acc[e] + b * ao[e];
  m = mn;
}

// The fused split merge of one item (run by the block that took the item's last ticket): for each
// of its rows, the splits' records (natural-log m, l, o relative to m) in p.out are folded into
// the final record in p.final_out. One warp per row, lane l holding the elements l + 32 k. Two
// passes over the records, both with independent loads (no chain through the merge): the largest
// m (NaN wins; -0 folded to +0 as in state.hpp), then l and o as sums over the splits in order
// 0..splits-1 of exp(m_s - m) times the split's l and o. This is state_merge's fold written
// in one pass: equal in exact arithmetic, the same bits on every run and device of one kind (a
// fixed order, no atomics in the sums), within a few ulps of the fold in float. Records are read
// through L2 (__ldcg): other blocks wrote them, and L1 is not coherent.
template <int D, int ROWS>
__device__ inline void merge_item_splits(const DecodeParams& p, const int64_t* rec_of, int warp,
                                         int lane) {
  constexpr int K = D / kWarpSize;
  static_assert(D % kWarpSize == 0, "the merge gives each lane D / 32 elements");
  for (int r = warp; r < ROWS; r += kDecodeWarps) {
    const int64_t ri = rec_of[r];
    if (ri < 0) continue;  // warp-uniform: past the item's rows
    const float* const base = p.out + ri * (D + 2);
    float* const out = p.final_out + ri * (D + 2);
    float mt = kNegInfF;
    for (int64_t s = lane; s < p.splits; s += kWarpSize)
      mt = nan_max(mt, __ldcg(base + s * p.split_stride));
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off >>= 1)
      mt = nan_max(mt, __shfl_xor_sync(0xffffffffu, mt, off));
    if (mt == 0.0f) mt = 0.0f;  // -0 -> +0, the same in every lane
    if (mt == kNegInfF) {       // every split empty: the empty state
      if (lane == 0) {
        out[0] = kNegInfF;
        out[1] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < K; ++k) out[2 + lane + k * kWarpSize] = 0.0f;
      continue;
    }
    float lt = 0.0f, ot[K];
#pragma unroll
    for (int k = 0; k < K; ++k) ot[k] = 0.0f;
#pragma unroll 8  // 8 splits' loads in flight: ~splits / 8 L2 round trips
    for (int64_t s = 0; s < p.splits; ++s) {
      const float* const rec = base + s * p.split_stride;
      const float ms = __ldcg(rec), ls = __ldcg(rec + 1);
      float os[K];
#pragma unroll
      for (int k = 0; k < K; ++k) os[k] = __ldcg(rec + 2 + lane + k * kWarpSize);
      if (ms == kNegInfF) continue;  // an empty split adds nothing (its o is never read as 0 * x)
      const float w = expf(ms - mt);
      lt = fmaf(w, ls, lt);
#pragma unroll
      for (int k = 0; k < K; ++k) ot[k] = fmaf(w, os[k], ot[k]);
    }
    if (lane == 0) {
      out[0] = mt;
      out[1] = lt;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) out[2 + lane + k * kWarpSize] = ot[k];
  }
}

// ptxas (CUDA 13.0.88, sm_90, -Xptxas -v; configure with -DTREEATTN_CUDA_PTXAS_VERBOSE=ON, or
// read tools/gpu-check.sh's build.log): registers per thread of every instance, ROWS 1 2 4 8,
// under the launch bounds' caps register_cap: 128 128 170 255 (4 4 3 2 blocks per SM); 8-bit K/V
// (at most 4 rows) 170 170 255 (3 3 2 blocks).
// Every instance: 0 bytes of stack frame, 0 bytes of spill stores and loads.
//   f32   D64: 106 113 147 160   D128: 124 112 141 159
//   f16   D64: 114 128 168 225   D128: 128 128 168 225
//   bf16  D64: 120 128 168 229   D128: 128 128 168 227
//   fp8   D64: 150 167 254       D128: 148 165 254
//   int8  D64: 157 165 254       D128: 157 167 254
template <DType T, int D, int ROWS>
__global__ void __launch_bounds__(kDecodeThreads, min_blocks_per_sm(T, ROWS))
    decode_split_kernel(const __grid_constant__ DecodeParams p) {
  using V = KvVec<T>;
  using Raw = typename V::Raw;
  constexpr int VEC = V::kVec;
  static_assert(VEC == vec_elems(T), "vector width differs from decode_geometry.hpp");
  static_assert(sizeof(Raw) == kVecBytes, "every dtype loads 16-byte vectors");
  static_assert(geometry_valid(T, D), "no lane geometry for this head dim");
  static_assert(ROWS <= max_rows_per_cta(T), "more rows than a CTA of this dtype serves");
  constexpr int LPT = lanes_per_token(T, D);
  constexpr int TPW = tokens_per_warp(T, D);
  constexpr int NG = token_groups(T, D);
  constexpr int U = unroll_tokens(ROWS);
  constexpr int N = U * ROWS;                  // (token, row) values per lane and iteration
  constexpr int P = rs_per_lane(N, LPT);       // whole logits a lane holds after rs_reduce
  constexpr int RL = rs_row_lanes(U, N, LPT);  // lanes holding one row's values
  constexpr int LV = rs_replicas(N, LPT);      // lanes holding each value
  static_assert(rs_valid(U, ROWS, LPT), "the reduce-scatter needs powers of 2 and P | U");
  constexpr bool kQuant = kv_8bit(T);
  static_assert(!kQuant || scales_valid(U, LPT), "a token's lanes cannot hold its scales");
  static_assert(!kQuant || scale_reg(k_scale_index(U - 1), LPT) == 0,
                "every K scale is in register 0 of its lane");
  constexpr int SL = kQuant ? scale_loads_per_lane(U, LPT) : 1;  // scale registers of a set
  constexpr int kStep = cta_slot_step(NG, U);
  constexpr int kSpan = warp_span(TPW, U, NG);
  constexpr float kLn2f = 0.69314718055994531f;
  constexpr unsigned kFull = 0xffffffffu;

  const ItemIndex it =
      decode_item(blockIdx.x, static_cast<uint32_t>(p.splits), static_cast<uint32_t>(p.row_groups),
                  static_cast<uint32_t>(p.kv_heads));
  const int bl = static_cast<int>(it.batch_in_launch);
  const int64_t b = p.b0 + bl;
  const int64_t kvh = it.kv_head;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const LaneRole role = lane_role(lane, T, D);
  const int sub = lane % LPT;  // the lane's place among its token's lanes
  const int64_t len = p.len[bl], pos0 = p.pos_start[bl], total = p.total_len[bl];

  // Each row's record index (-1 past the rows) and limit, computed once per block by ROWS
  // threads (the only 64-bit divisions of the kernel), then read by all.
  __shared__ int64_t sm_rec[ROWS];
  __shared__ int64_t sm_cnt[ROWS];
  if (threadIdx.x < ROWS) {
    const int64_t gr = static_cast<int64_t>(it.row_group) * ROWS + threadIdx.x;
    const bool valid = gr < p.rows_total;
    const RowTarget tg = row_target(valid ? gr : 0, p.group, kvh);
    sm_rec[threadIdx.x] = valid ? record_index(b, tg.query, tg.head, p.q_len, p.heads) : -1;
    sm_cnt[threadIdx.x] =
        valid ? visible_count(len, pos0, total, p.pos_stride, p.q_len, tg.query) : 0;
  }
  __syncthreads();
  float q[ROWS][VEC];
  int64_t cnt_max = 0, cnt_min = sm_cnt[0];  // row 0 of every row group is a row
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int64_t rec = sm_rec[r], cnt = sm_cnt[r];
    cnt_max = cnt > cnt_max ? cnt : cnt_max;
    if (rec >= 0) cnt_min = cnt < cnt_min ? cnt : cnt_min;
    const float* qr = p.q + (rec >= 0 ? rec : 0) * D + role.dim0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[r][e] = rec >= 0 ? qr[e] * p.qscale : 0.0f;
  }
  // The split's slots [t0, t1) in local 32-bit slots: n1 of them are seen by some row, the first
  // n_main by every row of the block (the unguarded main loop's).
  const int64_t t0 = static_cast<int64_t>(it.split) * p.chunk;
  const int n1 = local_limit(cnt_max, t0, static_cast<int>(p.chunk));
  const int n_main = local_limit(cnt_min, t0, n1);
  // The values this lane holds after the reduce-scatter: their unrolled loads, and their row
  // (the same for all P of them, since P divides U) with its limit and running max. Runtime
  // indices, so they are read from shared memory or kept apart, never indexed into a register
  // array (which would put the array in local memory).
  int held_load[P];
#pragma unroll
  for (int i = 0; i < P; ++i) held_load[i] = value_load(rs_value(sub, i, N, LPT), U);
  const int held_row = value_row(rs_value(sub, 0, N, LPT), U);
  const int held_lim = local_limit(sm_cnt[held_row], t0, n1);
  // The main loop's mask: a row of the block (past the rows, the limit is 0; every row's limit
  // is at least n_main, and the main loop runs only when n_main > 0).
  const bool held_live = held_lim > 0;
  float m_held = kNegInfF;  // m[held_row], kept alongside

  float m[ROWS], l[ROWS], acc[ROWS][VEC];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = kNegInfF;
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[r][e] = 0.0f;
  }

  // The lane's K and V pointers at slot t0 (64-bit, once); slots are 32-bit offsets from there.
  using Elem = typename V::Elem;
  const int64_t kv0 =
      kv_offset(b, kvh, t0, role.dim0, p.stride_batch, p.stride_head, p.stride_token);
  const Elem* const kbase = static_cast<const Elem*>(p.k) + kv0;
  const Elem* const vbase = static_cast<const Elem*>(p.v) + kv0;
  const auto stride = static_cast<uint32_t>(p.stride_token);
  // 8-bit: the scales this lane loads (register k: scale scale_of_lane(sub, k), of unrolled load
  // su[k] of K or V), at slot t0.
  const float* sbase[SL];
  int su[SL];
  const auto sstride = static_cast<uint32_t>(p.scale_stride_token);
#pragma unroll
  for (int k = 0; k < SL; ++k) {
    const int sidx = scale_of_lane(sub, k, U, LPT);
    su[k] = sidx % U;
    sbase[k] = nullptr;
    if constexpr (kQuant)
      sbase[k] = (sidx < U ? p.k_scale : p.v_scale) + b * p.scale_stride_batch +
                 kvh * p.scale_stride_head + t0 * p.scale_stride_token;
  }

  // One set of loads: U tokens of this lane's slot from local slot wl on, K and V, and its SL
  // scales (8-bit). Guarded: zeros, and no memory traffic, from n1 on; unguarded: every slot of
  // the warp's iteration is below n_main.
  const auto load = [&](bool guarded, int wl, Raw(&kr)[U], Raw(&vr)[U], float(&sc)[SL]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = lane_slot(wl, role.token_slot, u, NG);
      const uint32_t o = slot_offset(j, stride);
      if (!guarded || j < n1) {
        kr[u] = __ldg(reinterpret_cast<const Raw*>(kbase + o));
        vr[u] = __ldg(reinterpret_cast<const Raw*>(vbase + o));
      } else {
        kr[u] = V::zero();
        vr[u] = V::zero();
      }
    }
#pragma unroll
    for (int k = 0; k < SL; ++k) {
      sc[k] = 0.0f;
      if constexpr (kQuant) {
        const int j = lane_slot(wl, role.token_slot, su[k], NG);
        if (!guarded || j < n1) sc[k] = __ldg(sbase[k] + slot_offset(j, sstride));
      }
    }
  };

  // The math of one set of loads (wl is the same in every lane of the warp, so every shuffle
  // below sees the whole warp). Guarded: values past the held row's limit are hidden;
  // unguarded: every value of a row of the block is visible.
  const auto step = [&](bool guarded, int wl, const Raw(&kr)[U], const Raw(&vr)[U],
                        const float(&sc)[SL]) {
    // Partial dot products of this lane's elements, value v = r * U + u.
    float a[N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      V::widen(kr[u], kf);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) d = fmaf(q[r][e], kf[e], d);
        a[r * U + u] = d;
      }
    }
    rs_reduce<N, LPT>(a, sub, [](float x, int off) { return __shfl_xor_sync(kFull, x, off, LPT); });
    // The held logits (base 2), -inf where the causal rule or the split's end hides the token.
    float x[P];
    float mx = kNegInfF;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      float s = a[i];
      if constexpr (kQuant)  // the K scale of the value's token, from the lane that loaded it
        s *= __shfl_sync(kFull, sc[0], scale_lane(k_scale_index(held_load[i]), LPT), LPT);
      bool seen = held_live;
      if (guarded) seen = lane_slot(wl, role.token_slot, held_load[i], NG) < held_lim;
      x[i] = seen ? s : kNegInfF;
      mx = i == 0 ? x[i] : nan_max(mx, x[i]);
    }
    // The row's max over its lanes, then every row's new max in every lane (from the row's
    // first holder, so that all the token's lanes agree to the bit).
#pragma unroll
    for (int off = LV; off < RL; off <<= 1) mx = nan_max(mx, __shfl_xor_sync(kFull, mx, off, LPT));
    float mn[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      mn[r] = nan_max(m[r], __shfl_sync(kFull, mx, rs_holder(r * U, N, LPT), LPT));
    // The weights of the held values: one exp2 per (token, row), not one per lane. The row's
    // new max from this lane's own row max and m_held: the bits of mn[held_row].
    const float mr = nan_max(m_held, mx);
    m_held = mr;
    float w[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      w[i] = x[i] == kNegInfF ? 0.0f : exp2f(x[i] - mr);
    }
    // Rescale the rows whose max changed. An unchanged max would scale by exp2(0) = 1 (no bit
    // changes); a row still at -inf has l = 0 and acc = 0 (nothing was added), which a scale of
    // 0 would leave as they are; a NaN max is never equal to itself and rescales (to NaN).
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (mn[r] == m[r]) continue;
      if (m[r] != kNegInfF) {
        const float scale = exp2f(m[r] - mn[r]);
        l[r] *= scale;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][e] *= scale;
      }
      m[r] = mn[r];
    }
    // Every weight to every lane of the token, and the weighted V.
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[VEC];
      V::widen(vr[u], vf);
      float vs = 1.0f;  // the V scale of load u, from the lane that loaded it
      if constexpr (kQuant)
        vs = __shfl_sync(kFull, sc[scale_reg(v_scale_index(u, U), LPT)],
                         scale_lane(v_scale_index(u, U), LPT), LPT);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int v = r * U + u;
        const float pu = __shfl_sync(kFull, w[rs_slot(v, N, LPT)], rs_holder(v, N, LPT), LPT);
        if (pu != 0.0f) {  // a hidden token's V (even NaN) never enters the sums
          l[r] += pu;
          const float pv = kQuant ? pu * vs : pu;
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[r][e] = fmaf(pv, vf[e], acc[r][e]);
        }
      }
    }
  };

  // The token walk, software-pipelined: the next set's loads are in flight during this set's
  // math (two register sets; the loop body ends by moving the next set into this one). First the
  // iterations whose slots every row sees, unguarded; the last of them prefetches the tail's
  // first set guarded. Then the guarded tail up to n1.
  int wl = warp_first_slot(warp, TPW);
  Raw kr[U], vr[U];
  float sc[SL];
  const auto advance = [&](Raw(&kn)[U], Raw(&vn)[U], float(&scn)[SL]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kr[u] = kn[u];
      vr[u] = vn[u];
    }
#pragma unroll
    for (int k = 0; k < SL; ++k) sc[k] = scn[k];
  };
  if (unguarded_iteration(wl, kSpan, n_main)) {
    load(false, wl, kr, vr, sc);
    for (;;) {
      const int next = wl + kStep;
      const bool more = unguarded_iteration(next, kSpan, n_main);
      Raw kn[U], vn[U];
      float scn[SL];
      if (more)
        load(false, next, kn, vn, scn);
      else
        load(true, next, kn, vn, scn);
      step(false, wl, kr, vr, sc);
      advance(kn, vn, scn);
      wl = next;
      if (!more) break;
    }
  } else {
    load(true, wl, kr, vr, sc);
  }
  for (; wl < n1; wl += kStep) {
    Raw kn[U], vn[U];
    float scn[SL];
    load(true, wl + kStep, kn, vn, scn);
    step(true, wl, kr, vr, sc);
    advance(kn, vn, scn);
  }

  // Merge the token groups of the warp (lanes with the same elements, other token slots).
#pragma unroll
  for (int off = LPT; off < kWarpSize; off <<= 1) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float mo = __shfl_xor_sync(kFull, m[r], off);
      const float lo = __shfl_xor_sync(kFull, l[r], off);
      float ao[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) ao[e] = __shfl_xor_sync(kFull, acc[r][e], off);
      combine2<VEC>(m[r], l[r], acc[r], mo, lo, ao);
    }
  }

  // Merge the warps through shared memory and write one record per row: the split's record
  // (p.out + split * split_stride), which is the final state when there is one split.
  __shared__ float sm_m[kDecodeWarps][ROWS];
  __shared__ float sm_l[kDecodeWarps][ROWS];
  __shared__ float sm_o[kDecodeWarps][ROWS][D];
  if (role.token_slot == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) sm_o[warp][r][role.dim0 + e] = acc[r][e];
      if (role.dim0 == 0) {
        sm_m[warp][r] = m[r];
        sm_l[warp][r] = l[r];
      }
    }
  }
  __syncthreads();
  float* const split_out = p.out + static_cast<int64_t>(it.split) * p.split_stride;
  for (int idx = static_cast<int>(threadIdx.x); idx < ROWS * D; idx += kDecodeThreads) {
    const int r = idx / D, d = idx % D;  // D is a power of 2: shifts
    if (sm_rec[r] < 0) continue;
    float* rec = split_out + sm_rec[r] * (D + 2);
    float mt = sm_m[0][r];
#pragma unroll
    for (int w = 1; w < kDecodeWarps; ++w) mt = nan_max(mt, sm_m[w][r]);
    if (mt == kNegInfF) {  // the empty state
      rec[2 + d] = 0.0f;
      if (d == 0) {
        rec[0] = kNegInfF;
        rec[1] = 0.0f;
      }
      continue;
    }
    float lt = 0.0f, ot = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float mw = sm_m[w][r];
      if (mw == kNegInfF) continue;
      const float wgt = exp2f(mw - mt);
      lt = fmaf(wgt, sm_l[w][r], lt);
      ot = fmaf(wgt, sm_o[w][r][d], ot);
    }
    rec[2 + d] = ot;
    if (d == 0) {
      rec[0] = mt * kLn2f;
      rec[1] = lt;
    }
  }
  if (p.final_out == nullptr) return;

  // The fused split merge: every block of the item takes a ticket after its record is visible
  // device-wide; the block with the last one merges the item's splits and resets the counter.
  // Every block of the item reaches this point (no early return above), so exactly one merges.
  __threadfence();  // this thread's record stores before the ticket (release)
  __syncthreads();  // every thread's stores and fences before thread 0 takes it
  __shared__ int sm_last;
  const uint32_t tk =
      ticket_index(it, static_cast<uint32_t>(p.row_groups), static_cast<uint32_t>(p.kv_heads));
  if (threadIdx.x == 0)
    sm_last = atomicAdd(p.tickets + tk, 1u) == static_cast<unsigned>(p.splits - 1) ? 1 : 0;
  __syncthreads();
  if (!sm_last) return;
  __threadfence();  // acquire: the other blocks' records, read through L2 below
  merge_item_splits<D, ROWS>(p, sm_rec, warp, lane);
  if (threadIdx.x == 0) p.tickets[tk] = 0u;  // 0 again for the next launch or graph replay
}

// The kernel instance of one dtype, head dim and row count (nullptr for others, and for 8 rows of
// 8-bit K/V).
using DecodeKernelFn = void (*)(DecodeParams);

template <DType T, int D>
DecodeKernelFn decode_kernel_rows(int rows_tpl) {
  switch (rows_tpl) {
    case 1:
      return decode_split_kernel<T, D, 1>;
    case 2:
      return decode_split_kernel<T, D, 2>;
    case 4:
      return decode_split_kernel<T, D, 4>;
    case 8:
      if constexpr (max_rows_per_cta(T) >= 8) return decode_split_kernel<T, D, 8>;
      return nullptr;
    default:
      return nullptr;
  }
}

template <DType T>
DecodeKernelFn decode_kernel_for(int head_dim, int rows_tpl) {
  switch (head_dim) {
    case 64:
      return decode_kernel_rows<T, 64>(rows_tpl);
    case 128:
      return decode_kernel_rows<T, 128>(rows_tpl);
    default:
      return nullptr;
  }
}

template <DType T>
cudaError_t launch_decode_dtype(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                                cudaStream_t stream) {
  if (blocks <= 0 || blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const DecodeKernelFn fn = decode_kernel_for<T>(head_dim, rows_tpl);
  if (fn == nullptr) return cudaErrorInvalidValue;
  if (p.splits > 1 && p.final_out != nullptr && p.tickets == nullptr) return cudaErrorInvalidValue;
  fn<<<dim3(static_cast<unsigned>(blocks)), kDecodeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Resident blocks per SM of one instance (cudaOccupancyMaxActiveBlocksPerMultiprocessor).
template <DType T>
cudaError_t decode_occupancy_dtype(int head_dim, int rows_tpl, int* blocks_per_sm) {
  const DecodeKernelFn fn = decode_kernel_for<T>(head_dim, rows_tpl);
  if (fn == nullptr) return cudaErrorInvalidValue;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, fn, kDecodeThreads, 0);
}

}  // namespace treeattn::gpu
