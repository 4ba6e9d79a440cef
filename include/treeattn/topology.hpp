// The machine as data: how many ranks sit on a node, how fast the links between them are, and
// how fast one rank can stream its share of the KV cache.
//
// A Topology is a two-level hierarchy (the same vocabulary as the file format in
// docs/topology.md):
//
//   level "node"     ranks that share a node talk over the node's fabric (shared memory,
//                    NVLink, Infinity Fabric, PCIe): latency_us, bandwidth_GBps per direction
//                    per rank.
//   level "network"  ranks on different nodes talk over the network (InfiniBand, Ethernet, an
//                    emulated veth): latency_us, and bandwidth_GBps per link and direction,
//                    with links_per_node links that the node's ranks share.
//
// plus the local memory bandwidth of one rank (memory.bandwidth_GBps), optionally its capacity,
// a peak FLOP rate and a fixed per-kernel overhead. Ranks are placed on nodes in blocks: rank r
// lives on node r / ranks_per_node.
//
// Topologies are loaded from JSON files, from built-in presets ("preset:NAME"), or built from
// measured numbers (topology_from_measurements); they can be dumped back to JSON. Everything
// here is pure data and validation: no MPI, usable for machines that do not exist.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/status.hpp"

namespace treeattn {

// One link class: the cost of a message of n bytes is latency_us + n / (bandwidth_GBps * 1e3) us.
struct LinkLevel {
  std::string name;           // "node" or "network"
  double latency_us = 0;      // one-way small-message latency, > 0
  double bandwidth_GBps = 0;  // per direction, 1 GB = 1e9 bytes, > 0
  int links_per_node = 1;     // network only: links a node's ranks share (DGX: one per GPU)
  // Network only: extra fixed cost of one library call (collective, or one phase of
  // point-to-point messages) whose messages cross this level, on top of the topology's
  // collective_overhead_us. Large where ranks that wait for the network are descheduled (more
  // ranks than cores, as on the emulated cluster); 0 on dedicated hardware.
  double call_overhead_us = 0;
  // Extra fixed cost of one allreduce with a user-defined reduction (the state merge `tree`
  // runs, comm.hpp allreduce_states) over a built-in allreduce of the same bytes: node, for a
  // call inside a node; network, added when the call's messages cross nodes. Measured by
  // `topo --detect` (detect.hpp); 0 (a file without the field) prices the merge allreduce like
  // a built-in one.
  double user_op_overhead_us = 0;
  bool operator==(const LinkLevel&) const = default;
};

// Which collective library runs the MPI-style collectives; selects the algorithm models in
// cost_model.hpp (Open MPI's tuned component, or NCCL/RCCL's ring and tree).
enum class CollectiveLibrary { kMpi, kNccl };
std::string_view collective_library_name(CollectiveLibrary lib);

struct Topology {
  static constexpr std::string_view kFormat = "treeattn-topology/1";

  std::string name;
  std::string description;
  int nodes = 1;
  int ranks_per_node = 1;
  CollectiveLibrary collectives = CollectiveLibrary::kMpi;
  // Fixed software cost of one collective call (launch, progress engine, NCCL base latency).
  double collective_overhead_us = 0;

  LinkLevel node{"node", 0.5, 8.0, 1};  // used when ranks_per_node > 1
  std::optional<LinkLevel> network;     // required when nodes > 1

  double memory_bandwidth_GBps = 0;          // per rank, streaming reads, > 0
  std::optional<double> memory_capacity_GB;  // per rank; the planner rejects plans above it
  std::optional<double> peak_tflops;         // per rank; local time = max(bytes/bw, flops/peak)
  double kernel_overhead_us = 0;             // per local kernel call (launch, thread fork)
  // How many ranks of the whole job can compute at once (0 = all). An emulated cluster on a
  // 2-core machine has 2: with 4 ranks the local phase takes twice as long.
  int max_concurrent_ranks = 0;

  std::vector<std::string> sources;  // where the numbers come from (documentation only)

  int total_ranks() const { return nodes * ranks_per_node; }
  // Checks every field; messages name the field, the value and what is expected.
  Status validate() const;
  bool operator==(const Topology&) const = default;
};

// Parses the JSON text of a topology file. `source` names the text in error messages (a file
// name). Errors look like "topo.json: $.levels[1].bandwidth_GBps: expected a number > 0, got
// -3".
Result<Topology> parse_topology_json(std::string_view text, std::string_view source);

// Loads "preset:NAME" or a JSON file path.
Result<Topology> load_topology(std::string_view path_or_preset);

// Pretty-printed JSON in the file format; parse_topology_json(topology_to_json(t)) == t.
std::string topology_to_json(const Topology& t);

// Built-in presets: dgx-h100x16, mi300x4, rtx4090x2, local, emu-veth, emu-1gbit.
std::vector<std::string> preset_names();
Result<Topology> preset_topology(std::string_view name);

// Numbers measured on a running job (by detect_topology in detect.hpp, part of the measurement
// library treeattn_measure: shared-memory split, memory-bandwidth probe, ping-pong between ranks
// on the same and on different nodes).
struct MeasuredTopology {
  std::string name = "detected";
  int nodes = 1;
  int ranks_per_node = 1;
  double memory_bandwidth_GBps = 0;
  // Half round trip of a small message and the large-message bandwidth; required when the
  // level exists (ranks_per_node > 1, nodes > 1 respectively).
  std::optional<double> intra_latency_us, intra_bandwidth_GBps;
  std::optional<double> inter_latency_us, inter_bandwidth_GBps;
  double inter_call_overhead_us = 0;
  // The user-defined-reduction allreduce's extra over the built-in one (LinkLevel::
  // user_op_overhead_us), inside a node and added across nodes.
  double intra_user_op_overhead_us = 0, inter_user_op_overhead_us = 0;
  int links_per_node = 1;
  double collective_overhead_us = 0;
  int max_concurrent_ranks = 0;  // e.g. the number of cores when ranks oversubscribe them
  double kernel_overhead_us = 0;
  std::vector<std::string> sources;
};
Result<Topology> topology_from_measurements(const MeasuredTopology& m);

}  // namespace treeattn
