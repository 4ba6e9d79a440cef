// The gated activation on AVX-512 (F, DQ, VL) (activation.hpp): 16 floats a vector (the loops of
// activation_impl.hpp), the exponential in two halves of 8 doubles (the 32-entry table by two
// two-register permutes).
// Compiled with its own -m flags (and -ffp-contract=off, as activation_avx2.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "model/activation.hpp"

namespace treeattn::model::detail {
namespace {

// expf_glibc's fast path of 8 floats.
__m256 exp8_fast(__m256 x) {
  const __m512d inv = _mm512_set1_pd(std::bit_cast<double>(kExpInvLn2N));
  const __m512d shift = _mm512_set1_pd(std::bit_cast<double>(kExpShift));
  const __m512d xd = _mm512_cvtps_pd(x);
  const __m512d zs = _mm512_fmadd_pd(inv, xd, shift);
  const __m512i ki = _mm512_castpd_si512(zs);
  const __m512d kd = _mm512_sub_pd(zs, shift);
  const __m512d r = _mm512_fmsub_pd(inv, xd, kd);
  // kExpTab[ki % 32]: bits 0-3 pick one of 16 entries of two registers, bit 4 the pair.
  const auto* tab = reinterpret_cast<const long long*>(kExpTab);
  const __m512i lo =
      _mm512_permutex2var_epi64(_mm512_loadu_si512(tab), ki, _mm512_loadu_si512(tab + 8));
  const __m512i hi =
      _mm512_permutex2var_epi64(_mm512_loadu_si512(tab + 16), ki, _mm512_loadu_si512(tab + 24));
  const __mmask8 upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
  const __m512i t =
      _mm512_add_epi64(_mm512_mask_blend_epi64(upper, lo, hi), _mm512_slli_epi64(ki, 47));
  const __m512d p = _mm512_fmadd_pd(r, _mm512_set1_pd(std::bit_cast<double>(kExpC0)),
                                    _mm512_set1_pd(std::bit_cast<double>(kExpC1)));
  const __m512d q =
      _mm512_fmadd_pd(r, _mm512_set1_pd(std::bit_cast<double>(kExpC2)), _mm512_set1_pd(1.0));
  const __m512d y =
      _mm512_mul_pd(_mm512_fmadd_pd(p, _mm512_mul_pd(r, r), q), _mm512_castsi512_pd(t));
  return _mm512_cvtpd_ps(y);
}

// expf_glibc of 16 floats: the fast path, then glibc's other cases lane by lane.
__m512 exp16(__m512 x) {
  __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(exp8_fast(_mm512_castps512_ps256(x))),
                                exp8_fast(_mm512_extractf32x8_ps(x, 1)), 1);
  const auto c = [](uint32_t v) { return _mm512_set1_ps(std::bit_cast<float>(v)); };
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, c(kExpMayUnderflow), _CMP_LT_OQ), y,
                           _mm512_set1_ps(0x1p-149f));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, c(kExpUnderflow), _CMP_LT_OQ), y,
                           _mm512_setzero_ps());
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, c(kExpOverflow), _CMP_GT_OQ), y,
                           _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, _mm512_add_ps(x, x));
}

struct Ops {
  using V = __m512;
  static constexpr int kW = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V neg(V v) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
  }  // -v
  static V exp(V v) { return exp16(v); }
};

#include "model/activation_impl.hpp"

}  // namespace

void gated_avx512(FfnActivation act, float* gate, const float* up, int64_t n) {
  gated_body(act, gate, up, n);
}

void exp_avx512(const float* x, float* y, int64_t n) { exp_body(x, y, n); }

}  // namespace treeattn::model::detail
