// The gated activation on AVX2 + FMA (activation.hpp): 8 floats a vector (the loops of
// activation_impl.hpp), the exponential in two halves of 4 doubles (the table by a gather).
// Compiled with its own -m flags (and -ffp-contract=off: the scalar tail's products and sums stay
// separate operations, as the baseline loop's).
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

struct Ops {
  using V = __m256;
  static constexpr int kW = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V neg(V v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }  // -v
  static V exp(V v) { return exp8(v); }
};

#include "model/activation_impl.hpp"

}  // namespace

void gated_avx2(FfnActivation act, float* gate, const float* up, int64_t n) {
  gated_body(act, gate, up, n);
}

void exp_avx2(const float* x, float* y, int64_t n) { exp_body(x, y, n); }

}  // namespace treeattn::model::detail
