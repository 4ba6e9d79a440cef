// Deterministic decode workloads and the driver that runs a strategy over them.
//
// Data: every value is a pure function of (seed, tensor, batch row, head, position, element):
// splitmix64 of those coordinates mapped to a uniform float in [-1, 1), narrowed to the KV dtype
// for K and V. So each rank generates exactly its own shard and the query without
// communication, tokens appended during decoding are the ones at the next positions, and any
// process can regenerate the whole cache for the float64 oracle. The query of decode step s
// uses positions s * q_len .. s * q_len + q_len - 1 of the query stream, scaled by q_scale
// (larger values sharpen the softmax).
//
// Driver: run_decode() runs warmup + steps decode steps of one strategy through a DecodeSession
// (session.hpp) filled with the workload: the session checks that all ranks agree on the run
// (the configuration plus warm-up, steps, appends, seed and query scale; per step in debug
// mode), and the driver appends one generated token per batch row after each step when asked.
// Per timed step it reports this rank's wall time and the slowest rank's, the bytes this rank
// handed to the communicator, the bytes the transport saw (TCP counters, when the job runs over
// TCP), and the attention working set; beside them the analytic model (strategy.hpp).
// run_interleaved() measures several strategies on the very same shards (one session, the
// strategies added to it; `single` in a second session with its own placement), one step of each
// in turn, starting one later every step, so that slow drift of a shared machine hits them alike.
// Both run on any executor (RunConfig::executor, e.g. the CUDA one, with RunConfig::device_comm,
// e.g. NCCL): the shards then live in its memory, each step's query is copied there, and the
// merged states come back to the host for the checks.
// check_against_oracle() compares a step's merged states with the float64 oracle over the
// regenerated cache.
//
// Part of the measurement library treeattn_measure (src/measure), not of libtreeattn.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/state_buffer.hpp"
#include "treeattn/status.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {

// ---- deterministic data ---------------------------------------------------------------------

enum class WorkloadTensor : uint8_t { kQuery = 1, kKey = 2, kValue = 3 };

// Uniform in [-1, 1), from splitmix64 of (seed, tensor, b, h, position, element).
float workload_uniform(uint64_t seed, WorkloadTensor t, int64_t b, int64_t h, int64_t pos,
                       int64_t d);

struct WorkloadSpec {
  AttnShape shape;
  DType dtype = DType::kF32;
  uint64_t seed = 1;
  float q_scale = 1.0f;
};

// q [batch][q_len][heads][head_dim] of decode step `step`.
void make_query(const WorkloadSpec& w, int64_t step, float* q);
// K and V [kv_heads][head_dim] of the token at global position pos of row b, already rounded to
// the KV dtype (so widening the stored value gives back exactly these floats).
void make_token(const WorkloadSpec& w, int64_t b, int64_t pos, float* k, float* v);
// Fills this rank's shard with its tokens under plan.
Status fill_local_shard(const WorkloadSpec& w, const ShardPlan& plan, LocalShard& shard);
// The whole cache of every row (lens[b] tokens at positions 0..lens[b]-1), and a view of it.
KVCache make_full_cache(const WorkloadSpec& w, std::span<const int64_t> lens);

// ---- driver ---------------------------------------------------------------------------------

struct RunConfig {
  std::string strategy = "tree";
  AttnShape shape;
  DType dtype = DType::kF32;
  std::vector<int64_t> total_len;      // context per batch row; one value = the same for all rows
  ShardKind shard = ShardKind::kEven;  // `single` forces ShardKind::kSingle (holder 0)
  std::vector<int64_t> explicit_len;   // ShardKind::kExplicit (see ShardPlan::make)
  uint64_t seed = 1;
  float q_scale = 1.0f;
  int warmup = 0;            // untimed steps first (still appended, still checked for agreement)
  int steps = 1;             // timed steps
  bool append = false;       // append one generated token per row after every step
  int64_t spare_tokens = 0;  // extra shard capacity (appends beyond it grow the shard)
  // The shards' storage (sharding.hpp). run_interleaved resolves kAuto once for all its
  // strategies (choose_kv_layout, strategy.hpp: measured for this workload on the host, rank
  // 0's choice on every rank; rows on a device); run_decode lets the session choose for its one
  // strategy.
  KVLayout kv_layout = KVLayout::kAuto;
  StrategyOptions options;
  std::chrono::milliseconds timeout{60000};  // per communicator operation; 0 = forever
  bool check_fingerprint = true;             // at setup
  bool check_every_step = false;             // debug: fingerprint before every step
  bool check_inputs = false;                 // scan q, K, V for NaN/Inf and name the rank
  bool keep_states = true;                   // keep every timed step's merged states in the report
  int inject_nan_rank = -1;  // fault injection: that rank puts a NaN in its first K value
  // More fault injection (treeattn run/bench --inject, tools/soak.sh). At decode step
  // inject_step (warm-up steps counted from 0) rank inject_never_arrive_rank stops taking part
  // (it sleeps until the others' timeout ends the job) and rank inject_kill_rank kills itself
  // with SIGKILL; rank inject_slow_rank sleeps inject_slow_ms before every step.
  int inject_never_arrive_rank = -1;
  int inject_kill_rank = -1;
  int64_t inject_step = 0;
  int inject_slow_rank = -1;
  int inject_slow_ms = 0;
  // Called on every rank as each decode step begins (progress reporting); may be empty.
  std::function<void(int64_t step)> on_step;
  // Where the sessions run (executor.hpp, comm.hpp); both must outlive the run. executor: null =
  // cpu_executor(); a device executor (CUDA) keeps the shards in its memory as rows (kAuto
  // resolves to rows, kTiled is refused) and the driver copies each step's query into a buffer
  // of its own there. device_comm: the communicator the sessions merge over (NCCL with a CUDA
  // executor; its memory space must be the executor's); null = the `comm` argument. The driver
  // keeps `comm` (host memory) for its own operations: barriers, the slowest rank's time, the
  // input scan, the wire-byte probe, fault injection and, when device_comm works in device
  // memory, the agreement on the run (which the session would otherwise do over device_comm);
  // byte counters are read from device_comm. device_comm must have comm's ranks and size.
  Executor* executor = nullptr;
  Communicator* device_comm = nullptr;
};

struct StepReport {
  int64_t step = 0;        // index counting warm-up steps
  double seconds = 0;      // this rank's wall time of the step
  double max_seconds = 0;  // the slowest rank's
  uint64_t p2p_bytes = 0;  // point-to-point payload this rank sent (exact)
  uint64_t p2p_messages = 0;
  uint64_t collective_calls = 0;
  uint64_t collective_payload_bytes = 0;  // this rank's buffer per collective call
  std::optional<uint64_t> wire_bytes;     // TCP bytes this process sent during the step
  std::size_t working_set_bytes = 0;      // KV shard (live) + query + output + strategy buffers
};

struct RunReport {
  ShardPlan plan;                   // after the last step (appends included)
  std::vector<StepReport> steps;    // timed steps only
  std::vector<StateBuffer> states;  // merged states of each timed step (if keep_states)
  bool has_result = false;          // whether this rank receives results (root option)
  CostEstimate model;               // analytic cost for this rank at the first timed step
  std::size_t kv_bytes = 0;         // this rank's live KV bytes at the first timed step
  KVLayout kv_layout = KVLayout::kRows;  // the layout the strategy read (rows or tiled)
  int64_t peak_rss_bytes = 0;       // of this process, after the run (measure.hpp)
};

Result<RunReport> run_decode(Communicator& comm, const RunConfig& config);

// The strategies named, round robin on the same data (config.strategy is ignored); one report
// per name, in order. peak_rss_bytes is not filled (the strategies share one process's memory:
// measure it per strategy with run_decode).
Result<std::vector<RunReport>> run_interleaved(Communicator& comm, const RunConfig& config,
                                               std::span<const std::string> strategies);

// The plan a config starts from on `ranks` ranks (total_len expanded, `single` forcing its kind).
Result<ShardPlan> initial_plan(const RunConfig& config, int ranks);

struct CheckResult {
  double max_abs_error = 0;  // max |out - ref| over all outputs (inf for a NaN mismatch)
  double max_abs_ref = 0;    // max |ref|
  double tolerance = 0;      // rel_tol * max(1, max_abs_ref)
  double max_lse_error = 0;  // max |lse - ref| / max(1, |ref|) (inf when -inf or NaN differ)
  bool passed = false;       // both errors within their tolerance
  std::string detail;        // where the largest error is
  // The larger of max_abs_error / max(1, max_abs_ref) and max_lse_error: what reports print.
  double rel_error() const;
};

// The float64 oracle's output [batch][q_len][heads][head_dim] and LSE [batch][q_len][heads] for
// step `step` (counting warm-up steps) over the regenerated whole cache at that step.
struct OracleReference {
  std::vector<double> out, lse;
};
Result<OracleReference> oracle_reference(const RunConfig& config, int64_t step);

// Compares merged states with a reference: passes when max|out - ref| <= rel_tol * max(1,
// max|ref|) and every LSE is within rel_tol * max(1, |ref|) (infinities and NaN must match).
Result<CheckResult> compare_with_reference(const AttnShape& shape, const StateBuffer& states,
                                           const OracleReference& ref, double rel_tol = 1e-5);

// oracle_reference + compare_with_reference.
Result<CheckResult> check_against_oracle(const RunConfig& config, int64_t step,
                                         const StateBuffer& states, double rel_tol = 1e-5);

// Every rank's states must be byte-identical to rank 0's: an all-gather and memcmp. Returns
// kMismatch naming the first rank that differs and where.
Status check_identical_across_ranks(Communicator& comm, const StateBuffer& states);

}  // namespace treeattn
