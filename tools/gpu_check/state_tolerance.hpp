// How far a device merge of partial states may lie from the host's (issue 21, 3): the bound
// the CUDA tests (tests/cuda/test_cuda_executor.cpp) and the GPU check (gpu_check.cpp) share.
// Host code only, no CUDA headers.
//
// Why not relative to the result. A merged record's o[j] = sum_i w_i o_i[j], with weights
// w_i = exp(m_i - M) in (0, 1] and M = max_i m_i; the terms o_i[j] (up to +-l_i, here +-100)
// have either sign and cancel, so the result can be far smaller than its terms. An error in a
// weight is relative to the term it scales, not to the result: one ulp of difference in one
// exp times a term of 100 is 1.2e-5, which a bound of 4e-6 * max(1, |result|) rejects.
//
// The bound. The device's state kernels call the host's state_merge, in the host's order,
// compiled without contraction (--fmad=false; state_kernels.cu), so the two sides perform the
// same operations on the same floats: max and the subtraction m_a - m are exact or rounded
// identically, and they differ only where expf differs (CUDA documents <= 2 ulp, glibc's expf
// is < 1 ulp: E = kDeviceExpUlps + kHostExpUlps ulps between them, each ulp at most 2^-23 of
// the value) and then in the roundings of the operations that consume those different values.
// Folding k parts in order, each part's term goes through at most k - 1 rescalings, each with
// one exp (relative difference <= E 2^-23) and one multiply and one add per side (<= 2^-24 of
// the magnitude each, four per step counting both sides, <= 2 * 2^-23). Rounding errors made at
// an earlier step are scaled down by the later rescalings, exactly as the terms are, so to
// first order
//
//   |o_dev[j] - o_host[j]| <= (k - 1) (E + 2) 2^-23 * S[j],    S[j] = sum_i w_i |o_i[j]|,
//
// and the same for l with S = sum_i w_i l_i (= l: no cancellation there). merge_bound_factor
// doubles that for the second-order terms. Underflow (a weight below FLT_MIN, which one side
// may flush) adds at most k 2^-126 max_i |o_i[j]|. m is exact on both sides. NaN, infinities
// and empty records follow the same control flow on both sides and must match exactly.
//
// For the normalized output o / l of a merged record, with the bounds dO on o[j] and dL on l:
// |d(o/l)| <= dO / l + |o / l| dL / l + 2 2^-23 |o / l| (the division, both sides).
//
// A wrong merge (swapped weights, a dropped part) is off by about a term, S[j] itself, which is
// about 10^5 times the bound for k <= 8.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "treeattn/state.hpp"

namespace treeattn::tolerance {

inline constexpr double kDeviceExpUlps = 2.0;  // CUDA expf, full-range (no fast math)
inline constexpr double kHostExpUlps = 1.0;    // glibc expf
inline constexpr double kUlp = 0x1p-23;        // one ulp relative to the value, at most
inline constexpr double kMinNormal = 0x1p-126;

// The factor of S in the bound above for a fold of k parts (0 for k <= 1: nothing to merge,
// so the results must be equal up to NaN).
inline double merge_bound_factor(std::size_t k) {
  if (k <= 1) return 0.0;
  return 2.0 * static_cast<double>(k - 1) * (kDeviceExpUlps + kHostExpUlps + 2.0) * kUlp;
}

// The exact (double) weighted magnitudes of k records folded together: S_o[j] and S_l, and the
// largest |o_i[j]| (for the underflow floor). Records whose m is -inf (empty) contribute 0.
struct MergeMagnitudes {
  bool special = false;  // a NaN or infinite m or l among the parts: compare exactly
  double s_l = 0;
  std::vector<double> s_o, max_o;
};

inline MergeMagnitudes merge_magnitudes(const float* const* parts, std::size_t k, std::size_t d) {
  MergeMagnitudes g;
  g.s_o.assign(d, 0.0);
  g.max_o.assign(d, 0.0);
  double big_m = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < k; ++i) {
    const float m = state_m(parts[i]);
    if (std::isnan(m) || m == std::numeric_limits<float>::infinity() ||
        !std::isfinite(state_l(parts[i])))
      g.special = true;
    if (!state_is_empty(parts[i])) big_m = std::max(big_m, static_cast<double>(m));
  }
  if (g.special) return g;
  for (std::size_t i = 0; i < k; ++i) {
    if (state_is_empty(parts[i])) continue;
    const double w = std::exp(static_cast<double>(state_m(parts[i])) - big_m);
    g.s_l += w * std::fabs(static_cast<double>(state_l(parts[i])));
    const float* o = state_o(parts[i]);
    for (std::size_t j = 0; j < d; ++j) {
      g.s_o[j] += w * std::fabs(static_cast<double>(o[j]));
      g.max_o[j] = std::max(g.max_o[j], std::fabs(static_cast<double>(o[j])));
    }
  }
  return g;
}

// Both NaN, or equal (infinities included); for fields compared exactly.
inline bool same_value(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

// The worst |a - b| / bound over the fields of one merged record, where a and b are two
// merges (a device's and the host's) of the k records parts[0..k) (head dim d): <= 1 within the
// bound, +inf where m, the NaN pattern or an infinity differ.
inline double merged_record_excess(const float* const* parts, std::size_t k, std::size_t d,
                                   const float* a, const float* b) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const MergeMagnitudes g = merge_magnitudes(parts, k, d);
  const double f = merge_bound_factor(k);
  if (!same_value(state_m(a), state_m(b))) return kInf;
  double worst = 0;
  auto field = [&](float x, float y, double s, double floor) {
    if (std::isnan(x) || std::isnan(y) || std::isinf(x) || std::isinf(y) || g.special) {
      if (!same_value(x, y)) worst = kInf;
      return;
    }
    const double diff = std::fabs(static_cast<double>(x) - static_cast<double>(y));
    if (diff == 0) return;
    const double bound = f * s + floor;
    worst = std::max(worst, bound > 0 ? diff / bound : kInf);
  };
  field(state_l(a), state_l(b), g.s_l, 0.0);
  for (std::size_t j = 0; j < d && worst != kInf; ++j)
    field(state_o(a)[j], state_o(b)[j], g.s_o.empty() ? 0.0 : g.s_o[j],
          g.max_o.empty() ? 0.0 : static_cast<double>(k) * kMinNormal * g.max_o[j]);
  return worst;
}

// The same for the normalized outputs out_a, out_b (o / l, d floats) of two merges of parts.
inline double normalized_excess(const float* const* parts, std::size_t k, std::size_t d,
                                const float* out_a, const float* out_b) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const MergeMagnitudes g = merge_magnitudes(parts, k, d);
  const double f = merge_bound_factor(k);
  double worst = 0;
  for (std::size_t j = 0; j < d; ++j) {
    const float x = out_a[j], y = out_b[j];
    if (std::isnan(x) || std::isnan(y) || std::isinf(x) || std::isinf(y) || g.special ||
        g.s_l == 0) {
      if (!same_value(x, y)) return kInf;
      continue;
    }
    const double diff = std::fabs(static_cast<double>(x) - static_cast<double>(y));
    if (diff == 0) continue;
    const double out = std::fabs(static_cast<double>(y));
    const double bound = (f * g.s_o[j] + static_cast<double>(k) * kMinNormal * g.max_o[j]) / g.s_l +
                         out * f + 2.0 * kUlp * out;
    worst = std::max(worst, bound > 0 ? diff / bound : kInf);
  }
  return worst;
}

}  // namespace treeattn::tolerance
