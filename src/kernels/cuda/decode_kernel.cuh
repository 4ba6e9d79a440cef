// The CUDA split-KV decode kernel (flash-decoding): partial attention states of the queries of
// one KV head against one split of a KV shard in device memory.
//
// One thread block (CTA, kDecodeThreads threads) serves one item (decode_geometry.hpp): batch
// row b, KV head kvh, a group of up to 8 query rows (G heads x Q positions: the KV head is read
// once for all of them) and the token slots [split * chunk, (split + 1) * chunk). Each warp
// reads tokens_per_warp tokens per load (lane l: token slot l / lanes_per_token, vec elements of
// head_dim), each such token group keeps its own online-softmax state per row in registers, and
// the groups are merged (warp shuffles, then shared memory across warps) into one record per
// row, written to the split's record array. Splits are merged by the merge kernel
// (state_kernels.cu) with state.hpp's state_merge.
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

template <>
struct KvVec<DType::kFP8> {
  static constexpr int kVec = 8;
  using Elem = uint8_t;
  using Raw = uint2;
  __device__ static Raw zero() { return make_uint2(0u, 0u); }
  __device__ static void widen(const Raw& r, float (&f)[kVec]) {
    widen_fp8_pair(r.x, f + 0);
    widen_fp8_pair(r.x >> 16, f + 2);
    widen_fp8_pair(r.y, f + 4);
    widen_fp8_pair(r.y >> 16, f + 6);
  }
};

template <>
struct KvVec<DType::kInt8> {
  static constexpr int kVec = 8;
  using Elem = int8_t;
  using Raw = uint2;
  __device__ static Raw zero() { return make_uint2(0u, 0u); }
  __device__ static void widen(const Raw& r, float (&f)[kVec]) {
    const uint32_t w[2] = {r.x, r.y};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k)  // arithmetic shift: the sign-extended byte k
        f[4 * i + k] = static_cast<float>(static_cast<int32_t>(w[i] << (24 - 8 * k)) >> 24);
  }
};

template <DType T>
__device__ inline typename KvVec<T>::Raw load_vec(const void* base, int64_t elem) {
  using V = KvVec<T>;
  return __ldg(
      reinterpret_cast<const typename V::Raw*>(static_cast<const typename V::Elem*>(base) + elem));
}

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

template <DType T, int D, int ROWS>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_split_kernel(const __grid_constant__ DecodeParams p) {
  using V = KvVec<T>;
  constexpr int VEC = V::kVec;
  static_assert(VEC == vec_elems(T), "vector width differs from decode_geometry.hpp");
  static_assert(geometry_valid(T, D), "no lane geometry for this head dim");
  constexpr int LPT = lanes_per_token(T, D);
  constexpr int TPW = tokens_per_warp(T, D);
  constexpr int NG = token_groups(T, D);
  constexpr int U = unroll_tokens(ROWS);
  constexpr bool kQuant = T == DType::kFP8 || T == DType::kInt8;
  constexpr float kLn2f = 0.69314718055994531f;

  const ItemIndex it = decode_item(blockIdx.x, p.splits, p.row_groups, p.kv_heads);
  const int64_t bl = it.batch_in_launch;
  const int64_t b = p.b0 + bl;
  const int64_t kvh = it.kv_head;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const LaneRole role = lane_role(lane, T, D);
  const int64_t len = p.len[bl], pos0 = p.pos_start[bl], total = p.total_len[bl];

  // This lane's slice of every row's query, pre-scaled into base 2, and each row's limit.
  float q[ROWS][VEC];
  int64_t cnt[ROWS];
  int64_t cnt_max = 0;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int64_t gr = it.row_group * ROWS + r;
    const bool valid = gr < p.rows_total;
    const RowTarget tg = row_target(valid ? gr : 0, p.group, kvh);
    cnt[r] = valid ? visible_count(len, pos0, total, p.pos_stride, p.q_len, tg.query) : 0;
    cnt_max = cnt[r] > cnt_max ? cnt[r] : cnt_max;
    const float* qr = p.q + record_index(b, tg.query, tg.head, p.q_len, p.heads) * D + role.dim0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[r][e] = valid ? qr[e] * p.qscale : 0.0f;
  }
  const int64_t t0 = it.split * p.chunk;
  const int64_t t1 = t0 + p.chunk < cnt_max ? t0 + p.chunk : cnt_max;

  float m[ROWS], l[ROWS], acc[ROWS][VEC];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = kNegInfF;
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[r][e] = 0.0f;
  }

  const int64_t kv0 =
      kv_offset(b, kvh, 0, role.dim0, p.stride_batch, p.stride_head, p.stride_token);
  const int64_t sc0 = b * p.scale_stride_batch + kvh * p.scale_stride_head;

  // w0 is the same in every lane of the warp, so the shuffles below see the whole warp.
  for (int64_t w0 = warp_first_token(t0, warp, TPW); w0 < t1; w0 += cta_token_step(NG, U)) {
    typename V::Raw kr[U], vr[U];
    float ks[U], vs[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = lane_token(w0, role.token_slot, u, NG);
      ks[u] = vs[u] = 0.0f;
      if (j < t1) {
        kr[u] = load_vec<T>(p.k, kv0 + j * p.stride_token);
        vr[u] = load_vec<T>(p.v, kv0 + j * p.stride_token);
        if constexpr (kQuant) {
          ks[u] = __ldg(p.k_scale + sc0 + j * p.scale_stride_token);
          vs[u] = __ldg(p.v_scale + sc0 + j * p.scale_stride_token);
        }
      } else {
        kr[u] = V::zero();
        vr[u] = V::zero();
      }
    }
    float s[U][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      V::widen(kr[u], kf);
      const int64_t j = lane_token(w0, role.token_slot, u, NG);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) d = fmaf(q[r][e], kf[e], d);
#pragma unroll
        for (int off = LPT / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        if constexpr (kQuant) d *= ks[u];
        s[u][r] = (j < t1 && j < cnt[r]) ? d : kNegInfF;
      }
    }
    float vf[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) V::widen(vr[u], vf[u]);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float mx = s[0][r];
#pragma unroll
      for (int u = 1; u < U; ++u) mx = nan_max(mx, s[u][r]);
      const float mn = nan_max(m[r], mx);
      if (mn == kNegInfF) continue;  // nothing visible to this row yet
      const float sc = m[r] == kNegInfF ? 0.0f : exp2f(m[r] - mn);
      l[r] *= sc;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][e] *= sc;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pu = exp2f(s[u][r] - mn);
        if (pu != 0.0f) {
          l[r] += pu;
          const float pv = kQuant ? pu * vs[u] : pu;
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[r][e] = fmaf(pv, vf[u][e], acc[r][e]);
        }
      }
      m[r] = mn;
    }
  }

  // Merge the token groups of the warp (lanes with the same elements, other token slots).
#pragma unroll
  for (int off = LPT; off < kWarpSize; off <<= 1) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[r], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[r], off);
      float ao[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) ao[e] = __shfl_xor_sync(0xffffffffu, acc[r][e], off);
      combine2<VEC>(m[r], l[r], acc[r], mo, lo, ao);
    }
  }

  // Merge the warps through shared memory and write one record per row.
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
  float* const split_out = p.out + it.split * p.split_stride;
  for (int idx = static_cast<int>(threadIdx.x); idx < ROWS * D; idx += kDecodeThreads) {
    const int r = idx / D, d = idx % D;
    const int64_t gr = it.row_group * ROWS + r;
    if (gr >= p.rows_total) continue;
    const RowTarget tg = row_target(gr, p.group, kvh);
    float* rec = split_out + record_index(b, tg.query, tg.head, p.q_len, p.heads) * (D + 2);
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
}

// The launcher of one dtype: head_dim and the row template select the instance.
template <DType T, int D>
cudaError_t launch_decode_rows(int rows_tpl, const DecodeParams& p, int64_t blocks,
                               cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (rows_tpl) {
    case 1:
      decode_split_kernel<T, D, 1><<<grid, kDecodeThreads, 0, stream>>>(p);
      break;
    case 2:
      decode_split_kernel<T, D, 2><<<grid, kDecodeThreads, 0, stream>>>(p);
      break;
    case 4:
      decode_split_kernel<T, D, 4><<<grid, kDecodeThreads, 0, stream>>>(p);
      break;
    case 8:
      decode_split_kernel<T, D, 8><<<grid, kDecodeThreads, 0, stream>>>(p);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <DType T>
cudaError_t launch_decode_dtype(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                                cudaStream_t stream) {
  if (blocks <= 0 || blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  switch (head_dim) {
    case 64:
      return launch_decode_rows<T, 64>(rows_tpl, p, blocks, stream);
    case 128:
      return launch_decode_rows<T, 128>(rows_tpl, p, blocks, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace treeattn::gpu
