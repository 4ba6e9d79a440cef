// tree: the whole merge in one collective.
//
// Each rank computes its partial states (m, l, o) for every (batch, query, head) record, then
// one MPI_Allreduce merges all ranks' records with the state merge as a commutative
// user-defined reduction (comm.hpp allreduce_states). The collective library picks the
// reduction topology (recursive doubling, Rabenseifner, ring...). This is the paper's tree in a
// single call: d_h + 2 floats per record, one collective per decode step instead of three.
//
// Bit-identical results on all ranks: the merge is exactly commutative (the backend folds -0 to
// +0 in m), and Open MPI's allreduce algorithms compute each record along a single reduction
// tree whose result (or the partner's mirror image a (+) b == b (+) a) every rank receives;
// the multirank tests compare all ranks' bytes. With options.root >= 0 it is one MPI_Reduce.
#include "strategies/common.hpp"

namespace treeattn::strategies {
namespace {

class Tree final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "tree"; }

  Status run(const float* q, const KVShard& local, const ShardPlan&, float* out) override {
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out));
    if (options_.root >= 0) return comm_->reduce_states(out, records(), head_dim(), options_.root);
    return comm_->allreduce_states(out, records(), head_dim());
  }
};

}  // namespace

std::unique_ptr<Strategy> make_tree(const StrategyOptions& o) { return std::make_unique<Tree>(o); }

}  // namespace treeattn::strategies
