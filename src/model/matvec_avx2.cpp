// The weight row kernel for AVX2 + FMA + F16C: 8 floats per vector, 4 accumulators per (row,
// token); micro-tiles of 4 rows x 3 tokens, one accumulator of the 4 a pass (12 of the 16
// registers accumulate). Compiled with its
// own -m flags; called only when the CPU has AVX2 and FMA.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "model/matvec_targets.hpp"

namespace treeattn::model::detail::avx2 {
namespace {

struct Ops {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int RB1 = 2;  // one token: 2 rows x 4 accumulators in flight
  static constexpr int RB = 4;   // batched: 4 rows x 3 tokens = 12 accumulators a pass
  static constexpr int NT = 3;
  static void pin(V& w) { asm("" : "+x"(w)); }  // as the AVX-512 target's
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_bf16(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static V load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V nib(const uint8_t* qs, int j) {
    const int e = j * W;
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + (e & 15)));
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i n = e < 16 ? _mm_and_si128(b, m) : _mm_and_si128(_mm_srli_epi16(b, 4), m);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n));
  }
  using I = __m256i;
  static I u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I bits(uint32_t mask, int first) {
    const I sh =
        _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(mask)), sh),
                            _mm256_set1_epi32(1));
  }
  static I shr(I v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shl(I v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I and_(I v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static V cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static float f16(uint16_t h) { return _cvtsh_ss(h); }
  static void reduce_add16(const V* v, float* out) {
    for (int i = 0; i < 16; ++i) out[i] = reduce_add(v[i]);
  }
  static float reduce_add(V v) {
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
  }
};

#include "model/matvec_impl.hpp"

}  // namespace
}  // namespace treeattn::model::detail::avx2

namespace treeattn::model::detail {
void rows_avx2(const RowsArgs& a) { avx2::rows_impl(a); }
}  // namespace treeattn::model::detail
