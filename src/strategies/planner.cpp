// The planner: predict() (each strategy's cost-model entry, its descriptor's `model`), plan()
// (the ranking), choose_strategy() (`auto`: the ranking over what a backend offers) and the
// paper sweep. It lives with the strategies and uses the topology's simulator
// (src/topology/cost_sim.hpp); nothing in src/topology includes a strategy.
#include <algorithm>
#include <cmath>

#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"
#include "treeattn/cost_model.hpp"

namespace treeattn {

namespace {

// Plans predicted within 1% of the fastest are ties for the planner (see plan()).
constexpr double kPlanTieFraction = 0.01;

}  // namespace

const std::vector<std::string>& modeled_strategies() {
  static const std::vector<std::string> kNames = [] {
    std::vector<std::string> v;
    for (const strategies::StrategyDescriptor* d : strategies::strategy_descriptors(true))
      if (d->model) v.emplace_back(d->info.name);
    return v;
  }();
  return kNames;
}

namespace {

Result<Prediction> predict_with(const strategies::StrategyDescriptor* d, std::string_view strategy,
                                const CostQuery& q, const Topology& topo) {
  cost::Ctx c{topo, {}};
  TREEATTN_RETURN_IF_ERROR(cost::make_ctx(q, topo, c));
  if (!d || !d->model) {
    std::string known;
    for (const auto& s : modeled_strategies()) known += (known.empty() ? "" : ", ") + s;
    return invalid_argument("cost model: unknown strategy '" + std::string(strategy) +
                            "' (known: " + known + ")");
  }
  // NCCL has no user-defined reductions: a strategy that needs them runs its stand-in there
  // (tree: the all-gather of states, allgather.cpp), and that is what is priced.
  if (topo.collectives == CollectiveLibrary::kNccl && d->needs_user_reductions &&
      d->without_user_reductions != nullptr)
    d = d->without_user_reductions;
  Prediction pr = d->model(c);
  pr.strategy = std::string(d->info.name);
  return pr;
}

// plan() over the strategies of one backend's table (user_reductions: strategy_descriptors).
Result<std::vector<PlanEntry>> rank(const CostQuery& q, const Topology& topo,
                                    const PlanOptions& opts, bool user_reductions) {
  // Strategies that need the whole cache on one rank (single) are ranked only when asked.
  std::vector<std::string> names = opts.candidates;
  const bool all_modeled = names.empty();
  for (const strategies::StrategyDescriptor* d :
       strategies::strategy_descriptors(user_reductions)) {
    if (!d->model || !d->info.listed) continue;
    const bool listed = std::find(names.begin(), names.end(), d->info.name) != names.end();
    if (listed) continue;
    if (d->info.placement == PlacementNeed::kAllOnRoot ? opts.include_single : all_modeled)
      names.emplace_back(d->info.name);
  }
  std::vector<PlanEntry> out;
  for (const auto& name : names) {
    Result<Prediction> pr = predict_with(
        strategies::find_strategy_descriptor(name, user_reductions), name, q, topo);
    if (!pr.is_ok()) return pr.status();
    PlanEntry e;
    e.prediction = std::move(pr.value());
    if (topo.memory_capacity_GB && e.prediction.peak_bytes > *topo.memory_capacity_GB * 1e9) {
      e.feasible = false;
      e.reason = "peak " + std::to_string(e.prediction.peak_bytes / 1e9) + " GB exceeds " +
                 std::to_string(*topo.memory_capacity_GB) + " GB per rank";
    }
    out.push_back(std::move(e));
  }
  // Predictions within kPlanTieFraction of each other are below the model's resolution:
  // among them the plan with fewer library calls wins (each call is a synchronization that
  // scheduling noise can stretch), then the one that sends fewer bytes. Ties are judged
  // against the fastest feasible plan, so the order stays a strict weak ordering.
  double fastest = 0;
  bool have_fastest = false;
  for (const auto& e : out)
    if (e.feasible && (!have_fastest || e.prediction.latency_us < fastest)) {
      fastest = e.prediction.latency_us;
      have_fastest = true;
    }
  auto tied = [&](const PlanEntry& e) {
    return e.feasible && have_fastest &&
           e.prediction.latency_us <= fastest * (1 + kPlanTieFraction);
  };
  std::stable_sort(out.begin(), out.end(), [&](const PlanEntry& a, const PlanEntry& b) {
    if (a.feasible != b.feasible) return a.feasible;
    const bool ta = tied(a), tb = tied(b);
    if (ta != tb) return ta;
    if (ta && tb && a.prediction.collective_calls != b.prediction.collective_calls)
      return a.prediction.collective_calls < b.prediction.collective_calls;
    if (!ta && a.prediction.latency_us != b.prediction.latency_us)
      return a.prediction.latency_us < b.prediction.latency_us;
    if (a.prediction.bytes_sent_per_rank != b.prediction.bytes_sent_per_rank)
      return a.prediction.bytes_sent_per_rank < b.prediction.bytes_sent_per_rank;
    return a.prediction.strategy < b.prediction.strategy;
  });
  return out;
}

}  // namespace

Result<Prediction> predict(std::string_view strategy, const CostQuery& q, const Topology& topo) {
  return predict_with(strategies::find_strategy_descriptor(strategy), strategy, q, topo);
}

Result<std::vector<PlanEntry>> plan(const CostQuery& q, const Topology& topo,
                                    const PlanOptions& opts) {
  return rank(q, topo, opts, true);
}

Result<StrategyChoice> choose_strategy(const CostQuery& q, const Topology& topo,
                                       bool user_reductions, const PlanOptions& opts) {
  auto ranking = rank(q, topo, opts, user_reductions);
  TREEATTN_RETURN_IF_ERROR(ranking.status());
  if (ranking->empty()) return invalid_argument("auto: no strategy to choose from");
  StrategyChoice c;
  c.strategy = ranking->front().prediction.strategy;
  c.ranking = std::move(*ranking);
  c.topology = topo.name;
  return c;
}

Result<std::vector<SweepRow>> paper_sweep(const Topology& topo, const SweepOptions& opts) {
  TREEATTN_RETURN_IF_ERROR(topo.validate());
  std::vector<int> devices = opts.devices;
  if (devices.empty()) {
    for (int d : {8, 64, 128})
      if (d <= topo.total_ranks()) devices.push_back(d);
    if (devices.empty()) devices.push_back(topo.total_ranks());
  }
  std::vector<int64_t> contexts = opts.contexts;
  if (contexts.empty())
    for (int64_t n = 80'000; n <= 5'120'000; n *= 2) contexts.push_back(n);
  std::vector<SweepRow> rows;
  for (int d : devices) {
    for (int64_t n : contexts) {
      CostQuery q;
      q.shape = opts.shape;
      q.kv_dtype = opts.kv_dtype;
      q.context = n;
      q.ranks = d;
      Result<Prediction> tree = predict("tree", q, topo);
      if (!tree.is_ok()) return tree.status();
      Result<Prediction> paper = predict("tree-paper", q, topo);
      if (!paper.is_ok()) return paper.status();
      Result<Prediction> ring = predict("ring-kv", q, topo);
      if (!ring.is_ok()) return ring.status();
      SweepRow row;
      row.topology = topo.name;
      row.devices = d;
      row.context = n;
      row.tree_us = tree->latency_us;
      row.tree_paper_us = paper->latency_us;
      row.ring_kv_us = ring->latency_us;
      row.speedup = ring->latency_us / paper->latency_us;
      row.speedup_tree = ring->latency_us / tree->latency_us;
      row.ring_kv_bytes_per_rank = ring->bytes_sent_per_rank;
      row.tree_bytes_per_rank = tree->bytes_sent_per_rank;
      rows.push_back(row);
    }
  }
  return rows;
}

std::vector<std::string> replace_auto(const std::vector<std::string>& methods,
                                      const std::string& choice) {
  std::vector<std::string> out;
  for (const auto& m : methods) {
    const std::string name = m == "auto" ? choice : m;
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

}  // namespace treeattn
