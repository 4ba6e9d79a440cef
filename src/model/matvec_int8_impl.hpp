// The integer (8-bit activation) row kernel, written once and compiled once per target.
//
// Included (not compiled on its own) by matvec_int8_generic.cpp, matvec_int8_avx2.cpp and
// matvec_int8_vnni.cpp inside an anonymous namespace, after each defines `struct Ops`:
//
//   using B (32 bytes), I (8 int32 lanes), V (8 floats)
//   B load(const void*)                 32 bytes
//   B nib(const uint8_t* qs)            byte e: e < 16 ? qs[e] & 15 : qs[e - 16] >> 4
//   B lo4(B), hi4(B)                    each byte & 15, each byte >> 4
//   B shr(B, n), shl(B, n)              each byte shifted (logical, 8 bits)
//   B and_(B, uint8_t), or_(B, B)       bytewise
//   B or_bits(B c, uint32_t m, uint8_t v)  byte e: bit e of m ? c[e] | v : c[e]
//   I dot_u(B w, B x)   lane i = sum_{k<4} w[4i+k] (unsigned) * x[4i+k] (signed)
//   I dot_s(B w, B x)   the same with w signed
//   S (16 int16 sub-scales: 0-7 low half, 8-15 high), scales_i8(16 int8), half<h>(S) (half h in
//   both halves); M (8 mins); unpack_k4(12 packed bytes, S& sc, M& mn): Q4_K / Q5_K's 8 scales
//   (both halves) and 8 mins; B pairs(w, x): int16 j = w[2j] x[2j] + w[2j+1] x[2j+1]
//   (maddubs), I madd16(S a, const int16_t b[16]) (lane i: a[2i] b[2i] + a[2i+1] b[2i+1]);
//   P pick<e0, e1>(S s): element e0 of the low half (for lanes 0-3) and e1 of the high half
//   (lanes 4-7); I madd_acc(I acc, B p, P sc): lane i of
//   acc plus (p[2i] + p[2i+1]) times its element of sc (exact int32)
//   I izero(), add(I, I), isub(I, I)   int32 lanes; B splat(uint8_t) 32 equal bytes
//   V cvt(I) (rounded to nearest even; exact below 2^24), set1, zero, fma (one rounding)
//   int k4_msum(M mn, const int16_t bsum[8]) = sum_g mn_g * bsum_g (exact)
//   I dpu / dps(I acc, B w, B x) = acc + dot_u / dot_s; int hsum(I) (the lane sum)
//   Tokens in lanes (the batched paths): B bcast4(p) (the 4 bytes at p in every lane), I
//   ishl(I, n), iload, vload, vstore, mul, vadd; I mul_s(I, int32) (lanes times a scalar),
//   I madd_pairs(I acc, B p, int32 pr) (lane i + p[2i] * lo + p[2i+1] * hi, p as 16 int16, (lo,
//   hi) the int16 halves of pr). kRows4 (x86): F4 (4 floats, a row each), sums4(4 I) = the 4
//   lane sums (exact int32) converted to floats (rounded to nearest); set4, load4, f16x4, zero4,
//   mul4, fma4, add4, store4, neg4; f16pairs4(4 row pointers, F4& d, F4& dmin) (the K types'
//   f16 pairs); msums4(4 M, bsum) (k4_msum of 4 rows, as floats). kWide (AVX-512 VNNI): W (16
//   int32 lanes: two groups of 8 tokens), WV (16 floats) and w-prefixed forms of the batched
//   ops (wload2 of two 32-byte halves, wbcast4, wdpu, wmul_s, wadd, wmadd_pairs, wvload2, wvset1,
//   wvmul, wvadd, wvfma, wcvt, wvstore), for groupk's WideLanes.
//
// The 32-value types (one scale per 32 weights) read activation blocks of 32 (ActBlock); the K
// types (super-blocks of 256 weights with integer sub-scales) read blocks of 256 (ActBlockK, as
// llama.cpp's Q8_K), so that a super-block is one integer sum and one float multiply-add.
//
// 32-value types. Every block b of the row is decoded into 32 integer codes c (bytes), a float
// a_b and, for the types with a min, a float m_b, so that the weights are w = a_b * c + m_b:
//   Q8_0  c = q           signed   a = d
//   Q4_0  c = q - 8       offset   a = d
//   Q5_0  c = q - 16      offset   a = d
//   Q4_1  c = q           unsigned a = d                m = m
//   Q5_1  c = q           unsigned a = d                m = m
// The activation block b of the token (ActBlock: d_x, s_x = d_x * sum q_x, q_x) gives
//   S = sum of c * q_x over the block   an exact integer (|S| <= 32 * 128 * 127 < 2^24); the
//                                       offset types compute it as dot(q, q_x) - off * sum(q_x)
//   acc = fma(a_b * d_x, S, acc)        (a_b * d_x rounded once; S exact as a float)
//   macc = fma(m_b, s_x, macc)          (types with a min)
// block after block; the result is acc + macc. One token (dot_rows_1, dot_rows_1x4) sums S from
// 8 int32 lanes of 4 products; several tokens (group8) put 8 tokens in the lanes and sum each
// token's S in its lane (ActBlock8), so the float operations per (row, token) are the same
// scalar sequence either way. Tokens in lanes do one float multiply-add per 8 tokens and block
// instead of 8 (`treeattn_microbench --benchmark_filter=BM_Matmul` measures the batched path).
// K types: see CodeK below (one float multiply-add per 256 weights, the sub-scales and mins
// summed in integers; the same operations with 8 tokens in lanes in the batched path).
// The integer lanes are the same on every target (maddubs + madd and vpdpbusd both sum products
// 4i .. 4i+3 into lane i; maddubs' int16 pair sums cannot saturate: 2 * 128 * 127 < 2^15) and
// the float operations are the same sequence, so every target gives the same bits, and a (row,
// token) product does not depend on the token count, the rows sharing its pass or the thread
// (matvec_targets.hpp).
//
// Error bound (the test checks it). Quantizing an activation block b (32 values, or 256 for the
// K types) with d = amax_b / 127 (rounded) and q = rint(fl(x / d)) gives |x/d - fl(x/d)| <=
// 2^-24 * 127 and so
// |x - d q| <= d (1/2 + 127 * 2^-24) <= (amax_b / 254) (1 + 2^-24) (1 + 254 * 2^-24)
//          <= (amax_b / 254) (1 + 2^-15) per element.
// Hence, with w the weights as decoded (in exact arithmetic),
//   |<w, d q> - <w, x>| <= sum_b (amax_b / 254) (1 + 2^-15) sum_{i in b} |w_i|,
// and the float evaluation of <w, d q> adds at most gamma_k * sum_i |w_i d_b q_i| with
// gamma_k = k u / (1 - k u), u = 2^-24, k = blocks + 6 (a_b * d_x, the fma chain, the K types'
// float(S), the final add; the min terms' roundings are inside the same k), where
// blocks = cols / 32 for the 32-value types and cols / 256 for the K types.
// The float path decodes w with one rounding for Q4_1 / Q5_1 / Q4_K / Q5_K (fma(d, q, m)); the
// integer path never forms w, so against the dequantized row add u * sum |w_i x_i|.

// The weight prefetch of the one-token passes (the next pass's rows, `ahead` bytes on), with the
// hint matvec_targets.hpp states.
inline void prefetch_w(const void* p) { __builtin_prefetch(p, 0, kWeightPrefetchLocality); }

constexpr int kGroupBytes = 40;  // one decoded block in the batched path's scratch

template <uint32_t T>
struct Code;  // per 32-value type: kBytes, kOff, kMaxCode, kSigned, kMin; decode(block, Dec&)

struct Dec {
  typename Ops::B c;
  float a = 0.0f, m = 0.0f;
};

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// v << n for n > 0, v >> -n for n < 0 (bytewise), v for 0.
inline typename Ops::B shift(typename Ops::B v, int n) {
  return n > 0 ? Ops::shl(v, n) : n < 0 ? Ops::shr(v, -n) : v;
}

template <>
struct Code<kTypeQ8_0> {
  static constexpr int kBytes = 34, kOff = 0, kMaxCode = 127;  // |code|
  static constexpr bool kSigned = true, kMin = false;
  static void decode(const uint8_t* b, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.c = Ops::load(b + 2);
  }
};

template <>
struct Code<kTypeQ4_0> {
  static constexpr int kBytes = 18, kOff = 8, kMaxCode = 15;
  static constexpr bool kSigned = false, kMin = false;
  static void decode(const uint8_t* b, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.c = Ops::nib(b + 2);
  }
};

template <>
struct Code<kTypeQ4_1> {
  static constexpr int kBytes = 20, kOff = 0, kMaxCode = 15;
  static constexpr bool kSigned = false, kMin = true;
  static void decode(const uint8_t* b, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.m = Ops::f16(rd16(b + 2));
    o.c = Ops::nib(b + 4);
  }
};

template <>
struct Code<kTypeQ5_0> {
  static constexpr int kBytes = 22, kOff = 16, kMaxCode = 31;
  static constexpr bool kSigned = false, kMin = false;
  static void decode(const uint8_t* b, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.c = Ops::or_bits(Ops::nib(b + 6), rd32(b + 2), 0x10);
  }
};

template <>
struct Code<kTypeQ5_1> {
  static constexpr int kBytes = 24, kOff = 0, kMaxCode = 31;
  static constexpr bool kSigned = false, kMin = true;
  static void decode(const uint8_t* b, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.m = Ops::f16(rd16(b + 2));
    o.c = Ops::or_bits(Ops::nib(b + 8), rd32(b + 4), 0x10);
  }
};

template <int G, class F>
inline void for_each_group(F&& f) {
  [&]<int... g>(std::integer_sequence<int, g...>) { (f(std::integral_constant<int, g>{}), ...); }
  (std::make_integer_sequence<int, G>{});
}

// The offset term of a block of the token for the types stored with an offset (Q4_0, Q5_0):
// kOff times the lane sums of q_x, once per block for all the rows of the pass.
template <uint32_t T>
inline typename Ops::I offset(typename Ops::B xv) {
  if constexpr (Code<T>::kOff != 0) return Ops::dot_u(Ops::splat(Code<T>::kOff), xv);
  return Ops::izero();
}

// A block's products of codes c with the token's q_x in 8 int32 lanes (lane i: products 4i ..
// 4i+3; the offset types less their offset term xoff): their sum is the block's S.
template <uint32_t T>
inline typename Ops::I block_lanes(typename Ops::B c, typename Ops::B xq, typename Ops::I xoff) {
  typename Ops::I p = Code<T>::kSigned ? Ops::dot_s(c, xq) : Ops::dot_u(c, xq);
  if constexpr (Code<T>::kOff != 0) p = Ops::isub(p, xoff);
  return p;
}

// One block of one (row, token) product: the block's integer sum S (exact), then
// acc = fma(a_b * d_x, S, acc) and, for the types with a min, macc = fma(m_b, s_x, macc).
template <uint32_t T>
inline void step(const Dec& w, const ActBlock& xb, typename Ops::B xq, typename Ops::I xoff,
                 float& acc, float& macc) {
  acc = std::fma(w.a * xb.d, static_cast<float>(Ops::hsum(block_lanes<T>(w.c, xq, xoff))), acc);
  if constexpr (Code<T>::kMin) macc = std::fma(w.m, xb.s, macc);
}

// The one-token passes' prefetch: the lines that start inside block b's bytes, `ahead` bytes on
// in each of the RBn rows (so each line of the rows once).
template <uint32_t T, int RBn>
inline void prefetch_block(const uint8_t* const* rows, int64_t b, int64_t ahead) {
  for (int64_t o = (b * Code<T>::kBytes + 63) / 64 * 64; o < (b + 1) * Code<T>::kBytes; o += 64)
    for (int r = 0; r < RBn; ++r) prefetch_w(rows[r] + o + ahead);
}

// One token, RBn rows decoded in registers. The rows `ahead` bytes further (a later pass's:
// weight_prefetch_ahead) are prefetched, each line once, as these are read (the decode step
// streams every matrix from memory).
template <uint32_t T, int RBn>
inline void dot_rows_1(const uint8_t* const* rows, int64_t cols, const ActBlock* xq, float* y,
                       int64_t ahead) {
  float acc[RBn], macc[RBn];
  for (int r = 0; r < RBn; ++r) acc[r] = macc[r] = 0.0f;
  for (int64_t b = 0; b < cols / 32; ++b) {
    const ActBlock& xb = xq[b];
    const typename Ops::B xv = Ops::load(xb.q);
    const typename Ops::I xoff = offset<T>(xv);
    prefetch_block<T, RBn>(rows, b, ahead);
    for (int r = 0; r < RBn; ++r) {
      Dec w;
      Code<T>::decode(rows[r] + b * Code<T>::kBytes, w);
      step<T>(w, xb, xv, xoff, acc[r], macc[r]);
    }
  }
  for (int r = 0; r < RBn; ++r) y[r] = Code<T>::kMin ? acc[r] + macc[r] : acc[r];
}

// The same for 4 rows with the rows in the lanes of one 4-float vector (x86): the 4 integer sums
// in one reduction, then step()'s float operations on the 4 rows at once (the same roundings,
// lane by lane, so the same bits as dot_rows_1).
template <uint32_t T, class O = Ops>  // O: dependent, for the targets without kRows4
inline void dot_rows_1x4(const uint8_t* const* rows, int64_t cols, const ActBlock* xq, float* y,
                         int64_t ahead) {
  using F4 = typename O::F4;
  F4 acc = O::zero4(), macc = O::zero4();
  for (int64_t b = 0; b < cols / 32; ++b) {
    const ActBlock& xb = xq[b];
    const typename Ops::B xv = Ops::load(xb.q);
    const typename Ops::I xoff = offset<T>(xv);
    prefetch_block<T, 4>(rows, b, ahead);
    typename Ops::I p[4];
    for (int r = 0; r < 4; ++r) {
      Dec w;  // its codes (a and m are read below, for the 4 rows at once)
      Code<T>::decode(rows[r] + b * Code<T>::kBytes, w);
      p[r] = block_lanes<T>(w.c, xv, xoff);
    }
    // The 4 rows' f16 scales (every 32-value type: d at byte 0, m at byte 2) in one conversion.
    const uint8_t* q0 = rows[0] + b * Code<T>::kBytes;
    const uint8_t* q1 = rows[1] + b * Code<T>::kBytes;
    const uint8_t* q2 = rows[2] + b * Code<T>::kBytes;
    const uint8_t* q3 = rows[3] + b * Code<T>::kBytes;
    const F4 a =
        O::mul4(O::f16x4(rd16(q0), rd16(q1), rd16(q2), rd16(q3)), O::set4(xb.d, xb.d, xb.d, xb.d));
    acc = O::fma4(a, O::sums4(p[0], p[1], p[2], p[3]), acc);
    if constexpr (Code<T>::kMin)
      macc = O::fma4(O::f16x4(rd16(q0 + 2), rd16(q1 + 2), rd16(q2 + 2), rd16(q3 + 2)),
                     O::set4(xb.s, xb.s, xb.s, xb.s), macc);
  }
  O::store4(y, Code<T>::kMin ? O::add4(acc, macc) : acc);
}

// The codes of the batched path (group8): Code<T>'s, except that on the targets whose
// dot product sums in int32 (VNNI, generic: !Ops::kPairAcc) Q8_0's signed codes are stored
// biased, w + 128 as an unsigned byte, with an offset of 128: vpdpbusd multiplies them as they
// are (no |w| and sign(q, w) per product, 2 of dps's 3 or 4 instructions), and S = sum (w + 128)
// q - 128 sum q is the same integer, so the same bits. (Without VNNI maddubs' int16 pair sums
// could saturate at 2 x 255 x 127.)
template <uint32_t T>
struct BatchCode {
  static constexpr bool kBias = Code<T>::kSigned && !Ops::kPairAcc;
  static constexpr bool kSigned = Code<T>::kSigned && !kBias;
  static constexpr int kOff = kBias ? 128 : Code<T>::kOff;
  static constexpr int kShift = kOff == 8 ? 3 : kOff == 16 ? 4 : 7;
  static_assert(kOff == 0 || kOff == 1 << kShift);
};

// The batched path's decoded block: 32 code bytes, a, m (kGroupBytes).
inline void store_dec(uint8_t* p, const Dec& w) {
  Ops::store(p, w.c);
  std::memcpy(p + 32, &w.a, 4);
  std::memcpy(p + 36, &w.m, 4);
}

// The end of a batched pass: row r's results for kLanes tokens in the lanes of o[r] into
// y[t * y_stride + r] for the first `lanes` tokens. Four rows of a full vector go out as one
// 16-byte store per token (L::store_t4: the 4 rows of a token are adjacent in y), instead of a
// float at a time behind a runtime lane count (~5% of the K kernel at 1536 columns, perf
// annotate, Zen 5); anything else a float at a time. L: Ops, or groupk's lanes.
template <class L, int RBn, int kLanes>
inline void store_rows(const typename L::V (&o)[RBn], int lanes, float* y, int64_t y_stride) {
  if constexpr (RBn == 4)
    if (lanes == kLanes) return L::store_t4(y, y_stride, o[0], o[1], o[2], o[3]);
  for (int r = 0; r < RBn; ++r) {
    float out[kLanes];
    L::vstore(out, o[r]);
    for (int t = 0; t < lanes; ++t) y[t * y_stride + r] = out[t];
  }
}

// group8 on 4 rows x 8 tokens for the unsigned 32-value types without VNNI (AVX2:
// Ops::kPairAcc): per block one Ops::pair_block4 (asm: per row, maddubs' int16 pairs summed over
// kFlush groups, then one vpmaddwd by ones into S, instead of maddubs, vpmaddwd and an add per
// group), then group8's offset and float operations. The same integers (a pair sum is at most
// 2 * kMaxCode * 127, the activations being clamped to +-127 (quantize_block), and kFlush of them
// fit in int16: Q4_0 / Q4_1 8, Q5_0 / Q5_1 4; even at -128 they would, 31744 at most), so the
// same bits (Int8Matmul.CodesAtTheirLargestGiveTheOneTokenBits: every code at its largest).
template <uint32_t T, class O = Ops>  // O: dependent, pair_block4 is on the kPairAcc target only
inline void group8_pairs4(const uint8_t* dec, int64_t blocks, const ActBlock8* xt, int lanes,
                          float* y, int64_t y_stride) {
  using V = typename Ops::V;
  using I = typename Ops::I;
  constexpr int kFlush = std::min(8, 32767 / (2 * Code<T>::kMaxCode * 127));
  static_assert(kFlush == 8 || kFlush == 4);
  const I ones = Ops::iset1(0x00010001);  // int16 pairs (1, 1)
  V acc[4], macc[4];
  for (int r = 0; r < 4; ++r) acc[r] = macc[r] = Ops::zero();
  const uint8_t* c[4];
  for (int r = 0; r < 4; ++r) c[r] = dec + r * blocks * kGroupBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const ActBlock8& xb = xt[b];
    I p[4];
    for (int r = 0; r < 4; ++r) p[r] = Ops::izero();
    O::template pair_block4<kFlush>(xb.q[0], c, ones, p);
    if constexpr (Code<T>::kOff != 0) {
      constexpr int kShift = Code<T>::kOff == 8 ? 3 : 4;
      static_assert(Code<T>::kOff == 1 << kShift);
      const I off = Ops::ishl(Ops::iload(xb.sum), kShift);
      for (int r = 0; r < 4; ++r) p[r] = Ops::isub(p[r], off);
    }
    const V d = Ops::vload(xb.d);
    for (int r = 0; r < 4; ++r) {
      float wa, wm;
      std::memcpy(&wa, c[r] + 32, 4);
      acc[r] = Ops::fma(Ops::mul(Ops::set1(wa), d), Ops::cvt(p[r]), acc[r]);
      if constexpr (Code<T>::kMin) {
        std::memcpy(&wm, c[r] + 36, 4);
        macc[r] = Ops::fma(Ops::set1(wm), Ops::vload(xb.s), macc[r]);
      }
      c[r] += kGroupBytes;
    }
  }
  V o[4];
  for (int r = 0; r < 4; ++r) o[r] = Code<T>::kMin ? Ops::vadd(acc[r], macc[r]) : acc[r];
  store_rows<Ops, 4, 8>(o, lanes, y, y_stride);
}

// The lanes of the batched paths (group8 and groupk), one vector of tokens: Narrow, one group of 8
// tokens (I, V); Wide (Ops::kWide targets), groups 2v and 2v + 1 in one W / WV of 16 tokens, so
// one vpdpbusd does 64 products and the broadcasts, loads, scale products and float tail per
// product halve (Zen 4 runs a zmm operation as two ymm halves: the same peak, half the
// instructions, which bounded the narrow form; Zen 5's 512-bit units do twice the products per
// instruction). Vector v of a pass reads field f of its groups' block k (xt: group g's at
// xt[g * blocks + k]; ActBlock8 or ActBlockK8). Lane by lane both run the same integer and float
// operations, so the same bits.
struct NarrowLanes : Ops {  // Ops' own B, I, V and vector operations, 8 tokens
  static constexpr int kTokens = 8;
  static constexpr bool kPairAcc = Ops::kPairAcc;
  template <class X, class F>
  static B load(const X* xt, int64_t blocks, int v, int64_t k, F f) {
    return Ops::load(f(xt[v * blocks + k]));
  }
  template <class X, class F>
  static I iload(const X* xt, int64_t blocks, int v, int64_t k, F f) {
    return Ops::iload(f(xt[v * blocks + k]));
  }
  template <class X, class F>
  static V vload(const X* xt, int64_t blocks, int v, int64_t k, F f) {
    return Ops::vload(f(xt[v * blocks + k]));
  }
};
template <class O = Ops>  // O: dependent, instantiated on kWide targets only
struct WideLanes {
  using B = typename O::W;
  using I = typename O::W;
  using V = typename O::WV;
  static constexpr int kTokens = 16;
  static constexpr bool kPairAcc = false;
  template <class X, class F>
  static I load(const X* xt, int64_t blocks, int v, int64_t k, F f) {
    return O::wload2(f(xt[2 * v * blocks + k]), f(xt[(2 * v + 1) * blocks + k]));
  }
  template <class X, class F>
  static I iload(const X* xt, int64_t blocks, int v, int64_t k, F f) {
    return load(xt, blocks, v, k, f);
  }
  template <class X, class F>
  static V vload(const X* xt, int64_t blocks, int v, int64_t k, F f) {
    return O::wvload2(f(xt[2 * v * blocks + k]), f(xt[(2 * v + 1) * blocks + k]));
  }
  static I izero() { return O::wzero(); }
  static I bcast4(const uint8_t* p) { return O::wbcast4(p); }
  static I dpu(I acc, I w, I x) { return O::wdpu(acc, w, x); }
  static I add(I a, I b) { return O::wadd(a, b); }
  static I isub(I a, I b) { return O::wsub(a, b); }
  static I ishl(I a, int n) { return O::wshl(a, n); }
  static I mul_s(I v, int32_t s) { return O::wmul_s(v, s); }
  static I madd_pairs(I acc, I p, int32_t pr) { return O::wmadd_pairs(acc, p, pr); }
  static V zero() { return O::wvzero(); }
  static V set1(float x) { return O::wvset1(x); }
  static V mul(V a, V b) { return O::wvmul(a, b); }
  static V fma(V a, V b, V c) { return O::wvfma(a, b, c); }
  static V cvt(I v) { return O::wcvt(v); }
  static V vadd(V a, V b) { return O::wvadd(a, b); }
  static void vstore(float* p, V v) { O::wvstore(p, v); }
  static void store_t4(float* y, int64_t stride, V a, V b, V c, V d) {
    O::wstore_t4(y, stride, a, b, c, d);
  }
};

// RBn decoded rows (dec: row r's block b at (r * blocks + b) * kGroupBytes) against NV vectors
// of tokens (L: NarrowLanes, 8 tokens a vector, or WideLanes, 16), tokens in lanes: per block,
// the 8 four-code groups of each row are broadcast against the tokens' q (ActBlock8), so lane t
// sums token t's 32 products (the block's integer S of step(); Q8_0's biased codes, BatchCode,
// less their offset); then acc = fma(a_b * d, S, acc), macc = fma(m_b, s, macc) lane by lane:
// each lane runs step()'s operations, so a token's bits are those of its one-token pass. Each
// broadcast serves NV * L::kTokens tokens. y[(L::kTokens v + t) * y_stride + r] for the first
// `lanes` tokens of the last vector, all of the others'.
template <uint32_t T, int RBn, int NV, class L = NarrowLanes>
inline void group8(const uint8_t* dec, int64_t blocks, const ActBlock8* xt, int lanes, float* y,
                   int64_t y_stride) {
  if constexpr (L::kPairAcc && !Code<T>::kSigned && RBn == 4 && NV == 1) {
    group8_pairs4<T>(dec, blocks, xt, lanes, y, y_stride);
    return;
  }
  using V = typename L::V;
  using I = typename L::I;
  V acc[RBn][NV], macc[RBn][NV];
  for (int r = 0; r < RBn; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = macc[r][v] = L::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    I p[RBn][NV];
    for (int r = 0; r < RBn; ++r)
      for (int v = 0; v < NV; ++v) p[r][v] = L::izero();
    for_each_group<8>([&](auto i) {
      constexpr int kI = decltype(i)::value;
      typename L::B xv[NV];
      for (int v = 0; v < NV; ++v)
        xv[v] = L::load(xt, blocks, v, b, [](const ActBlock8& x) { return x.q[kI]; });
      for (int r = 0; r < RBn; ++r) {
        const typename L::B w = L::bcast4(dec + (r * blocks + b) * kGroupBytes + 4 * kI);
        for (int v = 0; v < NV; ++v) {
          if constexpr (BatchCode<T>::kSigned)
            p[r][v] = L::dps(p[r][v], w, xv[v]);
          else
            p[r][v] = L::dpu(p[r][v], w, xv[v]);
        }
      }
    });
    for (int v = 0; v < NV; ++v) {
      if constexpr (BatchCode<T>::kOff != 0) {
        const I sum = L::iload(xt, blocks, v, b, [](const ActBlock8& x) { return x.sum; });
        const I off = L::ishl(sum, BatchCode<T>::kShift);
        for (int r = 0; r < RBn; ++r) p[r][v] = L::isub(p[r][v], off);
      }
      const V d = L::vload(xt, blocks, v, b, [](const ActBlock8& x) { return x.d; });
      V s{};
      if constexpr (Code<T>::kMin)
        s = L::vload(xt, blocks, v, b, [](const ActBlock8& x) { return x.s; });
      for (int r = 0; r < RBn; ++r) {
        const uint8_t* db = dec + (r * blocks + b) * kGroupBytes;
        float wa, wm;
        std::memcpy(&wa, db + 32, 4);
        acc[r][v] = L::fma(L::mul(L::set1(wa), d), L::cvt(p[r][v]), acc[r][v]);
        if constexpr (Code<T>::kMin) {
          std::memcpy(&wm, db + 36, 4);
          macc[r][v] = L::fma(L::set1(wm), s, macc[r][v]);
        }
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    V o[RBn];
    for (int r = 0; r < RBn; ++r) o[r] = Code<T>::kMin ? L::vadd(acc[r][v], macc[r][v]) : acc[r][v];
    store_rows<L, RBn, L::kTokens>(o, v == NV - 1 ? lanes : L::kTokens,
                                   y + L::kTokens * v * y_stride, y_stride);
  }
}

// RBn rows against every token of the job. Several tokens: the rows are decoded once into the
// scratch (L1), then each group of 8 tokens runs from it (group8; on kWide targets pairs of
// groups on wide lanes first).
template <uint32_t T, int RBn>
inline void rows_block(const RowsArgs& a, int64_t r0) {
  const uint8_t* rows[RBn];
  for (int r = 0; r < RBn; ++r) rows[r] = a.w + (r0 + r) * a.row_bytes;
  if (a.tokens == 1) {
    float y[RBn];
    if constexpr (RBn == 4 && Ops::kRows4)
      dot_rows_1x4<T>(rows, a.cols, a.xq, y, weight_prefetch_ahead(RBn * a.row_bytes));
    else
      dot_rows_1<T, RBn>(rows, a.cols, a.xq, y, weight_prefetch_ahead(RBn * a.row_bytes));
    for (int r = 0; r < RBn; ++r) a.y[r0 + r] = y[r];
    return;
  }
  const int64_t blocks = a.cols / 32;
  // The next pass's rows (the RBn rows on; prefetching is harmless past the job's rows, inside
  // or outside the matrix), fetched while this pass decodes and computes, so that their decode
  // reads L2, not DRAM: a decode step's batch streams every matrix once, and without it the
  // decode below waited on each new line (41% of the Q5_0 pass's samples at 16 tokens, Zen 5).
  for (int64_t o = 0; o < RBn * a.row_bytes; o += 64) prefetch_w(rows[0] + RBn * a.row_bytes + o);
  auto* dec = reinterpret_cast<uint8_t*>(a.scratch);
  for (int r = 0; r < RBn; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      Dec w;
      Code<T>::decode(rows[r] + b * Code<T>::kBytes, w);
      if constexpr (BatchCode<T>::kBias) w.c = Ops::flip(w.c);  // w + 128 (mod 256)
      store_dec(dec + (r * blocks + b) * kGroupBytes, w);
    }
  const int64_t groups = (a.tokens + 7) / 8;
  int64_t g = 0;
  if constexpr (Ops::kWide) {
    // 2 vectors (32 tokens) a pass: 8 chains of vpdpbusd, p / acc (/ macc) in 16-24 registers;
    // then a last pair of groups as one vector.
    for (; g + 4 <= groups; g += 4)
      group8<T, RBn, 2, WideLanes<>>(
          dec, blocks, a.xt + g * blocks,
          static_cast<int>(std::min<int64_t>(16, a.tokens - 8 * (g + 2))),
          a.y + g * 8 * a.y_stride + r0, a.y_stride);
    if (g + 2 <= groups) {
      group8<T, RBn, 1, WideLanes<>>(dec, blocks, a.xt + g * blocks,
                                     static_cast<int>(std::min<int64_t>(16, a.tokens - 8 * g)),
                                     a.y + g * 8 * a.y_stride + r0, a.y_stride);
      g += 2;
    }
  }
  for (; g + Ops::NG <= groups; g += Ops::NG)
    group8<T, RBn, Ops::NG>(
        dec, blocks, a.xt + g * blocks,
        static_cast<int>(std::min<int64_t>(8, a.tokens - 8 * (g + Ops::NG - 1))),
        a.y + g * 8 * a.y_stride + r0, a.y_stride);
  for (; g < groups; ++g)
    group8<T, RBn, 1>(dec, blocks, a.xt + g * blocks,
                      static_cast<int>(std::min<int64_t>(8, a.tokens - 8 * g)),
                      a.y + g * 8 * a.y_stride + r0, a.y_stride);
}

// Rows in lanes for Q8_0 and Q5_0 (the rows8 records of matvec_targets.hpp, one per block of 32
// columns): rows r0 .. r0 + 7 against tokens t0 .. t0 + NT - 1, each record's codes decoded once
// for the NT tokens. Per block and token S = dot(c, q) - off sum(q) (exact: the row layout's
// integer) and acc = fma(d * d_x, float(S), acc) lane by lane (step()'s roundings), so the row
// layout's bits. Q8_0: 8 loads of signed codes, each one dps (|w| against sign(x, w): maddubs'
// int16 pairs stay below 2 * 128 * 127 on AVX2) against 4 broadcast activation bytes; Q5_0: 4
// loads of nibbles and one of fifth bits, a code vector per nibble half.
template <uint32_t T, int NT>
inline void rows8_pass32(const RowsArgs& a, int64_t r0, int64_t t0) {
  using I = typename Ops::I;
  using B = typename Ops::B;
  constexpr int64_t kRec = rows8_record_bytes(T);
  constexpr int kOff = T == kTypeQ8_0 ? 0 : 16;
  const int64_t blocks = a.cols / 32;
  const uint8_t* p = a.w8 + r0 / 8 * blocks * kRec;
  typename Ops::V acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = Ops::zero();
  for (int64_t b = 0; b < blocks; ++b, p += kRec) {
    for (int64_t o = (b * kRec + 63) / 64 * 64 - b * kRec; o < kRec; o += 64)
      prefetch_w(p + kWeightPrefetchBytes + o);
    const ActBlock* xb[NT];
    I s[NT];
    for (int t = 0; t < NT; ++t) {
      xb[t] = a.xq + (t0 + t) * a.xq_stride + b;
      s[t] = kOff != 0 ? Ops::iset1(-kOff * a.xsum[(t0 + t) * a.xq_stride + b]) : Ops::izero();
    }
    if constexpr (T == kTypeQ8_0) {
      for (int st = 0; st < 8; ++st) {
        const B w = Ops::load(p + 32 * st);  // signed: dps (|w| and sign(x, w), as the rows)
        for (int t = 0; t < NT; ++t)
          s[t] =
              Ops::dps(s[t], w, Ops::bcast4(reinterpret_cast<const uint8_t*>(xb[t]->q) + 4 * st));
      }
    } else {
      static_assert(T == kTypeQ5_0);
      const B h = Ops::load(p + 128);
      for_each_group<4>([&](auto ss) {
        constexpr int st = decltype(ss)::value;
        const B v = Ops::load(p + 32 * st);
        const B lo = Ops::or_(Ops::lo4(v), Ops::and_(shift(h, 4 - st), 0x10));
        const B hi = Ops::or_(Ops::hi4(v), Ops::and_(shift(h, -st), 0x10));
        for (int t = 0; t < NT; ++t) {
          const auto* xq = reinterpret_cast<const uint8_t*>(xb[t]->q) + 8 * st;
          s[t] = Ops::dpu(s[t], lo, Ops::bcast4(xq));
          s[t] = Ops::dpu(s[t], hi, Ops::bcast4(xq + 4));
        }
      });
    }
    const typename Ops::V d = Ops::f16x8(p + kRec - 16);
    for (int t = 0; t < NT; ++t)
      acc[t] = Ops::fma(Ops::mul(d, Ops::set1(xb[t]->d)), Ops::cvt(s[t]), acc[t]);
  }
  for (int t = 0; t < NT; ++t) Ops::vstore(a.y + (t0 + t) * a.y_stride + r0, acc[t]);
}

template <uint32_t T, int NT>
inline void rows8_pass(const RowsArgs& a, int64_t r0, int64_t t0);  // the K types, below

// Rows r0 .. r0 + 7 in the rows8 layout against every token of the job: passes of 4 tokens, then
// the rest.
template <uint32_t T>
inline void rows8_tokens(const RowsArgs& a, int64_t r0) {
  const auto pass = [&]<int NT>(int64_t t0) {
    if constexpr (rows8_record_cols(T) == 256)
      rows8_pass<T, NT>(a, r0, t0);
    else
      rows8_pass32<T, NT>(a, r0, t0);
  };
  int64_t t0 = 0;
  for (; t0 + 4 <= a.tokens; t0 += 4) pass.template operator()<4>(t0);
  switch (a.tokens - t0) {
    case 3:
      return pass.template operator()<3>(t0);
    case 2:
      return pass.template operator()<2>(t0);
    case 1:
      return pass.template operator()<1>(t0);
    default:
      return;
  }
}

template <uint32_t T>
void rows_typed(const RowsArgs& a) {
  int64_t r = a.row_begin;
  if constexpr (rows8_record_bytes(T) > 0)
    if (a.tokens <= kRows8MaxTokens && a.w8 != nullptr && (T == kTypeQ8_0 || a.xsum != nullptr)) {
      for (; r % 8 != 0 && r < a.row_end; ++r) rows_block<T, 1>(a, r);
      for (; r + 8 <= a.row_end; r += 8) rows8_tokens<T>(a, r);
    }
  for (; r + Ops::RB <= a.row_end; r += Ops::RB) rows_block<T, Ops::RB>(a, r);
  for (; r < a.row_end; ++r) rows_block<T, 1>(a, r);
}

// The K types, 256-value activation blocks (ActBlockK). Chunk g (32 values, g < 8) of a
// super-block is decoded into 32 integer codes c and its integer sub-scale(s):
//   Q4_K  c = q            unsigned  scale sc_g (6 bits), min mn_g (6 bits)
//   Q5_K  as Q4_K, c = q + 16 * (high bit)
//   Q6_K  c = u - 32, u = q (6 bits)  scales s_{2g} (values 0-15), s_{2g+1} (16-31), int8
// A super-block of a row against a token's block gives the exact integer
//   S = sum_g sum_{i in chunk g} (sub-scale of i) * c_i * q_i
// (|S| <= 256 * 32 * 127 * 128 < 2^31: Q6_K's bound, the largest) and, for Q4_K / Q5_K,
//   msum = sum_g mn_g * bsum_g (exact, |msum| <= 8 * 63 * 4064 < 2^21);
// then, per (row, token) and super-block,
//   acc  = fma(d * d_x, float(S), acc)              (d * d_x rounded once; float(S) rounded
//                                                    once, to nearest even, when |S| >= 2^24)
//   macc = fma(-(dmin * d_x), float(msum), macc)    (Q4_K / Q5_K; dmin * d_x rounded once)
// and the result is acc + macc. One token (superblock) sums S from 8 int32 lanes; several tokens
// (groupk) put 8 tokens in the lanes: one float multiply-add per 8 tokens and super-block, the
// sums in integers.
// One token, per row and super-block, prepare() unpacks the scales (Row) and returns the lanes'
// start (Q6_K: its offset term from the token's 16-value sums); per chunk, codes<g>() decodes
// the row's 32 bytes (unsigned), scale<g>() picks its sub-scale operand, maddubs gives the int16
// pairs with the token's q_x, and madd_acc adds the chunk's 8 scaled int32 lanes. Several
// tokens: decode_k() writes a row's super-block once (DecK) and groupk broadcasts it against 8
// tokens (16 in a zmm on AVX-512 VNNI, WideLanes).
template <uint32_t T>
struct CodeK;

// A decoded super-block of a row in the batched path's scratch (kDecKBytes bytes):
//   [0, 256)    the 256 codes, unsigned (Q4_K 0-15, Q5_K 0-31, Q6_K u = c + 32, 0-63)
//   [256, 320)  int32 sub-scales, one per kSub codes (Q4_K / Q5_K: 8 of 32; Q6_K: 16 of 16);
//               on the targets without VNNI (Ops::kPairAcc) pair16(sc, sc) instead
//   [320, 352)  int32 multiplier pairs of the token's sums: Q4_K / Q5_K, pair j < 4: int16
//               (mn_{2j}, mn_{2j+1}) against ActBlockK8::s32[j] (msum); Q6_K, pair j < 8: int16
//               (-32 s_{2j}, -32 s_{2j+1}) against s16[j] (the offset term, S = sum_j s_j sum(u q)
//               - sum_j 32 s_j sum(q))
//   [352, 360)  float d, float -dmin
constexpr int kDecKBytes = 384;
constexpr int kDecKScales = 256, kDecKPairs = 320, kDecKD = 352;

inline void put32(uint8_t* p, int32_t v) { std::memcpy(p, &v, 4); }
inline int32_t pair16(int v0, int v1) {
  return static_cast<int32_t>((static_cast<uint32_t>(v1) << 16) |
                              (static_cast<uint32_t>(v0) & 0xffffu));
}
// Sub-scale j of a DecK in the form its target's groupk multiplies by: int32, or on the targets
// without VNNI (Ops::kPairAcc: int16 pair sums times one vpmaddwd) pair16(sc, sc).
inline void put_sub_scale(uint8_t* o, int j, int sc) {
  put32(o + kDecKScales + 4 * j, Ops::kPairAcc ? pair16(sc, sc) : sc);
}

template <bool kFive>
struct CodeK45 {
  static constexpr int kBytes = kFive ? 176 : 144;
  static constexpr int kSub = 32;  // codes per sub-scale
  static constexpr int kMaxCode = kFive ? 31 : 15;
  static constexpr bool kMin = true;
  struct Row {
    typename Ops::S sc;
    typename Ops::M mn;
  };
  static float d(const uint8_t* b) { return Ops::f16(rd16(b)); }
  static float dmin(const uint8_t* b) { return Ops::f16(rd16(b + 2)); }
  // The 8 scales and the 8 mins (ggml's 12-byte 6-bit packing): Ops::unpack_k4 (x86: two
  // shuffles, masks and shifts in one xmm; generic: 32-bit words). The x86 SIMD unpack ran
  // BM_Matmul's Q4_K rows 1.1-1.3x faster than the earlier unpack in scalar registers (512 x 1536
  // in L2, 65536 x 1536 from DRAM) and Qwen2.5-1.5B's decode step 0-6% faster (AVX-512 VNNI Zen
  // 4, 1 thread). Before the prefetch hint became prefetcht2 (prefetch_w) the same unpack made
  // that step 15-25% slower.
  static typename Ops::I prepare(const uint8_t* b, const ActBlockK&, Row& o) {
    Ops::unpack_k4(b + 4, o.sc, o.mn);
    return Ops::izero();
  }
  template <int g>
  static typename Ops::B codes(const uint8_t* b) {
    const typename Ops::B q = Ops::load(b + (kFive ? 48 : 16) + 32 * (g / 2));
    typename Ops::B c = g % 2 ? Ops::hi4(q) : Ops::lo4(q);
    if constexpr (kFive) c = Ops::or_(c, Ops::and_(shift(Ops::load(b + 16), 4 - g), 0x10));
    return c;
  }
  template <int g>
  static typename Ops::P scale(const Row& o) {
    return Ops::template pick<g, g>(o.sc);
  }
  static int msum(const Row& o, const int16_t* bsum) { return Ops::k4_msum(o.mn, bsum); }
  // The batched path's scales (DecK): ggml's get_scale_min_k4, one chunk at a time (the same
  // integers as unpack_k4; the tests compare the two paths bit for bit).
  static void dec_scales(const uint8_t* b, uint8_t* o) {
    const uint8_t* q = b + 4;
    int mn[8];
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
      mn[j] = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      put_sub_scale(o, j, sc);
    }
    for (int j = 0; j < 4; ++j) put32(o + kDecKPairs + 4 * j, pair16(mn[2 * j], mn[2 * j + 1]));
  }
};
template <>
struct CodeK<kTypeQ4_K> : CodeK45<false> {};
template <>
struct CodeK<kTypeQ5_K> : CodeK45<true> {};

// Q6_K: chunk g = 4 h + k holds values 128 h + 32 k + l (l < 32), sub-scales 8 h + 2 k + l / 16.
template <>
struct CodeK<kTypeQ6_K> {
  static constexpr int kBytes = 210;
  static constexpr int kSub = 16;
  static constexpr int kMaxCode = 63;  // u, the code before its offset of -32
  static constexpr bool kMin = false;
  struct Row {
    typename Ops::S sc[2];  // half h of the 16 scales in both halves
  };
  static float d(const uint8_t* b) { return Ops::f16(rd16(b + 208)); }
  static float dmin(const uint8_t*) { return 0.0f; }
  // The one-token pass starts each row's lanes from the offset term, -32 sum_j s_j bsum16_j
  // (|.| <= 32 * 16 * 128 * 2032 < 2^28), and adds s_j sum(u q) per chunk, which saves 8
  // subtractions per row and super-block over subtracting pairs(32, q) in each chunk.
  static typename Ops::I prepare(const uint8_t* b, const ActBlockK& xb, Row& o) {
    const typename Ops::S s = Ops::scales_i8(reinterpret_cast<const int8_t*>(b + 192));
    o.sc[0] = Ops::template half<0>(s);
    o.sc[1] = Ops::template half<1>(s);
    return Ops::isub(Ops::izero(), Ops::ishl(Ops::madd16(s, xb.bsum16), 5));
  }
  template <int g>
  static typename Ops::B codes(const uint8_t* b) {
    constexpr int h = g / 4, k = g % 4;
    const typename Ops::B ql = Ops::load(b + 64 * h + 32 * (k % 2));
    const typename Ops::B lo = k / 2 ? Ops::hi4(ql) : Ops::lo4(ql);
    const typename Ops::B hi = Ops::and_(shift(Ops::load(b + 128 + 32 * h), 4 - 2 * k), 0x30);
    return Ops::or_(lo, hi);
  }
  template <int g>
  static typename Ops::P scale(const Row& o) {
    return Ops::template pick<(2 * g) % 8, (2 * g + 1) % 8>(o.sc[g / 4]);
  }
  static int msum(const Row&, const int16_t*) { return 0; }
  static void dec_scales(const uint8_t* b, uint8_t* o) {
    const auto* s = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 16; ++j) put_sub_scale(o, j, s[j]);
    for (int j = 0; j < 8; ++j)
      put32(o + kDecKPairs + 4 * j, pair16(-32 * s[2 * j], -32 * s[2 * j + 1]));
  }
};

// acc[r] = fma(d_r * d_x, float(S_r), acc[r]) with S_r the lane sum of sumi[r] (exact), and for
// Q4_K / Q5_K macc[r] = fma(-(dmin_r * d_x), float(msum_r), macc[r]). Four rows (x86): the 4
// sums in one reduction, Q4_K / Q5_K's d and dmin widened in one conversion and their 4 msums
// reduced together, and the float operations on the 4 rows at once (the same roundings as the
// scalar forms, lane by lane: a product, a negation, one fused multiply-add).
template <uint32_t T, int RBn, class O = Ops>  // O: dependent, for the targets without kRows4
inline void superblock_float(const uint8_t* const* b, const typename Ops::I* sumi,
                             const typename CodeK<T>::Row* st, const ActBlockK& xb, float* acc,
                             float* macc) {
  using CK = CodeK<T>;
  if constexpr (RBn == 4 && O::kRows4) {
    typename O::F4 d4, m4;
    if constexpr (CK::kMin)
      O::f16pairs4(b[0], b[1], b[2], b[3], d4, m4);
    else
      d4 = O::set4(CK::d(b[0]), CK::d(b[1]), CK::d(b[2]), CK::d(b[3]));
    const auto dx = O::set4(xb.d, xb.d, xb.d, xb.d);
    O::store4(
        acc, O::fma4(O::mul4(d4, dx), O::sums4(sumi[0], sumi[1], sumi[2], sumi[3]), O::load4(acc)));
    if constexpr (CK::kMin)
      O::store4(macc, O::fma4(O::neg4(O::mul4(m4, dx)),
                              O::msums4(st[0].mn, st[1].mn, st[2].mn, st[3].mn, xb.bsum),
                              O::load4(macc)));
  } else {
    for (int r = 0; r < RBn; ++r) {
      acc[r] = std::fma(CK::d(b[r]) * xb.d, static_cast<float>(Ops::hsum(sumi[r])), acc[r]);
      if constexpr (CK::kMin)
        macc[r] = std::fma(-(CK::dmin(b[r]) * xb.d), static_cast<float>(CK::msum(st[r], xb.bsum)),
                           macc[r]);
    }
  }
}

// Super-block k of RBn rows against one token's activation block xb (the scheme above): the
// lanes of S per row (lane i: bytes 4i .. 4i+3 of the 8 chunks, scaled), summed exactly, then the
// float operations. (|lane| <= 32 * 32 * 127 * 128 < 2^31; maddubs' int16 pairs <= 2 * 63 * 127
// (Q6_K's u), 2 * 31 * 127 (Q5_K), never saturate.) The super-block `ahead` bytes further in each
// row (a later pass's) is prefetched.
template <uint32_t T, int RBn>
inline void superblock(const uint8_t* const* rows, int64_t k, const ActBlockK& xb, float* acc,
                       float* macc, int64_t ahead) {
  using CK = CodeK<T>;
  const uint8_t* b[RBn];
  typename Ops::I sumi[RBn];
  typename CK::Row st[RBn];
  for (int r = 0; r < RBn; ++r) {
    b[r] = rows[r] + k * CK::kBytes;
    for (int o = 0; o < CK::kBytes; o += 64) prefetch_w(b[r] + ahead + o);
    sumi[r] = CK::prepare(b[r], xb, st[r]);
  }
  for_each_group<8>([&](auto g) {
    constexpr int kG = decltype(g)::value;
    const typename Ops::B xv = Ops::load(xb.q + 32 * kG);
    for (int r = 0; r < RBn; ++r)
      sumi[r] = Ops::madd_acc(sumi[r], Ops::pairs(CK::template codes<kG>(b[r]), xv),
                              CK::template scale<kG>(st[r]));
  });
  superblock_float<T, RBn>(b, sumi, st, xb, acc, macc);
}

// The start of super-block k in groupk and groupk_pairs4: the RBn rows' decoded super-block
// (db[r]), and while the first group pass runs (next != nullptr), the next pass's rows'
// super-block k prefetched.
template <uint32_t T, int RBn>
inline void prefetch_superblock(const uint8_t* next, int64_t row_bytes, int64_t k) {
  if (next != nullptr)
    for (int r = 0; r < RBn; ++r)
      for (int o = 0; o < CodeK<T>::kBytes; o += 64)
        prefetch_w(next + r * row_bytes + k * CodeK<T>::kBytes + o);
}
template <uint32_t T, int RBn>
inline void decoded_superblock(const uint8_t* dec, int64_t blocks, int64_t k, const uint8_t* next,
                               int64_t row_bytes, const uint8_t** db) {
  prefetch_superblock<T, RBn>(next, row_bytes, k);
  for (int r = 0; r < RBn; ++r) db[r] = dec + (r * blocks + k) * kDecKBytes;
}

// The end of super-block k in groupk and groupk_pairs4, superblock()'s float operations lane by
// lane: acc = fma(d * d_x, float(S), acc), and for Q4_K / Q5_K macc = fma(-dmin * d_x,
// float(msum), macc) (decode_k stores -dmin).
template <uint32_t T, class L, int RBn, int NV>
inline void groupk_floats(const uint8_t* const* db, const ActBlockK8* xt, int64_t blocks, int64_t k,
                          const typename L::I (&s)[RBn][NV], const typename L::I (&m)[RBn][NV],
                          typename L::V (&acc)[RBn][NV], typename L::V (&macc)[RBn][NV]) {
  for (int v = 0; v < NV; ++v) {
    const typename L::V d = L::vload(xt, blocks, v, k, [](const ActBlockK8& b) { return b.d; });
    for (int r = 0; r < RBn; ++r) {
      float wd, wn;
      std::memcpy(&wd, db[r] + kDecKD, 4);
      std::memcpy(&wn, db[r] + kDecKD + 4, 4);
      acc[r][v] = L::fma(L::mul(L::set1(wd), d), L::cvt(s[r][v]), acc[r][v]);
      if constexpr (CodeK<T>::kMin)
        macc[r][v] = L::fma(L::mul(L::set1(wn), d), L::cvt(m[r][v]), macc[r][v]);
    }
  }
}

// y[(L::kTokens v + t) * y_stride + r] = acc + macc (Q6_K: acc) for the first `lanes` tokens of
// the last vector, all of the others'.
template <uint32_t T, class L, int RBn, int NV>
inline void groupk_store(const typename L::V (&acc)[RBn][NV], const typename L::V (&macc)[RBn][NV],
                         int lanes, float* y, int64_t y_stride) {
  for (int v = 0; v < NV; ++v) {
    typename L::V o[RBn];
    for (int r = 0; r < RBn; ++r)
      o[r] = CodeK<T>::kMin ? L::vadd(acc[r][v], macc[r][v]) : acc[r][v];
    store_rows<L, RBn, L::kTokens>(o, v == NV - 1 ? lanes : L::kTokens,
                                   y + L::kTokens * v * y_stride, y_stride);
  }
}

// groupk on 4 rows x 8 tokens (NV = 1) or 16 tokens (NV = 2, two groups a pass) without VNNI
// (AVX2: Ops::kPairAcc): the sub-scales in a loop of Ops::pair_subscale4 / pair_subscale4x2
// (asm: per row, maddubs' int16 pairs summed over kFlush groups, then one vpmaddwd by
// pair16(sc, sc) into S), then the min (Q4_K / Q5_K) or offset (Q6_K) terms and the float
// operations of groupk. The same integers in another order (exact), the same float operations,
// so the same bits. On Zen 3 (BM_Int8InnerAvx2, the call alone in L1, best of five): Q4_K 0.84
// -> 0.99 maddubs a cycle, Q6_K 0.68 -> 0.88 (its flush every 2 groups is half its work);
// BM_Matmul's 512-token Q4_K 8960 x 1536 113 -> 77 ms; two groups a pass, less again
// (`treeattn_microbench --benchmark_filter=BM_Matmul`).
template <uint32_t T, class L, int NV>
inline void groupk_pairs4(const uint8_t* dec, int64_t blocks, const ActBlockK8* xt, int lanes,
                          float* y, int64_t y_stride, const uint8_t* next, int64_t row_bytes) {
  static_assert(NV == 1 || NV == 2);
  using CK = CodeK<T>;
  using V = typename L::V;
  using I = typename L::I;
  constexpr int RBn = 4;
  constexpr int kGroups = CK::kSub / 4;  // 4-code groups per sub-scale
  constexpr int kFlush = std::min(kGroups, 32767 / (2 * CK::kMaxCode * 127));
  static_assert(kFlush >= 1 && kGroups % kFlush == 0);
  V acc[RBn][NV], macc[RBn][NV];
  for (int r = 0; r < RBn; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = macc[r][v] = L::zero();
  const int64_t xs = blocks * static_cast<int64_t>(sizeof(ActBlockK8));  // vector 1's offset
  for (int64_t k = 0; k < blocks; ++k) {
    const uint8_t* db[RBn];
    decoded_superblock<T, RBn>(dec, blocks, k, next, row_bytes, db);
    I s[RBn][NV], m[RBn][NV];
    const auto* x = reinterpret_cast<const int8_t*>(xt[k].q);  // group g's 8 x 4 bytes at 32 g
    const uint8_t* c[RBn];
    for (int r = 0; r < RBn; ++r) c[r] = db[r];
    int64_t t = 0;  // c_r + t + kDecKScales: sub-scale j's pair16(sc, sc)
    I s0[RBn];      // the first vector's S in registers
    for (int r = 0; r < RBn; ++r) s0[r] = L::izero();
    alignas(32) int32_t sm[RBn][8];  // NV == 2: the second's in memory
    if constexpr (NV == 2)
      for (int r = 0; r < RBn; ++r) L::Ops::store(sm[r], L::izero());  // 4 stores, no rep stos
    for (int j = 0; j < 256 / CK::kSub; ++j) {
      if constexpr (NV == 1)
        L::Ops::template pair_subscale4<kGroups, kFlush, kDecKScales>(x, c, t, s0);
      else
        L::Ops::template pair_subscale4x2<kGroups, kFlush, kDecKScales>(x, xs, c, t, s0, &sm[0][0]);
      x += 32 * kGroups;
      for (int r = 0; r < RBn; ++r) c[r] += 4 * kGroups;
      t += 4 - 4 * kGroups;
    }
    for (int r = 0; r < RBn; ++r)
      for (int v = 0; v < NV; ++v) {
        s[r][v] = v == 0 ? s0[r] : L::Ops::load(sm[r]);
        m[r][v] = L::izero();
      }
    for (int jp = 0; jp < 128 / CK::kSub; ++jp)
      for (int r = 0; r < RBn; ++r) {
        int32_t pr;
        std::memcpy(&pr, db[r] + kDecKPairs + 4 * jp, 4);
        for (int v = 0; v < NV; ++v) {
          const ActBlockK8& xb = xt[v * blocks + k];
          if constexpr (CK::kMin)
            m[r][v] = L::madd_pairs(m[r][v], L::Ops::load(xb.s32[jp]), pr);
          else
            s[r][v] = L::madd_pairs(s[r][v], L::Ops::load(xb.s16[jp]), pr);
        }
      }
    groupk_floats<T, L, RBn, NV>(db, xt, blocks, k, s, m, acc, macc);
  }
  groupk_store<T, L, RBn, NV>(acc, macc, lanes, y, y_stride);
}

// A super-block's RBn rows of decoded codes (DecK, at dec + (r * blocks + k) * kDecKBytes)
// against NV vectors of tokens (L: NarrowLanes or WideLanes), tokens in lanes: per 4-code group
// the row's 4 codes are broadcast against the tokens' q (ActBlockK8), the kSub codes of a
// sub-scale summed in lane t, multiplied by the sub-scale and added to token t's S; every second
// sub-scale one pair of the min term (Q4_K / Q5_K, 32-value sums, into m) or of the offset term
// (Q6_K, 16-value sums, straight into S), spread over the loop rather than a chain of dependent
// multiply-adds after it; then superblock()'s float operations lane by lane, so a token's bits
// are those of its one-token pass. y[(L::kTokens v + t) * y_stride + r] for the first `lanes`
// tokens of the last vector, all of the others'.
// Every integer stays in int32: Q6_K's sum of s_j * sum(u q) is at most 16 * 128 * 16 * 63 * 127
// < 2^28 and its offset term 16 * 4096 * 2032 < 2^28 (Q4_K / Q5_K less).
template <uint32_t T, int RBn, int NV, class L>
inline void groupk(const uint8_t* dec, int64_t blocks, const ActBlockK8* xt, int lanes, float* y,
                   int64_t y_stride, const uint8_t* next, int64_t row_bytes) {
  if constexpr (L::kPairAcc && RBn == 4 && NV <= 2) {
    groupk_pairs4<T, L, NV>(dec, blocks, xt, lanes, y, y_stride, next, row_bytes);
    return;
  }
  using CK = CodeK<T>;
  using V = typename L::V;
  using I = typename L::I;
  constexpr int kGroups = CK::kSub / 4;  // 4-code groups per sub-scale
  V acc[RBn][NV], macc[RBn][NV];
  for (int r = 0; r < RBn; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = macc[r][v] = L::zero();
  for (int64_t k = 0; k < blocks; ++k) {
    const uint8_t* db[RBn];
    decoded_superblock<T, RBn>(dec, blocks, k, next, row_bytes, db);
    I s[RBn][NV], m[RBn][NV];
    for (int r = 0; r < RBn; ++r)
      for (int v = 0; v < NV; ++v) s[r][v] = m[r][v] = L::izero();
    for (int j = 0; j < 256 / CK::kSub; ++j) {
      if constexpr (L::kPairAcc) {
        // Without VNNI (AVX2): maddubs' int16 pair sums added in int16 over kFlush groups, then
        // one madd by the sub-scale in both halves of each pair (pair16(sc, sc)) into S: per
        // group one multiply instead of maddubs, madd by ones and, per sub-scale, vpmulld. The
        // same integers: a pair sum is at most 2 * kMaxCode * 127 (activations clamped to +-127
        // by quantize_block), and kFlush of them fit in int16 (Q4_K 8, Q5_K 4, Q6_K 2; 32256 at
        // most even at -128). (4 rows x 8 tokens: groupk_pairs4.)
        constexpr int kFlush = std::min(kGroups, 32767 / (2 * CK::kMaxCode * 127));
        static_assert(kFlush >= 1 && kGroups % kFlush == 0);
        int32_t sc2[RBn];  // pair16(sc, sc) on these targets (decode_k)
        for (int r = 0; r < RBn; ++r) std::memcpy(&sc2[r], db[r] + kDecKScales + 4 * j, 4);
        typename L::B a16[RBn][NV];
        for (int r = 0; r < RBn; ++r)
          for (int v = 0; v < NV; ++v) a16[r][v] = L::bzero();
        for_each_group<kGroups>([&](auto i) {
          constexpr int kI = decltype(i)::value;
          const int gi = j * kGroups + kI;
          typename L::B xv[NV];
          for (int v = 0; v < NV; ++v)
            xv[v] = L::load(xt, blocks, v, k, [gi](const ActBlockK8& b) { return b.q[gi]; });
          for (int r = 0; r < RBn; ++r) {
            const typename L::B w = L::bcast4(db[r] + 4 * gi);
            for (int v = 0; v < NV; ++v) a16[r][v] = L::add16(a16[r][v], L::pairs(w, xv[v]));
          }
          if constexpr ((kI + 1) % kFlush == 0)
            for (int r = 0; r < RBn; ++r)
              for (int v = 0; v < NV; ++v) {
                s[r][v] = L::madd_pairs(s[r][v], a16[r][v], sc2[r]);
                a16[r][v] = L::bzero();
              }
        });
      } else {
        // decode_k stores the sub-scales in the form of its target's branch (int32 here)
        static_assert(L::kPairAcc == Ops::kPairAcc);
        I u[RBn][NV];
        for (int r = 0; r < RBn; ++r)
          for (int v = 0; v < NV; ++v) u[r][v] = L::izero();
        for_each_group<kGroups>([&](auto i) {
          const int gi = j * kGroups + decltype(i)::value;
          typename L::B xv[NV];
          for (int v = 0; v < NV; ++v)
            xv[v] = L::load(xt, blocks, v, k, [gi](const ActBlockK8& b) { return b.q[gi]; });
          for (int r = 0; r < RBn; ++r) {
            const typename L::B w = L::bcast4(db[r] + 4 * gi);
            for (int v = 0; v < NV; ++v) u[r][v] = L::dpu(u[r][v], w, xv[v]);
          }
        });
        for (int r = 0; r < RBn; ++r) {
          int32_t sc;
          std::memcpy(&sc, db[r] + kDecKScales + 4 * j, 4);
          for (int v = 0; v < NV; ++v) s[r][v] = L::add(s[r][v], L::mul_s(u[r][v], sc));
        }
      }
      if (j % 2 == 1)
        for (int r = 0; r < RBn; ++r) {
          int32_t pr;
          std::memcpy(&pr, db[r] + kDecKPairs + 4 * (j / 2), 4);
          for (int v = 0; v < NV; ++v) {
            if constexpr (CK::kMin)
              m[r][v] = L::madd_pairs(
                  m[r][v],
                  L::load(xt, blocks, v, k, [j](const ActBlockK8& b) { return b.s32[j / 2]; }), pr);
            else
              s[r][v] = L::madd_pairs(
                  s[r][v],
                  L::load(xt, blocks, v, k, [j](const ActBlockK8& b) { return b.s16[j / 2]; }), pr);
          }
        }
    }
    groupk_floats<T, L, RBn, NV>(db, xt, blocks, k, s, m, acc, macc);
  }
  groupk_store<T, L, RBn, NV>(acc, macc, lanes, y, y_stride);
}

// Row b's super-block decoded for groupk (DecK).
template <uint32_t T>
inline void decode_k(const uint8_t* b, uint8_t* o) {
  using CK = CodeK<T>;
  for_each_group<8>([&](auto g) {
    constexpr int kG = decltype(g)::value;
    Ops::store(o + 32 * kG, CK::template codes<kG>(b));
  });
  CK::dec_scales(b, o);
  const float d = CK::d(b), nd = -CK::dmin(b);
  std::memcpy(o + kDecKD, &d, 4);
  std::memcpy(o + kDecKD + 4, &nd, 4);
}

// RBn rows against every token of the job. One token: superblock() straight from the weights
// (the decode step streams them). Several tokens: the rows are decoded once into the scratch
// (RBn * blocks * kDecKBytes bytes, within its kMaxRowBlock * cols floats), then the groups of 8
// tokens run from it (groupk): on kWide targets 4 groups at a time on wide lanes, then a last
// pair; the rest on narrow lanes.
template <uint32_t T, int RBn>
inline void rows_block_k(const RowsArgs& a, int64_t r0) {
  static_assert(kDecKBytes <= 4 * 256 * 4);  // a super-block's share of the scratch
  const uint8_t* rows[RBn];
  for (int r = 0; r < RBn; ++r) rows[r] = a.w + (r0 + r) * a.row_bytes;
  const int64_t blocks = a.cols / 256;
  if (a.tokens == 1) {
    float acc[RBn], macc[RBn];
    for (int r = 0; r < RBn; ++r) acc[r] = macc[r] = 0.0f;
    const int64_t ahead = weight_prefetch_ahead(RBn * a.row_bytes);
    for (int64_t k = 0; k < blocks; ++k) superblock<T, RBn>(rows, k, a.xk[k], acc, macc, ahead);
    for (int r = 0; r < RBn; ++r) a.y[r0 + r] = CodeK<T>::kMin ? acc[r] + macc[r] : acc[r];
    return;
  }
  auto* dec = reinterpret_cast<uint8_t*>(a.scratch);
  for (int r = 0; r < RBn; ++r)
    for (int64_t k = 0; k < blocks; ++k)
      decode_k<T>(rows[r] + k * CodeK<T>::kBytes, dec + (r * blocks + k) * kDecKBytes);
  const int64_t groups = (a.tokens + 7) / 8;
  // The first group pass prefetches the next pass's rows (RBn rows on; prefetching is harmless
  // past the job's rows, inside or outside the matrix) while it computes, so that their decode
  // reads L2, not DRAM.
  const uint8_t* next = rows[0] + RBn * a.row_bytes;
  int64_t g = 0;
  if constexpr (Ops::kWide) {
    using W = WideLanes<>;
    constexpr int kNW = 2;  // 2 vectors: 8 zmm chains of vpdpbusd, u / s / m in 24 registers
    for (; g + 2 * kNW <= groups; g += 2 * kNW)
      groupk<T, RBn, kNW, W>(
          dec, blocks, a.xtk + g * blocks,
          static_cast<int>(std::min<int64_t>(16, a.tokens - 8 * (g + 2 * kNW - 2))),
          a.y + g * 8 * a.y_stride + r0, a.y_stride, g == 0 ? next : nullptr, a.row_bytes);
    // A last pair (a 48-token tile is 4 + 2 groups): one W per row, still half the instructions.
    if (g + 2 <= groups) {
      groupk<T, RBn, 1, W>(dec, blocks, a.xtk + g * blocks,
                           static_cast<int>(std::min<int64_t>(16, a.tokens - 8 * g)),
                           a.y + g * 8 * a.y_stride + r0, a.y_stride, g == 0 ? next : nullptr,
                           a.row_bytes);
      g += 2;
    }
  }
  if constexpr (Ops::kPairAcc && RBn == 4)  // two groups a pass (groupk_pairs4)
    for (; g + 2 <= groups; g += 2)
      groupk<T, RBn, 2, NarrowLanes>(dec, blocks, a.xtk + g * blocks,
                                     static_cast<int>(std::min<int64_t>(8, a.tokens - 8 * (g + 1))),
                                     a.y + g * 8 * a.y_stride + r0, a.y_stride,
                                     g == 0 ? next : nullptr, a.row_bytes);
  for (; g + Ops::NG <= groups; g += Ops::NG)
    groupk<T, RBn, Ops::NG, NarrowLanes>(
        dec, blocks, a.xtk + g * blocks,
        static_cast<int>(std::min<int64_t>(8, a.tokens - 8 * (g + Ops::NG - 1))),
        a.y + g * 8 * a.y_stride + r0, a.y_stride, g == 0 ? next : nullptr, a.row_bytes);
  for (; g < groups; ++g)
    groupk<T, RBn, 1, NarrowLanes>(
        dec, blocks, a.xtk + g * blocks, static_cast<int>(std::min<int64_t>(8, a.tokens - 8 * g)),
        a.y + g * 8 * a.y_stride + r0, a.y_stride, g == 0 ? next : nullptr, a.row_bytes);
}

// NT tokens against a group of 8 rows in the rows8 layout (matvec_targets.hpp): lane r is row r
// from the first integer to the last float. Per record (super-block k), the scheme of superblock()
// and superblock_float() with the same integers (exact in any order) and, lane by lane, the same
// float operations: acc = fma(d * d_x, float(S), acc); Q4_K's macc = fma(dmin * -d_x, float(msum),
// macc) (-(a b) and a (-b) round alike); y = acc + macc (Q6_K: acc). Q4_K: chunk j's 32 columns
// are 4 loads of codes, each a low nibble (columns 32 j + 8 s ..) and a high nibble (+ 4) against
// 4 broadcast activation bytes, summed in two chains, then times the chunk's scales (one
// widening load and a lane product); the mins, 4 int16 multiply-adds of pairs against the
// token's sums of 32. Q6_K: chunk c's 16 columns are the two code loads and the shared top-bit
// load (each code = low nibble | its 2 bits at bits 4-5), minus 32 times the token's sum of the
// chunk's 16 activations (Q6_K's offset, -32 s_c sum(q), taken per chunk), times the sub-scales.
// (|S| < 2^25 for Q4_K: 256 * 63 * 15 * 128; Q6_K: 16 chunks of 128 * (16 * 63 * 128 + 32 * 2032)
// < 2^30.)
template <uint32_t T, int NT>
inline void rows8_record(const uint8_t* p, const ActBlockK* const* xb, typename Ops::V* acc,
                         typename Ops::V* macc) {
  using I = typename Ops::I;
  using B = typename Ops::B;
  I s[NT];
  for (int t = 0; t < NT; ++t) s[t] = Ops::izero();
  if constexpr (T == kTypeQ4_K) {
    for_each_group<8>([&](auto jj) {
      constexpr int j = decltype(jj)::value;
      I lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) lo[t] = hi[t] = Ops::izero();
      for (int st = 0; st < 4; ++st) {
        const B v = Ops::load(p + 128 * j + 32 * st);
        const B cl = Ops::lo4(v), ch = Ops::hi4(v);
        for (int t = 0; t < NT; ++t) {
          const auto* xq = reinterpret_cast<const uint8_t*>(xb[t]->q) + 32 * j + 8 * st;
          lo[t] = Ops::dpu(lo[t], cl, Ops::bcast4(xq));
          hi[t] = Ops::dpu(hi[t], ch, Ops::bcast4(xq + 4));
        }
      }
      const I sc = Ops::u8to32(p + 1024 + 8 * j);
      for (int t = 0; t < NT; ++t) s[t] = Ops::add(s[t], Ops::mul_i(Ops::add(lo[t], hi[t]), sc));
    });
    B mn[4];
    for (int q = 0; q < 4; ++q) mn[q] = Ops::u8to16(p + 1088 + 16 * q);
    const typename Ops::V d = Ops::f16x8(p + 1152), dmin = Ops::f16x8(p + 1168);
    for (int t = 0; t < NT; ++t) {
      I m = Ops::izero();
      for (int q = 0; q < 4; ++q)
        m = Ops::madd_pairs(m, mn[q], pair16(xb[t]->bsum[2 * q], xb[t]->bsum[2 * q + 1]));
      acc[t] = Ops::fma(Ops::mul(d, Ops::set1(xb[t]->d)), Ops::cvt(s[t]), acc[t]);
      macc[t] = Ops::fma(Ops::mul(dmin, Ops::set1(-xb[t]->d)), Ops::cvt(m), macc[t]);
    }
  } else {
    static_assert(T == kTypeQ6_K);
    for_each_group<16>([&](auto cc) {
      constexpr int c = decltype(cc)::value;
      const B h = Ops::load(p + 1024 + 32 * c);
      const B v0 = Ops::load(p + 64 * c), v1 = Ops::load(p + 64 * c + 32);
      const B u0 = Ops::or_(Ops::lo4(v0), Ops::and_(Ops::shl(h, 4), 0x30));
      const B u1 = Ops::or_(Ops::hi4(v0), Ops::and_(Ops::shl(h, 2), 0x30));
      const B u2 = Ops::or_(Ops::lo4(v1), Ops::and_(h, 0x30));
      const B u3 = Ops::or_(Ops::hi4(v1), Ops::and_(Ops::shr(h, 2), 0x30));
      const I sc = Ops::s8to32(p + 1536 + 8 * c);
      for (int t = 0; t < NT; ++t) {
        const auto* xq = reinterpret_cast<const uint8_t*>(xb[t]->q) + 16 * c;
        I a = Ops::dpu(Ops::izero(), u0, Ops::bcast4(xq));
        I b = Ops::dpu(Ops::izero(), u1, Ops::bcast4(xq + 4));
        a = Ops::dpu(a, u2, Ops::bcast4(xq + 8));
        b = Ops::dpu(b, u3, Ops::bcast4(xq + 12));
        const I u = Ops::isub(Ops::add(a, b), Ops::iset1(32 * xb[t]->bsum16[c]));
        s[t] = Ops::add(s[t], Ops::mul_i(u, sc));
      }
    });
    const typename Ops::V d = Ops::f16x8(p + 1664);
    for (int t = 0; t < NT; ++t)
      acc[t] = Ops::fma(Ops::mul(d, Ops::set1(xb[t]->d)), Ops::cvt(s[t]), acc[t]);
  }
}

// Rows r0 .. r0 + 7 (r0 % 8 == 0, inside a.w8's groups) against tokens t0 .. t0 + NT - 1 of the
// job: the group's records in column order, each decoded once for the NT tokens. A later pass
// (the next NT tokens) reads the same records again from cache.
template <uint32_t T, int NT>
inline void rows8_pass(const RowsArgs& a, int64_t r0, int64_t t0) {
  constexpr int64_t kRec = rows8_record_bytes(T);
  const int64_t blocks = a.cols / 256;
  const uint8_t* p = a.w8 + r0 / 8 * blocks * kRec;
  typename Ops::V acc[NT], macc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = macc[t] = Ops::zero();
  const ActBlockK* xb[NT];
  for (int64_t k = 0; k < blocks; ++k, p += kRec) {
    for (int64_t o = 0; o < kRec; o += 64) prefetch_w(p + kWeightPrefetchBytes + o);
    for (int t = 0; t < NT; ++t) xb[t] = a.xk + (t0 + t) * a.xk_stride + k;
    rows8_record<T, NT>(p, xb, acc, macc);
  }
  for (int t = 0; t < NT; ++t)
    Ops::vstore(a.y + (t0 + t) * a.y_stride + r0,
                T == kTypeQ4_K ? Ops::vadd(acc[t], macc[t]) : acc[t]);
}

// The AMX target's passes of 16 rows (matvec_int8_amx.hpp; declared for every target, defined
// and called on that one only): from row r on, r left at the first row it did not do.
template <uint32_t T>
void rows_k_amx(const RowsArgs& a, int64_t& r);

template <uint32_t T>
void rows_typed_k(const RowsArgs& a) {
  int64_t r = a.row_begin;
  if constexpr (rows8_record_bytes(T) > 0)
    if (a.tokens <= kRows8MaxTokens && a.w8 != nullptr) {
      for (; r % 8 != 0 && r < a.row_end; ++r) rows_block_k<T, 1>(a, r);
      for (; r + 8 <= a.row_end; r += 8) rows8_tokens<T>(a, r);
    }
  if constexpr (Ops::kAmx)
    if (a.tokens >= 16 && a.xtk16 != nullptr) rows_k_amx<T>(a, r);
  for (; r + Ops::RB <= a.row_end; r += Ops::RB) rows_block_k<T, Ops::RB>(a, r);
  for (; r < a.row_end; ++r) rows_block_k<T, 1>(a, r);
}

void rows_int8_impl(const RowsArgs& a) {
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
      return rows_typed_k<kTypeQ4_K>(a);
    case kTypeQ5_K:
      return rows_typed_k<kTypeQ5_K>(a);
    case kTypeQ6_K:
      return rows_typed_k<kTypeQ6_K>(a);
    default:  // kTypeQ8_0 (the driver sends only int8_type types)
      return rows_typed<kTypeQ8_0>(a);
  }
}
