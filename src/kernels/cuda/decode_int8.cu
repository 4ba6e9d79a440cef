// The split-KV decode kernel instances for int8 K/V (head dims 64 and 128, 1/2/4 rows per block:
// max_rows_per_cta): one file per dtype so that the instances compile in parallel.
#include "kernels/cuda/decode_kernel.cuh"

namespace treeattn::gpu {

cudaError_t launch_decode_int8(int head_dim, int rows_tpl, const DecodeParams& p, int64_t blocks,
                               cudaStream_t stream) {
  return launch_decode_dtype<DType::kInt8>(head_dim, rows_tpl, p, blocks, stream);
}

cudaError_t decode_occupancy_int8(int head_dim, int rows_tpl, int* blocks_per_sm) {
  return decode_occupancy_dtype<DType::kInt8>(head_dim, rows_tpl, blocks_per_sm);
}

}  // namespace treeattn::gpu
