// The weight row kernel, written once and compiled once per ISA target.
//
// Included (not compiled on its own) by matvec_avx512.cpp, matvec_avx2.cpp and
// matvec_generic.cpp inside an anonymous namespace, after each defines `struct Ops`:
//
//   using V;  static constexpr int W (floats per vector, 8 or 16), NT (tokens per pass)
//   V zero(), set1(float), loadu(const float*)
//   V fma(a, b, c) = a * b + c (one rounding);  V mul(a, b);  V add(a, b)
//   V load_f16(const uint16_t*), load_bf16(const uint16_t*), load_i8(const int8_t*)   W values
//   V nib(const uint8_t* qs, int j)   elements j*W .. j*W+W-1 of a 4-bit block as floats
//                                     (element e < 16: qs[e] & 15, else qs[e - 16] >> 4)
//   float f16(uint16_t);  float reduce_add(V)   (a fixed order of lane additions)
//
// One row against n <= NT tokens: the row is read once, every 32-value block is decoded into
// 32 / W weight vectors, and each token accumulates w * x into its own A = 2 * 32 / W vector
// accumulators (even and odd blocks alternate, so consecutive FMAs are independent). The result
// of a token is (acc[0] + acc[1] + ... + acc[A-1]) summed lane-wise, then reduce_add, then the
// scalar tail (float types with cols % 32 != 0) in column order. That sequence does not depend
// on n or on which tokens share the pass: the bits of a (row, token) product are fixed
// (matvec_targets.hpp).
//
// Decoding a block (ggml's formats; d and m are f16):
//   Q8_0  w = d * q                 exact in float (11-bit d times an 8-bit integer)
//   Q4_0  w = d * (q - 8)           exact
//   Q4_1  w = fma(d, q, m)          one rounding
//   F16, BF16, F32                  widened exactly

constexpr int kVB = 32 / Ops::W;  // vectors per 32-value block
constexpr int kA = 2 * kVB;       // accumulators per token

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

template <uint32_t T>
struct Block;

template <>
struct Block<kTypeQ8_0> {
  static constexpr int kBytes = 34;
  static void decode(const uint8_t* b, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < kVB; ++j) w[j] = Ops::mul(d, Ops::load_i8(q + j * Ops::W));
  }
};

template <>
struct Block<kTypeQ4_0> {
  static constexpr int kBytes = 18;
  static void decode(const uint8_t* b, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const typename Ops::V eight = Ops::set1(-8.0f);
    for (int j = 0; j < kVB; ++j) w[j] = Ops::mul(d, Ops::add(Ops::nib(b + 2, j), eight));
  }
};

template <>
struct Block<kTypeQ4_1> {
  static constexpr int kBytes = 20;
  static void decode(const uint8_t* b, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const typename Ops::V m = Ops::set1(Ops::f16(rd16(b + 2)));
    for (int j = 0; j < kVB; ++j) w[j] = Ops::fma(d, Ops::nib(b + 4, j), m);
  }
};

template <>
struct Block<kTypeF32> {
  static constexpr int kBytes = 128;
  static void decode(const uint8_t* b, typename Ops::V* w) {
    for (int j = 0; j < kVB; ++j) {
      float tmp[Ops::W];
      std::memcpy(tmp, b + j * Ops::W * 4, sizeof(tmp));
      w[j] = Ops::loadu(tmp);
    }
  }
  static float scalar(const uint8_t* row, int64_t c) {
    float v;
    std::memcpy(&v, row + c * 4, 4);
    return v;
  }
};

template <>
struct Block<kTypeF16> {
  static constexpr int kBytes = 64;
  static void decode(const uint8_t* b, typename Ops::V* w) {
    for (int j = 0; j < kVB; ++j)
      w[j] = Ops::load_f16(reinterpret_cast<const uint16_t*>(b) + j * Ops::W);
  }
  static float scalar(const uint8_t* row, int64_t c) { return Ops::f16(rd16(row + c * 2)); }
};

template <>
struct Block<kTypeBF16> {
  static constexpr int kBytes = 64;
  static void decode(const uint8_t* b, typename Ops::V* w) {
    for (int j = 0; j < kVB; ++j)
      w[j] = Ops::load_bf16(reinterpret_cast<const uint16_t*>(b) + j * Ops::W);
  }
  static float scalar(const uint8_t* row, int64_t c) {
    const uint32_t u = uint32_t{rd16(row + c * 2)} << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
};

// out[t * y_stride] = <row, x[t]> for t < N.
template <uint32_t T, int N>
inline void dot_group(const uint8_t* row, int64_t cols, const float* x, int64_t x_stride,
                      float* out, int64_t y_stride) {
  using V = typename Ops::V;
  V acc[N][kA];
  for (int t = 0; t < N; ++t)
    for (int a = 0; a < kA; ++a) acc[t][a] = Ops::zero();
  const int64_t blocks = cols / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    V w[kVB];
    Block<T>::decode(row + b * Block<T>::kBytes, w);
    const int par = static_cast<int>(b & 1) * kVB;
    for (int t = 0; t < N; ++t) {
      const float* xb = x + t * x_stride + b * 32;
      for (int j = 0; j < kVB; ++j)
        acc[t][par + j] = Ops::fma(w[j], Ops::loadu(xb + j * Ops::W), acc[t][par + j]);
    }
  }
  for (int t = 0; t < N; ++t) {
    V s = acc[t][0];
    for (int a = 1; a < kA; ++a) s = Ops::add(s, acc[t][a]);
    float r = Ops::reduce_add(s);
    if constexpr (T == kTypeF32 || T == kTypeF16 || T == kTypeBF16) {
      const float* xt = x + t * x_stride;
      for (int64_t c = blocks * 32; c < cols; ++c) r += Block<T>::scalar(row, c) * xt[c];
    }
    out[t * y_stride] = r;
  }
}

template <uint32_t T>
void rows_typed(const RowsArgs& a) {
  for (int64_t r = a.row_begin; r < a.row_end; ++r) {
    const uint8_t* row = a.w + r * a.row_bytes;
    int64_t t = 0;
    for (; t + Ops::NT <= a.tokens; t += Ops::NT)
      dot_group<T, Ops::NT>(row, a.cols, a.x + t * a.x_stride, a.x_stride,
                            a.y + t * a.y_stride + r, a.y_stride);
    const float* x = a.x + t * a.x_stride;
    float* y = a.y + t * a.y_stride + r;
    switch (a.tokens - t) {
      case 0:
        break;
      case 1:
        dot_group<T, 1>(row, a.cols, x, a.x_stride, y, a.y_stride);
        break;
      case 2:
        if constexpr (Ops::NT > 2) dot_group<T, 2>(row, a.cols, x, a.x_stride, y, a.y_stride);
        break;
      default:
        if constexpr (Ops::NT > 3) dot_group<T, 3>(row, a.cols, x, a.x_stride, y, a.y_stride);
        break;
    }
  }
}

void rows_impl(const RowsArgs& a) {
  switch (a.type) {
    case kTypeQ4_0:
      return rows_typed<kTypeQ4_0>(a);
    case kTypeQ4_1:
      return rows_typed<kTypeQ4_1>(a);
    case kTypeQ8_0:
      return rows_typed<kTypeQ8_0>(a);
    case kTypeF16:
      return rows_typed<kTypeF16>(a);
    case kTypeBF16:
      return rows_typed<kTypeBF16>(a);
    default:
      return rows_typed<kTypeF32>(a);
  }
}
