// The host-side rules of the NCCL communicator (comm_nccl.hpp, nccl_comm.cpp), kept free of NCCL
// and CUDA headers so that tests/cuda/test_nccl_comm.cpp checks them on machines without a GPU:
// the timeout a new communicator starts with, how long its destructor waits before aborting,
// the one message for an operation that waited for a rank that never came, the bounded poll the
// destructor uses and the bound of a blocking wait for the stream.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "treeattn/comm_nccl.hpp"

namespace treeattn::nccl_detail {

// The timeout a new NCCL communicator starts with (and its set-up honours): the bootstrap's, or
// kNcclDefaultTimeout where the bootstrap waits forever (0). A stream-ordered NCCL operation that
// waits for a dead rank never returns by itself, so the NCCL communicator never starts without a
// limit; set_timeout(0) afterwards still means "wait forever" (comm.hpp).
inline std::chrono::milliseconds initial_timeout(std::chrono::milliseconds bootstrap) {
  return bootstrap.count() > 0 ? bootstrap : kNcclDefaultTimeout;
}

// How long the destructor waits for the work enqueued on the stream before it aborts the
// communicator: the communicator's timeout, or kNcclDefaultTimeout where that is 0. Never
// unbounded: a rank whose queued collective waits for a dead peer must still exit.
inline std::chrono::milliseconds teardown_limit(std::chrono::milliseconds timeout) {
  return timeout.count() > 0 ? timeout : kNcclDefaultTimeout;
}

// The one message for one condition: an NCCL operation (a collective, a point-to-point group,
// or a non-blocking call still in progress) did not complete within the timeout because a rank
// did not take part. `what` names the operation ("allreduce (operation #3 at step 2)"); peers
// are the ranks its point-to-point messages wait for (empty for a collective, where NCCL does
// not say which rank is missing).
inline std::string missing_rank_message(const std::string& who, const std::string& what,
                                        int64_t timeout_ms, const std::vector<int>& peers) {
  std::string msg =
      who + "NCCL " + what + " did not complete within " + std::to_string(timeout_ms) + " ms; ";
  if (peers.empty()) {
    msg +=
        "NCCL does not report which rank is missing (every rank of the communicator must reach "
        "this operation)";
  } else {
    msg += "waiting for rank";
    msg += peers.size() > 1 ? "s" : "";
    for (std::size_t i = 0; i < peers.size(); ++i)
      msg += (i ? ", " : " ") + std::to_string(peers[i]);
  }
  return msg + "; aborted the NCCL communicator";
}

// Calls done() until it returns true (true) or `limit` has passed (false), calling nap(since)
// between tries. The destructor's wait for the stream: bounded, so that it can abort instead.
template <class Done, class Nap>
bool poll_until(Done&& done, std::chrono::milliseconds limit, Nap&& nap) {
  using Clock = std::chrono::steady_clock;
  const auto since = Clock::now();
  const auto end = since + limit;
  for (;;) {
    if (done()) return true;
    if (Clock::now() >= end) return false;
    nap(since);
  }
}

// The bound of a blocking wait for the stream (synchronize, barrier, wait_all, split_shared):
// it expires `timeout` after the wait began or after the watchdog last saw an operation complete
// (`progress`, a count of completed operations, changed), whichever is later; a timeout of 0
// never expires. The watchdog's deadlines cover the operations it tracks; this bound covers the
// work it does not see, such as the collectives of a replayed CUDA graph waiting for a dead rank.
class WaitBound {
 public:
  using Clock = std::chrono::steady_clock;
  WaitBound(std::chrono::milliseconds timeout, int64_t progress, Clock::time_point now)
      : timeout_(timeout), progress_(progress), since_(now) {}
  bool expired(int64_t progress, Clock::time_point now) {
    if (progress != progress_) {
      progress_ = progress;
      since_ = now;
    }
    return timeout_.count() > 0 && now - since_ > timeout_;
  }

 private:
  std::chrono::milliseconds timeout_;
  int64_t progress_;
  Clock::time_point since_;
};

}  // namespace treeattn::nccl_detail
