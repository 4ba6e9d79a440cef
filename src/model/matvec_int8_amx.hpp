// The K types' batched path on AMX-INT8 (Intel's tile unit): included by matvec_int8_x86.hpp in
// the AMX target only (matvec_int8_amx.cpp, compiled with -mamx-tile -mamx-int8), after
// matvec_int8_impl.hpp, inside the target's namespace.
//
// groupk (matvec_int8_impl.hpp) sums each sub-block's integer products u = sum(code * q) per (row,
// token) with vpdpbusd, 4 codes a broadcast, then multiplies u by the sub-scale; here the tile
// unit (tdpbusd / tdpbssd: 16 rows x 8 tokens x 64 columns a multiply) sums the products of the
// codes already times their sub-scales (DecA, two bytes each) over a whole super-block, 16 rows
// x 16 tokens (two 8-token groups: one WideLanes vector per row), and from there the steps of
// groupk: the min (Q4_K / Q5_K) or offset (Q6_K) pairs, groupk_floats and the store. The
// integers are exact in any order, the float operations are groupk's lane by lane, so the bits
// are the other targets'.
#pragma once

#include <immintrin.h>

// GCC 12's 512-bit intrinsics pass an undefined vector to their builtins: a false
// (maybe-)uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// The tile registers' shapes (LDTILECFG's 64-byte operand, palette 1).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64);

constexpr int kAmxRows = 16;  // rows of a pass: the tiles' M
// A row's super-block decoded for the tiles (DecA): DecK's layout (matvec_int8_impl.hpp: its min
// or offset pairs at kDecKPairs, d and -dmin at kDecKD) with each code times its sub-scale,
// v = sc * code, split into bytes: [0, 256) lo = v & 255 (unsigned) where DecK has the codes, and
// [384, 640) hi = v >> 8 (Q4_K / Q5_K: 0-7; Q6_K, whose sub-scales are signed: -32-31), so
// v = 256 hi + lo. The sub-scales' products then come out of the tile sums: S = 256 * sum(hi q) +
// sum(lo q) (+ the pairs), the same integer as groupk's sum_j sc_j sum(code q).
constexpr int kDecAHi = 384, kDecABytes = 640;
static_assert(kAmxRows * kDecABytes / 256 <= 4 * kScratchRows);  // scratch bytes per column

template <uint32_t T>
inline void decode_a(const uint8_t* b, uint8_t* o) {
  using CK = CodeK<T>;
  decode_k<T>(b, o);  // codes at [0, 256), int32 sub-scales at kDecKScales, pairs, d, -dmin
  for (int c = 0; c < 8; ++c) {  // 32 codes at a time, one or two sub-scales
    int32_t s0, s1;
    std::memcpy(&s0, o + kDecKScales + 4 * (32 * c / CK::kSub), 4);
    std::memcpy(&s1, o + kDecKScales + 4 * ((32 * c + 16) / CK::kSub), 4);
    const __m512i sc = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(s0)),
                                          _mm256_set1_epi16(static_cast<int16_t>(s1)), 1);
    const __m512i codes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32 * c)));
    const __m512i v = _mm512_mullo_epi16(codes, sc);  // |v| <= 63 * 128: int16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * c),
                        _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xff))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + kDecAHi + 32 * c),
                        _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
  }
}

// Tiles: 0, 1 = C of lo and hi for the first 16 tokens of a pass, 2, 3 for the next 16 (16 rows
// x 16 int32); 4, 5 = A, lo and hi (16 rows x 64 bytes: 64 columns); 6, 7 = B of the two
// 16-token groups (16 rows of 4 columns x 16 tokens: RowsArgs::xtk16).
inline AmxTileConfig amx_config() {
  AmxTileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

// 16 decoded rows (dec, DecA: row r's super-block k at (r * blocks + k) * kDecABytes) against
// NB (1 or 2) groups of 16 tokens: xt the first 8-token group's blocks (ActBlockK8, 2 NB groups,
// the last possibly partial or, past the call's last group, the spare one the driver allocates),
// x16 the same tokens' codes in pairs (RowsArgs::xtk16). y[t * y_stride + r] for the first
// lanes[v] tokens of group v. While it runs, `next`'s 16 rows (a later pass's) are prefetched
// where not null.
template <uint32_t T, int NB, class O = Ops>
inline void groupk_amx(const uint8_t* dec, int64_t blocks, const ActBlockK8* xt, const int8_t* x16,
                       const int* lanes, float* y, int64_t y_stride, const uint8_t* next,
                       int64_t row_bytes) {
  static_assert(NB == 1 || NB == 2);
  using CK = CodeK<T>;
  using L = WideLanes<>;
  using V = typename L::V;
  using I = typename L::I;
  constexpr int R = kAmxRows;
  constexpr int kPairs = 128 / CK::kSub;  // Q4_K / Q5_K: 4 pairs of mins; Q6_K: 8 of offsets
  // Row r's running float sums (groupk's acc and macc), 16 tokens of group v each.
  alignas(64) float acc[NB][R][16], macc[NB][R][16];
  for (int v = 0; v < NB; ++v)
    for (int r = 0; r < R; ++r) {
      L::vstore(acc[v][r], L::zero());
      L::vstore(macc[v][r], L::zero());
    }
  alignas(64) int32_t lo[NB][R][16], hi[NB][R][16];
  const int64_t row_stride = blocks * kDecABytes;
  for (int64_t k = 0; k < blocks; ++k) {
    const uint8_t* const db = dec + k * kDecABytes;  // row r's record at db + r * row_stride
    prefetch_superblock<T, R>(next, row_bytes, k);
    const int8_t* const b0 = x16 + k * kXtk16Bytes;
    const int8_t* const b1 = x16 + (blocks + k) * kXtk16Bytes;
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NB == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int c = 0; c < 4; ++c) {  // 64 columns a step
      _tile_loadd(4, db + 64 * c, row_stride);
      _tile_loadd(5, db + kDecAHi + 64 * c, row_stride);
      _tile_loadd(6, b0 + 1024 * c, 64);
      _tile_dpbusd(0, 4, 6);
      if constexpr (CK::kMin)  // hi >= 0
        _tile_dpbusd(1, 5, 6);
      else  // Q6_K's hi is signed
        _tile_dpbssd(1, 5, 6);
      if constexpr (NB == 2) {
        _tile_loadd(7, b1 + 1024 * c, 64);
        _tile_dpbusd(2, 4, 7);
        if constexpr (CK::kMin)
          _tile_dpbusd(3, 5, 7);
        else
          _tile_dpbssd(3, 5, 7);
      }
    }
    _tile_stored(0, &lo[0][0][0], 64);
    _tile_stored(1, &hi[0][0][0], 64);
    if constexpr (NB == 2) {
      _tile_stored(2, &lo[1][0][0], 64);
      _tile_stored(3, &hi[1][0][0], 64);
    }
    for (int v = 0; v < NB; ++v) {
      // The tokens' operands of every row: the pairs' sums and d_x (groupk_floats' d).
      const ActBlockK8& xa = xt[2 * v * blocks + k];
      const ActBlockK8& xb = xt[(2 * v + 1) * blocks + k];
      I xs[kPairs];
      for (int jp = 0; jp < kPairs; ++jp)
        xs[jp] = CK::kMin ? O::wload2(xa.s32[jp], xb.s32[jp]) : O::wload2(xa.s16[jp], xb.s16[jp]);
      const V dx = O::wvload2(xa.d, xb.d);
      for (int r = 0; r < R; ++r) {
        const uint8_t* const rec = db + r * row_stride;
        I sv = L::add(L::ishl(_mm512_load_si512(hi[v][r]), 8), _mm512_load_si512(lo[v][r]));
        I mv = L::izero();
        for (int jp = 0; jp < kPairs; ++jp) {
          int32_t pr;
          std::memcpy(&pr, rec + kDecKPairs + 4 * jp, 4);
          if constexpr (CK::kMin)
            mv = L::madd_pairs(mv, xs[jp], pr);
          else
            sv = L::madd_pairs(sv, xs[jp], pr);
        }
        float wd, wn;  // groupk_floats' operations, lane by lane
        std::memcpy(&wd, rec + kDecKD, 4);
        std::memcpy(&wn, rec + kDecKD + 4, 4);
        L::vstore(acc[v][r],
                  L::fma(L::mul(L::set1(wd), dx), L::cvt(sv), _mm512_load_ps(acc[v][r])));
        if constexpr (CK::kMin)
          L::vstore(macc[v][r],
                    L::fma(L::mul(L::set1(wn), dx), L::cvt(mv), _mm512_load_ps(macc[v][r])));
      }
    }
  }
  for (int v = 0; v < NB; ++v)
    for (int q = 0; q < R / 4; ++q) {  // four rows at a time: store_rows' transposed stores
      V o[4];
      for (int r = 0; r < 4; ++r) {
        const V a = _mm512_load_ps(acc[v][4 * q + r]);
        o[r] = CK::kMin ? L::vadd(a, _mm512_load_ps(macc[v][4 * q + r])) : a;
      }
      store_rows<L, 4, L::kTokens>(o, lanes[v], y + 16 * v * y_stride + 4 * q, y_stride);
    }
}

// Rows r .. of the job in passes of 16 (as many as fit before row_end), every token: the rows
// decoded once (DecA), then the tokens 32 at a time on the tiles (a last 16 alone). r: the
// first row left for the caller.
template <uint32_t T>
void rows_k_amx(const RowsArgs& a, int64_t& r) {
  using CK = CodeK<T>;
  const int64_t blocks = a.cols / 256;
  static const AmxTileConfig config = amx_config();
  _tile_loadconfig(&config);
  auto* dec = reinterpret_cast<uint8_t*>(a.scratch);
  for (; r + kAmxRows <= a.row_end; r += kAmxRows) {
    for (int rr = 0; rr < kAmxRows; ++rr) {
      const uint8_t* row = a.w + (r + rr) * a.row_bytes;
      for (int64_t k = 0; k < blocks; ++k)
        decode_a<T>(row + k * CK::kBytes, dec + (rr * blocks + k) * kDecABytes);
    }
    const uint8_t* next = a.w + (r + kAmxRows) * a.row_bytes;
    for (int64_t t = 0; t < a.tokens; t += 32) {
      const int lanes[2] = {static_cast<int>(std::min<int64_t>(16, a.tokens - t)),
                            static_cast<int>(std::min<int64_t>(16, a.tokens - t - 16))};
      const ActBlockK8* xt = a.xtk + t / 8 * blocks;
      const int8_t* x16 = a.xtk16 + t / 16 * blocks * kXtk16Bytes;
      float* y = a.y + t * a.y_stride + r;
      const uint8_t* nx = t == 0 ? next : nullptr;
      if (lanes[1] > 0)
        groupk_amx<T, 2>(dec, blocks, xt, x16, lanes, y, a.y_stride, nx, a.row_bytes);
      else
        groupk_amx<T, 1>(dec, blocks, xt, x16, lanes, y, a.y_stride, nx, a.row_bytes);
    }
  }
  _tile_release();
}

#pragma GCC diagnostic pop
