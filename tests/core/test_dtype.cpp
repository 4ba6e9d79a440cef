// Exactness of the f16 / bf16 converters: every 16-bit pattern widens exactly and narrows
// back to itself; rounding is to nearest even; overflow goes to infinity; NaN stays NaN. The
// quantization scale (quant_scale): the smallest bfloat16 value that maps the largest magnitude
// onto the largest code, over the whole float range.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "treeattn/dtype.hpp"

namespace treeattn {
namespace {

TEST(DType, F16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(f)))) << h;
      continue;
    }
    ASSERT_EQ(float_to_f16(f), h) << "pattern " << h << " value " << f;
  }
}

TEST(DType, F16KnownValues) {
  EXPECT_EQ(f16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_float(0xc000), -2.0f);
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x7c00), std::numeric_limits<float>::infinity());
  // Halfway between 1 and the next half (1 + 2^-10): ties to even -> 1.
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // rounds up to infinity
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (zero)
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -26)), 0x0001);
}

TEST(DType, BF16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f)))) << h;
      continue;
    }
    ASSERT_EQ(float_to_bf16(f), h) << "pattern " << h;
  }
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie to even
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
}

TEST(DType, BF16CeilRoundsUpAndBF16ValuesAreThoseWithoutLowBits) {
  EXPECT_EQ(bf16_ceil(0.0f), 0.0f);
  EXPECT_EQ(bf16_ceil(1.0f), 1.0f);
  EXPECT_EQ(bf16_ceil(1.0f + 0x1p-23f), 1.0f + 0x1p-7f);  // up, never to nearest
  EXPECT_EQ(bf16_ceil(2.0f - 0x1p-23f), 2.0f);            // carries into the exponent
  EXPECT_EQ(bf16_ceil(0x1p-149f), 0x1p-133f);             // subnormal: bf16's smallest
  EXPECT_EQ(bf16_ceil(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  const float payload = std::bit_cast<float>(0x7fffffffu);  // a NaN whose low bits are all set
  EXPECT_TRUE(std::isnan(bf16_ceil(payload)));              // not -0 (a carry out)
  EXPECT_TRUE(std::isnan(bf16_ceil(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_bf16_value(1.0f));
  EXPECT_TRUE(is_bf16_value(0x1p-133f));
  EXPECT_FALSE(is_bf16_value(1.0f + 0x1p-23f));
  EXPECT_FALSE(is_bf16_value(0.01f));
  EXPECT_TRUE(is_bf16_value(payload));    // a NaN stays a NaN
  for (uint32_t h = 0; h < 65536; ++h) {  // every bf16 value is one, and keeps its bits
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    ASSERT_TRUE(is_bf16_value(f)) << h;
    if (!std::isnan(f)) {
      ASSERT_EQ(to_bf16(f).bits, h) << h;
    }
  }
}

// quant_scale(amax, t) = the smallest bf16 value s with s * quant_max(t) >= amax (checked in
// double, and against the bf16 value just below s), for magnitudes over the whole float range
// (subnormal amax included, whose quotient underflows), exact multiples of a bf16 value (s is
// that value) and one ulp above them (fl(amax / q) rounds down onto a bf16 value: one more step).
TEST(DType, QuantScaleIsTheSmallestBF16ThatCoversTheMax) {
  const auto check = [](float amax, DType t) {
    const float s = quant_scale(amax, t);
    const double q = quant_max(t);
    ASSERT_TRUE(is_bf16_value(s)) << amax;
    ASSERT_GE(static_cast<double>(s) * q, static_cast<double>(amax)) << amax;
    const uint32_t bits = std::bit_cast<uint32_t>(s) >> 16;
    const double below = bits == 0 ? -1.0 : bf16_to_float(static_cast<uint16_t>(bits - 1));
    ASSERT_LT(below * q, static_cast<double>(amax)) << amax << " " << dtype_name(t);
  };
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<uint32_t> bits(1, 0x7f7fffffu);  // every positive finite float
  for (DType t : {DType::kInt8, DType::kFP8}) {
    EXPECT_EQ(quant_scale(0.0f, t), 0.0f);
    EXPECT_EQ(quant_scale(0x1p-149f, t), 0x1p-133f);  // amax / q underflows to 0
    EXPECT_EQ(quant_scale(std::numeric_limits<float>::infinity(), t),
              std::numeric_limits<float>::infinity());
    EXPECT_TRUE(std::isnan(quant_scale(std::numeric_limits<float>::quiet_NaN(), t)));
    for (int i = 0; i < 200000; ++i) check(std::bit_cast<float>(bits(rng)), t);
    int bumped = 0;
    for (uint32_t h = 0x0001; h < 0x7f00; h += 7) {
      const float b = bf16_to_float(static_cast<uint16_t>(h));
      const float exact = b * quant_max(t);  // exact: 8 by at most 7 significant bits
      if (!std::isfinite(exact)) break;      // past FLT_MAX / quant_max(t)
      EXPECT_EQ(quant_scale(exact, t), b) << h;
      const float above = std::nextafter(exact, std::numeric_limits<float>::infinity());
      check(above, t);
      EXPECT_GT(quant_scale(above, t), b) << h;
      if (bf16_ceil(above / quant_max(t)) == b) ++bumped;  // the quotient fell onto b
    }
    EXPECT_GT(bumped, 0) << dtype_name(t);  // the one-more-step path is exercised
  }
}

TEST(DType, NamesParseBack) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    auto p = parse_dtype(dtype_name(t));
    ASSERT_TRUE(p.has_value());
    EXPECT_EQ(*p, t);
  }
  EXPECT_FALSE(parse_dtype("int4").has_value());
}

}  // namespace
}  // namespace treeattn
