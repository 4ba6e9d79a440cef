// The few CUDA things the GPU check needs besides the executor (gpu_check_device.cu): device-side
// fill of a large bf16 or 8-bit cache with values the host can recompute, bandwidth probes, and
// stream timing with CUDA events. No CUDA types here; streams are the executor's (cuda_stream()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "treeattn/state.hpp"  // TREEATTN_HD
#include "treeattn/status.hpp"

namespace gpucheck {

// The synthetic cache's values, which the device writes and the host recomputes for the oracle
// (one definition for both: TREEATTN_HD).
// The hash of element i with this seed.
TREEATTN_HD inline uint64_t synthetic_hash(uint64_t seed, uint64_t i) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull + seed;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Element i of a bf16 cache: k / 128 for an integer k in [-127, 127], exact in bf16, f16 and
// float.
TREEATTN_HD inline float synthetic_value(uint64_t seed, uint64_t i) {
  return static_cast<float>(static_cast<int>(synthetic_hash(seed, i) % 255u) - 127) / 128.0f;
}
// Code i of an 8-bit cache: int8 in [-127, 127]; fp8 e4m3 with exponent field 4..11 (magnitudes
// 1/8 to 30, never NaN).
TREEATTN_HD inline uint8_t synthetic_code(uint64_t seed, uint64_t i, bool fp8) {
  const uint64_t h = synthetic_hash(seed, i);
  if (!fp8) return static_cast<uint8_t>(static_cast<int>(h % 255u) - 127);
  return static_cast<uint8_t>((h & 0x87u) | ((4u + (h >> 8) % 8u) << 3));
}
// Scale i (one per token and KV head): (1 + k) / 256 for k in [0, 7], exact.
TREEATTN_HD inline float synthetic_scale(uint64_t seed, uint64_t i) {
  return static_cast<float>(1 + synthetic_hash(seed, i) % 8u) / 256.0f;
}

// Writes synthetic_value(seed, i) as bf16 to p[i] for i < n, on the stream.
treeattn::Status fill_bf16(void* stream, void* p, std::size_t n, uint64_t seed);
// Writes synthetic_code(seed, i, fp8) to the bytes p[i], i < n, on the stream.
treeattn::Status fill_codes(void* stream, void* p, std::size_t n, uint64_t seed, bool fp8);
// Writes synthetic_scale(seed, i) to p[i], i < n, on the stream.
treeattn::Status fill_scales(void* stream, float* p, std::size_t n, uint64_t seed);

// Device-to-device copy bandwidth: cudaMemcpyAsync of `bytes` between two buffers of this size
// (allocated and freed here), best of `reps`, counting bytes read + bytes written.
treeattn::Result<double> copy_probe_gbps(void* stream, std::size_t bytes, int reps);
// Read bandwidth: a kernel that sums `bytes` of 16-byte words, best of `reps`.
treeattn::Result<double> read_probe_gbps(void* stream, std::size_t bytes, int reps);

// Milliseconds the work enqueued by fn on the stream takes (CUDA events around it; waits).
class StreamTimer {
 public:
  explicit StreamTimer(void* stream);
  ~StreamTimer();
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;
  treeattn::Status start();
  treeattn::Result<double> stop_ms();  // waits for the stop event

 private:
  void* stream_;
  void* begin_ = nullptr;
  void* end_ = nullptr;
};

}  // namespace gpucheck
