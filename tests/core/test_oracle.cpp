// The float64 oracle against hand-computable cases: it is the definition everything else is
// checked against, so it gets checked against arithmetic done by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "treeattn/oracle.hpp"

namespace treeattn {
namespace {

// One head, D = 64, three tokens whose logits are 0, ln 2 and ln 3 (with scale 1):
// weights 1:2:3, so the output is (1*v0 + 2*v1 + 3*v2) / 6 and the LSE is ln 6.
TEST(Oracle, HandComputedSoftmax) {
  AttnShape shape{1, 1, 1, 64, 1};
  KVCache cache(shape, DType::kF32, 3);
  std::vector<float> q(64, 0.0f);
  q[0] = 1.0f;
  const double logits[3] = {0.0, std::log(2.0), std::log(3.0)};
  for (int t = 0; t < 3; ++t) {
    std::vector<float> k(64, 0.0f), v(64, 0.0f);
    k[0] = static_cast<float>(logits[t]);
    v[1] = static_cast<float>(t + 1);
    cache.set_token(0, 0, t, k.data(), v.data());
  }
  std::vector<int64_t> len{3}, start{0}, total{3};
  std::vector<double> out(64), lse(1);
  ASSERT_TRUE(oracle_attention(shape, q.data(), cache.view(0, len, start, total, 1), out.data(),
                               lse.data(), 1.0).is_ok());
  double w[3], sum = 0;
  for (int t = 0; t < 3; ++t) sum += (w[t] = std::exp(static_cast<double>(static_cast<float>(logits[t]))));
  EXPECT_NEAR(out[1], (w[0] * 1 + w[1] * 2 + w[2] * 3) / sum, 1e-15);
  EXPECT_NEAR(out[1], 14.0 / 6.0, 1e-7);
  EXPECT_NEAR(lse[0], std::log(sum), 1e-15);
  EXPECT_EQ(out[0], 0.0);
}

// Q = 2 with the causal rule: query 0 sees positions <= N - 2, query 1 sees all N.
TEST(Oracle, MultiTokenQueryCausalLimit) {
  AttnShape shape{1, 1, 1, 64, 2};
  KVCache cache(shape, DType::kF32, 4);
  for (int t = 0; t < 4; ++t) {
    std::vector<float> k(64, 0.0f), v(64, static_cast<float>(t));
    cache.set_token(0, 0, t, k.data(), v.data());
  }
  std::vector<float> q(128, 0.0f);
  std::vector<int64_t> len{4}, start{0}, total{4};
  std::vector<double> out(128), lse(2);
  ASSERT_TRUE(oracle_attention(shape, q.data(), cache.view(0, len, start, total, 1), out.data(),
                               lse.data()).is_ok());
  EXPECT_DOUBLE_EQ(out[0], 1.0);   // mean of 0, 1, 2
  EXPECT_DOUBLE_EQ(out[64], 1.5);  // mean of 0..3
  EXPECT_DOUBLE_EQ(lse[0], std::log(3.0));
  EXPECT_DOUBLE_EQ(lse[1], std::log(4.0));
}

TEST(Oracle, EmptyContextGivesZeroAndMinusInf) {
  AttnShape shape{2, 2, 1, 64, 1};
  std::vector<int64_t> len{0, 0}, start{0, 0}, total{0, 0};
  KVShard kv;
  kv.len = len; kv.pos_start = start; kv.total_len = total;
  std::vector<float> q(2 * 2 * 64, 1.0f);
  std::vector<double> out(2 * 2 * 64, 7.0), lse(4);
  ASSERT_TRUE(oracle_attention(shape, q.data(), kv, out.data(), lse.data()).is_ok());
  for (double v : out) EXPECT_EQ(v, 0.0);
  for (double v : lse) EXPECT_EQ(v, -std::numeric_limits<double>::infinity());
}

TEST(Oracle, NaNInKeysPropagates) {
  AttnShape shape{1, 1, 1, 64, 1};
  KVCache cache(shape, DType::kBF16, 2);
  std::vector<float> k(64, 0.5f), v(64, 1.0f);
  cache.set_token(0, 0, 0, k.data(), v.data());
  k[3] = std::numeric_limits<float>::quiet_NaN();
  cache.set_token(0, 0, 1, k.data(), v.data());
  std::vector<int64_t> len{2}, start{0}, total{2};
  std::vector<float> q(64, 1.0f);
  std::vector<double> out(64), lse(1);
  ASSERT_TRUE(oracle_attention(shape, q.data(), cache.view(0, len, start, total, 1), out.data(),
                               lse.data()).is_ok());
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_TRUE(std::isnan(lse[0]));
}

}  // namespace
}  // namespace treeattn
