// Re-execution under mpirun (see include/treeattn/launch.hpp).
#include "treeattn/launch.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "treeattn/job_status.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/measure.hpp"

namespace treeattn::launch {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

// A refusal of run_model_command: "treeattn CMD: error: WHY", exit code 2.
int fail(const char* cmd, const Status& s) {
  std::fprintf(stderr, "treeattn %s: error: %s\n", cmd, s.to_string().c_str());
  return 2;
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

bool launch_names_hosts() {
  if (const char* extra = env("TREEATTN_MPIRUN_ARGS")) {
    std::istringstream ss(extra);
    std::string a;
    while (ss >> a)
      if (a == "--host" || a == "-H" || a == "-host" || a == "--hostfile" || a == "-hostfile" ||
          a == "--machinefile" || a == "-machinefile" || a == "--default-hostfile")
        return true;
  }
  return false;
}

Status check_local_rank_count(const LaunchOptions& options, const std::string& flag) {
  if (launch_names_hosts()) return Status::ok();  // the ranks run elsewhere
  const long cores = std::max(1l, sysconf(_SC_NPROCESSORS_ONLN));
  long cap = std::max(64l, 16 * cores);
  const auto avail = static_cast<double>(mem_available_bytes());
  constexpr double kPerRank = 48.0 * 1024 * 1024;
  if (avail > 0) cap = std::min(cap, std::max(1l, static_cast<long>(avail / kPerRank)));
  std::string why = "this machine's cap (max(64, 16 x " + std::to_string(cores) +
                    " cores), and ~48 MiB per rank of the memory available)";
  if (const char* v = env("TREEATTN_MAX_LOCAL_RANKS")) {
    cap = std::atol(v);
    why = "$TREEATTN_MAX_LOCAL_RANKS";
  }
  if (options.ranks > cap)
    return invalid_argument(
        flag + " " + std::to_string(options.ranks) + ": more local ranks than " + why + ", " +
        std::to_string(cap) +
        ": beyond it a run measures the scheduler rather than the algorithm and Open MPI runs "
        "out of descriptors and shared memory (set TREEATTN_MAX_LOCAL_RANKS to override, or "
        "run under your own mpirun with a hostfile)");
  static int warned_for = 0;  // once per rank count, however often it is checked
  if (options.ranks > 4 * cores && warned_for != options.ranks && (warned_for = options.ranks))
    std::fprintf(stderr,
                 "treeattn: warning: %d ranks on %ld cores: every decode step waits until each "
                 "rank has had a core, so timings show the oversubscription (results stay exact)\n",
                 options.ranks, cores);
  return Status::ok();
}

namespace {

volatile std::sig_atomic_t g_child = 0;      // pid being waited for
volatile std::sig_atomic_t g_signal = 0;     // first signal received
volatile std::sig_atomic_t g_forwarded = 0;  // forwarded to the child already
int g_last_interrupt = 0;
int g_child_signal = 0;  // the signal that ended the last child (mpirun), or 0

void forward_signal(int sig) {
  if (g_signal == 0) g_signal = sig;
  if (g_child > 0 && !g_forwarded) {
    g_forwarded = 1;
    kill(static_cast<pid_t>(g_child), sig);
  }
}

// Kills every rank recorded in the job's status files that is still this executable.
void kill_ranks(const std::string& status_dir) {
  if (status_dir.empty()) return;
  const std::string exe = self_exe();
  for (const RankFate& f : read_rank_status(status_dir)) {
    if (f.pid <= 0) continue;
    char buf[PATH_MAX];
    const std::string link = "/proc/" + std::to_string(f.pid) + "/exe";
    const ssize_t n = readlink(link.c_str(), buf, sizeof(buf) - 1);
    if (n <= 0) continue;
    buf[n] = '\0';
    if (exe == buf) kill(static_cast<pid_t>(f.pid), SIGKILL);
  }
}

// Forks cmd with the extra environment, forwards stop signals, waits (see treeattn/launch.hpp).
// poll, when set, is called about every 50 ms while the child runs.
Result<int> run_forwarding(const std::vector<std::string>& cmd,
                           const std::vector<std::pair<std::string, std::string>>& extra_env,
                           const std::string& status_dir,
                           const std::function<void()>& poll = {}) {
  std::vector<char*> argv;
  for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  g_signal = 0;
  g_forwarded = 0;
  g_child = 0;
  g_last_interrupt = 0;
  struct sigaction sa {}, old[3];
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: waitpid returns EINTR and the grace period starts
  const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; ++i) sigaction(sigs[i], &sa, &old[i]);
  auto restore = [&] {
    for (int i = 0; i < 3; ++i) sigaction(sigs[i], &old[i], nullptr);
    g_child = 0;
  };
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    restore();
    return internal_error(std::string("fork failed: ") + std::strerror(errno));
  }
  if (pid == 0) {
    for (int i = 0; i < 3; ++i) sigaction(sigs[i], &old[i], nullptr);
    setpgid(0, 0);  // terminal signals reach us only; we forward them once
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(128 + SIGTERM);  // the parent died before prctl
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) {
      dup2(devnull, STDIN_FILENO);
      close(devnull);
    }
    for (const auto& [k, v] : extra_env) setenv(k.c_str(), v.c_str(), 1);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "treeattn: cannot run %s: %s (is Open MPI installed? apt-get install "
                 "openmpi-bin)\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  g_child = pid;
  if (g_signal != 0 && !g_forwarded) {  // a signal came between fork and here
    g_forwarded = 1;
    kill(pid, g_signal);
  }
  int status = 0;
  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> deadline;
  bool killed = false;
  for (;;) {
    const pid_t w = waitpid(pid, &status, deadline || poll ? WNOHANG : 0);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) {
      restore();
      return internal_error(std::string("waitpid failed: ") + std::strerror(errno));
    }
    if (g_signal != 0 && !deadline) deadline = Clock::now() + std::chrono::seconds(10);
    if (deadline && !killed && Clock::now() > *deadline) {
      std::fprintf(stderr, "treeattn: the job did not stop within 10 s of the signal: killing it\n");
      kill(pid, SIGKILL);
      kill_ranks(status_dir);
      killed = true;
    }
    if (deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (poll && !deadline) {
      poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  g_last_interrupt = g_signal;
  restore();
  if (killed) kill_ranks(status_dir);  // ranks orphaned by the SIGKILLed mpirun
  g_child_signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// Whether pid is a live process (not gone, not a zombie waiting for its parent).
bool process_alive(long pid) {
  if (pid <= 0 || (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM)) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  return paren == std::string::npos || paren + 2 >= text.size() || text[paren + 2] != 'Z';
}

void remove_dir(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
        unlink((dir + "/" + e->d_name).c_str());
    closedir(d);
  }
  rmdir(dir.c_str());
}

// Open MPI's shared-memory segments of the jobs recorded in status_dir whose ranks are all gone:
// /dev/shm/vader_segment.HOST.UID.JOB.LOCALRANK (JOB in hex). mpirun removes them when a job
// ends; a SIGKILLed mpirun leaves them (4 MiB per rank) until reboot.
void remove_job_segments(const std::string& status_dir) {
  std::vector<unsigned long> jobs;
  for (const RankFate& f : read_rank_status(status_dir)) {
    if (process_alive(f.pid)) return;  // still in use
    if (f.job != 0 && std::find(jobs.begin(), jobs.end(), f.job) == jobs.end())
      jobs.push_back(f.job);
  }
  if (jobs.empty()) return;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return;
  const std::string uid = "." + std::to_string(geteuid()) + ".";
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("vader_segment.", 0) != 0) continue;
    const auto last = name.rfind('.');
    const auto job_at = name.rfind('.', last - 1);
    if (job_at == std::string::npos || job_at < 14 ||
        name.compare(name.rfind('.', job_at - 1), uid.size(), uid) != 0)
      continue;
    const std::string hex = name.substr(job_at + 1, last - job_at - 1);
    char* end = nullptr;
    const unsigned long job = std::strtoul(hex.c_str(), &end, 16);
    if (hex.empty() || *end != '\0') continue;
    if (std::find(jobs.begin(), jobs.end(), job) != jobs.end())
      unlink(("/dev/shm/" + name).c_str());
  }
  closedir(d);
}

}  // namespace

int interrupted_by() { return g_last_interrupt; }

int report_interrupt(const std::string& who, int ranks) {
  const int sig = interrupted_by();
  if (sig == 0) return 0;
  const std::string job = ranks > 0 ? "the " + std::to_string(ranks) + "-rank job" : "the job";
  std::fprintf(stderr, "%s: interrupted by signal %d (%s); %s was stopped\n", who.c_str(), sig,
               strsignal(sig), job.c_str());
  return 128 + sig;
}

std::string make_temp_file(const std::string& what) {
  std::string tmpl = "/tmp/treeattn-" + what + "-" + std::to_string(getpid()) + "-XXXXXX";
  const int fd = mkstemp(tmpl.data());
  if (fd < 0) return "";
  close(fd);
  return tmpl;
}

void remove_stale_temp_files() {
  DIR* d = opendir("/tmp");
  if (d == nullptr) return;
  while (const dirent* e = readdir(d)) {
    // treeattn-WHAT-PID-XXXXXX, WHAT one of ours
    const std::string name = e->d_name;
    std::string what;
    for (const char* w : {"job", "points", "plot", "topo", "bench"})
      if (name.rfind(std::string("treeattn-") + w + "-", 0) == 0) what = w;
    if (what.empty()) continue;
    const std::string rest = name.substr(10 + what.size());
    const auto dash = rest.find('-');
    if (dash == std::string::npos || dash == 0 || rest.size() != dash + 7) continue;
    if (rest.find_first_not_of("0123456789") != dash) continue;
    const long pid = std::atol(rest.substr(0, dash).c_str());
    if (pid <= 0 || kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) continue;
    const std::string path = "/tmp/" + name;
    if (what == "job") remove_job_segments(path);
    if (what == "job") remove_dir(path);
    else unlink(path.c_str());
  }
  closedir(d);
}

Result<int> run_child(const std::vector<std::string>& cmd) { return run_forwarding(cmd, {}, ""); }

Result<int> run_under_mpirun(const LaunchOptions& options,
                             const std::vector<std::string>& program_args) {
  TREEATTN_RETURN_IF_ERROR(check_local_rank_count(options, "--ranks"));
  const std::vector<std::string> cmd = mpirun_command(options, program_args);
  const std::string dir = make_job_status_dir();
  std::vector<std::pair<std::string, std::string>> extra = {{"TREEATTN_LAUNCHED", "1"}};
  if (!dir.empty()) extra.emplace_back("TREEATTN_STATUS_DIR", dir);
  // Which ranks were gone before any rank ended the job through MPI_Abort: those died on their
  // own (SIGKILL, which leaves no record); a rank still `running` that went after the abort was
  // stopped by it. Watched while the job runs, about every 50 ms (every 0.5 s past 64 ranks:
  // each look reads every rank's file).
  std::vector<int> died_before_abort;
  bool abort_seen = false;
  int polls = 0;
  auto watch = [&] {
    if (abort_seen || (options.ranks > 64 && ++polls % 10 != 0)) return;
    const std::vector<RankFate> fates = read_rank_status(dir);
    for (const RankFate& f : fates) abort_seen = abort_seen || f.state == "aborted";
    if (abort_seen) return;  // gone in the same look as the abort: the abort's doing
    for (const RankFate& f : fates)
      if (f.state == "running" && !process_alive(f.pid) &&
          std::find(died_before_abort.begin(), died_before_abort.end(), f.rank) ==
              died_before_abort.end())
        died_before_abort.push_back(f.rank);
  };
  auto rc = run_forwarding(cmd, extra, dir, dir.empty() ? std::function<void()>() : watch);
  if (rc.is_ok() && g_child_signal != 0 && interrupted_by() == 0)
    std::fprintf(stderr, "%s: mpirun itself was killed by signal %d (%s)%s\n", options.who.c_str(),
                 g_child_signal, strsignal(g_child_signal),
                 g_child_signal == SIGKILL ? "; its ranks are ended and its shared memory removed"
                                           : "");
  if (rc.is_ok() && *rc != 0 && interrupted_by() == 0 && !dir.empty())
    for (const std::string& line :
         unexplained_ends(read_rank_status(dir), options.who, died_before_abort))
      std::fprintf(stderr, "%s\n", line.c_str());
  clean_up_job(dir, g_child_signal == SIGKILL, std::chrono::milliseconds(0));
  return rc;
}

std::string make_job_status_dir() {
  remove_stale_temp_files();
  std::string tmpl = "/tmp/treeattn-job-" + std::to_string(getpid()) + "-XXXXXX";
  return mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
}

void clean_up_job(const std::string& status_dir, bool mpirun_killed,
                  std::chrono::milliseconds grace) {
  if (status_dir.empty()) return;
  auto wait_gone = [&](std::chrono::milliseconds most) {
    const auto until = std::chrono::steady_clock::now() + most;
    while (std::chrono::steady_clock::now() < until) {
      bool any = false;
      for (const RankFate& f : read_rank_status(status_dir)) any = any || process_alive(f.pid);
      if (!any) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  // A SIGKILLed mpirun stops neither its ranks nor cleans up after them: end the ranks (SIGTERM
  // first when a grace is given, so that they can answer their clients), then remove the job's
  // shared-memory segments (nothing else will).
  if (mpirun_killed) {
    if (grace.count() > 0) {
      for (const RankFate& f : read_rank_status(status_dir))
        if (f.pid > 0 && process_alive(f.pid)) kill(static_cast<pid_t>(f.pid), SIGTERM);
      wait_gone(grace);
    }
    kill_ranks(status_dir);
    wait_gone(std::chrono::seconds(1));
  }
  remove_job_segments(status_dir);
  remove_dir(status_dir);
}

int run_model_command(const char* cmd, int ranks, bool ranks_given,
                      const std::function<Result<std::string>(bool lead)>& preflight,
                      const std::function<int(Communicator&, const std::string&)>& job,
                      const std::function<int(const std::string&)>& launch) {
  if (started_by_mpi_launcher()) {
    auto world = mpi_init_world(nullptr, nullptr);
    if (!world.is_ok()) return fail(cmd, world.status());
    int rc = 2;
    {
      std::unique_ptr<Communicator> comm = std::move(world).value();
      auto path = preflight(comm->rank() == 0);
      float bad = path.is_ok() ? 0.0f : 1.0f;
      if (path.is_ok() && ranks_given && ranks != comm->size()) {
        if (comm->rank() == 0)
          std::fprintf(stderr, "treeattn %s: error: --ranks %d but the MPI job has %d ranks\n",
                       cmd, ranks, comm->size());
        bad = 1.0f;
      }
      if (!comm->allreduce(&bad, 1, ReduceOp::kMax).is_ok() || bad != 0.0f) {
        if (comm->rank() == 0 && !path.is_ok()) fail(cmd, path.status());
      } else {
        rc = job(*comm, *path);
      }
    }
    (void)mpi_finalize();
    return rc;
  }
  auto path = preflight(true);
  if (!path.is_ok()) return fail(cmd, path.status());
  if (ranks > 1) return launch(*path);
  auto world = make_local_world(1);
  if (!world.is_ok()) return fail(cmd, world.status());
  return job(*world.value()[0], *path);
}

}  // namespace treeattn::launch
