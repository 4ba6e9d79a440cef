// The weight row kernel, written once and compiled once per ISA target.
//
// Included (not compiled on its own) by matvec_avx512.cpp, matvec_avx2.cpp and
// matvec_generic.cpp inside an anonymous namespace, after each defines `struct Ops`:
//
//   using V;  static constexpr int W (floats per vector, 8 or 16)
//   static constexpr int RB1 (rows per pass of the one-token path), RB, NT (rows and tokens of
//   the batched micro-kernel: RB * NT accumulators, NT activations and a weight must fit the
//   registers)
//   V zero(), set1(float), loadu(const float*);  void storeu(float*, V)
//   V fma(a, b, c) = a * b + c (one rounding);  V mul(a, b);  V add(a, b)
//   V load_f16(const uint16_t*), load_bf16(const uint16_t*), load_i8(const int8_t*)   W values
//   V nib(const uint8_t* qs, int j)   elements j*W .. j*W+W-1 of a 4-bit block as floats
//                                     (element e < 16: qs[e] & 15, else qs[e - 16] >> 4)
//   float f16(uint16_t);  float reduce_add(V)   (a fixed order of lane additions)
//   void reduce_add16(const V* v, float* out)   out[i] = reduce_add(v[i]) for 16 vectors, bit for bit
//   void pin(V&)                      keeps a loaded vector in a register (no folding into uses)
//   using I (W int32 lanes), for the codes of the 5- and 6-bit and K types:
//   I u8(const uint8_t* p)            W bytes, zero-extended
//   I bits(uint32_t mask, int first)  lane i: (mask >> (first + i)) & 1
//   I shr(I, int n), shl(I, int n), and_(I, int m), or_(I, I);  V cvt(I) (exact: |lanes| < 2^24)
//
// The arithmetic of one (row, token) product, the same on every path: every 32-value group of
// the row (a whole block of the 32-value types, a sub-block or two of a 256-value K super-block)
// is decoded into kVB = 32 / W weight vectors w_j, and accumulator j of the pair takes
// acc_j = fma(w_j, x_j, acc_j), group after group. The result is (acc_0 + acc_1 + ... ) summed
// lane-wise in that order, then reduce_add, then the scalar tail (float types with cols % 32 != 0)
// in column order. The paths differ only in how many rows and tokens share a pass:
//   - few tokens: RB1 rows per pass decode their blocks in registers and each token is a pass
//     (independent accumulator chains across the rows hide the FMA latency);
//   - many tokens: RB rows are decoded once into a float scratch row (L1), then micro-tiles of
//     RB rows x NT tokens run from it, one accumulator j of the kVB at a time, so a weight is
//     decoded once per token tile, each activation load serves RB rows and each weight load NT
//     tokens.
// So the bits of a (row, token) product do not depend on the token count, the tile or the rows
// sharing its pass (matvec_targets.hpp).
//
// Decoding a group (ggml's formats, gguf.hpp; d, m, dmin are f16):
//   Q8_0  w = d * q                      exact in float (11-bit d times an 8-bit integer)
//   Q4_0  w = d * (q - 8)                exact
//   Q5_0  w = d * (q - 16)               exact
//   Q4_1  w = fma(d, q, m)               one rounding (d * q is exact)
//   Q5_1  w = fma(d, q, m)               one rounding
//   Q4_K  w = fma(d * sc, q, -(dmin * m)) one rounding (d * sc, dmin * m and d * sc * q exact)
//   Q5_K  as Q4_K
//   Q6_K  w = (d * sc) * (q - 32)        exact (11 + 7 + 5 significant bits)
//   F16, BF16, F32                       widened exactly
// so w is bit for bit gguf::dequantize_row's value on every path.

constexpr int kVB = 32 / Ops::W;     // vectors per 32-value group = accumulators per (row, token)
static_assert(Ops::W <= 16, "a Q6_K vector must lie inside one 16-value scale group");

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
  static constexpr int kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < kVB; ++j) w[j] = Ops::mul(d, Ops::load_i8(q + j * Ops::W));
  }
};

template <>
struct Block<kTypeQ4_0> {
  static constexpr int kBytes = 18;
  static constexpr int kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const typename Ops::V eight = Ops::set1(-8.0f);
    for (int j = 0; j < kVB; ++j) w[j] = Ops::mul(d, Ops::add(Ops::nib(b + 2, j), eight));
  }
};

template <>
struct Block<kTypeQ4_1> {
  static constexpr int kBytes = 20;
  static constexpr int kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const typename Ops::V m = Ops::set1(Ops::f16(rd16(b + 2)));
    for (int j = 0; j < kVB; ++j) w[j] = Ops::fma(d, Ops::nib(b + 4, j), m);
  }
};

template <>
struct Block<kTypeF32> {
  static constexpr int kBytes = 128;
  static constexpr int kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
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
  static constexpr int kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
    for (int j = 0; j < kVB; ++j)
      w[j] = Ops::load_f16(reinterpret_cast<const uint16_t*>(b) + j * Ops::W);
  }
  static float scalar(const uint8_t* row, int64_t c) { return Ops::f16(rd16(row + c * 2)); }
};

template <>
struct Block<kTypeBF16> {
  static constexpr int kBytes = 64;
  static constexpr int kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
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

// v << n for n > 0, v >> -n (logical) for n < 0, v for 0 (no instruction once n is a constant).
inline typename Ops::I shift(typename Ops::I v, int n) {
  return n > 0 ? Ops::shl(v, n) : n < 0 ? Ops::shr(v, -n) : v;
}

template <>
struct Block<kTypeQ5_0> {
  static constexpr int kBytes = 22, kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const typename Ops::V sixteen = Ops::set1(-16.0f);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < kVB; ++j) w[j] = Ops::mul(d, Ops::add(Ops::cvt(q5(qh, b + 6, j)), sixteen));
  }
  // Codes j*W .. j*W+W-1 of a Q5_0 / Q5_1 block: nibble | fifth bit << 4.
  static typename Ops::I q5(uint32_t qh, const uint8_t* qs, int j) {
    const int e = j * Ops::W;
    const typename Ops::I lo = Ops::and_(shift(Ops::u8(qs + (e & 15)), e < 16 ? 0 : -4), 15);
    return Ops::or_(lo, Ops::shl(Ops::bits(qh, e), 4));
  }
};

template <>
struct Block<kTypeQ5_1> {
  static constexpr int kBytes = 24, kGroups = 1;
  static void decode(const uint8_t* b, int /*g*/, typename Ops::V* w) {
    const typename Ops::V d = Ops::set1(Ops::f16(rd16(b)));
    const typename Ops::V m = Ops::set1(Ops::f16(rd16(b + 2)));
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int j = 0; j < kVB; ++j)
      w[j] = Ops::fma(d, Ops::cvt(Block<kTypeQ5_0>::q5(qh, b + 8, j)), m);
  }
};

// Q4_K and Q5_K: group g of a super-block is sub-block g (scale and min of its own).
template <bool kFive>
struct BlockK45 {
  static constexpr int kBytes = kFive ? 176 : 144, kGroups = 8;
  static void decode(const uint8_t* b, int g, typename Ops::V* w) {
    const uint8_t* sc6 = b + 4;
    int sc, m;
    if (g < 4) {
      sc = sc6[g] & 63;
      m = sc6[g + 4] & 63;
    } else {
      sc = (sc6[g + 4] & 15) | (sc6[g - 4] >> 6) << 4;
      m = (sc6[g + 4] >> 4) | (sc6[g] >> 6) << 4;
    }
    const typename Ops::V ds = Ops::set1(Ops::f16(rd16(b)) * static_cast<float>(sc));
    const typename Ops::V ndm = Ops::set1(-(Ops::f16(rd16(b + 2)) * static_cast<float>(m)));
    const uint8_t* qs = b + (kFive ? 48 : 16) + 32 * (g / 2);
    for (int j = 0; j < kVB; ++j) {
      typename Ops::I q = Ops::and_(shift(Ops::u8(qs + j * Ops::W), -4 * (g % 2)), 15);
      if constexpr (kFive)
        q = Ops::or_(q, Ops::and_(shift(Ops::u8(b + 16 + j * Ops::W), 4 - g), 16));  // bit g
      w[j] = Ops::fma(ds, Ops::cvt(q), ndm);
    }
  }
};
template <>
struct Block<kTypeQ4_K> : BlockK45<false> {};
template <>
struct Block<kTypeQ5_K> : BlockK45<true> {};

// Q6_K: group g = 4 h + k holds values 128 h + 32 k + l (l < 32), scales 8 h + 2 k + l / 16.
template <>
struct Block<kTypeQ6_K> {
  static constexpr int kBytes = 210, kGroups = 8;
  static void decode(const uint8_t* b, int g, typename Ops::V* w) {
    const int h = g / 4, k = g % 4;
    const float d = Ops::f16(rd16(b + 208));
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * k;
    const uint8_t* ql = b + 64 * h + 32 * (k % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const typename Ops::V m32 = Ops::set1(-32.0f);
    for (int j = 0; j < kVB; ++j) {
      const int l = j * Ops::W;
      const typename Ops::I lo = Ops::and_(shift(Ops::u8(ql + l), -4 * (k / 2)), 15);
      const typename Ops::I hi =
          Ops::and_(shift(Ops::u8(qh + l), 4 - 2 * k), 0x30);  // bits 2k, 2k+1
      const typename Ops::V ds = Ops::set1(d * static_cast<float>(scales[l / 16]));
      w[j] = Ops::mul(ds, Ops::add(Ops::cvt(Ops::or_(lo, hi)), m32));
    }
  }
};

template <uint32_t T>
constexpr bool kFloatType = T == kTypeF32 || T == kTypeF16 || T == kTypeBF16;

// f(g) for g = 0, 1, ..., G - 1 in that order, g a compile-time constant (so that a K block's
// shifts and scale positions are immediates once decode is inlined).
template <int G, class F>
inline void for_each_group(F&& f) {
  [&]<int... g>(std::integer_sequence<int, g...>) { (f(std::integral_constant<int, g>{}), ...); }
  (std::make_integer_sequence<int, G>{});
}

// The end of a (row, token) product: accumulators in order, lanes, then the scalar tail.
template <uint32_t T>
inline typename Ops::V sum_acc(const typename Ops::V* acc) {
  typename Ops::V s = acc[0];
  for (int j = 1; j < kVB; ++j) s = Ops::add(s, acc[j]);
  return s;
}
template <uint32_t T>
inline float add_tail(float r, const uint8_t* row, const float* x, int64_t cols) {
  if constexpr (kFloatType<T>) {
    for (int64_t c = cols / 32 * 32; c < cols; ++c) r += Block<T>::scalar(row, c) * x[c];
  }
  return r;
}
template <uint32_t T>
inline float finish(const typename Ops::V* acc, const uint8_t* row, const float* x, int64_t cols) {
  return add_tail<T>(Ops::reduce_add(sum_acc<T>(acc)), row, x, cols);
}

// One token, RBn rows decoded in registers: y[r] = <row r, x>. With ahead > 0 the bytes `ahead`
// further on (a later pass's rows: weight_prefetch_ahead) are prefetched, each cache line once,
// as these are read: a decode step streams every matrix from memory (as the int8 path's
// dot_rows_1). Prefetching changes no arithmetic; its hint: kWeightPrefetchLocality
// (matvec_targets.hpp).
template <uint32_t T, int RBn>
inline void dot_rows_1(const uint8_t* const* rows, int64_t cols, const float* x, float* y,
                       int64_t ahead) {
  using V = typename Ops::V;
  V acc[RBn][kVB];
  for (int r = 0; r < RBn; ++r)
    for (int j = 0; j < kVB; ++j) acc[r][j] = Ops::zero();
  constexpr int G = Block<T>::kGroups;
  constexpr int64_t kLine = 64;
  const int64_t blocks = cols / 32 / G;
  for (int64_t k = 0; k < blocks; ++k) {
    if (ahead > 0) {  // the lines that start inside this block's bytes
      const int64_t lo = k * Block<T>::kBytes;
      for (int64_t o = (lo + kLine - 1) / kLine * kLine; o < lo + Block<T>::kBytes; o += kLine)
        for (int r = 0; r < RBn; ++r)
          __builtin_prefetch(rows[r] + o + ahead, 0, kWeightPrefetchLocality);
    }
    for_each_group<G>([&](auto g) {  // 32-value group b of the row
      const int64_t b = k * G + g;
      V xv[kVB];
      for (int j = 0; j < kVB; ++j) xv[j] = Ops::loadu(x + b * 32 + j * Ops::W);
      for (int r = 0; r < RBn; ++r) {
        V w[kVB];
        Block<T>::decode(rows[r] + k * Block<T>::kBytes, g, w);
        for (int j = 0; j < kVB; ++j) acc[r][j] = Ops::fma(w[j], xv[j], acc[r][j]);
      }
    });
  }
  for (int r = 0; r < RBn; ++r) y[r] = finish<T>(acc[r], rows[r], x, cols);
}

// A micro-tile from decoded float rows: RBn rows (wf + r * wstride) x NTn tokens, one
// accumulator vector j at a time: pass j runs acc_j of every (row, token) over every group of the
// row (the same FMAs in the same order as a pass holding all kVB accumulators), and keeps it in
// `done` until finish sums them. So a pass holds RBn * NTn accumulators, not kVB times as many: a
// larger tile in the registers, each activation load serving RBn rows and each weight load NTn
// tokens.
template <uint32_t T, int RBn, int NTn>
inline void dot_tile(const float* wf, int64_t wstride, const uint8_t* const* rows, int64_t cols,
                     const float* x, int64_t x_stride, float* y, int64_t y_stride) {
  using V = typename Ops::V;
  V done[RBn][NTn][kVB];
  const int64_t blocks = cols / 32;
  for (int j = 0; j < kVB; ++j) {
    V acc[RBn][NTn];
    for (int r = 0; r < RBn; ++r)
      for (int t = 0; t < NTn; ++t) acc[r][t] = Ops::zero();
    const float* xj = x + j * Ops::W;
    const float* wj = wf + j * Ops::W;
    for (int64_t b = 0; b < blocks; ++b) {
      V xv[NTn];
      for (int t = 0; t < NTn; ++t) xv[t] = Ops::loadu(xj + t * x_stride + b * 32);
      for (int r = 0; r < RBn; ++r) {
        V w = Ops::loadu(wj + r * wstride + b * 32);
        Ops::pin(w);
        for (int t = 0; t < NTn; ++t) acc[r][t] = Ops::fma(w, xv[t], acc[r][t]);
      }
    }
    for (int r = 0; r < RBn; ++r)
      for (int t = 0; t < NTn; ++t) done[r][t][j] = acc[r][t];
  }
  // finish for every (row, token), the lanes reduced 16 products at a time (reduce_add16: the
  // same additions as reduce_add's, fewer shuffles).
  constexpr int kN = RBn * NTn, kPadded = (kN + 15) / 16 * 16;
  V s[kPadded];
  float red[kPadded];
  for (int r = 0; r < RBn; ++r)
    for (int t = 0; t < NTn; ++t) s[r * NTn + t] = sum_acc<T>(done[r][t]);
  for (int i = kN; i < kPadded; ++i) s[i] = Ops::zero();
  for (int i = 0; i < kPadded; i += 16) Ops::reduce_add16(s + i, red + i);
  for (int r = 0; r < RBn; ++r)
    for (int t = 0; t < NTn; ++t)
      y[t * y_stride + r] = add_tail<T>(red[r * NTn + t], rows[r], x + t * x_stride, cols);
}

template <uint32_t T, int RBn>
inline void decode_rows(const uint8_t* const* rows, int64_t cols, float* wf, int64_t wstride) {
  constexpr int G = Block<T>::kGroups;
  for (int r = 0; r < RBn; ++r)
    for (int64_t k = 0; k < cols / 32 / G; ++k)
      for_each_group<G>([&](auto g) {
        const int64_t b = k * G + g;
        typename Ops::V w[kVB];
        Block<T>::decode(rows[r] + k * Block<T>::kBytes, g, w);
        for (int j = 0; j < kVB; ++j) Ops::storeu(wf + r * wstride + b * 32 + j * Ops::W, w[j]);
      });
}

// RBn rows against every token of the job.
template <uint32_t T, int RBn>
inline void rows_block(const RowsArgs& a, int64_t r0) {
  const uint8_t* rows[RBn];
  for (int r = 0; r < RBn; ++r) rows[r] = a.w + (r0 + r) * a.row_bytes;
  if (a.tokens < kBatchTokens) {
    for (int64_t t = 0; t < a.tokens; ++t) {
      float y[RBn];
      // The first token's pass brings the rows into the cache for the others.
      dot_rows_1<T, RBn>(rows, a.cols, a.x + t * a.x_stride, y,
                         t == 0 ? weight_prefetch_ahead(RBn * a.row_bytes) : 0);
      for (int r = 0; r < RBn; ++r) a.y[t * a.y_stride + r0 + r] = y[r];
    }
    return;
  }
  const int64_t wstride = decoded_row_stride(a.cols);
  decode_rows<T, RBn>(rows, a.cols, a.scratch, wstride);
  int64_t t = 0;
  for (; t + Ops::NT <= a.tokens; t += Ops::NT)
    dot_tile<T, RBn, Ops::NT>(a.scratch, wstride, rows, a.cols, a.x + t * a.x_stride, a.x_stride,
                              a.y + t * a.y_stride + r0, a.y_stride);
  for (; t < a.tokens; ++t)
    dot_tile<T, RBn, 1>(a.scratch, wstride, rows, a.cols, a.x + t * a.x_stride, a.x_stride,
                        a.y + t * a.y_stride + r0, a.y_stride);
}

template <uint32_t T>
void rows_typed(const RowsArgs& a) {
  constexpr int RB = Ops::RB;
  int64_t r = a.row_begin;
  if (a.tokens < kBatchTokens) {
    for (; r + Ops::RB1 <= a.row_end; r += Ops::RB1) rows_block<T, Ops::RB1>(a, r);
  } else {
    for (; r + RB <= a.row_end; r += RB) rows_block<T, RB>(a, r);
  }
  for (; r < a.row_end; ++r) rows_block<T, 1>(a, r);
}

void rows_impl(const RowsArgs& a) {
  switch (a.type) {
    case kTypeQ4_0:
      return rows_typed<kTypeQ4_0>(a);
    case kTypeQ4_1:
      return rows_typed<kTypeQ4_1>(a);
    case kTypeQ5_0:
      return rows_typed<kTypeQ5_0>(a);
    case kTypeQ5_1:
      return rows_typed<kTypeQ5_1>(a);
    case kTypeQ4_K:
      return rows_typed<kTypeQ4_K>(a);
    case kTypeQ5_K:
      return rows_typed<kTypeQ5_K>(a);
    case kTypeQ6_K:
      return rows_typed<kTypeQ6_K>(a);
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
