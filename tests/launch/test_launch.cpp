// treeattn_launch (include/treeattn/launch.hpp, job_status.hpp): the mpirun command line for
// given options and environment, the local rank cap, temporary files, child exit codes, and the
// per-rank status files written by real (forked) ranks that return, exit, crash or are killed,
// read back and turned into the lines that name them.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "treeattn/job_status.hpp"
#include "treeattn/launch.hpp"

namespace treeattn::launch {
namespace {

using Args = std::vector<std::string>;

// Sets (or with nullptr unsets) an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
      had_ = true;
    }
    if (value != nullptr) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

Args plain_mpirun_flags(const std::string& mpirun, int ranks) {
  Args cmd = {mpirun, "-np", std::to_string(ranks)};
  if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
  cmd.insert(cmd.end(),
             {"--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"});
  return cmd;
}

TEST(Launch, SelfExeIsThisTestProgram) {
  EXPECT_EQ(std::filesystem::path(self_exe()).filename(), "test_launch");
  EXPECT_TRUE(std::filesystem::path(self_exe()).is_absolute());
}

TEST(Launch, PlainMpirunCommand) {
  ScopedEnv mpirun("TREEATTN_MPIRUN", nullptr), extra("TREEATTN_MPIRUN_ARGS", nullptr);
  LaunchOptions o;
  o.ranks = 4;
  Args want = plain_mpirun_flags("mpirun", 4);
  want.insert(want.end(), {self_exe(), "bench", "--seq", "64k"});
  EXPECT_EQ(mpirun_command(o, {"bench", "--seq", "64k"}), want);
}

TEST(Launch, MpirunCommandWithEnvironmentMonitoringAndExtraArgs) {
  ScopedEnv mpirun("TREEATTN_MPIRUN", "/opt/ompi/bin/mpirun");
  ScopedEnv extra("TREEATTN_MPIRUN_ARGS", "  --host a,b   -x FOO ");
  LaunchOptions o;
  o.ranks = 12;
  o.monitoring = true;
  o.mpirun_args = {"--tag-output"};
  Args want = plain_mpirun_flags("/opt/ompi/bin/mpirun", 12);
  want.insert(want.end(), {"--mca", "pml_monitoring_enable", "1", "--host", "a,b", "-x", "FOO",
                           "--tag-output", self_exe(), "verify"});
  EXPECT_EQ(mpirun_command(o, {"verify"}), want);
}

TEST(Launch, SessionPrefixReplacesMpirunAndItsMachineFlags) {
  ScopedEnv mpirun("TREEATTN_MPIRUN", "/never/used"), extra("TREEATTN_MPIRUN_ARGS", nullptr);
  LaunchOptions o;
  o.ranks = 2;
  o.session_prefix = {"tools/cluster/cluster.sh", "session", "2", "--slots", "1", "--"};
  const Args want = {"tools/cluster/cluster.sh", "session", "2", "--slots", "1", "--",
                     "-np", "2", self_exe(), "topo", "--detect"};
  EXPECT_EQ(mpirun_command(o, {"topo", "--detect"}), want);
}

TEST(Launch, HostsNamedOnlyByHostFlags) {
  {
    ScopedEnv extra("TREEATTN_MPIRUN_ARGS", nullptr);
    EXPECT_FALSE(launch_names_hosts());
  }
  {
    ScopedEnv extra("TREEATTN_MPIRUN_ARGS", "-x FOO --mca btl tcp,self");
    EXPECT_FALSE(launch_names_hosts());
  }
  for (const char* flag : {"--host", "-H", "--hostfile", "-machinefile", "--default-hostfile"}) {
    const std::string args = std::string("-x FOO ") + flag + " hosts.txt";
    ScopedEnv extra("TREEATTN_MPIRUN_ARGS", args.c_str());
    EXPECT_TRUE(launch_names_hosts()) << flag;
  }
}

TEST(Launch, LauncherEnvironment) {
  ScopedEnv a("OMPI_COMM_WORLD_SIZE", nullptr), b("PMIX_RANK", nullptr), c("PMI_RANK", nullptr),
      d("PMI_SIZE", nullptr), e("MPI_LOCALNRANKS", nullptr);
  EXPECT_FALSE(started_by_mpi_launcher());
  EXPECT_EQ(launcher_world_size(), 0);
  {
    ScopedEnv s("PMI_SIZE", "6");
    EXPECT_TRUE(started_by_mpi_launcher());
    EXPECT_EQ(launcher_world_size(), 6);
    ScopedEnv o("OMPI_COMM_WORLD_SIZE", "3");  // Open MPI's variable first
    EXPECT_EQ(launcher_world_size(), 3);
  }
  ScopedEnv r("PMIX_RANK", "0");  // a rank without a size
  EXPECT_TRUE(started_by_mpi_launcher());
  EXPECT_EQ(launcher_world_size(), 0);
}

TEST(Launch, LocalRankCap) {
  ScopedEnv extra("TREEATTN_MPIRUN_ARGS", nullptr), cap("TREEATTN_MAX_LOCAL_RANKS", "3");
  LaunchOptions o;
  o.ranks = 3;
  EXPECT_TRUE(check_local_rank_count(o, "--ranks").is_ok());
  o.ranks = 4;
  const Status s = check_local_rank_count(o, "--ranks");
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.to_string().find("--ranks 4: more local ranks than $TREEATTN_MAX_LOCAL_RANKS, 3:"),
            std::string::npos)
      << s.to_string();
  // Ranks on named hosts are not this machine's: no cap.
  ScopedEnv hosts("TREEATTN_MPIRUN_ARGS", "--hostfile h.txt");
  o.ranks = 100000;
  EXPECT_TRUE(check_local_rank_count(o, "--ranks").is_ok());
}

TEST(Launch, TempFilesAndTheSweepOfDeadProcesses) {
  const std::string mine = make_temp_file("points");
  ASSERT_FALSE(mine.empty());
  EXPECT_EQ(mine.rfind("/tmp/treeattn-points-" + std::to_string(getpid()) + "-", 0), 0u) << mine;
  EXPECT_TRUE(std::filesystem::is_regular_file(mine));
  EXPECT_EQ(std::filesystem::file_size(mine), 0u);
  // A pid that no longer exists: a child that has exited and been reaped.
  const pid_t dead = fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) _exit(0);
  ASSERT_EQ(waitpid(dead, nullptr, 0), dead);
  const std::string stale = "/tmp/treeattn-plot-" + std::to_string(dead) + "-abc123";
  const std::string not_ours = "/tmp/treeattn-other-" + std::to_string(dead) + "-abc123";
  std::ofstream(stale) << "x";
  std::ofstream(not_ours) << "x";
  remove_stale_temp_files();
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(mine));      // this process is alive
  EXPECT_TRUE(std::filesystem::exists(not_ours));  // not a kind of file of ours
  std::filesystem::remove(mine);
  std::filesystem::remove(not_ours);
}

TEST(Launch, ChildExitCodesAndSignals) {
  auto rc = run_child({"sh", "-c", "exit 3"});
  ASSERT_TRUE(rc.is_ok());
  EXPECT_EQ(*rc, 3);
  rc = run_child({"sh", "-c", "kill -KILL $$"});
  ASSERT_TRUE(rc.is_ok());
  EXPECT_EQ(*rc, 128 + SIGKILL);
  EXPECT_EQ(interrupted_by(), 0);
  // The child's stdin is /dev/null: `read` meets the end of input at once and fails.
  rc = run_child({"sh", "-c", "read x && exit 5; exit 4"});
  ASSERT_TRUE(rc.is_ok());
  EXPECT_EQ(*rc, 4);
}

TEST(Launch, StopSignalIsForwardedAndReported) {
  EXPECT_EQ(run_child({"true"}).value(), 0);
  EXPECT_EQ(report_interrupt("treeattn run", 4), 0);  // nothing interrupted the last run
  // The child sends SIGTERM to this process, which forwards it once to the child: the child
  // ends by it, and the run reports the interruption.
  auto rc = run_child({"sh", "-c", "kill -TERM $PPID; exec sleep 5"});
  ASSERT_TRUE(rc.is_ok());
  EXPECT_EQ(*rc, 128 + SIGTERM);
  EXPECT_EQ(interrupted_by(), SIGTERM);
  testing::internal::CaptureStderr();
  EXPECT_EQ(report_interrupt("treeattn run", 4), 128 + SIGTERM);
  EXPECT_EQ(report_interrupt("treeattn topo"), 128 + SIGTERM);
  EXPECT_EQ(testing::internal::GetCapturedStderr(),
            std::string("treeattn run: interrupted by signal 15 (") + strsignal(SIGTERM) +
                "); the 4-rank job was stopped\ntreeattn topo: interrupted by signal 15 (" +
                strsignal(SIGTERM) + "); the job was stopped\n");
}

// ---- status files --------------------------------------------------------------------------

// Forks a rank `rank` of a job with status directory dir, which runs body and then ends as body
// makes it; returns its pid after it has ended.
template <typename Body>
pid_t run_rank(const std::string& dir, int rank, Body body) {
  const pid_t pid = fork();
  if (pid == 0) {
    const rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    setenv("TREEATTN_STATUS_DIR", dir.c_str(), 1);
    setenv("OMPI_COMM_WORLD_RANK", std::to_string(rank).c_str(), 1);
    setenv("OMPI_MCA_ess_base_jobid", "305397760", 1);
    rank_status_open();
    body();
    _exit(99);  // body ends the process
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return pid;
}

TEST(JobStatus, RanksThatEndEachWayAreReadBackAndNamed) {
  char tmpl[] = "/tmp/treeattn-test-launch-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<pid_t> pids;
  pids.push_back(run_rank(dir, 0, [] {
    rank_status_phase("p=5 seq=64k batch=1: timed steps of tree");
    rank_status_step(3);
    rank_status_returned(1);
    _exit(1);
  }));
  pids.push_back(run_rank(dir, 1, [] {
    rank_status_phase("load");
    std::exit(7);  // a library's exit()
  }));
  pids.push_back(run_rank(dir, 2, [] {
    rank_status_phase("decode");
    rank_status_step(12);
    std::raise(SIGSEGV);
  }));
  pids.push_back(run_rank(dir, 3, [] {
    rank_status_phase("warm-up");
    kill(getpid(), SIGKILL);
  }));
  pids.push_back(run_rank(dir, 4, [] {
    rank_status_phase("merge");
    std::raise(SIGTERM);  // how mpirun stops the others: no line of ours
  }));
  pids.push_back(run_rank(dir, 5, [] {
    rank_status_phase(std::string(1000, 'a'));  // longer than the file's phase region
    std::exit(0);
  }));
  const std::vector<RankFate> fates = read_rank_status(dir);
  ASSERT_EQ(fates.size(), 6u);
  const char* states[] = {"returned", "exit", "signal", "running", "signal", "exit"};
  const int values[] = {1, 7, SIGSEGV, 0, SIGTERM, 0};
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(fates[r].rank, r);
    EXPECT_EQ(fates[r].pid, pids[r]);
    EXPECT_EQ(fates[r].job, 305397760ul);
    EXPECT_EQ(fates[r].state, states[r]) << "rank " << r;
    EXPECT_EQ(fates[r].value, values[r]) << "rank " << r;
  }
  EXPECT_EQ(fates[0].phase, "p=5 seq=64k batch=1: timed steps of tree, step 3");
  EXPECT_EQ(fates[1].phase, "load");
  EXPECT_EQ(fates[2].phase, "decode, step 12");
  EXPECT_EQ(fates[3].phase, "warm-up");
  EXPECT_EQ(fates[5].phase, std::string(383, 'a'));

  auto pid = [&](int r) { return std::to_string(pids[r]); };
  const std::vector<std::string> want = {
      "treeattn bench: rank 1 (pid " + pid(1) +
          ") exited with code 7 in load, outside treeattn's error handling: the message above "
          "it, if any, comes from a library (the OpenMP runtime, Open MPI)",
      "treeattn bench: rank 2 (pid " + pid(2) + ") crashed in decode, step 12: signal " +
          std::to_string(SIGSEGV) + " (" + strsignal(SIGSEGV) + ")",
      "treeattn bench: rank 3 (pid " + pid(3) +
          ") died without a message in warm-up: killed by a signal it cannot handle (SIGKILL: "
          "the OOM killer, a user or a scheduler)"};
  EXPECT_EQ(unexplained_ends(fates, "treeattn bench"), want);
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(read_rank_status(dir).empty());  // no directory: nothing, no error
}

TEST(JobStatus, RanksStillRunningWhenAnotherAborted) {
  std::vector<RankFate> fates(3);
  for (int r = 0; r < 3; ++r) fates[r] = {r, 100 + r, 0, "running", 0, "decode, step 2"};
  fates[1].state = "aborted";
  fates[1].value = 3;
  const std::string stopped = " was stopped in decode, step 2 when rank 1 ended the job "
                              "(MPI_Abort, after its error above)";
  EXPECT_EQ(unexplained_ends(fates, "treeattn"),
            (std::vector<std::string>{"treeattn: rank 0 (pid 100)" + stopped,
                                      "treeattn: rank 2 (pid 102)" + stopped}));
  // Rank 2 was seen gone before the abort: it died on its own.
  EXPECT_EQ(unexplained_ends(fates, "treeattn", {2}),
            (std::vector<std::string>{
                "treeattn: rank 0 (pid 100)" + stopped,
                "treeattn: rank 2 (pid 102) died without a message in decode, step 2: killed by "
                "a signal it cannot handle (SIGKILL: the OOM killer, a user or a scheduler)"}));
  // Everyone returned: nothing to add to treeattn's own messages.
  for (auto& f : fates) f.state = "returned";
  EXPECT_TRUE(unexplained_ends(fates, "treeattn").empty());
}

TEST(JobStatus, NothingWithoutTheLaunchersDirectory) {
  // Not under our launcher: the rank side does nothing (and must not fail).
  const pid_t pid = fork();
  if (pid == 0) {
    unsetenv("TREEATTN_STATUS_DIR");
    setenv("OMPI_COMM_WORLD_RANK", "0", 1);
    rank_status_open();
    rank_status_phase("x");
    rank_status_step(1);
    rank_status_returned(0);
    _exit(0);
  }
  int status = -1;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

}  // namespace
}  // namespace treeattn::launch
