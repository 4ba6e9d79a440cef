// Exactness of the f16 / bf16 converters: every 16-bit pattern widens exactly and narrows
// back to itself; rounding is to nearest even; overflow goes to infinity; NaN stays NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

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
