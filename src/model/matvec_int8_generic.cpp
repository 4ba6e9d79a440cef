// The integer row kernel for any CPU (matvec_int8_impl.hpp): plain C++ on arrays of 32 bytes and
// 8 lanes; the lanes are summed as the SIMD targets sum them (lane i: products 4i .. 4i+3) and
// the floats take the same operations (std::fma, the AVX2 reduction order), so this target's
// bits are the SIMD targets' bits. Also: quantize_activations, which every target reads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "model/matvec_targets.hpp"
#include "treeattn/kernel.hpp"

namespace treeattn::model::detail {

namespace {

// One block of n activations (n a multiple of 32): amax = max |x|, d = amax / 127 (rounded once),
// q = round-to-nearest-even(x / d) (one division, rounded once) clamped to [-127, 127]; d = 0
// gives q = 0. A NaN or infinite x: q = 0 and d = NaN (that token's outputs are NaN; the float
// path gives NaN or infinity there).
inline __attribute__((always_inline)) float quantize_block(const float* xb, int n, int8_t* q) {
  // 8 lanes of running maxima and a per-lane sum of x - x (0 for a finite x, NaN for an infinite
  // or NaN one, and NaN stays NaN) for the non-finite check, in GCC's vector extensions so that
  // every variant's loop is vector code: written as scalar lanes with an integer flag from a
  // comparison, GCC 12 kept it scalar (~5 instructions an element, 5-8% of a 1536-column prefill
  // call). The max of finite values does not depend on the order.
  using F8 = float __attribute__((vector_size(32)));
  using I8 = int32_t __attribute__((vector_size(32)));
  F8 m = {}, z = {};
  for (int i = 0; i < n; i += 8) {  // n: 32 or 256
    F8 v;
    std::memcpy(&v, xb + i, sizeof(v));
    const F8 a = reinterpret_cast<F8>(reinterpret_cast<I8>(v) & 0x7fffffff);
    m = a > m ? a : m;
    z += v - v;
  }
  float amax = 0.0f;
  bool bad = false;
  for (int j = 0; j < 8; ++j) {
    amax = std::max(amax, m[j]);
    bad = bad || z[j] != 0.0f;
  }
  if (bad) {
    std::memset(q, 0, static_cast<std::size_t>(n));
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float d = amax / 127.0f;
  if (!(d > 0.0f)) {
    std::memset(q, 0, static_cast<std::size_t>(n));
    return d;
  }
  for (int i0 = 0; i0 < n; i0 += 32) {
    // |x / d| <= 127 (1 + 2^-24) rounded, so (v + 1.5 * 2^23) - 1.5 * 2^23 is v rounded to the
    // nearest integer, ties to even, in the default rounding mode (as nearbyint; the compiler
    // may not fold it: no -ffast-math), and the loop vectorizes.
    float v[32];
    for (int i = 0; i < 32; ++i) {
      const float r = (xb[i0 + i] / d + 0x1.8p23f) - 0x1.8p23f;
      v[i] = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
    }
    for (int i = 0; i < 32; ++i) q[i0 + i] = static_cast<int8_t>(v[i]);
  }
  return d;
}

inline __attribute__((always_inline)) int block_sum(const int8_t* q) {
  int sum = 0;
  for (int i = 0; i < 32; ++i) sum += q[i];
  return sum;
}

}  // namespace

void activation_sums(const ActBlock* xq, int64_t blocks, int32_t* out) {
  for (int64_t b = 0; b < blocks; ++b) out[b] = block_sum(xq[b].q);
}

namespace {
// The two quantizations, compiled below once per x86 vector width (quantize_variants).
inline __attribute__((always_inline)) void quantize32_body(const float* x, int64_t cols,
                                                           ActBlock* out) {
  for (int64_t b = 0; b < cols / 32; ++b) {
    ActBlock& o = out[b];
    o.d = quantize_block(x + b * 32, 32, o.q);
    o.s = std::isnan(o.d) ? o.d : o.d * static_cast<float>(block_sum(o.q));
  }
}

inline __attribute__((always_inline)) void quantizek_body(const float* x, int64_t cols,
                                                          ActBlockK* out) {
  for (int64_t b = 0; b < cols / 256; ++b) {
    ActBlockK& o = out[b];
    o.d = quantize_block(x + b * 256, 256, o.q);
    for (int j = 0; j < 16; ++j) {
      int sum = 0;
      for (int e = 0; e < 16; ++e) sum += o.q[16 * j + e];
      o.bsum16[j] = static_cast<int16_t>(sum);
    }
    for (int j = 0; j < 8; ++j)
      o.bsum[j] = static_cast<int16_t>(o.bsum16[2 * j] + o.bsum16[2 * j + 1]);
  }
}

void quantize32_default(const float* x, int64_t cols, ActBlock* out) {
  quantize32_body(x, cols, out);
}
void quantizek_default(const float* x, int64_t cols, ActBlockK* out) {
  quantizek_body(x, cols, out);
}
#if defined(__x86_64__)
__attribute__((target("avx2"))) void quantize32_avx2(const float* x, int64_t cols, ActBlock* out) {
  quantize32_body(x, cols, out);
}
__attribute__((target("avx2"))) void quantizek_avx2(const float* x, int64_t cols, ActBlockK* out) {
  quantizek_body(x, cols, out);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void quantize32_avx512(
    const float* x, int64_t cols, ActBlock* out) {
  quantize32_body(x, cols, out);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void quantizek_avx512(
    const float* x, int64_t cols, ActBlockK* out) {
  quantizek_body(x, cols, out);
}
#endif

const QuantizeVariant& best_quantize() {
  static const QuantizeVariant v = quantize_variants().back();
  return v;
}
}  // namespace

std::vector<QuantizeVariant> quantize_variants() {
  std::vector<QuantizeVariant> v = {{"default", quantize32_default, quantizek_default}};
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) v.push_back({"avx2", quantize32_avx2, quantizek_avx2});
  if (isa_supported(Isa::kAvx512)) v.push_back({"avx512", quantize32_avx512, quantizek_avx512});
#endif
  return v;
}

void quantize_activations(const float* x, int64_t cols, ActBlock* out) {
  best_quantize().q32(x, cols, out);
}

namespace {
// Groups of 8 tokens, block by block: out[g * blocks + b] zeroed, then put(o, x, t) for each of
// its tokens t (x: the token's block b); tokens past the end stay zero.
template <class Out, class In, class Put>
void transpose_groups(const In* x, int64_t x_stride, int64_t tokens, int64_t blocks, Out* out,
                      Put put) {
  for (int64_t g = 0; g < (tokens + 7) / 8; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      Out& o = out[g * blocks + b];
      std::memset(&o, 0, sizeof(o));
      for (int64_t t = 0; t < 8 && 8 * g + t < tokens; ++t)
        put(o, x[(8 * g + t) * x_stride + b], static_cast<int>(t));
    }
}
}  // namespace

void transpose_activations(const ActBlock* xq, int64_t xq_stride, int64_t tokens, int64_t blocks,
                           ActBlock8* out) {
  transpose_groups(xq, xq_stride, tokens, blocks, out, [](ActBlock8& o, const ActBlock& x, int t) {
    for (int i = 0; i < 8; ++i) std::memcpy(&o.q[i][4 * t], x.q + 4 * i, 4);
    o.d[t] = x.d;
    o.s[t] = x.s;
    o.sum[t] = block_sum(x.q);
  });
}

void quantize_activations_k(const float* x, int64_t cols, ActBlockK* out) {
  best_quantize().qk(x, cols, out);
}

void transpose_activations_k(const ActBlockK* xk, int64_t xk_stride, int64_t tokens, int64_t blocks,
                             ActBlockK8* out) {
  transpose_groups(xk, xk_stride, tokens, blocks, out,
                   [](ActBlockK8& o, const ActBlockK& x, int t) {
                     for (int i = 0; i < 64; ++i) std::memcpy(&o.q[i][4 * t], x.q + 4 * i, 4);
                     o.d[t] = x.d;
                     for (int j = 0; j < 16; ++j) o.s16[j / 2][2 * t + j % 2] = x.bsum16[j];
                     for (int j = 0; j < 8; ++j) o.s32[j / 2][2 * t + j % 2] = x.bsum[j];
                   });
}

bool int8_type(uint32_t type) {
  switch (type) {
    case kTypeQ8_0:
    case kTypeQ4_0:
    case kTypeQ4_1:
    case kTypeQ5_0:
    case kTypeQ5_1:
    case kTypeQ4_K:
    case kTypeQ5_K:
    case kTypeQ6_K:
      return true;
    default:
      return false;
  }
}

bool int8_k_type(uint32_t type) {
  return type == kTypeQ4_K || type == kTypeQ5_K || type == kTypeQ6_K;
}

}  // namespace treeattn::model::detail

namespace treeattn::model::detail::int8_generic {
namespace {

struct Ops {
  static constexpr int RB = 2;
  static constexpr int NG = 1;  // groups of 8 tokens per pass of the batched paths (group8, groupk)
  static constexpr bool kWide = false;     // no wide lanes (groupk's WideLanes)
  static constexpr bool kPairAcc = false;  // groupk's int16 pair sums: the x86 targets without VNNI
  static constexpr bool kAmx = false;      // the tile unit's K path (matvec_int8_amx.hpp)
  struct B {
    uint8_t v[32];
  };
  struct I {
    int32_t v[8];
  };
  struct V {
    float v[8];
  };
  static B load(const void* p) {
    B r;
    std::memcpy(r.v, p, 32);
    return r;
  }
  static void store(void* p, B b) { std::memcpy(p, b.v, 32); }
  static B nib(const uint8_t* qs) {
    B r;
    for (int e = 0; e < 16; ++e) {
      r.v[e] = qs[e] & 15;
      r.v[e + 16] = qs[e] >> 4;
    }
    return r;
  }
  static B lo4(B b) { return and_(b, 15); }
  static B hi4(B b) { return shr(b, 4); }
  static B shr(B b, int n) {
    for (auto& x : b.v) x = static_cast<uint8_t>(x >> n);
    return b;
  }
  static B shl(B b, int n) {
    for (auto& x : b.v) x = static_cast<uint8_t>(x << n);
    return b;
  }
  static B and_(B b, uint8_t m) {
    for (auto& x : b.v) x &= m;
    return b;
  }
  static B or_(B a, B b) {
    for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i];
    return a;
  }
  static B or_bits(B c, uint32_t m, uint8_t v) {
    for (int e = 0; e < 32; ++e)
      if ((m >> e) & 1u) c.v[e] |= v;
    return c;
  }
  static I dot_u(B w, B x) {
    I r;
    for (int i = 0; i < 8; ++i) {
      int32_t s = 0;
      for (int k = 0; k < 4; ++k)
        s += int32_t{w.v[4 * i + k]} * static_cast<int8_t>(x.v[4 * i + k]);
      r.v[i] = s;
    }
    return r;
  }
  static I dot_s(B w, B x) {
    I r;
    for (int i = 0; i < 8; ++i) {
      int32_t s = 0;
      for (int k = 0; k < 4; ++k)
        s += int32_t{static_cast<int8_t>(w.v[4 * i + k])} * static_cast<int8_t>(x.v[4 * i + k]);
      r.v[i] = s;
    }
    return r;
  }
  struct S {
    int16_t v[16];
  };
  static S scales_i8(const int8_t* s) {
    S r;
    for (int e = 0; e < 16; ++e) r.v[e] = s[e];
    return r;
  }
  // lane i: a[2i] b[2i] + a[2i+1] b[2i+1] (exact int32), b 16 int16
  static I madd16(S a, const int16_t* b) {
    I r;
    for (int i = 0; i < 8; ++i)
      r.v[i] = int32_t{a.v[2 * i]} * b[2 * i] + int32_t{a.v[2 * i + 1]} * b[2 * i + 1];
    return r;
  }
  struct M {
    uint8_t v[8];
  };
  // Q4_K / Q5_K's 12 packed bytes q to the 8 scales (both halves of S) and the 8 mins, on 32-bit
  // words: scales 0-3 / mins 0-3 are the low 6 bits of q[0-3] / q[4-7]; scales 4-7 / mins 4-7
  // the low / high nibbles of q[8-11] with the top 2 bits of q[0-3] / q[4-7] above them.
  static void unpack_k4(const uint8_t* q, S& sc, M& mn) {
    uint32_t u[4];
    std::memcpy(u, q, 12);
    constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mins_lo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_lo;
    u[0] &= k1;
    uint8_t sm[16];
    std::memcpy(sm, u, 16);
    for (int e = 0; e < 8; ++e) sc.v[e] = sc.v[e + 8] = sm[e];
    std::memcpy(mn.v, sm + 8, 8);
  }
  static int k4_msum(const M& mn, const int16_t* bsum) {
    int m = 0;
    for (int g = 0; g < 8; ++g) m += int{mn.v[g]} * bsum[g];
    return m;
  }
  template <int h>
  static S half(S s) {
    S r;
    for (int e = 0; e < 8; ++e) r.v[e] = r.v[e + 8] = s.v[8 * h + e];
    return r;
  }
  // maddubs: int16 j = w[2j] x[2j] + w[2j+1] x[2j+1] (w unsigned, x signed), saturated.
  static B pairs(B w, B x) {
    B r;
    for (int j = 0; j < 16; ++j) {
      int32_t v = 0;
      for (int k = 0; k < 2; ++k)
        v += int32_t{w.v[2 * j + k]} * static_cast<int8_t>(x.v[2 * j + k]);
      const auto p = static_cast<int16_t>(std::clamp(v, -32768, 32767));
      std::memcpy(r.v + 2 * j, &p, 2);
    }
    return r;
  }
  struct P {
    int32_t lo, hi;  // the multiplier of lanes 0-3 and of lanes 4-7
  };
  template <int e0, int e1>
  static P pick(S s) {
    return P{s.v[e0], s.v[8 + e1]};
  }
  static I madd_acc(I acc, B p, P sc) {
    for (int i = 0; i < 8; ++i) {
      int16_t x, y;
      std::memcpy(&x, p.v + 4 * i, 2);
      std::memcpy(&y, p.v + 4 * i + 2, 2);
      acc.v[i] += (int32_t{x} + int32_t{y}) * (i < 4 ? sc.lo : sc.hi);
    }
    return acc;
  }
  // lane i + p[2i] * lo + p[2i+1] * hi, p as 16 int16, (lo, hi) the int16 halves of pr (exact)
  static I madd_pairs(I acc, B p, int32_t pr) {
    const auto lo = static_cast<int16_t>(static_cast<uint32_t>(pr) & 0xffffu);
    const auto hi = static_cast<int16_t>(static_cast<uint32_t>(pr) >> 16);
    for (int i = 0; i < 8; ++i) {
      int16_t x, y;
      std::memcpy(&x, p.v + 4 * i, 2);
      std::memcpy(&y, p.v + 4 * i + 2, 2);
      acc.v[i] += int32_t{x} * lo + int32_t{y} * hi;
    }
    return acc;
  }
  static I mul_s(I v, int32_t s) {
    for (auto& x : v.v) x *= s;
    return v;
  }
  static I u8to32(const uint8_t* p) {
    I r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static I s8to32(const uint8_t* p) {
    I r;
    for (int i = 0; i < 8; ++i) r.v[i] = static_cast<int8_t>(p[i]);
    return r;
  }
  static B u8to16(const uint8_t* p) {
    B r;
    for (int e = 0; e < 16; ++e) {
      const int16_t v = p[e];
      std::memcpy(r.v + 2 * e, &v, 2);
    }
    return r;
  }
  static V f16x8(const uint8_t* p) {
    V r;
    for (int i = 0; i < 8; ++i) r.v[i] = f16(rd16le(p + 2 * i));
    return r;
  }
  static uint16_t rd16le(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  static I mul_i(I a, I b) {
    for (int i = 0; i < 8; ++i)
      a.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) * static_cast<uint32_t>(b.v[i]));
    return a;
  }
  static I iset1(int32_t v) {
    I r;
    for (auto& x : r.v) x = v;
    return r;
  }
  static constexpr bool kRows4 = false;  // the one-token pass sums each row on its own
  static B bcast4(const uint8_t* p) {
    B r;
    for (int i = 0; i < 8; ++i) std::memcpy(r.v + 4 * i, p, 4);
    return r;
  }
  static I dpu(I acc, B w, B x) { return add(acc, dot_u(w, x)); }
  static I dps(I acc, B w, B x) { return add(acc, dot_s(w, x)); }
  static int hsum(I v) {
    int s = 0;
    for (const int32_t x : v.v) s += x;
    return s;
  }
  static I ishl(I v, int n) {
    for (auto& x : v.v) x = static_cast<int32_t>(static_cast<uint32_t>(x) << n);
    return v;
  }
  static I iload(const int32_t* p) {
    I r;
    std::memcpy(r.v, p, 32);
    return r;
  }
  static V vload(const float* p) {
    V r;
    std::memcpy(r.v, p, 32);
    return r;
  }
  static void vstore(float* p, V v) { std::memcpy(p, v.v, 32); }
  static void store_t4(float* y, int64_t stride, V a, V b, V c, V d) {
    for (int t = 0; t < 8; ++t) {
      const float row[4] = {a.v[t], b.v[t], c.v[t], d.v[t]};
      std::memcpy(y + t * stride, row, sizeof(row));
    }
  }
  static V mul(V a, V b) {
    for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static V vadd(V a, V b) {
    for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
    return a;
  }
  static I izero() { return I{}; }
  static I add(I a, I b) {
    for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
    return a;
  }
  static I isub(I a, I b) {
    for (int i = 0; i < 8; ++i) a.v[i] -= b.v[i];
    return a;
  }
  static B splat(uint8_t v) {
    B r;
    std::memset(r.v, v, 32);
    return r;
  }
  static B flip(B b) {  // each byte's top bit
    for (auto& x : b.v) x ^= 0x80;
    return b;
  }
  static V cvt(I a) {
    V r;
    for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(a.v[i]);
    return r;
  }
  static V set1(float x) {
    V r;
    for (float& v : r.v) v = x;
    return r;
  }
  static V zero() { return set1(0.0f); }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  // IEEE binary16 -> float, exact.
  static float f16(uint16_t h) {
    const uint32_t sign = (uint32_t{h} & 0x8000u) << 16;
    const uint32_t ex = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (ex == 0) {
      const float f = static_cast<float>(man) * 0x1p-24f;
      std::memcpy(&u, &f, 4);
      u |= sign;
    } else if (ex == 31) {
      u = sign | 0x7f800000u | (man << 13);
    } else {
      u = sign | ((ex + 112u) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

#include "model/matvec_int8_impl.hpp"

}  // namespace
}  // namespace treeattn::model::detail::int8_generic

namespace treeattn::model::detail {
void rows_int8_generic(const RowsArgs& a) { int8_generic::rows_int8_impl(a); }

namespace {

// Codes c[8 s + t] (low nibble) and c[8 s + 4 + t] (high nibble) of one row into byte 4 r + t of
// step s's 32 bytes (the rows8 layout's nibble vectors), for `steps` steps.
void put_nibbles(const uint8_t* c, int steps, int r, uint8_t* o) {
  for (int s = 0; s < steps; ++s)
    for (int t = 0; t < 4; ++t)
      o[32 * s + 4 * r + t] =
          static_cast<uint8_t>((c[8 * s + t] & 15) | ((c[8 * s + 4 + t] & 15) << 4));
}

// Row r of a group, block k (b: its bytes in the row layout) into the group's record o. The codes,
// sub-scales and mins come from the generic target's own decoders (decode_k, Code::decode: the
// batched path's and the rows' integers); d and dmin are copied as stored (f16).
template <uint32_t T>
void pack_block(const uint8_t* b, int r, uint8_t* o) {
  using namespace int8_generic;
  if constexpr (T == kTypeQ4_K || T == kTypeQ6_K) {
    uint8_t dec[kDecKBytes];
    decode_k<T>(b, dec);
    const auto i32 = [&](int at) {
      int32_t v;
      std::memcpy(&v, dec + at, 4);
      return v;
    };
    if constexpr (T == kTypeQ4_K) {
      for (int j = 0; j < 8; ++j) {
        put_nibbles(dec + 32 * j, 4, r, o + 128 * j);
        o[1024 + 8 * j + r] = static_cast<uint8_t>(i32(kDecKScales + 4 * j));
      }
      for (int q = 0; q < 4; ++q) {  // DecK's pair q: int16 (mn_2q, mn_2q+1)
        const int32_t pr = i32(kDecKPairs + 4 * q);
        o[1088 + 16 * q + 2 * r] = static_cast<uint8_t>(pr & 0xff);
        o[1088 + 16 * q + 2 * r + 1] = static_cast<uint8_t>((pr >> 16) & 0xff);
      }
      std::memcpy(o + 1152 + 2 * r, b, 2);
      std::memcpy(o + 1168 + 2 * r, b + 2, 2);
    } else {
      for (int c = 0; c < 16; ++c) {
        const uint8_t* u = dec + 16 * c;  // u = q + 32
        put_nibbles(u, 2, r, o + 64 * c);
        for (int t = 0; t < 4; ++t)
          o[1024 + 32 * c + 4 * r + t] =
              static_cast<uint8_t>((u[t] >> 4) | ((u[4 + t] >> 4) << 2) | ((u[8 + t] >> 4) << 4) |
                                   ((u[12 + t] >> 4) << 6));
        o[1536 + 8 * c + r] = static_cast<uint8_t>(i32(kDecKScales + 4 * c));
      }
      std::memcpy(o + 1664 + 2 * r, b + 208, 2);
    }
  } else {
    Dec w;
    Code<T>::decode(b, w);
    const uint8_t* c = w.c.v;  // Q8_0: the signed codes as stored; Q5_0: 0 .. 31
    if constexpr (T == kTypeQ8_0) {
      for (int s = 0; s < 8; ++s)
        for (int t = 0; t < 4; ++t) o[32 * s + 4 * r + t] = c[4 * s + t];
      std::memcpy(o + 256 + 2 * r, b, 2);
    } else {
      put_nibbles(c, 4, r, o);
      for (int t = 0; t < 4; ++t) {
        int h = 0;
        for (int s = 0; s < 4; ++s)
          h |= ((c[8 * s + t] >> 4) << s) | ((c[8 * s + 4 + t] >> 4) << (4 + s));
        o[128 + 4 * r + t] = static_cast<uint8_t>(h);
      }
      std::memcpy(o + 160 + 2 * r, b, 2);
    }
  }
}

template <uint32_t T>
void pack_typed(const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t cols, uint8_t* out) {
  constexpr int64_t kRec = rows8_record_bytes(T), kCols = rows8_record_cols(T);
  constexpr int64_t kIn = [] {  // the block's bytes in the row layout
    if constexpr (kCols == 256)
      return int64_t{int8_generic::CodeK<T>::kBytes};
    else
      return int64_t{int8_generic::Code<T>::kBytes};
  }();
  const int64_t records = cols / kCols;
  for (int64_t g = 0; g < rows / 8; ++g)
    for (int64_t k = 0; k < records; ++k)
      for (int r = 0; r < 8; ++r)
        pack_block<T>(w + (8 * g + r) * row_bytes + k * kIn, r, out + (g * records + k) * kRec);
}

}  // namespace

void pack_rows8(uint32_t type, const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t cols,
                uint8_t* out) {
  switch (type) {
    case kTypeQ4_K:
      return pack_typed<kTypeQ4_K>(w, rows, row_bytes, cols, out);
    case kTypeQ6_K:
      return pack_typed<kTypeQ6_K>(w, rows, row_bytes, cols, out);
    case kTypeQ8_0:
      return pack_typed<kTypeQ8_0>(w, rows, row_bytes, cols, out);
    case kTypeQ5_0:
      return pack_typed<kTypeQ5_0>(w, rows, row_bytes, cols, out);
    default:
      return;
  }
}
}  // namespace treeattn::model::detail
