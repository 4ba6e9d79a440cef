// gather-root: gather the partials to one rank, merge there, broadcast the result.
//
// The root (options.root, or rank 0 when every rank wants the result) gathers all p partial
// states (p * S bytes in, S out of every other rank), merges them in rank order and broadcasts
// the merged records (S bytes down a broadcast tree). This is Star Attention's pattern and the
// natural form when only one rank continues the computation (then the broadcast is skipped).
// Every rank ends with the root's bits.
//
// Message ordering (comm.hpp): no point-to-point messages; every rank makes the same gather
// and (unless options.root >= 0) broadcast calls in the same order per step.
//
// Cost: the analytic model counts the S bytes each rank hands to the gather and S per child
// of a binomial broadcast; the cost model simulates Open MPI's binomial gather, in which a rank
// forwards its whole subtree's states, so its busiest rank sends more.
#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"

namespace treeattn::strategies {
namespace {

class GatherRoot final : public RankOrderMerge {
 public:
  using RankOrderMerge::RankOrderMerge;
  std::string_view name() const override { return "gather-root"; }

 protected:
  Status merge_n(float* out, std::size_t n) override {
    const int p = comm_->size();
    const int root = options_.root >= 0 ? options_.root : 0;
    if (comm_->rank() == root) {
      const std::size_t bytes = static_cast<std::size_t>(p) * bytes_of(n);
      TREEATTN_RETURN_IF_ERROR(ensure(all_, bytes));
      note_buffers(bytes);
    }
    TREEATTN_RETURN_IF_ERROR(comm_->gather(
        out, bytes_of(n), comm_->rank() == root ? all_.as<float>() : nullptr, root));
    if (comm_->rank() == root)
      TREEATTN_RETURN_IF_ERROR(merge_in_rank_order(all_.as<float>(), p, n, out));
    if (options_.root >= 0) return Status::ok();
    return comm_->broadcast(out, bytes_of(n), root);
  }

 private:
  Buffer all_;
};

std::unique_ptr<Strategy> make_gather_root(const StrategyOptions& o) {
  return std::make_unique<GatherRoot>(o);
}

CostEstimate analytic(const AnalyticInput& in) {
  if (in.p == 1) return in.no_communication(0.0);
  const double P = in.p;
  const bool at_root = in.rank == in.root;
  CostEstimate c;
  c.bytes_sent = (at_root ? 0.0 : in.S) +
                 (in.all ? in.S * AnalyticInput::bcast_sends(in.rank, in.p, in.root) : 0.0);
  c.working_set_bytes = in.base_ws() + (at_root ? P * in.S : 0.0);
  c.formula = "sent = S (gather) + S per binomial broadcast child; ws = KV + q + S (+ p S root)";
  return c;
}

// The cost model: binomial gather of the p states to rank 0, merge there, broadcast the merged
// state (binomial for MPI, pipelined ring for NCCL).
Prediction model(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  double root_merge = 0;
  if (c.p > 1) {
    comm.add(c.call(c.n > 1) + cost::mpi_gather_binomial(sim, c.state_bytes), "binomial gather");
    root_merge = c.merge_us(c.p);
    if (c.nccl()) {
      const cost::ClosedForm f = cost::nccl_bcast(c.topo, c.p, c.r, c.state_bytes);
      sim.add_sent_all(f.bytes_per_rank);
      sim.add_rounds(f.hops);
      comm.add(c.call(c.n > 1) + f.us, "NCCL ring broadcast");
    } else {
      comm.add(c.call(c.n > 1) + cost::mpi_bcast_binomial(sim, c.state_bytes),
               "binomial broadcast");
    }
  }
  return cost::finish(c, c.local_us(c.shard_tokens, c.p) + root_merge, comm, sim,
                      static_cast<double>(c.p) * c.state_bytes);
}

}  // namespace

constinit const StrategyDescriptor kGatherRootDescriptor{
    .info = {.name = "gather-root",
             .summary = "gather the states to one rank, merge, broadcast",
             .holds_every_state = true,
             .merges_states = true},
    .create = make_gather_root,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = no_extra_kv,
};

}  // namespace treeattn::strategies
