// The NCCL Communicator (comm_nccl.hpp): stream-ordered collectives and grouped point-to-point
// messages on a CUDA executor's stream, a watchdog thread that turns a missing rank or an
// asynchronous NCCL error into an aborted communicator and a named error, and the set-up over a
// host communicator. The only file that includes <nccl.h>.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nccl_policy.hpp"
#include "treeattn/comm_nccl.hpp"
#include "treeattn/executor_cuda.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "treeattn's NCCL backend needs NCCL >= 2.18 (non-blocking communicators, ncclCommSplit)"
#endif

namespace treeattn {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kMaxTag = (1 << 30) - 1;

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

std::string nccl_text(ncclResult_t r, ncclComm_t c) {
  std::string s = ncclGetErrorString(r);
  const char* last = c ? ncclGetLastError(c) : nullptr;
  if (last && *last) s += " (" + std::string(last) + ")";
  return s;
}

cudaError_t use_device(int device) {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur == device) return cudaSuccess;
  return cudaSetDevice(device);
}

Clock::time_point deadline_after(milliseconds t) {
  return t.count() > 0 ? Clock::now() + t : Clock::time_point::max();
}

// Sleeps a little longer the longer a poll has waited: spin first (latency), then yield, then
// 50 us naps (so that a rank waiting for a slow peer leaves the CPU to others).
void backoff(Clock::time_point since) {
  const auto waited = Clock::now() - since;
  if (waited < std::chrono::microseconds(200)) return;
  if (waited < std::chrono::milliseconds(2)) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}

// FNV-1a of this host's name and boot id: ranks with equal values share a machine.
uint64_t host_identity() {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const std::string& s) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 1099511628211ull;
    }
  };
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0) mix(name);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (boot && std::getline(boot, id)) mix(id);
  return h;
}

// One enqueued operation the watchdog waits for.
struct Tracked {
  cudaEvent_t done = nullptr;
  Clock::time_point deadline;
  std::string what;        // "allreduce (collective #3 at step 2)"
  std::vector<int> peers;  // point-to-point: the ranks it exchanges with
  int64_t timeout_ms = 0;
};

struct PendingP2P {
  bool send = false;
  const void* data = nullptr;
  void* rdata = nullptr;
  std::size_t bytes = 0;
  int peer = 0;
  int tag = 0;
  int64_t id = 0;
};

class NcclComm final : public Communicator {
 public:
  NcclComm(std::shared_ptr<CommShared> shared, ncclComm_t comm, int world_rank, int device,
           cudaStream_t stream, Communicator* bootstrap)
      : Communicator(std::move(shared)),
        comm_(comm),
        world_rank_(world_rank),
        device_(device),
        stream_(stream),
        bootstrap_(bootstrap) {}

  // Second phase of construction: rank, size, scratch memory, events, the watchdog.
  Status init() {
    TREEATTN_RETURN_IF_ERROR(check_nccl("ncclCommUserRank", ncclCommUserRank(comm_, &rank_)));
    TREEATTN_RETURN_IF_ERROR(check_nccl("ncclCommCount", ncclCommCount(comm_, &size_)));
    TREEATTN_RETURN_IF_ERROR(check_cuda("cudaSetDevice", use_device(device_)));
    scratch_bytes_ = static_cast<std::size_t>(size_) * sizeof(uint64_t) + 64;
    TREEATTN_RETURN_IF_ERROR(
        check_cuda("cudaMalloc (communicator scratch)", cudaMalloc(&scratch_, scratch_bytes_)));
    TREEATTN_RETURN_IF_ERROR(check_cuda(
        "cudaEventCreate", cudaEventCreateWithFlags(&sync_event_, cudaEventDisableTiming)));
    watchdog_ = std::thread([this] { watch(); });
    return Status::ok();
  }

  ~NcclComm() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    (void)use_device(device_);
    std::lock_guard<std::mutex> nk(nccl_mu_);
    if (comm_) {
      // The work enqueued on the stream may wait for a peer that is gone, and with the watchdog
      // stopped nothing else would end it: wait at most the timeout (never unbounded,
      // nccl_policy.hpp), then abort, which makes NCCL's kernels return.
      const milliseconds limit = nccl_detail::teardown_limit(timeout());
      const bool drained = !failed_.load() && nccl_detail::poll_until(
                                                  [this] {
                                                    const cudaError_t q = cudaStreamQuery(stream_);
                                                    // An error is not "still running": stop.
                                                    return q != cudaErrorNotReady;
                                                  },
                                                  limit, backoff);
      if (drained) {
        // Then free the communicator; a peer that never completes makes the finalize time
        // out, and the communicator is aborted instead.
        ncclResult_t r = ncclCommFinalize(comm_);
        const auto end = Clock::now() + limit;
        const auto since = Clock::now();
        while (r == ncclInProgress && Clock::now() < end) {
          backoff(since);
          (void)ncclCommGetAsyncError(comm_, &r);
        }
        if (r == ncclSuccess)
          (void)ncclCommDestroy(comm_);
        else
          (void)ncclCommAbort(comm_);
      } else {
        (void)ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    for (Tracked& t : tracked_) (void)cudaEventDestroy(t.done);
    for (cudaEvent_t e : spare_events_) (void)cudaEventDestroy(e);
    if (sync_event_) (void)cudaEventDestroy(sync_event_);
    if (scratch_) (void)cudaFree(scratch_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank() const override { return world_rank_; }
  std::string_view backend_name() const override { return "nccl"; }
  CommCapabilities capabilities() const override {
    return {MemorySpace::kDevice, /*user_reductions=*/false, /*stream_ordered=*/true};
  }
  int max_tag() const override { return kMaxTag; }

  // ---- collectives -----------------------------------------------------------------------------
  Status allreduce(float* data, std::size_t count, ReduceOp op) override {
    TREEATTN_RETURN_IF_ERROR(begin("allreduce", count * sizeof(float)));
    if (count == 0) return Status::ok();
    return issue("allreduce", [&](ncclComm_t c) {
      return ncclAllReduce(data, data, count, ncclFloat32, nccl_op(op), c, stream_);
    });
  }
  Status reduce(float* data, std::size_t count, ReduceOp op, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("reduce", count * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(check_root("reduce", root));
    if (count == 0) return Status::ok();
    return issue("reduce", [&](ncclComm_t c) {
      return ncclReduce(data, data, count, ncclFloat32, nccl_op(op), root, c, stream_);
    });
  }
  Status allreduce_states(float*, std::size_t, std::size_t) override {
    return no_user_reductions("allreduce_states");
  }
  Status reduce_states(float*, std::size_t, std::size_t, int) override {
    return no_user_reductions("reduce_states");
  }
  Status allgather(const void* send, std::size_t bytes, void* recv) override {
    TREEATTN_RETURN_IF_ERROR(begin("allgather", bytes));
    if (bytes == 0) return Status::ok();
    return issue("allgather", [&](ncclComm_t c) {
      return ncclAllGather(send, recv, bytes, ncclUint8, c, stream_);
    });
  }
  Status gather(const void* send, std::size_t bytes, void* recv, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("gather", bytes));
    TREEATTN_RETURN_IF_ERROR(check_root("gather", root));
    if (bytes == 0) return Status::ok();
    std::vector<int> peers;
    if (rank_ == root) {
      for (int r = 0; r < size_; ++r)
        if (r != root) peers.push_back(r);
      TREEATTN_RETURN_IF_ERROR(check_cuda(
          "cudaMemcpyAsync (gather, own part)",
          cudaMemcpyAsync(static_cast<uint8_t*>(recv) + static_cast<std::size_t>(root) * bytes,
                          send, bytes, cudaMemcpyDeviceToDevice, stream_)));
    } else {
      peers.push_back(root);
    }
    return issue(
        "gather",
        [&](ncclComm_t c) {
          ncclResult_t r = ncclGroupStart();
          if (r != ncclSuccess) return r;
          if (rank_ == root) {
            for (int p : peers) {
              r = ncclRecv(static_cast<uint8_t*>(recv) + static_cast<std::size_t>(p) * bytes, bytes,
                           ncclUint8, p, c, stream_);
              if (r != ncclSuccess && r != ncclInProgress) break;
            }
          } else {
            r = ncclSend(send, bytes, ncclUint8, root, c, stream_);
          }
          const ncclResult_t e = ncclGroupEnd();
          return (r != ncclSuccess && r != ncclInProgress) ? r : e;
        },
        peers);
  }
  Status broadcast(void* data, std::size_t bytes, int root) override {
    TREEATTN_RETURN_IF_ERROR(begin("broadcast", bytes));
    TREEATTN_RETURN_IF_ERROR(check_root("broadcast", root));
    if (bytes == 0) return Status::ok();
    return issue("broadcast", [&](ncclComm_t c) {
      return ncclBroadcast(data, data, bytes, ncclUint8, root, c, stream_);
    });
  }
  Status barrier() override {
    TREEATTN_RETURN_IF_ERROR(begin("barrier", 0));
    auto* one = static_cast<float*>(scratch_);
    TREEATTN_RETURN_IF_ERROR(issue("barrier", [&](ncclComm_t c) {
      return ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, c, stream_);
    }));
    return wait_stream("barrier");
  }

  // ---- point to point --------------------------------------------------------------------------
  Result<CommRequest> isend(const void* data, std::size_t bytes, int dest, int tag) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("isend"));
    TREEATTN_RETURN_IF_ERROR(check_p2p("isend", bytes, dest, tag, data));
    PendingP2P op;
    op.send = true;
    op.data = data;
    op.bytes = bytes;
    op.peer = dest;
    op.tag = tag;
    op.id = next_id_++;
    pending_.push_back(op);
    outstanding_.insert(op.id);
    mutable_counters().p2p_bytes += bytes;
    mutable_counters().p2p_messages += 1;
    return CommRequest{op.id};
  }
  Result<CommRequest> irecv(void* data, std::size_t bytes, int src, int tag) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("irecv"));
    TREEATTN_RETURN_IF_ERROR(check_p2p("irecv", bytes, src, tag, data));
    PendingP2P op;
    op.rdata = data;
    op.bytes = bytes;
    op.peer = src;
    op.tag = tag;
    op.id = next_id_++;
    pending_.push_back(op);
    outstanding_.insert(op.id);
    return CommRequest{op.id};
  }
  Status wait_all(std::span<const CommRequest> requests) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("wait_all"));
    TREEATTN_RETURN_IF_ERROR(check_requests("wait_all", requests));
    TREEATTN_RETURN_IF_ERROR(flush());
    for (const CommRequest& r : requests) outstanding_.erase(r.id);
    if (capturing()) return Status::ok();  // recorded into the graph; nothing to wait for
    return wait_stream("wait_all");
  }
  Result<bool> test_all(std::span<const CommRequest> requests) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("test_all"));
    TREEATTN_RETURN_IF_ERROR(check_requests("test_all", requests));
    TREEATTN_RETURN_IF_ERROR(flush());
    if (capturing()) return true;
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaSuccess) return true;
    if (q == cudaErrorNotReady) return false;
    return check_cuda("cudaStreamQuery (test_all)", q);
  }

  // ---- groups ----------------------------------------------------------------------------------
  Result<std::unique_ptr<Communicator>> split(int color, int key) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("split"));
    TREEATTN_RETURN_IF_ERROR(flush());
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t child = nullptr;
    {
      std::lock_guard<std::mutex> nk(nccl_mu_);
      if (!comm_) return failure();
      ncclResult_t r =
          ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &cfg);
      if (r != ncclSuccess && r != ncclInProgress)
        return fail_now(Code::kInternal, "ncclCommSplit failed: " + nccl_text(r, comm_));
      TREEATTN_RETURN_IF_ERROR(settle(comm_, "ncclCommSplit"));
      if (child) TREEATTN_RETURN_IF_ERROR(settle(child, "ncclCommSplit (new communicator)"));
    }
    if (color < 0 || child == nullptr) return std::unique_ptr<Communicator>();
    auto c = std::make_unique<NcclComm>(shared(), child, world_rank_, device_, stream_, bootstrap_);
    TREEATTN_RETURN_IF_ERROR(c->init());
    return std::unique_ptr<Communicator>(std::move(c));
  }
  Result<std::unique_ptr<Communicator>> split_shared(int key) override {
    TREEATTN_RETURN_IF_ERROR(check_usable("split_shared"));
    TREEATTN_RETURN_IF_ERROR(flush());
    if (capturing())
      return unsupported(who() + "split_shared while the stream is captured into a CUDA graph");
    const uint64_t mine = host_identity();
    auto* ids = static_cast<uint64_t*>(scratch_);
    TREEATTN_RETURN_IF_ERROR(check_cuda(
        "cudaMemcpyAsync (split_shared)",
        cudaMemcpyAsync(ids + rank_, &mine, sizeof(mine), cudaMemcpyHostToDevice, stream_)));
    TREEATTN_RETURN_IF_ERROR(issue("split_shared (host ids)", [&](ncclComm_t c) {
      return ncclAllGather(ids + rank_, ids, sizeof(uint64_t), ncclUint8, c, stream_);
    }));
    std::vector<uint64_t> all(static_cast<std::size_t>(size_));
    TREEATTN_RETURN_IF_ERROR(
        check_cuda("cudaMemcpyAsync (split_shared)",
                   cudaMemcpyAsync(all.data(), ids, all.size() * sizeof(uint64_t),
                                   cudaMemcpyDeviceToHost, stream_)));
    TREEATTN_RETURN_IF_ERROR(wait_stream("split_shared"));
    int color = rank_;
    for (int r = 0; r < size_; ++r)
      if (all[static_cast<std::size_t>(r)] == mine) {
        color = r;
        break;
      }
    return split(color, key);
  }

  Status synchronize() override {
    TREEATTN_RETURN_IF_ERROR(check_usable("synchronize"));
    TREEATTN_RETURN_IF_ERROR(flush());
    if (capturing()) return Status::ok();
    return wait_stream("synchronize");
  }

  [[noreturn]] void abort(int code, std::string_view message) override {
    if (!message.empty())
      std::fprintf(stderr, "rank %d: %.*s\n", world_rank_, static_cast<int>(message.size()),
                   message.data());
    {
      std::lock_guard<std::mutex> nk(nccl_mu_);
      if (comm_) (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    failed_ = true;
    if (bootstrap_) bootstrap_->abort(code, "");
    std::_Exit(code == 0 ? 1 : code);
  }

 private:
  std::string who() const { return "rank " + std::to_string(world_rank_) + ": "; }
  std::string where() const { return context().empty() ? "" : " at " + context(); }
  static ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

  bool capturing() const {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &st) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return st != cudaStreamCaptureStatusNone;
  }

  Status check_cuda(const char* call, cudaError_t e) const {
    if (e == cudaSuccess) return Status::ok();
    return internal_error(who() + "nccl communicator: " + call + " failed: " + cuda_text(e));
  }
  Status check_nccl(const char* call, ncclResult_t r) const {
    if (r == ncclSuccess) return Status::ok();
    return internal_error(who() + call + " failed: " + nccl_text(r, comm_));
  }
  Status check_root(const char* op, int root) const {
    if (root >= 0 && root < size_) return Status::ok();
    return invalid_argument(who() + op + " root " + std::to_string(root) + " is outside [0, " +
                            std::to_string(size_) + ")");
  }
  Status check_p2p(const char* op, std::size_t bytes, int peer, int tag, const void* data) const {
    if (peer < 0 || peer >= size_)
      return invalid_argument(who() + op + " peer " + std::to_string(peer) + " is outside [0, " +
                              std::to_string(size_) + ")");
    if (tag < 0 || tag > kMaxTag)
      return invalid_argument(who() + op + " tag " + std::to_string(tag) + " is outside [0, " +
                              std::to_string(kMaxTag) + "]");
    if (bytes > 0 && data == nullptr) return invalid_argument(who() + op + ": null buffer");
    return Status::ok();
  }
  Status check_requests(const char* op, std::span<const CommRequest> requests) const {
    for (const CommRequest& r : requests)
      if (!outstanding_.count(r.id))
        return invalid_argument(who() + op + ": request " + std::to_string(r.id) +
                                " is not an outstanding request of this communicator");
    return Status::ok();
  }
  Status no_user_reductions(const char* op) const {
    return unsupported(who() + op +
                       ": NCCL has no user-defined reductions (the strategy registry serves `tree` "
                       "over NCCL as an all-gather and a merge kernel)");
  }

  // The error every call returns once the communicator failed.
  Status failure() const {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.is_ok()) return failure_;
    return internal_error(who() + "the NCCL communicator was aborted");
  }
  Status check_usable(const char* op) {
    if (failed_.load()) {
      const Status f = failure();
      return Status(f.code(), f.message() + " [then " + op + " was called]");
    }
    return check_cuda("cudaSetDevice", use_device(device_));
  }
  // Records a failure found on this thread (the communicator is aborted by the caller or the
  // watchdog).
  Status fail_now(Code code, const std::string& message) {
    Status s(code, who() + message);
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.is_ok()) failure_ = s;
    failed_ = true;
    return failure_;
  }

  Status begin(const char* op, std::size_t payload) {
    TREEATTN_RETURN_IF_ERROR(check_usable(op));
    TREEATTN_RETURN_IF_ERROR(flush());  // point-to-point first, in posting order
    ++seq_;
    mutable_counters().collective_calls += 1;
    mutable_counters().collective_payload_bytes += payload;
    return Status::ok();
  }

  // Waits (holding nccl_mu_) until a non-blocking call on c has left ncclInProgress, at most
  // timeout(); aborts the communicator on expiry or error.
  Status settle(ncclComm_t c, const char* call) {
    const auto end = deadline_after(timeout());
    const auto since = Clock::now();
    ncclResult_t r = ncclInProgress;
    for (;;) {
      const ncclResult_t q = ncclCommGetAsyncError(c, &r);
      if (q != ncclSuccess) r = q;
      if (r != ncclInProgress) break;
      if (Clock::now() > end) {
        (void)ncclCommAbort(comm_);
        if (c != comm_) (void)ncclCommAbort(c);
        comm_ = nullptr;
        // The same condition as the watchdog's (a rank that never came), so the same message.
        return fail_now(Code::kTimeout,
                        nccl_detail::missing_rank_message("", std::string(call) + where(),
                                                          timeout().count(), {}));
      }
      backoff(since);
    }
    if (r == ncclSuccess) return Status::ok();
    const std::string text = nccl_text(r, c);
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    return fail_now(Code::kInternal, std::string(call) + where() + " failed: " + text);
  }

  // Issues one NCCL call (or group) built by fn on the stream and hands it to the watchdog.
  template <class Fn>
  Status issue(const char* op, Fn&& fn, std::vector<int> peers = {}) {
    std::string what = std::string(op) + " (operation #" + std::to_string(seq_) + where() + ")";
    {
      std::lock_guard<std::mutex> nk(nccl_mu_);
      if (!comm_) return failure();
      const ncclResult_t r = fn(comm_);
      if (r != ncclSuccess && r != ncclInProgress) {
        const std::string text = nccl_text(r, comm_);
        (void)ncclCommAbort(comm_);
        comm_ = nullptr;
        return fail_now(Code::kInternal, what + " failed: " + text);
      }
      if (r == ncclInProgress) TREEATTN_RETURN_IF_ERROR(settle(comm_, op));
    }
    return track(std::move(what), std::move(peers));
  }

  // Issues every recorded isend / irecv in one group, in posting order.
  Status flush() {
    if (pending_.empty()) return Status::ok();
    std::vector<PendingP2P> ops;
    ops.swap(pending_);
    ++p2p_groups_;
    std::set<int> peer_set;
    std::string what = "point-to-point group #" + std::to_string(p2p_groups_) + where() + " (";
    bool first = true;
    for (const PendingP2P& o : ops) {
      if (o.bytes == 0) continue;
      peer_set.insert(o.peer);
      if (!first) what += ", ";
      first = false;
      what += (o.send ? "send " : "receive ") + std::to_string(o.bytes) + " B " +
              (o.send ? "to" : "from") + " rank " + std::to_string(o.peer) + " tag " +
              std::to_string(o.tag);
    }
    what += ")";
    if (peer_set.empty()) return Status::ok();
    {
      std::lock_guard<std::mutex> nk(nccl_mu_);
      if (!comm_) return failure();
      ncclResult_t r = ncclGroupStart();
      for (const PendingP2P& o : ops) {
        if (r != ncclSuccess && r != ncclInProgress) break;
        if (o.bytes == 0) continue;
        r = o.send ? ncclSend(o.data, o.bytes, ncclUint8, o.peer, comm_, stream_)
                   : ncclRecv(o.rdata, o.bytes, ncclUint8, o.peer, comm_, stream_);
      }
      const ncclResult_t e = ncclGroupEnd();
      if (r == ncclSuccess || r == ncclInProgress) r = e;
      if (r != ncclSuccess && r != ncclInProgress) {
        const std::string text = nccl_text(r, comm_);
        (void)ncclCommAbort(comm_);
        comm_ = nullptr;
        return fail_now(Code::kInternal, what + " failed: " + text);
      }
      if (r == ncclInProgress) TREEATTN_RETURN_IF_ERROR(settle(comm_, "ncclGroupEnd"));
    }
    return track(std::move(what), std::vector<int>(peer_set.begin(), peer_set.end()));
  }

  // Hands the operation just enqueued to the watchdog (not while the stream is being captured:
  // nothing runs then).
  Status track(std::string what, std::vector<int> peers) {
    if (capturing()) return Status::ok();
    std::lock_guard<std::mutex> lk(mu_);
    cudaEvent_t ev = nullptr;
    if (!spare_events_.empty()) {
      ev = spare_events_.back();
      spare_events_.pop_back();
    } else {
      const cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e != cudaSuccess) return check_cuda("cudaEventCreate", e);
    }
    const cudaError_t e = cudaEventRecord(ev, stream_);
    if (e != cudaSuccess) {
      spare_events_.push_back(ev);
      return check_cuda("cudaEventRecord", e);
    }
    tracked_.push_back(Tracked{ev, deadline_after(timeout()), std::move(what), std::move(peers),
                               static_cast<int64_t>(timeout().count())});
    cv_.notify_all();
    return Status::ok();
  }

  // Blocks until everything enqueued on the stream has completed, or the watchdog failed the
  // communicator, or timeout() passed without progress (nccl_policy.hpp WaitBound: work the
  // watchdog does not track, such as a replayed CUDA graph's collectives), which aborts it.
  Status wait_stream(const char* op) {
    TREEATTN_RETURN_IF_ERROR(check_cuda("cudaEventRecord", cudaEventRecord(sync_event_, stream_)));
    const auto since = Clock::now();
    nccl_detail::WaitBound bound(timeout(), completed_.load(), since);
    for (;;) {
      const cudaError_t q = cudaEventQuery(sync_event_);
      if (failed_.load()) {
        const Status f = failure();
        return Status(f.code(), f.message() + " [while in " + op + "]");
      }
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady) return check_cuda(op, q);
      if (bound.expired(completed_.load(), Clock::now())) {
        const Status f = fail_now(
            Code::kTimeout,
            nccl_detail::missing_rank_message(
                "",
                std::string(op) + where() +
                    " (the stream's work, which the watchdog does not track: a replayed CUDA "
                    "graph's collectives?)",
                timeout().count(), {}));
        std::lock_guard<std::mutex> nk(nccl_mu_);
        if (comm_) (void)ncclCommAbort(comm_);
        comm_ = nullptr;
        return f;
      }
      backoff(since);
    }
  }

  // The watchdog: retires completed operations, fails the communicator when the oldest one is
  // past its deadline or NCCL reports an asynchronous error, and aborts it.
  void watch() {
    (void)use_device(device_);
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_) {
      cv_.wait_for(lk, milliseconds(2));
      if (stop_ || failed_.load()) continue;
      while (!tracked_.empty()) {
        const cudaError_t q = cudaEventQuery(tracked_.front().done);
        if (q == cudaErrorNotReady) break;
        if (q != cudaSuccess) {
          failure_ = internal_error(who() + tracked_.front().what + ": " + cuda_text(q));
          failed_ = true;
          break;
        }
        spare_events_.push_back(tracked_.front().done);
        tracked_.pop_front();
        completed_.fetch_add(1);
        // The next operation's time starts now at the latest (a deep queue of enqueued steps
        // must not count against the operations at its end).
        if (!tracked_.empty() && tracked_.front().timeout_ms > 0)
          tracked_.front().deadline = std::max(
              tracked_.front().deadline, Clock::now() + milliseconds(tracked_.front().timeout_ms));
      }
      if (!failed_.load() && !tracked_.empty() && Clock::now() > tracked_.front().deadline) {
        const Tracked& t = tracked_.front();
        failure_ = Status(Code::kTimeout,
                          nccl_detail::missing_rank_message(who(), t.what, t.timeout_ms, t.peers));
        failed_ = true;
      }
      // Asynchronous NCCL errors. nccl_mu_ is busy while this rank's thread is inside an NCCL
      // call, which then watches its own deadline (settle).
      if (!failed_.load()) {
        std::unique_lock<std::mutex> nk(nccl_mu_, std::try_to_lock);
        if (nk.owns_lock() && comm_) {
          ncclResult_t ae = ncclSuccess;
          if (ncclCommGetAsyncError(comm_, &ae) == ncclSuccess && ae != ncclSuccess &&
              ae != ncclInProgress) {
            failure_ = internal_error(
                who() + "NCCL reported an asynchronous error: " + nccl_text(ae, comm_));
            failed_ = true;
          }
        }
      }
      if (failed_.load()) {
        lk.unlock();
        {
          std::lock_guard<std::mutex> nk(nccl_mu_);
          if (comm_) (void)ncclCommAbort(comm_);
          comm_ = nullptr;
        }
        lk.lock();
      }
    }
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1;
  int world_rank_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  Communicator* bootstrap_ = nullptr;
  void* scratch_ = nullptr;  // barrier float, split_shared host ids
  std::size_t scratch_bytes_ = 0;
  cudaEvent_t sync_event_ = nullptr;
  int64_t seq_ = 0;
  int64_t p2p_groups_ = 0;
  int64_t next_id_ = 0;
  std::vector<PendingP2P> pending_;
  std::set<int64_t> outstanding_;

  // Shared with the watchdog.
  mutable std::mutex mu_;  // tracked_, spare_events_, failure_, stop_
  std::mutex nccl_mu_;     // comm_ and every call on it
  std::condition_variable cv_;
  std::deque<Tracked> tracked_;
  std::vector<cudaEvent_t> spare_events_;
  Status failure_;
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> completed_{0};  // tracked operations retired: progress for wait_stream
  bool stop_ = false;
  std::thread watchdog_;
};

// What every rank tells the others at set-up (all-gathered over the bootstrap communicator).
struct Hello {
  int32_t ok = 0;
  int32_t device = -1;
  char error[240] = {};
  ncclUniqueId id{};  // rank 0's
};

}  // namespace

bool nccl_built() { return true; }

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap,
                                                             Executor& executor) {
  const int me = bootstrap.rank(), p = bootstrap.size();
  const std::string who = "rank " + std::to_string(bootstrap.world_rank()) + ": ";
  if (bootstrap.capabilities().memory != MemorySpace::kHost)
    return invalid_argument(who +
                            "make_nccl_communicator needs a host communicator to bootstrap "
                            "from (MPI or in-process), got '" +
                            std::string(bootstrap.backend_name()) + "'");

  // Local checks and rank 0's unique id travel together, so every rank reports the same error.
  Hello mine;
  std::string local;
  auto stream = cuda_stream(executor);
  auto info = cuda_device_info(executor);
  if (!stream.is_ok()) {
    local = stream.status().message();
  } else if (!info.is_ok()) {
    local = info.status().message();
  } else if (use_device(info->device) != cudaSuccess) {
    local = "cannot make device " + std::to_string(info->device) + " current";
  } else if (me == 0) {
    const ncclResult_t r = ncclGetUniqueId(&mine.id);
    if (r != ncclSuccess) local = std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r);
  }
  mine.ok = local.empty() ? 1 : 0;
  mine.device = info.is_ok() ? info->device : -1;
  std::snprintf(mine.error, sizeof(mine.error), "%s", local.c_str());
  std::vector<Hello> all(static_cast<std::size_t>(p));
  TREEATTN_RETURN_IF_ERROR(bootstrap.allgather(&mine, sizeof(Hello), all.data()));
  for (int r = 0; r < p; ++r)
    if (!all[static_cast<std::size_t>(r)].ok)
      return invalid_argument(who + "NCCL set-up: rank " + std::to_string(r) +
                              " cannot join: " + all[static_cast<std::size_t>(r)].error);

  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, p, all[0].id, me, &cfg);
  const milliseconds limit = nccl_detail::initial_timeout(bootstrap.timeout());
  const auto end = deadline_after(limit);
  const auto since = Clock::now();
  while (r == ncclInProgress && comm != nullptr) {
    if (Clock::now() > end) {
      (void)ncclCommAbort(comm);
      return Status(Code::kTimeout,
                    nccl_detail::missing_rank_message(
                        who, "ncclCommInitRankConfig (every rank passed the bootstrap all-gather)",
                        limit.count(), {}));
    }
    backoff(since);
    ncclResult_t q = ncclInProgress;
    if (ncclCommGetAsyncError(comm, &q) != ncclSuccess) break;
    r = q;
  }
  if (r != ncclSuccess) {
    const std::string text = nccl_text(r, comm);
    if (comm) (void)ncclCommAbort(comm);
    return internal_error(who + "ncclCommInitRankConfig (" + std::to_string(p) + " ranks, device " +
                          std::to_string(info->device) + ") failed: " + text);
  }
  auto shared = std::make_shared<CommShared>();
  shared->timeout = limit;  // never "forever" at the start (nccl_policy.hpp)
  shared->context = bootstrap.context();
  auto c = std::make_unique<NcclComm>(shared, comm, bootstrap.world_rank(), info->device,
                                      static_cast<cudaStream_t>(*stream), &bootstrap);
  TREEATTN_RETURN_IF_ERROR(c->init());
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace treeattn
