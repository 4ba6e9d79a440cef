// allgather: every rank receives every partial and merges them itself.
//
// Each rank computes its partial states, one all-gather gives every rank all p partials
// (p * S bytes received, (p - 1) * S sent per rank by a ring or recursive-doubling all-gather,
// S = one step's records), and each rank merges them in rank order 0..p-1. This is what serving
// engines do today (e.g. vLLM's decode context parallelism all-gathers LSEs and outputs), and
// it is the form `tree` takes on a backend without user-defined reductions: one collective, no
// custom operator, at the price of p times the receive volume. Identical inputs merged in the
// same order give every rank the same bits. With options.root >= 0 it is a gather to the root.
#include "strategies/common.hpp"

namespace treeattn::strategies {
namespace {

class Allgather final : public StrategyBase {
 public:
  Allgather(const StrategyOptions& o, std::string_view name) : StrategyBase(o), name_(name) {}
  std::string_view name() const override { return name_; }

  Status run(const float* q, const KVShard& local, const ShardPlan&, float* out) override {
    const int p = comm_->size();
    const std::size_t bytes = static_cast<std::size_t>(p) * state_bytes();
    TREEATTN_RETURN_IF_ERROR(ensure(all_, bytes));
    note_buffers(bytes);
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out));
    if (options_.root >= 0) {
      TREEATTN_RETURN_IF_ERROR(
          comm_->gather(out, state_bytes(), all_.as<float>(), options_.root));
      if (comm_->rank() != options_.root) return Status::ok();
    } else {
      TREEATTN_RETURN_IF_ERROR(comm_->allgather(out, state_bytes(), all_.as<float>()));
    }
    return merge_in_rank_order(all_.as<float>(), p, out);
  }

 private:
  std::string_view name_;
  Buffer all_;
};

}  // namespace

std::unique_ptr<Strategy> make_allgather(const StrategyOptions& o) {
  return std::make_unique<Allgather>(o, "allgather");
}
std::unique_ptr<Strategy> make_allgather_named(const StrategyOptions& o, std::string_view name) {
  return std::make_unique<Allgather>(o, name);
}

}  // namespace treeattn::strategies
