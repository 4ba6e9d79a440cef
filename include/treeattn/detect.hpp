// Topology detection: measuring the machine a job runs on (links, memory, overheads) and
// turning the numbers into a Topology (topology.hpp) for the cost model and the planner.
//
// Part of the measurement library treeattn_measure (src/measure), not of libtreeattn: it times
// ping-pongs, collectives and the decode kernel. topology.hpp stays pure data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/status.hpp"
#include "treeattn/topology.hpp"

namespace treeattn {

// What `treeattn topo --detect` measures (src/measure/detect.cpp), collectively over a running
// job through the Communicator interface only (no MPI here):
//   nodes            the shared-memory split (split_shared); ranks_per_node is the largest node
//   node level       latency: the smaller of a ping-pong between rank 0 and the next rank on
//                    its node (half round trip of latency_bytes) and every rank exchanging
//                    latency_bytes with a partner on its node at once (node-local index i with
//                    i ^ 1; the slowest rank, median). A lone ping-pong is slowed where the
//                    waiting ranks poll on the same cores (0.3 ms on 4 ranks / 2 cores), all
//                    pairs at once where ranks outnumber cores and a waiting rank sleeps (2.5
//                    ms on the emulated 2x2); what the collectives cost beyond the links is
//                    the call overhead (below). Bandwidth: all pairs exchanging
//                    bandwidth_bytes at once, the latency subtracted
//   network level    latency: the same with partners on another node (local index i of node k
//                    and of node k ^ 1); bandwidth: one pair's ping-pong of bandwidth_bytes
//                    (the model shares a node's links among its ranks itself)
//   memory           the streaming-read probe (roofline.hpp) on rank 0 with probe_threads,
//                    and the decode kernel's own read rate with every rank computing at once
//                    (the model's memory.bandwidth_GBps; see DetectOptions::kernel_tokens)
//   overhead         three collectives at one step's state size (allreduce_records records),
//                    timed interleaved on each node and on the whole job: allreduce_states (the
//                    `tree` merge, a user-defined reduction), a built-in float allreduce of the
//                    same bytes, and the all-gather of the records. What the cost model does
//                    not explain from the links in the built-in allreduce becomes
//                    collective_overhead_us (node) and network.call_overhead_us (the extra of
//                    a call that crosses nodes); what the user-defined reduction costs beyond
//                    the built-in allreduce becomes node.user_op_overhead_us and
//                    network.user_op_overhead_us (the extra across nodes), priced on `tree`
//                    only. The all-gather and the model's figure for it are recorded in notes.
//   cores            all ranks on one machine (same boot id, as on the emulated cluster) share
//                    its cores: max_concurrent_ranks = cores when the job has more ranks
// Every rank returns the same Topology (rank 0's measurements are broadcast).
struct DetectOptions {
  std::string name = "detected";
  int nodes = 0;  // > 0: group the ranks into this many equal blocks instead of split_shared
  int latency_iters = 200;
  int64_t latency_bytes = 8;
  int bandwidth_iters = 10;
  int64_t bandwidth_bytes = int64_t{4} << 20;
  int64_t probe_bytes = int64_t{256} << 20;
  int probe_threads = 0;  // 0: cores / ranks on rank 0's node (the kernel's default)
  int probe_repeats = 3;
  int allreduce_iters = 50;
  int allreduce_records = 32;  // records of head_dim + 2 floats (llama3-8b, batch 1: 32 heads)
  int head_dim = 128;
  // The decode kernel, timed on every rank at once (as in a real step): a shard of
  // kernel_tokens tokens of kernel_heads / kernel_kv_heads x head_dim in kernel_dtype
  // ("bf16", "f16", "f32"). Its achieved read rate becomes memory.bandwidth_GBps (the rate the
  // local phase really runs at; the probe's figure is recorded in sources), and a 16-token
  // shard's time becomes kernel_overhead_us. kernel_tokens = 0 keeps the probe's rate and
  // kernel_overhead_us below.
  int64_t kernel_tokens = 16384;
  int kernel_heads = 32, kernel_kv_heads = 8;
  std::string kernel_dtype = "bf16";
  int kernel_iters = 15;
  int kernel_threads = 0;  // 0: cores / ranks on the node (the CLI's default)
  double kernel_overhead_us = 2.0;
};
// Collective over `world`. Also fills `notes` (if given) with one line per measurement.
Result<Topology> detect_topology(Communicator& world, const DetectOptions& options,
                                 std::vector<std::string>* notes = nullptr);

}  // namespace treeattn
