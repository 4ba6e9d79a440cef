// The weight row kernel for AVX-512 (F, BW, VL, DQ): 16 floats per vector; micro-tiles of 8 rows
// x 3 tokens (24 of the 32 registers accumulate). Compiled with its own -m flags; called only when
// the CPU has AVX-512. GCC 12's AVX-512 conversions start from _mm512_undefined_ps(), which
// -Wmaybe-uninitialized reports as a use of an uninitialized value (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "model/matvec_targets.hpp"

namespace treeattn::model::detail::avx512 {
namespace {

struct Ops {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int RB1 = 4;  // one token: 4 rows x 2 accumulators in flight
  static constexpr int RB = 8;   // batched: 8 rows x 3 tokens = 24 accumulators a pass
  static constexpr int NT = 3;
  // w in a register of its own: GCC would otherwise fold the load into each FMA that uses it
  // (one load per use instead of one).
  static void pin(V& w) { asm("" : "+v"(w)); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_bf16(const uint16_t* p) {
    const __m512i u =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static V load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V nib(const uint8_t* qs, int j) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i n = j == 0 ? _mm_and_si128(b, m) : _mm_and_si128(_mm_srli_epi16(b, 4), m);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n));
  }
  using I = __m512i;
  static I u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I bits(uint32_t mask, int first) {
    const I sh =
        _mm512_add_epi32(_mm512_set1_epi32(first),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(mask)), sh),
                            _mm512_set1_epi32(1));
  }
  static I shr(I v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shl(I v, int n) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I and_(I v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static V cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static float f16(uint16_t h) { return _cvtsh_ss(h); }
  static float reduce_add(V v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
  }
  // reduce_add of 16 vectors at once, its four levels of additions on whole registers:
  //   level 1 (lane i + lane i + 8) on two inputs a register, level 2 (i + i + 4) on four, level
  //   3 (i + i + 2) on eight, level 4 (lane 0 + lane 1) on sixteen, where input q + 4s lands in
  //   lane 4q + s; one permutation puts the sums in input order.
  static void reduce_add16(const V* v, float* out) {
    V u[8], w[4], z[2];
    for (int k = 0; k < 8; ++k)  // [v_2k's 8 | v_2k+1's 8]
      u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; ++m)  // quarter q: v_4m+q's 4
      w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int n = 0; n < 2; ++n)  // quarter q: v_8n+q's 2, then v_8n+4+q's 2
      z[n] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * n], w[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(w[2 * n], w[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const V r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
  }
};

#include "model/matvec_impl.hpp"

}  // namespace
}  // namespace treeattn::model::detail::avx512

namespace treeattn::model::detail {
void rows_avx512(const RowsArgs& a) { avx512::rows_impl(a); }
}  // namespace treeattn::model::detail
