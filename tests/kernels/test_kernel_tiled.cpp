// The tiled KV layout (kv_tiles.hpp) and decode_partial_tiled() on every kernel target this CPU
// can run, against the float64 oracle on the same values in the caller layout: a sweep over
// KV lengths 0..16384 (tails around every vector width and tile size), every dtype (fp8/int8
// with per-token scales), GQA groups 1..8 including the SmolLM2 shape (H 9, Hkv 3, D 64),
// every supported head dim, ragged batches, Q 1 and 4, tile sizes 16 and 32, both tile
// layouts and two chunkings. Plus: the cache's encoding (bit-identical to KVCache, read back,
// growth; fp8/int8 scales as bfloat16, 2 * head_dim + 4 bytes per token and KV head, copy_from
// refusing a scale that is not a bf16 value), striped positions with Q > 1, causally hidden and
// tail-slot NaNs never read, NaN propagation, empty rows, extreme logits, the exact fixtures bit
// for bit (quantized too, on every target), bitwise determinism across thread counts, large
// caches asking for huge pages, and the validation messages.
//
// Tolerance: tests/support/test_data.hpp (1e-5 relative to max(1, max|ref|), output and LSE).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "support/test_data.hpp"
#include "treeattn/kv_tiles.hpp"

namespace treeattn {
namespace {

using testing::Errors;
using testing::Problem;

constexpr double kTol = 1e-5;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct TileConfig {
  int64_t tokens;
  KVTileLayout layout;
};
constexpr TileConfig kTileConfigs[] = {{32, KVTileLayout::kSplit},
                                       {16, KVTileLayout::kInterleaved},
                                       {128, KVTileLayout::kInterleaved},
                                       {64, KVTileLayout::kSplit},
                                       {32, KVTileLayout::kInterleaved},
                                       {16, KVTileLayout::kSplit}};

std::string tile_name(const TileConfig& c) {
  return "T" + std::to_string(c.tokens) + "_" + std::string(kv_tile_layout_name(c.layout));
}

TiledKVCache tiled_copy(const AttnShape& shape, const KVShard& src, const TileConfig& c,
                        int64_t capacity = 0) {
  Result<TiledKVCache> r = TiledKVCache::copy_from(shape, src, capacity, c.layout, c.tokens);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return std::move(r).value();
}

struct HeadsConfig {
  int64_t heads, kv_heads;
};
// Groups 1, 2, 3 (SmolLM2 9/3), 4 (llama3 32/8), 5, 6, 7, 8.
constexpr HeadsConfig kHeads[] = {{4, 4}, {4, 2}, {9, 3},   {32, 8},
                                  {10, 2}, {6, 1}, {14, 2}, {32, 4}};
constexpr int64_t kLengths[] = {0,  1,  2,  3,   7,   15,  16,  17,   31,   32,  33,
                                54, 97, 113, 256, 339, 799, 1024, 2048, 16384};
constexpr int64_t kDims[] = {64, 80, 96, 128, 192, 256};
constexpr int64_t kBatches[] = {1, 3, 17};
constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8};

struct SweepCase {
  AttnShape shape;
  DType dtype;
  std::vector<int64_t> len;
  TileConfig tile;
  std::string name;
};

// Cycles heads, dims, batches and tile configurations against every (length, dtype, Q), capping
// the oracle's work so the sweep stays quick.
std::vector<SweepCase> sweep_cases() {
  std::vector<SweepCase> cases;
  int k = 0;
  for (int64_t L : kLengths)
    for (DType t : kTypes)
      for (int64_t Q : {1, 4}) {
        HeadsConfig hc = kHeads[k % 8];
        const int64_t D = kDims[(k / 3) % 6];
        int64_t B = kBatches[(k / 2) % 3];
        const TileConfig tile = kTileConfigs[(k / 5) % 6];
        ++k;
        while (B * hc.heads * std::max<int64_t>(L, 1) * D * Q > 60'000'000 && B > 1)
          B = B > 3 ? 3 : 1;
        while (hc.heads * std::max<int64_t>(L, 1) * D * Q > 60'000'000 && hc.heads > 9)
          hc = {9, 3};
        SweepCase c;
        c.shape = AttnShape{B, hc.heads, hc.kv_heads, D, Q};
        c.dtype = t;
        c.tile = tile;
        for (int64_t b = 0; b < B; ++b) c.len.push_back(std::max<int64_t>(0, L - 13 * b));
        c.name = "L" + std::to_string(L) + "_" + std::string(dtype_name(t)) + "_B" +
                 std::to_string(B) + "_H" + std::to_string(hc.heads) + "_Hkv" +
                 std::to_string(hc.kv_heads) + "_D" + std::to_string(D) + "_Q" +
                 std::to_string(Q) + "_" + tile_name(tile);
        cases.push_back(std::move(c));
      }
  // The model decode's shape at a length past several chunks, every tile configuration.
  for (const TileConfig& tile : kTileConfigs)
    for (DType t : kTypes) {
      SweepCase c;
      c.shape = AttnShape{2, 9, 3, 64, 1};
      c.dtype = t;
      c.tile = tile;
      c.len = {5001, 4097};
      c.name = "SmolLM2_" + std::string(dtype_name(t)) + "_" + tile_name(tile);
      cases.push_back(std::move(c));
    }
  return cases;
}

void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.name; }

class TiledSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(TiledSweep, EveryTargetMatchesOracle) {
  const SweepCase& c = GetParam();
  Problem p(c.shape, c.dtype, c.len, 4321 + static_cast<uint64_t>(c.len[0]));
  std::vector<double> out(p.rows() * static_cast<std::size_t>(c.shape.head_dim)), lse(p.rows());
  ASSERT_TRUE(oracle_attention(p.shape, p.q.data(), p.whole(), out.data(), lse.data()).is_ok());
  const TiledKVCache tiled = tiled_copy(c.shape, p.whole(), c.tile);
  const TiledKVShard view = tiled.view(p.len, p.start, p.total, 1);
  std::vector<float> st(p.rows() * static_cast<std::size_t>(c.shape.head_dim + 2));
  for (Isa isa : testing::runnable_isas()) {
    for (int64_t chunk : {int64_t{0}, int64_t{37}}) {
      DecodeOptions opt;
      opt.isa = isa;
      opt.chunk_tokens = chunk;
      const Status s = decode_partial_tiled(p.shape, p.q.data(), view, st.data(), opt);
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      const Errors e = testing::compare_states(p.shape, st.data(), out.data(), lse.data());
      EXPECT_FALSE(e.nan_mismatch) << isa_name(isa);
      EXPECT_LE(e.out_rel(), kTol) << isa_name(isa) << " chunk " << chunk;
      EXPECT_LE(e.lse_abs, kTol) << isa_name(isa) << " chunk " << chunk;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tiled, TiledSweep, ::testing::ValuesIn(sweep_cases()),
                         [](const auto& param_info) { return param_info.param.name; });

// set_token encodes exactly like KVCache::set_token (same codes and scales), read_token gives
// the dequantized values back, set_tokens writes every head, and reserve keeps the contents.
TEST(TiledCache, EncodingMatchesKVCacheAndSurvivesGrowth) {
  for (DType t : kTypes)
    for (const TileConfig& tc : kTileConfigs) {
      const AttnShape s{2, 6, 3, 80, 1};
      const int64_t n = 45;
      KVCache ref(s, t, n);
      Result<TiledKVCache> c = TiledKVCache::create(s, t, 20, tc.layout, tc.tokens);
      ASSERT_TRUE(c.is_ok()) << c.status().to_string();
      EXPECT_EQ(c->capacity(), (20 + tc.tokens - 1) / tc.tokens * tc.tokens);  // whole tiles
      std::mt19937_64 rng(7);
      std::uniform_real_distribution<float> u(-3.0f, 3.0f);
      std::vector<float> k(static_cast<std::size_t>(3 * 80)), v(k.size());
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t tok = 0; tok < n; ++tok) {
          for (auto& x : k) x = u(rng);
          for (auto& x : v) x = u(rng);
          for (int64_t h = 0; h < 3; ++h) ref.set_token(b, h, tok, k.data() + h * 80, v.data() + h * 80);
          if (tok >= c->capacity()) {
            ASSERT_TRUE(c->reserve(2 * c->capacity()).is_ok());
          }
          c->set_tokens(b, tok, k.data(), v.data());
        }
      EXPECT_GE(c->capacity(), n);
      const std::size_t es = dtype_size(t);
      std::vector<uint8_t> kr(80 * es), vr(kr.size());
      std::vector<float> kf(80), vf(80);
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 3; ++h)
          for (int64_t tok = 0; tok < n; ++tok) {
            bf16_t ksb{0xffff}, vsb{0xffff};
            c->read_token_raw(b, h, tok, kr.data(), vr.data(), &ksb, &vsb);
            const float ks = bf16_value(ksb), vs = bf16_value(vsb);
            const std::size_t i = ref.index(b, h, tok) * es;
            ASSERT_EQ(std::memcmp(kr.data(), static_cast<const uint8_t*>(ref.k_data()) + i, kr.size()), 0)
                << dtype_name(t) << " " << tile_name(tc) << " b" << b << " h" << h << " t" << tok;
            ASSERT_EQ(std::memcmp(vr.data(), static_cast<const uint8_t*>(ref.v_data()) + i, vr.size()), 0);
            const float rks = dtype_is_quantized(t) ? ref.k_scale_data()[ref.scale_index(b, h, tok)] : 0.0f;
            const float rvs = dtype_is_quantized(t) ? ref.v_scale_data()[ref.scale_index(b, h, tok)] : 0.0f;
            EXPECT_EQ(ks, rks);
            EXPECT_EQ(vs, rvs);
            c->read_token(b, h, tok, kf.data(), vf.data());
            for (std::size_t d = 0; d < 80; ++d) {
              EXPECT_EQ(kf[d], dequantize(ref.k_data(), t, ref.index(b, h, tok) + d, rks));
              EXPECT_EQ(vf[d], dequantize(ref.v_data(), t, ref.index(b, h, tok) + d, rvs));
            }
          }
    }
}

// Every element sits where kv_tiles.hpp says: K^T panels of min(T, 32) tokens, V in column
// panels of 64 elements of head_dim (the last one narrower). Each element holds its own code
// (f16 bits numbering (token, d)), written by set_token_raw and by copy_from, and is read back
// from the view's raw bytes at the header's formula, written out here on its own; two elements
// at the addresses worked out by hand.
TEST(TiledCache, ElementsSitWhereTheHeaderSays) {
  EXPECT_EQ(kv_tile_v_index(64, 80, 5, 70), 64 * 64 + 5 * 16 + 6);   // the 16-wide last panel
  EXPECT_EQ(kv_tile_v_index(64, 192, 3, 130), 128 * 64 + 3 * 64 + 2);
  EXPECT_EQ(kv_tile_k_index(64, 80, 37, 2), 1 * 80 * 32 + 2 * 32 + 5);  // second K panel
  for (const int64_t D : kDims)
    for (const int64_t T : {16, 32, 64, 128})
      for (const KVTileLayout layout : {KVTileLayout::kInterleaved, KVTileLayout::kSplit}) {
        const AttnShape s{1, 4, 2, D, 1};
        const int64_t n = 2 * T + 3;  // a partly filled last tile
        auto code = [&](int64_t h, int64_t t, int64_t d, bool value) {
          return static_cast<uint16_t>(((h * n + t) * D + d) * 2 + (value ? 1 : 0));
        };
        KVCache rows(s, DType::kF16, n);
        auto c = TiledKVCache::create(s, DType::kF16, n, layout, T);
        ASSERT_TRUE(c.is_ok()) << c.status().to_string();
        std::vector<uint16_t> k(static_cast<std::size_t>(D)), v(k.size());
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t t = 0; t < n; ++t) {
            for (int64_t d = 0; d < D; ++d) {
              k[static_cast<std::size_t>(d)] = code(h, t, d, false);
              v[static_cast<std::size_t>(d)] = code(h, t, d, true);
            }
            c->set_token_raw(0, h, t, k.data(), v.data());
            std::memcpy(static_cast<uint16_t*>(rows.k_data()) + rows.index(0, h, t), k.data(), D * 2);
            std::memcpy(static_cast<uint16_t*>(rows.v_data()) + rows.index(0, h, t), v.data(), D * 2);
          }
        const std::vector<int64_t> len{n}, z{0};
        auto copied = TiledKVCache::copy_from(s, rows.view(0, len, z, len, 1), 0, layout, T);
        ASSERT_TRUE(copied.is_ok()) << copied.status().to_string();
        for (const TiledKVCache* cache : {&c.value(), &copied.value()}) {
          const TiledKVShard view = cache->view(len, z, len);
          const int64_t P = T < 32 ? T : 32;
          for (int64_t h = 0; h < 2; ++h)
            for (int64_t t = 0; t < n; ++t)
              for (int64_t d = 0; d < D; ++d) {
                const int64_t l = t % T, base = h * view.head_stride + (t / T) * view.tile_stride;
                const int64_t p0 = d / 64 * 64, w = std::min<int64_t>(64, D - p0);
                const int64_t ki = (l / P) * D * P + d * P + l % P;
                const int64_t vi = p0 * T + l * w + (d - p0);
                uint16_t kc = 0, vc = 0;
                std::memcpy(&kc, static_cast<const char*>(view.k) + base + ki * 2, 2);
                std::memcpy(&vc, static_cast<const char*>(view.v) + base + vi * 2, 2);
                ASSERT_EQ(kc, code(h, t, d, false)) << "K D" << D << " T" << T << " h" << h << " t" << t << " d" << d;
                ASSERT_EQ(vc, code(h, t, d, true)) << "V D" << D << " T" << T << " h" << h << " t" << t << " d" << d;
              }
        }
      }
}

// fp8 / int8 tiles hold bfloat16 scales: 2 * head_dim + 4 bytes per token and KV head
// (kv_head_token_bytes), so a pool of whole records holds exactly that many bytes per token,
// every supported head dim and tile size, both placements; f16 holds 4 * head_dim, so at head
// dim 64 a quantized page takes 132 / 256 of an f16 page's bytes (1.94x the tokens). The scale
// of token t sits 2 bytes after token t - 1's (and V's T scales after K's in a record).
TEST(TiledCache, ScalesAreBF16AndATokenTakes2DPlus4BytesPerKVHead) {
  static_assert(sizeof(bf16_t) == 2 && kTiledScaleBytes == 2);
  for (const int64_t D : kDims)
    for (const int64_t T : {16, 32, 64, 128, 256})
      for (const KVTileLayout layout : {KVTileLayout::kInterleaved, KVTileLayout::kSplit})
        for (const DType t : {DType::kInt8, DType::kFP8, DType::kF16}) {
          const int64_t Hkv = 3, pages = 5;
          EXPECT_EQ(kv_head_token_bytes(static_cast<std::size_t>(D), t),
                    static_cast<std::size_t>(dtype_is_quantized(t) ? 2 * D + 4 : 4 * D));
          auto c = TiledKVCache::create(AttnShape{1, 6, Hkv, D, 1}, t, pages * T, layout, T);
          ASSERT_TRUE(c.is_ok()) << c.status().to_string();
          // Split: the scale arrays are each rounded up to 64 bytes.
          const std::size_t exact = static_cast<std::size_t>(Hkv * pages * T) *
                                    kv_head_token_bytes(static_cast<std::size_t>(D), t);
          if (layout == KVTileLayout::kInterleaved) {
            EXPECT_EQ(c->bytes(), exact) << dtype_name(t) << " D" << D << " T" << T;
          } else {
            EXPECT_GE(c->bytes(), exact);
            EXPECT_LT(c->bytes(), exact + 128);
          }
          if (!dtype_is_quantized(t)) continue;
          const std::vector<int64_t> n{pages * T}, z{0};
          const TiledKVShard v = c->view(n, z, n);
          const auto* base = static_cast<const char*>(v.k);
          const auto* ks = reinterpret_cast<const char*>(v.k_scale);
          const auto* vs = reinterpret_cast<const char*>(v.v_scale);
          if (layout == KVTileLayout::kInterleaved) {
            EXPECT_EQ(ks - base, 2 * D * T);  // [K^T][V][k_scale][v_scale], whole record
            EXPECT_EQ(vs - ks, 2 * T);
            EXPECT_EQ(v.scale_tile_stride * 2, v.tile_stride);
            EXPECT_EQ(v.tile_stride, T * static_cast<int64_t>(
                                             kv_head_token_bytes(static_cast<std::size_t>(D), t)));
          } else {
            EXPECT_EQ(v.scale_tile_stride, T);
            EXPECT_EQ(vs - ks, (Hkv * pages * T * 2 + 63) / 64 * 64);
          }
        }
  static_assert(4.0 * 64 / (2 * 64 + 4) >= 1.9, "the capacity ratio at head dim 64");
}

// copy_from keeps a KVShard's scales bit for bit when they are bfloat16 values (quantize_token's
// are) and refuses any other, naming the row, head, token and scale, rather than round it.
TEST(TiledCache, CopyFromRefusesAScaleThatIsNotABF16Value) {
  const AttnShape s{2, 4, 2, 64, 1};
  for (const DType t : {DType::kInt8, DType::kFP8}) {
    KVCache cache(s, t, 9);
    std::vector<float> k(64), v(64);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t tok = 0; tok < 9; ++tok) {
          for (std::size_t d = 0; d < 64; ++d) {
            k[d] = std::sin(static_cast<float>(tok * 64 + static_cast<int64_t>(d) + b + h)) * 0.3f;
            v[d] = std::cos(static_cast<float>(tok * 64 + static_cast<int64_t>(d) * 3 + h)) * 7.0f;
          }
          cache.set_token(b, h, tok, k.data(), v.data());
        }
    const std::vector<int64_t> len{9, 7}, start{0, 0}, total{9, 7};
    auto c = TiledKVCache::copy_from(s, cache.view(0, len, start, total, 1), 0,
                                     KVTileLayout::kInterleaved, 16);
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t tok = 0; tok < len[static_cast<std::size_t>(b)]; ++tok) {
          std::vector<uint8_t> kr(64), vr(64);
          bf16_t ks{}, vs{};
          c->read_token_raw(b, h, tok, kr.data(), vr.data(), &ks, &vs);
          ASSERT_EQ(bf16_value(ks), cache.k_scale_data()[cache.scale_index(b, h, tok)]);
          ASSERT_EQ(bf16_value(vs), cache.v_scale_data()[cache.scale_index(b, h, tok)]);
        }
    const float kept = cache.v_scale_data()[cache.scale_index(1, 1, 6)];
    cache.v_scale_data()[cache.scale_index(1, 1, 6)] = std::nextafter(kept, 1.0f);
    auto bad = TiledKVCache::copy_from(s, cache.view(0, len, start, total, 1));
    ASSERT_FALSE(bad.is_ok());
    EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
    for (const char* words : {"batch row 1", "KV head 1", "token 6", "V scale", "not a bfloat16"})
      EXPECT_NE(bad.status().message().find(words), std::string::npos) << bad.status().message();
    // A slot past the row's length is no token of the view: not checked, not copied.
    cache.v_scale_data()[cache.scale_index(1, 1, 6)] = kept;
    cache.k_scale_data()[cache.scale_index(1, 0, 8)] = 0.1f;
    EXPECT_TRUE(TiledKVCache::copy_from(s, cache.view(0, len, start, total, 1)).is_ok());
    cache.k_scale_data()[cache.scale_index(0, 0, 8)] = 0.1f;
    auto bad_k = TiledKVCache::copy_from(s, cache.view(0, len, start, total, 1));
    ASSERT_FALSE(bad_k.is_ok());
    EXPECT_NE(bad_k.status().message().find("K scale 0.1"), std::string::npos)
        << bad_k.status().message();
  }
}

// Growing the cache between decodes changes no bit of the result.
TEST(TiledCache, ReserveKeepsResultsBitForBit) {
  for (const TileConfig& tc : kTileConfigs) {
    Problem p(AttnShape{2, 8, 2, 128, 2}, DType::kBF16, {700, 333}, 5);
    TiledKVCache c = tiled_copy(p.shape, p.whole(), tc);
    std::vector<float> a(p.rows() * 130), b(a.size());
    ASSERT_TRUE(decode_partial_tiled(p.shape, p.q.data(), c.view(p.len, p.start, p.total), a.data()).is_ok());
    ASSERT_TRUE(c.reserve(5000).is_ok());
    EXPECT_GE(c.capacity(), 5000);
    ASSERT_TRUE(decode_partial_tiled(p.shape, p.q.data(), c.view(p.len, p.start, p.total), b.data()).is_ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << tile_name(tc);
  }
}

// A cache large enough to be a mapping asks for transparent huge pages: its mapping carries the
// MADV_HUGEPAGE flag ("hg" in /proc/self/smaps' VmFlags). Skipped where the kernel has no THP.
TEST(TiledCache, LargeCachesAskForHugePages) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good())
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  Result<TiledKVCache> c = TiledKVCache::create(AttnShape{1, 8, 8, 128, 1}, DType::kBF16, 4096);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  ASSERT_GE(c->bytes(), std::size_t{16} << 20);
  const auto at = reinterpret_cast<uintptr_t>(c->data());
  std::ifstream smaps("/proc/self/smaps");
  ASSERT_TRUE(smaps.good());
  std::string line, flags;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find('-') < 17) {
      inside = lo <= at && at < hi;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) {
      flags = line;
      break;
    }
  }
  ASSERT_FALSE(flags.empty()) << "no mapping of /proc/self/smaps holds the cache";
  EXPECT_NE((flags + " ").find(" hg "), std::string::npos) << flags;
}

// Slots past a row's length (the rest of the last tile, and later tiles) hold NaN: never read.
TEST(TiledKernel, TailSlotsAreNeverRead) {
  for (DType t : kTypes)
    for (const TileConfig& tc : kTileConfigs)
      for (int64_t n : {1, 5, 15, 16, 17, 31, 33, 63, 64, 65, 100}) {
        AttnShape s{1, 12, 3, 96, 1};
        Problem p(s, t, {n}, static_cast<uint64_t>(n));
        TiledKVCache c = tiled_copy(s, p.whole(), tc, n + 80);
        std::vector<float> nan_row(96, kNaN);
        for (int64_t h = 0; h < 3; ++h)
          for (int64_t j = n; j < c.capacity(); ++j) c.set_token(0, h, j, nan_row.data(), nan_row.data());
        std::vector<double> out(p.rows() * 96), lse(p.rows());
        ASSERT_TRUE(oracle_attention(s, p.q.data(), p.whole(), out.data(), lse.data()).is_ok());
        std::vector<float> st(p.rows() * 98);
        for (Isa isa : testing::runnable_isas()) {
          DecodeOptions opt;
          opt.isa = isa;
          ASSERT_TRUE(decode_partial_tiled(s, p.q.data(), c.view(p.len, p.start, p.total), st.data(), opt).is_ok());
          const Errors e = testing::compare_states(s, st.data(), out.data(), lse.data());
          EXPECT_FALSE(e.nan_mismatch) << isa_name(isa) << " n=" << n << " " << tile_name(tc);
          EXPECT_LE(e.out_rel(), kTol) << isa_name(isa) << " n=" << n << " " << tile_name(tc);
        }
      }
}

// Striped placement (token j at global position r + j*p) with Q = 4 and the causal limit
// falling inside tiles.
TEST(TiledKernel, StripedPositionsWithMultiTokenQuery) {
  AttnShape shape{3, 8, 2, 128, 4};
  for (const TileConfig& tc : kTileConfigs)
    for (int64_t p : {2, 3, 5})
      for (int64_t r = 0; r < p; ++r) {
        const int64_t N = 301;
        std::vector<int64_t> total{N, N - 50, 3};
        std::vector<int64_t> len, start;
        for (int64_t b = 0; b < 3; ++b) {
          const int64_t tb = total[static_cast<std::size_t>(b)];
          len.push_back(tb > r ? (tb - r + p - 1) / p : 0);
          start.push_back(r);
        }
        Problem prob(shape, DType::kBF16, {N, N, N}, static_cast<uint64_t>(p * 10 + r));
        const KVShard kv = prob.cache.view(0, len, start, total, p);
        TiledKVCache c = tiled_copy(shape, kv, tc);
        std::vector<double> out(prob.rows() * 128), lse(prob.rows());
        ASSERT_TRUE(oracle_attention(shape, prob.q.data(), kv, out.data(), lse.data()).is_ok());
        std::vector<float> st(prob.rows() * 130);
        for (Isa isa : testing::runnable_isas())
          for (int64_t chunk : {int64_t{0}, int64_t{16}}) {
            DecodeOptions opt;
            opt.isa = isa;
            opt.chunk_tokens = chunk;
            ASSERT_TRUE(decode_partial_tiled(shape, prob.q.data(), c.view(len, start, total, p), st.data(), opt).is_ok());
            const Errors e = testing::compare_states(shape, st.data(), out.data(), lse.data());
            EXPECT_FALSE(e.nan_mismatch);
            EXPECT_LE(e.out_rel(), kTol) << isa_name(isa) << " p=" << p << " r=" << r << " " << tile_name(tc);
            EXPECT_LE(e.lse_abs, kTol);
          }
      }
}

// A NaN at a position only the last query may see reaches that query's rows only; a visible
// NaN in K or V reaches exactly the heads of its KV head.
TEST(TiledKernel, NaNReachesExactlyTheRowsThatSeeIt) {
  for (const TileConfig& tc : kTileConfigs) {
    AttnShape s{1, 4, 1, 64, 4};
    const int64_t n = 70;
    Problem p(s, DType::kF32, {n}, 3);
    std::vector<float> nan_row(64, kNaN);
    p.cache.set_token(0, 0, n - 1, nan_row.data(), nan_row.data());
    TiledKVCache c = tiled_copy(s, p.whole(), tc);
    std::vector<float> st(p.rows() * 66);
    for (Isa isa : testing::runnable_isas())
      for (int64_t chunk : {int64_t{0}, int64_t{16}}) {
        DecodeOptions opt;
        opt.isa = isa;
        opt.chunk_tokens = chunk;
        ASSERT_TRUE(decode_partial_tiled(s, p.q.data(), c.view(p.len, p.start, p.total), st.data(), opt).is_ok());
        for (std::size_t r = 0; r < p.rows(); ++r) {
          const bool last_query = r / 4 == 3;
          EXPECT_EQ(std::isnan(st[r * 66 + 1]), last_query) << isa_name(isa) << " record " << r;
          EXPECT_EQ(std::isnan(st[r * 66 + 2]), last_query) << isa_name(isa) << " record " << r;
        }
      }
  }
  for (int which = 0; which < 2; ++which) {
    Problem p(AttnShape{1, 4, 2, 64, 1}, DType::kF32, {300}, 77);
    std::vector<float> k(64, 0.1f), v(64, 0.2f);
    (which == 0 ? k : v)[9] = kNaN;
    p.cache.set_token(0, 1, 123, k.data(), v.data());  // KV head 1 serves heads 2 and 3
    for (const TileConfig& tc : kTileConfigs) {
      TiledKVCache c = tiled_copy(p.shape, p.whole(), tc);
      std::vector<float> st(4 * 66), out(64);
      for (Isa isa : testing::runnable_isas()) {
        DecodeOptions opt;
        opt.isa = isa;
        ASSERT_TRUE(decode_partial_tiled(p.shape, p.q.data(), c.view(p.len, p.start, p.total), st.data(), opt).is_ok());
        for (int h = 0; h < 4; ++h) {
          float lse = 0;
          state_normalize(st.data() + h * 66, 64, out.data(), &lse);
          const bool nan = std::isnan(out[9]) || std::isnan(lse);
          EXPECT_EQ(nan, h >= 2) << isa_name(isa) << " head " << h << (which ? " V" : " K");
          if (which == 0 && h >= 2) {
            EXPECT_TRUE(std::isnan(st[static_cast<std::size_t>(h) * 66])) << "m must be NaN";
          }
        }
      }
    }
  }
}

// Rows of a ragged batch with no tokens give the empty state exactly.
TEST(TiledKernel, EmptyRows) {
  AttnShape s{3, 8, 2, 128, 2};
  Problem p(s, DType::kF16, {0, 37, 0}, 5);
  for (const TileConfig& tc : kTileConfigs) {
    TiledKVCache c = tiled_copy(s, p.whole(), tc);
    std::vector<float> st(p.rows() * 130, 123.0f);
    for (Isa isa : testing::runnable_isas()) {
      DecodeOptions opt;
      opt.isa = isa;
      ASSERT_TRUE(decode_partial_tiled(s, p.q.data(), c.view(p.len, p.start, p.total), st.data(), opt).is_ok());
      for (std::size_t r = 0; r < p.rows(); ++r) {
        if (r / 16 == 1) {
          EXPECT_GT(st[r * 130 + 1], 0.0f);
          continue;
        }
        EXPECT_TRUE(state_is_empty(st.data() + r * 130)) << isa_name(isa) << " record " << r;
      }
    }
  }
}

// Raw logits of -524288 (and large positive ones) are ordinary numbers, not sentinels.
TEST(TiledKernel, ExtremeLogits) {
  for (float target : {-524288.0f, 60000.0f}) {
    AttnShape shape{1, 1, 1, 64, 1};
    KVCache cache(shape, DType::kF32, 4);
    std::vector<float> k(64, 0.0f), v(64, 0.0f);
    for (int t = 0; t < 4; ++t) {
      k[0] = target;
      v[0] = static_cast<float>(t);
      cache.set_token(0, 0, t, k.data(), v.data());
    }
    std::vector<float> q(64, 0.0f);
    q[0] = 1.0f;
    std::vector<int64_t> len{4}, start{0}, total{4};
    TiledKVCache c = tiled_copy(shape, cache.view(0, len, start, total, 1), kTileConfigs[0]);
    std::vector<float> st(66), out(64);
    for (Isa isa : testing::runnable_isas()) {
      DecodeOptions opt;
      opt.isa = isa;
      opt.scale = 1.0f;
      ASSERT_TRUE(decode_partial_tiled(shape, q.data(), c.view(len, start, total), st.data(), opt).is_ok());
      float lse = 0;
      state_normalize(st.data(), 64, out.data(), &lse);
      EXPECT_EQ(out[0], 1.5f) << isa_name(isa) << " logit " << target;
      EXPECT_FLOAT_EQ(lse, target + std::log(4.0f)) << isa_name(isa);
    }
  }
}

// q = 0 makes every weight exp(0) = 1 exactly, so with small-integer V and a power-of-two
// length the output is mean(V) bit for bit for every chunking, thread count, target and tiling.
TEST(TiledKernel, ZeroQueryGivesMeanOfValuesBitForBit) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16})
    for (int64_t D : {64, 128, 256}) {
      AttnShape shape{2, 8, 2, D, 1};
      const int64_t N = 1024;
      KVCache cache(shape, t, N);
      std::vector<float> k(static_cast<std::size_t>(D)), v(k.size());
      std::vector<double> sum(static_cast<std::size_t>(2 * 2 * D), 0.0);
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t tok = 0; tok < N; ++tok) {
            for (int64_t d = 0; d < D; ++d) {
              k[static_cast<std::size_t>(d)] = static_cast<float>((tok * 7 + d) % 11) - 5.0f;
              v[static_cast<std::size_t>(d)] = static_cast<float>((tok * 3 + d * 5 + b + h) % 17) - 8.0f;
              sum[static_cast<std::size_t>((b * 2 + h) * D + d)] += v[static_cast<std::size_t>(d)];
            }
            cache.set_token(b, h, tok, k.data(), v.data());
          }
      std::vector<int64_t> len{N, N}, start{0, 0}, total{N, N};
      std::vector<float> q(static_cast<std::size_t>(2 * 8 * D), 0.0f);
      std::vector<float> st(static_cast<std::size_t>(2 * 8 * (D + 2))), out(static_cast<std::size_t>(D));
      for (const TileConfig& tc : kTileConfigs) {
        TiledKVCache c = tiled_copy(shape, cache.view(0, len, start, total, 1), tc);
        for (Isa isa : testing::runnable_isas())
          for (int64_t chunk : {1, 64, 100, 1024, 4096})
            for (int threads : {1, 2}) {
              DecodeOptions opt;
              opt.isa = isa;
              opt.chunk_tokens = chunk;
              opt.threads = threads;
              ASSERT_TRUE(decode_partial_tiled(shape, q.data(), c.view(len, start, total), st.data(), opt).is_ok());
              for (int64_t b = 0; b < 2; ++b)
                for (int64_t h = 0; h < 8; ++h) {
                  float lse = 0;
                  state_normalize(st.data() + static_cast<std::size_t>(b * 8 + h) * static_cast<std::size_t>(D + 2),
                                  static_cast<std::size_t>(D), out.data(), &lse);
                  for (int64_t d = 0; d < D; ++d) {
                    const float mean = static_cast<float>(sum[static_cast<std::size_t>((b * 2 + h / 4) * D + d)] / N);
                    ASSERT_EQ(out[static_cast<std::size_t>(d)], mean)
                        << isa_name(isa) << " chunk " << chunk << " threads " << threads << " "
                        << dtype_name(t) << " " << tile_name(tc);
                  }
                  ASSERT_EQ(lse, std::log(1024.0f));
                }
            }
      }
    }
}

// The quantized form of the test above: int8 and fp8 tokens whose scale is a power of two that
// changes from token to token and head to head (their largest magnitude is quant_max * 2^e,
// the other codes small integers), so every product p * v_scale * code and every partial sum
// is exact: the record is m = 0, l = the row's length and o = the sum of the dequantized V,
// bit for bit on every target, tiling
// and chunking, with row lengths that leave the last tile partly full. A V scale read at
// another token's or head's offset would change the mean.
TEST(TiledKernel, QuantizedZeroQueryGivesTheExactValueSumsBitForBit) {
  for (DType t : {DType::kInt8, DType::kFP8}) {
    const AttnShape shape{2, 6, 3, 64, 1};
    const int64_t D = 64, N = 1024;
    const std::vector<int64_t> len{N, 777}, start{0, 0}, total{N, 777};
    KVCache cache(shape, t, N);
    std::vector<float> k(64), v(64);
    std::vector<double> sum(static_cast<std::size_t>(2 * 3 * D), 0.0);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t tok = 0; tok < len[static_cast<std::size_t>(b)]; ++tok) {
          const float sv = std::ldexp(1.0f, static_cast<int>((tok * 5 + h * 3 + b) % 4) - 2);
          for (std::size_t d = 0; d < 64; ++d) {
            k[d] = static_cast<float>((tok * 7 + static_cast<int64_t>(d)) % 11) - 5.0f;
            v[d] =
                (static_cast<float>((tok * 3 + static_cast<int64_t>(d) * 5 + b + h) % 17) - 8.0f) *
                sv;
          }
          v[static_cast<std::size_t>((tok + h) % D)] = quant_max(t) * sv;  // scale = sv
          for (std::size_t d = 0; d < 64; ++d)
            sum[static_cast<std::size_t>((b * 3 + h) * D) + d] += v[d];
          cache.set_token(b, h, tok, k.data(), v.data());
          ASSERT_EQ(cache.v_scale_data()[cache.scale_index(b, h, tok)], sv);
        }
    std::vector<float> q(static_cast<std::size_t>(2 * 6 * D), 0.0f);
    std::vector<float> st(static_cast<std::size_t>(2 * 6 * (D + 2)));
    for (const TileConfig& tc : kTileConfigs) {
      TiledKVCache c = tiled_copy(shape, cache.view(0, len, start, total, 1), tc);
      for (Isa isa : testing::runnable_isas())
        for (int64_t chunk : {64, 100, 4096}) {
          DecodeOptions opt;
          opt.isa = isa;
          opt.chunk_tokens = chunk;
          opt.threads = 2;
          ASSERT_TRUE(
              decode_partial_tiled(shape, q.data(), c.view(len, start, total), st.data(), opt)
                  .is_ok());
          for (int64_t b = 0; b < 2; ++b)
            for (int64_t hq = 0; hq < 6; ++hq) {
              const float* rec = st.data() + static_cast<std::size_t>((b * 6 + hq) * (D + 2));
              const auto n = static_cast<double>(len[static_cast<std::size_t>(b)]);
              ASSERT_EQ(rec[0], 0.0f);
              ASSERT_EQ(rec[1], static_cast<float>(n));  // l = the token count, o = the sum
              for (std::size_t d = 0; d < 64; ++d)
                ASSERT_EQ(rec[2 + d], static_cast<float>(
                                          sum[static_cast<std::size_t>((b * 3 + hq / 2) * D) + d]))
                    << isa_name(isa) << " chunk " << chunk << " " << dtype_name(t) << " "
                    << tile_name(tc) << " row " << b << " head " << hq << " d " << d;
            }
        }
    }
  }
}

TEST(TiledKernel, SameBitsForAnyThreadCount) {
  for (DType t : kTypes) {
    Problem p(AttnShape{2, 32, 8, 128, 1}, t, {5000, 4097}, 9);
    Problem smol(AttnShape{1, 9, 3, 64, 3}, t, {3333}, 10);
    for (const TileConfig& tc : kTileConfigs)
      for (const Problem* pr : {&p, &smol}) {
        TiledKVCache c = tiled_copy(pr->shape, pr->whole(), tc);
        const TiledKVShard view = c.view(pr->len, pr->start, pr->total);
        std::vector<float> a(pr->rows() * static_cast<std::size_t>(pr->shape.head_dim + 2)), b(a.size());
        for (Isa isa : testing::runnable_isas()) {
          DecodeOptions o1;
          o1.isa = isa;
          o1.threads = 1;
          ASSERT_TRUE(decode_partial_tiled(pr->shape, pr->q.data(), view, a.data(), o1).is_ok());
          for (int threads : {2, 3, 5, 8}) {
            DecodeOptions o2 = o1;
            o2.threads = threads;
            ASSERT_TRUE(decode_partial_tiled(pr->shape, pr->q.data(), view, b.data(), o2).is_ok());
            EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                << isa_name(isa) << " " << dtype_name(t) << " threads " << threads << " "
                << tile_name(tc);
          }
        }
      }
  }
}

TEST(TiledErrors, BadArgumentsAreNamed) {
  const AttnShape s{2, 8, 2, 64, 1};
  for (int64_t bad : {0, 8, 24, 48, 288}) {
    auto bad_tile = TiledKVCache::create(s, DType::kF32, 10, KVTileLayout::kSplit, bad);
    ASSERT_FALSE(bad_tile.is_ok());
    EXPECT_NE(bad_tile.status().message().find("tile_tokens must be 16 or a multiple of 32"),
              std::string::npos)
        << bad_tile.status().message();
  }
  EXPECT_FALSE(TiledKVCache::create(s, DType::kF32, -1).is_ok());
  EXPECT_FALSE(TiledKVCache::create(AttnShape{1, 8, 3, 64, 1}, DType::kF32, 10).is_ok());
  EXPECT_FALSE(parse_kv_tile_layout("diagonal").is_ok());
  EXPECT_EQ(parse_kv_tile_layout("interleaved").value(), KVTileLayout::kInterleaved);

  Result<TiledKVCache> c = TiledKVCache::create(s, DType::kF32, 40);
  ASSERT_TRUE(c.is_ok());
  std::vector<int64_t> len{40, 3}, start{0, 0}, total{40, 3}, one{40};
  std::vector<float> q(2 * 8 * 64), st(2 * 8 * 66);
  // Spans of the wrong size.
  Status e = decode_partial_tiled(s, q.data(), c->view(one, one, one), st.data());
  EXPECT_EQ(e.code(), Code::kInvalidArgument);
  EXPECT_NE(e.message().find("batch is 2"), std::string::npos) << e.message();
  // Positions past the context.
  std::vector<int64_t> short_total{39, 3};
  e = decode_partial_tiled(s, q.data(), c->view(len, start, short_total), st.data());
  EXPECT_NE(e.message().find("batch row 0"), std::string::npos) << e.message();
  // A tile stride smaller than a tile, a null pointer, scales on f32, device memory.
  TiledKVShard v = c->view(len, start, total);
  v.tile_stride = 100;
  e = decode_partial_tiled(s, q.data(), v, st.data());
  EXPECT_NE(e.message().find("smaller than one tile"), std::string::npos) << e.message();
  v = c->view(len, start, total);
  v.v = nullptr;
  EXPECT_FALSE(decode_partial_tiled(s, q.data(), v, st.data()).is_ok());
  v = c->view(len, start, total);
  const std::vector<bf16_t> some_scales(64);
  v.k_scale = some_scales.data();
  e = decode_partial_tiled(s, q.data(), v, st.data());
  EXPECT_NE(e.message().find("scales are only for quantized"), std::string::npos) << e.message();
  v = c->view(len, start, total);
  v.memory = MemorySpace::kDevice;
  EXPECT_EQ(decode_partial_tiled(s, q.data(), v, st.data()).code(), Code::kUnsupported);
  EXPECT_FALSE(decode_partial_tiled(s, nullptr, c->view(len, start, total), st.data()).is_ok());
  // Quantized caches need their scales.
  Result<TiledKVCache> qc = TiledKVCache::create(s, DType::kInt8, 40);
  ASSERT_TRUE(qc.is_ok());
  v = qc->view(len, start, total);
  v.v_scale = nullptr;
  e = decode_partial_tiled(s, q.data(), v, st.data());
  EXPECT_NE(e.message().find("null scale pointer"), std::string::npos) << e.message();
}

}  // namespace
}  // namespace treeattn
