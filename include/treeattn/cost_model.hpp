// A cost model for every decode strategy, a planner that ranks them, and the paper-scale sweep.
//
// Vocabulary (the same names as docs/topology.md):
//   p        ranks taking part; placed in blocks of r = ranks_per_node on n = ceil(p / r) nodes
//   t        tokens of one rank's KV shard, ceil(N / p) for context length N
//   S        bytes of one rank's partial state: B * Q * H * (D + 2) * 4 (state.hpp's record)
//   KV(t)    bytes of a KV shard of t tokens: 2 * B * t * Hkv * D * s (s = dtype bytes)
//   alpha_L  latency of link class L (node or network), beta_L its bandwidth per direction
//
// Local work is memory-bound decode attention: T_loc(t) = kernel_overhead +
// max(KV(t) / memory_bandwidth, flops / peak) (times ceil(p / max_concurrent_ranks) when ranks
// share cores). Communication is simulated round by round: each round is a set of messages
// (src, dst, bytes) that run concurrently; a rank's time in a round is the largest latency of
// its messages plus the bytes it sends (or receives, whichever is more) over each message's
// link bandwidth, and a node's time is the network latency plus the bytes leaving (or
// entering) it over links_per_node links. The round takes the slowest rank's or node's time.
// This is the NCCL-style
// `time = latency * steps + bytes / bandwidth` per link class, with the steps taken from the
// algorithm that actually runs:
//   Open MPI (tuned): allreduce < 10000 B recursive doubling (log2 p rounds of the whole
//     message, plus 2 rounds when p is not a power of two), else ring (2(p-1) rounds of 1/p);
//     allgather recursive doubling / Bruck (ceil(log2 p) rounds of growing blocks); gather
//     and bcast binomial trees.
//   NCCL: allreduce = min(ring, tree) from NCCL's own tuning formulas (pipelined ring; chain
//     inside a node plus a binary tree over nodes), with collective_overhead_us per call.
// Each strategy's rounds are documented at its model, in the strategy's own file
// (src/strategies/<name>.cpp, its descriptor's `model`).
//
// Pure functions: no MPI, no clocks. Machines that do not exist are fine.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/dtype.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"
#include "treeattn/topology.hpp"

namespace treeattn {

// Names of the modeled strategies, in the CLI's spelling: tree, tree-paper, tree2, hier,
// ring-kv, ring-state, allgather, gather-root, single.
const std::vector<std::string>& modeled_strategies();

// What one decode step looks like to the model.
struct CostQuery {
  AttnShape shape;  // batch, heads, kv_heads, head_dim, q_len
  DType kv_dtype = DType::kBF16;
  int64_t context = 0;     // N, tokens per sequence over all ranks (> 0)
  int ranks = 1;           // p (>= 1); 0 = all ranks of the topology
  int ranks_per_node = 0;  // placement; 0 = the topology's ranks_per_node
  int hier_fanout = 2;     // children per leader in hier's inter-node tree (>= 1)
};

struct Prediction {
  std::string strategy;
  double latency_us = 0;  // one decode step, all ranks done
  double local_us = 0;    // local attention part (for ring-kv: all p kernel calls)
  double comm_us = 0;     // communication part not hidden under compute
  // The busiest rank's bytes sent per step, as the simulated algorithm moves them (subtrees
  // forwarded in a binomial gather, recursive doubling below 10000 B...). analytic_cost
  // (strategy.hpp) counts what each rank hands to the communicator for a given shard plan;
  // where the two differ is written there.
  double bytes_sent_per_rank = 0;
  double peak_bytes = 0;     // the largest per-rank working set (KV shard + buffers)
  int collective_calls = 0;  // library calls per step (collectives or send/recv phases)
  int comm_rounds = 0;       // sequential message rounds on the critical path
  std::string algorithm;     // how it was modeled, e.g. "allreduce: recursive doubling"
};

// Predicts one strategy. Errors: unknown strategy (lists the known ones), invalid shape or
// topology, ranks above the topology's size, a placement that does not fit.
Result<Prediction> predict(std::string_view strategy, const CostQuery& q, const Topology& topo);

struct PlanEntry {
  Prediction prediction;
  bool feasible = true;
  std::string reason;  // why not feasible (memory capacity), empty when feasible
};

struct PlanOptions {
  std::vector<std::string> candidates;  // empty = all modeled strategies except "single"
  bool include_single = false;          // also rank "single" (all KV on one rank)
};

// Ranks the candidates by predicted latency (feasible first; ties broken by bytes sent, then
// by name). The first entry is the planner's choice.
Result<std::vector<PlanEntry>> plan(const CostQuery& q, const Topology& topo,
                                    const PlanOptions& opts = {});

// `auto`: the planner's ranking over the strategies a backend offers (user_reductions: the
// backend's CommCapabilities::user_reductions; without them `tree` is the all-gather form and
// hier is not offered), by-name-only strategies (tree-det) left out. The first entry is the
// choice. Pure: every rank that asks with the same inputs gets the same answer
// (DecodeSession resolves SessionConfig::strategy = "auto" with it, session.hpp).
struct StrategyChoice {
  std::string strategy;           // the choice: ranking.front()
  std::vector<PlanEntry> ranking;  // every candidate, best first, with its predicted times
  std::string topology;           // the name of the topology it was planned on
};
Result<StrategyChoice> choose_strategy(const CostQuery& q, const Topology& topo,
                                       bool user_reductions = true, const PlanOptions& opts = {});
// `methods` with each "auto" replaced by `choice` (a StrategyChoice's strategy), a duplicate of it
// dropped, order kept: how a method list that names "auto" is run.
std::vector<std::string> replace_auto(const std::vector<std::string>& methods,
                                      const std::string& choice);

// ---- the dense layers: replicated or split over the ranks (the serving engine's --dense) ----
//
// One step of `rows` rows through the dense layers (projections, FFN, output head) of a model
// with L layers whose projection matrices and head hold W bytes (the file's format):
//   replicated  every rank holds and reads every weight: W / B_mem per step (B_mem the
//               topology's memory bandwidth per rank), no communication (a step of several rows
//               splits them over the ranks, and each rank still reads every weight once);
//   split       rank r holds slice r of each matrix's output rows and reads W_r ~ W / p; every
//               matrix group's outputs are all-gathered: per layer q, k, v ((H + 2 Hkv) D floats a
//               row), the attention output (E), the FFN's activations (F) and its down projection
//               (E), and once per step the embeddings (each row's by the rank whose vocabulary
//               slice holds its token: E a row, ceil(rows / p) rows a slot) and the head's logits
//               (V a sampled row): 4 L + 2 all-gathers of about rows x width / p x 4 bytes from
//               each rank, each priced as the topology's library runs it
//               (cost_sim: Open MPI's recursive doubling / Bruck / ring, or NCCL's ring) plus one
//               call's fixed cost (collective_overhead_us, and the network's call_overhead_us
//               across nodes).
// Both local terms take max(bytes / B, flops / peak) where the topology gives a peak, and the
// concurrency factor where ranks share cores; B is the topology's memory bandwidth per rank, or
// the rate the matrix kernels were measured to read a decode step's weights at where that is
// lower (weight_gbps: quantized kernels on a CPU thread decode slower than memory streams). The
// split wins while the weight reads it saves, (W - max_r W_r) / B, exceed its all-gathers' time:
// on one node (about 1-3 us an all-gather) for any model of more than a few MB; across a slow
// network a small model may stay replicated (docs/architecture.md has the crossover).
struct DenseQuery {
  double weight_bytes = 0;   // W, every projection and the head
  double slice_bytes = 0;    // max_r W_r (0: W / p)
  double flops_per_row = 0;  // 2 x the matrices' weights (0: bandwidth only)
  double weight_gbps = 0;    // the kernels' measured weight read rate (0: memory bandwidth)
  int layers = 0;            // L
  int64_t qkv_width = 0;     // floats a row each group gathers: (H + 2 Hkv) D
  int64_t o_width = 0;       // E
  int64_t ffn_width = 0;     // F
  int64_t down_width = 0;    // E
  int64_t head_width = 0;    // V
  int64_t embd_width = 0;    // E (the embeddings' all-gather)
  int64_t rows = 1;          // rows of the step (1: one sequence decoding)
  int64_t sampled_rows = 1;  // rows whose logits are computed
  int ranks = 1;             // p (>= 1); 0 = all ranks of the topology
  int ranks_per_node = 0;    // placement; 0 = the topology's
};

struct DensePrediction {
  double replicated_us = 0;  // one step's dense part, replicated
  double split_us = 0;       // the split's: its compute plus its all-gathers
  double split_compute_us = 0;
  double split_comm_us = 0;
  int collectives = 0;             // all-gathers per step of the split: 4 L + 2
  double bytes_sent_per_rank = 0;  // the split's, per step, as the library moves them
  std::string algorithm;           // how each all-gather was modelled
  bool split_wins() const { return split_us < replicated_us; }
};
// Errors: a query without weights or layers, ranks or placement the topology cannot hold.
Result<DensePrediction> predict_dense(const DenseQuery& q, const Topology& topo);

// The paper's microbenchmark (Fig. 3): one attention block of 16 heads x 128, batch 1, one
// query, bf16, context 80k..5.12M (doubling), tree vs the KV-rotating ring.
struct SweepRow {
  std::string topology;
  int devices = 0;
  int64_t context = 0;
  double tree_us = 0;        // our one-collective tree
  double tree_paper_us = 0;  // the paper's recipe: 3 allreduces
  double ring_kv_us = 0;     // the paper's baseline
  double speedup = 0;        // ring_kv_us / tree_paper_us (the paper's comparison)
  double speedup_tree = 0;   // ring_kv_us / tree_us
  double ring_kv_bytes_per_rank = 0;
  double tree_bytes_per_rank = 0;
};

struct SweepOptions {
  std::vector<int> devices;       // empty = {8, 64, 128} capped at the topology's size, or
                                  // the topology's size when it has fewer than 8 ranks
  std::vector<int64_t> contexts;  // empty = 80'000 * 2^k up to 5'120'000
  AttnShape shape{1, 16, 16, 128, 1};
  DType kv_dtype = DType::kBF16;
};

Result<std::vector<SweepRow>> paper_sweep(const Topology& topo, const SweepOptions& opts = {});

}  // namespace treeattn
