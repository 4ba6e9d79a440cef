// What each rank of a job this command launched is doing, kept where the launcher can read it
// after the job ends, so that a rank that dies without a message of its own (SIGKILL, the OOM
// killer, a crash, a library that calls exit()) is named by our own line, with the step it was
// in, instead of only by mpirun's text.
//
// The launcher (launcher.cpp) makes a directory and passes it to the ranks in
// $TREEATTN_STATUS_DIR; each rank keeps one small file there, rank-R, rewritten in place: its pid,
// its state and its phase ("p=4 seq=64k batch=1: timed steps of tree, ring-kv, step 3"). States:
//
//   running      the rank has not ended (if the job is over: it died without running any code)
//   returned C   treeattn's own code returned C, having printed its message
//   aborted      treeattn ended the job with MPI_Abort after printing why
//   signal S     ended by SIGTERM, SIGINT or SIGHUP (how mpirun stops the other ranks of a job)
//   exit C       exit(C) called outside treeattn's error handling (the OpenMP runtime, Open MPI)
//
// Writing a state costs one pwrite of a few hundred bytes; nothing here allocates in a signal
// handler.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace treeattn::cli {

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
  std::string state;  // "running", "returned", "aborted", "signal", "exit"
  int value = 0;      // the code or the signal
  std::string phase;
};

// Every rank file in dir (sorted by rank); files that cannot be parsed are skipped.
std::vector<RankFate> read_rank_status(const std::string& dir);
// One line per rank that ended without a message of treeattn's own: still `running` (died by
// SIGKILL or a crash) or `exit C` with C != 0. `who` prefixes each line ("treeattn bench").
std::vector<std::string> unexplained_ends(const std::vector<RankFate>& fates, const std::string& who);

}  // namespace treeattn::cli
