// Built-in topology presets ("preset:NAME"). Every number has its source or assumption in the
// preset's `sources` list, and docs/topology.md discusses them. Bandwidths are per direction
// (1 GB = 1e9 bytes); NVLink's "900 GB/s" is the bidirectional aggregate of one H100.
#include <string>

#include "treeattn/topology.hpp"

namespace treeattn {
namespace {

Topology dgx_h100x16() {
  Topology t;
  t.name = "dgx-h100x16";
  t.description =
      "16 DGX H100 nodes x 8 H100 SXM (the paper's cluster): NVLink 4 inside a node, one "
      "400 Gb/s InfiniBand NDR link per GPU, NCCL collectives";
  t.nodes = 16;
  t.ranks_per_node = 8;
  t.collectives = CollectiveLibrary::kNccl;
  t.collective_overhead_us = 4.4;
  t.node = {"node", 0.5, 450.0, 1};
  t.network = LinkLevel{"network", 5.0, 50.0, 8};
  t.memory_bandwidth_GBps = 3350.0;
  t.memory_capacity_GB = 80.0;
  t.peak_tflops = 989.0;
  t.kernel_overhead_us = 5.0;
  t.sources = {
      "paper section 6: 16 nodes x 8 H100, NVLink 900 GB/s, 8 x 400 Gb/s IB NDR per node",
      "NVIDIA H100 SXM datasheet: HBM3 3.35 TB/s, 80 GB, 989 TFLOP/s dense BF16; NVLink 4 "
      "900 GB/s bidirectional = 450 GB/s per direction",
      "NCCL src/graph/tuning.cc: base latency ~4.4 us (LL), NVLink hop ~0.5 us, network hop "
      "~5 us (assumption; NCCL's own tables)",
      "kernel_overhead_us 5: launch + split-KV combine of a flash-decode kernel (assumption)"};
  return t;
}

Topology mi300x4() {
  Topology t;
  t.name = "mi300x4";
  t.description = "4 AMD MI300X in one node over Infinity Fabric, RCCL collectives";
  t.nodes = 1;
  t.ranks_per_node = 4;
  t.collectives = CollectiveLibrary::kNccl;
  t.collective_overhead_us = 12.0;
  t.node = {"node", 1.0, 64.0, 1};
  t.memory_bandwidth_GBps = 5300.0;
  t.memory_capacity_GB = 192.0;
  t.peak_tflops = 1307.0;
  t.kernel_overhead_us = 5.0;
  t.sources = {
      "paper Table 1: 4 x MI300X, Infinity Fabric",
      "AMD MI300X datasheet: HBM3 5.3 TB/s, 192 GB, 1307 TFLOP/s dense BF16; 7 Infinity "
      "Fabric links of 128 GB/s bidirectional, one link (64 GB/s per direction) per GPU pair",
      "ROCm/rccl src/graph/tuning.cc: base latency 12 us (LL); xGMI hop ~1 us (assumption)",
      "kernel_overhead_us 5 (assumption)"};
  return t;
}

Topology rtx4090x2() {
  Topology t;
  t.name = "rtx4090x2";
  t.description = "2 GeForce RTX 4090 over PCIe 4.0 x16 (no P2P: NCCL goes through host memory)";
  t.nodes = 1;
  t.ranks_per_node = 2;
  t.collectives = CollectiveLibrary::kNccl;
  t.collective_overhead_us = 4.4;
  t.node = {"node", 10.0, 12.0, 1};
  t.memory_bandwidth_GBps = 1008.0;
  t.memory_capacity_GB = 24.0;
  t.peak_tflops = 82.6;
  t.kernel_overhead_us = 5.0;
  t.sources = {
      "paper Fig. 4 and Table 2: 2 x RTX 4090 over PCIe",
      "NVIDIA RTX 4090 specifications: GDDR6X 1008 GB/s, 24 GB; 82.6 TFLOP/s BF16 tensor "
      "with FP32 accumulate",
      "PCIe 4.0 x16 peak 32 GB/s per direction; GeForce 40 has no P2P, NCCL's SHM transport "
      "copies through host memory: ~12 GB/s and ~10 us per hop (assumption)"};
  return t;
}

// This machine (research/ecosystem.md): 2 Zen 5 cores, Open MPI 4.1.4 over shared memory.
Topology local_machine() {
  Topology t;
  t.name = "local";
  t.description = "this machine: 2 ranks on 2 Zen 5 cores, Open MPI over shared memory";
  t.nodes = 1;
  t.ranks_per_node = 2;
  t.collectives = CollectiveLibrary::kMpi;
  t.collective_overhead_us = 0.8;
  t.node = {"node", 0.47, 8.8, 1};
  t.memory_bandwidth_GBps = 32.0;
  t.kernel_overhead_us = 2.0;
  t.max_concurrent_ranks = 2;
  t.sources = {
      "research/ecosystem.md: shared-memory ping-pong 0.47 us at 8 B, 8.8 GB/s at 2 MiB",
      "research/ecosystem.md: STREAM-like ~32 GB/s per core (1 thread), ~62 GB/s with 2",
      "collective_overhead_us 0.8: 1 KiB allreduce on 2 ranks measured 1.2-1.6 us minus one "
      "0.47 us hop",
      "kernel_overhead_us 2 (assumption: thread start + state write); calibrate with "
      "`treeattn topo --detect`"};
  return t;
}

Topology emulated(bool shaped) {
  Topology t = local_machine();
  t.name = shaped ? "emu-1gbit" : "emu-veth";
  t.description = std::string("tools/cluster emulated cluster: 2 network namespaces x 2 ranks, ") +
                  (shaped ? "veth shaped with tc tbf 1gbit" : "unshaped veth");
  t.nodes = 2;
  t.network = shaped ? LinkLevel{"network", 12.4, 0.121, 1} : LinkLevel{"network", 11.8, 1.45, 1};
  t.sources.push_back(shaped
                          ? "research/ecosystem.md: veth with tbf 1gbit: 12.4 us at 8 B, 121 MB/s"
                          : "research/ecosystem.md: unshaped veth: 11.8 us at 8 B, 1.45 GB/s");
  t.sources.push_back("all emulated hosts share the machine's 2 cores: max_concurrent_ranks 2");
  return t;
}

}  // namespace

std::vector<std::string> preset_names() {
  return {"dgx-h100x16", "mi300x4", "rtx4090x2", "local", "emu-veth", "emu-1gbit"};
}

Result<Topology> preset_topology(std::string_view name) {
  if (name == "dgx-h100x16") return dgx_h100x16();
  if (name == "mi300x4") return mi300x4();
  if (name == "rtx4090x2") return rtx4090x2();
  if (name == "local") return local_machine();
  if (name == "emu-veth") return emulated(false);
  if (name == "emu-1gbit") return emulated(true);
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  return invalid_argument("unknown topology preset '" + std::string(name) + "' (known: " + known +
                          ")");
}

}  // namespace treeattn
