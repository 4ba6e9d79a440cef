// The few CUDA things the GPU check needs besides the executor (gpu_check_device.cu): device-side
// fill of a large bf16 cache with values the host can recompute, bandwidth probes, and stream
// timing with CUDA events. No CUDA types here; streams are the executor's (cuda_stream()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "treeattn/status.hpp"

namespace gpucheck {

// Element i of the synthetic cache with this seed: k / 128 for an integer k in [-127, 127], exact
// in bf16, f16 and float (the host recomputes it for the oracle).
inline float synthetic_value(uint64_t seed, uint64_t i) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull + seed;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<int>(x % 255u) - 127) / 128.0f;
}

// Writes synthetic_value(seed, i) as bf16 to p[i] for i < n, on the stream.
treeattn::Status fill_bf16(void* stream, void* p, std::size_t n, uint64_t seed);

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
