// The decode item kernel for any CPU: fixed-width arrays of 8 floats that the compiler may
// vectorize for the baseline ISA, no intrinsics, libm exp. Compiled without extra flags.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/cpu_targets.hpp"

namespace treeattn::kernels::cpu::generic {
namespace {

struct Ops {
  static constexpr int W = 8;
  static constexpr int kAccRegs = 8;
  struct V {
    float v[W];
  };
  static V in_register(V v) { return v; }  // no intrinsics: left to the compiler
  static V zero() { return set1(0.0f); }
  static V set1(float x) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  static V loadu(const float* p) {
    V r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static void storeu(float* p, V v) { std::memcpy(p, v.v, sizeof(v.v)); }
  static V load_f32(const float* p) { return loadu(p); }
  static V load_bf16(const uint16_t* p) {
    V r;
    for (int i = 0; i < W; ++i) {
      const uint32_t u = uint32_t{p[i]} << 16;
      std::memcpy(&r.v[i], &u, 4);
    }
    return r;
  }
  // IEEE binary16 -> float, exact (subnormals, infinities and NaN included).
  static V load_f16(const uint16_t* p) {
    V r;
    for (int i = 0; i < W; ++i) {
      const uint32_t h = p[i];
      const uint32_t sign = (h & 0x8000u) << 16;
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
      std::memcpy(&r.v[i], &u, 4);
    }
    return r;
  }
  static V load_i8(const int8_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  // FP8 E4M3 (e4m3fn) -> float, exact; S.1111.111 is NaN.
  static V load_fp8(const uint8_t* p) {
    V r;
    for (int i = 0; i < W; ++i) {
      const uint32_t mag = p[i] & 0x7fu;
      const uint32_t bits = mag << 20;
      float f;
      std::memcpy(&f, &bits, 4);
      f *= 0x1p120f;
      if (mag == 0x7fu) f = __builtin_nanf("");
      r.v[i] = (p[i] & 0x80u) ? -f : f;
    }
    return r;
  }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < W; ++i) c.v[i] = a.v[i] * b.v[i] + c.v[i];
    return c;
  }
  static V mul(V a, V b) {
    for (int i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static V add(V a, V b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static V sub(V a, V b) {
    for (int i = 0; i < W; ++i) a.v[i] -= b.v[i];
    return a;
  }
  // Like maxps: a NaN lane of `a` yields b's lane.
  static V max(V a, V b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  static float reduce_add(V a) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += a.v[i];
    return s;
  }
  static float reduce_max(V a) {
    float m = a.v[0];
    for (int i = 1; i < W; ++i) m = a.v[i] > m ? a.v[i] : m;
    return m;
  }
  static V hsum(const V* a) {
    V r;
    for (int j = 0; j < W; ++j) r.v[j] = reduce_add(a[j]);
    return r;
  }
  static V exp(V x) {
    for (int i = 0; i < W; ++i) x.v[i] = __builtin_expf(x.v[i]);
    return x;
  }
  static V exp_nonpos(V x) { return exp(x); }  // the softmax's exp (x <= 0, -inf or NaN)
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

}  // namespace treeattn::kernels::cpu::generic
