// Per-rank status files of a launched job (see include/treeattn/job_status.hpp).
#include "treeattn/job_status.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "treeattn/comm_mpi.hpp"

namespace treeattn::launch {
namespace {

// The file: three fixed regions, each padded with spaces and ended by '\n', rewritten in place.
constexpr off_t kHeaderAt = 0, kStateAt = 64, kPhaseAt = 128;
constexpr std::size_t kHeaderWidth = 64, kStateWidth = 64, kPhaseWidth = 384;

int g_fd = -1;
volatile std::sig_atomic_t g_final = 0;  // a final state has been written
std::string g_phase;

// Async-signal-safe: decimal digits of v into p, returns the length.
std::size_t put_long(char* p, long v) {
  char tmp[24];
  std::size_t n = 0;
  const bool neg = v < 0;
  unsigned long u = neg ? 0ul - static_cast<unsigned long>(v) : static_cast<unsigned long>(v);
  do {
    tmp[n++] = static_cast<char>('0' + u % 10);
    u /= 10;
  } while (u != 0);
  std::size_t k = 0;
  if (neg) p[k++] = '-';
  while (n > 0) p[k++] = tmp[--n];
  return k;
}

// Async-signal-safe: text (n bytes) padded to width, ending in '\n', at offset at.
void write_region(off_t at, std::size_t width, const char* text, std::size_t n) {
  if (g_fd < 0) return;
  char buf[kPhaseWidth];
  n = std::min(n, width - 1);
  std::memcpy(buf, text, n);
  std::memset(buf + n, ' ', width - 1 - n);
  buf[width - 1] = '\n';
  ssize_t ignored = pwrite(g_fd, buf, width, at);
  (void)ignored;
}

// Async-signal-safe: "word N" as the state.
void write_state(const char* word, long value, bool with_value) {
  char buf[kStateWidth];
  std::size_t n = std::strlen(word);
  std::memcpy(buf, word, n);
  if (with_value) {
    buf[n++] = ' ';
    n += put_long(buf + n, value);
  }
  write_region(kStateAt, kStateWidth, buf, n);
}

void on_stop_signal(int sig) {
  if (!g_final) {
    g_final = 1;
    write_state("signal", sig, true);
  }
  // SA_RESETHAND restored the default action: die by the same signal once this returns.
  std::raise(sig);
}

// A crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT): record it, then let the handler that was
// there before (Open MPI's backtrace printer, or the default action) take the signal: it is
// re-raised with that handler restored and delivered when this one returns.
constexpr int kCrashSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction g_crash_old[sizeof(kCrashSignals) / sizeof(int)];
bool g_crash_watched = false;

void on_crash_signal(int sig) {
  if (!g_final) {
    g_final = 1;
    write_state("signal", sig, true);
  }
  for (std::size_t i = 0; i < sizeof(kCrashSignals) / sizeof(int); ++i)
    if (kCrashSignals[i] == sig) sigaction(sig, &g_crash_old[i], nullptr);
  std::raise(sig);
}

// After MPI_Init (the first phase comes after it), so that Open MPI's own handlers, installed
// there only where none is, stay in place behind ours.
void watch_crashes() {
  if (g_crash_watched) return;
  g_crash_watched = true;
  struct sigaction sa {};
  sa.sa_handler = on_crash_signal;
  sigemptyset(&sa.sa_mask);
  for (std::size_t i = 0; i < sizeof(kCrashSignals) / sizeof(int); ++i)
    sigaction(kCrashSignals[i], &sa, &g_crash_old[i]);
}

void on_process_exit(int status, void*) {
  if (g_final) return;
  g_final = 1;
  write_state("exit", status, true);
}

int rank_from_env() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return std::atoi(v);
  return -1;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n')) s.pop_back();
  return s;
}

}  // namespace

void rank_status_open() {
  const char* dir = std::getenv("TREEATTN_STATUS_DIR");
  const int rank = rank_from_env();
  if (dir == nullptr || *dir == '\0' || rank < 0 || g_fd >= 0) return;
  const std::string path = std::string(dir) + "/rank-" + std::to_string(rank);
  g_fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (g_fd < 0) return;  // best effort: the job runs without it
  std::string header = "rank " + std::to_string(rank) + " pid " + std::to_string(getpid());
  // Open MPI's job id names the job's shared-memory segments (launcher.cpp sweeps those of
  // jobs that died without removing them).
  if (const char* job = std::getenv("OMPI_MCA_ess_base_jobid"); job != nullptr && *job != '\0')
    header += std::string(" job ") + job;
  write_region(kHeaderAt, kHeaderWidth, header.data(), header.size());
  write_state("running", 0, false);
  rank_status_phase("start-up");
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaction(sig, &sa, nullptr);
  on_exit(on_process_exit, nullptr);
}

void rank_status_phase(std::string_view what) {
  if (g_fd < 0) return;
  watch_crashes();
  g_phase.assign(what);
  write_region(kPhaseAt, kPhaseWidth, g_phase.data(), g_phase.size());
}

void rank_status_step(int64_t step) {
  if (g_fd < 0) return;
  const std::string text = g_phase + ", step " + std::to_string(step);
  write_region(kPhaseAt, kPhaseWidth, text.data(), text.size());
}

void rank_status_returned(int code) {
  if (g_fd < 0 || g_final) return;
  g_final = 1;
  write_state("returned", code, true);
}

void abort_job(int code, std::string_view message) {
  if (g_fd >= 0 && !g_final) {
    g_final = 1;
    write_state("aborted", code, true);
  }
  mpi_abort(code, message);
}

std::vector<RankFate> read_rank_status(const std::string& dir) {
  std::vector<RankFate> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = readdir(d)) {
    if (std::strncmp(e->d_name, "rank-", 5) != 0) continue;
    std::ifstream in(dir + "/" + e->d_name, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.size() < kPhaseAt + 1) continue;
    RankFate f;
    if (std::sscanf(text.c_str(), "rank %d pid %ld job %lu", &f.rank, &f.pid, &f.job) < 2)
      continue;
    std::istringstream state(trim(text.substr(kStateAt, kStateWidth)));
    state >> f.state >> f.value;
    f.phase = trim(text.substr(kPhaseAt, kPhaseWidth));
    out.push_back(f);
  }
  closedir(d);
  std::sort(out.begin(), out.end(), [](const RankFate& a, const RankFate& b) { return a.rank < b.rank; });
  return out;
}

bool is_crash_signal(int sig) {
  return sig == SIGSEGV || sig == SIGBUS || sig == SIGFPE || sig == SIGILL || sig == SIGABRT;
}

std::vector<std::string> unexplained_ends(const std::vector<RankFate>& fates,
                                          const std::string& who,
                                          const std::vector<int>& died_before_abort) {
  // The first rank that ended the job on purpose (MPI_Abort after printing why).
  const RankFate* aborter = nullptr;
  for (const RankFate& f : fates)
    if (f.state == "aborted" && aborter == nullptr) aborter = &f;
  std::vector<std::string> lines;
  for (const RankFate& f : fates) {
    const std::string rank = "rank " + std::to_string(f.rank) + " (pid " + std::to_string(f.pid) + ")";
    const bool died_first = std::find(died_before_abort.begin(), died_before_abort.end(),
                                      f.rank) != died_before_abort.end();
    if (f.state == "running" && aborter != nullptr && !died_first)
      lines.push_back(who + ": " + rank + " was stopped in " + f.phase + " when rank " +
                      std::to_string(aborter->rank) +
                      " ended the job (MPI_Abort, after its error above)");
    else if (f.state == "running")
      lines.push_back(who + ": " + rank + " died without a message in " + f.phase +
                      ": killed by a signal it cannot handle (SIGKILL: the OOM killer, a user or "
                      "a scheduler)");
    else if (f.state == "signal" && is_crash_signal(f.value))
      lines.push_back(who + ": " + rank + " crashed in " + f.phase + ": signal " +
                      std::to_string(f.value) + " (" + strsignal(f.value) + ")");
    else if (f.state == "exit" && f.value != 0)
      lines.push_back(who + ": " + rank + " exited with code " + std::to_string(f.value) + " in " +
                      f.phase + ", outside treeattn's error handling: the message above it, if "
                      "any, comes from a library (the OpenMP runtime, Open MPI)");
  }
  return lines;
}

}  // namespace treeattn::launch
