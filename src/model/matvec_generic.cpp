// The weight row kernel for any CPU: fixed arrays of 8 floats the compiler may vectorize for the
// baseline ISA, no intrinsics; fma is std::fma (one rounding, as the SIMD targets). Compiled
// without extra flags.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "model/matvec_targets.hpp"

namespace treeattn::model::detail::generic {
namespace {

struct Ops {
  static constexpr int W = 8;
  static constexpr int RB1 = 2;
  static constexpr int RB = 2;
  static constexpr int NT = 2;
  struct V {
    float v[W];
  };
  static V set1(float x) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  static void pin(V& /*w*/) {}
  static V zero() { return set1(0.0f); }
  static V loadu(const float* p) {
    V r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < W; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static V mul(V a, V b) {
    for (int i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static void storeu(float* p, V v) { std::memcpy(p, v.v, sizeof(v.v)); }
  static V add(V a, V b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  // IEEE binary16 -> float, exact (subnormals, infinities and NaN included).
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
  static V load_f16(const uint16_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = f16(p[i]);
    return r;
  }
  static V load_bf16(const uint16_t* p) {
    V r;
    for (int i = 0; i < W; ++i) {
      const uint32_t u = uint32_t{p[i]} << 16;
      std::memcpy(&r.v[i], &u, 4);
    }
    return r;
  }
  static V load_i8(const int8_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static V nib(const uint8_t* qs, int j) {
    V r;
    const int e = j * W;
    for (int i = 0; i < W; ++i)
      r.v[i] = static_cast<float>(e < 16 ? (qs[e + i] & 15) : (qs[e - 16 + i] >> 4));
    return r;
  }
  struct I {
    int32_t v[W];
  };
  static I u8(const uint8_t* p) {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static I bits(uint32_t mask, int first) {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<int32_t>((mask >> (first + i)) & 1u);
    return r;
  }
  static I shr(I a, int n) {
    for (int i = 0; i < W; ++i) a.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) >> n);
    return a;
  }
  static I shl(I a, int n) {
    for (int i = 0; i < W; ++i) a.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) << n);
    return a;
  }
  static I and_(I a, int m) {
    for (int i = 0; i < W; ++i) a.v[i] &= m;
    return a;
  }
  static I or_(I a, I b) {
    for (int i = 0; i < W; ++i) a.v[i] |= b.v[i];
    return a;
  }
  static V cvt(I a) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(a.v[i]);
    return r;
  }
  // The AVX2 target's order: halves, then pairs, then the last two.
  static void reduce_add16(const V* v, float* out) {
    for (int i = 0; i < 16; ++i) out[i] = reduce_add(v[i]);
  }
  static float reduce_add(V v) {
    float b[4];
    for (int i = 0; i < 4; ++i) b[i] = v.v[i] + v.v[i + 4];
    const float c0 = b[0] + b[2], c1 = b[1] + b[3];
    return c0 + c1;
  }
};

#include "model/matvec_impl.hpp"

}  // namespace
}  // namespace treeattn::model::detail::generic

namespace treeattn::model::detail {
void rows_generic(const RowsArgs& a) { generic::rows_impl(a); }
}  // namespace treeattn::model::detail
