// minitest checks itself (ctest: MinitestSelftest; tools/gpu-check.sh runs it before the GPU
// tests): a failed EXPECT goes on and fails the test, a failed ASSERT returns, a skip or a
// fatal failure in SetUp skips the body, GTEST_SKIP returns, and the counts add up. Exit 0
// only when every rule held.
#include <cstdio>

#include "gtest/gtest.h"

namespace {

enum class Colour { kRed, kBlue };
bool reached = false, after_assert = false, skipped_body_ran = false, failed_body_ran = false,
     after_skip = false;

TEST(Self, Passes) {
  EXPECT_EQ(1, 1);
  EXPECT_EQ(Colour::kRed, Colour::kRed);
  EXPECT_NEAR(1.0, 1.05, 0.1);
  ASSERT_TRUE(true) << "not shown";
  EXPECT_LT(1, 2);
}

TEST(Self, ExpectFailsAndGoesOn) {
  EXPECT_EQ(Colour::kRed, Colour::kBlue) << "enums print as numbers";
  reached = true;
}

TEST(Self, AssertReturns) {
  ASSERT_GT(1, 2) << "expected";
  after_assert = true;
}

class SkipInSetUp : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_SKIP() << "no device"; }
};
TEST_F(SkipInSetUp, BodyDoesNotRun) { skipped_body_ran = true; }

class FailInSetUp : public ::testing::Test {
 protected:
  void SetUp() override { FAIL() << "broken device"; }
};
TEST_F(FailInSetUp, BodyDoesNotRun) { failed_body_ran = true; }

TEST(Self, SkipReturns) {
  GTEST_SKIP() << "skipped";
  after_skip = true;
}

TEST(Self, AlsoPasses) { EXPECT_FALSE(false); }

}  // namespace

int main() {
  const minitest::Counts c = minitest::run_all();
  const bool ok = c.passed == 2 && c.failed == 3 && c.skipped == 2 && reached && !after_assert &&
                  !skipped_body_ran && !failed_body_ran && !after_skip;
  std::printf("\nminitest selftest (the failures above are expected): %s\n",
              ok ? "every rule held" : "A RULE DID NOT HOLD");
  return ok ? 0 : 1;
}
