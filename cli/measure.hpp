// One measured point per method, in two passes over the same generated data in the same job:
// memory (each method alone for one step, its peak RSS reset before) and then latency and
// bytes (every method on the same shards, one step of each in turn, so that drift on a shared
// machine hits all methods alike). Each is checked against the float64 oracle outside the
// timed loop, and latency, bytes and memory are aggregated over ranks. Collective over the communicator; the
// points are complete on rank 0.
#pragma once

#include <string>
#include <vector>

#include "options.hpp"
#include "report.hpp"
#include "treeattn/comm.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/status.hpp"

namespace treeattn::cli {

struct MeasureConfig {
  std::vector<std::string> methods;
  AttnShape shape;
  DType dtype = DType::kBF16;
  int64_t seq = 0;
  std::string shard = "even";  // even, uneven, striped, empty
  KVLayout kv_layout = KVLayout::kAuto;
  uint64_t seed = 1;
  int warmup = 2;
  int iters = 10;
  bool append = false;   // decode loop: append a generated token after every step
  int nodes = 1;         // emulated nodes for `hier` (ranks grouped in equal blocks)
  int fanout = 2;
  int root = -1;
  int threads = 0;       // kernel threads per rank (0: OpenMP default)
  int timeout_ms = 60000;
  bool check = true;
  double tolerance = 1e-5;
  bool progress = false;  // progress lines on stderr (rank 0)
  InjectSpec inject;      // --inject (debug)
  // Where the ranks decode (--device): the executor and the communicator the sessions use,
  // owned by the caller (RunConfig::executor / device_comm; null: the CPU executor and the
  // measuring communicator). The measuring communicator stays the host one.
  Device device = Device::kCpu;
  Executor* executor = nullptr;
  Communicator* device_comm = nullptr;
};

// The number of tokens a rank will hold, for the memory pre-check.
Result<std::vector<Point>> measure(Communicator& comm, const MeasureConfig& config);

// Bytes the whole job needs on this machine and the bytes it has available (MemAvailable), for
// a clear "does not fit" error before anything is allocated: the KV shards of the shared
// session, `single`'s whole cache and ring-kv's two receive buffers (none of them with --device
// cuda: they are in GPU memory, whose lack the session reports), the oracle's regenerated
// cache and its float64 outputs, and per rank the query, the output states, the states kept
// for every timed step of every method, the strategies' receive buffers and a process baseline.
// Computed in doubles, so absurd shapes (--q-len 2^31) give a number, not an overflow.
struct MemoryNeed {
  double per_job_bytes = 0;
  double kv_bytes = 0;     // the cache terms
  double state_bytes = 0;  // queries, outputs, kept states and strategy buffers, all ranks
  double available_bytes = 0;
};
MemoryNeed memory_need(const MeasureConfig& config, int ranks);

}  // namespace treeattn::cli
