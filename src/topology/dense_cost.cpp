// The dense layers' cost, replicated or split over the ranks (cost_model.hpp, DenseQuery): the
// weights each rank reads per step against the split's all-gathers, on the collective model of
// cost_sim.
#include <algorithm>
#include <cmath>
#include <string>

#include "topology/cost_sim.hpp"
#include "treeattn/cost_model.hpp"

namespace treeattn {
namespace {

// One all-gather of m bytes per rank among p ranks placed r per node, with its call's fixed cost.
double allgather_us(const Topology& topo, int p, int r, double m, cost::RoundSim& sim,
                    std::string& algo) {
  const int n = (p + r - 1) / r;
  const double call =
      topo.collective_overhead_us + (n > 1 && topo.network ? topo.network->call_overhead_us : 0.0);
  if (topo.collectives == CollectiveLibrary::kNccl) {
    const cost::ClosedForm f = cost::nccl_allgather(topo, p, r, m);
    sim.add_sent_all(f.bytes_per_rank);
    sim.add_rounds(f.hops);
    algo = "NCCL ring allgather";
    return call + f.us;
  }
  std::string how;
  const double t = cost::mpi_allgather(sim, m, how);
  algo = "MPI allgather (" + how + ")";
  return call + t;
}

}  // namespace

Result<DensePrediction> predict_dense(const DenseQuery& q, const Topology& topo) {
  TREEATTN_RETURN_IF_ERROR(topo.validate());
  if (!(q.weight_bytes > 0) || q.layers < 1 || q.rows < 1 || q.sampled_rows < 0)
    return invalid_argument("dense cost: weight_bytes " + std::to_string(q.weight_bytes) +
                            ", layers " + std::to_string(q.layers) + ", rows " +
                            std::to_string(q.rows) +
                            ": expected weights > 0, layers >= 1, rows >= 1");
  const int total = topo.total_ranks();
  const int p = q.ranks == 0 ? total : q.ranks;
  if (p < 1 || p > total)
    return invalid_argument("dense cost: ranks must be in [1, " + std::to_string(total) +
                            "] for topology '" + topo.name + "', got " + std::to_string(q.ranks));
  const int r = std::min(p, q.ranks_per_node == 0 ? topo.ranks_per_node : q.ranks_per_node);
  if (r < 1 || r > topo.ranks_per_node || (p + r - 1) / r > topo.nodes)
    return invalid_argument("dense cost: " + std::to_string(p) + " ranks at " + std::to_string(r) +
                            " per node do not fit topology '" + topo.name + "'");
  const double cf = topo.max_concurrent_ranks > 0 && p > topo.max_concurrent_ranks
                        ? std::ceil(static_cast<double>(p) / topo.max_concurrent_ranks)
                        : 1.0;
  const auto rows = static_cast<double>(q.rows);
  const double read_gbps = q.weight_gbps > 0
                              ? std::min(topo.memory_bandwidth_GBps, q.weight_gbps)
                              : topo.memory_bandwidth_GBps;
  auto local = [&](double bytes, double flops) {
    double t = cost::transfer_us(bytes, read_gbps);
    if (topo.peak_tflops && flops > 0)
      t = std::max(t, flops / (*topo.peak_tflops * 1e12) * cost::kUsPerSecond);
    return t * cf;
  };
  DensePrediction d;
  d.replicated_us = local(q.weight_bytes, q.flops_per_row * rows / (q.rows > 1 ? p : 1));
  if (p == 1) {
    d.split_us = d.split_compute_us = d.replicated_us;
    d.algorithm = "one rank: nothing to gather";
    return d;
  }
  const double slice = q.slice_bytes > 0 ? q.slice_bytes : q.weight_bytes / p;
  d.split_compute_us = local(slice, q.flops_per_row * rows * slice / q.weight_bytes);
  // Each all-gather sends (p - 1) m from every rank in every algorithm modelled (recursive
  // doubling and Bruck: m, 2m, ...; ring: m, p - 1 times).
  const double per = 4.0 / p;  // bytes per gathered float, from each rank
  std::string algo;
  auto gather = [&](double m, int times) {
    cost::RoundSim sim(topo, p, r);
    d.split_comm_us += times * allgather_us(topo, p, r, m, sim, algo);
    d.bytes_sent_per_rank += times * (p - 1) * m;
  };
  for (const int64_t w : {q.qkv_width, q.o_width, q.ffn_width, q.down_width})
    gather(rows * static_cast<double>(w) * per, q.layers);
  gather(static_cast<double>(q.sampled_rows * q.head_width) * per, 1);
  gather(std::ceil(rows / p) * static_cast<double>(q.embd_width) * 4.0, 1);
  d.collectives = 4 * q.layers + 2;
  d.split_us = d.split_compute_us + d.split_comm_us;
  d.algorithm = algo + " x " + std::to_string(d.collectives);
  return d;
}

}  // namespace treeattn
