// decode_partial_paged() (include/treeattn/paged_kv.hpp) on every kernel target this CPU can run.
//
// Against the float64 oracle (oracle_attention over each query's visible tokens, gathered in
// position order into a caller-layout cache): pages shuffled in the pool (out of order, unused
// pages between them holding NaN), partly filled last pages (tail slots NaN), entries with no
// pages, multi-query entries whose causal limits fall inside pages, pages past every query's
// limit, gaps between a sequence's pages (pages held by other ranks), several entries in one
// call, GQA groups 1/3/4, head dims 64 and 128, every dtype, four tile configurations.
// Bitwise: a query alone (n_q = 1) == the same query as row i of a 37-query entry == inside a
// 5-query entry at another offset == with other entries in the call, for 1, 2 and 3 threads.
// Within tolerance of decode_partial_tiled() on the same pages placed contiguously. Quantized
// pages: scales spanning 2^-6 .. 2^6 per token and head against the oracle (and a view one
// scale off checked to fail), and exact value sums with q = 0, the same bits on every target.
// Bad input gives kInvalidArgument naming the entry and the page.
//
// Tolerance: tests/support/test_data.hpp (1e-5 relative to max(1, max|ref|), output and LSE).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/test_data.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/paged_kv.hpp"

namespace treeattn {
namespace {

using testing::Errors;

constexpr double kTol = 1e-5;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One sequence entry: its queries and its pages (positions ascending, lengths 1..T).
struct EntrySpec {
  int64_t n_q = 1;
  int64_t first_pos = 0;
  std::vector<int64_t> page_pos;
  std::vector<int32_t> page_len;
};

// Contiguous pages of T tokens from position `from` holding `tokens` tokens (last one partial).
EntrySpec contiguous(int64_t T, int64_t from, int64_t tokens, int64_t n_q, int64_t first_pos) {
  EntrySpec e;
  e.n_q = n_q;
  e.first_pos = first_pos;
  for (int64_t t = 0; t < tokens; t += T) {
    e.page_pos.push_back(from + t);
    e.page_len.push_back(static_cast<int32_t>(std::min(T, tokens - t)));
  }
  return e;
}

// A page pool holding the pages of some entries, their queries, and per entry the same tokens
// in position order in a caller-layout cache for the oracle.
struct PagedCase {
  AttnShape shape;  // batch 1, q_len 1
  DType dtype = DType::kF32;
  int64_t T = kKVTileTokens;
  int64_t pool_pages = 0;
  TiledKVCache pool;
  std::vector<EntrySpec> specs;
  std::vector<std::vector<int32_t>> pages;  // pool page of each page of each entry
  std::vector<std::vector<float>> q;        // [n_q][heads][head_dim] per entry
  std::vector<KVCache> gathered;            // the entry's tokens in position order
  std::vector<std::vector<int64_t>> pos;    // position of each gathered token
  int64_t window = 0;                       // PagedEntry::window of every entry

  // fill(e, i, h, k, v), when given, writes the head_dim floats of K and V of token i (in
  // position order) of entry e, KV head h, instead of uniform values in [-1, 1).
  using Fill = std::function<void(std::size_t, int64_t, int64_t, float*, float*)>;

  PagedCase(const AttnShape& s, DType t, int64_t tile, KVTileLayout layout,
            std::vector<EntrySpec> entries, uint64_t seed, bool shuffle = true,
            const Fill& fill = {})
      : shape(s), dtype(t), T(tile), specs(std::move(entries)) {
    shape.batch = 1;
    shape.q_len = 1;
    int64_t used = 0;
    for (const EntrySpec& e : specs) used += static_cast<int64_t>(e.page_pos.size());
    pool_pages = used + (shuffle ? 3 : 0);
    Result<TiledKVCache> r = TiledKVCache::create(shape, dtype, pool_pages * T, layout, T);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    pool = std::move(r).value();
    std::vector<int32_t> perm(static_cast<std::size_t>(pool_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(seed);
    if (shuffle) std::shuffle(perm.begin(), perm.end(), rng);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const auto D = static_cast<std::size_t>(shape.head_dim);
    std::vector<float> k(D), v(D), nan(D, kNaN);
    const bool quant = dtype_is_quantized(dtype);
    // Every slot that holds no token of a page (unused pages, partial pages' tails): NaN,
    // which must never reach a result (quantized dtypes cannot encode it: zeros there).
    if (!quant)
      for (int64_t h = 0; h < shape.kv_heads; ++h)
        for (int64_t slot = 0; slot < pool.capacity(); ++slot)
          pool.set_token(0, h, slot, nan.data(), nan.data());
    std::size_t next = 0;
    for (const EntrySpec& e : specs) {
      int64_t n = 0;
      for (int32_t l : e.page_len) n += l;
      KVCache g(shape, dtype, std::max<int64_t>(n, 1));
      std::vector<int32_t> pg;
      std::vector<int64_t> ps;
      int64_t idx = 0;
      for (std::size_t j = 0; j < e.page_pos.size(); ++j) {
        const int32_t page = perm[next++];
        pg.push_back(page);
        for (int32_t slot = 0; slot < e.page_len[j]; ++slot, ++idx) {
          for (int64_t h = 0; h < shape.kv_heads; ++h) {
            for (auto& x : k) x = u(rng);
            for (auto& x : v) x = u(rng);
            if (fill) fill(pages.size(), idx, h, k.data(), v.data());
            pool.set_token(0, h, page * T + slot, k.data(), v.data());
            g.set_token(0, h, idx, k.data(), v.data());
          }
          ps.push_back(e.page_pos[j] + slot);
        }
      }
      std::vector<float> qe(static_cast<std::size_t>(e.n_q * shape.heads) * D);
      for (auto& x : qe) x = u(rng);
      pages.push_back(std::move(pg));
      gathered.push_back(std::move(g));
      pos.push_back(std::move(ps));
      q.push_back(std::move(qe));
    }
  }

  std::size_t rec() const { return static_cast<std::size_t>(shape.head_dim + 2); }
  std::size_t state_floats(std::size_t e) const {
    return static_cast<std::size_t>(specs[e].n_q * shape.heads) * rec();
  }
  TiledKVShard view() const { return pool.view({}, {}, {}); }

  // The call's entries writing into `states` (resized; filled with garbage first).
  std::vector<PagedEntry> entries(std::vector<std::vector<float>>& states) const {
    states.resize(specs.size());
    std::vector<PagedEntry> out;
    for (std::size_t e = 0; e < specs.size(); ++e) {
      states[e].assign(state_floats(e), 12345.0f);
      out.push_back(entry(e, states[e].data()));
    }
    return out;
  }
  PagedEntry entry(std::size_t e, float* states) const {
    PagedEntry en;
    en.q = q[e].data();
    en.n_q = specs[e].n_q;
    en.first_pos = specs[e].first_pos;
    en.pages = pages[e];
    en.page_pos = specs[e].page_pos;
    en.page_len = specs[e].page_len;
    en.window = window;
    en.states = states;
    return en;
  }

  Status run(std::vector<std::vector<float>>& states, const DecodeOptions& opt) const {
    std::vector<PagedEntry> en = entries(states);
    return decode_partial_paged(shape, view(), pool_pages, en, opt);
  }

  // The largest errors of every query row of every entry against the float64 oracle.
  Errors vs_oracle(const std::vector<std::vector<float>>& states) const {
    Errors worst;
    const auto D = static_cast<std::size_t>(shape.head_dim);
    const auto H = static_cast<std::size_t>(shape.heads);
    std::vector<double> out(H * D), lse(H);
    for (std::size_t e = 0; e < specs.size(); ++e)
      for (int64_t i = 0; i < specs[e].n_q; ++i) {
        const int64_t limit = specs[e].first_pos + i;
        const int64_t c = std::upper_bound(pos[e].begin(), pos[e].end(), limit) - pos[e].begin();
        // A sliding window: the tokens at positions > limit - window only.
        const int64_t lo =
            window > 0
                ? std::min<int64_t>(c, std::lower_bound(pos[e].begin(), pos[e].end(),
                                                        limit - window + 1) - pos[e].begin())
                : 0;
        const std::vector<int64_t> len{c - lo}, start{lo}, total{c};
        const KVShard kv = gathered[e].view(lo, len, start, total, 1);
        const float* qi = q[e].data() + static_cast<std::size_t>(i) * H * D;
        const Status s = oracle_attention(shape, qi, kv, out.data(), lse.data());
        EXPECT_TRUE(s.is_ok()) << s.to_string();
        const Errors er = testing::compare_states(
            shape, states[e].data() + static_cast<std::size_t>(i) * H * rec(), out.data(),
            lse.data());
        worst.nan_mismatch = worst.nan_mismatch || er.nan_mismatch;
        worst.out_abs = std::max(worst.out_abs, er.out_rel());
        worst.lse_abs = std::max(worst.lse_abs, er.lse_abs);
      }
    worst.ref_max = 1.0;  // out_abs holds relative errors already
    return worst;
  }
};

// A call with every kind of entry: a decode step over shuffled pages with a partial last page;
// no pages; a 37-query prefill chunk whose limits fall inside pages and cross query blocks;
// pages with gaps between them (other ranks' pages), limits inside a gap; pages past every
// query's limit; a single partial page.
std::vector<EntrySpec> mixed_entries(int64_t T) {
  std::vector<EntrySpec> v;
  v.push_back(contiguous(T, 0, 9 * T + 37 % T + 1, 1, 9 * T + 37 % T));  // decode step
  EntrySpec none;
  none.n_q = 2;
  none.first_pos = 500;
  v.push_back(none);
  v.push_back(contiguous(T, 0, 10 * T - 5, 37, 3 * T + T / 2 - 20));  // prefill chunk
  EntrySpec gaps;
  gaps.n_q = 3;
  for (int64_t j = 0; j < 7; ++j) {
    gaps.page_pos.push_back(j * 3 * T + (j % 2) * 5);
    gaps.page_len.push_back(static_cast<int32_t>(j == 6 ? T / 2 : T - (j % 2) * 5));
  }
  gaps.first_pos = 4 * 3 * T + T + 2;  // inside the gap after page 4
  v.push_back(gaps);
  v.push_back(contiguous(T, 100, 3 * T, 5, 40));       // every page past every limit
  v.push_back(contiguous(T, 7, T - 3, 2, 7 + T - 5));  // one partial page, limit inside it
  return v;
}

struct SweepCase {
  int64_t heads, kv_heads, head_dim;
  DType dtype;
  int64_t T;
  KVTileLayout layout;
  std::string name;
};

std::vector<SweepCase> sweep_cases() {
  struct Heads {
    int64_t h, kv;
  };
  constexpr Heads kHeads[] = {{4, 4}, {9, 3}, {8, 2}};  // groups 1, 3, 4
  struct Tile {
    int64_t T;
    KVTileLayout layout;
  };
  constexpr Tile kTiles[] = {{64, KVTileLayout::kInterleaved},
                             {16, KVTileLayout::kSplit},
                             {32, KVTileLayout::kInterleaved},
                             {128, KVTileLayout::kSplit}};
  std::vector<SweepCase> v;
  int k = 0;
  for (const Heads& hc : kHeads)
    for (int64_t D : {64, 128})
      for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8}) {
        const Tile tile = kTiles[k++ % 4];
        v.push_back({hc.h, hc.kv, D, t, tile.T, tile.layout,
                     "H" + std::to_string(hc.h) + "_Hkv" + std::to_string(hc.kv) + "_D" +
                         std::to_string(D) + "_" + std::string(dtype_name(t)) + "_T" +
                         std::to_string(tile.T) + "_" +
                         std::string(kv_tile_layout_name(tile.layout))});
      }
  return v;
}

void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.name; }

class PagedSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(PagedSweep, EveryTargetMatchesOracle) {
  const SweepCase& c = GetParam();
  const PagedCase pc(AttnShape{1, c.heads, c.kv_heads, c.head_dim, 1}, c.dtype, c.T, c.layout,
                     mixed_entries(c.T), 99 + static_cast<uint64_t>(c.head_dim));
  std::vector<std::vector<float>> st;
  for (Isa isa : testing::runnable_isas()) {
    DecodeOptions opt;
    opt.isa = isa;
    opt.threads = 1;  // thread counts: RowBitsIndependentOfBatchingAndThreads
    const Status s = pc.run(st, opt);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    const Errors e = pc.vs_oracle(st);
    EXPECT_FALSE(e.nan_mismatch) << isa_name(isa);
    EXPECT_LE(e.out_abs, kTol) << isa_name(isa);
    EXPECT_LE(e.lse_abs, kTol) << isa_name(isa);
    // The entries without a visible token give exactly the empty state.
    for (std::size_t e2 : {std::size_t{1}, std::size_t{4}})
      for (std::size_t r = 0; r < st[e2].size(); r += pc.rec()) {
        EXPECT_TRUE(state_is_empty(st[e2].data() + r)) << isa_name(isa) << " entry " << e2;
        for (std::size_t d = 0; d < pc.rec(); ++d)
          EXPECT_EQ(st[e2][r + d], d == 0 ? -std::numeric_limits<float>::infinity() : 0.0f);
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Paged, PagedSweep, ::testing::ValuesIn(sweep_cases()),
                         [](const ::testing::TestParamInfo<SweepCase>& i) { return i.param.name; });

// Sliding windows (gemma3's local layers): each query sees the positions > its own - window only;
// window edges before, inside and after pages, on every target, against the oracle over exactly
// those tokens. The slots before a window's edge inside a page hold finite values that must
// weigh 0; every slot outside the entries' tokens is NaN (a read of one would show).
TEST(PagedKernel, SlidingWindowsMatchTheOracleOnEveryTarget) {
  for (const DType t : {DType::kF32, DType::kBF16}) {
    const int64_t T = kKVTileTokens;
    PagedCase pc(AttnShape{1, 8, 2, 64, 1}, t, T, KVTileLayout::kInterleaved, mixed_entries(T), 7);
    for (const int64_t w : {int64_t{1}, int64_t{5}, T - 3, T + 7, 3 * T, 100 * T}) {
      pc.window = w;
      std::vector<std::vector<float>> st;
      for (Isa isa : testing::runnable_isas()) {
        DecodeOptions opt;
        opt.isa = isa;
        opt.threads = 2;
        const Status s = pc.run(st, opt);
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        const Errors e = pc.vs_oracle(st);
        EXPECT_FALSE(e.nan_mismatch) << isa_name(isa) << " window " << w;
        EXPECT_LE(e.out_abs, kTol) << isa_name(isa) << " window " << w << " " << dtype_name(t);
        EXPECT_LE(e.lse_abs, kTol) << isa_name(isa) << " window " << w << " " << dtype_name(t);
      }
    }
  }
  PagedCase bad(AttnShape{1, 8, 2, 64, 1}, DType::kF32, kKVTileTokens, KVTileLayout::kInterleaved,
                mixed_entries(kKVTileTokens), 7);
  bad.window = -1;
  std::vector<std::vector<float>> st;
  const Status s = bad.run(st, DecodeOptions{});
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("window"), std::string::npos) << s.to_string();
}

bool same_bits(const float* a, const float* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

// A sliding-window layer's engine drops the pages no later query can see and names the index of
// the first page it keeps (page_index0): the merge groups stay those of the full list, so every
// row keeps the bits of the full list, decode steps and prefill chunks (per-page and block
// kernels), any dropped count, on every target. With page_index0 left at 0 the groups shift and
// the bits differ (the check is sensitive to the grouping).
TEST(PagedKernel, DroppedPagesOutsideTheWindowChangeNoBit) {
  const int64_t T = 16, W = 40;
  for (const DType t : {DType::kF32, DType::kBF16, DType::kInt8}) {
    for (const int64_t n_q : {int64_t{1}, int64_t{5}, int64_t{70}}) {
      // 23 pages (a partial last one), queries at the end: the first query at first_pos sees
      // positions > first_pos - W, so the pages ending at or before first_pos - W are unseen.
      const int64_t tokens = 22 * T + 9;
      const int64_t first_pos = tokens - n_q;
      PagedCase pc(AttnShape{1, 6, 2, 64, 1}, t, T, KVTileLayout::kInterleaved,
                   {contiguous(T, 0, tokens, n_q, first_pos)}, 11);
      pc.window = W;
      const auto& spec = pc.specs[0];
      int64_t dead = 0;
      while ((dead + 1) * T - 1 <= first_pos - W) ++dead;
      ASSERT_GE(dead, 5) << "the case must drop more than one group";
      for (Isa isa : testing::runnable_isas()) {
        DecodeOptions opt;
        opt.isa = isa;
        opt.threads = 2;
        std::vector<std::vector<float>> full;
        ASSERT_TRUE(pc.run(full, opt).is_ok());
        for (int64_t drop = 1; drop <= dead; ++drop) {
          std::vector<float> st(pc.state_floats(0), 12345.0f);
          PagedEntry en = pc.entry(0, st.data());
          const auto d = static_cast<std::size_t>(drop);
          en.pages = std::span<const int32_t>(pc.pages[0]).subspan(d);
          en.page_pos = std::span<const int64_t>(spec.page_pos).subspan(d);
          en.page_len = std::span<const int32_t>(spec.page_len).subspan(d);
          en.page_index0 = drop;
          ASSERT_TRUE(decode_partial_paged(pc.shape, pc.view(), pc.pool_pages, {&en, 1}, opt)
                          .is_ok());
          EXPECT_TRUE(same_bits(st.data(), full[0].data(), st.size()))
              << isa_name(isa) << " " << dtype_name(t) << " n_q " << n_q << " drop " << drop;
          if (drop % kPagedGroupPages != 0 && n_q == 70) {
            en.page_index0 = 0;  // the groups shift: rows whose window spans a group edge change
            ASSERT_TRUE(decode_partial_paged(pc.shape, pc.view(), pc.pool_pages, {&en, 1}, opt)
                            .is_ok());
            EXPECT_FALSE(same_bits(st.data(), full[0].data(), st.size()))
                << isa_name(isa) << " " << dtype_name(t) << " drop " << drop;
          }
        }
      }
    }
  }
  PagedCase bad(AttnShape{1, 8, 2, 64, 1}, DType::kF32, kKVTileTokens, KVTileLayout::kInterleaved,
                mixed_entries(kKVTileTokens), 7);
  std::vector<float> st(bad.state_floats(0));
  PagedEntry en = bad.entry(0, st.data());
  en.page_index0 = -1;
  const Status s = decode_partial_paged(bad.shape, bad.view(), bad.pool_pages, {&en, 1}, {});
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("page_index0"), std::string::npos) << s.to_string();
}

// The property a batch-invariant server needs: one query row's bits depend on its query, its
// causal limit and its pages only.
TEST(PagedKernel, RowBitsIndependentOfBatchingAndThreads) {
  for (DType t : {DType::kBF16, DType::kF32}) {
    const PagedCase pc(AttnShape{1, 9, 3, 64, 1}, t, 64, KVTileLayout::kInterleaved,
                       mixed_entries(64), 7);
    const std::size_t chunk = 2;  // the 37-query entry
    const int64_t H = pc.shape.heads, D = pc.shape.head_dim;
    const std::size_t rec = pc.rec(), row = static_cast<std::size_t>(H) * rec;
    for (Isa isa : testing::runnable_isas()) {
      DecodeOptions opt;
      opt.isa = isa;
      opt.threads = 1;
      std::vector<std::vector<float>> full;
      ASSERT_TRUE(pc.run(full, opt).is_ok());
      for (int threads : {2, 3}) {
        opt.threads = threads;
        std::vector<std::vector<float>> other;
        ASSERT_TRUE(pc.run(other, opt).is_ok());
        for (std::size_t e = 0; e < full.size(); ++e)
          EXPECT_TRUE(same_bits(full[e].data(), other[e].data(), full[e].size()))
              << isa_name(isa) << " threads " << threads << " entry " << e;
      }
      const EntrySpec& sp = pc.specs[chunk];
      for (int64_t i = 0; i < sp.n_q; ++i) {
        const float* want = full[chunk].data() + static_cast<std::size_t>(i) * row;
        // Alone: n_q = 1 at the same causal limit; 2 threads for some queries too (few
        // multi-thread calls keep the test quick on a loaded machine).
        const int max_threads = i % 8 == 0 ? 2 : 1;
        std::vector<float> alone(row, 7.0f);
        PagedEntry en = pc.entry(chunk, alone.data());
        en.q = pc.q[chunk].data() + i * H * D;
        en.n_q = 1;
        en.first_pos = sp.first_pos + i;
        for (int threads = 1; threads <= max_threads; ++threads) {
          opt.threads = threads;
          ASSERT_TRUE(
              decode_partial_paged(pc.shape, pc.view(), pc.pool_pages, {&en, 1}, opt).is_ok());
          EXPECT_TRUE(same_bits(want, alone.data(), row))
              << isa_name(isa) << " " << dtype_name(t) << " query " << i << " alone, threads "
              << threads;
        }
        // Row 2 of a 5-query entry (other rows: the neighbouring queries, or copies when at
        // the ends), behind the other entries of the call in reverse order.
        std::vector<float> q5(static_cast<std::size_t>(5 * H * D));
        for (int64_t j = 0; j < 5; ++j) {
          const int64_t src = std::clamp<int64_t>(i - 2 + j, 0, sp.n_q - 1);
          std::memcpy(q5.data() + j * H * D, pc.q[chunk].data() + src * H * D,
                      static_cast<std::size_t>(H * D) * sizeof(float));
        }
        std::vector<std::vector<float>> st;
        std::vector<PagedEntry> all = pc.entries(st);
        std::reverse(all.begin(), all.end());
        std::vector<float> five(5 * row, 7.0f);
        PagedEntry e5 = pc.entry(chunk, five.data());
        e5.q = q5.data();
        e5.n_q = 5;
        e5.first_pos = sp.first_pos + i - 2;
        all.push_back(e5);
        opt.threads = max_threads;
        ASSERT_TRUE(decode_partial_paged(pc.shape, pc.view(), pc.pool_pages, all, opt).is_ok());
        EXPECT_TRUE(same_bits(want, five.data() + 2 * row, row))
            << isa_name(isa) << " " << dtype_name(t) << " query " << i << " as row 2 of 5";
      }
    }
  }
}

// The prefill block kernel (PagedKernelChoice::kBlock) against the per-page decode item kernel
// (kPerPage): every state of every row bit-identical on every target, and within the oracle
// tolerance (checked on the best target; the others have the same bits or are checked by the
// sweep above). Entries: a whole odd-length prompt from position 0 (empty prefix; query blocks
// and pages both cross the causal diagonal), a chunk behind a prefix, uneven pages with gaps
// (other ranks' pages; limits inside a gap), a 9-query chunk, a decode step, an entry without
// pages; GQA groups 1, 3, 4; head dims 64, 80, 96, 128; every dtype; tiles 16 to 128 in both
// layouts; sliding windows of 1, 37 and 150 positions. Rows that see nothing are exactly the
// empty state, and no row is NaN (the oracle has none).
TEST(PagedKernel, BlockKernelGivesThePerPageKernelsBits) {
  struct Config {
    int64_t h, kv, d;
    DType t;
    int64_t T;
    KVTileLayout layout;
    std::vector<int64_t> windows;
  };
  const std::vector<Config> configs = {
      {9, 3, 64, DType::kF16, 64, KVTileLayout::kInterleaved, {0, 1, 37, 150}},
      {4, 4, 128, DType::kF32, 16, KVTileLayout::kSplit, {0, 37}},
      {8, 2, 80, DType::kBF16, 32, KVTileLayout::kInterleaved, {0, 150}},
      {9, 3, 64, DType::kBF16, 128, KVTileLayout::kSplit, {0}},
      {8, 2, 64, DType::kFP8, 64, KVTileLayout::kInterleaved, {0}},
      {4, 4, 64, DType::kInt8, 32, KVTileLayout::kSplit, {0}},
      {9, 3, 96, DType::kF32, 64, KVTileLayout::kInterleaved, {0}}};
  for (const Config& c : configs) {
    const int64_t T = c.T;
    std::vector<EntrySpec> specs;
    specs.push_back(contiguous(T, 0, 201, 201, 0));   // a whole prompt
    specs.push_back(contiguous(T, 0, 271, 190, 77));  // a chunk behind a prefix
    EntrySpec uneven;  // pages of uneven lengths with gaps (pages on other ranks)
    uneven.n_q = 70;
    int64_t at = 0;
    for (int64_t len : {T, T - 5, int64_t{3}, T, T / 2 + 1, T - 1, int64_t{7}, T}) {
      uneven.page_pos.push_back(at);
      uneven.page_len.push_back(static_cast<int32_t>(len));
      at += len + (uneven.page_pos.size() % 3 == 0 ? T + 2 : 0);
    }
    uneven.first_pos = at - 60;
    specs.push_back(uneven);
    specs.push_back(contiguous(T, 0, 150, 9, 141));  // 9 queries (just past the threshold)
    specs.push_back(contiguous(T, 0, 150, 1, 149));  // a decode step
    EntrySpec none;
    none.n_q = 20;
    none.first_pos = 33;
    specs.push_back(none);
    PagedCase pc(AttnShape{1, c.h, c.kv, c.d, 1}, c.t, T, c.layout, specs,
                 5 + static_cast<uint64_t>(c.d + T));
    for (const int64_t w : c.windows) {
      pc.window = w;
      for (Isa isa : testing::runnable_isas()) {
        if (isa == Isa::kReference) continue;  // one scalar page kernel for both choices
        const std::string what = std::string(isa_name(isa)) + " " + std::string(dtype_name(c.t)) + " H" +
                                 std::to_string(c.h) + "/" + std::to_string(c.kv) + " D" +
                                 std::to_string(c.d) + " T" + std::to_string(T) + " window " +
                                 std::to_string(w);
        DecodeOptions opt;
        opt.isa = isa;
        opt.threads = 2;
        std::vector<std::vector<float>> page, block;
        set_paged_kernel_choice(PagedKernelChoice::kPerPage);
        Status s = pc.run(page, opt);
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        set_paged_kernel_choice(PagedKernelChoice::kBlock);
        s = pc.run(block, opt);
        set_paged_kernel_choice(PagedKernelChoice::kAuto);
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        for (std::size_t e = 0; e < specs.size(); ++e)
          for (int64_t i = 0; i < specs[e].n_q; ++i) {
            const std::size_t row = static_cast<std::size_t>(i * c.h) * pc.rec();
            EXPECT_TRUE(same_bits(page[e].data() + row, block[e].data() + row,
                                  static_cast<std::size_t>(c.h) * pc.rec()))
                << what << ": entry " << e << " query " << i;
          }
        if (isa == testing::runnable_isas().back()) {  // the float64 oracle is the slow part:
          const Errors er = pc.vs_oracle(block);        // the best target (bits tie the rest)
          EXPECT_FALSE(er.nan_mismatch) << what;
          EXPECT_LE(er.out_abs, kTol) << what;
          EXPECT_LE(er.lse_abs, kTol) << what;
        }
        for (std::size_t r = 0; r < block[5].size(); r += pc.rec())
          EXPECT_TRUE(state_is_empty(block[5].data() + r)) << what;
        for (const auto& st : block)
          for (float x : st) ASSERT_FALSE(std::isnan(x)) << what;
      }
    }
  }
}

// Pages placed contiguously in order: the same tokens as one tiled shard row, so
// decode_partial_tiled() must agree within the oracle tolerance (other merge order, not the
// same bits).
TEST(PagedKernel, AgreesWithTiledKernelOnContiguousPages) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t T = 64, L = 20 * T - 9, Q = 4;
    const PagedCase pc(AttnShape{1, 8, 2, 128, 1}, t, T, KVTileLayout::kInterleaved,
                       {contiguous(T, 0, L, Q, L - Q)}, 3, /*shuffle=*/false);
    for (std::size_t j = 0; j < pc.pages[0].size(); ++j)
      ASSERT_EQ(pc.pages[0][j], static_cast<int32_t>(j));
    const std::vector<int64_t> len{L}, start{0}, total{L};
    const TiledKVShard row = pc.pool.view(len, start, total, 1);
    AttnShape s = pc.shape;
    s.q_len = Q;
    std::vector<float> tiled(pc.state_floats(0));
    for (Isa isa : testing::runnable_isas()) {
      DecodeOptions opt;
      opt.isa = isa;
      ASSERT_TRUE(decode_partial_tiled(s, pc.q[0].data(), row, tiled.data(), opt).is_ok());
      std::vector<std::vector<float>> st;
      ASSERT_TRUE(pc.run(st, opt).is_ok());
      const auto D = static_cast<std::size_t>(s.head_dim);
      double worst = 0, worst_lse = 0;
      std::vector<float> a(D), b(D);
      for (std::size_t r = 0; r < tiled.size() / pc.rec(); ++r) {
        float la = 0, lb = 0;
        state_normalize(tiled.data() + r * pc.rec(), D, a.data(), &la);
        state_normalize(st[0].data() + r * pc.rec(), D, b.data(), &lb);
        for (std::size_t d = 0; d < D; ++d) worst = std::max(worst, double{std::abs(a[d] - b[d])});
        worst_lse =
            std::max(worst_lse, std::abs(double{la} - lb) / std::max(1.0, std::abs(double{la})));
      }
      EXPECT_LE(worst, kTol) << isa_name(isa) << " " << dtype_name(t);
      EXPECT_LE(worst_lse, kTol) << isa_name(isa) << " " << dtype_name(t);
      const Errors e = pc.vs_oracle(st);
      EXPECT_LE(e.out_abs, kTol);
    }
  }
}

// Quantized pages whose scales span 2^-6 .. 2^6 from token to token and head to head (each
// token's K and V scaled by its own power of two), so that a scale read at any other token's,
// page's or head's offset changes a result far past the tolerance: odd page lengths, partly
// filled pages, shuffled pages, 3 KV heads, both tile layouts, every target, against the
// float64 oracle. The same pool read through scale pointers one element off (a kernel that
// missed its offset by one token) is checked to fail, so the test can.
TEST(PagedKernel, ScalesAreReadAtTheirTokensOffsets) {
  const auto spread = [](std::size_t e, int64_t i, int64_t h, float* k, float* v) {
    const float ks = std::ldexp(1.0f, static_cast<int>((i * 5 + h * 3 + e) % 13) - 6);
    const float vs = std::ldexp(1.0f, static_cast<int>((i * 7 + h * 5 + e + 3) % 11) - 5);
    for (int64_t d = 0; d < 64; ++d) {
      k[d] *= ks;
      v[d] *= vs;
    }
  };
  for (DType t : {DType::kInt8, DType::kFP8})
    for (const auto& [T, layout] : {std::pair{int64_t{16}, KVTileLayout::kSplit},
                                    std::pair{int64_t{64}, KVTileLayout::kInterleaved},
                                    std::pair{int64_t{32}, KVTileLayout::kInterleaved}}) {
      std::vector<EntrySpec> specs;
      specs.push_back(contiguous(T, 0, 5 * T - 3, 1, 5 * T - 4));  // decode, last page partial
      EntrySpec odd;  // odd page lengths, a gap, several queries with limits inside pages
      odd.n_q = 7;
      int64_t at = 0;
      for (int64_t len : {T - 1, int64_t{3}, T / 2 + 1, T, int64_t{1}, T - 7}) {
        odd.page_pos.push_back(at);
        odd.page_len.push_back(static_cast<int32_t>(len));
        at += len + (len == 3 ? T : 0);
      }
      odd.first_pos = at - 9;
      specs.push_back(odd);
      specs.push_back(contiguous(T, 0, 3 * T + 5, 13, 2 * T + 1));  // a prefill chunk
      const PagedCase pc(AttnShape{1, 9, 3, 64, 1}, t, T, layout, specs, 41, true, spread);
      const std::string what = std::string(dtype_name(t)) + " T" + std::to_string(T) + " " +
                               std::string(kv_tile_layout_name(layout));
      std::vector<std::vector<float>> st;
      for (Isa isa : testing::runnable_isas()) {
        DecodeOptions opt;
        opt.isa = isa;
        opt.threads = 2;
        ASSERT_TRUE(pc.run(st, opt).is_ok());
        const Errors e = pc.vs_oracle(st);
        EXPECT_FALSE(e.nan_mismatch) << isa_name(isa) << " " << what;
        EXPECT_LE(e.out_abs, kTol) << isa_name(isa) << " " << what;
        EXPECT_LE(e.lse_abs, kTol) << isa_name(isa) << " " << what;
      }
      for (const bool value : {false, true}) {  // K's, then V's scales one token off
        TiledKVShard off = pc.view();
        (value ? off.v_scale : off.k_scale) += 1;
        for (Isa isa : {Isa::kReference, testing::runnable_isas().back()}) {
          DecodeOptions opt;
          opt.isa = isa;
          std::vector<PagedEntry> en = pc.entries(st);
          ASSERT_TRUE(decode_partial_paged(pc.shape, off, pc.pool_pages, en, opt).is_ok());
          const Errors e = pc.vs_oracle(st);
          EXPECT_GT(std::max(e.out_abs, e.lse_abs), 1000 * kTol)
              << isa_name(isa) << " " << what << (value ? " V" : " K") << " scales one off";
        }
      }
    }
}

// q = 0 weighs every visible token exactly 1, so a query's record is m = 0, l = its token count
// and o = the sum of its tokens' V values; with tokens whose scale is a power of two (their
// largest magnitude quant_max(t) * 2^e) and small-integer codes every product and partial sum
// is exact: every target gives exactly those bits, whatever the order of its sums, and a V
// scale read at a wrong offset (the scales change from token to token and head to head) shows.
TEST(PagedKernel, QuantizedZeroQueryGivesTheExactValueSumsOnEveryTarget) {
  for (DType t : {DType::kInt8, DType::kFP8}) {
    const float qmax = quant_max(t);
    const auto fill = [qmax](std::size_t e, int64_t i, int64_t h, float* k, float* v) {
      const float sk = std::ldexp(1.0f, static_cast<int>((i * 3 + h + e) % 4) - 2);
      const float sv = std::ldexp(1.0f, static_cast<int>((i * 5 + h * 3 + e) % 4) - 2);
      for (int64_t d = 0; d < 64; ++d) {
        k[d] = static_cast<float>((i * 7 + d * 3 + h) % 17 - 8) * sk;
        v[d] = static_cast<float>((i * 3 + d * 5 + h * 2) % 17 - 8) * sv;
      }
      k[(i + h) % 64] = qmax * sk;  // the largest magnitude: scale = sk, a power of two
      v[(i * 3 + h) % 64] = -qmax * sv;
    };
    for (const auto& [T, layout] : {std::pair{int64_t{16}, KVTileLayout::kInterleaved},
                                    std::pair{int64_t{64}, KVTileLayout::kSplit}}) {
      std::vector<EntrySpec> specs;
      specs.push_back(contiguous(T, 0, 700, 1, 699));
      EntrySpec odd;
      odd.n_q = 3;
      int64_t at = 0;
      for (int64_t len : {T - 1, int64_t{5}, T, T / 2 + 3, int64_t{1}}) {
        odd.page_pos.push_back(at);
        odd.page_len.push_back(static_cast<int32_t>(len));
        at += len + 2;
      }
      odd.first_pos = at - 3;
      specs.push_back(odd);
      PagedCase pc(AttnShape{1, 9, 3, 64, 1}, t, T, layout, specs, 3, true, fill);
      for (auto& q : pc.q) std::fill(q.begin(), q.end(), 0.0f);
      for (Isa isa : testing::runnable_isas()) {
        DecodeOptions opt;
        opt.isa = isa;
        std::vector<std::vector<float>> st;
        ASSERT_TRUE(pc.run(st, opt).is_ok());
        for (std::size_t e = 0; e < specs.size(); ++e)
          for (int64_t i = 0; i < specs[e].n_q; ++i) {
            const int64_t limit = specs[e].first_pos + i;
            const int64_t n =
                std::upper_bound(pc.pos[e].begin(), pc.pos[e].end(), limit) - pc.pos[e].begin();
            for (int64_t hq = 0; hq < 9; ++hq) {
              const int64_t h = hq / 3;
              std::vector<double> sum(64, 0.0);  // exact: each term and sum fits 24 bits
              std::vector<float> kf(64), vf(64);
              for (int64_t j = 0; j < n; ++j) {
                fill(e, j, h, kf.data(), vf.data());
                for (std::size_t d = 0; d < 64; ++d) sum[d] += vf[d];
              }
              const float* rec = st[e].data() + static_cast<std::size_t>(i * 9 + hq) * pc.rec();
              const std::string what = std::string(isa_name(isa)) + " " +
                                       std::string(dtype_name(t)) + " T" + std::to_string(T) +
                                       " entry " + std::to_string(e) + " query " +
                                       std::to_string(i) + " head " + std::to_string(hq);
              ASSERT_EQ(rec[0], 0.0f) << what;
              ASSERT_EQ(rec[1], static_cast<float>(n)) << what;
              for (std::size_t d = 0; d < 64; ++d)
                ASSERT_EQ(rec[2 + d], static_cast<float>(sum[d])) << what << " d " << d;
            }
          }
      }
    }
  }
}

TEST(PagedKernel, NoEntriesAndNoPages) {
  const PagedCase pc(AttnShape{1, 4, 2, 64, 1}, DType::kF32, 64, KVTileLayout::kInterleaved,
                     {EntrySpec{}}, 1, false);
  ASSERT_EQ(pc.pool_pages, 0);
  EXPECT_TRUE(decode_partial_paged(pc.shape, pc.view(), 0, {}).is_ok());
  std::vector<std::vector<float>> st;
  ASSERT_TRUE(pc.run(st, {}).is_ok());
  for (std::size_t r = 0; r < st[0].size(); r += pc.rec()) EXPECT_TRUE(state_is_empty(&st[0][r]));
}

// Each bad input: kInvalidArgument whose message names the entry (and the page).
TEST(PagedKernel, RejectsBadInputNamingEntryAndPage) {
  const int64_t T = 32;
  const PagedCase pc(AttnShape{1, 4, 2, 64, 1}, DType::kF16, T, KVTileLayout::kInterleaved,
                     {contiguous(T, 0, 3 * T, 1, 3 * T - 1), contiguous(T, 0, 4 * T - 1, 2, 50)},
                     5);
  std::vector<std::vector<float>> st;
  ASSERT_TRUE(pc.run(st, {}).is_ok());
  struct Bad {
    std::string name, want;
    std::function<void(PagedEntry&, std::vector<int32_t>&, std::vector<int64_t>&,
                       std::vector<int32_t>&)>
        edit;
  };
  const std::vector<Bad> bad = {
      {"page index past the pool", "paged entry 1, page 2: pool page index",
       [&](PagedEntry&, auto& pg, auto&, auto&) { pg[2] = static_cast<int32_t>(pc.pool_pages); }},
      {"negative page index", "paged entry 1, page 0: pool page index -1",
       [](PagedEntry&, auto& pg, auto&, auto&) { pg[0] = -1; }},
      {"page_len 0", "paged entry 1, page 1: page_len 0",
       [](PagedEntry&, auto&, auto&, auto& pl) { pl[1] = 0; }},
      {"page_len > tile", "paged entry 1, page 3: page_len 33",
       [](PagedEntry&, auto&, auto&, auto& pl) { pl[3] = 33; }},
      {"overlapping positions", "paged entry 1, page 2: page_pos 63 overlaps",
       [](PagedEntry&, auto&, auto& pp, auto&) { pp[2] = 63; }},
      {"descending positions", "paged entry 1, page 1: page_pos 0",
       [](PagedEntry&, auto&, auto& pp, auto&) { pp[1] = 0; }},
      {"negative position", "paged entry 1, page 0: page_pos -4",
       [](PagedEntry&, auto&, auto& pp, auto&) { pp[0] = -4; }},
      {"null q", "paged entry 1: query pointer is null",
       [](PagedEntry& e, auto&, auto&, auto&) { e.q = nullptr; }},
      {"null states", "paged entry 1: state output pointer is null",
       [](PagedEntry& e, auto&, auto&, auto&) { e.states = nullptr; }},
      {"n_q 0", "paged entry 1: n_q must be >= 1",
       [](PagedEntry& e, auto&, auto&, auto&) { e.n_q = 0; }},
      {"span sizes", "paged entry 1: pages, page_pos and page_len must have the same size",
       [](PagedEntry& e, auto&, auto&, auto&) { e.page_len = e.page_len.first(2); }},
  };
  for (const Bad& b : bad) {
    std::vector<PagedEntry> en = pc.entries(st);
    std::vector<int32_t> pg(en[1].pages.begin(), en[1].pages.end());
    std::vector<int64_t> pp(en[1].page_pos.begin(), en[1].page_pos.end());
    std::vector<int32_t> pl(en[1].page_len.begin(), en[1].page_len.end());
    en[1].pages = pg;
    en[1].page_pos = pp;
    en[1].page_len = pl;
    b.edit(en[1], pg, pp, pl);
    const Status s = decode_partial_paged(pc.shape, pc.view(), pc.pool_pages, en);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << b.name << ": " << s.to_string();
    EXPECT_NE(s.message().find(b.want), std::string::npos) << b.name << ": " << s.message();
    // Nothing was computed: the states still hold the fill.
    EXPECT_EQ(st[0][0], 12345.0f) << b.name;
  }
  EXPECT_EQ(decode_partial_paged(pc.shape, pc.view(), -1, {}).code(), Code::kInvalidArgument);
  AttnShape bad_shape = pc.shape;
  bad_shape.kv_heads = 3;
  EXPECT_EQ(decode_partial_paged(bad_shape, pc.view(), pc.pool_pages, {}).code(),
            Code::kInvalidArgument);
}

// One decode step, SmolLM2 shape (H 9, Hkv 3, D 64, f16): 16 sequences of 2048 tokens on
// 64-token pages of a shuffled pool vs the same tokens as a contiguous tiled shard of 16 rows,
// 1 thread, alternating; KV GB/s of each (median of the rounds) and their ratio.
// Run: test_kernel_paged --gtest_also_run_disabled_tests --gtest_filter='*Throughput*'
TEST(PagedKernel, DISABLED_ThroughputVsTiled) {
  const int64_t B = 16, L = 2048, T = 64;
  const AttnShape shape{1, 9, 3, 64, 1};
  const DType dt = DType::kF16;
  std::vector<EntrySpec> specs;
  for (int64_t b = 0; b < B; ++b) specs.push_back(contiguous(T, 0, L, 1, L - 1));
  const PagedCase pc(shape, dt, T, kKVTileLayout, specs, 11);
  // The contiguous tiled shard: the same token values, row b = entry b.
  const AttnShape rows{B, 9, 3, 64, 1};
  Result<TiledKVCache> rc = TiledKVCache::create(rows, dt, L, kKVTileLayout, T);
  ASSERT_TRUE(rc.is_ok());
  TiledKVCache contig = std::move(rc).value();
  {
    std::vector<float> k(64), v(64);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t t = 0; t < L; ++t) {
          pc.pool.read_token(
              0, h,
              pc.pages[static_cast<std::size_t>(b)][static_cast<std::size_t>(t / T)] * T + t % T,
              k.data(), v.data());
          contig.set_token(b, h, t, k.data(), v.data());
        }
  }
  const std::vector<int64_t> len(B, L), start(B, 0), total(B, L);
  const TiledKVShard cview = contig.view(len, start, total, 1);
  std::vector<float> q(static_cast<std::size_t>(B * 9 * 64));
  for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b)
    std::memcpy(q.data() + b * 9 * 64, pc.q[b].data(), 9 * 64 * sizeof(float));
  std::vector<float> cst(static_cast<std::size_t>(B * 9 * 66));
  std::vector<std::vector<float>> pst;
  std::vector<PagedEntry> en = pc.entries(pst);
  DecodeOptions opt;
  opt.threads = 1;
  const double bytes = static_cast<double>(B * L * 3 * 64 * 2 * 2);
  auto secs = [](auto f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> tp, tt, ratio;
  for (int round = 0; round < 31; ++round) {
    tp.push_back(secs([&] {
      ASSERT_TRUE(decode_partial_paged(pc.shape, pc.view(), pc.pool_pages, en, opt).is_ok());
    }));
    tt.push_back(secs([&] {
      ASSERT_TRUE(decode_partial_tiled(rows, q.data(), cview, cst.data(), opt).is_ok());
    }));
    ratio.push_back(tt.back() / tp.back());  // paged GB/s over tiled GB/s, same round
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double best_p = *std::min_element(tp.begin(), tp.end());
  const double best_t = *std::min_element(tt.begin(), tt.end());
  std::printf(
      "isa %s, %.1f MB of KV, 1 thread: paged %.2f GB/s median, %.2f best; tiled %.2f median, "
      "%.2f best; paged/tiled: median of per-round ratios %.3f, best/best %.3f\n",
      std::string(isa_name(best_isa())).c_str(), bytes / 1e6, bytes / median(tp) / 1e9,
      bytes / best_p / 1e9, bytes / median(tt) / 1e9, bytes / best_t / 1e9, median(ratio),
      best_t / best_p);
  const Errors e = pc.vs_oracle(pst);
  EXPECT_LE(e.out_abs, kTol);
}

}  // namespace
}  // namespace treeattn
