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
//
// Message ordering (comm.hpp): no point-to-point messages; every rank makes the same single
// collective call per step, so there is nothing to match.
//
// Cost: the analytic model counts the ring allreduce's 2 (p-1)/p S per rank (paper eq. 14; a
// reduce sends S from every rank but the root); the cost model simulates the allreduce the
// topology's library picks at S bytes, plus the extra the user-defined operation was measured to
// cost over a built-in one (LinkLevel::user_op_overhead_us, from topo --detect), and keeps one
// more S for the reduction buffer. On a backend without user-defined reductions (NCCL) `tree`
// is the all-gather form (allgather.cpp), and the planner prices that form there.
#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"

namespace treeattn::strategies {
namespace {

class Tree final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "tree"; }

  // Two ranks: one exactly commutative merge per record, whatever the library does; more: the
  // association is the collective library's (rank order on an in-process backend).
  bool merge_batch_invariant() const override {
    return comm_ && (comm_->size() <= 2 || fixed_order());
  }
  bool merge_local_supported(int p) const override { return p <= 2 || (comm_ && fixed_order()); }
  Status merge_local(const float* const* parts, int p, std::size_t n, float* out) override {
    if (!merge_local_supported(p))
      return unsupported("tree: the allreduce at " + std::to_string(p) +
                         " ranks has no local twin (the collective library chooses its "
                         "association by message size)");
    return fold_in_rank_order(parts, p, n, out);
  }

 protected:
  Status merge_n(float* out, std::size_t n) override {
    if (options_.root >= 0) return comm_->reduce_states(out, n, head_dim(), options_.root);
    return comm_->allreduce_states(out, n, head_dim());
  }
};

std::unique_ptr<Strategy> make_tree(const StrategyOptions& o) { return std::make_unique<Tree>(o); }

CostEstimate analytic(const AnalyticInput& in) {
  if (in.p == 1) return in.no_communication(0.0);
  const double P = in.p;
  CostEstimate c;
  c.bytes_sent = in.all ? 2.0 * (P - 1) / P * in.S : (in.rank == in.root ? 0.0 : in.S);
  c.working_set_bytes = in.base_ws();
  c.formula = in.all ? "sent = 2(p-1)/p S (allreduce, paper eq. 14); ws = KV + q + S"
                     : "sent = S (binomial reduce, non-root); ws = KV + q + S";
  return c;
}

// One MPI_Allreduce of the packed (m, l, o[D]) records with the merge as a user op.
Prediction model(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  cost::allreduce_user_op(c, sim, comm, c.state_bytes, "merge-op");
  return cost::finish(c, c.local_us(c.shard_tokens, c.p), comm, sim, c.state_bytes);
}

}  // namespace

constinit const StrategyDescriptor kTreeDescriptor{
    .info = {.name = "tree",
             .summary = "one allreduce with the state merge as a user-defined reduction",
             .merges_states = true},
    .create = make_tree,
    .needs_user_reductions = true,
    .without_user_reductions = &kTreeAsAllgatherDescriptor,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = no_extra_kv,
};

}  // namespace treeattn::strategies
