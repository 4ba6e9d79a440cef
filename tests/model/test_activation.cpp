// The FFN's gated activation (src/model/activation.hpp): the exponential of every target against
// glibc's expf bit for bit (where the CPU has FMA, so that glibc runs __expf_fma) and against the
// scalar definition everywhere; the gated functions of every target against the scalar loop
// they replaced (std::exp), bit for bit, at 1 and 3 threads.
#include <gtest/gtest.h>

#if defined(__GLIBC__)
#include <gnu/libc-version.h>
#endif

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "model/activation.hpp"
#include "treeattn/kernel.hpp"

namespace treeattn::model {
namespace {

using ExpFn = void (*)(const float*, float*, int64_t);
using GatedFn = void (*)(FfnActivation, float*, const float*, int64_t);
struct Target {
  const char* name;
  Isa isa;
  ExpFn exp;
  GatedFn gated;
};

std::vector<Target> targets_here() {
  std::vector<Target> t{{"generic", Isa::kGeneric, detail::exp_generic, detail::gated_generic}};
#if defined(__x86_64__)
  if (isa_supported(Isa::kAvx2))
    t.push_back({"avx2", Isa::kAvx2, detail::exp_avx2, detail::gated_avx2});
  if (isa_supported(Isa::kAvx512))
    t.push_back({"avx512", Isa::kAvx512, detail::exp_avx512, detail::gated_avx512});
#endif
  static bool printed = false;
  if (!printed) {
    std::string s;
    for (const Target& x : t) s += std::string(" ") + x.name;
    std::printf("[ targets   ] activation targets run here:%s\n", s.c_str());
    printed = true;
  }
  return t;
}

// glibc runs its FMA variant (the one whose bits activation.hpp has) on CPUs with FMA; its expf
// has this algorithm from 2.28 on (Debian 12: 2.36). Other versions and CPUs: the scalar
// definition is the reference, and the test says so.
bool glibc_is_fma() {
#if defined(__x86_64__) && defined(__GLIBC__)
  int major = 0, minor = 0;
  if (std::sscanf(gnu_get_libc_version(), "%d.%d", &major, &minor) != 2) return false;
  const bool known = major == 2 && minor >= 28 && minor <= 40;
  if (!known) std::printf("glibc %d.%d: not compared with its expf\n", major, minor);
  return known && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

std::vector<float> exp_inputs() {
  std::vector<float> x;
  // Every 127th bit pattern (sign, exponent and mantissa all over), then every float near the
  // thresholds (|x| from 87 to 104: the fast path's ends, overflow, underflow, the subnormal
  // results), small magnitudes on a geometric grid, and the special values.
  for (uint64_t u = 0; u < (1ull << 32); u += 127) x.push_back(from_bits(static_cast<uint32_t>(u)));
  for (float lo : {87.0f, -104.0f}) {
    const float hi = lo > 0 ? 89.0f : -87.0f;
    for (float v = lo; v <= hi; v = std::nextafter(v, INFINITY)) x.push_back(v);
  }
  for (float v = 1e-9f; v < 1.0f; v *= 1.001f) {  // small magnitudes, where r is tiny
    x.push_back(v);
    x.push_back(-v);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float v : {0.0f,
                  -0.0f,
                  1.0f,
                  -1.0f,
                  INFINITY,
                  -INFINITY,
                  nan,
                  -nan,
                  std::numeric_limits<float>::signaling_NaN(),
                  std::numeric_limits<float>::max(),
                  -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(),
                  -std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(),
                  from_bits(detail::kExpOverflow),
                  from_bits(detail::kExpUnderflow),
                  from_bits(detail::kExpMayUnderflow),
                  from_bits(detail::kExpOverflow + 1),
                  from_bits(detail::kExpUnderflow + 1),
                  from_bits(detail::kExpMayUnderflow + 1),
                  from_bits(detail::kExpUnderflow - 1),
                  from_bits(detail::kExpMayUnderflow - 1),
                  88.0f,
                  -88.0f,
                  std::nextafter(88.0f, 0.0f),
                  std::nextafter(-88.0f, 0.0f)})
    x.push_back(v);
  return x;
}

TEST(Activation, ExpHasGlibcsBitsOnEveryTarget) {
  const std::vector<float> x = exp_inputs();
  const bool vs_glibc = glibc_is_fma();
  if (!vs_glibc)
    std::printf(
        "no FMA: glibc's expf is its non-FMA variant; compared with the scalar definition only\n");
  std::vector<float> want(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) want[i] = detail::expf_glibc(x[i]);
  if (vs_glibc) {
    int64_t bad = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float g = std::exp(x[i]);
      if (std::bit_cast<uint32_t>(g) != std::bit_cast<uint32_t>(want[i]) && bad++ < 5)
        ADD_FAILURE() << "expf_glibc(" << std::hexfloat << x[i] << ") = " << want[i]
                      << ", glibc's expf " << g;
    }
    EXPECT_EQ(bad, 0) << "of " << x.size();
  }
  for (const Target& t : targets_here()) {
    // Unaligned starts and odd lengths: the vector bodies and the scalar tails.
    for (std::size_t off : {std::size_t{0}, std::size_t{3}}) {
      std::vector<float> y(x.size() - off);
      t.exp(x.data() + off, y.data(), static_cast<int64_t>(y.size()));
      int64_t bad = 0;
      for (std::size_t i = 0; i < y.size(); ++i)
        if (std::bit_cast<uint32_t>(y[i]) != std::bit_cast<uint32_t>(want[i + off]) && bad++ < 5)
          ADD_FAILURE() << t.name << ": exp(" << std::hexfloat << x[i + off] << ") = " << y[i]
                        << ", expected " << want[i + off];
      EXPECT_EQ(bad, 0) << t.name << ", offset " << off << ", " << y.size() << " values";
    }
  }
}

// The loop of llama_model.cpp before activation.hpp (compiled here for the baseline ISA, where
// nothing is fused), with glibc's expf.
float old_loop(FfnActivation act, float g, float u) {
  if (act == FfnActivation::kGeluTanh) {
    constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f, kA = 0.044715f;
    const float y = kSqrt2OverPi * g * (1.0f + kA * g * g);
    return g / (1.0f + std::exp(-2.0f * y)) * u;
  }
  return g / (1.0f + std::exp(-g)) * u;
}

TEST(Activation, GatedGivesTheScalarLoopsBitsOnEveryTargetAndSplit) {
  std::mt19937 rng(20261204);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::uniform_real_distribution<float> wide(-120.0f, 120.0f);
  const int64_t n = 100003;  // odd: every target's tail
  std::vector<float> gate(static_cast<std::size_t>(n)), up(gate.size());
  for (int64_t i = 0; i < n; ++i) {
    gate[i] = i % 5 == 0 ? wide(rng) : nd(rng);
    up[i] = nd(rng);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float special[] = {0.0f,  -0.0f,  INFINITY, -INFINITY, nan,    1e30f,  -1e30f,
                           44.0f, -44.0f, -52.0f,   -51.9f,    1e-40f, -1e-40f};
  for (std::size_t i = 0; i < std::size(special); ++i) gate[7 * i + 1] = special[i];
  up[2] = INFINITY;
  up[9] = nan;
  for (FfnActivation act : {FfnActivation::kSilu, FfnActivation::kGeluTanh}) {
    const char* an = act == FfnActivation::kSilu ? "silu" : "gelu";
    std::vector<float> want(gate.size());
    for (std::size_t i = 0; i < gate.size(); ++i) want[i] = old_loop(act, gate[i], up[i]);
    const bool exact = glibc_is_fma();
    if (!exact) {  // the scalar definition instead of glibc's non-FMA expf
      for (std::size_t i = 0; i < gate.size(); ++i)
        want[i] = detail::gated_one(act, gate[i], up[i]);
    }
    for (const Target& t : targets_here())
      for (int threads : {1, 3}) {
        std::vector<float> y = gate;
        gated_activation(act, y.data(), up.data(), n, t.isa, threads);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; ++i)
          if (std::bit_cast<uint32_t>(y[i]) != std::bit_cast<uint32_t>(want[i]) && bad++ < 5)
            ADD_FAILURE() << an << " " << t.name << " x" << threads << ": [" << i << "] g "
                          << std::hexfloat << gate[i] << " u " << up[i] << " -> " << y[i]
                          << ", expected " << want[i];
        EXPECT_EQ(bad, 0) << an << " " << t.name << " x" << threads;
      }
  }
}

}  // namespace
}  // namespace treeattn::model
