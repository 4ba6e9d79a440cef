// gather-root: gather the partials to one rank, merge there, broadcast the result.
//
// The root (options.root, or rank 0 when every rank wants the result) gathers all p partial
// states (p * S bytes in, S out of every other rank), merges them in rank order and broadcasts
// the merged records (S bytes down a broadcast tree). This is Star Attention's pattern and the
// natural form when only one rank continues the computation (then the broadcast is skipped).
// Every rank ends with the root's bits.
#include "strategies/common.hpp"

namespace treeattn::strategies {
namespace {

class GatherRoot final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "gather-root"; }

  Status run(const float* q, const KVShard& local, const ShardPlan&, float* out) override {
    const int p = comm_->size();
    const int root = options_.root >= 0 ? options_.root : 0;
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out));
    if (comm_->rank() == root) {
      const std::size_t bytes = static_cast<std::size_t>(p) * state_bytes();
      TREEATTN_RETURN_IF_ERROR(ensure(all_, bytes));
      note_buffers(bytes);
    }
    TREEATTN_RETURN_IF_ERROR(comm_->gather(out, state_bytes(),
                                           comm_->rank() == root ? all_.as<float>() : nullptr,
                                           root));
    if (comm_->rank() == root) TREEATTN_RETURN_IF_ERROR(merge_in_rank_order(all_.as<float>(), p, out));
    if (options_.root >= 0) return Status::ok();
    return comm_->broadcast(out, state_bytes(), root);
  }

 private:
  Buffer all_;
};

}  // namespace

std::unique_ptr<Strategy> make_gather_root(const StrategyOptions& o) {
  return std::make_unique<GatherRoot>(o);
}

}  // namespace treeattn::strategies
