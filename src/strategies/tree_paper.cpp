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
#include <cmath>
#include <limits>

#include "strategies/common.hpp"

namespace treeattn::strategies {
namespace {

class TreePaper final : public StrategyBase {
 public:
  TreePaper(const StrategyOptions& o, bool fused) : StrategyBase(o), fused_(fused) {}
  std::string_view name() const override { return fused_ ? "tree2" : "tree-paper"; }

  Status step(const float* q, const KVShard& local, const ShardPlan&, StateBuffer& out) override {
    ensure_shape(out);
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out.data()));
    const std::size_t n = records(), D = head_dim();
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    lse_.resize(n);
    for (std::size_t i = 0; i < n; ++i) lse_[i] = state_lse(out.record(i));
    TREEATTN_RETURN_IF_ERROR(comm_->allreduce(lse_.data(), n, ReduceOp::kMax));
    // Our weights, scaled outputs and denominators.
    const std::size_t stride = fused_ ? D + 1 : D;
    num_.resize(n * stride);
    den_.resize(fused_ ? 0 : n);
    for (std::size_t i = 0; i < n; ++i) {
      const float* rec = out.record(i);
      const float M = lse_[i];
      const float mine = state_lse(rec);
      const float w = (mine == kNegInf || M == kNegInf) ? 0.0f : std::exp(mine - M);
      float* dst = num_.data() + i * stride;
      const float l = rec[1];
      for (std::size_t d = 0; d < D; ++d) dst[d] = w == 0.0f ? 0.0f : rec[2 + d] / l * w;
      if (fused_)
        dst[D] = w;
      else
        den_[i] = w;
    }
    note_buffers((lse_.size() + num_.size() + den_.size()) * sizeof(float));
    if (options_.root >= 0) {
      TREEATTN_RETURN_IF_ERROR(
          comm_->reduce(num_.data(), num_.size(), ReduceOp::kSum, options_.root));
      if (!fused_)
        TREEATTN_RETURN_IF_ERROR(comm_->reduce(den_.data(), n, ReduceOp::kSum, options_.root));
      if (comm_->rank() != options_.root) return Status::ok();
    } else {
      TREEATTN_RETURN_IF_ERROR(comm_->allreduce(num_.data(), num_.size(), ReduceOp::kSum));
      if (!fused_) TREEATTN_RETURN_IF_ERROR(comm_->allreduce(den_.data(), n, ReduceOp::kSum));
    }
    for (std::size_t i = 0; i < n; ++i) {
      float* rec = out.record(i);
      const float* src = num_.data() + i * stride;
      const float L = fused_ ? src[D] : den_[i];
      if (lse_[i] == kNegInf || L == 0.0f) {
        state_set_empty(rec, D);
        continue;
      }
      rec[0] = lse_[i];
      rec[1] = L;
      for (std::size_t d = 0; d < D; ++d) rec[2 + d] = src[d];
    }
    return Status::ok();
  }

 private:
  bool fused_;
  std::vector<float> lse_, num_, den_;
};

}  // namespace

std::unique_ptr<Strategy> make_tree_paper(const StrategyOptions& o) {
  return std::make_unique<TreePaper>(o, false);
}
std::unique_ptr<Strategy> make_tree2(const StrategyOptions& o) {
  return std::make_unique<TreePaper>(o, true);
}

}  // namespace treeattn::strategies
