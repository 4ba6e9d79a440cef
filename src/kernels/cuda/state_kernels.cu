// Device kernels of the state algebra (state.hpp) on packed records in device memory: merge
// (the split merge of the decode kernel and the executor's merge / merge_ordered), set_empty,
// lse, normalize and the paper's sum form.
//
// One warp per record. Lane l holds the record's fields m and l and the elements
// o[l], o[l + 32], ... in a small local record [m, l, o_l, o_{l+32}, ...] (padded with zeros to
// state_lane_elems(head_dim) elements) and calls the very state.hpp function the CPU executor
// calls (state_merge, state_normalize, state_to_sum_form, ...) on it: every operation on m and l
// is the same per lane (so every lane gets the same bits) and every element of o sees exactly the
// arithmetic the host function applies to it. This file is compiled with --fmad=false (no
// contraction of a * x + b * y into an FMA), as the host code is, so a device merge differs from
// the host one only where the device's expf / logf round differently (CUDA: <= 2 ulp).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.hpp"
#include "treeattn/state.hpp"

namespace treeattn::gpu {
namespace {

constexpr int kThreads = kStateWarpsPerBlock * kWarpSize;

// The local record of lane `lane` for K elements per lane.
template <int K>
struct Slice {
  float r[K + 2];
};

template <int K>
__device__ inline void load_slice(const float* rec, int64_t d, int lane, Slice<K>& s) {
  s.r[0] = rec[0];
  s.r[1] = rec[1];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t e = lane + static_cast<int64_t>(k) * kWarpSize;
    s.r[2 + k] = e < d ? rec[2 + e] : 0.0f;
  }
}

template <int K>
__device__ inline void store_slice(float* rec, int64_t d, int lane, const Slice<K>& s) {
  if (lane == 0) {
    rec[0] = s.r[0];
    rec[1] = s.r[1];
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t e = lane + static_cast<int64_t>(k) * kWarpSize;
    if (e < d) rec[2 + e] = s.r[2 + k];
  }
}

// The record this warp serves, or -1 past the end (warp-uniform).
__device__ inline int64_t warp_record(int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kStateWarpsPerBlock +
                    static_cast<int64_t>(threadIdx.x) / kWarpSize;
  return i < n ? i : -1;
}

template <int K>
__global__ void __launch_bounds__(kThreads)
    merge_kernel(const float* init, const float* parts, int64_t count, int64_t part_stride,
                 int64_t n, int64_t d, float* out) {
  const int64_t i = warp_record(n);
  if (i < 0) return;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t rf = static_cast<int64_t>(state_record_floats(static_cast<std::size_t>(d)));
  Slice<K> acc;
  if (init) {
    load_slice<K>(init + i * rf, d, lane, acc);
  } else {
    state_set_empty(acc.r, K);
  }
  // Loads of the next part are independent of the merge of this one; the unroll lets them overlap.
#pragma unroll 4
  for (int64_t c = 0; c < count; ++c) {
    Slice<K> x;
    load_slice<K>(parts + c * part_stride + i * rf, d, lane, x);
    state_merge(acc.r, x.r, K);
  }
  __syncwarp();  // every lane has read m and l before lane 0 may overwrite them (out == init)
  store_slice<K>(out + i * rf, d, lane, acc);
}

__global__ void set_empty_kernel(float* states, int64_t total, int64_t rf) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t f = i % rf;
  states[i] = f == static_cast<int64_t>(kStateM) ? state_neg_inf<float>() : 0.0f;
}

__global__ void lse_kernel(const float* states, int64_t n, int64_t rf, float* lse) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  lse[i] = state_lse(states + i * rf);
}

template <int K>
__global__ void __launch_bounds__(kThreads)
    normalize_kernel(const float* states, int64_t n, int64_t d, float* out, float* lse) {
  const int64_t i = warp_record(n);
  if (i < 0) return;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t rf = d + 2;
  Slice<K> s;
  load_slice<K>(states + i * rf, d, lane, s);
  float o[K];
  float l = 0.0f;
  state_normalize(s.r, K, o, &l);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t e = lane + static_cast<int64_t>(k) * kWarpSize;
    if (e < d) out[i * d + e] = o[k];
  }
  if (lse && lane == 0) lse[i] = l;
}

template <int K>
__global__ void __launch_bounds__(kThreads)
    to_sum_form_kernel(const float* states, const float* max_lse, int64_t n, int64_t d, float* num,
                       int64_t num_stride, float* den) {
  const int64_t i = warp_record(n);
  if (i < 0) return;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  Slice<K> s;
  load_slice<K>(states + i * (d + 2), d, lane, s);
  float nm[K];
  float w = 0.0f;
  state_to_sum_form(s.r, max_lse[i], K, nm, &w);
  float* dst = num + i * num_stride;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t e = lane + static_cast<int64_t>(k) * kWarpSize;
    if (e < d) dst[e] = nm[k];
  }
  if (lane == 0) {
    if (den)
      den[i] = w;
    else
      dst[d] = w;
  }
}

template <int K>
__global__ void __launch_bounds__(kThreads)
    from_sum_form_kernel(const float* max_lse, const float* num, int64_t num_stride,
                         const float* den, int64_t n, int64_t d, float* states) {
  const int64_t i = warp_record(n);
  if (i < 0) return;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const float* src = num + i * num_stride;
  float nm[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t e = lane + static_cast<int64_t>(k) * kWarpSize;
    nm[k] = e < d ? src[e] : 0.0f;
  }
  const float w = den ? den[i] : src[d];
  Slice<K> s;
  state_from_sum_form(max_lse[i], nm, w, K, s.r);
  __syncwarp();
  store_slice<K>(states + i * (d + 2), d, lane, s);
}

dim3 warp_grid(int64_t n) {
  return dim3(static_cast<unsigned>((n + kStateWarpsPerBlock - 1) / kStateWarpsPerBlock));
}
dim3 flat_grid(int64_t n, int threads) {
  return dim3(static_cast<unsigned>((n + threads - 1) / threads));
}
// Grids stay below 2^31 blocks.
bool too_many(int64_t n) { return n <= 0 || n / kStateWarpsPerBlock >= 0x7fffffffLL; }

}  // namespace

cudaError_t probe_kernel_image() {
  cudaFuncAttributes a{};
  return cudaFuncGetAttributes(&a, merge_kernel<4>);
}

cudaError_t launch_merge(const float* init, const float* parts, int64_t count, int64_t part_stride,
                         int64_t n, int64_t head_dim, float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (too_many(n)) return cudaErrorInvalidConfiguration;
  switch (state_lane_elems(head_dim)) {
    case 2:
      merge_kernel<2><<<warp_grid(n), kThreads, 0, stream>>>(init, parts, count, part_stride, n,
                                                             head_dim, out);
      break;
    case 4:
      merge_kernel<4><<<warp_grid(n), kThreads, 0, stream>>>(init, parts, count, part_stride, n,
                                                             head_dim, out);
      break;
    case 8:
      merge_kernel<8><<<warp_grid(n), kThreads, 0, stream>>>(init, parts, count, part_stride, n,
                                                             head_dim, out);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_set_empty(float* states, int64_t n, int64_t head_dim, cudaStream_t stream) {
  const int64_t total = n * (head_dim + 2);
  if (total == 0) return cudaSuccess;
  if (too_many(total)) return cudaErrorInvalidConfiguration;
  set_empty_kernel<<<flat_grid(total, 256), 256, 0, stream>>>(states, total, head_dim + 2);
  return cudaGetLastError();
}

cudaError_t launch_lse(const float* states, int64_t n, int64_t head_dim, float* lse,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (too_many(n)) return cudaErrorInvalidConfiguration;
  lse_kernel<<<flat_grid(n, 256), 256, 0, stream>>>(states, n, head_dim + 2, lse);
  return cudaGetLastError();
}

cudaError_t launch_normalize(const float* states, int64_t n, int64_t head_dim, float* out,
                             float* lse, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (too_many(n)) return cudaErrorInvalidConfiguration;
  switch (state_lane_elems(head_dim)) {
    case 2:
      normalize_kernel<2><<<warp_grid(n), kThreads, 0, stream>>>(states, n, head_dim, out, lse);
      break;
    case 4:
      normalize_kernel<4><<<warp_grid(n), kThreads, 0, stream>>>(states, n, head_dim, out, lse);
      break;
    case 8:
      normalize_kernel<8><<<warp_grid(n), kThreads, 0, stream>>>(states, n, head_dim, out, lse);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_to_sum_form(const float* states, const float* max_lse, int64_t n,
                               int64_t head_dim, float* num, int64_t num_stride, float* den,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (too_many(n)) return cudaErrorInvalidConfiguration;
  switch (state_lane_elems(head_dim)) {
    case 2:
      to_sum_form_kernel<2><<<warp_grid(n), kThreads, 0, stream>>>(states, max_lse, n, head_dim,
                                                                   num, num_stride, den);
      break;
    case 4:
      to_sum_form_kernel<4><<<warp_grid(n), kThreads, 0, stream>>>(states, max_lse, n, head_dim,
                                                                   num, num_stride, den);
      break;
    case 8:
      to_sum_form_kernel<8><<<warp_grid(n), kThreads, 0, stream>>>(states, max_lse, n, head_dim,
                                                                   num, num_stride, den);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_from_sum_form(const float* max_lse, const float* num, int64_t num_stride,
                                 const float* den, int64_t n, int64_t head_dim, float* states,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (too_many(n)) return cudaErrorInvalidConfiguration;
  switch (state_lane_elems(head_dim)) {
    case 2:
      from_sum_form_kernel<2><<<warp_grid(n), kThreads, 0, stream>>>(max_lse, num, num_stride, den,
                                                                     n, head_dim, states);
      break;
    case 4:
      from_sum_form_kernel<4><<<warp_grid(n), kThreads, 0, stream>>>(max_lse, num, num_stride, den,
                                                                     n, head_dim, states);
      break;
    case 8:
      from_sum_form_kernel<8><<<warp_grid(n), kThreads, 0, stream>>>(max_lse, num, num_stride, den,
                                                                     n, head_dim, states);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace treeattn::gpu
