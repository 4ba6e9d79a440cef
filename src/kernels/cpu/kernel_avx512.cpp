// The decode item kernel for AVX-512 (F, BW, VL, DQ) with FMA and F16C.
//
// This file is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c (see
// src/kernels/CMakeLists.txt) and only runs after dispatch.cpp checked the CPU. bf16 widens by
// a 16-bit shift (in the tiled kernel 32 values per load, a shift and a mask), f16 by
// vcvtph2ps, int8 by vpmovsxbd + vcvtdq2ps, fp8 by bit placement; exp uses a Cephes-style
// polynomial and vscalefps.
// GCC 12's AVX-512 shuffles start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// reports at every inlined use (GCC bug 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/cpu_targets.hpp"

namespace treeattn::kernels::cpu::avx512 {
namespace {

struct Ops {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kAccRegs = 16;
  static V in_register(V v) { return v; }  // left to the compiler: not measured on AVX-512
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // bf16 in pairs (tiled_item_impl.hpp): 32 values from one load, the even-indexed ones by a
  // shift, the odd-indexed ones by a mask (no zero extension, which is a shuffle).
  struct V2 {
    V a, b;
  };
  static V2 load_bf16_pair(const uint16_t* p) {
    __m512i w = _mm512_loadu_si512(p);
    asm("" : "+v"(w));  // one load: the compiler would otherwise fold a second one into vpandd
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(w, high))};
  }
  // {even, odd} -> memory order {elements 0..15, elements 16..31}; deinterleave is its inverse.
  static V2 interleave(V even, V odd) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    return {_mm512_permutex2var_ps(even, lo, odd), _mm512_permutex2var_ps(even, hi, odd)};
  }
  static V2 deinterleave(V a, V b) {
    const __m512i ev =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od =
        _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return {_mm512_permutex2var_ps(a, ev, b), _mm512_permutex2var_ps(a, od, b)};
  }
  static V load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // FP8 E4M3: the 7 magnitude bits under the float exponent field read as 2^-120 times the
  // value (subnormal codes become float subnormals), times 2^120 exactly; S.1111.111 is NaN.
  static V load_fp8(const uint8_t* p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const V v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)), _mm512_set1_ps(0x1p120f));
    const V sv = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), sv,
                                _mm512_set1_ps(__builtin_nanf("")));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }

  // Lane j of the result = sum of the 16 lanes of a[j] (transposing reduction, 45 ops).
  static V hsum(const V* a) {
    V u[4];
    for (int g = 0; g < 4; ++g) {
      const V* v = a + 4 * g;
      const V s01 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
      const V s23 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
      u[g] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // u[g] 128-bit block k holds the block-k partial sums of a[4g .. 4g+3].
    const V w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const V w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // exp(x) = 2^n * e^r, n = round(x log2 e), r = x - n ln 2 (two-part ln 2), e^r by the Cephes
  // expf polynomial evaluated so that r = 0 gives exactly 1. Below ln(FLT_MIN) the result is
  // 0, above ln(FLT_MAX) +inf, NaN stays NaN.
  // exp_clamped: that for xc already in [-87.34, 88]; exp and exp_nonpos add the edges.
  static V exp_clamped(V xc) {
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    V y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
  }
  static V exp(V x) {
    const V xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.0f));
    V res = exp_clamped(xc);
    res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ), res,
                               _mm512_setzero_ps());
    res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283f), _CMP_GT_OQ), res,
                               _mm512_set1_ps(__builtin_inff()));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), res, x);
  }
  // exp(x) for x <= 0, -inf or NaN (the softmax's s - m): exp's bits for every such x, in 16
  // operations instead of 22. max(c, x) returns x when x is NaN (vmaxps returns its second
  // operand), so a NaN flows through the polynomial; nothing overflows, so no clamp above.
  static V exp_nonpos(V x) {
    const V xc = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x);
    const V res = exp_clamped(xc);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ), res,
                                _mm512_setzero_ps());
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

}  // namespace treeattn::kernels::cpu::avx512
