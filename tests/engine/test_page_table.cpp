// The engine's replicated page bookkeeping (src/engine/page_table.hpp): reservations, the
// placement rule, prefix index with collision checks, LRU eviction of cached pages, refcounts.
#include "engine/page_table.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

namespace treeattn::engine {
namespace {

std::vector<TokenId> page_tokens(int seed, int n) {
  std::vector<TokenId> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), seed * 1000);
  return t;
}

TEST(PageTable, PlacementAndReservationsCountPerRank) {
  PageTable t(3, 4, 16);
  EXPECT_EQ(t.owner(0), 0);
  EXPECT_EQ(t.owner(4), 1);
  const auto need = t.pages_needed(1, 6);  // pages 1..5 -> ranks 1,2,0,1,2
  EXPECT_EQ(need, (std::vector<int64_t>{1, 2, 2}));
  t.reserve(need);
  EXPECT_EQ(t.available(0), 3);
  EXPECT_EQ(t.available(1), 2);
  for (int r : {1, 2, 0, 1, 2}) {
    auto p = t.allocate(r);
    ASSERT_TRUE(p.is_ok());
    EXPECT_EQ(p->rank, r);
  }
  EXPECT_EQ(t.used_pages(1), 2);
  EXPECT_EQ(t.reserved(1), 0);
  // Without a reservation: a clear internal error, nothing changes.
  auto bad = t.allocate(1);
  EXPECT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("without a reservation"), std::string::npos);
  EXPECT_TRUE(t.check().is_ok()) << t.check().to_string();
}

TEST(PageTable, LowestFreeIdFirstAndReleaseReturnsToTheFreeList) {
  PageTable t(1, 4, 16);
  t.reserve(std::vector<int64_t>{3});
  std::vector<PageRef> got;
  for (int i = 0; i < 3; ++i) got.push_back(*t.allocate(0));
  EXPECT_EQ(got[0].id, 0);
  EXPECT_EQ(got[2].id, 2);
  t.release(got[1]);
  EXPECT_EQ(t.free_pages(0), 2);
  t.reserve(std::vector<int64_t>{1});
  EXPECT_EQ(t.allocate(0)->id, 1);  // the lowest free id again
  EXPECT_TRUE(t.check().is_ok());
}

TEST(PageTable, PrefixIndexHitsSharedPagesAndChecksTokensOnCollision) {
  PageTable t(2, 4, 4);
  t.reserve(std::vector<int64_t>{1, 1});
  const PageRef a = *t.allocate(0), b = *t.allocate(1);
  const auto ta = page_tokens(1, 4), tb = page_tokens(2, 4);
  const uint64_t ha = PageTable::chain_hash(PageTable::kRootHash, ta);
  const uint64_t hb = PageTable::chain_hash(ha, tb);
  EXPECT_TRUE(t.insert(ha, PageTable::kRootHash, ta, a));
  EXPECT_TRUE(t.insert(hb, ha, tb, b));
  EXPECT_FALSE(t.insert(ha, PageTable::kRootHash, ta, b));  // hash taken: stays private
  EXPECT_EQ(t.lookup(ha, PageTable::kRootHash, ta), a);
  EXPECT_EQ(t.lookup(hb, ha, tb), b);
  // Same hash key, other tokens or parent (a forced collision): no hit.
  EXPECT_EQ(t.lookup(ha, PageTable::kRootHash, tb).rank, -1);
  EXPECT_EQ(t.lookup(hb, PageTable::kRootHash, tb).rank, -1);
  // The chain: a different first page changes the second page's hash.
  EXPECT_NE(PageTable::chain_hash(PageTable::chain_hash(PageTable::kRootHash, tb), tb), hb);
  // Released indexed pages are cached (evictable), not freed; a hit takes them back.
  t.release(a);
  EXPECT_EQ(t.cached_pages(0), 1);
  EXPECT_EQ(t.free_pages(0), 3);
  EXPECT_EQ(t.available(0), 4);
  t.acquire(a);
  EXPECT_EQ(t.cached_pages(0), 0);
  EXPECT_EQ(t.refcount(a), 1);
  t.acquire(a);
  EXPECT_EQ(t.refcount(a), 2);
  t.release(a);
  t.release(a);
  t.release(a);  // one release too many: refcounts never go below zero
  EXPECT_EQ(t.refcount(a), 0);
  EXPECT_TRUE(t.check().is_ok()) << t.check().to_string();
}

TEST(PageTable, EvictionTakesTheLeastRecentlyCachedPageAndDropsItsIndexEntry) {
  PageTable t(1, 3, 4);
  t.reserve(std::vector<int64_t>{3});
  std::vector<PageRef> p;
  std::vector<uint64_t> h;
  for (int i = 0; i < 3; ++i) {
    p.push_back(*t.allocate(0));
    const auto toks = page_tokens(i, 4);
    h.push_back(PageTable::chain_hash(PageTable::kRootHash, toks));
    ASSERT_TRUE(t.insert(h.back(), PageTable::kRootHash, toks, p.back()));
  }
  t.release(p[1]);
  t.release(p[0]);
  t.release(p[2]);
  EXPECT_EQ(t.cached_pages(0), 3);
  EXPECT_EQ(t.free_pages(0), 0);
  t.reserve(std::vector<int64_t>{2});
  EXPECT_EQ(t.allocate(0)->id, p[1].id);  // released first, evicted first
  EXPECT_EQ(t.lookup(h[1], PageTable::kRootHash, page_tokens(1, 4)).rank, -1);
  EXPECT_EQ(t.allocate(0)->id, p[0].id);
  EXPECT_EQ(t.lookup(h[2], PageTable::kRootHash, page_tokens(2, 4)), p[2]);
  EXPECT_EQ(t.index_size(), 1);
  EXPECT_TRUE(t.check().is_ok()) << t.check().to_string();
}

TEST(PageTable, RandomOperationsKeepEveryInvariant) {
  std::mt19937 rng(7);
  PageTable t(3, 8, 4);
  std::vector<PageRef> held;
  for (int it = 0; it < 3000; ++it) {
    const int op = static_cast<int>(rng() % 4);
    const int r = static_cast<int>(rng() % 3);
    if (op == 0 && t.available(r) > 0) {
      std::vector<int64_t> c(3, 0);
      c[static_cast<std::size_t>(r)] = 1;
      t.reserve(c);
      auto p = t.allocate(r);
      ASSERT_TRUE(p.is_ok());
      held.push_back(*p);
      if (rng() % 2) {
        const auto toks = page_tokens(it, 4);
        t.insert(PageTable::chain_hash(PageTable::kRootHash, toks), PageTable::kRootHash, toks, *p);
      }
    } else if (op == 1 && !held.empty()) {
      const std::size_t i = rng() % held.size();
      t.release(held[i]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op == 2 && !held.empty()) {
      const PageRef p = held[rng() % held.size()];
      t.acquire(p);
      held.push_back(p);
    }
    ASSERT_TRUE(t.check().is_ok()) << "after operation " << it << ": " << t.check().to_string();
  }
  for (const PageRef& p : held) t.release(p);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(t.used_pages(r), 0);
    EXPECT_EQ(t.free_pages(r) + t.cached_pages(r), 8);
  }
}

}  // namespace
}  // namespace treeattn::engine
