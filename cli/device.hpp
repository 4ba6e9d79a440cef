// Where the ranks of run, bench and verify decode (--device): what this build can run, the
// strategies each device offers, and opening a rank's GPU and NCCL communicator. Shared by the
// commands; kept out of options.cpp, which the fuzzers link without CUDA and NCCL.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "measure.hpp"
#include "options.hpp"
#include "treeattn/comm.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/status.hpp"

namespace treeattn::cli {

// The communicator the sessions merge over on each device: MPI (host) or NCCL (comm_nccl.hpp).
CommCapabilities session_caps(Device d);
// Every strategy name the device's communicator can run.
std::vector<std::string> all_methods(Device d = Device::kCpu);
// --methods TEXT ("all" or a comma list, "auto" allowed on the CPU) for the device.
Result<std::vector<std::string>> resolve_methods(const std::string& text, Device d);
// Whether this build can run --device d.
Status check_device_built(Device d);
// Before any rank starts: --device cuda on a machine with no usable GPU for its ranks (unless
// the job is already running under mpirun, or the launch names other hosts).
Status check_device_here(Device d);

// This rank's GPU for --device cuda. Members in this order, so that the NCCL communicator goes
// before the executor whose stream it uses (and both before the MPI world, which the caller
// destroys after them).
struct RankDevice {
  std::unique_ptr<Executor> executor;
  std::unique_ptr<Communicator> comm;
  std::string description = "device cpu";  // the report's header line
};

// Collective over world. --device cuda: the CUDA executor and the NCCL communicator, agreed by
// every rank (see device.cpp); the CPU: an empty RankDevice.
Result<RankDevice> open_device(Communicator& world, Device d);

}  // namespace treeattn::cli
