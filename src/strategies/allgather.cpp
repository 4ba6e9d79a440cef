// allgather: every rank receives every partial and merges them itself.
//
// Each rank computes its partial states, one all-gather gives every rank all p partials
// (p * S bytes received, (p - 1) * S sent per rank by a ring or recursive-doubling all-gather,
// S = one step's records), and each rank merges them in rank order 0..p-1. This is what serving
// engines do today (e.g. vLLM's decode context parallelism all-gathers LSEs and outputs), and
// it is the form `tree` takes on a backend without user-defined reductions: one collective, no
// custom operator, at the price of p times the receive volume. Identical inputs merged in the
// same order give every rank the same bits. With options.root >= 0 it is a gather to the root.
//
// Message ordering (comm.hpp): no point-to-point messages; every rank makes the same single
// collective call per step.
//
// Cost: both models count the (p - 1) S bytes each rank sends in the all-gather (ring,
// recursive doubling and Bruck all send that much); the analytic model counts S from every
// rank but the root for the gather.
#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"

namespace treeattn::strategies {
namespace {

class Allgather final : public RankOrderMerge {
 public:
  Allgather(const StrategyOptions& o, std::string_view name) : RankOrderMerge(o), name_(name) {}
  std::string_view name() const override { return name_; }

 protected:
  Status merge_n(float* out, std::size_t n) override {
    const int p = comm_->size();
    const std::size_t bytes = static_cast<std::size_t>(p) * bytes_of(n);
    TREEATTN_RETURN_IF_ERROR(ensure(all_, bytes));
    note_buffers(bytes);
    if (options_.root >= 0) {
      TREEATTN_RETURN_IF_ERROR(comm_->gather(out, bytes_of(n), all_.as<float>(), options_.root));
      if (comm_->rank() != options_.root) return Status::ok();
    } else {
      TREEATTN_RETURN_IF_ERROR(comm_->allgather(out, bytes_of(n), all_.as<float>()));
    }
    return merge_in_rank_order(all_.as<float>(), p, n, out);
  }

 private:
  std::string_view name_;
  Buffer all_;
};

std::unique_ptr<Strategy> make_allgather(const StrategyOptions& o) {
  return std::make_unique<Allgather>(o, "allgather");
}
// The same strategy under the name `tree` (kTreeAsAllgatherDescriptor).
std::unique_ptr<Strategy> make_tree_as_allgather(const StrategyOptions& o) {
  return std::make_unique<Allgather>(o, "tree");
}

CostEstimate analytic(const AnalyticInput& in) {
  if (in.p == 1) return in.no_communication(in.S);
  const double P = in.p;
  CostEstimate c;
  c.bytes_sent = in.all ? (P - 1) * in.S : (in.rank == in.root ? 0.0 : in.S);
  c.working_set_bytes = in.base_ws() + P * in.S;
  c.formula = "sent = (p-1) S (ring all-gather); ws = KV + q + S + p S";
  return c;
}

// The cost model: every rank gathers all p states and merges them locally.
Prediction model(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  if (c.p > 1) {
    if (c.nccl()) {
      const cost::ClosedForm f = cost::nccl_allgather(c.topo, c.p, c.r, c.state_bytes);
      sim.add_sent_all(f.bytes_per_rank);
      sim.add_rounds(f.hops);
      comm.add(c.call(c.n > 1) + f.us, "NCCL ring allgather");
    } else {
      std::string algo;
      const double t = cost::mpi_allgather(sim, c.state_bytes, algo);
      comm.add(c.call(c.n > 1) + t, "allgather " + algo);
    }
  }
  const double local = c.local_us(c.shard_tokens, c.p) + (c.p > 1 ? c.merge_us(c.p) : 0.0);
  return cost::finish(c, local, comm, sim, static_cast<double>(c.p) * c.state_bytes);
}

}  // namespace

constinit const StrategyDescriptor kAllgatherDescriptor{
    .info = {.name = "allgather",
             .summary = "all-gather the partial states, merge locally",
             .holds_every_state = true,
             .merges_states = true},
    .create = make_allgather,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = no_extra_kv,
};

// `tree` on a backend without user-defined reductions (tree.cpp's stand-in there).
constinit const StrategyDescriptor kTreeAsAllgatherDescriptor{
    .info = {.name = "tree",
             .summary = "all-gather of partial states and a local merge (no user-defined reductions)",
             .holds_every_state = true,
             .merges_states = true},
    .create = make_tree_as_allgather,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = no_extra_kv,
};

}  // namespace treeattn::strategies
