// The NCCL backend of the Communicator interface: device buffers, stream-ordered collectives.
//
// This header does not include <nccl.h>; only src/comm/nccl does. Link `treeattn_nccl`.
//
// Set-up: make_nccl_communicator() is collective over a host communicator (the Open MPI one
// under mpirun, or the in-process one): rank 0 of it creates the NCCL unique id and broadcasts
// it over that communicator, and every rank joins with its rank there, on the device and stream
// of its CUDA executor (executor_cuda.hpp; one rank per GPU). The NCCL communicator's ranks are
// the bootstrap communicator's ranks. So `mpirun -np 8` on an 8-GPU host is
//
//   auto world = mpi_init_world(&argc, &argv);              // host communicator
//   auto exec = make_cuda_executor();                        // device = local rank % GPUs
//   auto nccl = make_nccl_communicator(**world, **exec);     // collective
//   auto s = DecodeSession::create(**nccl, cfg, **exec);
//
// Behaviour (see comm.hpp for the contract):
// - capabilities(): device memory, no user-defined reductions, stream-ordered. The strategy
//   registry then offers `tree` as the all-gather form and no `hier` (strategy.hpp).
//   allreduce_states / reduce_states return kUnsupported.
// - Every operation is enqueued on the executor's stream (the executor's kernels and NCCL's are
//   ordered by the stream; nothing synchronizes between them). allreduce, reduce, allgather,
//   broadcast are the NCCL collectives; gather is one group of ncclSend / ncclRecv to the root.
// - Point to point: isend / irecv only record the operation; test_all and wait_all issue every
//   recorded operation in one ncclGroupStart / ncclGroupEnd, in posting order, so the k-th send
//   from s to r meets the k-th receive r posts from s (NCCL matches in that order; tags are
//   labels for messages). A strategy posts both sides of an exchange before it waits, so a
//   group holds them together and two ranks that send to each other cannot deadlock.
//   Zero-byte messages are not issued (both sides know the size, comm.hpp). wait_all and
//   barrier wait for the stream; collectives and test_all do not block.
// - Timeouts: the NCCL communicator is non-blocking (ncclConfig_t::blocking = 0). A watchdog
//   thread polls ncclCommGetAsyncError and the completion of every enqueued operation; an
//   operation not complete timeout() (0: never) after it was enqueued or after the operation
//   before it completed, whichever is later, or an asynchronous NCCL error aborts the
//   communicator (ncclCommAbort; the kernels waiting for the missing rank return) and every
//   later call returns the error: kTimeout "rank R: NCCL <op> (#k at <context>) did not complete
//   within N ms; waiting for ranks X, Y (the peers of its point-to-point messages)" or, for a
//   collective, a message saying that NCCL does not tell which rank is missing. The same message
//   (one condition, one message) when the missing rank shows while a non-blocking NCCL call is
//   still in progress (newer NCCL connects at the first collective). Results of the step that
//   timed out are garbage: a caller that copies results back checks synchronize() (the session
//   does). The blocking calls (wait_all, barrier, synchronize, split) return the error as soon
//   as the watchdog raised it, and give up by themselves when the stream has not drained
//   timeout() after they began or after the watchdog last saw an operation complete: the work
//   of a replayed CUDA graph (its collectives are not tracked) waiting for a dead rank ends in
//   the same kTimeout message and an aborted communicator, not a hang.
// - The timeout starts finite: the bootstrap's, or kNcclDefaultTimeout where the bootstrap's is
//   0 (a queued NCCL kernel that waits for a dead rank never returns by itself). The destructor
//   waits for the enqueued work at most timeout() (kNcclDefaultTimeout where it is 0), then
//   aborts the NCCL communicator instead of finalizing it, so a rank never hangs on exit.
// - split() is ncclCommSplit (ranks ordered by key, then rank); split_shared() groups the ranks
//   whose host name and boot id agree. Sub-communicators share the settings and counters.
// - Counters as the other backends: isend payload bytes and messages; per collective one call
//   and this rank's buffer bytes. transport_bytes_sent() is not available.
// - abort() prints the message, aborts the NCCL communicator and calls abort() of the bootstrap
//   communicator (which must therefore outlive this one) to end the job.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "treeattn/comm.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// The NCCL communicator's timeout where its bootstrap communicator has none (0: wait forever),
// and the destructor's limit where timeout() is 0. The CLI's --timeout-ms, SessionConfig::timeout
// and EngineConfig::timeout replace it (comm.set_timeout) for their operations.
inline constexpr std::chrono::milliseconds kNcclDefaultTimeout{60000};

// Whether this build has the NCCL backend (TREEATTN_WITH_CUDA and NCCL found at configure time).
bool nccl_built();

// Collective over bootstrap (a host communicator). executor: a CUDA executor; the NCCL
// communicator enqueues on its stream and must not outlive it or bootstrap. The set-up honours
// bootstrap.timeout(), which the new communicator inherits (kNcclDefaultTimeout where it is 0).
Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap,
                                                             Executor& executor);

// One rank's GPU: the CUDA executor and the NCCL communicator over it. Members in this order, so
// that the communicator goes before the executor whose stream it uses (and both before the
// bootstrap communicator, which the caller destroys after them).
struct CudaRank {
  std::unique_ptr<Executor> executor;
  std::unique_ptr<Communicator> comm;
  std::string description;  // "device cuda: NVIDIA H200 (sm_90, 141 GiB)"
};

// Collective over world (a host communicator): the CUDA executor (on device r % GPUs, r the
// rank's place among the ranks of its host, from world.split_shared; no more ranks on a host
// than its GPUs), agreed by every rank, then the NCCL communicator over
// world on its stream (its set-up honours world's timeout), agreed again. On failure every rank
// returns kUnsupported with the first failing rank's message (first_failure, comm.hpp).
Result<CudaRank> open_cuda_rank(Communicator& world);

}  // namespace treeattn
