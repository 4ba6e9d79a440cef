// The serving engine's per-layer merge: a strategy's merge stage (strategy.hpp, Strategy::merge),
// chosen by name or by the planner (`auto`), the same code the decode session and the benchmark
// harness run. The engine holds one LayerMerge for its lifetime.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/topology.hpp"

namespace treeattn::engine {

// What the merge is chosen for: one layer's states of a full batch of decoding sequences.
struct MergeRequest {
  std::string method = "auto";  // a strategy whose descriptor merges states, or "auto"
  AttnShape shape;               // batch = the engine's max batch, q_len 1, the model's heads
  DType kv_dtype = DType::kF16;
  int64_t context = 1;            // tokens per sequence the planner prices (> 0)
  std::string topology;           // file or preset for auto; empty: the job's (job_topology)
  int fanout = 2;                 // hier's inter-node fan-out
};

class LayerMerge {
 public:
  // Collective over comm: every rank passes the same request. auto: rank 0 ranks the strategies
  // that merge states on the topology (the planner's choose_strategy) and every rank takes the
  // first whose merge is batch invariant at this rank count (a served request's bits must not
  // depend on its batch). A name that does not merge a batch of states, an unknown name, or a
  // topology that does not fit the job is refused on every rank with rank 0's message.
  static Result<std::unique_ptr<LayerMerge>> create(Communicator& comm, const MergeRequest& req);

  const MergeChoice& choice() const { return choice_; }
  // n records of head_dim + 2 floats, merged over every rank in place (every rank gets the bits).
  Status merge(float* records, std::size_t n) { return strategy_->merge(records, n); }
  // The same merge without communication (parts[r]: rank r's records); choice().local_twin.
  Status merge_local(const float* const* parts, int p, std::size_t n, float* out) {
    return strategy_->merge_local(parts, p, n, out);
  }

 private:
  LayerMerge() = default;
  std::unique_ptr<Strategy> strategy_;
  MergeChoice choice_;
};

// The engine's merge: EngineConfig::merge (and topology, fanout) for one layer's states of a full
// batch (max_batch rows of the model's heads), priced at the context a batch slot's share of
// `pages` pages per rank holds. Collective.
Result<std::unique_ptr<LayerMerge>> engine_merge(Communicator& comm, const EngineConfig& config,
                                                 const model::LlamaConfig& mc, int64_t pages);

// The strategies whose merge stage the engine can run (StrategyInfo::merges_states) on this
// backend, in the registry's order, tree-det included.
std::vector<std::string> merge_methods(const CommCapabilities& caps);

}  // namespace treeattn::engine
