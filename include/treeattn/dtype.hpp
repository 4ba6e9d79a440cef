// Element types of the KV cache and exact conversions to float / double.
//
// Queries, partial states and outputs are always float32. K and V may be float32, float16
// (IEEE binary16) or bfloat16; every f16 and bf16 value is exactly representable in float32,
// so widening is exact and the float64 oracle sees the same numbers as the kernels.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace treeattn {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr std::size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}
inline std::optional<DType> parse_dtype(std::string_view s) {
  if (s == "f32" || s == "float32" || s == "fp32") return DType::kF32;
  if (s == "f16" || s == "float16" || s == "fp16") return DType::kF16;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  return std::nullopt;
}

// Storage types: plain 16-bit words, so that headers stay free of compiler extensions.
struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

inline float bf16_to_float(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

// Round-to-nearest-even; NaN stays NaN (quiet).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return std::bit_cast<float>(sign);
    // Subnormal: value = man * 2^-24, exact in float.
    const float v = static_cast<float>(man) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round-to-nearest-even, overflow to infinity, NaN stays NaN.
inline uint16_t float_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    const float a = std::bit_cast<float>(abs);
    // a * 2^24 is the subnormal mantissa; nearbyint-free RNE via the float adder.
    const float m = (a * 0x1p24f + 0x1p23f) - 0x1p23f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(m));
  }
  uint32_t r = abs - (112u << 23);
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

// Widen element i of a typed buffer to float.
inline float load_as_float(const void* base, DType t, std::size_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

// Narrow a float into a typed buffer (used to build test and benchmark caches).
inline void store_from_float(void* base, DType t, std::size_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
  }
}

}  // namespace treeattn
