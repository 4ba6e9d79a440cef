// The Open MPI backend of the Communicator interface: set-up and tear-down of MPI.
//
// This header does not include <mpi.h>; only src/comm/mpi does. Link the `treeattn_mpi`
// library to use it.
//
// Behaviour of the backend (see comm.hpp for the contract):
// - Each communicator is an MPI_Comm_dup of the caller's group, with MPI_ERRORS_RETURN, plus a
//   second duplicate used only to diagnose timeouts.
// - allreduce_states / reduce_states use one MPI_Allreduce / MPI_Reduce with a commutative
//   user-defined MPI_Op over a contiguous datatype of head_dim + 2 floats.
// - With a timeout > 0 every operation is the non-blocking MPI call (MPI_Iallreduce, ...)
//   polled with MPI_Testall until the deadline; the poll yields the CPU (sched_yield, then
//   short sleeps after 2 ms) so that oversubscribed ranks make progress. On expiry the ranks
//   that timed out exchange (on the diagnostic duplicate, with a grace period of half the
//   timeout, at least 50 ms and at most 2 s) which operation each is in; ranks that send
//   nothing are named as "never arrived". With timeout 0 the blocking MPI calls are used, so
//   Open MPI's tuned (or han) component chooses the algorithm.
// - Communicator splits run after a timed barrier, so a missing rank cannot hang them.
#pragma once

#include <memory>
#include <string_view>

#include "treeattn/comm.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// Initializes MPI (MPI_THREAD_FUNNELED) unless already initialized and returns a communicator
// over all ranks of the job (a duplicate of MPI_COMM_WORLD). argc/argv may be null.
Result<std::unique_ptr<Communicator>> mpi_init_world(int* argc, char*** argv);

// Frees the backend's MPI objects and calls MPI_Finalize (if this process initialized MPI
// through mpi_init_world). Destroy all communicators first.
Status mpi_finalize();

// Ends the whole job: prints message (if not empty) to stderr on this rank, then MPI_Abort.
[[noreturn]] void mpi_abort(int code, std::string_view message);

// Whether MPI is initialized and not yet finalized.
bool mpi_active();

}  // namespace treeattn

namespace treeattn {

// Wraps an existing MPI communicator (given as its Fortran handle, MPI_Comm_c2f) that the
// caller keeps alive; MPI must be initialized (e.g. by mpi4py). The result duplicates it.
Result<std::unique_ptr<Communicator>> mpi_wrap_fortran(int64_t fortran_handle);

}  // namespace treeattn
