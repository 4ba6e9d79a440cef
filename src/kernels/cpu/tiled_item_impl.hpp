// The SIMD decode item kernel for the tiled KV layout (include/treeattn/kv_tiles.hpp), written
// once and compiled once per ISA target.
//
// Included by kernel_avx512.cpp, kernel_avx2.cpp and kernel_generic.cpp right after
// decode_item_impl.hpp, inside the same anonymous namespace: it uses that file's Ops contract,
// load_elems<DT>(), elem_bytes<DT>() and kNegInf, and adds nothing shared across targets.
//
// One item = the R query rows of one KV head (group * q_len rows) against the tiles of one
// chunk, in blocks of TiledItemArgs::block_tiles tiles:
//   1. scores: units of 2 vectors of W tokens. K is transposed in 32-token panels ([D][32]),
//      so the scores of a unit for RS rows are 2 * RS accumulators updated by vertical FMAs of
//      the broadcast q[r][d] with the unit's two K vectors at each d: no horizontal reduction,
//      each K vector widened once for all RS rows (RS up to 8 with AVX-512's 32 registers, 6
//      with AVX2's 16), and an AVX-512 unit reads its panel front to back. Each vector has its
//      own base pointer, so a unit may span two tiles (T = 16 with W = 16) and vectors past
//      the block repeat the first one (then masked).
//   2. online softmax per row over the block, as in decode_item_impl.hpp: block max, rescale
//      of (l, o) by exp(m_old - m_new) only when the max moved, p = exp(s - m); scores past
//      the row's visible tokens are overwritten with -inf, so K values there never matter.
//   3. values: V in column panels of kVPanel elements ([T][64] per panel); tiles of RV rows x
//      NV vectors of D (a slice inside one panel) held in registers over the block's tokens,
//      p[r][t] broadcast, so a slice reads its panel's rows front to back (an AVX-512 slice is
//      a whole panel); a row never multiplies a value past its visible tokens (rows tiled
//      4/3/2/1 over the tokens they all see, then each row's extra tokens).
// Software prefetch (prefetch_bytes > 0): each stream (K and V tiles; one stream when a tile
// holds both) is fetched into L1 (prefetcht0) or, with prefetch_l2, into L2 (prefetcht1)
// prefetch_bytes ahead of the block being read, the requests spread evenly over both passes
// (see TiledPrefetch).
//
// Quantized K/V (fp8, int8): logits are (q . k_codes) * k_scale * scale and the value weight
// of a token is p * v_scale (l sums p), scales read from the tiles (bfloat16, widened exactly
// per block), as in the row kernel.
//
// Limits (per token and KV head, llama3-8b: group 4, D 128): bytes f32 1024, bf16/f16 512,
// fp8/int8 256 + 4 of scales, over the read bandwidth; flops 2048 (4 rows x 128 x (q.k + p.v) x
// 2) = 64 512-bit FMAs, over the FMA peak. Where a core streams about 15 GB/s that is
// memory-bound with a margin for f32 and bf16/f16; where it streams about 48 GB/s (Zen 5) the
// 16-bit case is bound by this kernel's own arithmetic (its L2 rate is about its DRAM rate);
// fp8/int8 are closer to the compute bound (fp8 widening is 7 instructions per 16 values).
// From DRAM, compute and memory overlap only partly (time ~ memory + a fraction of compute, the
// fraction growing with the GQA group), and leads longer than kTiledPrefetchBytes read slower,
// so the prefetch cannot hide all of the compute. Measure: `treeattn bench --kernel
// --kernel-cases` (fraction of the probe and of the bound per case, docs/kernels.md).
// Both passes take their prefetch count per step (d step, token) as a template value when it
// is one line, the common case, so that the loops carry no inner prefetch loop; other counts
// take it at run time.

constexpr int kUnitTokens = 2 * Ops::W;
// __builtin_prefetch localities: prefetcht0 (into L1) and prefetcht1 (into L2).
constexpr int kPrefetchL1 = 3;
constexpr int kPrefetchL2 = 2;
constexpr int kMaxScoreRows = Ops::W >= 16 ? 8 : 6;
constexpr int kValueVecs = Ops::W >= 16 ? 4 : 2;

// bf16 in pairs: a target whose Ops has load_bf16_pair widens 2W consecutive bf16 values from
// one load into two vectors, the even-indexed values and the odd-indexed ones (a shift and a
// mask, where two separate widenings take a zero extension and a shift each). Vector 0 then
// holds elements 0, 2, .., vector 1 elements 1, 3, ..; interleave() and deinterleave() move
// between that order and memory order. Only the order of lanes changes: every element meets the
// same operations in the same order, so the bits are the same.
template <class O>
concept HasBf16Pair = requires(const uint16_t* p, typename O::V v) {
  O::load_bf16_pair(p);
  O::interleave(v, v);
  O::deinterleave(v, v);
};
template <DType DT>
constexpr bool kPairBf16 = DT == DType::kBF16 && HasBf16Pair<Ops>;
// Called as pair_*<DT, Ops>: the dtype argument makes each call dependent, so a target without
// the pair functions never compiles one (the calls sit in `if constexpr (kPairBf16<DT>)`).
template <DType, class O>
inline auto pair_load(const void* p) {
  return O::load_bf16_pair(static_cast<const uint16_t*>(p));
}
template <DType, class O>
inline auto pair_interleave(typename O::V even, typename O::V odd) {
  return O::interleave(even, odd);
}
template <DType, class O>
inline auto pair_deinterleave(typename O::V a, typename O::V b) {
  return O::deinterleave(a, b);
}

// Row stride of the score scratch for a block of n tokens (a whole number of 32 tokens, which
// covers the score units of every target). The driver sizes the scratch with the same rule.
constexpr int64_t tiled_score_ld(int64_t block_tokens) { return (block_tokens + 31) / 32 * 32; }

// Tokens per K panel of a tile of T tokens (kv_tile_panel(): the tile, at most 32 tokens).
constexpr int64_t tiled_panel_tokens(int64_t T) { return T < 32 ? T : 32; }

// The V column panel holding element d: its first element and its width, of head dim D
// (kv_tile_v_index(): lane l's element d at p0 * T + l * width + d - p0).
struct TiledVPanel {
  int64_t p0, width;
};
constexpr TiledVPanel tiled_v_panel(int64_t D, int64_t d) {
  const int64_t p0 = d / kVPanel * kVPanel;
  return {p0, D - p0 < kVPanel ? D - p0 : kVPanel};
}

// Raw dot products of RS rows (q, row stride D) with the 2W tokens of one unit: vector j reads
// K^T row d at kb[j] + d * row_bytes. Stores s[r * ld + j * W + lane].
// With PF (a prefetch locality, kPrefetchL1 or kPrefetchL2; 0: none), also prefetches pf_per_d
// lines of each prefetch stream per d, from pf0 (and pf1 when not null), so that the requests
// are spread over the unit's work; kPerD > 0 fixes that count, and kTwo whether pf1 is a
// stream, at compile time.
template <DType DT, int RS, int PF, bool kPairK, int kPerD = 0, bool kTwo = false>
inline void tiled_score_unit(const float* q, int D, const char* kb0, const char* kb1,
                             int64_t row_bytes, float* s, int64_t ld, const char* pf0,
                             const char* pf1, int pf_per_d) {
  using V = typename Ops::V;
  V acc0[RS], acc1[RS];
  for (int r = 0; r < RS; ++r) acc0[r] = acc1[r] = Ops::zero();
#pragma GCC unroll 4
  for (int d = 0; d < D; ++d) {
    if constexpr (PF != 0) {
      const int per = kPerD > 0 ? kPerD : pf_per_d;
      const bool two = kPerD > 0 ? kTwo : pf1 != nullptr;
      for (int j = 0; j < per; ++j) {
        __builtin_prefetch(pf0 + j * 64, 0, PF);
        if (two) __builtin_prefetch(pf1 + j * 64, 0, PF);
      }
      pf0 += per * 64;
      if (two) pf1 += per * 64;
    }
    V k0, k1;
    if constexpr (kPairK) {  // k1 = k0 + W tokens (tiled_score_rows): even | odd tokens
      const auto k = pair_load<DT, Ops>(kb0 + d * row_bytes);
      k0 = k.a;
      k1 = k.b;
    } else {
      k0 = load_elems<DT>(kb0 + d * row_bytes, 0);
      k1 = load_elems<DT>(kb1 + d * row_bytes, 0);
    }
    for (int r = 0; r < RS; ++r) {
      const V qb = Ops::set1(q[r * D + d]);
      acc0[r] = Ops::fma(qb, k0, acc0[r]);
      acc1[r] = Ops::fma(qb, k1, acc1[r]);
    }
  }
  for (int r = 0; r < RS; ++r) {
    if constexpr (kPairK) {
      const auto m = pair_interleave<DT, Ops>(acc0[r], acc1[r]);
      acc0[r] = m.a;
      acc1[r] = m.b;
    }
    Ops::storeu(s + r * ld, acc0[r]);
    Ops::storeu(s + r * ld + Ops::W, acc1[r]);
  }
}

// Where the software prefetch of an item stands: streams of `len` bytes from s0 (and s1 when
// K and V tiles live apart), fetched up to `done`. Each block plans the lines that bring the
// streams `ahead` bytes past the block's end and issues them evenly over its time, half
// spread over the score pass (a few per head_dim step) and half over the value pass (a few
// per token of every D slice), so that requests stay in flight while the core computes and
// none bunch up (bunched requests wait for free miss buffers), `ahead` bytes (the
// lead) before the data is read. Where the lines go is the kernel's PF: into L1 (prefetcht0)
// or into L2 (prefetcht1), a choice of the calibration (TiledItemArgs::prefetch_l2).
struct TiledPrefetch {
  const char* s0 = nullptr;
  const char* s1 = nullptr;
  int64_t len = 0;
  int64_t done = 0;
  int64_t ahead = 0;        // prefetch_bytes
  int64_t score_lines = 0;  // this block's share of the score pass
  int64_t value_lines = 0;  // this block's share of the value pass
  template <int PF>
  void upto(int64_t target) {
    if (target > len) target = len;
    for (; done < target; done += 64) {
      __builtin_prefetch(s0 + done, 0, PF);
      if (s1 != nullptr) __builtin_prefetch(s1 + done, 0, PF);
    }
  }
  void plan_block(int64_t block_end) {
    const int64_t target = block_end + ahead < len ? block_end + ahead : len;
    const int64_t lines = target > done ? (target - done + 63) / 64 : 0;
    score_lines = (lines + 1) / 2;
    value_lines = lines - score_lines;
  }
  // Lines per step for `lines` over `steps` steps (rounded up: overshooting a line is
  // harmless), and the pointers of the next line.
  static int per_step(int64_t lines, int64_t steps) {
    return steps > 0 ? static_cast<int>((lines + steps - 1) / steps) : 0;
  }
  const char* p0() const { return s0 + done; }
  const char* p1() const { return s1 != nullptr ? s1 + done : nullptr; }
};

// Scores of RS rows for the n tokens of a block starting at tile `bt` of the item (padded to
// whole units); `pf` (first row group only) issues the block's score-pass prefetch share.
template <DType DT, int RS, int PF, bool kPairK>
void tiled_score_rows(const TiledItemArgs& a, const float* q, int64_t bt, int n, float* s,
                      int64_t ld, TiledPrefetch* pf) {
  constexpr int64_t es = elem_bytes<DT>();
  const int64_t T = a.tile_tokens;
  const int64_t P = tiled_panel_tokens(T);
  const int64_t row_bytes = P * es;
  auto vec_base = [&](int64_t tok) {  // K^T row 0 of the vector holding block token tok
    const int64_t tile = tok / T, lane = tok - tile * T, panel = lane / P;
    return a.k + (bt + tile) * a.tile_stride + (panel * a.head_dim * P + lane - panel * P) * es;
  };
  for (int u = 0; u < n; u += kUnitTokens) {
    const char* k0 = vec_base(u);
    // A pair load reads the unit's 2W tokens from k0: only where a unit never crosses a K panel
    // (tiled_score_dispatch_n), and lanes past the block only give scores that are masked.
    const char* k1 = u + Ops::W < n ? vec_base(u + Ops::W) : k0;
    const int64_t units_left = (n - u + kUnitTokens - 1) / kUnitTokens;
    const int per_d =
        pf != nullptr ? TiledPrefetch::per_step(pf->score_lines, units_left * a.head_dim) : 0;
    if (per_d == 0) {
      tiled_score_unit<DT, RS, 0, kPairK>(q, a.head_dim, k0, k1, row_bytes, s + u, ld, nullptr,
                                       nullptr, 0);
      continue;
    }
    if (per_d == 1 && pf->p1() == nullptr)
      tiled_score_unit<DT, RS, PF, kPairK, 1, false>(q, a.head_dim, k0, k1, row_bytes, s + u, ld,
                                                pf->p0(), nullptr, 1);
    else if (per_d == 1)
      tiled_score_unit<DT, RS, PF, kPairK, 1, true>(q, a.head_dim, k0, k1, row_bytes, s + u, ld,
                                               pf->p0(), pf->p1(), 1);
    else
      tiled_score_unit<DT, RS, PF, kPairK>(q, a.head_dim, k0, k1, row_bytes, s + u, ld, pf->p0(),
                                      pf->p1(), per_d);
    const int64_t issued = int64_t{per_d} * a.head_dim;
    pf->done += issued * 64;
    pf->score_lines = pf->score_lines > issued ? pf->score_lines - issued : 0;
  }
}

template <DType DT, int RS, int PF>
void tiled_score_dispatch_n(int rs, const TiledItemArgs& a, const float* q, int64_t bt, int n,
                            float* s, int64_t ld, TiledPrefetch* pf) {
  if constexpr (RS > 1) {
    if (rs < RS) return tiled_score_dispatch_n<DT, RS - 1, PF>(rs, a, q, bt, n, s, ld, pf);
  }
  // bf16 pairs read a unit's 2W tokens with one load: where a K panel holds a whole unit.
  if constexpr (kPairBf16<DT>) {
    if (tiled_panel_tokens(a.tile_tokens) >= kUnitTokens)
      return tiled_score_rows<DT, RS, PF, true>(a, q, bt, n, s, ld, pf);
  }
  tiled_score_rows<DT, RS, PF, false>(a, q, bt, n, s, ld, pf);
}

// o[r][d0 .. d0 + NV*W) += sum_{t in [tb, te)} p[r][t] * V[t][d0 ..] for RV rows; block token
// t is lane t % T of tile bt + t / T; the slice lies inside one V panel.
// With PF (as tiled_score_unit's), also prefetches pf_per_t lines of each stream per token,
// from pf0 (and pf1).
template <DType DT, int RV, int NV, int PF, int kPerT = 0, bool kTwo = false>
inline void tiled_value_slice(const TiledItemArgs& a, int64_t bt, float* const* o,
                              const float* const* p, int tb, int te, int d0, const char* pf0,
                              const char* pf1, int pf_per_t) {
  using V = typename Ops::V;
  constexpr int64_t es = elem_bytes<DT>();
  const int64_t T = a.tile_tokens;
  const TiledVPanel vp = tiled_v_panel(a.head_dim, d0);
  constexpr bool kPair = kPairBf16<DT> && NV % 2 == 0;  // vectors 2i, 2i+1: even, odd d
  // In pair order the slice of o is rearranged in place around the pass (exact moves), so
  // that the accumulators are loaded and stored as in memory order (rearranged in registers,
  // GCC kept them in memory through the token loop).
  auto rearrange = [&](auto fn) {
    for (int r = 0; r < RV; ++r)
      for (int j = 0; j < NV; j += 2) {
        float* x = o[r] + d0 + j * Ops::W;
        const auto m = fn(Ops::loadu(x), Ops::loadu(x + Ops::W));
        Ops::storeu(x, m.a);
        Ops::storeu(x + Ops::W, m.b);
      }
  };
  if constexpr (kPair)
    rearrange([](V x, V y) { return pair_deinterleave<DT, Ops>(x, y); });
  V acc[RV][NV];
  for (int r = 0; r < RV; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = Ops::loadu(o[r] + d0 + j * Ops::W);
  int t = tb;
  while (t < te) {
    const int64_t tile = t / T;
    const int tile_end = static_cast<int>((tile + 1) * T < te ? (tile + 1) * T : te);
    const char* row = a.v + (bt + tile) * a.tile_stride +
                      (vp.p0 * T + (t - tile * T) * vp.width + d0 - vp.p0) * es;
    for (; t < tile_end; ++t, row += vp.width * es) {
      if constexpr (PF != 0) {
        const int per = kPerT > 0 ? kPerT : pf_per_t;
        const bool two = kPerT > 0 ? kTwo : pf1 != nullptr;
        for (int j = 0; j < per; ++j) {
          __builtin_prefetch(pf0 + j * 64, 0, PF);
          if (two) __builtin_prefetch(pf1 + j * 64, 0, PF);
        }
        pf0 += per * 64;
        if (two) pf1 += per * 64;
      }
      V vv[NV];
      if constexpr (kPair) {
        for (int j = 0; j < NV; j += 2) {
          const auto v = pair_load<DT, Ops>(row + j * Ops::W * 2);
          vv[j] = v.a;
          vv[j + 1] = v.b;
        }
      } else {
        for (int j = 0; j < NV; ++j) vv[j] = load_elems<DT>(row, j * Ops::W);
      }
      for (int r = 0; r < RV; ++r) {
        const V pb = Ops::set1(p[r][t]);
        for (int j = 0; j < NV; ++j) acc[r][j] = Ops::fma(pb, vv[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < RV; ++r)
    for (int j = 0; j < NV; ++j) Ops::storeu(o[r] + d0 + j * Ops::W, acc[r][j]);
  if constexpr (kPair) rearrange([](V x, V y) { return pair_interleave<DT, Ops>(x, y); });
}

// o += p * V over tokens [tb, te) for RV rows, D in slices; `pf` (first row tile only) issues
// the block's value-pass prefetch share spread over every slice: AVX2's 16-wide slices would
// otherwise put it into an eighth of the pass at head dim 128, more requests at once than a core
// keeps in flight (measure: `treeattn_roofline --layouts tiled --seq 262144 --threads 1`).
template <DType DT, int RV, int PF>
inline void tiled_value_rows(const TiledItemArgs& a, int64_t bt, float* const* o,
                             const float* const* p, int tb, int te, TiledPrefetch* pf) {
  if (tb >= te) return;
  const int D = a.head_dim;
  constexpr int kSliceW = kValueVecs * Ops::W;
  static_assert(kSliceW <= 64, "a whole slice fits the smallest head dim");
  static_assert(kVPanel % kSliceW == 0 && kVPanel % Ops::W == 0, "no slice crosses a V panel");
  const int slices = D / kSliceW;
  int d0 = 0;
  for (int i = 0; i < slices; ++i, d0 += kSliceW) {
    const int per_t =
        pf != nullptr ? TiledPrefetch::per_step(pf->value_lines, int64_t{slices - i} * (te - tb))
                      : 0;
    if (per_t == 0) {
      tiled_value_slice<DT, RV, kValueVecs, 0>(a, bt, o, p, tb, te, d0, nullptr, nullptr, 0);
      continue;
    }
    if (per_t == 1 && pf->p1() == nullptr)
      tiled_value_slice<DT, RV, kValueVecs, PF, 1, false>(a, bt, o, p, tb, te, d0, pf->p0(),
                                                            nullptr, 1);
    else if (per_t == 1)
      tiled_value_slice<DT, RV, kValueVecs, PF, 1, true>(a, bt, o, p, tb, te, d0, pf->p0(),
                                                           pf->p1(), 1);
    else
      tiled_value_slice<DT, RV, kValueVecs, PF>(a, bt, o, p, tb, te, d0, pf->p0(), pf->p1(),
                                                  per_t);
    const int64_t issued = int64_t{per_t} * (te - tb);
    pf->done += issued * 64;
    pf->value_lines = pf->value_lines > issued ? pf->value_lines - issued : 0;
  }
  for (; d0 < D; d0 += Ops::W)
    tiled_value_slice<DT, RV, 1, 0>(a, bt, o, p, tb, te, d0, nullptr, nullptr, 0);
}

template <DType DT, int PF>
void run_tiled_item(const TiledItemArgs& a) {
  constexpr bool kQuant = DT == DType::kFP8 || DT == DType::kInt8;
  const int R = a.rows;
  const int D = a.head_dim;
  const int64_t kRec = D + 2;
  const int64_t T = a.tile_tokens;
  const int64_t block_tokens = a.block_tiles * T;
  const int64_t ld = tiled_score_ld(block_tokens);
  float* s = a.scores;

  if (!a.keep)  // else continue the records' states
    for (int r = 0; r < R; ++r) {
      float* rec = a.out + r * kRec;
      rec[kM] = kNegInf;
      for (int64_t i = kL; i < kRec; ++i) rec[i] = 0.0f;
    }

  const int64_t tiles = (a.tokens + T - 1) / T;
  TiledPrefetch pf_state;
  TiledPrefetch* pf = nullptr;
  if (a.prefetch_bytes > 0) {
    pf_state.s0 = a.k;
    // One stream when the V tile sits inside the K tile's record (interleaved layout).
    const bool one_stream = a.v > a.k && a.v < a.k + a.tile_stride;
    pf_state.s1 = one_stream ? nullptr : a.v;
    pf_state.len = tiles * a.tile_stride;
    pf_state.ahead = a.prefetch_bytes;
    pf_state.upto<PF>(a.prefetch_bytes);
    pf = &pf_state;
  }

  for (int64_t tb = 0; tb < a.tokens; tb += block_tokens) {
    const int64_t bt = tb / T;  // first tile of the block
    const int n = static_cast<int>(a.tokens - tb < block_tokens ? a.tokens - tb : block_tokens);
    const int padded = (n + kUnitTokens - 1) / kUnitTokens * kUnitTokens;
    if (pf != nullptr) pf->plan_block((bt + (n + T - 1) / T) * a.tile_stride);

    // 1. Scores, rows in groups of up to kMaxScoreRows; the first group drives the prefetch.
    for (int r0 = 0; r0 < R; r0 += kMaxScoreRows) {
      const int rs = R - r0 < kMaxScoreRows ? R - r0 : kMaxScoreRows;
      tiled_score_dispatch_n<DT, kMaxScoreRows, PF>(rs, a, a.q + r0 * D, bt, n, s + r0 * ld, ld,
                                                r0 == 0 ? pf : nullptr);
    }

    // 2. Online softmax per row; afterwards s holds p = exp(s - m) for the row's visible
    //    tokens of the block (0 past them), times the value scale for quantized V.
    float* ksc = s + R * ld;
    float* vsc = s + (R + 1) * ld;
    if constexpr (kQuant) {
      for (int t0 = 0; t0 < n; t0 += static_cast<int>(T)) {
        const int m = n - t0 < T ? n - t0 : static_cast<int>(T);
        const bf16_t* kst = a.k_scale + (bt + t0 / T) * a.scale_tile_stride;
        const bf16_t* vst = a.v_scale + (bt + t0 / T) * a.scale_tile_stride;
        for (int j = 0; j < m; ++j) {
          ksc[t0 + j] = bf16_value(kst[j]) * a.scale;
          vsc[t0 + j] = bf16_value(vst[j]);
        }
      }
      for (int t = n; t < padded; ++t) ksc[t] = vsc[t] = 0.0f;
    }
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * ld;
      const int64_t vis = a.visible[r] - tb;
      const int take = vis <= 0 ? 0 : (vis < n ? static_cast<int>(vis) : n);
      if (take == 0) continue;
      if (a.visible_from != nullptr) {  // a sliding window: tokens before it weigh exactly 0
        const int64_t lo = a.visible_from[r] - tb;
        const int masked = lo <= 0 ? 0 : (lo < take ? static_cast<int>(lo) : take);
        for (int t = 0; t < masked; ++t) sr[t] = kNegInf;
      }
      softmax_block_row<kQuant>(sr, take, padded, ksc, vsc, a.scale, D, a.out + r * kRec);
    }

    // 3. Values: rows tiled 4/3/2/1 over the tokens they all take, then each row alone.
    auto take_of = [&](int r) -> int {
      const int64_t vis = a.visible[r] - tb;
      int take = vis <= 0 ? 0 : (vis < n ? static_cast<int>(vis) : n);
      if (take > 0 && a.out[r * kRec + kM] == kNegInf) take = 0;
      return take;
    };
    auto run_group = [&](auto rv_tag, int rb, TiledPrefetch* gpf) {
      constexpr int RV = decltype(rv_tag)::value;
      float* o[RV];
      const float* p[RV];
      int tk[RV];
      int common = n;
      for (int i = 0; i < RV; ++i) {
        o[i] = a.out + (rb + i) * kRec + kO;
        p[i] = s + (rb + i) * ld;
        tk[i] = take_of(rb + i);
        common = tk[i] < common ? tk[i] : common;
      }
      tiled_value_rows<DT, RV, PF>(a, bt, o, p, 0, common, gpf);
      if constexpr (RV > 1) {
        for (int i = 0; i < RV; ++i)
          tiled_value_rows<DT, 1, PF>(a, bt, o + i, p + i, common, tk[i], nullptr);
      }
    };
    int r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) run_group(RowTile<4>{}, r0, r0 == 0 ? pf : nullptr);
    TiledPrefetch* last_pf = r0 == 0 ? pf : nullptr;
    if (R - r0 == 3) run_group(RowTile<3>{}, r0, last_pf);
    if (R - r0 == 2) run_group(RowTile<2>{}, r0, last_pf);
    if (R - r0 == 1) run_group(RowTile<1>{}, r0, last_pf);
  }

  // A NaN logit leaves m finite but l NaN; report it in m too, as the reference does.
  for (int r = 0; r < R; ++r) {
    float* rec = a.out + r * kRec;
    if (rec[kL] != rec[kL]) rec[kM] = rec[kL];
  }
}

// The run-time to compile-time switches of the tiled kernel: the dtype and where the software
// prefetch puts its lines (head_dim and the tile size stay run-time values; the dispatcher has
// validated both).
template <int PF>
void dispatch_tiled_item_pf(const TiledItemArgs& a) {
  switch (a.dtype) {
    case DType::kF32: return run_tiled_item<DType::kF32, PF>(a);
    case DType::kF16: return run_tiled_item<DType::kF16, PF>(a);
    case DType::kBF16: return run_tiled_item<DType::kBF16, PF>(a);
    case DType::kFP8: return run_tiled_item<DType::kFP8, PF>(a);
    case DType::kInt8: return run_tiled_item<DType::kInt8, PF>(a);
  }
}
void dispatch_tiled_item(const TiledItemArgs& a) {
  if (a.prefetch_l2) return dispatch_tiled_item_pf<kPrefetchL2>(a);
  dispatch_tiled_item_pf<kPrefetchL1>(a);
}
