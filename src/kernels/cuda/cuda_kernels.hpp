// The CUDA kernels' launch interface, shared by the .cu files that define the kernels and the
// executor (cuda_executor.cpp) that calls them. Internal to treeattn_cuda; includes only the CUDA
// runtime API header (types cudaStream_t and cudaError_t), no device code.
//
// Every launcher enqueues on the given stream and returns cudaGetLastError() of the launch (a
// bad configuration); faults inside a kernel surface at the next synchronizing call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/decode_geometry.hpp"

namespace treeattn::gpu {

// Everything the split-KV decode kernel reads, passed by value (the per-row lengths of up to
// kMaxBatchPerLaunch batch rows travel here, so a launch needs no metadata copy and a CUDA graph
// can capture it). Element strides as in KVShard (shape.hpp); scales only for fp8 / int8.
struct DecodeParams {
  const float* q = nullptr;  // [batch][q_len][heads][head_dim]
  const void* k = nullptr;
  const void* v = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  float* out = nullptr;  // split s's records at out + s * split_stride, [batch][q_len][heads]
  // The fused split merge (splits > 1): the final records, [batch][q_len][heads], and one ticket
  // counter per (batch row of the launch, KV head, row group) (tickets_per_launch), all 0 before
  // the launch and left 0 after it. nullptr: no merge (partial_chunks keeps every split's records).
  float* final_out = nullptr;
  unsigned int* tickets = nullptr;
  int64_t stride_batch = 0, stride_head = 0, stride_token = 0;
  int64_t scale_stride_batch = 0, scale_stride_head = 0, scale_stride_token = 0;
  int64_t pos_stride = 1;
  int64_t chunk = 1;         // token slots per split
  int64_t split_stride = 0;  // floats between the record arrays of consecutive splits
  int64_t splits = 1;
  int64_t row_groups = 1;
  int64_t rows_total = 1;  // G * Q
  int64_t b0 = 0;          // first batch row of this launch
  int64_t heads = 1, kv_heads = 1, group = 1, q_len = 1;
  float qscale = 1.0f;  // softmax scale * log2(e): the kernel works in base 2
  int64_t len[kMaxBatchPerLaunch] = {};
  int64_t pos_start[kMaxBatchPerLaunch] = {};
  int64_t total_len[kMaxBatchPerLaunch] = {};
};

// One launch of blocks thread blocks of kDecodeThreads threads; head_dim in kCudaHeadDims and
// rows_tpl in {1, 2, 4, 8} (8-bit K/V: {1, 2, 4}, max_rows_per_cta), else cudaErrorInvalidValue
// (also for a merge without tickets).
cudaError_t launch_decode_f32(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                              cudaStream_t stream);
cudaError_t launch_decode_f16(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                              cudaStream_t stream);
cudaError_t launch_decode_bf16(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                               cudaStream_t stream);
cudaError_t launch_decode_fp8(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                              cudaStream_t stream);
cudaError_t launch_decode_int8(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                               cudaStream_t stream);

// Resident blocks per SM of the instance (cudaOccupancyMaxActiveBlocksPerMultiprocessor on the
// current device): the planner's wave is SMs x this.
cudaError_t decode_occupancy_f32(int head_dim, int rows_tpl, int* blocks_per_sm);
cudaError_t decode_occupancy_f16(int head_dim, int rows_tpl, int* blocks_per_sm);
cudaError_t decode_occupancy_bf16(int head_dim, int rows_tpl, int* blocks_per_sm);
cudaError_t decode_occupancy_fp8(int head_dim, int rows_tpl, int* blocks_per_sm);
cudaError_t decode_occupancy_int8(int head_dim, int rows_tpl, int* blocks_per_sm);

// The launcher and the occupancy query of K/V dtype t ({nullptr, nullptr} for a dtype without a
// kernel).
struct DecodeEntry {
  cudaError_t (*launch)(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                        cudaStream_t stream) = nullptr;
  cudaError_t (*occupancy)(int head_dim, int rows_tpl, int* blocks_per_sm) = nullptr;
};
inline DecodeEntry decode_entry(DType t) {
  switch (t) {
    case DType::kF32:
      return {launch_decode_f32, decode_occupancy_f32};
    case DType::kF16:
      return {launch_decode_f16, decode_occupancy_f16};
    case DType::kBF16:
      return {launch_decode_bf16, decode_occupancy_bf16};
    case DType::kFP8:
      return {launch_decode_fp8, decode_occupancy_fp8};
    case DType::kInt8:
      return {launch_decode_int8, decode_occupancy_int8};
  }
  return {};
}

// ---- state records (state.hpp), one warp per record (state_kernels.cu) --------------------------
// out[i] <- (init ? init[i] : empty) (+) parts[0][i] (+) ... (+) parts[count-1][i], part k at
// parts + k * part_stride floats. out may be init (in place).
cudaError_t launch_merge(const float* init, const float* parts, int64_t count, int64_t part_stride,
                         int64_t n, int64_t head_dim, float* out, cudaStream_t stream);
cudaError_t launch_set_empty(float* states, int64_t n, int64_t head_dim, cudaStream_t stream);
cudaError_t launch_lse(const float* states, int64_t n, int64_t head_dim, float* lse,
                       cudaStream_t stream);
cudaError_t launch_normalize(const float* states, int64_t n, int64_t head_dim, float* out,
                             float* lse, cudaStream_t stream);
cudaError_t launch_to_sum_form(const float* states, const float* max_lse, int64_t n,
                               int64_t head_dim, float* num, int64_t num_stride, float* den,
                               cudaStream_t stream);
cudaError_t launch_from_sum_form(const float* max_lse, const float* num, int64_t num_stride,
                                 const float* den, int64_t n, int64_t head_dim, float* states,
                                 cudaStream_t stream);

// cudaSuccess when the current device can run this build's kernels (cudaFuncGetAttributes of one
// of them: no image for the device's architecture is cudaErrorNoKernelImageForDevice).
cudaError_t probe_kernel_image();

}  // namespace treeattn::gpu
