// Whether this machine has no CUDA device or driver at all (a GPU test skips, gpu_check exits
// 2), as opposed to a GPU environment that is there but broken (a test fails). No CUDA headers:
// the classification is plain code, tested on any machine (tests/cuda/test_cuda_presence.cpp);
// probe_cuda() is in cuda_executor.cpp (cuda_none.cpp in a build without CUDA).
//
// Absent (skip), and only these:
// - a build without CUDA;
// - cudaGetDeviceCount returns cudaErrorNoDevice (a driver, no device: none installed, or
//   CUDA_VISIBLE_DEVICES hides them all), or succeeds with 0 devices;
// - cudaErrorInsufficientDriver while cudaDriverGetVersion reports 0, which it does when no
//   driver is installed (the runtime reports "insufficient driver" for a missing libcuda too);
// - cudaErrorStubLibrary: the process loaded the toolkit's stub libcuda, which a machine with
//   the toolkit and no driver has.
// Everything else is a failure: a driver older than the runtime (cudaErrorInsufficientDriver
// with a driver version > 0), a driver/kernel-module mismatch (cudaErrorSystemDriverMismatch),
// busy or unavailable devices, a missing architecture image, an allocation failure, any error
// once a device is there.
#pragma once

#include <string>

namespace treeattn::gpu {

// cudaError_t values the classification names (cuda_executor.cpp static_asserts them).
inline constexpr int kCudaSuccess = 0;
inline constexpr int kCudaErrorStubLibrary = 34;
inline constexpr int kCudaErrorInsufficientDriver = 35;
inline constexpr int kCudaErrorNoDevice = 100;

// What the machine says, as plain values.
struct CudaProbe {
  bool built = false;      // this build has the CUDA executor
  int count_error = 0;     // the cudaError_t of cudaGetDeviceCount
  int device_count = 0;    // its count, when it succeeded
  int driver_version = 0;  // cudaDriverGetVersion (0: no driver installed)
  std::string error_name;  // "cudaErrorNoDevice", for messages
};

CudaProbe probe_cuda();

// Empty when a CUDA device and driver are present (so any failure to use them is a failure);
// otherwise why there is none, for the skip message.
inline std::string cuda_absence(const CudaProbe& p) {
  if (!p.built) return "this treeattn was built without CUDA";
  if (p.count_error == kCudaSuccess)
    return p.device_count > 0 ? std::string() : "cudaGetDeviceCount found 0 devices";
  if (p.count_error == kCudaErrorNoDevice) return "no CUDA device (" + p.error_name + ")";
  if (p.count_error == kCudaErrorInsufficientDriver && p.driver_version == 0)
    return "no NVIDIA driver installed (" + p.error_name + ", driver version 0)";
  if (p.count_error == kCudaErrorStubLibrary)
    return "only the CUDA toolkit's stub driver library, no NVIDIA driver (" + p.error_name + ")";
  return std::string();  // present but broken: an old driver, a mismatch, ...: not a skip
}

}  // namespace treeattn::gpu
