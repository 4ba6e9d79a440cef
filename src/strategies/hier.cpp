// hier: an explicit topology-aware tree: inside nodes, across node leaders, back inside nodes.
//
// Ranks are grouped into nodes, by shared memory (Communicator::split_shared, one group per
// host or emulated host) or by options.node_of_rank (any grouping, so one machine can stand for
// several nodes). Per step:
//   1. inside each node, reduce_states merges every rank's partial to the node leader (the
//      node's first rank; shared-memory transport);
//   2. the leaders form a k-ary tree (k = options.fanout): leader i waits for its children
//      i k + 1 .. i k + k, merges their states into its own in child order, and sends the
//      result to its parent (i - 1) / k; leader 0 then holds the full merge;
//   3. down the same tree the leaders pass the final states, and each leader broadcasts them
//      inside its node.
// Only leader 0 computes the final merge, so every rank gets the same bits. With
// options.root >= 0 the root's node is leader 0 and the root its leader, and step 3 is skipped.
// Per step a non-leader sends S bytes (S = one step's records); a leader sends S to its parent
// and S to each child on the way down, plus its share of the intra-node broadcast.
//
// Message ordering (comm.hpp): point-to-point messages only between leaders, at most one per
// ordered pair and direction per step (a child's state up, then the final state down), posted
// on both sides from the replicated fan-out and leader count; tags 500/501 are labels, and
// every request completes before the intra-node broadcast.
//
// Cost: the analytic model takes the grouping from options.node_of_rank (all ranks on one node
// when empty) and counts the intra-node broadcast as a binomial tree; the cost model places r
// ranks per node in blocks and counts that broadcast as one shared-memory write by the leader.
// Both count S per tree edge elsewhere.
#include <algorithm>

#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"
#include "topology/cost_sim.hpp"

namespace treeattn::strategies {
namespace {

constexpr int kTagUp = 500, kTagDown = 501;

class Hier final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "hier"; }

  // merge(): the association of every record is the node reduce's (rank order, or one
  // commutative merge at two ranks a node) and then the leaders' fixed tree.
  bool merge_batch_invariant() const override {
    return comm_ && (max_node_ <= 2 || fixed_order());
  }
  bool merge_local_supported(int p) const override {
    return comm_ && p == comm_->size() && (max_node_ <= 2 || fixed_order());
  }
  // Leader i's value going up: its node's states in node order, then (+) each child's value.
  Status merge_local(const float* const* parts, int p, std::size_t n, float* out) override {
    if (!merge_local_supported(p))
      return unsupported("hier: no local twin at " + std::to_string(p) +
                         " ranks (a node of more than two ranks reduces in the collective "
                         "library's association)");
    return up_value(0, parts, n, out);
  }

  Status setup_groups() override {
    const int p = comm_->size(), r = comm_->rank();
    if (options_.fanout < 1)
      return invalid_argument(who() + "hier fan-out must be >= 1, got " +
                              std::to_string(options_.fanout));
    const int root = options_.root >= 0 ? options_.root : 0;
    // The root's rank sorts first in its node, and the root's node first among the leaders.
    const int key = r == root ? -1 : r;
    if (!options_.node_of_rank.empty()) {
      if (static_cast<int>(options_.node_of_rank.size()) != p)
        return invalid_argument(who() + "hier node grouping has " +
                                std::to_string(options_.node_of_rank.size()) +
                                " entries, the job has " + std::to_string(p) + " ranks");
      for (int i = 0; i < p; ++i)
        if (options_.node_of_rank[static_cast<std::size_t>(i)] < 0)
          return invalid_argument(
              who() + "hier node id of rank " + std::to_string(i) + " is negative (" +
              std::to_string(options_.node_of_rank[static_cast<std::size_t>(i)]) + ")");
      auto c = comm_->split(options_.node_of_rank[static_cast<std::size_t>(r)], key);
      TREEATTN_RETURN_IF_ERROR(c.status());
      node_ = std::move(*c);
    } else {
      auto c = comm_->split_shared(key);
      TREEATTN_RETURN_IF_ERROR(c.status());
      node_ = std::move(*c);
    }
    const bool leader = node_->rank() == 0;
    // Is the root in my node? Leaders of the root's node sort first.
    int root_here = r == root ? 1 : 0;
    TREEATTN_RETURN_IF_ERROR(broadcast_int(&root_here));
    auto l = comm_->split(leader ? 0 : -1, root_here ? -1 : r);
    TREEATTN_RETURN_IF_ERROR(l.status());
    leaders_ = std::move(*l);
    return learn_groups(root_here != 0);
  }

 protected:
  Status merge_n(float* out, std::size_t n) override {
    const std::size_t D = head_dim();
    const std::size_t S = floats_of(n), Sb = bytes_of(n);
    if (node_->size() > 1) TREEATTN_RETURN_IF_ERROR(node_->reduce_states(out, n, D, 0));
    const bool all = options_.root < 0;
    if (leaders_) {
      const int L = leaders_->size(), i = leaders_->rank(), k = options_.fanout;
      std::vector<int> children;
      for (int c = i * k + 1; c <= i * k + k && c < L; ++c) children.push_back(c);
      TREEATTN_RETURN_IF_ERROR(ensure(child_, children.size() * Sb));
      note_buffers(children.size() * Sb);
      float* child = child_.as<float>();
      std::vector<CommRequest> reqs;
      for (std::size_t c = 0; c < children.size(); ++c) {
        auto rq = leaders_->irecv(child + c * S, Sb, children[c], kTagUp);
        TREEATTN_RETURN_IF_ERROR(rq.status());
        reqs.push_back(*rq);
      }
      TREEATTN_RETURN_IF_ERROR(leaders_->wait_all(reqs));
      for (std::size_t c = 0; c < children.size(); ++c)
        TREEATTN_RETURN_IF_ERROR(exec_->merge(out, child + c * S, n, D));
      if (i > 0) {
        TREEATTN_RETURN_IF_ERROR(send(out, Sb, (i - 1) / k, kTagUp));
        if (all) TREEATTN_RETURN_IF_ERROR(recv(out, Sb, (i - 1) / k, kTagDown));
      }
      if (all) {
        reqs.clear();
        for (int c : children) {
          auto sq = leaders_->isend(out, Sb, c, kTagDown);
          TREEATTN_RETURN_IF_ERROR(sq.status());
          reqs.push_back(*sq);
        }
        TREEATTN_RETURN_IF_ERROR(leaders_->wait_all(reqs));
      }
    }
    if (all && node_->size() > 1) TREEATTN_RETURN_IF_ERROR(node_->broadcast(out, Sb, 0));
    return Status::ok();
  }

 private:
  // Every rank learns the grouping (the node leader of each rank, the leaders in tree order)
  // for merge_local and merge_batch_invariant.
  Status learn_groups(bool root_here) {
    const int p = comm_->size();
    int32_t mine[2] = {comm_->rank(), root_here ? 1 : 0};  // my node leader's rank, root flag
    if (node_->size() > 1) TREEATTN_RETURN_IF_ERROR(node_->broadcast(mine, sizeof(mine), 0));
    std::vector<int32_t> all(2 * static_cast<std::size_t>(p));
    TREEATTN_RETURN_IF_ERROR(comm_->allgather(mine, sizeof(mine), all.data()));
    const int root = options_.root >= 0 ? options_.root : 0;
    // Leaders in the leaders' communicator's order (the root's node first, then by rank),
    // members of a node in its order (the root first, then by rank).
    std::vector<int> leaders;
    for (int q = 0; q < p; ++q)
      if (std::find(leaders.begin(), leaders.end(), all[2 * q]) == leaders.end())
        leaders.push_back(all[2 * q]);
    std::stable_sort(leaders.begin(), leaders.end(), [&](int a, int b) {
      const bool ra = all[2 * static_cast<std::size_t>(a) + 1] != 0,
                 rb = all[2 * static_cast<std::size_t>(b) + 1] != 0;
      return ra != rb ? ra : a < b;
    });
    node_members_.assign(leaders.size(), {});
    max_node_ = 0;
    for (std::size_t i = 0; i < leaders.size(); ++i) {
      for (int q = 0; q < p; ++q)
        if (all[2 * static_cast<std::size_t>(q)] == leaders[i]) node_members_[i].push_back(q);
      std::stable_sort(node_members_[i].begin(), node_members_[i].end(),
                       [&](int a, int b) { return (a == root) != (b == root) ? a == root : a < b; });
      max_node_ = std::max(max_node_, static_cast<int>(node_members_[i].size()));
    }
    return Status::ok();
  }

  // merge_local: the value leader i sends up (the final merge for i = 0).
  Status up_value(std::size_t i, const float* const* parts, std::size_t n, float* out) {
    const std::vector<int>& m = node_members_[i];
    std::copy(parts[m[0]], parts[m[0]] + floats_of(n), out);
    for (std::size_t j = 1; j < m.size(); ++j)
      TREEATTN_RETURN_IF_ERROR(exec_->merge(out, parts[m[j]], n, head_dim()));
    const std::size_t L = node_members_.size(), k = static_cast<std::size_t>(options_.fanout);
    std::vector<float> child(floats_of(n));
    for (std::size_t c = i * k + 1; c <= i * k + k && c < L; ++c) {
      TREEATTN_RETURN_IF_ERROR(up_value(c, parts, n, child.data()));
      TREEATTN_RETURN_IF_ERROR(exec_->merge(out, child.data(), n, head_dim()));
    }
    return Status::ok();
  }

  Status send(const float* data, std::size_t bytes, int to, int tag) {
    auto s = leaders_->isend(data, bytes, to, tag);
    TREEATTN_RETURN_IF_ERROR(s.status());
    const CommRequest reqs[1] = {*s};
    return leaders_->wait_all(reqs);
  }
  Status recv(float* data, std::size_t bytes, int from, int tag) {
    auto s = leaders_->irecv(data, bytes, from, tag);
    TREEATTN_RETURN_IF_ERROR(s.status());
    const CommRequest reqs[1] = {*s};
    return leaders_->wait_all(reqs);
  }
  // Max over the node of *v (tells every rank of a node whether the root is among them).
  Status broadcast_int(int* v) {
    float f = static_cast<float>(*v);
    TREEATTN_RETURN_IF_ERROR(node_->allreduce(&f, 1, ReduceOp::kMax));
    *v = f > 0.0f ? 1 : 0;
    return Status::ok();
  }

  std::unique_ptr<Communicator> node_, leaders_;
  Buffer child_;
  std::vector<std::vector<int>> node_members_;  // per leader (tree order): its node's ranks
  int max_node_ = 1;
};

std::unique_ptr<Strategy> make_hier(const StrategyOptions& o) { return std::make_unique<Hier>(o); }

CostEstimate analytic(const AnalyticInput& in) {
  if (in.p == 1) return in.no_communication(0.0);
  const int p = in.p, rank = in.rank;
  const double S = in.S;
  // Modelled with one node per rank group given; without an explicit grouping every rank
  // is assumed on one node (shared memory).
  std::vector<int> node = in.options.node_of_rank;
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
  const int L = static_cast<int>(leaders.size()), k = std::max(1, in.options.fanout);
  double sent = leader ? 0.0 : S;  // intra-node reduce
  if (leader) {
    int li = 0;
    for (int i = 0; i < L; ++i)
      if (leaders[static_cast<std::size_t>(i)] == rank) li = i;
    const int children = std::max(0, std::min(L - 1, li * k + k) - li * k);
    if (li > 0) sent += S;
    if (in.all) sent += S * children;
  }
  if (in.all) {
    const int n = static_cast<int>(members.size());
    int me = 0;
    for (int i = 0; i < n; ++i)
      if (members[static_cast<std::size_t>(i)] == rank) me = i;
    sent += S * AnalyticInput::bcast_sends(me, n, 0);
  }
  CostEstimate c;
  c.bytes_sent = sent;
  c.working_set_bytes = in.base_ws() + (leader ? S * k : 0.0);
  c.formula =
      "sent = S per tree edge (intra reduce, leader tree up and down, binomial "
      "broadcast); ws = KV + q + S + k S at leaders";
  return c;
}

// The cost model: (1) every rank of a node hands its state to the node
// leader (its first rank) over shared memory and the leader merges them; (2) the n leaders
// form a k-ary tree in heap order (leader i's children are i k + 1 .. i k + k): from the
// deepest level up, each leader receives its children's states and sends the merge to its
// parent (one round per level); (3) the final states go back down the same tree (a parent
// sends to each child in turn) and (4) each leader broadcasts them inside its node.
Prediction model(const cost::Ctx& c) {
  cost::RoundSim sim(c.topo, c.p, c.r);
  cost::CommCost comm;
  const double S = c.state_bytes;
  auto leader = [&](int node) { return node * c.r; };
  if (c.r > 1) {
    cost::Round in;
    for (int i = 0; i < c.p; ++i)
      if (i % c.r != 0) in.push_back({i, leader(i / c.r), S, true});
    comm.add(c.call(false) + sim.round(in), "intra-node reduce to leader");
  }
  if (c.n > 1) {
    // Heap levels: level(i) = depth of leader i; one round per level, deepest first.
    std::vector<int> level(static_cast<std::size_t>(c.n), 0);
    int depth = 0;
    for (int i = 1; i < c.n; ++i) {
      const int lv = level[static_cast<std::size_t>((i - 1) / c.fanout)] + 1;
      level[static_cast<std::size_t>(i)] = lv;
      depth = std::max(depth, lv);
    }
    std::vector<cost::Round> up;
    for (int lv = depth; lv >= 1; --lv) {
      cost::Round rd;
      for (int i = 1; i < c.n; ++i)
        if (level[static_cast<std::size_t>(i)] == lv)
          rd.push_back({leader(i), leader((i - 1) / c.fanout), S, true});
      up.push_back(rd);
    }
    double t = 0;
    for (const cost::Round& rd : up) t += sim.round(rd);
    comm.add(c.call(true) + t, "inter-leader " + std::to_string(c.fanout) + "-ary tree reduce (" +
                                   std::to_string(up.size()) + " rounds)");
    t = 0;
    for (auto it = up.rbegin(); it != up.rend(); ++it) {
      cost::Round down;
      for (const cost::Msg& m : *it) down.push_back({m.dst, m.src, S, false});
      t += sim.round(down);
    }
    comm.add(c.call(true) + t, "inter-leader tree broadcast");
  }
  if (c.r > 1) {
    cost::Round out;
    for (int i = 0; i < c.p; ++i)
      if (i % c.r != 0) out.push_back({leader(i / c.r), i, S, false, true});
    comm.add(c.call(false) + sim.round(out), "intra-node shared broadcast");
  }
  // The leader's shared segment holds the node's r states.
  return cost::finish(c, c.local_us(c.shard_tokens, c.p), comm, sim, static_cast<double>(c.r) * S);
}

}  // namespace

// Not offered without user-defined reductions: step 1 is a reduce_states inside each node.
constinit const StrategyDescriptor kHierDescriptor{
    .info = {.name = "hier",
             .summary = "merge to node leaders, k-ary tree over leaders, broadcast inside nodes",
             .merges_states = true},
    .create = make_hier,
    .needs_user_reductions = true,
    .without_user_reductions = nullptr,
    .analytic = analytic,
    .model = model,
    .extra_kv_caches = no_extra_kv,
};

}  // namespace treeattn::strategies
