// When a GPU test skips and when it fails (src/kernels/cuda/cuda_presence.hpp), on any machine:
// skip only where there is no CUDA device or driver; an old driver, a driver mismatch or busy
// devices are failures.
#include <gtest/gtest.h>

#include <string>

#include "kernels/cuda/cuda_presence.hpp"
#include "treeattn/executor_cuda.hpp"

namespace treeattn {
namespace {

using gpu::cuda_absence;
using gpu::CudaProbe;

CudaProbe probe(int error, int count, int driver, const char* name = "cudaErrorX") {
  CudaProbe p;
  p.built = true;
  p.count_error = error;
  p.device_count = count;
  p.driver_version = driver;
  p.error_name = name;
  return p;
}

TEST(CudaPresence, NoDeviceOrNoDriverIsAbsent) {
  EXPECT_NE(cuda_absence(CudaProbe{}), "");  // a build without CUDA
  EXPECT_NE(cuda_absence(probe(gpu::kCudaErrorNoDevice, 0, 13000, "cudaErrorNoDevice")), "");
  EXPECT_NE(cuda_absence(probe(gpu::kCudaSuccess, 0, 13000)), "");
  // No driver installed: the runtime says "insufficient driver", the driver version is 0.
  const std::string none =
      cuda_absence(probe(gpu::kCudaErrorInsufficientDriver, 0, 0, "cudaErrorInsufficientDriver"));
  EXPECT_NE(none.find("no NVIDIA driver"), std::string::npos) << none;
  EXPECT_NE(cuda_absence(probe(gpu::kCudaErrorStubLibrary, 0, 0, "cudaErrorStubLibrary")), "");
}

TEST(CudaPresence, ABrokenGpuEnvironmentIsNotASkip) {
  EXPECT_EQ(cuda_absence(probe(gpu::kCudaSuccess, 1, 13000)), "");  // present
  // A driver older than the runtime: installed (version > 0), too old. Fail, do not skip.
  EXPECT_EQ(cuda_absence(probe(gpu::kCudaErrorInsufficientDriver, 0, 12020)), "");
  EXPECT_EQ(cuda_absence(probe(803, 0, 13000, "cudaErrorSystemDriverMismatch")), "");
  EXPECT_EQ(cuda_absence(probe(46, 0, 13000, "cudaErrorDevicesUnavailable")), "");
  EXPECT_EQ(cuda_absence(probe(999, 0, 13000, "cudaErrorUnknown")), "");
}

TEST(CudaPresence, ThisMachineAgreesWithTheFactory) {
  // Where the probe says there is no device, the executor factory cannot make one either (and
  // the GPU tests skip); where it says there is one, they must make one or fail.
  const CudaProbe p = gpu::probe_cuda();
  EXPECT_EQ(p.built, cuda_built());
  if (!cuda_absence(p).empty()) {
    EXPECT_FALSE(make_cuda_executor().is_ok());
    EXPECT_EQ(cuda_device_count(), 0);
  } else {
    EXPECT_GT(cuda_device_count(), 0);
  }
}

}  // namespace
}  // namespace treeattn
