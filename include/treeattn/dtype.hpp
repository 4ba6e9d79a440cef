// Element types of the KV cache and exact conversions to float / double.
//
// Queries, partial states and outputs are always float32. K and V may be float32, float16
// (IEEE binary16) or bfloat16; every f16 and bf16 value is exactly representable in float32,
// so widening is exact and the float64 oracle sees the same numbers as the kernels.
//
// Quantized KV: K and V may also be 8-bit codes with one scale per (token, KV head) (separate
// scales for K and V, see KVShard in shape.hpp and TiledKVShard in kv_tiles.hpp):
//   fp8   OCP FP8 E4M3 ("e4m3fn": bias 7, 3 mantissa bits, no infinities, S.1111.111 is NaN,
//         largest finite 448); value = fp8_e4m3_to_float(code) * scale.
//   int8  two's complement codes in [-127, 127]; value = float(code) * scale.
// The dequantized value is exactly that float32 product (dequantize() below); kernels and the
// oracle are exact relative to it. quantize_token() picks scale = max|x| / 448 (fp8) or
// max|x| / 127 (int8) rounded UP to a bfloat16 value (quant_scale()), and rounds x / scale to
// the nearest code (ties to even); with the scale rounded up no code saturates, so an int8
// element is within scale / 2 of x. The tiled and paged layouts (kv_tiles.hpp: the engine's
// pages, the K/V exchange) store the scale as bfloat16, 2 bytes; the caller layout (KVShard)
// holds float32 scales, of which quantize_token()'s are bfloat16 values, so a copy between the
// layouts is exact (TiledKVCache::copy_from refuses a caller scale that is not a bf16 value).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace treeattn {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kFP8 = 3, kInt8 = 4 };

constexpr bool dtype_is_quantized(DType t) { return t == DType::kFP8 || t == DType::kInt8; }
constexpr std::size_t dtype_size(DType t) {
  return t == DType::kF32 ? 4 : (dtype_is_quantized(t) ? 1 : 2);
}
// Bytes of one quantized token's scale in the tiled / paged layout (bfloat16).
inline constexpr std::size_t kTiledScaleBytes = 2;
// Bytes of one token's K and V in one KV head of head_dim elements as a page and the K/V
// exchange hold them: the encoded elements and, for fp8 and int8, K's and V's bfloat16 scales
// (2 * head_dim + 4 bytes for fp8 and int8; the caller layout's KVCache holds float32 scales).
constexpr std::size_t kv_head_token_bytes(std::size_t head_dim, DType t) {
  return 2 * head_dim * dtype_size(t) + (dtype_is_quantized(t) ? 2 * kTiledScaleBytes : 0);
}
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kFP8: return "fp8";
    case DType::kInt8: return "int8";
  }
  return "?";
}
inline std::optional<DType> parse_dtype(std::string_view s) {
  if (s == "f32" || s == "float32" || s == "fp32") return DType::kF32;
  if (s == "f16" || s == "float16" || s == "fp16") return DType::kF16;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp8" || s == "e4m3" || s == "fp8_e4m3") return DType::kFP8;
  if (s == "int8" || s == "i8") return DType::kInt8;
  return std::nullopt;
}
// The largest code magnitude of a quantized type (the scale maps max|x| onto it).
constexpr float quant_max(DType t) { return t == DType::kFP8 ? 448.0f : 127.0f; }

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

// A bf16_t's value, exactly; a float as a bf16_t (round to nearest even: exact for the values
// is_bf16_value() below accepts, such as quantize_token()'s scales).
inline float bf16_value(bf16_t h) { return bf16_to_float(h.bits); }
inline bf16_t to_bf16(float f) { return bf16_t{float_to_bf16(f)}; }

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

// FP8 E4M3 (e4m3fn) -> float, exact. S.1111.111 is NaN.
inline float fp8_e4m3_to_float(uint8_t c) {
  const uint32_t sign = uint32_t{c & 0x80u} << 24;
  const uint32_t mag = c & 0x7fu;
  if (mag == 0x7fu) return std::bit_cast<float>(sign | 0x7fc00000u);
  // The 7 magnitude bits placed under the float exponent field read as 2^-120 times the value
  // (subnormal codes become float subnormals); the product by 2^120 is exact.
  return std::bit_cast<float>(sign | (mag << 20)) * 0x1p120f;
}

// float -> FP8 E4M3, round to nearest even, saturating to +-448; NaN -> NaN code.
inline uint8_t float_to_fp8_e4m3(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = std::bit_cast<float>(u & 0x7fffffffu);
  if (a != a) return static_cast<uint8_t>(sign | 0x7fu);
  if (a >= 464.0f) return static_cast<uint8_t>(sign | 0x7eu);  // 464 rounds past 448
  if (a < 0x1p-6f) {
    // Subnormal codes: multiples of 2^-9; RNE via the float adder.
    const float m = (a * 0x1p9f + 0x1p23f) - 0x1p23f;
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(m));
  }
  // Normal: keep 3 mantissa bits with RNE on the float bits, then rebias 127 -> 7.
  uint32_t r = std::bit_cast<uint32_t>(a);
  r += 0x7ffffu + ((r >> 20) & 1u);
  const uint32_t e = (r >> 23) - 120u, m = (r >> 20) & 7u;
  return static_cast<uint8_t>(sign | (e << 3) | m);
}

// float -> int8 code: round to nearest even, saturating to [-127, 127]; NaN -> 0.
inline int8_t float_to_int8(float f) {
  if (!(f == f)) return 0;
  const float c = f > 127.0f ? 127.0f : (f < -127.0f ? -127.0f : f);
  const float r = (c + 0x1.8p23f) - 0x1.8p23f;  // RNE for |c| < 2^22
  return static_cast<int8_t>(r);
}

// Widen element i of a typed buffer to float. For quantized types this is the code's value
// WITHOUT the scale (see dequantize()).
inline float load_as_float(const void* base, DType t, std::size_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kFP8: return fp8_e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kInt8: return static_cast<float>(static_cast<const int8_t*>(base)[i]);
  }
  return 0.0f;
}

// The value of element i as the kernels and the oracle define it: the widened element, times
// the token's scale for quantized types (scale is ignored otherwise).
inline float dequantize(const void* base, DType t, std::size_t i, float scale) {
  const float x = load_as_float(base, t, i);
  return dtype_is_quantized(t) ? x * scale : x;
}

// Narrow a float into a typed buffer (used to build test and benchmark caches). For quantized
// types v is the code's value (already divided by the scale).
inline void store_from_float(void* base, DType t, std::size_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case DType::kFP8: static_cast<uint8_t*>(base)[i] = float_to_fp8_e4m3(v); break;
    case DType::kInt8: static_cast<int8_t*>(base)[i] = float_to_int8(v); break;
  }
}

// store_from_float for x[0 .. n) into base[i0 .. i0 + n), the type chosen once per row (the
// per-element switch kept the compiler from vectorizing large cache fills).
inline void store_row_from_float(void* base, DType t, std::size_t i0, const float* x,
                                 std::size_t n) {
  auto each = [&](auto* out, auto convert) {
    for (std::size_t d = 0; d < n; ++d) out[i0 + d] = convert(x[d]);
  };
  switch (t) {
    case DType::kF32: each(static_cast<float*>(base), [](float v) { return v; }); break;
    case DType::kF16: each(static_cast<uint16_t*>(base), float_to_f16); break;
    case DType::kBF16: each(static_cast<uint16_t*>(base), float_to_bf16); break;
    case DType::kFP8: each(static_cast<uint8_t*>(base), float_to_fp8_e4m3); break;
    case DType::kInt8: each(static_cast<int8_t*>(base), float_to_int8); break;
  }
}

// x[i] = the value x[i] has once stored as t (F16, BF16: rounded; F32 and the quantized types,
// whose codes are per-token scaled by KVCache::set_token: unchanged).
inline void round_to_dtype(DType t, float* x, std::size_t n) {
  if (t == DType::kBF16)
    for (std::size_t i = 0; i < n; ++i) x[i] = bf16_to_float(float_to_bf16(x[i]));
  else if (t == DType::kF16)
    for (std::size_t i = 0; i < n; ++i) x[i] = f16_to_float(float_to_f16(x[i]));
}

// Whether f is a bfloat16 value (its low 16 bits are zero), so that a bf16 scale holds it
// exactly. A NaN counts as one (it stays a NaN, its payload is not kept).
inline bool is_bf16_value(float f) { return f != f || (std::bit_cast<uint32_t>(f) & 0xffffu) == 0; }

// The smallest bfloat16 value >= s, for s >= 0 (+inf stays +inf; a NaN gives a quiet NaN).
inline float bf16_ceil(float s) {
  if (s != s) return std::bit_cast<float>(0x7fc00000u);
  uint32_t u = std::bit_cast<uint32_t>(s);
  if ((u & 0xffffu) != 0) u = (u | 0xffffu) + 1u;  // carries into the exponent when it must
  return std::bit_cast<float>(u);
}

// The scale of a token whose largest magnitude is amax (>= 0, or NaN / inf): the smallest
// bfloat16 value s with s * quant_max(t) >= amax, found from amax / quant_max(t) rounded up
// (and one bf16 step more where that quotient's float rounding fell below it; s * quant_max is
// exact: 8 by at most 7 significant bits). amax 0 gives 0; a non-finite amax a non-finite s.
inline float quant_scale(float amax, DType t) {
  const float q = quant_max(t);
  float s = bf16_ceil(amax / q);
  if (s * q < amax) s = bf16_ceil(std::bit_cast<float>(std::bit_cast<uint32_t>(s) + 1u));
  return s;
}

// Quantizes n floats (one token of one KV head) into codes at base[i0 .. i0 + n) and returns
// the scale: quant_scale(max|x|, t) (a bfloat16 value >= max|x| / quant_max(t)), codes =
// round(x / scale), never past +-quant_max(t). An all-zero token gets scale 0 and zero codes;
// a non-finite max gives a non-finite scale (dequantized values NaN/inf).
inline float quantize_token(void* base, DType t, std::size_t i0, const float* x, std::size_t n) {
  float amax = 0.0f;
  for (std::size_t d = 0; d < n; ++d) {
    const float a = x[d] < 0 ? -x[d] : x[d];
    if (a > amax || a != a) amax = a;
    if (a != a) break;
  }
  const float scale = quant_scale(amax, t);
  for (std::size_t d = 0; d < n; ++d)
    store_from_float(base, t, i0 + d, scale > 0.0f ? x[d] / scale : 0.0f);
  return scale;
}

}  // namespace treeattn
