// The bound a device merge of partial states is held to (tools/gpu_check/state_tolerance.hpp),
// on the host: a merge whose exp is off by up to 2 ulp in either direction (what a GPU's expf
// may do) passes it, including where the terms cancel and the old bound, relative to the merged
// result, rejected it; a wrong merge (swapped weights, a dropped part) fails it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "tools/gpu_check/state_tolerance.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace {

using tolerance::merged_record_excess;
using tolerance::normalized_excess;

enum class Wrong { kNone, kSwappedWeights };

// state_merge with the exp given (the algebra of state.hpp, line for line), or a wrong merge.
template <class Exp>
void merge_with(float* acc, const float* x, std::size_t d, Exp ex, Wrong wrong = Wrong::kNone) {
  const float ma = state_m(acc), mb = state_m(x);
  if (mb == state_neg_inf<float>()) return;
  if (ma == state_neg_inf<float>()) {
    for (std::size_t i = 0; i < d + 2; ++i) acc[i] = x[i];
    return;
  }
  float m = (std::isnan(ma) || std::isnan(mb)) ? NAN : (ma > mb ? ma : mb);
  if (m == 0.0f) m = 0.0f;
  float sa = ex(ma - m), sb = ex(mb - m);
  if (wrong == Wrong::kSwappedWeights) std::swap(sa, sb);
  state_m(acc) = m;
  state_l(acc) = sa * state_l(acc) + sb * state_l(x);
  for (std::size_t i = 0; i < d; ++i) state_o(acc)[i] = sa * state_o(acc)[i] + sb * state_o(x)[i];
}

// An expf that is off by -2..2 ulp, chosen by a seeded generator per call.
struct PerturbedExp {
  std::mt19937_64* rng;
  float operator()(float x) const {
    float y = std::exp(x);
    const int ulps = static_cast<int>((*rng)() % 5) - 2;
    for (int i = 0; i < std::abs(ulps); ++i)
      y = std::nextafter(y, ulps > 0 ? std::numeric_limits<float>::infinity() : 0.0f);
    return y;
  }
};
const auto kHostExp = [](float x) { return std::exp(x); };

// Folds parts (k records of d) in order into out, as merge_ordered does.
template <class Exp>
std::vector<float> fold(const std::vector<const float*>& parts, std::size_t d, Exp ex,
                        Wrong wrong = Wrong::kNone, std::size_t drop = SIZE_MAX) {
  std::vector<float> acc(d + 2);
  state_set_empty(acc.data(), d);
  for (std::size_t i = 0; i < parts.size(); ++i)
    if (i != drop) merge_with(acc.data(), parts[i], d, ex, wrong);
  return acc;
}

std::vector<float> normalized(const std::vector<float>& rec, std::size_t d) {
  std::vector<float> out(d);
  float lse = 0;
  state_normalize(rec.data(), d, out.data(), &lse);
  return out;
}

TEST(StateTolerance, CancellingTermsWithAPerturbedExpPassTheNewBoundNotTheOld) {
  // Two parts whose weighted outputs nearly cancel: w_a = 1, w_b = exp(-0.25), and
  // o_b = -o_a / w_b, so the merged o is about 0 while its terms are 100.
  const std::size_t d = 4;
  const float c = 100.0f / std::exp(-0.25f);
  std::vector<float> a{1.5f, 100.0f, 100.0f, -50.0f, 3.0f, 0.0f};
  std::vector<float> b{1.25f, 130.0f, -c, 50.0f, -3.0f, 1.0f};
  const std::vector<const float*> parts{a.data(), b.data()};
  const auto host = fold(parts, d, kHostExp);
  // A device expf 2 ulp above the host's, every call.
  const auto up2 = [](float x) {
    const float y = std::exp(x);
    return std::nextafter(std::nextafter(y, 2.0f * y + 1.0f), 2.0f * y + 1.0f);
  };
  const auto dev = fold(parts, d, up2);
  ASSERT_NE(host, dev) << "the perturbation must change the result";
  EXPECT_LE(merged_record_excess(parts.data(), 2, d, dev.data(), host.data()), 1.0);
  // The old rule (|a - b| <= 4e-6 * max(1, |a|, |b|) per float) rejects this correct merge.
  bool old_rule_rejects = false;
  for (std::size_t i = 0; i < d + 2; ++i) {
    const float x = host[i], y = dev[i];
    old_rule_rejects |=
        std::fabs(x - y) > 4e-6f * std::max(1.0f, std::max(std::fabs(x), std::fabs(y)));
  }
  EXPECT_TRUE(old_rule_rejects) << "the case no longer shows why the bound changed";
}

// Records as the CUDA tests make them: empty, -0 and +0 maxima, NaN, spreads of +-30 in m,
// l in [1, 100], o up to +-l.
std::vector<float> records(std::size_t n, std::size_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), m(-30.0f, 30.0f), l(1.0f, 100.0f);
  std::vector<float> r(n * (d + 2));
  for (std::size_t i = 0; i < n; ++i) {
    float* rec = r.data() + i * (d + 2);
    const auto kind = rng() % 10;
    if (kind == 0) {
      state_set_empty(rec, d);
      continue;
    }
    rec[0] = kind == 1 ? -0.0f : kind == 2 ? 0.0f : kind == 3 ? std::nanf("") : m(rng);
    rec[1] = l(rng);
    for (std::size_t k = 0; k < d; ++k) rec[2 + k] = u(rng) * rec[1];
  }
  return r;
}

// n rows of k parts each; part p of row r at all[(p * n + r) * (d + 2)], as merge_ordered reads.
struct Rows {
  std::size_t n, k, d;
  std::vector<float> all;
  std::vector<const float*> parts(std::size_t r) const {
    std::vector<const float*> v;
    for (std::size_t p = 0; p < k; ++p) v.push_back(all.data() + (p * n + r) * (d + 2));
    return v;
  }
};

TEST(StateTolerance, EveryPerturbedExpMergePasses) {
  for (std::size_t k : {2, 3, 5, 8})
    for (std::size_t d : {64, 128}) {
      const Rows rows{301, k, d, records(301 * k, d, k * 1000 + d)};
      std::mt19937_64 rng(k + d);
      const PerturbedExp ex{&rng};
      for (std::size_t r = 0; r < rows.n; ++r) {
        const auto parts = rows.parts(r);
        const auto host = fold(parts, d, kHostExp);
        const auto dev = fold(parts, d, ex);
        const double e = merged_record_excess(parts.data(), k, d, dev.data(), host.data());
        ASSERT_LE(e, 1.0) << "k " << k << " d " << d << " row " << r;
        const double ne = normalized_excess(parts.data(), k, d, normalized(dev, d).data(),
                                            normalized(host, d).data());
        ASSERT_LE(ne, 1.0) << "normalized, k " << k << " d " << d << " row " << r;
      }
    }
}

TEST(StateTolerance, AWrongMergeFails) {
  const std::size_t k = 2, d = 64, n = 400;
  const Rows rows{n, k, d, records(n * k, d, 99)};
  int checked = 0;
  for (std::size_t r = 0; r < n; ++r) {
    const auto parts = rows.parts(r);
    const float ma = state_m(parts[0]), mb = state_m(parts[1]);
    // Rows where the two weights differ (two non-empty, non-NaN parts with distinct m).
    if (std::isnan(ma) || std::isnan(mb) || state_is_empty(parts[0]) || state_is_empty(parts[1]) ||
        std::fabs(ma - mb) < 0.1f)
      continue;
    ++checked;
    const auto host = fold(parts, d, kHostExp);
    const auto swapped = fold(parts, d, kHostExp, Wrong::kSwappedWeights);
    EXPECT_GT(merged_record_excess(parts.data(), k, d, swapped.data(), host.data()), 1.0)
        << "swapped weights passed, row " << r;
    EXPECT_GT(normalized_excess(parts.data(), k, d, normalized(swapped, d).data(),
                                normalized(host, d).data()),
              1.0)
        << "swapped weights passed (normalized), row " << r;
    // A dropped part: the smaller one (the larger would change m, which must match exactly),
    // where its weight is not negligible (exp(-30) is below float precision: dropping it is
    // not a wrong result).
    if (std::fabs(ma - mb) > 5.0f) continue;
    const auto dropped = fold(parts, d, kHostExp, Wrong::kNone, ma < mb ? 0 : 1);
    EXPECT_GT(merged_record_excess(parts.data(), k, d, dropped.data(), host.data()), 1.0)
        << "a dropped part passed, row " << r;
  }
  EXPECT_GT(checked, 200);
}

TEST(StateTolerance, SpecialValuesMustMatchExactly) {
  const std::size_t d = 2;
  std::vector<float> a{1.0f, 2.0f, 1.0f, 1.0f}, nan_m{NAN, 1.0f, 0.5f, 0.5f};
  const std::vector<const float*> parts{a.data(), nan_m.data()};
  std::vector<float> all_nan{NAN, NAN, NAN, NAN}, finite{1.0f, 3.0f, 1.5f, 1.5f};
  EXPECT_LE(merged_record_excess(parts.data(), 2, d, all_nan.data(), all_nan.data()), 1.0);
  EXPECT_EQ(merged_record_excess(parts.data(), 2, d, finite.data(), all_nan.data()),
            std::numeric_limits<double>::infinity());
  // Another m is never within the bound (max is exact on both sides).
  std::vector<float> x{1.0f, 2.0f, 1.0f, 1.0f}, y{std::nextafter(1.0f, 2.0f), 2.0f, 1.0f, 1.0f};
  const std::vector<const float*> one{x.data()};
  EXPECT_EQ(merged_record_excess(one.data(), 1, d, y.data(), x.data()),
            std::numeric_limits<double>::infinity());
  EXPECT_EQ(merged_record_excess(one.data(), 1, d, x.data(), x.data()), 0.0);
}

}  // namespace
}  // namespace treeattn
