// Running a job on the emulated multi-host cluster (tools/cluster/cluster.sh): `--cluster KxR`
// means K emulated hosts (network namespaces) with R rank slots each, `--link RATE` shapes each
// host's link with tc tbf (for example 1gbit). A job is one `cluster.sh session`: the cluster
// is brought up, mpirun runs inside it, and the cluster is always taken down afterwards, also
// when the job fails or times out. A single host (1xR) needs no namespaces: it is a plain local
// mpirun with R ranks.
#pragma once

#include <string>
#include <vector>

#include "treeattn/cost_model.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"
#include "treeattn/topology.hpp"

namespace treeattn::cli {

struct ClusterSpec {
  int hosts = 1;           // K
  int ranks_per_host = 1;  // R (mpirun slots per emulated host)
  std::string link;        // tc rate ("1gbit", "100mbit"); empty = unshaped veth
  int ranks() const { return hosts * ranks_per_host; }
  bool emulated() const { return hosts > 1; }
  std::string label() const;  // "2x2", "2x2@1gbit"
};

// Parses "KxR" (K hosts in [1, 16], R ranks per host in [1, 64]) and an optional link rate
// (digits followed by bit, kbit, mbit or gbit).
Result<ClusterSpec> parse_cluster(const std::string& text, const std::string& link);

// Path of tools/cluster/cluster.sh: $TREEATTN_CLUSTER_SH, else the source tree this binary was
// built from. Errors when it does not exist or this process is not root.
Result<std::string> cluster_script();

// The command prefix that replaces "mpirun" for a job on the emulated cluster: cluster.sh
// session K --slots R [--link RATE] -- (mpirun arguments follow). Checks that `ranks` equals
// K x R so that every host gets exactly R ranks.
Result<std::vector<std::string>> cluster_session_prefix(const ClusterSpec& spec, int ranks);

// Link rate of a tc rate string in GB/s (1 GB = 1e9 bytes): "1gbit" -> 0.125.
Result<double> link_rate_GBps(const std::string& rate);

// The topology a job is planned on: `topology` (FILE or preset:NAME) when given; otherwise
// this machine (preset `local`) with all `ranks` on one node, or on an emulated cluster KxR
// preset `emu-veth` (or `emu-1gbit`; another --link rate sets the network bandwidth) resized to
// K nodes x R ranks. Also returns the placement (ranks per node) the job will have.
struct JobTopology {
  Topology topology;
  int ranks_per_node = 0;
};
Result<JobTopology> job_topology(const std::string& topology, const std::string& cluster,
                                 const std::string& link, int ranks);

// Replaces "auto" in `methods` by the library's choice (choose_strategy, cost_model.hpp) for this shape, context and rank count
// on job_topology(...) (dropping a duplicate when the choice is also listed). With announce,
// prints "auto -> CHOICE" with the prediction on stderr.
Result<std::vector<std::string>> resolve_auto_methods(
    const std::vector<std::string>& methods, const AttnShape& shape, DType dtype, int64_t seq,
    int ranks, const std::string& topology, const std::string& cluster, const std::string& link,
    int fanout, bool announce);

// "  auto -> CHOICE (planner on topology ...: predicted; next ...)" on stderr.
void announce_auto(const StrategyChoice& choice);

}  // namespace treeattn::cli
