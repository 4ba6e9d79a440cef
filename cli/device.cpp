// --device for run, bench and verify (device.hpp).
#include "device.hpp"

#include <fmt/format.h>

#include "cluster.hpp"
#include "treeattn/comm_nccl.hpp"
#include "treeattn/executor_cuda.hpp"
#include "treeattn/launch.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn::cli {
// The communicator the sessions merge over on each device: MPI (host) or NCCL (comm_nccl.hpp).
CommCapabilities session_caps(Device d) {
  if (d == Device::kCpu) return CommCapabilities{};
  return CommCapabilities{MemorySpace::kDevice, /*user_reductions=*/false, /*stream_ordered=*/true};
}

std::vector<std::string> all_methods(Device d) {
  std::vector<std::string> v;
  for (const auto& i : StrategyRegistry::for_backend(session_caps(d)).list())
    v.emplace_back(i.name);
  return v;
}

Result<std::vector<std::string>> resolve_methods(const std::string& text, Device d) {
  if (text == "all") return all_methods(d);
  std::vector<std::string> v = split_list(text);
  const auto& reg = StrategyRegistry::for_backend(CommCapabilities{});
  const auto& here = StrategyRegistry::for_backend(session_caps(d));
  for (const auto& m : v) {
    if (m != "auto" && !reg.contains(m)) {
      std::string known;
      for (const auto& k : all_methods()) known += (known.empty() ? "" : ", ") + k;
      return invalid_argument("--methods: unknown method '" + m + "' (known: " + known +
                              ", auto (the planner's choice), or all)");
    }
    if (d == Device::kCuda && m == "auto")
      return invalid_argument(
          "--methods auto with --device cuda: the planner models CPU ranks "
          "and host links; name the methods (or all)");
    if (m != "auto" && !here.contains(m)) {
      std::string known;
      for (const auto& k : all_methods(d)) known += (known.empty() ? "" : ", ") + k;
      return invalid_argument("--methods: method '" + m + "' is not available with --device " +
                              device_name(d) +
                              " (NCCL has no user-defined reductions; there: " + known + ")");
    }
  }
  if (v.empty()) return invalid_argument("--methods: empty list");
  return v;
}

// Whether this build can run --device d (kept out of options.cpp, which the fuzzers link
// without the CUDA and NCCL libraries).
Status check_device_built(Device d) {
  if (d == Device::kCpu) return Status::ok();
  if (!cuda_built())
    return unsupported(
        "--device cuda: this treeattn was built without CUDA (nvcc was not found at configure "
        "time; see README, GPUs)");
  // The strategies need a communicator in the executor's memory, even for one rank: NCCL.
  if (!nccl_built())
    return unsupported(
        "--device cuda: this treeattn was built with CUDA but without NCCL, which the ranks' "
        "communicator on the GPU needs, even for one rank (NCCL was not found at configure time; "
        "see README, GPUs)");
  return Status::ok();
}

Status check_device_here(Device d) {
  if (d != Device::kCuda || launch::started_by_mpi_launcher() || launch::launch_names_hosts())
    return Status::ok();
  std::string why;
  if (cuda_device_count(&why) == 0)
    return unsupported("--device cuda: no CUDA device for the ranks on this machine" +
                       (why.empty() ? std::string() : ": " + why));
  return Status::ok();
}

// Collective over world. --device cuda: this rank's GPU and NCCL communicator (open_cuda_rank,
// comm_nccl.hpp); the CPU: an empty RankDevice.
Result<RankDevice> open_device(Communicator& world, Device d) {
  RankDevice dev;
  if (d == Device::kCpu) return dev;
  auto rank = open_cuda_rank(world);
  TREEATTN_RETURN_IF_ERROR(rank.status());
  dev.executor = std::move(rank->executor);
  dev.comm = std::move(rank->comm);
  dev.description = std::move(rank->description);
  return dev;
}

}  // namespace treeattn::cli
