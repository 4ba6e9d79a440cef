// The emulated-cluster launcher (see cluster.hpp).
#include "cluster.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <regex>

#include "treeattn/cost_model.hpp"

namespace treeattn::cli {

std::string ClusterSpec::label() const {
  std::string s = fmt::format("{}x{}", hosts, ranks_per_host);
  if (!link.empty()) s += "@" + link;
  return s;
}

Result<ClusterSpec> parse_cluster(const std::string& text, const std::string& link) {
  static const std::regex kShape("^([0-9]{1,3})x([0-9]{1,3})$");
  std::smatch m;
  if (!std::regex_match(text, m, kShape))
    return invalid_argument(
        "--cluster: expected KxR (K emulated hosts x R ranks per host, "
        "for example 2x2), got '" +
        text + "'");
  ClusterSpec s;
  s.hosts = std::atoi(m[1].str().c_str());
  s.ranks_per_host = std::atoi(m[2].str().c_str());
  if (s.hosts < 1 || s.hosts > 16)
    return invalid_argument(
        fmt::format("--cluster {}: host count must be in [1, 16], got {}", text, s.hosts));
  if (s.ranks_per_host < 1 || s.ranks_per_host > 64)
    return invalid_argument(fmt::format("--cluster {}: ranks per host must be in [1, 64], got {}",
                                        text, s.ranks_per_host));
  if (!link.empty()) {
    static const std::regex kRate("^[0-9]+(\\.[0-9]+)?(bit|kbit|mbit|gbit)$");
    if (!std::regex_match(link, kRate))
      return invalid_argument(
          "--link: expected a tc rate such as 1gbit, 100mbit or 500kbit, got '" + link + "'");
    if (s.hosts == 1)
      return invalid_argument("--link " + link + " needs at least 2 emulated hosts (--cluster " +
                              text + " has one host, whose ranks talk over shared memory)");
  }
  s.link = link;
  return s;
}

Result<std::string> cluster_script() {
  std::string path;
  if (const char* e = std::getenv("TREEATTN_CLUSTER_SH"); e != nullptr && *e != '\0') {
    path = e;
  } else {
    path = std::string(TREEATTN_SOURCE_DIR) + "/tools/cluster/cluster.sh";
  }
  if (access(path.c_str(), X_OK) != 0)
    return invalid_argument("the emulated-cluster tool '" + path +
                            "' does not exist or is not executable (set TREEATTN_CLUSTER_SH)");
  if (geteuid() != 0)
    return invalid_argument(
        "--cluster needs root: the emulated hosts are network namespaces "
        "(run as root, or use plain --ranks for local ranks)");
  return path;
}

Result<std::vector<std::string>> cluster_session_prefix(const ClusterSpec& spec, int ranks) {
  if (ranks != spec.ranks())
    return invalid_argument(fmt::format(
        "--cluster {} places {} ranks ({} hosts x {} per host), but the job has --ranks {}; "
        "use --ranks {} (or another --cluster)",
        spec.label(), spec.ranks(), spec.hosts, spec.ranks_per_host, ranks, spec.ranks()));
  if (!spec.emulated()) return std::vector<std::string>{};
  auto script = cluster_script();
  if (!script.is_ok()) return script.status();
  std::vector<std::string> cmd = {*script, "session", std::to_string(spec.hosts), "--slots",
                                  std::to_string(spec.ranks_per_host)};
  if (!spec.link.empty()) cmd.insert(cmd.end(), {"--link", spec.link});
  cmd.push_back("--");
  return cmd;
}

Result<double> link_rate_GBps(const std::string& rate) {
  static const std::regex kRate("^([0-9]+(\\.[0-9]+)?)(bit|kbit|mbit|gbit)$");
  std::smatch m;
  if (!std::regex_match(rate, m, kRate))
    return invalid_argument("--link: expected a tc rate such as 1gbit or 100mbit, got '" + rate +
                            "'");
  const double v = std::stod(m[1].str());
  const std::string unit = m[3].str();
  const double bits = unit == "gbit" ? 1e9 : unit == "mbit" ? 1e6 : unit == "kbit" ? 1e3 : 1.0;
  return v * bits / 8.0 / 1e9;
}

Result<JobTopology> job_topology(const std::string& topology, const std::string& cluster,
                                 const std::string& link, int ranks) {
  JobTopology jt;
  if (!topology.empty()) {
    auto t = load_topology(topology);
    if (!t.is_ok()) return t.status();
    jt.topology = *t;
    jt.ranks_per_node = std::min(ranks, jt.topology.ranks_per_node);
    return jt;
  }
  if (cluster.empty()) {
    auto t = preset_topology("local");
    if (!t.is_ok()) return t.status();
    jt.topology = *t;
    jt.topology.ranks_per_node = ranks;
    jt.topology.description += " (resized to the job: " + std::to_string(ranks) + " ranks)";
    jt.ranks_per_node = ranks;
    return jt;
  }
  auto spec = parse_cluster(cluster, link);
  if (!spec.is_ok()) return spec.status();
  auto t = preset_topology(spec->hosts == 1 ? "local" : link == "1gbit" ? "emu-1gbit" : "emu-veth");
  if (!t.is_ok()) return t.status();
  jt.topology = *t;
  if (spec->hosts > 1 && !link.empty() && link != "1gbit") {
    auto bw = link_rate_GBps(link);
    if (!bw.is_ok()) return bw.status();
    jt.topology.network->bandwidth_GBps = *bw;
    jt.topology.sources.push_back("network bandwidth from --link " + link);
  }
  jt.topology.nodes = spec->hosts;
  jt.topology.ranks_per_node = spec->ranks_per_host;
  if (spec->hosts == 1) jt.topology.network.reset();
  jt.topology.description += " (resized to --cluster " + spec->label() + ")";
  jt.ranks_per_node = spec->ranks_per_host;
  return jt;
}

Result<std::vector<std::string>> resolve_auto_methods(
    const std::vector<std::string>& methods, const AttnShape& shape, DType dtype, int64_t seq,
    int ranks, const std::string& topology, const std::string& cluster, const std::string& link,
    int fanout, bool announce) {
  if (std::find(methods.begin(), methods.end(), "auto") == methods.end()) return methods;
  auto jt = job_topology(topology, cluster, link, ranks);
  if (!jt.is_ok()) return jt.status();
  CostQuery q;
  q.shape = shape;
  q.kv_dtype = dtype;
  q.context = seq;
  q.ranks = ranks;
  q.ranks_per_node = jt->ranks_per_node;
  q.hier_fanout = fanout;
  // The library's decision (choose_strategy, as SessionConfig::strategy = "auto" makes it).
  auto choice = choose_strategy(q, jt->topology);
  if (!choice.is_ok()) return invalid_argument("--methods auto: " + choice.status().message());
  if (announce) announce_auto(*choice);
  return replace_auto(methods, choice->strategy);
}

void announce_auto(const StrategyChoice& c) {
  const std::vector<PlanEntry>& r = c.ranking;
  std::fprintf(stderr,
               "  auto -> %s (planner on topology '%s': %.1f us predicted; next %s %.1f us)\n",
               c.strategy.c_str(), c.topology.c_str(), r.front().prediction.latency_us,
               r.size() > 1 ? r[1].prediction.strategy.c_str() : "-",
               r.size() > 1 ? r[1].prediction.latency_us : 0.0);
}

}  // namespace treeattn::cli
