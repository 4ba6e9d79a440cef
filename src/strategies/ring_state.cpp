// ring-state: a ring that passes partial states instead of KV.
//
// Rank r computes its partial s_r. In each of p - 1 steps k = 0..p-2 it sends the partial it
// received last (its own at k = 0, i.e. s_{(r-k) mod p}) to rank r + 1 and receives
// s_{(r-k-1) mod p} from rank r - 1, so after p - 1 steps of S bytes each every rank holds all p
// partials and merges them in rank order 0..p-1 (the same bits on every rank). This is the fair
// ring baseline the paper did not run: (p - 1) * S bytes per rank instead of the KV ring's
// (p - 1) * 2 t d, but p - 1 latencies in sequence instead of log p. With options.root >= 0 the
// ring still runs and only the root merges.
//
// Message ordering (comm.hpp): one message per hop from rank r to rank r + 1, posted on both
// sides in hop order with the size of one step's states; tag 300 is a label, and each hop's
// requests complete before the next hop.
//
// Cost: both models count the (p - 1) S bytes each rank forwards.
#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"

namespace treeattn::strategies {
namespace {

constexpr int kTag = 300;

class RingState final : public RankOrderMerge {
 public:
  using RankOrderMerge::RankOrderMerge;
  std::string_view name() const override { return "ring-state"; }

 protected:
  Status merge_n(float* out, std::size_t n) override {
    const int p = comm_->size(), r = comm_->rank();
    const std::size_t S = floats_of(n);
    TREEATTN_RETURN_IF_ERROR(ensure(all_, static_cast<std::size_t>(p) * bytes_of(n)));
    note_buffers(static_cast<std::size_t>(p) * bytes_of(n));
    auto slot = [&](int origin) { return all_.as<float>() + static_cast<std::size_t>(origin) * S; };
    TREEATTN_RETURN_IF_ERROR(exec_->copy(slot(r), out, bytes_of(n)));
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
    return merge_in_rank_order(all_.as<float>(), p, n, out);
  }

 private:
  Buffer all_;
};

std::unique_ptr<Strategy> make_ring_state(const StrategyOptions& o) {
  return std::make_unique<RingState>(o);
}

CostEstimate analytic(const AnalyticInput& in) {
  if (in.p == 1) return in.no_communication(in.S);
  const double P = in.p;
  CostEstimate c;
  c.bytes_sent = (P - 1) * in.S;
  c.working_set_bytes = in.base_ws() + P * in.S;
  c.formula = "sent = (p-1) S; ws = KV + q + S + p S";
  return c;
}

// The cost model: p-1 steps; in each, every rank forwards the state it received last (its own
// first) to rank + 1. Every rank then holds all p partials and merges them in rank order.
Prediction model(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  if (c.p > 1) {
    cost::Round r;
    for (int i = 0; i < c.p; ++i) r.push_back({i, (i + 1) % c.p, c.state_bytes, false});
    const double k = c.p - 1;
    comm.us = k * (c.call(c.n > 1) + sim.round(r, k));
    comm.calls = c.p - 1;
    comm.algorithm = std::to_string(c.p - 1) + " ring steps of S";
  }
  const double merge = c.p > 1 ? c.merge_us(c.p) : 0.0;
  return cost::finish(c, c.local_us(c.shard_tokens, c.p) + merge, comm, sim,
                      c.p > 1 ? c.p * c.state_bytes : 0.0);
}

}  // namespace

constinit const StrategyDescriptor kRingStateDescriptor{
    .info = {.name = "ring-state",
             .summary = "partial states rotate around the ring (p - 1 small messages)",
             .merges_states = true},
    .create = make_ring_state,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = no_extra_kv,
};

}  // namespace treeattn::strategies
