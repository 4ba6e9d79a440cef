// single: the whole KV cache on one rank, no merge at all: the reference for speed and memory.
//
// The plan must place every token on rank 0 (ShardKind::kSingle, holder 0). Rank 0 computes the
// attention over the whole cache; in a job of p > 1 ranks the other ranks compute nothing and
// receive the result by broadcast (or, with options.root >= 0, only the root receives it, by
// one message from rank 0). With p = 1 it is just the local kernel. Its latency is the time of
// one rank reading the whole cache, which the sharded strategies divide by p.
//
// Message ordering (comm.hpp): with options.root > 0 the only point-to-point message is the
// result from rank 0 to the root (tag 400 is a label), completed before run() returns; otherwise
// a broadcast, the same call on every rank.
//
// Cost: both models count S per child of rank 0 in a binomial broadcast (Open MPI); NCCL's
// pipelined ring broadcast in the cost model sends S from every rank but the last.
#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"

namespace treeattn::strategies {
namespace {

constexpr int kTag = 400;

class Single final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "single"; }

  Status setup_more(const ShardPlan& plan) override { return check_plan(plan); }

  Status run(const float* q, const KVShard& local, const ShardPlan& plan, float* out) override {
    TREEATTN_RETURN_IF_ERROR(check_plan(plan));
    const int r = comm_->rank();
    if (r == 0) TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out));
    if (comm_->size() == 1) return Status::ok();
    if (options_.root < 0) return comm_->broadcast(out, state_bytes(), 0);
    if (options_.root == 0) return Status::ok();
    if (r == 0) {
      auto s = comm_->isend(out, state_bytes(), options_.root, kTag);
      TREEATTN_RETURN_IF_ERROR(s.status());
      const CommRequest reqs[1] = {*s};
      return comm_->wait_all(reqs);
    }
    if (r == options_.root) {
      auto s = comm_->irecv(out, state_bytes(), 0, kTag);
      TREEATTN_RETURN_IF_ERROR(s.status());
      const CommRequest reqs[1] = {*s};
      return comm_->wait_all(reqs);
    }
    return Status::ok();
  }

 private:
  // The plan is replicated, so every rank reaches the same verdict (no rank waits alone).
  Status check_plan(const ShardPlan& plan) const {
    for (int r = 1; r < plan.ranks(); ++r)
      if (plan.total_tokens(r) != 0)
        return invalid_argument(who() +
                                "strategy 'single' needs the whole KV cache on rank 0, "
                                "but the plan (" +
                                plan.to_string() + ") puts " +
                                std::to_string(plan.total_tokens(r)) + " tokens on rank " +
                                std::to_string(r) + "; use shard kind 'single'");
    return Status::ok();
  }
};

std::unique_ptr<Strategy> make_single(const StrategyOptions& o) {
  return std::make_unique<Single>(o);
}

CostEstimate analytic(const AnalyticInput& in) {
  CostEstimate c;
  if (in.p == 1)
    c.bytes_sent = 0;
  else if (in.all)
    c.bytes_sent = in.S * AnalyticInput::bcast_sends(in.rank, in.p, 0);
  else
    c.bytes_sent = (in.rank == 0 && in.options.root != 0) ? in.S : 0.0;
  c.working_set_bytes = in.base_ws();
  c.formula = "sent = S per binomial broadcast child of rank 0; ws = KV (all on rank 0) + q + S";
  return c;
}

// The cost model: rank 0 holds the whole KV cache and computes alone; in a job of p > 1 ranks it
// then broadcasts the result (binomial for MPI, ring for NCCL).
Prediction model(const cost::Ctx& c) {
  cost::Ctx one = c;
  one.shard_tokens = c.context;
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  if (c.p > 1) {
    if (c.nccl()) {
      const cost::ClosedForm f = cost::nccl_bcast(c.topo, c.p, c.r, c.state_bytes);
      sim.add_sent_all(f.bytes_per_rank);
      sim.add_rounds(f.hops);
      comm.add(c.call(c.n > 1) + f.us, "NCCL ring broadcast of the result");
    } else {
      comm.add(c.call(c.n > 1) + cost::mpi_bcast_binomial(sim, c.state_bytes),
               "binomial broadcast of the result");
    }
  } else {
    comm.algorithm = "no communication";
  }
  return cost::finish(one, one.local_us(c.context, 1), comm, sim, 0.0);
}

// Its own placement (the whole cache on rank 0): one more copy beside a shared placement.
double extra_kv_caches(int) { return 1.0; }

}  // namespace

constinit const StrategyDescriptor kSingleDescriptor{
    .info = {.name = "single",
             .summary = "one rank holds the whole KV cache and broadcasts the result",
             .placement = PlacementNeed::kAllOnRoot},
    .create = make_single,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = extra_kv_caches,
};

}  // namespace treeattn::strategies
