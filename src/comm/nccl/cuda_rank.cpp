// open_cuda_rank (comm_nccl.hpp): a rank's GPU and its NCCL communicator, agreed by every rank.
// Through the public executor_cuda.hpp and comm_nccl.hpp calls only (no CUDA or NCCL header
// here), so it builds, and refuses with their kUnsupported, where either is missing.
#include <cstdio>
#include <string>

#include "treeattn/comm_nccl.hpp"
#include "treeattn/executor_cuda.hpp"

namespace treeattn {
namespace {

std::string plural(int n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// "device cuda: NVIDIA H200 (sm_90, 141 GiB)"
std::string describe_cuda(const Executor& e) {
  auto info = cuda_device_info(e);
  if (!info.is_ok()) return "device cuda";
  char text[256];
  std::snprintf(text, sizeof(text), "device cuda: %s (sm_%d%d, %.0f GiB)", info->name.c_str(),
                info->cc_major, info->cc_minor,
                static_cast<double>(info->memory_bytes) / (1ull << 30));
  return text;
}

// The GPU of this rank: its place among the ranks of its host (the host split of the world),
// which every launcher gives, rather than a launcher's local-rank variable, which some do not set.
CudaExecutorOptions local_device(const Communicator& host, int gpus) {
  CudaExecutorOptions o;
  if (gpus > 0) o.device = host.rank() % gpus;
  return o;
}

}  // namespace

Result<CudaRank> open_cuda_rank(Communicator& world) {
  CudaRank dev;
  Status mine;
  // NCCL takes one GPU per rank: the ranks of a host must not outnumber its GPUs.
  auto host = world.split_shared(world.rank());
  std::string why;
  const int gpus = cuda_device_count(&why);
  if (!host.is_ok())
    mine = host.status();
  else if (gpus > 0 && (*host)->size() > gpus)
    mine = invalid_argument(std::to_string((*host)->size()) + " ranks on this host share its " +
                            plural(gpus, "GPU") +
                            "; --device cuda needs one GPU per rank (NCCL), so at most " +
                            plural(gpus, "rank") + " per host");
  else if (auto e = make_cuda_executor(local_device(**host, gpus)); e.is_ok())
    dev.executor = std::move(e).value();
  else
    mine = e.status();
  auto agreed = first_failure(world, mine);
  TREEATTN_RETURN_IF_ERROR(agreed.status());
  if (!agreed->empty()) return unsupported(*agreed);
  if (auto c = make_nccl_communicator(world, *dev.executor); c.is_ok())
    dev.comm = std::move(c).value();
  else
    mine = c.status();
  agreed = first_failure(world, mine);
  TREEATTN_RETURN_IF_ERROR(agreed.status());
  if (!agreed->empty()) return unsupported(*agreed);
  dev.description = describe_cuda(*dev.executor);
  return dev;
}

}  // namespace treeattn
