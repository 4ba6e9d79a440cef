// --device for run, bench and verify (device.hpp).
#include "device.hpp"

#include <fmt/format.h>

#include "cluster.hpp"
#include "launcher.hpp"
#include "treeattn/comm_nccl.hpp"
#include "treeattn/executor_cuda.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn::cli {
namespace {

// "device cuda: NVIDIA H200 (sm_90, 141 GiB)"
std::string describe_cuda(const Executor& e) {
  auto info = cuda_device_info(e);
  if (!info.is_ok()) return "device cuda";
  return fmt::format("device cuda: {} (sm_{}{}, {:.0f} GiB)", info->name, info->cc_major,
                     info->cc_minor, static_cast<double>(info->memory_bytes) / (1ull << 30));
}

}  // namespace

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
  if (d != Device::kCuda || started_by_mpi_launcher() || launch_names_hosts())
    return Status::ok();
  std::string why;
  if (cuda_device_count(&why) == 0)
    return unsupported("--device cuda: no CUDA device for the ranks on this machine" +
                       (why.empty() ? std::string() : ": " + why));
  return Status::ok();
}

// Collective over world: the message of the lowest rank whose `mine` failed ("rank R: ...",
// and how many others failed), the same on every rank; empty when every rank succeeded. So a
// rank that fails alone does not leave the others waiting for it.
Result<std::string> first_failure(Communicator& world, const Status& mine) {
  const int P = world.size(), me = world.rank();
  float lowest = mine.is_ok() ? 0.0f : static_cast<float>(P - me);  // max = lowest failing rank
  TREEATTN_RETURN_IF_ERROR(world.allreduce(&lowest, 1, ReduceOp::kMax));
  if (lowest == 0.0f) return std::string();
  float failed = mine.is_ok() ? 0.0f : 1.0f;
  TREEATTN_RETURN_IF_ERROR(world.allreduce(&failed, 1, ReduceOp::kSum));
  const int who = P - static_cast<int>(lowest);
  char text[1024] = {};
  if (me == who) {
    // Library messages that already name the rank keep their own prefix.
    const std::string m = mine.message().rfind("rank ", 0) == 0
                              ? mine.to_string()
                              : fmt::format("rank {}: {}", me, mine.to_string());
    std::snprintf(text, sizeof(text), "%s", m.c_str());
  }
  TREEATTN_RETURN_IF_ERROR(world.broadcast(text, sizeof(text), who));
  std::string out = text;
  const int others = static_cast<int>(failed) - 1;
  if (others > 0) out += fmt::format(" (and {} more rank{})", others, others == 1 ? "" : "s");
  return out;
}

// Collective over world. --device cuda: the CUDA executor (device -1: local rank % GPUs; no more
// ranks on a host than its GPUs), agreed by every rank, then the NCCL communicator over world on
// its stream (collective; its set-up honours world's timeout), agreed again. On failure every rank
// returns the first failing rank's message; rank 0 prints it.
Result<RankDevice> open_device(Communicator& world, Device d) {
  RankDevice dev;
  if (d == Device::kCpu) return dev;
  Status mine;
  // NCCL takes one GPU per rank: the ranks of a host must not outnumber its GPUs.
  auto host = world.split_shared(world.rank());
  std::string why;
  const int gpus = cuda_device_count(&why);
  if (!host.is_ok())
    mine = host.status();
  else if (gpus > 0 && (*host)->size() > gpus)
    mine = invalid_argument(fmt::format(
        "{} ranks on this host share its {} GPU{}; --device cuda needs one GPU per rank (NCCL), "
        "so at most {} rank{} per host",
        (*host)->size(), gpus, gpus == 1 ? "" : "s", gpus, gpus == 1 ? "" : "s"));
  else if (auto e = make_cuda_executor(); e.is_ok())
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

}  // namespace treeattn::cli
