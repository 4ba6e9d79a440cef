// The engine's scheduler: rank 0's inbox (submit, cancel, stop: thread-safe), admission first
// come first served under the KV pages every rank has (kv_manager.hpp), the replicated lists of
// running and preempted sequences, and each step's work (decoding sequences one token each,
// prefilling ones sharing prefill_chunk tokens in admission order). Rank 0 decides a Plan
// (step_plan.hpp); the other ranks apply the same Plan with apply_plan, so every rank's
// sequences and page tables stay identical. No model and no communicator: tests drive it with
// hand-made states.
//
// Pages on demand: admission takes the pages of a prompt; each step, before admitting anyone,
// the running sequences reserve the pages their work needs, in admission order, and when a rank
// has none left the most recently admitted running sequence is preempted (its pages released,
// its tokens and sampler kept) and queued ahead of every waiting request. A preempted sequence
// is admitted again with every token it holds as its prompt: the prefix cache gives back what
// it still holds, the rest is recomputed, and since a row's bits do not depend on the batch or
// the chunking, it continues with exactly the tokens and logits it would have had.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/kv_manager.hpp"
#include "engine/sequence.hpp"
#include "engine/step_plan.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/status.hpp"

namespace treeattn::engine {

struct SchedulerConfig {
  int max_batch = 16;                        // running sequences at most
  int64_t prefill_chunk = 256;               // prompt tokens per step over all prefilling sequences
  int max_queue = 256;                       // waiting requests at most
  std::chrono::milliseconds idle_tick{250};  // make_plan's wait on an idle engine
  std::string who;                           // this rank's prefix of messages ("rank 1: ")
};

using Running = std::vector<std::unique_ptr<Sequence>>;

// Decoding sequences (their prompt computed, one token pending) always take their one token;
// prefilling ones, and resumed ones recomputing, share prefill_chunk tokens in admission order.
std::vector<WorkItem> choose_work(const Running& running, int64_t prefill_chunk);

// Whether a running sequence has not yet computed full pages that `prompt` could take from the
// prefix cache once they are (the pages a prompt can reuse: those before its last token).
bool prefix_in_flight(const Running& running, std::span<const TokenId> prompt, const KVManager& kv);

class Scheduler {
 public:
  Scheduler(SchedulerConfig config, KVManager& kv) : cfg_(std::move(config)), kv_(kv) {}

  // ---- the inbox: rank 0, thread-safe ----
  // kInternal after fail_all or stop; kOutOfMemory when max_queue requests wait.
  Result<RequestId> submit(Request request, TokenCallback callback);
  void cancel(RequestId id);
  void stop(bool drain);
  int64_t waiting() const;
  bool failed() const;
  Status failure() const;  // what fail_all was given; ok before

  // ---- the replicated state ----
  const Running& running() const { return running_; }
  const Running& preempted() const { return preempted_; }  // next to resume first
  Sequence* find(RequestId id);
  // Rank 0: this step's cancels, admissions and work, applied to the replicated state as they
  // are decided. With nothing to do, it first waits up to idle_tick for a request.
  Result<Plan> make_plan();
  // Other ranks: rank 0's cancels and admissions; an admission that does not fit is kInternal
  // (the replicated tables diverged).
  Status apply_plan(Plan& plan);
  // Whether this rank can run the work (every named request is live and has the tokens).
  Status check_work(std::span<const WorkItem> work);
  // Releases a sequence's pages and reservation and drops it.
  void retire(RequestId id);
  // Sends an event to a sequence's callback (rank 0's) with its timings so far.
  static void emit(Sequence& s, TokenEvent ev);
  // Every request in flight ends with kError; later submits and steps refuse.
  void fail_all(const Status& st);
  // Whatever is queued or running ends with kCancelled (the engine goes away).
  void end_everything();

  int64_t preemptions_total() const { return preemptions_total_; }
  int64_t requests_total() const { return requests_total_; }
  int64_t prompt_tokens_total() const { return prompt_total_; }
  int64_t cached_tokens_total() const { return cached_total_; }

 private:
  struct Pending {
    RequestId id = 0;
    Request req;
    TokenCallback cb;
    Clock::time_point submitted;
  };
  // Admission on every rank. decide (rank 0): false when it does not fit now; other ranks: it
  // must fit (rank 0 decided on the same state).
  Result<bool> admit(RequestId id, Request req, bool decide, TokenCallback cb,
                     Clock::time_point submitted);
  // Admits preempted_.front() again on every rank; decide as for admit.
  Result<bool> resume(bool decide);
  void cancel_running(RequestId id);
  // Moves a running sequence to the front of preempted_, its pages released.
  void preempt(RequestId id);
  // Rank 0: reserves the pages the running sequences' work needs, preempting the most recently
  // admitted ones while a rank has too few; records the preemptions in the plan.
  Status grow_running(Plan& plan);
  // Every rank: reserves the growth of the work of sequences running now (after the plan's
  // preemptions, before its admissions: as rank 0 did).
  Status apply_growth(const Plan& plan);
  bool known(RequestId id);  // running or preempted
  // Under the lock: takes the cancels and the stop flag into the plan; returns the queued
  // requests dropped (their callbacks run after the lock).
  std::vector<Pending> take_cancels(Plan& plan);
  Status admit_waiting(Plan& plan);
  static void drop(std::vector<Pending>& dropped, TokenEvent ev);

  SchedulerConfig cfg_;
  KVManager& kv_;
  Running running_;    // admission order, replicated
  Running preempted_;  // the most recently preempted first, replicated
  int64_t requests_total_ = 0, prompt_total_ = 0, cached_total_ = 0, preemptions_total_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> waiting_;
  std::vector<RequestId> cancel_ids_;
  bool stop_now_ = false, stop_drain_ = false;
  RequestId next_id_ = 1;
  bool failed_ = false;
  Status failure_;
};

}  // namespace treeattn::engine
