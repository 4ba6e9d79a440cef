// The strategy registries (one per backend kind) and the analytic cost model.
#include <cmath>
#include <string>

#include "strategies/common.hpp"

namespace treeattn {
namespace {

using Factory = std::unique_ptr<Strategy> (*)(const StrategyOptions&);

struct Entry {
  StrategyInfo info;
  Factory factory;
};

std::unique_ptr<Strategy> make_tree_as_allgather(const StrategyOptions& o) {
  return strategies::make_allgather_named(o, "tree");
}

// Backends with user-defined reductions (Open MPI).
const Entry kHostEntries[] = {
    {{"tree", "one allreduce with the state merge as a user-defined reduction"},
     strategies::make_tree},
    {{"tree-paper",
      "the paper's three allreduces: MAX of LSE, SUM of outputs, SUM of denominators"},
     strategies::make_tree_paper},
    {{"tree2", "MAX of LSE, then one fused SUM of outputs and denominators"},
     strategies::make_tree2},
    {{"hier", "merge to node leaders, k-ary tree over leaders, broadcast inside nodes"},
     strategies::make_hier},
    {{"ring-kv", "KV shards rotate around the ring, overlapped with local attention"},
     strategies::make_ring_kv},
    {{"ring-state", "partial states rotate around the ring (p - 1 small messages)"},
     strategies::make_ring_state},
    {{"allgather", "all-gather the partial states, merge locally"}, strategies::make_allgather},
    {{"gather-root", "gather the states to one rank, merge, broadcast"},
     strategies::make_gather_root},
    {{"single", "one rank holds the whole KV cache and broadcasts the result"},
     strategies::make_single},
};

// Backends without user-defined reductions (NCCL): the same table, except that `tree` is the
// all-gather form and `hier` (whose intra-node step is a user-defined reduce) is not offered.
std::vector<Entry> without_user_reductions() {
  std::vector<Entry> v;
  for (const Entry& e : kHostEntries) {
    if (e.info.name == "hier") continue;
    if (e.info.name == "tree")
      v.push_back({{"tree", "all-gather of partial states and a local merge (no user-defined "
                            "reductions)"},
                   make_tree_as_allgather});
    else
      v.push_back(e);
  }
  return v;
}

std::span<const Entry> entries(bool user_reductions) {
  static const std::vector<Entry> kNoUserReductionEntries = without_user_reductions();
  if (user_reductions) return kHostEntries;
  return kNoUserReductionEntries;
}

std::vector<StrategyInfo> infos(bool user_reductions) {
  std::vector<StrategyInfo> v;
  for (const Entry& e : entries(user_reductions)) v.push_back(e.info);
  return v;
}

}  // namespace

Status Strategy::step(const float* q, const KVShard& local, const ShardPlan& plan,
                      StateBuffer& out) {
  if (!exec_ || exec_->memory() != MemorySpace::kHost)
    return invalid_argument(std::string(name()) +
                            ": step() with a host StateBuffer needs a strategy set up on a host "
                            "executor; use run() with a buffer in the executor's memory");
  const auto B = static_cast<std::size_t>(shape_.batch), Q = static_cast<std::size_t>(shape_.q_len),
             H = static_cast<std::size_t>(shape_.heads),
             D = static_cast<std::size_t>(shape_.head_dim);
  if (out.records() != B * Q * H || out.head_dim() != D) out = StateBuffer(B, Q, H, D);
  return run(q, local, plan, out.data());
}

const StrategyRegistry& StrategyRegistry::for_backend(const CommCapabilities& caps) {
  static const StrategyRegistry with(true), without(false);
  return caps.user_reductions ? with : without;
}

std::span<const StrategyInfo> StrategyRegistry::list() const {
  static const std::vector<StrategyInfo> with = infos(true), without = infos(false);
  return user_reductions_ ? with : without;
}

bool StrategyRegistry::contains(std::string_view name) const {
  for (const Entry& e : entries(user_reductions_))
    if (e.info.name == name) return true;
  return false;
}

Result<std::unique_ptr<Strategy>> StrategyRegistry::create(std::string_view name,
                                                           const StrategyOptions& options) const {
  for (const Entry& e : entries(user_reductions_))
    if (e.info.name == name) return e.factory(options);
  std::string known;
  for (const Entry& e : entries(user_reductions_)) {
    if (!known.empty()) known += ", ";
    known += e.info.name;
  }
  return invalid_argument("unknown strategy '" + std::string(name) + "' (known: " + known + ")");
}

// ---- analytic cost ----------------------------------------------------------------------------

Result<CostEstimate> analytic_cost(std::string_view strategy, const AttnShape& shape, DType dtype,
                                   const ShardPlan& plan, int rank,
                                   const StrategyOptions& options) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  if (rank < 0 || rank >= plan.ranks())
    return invalid_argument("analytic_cost: rank " + std::to_string(rank) + " is outside [0, " +
                            std::to_string(plan.ranks()) + ")");
  const int p = plan.ranks();
  const double P = p;
  const double S = static_cast<double>(shape.batch * shape.q_len * shape.heads) *
                   static_cast<double>(shape.head_dim + 2) * 4.0;
  const double Qb =
      static_cast<double>(shape.batch * shape.q_len * shape.heads * shape.head_dim) * 4.0;
  const double kv_per_token = 2.0 * static_cast<double>(shape.kv_heads * shape.head_dim) *
                              static_cast<double>(dtype_size(dtype));
  auto kv_bytes = [&](int r) { return static_cast<double>(plan.total_tokens(r)) * kv_per_token; };
  const double mine = kv_bytes(rank);
  const int root = options.root >= 0 ? options.root : 0;
  const bool all = options.root < 0;
  // Sends of a binomial broadcast rooted at `root` (relative rank numbering).
  auto bcast_sends = [&](int r, int n, int rt) {
    const int rel = ((r - rt) % n + n) % n;
    return static_cast<double>(strategies::binomial_children(rel, n).size());
  };
  CostEstimate c;
  const double base_ws = mine + Qb + S;  // KV shard, query, output records
  if (p == 1 && strategy != "single" && strategy != "ring-kv") {
    c.bytes_sent = 0;
    c.working_set_bytes = base_ws;
    c.formula = "p = 1: no communication; ws = KV + q + S";
    if (strategy == "allgather" || strategy == "ring-state") c.working_set_bytes += S;
    return c;
  }
  if (strategy == "tree") {
    c.bytes_sent = all ? 2.0 * (P - 1) / P * S : (rank == root ? 0.0 : S);
    c.working_set_bytes = base_ws;
    c.formula = all ? "sent = 2(p-1)/p S (allreduce, paper eq. 14); ws = KV + q + S"
                    : "sent = S (binomial reduce, non-root); ws = KV + q + S";
  } else if (strategy == "tree-paper" || strategy == "tree2") {
    const double n = static_cast<double>(shape.batch * shape.q_len * shape.heads);
    const double max_part = 2.0 * (P - 1) / P * n * 4.0;
    const double sum_part =
        all ? 2.0 * (P - 1) / P * (S - n * 4.0) : (rank == root ? 0.0 : S - n * 4.0);
    c.bytes_sent = max_part + sum_part;
    c.working_set_bytes = base_ws + S;  // lse + numerators + denominators
    c.formula = strategy == "tree2"
                    ? "sent = 2(p-1)/p (n + n(D+1)) 4 B (MAX, fused SUM); ws = KV + q + 2S"
                    : "sent = 2(p-1)/p (n + nD + n) 4 B (MAX, SUM, SUM); ws = KV + q + 2S";
  } else if (strategy == "hier") {
    // Modelled with one node per rank group given; without an explicit grouping every rank
    // is assumed on one node (shared memory).
    std::vector<int> node = options.node_of_rank;
    if (node.empty()) node.assign(static_cast<std::size_t>(p), 0);
    std::vector<int> members, leaders;  // my node's ranks; first rank of each node
    const int mynode = node[static_cast<std::size_t>(rank)];
    for (int r = 0; r < p; ++r)
      if (node[static_cast<std::size_t>(r)] == mynode) members.push_back(r);
    for (int r = 0; r < p; ++r) {
      bool first = true;
      for (int s = 0; s < r; ++s)
        if (node[static_cast<std::size_t>(s)] == node[static_cast<std::size_t>(r)]) first = false;
      if (first) leaders.push_back(r);
    }
    const bool leader = members.front() == rank;
    const int L = static_cast<int>(leaders.size()), k = std::max(1, options.fanout);
    double sent = leader ? 0.0 : S;  // intra-node reduce
    if (leader) {
      int li = 0;
      for (int i = 0; i < L; ++i)
        if (leaders[static_cast<std::size_t>(i)] == rank) li = i;
      const int children = std::max(0, std::min(L - 1, li * k + k) - li * k);
      if (li > 0) sent += S;
      if (all) sent += S * children;
    }
    if (all) {
      const int n = static_cast<int>(members.size());
      int me = 0;
      for (int i = 0; i < n; ++i)
        if (members[static_cast<std::size_t>(i)] == rank) me = i;
      sent += S * bcast_sends(me, n, 0);
    }
    c.bytes_sent = sent;
    c.working_set_bytes = base_ws + (leader ? S * k : 0.0);
    c.formula =
        "sent = S per tree edge (intra reduce, leader tree up and down, binomial "
        "broadcast); ws = KV + q + S + k S at leaders";
  } else if (strategy == "ring-kv") {
    double sent = 0;
    for (int k = 0; k + 1 < p; ++k) sent += kv_bytes(((rank - k) % p + p) % p);
    sent += (P - 1) * static_cast<double>(3 * shape.batch + 1) * 8.0;
    int64_t max_len = 0;
    for (int o = 0; o < p; ++o)
      if (o != rank) max_len = std::max(max_len, plan.max_len(o));
    const double buf = static_cast<double>(shape.batch * max_len) * kv_per_token;
    const int nbuf = p >= 3 ? 2 : (p == 2 ? 1 : 0);
    c.bytes_sent = sent;
    c.working_set_bytes = base_ws + nbuf * buf + P * S;
    c.formula =
        "sent = sum of the p-1 KV shards forwarded (paper: 2btd per hop); "
        "ws = KV + q + S + (1 or 2) receive buffers + p S (paper eq. 8: 4btd + 2bd)";
  } else if (strategy == "ring-state") {
    c.bytes_sent = (P - 1) * S;
    c.working_set_bytes = base_ws + P * S;
    c.formula = "sent = (p-1) S; ws = KV + q + S + p S";
  } else if (strategy == "allgather") {
    c.bytes_sent = all ? (P - 1) * S : (rank == root ? 0.0 : S);
    c.working_set_bytes = base_ws + P * S;
    c.formula = "sent = (p-1) S (ring all-gather); ws = KV + q + S + p S";
  } else if (strategy == "gather-root") {
    c.bytes_sent = (rank == root ? 0.0 : S) + (all ? S * bcast_sends(rank, p, root) : 0.0);
    c.working_set_bytes = base_ws + (rank == root ? P * S : 0.0);
    c.formula = "sent = S (gather) + S per binomial broadcast child; ws = KV + q + S (+ p S root)";
  } else if (strategy == "single") {
    if (p == 1)
      c.bytes_sent = 0;
    else if (all)
      c.bytes_sent = S * bcast_sends(rank, p, 0);
    else
      c.bytes_sent = (rank == 0 && options.root != 0) ? S : 0.0;
    c.working_set_bytes = base_ws;
    c.formula = "sent = S per binomial broadcast child of rank 0; ws = KV (all on rank 0) + q + S";
  } else {
    return invalid_argument("analytic_cost: unknown strategy '" + std::string(strategy) + "'");
  }
  return c;
}

}  // namespace treeattn
