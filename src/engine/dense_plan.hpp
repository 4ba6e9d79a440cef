// How the serving engine spreads the dense layers over the ranks (EngineConfig::dense): the
// choice (by name, or the cost model's for one decoding sequence on the job's topology) and this
// rank's weights for it: the model's whole (replicated) or slice `rank` of `ranks` of every
// projection's output rows (split), with the rows8 copy of exactly those rows.
#pragma once

#include <string_view>

#include "treeattn/comm.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/model.hpp"
#include "treeattn/status.hpp"

namespace treeattn::engine {

// "split", "replicated" or "auto"; kInvalidArgument otherwise.
Status check_dense_name(std::string_view name);

// The cost query of one decoding sequence's dense part on `ranks` ranks (predict_dense):
// the model's weights, its largest slice and the widths each group gathers.
DenseQuery dense_query(const model::LlamaModel& model, int ranks);

struct DensePlan {
  DenseChoice choice;
  model::DenseWeights weights;
};

// Collective over comm, every rank with the same (agreed) configuration: auto at more than one
// rank plans on config.topology (rank 0 reads it) or the job's own (job_topology_of), and every
// rank takes rank 0's choice; then each rank slices its weights. A model whose matrices cannot
// be sliced is refused on every rank (the message names the tensor and why), as is a topology
// auto cannot plan on (rank 0's message).
Result<DensePlan> plan_dense(Communicator& comm, const EngineConfig& config,
                             const model::LlamaModel& model);

}  // namespace treeattn::engine
