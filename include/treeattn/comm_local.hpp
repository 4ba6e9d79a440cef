// The in-process backend of the Communicator interface: the threads of one process are the ranks.
//
// A second real implementation of comm.hpp beside Open MPI: it runs every strategy at any rank
// count inside one test process (no mpirun), and it keeps the parts of the contract a backend
// without tags keeps (matching by posting order), so a strategy that passes here does not rely
// on anything MPI gives beyond the contract.
//
// Behaviour of the backend (see comm.hpp for the contract):
// - make_local_world(p) creates p communicators over one shared world; communicator r belongs
//   to the thread that plays rank r (a communicator is used by one thread at a time).
// - Collectives: every rank registers its call and buffers; the last to arrive checks that all
//   calls agree (operation, count, root, reduction, head_dim: otherwise Code::kMismatch naming
//   both ranks' calls), computes the result once, in rank order 0..p-1, and copies the same
//   bits into every rank's buffer. allreduce_states / reduce_states merge with state_merge in
//   rank order; every rank of an all-rank collective therefore gets bit-identical results.
//   An invalid argument on one rank (a root out of range) fails the collective on every rank.
// - Point to point: the k-th isend from s to r is matched with the k-th irecv r posts from s,
//   whatever the tags (labels for messages only); the side that posts second copies the bytes
//   (rendezvous: a send completes when its receive is posted, as with NCCL). A size
//   difference between matched send and receive fails both with Code::kMismatch.
// - Waits block on a condition variable (no spinning). With timeout() > 0 a wait that expires
//   returns Code::kTimeout: "rank R: timed out after N ms in <op> at <context> (collective #k);
//   rank X never arrived" (collectives), or "...; still waiting to receive from rank X (tag t)"
//   (wait_all), plus where each missing rank is waiting if it is blocked elsewhere. A rank that
//   timed out withdraws its buffers and its communicator is unusable; a rank that later enters
//   a wait that can no longer complete (a peer failed or destroyed its communicator) fails at
//   once instead of waiting. Destroying a communicator while peers wait for it wakes them with
//   an error, so an early return on one thread does not hang the others even with timeout 0.
// - split_shared groups ranks by LocalWorldOptions::node_of_rank (an emulated node per rank).
// - Counters count as the MPI backend does: per collective call one call and this rank's buffer
//   bytes; per isend its payload bytes and one message; splits are not counted.
// - capabilities(): host memory, user-defined reductions, not stream-ordered. abort() prints the
//   message and ends the process (every rank of the job).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

struct LocalWorldOptions {
  // The emulated node of each rank; split_shared() groups ranks with equal ids. Empty: every
  // rank is on node 0. Otherwise one non-negative id per rank.
  std::vector<int> node_of_rank;
};

// Creates `size` communicators sharing one in-process world; hand communicator r to thread r.
Result<std::vector<std::unique_ptr<Communicator>>> make_local_world(
    int size, const LocalWorldOptions& options = {});

// Runs fn(comm) on `size` threads, thread r with rank r's communicator, and joins them. Each
// thread destroys its communicator when fn returns, so ranks still waiting on it fail instead of
// hanging. Returns OK when every rank returned OK, else the error of the lowest rank whose error
// was its own (not caused by another rank leaving or failing), else the lowest rank's error.
Status run_local(int size, const std::function<Status(Communicator&)>& fn,
                 const LocalWorldOptions& options = {});

}  // namespace treeattn
