// The Open MPI Communicator: collectives with timeouts, the state merge as a user MPI_Op,
// timeout diagnosis that names the missing ranks, and MPI set-up / tear-down.
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "treeattn/comm_mpi.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kDiagTag = 4242;
// Every point-to-point message of the Communicator interface carries this one MPI tag, so MPI's
// non-overtaking rule matches messages between a pair of ranks in the order they were posted:
// the ordering contract of comm.hpp, the one a backend without tags (NCCL) gives. The caller's
// tag is only a label for diagnostics ("still waiting to receive from rank 3 (tag 7)").
constexpr int kP2PTag = 0;

// ---- process-wide MPI objects ---------------------------------------------------------------

bool g_we_initialized = false;
MPI_Op g_merge_op = MPI_OP_NULL;
std::map<std::size_t, MPI_Datatype>& state_types() {
  static std::map<std::size_t, MPI_Datatype> types;
  return types;
}

// inout[i] <- in[i] (+) inout[i] for len records; the record length comes from the datatype.
extern "C" void treeattn_merge_states_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  int type_bytes = 0;
  MPI_Type_size(*type, &type_bytes);
  const std::size_t rec = static_cast<std::size_t>(type_bytes) / sizeof(float);
  const std::size_t d = rec - 2;
  auto* acc = static_cast<float*>(inout);
  const auto* x = static_cast<const float*>(in);
  for (int i = 0; i < *len; ++i) {
    // state_merge is commutative bit for bit (it folds m = -0 to +0), as MPI_Op_create's
    // commute flag below requires.
    state_merge(acc + static_cast<std::size_t>(i) * rec, x + static_cast<std::size_t>(i) * rec, d);
  }
}

Result<MPI_Datatype> state_type(std::size_t head_dim) {
  auto& types = state_types();
  auto it = types.find(head_dim);
  if (it != types.end()) return it->second;
  MPI_Datatype t = MPI_DATATYPE_NULL;
  if (MPI_Type_contiguous(static_cast<int>(state_record_floats(head_dim)), MPI_FLOAT, &t) !=
          MPI_SUCCESS ||
      MPI_Type_commit(&t) != MPI_SUCCESS)
    return internal_error("cannot create the MPI datatype for state records of head_dim " +
                          std::to_string(head_dim));
  types.emplace(head_dim, t);
  return t;
}

Result<MPI_Op> merge_op() {
  if (g_merge_op == MPI_OP_NULL &&
      MPI_Op_create(&treeattn_merge_states_op, /*commute=*/1, &g_merge_op) != MPI_SUCCESS)
    return internal_error("MPI_Op_create for the state merge failed");
  return g_merge_op;
}

std::string mpi_error_text(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<std::size_t>(len));
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX; }

std::string join_ranks(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// What a rank that timed out tells the others during diagnosis.
struct DiagRecord {
  int64_t seq;
  char op[32];
  char context[64];
};

// ---- the communicator ---------------------------------------------------------------------

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of comm (already a private duplicate).
  MpiCommunicator(MPI_Comm comm, std::shared_ptr<CommShared> shared)
      : Communicator(std::move(shared)), comm_(comm) {}
  ~MpiCommunicator() override {
    for (MPI_Request& r : requests_)
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    if (diag_ != MPI_COMM_NULL) MPI_Comm_free(&diag_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  Status init() {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    if (int rc = MPI_Comm_dup(comm_, &diag_); rc != MPI_SUCCESS)
      return internal_error("MPI_Comm_dup failed: " + mpi_error_text(rc));
    MPI_Comm_set_errhandler(diag_, MPI_ERRORS_RETURN);
    // World ranks of this group, for messages.
    MPI_Group mine, world;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> local(static_cast<std::size_t>(size_));
    for (int i = 0; i < size_; ++i) local[static_cast<std::size_t>(i)] = i;
    world_of_.assign(static_cast<std::size_t>(size_), -1);
    MPI_Group_translate_ranks(mine, size_, local.data(), world, world_of_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    int flag = 0;
    int* ub = nullptr;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &flag);
    max_tag_ = (flag && ub) ? *ub : 32767;
    return Status::ok();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank() const override { return world_of_[static_cast<std::size_t>(rank_)]; }
  std::string_view backend_name() const override { return "mpi"; }
  CommCapabilities capabilities() const override { return {}; }
  int max_tag() const override { return max_tag_ - 1; }  // kDiagTag lives on diag_ only

  Status allreduce(float* data, std::size_t count, ReduceOp op) override {
    TREEATTN_RETURN_IF_ERROR(begin("allreduce", count * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(check_count("allreduce", count));
    const int n = static_cast<int>(count);
    if (blocking())
      return check("MPI_Allreduce",
                   MPI_Allreduce(MPI_IN_PLACE, data, n, MPI_FLOAT, mpi_op(op), comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(check(
        "MPI_Iallreduce", MPI_Iallreduce(MPI_IN_PLACE, data, n, MPI_FLOAT, mpi_op(op), comm_, &r)));
    return wait_collective(&r, "allreduce");
  }

  Status reduce(float* data, std::size_t count, ReduceOp op, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("reduce", count * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(check_count("reduce", count));
    TREEATTN_RETURN_IF_ERROR(check_root("reduce", root));
    const int n = static_cast<int>(count);
    const void* send = rank_ == root ? MPI_IN_PLACE : data;
    void* recv = rank_ == root ? data : nullptr;
    if (blocking())
      return check("MPI_Reduce", MPI_Reduce(send, recv, n, MPI_FLOAT, mpi_op(op), root, comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Ireduce", MPI_Ireduce(send, recv, n, MPI_FLOAT, mpi_op(op), root, comm_, &r)));
    return wait_collective(&r, "reduce");
  }

  Status allreduce_states(float* records, std::size_t n, std::size_t head_dim) override {
    TREEATTN_RETURN_IF_ERROR(
        begin("allreduce_states", n * state_record_floats(head_dim) * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(check_count("allreduce_states", n));
    auto type = state_type(head_dim);
    TREEATTN_RETURN_IF_ERROR(type.status());
    auto op = merge_op();
    TREEATTN_RETURN_IF_ERROR(op.status());
    const int cnt = static_cast<int>(n);
    if (blocking())
      return check("MPI_Allreduce(states)",
                   MPI_Allreduce(MPI_IN_PLACE, records, cnt, *type, *op, comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Iallreduce(states)",
              MPI_Iallreduce(MPI_IN_PLACE, records, cnt, *type, *op, comm_, &r)));
    return wait_collective(&r, "allreduce_states");
  }

  Status reduce_states(float* records, std::size_t n, std::size_t head_dim, int root) override {
    TREEATTN_RETURN_IF_ERROR(
        begin("reduce_states", n * state_record_floats(head_dim) * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(check_count("reduce_states", n));
    TREEATTN_RETURN_IF_ERROR(check_root("reduce_states", root));
    auto type = state_type(head_dim);
    TREEATTN_RETURN_IF_ERROR(type.status());
    auto op = merge_op();
    TREEATTN_RETURN_IF_ERROR(op.status());
    const int cnt = static_cast<int>(n);
    const void* send = rank_ == root ? MPI_IN_PLACE : records;
    void* recv = rank_ == root ? records : nullptr;
    if (blocking())
      return check("MPI_Reduce(states)", MPI_Reduce(send, recv, cnt, *type, *op, root, comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Ireduce(states)", MPI_Ireduce(send, recv, cnt, *type, *op, root, comm_, &r)));
    return wait_collective(&r, "reduce_states");
  }

  Status allgather(const void* send, std::size_t bytes, void* recv) override {
    TREEATTN_RETURN_IF_ERROR(begin("allgather", bytes));
    TREEATTN_RETURN_IF_ERROR(check_count("allgather", bytes));
    const int n = static_cast<int>(bytes);
    if (blocking())
      return check("MPI_Allgather", MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Iallgather", MPI_Iallgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r)));
    return wait_collective(&r, "allgather");
  }

  Status gather(const void* send, std::size_t bytes, void* recv, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("gather", bytes));
    TREEATTN_RETURN_IF_ERROR(check_count("gather", bytes));
    TREEATTN_RETURN_IF_ERROR(check_root("gather", root));
    const int n = static_cast<int>(bytes);
    if (blocking())
      return check("MPI_Gather", MPI_Gather(send, n, MPI_BYTE, recv, n, MPI_BYTE, root, comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Igather", MPI_Igather(send, n, MPI_BYTE, recv, n, MPI_BYTE, root, comm_, &r)));
    return wait_collective(&r, "gather");
  }

  Status broadcast(void* data, std::size_t bytes, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("broadcast", bytes));
    TREEATTN_RETURN_IF_ERROR(check_count("broadcast", bytes));
    TREEATTN_RETURN_IF_ERROR(check_root("broadcast", root));
    const int n = static_cast<int>(bytes);
    if (blocking()) return check("MPI_Bcast", MPI_Bcast(data, n, MPI_BYTE, root, comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(check("MPI_Ibcast", MPI_Ibcast(data, n, MPI_BYTE, root, comm_, &r)));
    return wait_collective(&r, "broadcast");
  }

  Status barrier() override {
    TREEATTN_RETURN_IF_ERROR(begin("barrier", 0));
    if (blocking()) return check("MPI_Barrier", MPI_Barrier(comm_));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(check("MPI_Ibarrier", MPI_Ibarrier(comm_, &r)));
    return wait_collective(&r, "barrier");
  }

  Result<CommRequest> isend(const void* data, std::size_t bytes, int dest, int tag) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("isend"));
    TREEATTN_RETURN_IF_ERROR(check_p2p("isend", bytes, dest, tag));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(check(
        "MPI_Isend", MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, dest, kP2PTag, comm_, &r)));
    mutable_counters().p2p_bytes += bytes;
    mutable_counters().p2p_messages += 1;
    return store(r, PeerOp{true, dest, tag});
  }

  Result<CommRequest> irecv(void* data, std::size_t bytes, int src, int tag) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("irecv"));
    TREEATTN_RETURN_IF_ERROR(check_p2p("irecv", bytes, src, tag));
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(check(
        "MPI_Irecv", MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, src, kP2PTag, comm_, &r)));
    return store(r, PeerOp{false, src, tag});
  }

  Status wait_all(std::span<const CommRequest> requests) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("wait_all"));
    std::vector<MPI_Request> reqs;
    reqs.reserve(requests.size());
    for (const CommRequest& q : requests) {
      if (q.id < 0 || static_cast<std::size_t>(q.id) >= requests_.size())
        return invalid_argument(who() + "wait_all got an invalid request handle " +
                                std::to_string(q.id));
      reqs.push_back(requests_[static_cast<std::size_t>(q.id)]);
    }
    pending_ids_.assign(requests.begin(), requests.end());
    Status s = wait(reqs.data(), static_cast<int>(reqs.size()), "wait_all (point-to-point)",
                    /*collective=*/false);
    for (const CommRequest& q : requests) {
      requests_[static_cast<std::size_t>(q.id)] = MPI_REQUEST_NULL;
      free_ids_.push_back(q.id);
    }
    if (!s.is_ok()) {
      // The MPI requests still in flight are left to the abort that follows a failure.
      for (MPI_Request& r : reqs)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    }
    return s;
  }

  Result<bool> test_all(std::span<const CommRequest> requests) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("test_all"));
    std::vector<MPI_Request> reqs;
    reqs.reserve(requests.size());
    for (const CommRequest& q : requests) {
      if (q.id < 0 || static_cast<std::size_t>(q.id) >= requests_.size())
        return invalid_argument(who() + "test_all got an invalid request handle " +
                                std::to_string(q.id));
      reqs.push_back(requests_[static_cast<std::size_t>(q.id)]);
    }
    int done = 0;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Testall",
              MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE)));
    for (std::size_t i = 0; i < requests.size(); ++i)
      requests_[static_cast<std::size_t>(requests[i].id)] = reqs[i];
    return done != 0;
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key) override {
    TREEATTN_RETURN_IF_ERROR(barrier_before("split"));
    MPI_Comm c = MPI_COMM_NULL;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Comm_split", MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &c)));
    if (c == MPI_COMM_NULL) return std::unique_ptr<Communicator>{};
    return wrap(c);
  }

  Result<std::unique_ptr<Communicator>> split_shared(int key) override {
    TREEATTN_RETURN_IF_ERROR(barrier_before("split_shared"));
    MPI_Comm c = MPI_COMM_NULL;
    TREEATTN_RETURN_IF_ERROR(
        check("MPI_Comm_split_type",
              MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, &c)));
    return wrap(c);
  }

  [[noreturn]] void abort(int code, std::string_view message) override { mpi_abort(code, message); }

  std::optional<uint64_t> transport_bytes_sent() const override { return process_tcp_bytes_sent(); }

 private:
  bool blocking() const { return timeout().count() <= 0; }

  std::string who() const { return "rank " + std::to_string(world_rank()) + ": "; }
  std::string where() const { return context().empty() ? "" : " at " + context(); }

  Status check_usable(const char* op) const {
    if (broken_)
      return {Code::kInternal, who() + op + " called on a communicator that already failed (" +
                                   broken_reason_ + ")"};
    return Status::ok();
  }

  Status begin(const char* op, std::size_t payload) {
    TREEATTN_RETURN_IF_ERROR(check_usable(op));
    ++seq_;
    mutable_counters().collective_calls += 1;
    mutable_counters().collective_payload_bytes += payload;
    return Status::ok();
  }

  Status check(const char* call, int rc) {
    if (rc == MPI_SUCCESS) return Status::ok();
    broken_ = true;
    broken_reason_ = std::string(call) + " failed";
    return internal_error(who() + call + " failed" + where() + ": " + mpi_error_text(rc));
  }

  Status check_count(const char* op, std::size_t count) const {
    if (count > static_cast<std::size_t>(INT_MAX))
      return invalid_argument(who() + op + " count " + std::to_string(count) +
                              " exceeds the MPI limit of " + std::to_string(INT_MAX) +
                              " elements per call");
    return Status::ok();
  }

  Status check_root(const char* op, int root) const {
    if (root < 0 || root >= size_)
      return invalid_argument(who() + op + " root " + std::to_string(root) + " is outside [0, " +
                              std::to_string(size_) + ")");
    return Status::ok();
  }

  Status check_p2p(const char* op, std::size_t bytes, int peer, int tag) const {
    TREEATTN_RETURN_IF_ERROR(check_count(op, bytes));
    if (peer < 0 || peer >= size_)
      return invalid_argument(who() + op + " peer " + std::to_string(peer) + " is outside [0, " +
                              std::to_string(size_) + ")");
    if (tag < 0 || tag > max_tag())
      return invalid_argument(who() + op + " tag " + std::to_string(tag) + " is outside [0, " +
                              std::to_string(max_tag()) + "]");
    return Status::ok();
  }

  // What a point-to-point request waits for, for timeout messages.
  struct PeerOp {
    bool send = false;
    int peer = -1;
    int tag = 0;
  };

  CommRequest store(MPI_Request r, PeerOp what) {
    if (!free_ids_.empty()) {
      const int64_t id = free_ids_.back();
      free_ids_.pop_back();
      requests_[static_cast<std::size_t>(id)] = r;
      peer_ops_[static_cast<std::size_t>(id)] = what;
      return CommRequest{id};
    }
    requests_.push_back(r);
    peer_ops_.push_back(what);
    return CommRequest{static_cast<int64_t>(requests_.size() - 1)};
  }

  Result<std::unique_ptr<Communicator>> wrap(MPI_Comm c) {
    auto child = std::make_unique<MpiCommunicator>(c, shared());
    TREEATTN_RETURN_IF_ERROR(child->init());
    return std::unique_ptr<Communicator>(std::move(child));
  }

  // A timed barrier on the diagnostic communicator before a blocking group operation, so that
  // a rank that never arrives yields a timeout instead of a hang.
  Status barrier_before(const char* op) {
    TREEATTN_RETURN_IF_ERROR(check_usable(op));
    if (blocking()) return Status::ok();
    ++seq_;
    MPI_Request r;
    TREEATTN_RETURN_IF_ERROR(check("MPI_Ibarrier", MPI_Ibarrier(comm_, &r)));
    return wait_collective(&r, op);
  }

  Status wait_collective(MPI_Request* r, const char* op) { return wait(r, 1, op, true); }

  // Polls until all requests complete or the timeout expires.
  Status wait(MPI_Request* reqs, int n, const char* op, bool collective) {
    if (n == 0) return Status::ok();
    if (blocking()) return check("MPI_Waitall", MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE));
    const auto start = Clock::now();
    const auto deadline = start + timeout();
    for (;;) {
      int done = 0;
      TREEATTN_RETURN_IF_ERROR(
          check("MPI_Testall", MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE)));
      if (done) return Status::ok();
      const auto now = Clock::now();
      if (now >= deadline) {
        std::string pending;
        if (!collective) pending = describe_pending(reqs, n);
        return diagnose_timeout(op, collective, now - start, pending);
      }
      // Spin briefly (a collective of a step usually completes within microseconds), then sleep
      // in short and, once the wait is already long (an idle server's ranks waiting for the next
      // step), longer naps: at most 0.5 ms late on a wait of 20 ms or more, instead of a quarter
      // of a core polling while idle (measured: 2-rank idle `serve`, 29% of a core before).
      const auto waited = now - start;
      if (waited < milliseconds(2))
        sched_yield();
      else if (waited < milliseconds(20))
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      else
        std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }

  // "still waiting to receive from rank 3 (tag 7)" for the requests of wait_all not complete.
  std::string describe_pending(MPI_Request* reqs, int n) {
    std::string s;
    for (int i = 0; i < n && static_cast<std::size_t>(i) < pending_ids_.size(); ++i) {
      int done = 0;
      MPI_Request_get_status(reqs[i], &done, MPI_STATUS_IGNORE);
      if (done) continue;
      const PeerOp& w =
          peer_ops_[static_cast<std::size_t>(pending_ids_[static_cast<std::size_t>(i)].id)];
      s += std::string("; still waiting to ") + (w.send ? "send to" : "receive from") + " rank " +
           std::to_string(world_of_[static_cast<std::size_t>(w.peer)]) + " (tag " +
           std::to_string(w.tag) + ")";
    }
    return s;
  }

  // Every rank that times out tells every other rank which operation it is in; ranks not heard
  // from within the grace period are named as never arrived (for a collective; a
  // point-to-point wait names the peers it still waits for, since the other ranks may have
  // finished their part and moved on).
  Status diagnose_timeout(const char* op, bool collective, Clock::duration waited,
                          const std::string& pending) {
    broken_ = true;
    broken_reason_ = std::string("timed out in ") + op;
    // Buffers of requests that may outlive this call (a free'd send, a cancelled receive) are
    // members, so MPI never touches freed memory.
    DiagRecord& mine = diag_mine_;
    mine = DiagRecord{};
    mine.seq = collective ? seq_ : -1;
    std::snprintf(mine.op, sizeof(mine.op), "%s", op);
    std::snprintf(mine.context, sizeof(mine.context), "%s", context().c_str());

    const auto n = static_cast<std::size_t>(size_);
    std::vector<DiagRecord>& theirs = diag_theirs_;
    theirs.assign(n, DiagRecord{});
    std::vector<MPI_Request> recvs(n, MPI_REQUEST_NULL), sends(n, MPI_REQUEST_NULL);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const auto i = static_cast<std::size_t>(r);
      MPI_Irecv(&theirs[i], sizeof(DiagRecord), MPI_BYTE, r, kDiagTag, diag_, &recvs[i]);
      MPI_Isend(&mine, sizeof(DiagRecord), MPI_BYTE, r, kDiagTag, diag_, &sends[i]);
    }
    const auto grace = std::clamp(timeout() / 2, milliseconds(50), milliseconds(2000));
    const auto deadline = Clock::now() + grace;
    std::vector<bool> heard(n, false);
    heard[static_cast<std::size_t>(rank_)] = true;
    for (;;) {
      bool all = true;
      for (std::size_t i = 0; i < n; ++i) {
        if (heard[i]) continue;
        int flag = 0;
        MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE);
        if (flag)
          heard[i] = true;
        else
          all = false;
      }
      if (all || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::vector<int> missing;
    std::string elsewhere;
    for (std::size_t i = 0; i < n; ++i) {
      const int wr = world_of_[i];
      if (!heard[i]) {
        MPI_Cancel(&recvs[i]);
        MPI_Request_free(&recvs[i]);
        missing.push_back(wr);
        continue;
      }
      if (static_cast<int>(i) == rank_) continue;
      const DiagRecord& t = theirs[i];
      const std::string top(t.op, strnlen(t.op, sizeof(t.op)));
      const std::string tctx(t.context, strnlen(t.context, sizeof(t.context)));
      if (top != op || t.seq != mine.seq)
        elsewhere += "; rank " + std::to_string(wr) + " is waiting in " + top +
                     (t.seq >= 0 ? " (collective #" + std::to_string(t.seq) + ")" : "") +
                     (tctx.empty() ? "" : " at " + tctx);
    }
    for (MPI_Request& s : sends)
      if (s != MPI_REQUEST_NULL) MPI_Request_free(&s);

    const auto ms = std::chrono::duration_cast<milliseconds>(waited).count();
    std::string msg = who() + "timed out after " + std::to_string(ms) + " ms in " + op + where();
    if (collective) msg += " (collective #" + std::to_string(seq_) + ")";
    if (collective) {
      if (!missing.empty()) msg += "; " + join_ranks(missing) + " never arrived";
      msg += elsewhere;
      if (missing.empty() && elsewhere.empty())
        msg += "; every rank arrived but the operation did not complete";
    } else {
      msg += pending + elsewhere;
    }
    return {Code::kTimeout, msg};
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm diag_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, max_tag_ = 32767;
  std::vector<int> world_of_;
  int64_t seq_ = 0;  // collectives started on this communicator
  std::vector<MPI_Request> requests_;
  std::vector<PeerOp> peer_ops_;
  std::vector<int64_t> free_ids_;
  std::vector<CommRequest> pending_ids_;  // the requests wait_all is waiting for
  bool broken_ = false;
  std::string broken_reason_;
  DiagRecord diag_mine_{};
  std::vector<DiagRecord> diag_theirs_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> mpi_init_world(int* argc, char*** argv) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) return internal_error("MPI was already finalized in this process");
  if (!initialized) {
    int provided = 0;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      return internal_error("MPI_Init_thread failed");
    g_we_initialized = true;
  }
  MPI_Comm c = MPI_COMM_NULL;
  if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c); rc != MPI_SUCCESS)
    return internal_error("MPI_Comm_dup(MPI_COMM_WORLD) failed: " + mpi_error_text(rc));
  auto comm = std::make_unique<MpiCommunicator>(c, std::make_shared<CommShared>());
  TREEATTN_RETURN_IF_ERROR(comm->init());
  return std::unique_ptr<Communicator>(std::move(comm));
}

Status mpi_finalize() {
  if (!mpi_active()) return Status::ok();
  for (auto& [d, t] : state_types()) MPI_Type_free(&t);
  state_types().clear();
  if (g_merge_op != MPI_OP_NULL) MPI_Op_free(&g_merge_op);
  if (!g_we_initialized) return Status::ok();
  if (int rc = MPI_Finalize(); rc != MPI_SUCCESS)
    return internal_error("MPI_Finalize failed: " + mpi_error_text(rc));
  return Status::ok();
}

void mpi_abort(int code, std::string_view message) {
  if (!message.empty()) {
    std::fprintf(stderr, "%.*s\n", static_cast<int>(message.size()), message.data());
    std::fflush(stderr);
  }
  std::fflush(stdout);
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

bool mpi_active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

}  // namespace treeattn

namespace treeattn {

Result<std::unique_ptr<Communicator>> mpi_wrap_fortran(int64_t fortran_handle) {
  if (!mpi_active())
    return invalid_argument("cannot wrap MPI communicator handle " +
                            std::to_string(fortran_handle) +
                            ": MPI is not initialized (or already finalized)");
  if (fortran_handle < INT_MIN || fortran_handle > INT_MAX)
    return invalid_argument("MPI communicator handle " + std::to_string(fortran_handle) +
                            " is not a Fortran handle (outside the range of MPI_Fint)");
  MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  if (c == MPI_COMM_NULL)
    return invalid_argument("MPI communicator handle " + std::to_string(fortran_handle) +
                            " is MPI_COMM_NULL or not a valid communicator");
  int inter = 0;
  if (int rc = MPI_Comm_test_inter(c, &inter); rc != MPI_SUCCESS)
    return invalid_argument("MPI communicator handle " + std::to_string(fortran_handle) +
                            " is not a valid communicator: " + mpi_error_text(rc));
  if (inter)
    return invalid_argument("MPI communicator handle " + std::to_string(fortran_handle) +
                            " is an intercommunicator; treeattn needs an intracommunicator");
  MPI_Comm dup = MPI_COMM_NULL;
  if (int rc = MPI_Comm_dup(c, &dup); rc != MPI_SUCCESS)
    return internal_error("MPI_Comm_dup of communicator handle " + std::to_string(fortran_handle) +
                          " failed: " + mpi_error_text(rc));
  auto comm = std::make_unique<MpiCommunicator>(dup, std::make_shared<CommShared>());
  TREEATTN_RETURN_IF_ERROR(comm->init());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace treeattn
