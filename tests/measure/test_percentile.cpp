// percentile() (measure.hpp): the one definition bench, run and generate report. Linear
// interpolation between the closest ranks (numpy's default): the expected values below are
// numpy.percentile's for the same inputs, worked by hand.
#include <gtest/gtest.h>

#include <vector>

#include "treeattn/measure.hpp"

namespace treeattn {
namespace {

TEST(Percentile, LinearBetweenTheClosestRanks) {
  const std::vector<double> v = {4, 1, 3, 2};  // any order
  EXPECT_DOUBLE_EQ(percentile(v, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(percentile(v, 1.0), 4.0);
  EXPECT_DOUBLE_EQ(percentile(v, 0.5), 2.5);   // mean of the middle two
  EXPECT_DOUBLE_EQ(percentile(v, 0.9), 3.7);   // 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
  EXPECT_DOUBLE_EQ(percentile(v, 0.1), 1.3);   // 0.3: 1 + 0.3 * (2 - 1)
  const std::vector<double> odd = {10, 30, 20};
  EXPECT_DOUBLE_EQ(percentile(odd, 0.5), 20.0);  // the middle one
  EXPECT_DOUBLE_EQ(percentile(odd, 0.99), 29.8);  // 1.98: 20 + 0.98 * 10
}

TEST(Percentile, EdgeCases) {
  EXPECT_EQ(percentile(std::vector<double>{}, 0.5), 0.0);
  EXPECT_EQ(percentile(std::vector<double>{7.5}, 0.99), 7.5);
  const std::vector<double> v = {1, 2};
  EXPECT_EQ(percentile(v, -1.0), 1.0);  // clamped
  EXPECT_EQ(percentile(v, 2.0), 2.0);
  // Not the nearest rank: p50 of 1..10 is 5.5, which nearest rank would give as 5.
  std::vector<double> ten;
  for (int i = 1; i <= 10; ++i) ten.push_back(i);
  EXPECT_DOUBLE_EQ(percentile(ten, 0.5), 5.5);
}

}  // namespace
}  // namespace treeattn
