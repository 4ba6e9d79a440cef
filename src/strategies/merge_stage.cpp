// The merge stage's defaults (strategy.hpp: Strategy::merge and its local twin): a strategy that
// does not merge a batch of states says so by name; StrategyBase (common.hpp) runs merge_n.
#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"

namespace treeattn {

Status Strategy::merge(float*, std::size_t) {
  return unsupported(std::string(name()) + " does not merge a batch of states");
}

Status Strategy::merge_local(const float* const*, int p, std::size_t, float*) {
  return unsupported(std::string(name()) + " has no local twin of its merge at " +
                     std::to_string(p) + " ranks");
}

bool Strategy::merge_local_supported(int) const { return false; }

bool Strategy::merge_batch_invariant() const { return false; }

Status Strategy::do_setup_merge(Communicator& comm, Executor&, std::size_t) {
  return unsupported("rank " + std::to_string(comm.world_rank()) + ": " + std::string(name()) +
                     " does not merge a batch of states");
}

namespace strategies {

bool StrategyBase::merges_states() const {
  const StrategyDescriptor* d = find_strategy_descriptor(name());
  return d != nullptr && d->info.merges_states;
}

}  // namespace strategies
}  // namespace treeattn
