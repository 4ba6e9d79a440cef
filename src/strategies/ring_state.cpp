// ring-state: a ring that passes partial states instead of KV.
//
// Rank r computes its partial s_r. In each of p - 1 steps k = 0..p-2 it sends the partial it
// received last (its own at k = 0, i.e. s_{(r-k) mod p}) to rank r + 1 and receives
// s_{(r-k-1) mod p} from rank r - 1, so after p - 1 steps of S bytes each every rank holds all p
// partials and merges them in rank order 0..p-1 (the same bits on every rank). This is the fair
// ring baseline the paper did not run: (p - 1) * S bytes per rank instead of the KV ring's
// (p - 1) * 2 t d, but p - 1 latencies in sequence instead of log p. With options.root >= 0 the
// ring still runs and only the root merges.
#include "strategies/common.hpp"

namespace treeattn::strategies {
namespace {

constexpr int kTag = 300;

class RingState final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "ring-state"; }

  Status run(const float* q, const KVShard& local, const ShardPlan&, float* out) override {
    const int p = comm_->size(), r = comm_->rank();
    const std::size_t S = state_floats();
    TREEATTN_RETURN_IF_ERROR(ensure(all_, static_cast<std::size_t>(p) * state_bytes()));
    note_buffers(static_cast<std::size_t>(p) * state_bytes());
    auto slot = [&](int origin) { return all_.as<float>() + static_cast<std::size_t>(origin) * S; };
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, slot(r)));
    const int next = (r + 1) % p, prev = (r + p - 1) % p;
    for (int k = 0; k + 1 < p; ++k) {
      const int send_origin = ((r - k) % p + p) % p;
      const int recv_origin = ((r - k - 1) % p + p) % p;
      auto rq = comm_->irecv(slot(recv_origin), S * sizeof(float), prev, kTag);
      TREEATTN_RETURN_IF_ERROR(rq.status());
      auto sq = comm_->isend(slot(send_origin), S * sizeof(float), next, kTag);
      TREEATTN_RETURN_IF_ERROR(sq.status());
      const CommRequest reqs[2] = {*rq, *sq};
      TREEATTN_RETURN_IF_ERROR(comm_->wait_all(reqs));
    }
    if (!delivers_result(r)) return Status::ok();
    return merge_in_rank_order(all_.as<float>(), p, out);
  }

 private:
  Buffer all_;
};

}  // namespace

std::unique_ptr<Strategy> make_ring_state(const StrategyOptions& o) {
  return std::make_unique<RingState>(o);
}

}  // namespace treeattn::strategies
