// CUDA side of the GPU check (gpu_check_device.hpp): the synthetic fill, the bandwidth probes and
// the event timer.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "tools/gpu_check/gpu_check_device.hpp"

namespace gpucheck {
namespace {

treeattn::Status cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return treeattn::Status::ok();
  return treeattn::internal_error(std::string("gpu-check: ") + what + ": " + cudaGetErrorName(e) +
                                  ": " + cudaGetErrorString(e));
}

// p[i] = value(i) for i < n, a grid-stride loop.
template <class T, class Value>
__global__ void fill_kernel(T* p, std::size_t n, Value value) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = value(i);
}

struct Bf16Value {
  uint64_t seed;
  __device__ uint16_t operator()(std::size_t i) const {  // exact in bf16
    return static_cast<uint16_t>(__float_as_uint(synthetic_value(seed, i)) >> 16);
  }
};
struct CodeValue {
  uint64_t seed;
  bool fp8;
  __device__ uint8_t operator()(std::size_t i) const { return synthetic_code(seed, i, fp8); }
};
struct ScaleValue {
  uint64_t seed;
  __device__ float operator()(std::size_t i) const { return synthetic_scale(seed, i); }
};

__global__ void read_kernel(const uint4* p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads; practically never taken
}

int sm_count() {
  int dev = 0, sms = 0;
  (void)cudaGetDevice(&dev);
  (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms > 0 ? sms : 132;
}

template <class T, class Value>
treeattn::Status fill(void* stream, T* p, std::size_t n, Value value) {
  fill_kernel<<<sm_count() * 8, 256, 0, static_cast<cudaStream_t>(stream)>>>(p, n, value);
  return cuda(cudaGetLastError(), "fill kernel");
}

}  // namespace

treeattn::Status fill_bf16(void* stream, void* p, std::size_t n, uint64_t seed) {
  return fill(stream, static_cast<uint16_t*>(p), n, Bf16Value{seed});
}
treeattn::Status fill_codes(void* stream, void* p, std::size_t n, uint64_t seed, bool fp8) {
  return fill(stream, static_cast<uint8_t*>(p), n, CodeValue{seed, fp8});
}
treeattn::Status fill_scales(void* stream, float* p, std::size_t n, uint64_t seed) {
  return fill(stream, p, n, ScaleValue{seed});
}

StreamTimer::StreamTimer(void* stream) : stream_(stream) {
  cudaEvent_t b = nullptr, e = nullptr;
  (void)cudaEventCreate(&b);
  (void)cudaEventCreate(&e);
  begin_ = b;
  end_ = e;
}
StreamTimer::~StreamTimer() {
  if (begin_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(begin_));
  if (end_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(end_));
}
treeattn::Status StreamTimer::start() {
  return cuda(cudaEventRecord(static_cast<cudaEvent_t>(begin_), static_cast<cudaStream_t>(stream_)),
              "cudaEventRecord");
}
treeattn::Result<double> StreamTimer::stop_ms() {
  TREEATTN_RETURN_IF_ERROR(
      cuda(cudaEventRecord(static_cast<cudaEvent_t>(end_), static_cast<cudaStream_t>(stream_)),
           "cudaEventRecord"));
  TREEATTN_RETURN_IF_ERROR(cuda(cudaEventSynchronize(static_cast<cudaEvent_t>(end_)),
                                "cudaEventSynchronize (a kernel failed?)"));
  float ms = 0;
  TREEATTN_RETURN_IF_ERROR(cuda(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin_), static_cast<cudaEvent_t>(end_)),
      "cudaEventElapsedTime"));
  return static_cast<double>(ms);
}

// Device memory freed at the end of the scope.
struct DeviceMemory {
  void* p = nullptr;
  ~DeviceMemory() {
    if (p) (void)cudaFree(p);
  }
};

// Best GB/s over reps timed runs of fn (after one warm-up) moving `bytes` per run.
template <class Fn>
treeattn::Result<double> best_gbps(void* stream, double bytes, int reps, Fn&& fn) {
  double best = 0;
  StreamTimer t(stream);
  for (int r = 0; r <= reps; ++r) {
    TREEATTN_RETURN_IF_ERROR(t.start());
    TREEATTN_RETURN_IF_ERROR(fn());
    auto ms = t.stop_ms();
    TREEATTN_RETURN_IF_ERROR(ms.status());
    if (r > 0) best = std::max(best, bytes / (*ms * 1e6));
  }
  return best;
}

treeattn::Result<double> copy_probe_gbps(void* stream, std::size_t bytes, int reps) {
  DeviceMemory a, b;
  TREEATTN_RETURN_IF_ERROR(cuda(cudaMalloc(&a.p, bytes), "cudaMalloc (copy probe)"));
  TREEATTN_RETURN_IF_ERROR(cuda(cudaMalloc(&b.p, bytes), "cudaMalloc (copy probe)"));
  const auto s = static_cast<cudaStream_t>(stream);
  TREEATTN_RETURN_IF_ERROR(cuda(cudaMemsetAsync(a.p, 1, bytes, s), "cudaMemsetAsync"));
  return best_gbps(stream, 2.0 * static_cast<double>(bytes), reps, [&] {
    return cuda(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s), "copy probe");
  });
}

treeattn::Result<double> read_probe_gbps(void* stream, std::size_t bytes, int reps) {
  DeviceMemory a, sink;
  TREEATTN_RETURN_IF_ERROR(cuda(cudaMalloc(&a.p, bytes), "cudaMalloc (read probe)"));
  TREEATTN_RETURN_IF_ERROR(cuda(cudaMalloc(&sink.p, sizeof(unsigned)), "cudaMalloc (read probe)"));
  const auto s = static_cast<cudaStream_t>(stream);
  TREEATTN_RETURN_IF_ERROR(cuda(cudaMemsetAsync(a.p, 1, bytes, s), "cudaMemsetAsync"));
  const int blocks = sm_count() * 8;
  return best_gbps(stream, static_cast<double>(bytes), reps, [&] {
    read_kernel<<<blocks, 512, 0, s>>>(static_cast<const uint4*>(a.p), bytes / 16,
                                       static_cast<unsigned*>(sink.p));
    return cuda(cudaGetLastError(), "read kernel");
  });
}

}  // namespace gpucheck
