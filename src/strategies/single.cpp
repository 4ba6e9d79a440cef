// single: the whole KV cache on one rank, no merge at all: the reference for speed and memory.
//
// The plan must place every token on rank 0 (ShardKind::kSingle, holder 0). Rank 0 computes the
// attention over the whole cache; in a job of p > 1 ranks the other ranks compute nothing and
// receive the result by broadcast (or, with options.root >= 0, only the root receives it, by
// one message from rank 0). With p = 1 it is just the local kernel. Its latency is the time of
// one rank reading the whole cache, which the sharded strategies divide by p.
#include "strategies/common.hpp"

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

}  // namespace

std::unique_ptr<Strategy> make_single(const StrategyOptions& o) {
  return std::make_unique<Single>(o);
}

}  // namespace treeattn::strategies
