// Topology validation, loading a topology file or preset, and building a Topology from measured
// numbers. The JSON file format itself is topology_json.cpp.
#include "treeattn/topology.hpp"

#include <cmath>
#include <fstream>
#include <string>

#include "topology/topology_detail.hpp"

namespace treeattn {
namespace {

using topology_detail::fmt_double;
using topology_detail::kMaxCount;
using topology_detail::positive_finite;

Status check_level(const LinkLevel& l, std::string_view where) {
  const std::string w(where);
  if (!positive_finite(l.latency_us))
    return invalid_argument(w + ".latency_us must be a number > 0, got " +
                            fmt_double(l.latency_us));
  if (!positive_finite(l.bandwidth_GBps))
    return invalid_argument(w + ".bandwidth_GBps must be a number > 0, got " +
                            fmt_double(l.bandwidth_GBps));
  if (l.links_per_node < 1)
    return invalid_argument(w + ".links_per_node must be >= 1, got " +
                            std::to_string(l.links_per_node));
  if (!(l.call_overhead_us >= 0) || !std::isfinite(l.call_overhead_us))
    return invalid_argument(w + ".call_overhead_us must be >= 0, got " +
                            fmt_double(l.call_overhead_us));
  if (!(l.user_op_overhead_us >= 0) || !std::isfinite(l.user_op_overhead_us))
    return invalid_argument(w + ".user_op_overhead_us must be >= 0, got " +
                            fmt_double(l.user_op_overhead_us));
  return Status::ok();
}

}  // namespace

std::string_view collective_library_name(CollectiveLibrary lib) {
  return lib == CollectiveLibrary::kNccl ? "nccl" : "mpi";
}

Status Topology::validate() const {
  const std::string who = "topology '" + name + "': ";
  if (nodes < 1 || nodes > kMaxCount)
    return invalid_argument(who + "nodes must be in [1, " + std::to_string(kMaxCount) + "], got " +
                            std::to_string(nodes));
  if (ranks_per_node < 1 || ranks_per_node > kMaxCount)
    return invalid_argument(who + "ranks_per_node must be in [1, " + std::to_string(kMaxCount) +
                            "], got " + std::to_string(ranks_per_node));
  if (int64_t{nodes} * ranks_per_node > kMaxCount)
    return invalid_argument(
        who + "nodes * ranks_per_node = " + std::to_string(int64_t{nodes} * ranks_per_node) +
        " exceeds " + std::to_string(kMaxCount));
  if (node.name != "node")
    return invalid_argument(who + "the first level must be named \"node\", got \"" + node.name +
                            "\"");
  TREEATTN_RETURN_IF_ERROR(check_level(node, who + "level node"));
  if (network) {
    if (network->name != "network")
      return invalid_argument(who + "the second level must be named \"network\", got \"" +
                              network->name + "\"");
    TREEATTN_RETURN_IF_ERROR(check_level(*network, who + "level network"));
  } else if (nodes > 1) {
    return invalid_argument(who + "nodes = " + std::to_string(nodes) +
                            " needs a \"network\" level (latency and bandwidth between nodes)");
  }
  if (!(collective_overhead_us >= 0) || !std::isfinite(collective_overhead_us))
    return invalid_argument(who + "collective_overhead_us must be >= 0, got " +
                            fmt_double(collective_overhead_us));
  if (!positive_finite(memory_bandwidth_GBps))
    return invalid_argument(who + "memory.bandwidth_GBps must be > 0, got " +
                            fmt_double(memory_bandwidth_GBps));
  if (memory_capacity_GB && !positive_finite(*memory_capacity_GB))
    return invalid_argument(who + "memory.capacity_GB must be > 0, got " +
                            fmt_double(*memory_capacity_GB));
  if (peak_tflops && !positive_finite(*peak_tflops))
    return invalid_argument(who + "compute.peak_TFLOPs must be > 0, got " +
                            fmt_double(*peak_tflops));
  if (!(kernel_overhead_us >= 0) || !std::isfinite(kernel_overhead_us))
    return invalid_argument(who + "compute.kernel_overhead_us must be >= 0, got " +
                            fmt_double(kernel_overhead_us));
  if (max_concurrent_ranks < 0)
    return invalid_argument(who +
                            "compute.max_concurrent_ranks must be >= 0 (0 = unlimited), "
                            "got " +
                            std::to_string(max_concurrent_ranks));
  return Status::ok();
}

Result<Topology> load_topology(std::string_view path_or_preset) {
  constexpr std::string_view kPrefix = "preset:";
  if (path_or_preset.substr(0, kPrefix.size()) == kPrefix)
    return preset_topology(path_or_preset.substr(kPrefix.size()));
  const std::string path(path_or_preset);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return invalid_argument("cannot open topology file '" + path +
                            "' (give a JSON file or preset:NAME; presets: dgx-h100x16, mi300x4, "
                            "rtx4090x2, local, emu-veth, emu-1gbit)");
  }
  // A topology file is a few hundred bytes: stop reading well before a wrong path (a log, a
  // device such as /dev/zero) fills memory.
  constexpr std::size_t kMaxBytes = 16u << 20;
  std::string text(kMaxBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return invalid_argument("cannot read topology file '" + path + "'");
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kMaxBytes)
    return invalid_argument("topology file '" + path + "' is larger than 16 MiB: not a topology " +
                            "file (docs/topology.md)");
  return parse_topology_json(text, path);
}

Result<Topology> topology_from_measurements(const MeasuredTopology& m) {
  Topology t;
  t.name = m.name;
  t.description = "measured: " + std::to_string(m.nodes) + " node(s) x " +
                  std::to_string(m.ranks_per_node) + " rank(s)";
  t.nodes = m.nodes;
  t.ranks_per_node = m.ranks_per_node;
  t.collectives = CollectiveLibrary::kMpi;
  t.collective_overhead_us = m.collective_overhead_us;
  t.memory_bandwidth_GBps = m.memory_bandwidth_GBps;
  t.max_concurrent_ranks = m.max_concurrent_ranks;
  t.kernel_overhead_us = m.kernel_overhead_us;
  t.sources = m.sources;
  if (m.ranks_per_node > 1) {
    if (!m.intra_latency_us || !m.intra_bandwidth_GBps)
      return invalid_argument(
          "measured topology: ranks_per_node = " + std::to_string(m.ranks_per_node) +
          " needs the intra-node latency and bandwidth");
    t.node = LinkLevel{"node", *m.intra_latency_us, *m.intra_bandwidth_GBps, 1};
  } else if (m.intra_latency_us && m.intra_bandwidth_GBps) {
    t.node = LinkLevel{"node", *m.intra_latency_us, *m.intra_bandwidth_GBps, 1};
  }
  t.node.user_op_overhead_us = m.intra_user_op_overhead_us;
  if (m.nodes > 1 || (m.inter_latency_us && m.inter_bandwidth_GBps)) {
    if (!m.inter_latency_us || !m.inter_bandwidth_GBps)
      return invalid_argument("measured topology: nodes = " + std::to_string(m.nodes) +
                              " needs the inter-node latency and bandwidth");
    t.network = LinkLevel{"network", *m.inter_latency_us, *m.inter_bandwidth_GBps, m.links_per_node,
                          m.inter_call_overhead_us, m.inter_user_op_overhead_us};
  }
  TREEATTN_RETURN_IF_ERROR(t.validate());
  return t;
}

}  // namespace treeattn
