// executor_cuda.hpp in a build without CUDA (TREEATTN_WITH_CUDA=OFF, or AUTO where no nvcc was
// found): the same functions, each saying that this build has no CUDA executor.
#include "kernels/cuda/cuda_presence.hpp"
#include "treeattn/executor_cuda.hpp"

namespace treeattn {
namespace {

Status no_cuda(const char* op) {
  return unsupported(std::string(op) +
                     ": this treeattn was built without CUDA (configure with "
                     "-DTREEATTN_WITH_CUDA=ON on a machine with the CUDA toolkit)");
}

}  // namespace

bool cuda_built() { return false; }

gpu::CudaProbe gpu::probe_cuda() { return CudaProbe{}; }  // built = false

int cuda_device_count(std::string* why) {
  if (why) *why = "this treeattn was built without CUDA";
  return 0;
}

Result<std::unique_ptr<Executor>> make_cuda_executor(const CudaExecutorOptions&) {
  return no_cuda("make_cuda_executor");
}
Result<CudaDeviceInfo> cuda_device_info(const Executor&) { return no_cuda("cuda_device_info"); }
Result<void*> cuda_stream(const Executor&) { return no_cuda("cuda_stream"); }
Status cuda_capture_begin(Executor&) { return no_cuda("cuda_capture_begin"); }
Result<std::unique_ptr<CudaGraph>> cuda_capture_end(Executor&) {
  return no_cuda("cuda_capture_end");
}

}  // namespace treeattn
