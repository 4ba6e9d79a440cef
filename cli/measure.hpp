// The CLI's configuration of one job's measured points (run, bench) and the call into the
// measurement library: bench_config() turns the flags' MeasureConfig into bench.hpp's
// BenchConfig, which bench_sweep (src/measure/bench_results.hpp: bench_strategies over the
// contexts and batches, each point summarized) measures. Collective over the communicator; the
// points are complete on every rank.
#pragma once

#include "options.hpp"
#include "treeattn/bench.hpp"

namespace treeattn::cli {

// The library's configuration (bench.hpp) plus what the CLI's flags say in their own terms:
// --inject (turned into BenchConfig::faults) and --device (the KV in GPU memory for the memory
// pre-check, and the points' device label). executor / device_comm: RunConfig's, owned by the
// caller (null: the CPU executor and the measuring communicator).
struct MeasureConfig : BenchConfig {
  InjectSpec inject;  // --inject (debug)
  Device device = Device::kCpu;
};

// The library's configuration of these flags, reporting the phase and step of every rank to
// the job status file (treeattn/job_status.hpp).
BenchConfig bench_config(const MeasureConfig& config);

}  // namespace treeattn::cli
