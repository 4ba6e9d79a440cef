// tree-paper and tree2: the paper's merge with the built-in MAX and SUM reductions only.
//
// tree-paper is Algorithm 3 of the paper as its code runs it. From each rank's partial state
// (m, l, o) it forms the normalized output o_p = o / l and lse_p = m + log(l), then
//   1. M = Allreduce(MAX, lse_p)                      one float per record
//   2. N = Allreduce(SUM, o_p * exp(lse_p - M))       head_dim floats per record
//   3. L = Allreduce(SUM, exp(lse_p - M))             one float per record
// and the merged state is (m = M, l = L, o = N): its output N / L is the exact attention, its
// LSE M + log(L). Every weight exp(lse_p - M) is <= 1 and at least one is 1, so nothing
// overflows. Empty shards have lse_p = -inf and weight 0; if every shard is empty M = -inf and
// the result is the empty state (no -inf - -inf is ever evaluated).
//
// tree2 fuses steps 2 and 3 into one SUM over head_dim + 1 floats per record (two collectives),
// which is what a backend without user-defined reductions (NCCL) can do best in one round trip.
// Both exist for comparison with `tree` (one collective) and for such backends.
//
// The sums run in float32 in whatever order the library's algorithm uses; Open MPI's algorithms
// give every rank the same result, which the multirank tests check. With options.root >= 0 the
// MAX stays an allreduce (every rank needs M to scale) and the sums become reduces to the root.
//
// Message ordering (comm.hpp): no point-to-point messages; every rank makes the same two or
// three collective calls in the same order per step.
//
// Cost: the analytic model counts ring allreduces (2 (p-1)/p of each message per rank; the
// reduces send their message from every rank but the root); the cost model simulates each
// allreduce with the algorithm the topology's library picks at its own size (the MAX of n
// floats is small, recursive doubling on Open MPI) and adds the local rescale.
#include <cmath>
#include <limits>

#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"

namespace treeattn::strategies {
namespace {

class TreePaper final : public StrategyBase {
 public:
  TreePaper(const StrategyOptions& o, bool fused) : StrategyBase(o), fused_(fused) {}
  std::string_view name() const override { return fused_ ? "tree2" : "tree-paper"; }

  // The MAX is exact; the SUMs are one exactly commutative addition at two ranks.
  bool merge_batch_invariant() const override {
    return comm_ && (comm_->size() <= 2 || fixed_order());
  }

 protected:
  Status merge_n(float* out, std::size_t n) override {
    const std::size_t D = head_dim();
    const std::size_t stride = fused_ ? D + 1 : D;
    TREEATTN_RETURN_IF_ERROR(ensure(lse_, n * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(ensure(num_, n * stride * sizeof(float)));
    if (!fused_) TREEATTN_RETURN_IF_ERROR(ensure(den_, n * sizeof(float)));
    note_buffers((n + n * stride + (fused_ ? 0 : n)) * sizeof(float));
    float* lse = lse_.as<float>();
    float* num = num_.as<float>();
    float* den = fused_ ? nullptr : den_.as<float>();
    // 1. M = max over ranks of each record's LSE.
    TREEATTN_RETURN_IF_ERROR(exec_->lse(out, n, D, lse));
    TREEATTN_RETURN_IF_ERROR(comm_->allreduce(lse, n, ReduceOp::kMax));
    // 2./3. Our weights exp(lse - M), weighted outputs and denominators, summed over ranks.
    TREEATTN_RETURN_IF_ERROR(exec_->to_sum_form(out, lse, n, D, num, stride, den));
    if (options_.root >= 0) {
      TREEATTN_RETURN_IF_ERROR(comm_->reduce(num, n * stride, ReduceOp::kSum, options_.root));
      if (!fused_) TREEATTN_RETURN_IF_ERROR(comm_->reduce(den, n, ReduceOp::kSum, options_.root));
      if (comm_->rank() != options_.root) return Status::ok();
    } else {
      TREEATTN_RETURN_IF_ERROR(comm_->allreduce(num, n * stride, ReduceOp::kSum));
      if (!fused_) TREEATTN_RETURN_IF_ERROR(comm_->allreduce(den, n, ReduceOp::kSum));
    }
    // The merged state (M, L, N); empty where M = -inf or L = 0.
    return exec_->from_sum_form(lse, num, stride, den, n, D, out);
  }

 private:
  bool fused_;
  Buffer lse_, num_, den_;
};

std::unique_ptr<Strategy> make_tree_paper(const StrategyOptions& o) {
  return std::make_unique<TreePaper>(o, false);
}
std::unique_ptr<Strategy> make_tree2(const StrategyOptions& o) {
  return std::make_unique<TreePaper>(o, true);
}

// Both forms send the same bytes: MAX over n floats, then SUMs over n (D + 1) floats.
CostEstimate analytic(const AnalyticInput& in, bool fused) {
  if (in.p == 1) return in.no_communication(0.0);
  const double P = in.p;
  const double n = static_cast<double>(in.shape.batch * in.shape.q_len * in.shape.heads);
  const double max_part = 2.0 * (P - 1) / P * n * 4.0;
  const double sum_part =
      in.all ? 2.0 * (P - 1) / P * (in.S - n * 4.0) : (in.rank == in.root ? 0.0 : in.S - n * 4.0);
  CostEstimate c;
  c.bytes_sent = max_part + sum_part;
  c.working_set_bytes = in.base_ws() + in.S;  // lse + numerators + denominators
  c.formula = fused ? "sent = 2(p-1)/p (n + n(D+1)) 4 B (MAX, fused SUM); ws = KV + q + 2S"
                    : "sent = 2(p-1)/p (n + nD + n) 4 B (MAX, SUM, SUM); ws = KV + q + 2S";
  return c;
}
CostEstimate analytic_paper(const AnalyticInput& in) { return analytic(in, false); }
CostEstimate analytic_fused(const AnalyticInput& in) { return analytic(in, true); }

// tree-paper: Algorithm 3 of the paper: MAX of lse (one float per row), SUM of the rescaled
// outputs (D floats per row), SUM of the denominators (one float per row), then a local
// rescale and divide.
Prediction model_paper(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  const double row = c.rows() * 4.0;
  cost::allreduce(c, sim, comm, row, "max(lse)");
  cost::allreduce(c, sim, comm, row * static_cast<double>(c.shape.head_dim), "sum(num)");
  cost::allreduce(c, sim, comm, row, "sum(den)");
  const double rescale = cost::transfer_us(3.0 * c.state_bytes, c.topo.memory_bandwidth_GBps);
  return cost::finish(c, c.local_us(c.shard_tokens, c.p) + rescale, comm, sim, c.state_bytes);
}

// tree2: MAX of m, then one fused SUM of (l, o[D]) rescaled to the global max.
Prediction model_fused(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  const double row = c.rows() * 4.0;
  cost::allreduce(c, sim, comm, row, "max(m)");
  cost::allreduce(c, sim, comm, row * static_cast<double>(c.shape.head_dim + 1), "sum(l,o)");
  const double rescale = cost::transfer_us(2.0 * c.state_bytes, c.topo.memory_bandwidth_GBps);
  return cost::finish(c, c.local_us(c.shard_tokens, c.p) + rescale, comm, sim, c.state_bytes);
}

}  // namespace

constinit const StrategyDescriptor kTreePaperDescriptor{
    .info = {.name = "tree-paper",
             .summary =
             "the paper's three allreduces: MAX of LSE, SUM of outputs, SUM of denominators",
             .merges_states = true},
    .create = make_tree_paper,
    .analytic = analytic_paper,
    .model = model_paper,
    .extra_kv_caches = no_extra_kv,
};

constinit const StrategyDescriptor kTree2Descriptor{
    .info = {.name = "tree2",
             .summary = "MAX of LSE, then one fused SUM of outputs and denominators",
             .merges_states = true},
    .create = make_tree2,
    .analytic = analytic_fused,
    .model = model_fused,
    .extra_kv_caches = no_extra_kv,
};

}  // namespace treeattn::strategies
