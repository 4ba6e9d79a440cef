// The merge algebra of state.hpp: identity, commutativity, associativity over random tree
// shapes and orders, extreme and empty inputs, NaN propagation, base-2 converters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "treeattn/state_buffer.hpp"

namespace treeattn {
namespace {

constexpr std::size_t kD = 64;
constexpr float kInf = std::numeric_limits<float>::infinity();
using Rec = std::vector<float>;

Rec empty_rec() {
  Rec r(kD + 2);
  state_set_empty(r.data(), kD);
  return r;
}

// A state as a kernel would produce it for n random tokens with logits around `center`.
Rec random_rec(std::mt19937_64& rng, float center, int n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Rec r = empty_rec();
  for (int j = 0; j < n; ++j) {
    Rec t(kD + 2);
    t[0] = center + 4.0f * u(rng);
    t[1] = 1.0f;
    for (std::size_t d = 0; d < kD; ++d) t[2 + d] = u(rng);
    state_merge(r.data(), t.data(), kD);
  }
  return r;
}

bool bitwise_equal(const Rec& a, const Rec& b) {
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Float64 merge of many records, sequential: the reference for associativity tests.
std::vector<double> merge64(const std::vector<Rec>& parts) {
  std::vector<double> acc(kD + 2), x(kD + 2);
  state_set_empty(acc.data(), kD);
  for (const Rec& p : parts) {
    for (std::size_t i = 0; i < kD + 2; ++i) x[i] = p[i];
    state_merge(acc.data(), x.data(), kD);
  }
  return acc;
}

// Merge parts[lo, hi) following a random binary tree.
Rec merge_tree(std::mt19937_64& rng, const std::vector<Rec>& parts, std::size_t lo, std::size_t hi) {
  if (hi - lo == 1) return parts[lo];
  std::uniform_int_distribution<std::size_t> cut(lo + 1, hi - 1);
  const std::size_t mid = cut(rng);
  Rec a = merge_tree(rng, parts, lo, mid);
  Rec b = merge_tree(rng, parts, mid, hi);
  if (rng() & 1) std::swap(a, b);  // commutativity exercised too
  state_merge(a.data(), b.data(), kD);
  return a;
}

TEST(State, EmptyIsIdentityBitForBit) {
  std::mt19937_64 rng(1);
  const Rec x = random_rec(rng, 3.0f, 7);
  Rec a = empty_rec();
  state_merge(a.data(), x.data(), kD);
  EXPECT_TRUE(bitwise_equal(a, x));
  Rec b = x;
  const Rec e = empty_rec();
  state_merge(b.data(), e.data(), kD);
  EXPECT_TRUE(bitwise_equal(b, x));
}

TEST(State, EmptyWithEmptyStaysEmptyWithoutNaN) {
  Rec a = empty_rec();
  const Rec b = empty_rec();
  state_merge(a.data(), b.data(), kD);
  EXPECT_TRUE(bitwise_equal(a, empty_rec()));
  for (float v : a) EXPECT_FALSE(std::isnan(v));
  std::vector<float> out(kD, 123.0f);
  float lse = 0;
  state_normalize(a.data(), kD, out.data(), &lse);
  EXPECT_EQ(lse, -kInf);
  for (float v : out) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(state_lse(a.data()), -kInf);
}

TEST(State, MergeIsCommutativeBitForBit) {
  std::mt19937_64 rng(2);
  for (int trial = 0; trial < 200; ++trial) {
    const Rec x = random_rec(rng, static_cast<float>(trial % 7) * 10.0f - 30.0f, 1 + trial % 5);
    const Rec y = random_rec(rng, static_cast<float>(trial % 3) * 10.0f - 10.0f, 1 + trial % 4);
    Rec xy = x, yx = y;
    state_merge(xy.data(), y.data(), kD);
    state_merge(yx.data(), x.data(), kD);
    ASSERT_TRUE(bitwise_equal(xy, yx)) << "trial " << trial;
  }
}

// Associativity up to rounding: any tree shape and order over n partials (a third of them
// empty, as a shard without visible tokens would be) matches the float64 merge.
class StateAssociativity : public ::testing::TestWithParam<int> {};

TEST_P(StateAssociativity, AnyTreeShapeMatchesFloat64) {
  const int n = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(n) * 7919u);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<Rec> parts;
    for (int i = 0; i < n; ++i) {
      if (n > 1 && rng() % 3 == 0) parts.push_back(empty_rec());
      else parts.push_back(random_rec(rng, static_cast<float>(static_cast<int>(rng() % 41) - 20), 1 + static_cast<int>(rng() % 6)));
    }
    const std::vector<double> ref = merge64(parts);
    std::vector<double> ref_out(kD);
    double ref_lse = 0;
    state_normalize(ref.data(), kD, ref_out.data(), &ref_lse);
    for (int shape = 0; shape < 5; ++shape) {
      std::vector<Rec> shuffled = parts;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      const Rec got = merge_tree(rng, shuffled, 0, shuffled.size());
      std::vector<float> out(kD);
      float lse = 0;
      state_normalize(got.data(), kD, out.data(), &lse);
      if (std::isinf(ref_lse)) {
        EXPECT_EQ(lse, -kInf);
        continue;
      }
      EXPECT_NEAR(lse, ref_lse, 1e-5 * std::max(1.0, std::abs(ref_lse))) << "n=" << n;
      for (std::size_t d = 0; d < kD; ++d)
        ASSERT_NEAR(out[d], ref_out[d], 1e-5) << "n=" << n << " d=" << d;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Partials, StateAssociativity,
                         ::testing::Values(1, 2, 3, 5, 17, 32, 55, 97, 133));

// max(+0, -0) keeps the sign of its second operand; state_merge itself folds m = -0 to +0, so
// merge(a, b) and merge(b, a) agree bit for bit for every backend that calls it (not only the
// MPI op, where the fold used to live).
TEST(State, SignedZeroMaxIsFoldedSoMergeStaysCommutative) {
  Rec a(kD + 2, 1.0f), b(kD + 2, 2.0f);
  state_m(a.data()) = 0.0f;
  state_m(b.data()) = -0.0f;
  Rec ab = a, ba = b;
  state_merge(ab.data(), b.data(), kD);
  state_merge(ba.data(), a.data(), kD);
  EXPECT_EQ(std::memcmp(ab.data(), ba.data(), ab.size() * sizeof(float)), 0);
  EXPECT_FALSE(std::signbit(state_m(ab.data())));
  // Both -0: the result is +0 too (never -0 from a merge of two non-empty states).
  Rec c = b;
  state_merge(c.data(), b.data(), kD);
  EXPECT_FALSE(std::signbit(state_m(c.data())));
  // The identity still returns the other side bit for bit, -0 included.
  Rec e = empty_rec();
  state_merge(e.data(), b.data(), kD);
  EXPECT_EQ(std::memcmp(e.data(), b.data(), b.size() * sizeof(float)), 0);
}

TEST(State, NamedFieldsAreThePackedOffsets) {
  Rec r(kD + 2);
  for (std::size_t i = 0; i < r.size(); ++i) r[i] = static_cast<float>(i);
  EXPECT_EQ(state_m(r.data()), r[kStateM]);
  EXPECT_EQ(state_l(r.data()), r[kStateL]);
  EXPECT_EQ(state_o(r.data()), r.data() + kStateO);
  EXPECT_EQ(kStateM, 0u);
  EXPECT_EQ(kStateL, 1u);
  EXPECT_EQ(kStateO, 2u);
}

// The sum form of tree-paper / tree2 rebuilds the merge: merging records and summing their
// weighted forms under the common max LSE give the same output and LSE.
TEST(State, SumFormOfTwoRecordsMatchesTheirMerge) {
  std::mt19937_64 rng(7);
  const Rec a = random_rec(rng, 3.0f, 40), b = random_rec(rng, -2.0f, 17);
  Rec merged = a;
  state_merge(merged.data(), b.data(), kD);
  const float M = std::max(state_lse(a.data()), state_lse(b.data()));
  Rec na(kD), nb(kD);
  float wa = 0, wb = 0;
  state_to_sum_form(a.data(), M, kD, na.data(), &wa);
  state_to_sum_form(b.data(), M, kD, nb.data(), &wb);
  Rec sum(kD);
  for (std::size_t d = 0; d < kD; ++d) sum[d] = na[d] + nb[d];
  Rec rebuilt(kD + 2);
  state_from_sum_form(M, sum.data(), wa + wb, kD, rebuilt.data());
  Rec o1(kD), o2(kD);
  float l1 = 0, l2 = 0;
  state_normalize(merged.data(), kD, o1.data(), &l1);
  state_normalize(rebuilt.data(), kD, o2.data(), &l2);
  EXPECT_NEAR(l1, l2, 1e-5f * std::max(1.0f, std::fabs(l1)));
  for (std::size_t d = 0; d < kD; ++d) EXPECT_NEAR(o1[d], o2[d], 1e-5f);
  // Empty records weigh nothing, and an all-empty sum rebuilds the empty state.
  const Rec e = empty_rec();
  float we = 1;
  Rec ne(kD, 1.0f);
  state_to_sum_form(e.data(), M, kD, ne.data(), &we);
  EXPECT_EQ(we, 0.0f);
  for (float x : ne) EXPECT_EQ(x, 0.0f);
  Rec out(kD + 2, 5.0f);
  state_from_sum_form(-kInf, ne.data(), 0.0f, kD, out.data());
  EXPECT_TRUE(state_is_empty(out.data()));
}

TEST(State, AllEmptyPartialsNormalizeToZeroAndMinusInf) {
  std::vector<Rec> parts(17, empty_rec());
  std::mt19937_64 rng(3);
  const Rec got = merge_tree(rng, parts, 0, parts.size());
  std::vector<float> out(kD, 1.0f);
  float lse = 0;
  state_normalize(got.data(), kD, out.data(), &lse);
  EXPECT_EQ(lse, -kInf);
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

// No finite sentinel stands for -inf: logits of -524288 are ordinary values.
TEST(State, ExtremeNegativeLogitsAreNotTreatedAsEmpty) {
  Rec a = empty_rec(), b = empty_rec();
  a[0] = -524288.0f; a[1] = 1.0f; a[2] = 5.0f;
  b[0] = -524288.0f; b[1] = 1.0f; b[2] = 7.0f;
  state_merge(a.data(), b.data(), kD);
  std::vector<float> out(kD);
  float lse = 0;
  state_normalize(a.data(), kD, out.data(), &lse);
  EXPECT_EQ(out[0], 6.0f);
  EXPECT_FLOAT_EQ(lse, -524288.0f + std::log(2.0f));
  // A huge gap: the tiny side contributes exactly nothing, without NaN.
  Rec c = empty_rec();
  c[0] = 1.0e30f; c[1] = 1.0f; c[2] = 3.0f;
  state_merge(a.data(), c.data(), kD);
  state_normalize(a.data(), kD, out.data(), &lse);
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ(lse, 1.0e30f);
}

TEST(State, NaNPropagatesFromEitherSideAndEveryField) {
  std::mt19937_64 rng(4);
  const Rec x = random_rec(rng, 0.0f, 3);
  for (std::size_t field : {std::size_t{0}, std::size_t{1}, std::size_t{2 + 5}}) {
    Rec bad = random_rec(rng, 1.0f, 2);
    bad[field] = std::numeric_limits<float>::quiet_NaN();
    for (int side = 0; side < 2; ++side) {
      Rec acc = side ? x : bad;
      const Rec& other = side ? bad : x;
      state_merge(acc.data(), other.data(), kD);
      std::vector<float> out(kD);
      float lse = 0;
      state_normalize(acc.data(), kD, out.data(), &lse);
      const bool any_nan = std::any_of(out.begin(), out.end(), [](float v) { return std::isnan(v); });
      EXPECT_TRUE(any_nan || std::isnan(lse)) << "field " << field << " side " << side;
    }
    // Merged with the empty state, the NaN survives too.
    Rec acc = empty_rec();
    state_merge(acc.data(), bad.data(), kD);
    EXPECT_TRUE(std::isnan(acc[field]));
  }
}

TEST(State, Base2ConvertersRoundTrip) {
  for (float lse : {0.0f, 1.0f, -3.5f, 80.0f, -524288.0f}) {
    EXPECT_NEAR(lse_from_base2(lse_to_base2(lse)), lse, 1e-6f * std::max(1.0f, std::abs(lse)));
    EXPECT_NEAR(std::exp2(static_cast<double>(lse_to_base2(lse))), std::exp(static_cast<double>(lse)),
                1e-5 * std::exp(static_cast<double>(lse)) + 1e-300);
  }
  EXPECT_EQ(lse_to_base2(-kInf), -kInf);
  EXPECT_TRUE(std::isnan(lse_to_base2(std::numeric_limits<float>::quiet_NaN())));
}

TEST(State, FromOutputLseRoundTripsAndMergesLikeTheOriginal) {
  std::mt19937_64 rng(5);
  const Rec x = random_rec(rng, 2.0f, 9), y = random_rec(rng, -1.0f, 4);
  std::vector<float> ox(kD), oy(kD);
  float lx = 0, ly = 0;
  state_normalize(x.data(), kD, ox.data(), &lx);
  state_normalize(y.data(), kD, oy.data(), &ly);
  Rec fx(kD + 2), fy(kD + 2);
  state_from_output_lse(ox.data(), lx, kD, fx.data());
  state_from_output_lse(oy.data(), ly, kD, fy.data());
  Rec a = x, b = fx;
  state_merge(a.data(), y.data(), kD);
  state_merge(b.data(), fy.data(), kD);
  std::vector<float> oa(kD), ob(kD);
  float la = 0, lb = 0;
  state_normalize(a.data(), kD, oa.data(), &la);
  state_normalize(b.data(), kD, ob.data(), &lb);
  EXPECT_NEAR(la, lb, 1e-5f);
  for (std::size_t d = 0; d < kD; ++d) EXPECT_NEAR(oa[d], ob[d], 1e-5f);
  Rec e(kD + 2);
  state_from_output_lse(ox.data(), -kInf, kD, e.data());
  EXPECT_TRUE(bitwise_equal(e, empty_rec()));
}

TEST(StateBuffer, StartsEmptyAndIndexesBatchQueryHead) {
  StateBuffer buf(2, 3, 4, kD);
  EXPECT_EQ(buf.records(), 24u);
  EXPECT_EQ(buf.bytes(), 24u * (kD + 2) * sizeof(float));
  for (std::size_t r = 0; r < buf.records(); ++r) EXPECT_TRUE(state_is_empty(buf.record(r)));
  EXPECT_EQ(buf.record(1, 2, 3), buf.record(23));
  EXPECT_EQ(buf.record(0, 1, 0), buf.record(4));
}

}  // namespace
}  // namespace treeattn
