// The communicator interface strategies are written against.
//
// A Communicator is a group of ranks with the few operations a decode strategy needs: float
// reductions, the state merge as a reduction (state.hpp), all-gather, gather, broadcast, barrier,
// non-blocking point-to-point messages for rings, and splitting into sub-groups (ranks sharing
// memory, or an explicit node id so one machine can stand for several nodes). It includes no
// backend header; backends (Open MPI in comm_mpi.hpp, later NCCL) implement it.
//
// Contract, for every backend:
// - Collectives are called by every rank of the communicator in the same order with the same
//   counts (the fingerprint check in workload.hpp verifies shapes before a run).
// - Every blocking call honours timeout(): if it cannot complete within that time it returns
//   Code::kTimeout with a message naming this rank, the operation, context() and the rank(s)
//   that never arrived. After a timeout the communicator is unusable (abort the job). A timeout
//   of 0 means wait forever and lets a backend use its blocking calls.
// - Buffers live in capabilities().memory. A stream-ordered backend (NCCL) enqueues work on its
//   stream and completes it in synchronize() / wait_all(); host backends complete in the call.
// - allreduce_states / reduce_states merge packed records [m, l, o_0..o_{D-1}] with
//   state_merge. A backend without user-defined reductions (NCCL) reports
//   user_reductions = false and returns kUnsupported; the strategy registry then maps `tree`
//   to a form built from the other operations (strategy.hpp).
// - counters() count what this rank handed to the communicator and all communicators split
//   from it (they share one set of counters): point-to-point payload bytes exactly, and for
//   collectives the number of calls and this rank's payload per call (not what the
//   collective's algorithm moved; transport_bytes_sent() measures that where it can).
//
// Message ordering (point to point), the rule every strategy keeps so that a backend that
// matches by posting order only (NCCL's ncclSend/ncclRecv) serves it unchanged:
// - Between one ordered pair of ranks (sender s, receiver r) of one communicator, the k-th
//   isend s posts to r is received by the k-th irecv r posts from s, whatever the tags. Tags are
//   labels for diagnostics; a backend may ignore them (the MPI backend sends every message with
//   one MPI tag, so MPI's non-overtaking rule gives exactly this order).
// - Sizes must match pairwise: the k-th receive has room for exactly the k-th send's bytes.
// - Both sides decide what to post from replicated data (the shard plan, the shape), never from
//   something only one side knows, so the sequences agree.
// - A strategy completes (wait_all) every request it posted before it returns from a step and
//   before any collective on the same communicator, so point-to-point traffic of one step never
//   interleaves with a collective or the next step.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "treeattn/shape.hpp"  // MemorySpace
#include "treeattn/status.hpp"

namespace treeattn {

enum class ReduceOp : uint8_t { kSum, kMax };

struct CommCapabilities {
  MemorySpace memory = MemorySpace::kHost;
  bool user_reductions = true;  // allreduce_states / reduce_states are one collective
  bool stream_ordered = false;  // calls enqueue; synchronize() completes them
  // allreduce_states / reduce_states / allreduce merge each record's contributions in an order
  // fixed by the rank count alone (rank order), whatever the count: an in-process backend. MPI
  // picks its algorithm, and with it the association, by message size.
  bool fixed_reduction_order = false;
};

// Cumulative since the root communicator was created; shared with sub-communicators.
struct CommCounters {
  uint64_t p2p_bytes = 0;     // payload bytes passed to isend: exactly what this rank sent
  uint64_t p2p_messages = 0;  // number of isend calls
  uint64_t collective_calls = 0;
  uint64_t collective_payload_bytes = 0;  // this rank's buffer size per collective call
};

// Settings and counters shared by a communicator and everything split from it.
struct CommShared {
  CommCounters counters;
  std::chrono::milliseconds timeout{0};  // 0: wait forever
  std::string context;                   // e.g. "step 3", quoted in error messages
};

// Handle of an outstanding isend / irecv; complete it with wait_all.
struct CommRequest {
  int64_t id = -1;
};

class Communicator {
 public:
  Communicator() : shared_(std::make_shared<CommShared>()) {}
  explicit Communicator(std::shared_ptr<CommShared> shared) : shared_(std::move(shared)) {}
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank of this process in the job (the root communicator), used in messages.
  virtual int world_rank() const = 0;
  virtual std::string_view backend_name() const = 0;
  virtual CommCapabilities capabilities() const = 0;

  // ---- collectives (every rank calls them, same order, same counts) ------------------------
  // In place over count floats.
  virtual Status allreduce(float* data, std::size_t count, ReduceOp op) = 0;
  // In place on root; on other ranks data is only read.
  virtual Status reduce(float* data, std::size_t count, ReduceOp op, int root) = 0;
  // In place over n packed records of head_dim + 2 floats, merged with state_merge.
  virtual Status allreduce_states(float* records, std::size_t n, std::size_t head_dim) = 0;
  virtual Status reduce_states(float* records, std::size_t n, std::size_t head_dim, int root) = 0;
  // recv holds size() * bytes, rank r's contribution at offset r * bytes.
  virtual Status allgather(const void* send, std::size_t bytes, void* recv) = 0;
  // recv (root only) holds size() * bytes.
  virtual Status gather(const void* send, std::size_t bytes, void* recv, int root) = 0;
  virtual Status broadcast(void* data, std::size_t bytes, int root) = 0;
  virtual Status barrier() = 0;

  // ---- point to point -----------------------------------------------------------------------
  // Tags in [0, max_tag()] are labels (see "Message ordering" above): matching is by posting
  // order per ordered pair of ranks.
  virtual Result<CommRequest> isend(const void* data, std::size_t bytes, int dest, int tag) = 0;
  virtual Result<CommRequest> irecv(void* data, std::size_t bytes, int src, int tag) = 0;
  // Completes every request (honouring the timeout); the handles become invalid.
  virtual Status wait_all(std::span<const CommRequest> requests) = 0;
  // Drives progress without blocking: true when every request has completed. The handles stay
  // valid (still pass them to wait_all). Call it between pieces of computation to overlap
  // transfers whose protocol needs the receiver's or sender's participation.
  virtual Result<bool> test_all(std::span<const CommRequest> requests) = 0;
  virtual int max_tag() const = 0;

  // ---- groups -------------------------------------------------------------------------------
  // Ranks with equal color form one communicator, ordered by (key, rank). color < 0: this
  // rank joins none and gets nullptr. Collective over this communicator.
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key) = 0;
  // Ranks that share memory (one host, or one emulated host) form one communicator.
  virtual Result<std::unique_ptr<Communicator>> split_shared(int key) = 0;

  // Completes stream-ordered work; a no-op for host backends.
  virtual Status synchronize() { return Status::ok(); }
  // Ends every rank of the job. Prints message on this rank first.
  [[noreturn]] virtual void abort(int code, std::string_view message) = 0;

  // Bytes this process has put on the wire as the transport sees them, if the backend can
  // observe it (Open MPI: the sum over this process's TCP sockets; shared memory is invisible).
  virtual std::optional<uint64_t> transport_bytes_sent() const { return std::nullopt; }

  // ---- settings and accounting (shared with sub-communicators) ------------------------------
  void set_timeout(std::chrono::milliseconds t) { shared_->timeout = t; }
  std::chrono::milliseconds timeout() const { return shared_->timeout; }
  void set_context(std::string c) { shared_->context = std::move(c); }
  const std::string& context() const { return shared_->context; }
  const CommCounters& counters() const { return shared_->counters; }

 protected:
  CommCounters& mutable_counters() { return shared_->counters; }
  const std::shared_ptr<CommShared>& shared() const { return shared_; }

 private:
  std::shared_ptr<CommShared> shared_;
};

// Sum over this process's TCP sockets of the kernel's bytes-sent counter (Linux TCP_INFO
// tcpi_bytes_sent), or nullopt where it cannot be read. An interface-level count of what the
// process sent over TCP, whichever library sent it.
std::optional<uint64_t> process_tcp_bytes_sent();

// Collective over world: the message of the lowest rank whose `mine` failed ("rank R: ...", a
// message that already starts with "rank " kept as it is, and "(and N more ranks)"), the same
// on every rank; empty when every rank succeeded. So a rank that fails alone does not leave
// the others waiting for it. Errors: world's own.
Result<std::string> first_failure(Communicator& world, const Status& mine);

}  // namespace treeattn
