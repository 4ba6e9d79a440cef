// The integer row kernel's Ops on x86 (matvec_int8_impl.hpp), 256-bit vectors (and, on AVX-512
// VNNI, the K types' batched path's 512-bit wide lanes, kWide). Included by matvec_int8_avx2.cpp
// (AVX2: maddubs + madd), matvec_int8_avxvnni.cpp (AVX-VNNI) and matvec_int8_avx512vnni.cpp
// (AVX-512 VNNI + VL: vpdpbusd on ymm, and on zmm in groupk's WideLanes), each compiled with its
// own -m flags, after defining TREEATTN_INT8_DOT (0, 1, 2) and TREEATTN_INT8_NS (the namespace).
// vpdpbusd sums the products 4i .. 4i+3 into lane i, as madd(maddubs) does, without the int16
// stage (which cannot saturate here), so the three give the same lanes and the same bits.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "model/matvec_targets.hpp"

namespace treeattn::model::detail::TREEATTN_INT8_NS {
namespace {

struct Ops {
  static constexpr int RB = 4;  // rows per pass: 4 accumulators, 4 decoded groups in flight
  // Groups of 8 tokens per pass of the batched paths (group8, groupk): 2 x 4 rows of integer
  // sums need AVX-512 VL's 32 registers.
  static constexpr int NG = TREEATTN_INT8_DOT == 2 ? 2 : 1;
  // Without VNNI the batched K path adds maddubs' int16 pairs in int16 before one madd by the
  // sub-scale (groupk); with VNNI vpdpbusd already sums into int32 in one instruction.
  static constexpr bool kPairAcc = TREEATTN_INT8_DOT == 0;
  using B = __m256i;
  using I = __m256i;
  using V = __m256;
  static B load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store(void* p, B b) { _mm256_storeu_si256(static_cast<__m256i*>(p), b); }
  // The 16 bytes in both halves (one broadcast load), the high half shifted right by 4 bits
  // (64-bit lanes: each byte's high nibble lands low, the next byte's low nibble above it,
  // which the mask drops).
  static B nib(const uint8_t* qs) {
    const __m256i t =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return and_(_mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4)), 0x0f);
  }
  static B and_(B b, uint8_t m) {
    return _mm256_and_si256(b, _mm256_set1_epi8(static_cast<char>(m)));
  }
  static B lo4(B b) { return and_(b, 0x0f); }
  static B hi4(B b) { return and_(_mm256_srli_epi16(b, 4), 0x0f); }
  static B shr(B b, int n) {
    return and_(_mm256_srl_epi16(b, _mm_cvtsi32_si128(n)), static_cast<uint8_t>(0xff >> n));
  }
  static B shl(B b, int n) {
    return and_(_mm256_sll_epi16(b, _mm_cvtsi32_si128(n)), static_cast<uint8_t>(0xff << n));
  }
  static B or_(B a, B b) { return _mm256_or_si256(a, b); }
  // Byte e: 0xff where bit e of m is set (ggml's bytes_from_bits_32).
  static B bitmask(uint32_t m) {
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                            0x0202020202020202, 0x0303030303030303);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
  }
  // Byte e: c[e] | v where bit e of m is set, else c[e] (Q5_0 / Q5_1's fifth bit). AVX-512 BW +
  // VL: one masked blend from a mask register instead of bitmask's shuffle, or and compare.
  static B or_bits(B c, uint32_t m, uint8_t v) {
#if TREEATTN_INT8_DOT == 2
    return _mm256_mask_blend_epi8(static_cast<__mmask32>(m), c, or_(c, splat(v)));
#else
    return or_(c, and_(bitmask(m), v));
#endif
  }
  // acc plus dot_u / dot_s (VNNI fuses the add; AVX2 adds madd(maddubs) to it); the dots alone
  // start from zero (an add of zero the compiler drops).
  static I dpu(I acc, B w, B x) {
#if TREEATTN_INT8_DOT == 1
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#elif TREEATTN_INT8_DOT == 2
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
  }
  static I dps(I acc, B w, B x) { return dpu(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w)); }
  static I dot_u(B w, B x) { return dpu(_mm256_setzero_si256(), w, x); }
  static I dot_s(B w, B x) { return dps(_mm256_setzero_si256(), w, x); }
  // The K types' integer sub-scales: S = 16 int16 (elements 0-7 in the low 128 bits, 8-15 in
  // the high); pairs() = maddubs' 16 int16 pair sums; pick<e0, e1> and madd_acc multiply them by
  // element e0 of the low half (lanes 0-3) and element e1 of the high half (lanes 4-7).
  using S = __m256i;
  static S scales_i8(const int8_t* s) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  // lane i: a[2i] b[2i] + a[2i+1] b[2i+1] (exact int32), b 16 int16
  static I madd16(S a, const int16_t* b) {
    return _mm256_madd_epi16(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  }
  using M = __m128i;  // 8 int16 mins (Q4_K / Q5_K)
  // Q4_K / Q5_K: the 8 scales (S, both halves) and 8 mins (M) from the super-block's 12 packed
  // bytes q (16 bytes are read, 4 past q's end: still inside the super-block). Bytes [sc0-3 |
  // sc4-7 | mn0-3 | mn4-7]: low 6 bits of q[0-3] | low nibbles of q[8-11] | low 6 bits of q[4-7] |
  // high nibbles of q[8-11], with the top 2 bits of q[0-3] (q[4-7]) as bits 4-5 of sc4-7 (mn4-7):
  // ggml's get_scale_min_k4.
  static void unpack_k4(const uint8_t* q, S& sc, M& mn) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i a =
        _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i b =
        _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i lo6 = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i hi4 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
    const __m128i lo =
        _mm_or_si128(_mm_and_si128(a, lo6), _mm_and_si128(_mm_srli_epi16(a, 4), hi4));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30));
    const __m128i u = _mm_or_si128(lo, hi);
    sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(u));
    mn = _mm_cvtepu8_epi16(_mm_srli_si128(u, 8));
  }
  static int k4_msum(M mn, const int16_t* bsum) {
    __m128i p = _mm_madd_epi16(mn, _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsum)));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0x4e));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0xb1));
    return _mm_cvtsi128_si32(p);
  }
  template <int h>
  static S half(S s) {
    return _mm256_permute4x64_epi64(s, h ? 0xee : 0x44);
  }
  static B pairs(B w, B x) { return _mm256_maddubs_epi16(w, x); }
  static B bzero() { return _mm256_setzero_si256(); }
  static B add16(B a, B b) { return _mm256_add_epi16(a, b); }
#if TREEATTN_INT8_DOT == 0
  // One sub-scale of groupk_pairs4 on 4 rows against 8 tokens (AVX2, no VNNI), kGroups 4-code
  // groups: group i's codes of row r at c_r + 4 i (broadcast), the tokens' bytes at x + 32 i;
  // maddubs' int16 pairs summed per row over F groups, then one vpmaddwd by the row's
  // pair16(sc, sc) (at c_r + t + kDecKScales) added into s_r. Written out in asm because what
  // the compiler made of the same intrinsics was far slower on Zen 3: with the sub-scale loop at
  // run time it reassociated the int16 chains into trees and spilled them; unrolled over the
  // super-block, its ~1000 instructions ran slower than the same code in a short loop. With this
  // block BM_Int8InnerAvx2's Q4_K call went from 0.84 to 0.99 maddubs a cycle (best of five;
  // BM_Int8DotPeak: 1.32).
#define TA_X(i) "vmovdqu 32*" #i "(%[x]), %[xv]\n\t"
#define TA_G0(i, r)              \
  "vpbroadcastd 4*" #i "(%[c" #r \
  "]), %[w]\n\t"                 \
  "vpmaddubsw %[xv], %[w], %[a" #r "]\n\t"
#define TA_GN(i, r)                  \
  "vpbroadcastd 4*" #i "(%[c" #r     \
  "]), %[w]\n\t"                     \
  "vpmaddubsw %[xv], %[w], %[w]\n\t" \
  "vpaddw %[w], %[a" #r "], %[a" #r "]\n\t"
#define TA_FIRST(i) TA_X(i) TA_G0(i, 0) TA_G0(i, 1) TA_G0(i, 2) TA_G0(i, 3)
#define TA_NEXT(i) TA_X(i) TA_GN(i, 0) TA_GN(i, 1) TA_GN(i, 2) TA_GN(i, 3)
#define TA_FL(r)               \
  "vpbroadcastd %c[so](%[c" #r \
  "],%[t],1), %[w]\n\t"        \
  "vpmaddwd %[w], %[a" #r      \
  "], %[w]\n\t"                \
  "vpaddd %[w], %[s" #r "], %[s" #r "]\n\t"
#define TA_FLUSH TA_FL(0) TA_FL(1) TA_FL(2) TA_FL(3)
#define TA_F1(r)             \
  "vpmaddwd %[ones], %[a" #r \
  "], %[w]\n\t"              \
  "vpaddd %[w], %[s" #r "], %[s" #r "]\n\t"
#define TA_FLUSH1 TA_F1(0) TA_F1(1) TA_F1(2) TA_F1(3)
#define TA_OUT                                                                      \
  : [a0] "=&x"(a0), [a1] "=&x"(a1), [a2] "=&x"(a2), [a3] "=&x"(a3), [xv] "=&x"(xv),        \
    [w] "=&x"(w), [s0] "+x"(s[0]), [s1] "+x"(s[1]), [s2] "+x"(s[2]), [s3] "+x"(s[3])
#define TA_IN : [x] "r"(x), [c0] "r"(c[0]), [c1] "r"(c[1]), [c2] "r"(c[2]), [c3] "r"(c[3])
#define TA_OPERANDS TA_OUT TA_IN, [t] "r"(t), [so] "i"(so) : "memory"
#define TA_OPERANDS1 TA_OUT TA_IN, [ones] "x"(ones) : "memory"
  template <int kGroups, int F, int so>
  static void pair_subscale4(const int8_t* x, const uint8_t* const* c, int64_t t, I* s) {
    B a0, a1, a2, a3, xv, w;
    if constexpr (kGroups == 8 && F == 8)  // Q4_K
      __asm__(TA_FIRST(0) TA_NEXT(1) TA_NEXT(2) TA_NEXT(3) TA_NEXT(4) TA_NEXT(5) TA_NEXT(6)
                  TA_NEXT(7) TA_FLUSH TA_OPERANDS);
    else if constexpr (kGroups == 8 && F == 4)  // Q5_K
      __asm__(TA_FIRST(0) TA_NEXT(1) TA_NEXT(2) TA_NEXT(3) TA_FLUSH TA_FIRST(4) TA_NEXT(5)
                  TA_NEXT(6) TA_NEXT(7) TA_FLUSH TA_OPERANDS);
    else if constexpr (kGroups == 4 && F == 2)  // Q6_K
      __asm__(TA_FIRST(0) TA_NEXT(1) TA_FLUSH TA_FIRST(2) TA_NEXT(3) TA_FLUSH TA_OPERANDS);
    else
      static_assert(kGroups < 0, "no pair_subscale4 for this sub-scale and flush");
  }
  // The same for one 32-value block of the unsigned 32-value types (group8_pairs4: Q4_0, Q4_1
  // F = 8; Q5_0, Q5_1 F = 4), its 8 groups at c_r + 4 i and x + 32 i, the int16 pairs summed
  // over F groups and widened by one vpmaddwd by pair16(1, 1) (ones) into s_r.
  template <int F>
  static void pair_block4(const int8_t* x, const uint8_t* const* c, I ones, I* s) {
    B a0, a1, a2, a3, xv, w;
    if constexpr (F == 8)
      __asm__(TA_FIRST(0) TA_NEXT(1) TA_NEXT(2) TA_NEXT(3) TA_NEXT(4) TA_NEXT(5) TA_NEXT(6)
                  TA_NEXT(7) TA_FLUSH1 TA_OPERANDS1);
    else if constexpr (F == 4)
      __asm__(TA_FIRST(0) TA_NEXT(1) TA_NEXT(2) TA_NEXT(3) TA_FLUSH1 TA_FIRST(4) TA_NEXT(5)
                  TA_NEXT(6) TA_NEXT(7) TA_FLUSH1 TA_OPERANDS1);
    else
      static_assert(F < 0, "no pair_block4 for this flush");
  }
  // The same on 4 rows against 16 tokens (two groups of 8: x and x + xs), so that each broadcast
  // of a row's 4 codes serves two maddubs: per group 2 loads, 4 broadcasts, 8 maddubs and 8 adds
  // instead of twice 1, 4, 4, 4. The 8 int16 sums and the 4 operands take 12 of the 16
  // registers, so the first group's S stays in registers (s_r, as in pair_subscale4) and the
  // second's lives in memory, sm[r] (int32 x 8, 32-byte aligned, added to like s_r). volatile:
  // sm is written through memory. (Both in memory measured slower in
  // BM_Int8InnerAvx2.) The same integers per token as pair_subscale4.
#define TB_X(i)       \
  "vmovdqu 32*" #i    \
  "(%[x]), %[xv]\n\t" \
  "vmovdqu 32*" #i "(%[x],%[xs],1), %[xw]\n\t"
#define TB_G0(i, r)                \
  "vpbroadcastd 4*" #i "(%[c" #r   \
  "]), %[w]\n\t"                   \
  "vpmaddubsw %[xv], %[w], %[a" #r \
  "]\n\t"                          \
  "vpmaddubsw %[xw], %[w], %[b" #r "]\n\t"
#define TB_GN(i, r)                  \
  "vpbroadcastd 4*" #i "(%[c" #r     \
  "]), %[w]\n\t"                     \
  "vpmaddubsw %[xv], %[w], %[p]\n\t" \
  "vpaddw %[p], %[a" #r "], %[a" #r  \
  "]\n\t"                            \
  "vpmaddubsw %[xw], %[w], %[p]\n\t" \
  "vpaddw %[p], %[b" #r "], %[b" #r "]\n\t"
#define TB_FIRST(i) TB_X(i) TB_G0(i, 0) TB_G0(i, 1) TB_G0(i, 2) TB_G0(i, 3)
#define TB_NEXT(i) TB_X(i) TB_GN(i, 0) TB_GN(i, 1) TB_GN(i, 2) TB_GN(i, 3)
#define TB_FL(r)                    \
  "vpbroadcastd %c[so](%[c" #r      \
  "],%[t],1), %[w]\n\t"             \
  "vpmaddwd %[w], %[a" #r           \
  "], %[p]\n\t"                     \
  "vpaddd %[p], %[s" #r "], %[s" #r \
  "]\n\t"                           \
  "vpmaddwd %[w], %[b" #r           \
  "], %[p]\n\t"                     \
  "vpaddd 32*" #r                   \
  "(%[sm]), %[p], %[p]\n\t"         \
  "vmovdqa %[p], 32*" #r "(%[sm])\n\t"
#define TB_FLUSH TB_FL(0) TB_FL(1) TB_FL(2) TB_FL(3)
#define TB_OPERANDS                                                                 \
  : [a0] "=&x"(a0), [a1] "=&x"(a1), [a2] "=&x"(a2), [a3] "=&x"(a3), [b0] "=&x"(b0),         \
    [b1] "=&x"(b1), [b2] "=&x"(b2), [b3] "=&x"(b3), [xv] "=&x"(xv), [xw] "=&x"(xw),        \
    [w] "=&x"(w), [p] "=&x"(p), [s0] "+x"(s[0]), [s1] "+x"(s[1]), [s2] "+x"(s[2]),         \
    [s3] "+x"(s[3])                                                                         \
  : [x] "r"(x), [xs] "r"(xs), [c0] "r"(c[0]), [c1] "r"(c[1]), [c2] "r"(c[2]),              \
    [c3] "r"(c[3]), [t] "r"(t), [so] "i"(so), [sm] "r"(sm)                                  \
  : "memory"
  template <int kGroups, int F, int so>
  static void pair_subscale4x2(const int8_t* x, int64_t xs, const uint8_t* const* c, int64_t t,
                               I* s, int32_t* sm) {
    B a0, a1, a2, a3, b0, b1, b2, b3, xv, xw, w, p;
    if constexpr (kGroups == 8 && F == 8)  // Q4_K
      __asm__ volatile(TB_FIRST(0) TB_NEXT(1) TB_NEXT(2) TB_NEXT(3) TB_NEXT(4) TB_NEXT(5) TB_NEXT(6)
                           TB_NEXT(7) TB_FLUSH TB_OPERANDS);
    else if constexpr (kGroups == 8 && F == 4)  // Q5_K
      __asm__ volatile(TB_FIRST(0) TB_NEXT(1) TB_NEXT(2) TB_NEXT(3) TB_FLUSH TB_FIRST(4) TB_NEXT(5)
                           TB_NEXT(6) TB_NEXT(7) TB_FLUSH TB_OPERANDS);
    else if constexpr (kGroups == 4 && F == 2)  // Q6_K
      __asm__ volatile(TB_FIRST(0) TB_NEXT(1) TB_FLUSH TB_FIRST(2) TB_NEXT(3) TB_FLUSH TB_OPERANDS);
    else
      static_assert(kGroups < 0, "no pair_subscale4x2 for this sub-scale and flush");
  }
#undef TB_X
#undef TB_G0
#undef TB_GN
#undef TB_FIRST
#undef TB_NEXT
#undef TB_FL
#undef TB_FLUSH
#undef TB_OPERANDS
#undef TA_X
#undef TA_G0
#undef TA_GN
#undef TA_FIRST
#undef TA_NEXT
#undef TA_FL
#undef TA_FLUSH
#undef TA_F1
#undef TA_FLUSH1
#undef TA_OUT
#undef TA_IN
#undef TA_OPERANDS
#undef TA_OPERANDS1
#endif
  // The sub-scale operand of madd_acc: element e0 of the low half in the int16 pairs of lanes
  // 0-3, e1 of the high half in lanes 4-7 (picked once per row and chunk, shared by the tokens).
  using P = __m256i;
  template <int e0, int e1>
  static P pick(S s) {
    constexpr char a0 = 2 * e0, a1 = 2 * e0 + 1, b0 = 2 * e1, b1 = 2 * e1 + 1;
    const __m256i m =
        _mm256_setr_epi8(a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, b0, b1, b0,
                         b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1);
    return _mm256_shuffle_epi8(s, m);
  }
  // acc + lane i = p[2i] * sc + p[2i+1] * sc (exact int32; VNNI's vpdpwssd fuses the add).
  static I madd_acc(I acc, B p, P sc) {
#if TREEATTN_INT8_DOT == 1
    return _mm256_dpwssd_avx_epi32(acc, p, sc);
#elif TREEATTN_INT8_DOT == 2
    return _mm256_dpwssd_epi32(acc, p, sc);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
#endif
  }
  // acc + lane i of p[2i] * lo + p[2i+1] * hi: p as 16 int16, (lo, hi) the int16 halves of pr
  // (exact int32; VNNI's vpdpwssd fuses the add).
  static I madd_pairs(I acc, B p, int32_t pr) { return madd_acc(acc, p, _mm256_set1_epi32(pr)); }
  static I mul_s(I v, int32_t s) { return _mm256_mullo_epi32(v, _mm256_set1_epi32(s)); }
  // Rows in lanes (the rows8 records): 8 bytes to 8 int32 lanes (zero / sign
  // extension), 16 bytes to 16 int16 (zero extension), 8 f16 to floats, lane products (exact
  // here), an int32 in every lane.
  static I u8to32(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I s8to32(const uint8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static B u8to16(const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V f16x8(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I mul_i(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I iset1(int32_t v) { return _mm256_set1_epi32(v); }
  // Tokens in lanes (the batched paths): the 4 bytes at p in every lane; lane
  // sums; int32 lanes shifted left; loads and a product.
  static B bcast4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static int hsum(I v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
  // The one-token pass's 4 rows with rows in lanes: the lane sums of p0 .. p3 (exact int32) as 4
  // floats (rounded to nearest even, as static_cast<float>; exact below 2^24, which the 32-value
  // types' sums are); 4 floats; a multiply, a fused multiply-add and a sum.
  static constexpr bool kRows4 = true;
  using F4 = __m128;
  static F4 sums4(I p0, I p1, I p2, I p3) {
    // Unpacks and adds (vphaddd made the Q8_0 one-token pass ~30% slower on Zen 4).
    const __m256i s01 =
        _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
    const __m256i s23 =
        _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
    const __m256i t =
        _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
    return _mm_cvtepi32_ps(
        _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
  }
  static F4 set4(float a, float b, float c, float d) { return _mm_setr_ps(a, b, c, d); }
  static F4 load4(const float* p) { return _mm_loadu_ps(p); }
  static F4 f16x4(uint16_t a, uint16_t b, uint16_t c, uint16_t d) {
    return _mm_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(a), static_cast<int16_t>(b),
                                       static_cast<int16_t>(c), static_cast<int16_t>(d), 0, 0, 0,
                                       0));
  }
  // The K types' (d, dmin) f16 pairs of 4 rows (the 4 bytes at p0 .. p3) as floats: d in d4,
  // dmin in m4, row r in element r.
  static void f16pairs4(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, const uint8_t* p3,
                        F4& d4, F4& m4) {
    int32_t w[4];
    std::memcpy(w, p0, 4);
    std::memcpy(w + 1, p1, 4);
    std::memcpy(w + 2, p2, 4);
    std::memcpy(w + 3, p3, 4);
    const __m256 v = _mm256_cvtph_ps(_mm_setr_epi32(w[0], w[1], w[2], w[3]));
    const __m256 t = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    d4 = _mm256_castps256_ps128(t);
    m4 = _mm256_extractf128_ps(t, 1);
  }
  // k4_msum of 4 rows at once, as floats (exact: |msum| < 2^24).
  static F4 msums4(M m0, M m1, M m2, M m3, const int16_t* bsum) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsum));
    const __m128i p0 = _mm_madd_epi16(m0, b), p1 = _mm_madd_epi16(m1, b);
    const __m128i p2 = _mm_madd_epi16(m2, b), p3 = _mm_madd_epi16(m3, b);
    const __m128i s01 = _mm_add_epi32(_mm_unpacklo_epi32(p0, p1), _mm_unpackhi_epi32(p0, p1));
    const __m128i s23 = _mm_add_epi32(_mm_unpacklo_epi32(p2, p3), _mm_unpackhi_epi32(p2, p3));
    return _mm_cvtepi32_ps(
        _mm_add_epi32(_mm_unpacklo_epi64(s01, s23), _mm_unpackhi_epi64(s01, s23)));
  }
  static F4 neg4(F4 a) { return _mm_xor_ps(a, _mm_set1_ps(-0.0f)); }
  static F4 zero4() { return _mm_setzero_ps(); }
  static F4 mul4(F4 a, F4 b) { return _mm_mul_ps(a, b); }
  static F4 fma4(F4 a, F4 b, F4 c) { return _mm_fmadd_ps(a, b, c); }
  static F4 add4(F4 a, F4 b) { return _mm_add_ps(a, b); }
  static void store4(float* p, F4 v) { _mm_storeu_ps(p, v); }
  static I ishl(I v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I iload(const int32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static V vload(const float* p) { return _mm256_loadu_ps(p); }
  static void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
  // Rows r .. r + 3 of 8 tokens (a, b, c, d: one row each, tokens in lanes) into y[t * stride +
  // r ..]: a 4 x 4 transpose per 128-bit half, then 4 floats a token (where the scalar loop
  // stored them one by one).
  static void store_t4(float* y, int64_t stride, V a, V b, V c, V d) {
    const V t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
    const V t2 = _mm256_unpacklo_ps(c, d), t3 = _mm256_unpackhi_ps(c, d);
    const V u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                    _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int j = 0; j < 4; ++j) {
      _mm_storeu_ps(y + j * stride, _mm256_castps256_ps128(u[j]));
      _mm_storeu_ps(y + (4 + j) * stride, _mm256_extractf128_ps(u[j], 1));
    }
  }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V vadd(V a, V b) { return _mm256_add_ps(a, b); }
  static I izero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static B splat(uint8_t v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static B flip(B b) { return _mm256_xor_si256(b, splat(0x80)); }  // each byte's top bit
  static V cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float f16(uint16_t h) { return _cvtsh_ss(h); }

  // Wide lanes (the batched paths' WideLanes: group8, groupk): two groups of 8 tokens in one
  // zmm, so each vpdpbusd does 64 products where the ymm one does 32. Zen 4 runs a zmm operation
  // as two ymm halves, so the peak is the same; what halves is the instructions per product
  // (broadcasts, loads, multiplies and adds of the sub-scales, the float tail), which bounded
  // the ymm form. Lane by lane the same integer and float operations, so the same bits.
#if TREEATTN_INT8_DOT == 2
  // (GCC 12's 512-bit intrinsics pass an undefined vector to their builtins: a false
  // (maybe-)uninitialized.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
  static constexpr bool kWide = true;
  using W = __m512i;
  using WV = __m512;
  static W wzero() { return _mm512_setzero_si512(); }
  static W wload2(const void* lo, const void* hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load(lo)), load(hi), 1);
  }
  static W wbcast4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static W wdpu(W acc, W w, W x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static W wsub(W a, W b) { return _mm512_sub_epi32(a, b); }
  static W wshl(W a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
  static W wmul_s(W v, int32_t s) { return _mm512_mullo_epi32(v, _mm512_set1_epi32(s)); }
  static W wadd(W a, W b) { return _mm512_add_epi32(a, b); }
  static W wmadd_pairs(W acc, W p, int32_t pr) {
    return _mm512_dpwssd_epi32(acc, p, _mm512_set1_epi32(pr));
  }
  static WV wvload2(const float* lo, const float* hi) {
    return _mm512_castsi512_ps(wload2(lo, hi));
  }
  static WV wvzero() { return _mm512_setzero_ps(); }
  static WV wvset1(float x) { return _mm512_set1_ps(x); }
  static WV wvmul(WV a, WV b) { return _mm512_mul_ps(a, b); }
  static WV wvadd(WV a, WV b) { return _mm512_add_ps(a, b); }
  static WV wvfma(WV a, WV b, WV c) { return _mm512_fmadd_ps(a, b, c); }
  static WV wcvt(W v) { return _mm512_cvtepi32_ps(v); }
  static void wvstore(float* p, WV v) { _mm512_storeu_ps(p, v); }
  // store_t4 on 16 tokens: the two 8-token halves.
  static void wstore_t4(float* y, int64_t stride, WV a, WV b, WV c, WV d) {
    const auto hi = [](WV v) {
      return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    };
    store_t4(y, stride, _mm512_castps512_ps256(a), _mm512_castps512_ps256(b),
             _mm512_castps512_ps256(c), _mm512_castps512_ps256(d));
    store_t4(y + 8 * stride, stride, hi(a), hi(b), hi(c), hi(d));
  }

#pragma GCC diagnostic pop
#else
  static constexpr bool kWide = false;
#endif
  // The K types' batched path on the tile unit (matvec_int8_amx.hpp): the AMX target only.
#if defined(TREEATTN_INT8_AMX)
  static constexpr bool kAmx = true;
#else
  static constexpr bool kAmx = false;
#endif
};

#include "model/matvec_int8_impl.hpp"
#if defined(TREEATTN_INT8_AMX)
#include "model/matvec_int8_amx.hpp"
#endif

}  // namespace
}  // namespace treeattn::model::detail::TREEATTN_INT8_NS
