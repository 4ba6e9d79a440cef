// minitest's runner (gtest/gtest.h here): run_all() runs every registered test in registration
// order, prints GoogleTest's lines, and with MINITEST_JSON=PATH writes
// {"tests": [{"name", "result": "passed" | "failed" | "skipped", "message"}], "passed", "failed",
// "skipped"}. main() (minitest_run.cpp) exits 1 when a test failed.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
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
  using minitest::current;
  int passed = 0, failed = 0, skipped = 0;
  std::string json = "{\"tests\": [";
  bool first = true;
  for (const auto& e : minitest::registry()) {
    std::printf("[ RUN      ] %s\n", e.name.c_str());
    std::fflush(stdout);
    current() = minitest::Current{};
    e.make()->Run();
    const minitest::Current& c = current();
    const char* result = c.failed ? "failed" : c.skipped ? "skipped" : "passed";
    std::printf("%s %s\n",
                c.failed    ? "[  FAILED  ]"
                : c.skipped ? "[  SKIPPED ]"
                            : "[       OK ]",
                e.name.c_str());
    std::fflush(stdout);
    (c.failed ? failed : c.skipped ? skipped : passed) += 1;
    json += std::string(first ? "" : ",") + "\n  {\"name\": " + minitest::json_str(e.name) +
            ", \"result\": \"" + result + "\", \"message\": " + minitest::json_str(c.messages) +
            "}";
    first = false;
  }
  json += "\n], \"passed\": " + std::to_string(passed) + ", \"failed\": " + std::to_string(failed) +
          ", \"skipped\": " + std::to_string(skipped) + "}\n";
  std::printf("[==========] %d tests: %d passed, %d skipped, %d failed\n",
              passed + skipped + failed, passed, skipped, failed);
  if (failed == 0) std::printf("[  PASSED  ] %d tests.\n", passed);
  if (const char* path = std::getenv("MINITEST_JSON")) {
    std::ofstream f(path);
    f << json;
    if (!f) std::fprintf(stderr, "minitest: cannot write %s\n", path);
  }
  return {passed, failed, skipped};
}
