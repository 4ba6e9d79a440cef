// LayerMerge: see layer_merge.hpp.
#include "engine/layer_merge.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <cstring>

#include "treeattn/executor.hpp"
#include "treeattn/session.hpp"

namespace treeattn::engine {
namespace {

constexpr std::size_t kWire = 4096;  // rank 0's verdict: "ok\n" + names, or "error\n" + message

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// Rank 0's candidates in the order to try, or its error. Local: no communication.
Result<std::vector<std::string>> candidates_on_rank0(const Communicator& comm,
                                                     const MergeRequest& req,
                                                     const Result<Topology>& topo,
                                                     MergeChoice& choice) {
  const CommCapabilities caps = comm.capabilities();
  const std::vector<std::string> known = merge_methods(caps);
  if (req.method != "auto") {
    if (std::find(known.begin(), known.end(), req.method) == known.end()) {
      const StrategyRegistry& reg = StrategyRegistry::for_backend(caps);
      const std::string why = reg.contains(req.method) || req.method == deterministic_strategy()
                                  ? "' cannot merge a batch of states (it needs the KV shards)"
                                  : "' is not a strategy";
      return invalid_argument("--method '" + req.method + why + " (methods that merge a batch: " +
                              join(known) + ", or auto)");
    }
    choice.how = "by name";
    return std::vector<std::string>{req.method};
  }
  if (comm.size() == 1) {  // nothing to merge: every strategy's merge is the identity
    choice.how = "auto: one rank, nothing to merge";
    return std::vector<std::string>{"tree"};
  }
  TREEATTN_RETURN_IF_ERROR(topo.status());
  CostQuery q;
  q.shape = req.shape;
  // The cost model prices kernel head dims only (shape.hpp); another head dim (small test
  // models) is priced at the nearest one with the heads scaled to keep one layer's state bytes,
  // which is what the merges' cost depends on.
  std::string priced;
  if (!head_dim_supported(q.shape.head_dim)) {
    int d = kSupportedHeadDims[0];
    for (int s : kSupportedHeadDims)
      if (std::abs(s - q.shape.head_dim) < std::abs(d - q.shape.head_dim)) d = s;
    const int64_t rec = static_cast<int64_t>(req.shape.heads) * (req.shape.head_dim + 2);
    q.shape.heads = static_cast<int>(std::max<int64_t>(1, (rec + d + 1) / (d + 2)));
    q.shape.kv_heads = 1;
    q.shape.head_dim = d;
    priced = " (priced at head dim " + std::to_string(d) + ", " + std::to_string(q.shape.heads) +
             " heads: the same state bytes)";
  }
  q.kv_dtype = req.kv_dtype;
  q.context = std::max<int64_t>(req.context, 1);
  q.ranks = comm.size();
  q.ranks_per_node = std::min(comm.size(), topo->ranks_per_node);
  q.hier_fanout = req.fanout;
  PlanOptions po;
  for (const std::string& m : known)
    if (m != deterministic_strategy()) po.candidates.push_back(m);
  auto c = choose_strategy(q, *topo, caps.user_reductions, po);
  if (!c.is_ok())
    return invalid_argument("--method auto on topology '" + topo->name +
                            "': " + c.status().message());
  std::vector<std::string> order;
  for (const PlanEntry& e : c->ranking)
    if (e.feasible) order.push_back(e.prediction.strategy);
  order.emplace_back(deterministic_strategy());  // batch invariant everywhere: the last resort
  choice.ranking = std::move(c->ranking);
  choice.topology = topo->name;
  choice.how = "auto: planned on topology " + topo->name + priced;
  return order;
}

}  // namespace

Result<std::unique_ptr<LayerMerge>> engine_merge(Communicator& comm, const EngineConfig& config,
                                                 const model::LlamaConfig& mc, int64_t pages) {
  MergeRequest mr;
  mr.method = config.merge;
  mr.shape = AttnShape{config.max_batch, mc.n_head, mc.n_head_kv, mc.head_dim, 1};
  mr.kv_dtype = config.kv_dtype;
  mr.context = std::max<int64_t>(1, pages * config.page_tokens * comm.size() / config.max_batch);
  mr.topology = config.topology;
  mr.fanout = config.fanout;
  return LayerMerge::create(comm, mr);
}

std::string describe_merge(const MergeChoice& c) {
  const bool planned = c.how.rfind("auto", 0) == 0 && !c.topology.empty();
  std::string s = c.strategy + " (" + (planned ? "auto on topology " + c.topology : c.how) +
                  (c.batch_invariant ? ", batch invariant" : ", NOT batch invariant at this rank count");
  if (!c.ranking.empty()) {
    s += "; predicted per layer:";
    char buf[96];
    for (std::size_t i = 0; i < c.ranking.size(); ++i) {
      const Prediction& pr = c.ranking[i].prediction;
      std::snprintf(buf, sizeof(buf), "%s %s %.1f us", i ? "," : "", pr.strategy.c_str(),
                    pr.latency_us);
      s += buf;
    }
  }
  return s + ")";
}

std::vector<std::string> merge_methods(const CommCapabilities& caps) {
  std::vector<std::string> v;
  for (const StrategyInfo& i : StrategyRegistry::for_backend(caps).list())
    if (i.merges_states) v.emplace_back(i.name);
  v.emplace_back(deterministic_strategy());
  return v;
}

Result<std::unique_ptr<LayerMerge>> LayerMerge::create(Communicator& comm,
                                                        const MergeRequest& req) {
  const int p = comm.size();
  const std::string who = "rank " + std::to_string(comm.world_rank()) + ": ";
  std::unique_ptr<LayerMerge> lm(new LayerMerge());
  // The topology: a file or preset is read by rank 0 alone; the job's own is collective. One
  // rank has nothing to merge and plans nothing.
  Result<Topology> topo = invalid_argument("no topology");
  if (req.method == "auto" && p > 1) {
    if (!req.topology.empty()) {
      if (comm.rank() == 0) topo = load_topology(req.topology);
    } else {
      topo = job_topology_of(comm, cpu_executor());
    }
  }
  char wire[kWire] = {};
  if (comm.rank() == 0) {
    auto order = candidates_on_rank0(comm, req, topo, lm->choice_);
    std::string w = order.is_ok() ? "ok\n" + join(*order) : "error\n" + order.status().message();
    std::memcpy(wire, w.data(), std::min(w.size(), kWire - 1));
  }
  if (p > 1) TREEATTN_RETURN_IF_ERROR(comm.broadcast(wire, kWire, 0));
  const std::string w(wire, strnlen(wire, kWire));
  if (w.rfind("error\n", 0) == 0) return invalid_argument(who + w.substr(6));
  std::vector<std::string> order;
  for (std::size_t at = 3; at < w.size();) {
    const std::size_t end = std::min(w.find(", ", at), w.size());
    order.push_back(w.substr(at, end - at));
    at = end + 2;
  }
  const StrategyRegistry& reg = StrategyRegistry::for_backend(comm.capabilities());
  StrategyOptions so;
  so.fanout = req.fanout;
  for (const std::string& name : order) {
    auto s = reg.create(name, so);
    TREEATTN_RETURN_IF_ERROR(s.status());
    Status st = (*s)->setup_merge(comm, cpu_executor(), static_cast<std::size_t>(req.shape.head_dim));
    if (!st.is_ok()) return Status(st.code(), who + "--method " + name + ": " + st.message());
    const bool invariant = (*s)->merge_batch_invariant();
    if (req.method == "auto" && !invariant) continue;
    lm->choice_.strategy = name;
    lm->choice_.batch_invariant = invariant;
    lm->choice_.local_twin = (*s)->merge_local_supported(p);
    lm->strategy_ = std::move(*s);
    if (lm->choice_.how.empty()) lm->choice_.how = req.method == "auto" ? "auto" : "by name";
    return lm;
  }
  return internal_error(who + "--method auto: no candidate merges batch-invariantly");
}

}  // namespace treeattn::engine
