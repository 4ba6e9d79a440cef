// Decode strategies: how the ranks' partial states become the exact attention output.
//
// Every strategy takes the same inputs on every rank (the query, this rank's KV shard and the
// replicated ShardPlan) and leaves the merged state records (state.hpp) in `out` on every rank,
// or only on options.root when root >= 0. Names (one registry per backend, see below):
//
//   tree        one allreduce with the state merge as a user-defined reduction
//   tree-paper  the paper's Algorithm 3: allreduce MAX of the LSE, SUM of the rescaled outputs,
//               SUM of the rescaled denominators (three collectives)
//   tree2       MAX of the LSE, then one SUM over outputs and denominators fused (two)
//   hier        merge to a leader per node, k-ary tree over leaders, broadcast inside nodes
//   ring-kv     the KV shards rotate around the ring, overlapped with local attention
//   ring-state  a ring that passes partial states (p - 1 steps of small messages)
//   allgather   all-gather the partial states, merge locally
//   gather-root gather the states to one rank, merge, broadcast
//   single      one rank holds the whole KV (the plan must be ShardKind::kSingle with holder 0);
//               it computes the output and broadcasts it; other ranks compute nothing
//
// All-rank results are bit-identical on every rank: strategies that merge on several ranks
// merge in rank order 0..p-1, and the others compute once and send the bits.
//
// Memory spaces: a strategy touches data only through the Communicator and the Executor
// (executor.hpp) it is set up with: the query, the KV shard, `out` and every buffer it allocates
// live in the executor's memory space, and it computes nothing itself (partial attention, merges,
// the sum form of tree-paper all go through the executor). Its point-to-point messages keep the
// ordering contract of comm.hpp (matching by posting order, tags are labels), so a backend without
// tags or user-defined reductions serves it unchanged; the registry below picks the forms that
// need neither.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/state_buffer.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

struct StrategyOptions {
  int root = -1;                  // >= 0: deliver the merged states to this rank only
  int fanout = 2;                 // hier: children per leader in the inter-node tree (>= 1)
  std::vector<int> node_of_rank;  // hier: node id per rank; empty = split by shared memory
  DecodeOptions kernel;           // the local attention
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string_view name() const = 0;

  // Once per run, collective over comm (sub-communicators, plan checks). comm and executor must
  // outlive the strategy. Without an executor: the host one (cpu_executor()).
  Status setup(Communicator& comm, Executor& executor, const AttnShape& shape, DType dtype,
               const ShardPlan& plan) {
    return do_setup(comm, executor, shape, dtype, plan);
  }
  Status setup(Communicator& comm, const AttnShape& shape, DType dtype, const ShardPlan& plan) {
    return do_setup(comm, cpu_executor(), shape, dtype, plan);
  }

  // One decode step, collective over comm. q is [batch][q_len][heads][head_dim] (the same on
  // every rank), local is this rank's shard for plan; out has room for the step's records
  // (batch * q_len * heads * (head_dim + 2) floats). q, local and out live in the executor's
  // memory space. out holds the merged states where delivers_result(comm.rank()), and is
  // unspecified elsewhere.
  virtual Status run(const float* q, const KVShard& local, const ShardPlan& plan, float* out) = 0;
  // The same with a host StateBuffer, resized to the step's records (host executors only).
  Status step(const float* q, const KVShard& local, const ShardPlan& plan, StateBuffer& out);

  // ---- the merge stage alone (the serving engine's per-layer merge) ----
  // A strategy whose StrategyInfo::merges_states is true merges states the ranks computed
  // themselves: n records per rank, the partials of the same n (row, head) pairs, one
  // collective pattern for the whole batch, exactly the communication and merges run() does
  // after its local partial (run() is local partial + merge()).
  //
  // Once, collective over comm, instead of setup() when only merge() is used: no shape, plan or
  // KV; sub-communicators (hier) are made here. comm and executor must outlive the strategy.
  Status setup_merge(Communicator& comm, Executor& executor, std::size_t head_dim) {
    return do_setup_merge(comm, executor, head_dim);
  }
  // records: n * (head_dim + 2) floats in the executor's memory; afterwards they hold the merged
  // states where delivers_result(comm.rank()). The same n on every rank. kUnsupported for a
  // strategy that does not merge states (ring-kv moves KV, single computes on one rank).
  virtual Status merge(float* records, std::size_t n);
  // The local twin of merge(): parts[r] holds the n records rank r would contribute (host
  // memory), out receives the records merge() delivers, the same bits (the same association of
  // every record). For a rank that already holds every rank's states (the engine's K/V
  // exchange). kUnsupported where the association is the library's choice (an MPI reduction at
  // more than two ranks: merge_local_supported() says so beforehand).
  virtual Status merge_local(const float* const* parts, int p, std::size_t n, float* out);
  virtual bool merge_local_supported(int p) const;
  // merge() gives each record bits that depend on the rank count alone, never on n or on the
  // other records of the batch (what the engine's batch invariance needs). False for reductions
  // whose association the collective library chooses by message size (MPI at p > 2).
  virtual bool merge_batch_invariant() const;

  // Peak bytes of the buffers the strategy itself allocated (receive buffers, partial-state
  // buffers), over the steps run so far. The KV shard, query and `out` are not included.
  virtual std::size_t buffer_bytes() const = 0;

  bool delivers_result(int rank) const { return options_.root < 0 || rank == options_.root; }
  const StrategyOptions& options() const { return options_; }

 protected:
  explicit Strategy(StrategyOptions options) : options_(std::move(options)) {}
  virtual Status do_setup(Communicator& comm, Executor& executor, const AttnShape& shape,
                          DType dtype, const ShardPlan& plan) = 0;
  virtual Status do_setup_merge(Communicator& comm, Executor& executor, std::size_t head_dim);
  StrategyOptions options_;
  AttnShape shape_;
  Executor* exec_ = nullptr;
};

// Where a strategy needs the tokens of the KV cache (the plan's kind, sharding.hpp).
enum class PlacementNeed : uint8_t {
  kAny,         // every placement: even, uneven, striped, explicit
  kContiguous,  // every rank holds one contiguous range of positions (not striped): tree-det
  kAllOnRoot,   // the whole cache on rank 0 (ShardKind::kSingle, holder 0): single
};

// Everything a caller asks about a strategy without running it, from its descriptor
// (src/strategies/descriptor.hpp). Code outside src/strategies asks these instead of comparing
// names (tests/strategies/check_strategy_names.sh keeps it so).
struct StrategyInfo {
  std::string_view name;
  std::string_view summary;
  // The placement it needs; initial_plan() applies it.
  PlacementNeed placement = PlacementNeed::kAny;
  // Every rank runs the kernel over every rank's shard (ring-kv): one step reads the whole
  // cache p times over the job instead of once.
  bool reads_every_shard = false;
  // A rank holds every rank's partial state at once (p state buffers: allgather, gather-root,
  // ring-kv, tree-det's subtree roots); the others hold at most two besides the output.
  bool holds_every_state = false;
  // Output and LSE are the same bits for any rank count, placement and thread count.
  bool rank_count_invariant = false;
  // Strategy::merge() merges a batch of states the ranks already hold: the strategies that move
  // states (what the serving engine can run), not ring-kv or single.
  bool merges_states = false;
  // Listed by StrategyRegistry::list() (the CLI's `all`) and ranked by the planner; false for
  // strategies offered by name only (tree-det).
  bool listed = true;
};

// The strategies a backend offers, by name. Host backends with user-defined reductions (MPI)
// use the full table; backends without them (NCCL) map `tree` to the all-gather form and do
// not offer `hier` (whose intra-node step is a user-defined reduce). Both tables come from the
// strategies' descriptors (src/strategies/descriptor.hpp, one in each strategy's file).
class StrategyRegistry {
 public:
  static const StrategyRegistry& for_backend(const CommCapabilities& caps);

  std::span<const StrategyInfo> list() const;
  bool contains(std::string_view name) const;
  // The strategy's StrategyInfo; null when name is not one of them.
  const StrategyInfo* info(std::string_view name) const;
  // InvalidArgument naming the known strategies when name is not one of them.
  Result<std::unique_ptr<Strategy>> create(std::string_view name,
                                           const StrategyOptions& options) const;

 private:
  explicit StrategyRegistry(bool user_reductions) : user_reductions_(user_reductions) {}
  bool user_reductions_;
};

// ---- what the descriptors decide for a run -----------------------------------------------------

// The strategy offered by name only whose bits do not depend on the rank count (tree-det):
// what `--deterministic` runs.
std::string_view deterministic_strategy();

// The KV layout the host decode kernel of target `isa` reads fastest for llama3-8b's shape on the
// CPUs measured (what kAuto picks on host memory without a workload or a tuned entry): kTiled
// for kAvx512, kGeneric and kReference, kRows for kAvx2; kAuto means best_isa(). The
// measurements behind it are written at its definition (src/strategies/registry.cpp); the
// faster layout also depends on the CPU and the shape, hence host_kv_layout(workload) below.
KVLayout host_kv_layout(Isa isa = Isa::kAuto);

// The KV layout a run of `strategies` (one shared placement) uses: `requested`, or for kAuto
// host_kv_layout() on host memory (by the CPU's kernel target) and rows on a device's. Every
// strategy reads both (ring-kv rotates tiles on the tiled layout, tree-det copies the tokens of
// its chunks out of them). InvalidArgument for an unknown strategy and for tiled on device
// memory. The one place this rule is written (the session, the measurement driver and the CLI
// ask it).
Result<KVLayout> choose_kv_layout(KVLayout requested, MemorySpace memory,
                                  std::span<const std::string> strategies);

// What a layout is chosen for: the attention shape (its batch is ignored), the KV dtype and the
// kernel options (ISA, threads) of the calls that will read it.
struct KVLayoutWorkload {
  AttnShape shape;
  DType dtype = DType::kBF16;
  DecodeOptions kernel;
};
struct HostKVLayout {
  KVLayout layout = KVLayout::kRows;
  std::string how;  // "tuned on this CPU for bf16 D128 G4 T1", "by the CPU's kernel target (...)"
};
// The layout the host kernel reads faster for this workload: the one the kernel tuning measured
// on this CPU (tuning.hpp: the entry of the workload's dtype and head_dim nearest in group and
// threads, ISA and threads resolved: kAuto is best_isa(), 0 threads what OpenMP offers), else
// host_kv_layout(isa), the rule by kernel target (no tuning cache, TREEATTN_TUNE=0, or no entry
// for the dtype and head_dim), saying why. Reads the cache; never measures. The session and
// the driver ask it on rank 0 only and broadcast the answer, so ranks whose caches differ store
// one layout.
HostKVLayout host_kv_layout(const KVLayoutWorkload& workload);
// choose_kv_layout for one workload: kAuto on host memory is host_kv_layout(workload).
Result<KVLayout> choose_kv_layout(KVLayout requested, MemorySpace memory,
                                  std::span<const std::string> strategies,
                                  const KVLayoutWorkload& workload);

// The shard plan a run of `strategy` starts from: `requested` placement of rows of `lens`
// tokens on `ranks` ranks, except that a strategy needing the whole cache on rank 0 gets
// ShardKind::kSingle whatever was requested. An explicit placement with every row empty gives
// every rank nothing (explicit_len then describes the prefill, DecodeSession::extend).
// InvalidArgument for an unknown strategy and the errors of ShardPlan::make (a placement the
// strategy cannot run on, striped for tree-det, is refused by its setup). The one place the
// initial plan is written.
Result<ShardPlan> initial_plan(std::string_view strategy, ShardKind requested, int ranks,
                               std::vector<int64_t> lens,
                               std::span<const int64_t> explicit_len = {}, int holder = 0);

// ---- analytic cost (paper.md section 4, per rank) -------------------------------------------

struct CostEstimate {
  double bytes_sent = 0;         // bytes this rank sends in one step
  double working_set_bytes = 0;  // KV shard + query + output + the strategy's buffers
  std::string formula;           // the formula, in words, for reports
};

// What the model says rank `rank` sends and holds in one step of `strategy` under plan. The
// collectives are modelled as Open MPI's large-message algorithms would move them (allreduce
// 2 (p-1)/p S as in the paper's eq. 14, binomial reduce/broadcast trees, ring all-gather);
// S = batch * q_len * heads * (head_dim + 2) * 4 bytes is one step's state records.
// Point-to-point strategies count exactly the payload they hand to the communicator (ring-kv:
// each forwarded shard and its metadata message), and a gather counts the S bytes each rank
// hands to it, so the bench can compare this with the bytes counted at the communicator.
//
// The cost model (cost_model.hpp, predict) answers a different question with the same
// vocabulary: the busiest rank's bytes on a topology, for an even split of the context, under
// the algorithm the topology's library picks at this message size, simulated message by
// message. Both come from the strategy's descriptor (src/strategies/descriptor.hpp), and they
// agree (tests/strategies/test_descriptors.cpp) except where they model different things:
//   - allreduces below 10000 B: predict uses recursive doubling (log2 p whole messages), this
//     the ring's 2 (p-1)/p S (tree, tree-paper, tree2), and NCCL's tree sends 2 S;
//   - gather-root: predict's binomial gather forwards whole subtrees, this counts the S each
//     rank hands to the gather;
//   - hier: predict's intra-node broadcast is one shared-memory write by the leader, this a
//     binomial tree inside the node (they agree with up to 2 ranks per node);
//   - ring-kv: predict leaves out the (3 batch + 1) * 8 bytes metadata message per hop;
//   - single on NCCL: predict's pipelined ring broadcast sends S from every rank;
//   - working sets: predict keeps S more for tree's reduction buffer, r S at a hier leader (its
//     node's states) where this keeps k S (its children's), and at p = 1 S more for tree-paper,
//     tree2 and gather-root and S less for ring-kv and ring-state.
Result<CostEstimate> analytic_cost(std::string_view strategy, const AttnShape& shape, DType dtype,
                                   const ShardPlan& plan, int rank,
                                   const StrategyOptions& options = {});

// The KV storage a run of `strategy` on `ranks` ranks needs beside one placement of the cache
// shared by every strategy of the run, in copies of the whole cache: ring-kv's receive buffers,
// each the size of a shard (2: two per rank; 1 at p = 2, 0 at p = 1), single's own placement
// (1: the whole cache on rank 0, which a shared sharded placement cannot serve), 0 for the
// others. For memory pre-checks before any plan exists (a run of several strategies needs
// 1 + the sum over the distinct strategies, KV bytes of the whole cache each); with a plan,
// analytic_cost's working set is each rank's exact figure. InvalidArgument for an unknown
// strategy or ranks < 1.
Result<double> strategy_extra_kv_caches(std::string_view strategy, int ranks);

}  // namespace treeattn
