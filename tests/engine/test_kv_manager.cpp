// The engine's KV manager (src/engine/kv_manager.hpp) on hand-made sequences: placement (logical
// page j on rank j mod p), reservations of a prompt's pages that allocation draws down, growth
// on demand, prefix hits and the pages they save, cached hits counted against availability,
// release (tail first into the LRU), preemption, this rank's entry pages, poisoned pages, and the
// window group: pages dropped once a sliding window has passed them, window prefix hits.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "engine/kv_manager.hpp"

namespace treeattn::engine {
namespace {

std::vector<TokenId> iota_tokens(int64_t n, TokenId first = 0) {
  std::vector<TokenId> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

// Admits a sequence as the scheduler does: fit, then take.
Sequence admitted(KVManager& kv, std::vector<TokenId> prompt, int64_t max_new) {
  Sequence s;
  s.tokens = prompt;
  s.prompt_len = static_cast<int64_t>(prompt.size());
  const AdmissionFit fit = kv.fit(prompt);
  EXPECT_TRUE(fit.fits());
  kv.take(fit, s);
  s.req.prompt = std::move(prompt);
  s.req.max_new_tokens = max_new;
  return s;
}

// Stores n more positions of s (as a step's forward pass would: its pages grown first, as the
// scheduler does) and indexes its full pages; tokens past the prompt are made up.
void compute(KVManager& kv, Sequence& s, int64_t n, int me = 0,
             std::vector<PageRef>* mine = nullptr) {
  while (static_cast<int64_t>(s.tokens.size()) < s.computed + n)
    s.tokens.push_back(static_cast<TokenId>(1000 + s.tokens.size()));
  const std::vector<int64_t> need = kv.growth(s, n);
  ASSERT_LT(kv.short_rank(need), 0);
  kv.grow(s, need);
  ASSERT_TRUE(kv.allocate(s, n, me, mine).is_ok());
  s.computed += n;
  kv.index_full_pages(s);
}

TEST(EngineKVManager, PlacesLogicalPageJOnRankJModP) {
  KVManager kv(3, 8, 16, true);
  Sequence s = admitted(kv, iota_tokens(100), 1);  // 100 positions: pages 0..6
  EXPECT_EQ(s.reserve_left, (std::vector<int64_t>{3, 2, 2}));
  std::vector<PageRef> mine;
  compute(kv, s, 100, 1, &mine);
  ASSERT_EQ(s.pages.size(), 7u);
  for (std::size_t j = 0; j < s.pages.size(); ++j)
    EXPECT_EQ(s.pages[j].rank, static_cast<int>(j % 3));
  EXPECT_EQ(s.reserve_left, (std::vector<int64_t>{0, 0, 0}));
  ASSERT_EQ(mine.size(), 2u);  // rank 1's pages: logical 1 and 4
  EXPECT_EQ(mine[0], s.pages[1]);
  EXPECT_EQ(mine[1], s.pages[4]);
  EXPECT_EQ(s.hashes.size(), 6u);  // full pages only
  EXPECT_TRUE(kv.table().check().is_ok());
  EXPECT_EQ(kv.max_sequence_tokens(), 3 * 8 * 16);
}

TEST(EngineKVManager, ReservesThePromptsPagesGrowsOnDemandAndReleasesEverything) {
  KVManager kv(2, 4, 16, true);
  Sequence s = admitted(kv, iota_tokens(20), 30);  // the prompt's 20 positions: 2 pages
  EXPECT_EQ(s.reserve_left, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(kv.table().available(0), 3);
  compute(kv, s, 20);
  EXPECT_EQ(s.reserve_left, (std::vector<int64_t>{0, 0}));
  // Decoding: position 20 is on page 1 (held), 32 on page 2 (rank 0, grown then).
  EXPECT_EQ(kv.growth(s, 1), (std::vector<int64_t>{0, 0}));
  compute(kv, s, 12);
  EXPECT_EQ(kv.growth(s, 1), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(kv.growth(s, 17), (std::vector<int64_t>{1, 1}));
  compute(kv, s, 1);
  EXPECT_EQ(s.pages.size(), 3u);
  EXPECT_EQ(kv.table().available(0), 2);
  kv.release(s);
  EXPECT_EQ(kv.table().reserved(0), 0);
  EXPECT_EQ(kv.table().reserved(1), 0);
  EXPECT_EQ(kv.table().used_pages(0), 0);
  EXPECT_EQ(kv.table().cached_pages(0), 1);  // the one full page stays for reuse
  EXPECT_EQ(kv.table().available(0) + kv.table().available(1), 8);
  EXPECT_TRUE(kv.table().check().is_ok());
}

TEST(EngineKVManager, ReportsTheFirstShortRank) {
  KVManager kv(2, 2, 16, true);
  const AdmissionFit ok = kv.fit(iota_tokens(64));  // 64 positions: 2 pages per rank
  EXPECT_TRUE(ok.fits());
  const AdmissionFit no = kv.fit(iota_tokens(65));  // 65: 3 pages on rank 0
  EXPECT_FALSE(no.fits());
  EXPECT_EQ(no.short_rank, 0);
}

TEST(EngineKVManager, PrefixHitsLeaveTheLastTokenAndSavePages) {
  KVManager kv(2, 8, 16, true);
  const auto doc = iota_tokens(48);
  Sequence a = admitted(kv, doc, 1);
  compute(kv, a, 48);
  // The same 48 tokens: 2 hits (the third page holds the last token, computed again).
  const AdmissionFit same = kv.fit(doc);
  EXPECT_EQ(same.hits.size(), 2u);
  EXPECT_EQ(same.need, (std::vector<int64_t>{1, 0}));
  Sequence b;
  b.tokens = doc;
  b.prompt_len = 48;
  kv.take(same, b);
  EXPECT_EQ(b.computed, 32);
  EXPECT_EQ(b.cached_tokens, 32);
  EXPECT_EQ(b.pages, (std::vector<PageRef>{a.pages[0], a.pages[1]}));
  EXPECT_EQ(kv.table().refcount(a.pages[0]), 2);
  // A prompt that differs in its second page hits only the first.
  auto other = doc;
  other[20] = 999;
  EXPECT_EQ(kv.fit(other).hits.size(), 1u);
  EXPECT_TRUE(kv.table().check().is_ok());
}

TEST(EngineKVManager, CachedHitsCountAgainstAvailablePages) {
  KVManager kv(1, 3, 16, true);
  const auto doc = iota_tokens(33);
  Sequence a = admitted(kv, doc, 1);
  compute(kv, a, 33);
  kv.release(a);  // pages 0, 1 cached, page 2 free
  EXPECT_EQ(kv.table().cached_pages(0), 2);
  // Two hits leave the LRU: with one page needed, 3 of 3 available pages are spoken for.
  const AdmissionFit f = kv.fit(doc);
  EXPECT_EQ(f.hits.size(), 2u);
  EXPECT_TRUE(f.fits());
  const AdmissionFit g = kv.fit(iota_tokens(49));  // the same 2 hits, one page more: no fit
  EXPECT_EQ(g.hits.size(), 2u);
  EXPECT_FALSE(g.fits());
}

TEST(EngineKVManager, NoPrefixCacheNoHitsNoIndex) {
  KVManager kv(1, 8, 16, false);
  const auto doc = iota_tokens(40);
  Sequence a = admitted(kv, doc, 1);
  compute(kv, a, 40);
  EXPECT_EQ(a.hashes.size(), 2u);  // hashed, not indexed
  EXPECT_EQ(kv.table().index_size(), 0);
  EXPECT_TRUE(kv.fit(doc).hits.empty());
}

// Tail-first eviction: a released chain joins the LRU deepest page first, so evicting one page
// takes its last page and every earlier one is still a prefix hit.
TEST(EngineKVManager, EvictionTakesAReleasedChainFromItsTailSoItsHeadStillHits) {
  KVManager kv(1, 12, 16, true);
  const auto doc = iota_tokens(161);  // 10 full pages and one token
  Sequence a = admitted(kv, doc, 1);
  compute(kv, a, 161);
  kv.release(a);  // 10 cached pages, 2 free
  ASSERT_EQ(kv.table().cached_pages(0), 10);
  // A stranger takes the 2 free pages and one more: one cached page is evicted.
  Sequence b = admitted(kv, iota_tokens(48, 5000), 1);
  compute(kv, b, 48);
  EXPECT_EQ(kv.table().cached_pages(0), 9);
  // Pages 0-8 of the chain still hit; page 9 (its tail) was the one evicted.
  const AdmissionFit f = kv.fit(doc);
  EXPECT_EQ(f.hits.size(), 9u);
  for (std::size_t j = 0; j < f.hits.size(); ++j) EXPECT_EQ(f.hits[j], a.pages[j]);
  EXPECT_TRUE(kv.table().check().is_ok());
}

TEST(EngineKVManager, PreemptReleasesEverythingAndKeepsTheTokensForAResumption) {
  KVManager kv(2, 8, 16, true);
  Sequence s = admitted(kv, iota_tokens(40), 1);
  compute(kv, s, 40);
  compute(kv, s, 5);  // "generated" positions
  const auto held = s.tokens;
  kv.preempt(s);
  EXPECT_TRUE(s.pages.empty());
  EXPECT_TRUE(s.hashes.empty());
  EXPECT_EQ(s.computed, 0);
  EXPECT_EQ(s.reserve_left, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(s.tokens, held);
  EXPECT_EQ(kv.table().used_pages(0) + kv.table().used_pages(1), 0);
  EXPECT_EQ(kv.table().reserved(0) + kv.table().reserved(1), 0);
  // Admitted again with every token it holds: its 2 full pages are hits, the rest recomputed.
  const AdmissionFit f = kv.fit(s.tokens);
  EXPECT_EQ(f.hits.size(), 2u);
  kv.take(f, s);
  EXPECT_EQ(s.computed, 32);
  EXPECT_EQ(s.reserve_left, (std::vector<int64_t>{1, 0}));  // page 2 of 45 positions
  EXPECT_TRUE(kv.table().check().is_ok());
}

TEST(EngineKVManager, EntryPagesAreThisRanksPagesUpToTheEnd) {
  KVManager kv(2, 8, 16, true);
  Sequence s = admitted(kv, iota_tokens(70), 1);
  compute(kv, s, 70);
  EntryPages r0, r1;
  kv.entry_pages(s, 70, 0, r0);
  kv.entry_pages(s, 70, 1, r1);
  EXPECT_EQ(r0.pos, (std::vector<int64_t>{0, 32, 64}));
  EXPECT_EQ(r0.len, (std::vector<int32_t>{16, 16, 6}));
  EXPECT_EQ(r1.pos, (std::vector<int64_t>{16, 48}));
  EXPECT_EQ(r1.len, (std::vector<int32_t>{16, 16}));
  EXPECT_EQ(r0.ids[2], s.pages[4].id);
  EntryPages part;
  kv.entry_pages(s, 20, 1, part);  // [0, 20): rank 1 holds positions 16..19
  EXPECT_EQ(part.len, (std::vector<int32_t>{4}));
}

// The window group (sliding-window layers): window 40, pages of 16, 2 ranks. A sequence keeps
// every full page and, of the window pages, those a query at `computed` or later still sees:
// page j goes once (j + 1) * 16 - 1 <= computed - 40. Dropped pages leave the window table's
// use count, and each rank's entry counts its own dropped pages (the kernel's page_index0).
TEST(EngineKVManager, WindowPagesAreDroppedOnceTheWindowHasPassedThem) {
  KVManager kv(2, 16, 16, true, WindowGroup{40, 8, 32});
  ASSERT_TRUE(kv.has_window());
  Sequence s = admitted(kv, iota_tokens(300), 1);
  // Admission reserves the window pages of the first chunk only (positions 0..31: pages 0, 1).
  EXPECT_EQ(s.reserve_left, (std::vector<int64_t>{10, 9, 1, 1}));
  for (int64_t step = 0; step < 10; ++step) {
    compute(kv, s, step < 9 ? 32 : 12);
    const int64_t c = s.computed;
    const int64_t first_live = c - 40 + 1 <= 0 ? 0 : (c - 40 + 1) / 16;
    EXPECT_EQ(kv.window_first_live(c), first_live);
    EXPECT_EQ(s.window_dropped, first_live) << "computed " << c;
    ASSERT_EQ(s.window_pages.size(), s.pages.size());
    int64_t held = 0;
    for (int64_t j = 0; j < static_cast<int64_t>(s.window_pages.size()); ++j) {
      const PageRef& pg = s.window_pages[static_cast<std::size_t>(j)];
      EXPECT_EQ(pg.rank >= 0, j >= first_live) << "page " << j << " computed " << c;
      if (pg.rank >= 0) {
        EXPECT_EQ(pg.rank, static_cast<int>(j % 2));
        ++held;
      }
      // no later query sees a dropped page's last position; every held page's is seen
      if (pg.rank < 0) {
        EXPECT_LE((j + 1) * 16 - 1, c - 40);
      }
    }
    EXPECT_EQ(kv.window_table().used_pages(0) + kv.window_table().used_pages(1), held);
    EXPECT_LE(held, (40 - 1 + 16 - 1) / 16 + 1);  // the window and the page being filled
    EXPECT_EQ(kv.table().used_pages(0) + kv.table().used_pages(1), (c + 15) / 16);
    for (int r = 0; r < 2; ++r) {
      EntryPages e;
      kv.window_entry_pages(s, c, r, e);
      int64_t dropped_here = 0;
      for (int64_t j = r; j < first_live; j += 2) ++dropped_here;
      EXPECT_EQ(e.index0, dropped_here) << "rank " << r << " computed " << c;
      for (const int64_t pos : e.pos) EXPECT_GE(pos / 16, first_live);
    }
    EXPECT_TRUE(kv.check().is_ok());
  }
  kv.release(s);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(kv.window_table().used_pages(r), 0);
    EXPECT_EQ(kv.window_table().reserved(r), 0);
    EXPECT_EQ(kv.table().reserved(r), 0);
  }
  EXPECT_TRUE(kv.check().is_ok());
}

// A prefix hit needs the window pages its first computed position sees: a released 10-page
// chain hits whole while its last window pages are cached (its dropped earlier ones are evicted
// first), and not at all once one of them is gone.
TEST(EngineKVManager, AWindowHitNeedsTheWindowPagesBeforeItsEnd) {
  for (const int64_t stranger_pages : {9, 10}) {
    KVManager kv(1, 40, 16, true, WindowGroup{40, 12, 16});
    const auto doc = iota_tokens(161);  // 10 full pages and one token
    Sequence a = admitted(kv, doc, 1);
    for (int64_t done = 0; done < 161; done += 16) compute(kv, a, std::min<int64_t>(16, 161 - done));
    kv.release(a);  // window table: 10 cached (0..6 dropped earlier, then 9, 8, 7), 2 free
    ASSERT_EQ(kv.window_table().cached_pages(0), 10);
    const AdmissionFit before = kv.fit(doc);
    EXPECT_EQ(before.hits.size(), 10u);
    EXPECT_EQ(before.window_first, 7);  // (160 - 40 + 1) / 16
    ASSERT_EQ(before.window_hits.size(), 3u);
    for (std::size_t j = 0; j < 3; ++j) EXPECT_EQ(before.window_hits[j], a.window_pages[7 + j]);
    // A stranger computing its pages at once takes the 2 free window pages and evicts the rest
    // it needs, least recently released first: 0..6, then the chain's tail.
    Sequence b = admitted(kv, iota_tokens(stranger_pages * 16, 5000), 1);
    compute(kv, b, stranger_pages * 16);
    const AdmissionFit after = kv.fit(doc);
    if (stranger_pages == 9) {
      EXPECT_EQ(after.hits.size(), 10u) << "only pages no hit needs were evicted";
      EXPECT_EQ(after.window_hits.size(), 3u);
    } else {
      EXPECT_EQ(after.hits.size(), 0u) << "window page 9 is gone: no prefix has its window";
      EXPECT_TRUE(after.window_hits.empty());
    }
    // What it takes is consistent: admitting it and computing the rest gives every page.
    kv.release(b);
    Sequence c = admitted(kv, doc, 1);
    EXPECT_EQ(c.computed, static_cast<int64_t>(after.hits.size()) * 16);
    compute(kv, c, 161 - c.computed);
    EXPECT_EQ(c.window_dropped, kv.window_first_live(161));
    EXPECT_TRUE(kv.check().is_ok());
  }
}

TEST(EngineKVManager, PoisonFillsAPageWithNaN) {
  auto pool =
      TiledKVCache::create(AttnShape{1, 2, 2, 64, 1}, DType::kF32, 2 * 16, kKVTileLayout, 16);
  ASSERT_TRUE(pool.is_ok()) << pool.status().message();
  std::vector<TiledKVCache> pools;
  pools.push_back(std::move(pool).value());
  const std::vector<float> one(128, 1.0f);
  for (int64_t t = 0; t < 32; ++t) pools[0].set_tokens(0, t, one.data(), one.data());
  poison_page(pools, PageRef{0, 1}, 16, 128);
  float k[64], v[64];
  pools[0].read_token(0, 1, 15, k, v);
  EXPECT_EQ(k[0], 1.0f);  // page 0 untouched
  for (int64_t t = 16; t < 32; ++t) {
    pools[0].read_token(0, 0, t, k, v);
    EXPECT_TRUE(std::isnan(k[0]) && std::isnan(v[63])) << t;
  }
}

}  // namespace
}  // namespace treeattn::engine
