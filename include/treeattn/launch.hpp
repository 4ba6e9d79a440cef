// Starting ranks (treeattn_launch, src/launch): from a plain shell `--ranks P` re-executes this
// program under mpirun with the flags this kind of machine needs; under an existing mpirun/srun
// the job's world is used. What each rank is doing, and which one died how: job_status.hpp.
#pragma once

#include <chrono>

#include <functional>
#include <string>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/status.hpp"

namespace treeattn::launch {

// Absolute path of this executable (for re-execution).
std::string self_exe();

// True when this process was started by an MPI launcher (mpirun, mpiexec, srun with PMI/PMIx).
bool started_by_mpi_launcher();
// The world size the launcher announced, or 0 if none.
int launcher_world_size();

struct LaunchOptions {
  int ranks = 1;
  // Extra mpirun arguments (also from $TREEATTN_MPIRUN_ARGS, split on spaces).
  std::vector<std::string> mpirun_args;
  // Set when Open MPI's monitoring component should count what collectives really moved.
  bool monitoring = false;
  // When set (the CLI's cluster.hpp: `cluster.sh session K --slots R ... --`), the job runs
  // through this prefix instead of plain mpirun; the prefix supplies the machine flags itself.
  std::vector<std::string> session_prefix;
  // Prefix of our own lines about the job ("treeattn bench").
  std::string who = "treeattn";
};

// The command line that would be run (for messages and --dry-run).
std::vector<std::string> mpirun_command(const LaunchOptions& options,
                                        const std::vector<std::string>& program_args);

// Whether $TREEATTN_MPIRUN_ARGS names hosts (--host, --hostfile, ...): the ranks may then run
// on other machines, and what this one has (cores, memory, GPUs) says nothing about theirs.
bool launch_names_hosts();

// Local launches (mpirun on this machine, the emulated cluster included) are capped at
// max(64, 16 x cores) ranks, and at what MemAvailable holds at ~48 MiB per rank (Open MPI's
// per-process baseline here); $TREEATTN_MAX_LOCAL_RANKS overrides the cap. Beyond it a run
// measures the scheduler, not the algorithm (every decode step waits until every rank has had
// a core), start-up alone takes minutes, and Open MPI runs out of file descriptors and shared
// memory somewhere past a thousand local processes. Above 4 ranks per core a warning is
// printed. Launches that name hosts ($TREEATTN_MPIRUN_ARGS with --host/--hostfile) are not
// capped. `flag` names the option in the message.
Status check_local_rank_count(const LaunchOptions& options, const std::string& flag);

// Runs this executable with program_args under mpirun with options.ranks ranks and waits.
// Returns the child's exit code (128 + signal when it was killed).
//
// mpirun runs in its own process group with stdin from /dev/null, and dies with us
// (PR_SET_PDEATHSIG). SIGINT, SIGTERM and SIGHUP that reach this process are forwarded to it
// once (mpirun then stops its ranks); if the job has not ended 10 s later, mpirun and every
// rank are killed. Afterwards interrupted_by() is the signal (0 when none came) and the caller
// removes its temporary files and exits with 128 + that signal. When the job fails, a line of
// our own names each rank that ended without a message of treeattn's (treeattn/job_status.hpp).
Result<int> run_under_mpirun(const LaunchOptions& options,
                             const std::vector<std::string>& program_args);

// The same signal handling for any child command (cmd[0] is looked up in PATH).
Result<int> run_child(const std::vector<std::string>& cmd);

// The signal that interrupted the last run_under_mpirun / run_child, or 0.
int interrupted_by();
// When one did: prints "WHO: interrupted by signal S (NAME); the P-rank job was stopped" ("the
// job" when ranks is 0) on stderr and returns the exit code 128 + S; returns 0 otherwise.
int report_interrupt(const std::string& who, int ranks = 0);

// A new empty temporary file /tmp/treeattn-WHAT-PID-XXXXXX (its path, or "" on failure). The
// pid in the name lets a later run remove what a SIGKILLed run could not:
// run_under_mpirun first removes such files and /tmp/treeattn-job-PID-* directories of
// processes that no longer exist.
std::string make_temp_file(const std::string& what);
void remove_stale_temp_files();

// A job's status directory, /tmp/treeattn-job-PID-XXXXXX (after remove_stale_temp_files): its
// ranks record their pid and state there when $TREEATTN_STATUS_DIR names it. "" on failure.
std::string make_job_status_dir();
// After the job's mpirun has ended: when it was SIGKILLed (its ranks orphaned), ends the ranks
// (SIGTERM and up to `grace` for them to go, when grace > 0; then SIGKILL); then removes the
// job's Open MPI shared-memory segments and the directory.
void clean_up_job(const std::string& status_dir, bool mpirun_killed,
                  std::chrono::milliseconds grace);

// A command over a model file with --ranks P (generate, serve). Under an MPI launcher: every rank
// checks the flags (preflight, told whether it is rank 0), --ranks when given must be the job's
// size, all ranks go on or none (rank 0 says why), then job(comm, model path) on each. From a
// plain shell: preflight once, then job() here for one rank, else launch(model path), which
// starts the ranks. The exit code; refusals are 2 ("treeattn CMD: error: ...").
int run_model_command(const char* cmd, int ranks, bool ranks_given,
                      const std::function<Result<std::string>(bool lead)>& preflight,
                      const std::function<int(Communicator&, const std::string&)>& job,
                      const std::function<int(const std::string&)>& launch);

}  // namespace treeattn::launch
