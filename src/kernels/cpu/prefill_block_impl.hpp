// The prefill block kernel for the paged driver (paged_kernels.cpp), written once and compiled
// once per ISA target.
//
// Included by kernel_avx512.cpp, kernel_avx2.cpp and kernel_generic.cpp right after
// tiled_item_impl.hpp, inside the same anonymous namespace: it uses that file's score unit
// (tiled_score_unit), value slices (tiled_value_rows), tiled_score_ld() and the online-softmax
// step softmax_block_row() of decode_item_impl.hpp, and adds nothing shared across targets.
//
// Contract: exactly the tiled item kernel's (TiledItemArgs) for a one-tile chunk, the only
// form the paged driver calls (block_tiles = 1, tokens <= tile_tokens), and the SAME BITS for
// every row. The difference is the loop order, made for many rows per tile (a prefill query
// block: group x queries rows) instead of streaming memory:
//   1. the tile's K and V are widened to float once per call into the scratch (exact for every
//      dtype: the float each inner loop of the tiled kernel computes from the element), so the
//      rows read an L1-resident float tile, with no widening in the inner loops;
//   2. the rows run in tiles of kBlockRows rows, each tile fused: scores of its rows, their
//      online-softmax step, their value sums, while the tile's scores stay in L1;
//   3. a row tile computes scores only up to the last token any of its rows sees (rounded up
//      to a score unit), so on the causal diagonal the tiles above it are never computed, and
//      a row tile that sees nothing of the page does no work at all.
// Why the bits are the tiled kernel's: a score is the same chain of FMAs over d in the same
// lane (tiled_score_unit, with the same float K values); the softmax step is the same function
// on the same scores (score vectors past every row's visible tokens hold -inf, whose weight is
// exactly +0: leaving them out adds +0 to non-negative lane sums, and -inf never raises a
// max); each o[d] is the same chain of FMAs over the row's visible tokens in token order
// (tiled_value_rows over the tokens all rows of a value tile see, then each row alone, as
// there). Rows never share arithmetic, so the row tiling is free.
//
// Scratch (TiledItemArgs::scores): prefill_block_scratch_floats(tile_tokens, head_dim) floats.

constexpr int kBlockRows = kMaxScoreRows;  // rows per fused tile: 6 (AVX2, generic), 8
// Value tiles: kBlockValueRows rows x kBlockValueVecs vectors of accumulators, plus the value
// vectors and one broadcast weight. AVX-512: 4 x 4, so the 8-row tile is two equal value
// tiles; with 6 x 4 its last 2 rows ran alone at 8 FMAs per 4 value loads (Zen 4, SmolLM2's
// shape, treeattn_prefill_bench --tokens 4096 --threads 1 --only block: best 315-324 ms with
// 6 x 4, 282-299 with 4 x 4, alternating builds). 8-float targets: the whole 6-row tile as one
// value tile of 6 x 2 (12 + 2 + 1 = 15 registers). 4 x 3 loads fewer broadcasts (one per 3 FMAs,
// not 2) but left rows 5-6 as a 2 x 3 tile whose 6 FMA chains cannot cover the FMA latency (4
// cycles x 2 pipes = 8 chains), and whose compiled loop reloaded V in every FMA (AVX2 Zen 3 at
// 2.45 GHz, treeattn_prefill_bench --tokens 4096 --chunk 256 --threads 1 --rounds 3 --only
// block, builds alternating 3 times: best 336-358 ms with 4 x 3, 316-329 ms with 6 x 2).
constexpr int kBlockValueRows = Ops::W >= 16 ? 4 : kBlockRows;
constexpr int kBlockValueVecs = Ops::W >= 16 ? 4 : 2;

// Scores of RS rows (q, row stride D) with the 2W tokens of one unit: vector j reads the
// float K^T row d at kj + d * P. The FMA chain of tiled_score_unit: same lanes, same order;
// kScale: stored times scale (softmax_block_row's product, done here while they are in
// registers), else raw.
template <int RS, bool kScale>
__attribute__((always_inline)) inline void block_score_unit(const float* q, int D,
                                                            const float* k0, const float* k1,
                                                            int64_t P, float* s, int64_t ld,
                                                            float scale) {
  using V = typename Ops::V;
  V acc0[RS], acc1[RS];
  for (int r = 0; r < RS; ++r) acc0[r] = acc1[r] = Ops::zero();
#pragma GCC unroll 4
  for (int d = 0; d < D; ++d) {
    const V kv0 = Ops::loadu(k0 + d * P);
    const V kv1 = Ops::loadu(k1 + d * P);
    for (int r = 0; r < RS; ++r) {
      const V qb = Ops::set1(q[r * D + d]);
      acc0[r] = Ops::fma(qb, kv0, acc0[r]);
      acc1[r] = Ops::fma(qb, kv1, acc1[r]);
    }
  }
  if constexpr (kScale) {
    const V vs = Ops::set1(scale);
    for (int r = 0; r < RS; ++r) {
      acc0[r] = Ops::mul(acc0[r], vs);
      acc1[r] = Ops::mul(acc1[r], vs);
    }
  }
  for (int r = 0; r < RS; ++r) {
    Ops::storeu(s + r * ld, acc0[r]);
    Ops::storeu(s + r * ld + Ops::W, acc1[r]);
  }
}

// o[r][d0 .. d0 + NV*W) += sum_{t in [tb, te)} p[r][t] * v[t][d0 ..] for RV rows, v the float
// V tile of T tokens in the tile's column panels (the slice inside one): the FMA chain of
// tiled_value_slice (token order per lane).
template <int RV, int NV>
__attribute__((always_inline)) inline void block_value_slice(float* const* o,
                                                             const float* const* p,
                                                             const float* v, int D, int64_t T,
                                                             int tb, int te, int d0) {
  using V = typename Ops::V;
  V acc[RV][NV];
  for (int r = 0; r < RV; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = Ops::loadu(o[r] + d0 + j * Ops::W);
  const TiledVPanel vp = tiled_v_panel(D, d0);
  const float* row = v + vp.p0 * T + tb * vp.width + d0 - vp.p0;
  for (int t = tb; t < te; ++t, row += vp.width) {
    V vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = Ops::loadu(row + j * Ops::W);
    for (int r = 0; r < RV; ++r) {
      const V pb = Ops::set1(p[r][t]);
      for (int j = 0; j < NV; ++j) acc[r][j] = Ops::fma(pb, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RV; ++r)
    for (int j = 0; j < NV; ++j) Ops::storeu(o[r] + d0 + j * Ops::W, acc[r][j]);
}

template <int RV>
__attribute__((always_inline)) inline void block_value_rows(float* const* o,
                                                            const float* const* p,
                                                            const float* v, int D, int64_t T,
                                                            int tb, int te) {
  static_assert(kVPanel % (kBlockValueVecs * Ops::W) == 0, "no slice crosses a V panel");
  if (tb >= te) return;
  int d0 = 0;
  for (; d0 + kBlockValueVecs * Ops::W <= D; d0 += kBlockValueVecs * Ops::W)
    block_value_slice<RV, kBlockValueVecs>(o, p, v, D, T, tb, te, d0);
  if constexpr (kBlockValueVecs > 2) {
    if (d0 + 2 * Ops::W <= D) {
      block_value_slice<RV, 2>(o, p, v, D, T, tb, te, d0);
      d0 += 2 * Ops::W;
    }
  }
  for (; d0 < D; d0 += Ops::W) block_value_slice<RV, 1>(o, p, v, D, T, tb, te, d0);
}

// Everything one tile of RS rows (from r0) does with the float tile: scores up to the last
// token a row of the tile sees, the online-softmax step of each row, the value sums.
struct BlockTile {
  const TiledItemArgs* a;
  const float* kf;   // K^T panels in floats
  const float* vf;   // V panels in floats
  float* s;          // kBlockRows rows of ld scores
  const float* ksc;  // quantized: per-token logit factors, value scales
  const float* vsc;
  int64_t P, ld;
  int n;             // tokens of the page
};

// The value sums of rows [r0 + V0, r0 + RS) of a tile, in value tiles of kBlockValueRows rows:
// each over the tokens all its rows take, then each row's own extra tokens alone.
template <int RS, int V0>
__attribute__((always_inline)) inline void block_values(const BlockTile& b, int r0,
                                                        const int* take) {
  constexpr int RV = RS - V0 < kBlockValueRows ? RS - V0 : kBlockValueRows;
  const TiledItemArgs& a = *b.a;
  const int D = a.head_dim;
  const int64_t kRec = D + 2;
  float* o[RV];
  const float* p[RV];
  int tk[RV];
  int common = b.n;
  for (int i = 0; i < RV; ++i) {
    const int r = r0 + V0 + i;
    o[i] = a.out + r * kRec + kO;
    p[i] = b.s + (V0 + i) * b.ld;
    tk[i] = a.out[r * kRec + kM] == kNegInf ? 0 : take[V0 + i];
    common = tk[i] < common ? tk[i] : common;
  }
  const int64_t T = a.tile_tokens;
  block_value_rows<RV>(o, p, b.vf, D, T, 0, common);
  if constexpr (RV > 1) {
    for (int i = 0; i < RV; ++i) block_value_rows<1>(o + i, p + i, b.vf, D, T, common, tk[i]);
  }
  if constexpr (V0 + RV < RS) block_values<RS, V0 + RV>(b, r0, take);
}

template <bool kQuant, int RS>
void block_tile(const BlockTile& b, int r0, const int* take) {
  const TiledItemArgs& a = *b.a;
  const int D = a.head_dim;
  const int64_t kRec = D + 2;
  int need = 0;
  for (int i = 0; i < RS; ++i) need = take[i] > need ? take[i] : need;
  if (need == 0) return;  // the tile sees nothing of this page: empty records
  const int pad = (need + kUnitTokens - 1) / kUnitTokens * kUnitTokens;
  const float* q = a.q + r0 * D;
  for (int u = 0; u < pad; u += kUnitTokens) {
    const int64_t p0 = u / b.P;
    const float* k0 = b.kf + p0 * D * b.P + (u - p0 * b.P);
    const int64_t p1 = (u + Ops::W) / b.P;
    const float* k1 = u + Ops::W < b.n ? b.kf + p1 * D * b.P + (u + Ops::W - p1 * b.P) : k0;
    block_score_unit<RS, !kQuant>(q, D, k0, k1, b.P, b.s + u, b.ld, a.scale);
  }
  for (int i = 0; i < RS; ++i) {
    if (take[i] == 0) continue;
    const int r = r0 + i;
    float* sr = b.s + i * b.ld;
    if (a.visible_from != nullptr) {  // a sliding window: tokens before it weigh exactly 0
      const int64_t lo = a.visible_from[r];
      const int masked = lo <= 0 ? 0 : (lo < take[i] ? static_cast<int>(lo) : take[i]);
      for (int t = 0; t < masked; ++t) sr[t] = kNegInf;
    }
    softmax_block_row<kQuant, !kQuant>(sr, take[i], pad, b.ksc, b.vsc, a.scale, D,
                                       a.out + r * kRec);
  }
  block_values<RS, 0>(b, r0, take);
}

template <bool kQuant, int RS>
void block_tile_dispatch(int rs, const BlockTile& b, int r0, const int* take) {
  if constexpr (RS > 1) {
    if (rs < RS) return block_tile_dispatch<kQuant, RS - 1>(rs, b, r0, take);
  }
  block_tile<kQuant, RS>(b, r0, take);
}

template <DType DT>
void run_prefill_block(const TiledItemArgs& a) {
  constexpr bool kQuant = DT == DType::kFP8 || DT == DType::kInt8;
  const int R = a.rows;
  const int D = a.head_dim;
  const int64_t kRec = D + 2;
  const int64_t T = a.tile_tokens;
  const int64_t P = tiled_panel_tokens(T);
  const int n = static_cast<int>(a.tokens);  // <= T: one tile
  const int64_t ld = tiled_score_ld(T);
  float* kf = a.scores;       // K^T of the tile in floats, same panel layout
  float* vf = kf + T * D;     // V of the tile in floats, same panel layout
  float* s = vf + T * D;      // kBlockRows rows of ld scores
  float* ksc = s + kBlockRows * ld;
  float* vsc = ksc + ld;

  if (!a.keep)  // else continue the records' states
    for (int r = 0; r < R; ++r) {
      float* rec = a.out + r * kRec;
      rec[kM] = kNegInf;
      for (int64_t i = kL; i < kRec; ++i) rec[i] = 0.0f;
    }
  auto take_of = [&](int r) -> int {
    const int64_t vis = a.visible[r];
    return vis <= 0 ? 0 : (vis < n ? static_cast<int>(vis) : n);
  };
  int seen = 0;  // tokens any row sees
  for (int r = 0; r < R; ++r) seen = take_of(r) > seen ? take_of(r) : seen;
  if (seen > 0) {
    // The tile in floats: K panels up to the last vector a row tile may read (K^T is
    // [T/P][D][P]: whole panels), each V panel's rows up to `seen`.
    const int64_t k_elems = (seen + P - 1) / P * P * D;
    for (int64_t i = 0; i < k_elems; i += Ops::W) Ops::storeu(kf + i, load_elems<DT>(a.k, i));
    for (int64_t p0 = 0; p0 < D; p0 += kVPanel) {
      const int64_t from = p0 * T, to = from + seen * tiled_v_panel(D, p0).width;
      for (int64_t i = from; i < to; i += Ops::W) Ops::storeu(vf + i, load_elems<DT>(a.v, i));
    }
    if constexpr (kQuant) {
      const int padded = (n + kUnitTokens - 1) / kUnitTokens * kUnitTokens;
      for (int j = 0; j < n; ++j) {
        ksc[j] = bf16_value(a.k_scale[j]) * a.scale;
        vsc[j] = bf16_value(a.v_scale[j]);
      }
      for (int t = n; t < padded; ++t) ksc[t] = vsc[t] = 0.0f;
    }
    const BlockTile b{&a, kf, vf, s, ksc, vsc, P, ld, n};
    for (int r0 = 0; r0 < R; r0 += kBlockRows) {
      const int rs = R - r0 < kBlockRows ? R - r0 : kBlockRows;
      int take[kBlockRows];
      for (int i = 0; i < rs; ++i) take[i] = take_of(r0 + i);
      block_tile_dispatch<kQuant, kBlockRows>(rs, b, r0, take);
    }
  }

  // A NaN logit leaves m finite but l NaN; report it in m too, as the reference does.
  for (int r = 0; r < R; ++r) {
    float* rec = a.out + r * kRec;
    if (rec[kL] != rec[kL]) rec[kM] = rec[kL];
  }
}

void dispatch_prefill_block(const TiledItemArgs& a) {
  switch (a.dtype) {
    case DType::kF32: return run_prefill_block<DType::kF32>(a);
    case DType::kF16: return run_prefill_block<DType::kF16>(a);
    case DType::kBF16: return run_prefill_block<DType::kBF16>(a);
    case DType::kFP8: return run_prefill_block<DType::kFP8>(a);
    case DType::kInt8: return run_prefill_block<DType::kInt8>(a);
  }
}
