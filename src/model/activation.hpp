// The FFN's gated activation, gate[i] = act(gate[i]) * up[i] (SiLU, or GELU's tanh form), with
// its exponential computed in vectors. The exponential has the bits of glibc's expf (2.28 and
// later, the FMA variant that every x86-64 CPU with FMA runs, __expf_fma): its algorithm, table
// and constants (read from Debian 12's libm, glibc 2.36), so the vector targets give the bits of
// the scalar loop they replace, `g / (1.0f + std::exp(-g)) * up[i]`, element by element, on every
// target, instead of a call into glibc per element (`perf record` of a 512-token prefill shows
// the difference).
//
// expf(x), for x not NaN and |x| < 88 (glibc's fast path, also taken up to log(2^128) and down to
// log(2^-149)): with N = 32, z = x N / ln 2 = k + r (k the nearest integer, in double),
//   zs = fma(N / ln 2, double(x), 0x1.8p52)   (k in zs's low bits), kd = zs - 0x1.8p52,
//   r  = fma(N / ln 2, double(x), -kd)        (exact-rounded),
//   s  = 2^(k / N) = double(kTab[k % N] + (k << 47))   (the table holds 2^(i/N) minus i << 47),
//   y  = fma(fma(r, C0, C1), r * r, fma(r, C2, 1)) * s, rounded to float once.
// Outside: x > 0x1.62e42ep6 -> +inf, x < -0x1.9fe368p6 -> 0, below -0x1.9d1d9ep6 -> 0x1p-149
// (glibc's __math_may_uflowf: 0x1.4p-75f squared), NaN -> x + x (quiet), -inf -> 0.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "treeattn/model.hpp"

namespace treeattn::model::detail {

inline constexpr uint64_t kExpTab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
inline constexpr uint64_t kExpInvLn2N = 0x40471547652b82fe;  // 32 / ln 2
inline constexpr uint64_t kExpShift = 0x4338000000000000;    // 0x1.8p52
inline constexpr uint64_t kExpC0 = 0x3ebc6af84b912394, kExpC1 = 0x3f2ebfce50fac4f3,
                          kExpC2 = 0x3f962e42ff0c52d6;
inline constexpr uint32_t kExpOverflow = 0x42b17217;      //  0x1.62e42ep6 (x above: +inf)
inline constexpr uint32_t kExpUnderflow = 0xc2cff1b4;     // -0x1.9fe368p6 (x below: 0)
inline constexpr uint32_t kExpMayUnderflow = 0xc2ce8ecf;  // -0x1.9d1d9ep6 (below: 0x1p-149)

// The scalar definition (the vector targets' tails and the generic target). std::fma is one
// instruction where the target has FMA and glibc's exact fma elsewhere: the same bits.
inline float expf_glibc(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if (((u >> 20) & 0x7ff) > 0x42a) {  // |x| >= 88, inf or NaN
    if (u == 0xff800000u) return 0.0f;
    if (((u >> 20) & 0x7ff) > 0x7f7) return x + x;
    if (x > std::bit_cast<float>(kExpOverflow)) return INFINITY;
    if (x < std::bit_cast<float>(kExpUnderflow)) return 0.0f;
    if (x < std::bit_cast<float>(kExpMayUnderflow)) return 0x1p-149f;
  }
  const double xd = x, inv = std::bit_cast<double>(kExpInvLn2N),
               shift = std::bit_cast<double>(kExpShift);
  const double zs = std::fma(inv, xd, shift);
  const uint64_t ki = std::bit_cast<uint64_t>(zs);
  const double kd = zs - shift;
  const double r = std::fma(inv, xd, -kd);
  const double s = std::bit_cast<double>(kExpTab[ki % 32] + (ki << 47));
  const double p = std::fma(r, std::bit_cast<double>(kExpC0), std::bit_cast<double>(kExpC1));
  const double q = std::fma(r, std::bit_cast<double>(kExpC2), 1.0);
  return static_cast<float>(std::fma(p, r * r, q) * s);
}

// GELU's constants (ggml's): gate = g / (1 + exp(-2 y)), y = kGeluS g (1 + kGeluA g^2).
inline constexpr float kGeluS = 0.79788456080286535587989211986876f, kGeluA = 0.044715f;

// One element, the operations (and their order) of every target's vector loop.
inline float gated_one(FfnActivation act, float g, float u) {
  if (act == FfnActivation::kGeluTanh) {
    const float y = kGeluS * g * (1.0f + kGeluA * g * g);
    return g / (1.0f + expf_glibc(-2.0f * y)) * u;
  }
  return g / (1.0f + expf_glibc(-g)) * u;
}

// gate[i] = gated_one(act, gate[i], up[i]) for i < n: one thread, per target.
void gated_generic(FfnActivation act, float* gate, const float* up, int64_t n);
void gated_avx2(FfnActivation act, float* gate, const float* up, int64_t n);
void gated_avx512(FfnActivation act, float* gate, const float* up, int64_t n);
// expf_glibc over n floats, per target (tests).
void exp_generic(const float* x, float* y, int64_t n);
void exp_avx2(const float* x, float* y, int64_t n);
void exp_avx512(const float* x, float* y, int64_t n);

}  // namespace treeattn::model::detail

namespace treeattn::model {

// gate[i] = act(gate[i]) * up[i] over `threads` OpenMP threads (0: all) on `isa`'s target
// (kAuto: the best this CPU runs; kReference: generic). The same bits on every target and split.
void gated_activation(FfnActivation act, float* gate, const float* up, int64_t n, Isa isa,
                      int threads);

}  // namespace treeattn::model
