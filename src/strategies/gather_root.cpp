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

  Status step(const float* q, const KVShard& local, const ShardPlan&, StateBuffer& out) override {
    ensure_shape(out);
    const int p = comm_->size();
    const int root = options_.root >= 0 ? options_.root : 0;
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out.data()));
    if (comm_->rank() == root) {
      all_.resize(static_cast<std::size_t>(p) * state_floats());
      note_buffers(all_.size() * sizeof(float));
    }
    TREEATTN_RETURN_IF_ERROR(comm_->gather(out.data(), state_bytes(),
                                           comm_->rank() == root ? all_.data() : nullptr, root));
    if (comm_->rank() == root) merge_in_rank_order(all_.data(), p, out.data());
    if (options_.root >= 0) return Status::ok();
    return comm_->broadcast(out.data(), state_bytes(), root);
  }

 private:
  std::vector<float> all_;
};

}  // namespace

std::unique_ptr<Strategy> make_gather_root(const StrategyOptions& o) {
  return std::make_unique<GatherRoot>(o);
}

}  // namespace treeattn::strategies
