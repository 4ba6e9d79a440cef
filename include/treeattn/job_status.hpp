// What each rank of a job this command launched is doing, kept where the launcher can read it
// after the job ends, so that a rank that dies without a message of its own (SIGKILL, the OOM
// killer, a crash, a library that calls exit()) is named by our own line, with the step it was
// in, instead of only by mpirun's text.
//
// The launcher (src/launch/launcher.cpp) makes a directory and passes it to the ranks in
// $TREEATTN_STATUS_DIR; each rank keeps one small file there, rank-R, rewritten in place: its pid,
// its state and its phase ("p=4 seq=64k batch=1: timed steps of tree, ring-kv, step 3"). States:
//
//   running      the rank has not ended (if the job is over: it died without running any code)
//   returned C   treeattn's own code returned C, having printed its message
//   aborted      treeattn ended the job with MPI_Abort after printing why
//   signal S     ended by SIGTERM, SIGINT or SIGHUP (how mpirun stops the other ranks of a job),
//                or crashed with SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT (recorded from the
//                first phase on, after MPI_Init)
//   exit C       exit(C) called outside treeattn's error handling (the OpenMP runtime, Open MPI)
//
// Writing a state costs one pwrite of a few hundred bytes; nothing here allocates in a signal
// handler.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace treeattn::launch {

// ---- rank side -------------------------------------------------------------------------------

// Opens this rank's file when running under our launcher ($TREEATTN_STATUS_DIR and a rank from
// the MPI launcher's environment); does nothing otherwise. Call once, first thing in main().
void rank_status_open();
// The current phase; rank_status_step appends ", step N" to it.
void rank_status_phase(std::string_view what);
void rank_status_step(int64_t step);
// main() returns `code` (treeattn printed whatever went wrong).
void rank_status_returned(int code);
// Ends the job through MPI_Abort (mpi_abort), recording first that this rank did it on purpose.
[[noreturn]] void abort_job(int code, std::string_view message);

// ---- launcher side ---------------------------------------------------------------------------

struct RankFate {
  int rank = -1;
  long pid = 0;
  unsigned long job = 0;  // Open MPI's job id (0: not under Open MPI)
  std::string state;  // "running", "returned", "aborted", "signal", "exit"
  int value = 0;      // the code or the signal
  std::string phase;
};

// Every rank file in dir (sorted by rank); files that cannot be parsed are skipped.
std::vector<RankFate> read_rank_status(const std::string& dir);
// One line per rank that ended without a message of treeattn's own, saying how:
//   `signal S` for a crash signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT): that signal;
//   still `running` while another rank ended the job through MPI_Abort: stopped by that abort
//     (Open MPI ends the other ranks then), unless the launcher saw it gone before the abort
//     (its rank in died_before_abort);
//   still `running` otherwise: SIGKILL (the one signal it cannot record: the OOM killer, a
//     user, a scheduler);
//   `exit C` with C != 0: a library's exit().
// `who` prefixes each line ("treeattn bench").
std::vector<std::string> unexplained_ends(const std::vector<RankFate>& fates, const std::string& who,
                                          const std::vector<int>& died_before_abort = {});

}  // namespace treeattn::launch
