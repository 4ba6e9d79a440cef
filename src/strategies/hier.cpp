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
#include <algorithm>

#include "strategies/common.hpp"

namespace treeattn::strategies {
namespace {

constexpr int kTagUp = 500, kTagDown = 501;

class Hier final : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  std::string_view name() const override { return "hier"; }

  Status setup_more(const ShardPlan&) override {
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
    return Status::ok();
  }

  Status run(const float* q, const KVShard& local, const ShardPlan&, float* out) override {
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out));
    const std::size_t n = records(), D = head_dim();
    if (node_->size() > 1) TREEATTN_RETURN_IF_ERROR(node_->reduce_states(out, n, D, 0));
    const bool all = options_.root < 0;
    if (leaders_) {
      const int L = leaders_->size(), i = leaders_->rank(), k = options_.fanout;
      std::vector<int> children;
      for (int c = i * k + 1; c <= i * k + k && c < L; ++c) children.push_back(c);
      TREEATTN_RETURN_IF_ERROR(ensure(child_, children.size() * state_bytes()));
      note_buffers(children.size() * state_bytes());
      float* child = child_.as<float>();
      std::vector<CommRequest> reqs;
      for (std::size_t c = 0; c < children.size(); ++c) {
        auto rq = leaders_->irecv(child + c * state_floats(), state_bytes(), children[c], kTagUp);
        TREEATTN_RETURN_IF_ERROR(rq.status());
        reqs.push_back(*rq);
      }
      TREEATTN_RETURN_IF_ERROR(leaders_->wait_all(reqs));
      for (std::size_t c = 0; c < children.size(); ++c)
        TREEATTN_RETURN_IF_ERROR(exec_->merge(out, child + c * state_floats(), n, D));
      if (i > 0) {
        TREEATTN_RETURN_IF_ERROR(send(out, (i - 1) / k, kTagUp));
        if (all) TREEATTN_RETURN_IF_ERROR(recv(out, (i - 1) / k, kTagDown));
      }
      if (all) {
        reqs.clear();
        for (int c : children) {
          auto sq = leaders_->isend(out, state_bytes(), c, kTagDown);
          TREEATTN_RETURN_IF_ERROR(sq.status());
          reqs.push_back(*sq);
        }
        TREEATTN_RETURN_IF_ERROR(leaders_->wait_all(reqs));
      }
    }
    if (all && node_->size() > 1)
      TREEATTN_RETURN_IF_ERROR(node_->broadcast(out, state_bytes(), 0));
    return Status::ok();
  }

 private:
  Status send(const float* data, int to, int tag) {
    auto s = leaders_->isend(data, state_bytes(), to, tag);
    TREEATTN_RETURN_IF_ERROR(s.status());
    const CommRequest reqs[1] = {*s};
    return leaders_->wait_all(reqs);
  }
  Status recv(float* data, int from, int tag) {
    auto s = leaders_->irecv(data, state_bytes(), from, tag);
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
};

}  // namespace

std::unique_ptr<Strategy> make_hier(const StrategyOptions& o) { return std::make_unique<Hier>(o); }

}  // namespace treeattn::strategies
