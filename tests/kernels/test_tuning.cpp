// The kernel tuning (include/treeattn/tuning.hpp): the cache file and what the kernels take from
// it, the files it ignores (with the warning), the skip setting, the calibration, and the bits:
// every candidate of every choice gives the same states as the compiled-in defaults, on every
// ISA target this CPU runs, in the tiled, rows and paged drivers (decode and prefill entries).
//
// Every test works in its own scratch cache directory (TREEATTN_CACHE_DIR), never the user's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/cpu/driver_tuning.hpp"
#include "support/test_data.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/paged_kv.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/tuning.hpp"

namespace treeattn {
namespace {

namespace kc = kernels::cpu;

// A scratch cache directory and TREEATTN_TUNE unset for the test's life; the process's tuning
// is read again on entry and on exit.
class ScratchCache {
 public:
  explicit ScratchCache(const std::string& name)
      : dir_(::testing::TempDir() + "tuning_" + name + "_" + std::to_string(::getpid())) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    ::setenv("TREEATTN_CACHE_DIR", dir_.c_str(), 1);
    ::setenv("TREEATTN_TUNE", "auto", 1);
    reload_kernel_tuning();
  }
  ~ScratchCache() {
    std::filesystem::remove_all(dir_);
    ::unsetenv("TREEATTN_CACHE_DIR");
    ::setenv("TREEATTN_TUNE", "0", 1);
    reload_kernel_tuning();
  }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_all(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

// An entry far from every default, so that using it cannot pass for the defaults.
TuneEntry unusual(const TuneKey& key) {
  TuneEntry e;
  e.key = key;
  e.choice = tuning_defaults(key, best_isa());
  e.choice.tiled_prefetch = 20480;
  e.choice.paged_prefetch = 28672;
  e.choice.tiled_l2 = true;
  e.choice.paged_l2 = true;
  e.choice.rows_prefetch = 3072;
  e.choice.chunks_outer = true;
  e.choice.layout = host_kv_layout(best_isa()) == KVLayout::kRows ? KVLayout::kTiled
                                                                   : KVLayout::kRows;
  e.probe_gbps = 12.5;
  e.kernel_gbps = 10.25;
  return e;
}

void expect_driver_uses(const TuneChoice& c, const TuneKey& k, const std::string& what) {
  const kc::DriverChoice d = kc::driver_choice(k.dtype, k.head_dim, k.group, k.threads, best_isa());
  EXPECT_EQ(d.tiled_prefetch, c.tiled_prefetch) << what;
  EXPECT_EQ(d.paged_prefetch, c.paged_prefetch) << what;
  EXPECT_EQ(d.tiled_l2, c.tiled_l2) << what;
  EXPECT_EQ(d.paged_l2, c.paged_l2) << what;
  EXPECT_EQ(d.rows_prefetch, c.rows_prefetch) << what;
  EXPECT_EQ(d.order == kc::ItemOrder::kChunksOuter, c.chunks_outer) << what;
}

// The file round trip: stored entries are what the kernels use (the key's own entry, the nearest
// in group then threads for other calls of the same dtype and head_dim, the defaults for
// others), the session's auto layout is the entry's, and a second store keeps the first key and
// replaces a repeated one.
TEST(Tuning, CacheHitIsWhatTheKernelsUse) {
  ScratchCache scratch("hit");
  EXPECT_EQ(kernel_tuning().source, TuningState::Source::kNone);
  const TuneKey a{DType::kBF16, 128, 4, 1};
  const TuneEntry ea = unusual(a);
  ASSERT_TRUE(store_kernel_tuning({ea}).is_ok());

  const TuningState& s = kernel_tuning();
  EXPECT_EQ(s.source, TuningState::Source::kCache);
  EXPECT_EQ(s.path, tuning_cache_path());
  EXPECT_EQ(s.path.rfind(scratch.dir() + "/kernel-tuning-", 0), 0u) << s.path;
  ASSERT_EQ(s.entries.size(), 1u);
  EXPECT_EQ(s.entries[0].key, a);
  EXPECT_EQ(s.entries[0].choice, ea.choice);
  EXPECT_DOUBLE_EQ(s.entries[0].probe_gbps, 12.5);
  const std::string text = read_all(s.path);
  EXPECT_EQ(text.rfind("treeattn kernel tuning 2\nkey " + tuning_cache_key() + "\n", 0), 0u) << text;

  expect_driver_uses(ea.choice, a, "the key's own entry");
  expect_driver_uses(ea.choice, TuneKey{DType::kBF16, 128, 8, 2}, "nearest: same dtype, head_dim");
  expect_driver_uses(tuning_defaults({DType::kF32, 128, 4, 1}, best_isa()),
                     TuneKey{DType::kF32, 128, 4, 1}, "another dtype: the defaults");
  expect_driver_uses(tuning_defaults({DType::kBF16, 64, 4, 1}, best_isa()),
                     TuneKey{DType::kBF16, 64, 4, 1}, "another head_dim: the defaults");

  DecodeOptions one;
  one.threads = 1;
  const HostKVLayout hl = host_kv_layout(KVLayoutWorkload{AttnShape{1, 32, 8, 128, 1}, DType::kBF16, one});
  EXPECT_EQ(hl.layout, ea.choice.layout);
  EXPECT_EQ(hl.how, "tuned on this CPU for bf16 D128 G4 T1");
  const std::string names[] = {"tree"};
  EXPECT_EQ(*choose_kv_layout(KVLayout::kAuto, MemorySpace::kHost, names,
                              KVLayoutWorkload{AttnShape{1, 32, 8, 128, 1}, DType::kBF16, one}),
            ea.choice.layout);
  const HostKVLayout other =
      host_kv_layout(KVLayoutWorkload{AttnShape{1, 8, 8, 64, 1}, DType::kF16, one});
  EXPECT_EQ(other.layout, host_kv_layout(best_isa()));
  EXPECT_EQ(other.how, "by the CPU's kernel target (no tuned entry for f16 head_dim 64)");

  // A second store: a new key added, the first kept, then the first replaced.
  const TuneKey b{DType::kF32, 64, 3, 2};
  TuneEntry eb = unusual(b);
  eb.choice.chunks_outer = false;
  ASSERT_TRUE(store_kernel_tuning({eb}).is_ok());
  ASSERT_EQ(kernel_tuning().entries.size(), 2u);
  TuneEntry ea2 = ea;
  ea2.choice.tiled_prefetch = 4096;
  ASSERT_TRUE(store_kernel_tuning({ea2}).is_ok());
  const TuningState& s2 = kernel_tuning();
  ASSERT_EQ(s2.entries.size(), 2u);
  EXPECT_EQ(find_tuning(a, best_isa())->choice.tiled_prefetch, 4096);
  EXPECT_EQ(find_tuning(b, best_isa())->choice, eb.choice);
  // Entries apply to the cached target only.
  for (Isa other_isa : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512}) {
    if (other_isa != best_isa()) {
      EXPECT_EQ(find_tuning(a, other_isa), nullptr);
    }
  }
}

// A file is ignored, whole, with one warning naming it and why, when it was written for another
// CPU, ISA or build, or when it does not parse; the kernels then use the compiled-in defaults.
TEST(Tuning, ForeignOrCorruptCacheIsIgnoredWithAWarning) {
  ScratchCache scratch("ignored");
  const TuneKey k{DType::kBF16, 128, 4, 1};
  ASSERT_TRUE(store_kernel_tuning({unusual(k)}).is_ok());
  const std::string path = tuning_cache_path();
  const std::string good = read_all(path);
  const std::string key_line = "key " + tuning_cache_key() + "\n";
  ASSERT_NE(good.find(key_line), std::string::npos);
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? t : t.replace(at, from.size(), to);
  };
  const std::string entry = good.substr(good.find("entry "), good.find("\nend") - good.find("entry ") + 1);
  struct Bad {
    std::string what, text, says;
  };
  const std::vector<Bad> bad = {
      {"another CPU", replaced(key_line, "key Some Other CPU (family 25 model 17 stepping 1)|avx512|" +
                                             tuning_cache_key().substr(tuning_cache_key().rfind('|') + 1) + "\n"),
       "it was tuned for Some Other CPU"},
      {"another ISA", replaced("|" + std::string(isa_name(best_isa())) + "|", "|generic-x|"),
       "it was tuned for "},
      {"another build", replaced(key_line, key_line.substr(0, key_line.size() - 1) + "0\n"),
       "it was tuned for "},
      {"garbage", "\x7f" "ELF\x02\x01\x01 not a tuning file\n", "it is corrupt (no 'treeattn kernel tuning 2' line)"},
      {"empty", "", "it is corrupt"},
      {"truncated", good.substr(0, good.find("\nend") + 1), "does not end with 'end 1'"},
      {"a wrong count", replaced("end 1", "end 2"), "does not end with 'end 1'"},
      {"a bad value", replaced("tiled_prefetch=20480", "tiled_prefetch=fast"),
       "bad value 'fast' for tiled_prefetch"},
      {"a lead out of range", replaced("tiled_prefetch=20480", "tiled_prefetch=99999999"),
       "bad value '99999999' for tiled_prefetch"},
      {"a bad level", replaced("tiled_level=l2", "tiled_level=l3"), "bad value 'l3' for tiled_level"},
      {"an unknown field", replaced("order=chunks", "order=chunks speed=11"), "unknown field 'speed'"},
      {"a missing field", replaced(" order=chunks", ""), "an entry lacks a field"},
      {"two entries of one key", replaced("end 1", entry + "end 2"), "two entries for bf16 D128 G4 T1"},
      {"an unknown dtype", replaced("entry bf16", "entry q4"), "unknown dtype 'q4'"},
      {"text after the end", good + "entry f32\n", "does not end with"},
  };
  const TuneChoice defaults = tuning_defaults(k, best_isa());
  for (const Bad& b : bad) {
    write_all(path, b.text);
    ::testing::internal::CaptureStderr();
    reload_kernel_tuning();
    const TuningState& s = kernel_tuning();
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(s.source, TuningState::Source::kIgnored) << b.what;
    EXPECT_NE(s.detail.find(b.says), std::string::npos) << b.what << ": " << s.detail;
    EXPECT_TRUE(s.entries.empty()) << b.what;
    EXPECT_NE(err.find("treeattn: warning: kernel tuning cache " + path + " ignored: " + s.detail),
              std::string::npos)
        << b.what << ": " << err;
    expect_driver_uses(defaults, k, b.what);
    EXPECT_EQ(find_tuning(k, best_isa()), nullptr) << b.what;
  }
  // A store replaces an ignored file with a good one.
  ASSERT_TRUE(store_kernel_tuning({unusual(k)}).is_ok());
  EXPECT_EQ(kernel_tuning().source, TuningState::Source::kCache);
  EXPECT_EQ(read_all(path), good);
}

// The matrix kernels' lines: stored beside the entries, the nearest thread count's tile used,
// none for another target; a bad or repeated matmul line makes the file corrupt.
TEST(Tuning, MatmulTileIsCachedPerThreadCount) {
  ScratchCache scratch("matmul");
  EXPECT_EQ(tuned_matmul_tile_bytes(1, best_isa()), 0);
  const TuneKey k{DType::kBF16, 128, 4, 1};
  ASSERT_TRUE(store_kernel_tuning({unusual(k)}, {MatmulTuneEntry{1, 1 << 20, 150.5}}).is_ok());
  ASSERT_TRUE(store_kernel_tuning({}, {MatmulTuneEntry{4, 256 << 10, 400.25}}).is_ok());
  const TuningState& s = kernel_tuning();
  EXPECT_EQ(s.source, TuningState::Source::kCache);
  EXPECT_EQ(s.entries.size(), 1u);
  ASSERT_EQ(s.matmul.size(), 2u);
  EXPECT_EQ(tuned_matmul_tile_bytes(1, best_isa()), 1 << 20);
  EXPECT_EQ(tuned_matmul_tile_bytes(2, best_isa()), 1 << 20);
  EXPECT_EQ(tuned_matmul_tile_bytes(8, best_isa()), 256 << 10);
  for (Isa other : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512}) {
    if (other != best_isa()) {
      EXPECT_EQ(tuned_matmul_tile_bytes(1, other), 0);
    }
  }
  const std::string path = tuning_cache_path(), good = read_all(path);
  EXPECT_NE(good.find("\nmatmul 1 tile_bytes=1048576 gops=150.500\nmatmul 4 tile_bytes=262144 "
                      "gops=400.250\nend 3\n"),
            std::string::npos)
      << good;
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"matmul 4 tile_bytes=262144", "matmul 1 tile_bytes=262144"},
           {"tile_bytes=262144", "tile_bytes=12"},
           {"gops=400.250", "gops=fast"},
           {"matmul 4 ", "matmul 0 "},
           {"gops=400.250", "gops=400.250 more"}}) {
    std::string t = good;
    t.replace(t.find(from), from.size(), to);
    write_all(path, t);
    ::testing::internal::CaptureStderr();
    reload_kernel_tuning();
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(kernel_tuning().source, TuningState::Source::kIgnored) << to;
    EXPECT_NE(err.find("it is corrupt"), std::string::npos) << to << ": " << err;
    EXPECT_EQ(tuned_matmul_tile_bytes(1, best_isa()), 0) << to;
  }
  ::setenv("TREEATTN_TUNE", "0", 1);
  write_all(path, good);
  reload_kernel_tuning();
  EXPECT_EQ(tuned_matmul_tile_bytes(1, best_isa()), 0);
}

// TREEATTN_TUNE=0 (or off): the compiled-in defaults, the cache not read (a good one present),
// the session's auto layout by the rule, saying so.
TEST(Tuning, SkipSettingUsesTheCompiledInDefaults) {
  ScratchCache scratch("skip");
  const TuneKey k{DType::kF16, 64, 3, 1};
  ASSERT_TRUE(store_kernel_tuning({unusual(k)}).is_ok());
  expect_driver_uses(unusual(k).choice, k, "cached");
  for (const char* off : {"0", "off"}) {
    ::setenv("TREEATTN_TUNE", off, 1);
    reload_kernel_tuning();
    EXPECT_TRUE(tuning_skipped());
    EXPECT_EQ(kernel_tuning().source, TuningState::Source::kSkipped) << off;
    EXPECT_TRUE(kernel_tuning().entries.empty());
    expect_driver_uses(tuning_defaults(k, best_isa()), k, off);
    DecodeOptions one;
    one.threads = 1;
    const HostKVLayout hl = host_kv_layout(KVLayoutWorkload{AttnShape{1, 9, 3, 64, 1}, DType::kF16, one});
    EXPECT_EQ(hl.layout, host_kv_layout(best_isa()));
    EXPECT_EQ(hl.how, "by the CPU's kernel target (TREEATTN_TUNE=0)");
  }
  ::setenv("TREEATTN_TUNE", "1", 1);
  reload_kernel_tuning();
  EXPECT_FALSE(tuning_skipped());
  expect_driver_uses(unusual(k).choice, k, "on again");
}

// The compiled-in defaults the file is measured against: the tiled lead per dtype and head_dim,
// one paged and one rows lead, heads outer, the layout by the rule.
TEST(Tuning, DefaultsAreTheCompiledInChoices) {
  for (Isa isa : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512})
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kFP8, DType::kInt8})
      for (int64_t hd : {64, 128, 256}) {
        const TuneChoice c = tuning_defaults(TuneKey{d, hd, 4, 1}, isa);
        EXPECT_EQ(c.tiled_prefetch, kc::default_tiled_prefetch_bytes(d, hd));
        EXPECT_EQ(c.paged_prefetch, kc::kTiledPrefetchBytes);
        EXPECT_EQ(c.rows_prefetch, kc::kDefaultPrefetchBytes);
        EXPECT_FALSE(c.chunks_outer);
        EXPECT_EQ(c.layout, host_kv_layout(isa));
      }
  EXPECT_EQ(kc::default_tiled_prefetch_bytes(DType::kBF16, 128), kc::kTiledPrefetchBytes16);
  EXPECT_EQ(kc::default_tiled_prefetch_bytes(DType::kF16, 64), kc::kTiledPrefetchBytes16);
  EXPECT_EQ(kc::default_tiled_prefetch_bytes(DType::kBF16, 256), kc::kTiledPrefetchBytes);
  EXPECT_EQ(kc::default_tiled_prefetch_bytes(DType::kF32, 128), kc::kTiledPrefetchBytes);
}

// ---- the same bits whatever the tuning picks ---------------------------------------------

// One case's inputs in the three layouts: two rows of ragged lengths (not whole tiles) in rows
// and tiles, and one row's pages shuffled in a pool with a decode entry and a prefill entry
// (>= kPagedBlockMinQueries queries: the block kernel).
struct BitsCase {
  AttnShape shape;
  DType dtype;
  testing::Problem rows;
  TiledKVCache tiled;
  TiledKVCache pool;
  int64_t pool_pages = 0;
  std::vector<int32_t> pages;
  std::vector<int64_t> page_pos;
  std::vector<int32_t> page_len;
  std::vector<float> prefill_q;

  BitsCase(const AttnShape& s, DType t, uint64_t seed)
      : shape(s), dtype(t), rows(s, t, {1000, 777}, seed) {
    auto tc = TiledKVCache::copy_from(shape, rows.whole());
    EXPECT_TRUE(tc.is_ok()) << tc.status().to_string();
    tiled = std::move(tc).value();
    // The pool: row 0's tokens in pages, the pages in a shuffled order.
    const int64_t T = kKVTileTokens, n = rows.len[0];
    pool_pages = (n + T - 1) / T;
    AttnShape one = shape;
    one.batch = 1;
    auto p = TiledKVCache::create(one, dtype, pool_pages * T);
    EXPECT_TRUE(p.is_ok());
    pool = std::move(p).value();
    std::vector<int32_t> perm(static_cast<std::size_t>(pool_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<uint8_t> k(static_cast<std::size_t>(shape.head_dim) * dtype_size(dtype)), v(k.size());
    for (int64_t j = 0; j < pool_pages; ++j) {
      pages.push_back(perm[static_cast<std::size_t>(j)]);
      page_pos.push_back(j * T);
      page_len.push_back(static_cast<int32_t>(std::min(T, n - j * T)));
      for (int64_t slot = 0; slot < page_len.back(); ++slot)
        for (int64_t h = 0; h < shape.kv_heads; ++h) {
          bf16_t ks{}, vs{};
          tiled.read_token_raw(0, h, j * T + slot, k.data(), v.data(), &ks, &vs);
          pool.set_token_raw(0, h, pages.back() * T + slot, k.data(), v.data(), ks, vs);
        }
    }
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    prefill_q.resize(static_cast<std::size_t>(11 * shape.heads * shape.head_dim));
    for (float& x : prefill_q) x = u(rng);
  }

  // Every output of every driver under the current choice, concatenated.
  std::vector<float> run(Isa isa, int threads) const {
    DecodeOptions o;
    o.isa = isa;
    o.threads = threads;
    const std::size_t rec = static_cast<std::size_t>(shape.head_dim + 2);
    std::vector<float> out, st(rows.rows() * rec);
    auto append = [&](const Status& s, const std::vector<float>& v, const char* what) {
      EXPECT_TRUE(s.is_ok()) << what << ": " << s.to_string();
      out.insert(out.end(), v.begin(), v.end());
    };
    append(decode_partial(shape, rows.q.data(), rows.whole(), st.data(), o), st, "rows");
    append(decode_partial_tiled(shape, rows.q.data(),
                                tiled.view(rows.len, rows.start, rows.total, 1), st.data(), o),
           st, "tiled");
    AttnShape one = shape;
    one.batch = 1;
    one.q_len = 1;
    std::vector<float> dec(static_cast<std::size_t>(shape.heads) * rec);
    std::vector<float> pre(11 * static_cast<std::size_t>(shape.heads) * rec);
    PagedEntry e[2];
    e[0].q = rows.q.data();
    e[0].n_q = 1;
    e[0].first_pos = rows.len[0] - 1;
    e[1].q = prefill_q.data();
    e[1].n_q = 11;
    e[1].first_pos = rows.len[0] - 11;
    for (PagedEntry& x : e) {
      x.pages = pages;
      x.page_pos = page_pos;
      x.page_len = page_len;
    }
    e[0].states = dec.data();
    e[1].states = pre.data();
    const std::vector<int64_t> none;
    append(decode_partial_paged(one, pool.view(none, none, none, 1), pool_pages, e, o), dec,
           "paged decode");
    out.insert(out.end(), pre.begin(), pre.end());
    return out;
  }
};

TEST(Tuning, EveryCandidateGivesTheSameBits) {
  int compared = 0;
  for (Isa isa : testing::runnable_isas()) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kFP8, DType::kInt8}) {
      for (const AttnShape& s : {AttnShape{2, 6, 2, 64, 2}, AttnShape{2, 12, 3, 128, 1}}) {
        const BitsCase c(s, dt, 7 + static_cast<uint64_t>(dt));
        const TuneKey key{dt, s.head_dim, s.group(), 1};
        const TuneChoice defaults = tuning_defaults(key, best_isa());
        kc::force_driver_choice(&defaults);
        const std::vector<float> want = c.run(isa, 1);
        for (const TuneChoice& cand : tuning_candidates(key, best_isa()))
          for (int threads : {1, 3}) {
            kc::force_driver_choice(&cand);
            const std::vector<float> got = c.run(isa, threads);
            ASSERT_EQ(got.size(), want.size());
            EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
                << isa_name(isa) << " " << dtype_name(dt) << " " << s.to_string()
                << " tiled " << cand.tiled_prefetch << (cand.tiled_l2 ? ":l2" : "") << " paged "
                << cand.paged_prefetch << (cand.paged_l2 ? ":l2" : "")
                << " rows " << cand.rows_prefetch << " chunks outer " << cand.chunks_outer
                << " threads " << threads;
            ++compared;
          }
        kc::force_driver_choice(nullptr);
      }
    }
  }
  EXPECT_GT(compared, 0);
}

// The candidate sets: each differs from the defaults in one choice (a lead with its level is
// one), the defaults' own values are among them, and the leads cover shorter and longer ones,
// into L1 and into L2.
TEST(Tuning, CandidatesChangeOneChoiceEach) {
  for (const TuneKey& key : {TuneKey{DType::kBF16, 128, 4, 1}, TuneKey{DType::kF32, 128, 4, 2}}) {
    const TuneChoice d = tuning_defaults(key, best_isa());
    EXPECT_FALSE(d.tiled_l2);
    EXPECT_FALSE(d.paged_l2);
    const std::vector<TuneChoice> cands = tuning_candidates(key, best_isa());
    int tiled = 0, paged = 0, rows = 0, order = 0, tiled_l2 = 0, paged_l2 = 0;
    for (const TuneChoice& c : cands) {
      const bool t = c.tiled_prefetch != d.tiled_prefetch || c.tiled_l2 != d.tiled_l2;
      const bool p = c.paged_prefetch != d.paged_prefetch || c.paged_l2 != d.paged_l2;
      const int changed = t + p + (c.rows_prefetch != d.rows_prefetch) + (c.chunks_outer != d.chunks_outer);
      EXPECT_LE(changed, 1);
      EXPECT_EQ(c.layout, d.layout);
      tiled += t;
      paged += p;
      tiled_l2 += c.tiled_l2;
      paged_l2 += c.paged_l2;
      rows += c.rows_prefetch != d.rows_prefetch;
      order += c.chunks_outer != d.chunks_outer;
    }
    EXPECT_GE(tiled, 8);
    EXPECT_GE(tiled_l2, 4);
    EXPECT_GE(paged, 5);
    EXPECT_GE(paged_l2, 2);
    EXPECT_GE(rows, 3);
    EXPECT_EQ(order, 1);
    EXPECT_NE(std::find(cands.begin(), cands.end(), d), cands.end());
  }
}

// A short calibration: one chosen value per choice, among the candidates, rates measured, the
// layout chosen; stored, it is what the kernels use. Bad options are refused by name.
TEST(Tuning, CalibrationPicksAmongItsCandidates) {
  ScratchCache scratch("calibrate");
  TuneOptions o;
  o.keys = {TuneKey{DType::kBF16, 64, 3, 1}, TuneKey{DType::kInt8, 128, 4, 2}};
  o.bytes = int64_t{4} << 20;
  o.seconds = 0.01;
  o.min_rounds = 2;
  auto r = calibrate_kernels(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 2u);
  for (std::size_t i = 0; i < r->size(); ++i) {
    const TuneResult& res = (*r)[i];
    EXPECT_EQ(res.entry.key, o.keys[i]);
    EXPECT_GE(res.rounds, 2);
    EXPECT_GT(res.entry.probe_gbps, 0);
    EXPECT_GT(res.entry.kernel_gbps, 0);
    EXPECT_GT(res.bytes, 0);
    for (const char* knob : {"tiled_prefetch", "paged_prefetch", "rows_prefetch", "item_order", "layout"}) {
      int chosen = 0, defaults = 0;
      for (const TuneCandidate& c : res.candidates) {
        if (c.knob != knob) continue;
        chosen += c.chosen;
        defaults += c.is_default;
        EXPECT_GT(c.gbps, 0) << knob << " " << c.value;
        if (c.chosen && std::string(knob) == "tiled_prefetch") {
          EXPECT_EQ(c.value, std::to_string(res.entry.choice.tiled_prefetch) +
                                 (res.entry.choice.tiled_l2 ? ":l2" : ""));
        }
        if (c.chosen && std::string(knob) == "paged_prefetch") {
          EXPECT_EQ(c.value, std::to_string(res.entry.choice.paged_prefetch) +
                                 (res.entry.choice.paged_l2 ? ":l2" : ""));
        }
        if (c.chosen && std::string(knob) == "layout") {
          EXPECT_EQ(c.value, std::string(kv_layout_name(res.entry.choice.layout)));
        }
      }
      EXPECT_EQ(chosen, 1) << knob;
      EXPECT_EQ(defaults, 1) << knob;
    }
    const std::vector<TuneChoice> cands = tuning_candidates(res.entry.key, best_isa());
    auto among = [&](int64_t TuneChoice::*f) {
      return std::any_of(cands.begin(), cands.end(),
                         [&](const TuneChoice& c) { return c.*f == res.entry.choice.*f; });
    };
    EXPECT_TRUE(among(&TuneChoice::tiled_prefetch));
    EXPECT_TRUE(among(&TuneChoice::paged_prefetch));
    EXPECT_TRUE(among(&TuneChoice::rows_prefetch));
  }
  std::vector<TuneEntry> entries;
  for (const TuneResult& res : *r) entries.push_back(res.entry);
  ASSERT_TRUE(store_kernel_tuning(entries).is_ok());
  for (const TuneEntry& e : entries) expect_driver_uses(e.choice, e.key, e.key.to_string());

  TuneOptions bad = o;
  bad.keys.clear();
  EXPECT_EQ(calibrate_kernels(bad).status().code(), Code::kInvalidArgument);
  bad = o;
  bad.keys = {TuneKey{DType::kF32, 64, 4, 0}};
  EXPECT_NE(calibrate_kernels(bad).status().message().find("threads"), std::string::npos);
  bad.keys = {TuneKey{DType::kF32, 59, 4, 1}};
  EXPECT_FALSE(calibrate_kernels(bad).is_ok());
  bad = o;
  bad.min_rounds = 0;
  EXPECT_EQ(calibrate_kernels(bad).status().code(), Code::kInvalidArgument);
}

// The environment's and the benchmarks' lead override the cache (and 0, no prefetch, is a
// lead); a calibration's forced choice overrides both.
TEST(Tuning, OverridesComeBeforeTheCacheAndTheForcedChoiceBeforeAll) {
  ScratchCache scratch("overrides");
  const TuneKey k{DType::kBF16, 128, 4, 1};
  const TuneEntry e = unusual(k);
  ASSERT_TRUE(store_kernel_tuning({e}).is_ok());
  const kc::TiledTuning saved = kc::tiled_tuning();
  for (int64_t lead : {int64_t{0}, int64_t{4096}}) {
    kc::TiledTuning t = saved;
    t.prefetch_bytes = lead;
    kc::set_tiled_tuning(t);
    const kc::DriverChoice d = kc::driver_choice(k.dtype, k.head_dim, k.group, k.threads, best_isa());
    EXPECT_EQ(d.tiled_prefetch, lead);
    EXPECT_EQ(d.paged_prefetch, lead);
    EXPECT_EQ(d.rows_prefetch, e.choice.rows_prefetch);
    TuneChoice forced = tuning_defaults(k, best_isa());
    kc::force_driver_choice(&forced);
    expect_driver_uses(forced, k, "forced");
    kc::force_driver_choice(nullptr);
  }
  for (int level : {1, 2}) {  // the level override, over the cache's l2 (unusual())
    kc::TiledTuning t = saved;
    t.prefetch_level = level;
    kc::set_tiled_tuning(t);
    const kc::DriverChoice d = kc::driver_choice(k.dtype, k.head_dim, k.group, k.threads, best_isa());
    EXPECT_EQ(d.tiled_l2, level == 2);
    EXPECT_EQ(d.paged_l2, level == 2);
    EXPECT_EQ(d.tiled_prefetch, e.choice.tiled_prefetch);
  }
  kc::set_tiled_tuning(saved);
  expect_driver_uses(e.choice, k, "back to the cache");
}

}  // namespace
}  // namespace treeattn
