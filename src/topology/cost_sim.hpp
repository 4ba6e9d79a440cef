// The cost model's simulator, shared by the strategies' cost-model entries (internal header).
//
// cost_model.hpp declares the public model (predict, plan, paper_sweep) and its vocabulary
// (p, r, n, t, S, KV(t), alpha_L, beta_L). This header holds what one strategy's entry composes:
//   Ctx       the query resolved against the topology: p, r, n, t, S, KV(t), the local kernel's
//             time, the fixed cost of a library call;
//   RoundSim  rounds of concurrent messages on a block placement: each round's time, and the
//             bytes every rank sends (Prediction::bytes_sent_per_rank is its busiest rank);
//   the collective algorithms of the topology's library: Open MPI's simulated round by round,
//             NCCL's in closed form (their bytes added to every rank).
// Each strategy's entry (its StrategyDescriptor::model, src/strategies/descriptor.hpp) lives in
// the strategy's own file next to the algorithm it models, and ends with finish(). The
// definitions of the non-inline functions are in cost_sim.cpp; the planner that calls the
// strategies' entries (predict, plan) is src/strategies/planner.cpp.
//
// Pure functions: no MPI, no clocks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/cost_model.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/status.hpp"
#include "treeattn/topology.hpp"

namespace treeattn::cost {

constexpr double kUsPerSecond = 1e6;

// ---- the byte quantities the cost model and analytic_cost use (one definition each) --------

// S: one step's state records, batch * q_len * heads * (head_dim + 2) float32.
inline double state_bytes(const AttnShape& s) {
  return static_cast<double>(s.batch * s.q_len * s.heads) * static_cast<double>(s.head_dim + 2) *
         4.0;
}
// The query, batch * q_len * heads * head_dim float32.
inline double query_bytes(const AttnShape& s) {
  return static_cast<double>(s.batch * s.q_len * s.heads * s.head_dim) * 4.0;
}
// One token of one batch row in the KV cache: its K and V over every KV head, each with its
// float32 scale per KV head for quantized dtypes (what the cache holds, the kernel reads and
// ring-kv sends).
inline double kv_bytes_per_token(const AttnShape& s, DType dtype) {
  const double scales = dtype_is_quantized(dtype) ? sizeof(float) : 0.0;
  return 2.0 * static_cast<double>(s.kv_heads) *
         (static_cast<double>(s.head_dim) * static_cast<double>(dtype_size(dtype)) + scales);
}

// Bytes over GB/s, in microseconds.
inline double transfer_us(double bytes, double gbps) { return bytes / (gbps * 1e3); }

struct Msg {
  int src = 0;
  int dst = 0;
  double bytes = 0;
  bool reduce = false;  // the receiver merges the payload into its own (costs memory traffic)
  bool shared = false;  // shared-memory multicast: the sender's cost is paid once per round
};
using Round = std::vector<Msg>;

// Simulates rounds of messages on a block placement of p ranks, r per node.
class RoundSim {
 public:
  RoundSim(const Topology& topo, int p, int r) : topo_(topo), p_(p), r_(r) {
    sent_.assign(static_cast<std::size_t>(p), 0.0);
  }
  int node_of(int rank) const { return rank / r_; }
  int nodes() const { return (p_ + r_ - 1) / r_; }
  const LinkLevel& link(int a, int b) const {
    return node_of(a) == node_of(b) ? topo_.node : *topo_.network;
  }

  // Time of one round in us; adds each rank's sent bytes times `repeat`. A rank serializes
  // its own sends (and its own receives) at each message's link bandwidth; a node's ranks
  // share its links_per_node network links, so a node also needs
  // network latency + (bytes leaving or entering it) / (links_per_node * bandwidth).
  double round(const Round& msgs, double repeat = 1.0);

  double max_sent() const { return *std::max_element(sent_.begin(), sent_.end()); }
  void add_sent_all(double bytes) {
    for (double& s : sent_) s += bytes;
  }
  int rounds() const { return static_cast<int>(std::lround(rounds_)); }
  void add_rounds(double k) { rounds_ += k; }
  int p() const { return p_; }
  // Rounds simulated so far that had a message between nodes (to tell whether a library
  // call crossed the network).
  int inter_rounds() const { return inter_rounds_; }

 private:
  const Topology& topo_;
  int p_, r_;
  std::vector<double> sent_;
  double rounds_ = 0;
  int inter_rounds_ = 0;
};

// Where a model's time goes.
struct CommCost {
  double us = 0;
  int calls = 0;
  std::string algorithm;
  void add(double t, std::string_view what) {
    us += t;
    ++calls;
    if (!algorithm.empty()) algorithm += "; ";
    algorithm += what;
  }
};

// A collective in closed form (NCCL's tuning model): its time, the bytes each rank sends, and
// its hops (rounds on the critical path).
struct ClosedForm {
  double us = 0;
  double bytes_per_rank = 0;
  int hops = 0;
  std::string algo;
};

// ---- the query, resolved -------------------------------------------------------------------

struct Ctx {
  const Topology& topo;
  AttnShape shape;
  double kv_token_bytes = 0;  // one token of one batch row (kv_bytes_per_token)
  int64_t context = 0;
  int p = 1;
  int r = 1;  // ranks per node actually used
  int n = 1;
  int fanout = 2;
  double state_bytes = 0;  // S
  double q_bytes = 0;
  int64_t shard_tokens = 0;

  double kv_bytes(int64_t tokens) const {
    return static_cast<double>(shape.batch) * static_cast<double>(tokens) * kv_token_bytes;
  }
  double rows() const {
    return static_cast<double>(shape.batch) * static_cast<double>(shape.q_len) *
           static_cast<double>(shape.heads);
  }
  // How many times slower the local phase runs because ranks share cores.
  double concurrency_factor(int ranks) const {
    if (topo.max_concurrent_ranks <= 0 || ranks <= topo.max_concurrent_ranks) return 1.0;
    return std::ceil(static_cast<double>(ranks) / topo.max_concurrent_ranks);
  }
  // One local decode kernel over `tokens` tokens, `ranks` ranks running it at once.
  double local_us(int64_t tokens, int ranks) const {
    const double bytes = kv_bytes(tokens) + q_bytes + state_bytes;
    double t = transfer_us(bytes, topo.memory_bandwidth_GBps);
    if (topo.peak_tflops) {
      const double flops =
          4.0 * rows() * static_cast<double>(tokens) * static_cast<double>(shape.head_dim);
      t = std::max(t, flops / (*topo.peak_tflops * 1e12) * kUsPerSecond);
    }
    return topo.kernel_overhead_us + t * concurrency_factor(ranks);
  }
  // Merging k states held in memory (reads k states, writes one).
  double merge_us(double k) const {
    return transfer_us((k + 1.0) * state_bytes, topo.memory_bandwidth_GBps);
  }
  bool nccl() const { return topo.collectives == CollectiveLibrary::kNccl; }
  // Fixed cost of one library call: collective_overhead_us, plus the network's
  // call_overhead_us when the call's messages crossed nodes.
  double call(bool crossed) const {
    return topo.collective_overhead_us +
           (crossed && topo.network ? topo.network->call_overhead_us : 0.0);
  }
  // Extra of an allreduce with a user-defined reduction over a built-in one of the same bytes
  // (LinkLevel::user_op_overhead_us): the node level's, plus the network's when the call's
  // messages crossed nodes.
  double user_op(bool crossed) const {
    return topo.node.user_op_overhead_us +
           (crossed && topo.network ? topo.network->user_op_overhead_us : 0.0);
  }
  // Ranks oversubscribe the cores: a rank that copies or waits for a transfer takes a core
  // from one that computes, so ring-kv's transfers do not hide under its kernel.
  bool oversubscribed() const {
    return topo.max_concurrent_ranks > 0 && p > topo.max_concurrent_ranks;
  }
};

// Validates q against topo and fills c (p, r, n, t; S, the query's and a KV token's bytes as
// analytic_cost counts them, src/strategies/descriptor.hpp).
Status make_ctx(const CostQuery& q, const Topology& topo, Ctx& c);

// The prediction of a strategy whose local phase takes `local` us and whose communication is
// `comm`, with the bytes sent taken from sim; the peak is KV(t) + q + S + extra_peak.
// Prediction::strategy is left empty (predict() names it).
Prediction finish(const Ctx& c, double local, const CommCost& comm, const RoundSim& sim,
                  double extra_peak);

// ---- collectives ---------------------------------------------------------------------------

// One allreduce of m bytes with a reduction, in the topology's collective library (one call
// added to cost, labelled `label`).
void allreduce(const Ctx& c, RoundSim& sim, CommCost& cost, double m, std::string_view label);

// One allreduce of m bytes with a user-defined reduction (the state merge, comm.hpp
// allreduce_states): the built-in allreduce's algorithm and call cost, plus the extra a
// user-defined operation was measured to cost (Ctx::user_op). NCCL has no user-defined
// reductions: there the planner prices a strategy's stand-in instead (planner.cpp).
void allreduce_user_op(const Ctx& c, RoundSim& sim, CommCost& cost, double m,
                       std::string_view label);

// Open MPI, simulated on sim; each returns the time in us.
// Allgather of m bytes per rank: recursive doubling (p a power of two) or Bruck for small
// totals, ring otherwise (algo names the one used).
double mpi_allgather(RoundSim& sim, double m, std::string& algo);
// Binomial gather to rank 0: in round k, ranks at odd multiples of 2^k send their subtree.
double mpi_gather_binomial(RoundSim& sim, double m);
// Binomial broadcast from rank 0: in round k, ranks below 2^k send to rank + 2^k.
double mpi_bcast_binomial(RoundSim& sim, double m);

// NCCL's ring all-gather of m bytes per rank and its pipelined ring broadcast of m bytes, on p
// ranks placed r per node.
ClosedForm nccl_allgather(const Topology& topo, int p, int r, double m);
ClosedForm nccl_bcast(const Topology& topo, int p, int r, double m);

}  // namespace treeattn::cost
