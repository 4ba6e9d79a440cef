// The gated activation on AVX2 + FMA (activation.hpp): 8 floats a vector, the exponential in two
// halves of 4 doubles (the table by a gather). Compiled with its own -m flags (and
// -ffp-contract=off: the scalar tail's products and sums stay separate operations, as the
// baseline loop's).
#include <immintrin.h>

#include "model/activation.hpp"

namespace treeattn::model::detail {
namespace {

// expf_glibc of 4 floats.
__m128 exp4(__m128 x) {
  const __m256d inv = _mm256_set1_pd(std::bit_cast<double>(kExpInvLn2N));
  const __m256d shift = _mm256_set1_pd(std::bit_cast<double>(kExpShift));
  const __m256d xd = _mm256_cvtps_pd(x);
  const __m256d zs = _mm256_fmadd_pd(inv, xd, shift);
  const __m256i ki = _mm256_castpd_si256(zs);
  const __m256d kd = _mm256_sub_pd(zs, shift);
  const __m256d r = _mm256_fmsub_pd(inv, xd, kd);
  const __m256i idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
  const __m256i t =
      _mm256_add_epi64(_mm256_i64gather_epi64(reinterpret_cast<const long long*>(kExpTab), idx, 8),
                       _mm256_slli_epi64(ki, 47));
  const __m256d p = _mm256_fmadd_pd(r, _mm256_set1_pd(std::bit_cast<double>(kExpC0)),
                                    _mm256_set1_pd(std::bit_cast<double>(kExpC1)));
  const __m256d q =
      _mm256_fmadd_pd(r, _mm256_set1_pd(std::bit_cast<double>(kExpC2)), _mm256_set1_pd(1.0));
  const __m256d y =
      _mm256_mul_pd(_mm256_fmadd_pd(p, _mm256_mul_pd(r, r), q), _mm256_castsi256_pd(t));
  return _mm256_cvtpd_ps(y);
}

// expf_glibc of 8 floats: the fast path, then glibc's other cases lane by lane.
__m256 exp8(__m256 x) {
  __m256 y = _mm256_set_m128(exp4(_mm256_extractf128_ps(x, 1)), exp4(_mm256_castps256_ps128(x)));
  const auto lt = [&](uint32_t c) {
    return _mm256_cmp_ps(x, _mm256_set1_ps(std::bit_cast<float>(c)), _CMP_LT_OQ);
  };
  y = _mm256_blendv_ps(y, _mm256_set1_ps(0x1p-149f), lt(kExpMayUnderflow));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), lt(kExpUnderflow));
  y = _mm256_blendv_ps(
      y, _mm256_set1_ps(INFINITY),
      _mm256_cmp_ps(x, _mm256_set1_ps(std::bit_cast<float>(kExpOverflow)), _CMP_GT_OQ));
  return _mm256_blendv_ps(y, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

}  // namespace

void gated_avx2(FfnActivation act, float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  if (act == FfnActivation::kGeluTanh) {
    const __m256 s = _mm256_set1_ps(kGeluS), a = _mm256_set1_ps(kGeluA), m2 = _mm256_set1_ps(-2.0f);
    for (; i + 8 <= n; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 y = _mm256_mul_ps(_mm256_mul_ps(s, g),
                                     _mm256_add_ps(one, _mm256_mul_ps(_mm256_mul_ps(a, g), g)));
      const __m256 e = exp8(_mm256_mul_ps(m2, y));
      _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                               _mm256_loadu_ps(up + i)));
    }
  } else {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp8(_mm256_xor_ps(g, sign));
      _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                               _mm256_loadu_ps(up + i)));
    }
  }
  for (; i < n; ++i) gate[i] = gated_one(act, gate[i], up[i]);
}

void exp_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = expf_glibc(x[i]);
}

}  // namespace treeattn::model::detail
