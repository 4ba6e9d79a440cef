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
//   B and_(B, uint8_t), or_(B, B), sub(B, uint8_t)   bytewise (sub wraps mod 256)
//   B bitmask(uint32_t m)               byte e: bit e of m ? 0xff : 0
//   I dot_u(B w, B x)   lane i = sum_{k<4} w[4i+k] (unsigned) * x[4i+k] (signed)
//   I dot_s(B w, B x)   the same with w signed
//   I dot_s2(B w, B x, int s0, int s1)  dot_s with lanes 0-3 times s0, lanes 4-7 times s1
//   V cvt(I) (exact: |lanes| < 2^24), set1, zero, fma (one rounding), reduce_add (a fixed order)
//
// The arithmetic of one (row, token) product. Every 32-value group b of the row (a block of the
// 32-value types, one sub-block of a 256-value K super-block) is decoded into 32 integer codes
// c (bytes), a float a_b and, for the types with a min, a float m_b, so that the weights are
// w = a_b * c + m_b (Q6_K: w = a_b * s * c with s the 16-value sub-scale, kept integer):
//   Q8_0  c = q           signed   a = d
//   Q4_0  c = q - 8       signed   a = d
//   Q5_0  c = q - 16      signed   a = d
//   Q4_1  c = q           unsigned a = d                m = m
//   Q5_1  c = q           unsigned a = d                m = m
//   Q4_K  c = q           unsigned a = d * sc (exact)   m = -(dmin * mn) (exact)
//   Q5_K  as Q4_K
//   Q6_K  c = q - 32      signed   a = d, the lanes times sc (integers)
// The activation block b of the token (ActBlock: d_x, s_x = d_x * sum q_x, q_x) gives
//   P = dot(c, q_x)                     8 int32 lanes, exact (|P| < 2^24: |c| <= 128, |q_x| <=
//                                       127, 4 products a lane; Q6_K: 4 * 32 * 127 * 128)
//   acc = fma(set1(a_b * d_x), cvt(P), acc)      (a_b * d_x rounded once)
//   macc = fma(m_b, s_x, macc)                   (scalar, types with a min)
// group after group; the result is reduce_add(acc) + macc. The integer lanes are the same on
// every target (maddubs + madd and vpdpbusd both sum products 4i .. 4i+3 into lane i; maddubs'
// int16 pair sums cannot saturate: 2 * 128 * 127 < 2^15) and the float operations are the
// same sequence, so every target gives the same bits, and a (row, token) product does not
// depend on the token count, the rows sharing its pass or the thread (matvec_targets.hpp).
//
// Error bound (the test checks it). Quantizing a block of activations with d = amax / 127
// (rounded) and q = rint(fl(x / d)) gives |x/d - fl(x/d)| <= 2^-24 * 127 and so
// |x - d q| <= d (1/2 + 127 * 2^-24) <= (amax / 254) (1 + 2^-24) (1 + 254 * 2^-24)
//          <= (amax / 254) (1 + 2^-15) per element.
// Hence, with w the weights as decoded above (in exact arithmetic),
//   |<w, d q> - <w, x>| <= sum_b (amax_b / 254) (1 + 2^-15) sum_{i in b} |w_i|,
// and the float evaluation of <w, d q> adds at most gamma_k * sum_i |w_i d_b q_i| with
// gamma_k = k u / (1 - k u), u = 2^-24, k = groups + 6 (a_b * d_x, the fma chain of each lane,
// three reduction adds, the final add; m_b s_x's roundings are inside the same k).
// The float path decodes w with one rounding for Q4_1 / Q5_1 / Q4_K / Q5_K (fma(d, q, m)); the
// integer path never forms w, so against the dequantized row add u * sum |w_i x_i|.

constexpr int kGroupBytes = 48;  // one decoded group in the batched path's scratch

template <uint32_t T>
struct Code;  // per type: kBytes, kGroups, kSigned, kMin, kSub; decode(block, g, Dec&)

struct Dec {
  typename Ops::B c;
  float a = 0.0f, m = 0.0f;
  int s0 = 1, s1 = 1;
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
  static constexpr int kBytes = 34, kGroups = 1;
  static constexpr bool kSigned = true, kMin = false, kSub = false;
  static void decode(const uint8_t* b, int /*g*/, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.c = Ops::load(b + 2);
  }
};

template <>
struct Code<kTypeQ4_0> {
  static constexpr int kBytes = 18, kGroups = 1;
  static constexpr bool kSigned = true, kMin = false, kSub = false;
  static void decode(const uint8_t* b, int /*g*/, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.c = Ops::sub(Ops::nib(b + 2), 8);
  }
};

template <>
struct Code<kTypeQ4_1> {
  static constexpr int kBytes = 20, kGroups = 1;
  static constexpr bool kSigned = false, kMin = true, kSub = false;
  static void decode(const uint8_t* b, int /*g*/, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.m = Ops::f16(rd16(b + 2));
    o.c = Ops::nib(b + 4);
  }
};

template <>
struct Code<kTypeQ5_0> {
  static constexpr int kBytes = 22, kGroups = 1;
  static constexpr bool kSigned = true, kMin = false, kSub = false;
  static void decode(const uint8_t* b, int /*g*/, Dec& o) {
    o.a = Ops::f16(rd16(b));
    const typename Ops::B hi = Ops::and_(Ops::bitmask(rd32(b + 2)), 0x10);
    o.c = Ops::sub(Ops::or_(Ops::nib(b + 6), hi), 16);
  }
};

template <>
struct Code<kTypeQ5_1> {
  static constexpr int kBytes = 24, kGroups = 1;
  static constexpr bool kSigned = false, kMin = true, kSub = false;
  static void decode(const uint8_t* b, int /*g*/, Dec& o) {
    o.a = Ops::f16(rd16(b));
    o.m = Ops::f16(rd16(b + 2));
    const typename Ops::B hi = Ops::and_(Ops::bitmask(rd32(b + 4)), 0x10);
    o.c = Ops::or_(Ops::nib(b + 8), hi);
  }
};

// Q4_K and Q5_K: group g of a super-block is sub-block g (6-bit scale and min of its own).
template <bool kFive>
struct CodeK45 {
  static constexpr int kBytes = kFive ? 176 : 144, kGroups = 8;
  static constexpr bool kSigned = false, kMin = true, kSub = false;
  static void decode(const uint8_t* b, int g, Dec& o) {
    const uint8_t* sc6 = b + 4;
    int sc, mn;
    if (g < 4) {
      sc = sc6[g] & 63;
      mn = sc6[g + 4] & 63;
    } else {
      sc = (sc6[g + 4] & 15) | (sc6[g - 4] >> 6) << 4;
      mn = (sc6[g + 4] >> 4) | (sc6[g] >> 6) << 4;
    }
    o.a = Ops::f16(rd16(b)) * static_cast<float>(sc);
    o.m = -(Ops::f16(rd16(b + 2)) * static_cast<float>(mn));
    const typename Ops::B q = Ops::load(b + (kFive ? 48 : 16) + 32 * (g / 2));
    o.c = g % 2 ? Ops::hi4(q) : Ops::lo4(q);
    if constexpr (kFive) o.c = Ops::or_(o.c, Ops::and_(shift(Ops::load(b + 16), 4 - g), 0x10));
  }
};
template <>
struct Code<kTypeQ4_K> : CodeK45<false> {};
template <>
struct Code<kTypeQ5_K> : CodeK45<true> {};

// Q6_K: group g = 4 h + k holds values 128 h + 32 k + l (l < 32), sub-scales 8 h + 2 k + l / 16.
template <>
struct Code<kTypeQ6_K> {
  static constexpr int kBytes = 210, kGroups = 8;
  static constexpr bool kSigned = true, kMin = false, kSub = true;
  static void decode(const uint8_t* b, int g, Dec& o) {
    const int h = g / 4, k = g % 4;
    o.a = Ops::f16(rd16(b + 208));
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * k;
    o.s0 = scales[0];
    o.s1 = scales[1];
    const typename Ops::B ql = Ops::load(b + 64 * h + 32 * (k % 2));
    const typename Ops::B lo = k / 2 ? Ops::hi4(ql) : Ops::lo4(ql);
    const typename Ops::B hi = Ops::and_(shift(Ops::load(b + 128 + 32 * h), 4 - 2 * k), 0x30);
    o.c = Ops::sub(Ops::or_(lo, hi), 32);
  }
};

template <int G, class F>
inline void for_each_group(F&& f) {
  [&]<int... g>(std::integer_sequence<int, g...>) { (f(std::integral_constant<int, g>{}), ...); }
  (std::make_integer_sequence<int, G>{});
}

// One group of one (row, token) product.
template <uint32_t T>
inline void step(const Dec& w, const ActBlock& xb, typename Ops::B xq, typename Ops::V& acc,
                 float& macc) {
  typename Ops::I p;
  if constexpr (Code<T>::kSub)
    p = Ops::dot_s2(w.c, xq, w.s0, w.s1);
  else if constexpr (Code<T>::kSigned)
    p = Ops::dot_s(w.c, xq);
  else
    p = Ops::dot_u(w.c, xq);
  acc = Ops::fma(Ops::set1(w.a * xb.d), Ops::cvt(p), acc);
  if constexpr (Code<T>::kMin) macc = std::fma(w.m, xb.s, macc);
}

template <uint32_t T>
inline float finish(typename Ops::V acc, float macc) {
  const float r = Ops::reduce_add(acc);
  if constexpr (Code<T>::kMin) return r + macc;
  return r;
}

// One token, RBn rows decoded in registers.
template <uint32_t T, int RBn>
inline void dot_rows_1(const uint8_t* const* rows, int64_t cols, const ActBlock* xq, float* y) {
  typename Ops::V acc[RBn];
  float macc[RBn];
  for (int r = 0; r < RBn; ++r) {
    acc[r] = Ops::zero();
    macc[r] = 0.0f;
  }
  constexpr int G = Code<T>::kGroups;
  const int64_t blocks = cols / 32 / G;
  for (int64_t k = 0; k < blocks; ++k) {
    for_each_group<G>([&](auto g) {
      const ActBlock& xb = xq[k * G + g];
      const typename Ops::B xv = Ops::load(xb.q);
      for (int r = 0; r < RBn; ++r) {
        Dec w;
        Code<T>::decode(rows[r] + k * Code<T>::kBytes, g, w);
        step<T>(w, xb, xv, acc[r], macc[r]);
      }
    });
  }
  for (int r = 0; r < RBn; ++r) y[r] = finish<T>(acc[r], macc[r]);
}

// The batched path's decoded group: 32 code bytes, a, m, s0, s1 (kGroupBytes).
inline void store_dec(uint8_t* p, const Dec& w) {
  Ops::store(p, w.c);
  std::memcpy(p + 32, &w.a, 4);
  std::memcpy(p + 36, &w.m, 4);
  std::memcpy(p + 40, &w.s0, 4);
  std::memcpy(p + 44, &w.s1, 4);
}
inline Dec load_dec(const uint8_t* p) {
  Dec w;
  w.c = Ops::load(p);
  std::memcpy(&w.a, p + 32, 4);
  std::memcpy(&w.m, p + 36, 4);
  std::memcpy(&w.s0, p + 40, 4);
  std::memcpy(&w.s1, p + 44, 4);
  return w;
}

// RBn rows against every token of the job. Several tokens: the rows are decoded once into the
// scratch (L1), then each token runs from it with the same operations as dot_rows_1.
template <uint32_t T, int RBn>
inline void rows_block(const RowsArgs& a, int64_t r0) {
  const uint8_t* rows[RBn];
  for (int r = 0; r < RBn; ++r) rows[r] = a.w + (r0 + r) * a.row_bytes;
  if (a.tokens == 1) {
    float y[RBn];
    dot_rows_1<T, RBn>(rows, a.cols, a.xq, y);
    for (int r = 0; r < RBn; ++r) a.y[r0 + r] = y[r];
    return;
  }
  constexpr int G = Code<T>::kGroups;
  const int64_t groups = a.cols / 32;
  auto* dec = reinterpret_cast<uint8_t*>(a.scratch);
  for (int r = 0; r < RBn; ++r)
    for (int64_t k = 0; k < groups / G; ++k)
      for_each_group<G>([&](auto g) {
        Dec w;
        Code<T>::decode(rows[r] + k * Code<T>::kBytes, g, w);
        store_dec(dec + (r * groups + k * G + g) * kGroupBytes, w);
      });
  for (int64_t t = 0; t < a.tokens; ++t) {
    const ActBlock* xq = a.xq + t * a.xq_stride;
    typename Ops::V acc[RBn];
    float macc[RBn];
    for (int r = 0; r < RBn; ++r) {
      acc[r] = Ops::zero();
      macc[r] = 0.0f;
    }
    for (int64_t b = 0; b < groups; ++b) {
      const typename Ops::B xv = Ops::load(xq[b].q);
      for (int r = 0; r < RBn; ++r)
        step<T>(load_dec(dec + (r * groups + b) * kGroupBytes), xq[b], xv, acc[r], macc[r]);
    }
    for (int r = 0; r < RBn; ++r) a.y[t * a.y_stride + r0 + r] = finish<T>(acc[r], macc[r]);
  }
}

template <uint32_t T>
void rows_typed(const RowsArgs& a) {
  int64_t r = a.row_begin;
  for (; r + Ops::RB <= a.row_end; r += Ops::RB) rows_block<T, Ops::RB>(a, r);
  for (; r < a.row_end; ++r) rows_block<T, 1>(a, r);
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
      return rows_typed<kTypeQ4_K>(a);
    case kTypeQ5_K:
      return rows_typed<kTypeQ5_K>(a);
    case kTypeQ6_K:
      return rows_typed<kTypeQ6_K>(a);
    default:  // kTypeQ8_0 (the driver sends only int8_type types)
      return rows_typed<kTypeQ8_0>(a);
  }
}
