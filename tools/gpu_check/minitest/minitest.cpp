// minitest's runner (gtest/gtest.h here): runs the registered tests in registration order, in
// this process or each in its own (--isolate), prints GoogleTest's lines, and with
// MINITEST_JSON=PATH rewrites {"tests": [{"name", "result": "passed" | "failed" | "skipped" |
// "not run", "message"}], "passed", "failed", "skipped", "not_run", "complete"} after every test
// ("complete": false until the last, so a run that dies leaves the verdicts it reached and names
// the tests it did not).
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace minitest {
namespace {

struct Entry {
  std::string name;
  Factory make;
};

std::vector<Entry>& registry() {
  static std::vector<Entry> r;
  return r;
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (c == '\n') {
      o += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      o += ' ';
    } else {
      o += c;
    }
  }
  return o + "\"";
}

// One test's verdict.
struct Verdict {
  std::string name;
  std::string result = "not run";  // passed, failed, skipped, not run
  std::string message;
};

// Rewrites MINITEST_JSON (when set) with every verdict so far.
void write_json(const std::vector<Verdict>& all, bool complete) {
  const char* path = std::getenv("MINITEST_JSON");
  if (!path || !*path) return;
  int passed = 0, failed = 0, skipped = 0, not_run = 0;
  std::string json = "{\"tests\": [";
  for (std::size_t i = 0; i < all.size(); ++i) {
    const Verdict& v = all[i];
    (v.result == "passed"    ? passed
     : v.result == "failed"  ? failed
     : v.result == "skipped" ? skipped
                             : not_run) += 1;
    json += std::string(i ? "," : "") + "\n  {\"name\": " + json_str(v.name) + ", \"result\": \"" +
            v.result + "\", \"message\": " + json_str(v.message) + "}";
  }
  json += "\n], \"passed\": " + std::to_string(passed) + ", \"failed\": " + std::to_string(failed) +
          ", \"skipped\": " + std::to_string(skipped) +
          ", \"not_run\": " + std::to_string(not_run) +
          ", \"complete\": " + (complete ? "true" : "false") + "}\n";
  const std::string tmp = std::string(path) + ".tmp";
  {
    std::ofstream f(tmp);
    f << json;
    if (!f) {
      std::fprintf(stderr, "minitest: cannot write %s\n", tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path) != 0)
    std::fprintf(stderr, "minitest: cannot write %s\n", path);
}

// Runs one registered test in this process and returns its verdict.
Verdict run_one(const Entry& e) {
  std::printf("[ RUN      ] %s\n", e.name.c_str());
  std::fflush(stdout);
  current() = Current{};
  e.make()->Run();
  const Current& c = current();
  Verdict v{e.name, c.failed ? "failed" : c.skipped ? "skipped" : "passed", c.messages};
  std::printf("%s %s\n",
              c.failed    ? "[  FAILED  ]"
              : c.skipped ? "[  SKIPPED ]"
                          : "[       OK ]",
              e.name.c_str());
  std::fflush(stdout);
  return v;
}

Counts finish(const std::vector<Verdict>& all) {
  Counts n;
  for (const Verdict& v : all)
    (v.result == "passed" ? n.passed : v.result == "skipped" ? n.skipped : n.failed) += 1;
  std::printf("[==========] %d tests: %d passed, %d skipped, %d failed\n",
              n.passed + n.skipped + n.failed, n.passed, n.skipped, n.failed);
  if (n.failed == 0) std::printf("[  PASSED  ] %d tests.\n", n.passed);
  write_json(all, true);
  return n;
}

std::vector<Verdict> not_yet_run(const std::string& why) {
  std::vector<Verdict> all;
  for (const Entry& e : registry()) all.push_back({e.name, "not run", why});
  return all;
}

// The verdict of a test run by a child process (--only NAME), from the file it wrote
// (MINITEST_RESULT: the result on the first line, then the messages) and how it ended.
Verdict child_verdict(const std::string& name, const std::string& result_file, int status,
                      bool timed_out, int timeout_s) {
  Verdict v{name, "failed", ""};
  std::ifstream f(result_file);
  std::string result;
  const bool wrote = static_cast<bool>(f) && static_cast<bool>(std::getline(f, result));
  if (wrote) {
    std::ostringstream rest;
    rest << f.rdbuf();
    v.result = result;
    v.message = rest.str();
  }
  std::string how;
  if (timed_out)
    how = "timed out after " + std::to_string(timeout_s) + " s (killed)";
  else if (WIFSIGNALED(status))
    how = "killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
          strsignal(WTERMSIG(status)) + ")";
  else if (WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 1)
    how = "exited with status " + std::to_string(WEXITSTATUS(status));
  if (!how.empty()) {
    v.result = "failed";
    v.message += (wrote ? "the test ended, then its process " : "its process ") + how +
                 (wrote ? "" : " before the test ended") + "\n";
  } else if (!wrote) {
    v.message = "its process ended without a result\n";
  }
  return v;
}

// Runs the test named `name` as a child process (this program with --only NAME), at most
// timeout_s seconds.
Verdict run_isolated(const char* self, const std::string& name, int timeout_s) {
  char tmpl[] = "/tmp/minitest-result-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return {name, "failed", "minitest: cannot create a result file in /tmp\n"};
  close(fd);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) {
    std::remove(tmpl);
    return {name, "failed", "minitest: fork failed\n"};
  }
  if (pid == 0) {
    setenv("MINITEST_RESULT", tmpl, 1);
    unsetenv("MINITEST_JSON");
    execl("/proc/self/exe", self, "--only", name.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  bool timed_out = false;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) {
      status = 0;
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      timed_out = true;
      kill(pid, SIGKILL);
      (void)waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Verdict v = child_verdict(name, tmpl, status, timed_out, timeout_s);
  std::remove(tmpl);
  if (timed_out || WIFSIGNALED(status))
    std::printf("[  FAILED  ] %s (%s)\n", name.c_str(),
                v.message.substr(0, v.message.find_last_not_of('\n') + 1).c_str());
  return v;
}

}  // namespace

Current& current() {
  static Current c;
  return c;
}

int add_test(const char* suite, const char* name, Factory make) {
  registry().push_back({std::string(suite) + "." + name, std::move(make)});
  return 0;
}

void Reporter::operator=(const Message& m) const {
  Current& c = current();
  const std::string text = m.str();
  if (kind_ == Kind::kSkip) {
    c.skipped = true;
    c.messages += std::string(file_) + ":" + std::to_string(line_) + ": Skipped\n" + text + "\n";
    std::printf("%s:%d: Skipped\n%s\n", file_, line_, text.c_str());
    return;
  }
  c.failed = true;
  if (kind_ == Kind::kFatal) c.fatal = true;
  const std::string line = std::string(file_) + ":" + std::to_string(line_) + ": Failure\n" +
                           what_ + (text.empty() ? "" : "\n" + text) + "\n";
  c.messages += line;
  std::printf("%s", line.c_str());
}

}  // namespace minitest

void testing::Test::Run() {
  SetUp();
  const minitest::Current& c = minitest::current();
  if (!c.fatal && !c.skipped) TestBody();
  TearDown();
}

minitest::Counts minitest::run_all() {
  std::vector<Verdict> all = not_yet_run("the run ended before this test (a crash or a hang)");
  write_json(all, false);
  for (std::size_t i = 0; i < registry().size(); ++i) {
    all[i] = run_one(registry()[i]);
    write_json(all, false);
  }
  return finish(all);
}

int minitest::main_with_args(int argc, char** argv) {
  const std::string a1 = argc > 1 ? argv[1] : "";
  if (argc == 1) return run_all().failed > 0 ? 1 : 0;
  if (a1 == "--list" && argc == 2) {
    for (const Entry& e : registry()) std::printf("%s\n", e.name.c_str());
    return 0;
  }
  if (a1 == "--only" && argc == 3) {
    for (const Entry& e : registry()) {
      if (e.name != argv[2]) continue;
      const Verdict v = run_one(e);
      if (const char* path = std::getenv("MINITEST_RESULT")) {
        std::ofstream f(path);
        f << v.result << "\n" << v.message;
      }
      return v.result == "failed" ? 1 : 0;
    }
    std::fprintf(stderr, "minitest: no test named %s (--list names them)\n", argv[2]);
    return 2;
  }
  if (a1 == "--isolate" && argc == 2) {
    int timeout_s = 300;
    if (const char* t = std::getenv("MINITEST_TIMEOUT")) timeout_s = std::max(1, std::atoi(t));
    std::vector<Verdict> all =
        not_yet_run("the run ended before this test (the runner was killed)");
    write_json(all, false);
    for (std::size_t i = 0; i < registry().size(); ++i) {
      all[i] = run_isolated(argv[0], registry()[i].name, timeout_s);
      write_json(all, false);
    }
    return finish(all).failed > 0 ? 1 : 0;
  }
  std::fprintf(stderr, "usage: %s [--list | --only NAME | --isolate]\n", argv[0]);
  return 2;
}
