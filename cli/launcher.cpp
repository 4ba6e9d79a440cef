// Re-execution under mpirun (see launcher.hpp).
#include "launcher.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace treeattn::cli {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

}  // namespace

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "treeattn";
  buf[n] = '\0';
  return buf;
}

bool started_by_mpi_launcher() {
  return env("OMPI_COMM_WORLD_SIZE") || env("PMIX_RANK") || env("PMI_RANK") ||
         env("PMI_SIZE") || env("MPI_LOCALNRANKS");
}

int launcher_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = env(name)) return std::atoi(v);
  return 0;
}

std::vector<std::string> mpirun_command(const LaunchOptions& options,
                                        const std::vector<std::string>& program_args) {
  std::vector<std::string> cmd;
  if (!options.session_prefix.empty()) {
    // The emulated cluster's session adds the machine flags (cluster.sh run).
    cmd = options.session_prefix;
    cmd.insert(cmd.end(), {"-np", std::to_string(options.ranks)});
  } else {
    cmd.push_back(env("TREEATTN_MPIRUN") ? env("TREEATTN_MPIRUN") : "mpirun");
    cmd.insert(cmd.end(), {"-np", std::to_string(options.ranks)});
    if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
    // More ranks than cores is the normal case on a small machine: let them share cores and
    // yield when idle instead of spinning, and do not pin every rank to core 0.
    cmd.insert(cmd.end(), {"--oversubscribe", "--bind-to", "none", "--mca",
                           "mpi_yield_when_idle", "1"});
  }
  if (options.monitoring)
    cmd.insert(cmd.end(), {"--mca", "pml_monitoring_enable", "1"});
  if (const char* extra = env("TREEATTN_MPIRUN_ARGS")) {
    std::istringstream ss(extra);
    std::string a;
    while (ss >> a) cmd.push_back(a);
  }
  cmd.insert(cmd.end(), options.mpirun_args.begin(), options.mpirun_args.end());
  cmd.push_back(self_exe());
  cmd.insert(cmd.end(), program_args.begin(), program_args.end());
  return cmd;
}

Result<int> run_under_mpirun(const LaunchOptions& options,
                             const std::vector<std::string>& program_args) {
  const std::vector<std::string> cmd = mpirun_command(options, program_args);
  std::vector<char*> argv;
  for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return internal_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    setenv("TREEATTN_LAUNCHED", "1", 1);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "treeattn: cannot run %s: %s (is Open MPI installed? apt-get install "
                 "openmpi-bin)\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return internal_error(std::string("waitpid failed: ") + std::strerror(errno));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace treeattn::cli
