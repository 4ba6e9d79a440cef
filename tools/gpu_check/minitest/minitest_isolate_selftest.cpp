// minitest's --isolate checks itself (ctest: MinitestIsolateSelftest): each test runs in a process
// of its own, so a test that crashes or hangs fails alone and every test after it still gets its
// verdict, and MINITEST_JSON names each result. Run without arguments, this program runs itself
// with --isolate (MINITEST_TIMEOUT=2) and reads the JSON; exit 0 only when every rule held.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace {

TEST(Isolate, Passes) { EXPECT_EQ(1, 1); }
TEST(Isolate, Fails) { EXPECT_EQ(1, 2) << "expected"; }
TEST(Isolate, Crashes) { std::abort(); }
TEST(Isolate, Hangs) { std::this_thread::sleep_for(std::chrono::seconds(60)); }
TEST(Isolate, Skips) { GTEST_SKIP() << "skipped"; }
TEST(Isolate, RunsAfterTheCrashAndTheHang) { EXPECT_TRUE(true); }

bool has(const std::string& text, const std::string& what) {
  if (text.find(what) != std::string::npos) return true;
  std::printf("minitest isolate selftest: the JSON lacks %s\n", what.c_str());
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) return minitest::main_with_args(argc, argv);
  char self[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  const std::string json_path =
      "/tmp/minitest-isolate-selftest-" + std::to_string(getpid()) + ".json";
  setenv("MINITEST_JSON", json_path.c_str(), 1);
  setenv("MINITEST_TIMEOUT", "2", 1);
  const std::string cmd = "'" + std::string(self) + "' --isolate";
  const int rc = std::system(cmd.c_str());
  std::ifstream f(json_path);
  std::stringstream text;
  text << f.rdbuf();
  std::remove(json_path.c_str());
  const std::string j = text.str();
  bool ok = rc != 0;  // a test failed
  ok = has(j, R"({"name": "Isolate.Passes", "result": "passed")") && ok;
  ok = has(j, R"({"name": "Isolate.Fails", "result": "failed")") && ok;
  ok = has(j, R"({"name": "Isolate.Crashes", "result": "failed", "message": "its process killed )"
              R"(by signal 6)") &&
       ok;
  ok = has(j, R"({"name": "Isolate.Hangs", "result": "failed", "message": "its process timed out )"
              R"(after 2 s (killed) before the test ended)") &&
       ok;
  ok = has(j, R"({"name": "Isolate.Skips", "result": "skipped")") && ok;
  ok = has(j, R"({"name": "Isolate.RunsAfterTheCrashAndTheHang", "result": "passed")") && ok;
  ok = has(j, R"("passed": 2, "failed": 3, "skipped": 1, "not_run": 0, "complete": true)") && ok;
  std::printf("\nminitest isolate selftest (the failures above are expected): %s\n",
              ok ? "every rule held" : "A RULE DID NOT HOLD");
  return ok ? 0 : 1;
}
