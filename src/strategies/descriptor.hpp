// One descriptor per strategy: everything the library knows about a strategy besides its
// algorithm, defined in the strategy's own file (internal header).
//
// A descriptor names the strategy and says in one line what it does, creates it, says whether
// it needs a backend with user-defined reductions (and what replaces it on one without), and
// carries the strategy's three models:
//   analytic  what one rank sends and holds in one step of a given ShardPlan, as Open MPI's
//             large-message algorithms move the data (analytic_cost(), strategy.hpp; the bench
//             compares it with the bytes counted at the communicator);
//   model     its entry in the topology cost model (predict(), cost_model.hpp): the rounds of
//             messages and the local work of one step on a topology, simulated with the
//             collective algorithms the topology's library picks at this message size
//             (src/topology/cost_sim.hpp);
//   extra_kv_caches  the KV storage a run needs beside one shared placement of the cache, in
//             copies of the whole cache (the CLI's memory pre-check,
//             strategy_extra_kv_caches()).
// How the two byte models relate is written at analytic_cost (strategy.hpp); where they differ
// for one strategy, its descriptor's comment says why, and tests/strategies/test_descriptors.cpp
// checks that they agree wherever they should.
//
// The registry (registry.cpp) lists the descriptors in one table; the table for backends
// without user-defined reductions is derived from it.
#pragma once

#include <memory>
#include <span>
#include <string_view>

#include "topology/cost_sim.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {

namespace strategies {

// ---- the byte quantities both models use (one definition each, src/topology/cost_sim.hpp) ---
using cost::kv_bytes_per_token;
using cost::query_bytes;
using cost::state_bytes;

// What analytic_cost knows about rank `rank` in one step, with the quantities every strategy's
// formula uses (the vocabulary of strategy.hpp: S, q, KV).
struct AnalyticInput {
  const AttnShape& shape;
  DType dtype;
  const ShardPlan& plan;
  int rank;
  const StrategyOptions& options;
  int p;                // ranks
  double S;             // bytes of one step's state records
  double q_bytes;       // bytes of the query
  double kv_per_token;  // bytes of one token's K and V over all KV heads
  int root;             // options.root, or 0 when every rank gets the result
  bool all;             // every rank gets the result (options.root < 0)

  // Bytes of rank r's KV shard.
  double kv_bytes(int r) const;
  // KV shard + query + output records: what every strategy holds.
  double base_ws() const { return kv_bytes(rank) + q_bytes + S; }
  // Sends of rank r in a binomial broadcast over n ranks rooted at rt.
  static double bcast_sends(int r, int n, int rt);
  // p = 1: nothing sent; the working set is base_ws() + extra_ws.
  CostEstimate no_communication(double extra_ws) const;
};

struct StrategyDescriptor {
  StrategyInfo info;  // name (the CLI's spelling) and one-line summary
  std::unique_ptr<Strategy> (*create)(const StrategyOptions&);
  // The strategy calls allreduce_states / reduce_states (a user-defined reduction).
  bool needs_user_reductions = false;
  // On a backend without user-defined reductions: the descriptor offered under this name
  // instead, or nullptr when the strategy is not offered there.
  const StrategyDescriptor* without_user_reductions = nullptr;
  // analytic_cost() for this strategy; the input is validated (rank in range, shape valid).
  CostEstimate (*analytic)(const AnalyticInput&) = nullptr;
  // predict() for this strategy (Prediction::strategy is filled in by predict()).
  Prediction (*model)(const cost::Ctx&) = nullptr;
  // strategy_extra_kv_caches() (strategy.hpp) on `ranks` ranks.
  double (*extra_kv_caches)(int ranks) = nullptr;
};

// Defined in each strategy's file.
extern const StrategyDescriptor kTreeDescriptor;             // tree.cpp
extern const StrategyDescriptor kTreePaperDescriptor;        // tree_paper.cpp
extern const StrategyDescriptor kTree2Descriptor;            // tree_paper.cpp
extern const StrategyDescriptor kHierDescriptor;             // hier.cpp
extern const StrategyDescriptor kRingKVDescriptor;           // ring_kv.cpp
extern const StrategyDescriptor kRingStateDescriptor;        // ring_state.cpp
extern const StrategyDescriptor kAllgatherDescriptor;        // allgather.cpp
extern const StrategyDescriptor kTreeAsAllgatherDescriptor;  // allgather.cpp (tree, no user ops)
extern const StrategyDescriptor kGatherRootDescriptor;       // gather_root.cpp
extern const StrategyDescriptor kSingleDescriptor;           // single.cpp
extern const StrategyDescriptor kTreeDetDescriptor;          // tree_det.cpp

// The strategies a backend offers, in the CLI's order (registry.cpp).
std::span<const StrategyDescriptor* const> strategy_descriptors(bool user_reductions);
// The descriptor a backend offers under `name`; nullptr for a name it does not offer.
// analytic_cost, predict and the memory pre-check describe the strategies of a backend with
// user-defined reductions (the default).
const StrategyDescriptor* find_strategy_descriptor(std::string_view name,
                                                   bool user_reductions = true);

// extra_kv_caches of a strategy that works on the shared placement's shards and keeps no
// KV-sized buffers.
inline double no_extra_kv(int) { return 0.0; }

}  // namespace strategies
}  // namespace treeattn
