// The engine's replicated page bookkeeping: every rank's free list, reference counts, the
// prefix index and the LRU list of cached pages, for all ranks at once.
//
// Every rank keeps an identical PageTable and applies the same calls in the same order (the
// step descriptions rank 0 broadcasts), so each rank knows, without messages, which page of
// which rank holds any logical page of any sequence, and rank 0 knows every rank's free pages
// when it admits a request. A rank stores data only in the pages whose `rank` is its own.
//
// Placement rule: logical page j of a sequence lives on rank j mod p.
//
// Page states (per rank, per page id): free (on the free list), referenced (refcount >= 1, by
// live sequences), cached (refcount 0 but indexed by its prefix hash, kept for reuse, evictable:
// least recently released first; the KV manager releases a sequence's pages deepest first, so a
// chain is evicted from its tail). Reservations: the scheduler reserves, per rank, the pages a
// sequence will allocate next (a prompt's at admission, a step's growth before the step);
// allocation then never fails, because available() = free + cached - reserved never goes below
// zero.
//
// Determinism: free lists hand out the lowest free page id first; the LRU order and the index
// depend only on the order of the calls.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "treeattn/status.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::engine {

struct PageRef {
  int rank = -1;
  int32_t id = -1;
  bool operator==(const PageRef&) const = default;
};

class PageTable {
 public:
  PageTable(int ranks, int64_t pages_per_rank, int64_t page_tokens);

  int ranks() const { return ranks_; }
  int64_t pages_per_rank() const { return pages_; }
  int64_t page_tokens() const { return page_tokens_; }
  int owner(int64_t logical_page) const { return static_cast<int>(logical_page % ranks_); }

  // Pages needed on each rank for logical pages [first, last) of one sequence.
  std::vector<int64_t> pages_needed(int64_t first_page, int64_t end_page) const;
  // Free + cached - reserved on `rank`.
  int64_t available(int rank) const;
  int64_t free_pages(int rank) const;
  int64_t cached_pages(int rank) const;
  int64_t used_pages(int rank) const;  // referenced by a live sequence
  int64_t reserved(int rank) const;

  // Adds `count[r]` to rank r's reservation (the caller checked available()).
  void reserve(std::span<const int64_t> count);
  // Returns unused reservation.
  void unreserve(std::span<const int64_t> count);
  // Takes one reserved page of `rank`: the lowest free id, else the least recently cached page
  // (dropped from the index). Its refcount becomes 1. kInternal when nothing is reserved.
  Result<PageRef> allocate(int rank);
  // One more reference to a page (a prefix hit): a cached page leaves the LRU list.
  void acquire(PageRef page);
  // One reference fewer; at zero the page becomes cached when indexed, free otherwise.
  void release(PageRef page);

  // ---- prefix index ----------------------------------------------------------------------------
  // The chain hash of a full page: H(parent hash, its tokens). kRootHash for the empty prefix.
  static constexpr uint64_t kRootHash = 0x6a09e667f3bcc908ull;
  static uint64_t chain_hash(uint64_t parent, std::span<const TokenId> tokens);
  // The indexed page whose prefix hash is `hash` and whose parent and tokens match (collisions
  // are checked against the stored tokens), or an invalid PageRef.
  PageRef lookup(uint64_t hash, uint64_t parent, std::span<const TokenId> tokens) const;
  // Indexes a full, referenced page under `hash`; false (nothing changes) when the hash is
  // already indexed (another sequence computed the same prefix) or the page is indexed already.
  bool insert(uint64_t hash, uint64_t parent, std::span<const TokenId> tokens, PageRef page);
  bool indexed(PageRef page) const;
  int64_t index_size() const { return static_cast<int64_t>(index_.size()); }

  // Refcount of a page (tests).
  int32_t refcount(PageRef page) const;
  // Consistency check of every invariant (tests): counts, lists, index back-pointers.
  Status check() const;

 private:
  struct Page {
    int32_t refs = 0;
    bool on_free_list = true;
    uint64_t hash = 0;  // indexed pages only
    bool is_indexed = false;
    std::list<int32_t>::iterator lru;  // cached pages only
  };
  struct Entry {
    PageRef page;
    uint64_t parent = 0;
    std::vector<TokenId> tokens;
  };
  struct Rank {
    std::vector<Page> pages;
    std::vector<int32_t> free;   // kept as a min-heap on id
    std::list<int32_t> lru;      // cached pages, least recently released first
    int64_t reserved = 0;
    int64_t used = 0;
  };
  Page& page(PageRef r) { return ranks_v_[static_cast<std::size_t>(r.rank)].pages[static_cast<std::size_t>(r.id)]; }
  const Page& page(PageRef r) const {
    return ranks_v_[static_cast<std::size_t>(r.rank)].pages[static_cast<std::size_t>(r.id)];
  }

  int ranks_;
  int64_t pages_;
  int64_t page_tokens_;
  std::vector<Rank> ranks_v_;
  std::unordered_map<uint64_t, Entry> index_;
};

}  // namespace treeattn::engine
