// The cost model's simulator (cost_sim.hpp; see cost_model.hpp for the vocabulary: p, r, n, t,
// S, KV(t), alpha_L, beta_L): collectives on a topology, the query resolved against it.
//
// Communication is simulated as rounds of concurrent messages (RoundSim). Each collective
// algorithm is a generator of rounds; each strategy is a sequence of collectives around the
// local kernel, modelled in the strategy's own file (its descriptor's `model`,
// src/strategies/descriptor.hpp), and predict / plan / paper_sweep are the planner
// (src/strategies/planner.cpp): strategies depend on the topology, not the other way round.
// Rounds that repeat identically (ring steps) are simulated once and multiplied.
#include "topology/cost_sim.hpp"

#include <algorithm>
#include <cmath>

namespace treeattn {
namespace cost {
namespace {

int ceil_log2(int p) {
  int k = 0;
  while ((1 << k) < p) ++k;
  return k;
}
int floor_pow2(int p) {
  int v = 1;
  while (v * 2 <= p) v *= 2;
  return v;
}

// Open MPI tuned's classic fixed decision (coll_tuned_decision_fixed.c): recursive doubling
// below 10000 bytes, ring above. Kept here as one constant so the choice is visible.
constexpr double kMpiAllreduceRdMaxBytes = 10000;
constexpr double kMpiAllgatherLogMaxBytes = 50000;  // total bytes; ring above

// ---- Open MPI algorithms, simulated ---------------------------------------------------------

// Recursive doubling allreduce (non-power-of-two: fold the first 2*rem ranks in pairs first).
double mpi_allreduce_rd(RoundSim& sim, double m) {
  const int p = sim.p();
  const int p2 = floor_pow2(p);
  const int rem = p - p2;
  auto real = [rem](int nr) { return nr < rem ? 2 * nr + 1 : nr + rem; };
  double t = 0;
  if (rem > 0) {
    Round pre;
    for (int i = 0; i < rem; ++i) pre.push_back({2 * i, 2 * i + 1, m, true});
    t += sim.round(pre);
  }
  for (int mask = 1; mask < p2; mask <<= 1) {
    Round r;
    for (int nr = 0; nr < p2; ++nr) r.push_back({real(nr), real(nr ^ mask), m, true});
    t += sim.round(r);
  }
  if (rem > 0) {
    Round post;
    for (int i = 0; i < rem; ++i) post.push_back({2 * i + 1, 2 * i, m, false});
    t += sim.round(post);
  }
  return t;
}

// Ring allreduce: reduce-scatter then allgather, p-1 identical rounds each of m/p per rank.
double mpi_allreduce_ring(RoundSim& sim, double m) {
  const int p = sim.p();
  Round rs, ag;
  for (int i = 0; i < p; ++i) {
    rs.push_back({i, (i + 1) % p, m / p, true});
    ag.push_back({i, (i + 1) % p, m / p, false});
  }
  const double k = p - 1;
  return k * sim.round(rs, k) + k * sim.round(ag, k);
}

}  // namespace

double RoundSim::round(const Round& msgs, double repeat) {
  if (msgs.empty()) return 0.0;
  const std::size_t np = static_cast<std::size_t>(p_);
  const std::size_t nn = static_cast<std::size_t>(nodes());
  std::vector<double> lat(np, 0.0), send_t(np, 0.0), recv_t(np, 0.0);
  std::vector<double> node_out(nn, 0.0), node_in(nn, 0.0);
  std::vector<char> shared_paid(np, 0);
  bool any_inter = false;
  for (const Msg& m : msgs) {
    const LinkLevel& l = link(m.src, m.dst);
    const double t = transfer_us(m.bytes, l.bandwidth_GBps);
    const auto s = static_cast<std::size_t>(m.src);
    const auto d = static_cast<std::size_t>(m.dst);
    lat[s] = std::max(lat[s], l.latency_us);
    lat[d] = std::max(lat[d], l.latency_us);
    const bool pay_send = !m.shared || !shared_paid[s];
    if (pay_send) {
      send_t[s] += t;
      sent_[s] += m.bytes * repeat;
      shared_paid[s] = 1;
    }
    recv_t[d] += t;
    // Merging a received payload reads it and the accumulator and writes the accumulator.
    if (m.reduce) recv_t[d] += transfer_us(3.0 * m.bytes, topo_.memory_bandwidth_GBps);
    if (node_of(m.src) != node_of(m.dst)) {
      any_inter = true;
      if (pay_send) node_out[static_cast<std::size_t>(node_of(m.src))] += m.bytes;
      node_in[static_cast<std::size_t>(node_of(m.dst))] += m.bytes;
    }
  }
  double worst = 0.0;
  for (std::size_t i = 0; i < np; ++i)
    worst = std::max(worst, lat[i] + std::max(send_t[i], recv_t[i]));
  if (any_inter) {
    const LinkLevel& net = *topo_.network;
    const double node_bw = net.bandwidth_GBps * net.links_per_node;
    for (std::size_t k = 0; k < nn; ++k)
      worst =
          std::max(worst, net.latency_us + transfer_us(std::max(node_out[k], node_in[k]), node_bw));
  }
  rounds_ += repeat;
  if (any_inter) ++inter_rounds_;
  return worst;
}

// Allgather of m bytes per rank: recursive doubling (p a power of two) or Bruck for small
// totals, ring otherwise.
double mpi_allgather(RoundSim& sim, double m, std::string& algo) {
  const int p = sim.p();
  double t = 0;
  if (m * p < kMpiAllgatherLogMaxBytes) {
    const bool pow2 = (p & (p - 1)) == 0;
    algo = pow2 ? "recursive doubling" : "Bruck";
    for (int dist = 1; dist < p; dist <<= 1) {
      Round r;
      const double blocks = std::min(dist, p - dist);
      for (int i = 0; i < p; ++i) {
        const int peer = pow2 ? (i ^ dist) : ((i - dist + p) % p);
        r.push_back({i, peer, m * blocks, false});
      }
      t += sim.round(r);
    }
    return t;
  }
  algo = "ring";
  Round r;
  for (int i = 0; i < p; ++i) r.push_back({i, (i + 1) % p, m, false});
  const double k = p - 1;
  return k * sim.round(r, k);
}

// Binomial gather to rank 0: in round k, ranks at odd multiples of 2^k send their subtree.
double mpi_gather_binomial(RoundSim& sim, double m) {
  const int p = sim.p();
  double t = 0;
  for (int step = 1; step < p; step <<= 1) {
    Round r;
    for (int i = step; i < p; i += 2 * step) {
      const double blocks = std::min(step, p - i);
      r.push_back({i, i - step, m * blocks, false});
    }
    t += sim.round(r);
  }
  return t;
}

// Binomial broadcast from rank 0: in round k, ranks below 2^k send to rank + 2^k.
double mpi_bcast_binomial(RoundSim& sim, double m) {
  const int p = sim.p();
  double t = 0;
  for (int step = 1; step < p; step <<= 1) {
    Round r;
    for (int i = 0; i < step && i + step < p; ++i) r.push_back({i, i + step, m, false});
    t += sim.round(r);
  }
  return t;
}

// ---- NCCL algorithms, from NCCL's tuning model ----------------------------------------------

namespace {

// Ring hops that cross nodes in `steps` ring steps over n nodes (one crossing per node per
// circuit of p hops).
int inter_hops(int steps, int n, int p) {
  if (n <= 1) return 0;
  return std::min(steps, static_cast<int>(std::ceil(static_cast<double>(steps) * n / p)));
}

double ring_bw(const Topology& topo, int n) {
  if (n <= 1) return topo.node.bandwidth_GBps;
  return std::min(topo.node.bandwidth_GBps,
                  topo.network->bandwidth_GBps * topo.network->links_per_node);
}

ClosedForm nccl_allreduce(const Topology& topo, int p, int r, double m) {
  const int n = (p + r - 1) / r;
  const int rr = std::min(p, r);
  const double an = topo.node.latency_us;
  const double aw = n > 1 ? topo.network->latency_us : 0.0;
  // Ring: 2(p-1) pipelined hops, 2(p-1)/p * m through the slowest link.
  ClosedForm ring;
  const int steps = 2 * (p - 1);
  const int ih = inter_hops(steps, n, p);
  ring.us = (steps - ih) * an + ih * aw + transfer_us(m * steps / p, ring_bw(topo, n));
  ring.bytes_per_rank = m * steps / p;
  ring.hops = steps;
  ring.algo = "ring";
  // Tree: chain inside a node (r-1 hops), binary tree over nodes (ceil(log2 n) hops), up and
  // down; the payload streams through the slowest link twice.
  ClosedForm tree;
  const int lg = ceil_log2(n);
  const double slow = n > 1 ? std::min(topo.node.bandwidth_GBps, topo.network->bandwidth_GBps)
                            : topo.node.bandwidth_GBps;
  tree.us = 2.0 * ((rr - 1) * an + lg * aw) + transfer_us(2.0 * m, slow);
  tree.bytes_per_rank = 2.0 * m;
  tree.hops = 2 * ((rr - 1) + lg);
  tree.algo = "tree";
  return tree.us < ring.us ? tree : ring;
}

}  // namespace

ClosedForm nccl_allgather(const Topology& topo, int p, int r, double m) {
  const int n = (p + r - 1) / r;
  ClosedForm c;
  const int steps = p - 1;
  const int ih = inter_hops(steps, n, p);
  const double aw = n > 1 ? topo.network->latency_us : 0.0;
  c.us = (steps - ih) * topo.node.latency_us + ih * aw + transfer_us(m * steps, ring_bw(topo, n));
  c.bytes_per_rank = m * steps;
  c.hops = steps;
  c.algo = "ring";
  return c;
}

ClosedForm nccl_bcast(const Topology& topo, int p, int r, double m) {
  const int n = (p + r - 1) / r;
  ClosedForm c;
  const int steps = p - 1;
  const int ih = inter_hops(steps, n, p);
  const double aw = n > 1 ? topo.network->latency_us : 0.0;
  c.us = (steps - ih) * topo.node.latency_us + ih * aw + transfer_us(m, ring_bw(topo, n));
  c.bytes_per_rank = m;
  c.hops = steps;
  c.algo = "ring (pipelined)";
  return c;
}

// ---- the model ------------------------------------------------------------------------------

// One allreduce of m bytes with a reduction, in the topology's collective library.
void allreduce(const Ctx& c, RoundSim& sim, CommCost& cost, double m, std::string_view label) {
  if (c.p == 1) {
    cost.add(c.topo.collective_overhead_us, std::string(label) + ": 1 rank, no messages");
    return;
  }
  if (c.nccl()) {
    const ClosedForm f = nccl_allreduce(c.topo, c.p, c.r, m);
    sim.add_sent_all(f.bytes_per_rank);
    sim.add_rounds(f.hops);
    cost.add(c.call(c.n > 1) + f.us, std::string(label) + ": NCCL " + f.algo + " allreduce");
    return;
  }
  const int before = sim.inter_rounds();
  if (m < kMpiAllreduceRdMaxBytes) {
    const double t = mpi_allreduce_rd(sim, m);
    cost.add(c.call(sim.inter_rounds() > before) + t,
             std::string(label) + ": allreduce recursive doubling");
  } else {
    const double t = mpi_allreduce_ring(sim, m);
    cost.add(c.call(sim.inter_rounds() > before) + t, std::string(label) + ": allreduce ring");
  }
}

void allreduce_user_op(const Ctx& c, RoundSim& sim, CommCost& cost, double m,
                       std::string_view label) {
  const int before = sim.inter_rounds();
  allreduce(c, sim, cost, m, label);
  if (c.p == 1) return;
  const bool crossed = c.nccl() ? c.n > 1 : sim.inter_rounds() > before;
  const double extra = c.user_op(crossed);
  if (extra <= 0) return;
  cost.us += extra;
  cost.algorithm += " + user-defined op " + std::to_string(static_cast<int64_t>(std::lround(extra))) + " us";
}

Status make_ctx(const CostQuery& q, const Topology& topo, Ctx& c) {
  TREEATTN_RETURN_IF_ERROR(topo.validate());
  TREEATTN_RETURN_IF_ERROR(q.shape.validate());
  if (q.context < 1)
    return invalid_argument("cost model: context must be >= 1 token, got " +
                            std::to_string(q.context));
  const int total = topo.total_ranks();
  const int p = q.ranks == 0 ? total : q.ranks;
  if (p < 1 || p > total)
    return invalid_argument("cost model: ranks must be in [1, " + std::to_string(total) +
                            "] for topology '" + topo.name + "' (" + std::to_string(topo.nodes) +
                            " nodes x " + std::to_string(topo.ranks_per_node) + "), got " +
                            std::to_string(q.ranks));
  const int r = q.ranks_per_node == 0 ? topo.ranks_per_node : q.ranks_per_node;
  if (r < 1 || r > topo.ranks_per_node)
    return invalid_argument("cost model: ranks_per_node must be in [1, " +
                            std::to_string(topo.ranks_per_node) + "], got " +
                            std::to_string(q.ranks_per_node));
  const int n = (p + r - 1) / r;
  if (n > topo.nodes)
    return invalid_argument("cost model: " + std::to_string(p) + " ranks at " + std::to_string(r) +
                            " per node need " + std::to_string(n) + " nodes, topology '" +
                            topo.name + "' has " + std::to_string(topo.nodes));
  if (q.hier_fanout < 1)
    return invalid_argument("cost model: hier_fanout must be >= 1, got " +
                            std::to_string(q.hier_fanout));
  c.shape = q.shape;
  c.kv_token_bytes = kv_bytes_per_token(q.shape, q.kv_dtype);
  c.context = q.context;
  c.p = p;
  c.r = std::min(r, p);
  c.n = n;
  c.fanout = q.hier_fanout;
  c.state_bytes = state_bytes(q.shape);
  c.q_bytes = query_bytes(q.shape);
  c.shard_tokens = (q.context + p - 1) / p;
  return Status::ok();
}

Prediction finish(const Ctx& c, double local, const CommCost& comm, const RoundSim& sim,
                  double extra_peak) {
  Prediction pr;
  pr.local_us = local;
  pr.comm_us = comm.us;
  pr.latency_us = local + comm.us;
  pr.bytes_sent_per_rank = sim.max_sent();
  pr.peak_bytes = c.kv_bytes(c.shard_tokens) + c.q_bytes + c.state_bytes + extra_peak;
  pr.collective_calls = comm.calls;
  pr.comm_rounds = sim.rounds();
  pr.algorithm = comm.algorithm;
  return pr;
}

}  // namespace cost

}  // namespace treeattn
