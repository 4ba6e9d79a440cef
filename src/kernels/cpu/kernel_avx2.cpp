// The decode item kernel for AVX2 with FMA and F16C.
//
// Compiled with -mavx2 -mfma -mf16c (see src/kernels/CMakeLists.txt); runs only after
// dispatch.cpp checked the CPU. bf16 widens by a 16-bit shift, f16 by vcvtph2ps, int8 by
// vpmovsxbd + vcvtdq2ps, fp8 by bit placement.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/cpu_targets.hpp"

namespace treeattn::kernels::cpu::avx2 {
namespace {

struct Ops {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kAccRegs = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  // An empty asm that takes v in a ymm register and may change it: the compiler must keep the
  // value there and can no longer fold its load into each FMA that uses it (score_tile).
  static V in_register(V v) {
    asm("" : "+x"(v));
    return v;
  }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // 16 bf16 values from one load: {elements 0, 2, .., 14; elements 1, 3, .., 15} (the low half
  // of a 32-bit lane shifted up, the high half masked), each exactly its float value.
  struct V2 {
    V a, b;
  };
  static V2 load_bf16_pair(const uint16_t* p) {
    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    asm("" : "+x"(w));  // one load: the compiler would otherwise fold a second one into vpand
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(w, high))};
  }
  // {even, odd} -> memory order {elements 0..7, elements 8..15}; deinterleave is its inverse.
  static V2 interleave(V even, V odd) {
    const V lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    return {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
  }
  static V2 deinterleave(V a, V b) {
    const V e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const V o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    constexpr int kOrder = _MM_SHUFFLE(3, 1, 2, 0);  // 64-bit pairs 0, 2, 1, 3
    return {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), kOrder)),
            _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), kOrder))};
  }
  static V load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // FP8 E4M3 as in the AVX-512 target: magnitude bits placed under the exponent, times 2^120.
  static V load_fp8(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const V v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)), _mm256_set1_ps(0x1p120f));
    const V sv = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
    const V nan_lanes = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
    return _mm256_blendv_ps(sv, _mm256_set1_ps(__builtin_nanf("")), nan_lanes);
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // Lane j of the result = sum of the 8 lanes of a[j].
  static V hsum(const V* a) {
    V s[4];
    for (int i = 0; i < 4; ++i)
      s[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    const V u0 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const V u1 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }

  // Same algorithm as the AVX-512 exp; 2^n is built in the exponent field (n in [-126, 127]).
  // exp_clamped: that for xc already in [-87.34, 88]; exp and exp_nonpos add the edges.
  static V exp_clamped(V xc) {
    const V n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    V y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  static V exp(V x) {
    const V xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
    V res = exp_clamped(xc);
    res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ));
    res = _mm256_blendv_ps(res, _mm256_set1_ps(__builtin_inff()),
                           _mm256_cmp_ps(x, _mm256_set1_ps(88.72283f), _CMP_GT_OQ));
    return _mm256_blendv_ps(res, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  // exp(x) for x <= 0, -inf or NaN (the softmax's s - m): exp's bits for every such x, without
  // the clamp and blend above 88 and the NaN blend (max(c, x) returns a NaN x, which the
  // polynomial and the final product keep).
  static V exp_nonpos(V x) {
    const V xc = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
    const V res = exp_clamped(xc);
    return _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ));
  }
};

#include "kernels/cpu/decode_item_impl.hpp"
#include "kernels/cpu/tiled_item_impl.hpp"
#include "kernels/cpu/prefill_block_impl.hpp"

}  // namespace

void decode_item(const ItemArgs& a) { dispatch_item(a); }
void decode_tiled_item(const TiledItemArgs& a) { dispatch_tiled_item(a); }
void prefill_block_item(const TiledItemArgs& a) { dispatch_prefill_block(a); }
void exp_array(const float* in, float* out, int64_t n) { exp_array_impl<false>(in, out, n); }
void exp_nonpos_array(const float* in, float* out, int64_t n) {
  exp_array_impl<true>(in, out, n);
}
float read_stream(const float* p, int64_t n) { return read_stream_impl(p, n); }
float fma_burn(int64_t iters, float seed, double* flops) { return fma_burn_impl(iters, seed, flops); }
float fma_stream(const void* p, int64_t bytes, DType dtype, int rows, int64_t prefetch_bytes,
                 float c) {
  return fma_stream_impl(p, bytes, dtype, rows, prefetch_bytes, c);
}

}  // namespace treeattn::kernels::cpu::avx2
