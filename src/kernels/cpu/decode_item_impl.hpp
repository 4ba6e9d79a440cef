// The SIMD decode item kernel, written once and compiled once per ISA target.
//
// Included (not compiled on its own) by kernel_avx512.cpp, kernel_avx2.cpp and
// kernel_generic.cpp inside an anonymous namespace, after each defines `struct Ops`:
//
//   using V;  static constexpr int W (floats per vector), kAccRegs (accumulator registers);
//   V zero(), set1(float), loadu(const float*);  void storeu(float*, V);
//   V load_f32/load_f16/load_bf16/load_fp8/load_i8(first element)   (W elements widened to
//                            float; fp8 and int8 give the code's value, without its scale)
//   V in_register(V)         the value, kept in a register by the compiler (see score_tile)
//   V fma(a, b, c) = a * b + c;  V mul(a, b);  V add(a, b);  V sub(a, b);  V max(a, b) (ignores NaN lanes)
//   V hsum(const V acc[W])   lane j = sum of the lanes of acc[j]
//   V exp(V)                 exp(0) == 1 exactly, exp(-inf) == 0, NaN -> NaN
//   float reduce_add(V), reduce_max(V)
//
// One item = the R query rows of one KV head (group * q_len rows) against one chunk of tokens.
// The chunk is processed in blocks of kBlockTokens tokens:
//   1. scores: tiles of RR rows x TT tokens (RR * TT = W accumulators), each K vector loaded
//      once per tile and used by RR rows, a transposing horizontal sum turns W accumulators
//      into one vector of W scores;
//   2. online softmax per row over the block: block max, rescale of (l, o) by
//      exp(m_old - m_new) only when the max moved, p = exp(s - m);
//   3. values: tiles of RR rows x NV vectors of head_dim, each V vector loaded once per tile
//      and used by RR rows, accumulators kept in registers over the tokens of the block.
// head_dim and the dtype are template parameters, chosen by the one switch in decode_item().
//
// Semantics match the reference kernel: a row sees the first `visible[r]` tokens of the chunk
// (causal limit; tokens past it are never read for that row and never multiply its values),
// logits of exactly -inf get weight 0, NaN logits make l and o NaN (and m NaN at the end).
// Tokens past the chunk are never read: score tiles padded past the end read a zero row.
//
// Quantized K/V (fp8, int8; value = code * per-token scale): the tiles run on the codes and the
// scales are applied per token outside the inner loops: the logit is (q . k_codes) * k_scale *
// scale, and the value weight of a token is p * v_scale (l still sums p).

// Static zero "token" used to pad score tiles past the end of the data (largest head dim, f32).
alignas(64) constexpr float kZeroRow[256] = {};

constexpr float kNegInf = -__builtin_inff();
constexpr int kNB = ::treeattn::kernels::cpu::kBlockTokens;
static_assert(kNB % Ops::W == 0, "block must be a whole number of vectors");

template <DType DT>
inline typename Ops::V load_elems(const void* base, int64_t elem) {
  if constexpr (DT == DType::kF32) {
    return Ops::load_f32(static_cast<const float*>(base) + elem);
  } else if constexpr (DT == DType::kF16) {
    return Ops::load_f16(static_cast<const uint16_t*>(base) + elem);
  } else if constexpr (DT == DType::kBF16) {
    return Ops::load_bf16(static_cast<const uint16_t*>(base) + elem);
  } else if constexpr (DT == DType::kFP8) {
    return Ops::load_fp8(static_cast<const uint8_t*>(base) + elem);
  } else {
    return Ops::load_i8(static_cast<const int8_t*>(base) + elem);
  }
}

template <DType DT>
constexpr int64_t elem_bytes() {
  return DT == DType::kF32 ? 4 : (DT == DType::kFP8 || DT == DType::kInt8 ? 1 : 2);
}

// Raw dot products of RR rows (q, row stride D) with TT = W / RR tokens (kp[t]) into
// s[r * kNB + t].
template <int D, DType DT, int RR>
inline void score_tile(const float* q, const void* const* kp, float* s) {
  using V = typename Ops::V;
  constexpr int TT = Ops::W / RR;
  V acc[Ops::W];
  for (int i = 0; i < Ops::W; ++i) acc[i] = Ops::zero();
  for (int d = 0; d < D; d += Ops::W) {
    V qv[RR];
    // 16-bit K: q held in registers (4 q loads per 8 FMAs, not 8 folded into them); other dtypes:
    // the compiler's folded loads (pinning f32 was faster in L3, slower from DRAM). Measure:
    // `build/release/bench/treeattn_roofline --dtype f32,bf16,f16 --threads 1,2 --seq 262144
    // --layouts rows`, both builds alternating.
    constexpr bool kPinQ = DT == DType::kF16 || DT == DType::kBF16;
    for (int r = 0; r < RR; ++r) {
      const V v = Ops::loadu(q + r * D + d);
      qv[r] = kPinQ ? Ops::in_register(v) : v;
    }
    for (int t = 0; t < TT; ++t) {
      const V kv = load_elems<DT>(kp[t], d);
      for (int r = 0; r < RR; ++r) acc[t * RR + r] = Ops::fma(qv[r], kv, acc[t * RR + r]);
    }
  }
  alignas(64) float tmp[Ops::W];
  Ops::storeu(tmp, Ops::hsum(acc));
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < RR; ++r) s[r * kNB + t] = tmp[t * RR + r];
}

// o[r][d0 .. d0 + NV*W) += sum_{t in [tb, te)} p[r][t] * v_t[d0 ..], for RR rows.
template <int D, DType DT, int RR, int NV>
inline void value_slice(float* const* o, const float* const* p, const char* vbase,
                        int64_t vstride_bytes, int tb, int te, int d0) {
  using V = typename Ops::V;
  V acc[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = Ops::loadu(o[r] + d0 + j * Ops::W);
  for (int t = tb; t < te; ++t) {
    const char* vp = vbase + t * vstride_bytes;
    V vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load_elems<DT>(vp, d0 + j * Ops::W);
    for (int r = 0; r < RR; ++r) {
      const V pb = Ops::set1(p[r][t]);
      for (int j = 0; j < NV; ++j) acc[r][j] = Ops::fma(pb, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int j = 0; j < NV; ++j) Ops::storeu(o[r] + d0 + j * Ops::W, acc[r][j]);
}

template <int D, DType DT, int RR>
inline void value_tile(float* const* o, const float* const* p, const char* vbase,
                       int64_t vstride_bytes, int tb, int te) {
  if (tb >= te) return;
  constexpr int kVecs = D / Ops::W;
  constexpr int kNVcap = Ops::kAccRegs / RR;
  constexpr int NV = kNVcap < kVecs ? kNVcap : kVecs;
  constexpr int kFull = kVecs / NV;
  constexpr int kRest = kVecs % NV;
  for (int s = 0; s < kFull; ++s)
    value_slice<D, DT, RR, NV>(o, p, vbase, vstride_bytes, tb, te, s * NV * Ops::W);
  if constexpr (kRest > 0)
    value_slice<D, DT, RR, kRest>(o, p, vbase, vstride_bytes, tb, te, kFull * NV * Ops::W);
}

// Software prefetch of the K and V rows ItemArgs::prefetch_tokens tokens ahead (0 disables),
// issued a few tokens at a time during the score pass so that requests stay in flight while
// the core computes (the hardware prefetchers stop at every 4 KiB page: 8 f32 tokens of D 128).
// Into L2 (prefetcht1): see kDefaultPrefetchBytes for the distance and the measurement.

template <int D, DType DT>
inline void prefetch_rows(const char* k, const char* v, int64_t stride_bytes, int64_t tb,
                          int64_t te) {
  constexpr int64_t kRowBytes = D * elem_bytes<DT>();
  for (int64_t t = tb; t < te; ++t) {
    const char* kr = k + t * stride_bytes;
    const char* vr = v + t * stride_bytes;
    // Every line the row touches, including a partial last line of a misaligned row.
    for (int64_t off = 0; off < kRowBytes + 63; off += 64) {
      const int64_t o = off < kRowBytes ? off : kRowBytes - 1;
      __builtin_prefetch(kr + o, 0, 2);
      __builtin_prefetch(vr + o, 0, 2);
    }
  }
}

// Scores of RR rows for the `padded` tokens of a block. When `pf` is set, also prefetches the
// rows prefetch_tokens ahead of each tile (tokens [pf_begin, pf_end) of the item, relative to
// the block start), spread over the tiles.
struct PrefetchPlan {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t stride_bytes = 0;
  int64_t first = 0;  // first token to prefetch (item-relative)
  int64_t end = 0;    // one past the last token of the item
};

template <int D, DType DT, int RR>
inline void score_rows(const float* q, const void* const* kp, int padded, float* s,
                       const PrefetchPlan* pf) {
  constexpr int TT = Ops::W / RR;
  for (int t = 0; t < padded; t += TT) {
    if (pf != nullptr) {
      const int64_t b = pf->first + t;
      const int64_t e = b + TT < pf->end ? b + TT : pf->end;
      prefetch_rows<D, DT>(pf->k, pf->v, pf->stride_bytes, b, e);
    }
    score_tile<D, DT, RR>(q, kp + t, s + t);
  }
}

template <int N>
struct RowTile {
  static constexpr int value = N;
};

// The online-softmax update of one row's record `rec` with a block of raw scores sr[0, padded)
// of which the row sees the first take (> 0): the scores are scaled (by scale, or quantized by
// ksc[t] = k_scale * scale), the rest set to -inf, the block max found (a NaN wins), the record
// rescaled to the new max, and sr left holding exp(s - m) (times vsc[t] when quantized) for the
// value pass. Both item kernels (rows here, tiles in tiled_item_impl.hpp) run exactly this.
// kScaled: the caller already multiplied sr[0, take) by scale (the same product, so the same
// bits; the prefill block kernel does it as it stores the scores).
template <bool kQuant, bool kScaled = false>
__attribute__((always_inline)) inline void softmax_block_row(float* sr, int take, int padded,
                                                             const float* ksc, const float* vsc,
                                                             float scale, int D, float* rec) {
  using V = typename Ops::V;
  int t = 0;
  if constexpr (kScaled) {
    static_assert(!kQuant);
    t = take;
  } else if constexpr (kQuant) {
    for (; t + Ops::W <= take; t += Ops::W)
      Ops::storeu(sr + t, Ops::mul(Ops::loadu(sr + t), Ops::loadu(ksc + t)));
    for (; t < take; ++t) sr[t] *= ksc[t];
  } else {
    const V vscale = Ops::set1(scale);
    for (; t + Ops::W <= take; t += Ops::W)
      Ops::storeu(sr + t, Ops::mul(Ops::loadu(sr + t), vscale));
    for (; t < take; ++t) sr[t] *= scale;
  }
  for (; t < padded; ++t) sr[t] = kNegInf;
  V vmax = Ops::set1(kNegInf);
  for (int j = 0; j < padded; j += Ops::W) vmax = Ops::max(Ops::loadu(sr + j), vmax);
  float mb = Ops::reduce_max(vmax);
  if (!(mb > kNegInf)) {  // -inf or NaN: look for a NaN the max may have dropped
    for (int j = 0; j < take; ++j)
      if (sr[j] != sr[j]) mb = sr[j];
  }
  const float m_old = rec[kM];
  float m_new;
  if (m_old != m_old || mb != mb) {
    m_new = mb != mb ? mb : m_old;
  } else {
    m_new = mb > m_old ? mb : m_old;
  }
  if (m_new == kNegInf) return;  // every visible logit so far is -inf: nothing to add
  if (m_new != m_old && m_old != kNegInf) {
    const float alpha = __builtin_expf(m_old - m_new);
    rec[kL] *= alpha;
    const V va = Ops::set1(alpha);
    for (int d = 0; d < D; d += Ops::W)
      Ops::storeu(rec + kO + d, Ops::mul(Ops::loadu(rec + kO + d), va));
  }
  rec[kM] = m_new;
  const V vm = Ops::set1(m_new);
  V lsum = Ops::zero();
  for (int j = 0; j < padded; j += Ops::W) {
    const V p = Ops::exp_nonpos(Ops::sub(Ops::loadu(sr + j), vm));  // s - m <= 0, -inf or NaN
    lsum = Ops::add(lsum, p);
    if constexpr (kQuant) {
      Ops::storeu(sr + j, Ops::mul(p, Ops::loadu(vsc + j)));
    } else {
      Ops::storeu(sr + j, p);
    }
  }
  rec[kL] += Ops::reduce_add(lsum);
}

template <int D, DType DT>
void run_item(const ItemArgs& a) {
  constexpr int kRec = D + 2;
  constexpr bool kQuant = DT == DType::kFP8 || DT == DType::kInt8;
  const int R = a.rows;
  const int64_t stride_bytes = a.stride_token * elem_bytes<DT>();
  const char* kbase = static_cast<const char*>(a.k);
  const char* vbase = static_cast<const char*>(a.v);
  float* s = a.scores;

  for (int r = 0; r < R; ++r) {
    float* rec = a.out + r * kRec;
    rec[kM] = kNegInf;
    for (int i = kL; i < kRec; ++i) rec[i] = 0.0f;
  }

  const void* kp[kNB];
  const int64_t pf_dist = a.prefetch_tokens;
  if (pf_dist > 0) {
    // The first pf_dist rows: the tiles of the blocks before them prefetch the rest.
    prefetch_rows<D, DT>(kbase, vbase, stride_bytes, 0, pf_dist < a.tokens ? pf_dist : a.tokens);
  }
  for (int64_t tb = 0; tb < a.tokens; tb += kNB) {
    const int n = static_cast<int>(a.tokens - tb < kNB ? a.tokens - tb : kNB);
    PrefetchPlan pf_plan{kbase, vbase, stride_bytes, tb + pf_dist, a.tokens};
    const PrefetchPlan* pf = pf_dist > 0 ? &pf_plan : nullptr;
    const int padded_w = (n + Ops::W - 1) / Ops::W * Ops::W;  // multiple of every TT
    for (int t = 0; t < kNB; ++t) kp[t] = t < n ? static_cast<const void*>(kbase + (tb + t) * stride_bytes)
                                : static_cast<const void*>(kZeroRow);

    // 1. Scores for every row; rows in tiles of 4, then 2, then 1.
    int r0 = 0;
    // The first row tile also issues the prefetches.
    for (; r0 + 4 <= R; r0 += 4)
      score_rows<D, DT, 4>(a.q + r0 * D, kp, padded_w, s + r0 * kNB, r0 == 0 ? pf : nullptr);
    for (; r0 + 2 <= R; r0 += 2)
      score_rows<D, DT, 2>(a.q + r0 * D, kp, padded_w, s + r0 * kNB, r0 == 0 ? pf : nullptr);
    for (; r0 < R; ++r0)
      score_rows<D, DT, 1>(a.q + r0 * D, kp, padded_w, s + r0 * kNB, r0 == 0 ? pf : nullptr);

    // 2. Online softmax per row. Afterwards s holds p = exp(s - m) for the row's visible
    //    tokens of the block (0 past them), times the value scale for quantized V.
    // Quantized: per-token logit factors k_scale * scale and value scales, 0 past the block.
    float* ksc = s + R * kNB;
    float* vsc = s + (R + 1) * kNB;
    if constexpr (kQuant) {
      for (int t = 0; t < n; ++t) {
        ksc[t] = a.k_scale[(tb + t) * a.scale_stride_token] * a.scale;
        vsc[t] = a.v_scale[(tb + t) * a.scale_stride_token];
      }
      for (int t = n; t < padded_w; ++t) ksc[t] = vsc[t] = 0.0f;
    }
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * kNB;
      int64_t vis = a.visible[r] - tb;
      const int take = vis <= 0 ? 0 : (vis < n ? static_cast<int>(vis) : n);
      if (take == 0) continue;
      softmax_block_row<kQuant>(sr, take, padded_w, ksc, vsc, a.scale, D, a.out + r * kRec);
    }

    // 3. Values. A row takes the first take_r tokens of the block (0 if it skipped the
    //    block). Rows are tiled 4/2/1; a tile runs over the tokens all its rows take and each
    //    row finishes its own extra tokens alone, so no row multiplies a value it may not see.
    auto take_of = [&](int r) -> int {
      const int64_t vis = a.visible[r] - tb;
      int take = vis <= 0 ? 0 : (vis < n ? static_cast<int>(vis) : n);
      if (take > 0 && a.out[r * kRec + kM] == kNegInf) take = 0;
      return take;
    };
    auto run_group = [&](auto rr_tag, int rb) {
      constexpr int RR = decltype(rr_tag)::value;
      float* o[RR];
      const float* p[RR];
      int tk[RR];
      int common = kNB;
      for (int i = 0; i < RR; ++i) {
        o[i] = a.out + (rb + i) * kRec + kO;
        p[i] = s + (rb + i) * kNB;
        tk[i] = take_of(rb + i);
        common = tk[i] < common ? tk[i] : common;
      }
      value_tile<D, DT, RR>(o, p, vbase + tb * stride_bytes, stride_bytes, 0, common);
      for (int i = 0; i < RR; ++i)
        value_tile<D, DT, 1>(o + i, p + i, vbase + tb * stride_bytes, stride_bytes, common, tk[i]);
    };
    // Rows tiled 4/2/1 for every dtype: with the L2 software prefetch, 4-row tiles read faster
    // than 2-row tiles even for f32 (`treeattn bench --kernel --kv-layout rows --dtype f32`).
    r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) run_group(RowTile<4>{}, r0);
    for (; r0 + 2 <= R; r0 += 2) run_group(RowTile<2>{}, r0);
    for (; r0 < R; ++r0) run_group(RowTile<1>{}, r0);
  }

  // A NaN logit leaves m finite but l NaN; report it in m too, as the reference does.
  for (int r = 0; r < R; ++r) {
    float* rec = a.out + r * kRec;
    if (rec[kL] != rec[kL]) rec[kM] = rec[kL];
  }
}

template <int D>
void run_dim(const ItemArgs& a) {
  switch (a.dtype) {
    case DType::kF32: return run_item<D, DType::kF32>(a);
    case DType::kF16: return run_item<D, DType::kF16>(a);
    case DType::kBF16: return run_item<D, DType::kBF16>(a);
    case DType::kFP8: return run_item<D, DType::kFP8>(a);
    case DType::kInt8: return run_item<D, DType::kInt8>(a);
  }
}

// The one run-time to compile-time switch over head_dim (the dispatcher has already rejected
// unsupported values with a clear error).
void dispatch_item(const ItemArgs& a) {
  switch (a.head_dim) {
    case 64: return run_dim<64>(a);
    case 80: return run_dim<80>(a);
    case 96: return run_dim<96>(a);
    case 128: return run_dim<128>(a);
    case 192: return run_dim<192>(a);
    case 256: return run_dim<256>(a);
    default: __builtin_trap();  // unreachable: AttnShape::validate() rejects other dims
  }
}

// out = Ops::exp(in), or Ops::exp_nonpos(in) (kNonpos), for the tests.
template <bool kNonpos>
void exp_array_impl(const float* in, float* out, int64_t n) {
  auto f = [](typename Ops::V x) { return kNonpos ? Ops::exp_nonpos(x) : Ops::exp(x); };
  int64_t i = 0;
  for (; i + Ops::W <= n; i += Ops::W) Ops::storeu(out + i, f(Ops::loadu(in + i)));
  if (i < n) {
    alignas(64) float buf[Ops::W] = {};
    for (int64_t j = i; j < n; ++j) buf[j - i] = in[j];
    Ops::storeu(buf, f(Ops::loadu(buf)));
    for (int64_t j = i; j < n; ++j) out[j] = buf[j - i];
  }
}

// Roofline probes (see cpu_targets.hpp).
float read_stream_impl(const float* p, int64_t n) {
  using V = typename Ops::V;
  constexpr int kAcc = 8;
  V acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = Ops::zero();
  for (int64_t i = 0; i + kAcc * Ops::W <= n; i += kAcc * Ops::W)
    for (int j = 0; j < kAcc; ++j) acc[j] = Ops::add(acc[j], Ops::loadu(p + i + j * Ops::W));
  for (int j = 1; j < kAcc; ++j) acc[0] = Ops::add(acc[0], acc[j]);
  return Ops::reduce_add(acc[0]);
}

float fma_burn_impl(int64_t iters, float seed, double* flops) {
  using V = typename Ops::V;
  constexpr int kChains = 12;  // > FMA latency x FMA ports on current x86 cores
  V acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = Ops::set1(seed + static_cast<float>(i) * 1e-3f);
  const V a = Ops::set1(0.9999999f), b = Ops::set1(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = Ops::fma(acc[i], a, b);
  for (int i = 1; i < kChains; ++i) acc[0] = Ops::add(acc[0], acc[i]);
  *flops = static_cast<double>(iters) * kChains * Ops::W * 2.0;
  return Ops::reduce_add(acc[0]);
}

// See FmaStreamFn (cpu_targets.hpp). Row r multiplies by c * (r + 1), as each query row of a
// group has its own q and p (rows with one multiplier would be one chain to the compiler, which
// merges them). Two lines per step; where two sets of RR accumulators fit the target's
// registers (2 * RR <= kAccRegs) vectors alternate between them, so that no chain waits on its
// own FMA latency; else one set (RR >= 5 chains per vector).
template <DType DT, int RR>
float fma_stream_rows(const char* p, int64_t bytes, int64_t pf, float c) {
  using V = typename Ops::V;
  constexpr int kPerLine = static_cast<int>(64 / elem_bytes<DT>()) / Ops::W;
  static_assert(kPerLine >= 1);
  constexpr int kSets = 2 * RR <= Ops::kAccRegs ? 2 : 1;
  V acc[kSets][RR];
  V vc[RR];
  for (auto& set : acc)
    for (V& a : set) a = Ops::zero();
  for (int r = 0; r < RR; ++r) vc[r] = Ops::set1(c * static_cast<float>(r + 1));
  auto lines = [&](int64_t off, auto n_tag) {
    constexpr int kLines = decltype(n_tag)::value;
#pragma GCC unroll 16
    for (int j = 0; j < kLines * kPerLine; ++j) {
      const V v = load_elems<DT>(p + off, j * Ops::W);
#pragma GCC unroll 8
      for (int r = 0; r < RR; ++r) acc[j % kSets][r] = Ops::fma(v, vc[r], acc[j % kSets][r]);
    }
  };
  int64_t off = 0;
  for (; off + 128 <= bytes; off += 128) {
    if (pf > 0 && off + 64 + pf < bytes) {
      __builtin_prefetch(p + off + pf, 0, 2);
      __builtin_prefetch(p + off + 64 + pf, 0, 2);
    }
    lines(off, RowTile<2>{});
  }
  if (off < bytes) lines(off, RowTile<1>{});
  V sum = Ops::zero();
  for (const auto& set : acc)
    for (const V& a : set) sum = Ops::add(sum, a);
  return Ops::reduce_add(sum);
}

template <DType DT>
float fma_stream_dtype(const char* p, int64_t bytes, int rows, int64_t pf, float c) {
  switch (rows) {
    case 1: return fma_stream_rows<DT, 1>(p, bytes, pf, c);
    case 2: return fma_stream_rows<DT, 2>(p, bytes, pf, c);
    case 3: return fma_stream_rows<DT, 3>(p, bytes, pf, c);
    case 4: return fma_stream_rows<DT, 4>(p, bytes, pf, c);
    case 5: return fma_stream_rows<DT, 5>(p, bytes, pf, c);
    case 6: return fma_stream_rows<DT, 6>(p, bytes, pf, c);
    case 7: return fma_stream_rows<DT, 7>(p, bytes, pf, c);
    default: return fma_stream_rows<DT, 8>(p, bytes, pf, c);
  }
}

float fma_stream_impl(const void* p, int64_t bytes, DType dtype, int rows, int64_t pf, float c) {
  const char* b = static_cast<const char*>(p);
  rows = rows < 1 ? 1 : (rows > 8 ? 8 : rows);
  bytes = bytes / 64 * 64;  // whole lines only: never past p + bytes
  switch (dtype) {
    case DType::kF32: return fma_stream_dtype<DType::kF32>(b, bytes, rows, pf, c);
    case DType::kF16: return fma_stream_dtype<DType::kF16>(b, bytes, rows, pf, c);
    case DType::kBF16: return fma_stream_dtype<DType::kBF16>(b, bytes, rows, pf, c);
    case DType::kFP8: return fma_stream_dtype<DType::kFP8>(b, bytes, rows, pf, c);
    case DType::kInt8: return fma_stream_dtype<DType::kInt8>(b, bytes, rows, pf, c);
  }
  return 0.0f;
}
