// Starting ranks: from a plain shell `--ranks P` re-executes this program under mpirun with the
// flags this kind of machine needs; under an existing mpirun/srun the job's world is used.
#pragma once

#include <string>
#include <vector>

#include "treeattn/status.hpp"

namespace treeattn::cli {

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
  // When set (cluster.hpp: `cluster.sh session K --slots R ... --`), the job runs through this
  // prefix instead of plain mpirun; the prefix supplies the machine flags itself.
  std::vector<std::string> session_prefix;
};

// The command line that would be run (for messages and --dry-run).
std::vector<std::string> mpirun_command(const LaunchOptions& options,
                                        const std::vector<std::string>& program_args);

// Runs this executable with program_args under mpirun with options.ranks ranks and waits.
// Returns the child's exit code (128 + signal when it was killed).
Result<int> run_under_mpirun(const LaunchOptions& options,
                             const std::vector<std::string>& program_args);

}  // namespace treeattn::cli
