// The CLI's configuration of one measured point (run, bench) and the call into the measurement
// library: measure() hands it to bench_strategies (treeattn/bench.hpp: the memory pass, every
// method interleaved step by step on the same shards, the oracle checks, the aggregation over
// ranks) and returns the report's points. Collective over the communicator; the points are
// complete on every rank.
#pragma once

#include <string>
#include <vector>

#include "options.hpp"
#include "report.hpp"
#include "treeattn/bench.hpp"
#include "treeattn/comm.hpp"
#include "treeattn/status.hpp"

namespace treeattn::cli {

// The library's configuration (bench.hpp) plus what the CLI's flags say in their own terms:
// --inject (turned into BenchConfig::faults) and --device (the KV in GPU memory for the memory
// pre-check, and the points' device label). executor / device_comm: RunConfig's, owned by the
// caller (null: the CPU executor and the measuring communicator).
struct MeasureConfig : BenchConfig {
  InjectSpec inject;  // --inject (debug)
  Device device = Device::kCpu;
};

// One point per method (bench_strategies), as the report prints and writes them.
Result<std::vector<Point>> measure(Communicator& comm, const MeasureConfig& config);

// The job's memory need against what this machine has (bench_memory_need, bench.hpp), for a
// clear "does not fit" error before anything is allocated.
MemoryNeed memory_need(const MeasureConfig& config, int ranks);

}  // namespace treeattn::cli
