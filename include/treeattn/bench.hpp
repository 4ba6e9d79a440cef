// Measuring several strategies on the same data in one job (what `treeattn run` and `bench`
// report): one point per strategy, in two passes over the same generated data.
//
//   memory    each strategy alone in a fresh session for one step, its peak RSS reset before
//             (so that one strategy's peak is not another's);
//   latency   every strategy on the same shards, interleaved: one step of each in turn, the
//             first one rotating every step (run_interleaved, workload.hpp), so that load that
//             comes and goes on a shared machine hits all of them alike; the slowest rank's
//             time per step, and the bytes each rank handed to the communicator.
//
// Each strategy's last step is checked against the float64 oracle outside the timed loop (and
// for bit-identical results on every rank that delivers one). Latency, bytes and memory are
// aggregated over ranks; the points are complete on every rank.
//
// Part of the measurement library treeattn_measure; the CLI parses flags, calls
// bench_strategies and prints (cli/measure.cpp, cli/report.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// Fault injection for the soak and hardening tests (RunConfig's inject_* fields, workload.hpp).
struct BenchFaults {
  int nan_rank = -1;           // that rank puts a NaN in its first K value (inputs are scanned)
  int never_arrive_rank = -1;  // stops taking part at `step`
  int kill_rank = -1;          // SIGKILLs itself at `step`
  int64_t step = 0;
  int slow_rank = -1;          // sleeps slow_ms before every step
  int slow_ms = 0;
};

struct BenchConfig {
  std::vector<std::string> methods;
  AttnShape shape;
  DType dtype = DType::kBF16;
  int64_t seq = 0;
  std::string shard = "even";  // even, uneven, striped, empty (rank 0 holds nothing)
  KVLayout kv_layout = KVLayout::kAuto;
  uint64_t seed = 1;
  int warmup = 2;
  int iters = 10;
  bool append = false;  // decode loop: append a generated token after every step
  int nodes = 1;        // emulated nodes for `hier` (ranks grouped in equal blocks)
  int fanout = 2;
  int root = -1;
  int threads = 0;  // kernel threads per rank (0: OpenMP default)
  int timeout_ms = 60000;
  bool check = true;
  double tolerance = 1e-5;
  bool progress = false;  // progress lines on stderr (rank 0)
  BenchFaults faults;
  // Where the ranks decode: the executor and the communicator the sessions use, owned by the
  // caller (null: the CPU executor and the measuring communicator, which stays the host one).
  Executor* executor = nullptr;
  Communicator* device_comm = nullptr;
  // The KV cache lives in device memory (bench_memory_need counts no host copy of it): implied
  // by an executor that works in device memory; set it for the pre-check made before one exists.
  bool device_memory = false;
  // Called on every rank with what it is doing (a phase) and at every decode step (the CLI's
  // job status file, so that a stuck job names its phase).
  std::function<void(std::string_view phase)> on_phase;
  std::function<void(int64_t step)> on_step;
};

// One strategy at one configuration.
struct BenchPoint {
  std::string method;
  int ranks = 1, nodes = 1;
  int64_t seq = 0, batch = 1, heads = 0, kv_heads = 0, head_dim = 0, q_len = 1;
  std::string dtype, shard;
  std::string kv_layout = "rows";  // the KV layout the method read (rows or tiled)
  std::vector<double> step_us;     // per timed step, the slowest rank's time
  uint64_t bytes_sent_per_rank = 0;              // counted at the communicator, max over ranks
  std::optional<uint64_t> bytes_wire_per_rank;   // what the transport moved, max over ranks
  uint64_t bytes_formula = 0;                    // analytic, per rank
  uint64_t peak_bytes_per_rank = 0;              // attention working set, max over ranks
  uint64_t peak_bytes_formula = 0;
  uint64_t peak_rss_bytes = 0;                   // process peak RSS (memory pass), max
  uint64_t kv_bytes_read = 0;                    // KV bytes all ranks' kernels read per step
  double max_rel_err = 0;                        // vs the float64 oracle
  std::string output_sha256;                     // of the last step's output + LSE
  double tolerance = 0;
  bool ok = true;
};

// Collective over comm. Unknown methods (for the sessions' communicator) are an error naming
// the known ones.
Result<std::vector<BenchPoint>> bench_strategies(Communicator& comm, const BenchConfig& config);

// Bytes the whole job needs on this machine and the bytes it has available (MemAvailable), for
// a clear "does not fit" error before anything is allocated: the KV shards of the shared
// session, `single`'s whole cache and ring-kv's receive buffers (none where the executor works in
// device memory), the oracle's regenerated cache and its float64 outputs, and per rank
// the query, the output states, the states kept for every timed step of every method, the
// strategies' receive buffers and a process baseline. Computed in doubles, so absurd shapes
// give a number, not an overflow.
struct MemoryNeed {
  double per_job_bytes = 0;
  double kv_bytes = 0;     // the cache terms
  double state_bytes = 0;  // queries, outputs, kept states and strategy buffers, all ranks
  double available_bytes = 0;
};
MemoryNeed bench_memory_need(const BenchConfig& config, int ranks);

}  // namespace treeattn
