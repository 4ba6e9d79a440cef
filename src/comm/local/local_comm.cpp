// The in-process Communicator (comm_local.hpp): ranks are threads, collectives are computed once
// by the last rank to arrive, point-to-point messages match by posting order per ordered pair.
//
// Vocabulary. A world is the job: its size, the emulated node of each rank and what each rank
// is waiting in (for timeout messages). A group is one communicator seen from all its members
// (the world's root group, or one made by a split): one mutex, one condition variable per member,
// the collective in progress and the point-to-point queues. A member's communicator object holds
// the group, its rank in it and its own request table.
//
// Collective k of a group (k counts from 1, like the MPI backend's "collective #k"): each member
// writes its call (kind, counts, buffers) into its slot and waits until `completed` reaches k.
// The member that arrives last runs the whole collective under the mutex while everyone else is
// parked, so every buffer it touches is live: it checks the calls against each other, computes
// reductions once in rank order 0..p-1 and copies the bits to each member, stores one Status
// per member, empties the slots and wakes everyone. A member cannot reach collective k + 1
// before collective k completed, so one set of slots suffices.
//
// Point to point: the queues hold posted operations not yet matched, per ordered pair (s, r):
// sends of s to r and receives r posted from s. Whoever posts second finds the other side at the
// head of the opposite queue, copies the bytes and completes both.
//
// Failure: a member whose wait expires withdraws (its slot, its queued operations) so nobody
// touches its buffers afterwards, and is marked failed. A destroyed communicator withdraws the
// same way and is marked as left, which wakes the members waiting in the group: what they wait
// for can no longer happen. Members entering a wait that cannot complete fail at once.
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// ---- the world ------------------------------------------------------------------------------

// What a rank is blocked in, for "rank 3 is waiting in gather (collective #2) at step 1".
struct Activity {
  bool waiting = false;
  std::string op;
  int64_t seq = -1;  // collective number, or -1 for point-to-point
  std::string context;
};

struct World {
  World(int n, std::vector<int> nodes)
      : size(n),
        node_of_rank(std::move(nodes)),
        activity(static_cast<std::size_t>(n)),
        consequential(static_cast<std::size_t>(n), 0) {}
  const int size;
  const std::vector<int> node_of_rank;  // one per rank
  std::mutex mu;                        // guards the two vectors below (taken after a group's)
  std::vector<Activity> activity;
  // 1 when the rank's last failure was caused by another rank (it left or failed first).
  std::vector<char> consequential;
};

// ---- collectives ----------------------------------------------------------------------------

enum class Kind : uint8_t {
  kAllreduce,
  kReduce,
  kAllreduceStates,
  kReduceStates,
  kAllgather,
  kGather,
  kBroadcast,
  kBarrier,
  kSplit,
  kSplitShared,
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllreduce:
      return "allreduce";
    case Kind::kReduce:
      return "reduce";
    case Kind::kAllreduceStates:
      return "allreduce_states";
    case Kind::kReduceStates:
      return "reduce_states";
    case Kind::kAllgather:
      return "allgather";
    case Kind::kGather:
      return "gather";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kBarrier:
      return "barrier";
    case Kind::kSplit:
      return "split";
    case Kind::kSplitShared:
      return "split_shared";
  }
  return "?";
}

bool has_root(Kind k) {
  return k == Kind::kReduce || k == Kind::kReduceStates || k == Kind::kGather ||
         k == Kind::kBroadcast;
}

// One member's call of a collective.
struct Call {
  Kind kind = Kind::kBarrier;
  std::size_t count = 0;  // floats (allreduce, reduce), records (states) or bytes (the rest)
  std::size_t head_dim = 0;
  int root = 0;
  ReduceOp op = ReduceOp::kSum;
  int color = 0, key = 0;  // split; split_shared: color is the member's node
  const void* send = nullptr;
  void* recv = nullptr;  // in-place collectives: the same buffer as send
  std::string context;
  std::string error;  // this member's own arguments are invalid (the text says why)
};

// "allreduce(count=4, op=sum)"
std::string describe(const Call& c) {
  std::string s = std::string(kind_name(c.kind)) + "(";
  switch (c.kind) {
    case Kind::kAllreduce:
    case Kind::kReduce:
      s += "count=" + std::to_string(c.count) + ", op=" + (c.op == ReduceOp::kSum ? "sum" : "max");
      break;
    case Kind::kAllreduceStates:
    case Kind::kReduceStates:
      s += "records=" + std::to_string(c.count) + ", head_dim=" + std::to_string(c.head_dim);
      break;
    case Kind::kAllgather:
    case Kind::kGather:
    case Kind::kBroadcast:
      s += "bytes=" + std::to_string(c.count);
      break;
    case Kind::kSplit:
      s += "color=" + std::to_string(c.color) + ", key=" + std::to_string(c.key);
      break;
    case Kind::kSplitShared:
      s += "key=" + std::to_string(c.key);
      break;
    case Kind::kBarrier:
      break;
  }
  if (has_root(c.kind)) s += ", root=" + std::to_string(c.root);
  return s + ")";
}

// Whether two members' calls can be one collective (colors and keys of a split may differ).
bool compatible(const Call& a, const Call& b) {
  if (a.kind != b.kind || a.count != b.count) return false;
  if (has_root(a.kind) && a.root != b.root) return false;
  if ((a.kind == Kind::kAllreduce || a.kind == Kind::kReduce) && a.op != b.op) return false;
  if ((a.kind == Kind::kAllreduceStates || a.kind == Kind::kReduceStates) &&
      a.head_dim != b.head_dim)
    return false;
  return true;
}

// ---- groups ---------------------------------------------------------------------------------

// A posted isend or irecv.
struct P2POp {
  bool send = false;
  int owner = 0;       // group rank that posted it
  int peer = 0;        // group rank of the other side
  int tag = 0;         // label, for messages only
  int64_t number = 0;  // 1-based position among the pair's sends (or receives)
  const void* src = nullptr;
  void* dst = nullptr;
  std::size_t bytes = 0;
  bool queued = false;  // waiting in a group queue for its match
  bool done = false;
  Status status;
};

enum class Member : uint8_t { kActive, kFailed, kLeft };
enum class Slot : uint8_t { kAbsent, kHere, kWithdrawn };

struct Group;

struct SplitOut {
  std::shared_ptr<Group> group;  // null: this member joined none
  int rank = -1;
};

struct Group {
  Group(std::shared_ptr<World> w, std::vector<int> ranks)
      : world(std::move(w)),
        world_rank(std::move(ranks)),
        size(static_cast<int>(world_rank.size())),
        cv(world_rank.size()),
        member(world_rank.size(), Member::kActive),
        member_reason(world_rank.size()),
        member_code(world_rank.size(), Code::kOk),
        slot(world_rank.size(), Slot::kAbsent),
        call(world_rank.size()),
        result(world_rank.size()),
        split(world_rank.size()),
        sends(world_rank.size() * world_rank.size()),
        recvs(world_rank.size() * world_rank.size()),
        sends_posted(world_rank.size() * world_rank.size(), 0),
        recvs_posted(world_rank.size() * world_rank.size(), 0) {}

  std::size_t pair(int src, int dst) const {
    return static_cast<std::size_t>(src) * static_cast<std::size_t>(size) +
           static_cast<std::size_t>(dst);
  }
  int wr(int r) const { return world_rank[static_cast<std::size_t>(r)]; }
  // The first failure or departure of member r sticks.
  void set_member(int r, Member state, Code code, std::string reason) {
    const auto i = static_cast<std::size_t>(r);
    if (member[i] != Member::kActive) return;
    member[i] = state;
    member_code[i] = code;
    member_reason[i] = std::move(reason);
  }
  void wake_all() {
    for (auto& c : cv) c.notify_all();
  }

  const std::shared_ptr<World> world;
  const std::vector<int> world_rank;  // of each member, in group rank order
  const int size;

  std::mutex mu;                            // guards everything below
  std::vector<std::condition_variable> cv;  // member r waits on cv[r]
  std::vector<Member> member;
  std::vector<std::string> member_reason;  // why a member failed or left
  std::vector<Code> member_code;           // the code its failure returned

  // The collective in progress (number completed + 1).
  int64_t completed = 0;
  int arrived = 0;
  std::vector<Slot> slot;
  std::vector<Call> call;
  std::vector<Status> result;  // of the last completed collective, per member
  std::vector<SplitOut> split;
  std::vector<float> scratch;

  // Point to point, per ordered pair (src, dst).
  std::vector<std::deque<P2POp*>> sends, recvs;
  std::vector<int64_t> sends_posted, recvs_posted;
};

// acc <- acc (op) x, elementwise; MAX propagates NaN from either side.
void combine(float* acc, const float* x, std::size_t n, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    for (std::size_t i = 0; i < n; ++i) acc[i] = acc[i] + x[i];
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const float a = acc[i], b = x[i];
    acc[i] = (std::isnan(a) || std::isnan(b)) ? NAN : (b > a ? b : a);
  }
}

void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
}

// The last member to arrive at collective k runs it: checks, computes, delivers. Holds g.mu.
void run_collective(Group& g, int64_t k) {
  const auto p = static_cast<std::size_t>(g.size);
  auto who = [&](std::size_t r) {
    return "rank " + std::to_string(g.wr(static_cast<int>(r))) + ": ";
  };
  auto where = [&](std::size_t r) {
    return g.call[r].context.empty() ? std::string() : " at " + g.call[r].context;
  };
  auto what = [&](std::size_t r) {
    return std::string(kind_name(g.call[r].kind)) + where(r) + " (collective #" +
           std::to_string(k) + ")";
  };
  bool failed = false;

  // Invalid arguments on any member fail the collective on every member.
  for (std::size_t e = 0; e < p && !failed; ++e) {
    if (g.call[e].error.empty()) continue;
    failed = true;
    for (std::size_t r = 0; r < p; ++r)
      g.result[r] = r == e ? invalid_argument(g.call[e].error)
                           : invalid_argument(who(r) + what(r) + " failed on rank " +
                                              std::to_string(g.wr(static_cast<int>(e))) + ": " +
                                              g.call[e].error);
  }

  // Every member's call must agree with member 0's.
  if (!failed) {
    std::vector<int> differ;
    for (std::size_t r = 1; r < p; ++r)
      if (!compatible(g.call[0], g.call[r])) differ.push_back(g.wr(static_cast<int>(r)));
    if (!differ.empty()) {
      failed = true;
      std::size_t first = 1;
      while (compatible(g.call[0], g.call[first])) ++first;
      std::string detail =
          "collective #" + std::to_string(k) + " does not match across ranks: rank " +
          std::to_string(g.wr(0)) + " called " + describe(g.call[0]) + ", rank " +
          std::to_string(g.wr(static_cast<int>(first))) + " called " + describe(g.call[first]) +
          " (ranks differing from rank " + std::to_string(g.wr(0)) + ":";
      for (int r : differ) detail += " " + std::to_string(r);
      detail += ")";
      for (std::size_t r = 0; r < p; ++r)
        g.result[r] = {Code::kMismatch,
                       who(r) + kind_name(g.call[r].kind) + where(r) + ": " + detail};
    }
  }

  if (!failed) {
    const Call& c0 = g.call[0];
    const std::size_t n = c0.count;
    auto in = [&](std::size_t r) { return static_cast<const float*>(g.call[r].send); };
    auto out = [&](std::size_t r) { return static_cast<float*>(g.call[r].recv); };
    switch (c0.kind) {
      case Kind::kAllreduce:
      case Kind::kReduce:
      case Kind::kAllreduceStates:
      case Kind::kReduceStates: {
        const bool states = c0.kind == Kind::kAllreduceStates || c0.kind == Kind::kReduceStates;
        const std::size_t floats = states ? n * state_record_floats(c0.head_dim) : n;
        if (floats == 0) break;
        g.scratch.assign(in(0), in(0) + floats);
        for (std::size_t r = 1; r < p; ++r) {
          if (states)
            state_merge_n(g.scratch.data(), in(r), n, c0.head_dim);
          else
            combine(g.scratch.data(), in(r), n, c0.op);
        }
        const bool all = c0.kind == Kind::kAllreduce || c0.kind == Kind::kAllreduceStates;
        for (std::size_t r = 0; r < p; ++r)
          if (all || static_cast<int>(r) == c0.root)
            copy_bytes(out(r), g.scratch.data(), floats * sizeof(float));
        break;
      }
      case Kind::kAllgather:
        for (std::size_t r = 0; r < p; ++r)
          for (std::size_t x = 0; x < p; ++x)
            copy_bytes(static_cast<char*>(g.call[r].recv) + x * n, g.call[x].send, n);
        break;
      case Kind::kGather: {
        const auto root = static_cast<std::size_t>(c0.root);
        for (std::size_t x = 0; x < p; ++x)
          copy_bytes(static_cast<char*>(g.call[root].recv) + x * n, g.call[x].send, n);
        break;
      }
      case Kind::kBroadcast: {
        const auto root = static_cast<std::size_t>(c0.root);
        for (std::size_t r = 0; r < p; ++r)
          if (r != root) copy_bytes(g.call[r].recv, g.call[root].send, n);
        break;
      }
      case Kind::kBarrier:
        break;
      case Kind::kSplit:
      case Kind::kSplitShared: {
        // Members with equal color, ordered by (key, rank).
        std::map<int, std::vector<std::size_t>> by_color;
        for (std::size_t r = 0; r < p; ++r)
          if (g.call[r].color >= 0) by_color[g.call[r].color].push_back(r);
        for (auto& [color, members] : by_color) {
          std::stable_sort(members.begin(), members.end(), [&](std::size_t a, std::size_t b) {
            return g.call[a].key < g.call[b].key;
          });
          std::vector<int> ranks;
          for (std::size_t r : members) ranks.push_back(g.wr(static_cast<int>(r)));
          auto child = std::make_shared<Group>(g.world, std::move(ranks));
          for (std::size_t i = 0; i < members.size(); ++i)
            g.split[members[i]] = SplitOut{child, static_cast<int>(i)};
        }
        for (std::size_t r = 0; r < p; ++r)
          if (g.call[r].color < 0) g.split[r] = SplitOut{};
        break;
      }
    }
    for (std::size_t r = 0; r < p; ++r) g.result[r] = Status::ok();
  }

  for (std::size_t r = 0; r < p; ++r) {
    g.slot[r] = Slot::kAbsent;
    g.call[r] = Call{};
  }
  g.arrived = 0;
  g.completed = k;
  g.wake_all();
}

// ---- the communicator -----------------------------------------------------------------------

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<Group> group, int rank, std::shared_ptr<CommShared> shared)
      : Communicator(std::move(shared)), g_(std::move(group)), rank_(rank) {}

  ~LocalCommunicator() override {
    std::lock_guard<std::mutex> lk(g_->mu);
    withdraw_ops();
    const auto me = static_cast<std::size_t>(rank_);
    if (g_->member[me] == Member::kActive) {
      g_->set_member(rank_, Member::kLeft, Code::kOk, "destroyed its communicator");
      g_->wake_all();
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  int world_rank() const override { return g_->wr(rank_); }
  std::string_view backend_name() const override { return "local"; }
  CommCapabilities capabilities() const override {
    return CommCapabilities{MemorySpace::kHost, /*user_reductions=*/true,
                            /*stream_ordered=*/false, /*fixed_reduction_order=*/true};
  }
  int max_tag() const override { return INT_MAX; }

  Status allreduce(float* data, std::size_t count, ReduceOp op) override {
    TREEATTN_RETURN_IF_ERROR(begin("allreduce", count * sizeof(float)));
    Call c = make_call(Kind::kAllreduce, count);
    c.op = op;
    c.send = c.recv = data;
    need(c, data, count, "data");
    return collective(std::move(c));
  }

  Status reduce(float* data, std::size_t count, ReduceOp op, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("reduce", count * sizeof(float)));
    Call c = make_call(Kind::kReduce, count, root);
    c.op = op;
    c.send = c.recv = data;
    need(c, data, count, "data");
    return collective(std::move(c));
  }

  Status allreduce_states(float* records, std::size_t n, std::size_t head_dim) override {
    TREEATTN_RETURN_IF_ERROR(
        begin("allreduce_states", n * state_record_floats(head_dim) * sizeof(float)));
    Call c = make_call(Kind::kAllreduceStates, n);
    c.head_dim = head_dim;
    c.send = c.recv = records;
    need(c, records, n, "records");
    return collective(std::move(c));
  }

  Status reduce_states(float* records, std::size_t n, std::size_t head_dim, int root) override {
    TREEATTN_RETURN_IF_ERROR(
        begin("reduce_states", n * state_record_floats(head_dim) * sizeof(float)));
    Call c = make_call(Kind::kReduceStates, n, root);
    c.head_dim = head_dim;
    c.send = c.recv = records;
    need(c, records, n, "records");
    return collective(std::move(c));
  }

  Status allgather(const void* send, std::size_t bytes, void* recv) override {
    TREEATTN_RETURN_IF_ERROR(begin("allgather", bytes));
    Call c = make_call(Kind::kAllgather, bytes);
    c.send = send;
    c.recv = recv;
    need(c, send, bytes, "send");
    need(c, recv, bytes, "recv");
    return collective(std::move(c));
  }

  Status gather(const void* send, std::size_t bytes, void* recv, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("gather", bytes));
    Call c = make_call(Kind::kGather, bytes, root);
    c.send = send;
    c.recv = recv;
    need(c, send, bytes, "send");
    if (rank_ == root) need(c, recv, bytes, "recv (on the root)");
    return collective(std::move(c));
  }

  Status broadcast(void* data, std::size_t bytes, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("broadcast", bytes));
    Call c = make_call(Kind::kBroadcast, bytes, root);
    c.send = c.recv = data;
    need(c, data, bytes, "data");
    return collective(std::move(c));
  }

  Status barrier() override {
    TREEATTN_RETURN_IF_ERROR(begin("barrier", 0));
    return collective(make_call(Kind::kBarrier, 0));
  }

  Result<CommRequest> isend(const void* data, std::size_t bytes, int dest, int tag) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("isend"));
    TREEATTN_RETURN_IF_ERROR(check_p2p("isend", data, bytes, dest, tag));
    mutable_counters().p2p_bytes += bytes;
    mutable_counters().p2p_messages += 1;
    auto op = std::make_unique<P2POp>();
    op->send = true;
    op->owner = rank_;
    op->peer = dest;
    op->tag = tag;
    op->src = data;
    op->bytes = bytes;
    post(*op);
    return store(std::move(op));
  }

  Result<CommRequest> irecv(void* data, std::size_t bytes, int src, int tag) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("irecv"));
    TREEATTN_RETURN_IF_ERROR(check_p2p("irecv", data, bytes, src, tag));
    auto op = std::make_unique<P2POp>();
    op->owner = rank_;
    op->peer = src;
    op->tag = tag;
    op->dst = data;
    op->bytes = bytes;
    post(*op);
    return store(std::move(op));
  }

  Status wait_all(std::span<const CommRequest> requests) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("wait_all"));
    std::vector<P2POp*> ops;
    TREEATTN_RETURN_IF_ERROR(lookup("wait_all", requests, ops));
    Status s = wait_ops(ops);
    for (const CommRequest& q : requests) release(q.id);
    if (!s.is_ok()) fail_locally(s);
    return s;
  }

  Result<bool> test_all(std::span<const CommRequest> requests) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("test_all"));
    std::vector<P2POp*> ops;
    TREEATTN_RETURN_IF_ERROR(lookup("test_all", requests, ops));
    Status failed;
    bool all = true;
    {
      std::lock_guard<std::mutex> lk(g_->mu);
      for (P2POp* op : ops) {
        if (op->done && !op->status.is_ok() && failed.is_ok()) failed = op->status;
        all = all && op->done;
      }
    }
    if (!failed.is_ok()) {
      fail_locally(failed);
      return failed;
    }
    return all;
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("split"));
    ++seq_;
    Call c = make_call(Kind::kSplit, 0);
    c.color = color < 0 ? -1 : color;
    c.key = key;
    return split_with(std::move(c));
  }

  Result<std::unique_ptr<Communicator>> split_shared(int key) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("split_shared"));
    ++seq_;
    Call c = make_call(Kind::kSplitShared, 0);
    c.color = g_->world->node_of_rank[static_cast<std::size_t>(world_rank())];
    c.key = key;
    return split_with(std::move(c));
  }

  [[noreturn]] void abort(int code, std::string_view message) override {
    if (!message.empty()) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(message.size()), message.data());
      std::fflush(stderr);
    }
    std::fflush(stdout);
    std::_Exit(code);
  }

 private:
  // ---- helpers ----------------------------------------------------------------------------
  std::string who() const { return "rank " + std::to_string(world_rank()) + ": "; }
  std::string where() const { return context().empty() ? "" : " at " + context(); }
  World& world() const { return *g_->world; }

  Status check_usable(const char* op) const {
    if (broken_)
      return {Code::kInternal, who() + op + " called on a communicator that already failed (" +
                                   broken_reason_ + ")"};
    return Status::ok();
  }

  // Counted as the MPI backend counts: every collective call, with this rank's buffer bytes.
  Status begin(const char* op, std::size_t payload) {
    TREEATTN_RETURN_IF_ERROR(check_usable(op));
    ++seq_;
    mutable_counters().collective_calls += 1;
    mutable_counters().collective_payload_bytes += payload;
    return Status::ok();
  }

  Call make_call(Kind kind, std::size_t count, int root = 0) const {
    Call c;
    c.kind = kind;
    c.count = count;
    c.root = root;
    c.context = context();
    if (has_root(kind) && (root < 0 || root >= size()) && c.error.empty())
      c.error = who() + kind_name(kind) + " root " + std::to_string(root) + " is outside [0, " +
                std::to_string(size()) + ")";
    return c;
  }

  void need(Call& c, const void* ptr, std::size_t count, const char* what) const {
    if (ptr == nullptr && count > 0 && c.error.empty())
      c.error =
          who() + kind_name(c.kind) + " got a null " + what + " buffer for " +
          std::to_string(count) +
          (c.kind == Kind::kAllreduce || c.kind == Kind::kReduce
               ? " floats"
               : (c.kind == Kind::kAllreduceStates || c.kind == Kind::kReduceStates ? " records"
                                                                                    : " bytes"));
  }

  Status check_p2p(const char* op, const void* data, std::size_t bytes, int peer, int tag) const {
    if (peer < 0 || peer >= size())
      return invalid_argument(who() + op + " peer " + std::to_string(peer) + " is outside [0, " +
                              std::to_string(size()) + ")");
    if (tag < 0 || tag > max_tag())
      return invalid_argument(who() + op + " tag " + std::to_string(tag) + " is outside [0, " +
                              std::to_string(max_tag()) + "]");
    if (data == nullptr && bytes > 0)
      return invalid_argument(who() + op + " got a null buffer for " + std::to_string(bytes) +
                              " bytes");
    return Status::ok();
  }

  // After any failure the communicator is unusable: later calls fail at once, its queued
  // operations are withdrawn (their buffers may go away) and peers entering a wait on this
  // member fail at once too. Takes g.mu.
  void fail_locally(const Status& s) {
    if (broken_) return;
    broken_ = true;
    broken_reason_ = s.message();
    std::lock_guard<std::mutex> lk(g_->mu);
    withdraw_ops();
    g_->set_member(rank_, Member::kFailed, s.code(), s.message());
  }

  void set_activity(const std::string& op, int64_t seq) {
    std::lock_guard<std::mutex> lk(world().mu);
    Activity& a = world().activity[static_cast<std::size_t>(world_rank())];
    a.waiting = true;
    a.op = op;
    a.seq = seq;
    a.context = context();
  }
  void clear_activity() {
    std::lock_guard<std::mutex> lk(world().mu);
    world().activity[static_cast<std::size_t>(world_rank())].waiting = false;
  }
  void mark_consequential() {
    std::lock_guard<std::mutex> lk(world().mu);
    world().consequential[static_cast<std::size_t>(world_rank())] = 1;
  }

  // "; rank 3 is waiting in gather (collective #2) at step 1" for a member that is not where
  // we need it, or why it can never come. Holds g.mu.
  std::string whereabouts(int r) const {
    const auto i = static_cast<std::size_t>(r);
    const std::string name = "; rank " + std::to_string(g_->wr(r));
    if (g_->member[i] == Member::kFailed)
      return name + " failed earlier (" + g_->member_reason[i] + ")";
    if (g_->member[i] == Member::kLeft) return name + " left (" + g_->member_reason[i] + ")";
    std::lock_guard<std::mutex> lk(world().mu);
    const Activity& a = world().activity[static_cast<std::size_t>(g_->wr(r))];
    if (!a.waiting) return "";
    return name + " is waiting in " + a.op +
           (a.seq >= 0 ? " (collective #" + std::to_string(a.seq) + ")" : "") +
           (a.context.empty() ? "" : " at " + a.context);
  }

  // Members (other than this one) among `ranks` that failed or left: nothing they owe can come.
  std::vector<int> gone(const std::vector<int>& ranks) const {
    std::vector<int> out;
    for (int r : ranks)
      if (r != rank_ && g_->member[static_cast<std::size_t>(r)] != Member::kActive)
        out.push_back(r);
    return out;
  }

  // The failure of a wait that can no longer complete because `culprits` failed or left.
  // Holds g.mu. Marks this member failed so that later arrivals fail at once too.
  Status cannot_complete(const std::string& what, Clock::duration waited,
                         const std::vector<int>& culprits, const std::string& extra) {
    bool any_timeout = false;
    std::string msg = who() + "gave up after " +
                      std::to_string(std::chrono::duration_cast<milliseconds>(waited).count()) +
                      " ms in " + what + ": it cannot complete";
    for (int r : culprits) {
      if (g_->member_code[static_cast<std::size_t>(r)] == Code::kTimeout) any_timeout = true;
      msg += whereabouts(r);
    }
    msg += extra;
    const Code code = any_timeout ? Code::kTimeout : Code::kInternal;
    g_->set_member(rank_, Member::kFailed, code, "gave up in " + what);
    withdraw_ops();
    mark_consequential();
    return {code, msg};
  }

  // ---- collectives ------------------------------------------------------------------------
  Status collective(Call call) {
    Status s = collective_impl(std::move(call), nullptr);
    if (!s.is_ok()) fail_locally(s);
    return s;
  }

  Result<std::unique_ptr<Communicator>> split_with(Call call) {
    SplitOut out;
    Status s = collective_impl(std::move(call), &out);
    if (!s.is_ok()) {
      fail_locally(s);
      return s;
    }
    if (!out.group) return std::unique_ptr<Communicator>{};
    return std::unique_ptr<Communicator>(
        std::make_unique<LocalCommunicator>(std::move(out.group), out.rank, shared()));
  }

  Status collective_impl(Call call, SplitOut* split_out) {
    Group& g = *g_;
    const auto me = static_cast<std::size_t>(rank_);
    const int64_t k = seq_;
    const std::string op = kind_name(call.kind);
    const std::string what = op + where() + " (collective #" + std::to_string(k) + ")";
    const auto start = Clock::now();
    std::unique_lock<std::mutex> lk(g.mu);
    if (g.completed != k - 1)
      return internal_error(who() + what + ": the group completed " + std::to_string(g.completed) +
                            " collectives, this rank expected " + std::to_string(k - 1));
    std::vector<int> everyone(static_cast<std::size_t>(g.size));
    for (int r = 0; r < g.size; ++r) everyone[static_cast<std::size_t>(r)] = r;
    if (std::vector<int> out = gone(everyone); !out.empty())
      return cannot_complete(what, Clock::duration::zero(), out, "");

    g.call[me] = std::move(call);
    g.slot[me] = Slot::kHere;
    if (++g.arrived == g.size) {
      run_collective(g, k);
    } else {
      set_activity(op, k);
      const milliseconds limit = timeout();
      const auto deadline = start + limit;
      while (g.completed < k) {
        std::vector<int> left;
        for (int r = 0; r < g.size; ++r)
          if (g.member[static_cast<std::size_t>(r)] == Member::kLeft &&
              g.slot[static_cast<std::size_t>(r)] == Slot::kAbsent)
            left.push_back(r);
        if (!left.empty()) {
          withdraw_slot();
          clear_activity();
          return cannot_complete(what, Clock::now() - start, left, never_arrived(left));
        }
        if (limit.count() <= 0) {
          g.cv[me].wait(lk);
        } else if (g.cv[me].wait_until(lk, deadline) == std::cv_status::timeout &&
                   g.completed < k) {
          withdraw_slot();
          clear_activity();
          return timed_out(what, Clock::now() - start);
        }
      }
      clear_activity();
    }
    Status s = std::move(g.result[me]);
    g.result[me] = Status::ok();
    if (split_out) *split_out = std::move(g.split[me]);
    g.split[me] = SplitOut{};
    return s;
  }

  void withdraw_slot() {
    const auto me = static_cast<std::size_t>(rank_);
    g_->slot[me] = Slot::kWithdrawn;
    g_->call[me] = Call{};
    --g_->arrived;
  }

  // "; ranks 1, 3 never arrived; rank 1 is waiting in gather (collective #2) at step 1". Holds
  // g.mu.
  // Members in `described` are named without their whereabouts (the caller gave them).
  std::string never_arrived(const std::vector<int>& described = {}) const {
    std::vector<int> absent, names;
    for (int r = 0; r < g_->size; ++r)
      if (g_->slot[static_cast<std::size_t>(r)] == Slot::kAbsent) {
        absent.push_back(r);
        names.push_back(g_->wr(r));
      }
    if (absent.empty()) return "";
    std::string s = "; " + rank_list(names) + " never arrived";
    for (int r : absent)
      if (std::find(described.begin(), described.end(), r) == described.end()) s += whereabouts(r);
    return s;
  }

  Status timed_out(const std::string& what, Clock::duration waited) {
    const auto ms = std::chrono::duration_cast<milliseconds>(waited).count();
    const std::string msg =
        who() + "timed out after " + std::to_string(ms) + " ms in " + what + never_arrived();
    g_->set_member(rank_, Member::kFailed, Code::kTimeout, "timed out in " + what);
    withdraw_ops();
    return {Code::kTimeout, msg};
  }

  // ---- point to point ---------------------------------------------------------------------
  void post(P2POp& op) {
    Group& g = *g_;
    std::lock_guard<std::mutex> lk(g.mu);
    const int src = op.send ? rank_ : op.peer, dst = op.send ? op.peer : rank_;
    const std::size_t pr = g.pair(src, dst);
    op.number = ++(op.send ? g.sends_posted : g.recvs_posted)[pr];
    std::deque<P2POp*>& other = op.send ? g.recvs[pr] : g.sends[pr];
    if (other.empty()) {
      (op.send ? g.sends[pr] : g.recvs[pr]).push_back(&op);
      op.queued = true;
      return;
    }
    P2POp* peer = other.front();
    other.pop_front();
    peer->queued = false;
    match(op.send ? op : *peer, op.send ? *peer : op);
  }

  // Completes a matched pair: the k-th send of s to r and the k-th receive r posted from s.
  void match(P2POp& s, P2POp& r) {
    Group& g = *g_;
    const int ws = g.wr(s.owner), wd = g.wr(r.owner);
    if (s.bytes != r.bytes) {
      const std::string rule =
          " (the k-th receive from a rank must have room for exactly the k-th message it sends; "
          "tags are labels and do not reorder)";
      s.status = {Code::kMismatch,
                  "rank " + std::to_string(ws) + ": message #" + std::to_string(s.number) +
                      " to rank " + std::to_string(wd) + " (tag " + std::to_string(s.tag) +
                      ") has " + std::to_string(s.bytes) + " bytes, but the matching receive on " +
                      "rank " + std::to_string(wd) + " (tag " + std::to_string(r.tag) +
                      ") has room for " + std::to_string(r.bytes) + rule};
      r.status = {Code::kMismatch,
                  "rank " + std::to_string(wd) + ": receive #" + std::to_string(r.number) +
                      " from rank " + std::to_string(ws) + " (tag " + std::to_string(r.tag) +
                      ") has room for " + std::to_string(r.bytes) +
                      " bytes, but the matching message from rank " + std::to_string(ws) +
                      " (tag " + std::to_string(s.tag) + ") has " + std::to_string(s.bytes) + rule};
    } else {
      copy_bytes(r.dst, s.src, s.bytes);
    }
    s.done = r.done = true;
    g.cv[static_cast<std::size_t>(s.owner)].notify_all();
    g.cv[static_cast<std::size_t>(r.owner)].notify_all();
  }

  CommRequest store(std::unique_ptr<P2POp> op) {
    if (!free_ids_.empty()) {
      const int64_t id = free_ids_.back();
      free_ids_.pop_back();
      ops_[static_cast<std::size_t>(id)] = std::move(op);
      return CommRequest{id};
    }
    ops_.push_back(std::move(op));
    return CommRequest{static_cast<int64_t>(ops_.size() - 1)};
  }

  Status lookup(const char* op, std::span<const CommRequest> requests, std::vector<P2POp*>& out) {
    out.reserve(requests.size());
    for (const CommRequest& q : requests) {
      if (q.id < 0 || static_cast<std::size_t>(q.id) >= ops_.size() ||
          !ops_[static_cast<std::size_t>(q.id)])
        return invalid_argument(who() + op + " got an invalid request handle " +
                                std::to_string(q.id) + " (never issued, or already completed)");
      out.push_back(ops_[static_cast<std::size_t>(q.id)].get());
    }
    return Status::ok();
  }

  void release(int64_t id) {
    if (id < 0 || static_cast<std::size_t>(id) >= ops_.size()) return;
    auto& slot = ops_[static_cast<std::size_t>(id)];
    if (!slot) return;
    if (slot->queued) {  // only after a failure: take it out so nobody touches its buffer
      std::lock_guard<std::mutex> lk(g_->mu);
      unqueue(*slot);
    }
    slot.reset();
    free_ids_.push_back(id);
  }

  void unqueue(P2POp& op) {
    if (!op.queued) return;
    const int src = op.send ? op.owner : op.peer, dst = op.send ? op.peer : op.owner;
    auto& q = (op.send ? g_->sends : g_->recvs)[g_->pair(src, dst)];
    q.erase(std::remove(q.begin(), q.end(), &op), q.end());
    op.queued = false;
  }

  // Takes every operation of this communicator still waiting for a match out of the queues.
  // Holds g.mu.
  void withdraw_ops() {
    for (auto& op : ops_)
      if (op) unqueue(*op);
  }

  Status wait_ops(const std::vector<P2POp*>& ops) {
    Group& g = *g_;
    const auto me = static_cast<std::size_t>(rank_);
    const std::string what = "wait_all (point-to-point)" + where();
    const auto start = Clock::now();
    std::unique_lock<std::mutex> lk(g.mu);
    auto pending_peers = [&] {
      std::vector<int> peers;
      for (P2POp* op : ops)
        if (!op->done && std::find(peers.begin(), peers.end(), op->peer) == peers.end())
          peers.push_back(op->peer);
      return peers;
    };
    std::vector<int> peers = pending_peers();
    if (!peers.empty()) {
      if (std::vector<int> out = gone(peers); !out.empty())
        return cannot_complete(what, Clock::duration::zero(), out, still_waiting(ops));
      set_activity("wait_all (point-to-point)", -1);
      const milliseconds limit = timeout();
      const auto deadline = start + limit;
      for (;;) {
        peers = pending_peers();
        if (peers.empty()) break;
        std::vector<int> left;
        for (int r : peers)
          if (g.member[static_cast<std::size_t>(r)] == Member::kLeft) left.push_back(r);
        if (!left.empty()) {
          clear_activity();
          return cannot_complete(what, Clock::now() - start, left, still_waiting(ops));
        }
        if (limit.count() <= 0) {
          g.cv[me].wait(lk);
        } else if (g.cv[me].wait_until(lk, deadline) == std::cv_status::timeout &&
                   !pending_peers().empty()) {
          clear_activity();
          const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
          std::string msg = who() + "timed out after " + std::to_string(ms) + " ms in " + what +
                            still_waiting(ops);
          for (int r : pending_peers()) msg += whereabouts(r);
          g.set_member(rank_, Member::kFailed, Code::kTimeout, "timed out in " + what);
          withdraw_ops();
          return {Code::kTimeout, msg};
        }
      }
      clear_activity();
    }
    for (P2POp* op : ops)
      if (!op->status.is_ok()) return op->status;
    return Status::ok();
  }

  // "; still waiting to receive from rank 3 (tag 7)" per pending operation. Holds g.mu.
  std::string still_waiting(const std::vector<P2POp*>& ops) const {
    std::string s;
    for (P2POp* op : ops)
      if (!op->done)
        s += std::string("; still waiting to ") + (op->send ? "send to" : "receive from") +
             " rank " + std::to_string(g_->wr(op->peer)) + " (tag " + std::to_string(op->tag) + ")";
    return s;
  }

  std::shared_ptr<Group> g_;
  int rank_ = 0;
  int64_t seq_ = 0;  // collectives (splits included) started on this communicator
  std::vector<std::unique_ptr<P2POp>> ops_;  // by request id; null: free
  std::vector<int64_t> free_ids_;
  bool broken_ = false;
  std::string broken_reason_;
};

struct LocalWorld {
  std::shared_ptr<World> world;
  std::vector<std::unique_ptr<Communicator>> comms;
};

Result<LocalWorld> make_world(int size, const LocalWorldOptions& options) {
  if (size < 1)
    return invalid_argument("local world size must be >= 1, got " + std::to_string(size));
  std::vector<int> nodes = options.node_of_rank;
  if (nodes.empty()) nodes.assign(static_cast<std::size_t>(size), 0);
  if (static_cast<int>(nodes.size()) != size)
    return invalid_argument("local world node_of_rank has " + std::to_string(nodes.size()) +
                            " entries for " + std::to_string(size) + " ranks");
  for (int r = 0; r < size; ++r)
    if (nodes[static_cast<std::size_t>(r)] < 0)
      return invalid_argument("local world node id of rank " + std::to_string(r) +
                              " is negative (" +
                              std::to_string(nodes[static_cast<std::size_t>(r)]) + ")");
  LocalWorld w;
  w.world = std::make_shared<World>(size, std::move(nodes));
  std::vector<int> ranks(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<std::size_t>(r)] = r;
  auto group = std::make_shared<Group>(w.world, std::move(ranks));
  for (int r = 0; r < size; ++r)
    w.comms.push_back(
        std::make_unique<LocalCommunicator>(group, r, std::make_shared<CommShared>()));
  return w;
}

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> make_local_world(
    int size, const LocalWorldOptions& options) {
  auto w = make_world(size, options);
  TREEATTN_RETURN_IF_ERROR(w.status());
  return std::move(w->comms);
}

Status run_local(int size, const std::function<Status(Communicator&)>& fn,
                 const LocalWorldOptions& options) {
  auto w = make_world(size, options);
  TREEATTN_RETURN_IF_ERROR(w.status());
  std::vector<Status> results(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  Status start_error;
  for (int r = 0; r < size; ++r) {
    auto& comm = w->comms[static_cast<std::size_t>(r)];
    try {
      threads.emplace_back([&fn, &results, r, c = std::move(comm)]() mutable {
        Status s;
        try {
          s = fn(*c);
        } catch (const std::exception& e) {
          s = internal_error("rank " + std::to_string(r) + ": threw " + e.what());
        } catch (...) {
          s = internal_error("rank " + std::to_string(r) + ": threw an unknown exception");
        }
        c.reset();  // peers still waiting on this rank fail instead of hanging
        results[static_cast<std::size_t>(r)] = std::move(s);
      });
    } catch (const std::exception& e) {
      start_error = internal_error("run_local: cannot start the thread of rank " +
                                   std::to_string(r) + ": " + e.what());
      break;
    }
  }
  // Ranks that never started leave, so that the started ones do not wait for them.
  w->comms.clear();
  for (std::thread& t : threads) t.join();
  if (!start_error.is_ok()) return start_error;

  const Status* first = nullptr;
  for (int r = 0; r < size; ++r) {
    const Status& s = results[static_cast<std::size_t>(r)];
    if (s.is_ok()) continue;
    if (!w->world->consequential[static_cast<std::size_t>(r)]) return s;
    if (!first) first = &s;
  }
  return first ? *first : Status::ok();
}

}  // namespace treeattn
