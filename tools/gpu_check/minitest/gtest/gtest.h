// minitest: the few GoogleTest macros the GPU tests (tests/cuda/test_cuda_executor.cpp,
// test_nccl_comm.cpp) use, so that tools/gpu-check.sh builds and runs those very sources on a
// bare GPU machine that has the CUDA toolkit but no GoogleTest. On a full machine the same
// sources build against GoogleTest (ctest -L gpu). Found as <gtest/gtest.h> through the include
// path of the core-only build only (tools/gpu_check/CMakeLists.txt).
//
// Kept: TEST, TEST_F (SetUp / TearDown; a fatal failure or a skip in SetUp skips the body),
// EXPECT_ / ASSERT_ {TRUE, FALSE, EQ, NE, LT, LE, GT, GE}, EXPECT_NEAR, ADD_FAILURE(), FAIL(),
// GTEST_SKIP(), each streaming a message (<<). ASSERT_, FAIL and GTEST_SKIP return from the
// function they are in, as in GoogleTest. The output lines are GoogleTest's ("[ RUN      ]",
// "[       OK ]", "[  SKIPPED ]", "[  FAILED  ]"); minitest.cpp runs the tests, in one process or
// each in its own, and with MINITEST_JSON=PATH rewrites the results as JSON after every test.
// minitest_selftest.cpp and minitest_isolate_selftest.cpp check these rules.
#pragma once

#include <cmath>
#include <functional>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace testing {

class Test {
 public:
  virtual ~Test() = default;
  virtual void TestBody() = 0;
  // SetUp, then the body unless SetUp failed fatally or skipped, then TearDown.
  void Run();

 protected:
  virtual void SetUp() {}
  virtual void TearDown() {}
};

}  // namespace testing

namespace minitest {

// The state of the test that is running.
struct Current {
  bool failed = false;
  bool fatal = false;  // an ASSERT_ or FAIL: the body ends
  bool skipped = false;
  std::string messages;
};
Current& current();

using Factory = std::function<std::unique_ptr<::testing::Test>()>;
int add_test(const char* suite, const char* name, Factory make);

// Runs every test in this process (minitest.cpp).
struct Counts {
  int passed = 0, failed = 0, skipped = 0;
};
Counts run_all();
// main() of a minitest program (minitest_run.cpp): no argument runs every test in this process;
// --list prints the names; --only NAME runs that test; --isolate runs each test in a process of
// its own (this program with --only NAME), so that a crash, a hang (MINITEST_TIMEOUT seconds a
// test, 300 by default) or a lost CUDA context fails that test only. Exit status 1 when a test
// failed, 2 for a bad argument.
int main_with_args(int argc, char** argv);

class Message {
 public:
  template <class T>
  Message& operator<<(const T& v) {
    out_ << v;
    return *this;
  }
  std::string str() const { return out_.str(); }

 private:
  std::ostringstream out_;
};

enum class Kind { kFailure, kFatal, kSkip };

// `Reporter(...) = Message() << ...`: records the failure or skip with the streamed message.
class Reporter {
 public:
  Reporter(const char* file, int line, std::string what, Kind kind)
      : file_(file), line_(line), what_(std::move(what)), kind_(kind) {}
  void operator=(const Message& m) const;

 private:
  const char* file_;
  int line_;
  std::string what_;
  Kind kind_;
};

// Printing a value: what operator<< prints, an enum's number, or a placeholder.
template <class T, class = void>
struct Streamable : std::false_type {};
template <class T>
struct Streamable<T,
                  std::void_t<decltype(std::declval<std::ostream&>() << std::declval<const T&>())>>
    : std::true_type {};

template <class T>
std::string show(const T& v) {
  std::ostringstream o;
  if constexpr (Streamable<T>::value) {
    o << v;
  } else if constexpr (std::is_enum_v<T>) {
    o << static_cast<long long>(static_cast<std::underlying_type_t<T>>(v));
  } else {
    o << "<unprintable " << sizeof(T) << "-byte value>";
  }
  return o.str();
}

struct Outcome {
  bool ok = true;
  std::string text;
};

template <class A, class B, class Op>
Outcome compare(const A& a, const B& b, Op op, const char* sa, const char* sb, const char* rel) {
  if (op(a, b)) return {};
  return {false, std::string("Expected: (") + sa + ") " + rel + " (" + sb +
                     "), actual: " + show(a) + " vs " + show(b)};
}

inline Outcome truth(bool v, const char* text, bool want) {
  if (v == want) return {};
  return {false, std::string("Value of: ") + text + "\n  Actual: " + (v ? "true" : "false") +
                     "\nExpected: " + (want ? "true" : "false")};
}

template <class A, class B, class C>
Outcome near(const A& a, const B& b, const C& tol, const char* sa, const char* sb) {
  const double d = std::fabs(static_cast<double>(a) - static_cast<double>(b));
  if (d <= static_cast<double>(tol)) return {};
  return {false, std::string("The difference between ") + sa + " and " + sb + " is " + show(d) +
                     ", which exceeds " + show(tol)};
}

}  // namespace minitest

#define MINITEST_CAT2(a, b) a##b
#define MINITEST_CAT(a, b) MINITEST_CAT2(a, b)

#define MINITEST_DEFINE(suite, name, base)                                         \
  class suite##_##name##_Test : public base {                                      \
   public:                                                                         \
    void TestBody() override;                                                      \
  };                                                                               \
  [[maybe_unused]] static const int MINITEST_CAT(minitest_registered_, __LINE__) = \
      ::minitest::add_test(#suite, #name, [] {                                     \
        return std::unique_ptr<::testing::Test>(new suite##_##name##_Test());      \
      });                                                                          \
  void suite##_##name##_Test::TestBody()

#define TEST(suite, name) MINITEST_DEFINE(suite, name, ::testing::Test)
#define TEST_F(fixture, name) MINITEST_DEFINE(fixture, name, fixture)

// Non-fatal: the statement goes on; fatal: `return` from the function.
#define MINITEST_CHECK(outcome, kind, ret)                                 \
  if (const ::minitest::Outcome minitest_o_ = (outcome); minitest_o_.ok) { \
  } else                                                                   \
    ret ::minitest::Reporter(__FILE__, __LINE__, minitest_o_.text, kind) = ::minitest::Message()

#define MINITEST_EXPECT(outcome) MINITEST_CHECK(outcome, ::minitest::Kind::kFailure, )
#define MINITEST_ASSERT(outcome) MINITEST_CHECK(outcome, ::minitest::Kind::kFatal, return )

#define MINITEST_CMP(a, b, op, rel) \
  ::minitest::compare((a), (b), [](const auto& x, const auto& y) { return x op y; }, #a, #b, rel)

#define EXPECT_TRUE(c) MINITEST_EXPECT(::minitest::truth(static_cast<bool>(c), #c, true))
#define EXPECT_FALSE(c) MINITEST_EXPECT(::minitest::truth(static_cast<bool>(c), #c, false))
#define EXPECT_EQ(a, b) MINITEST_EXPECT(MINITEST_CMP(a, b, ==, "=="))
#define EXPECT_NE(a, b) MINITEST_EXPECT(MINITEST_CMP(a, b, !=, "!="))
#define EXPECT_LT(a, b) MINITEST_EXPECT(MINITEST_CMP(a, b, <, "<"))
#define EXPECT_LE(a, b) MINITEST_EXPECT(MINITEST_CMP(a, b, <=, "<="))
#define EXPECT_GT(a, b) MINITEST_EXPECT(MINITEST_CMP(a, b, >, ">"))
#define EXPECT_GE(a, b) MINITEST_EXPECT(MINITEST_CMP(a, b, >=, ">="))
#define EXPECT_NEAR(a, b, t) MINITEST_EXPECT(::minitest::near((a), (b), (t), #a, #b))
#define ASSERT_TRUE(c) MINITEST_ASSERT(::minitest::truth(static_cast<bool>(c), #c, true))
#define ASSERT_FALSE(c) MINITEST_ASSERT(::minitest::truth(static_cast<bool>(c), #c, false))
#define ASSERT_EQ(a, b) MINITEST_ASSERT(MINITEST_CMP(a, b, ==, "=="))
#define ASSERT_NE(a, b) MINITEST_ASSERT(MINITEST_CMP(a, b, !=, "!="))
#define ASSERT_LT(a, b) MINITEST_ASSERT(MINITEST_CMP(a, b, <, "<"))
#define ASSERT_LE(a, b) MINITEST_ASSERT(MINITEST_CMP(a, b, <=, "<="))
#define ASSERT_GT(a, b) MINITEST_ASSERT(MINITEST_CMP(a, b, >, ">"))
#define ASSERT_GE(a, b) MINITEST_ASSERT(MINITEST_CMP(a, b, >=, ">="))

#define ADD_FAILURE()                                                              \
  ::minitest::Reporter(__FILE__, __LINE__, "Failed", ::minitest::Kind::kFailure) = \
      ::minitest::Message()
#define FAIL()                                                                          \
  return ::minitest::Reporter(__FILE__, __LINE__, "Failed", ::minitest::Kind::kFatal) = \
             ::minitest::Message()
#define GTEST_SKIP()                                                                    \
  return ::minitest::Reporter(__FILE__, __LINE__, "Skipped", ::minitest::Kind::kSkip) = \
             ::minitest::Message()
