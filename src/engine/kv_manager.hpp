// The engine's KV page bookkeeping over the replicated PageTable (page_table.hpp): which pages a
// prompt takes from the prefix cache and how many more each rank must reserve for it, page
// allocation under the placement rule (logical page j on rank j mod p), indexing of full pages,
// releasing a sequence, and one rank's pages of a sequence as the paged kernel reads them.
//
// Every call is deterministic in the replicated state and its arguments, so every rank that
// applies the same calls in the same order holds the same tables.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/page_table.hpp"
#include "engine/sequence.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/status.hpp"

namespace treeattn::engine {

// What admission learns about one prompt before it commits to it.
struct AdmissionFit {
  std::vector<PageRef> hits;     // full prompt pages found in the prefix index, in order
  std::vector<uint64_t> hashes;  // their chain hashes
  // With a window group: the window pages of hits [window_first, hits.size()), the ones the
  // first computed position's window still sees.
  std::vector<PageRef> window_hits;
  int64_t window_first = 0;
  std::vector<int64_t> need;  // per group and rank ([group * ranks + rank]): pages to reserve
  int short_rank = -1;        // the first rank without those pages; -1: it fits now
  bool fits() const { return short_rank < 0; }
};

// The window group (sliding-window layers, gemma3's local layers): a second page table whose
// pages hold those layers' K/V. Logical page j of a sequence has a page in each group, on the
// same rank (j mod p); a window page is dropped (released: cached when indexed, else free) once
// no later query of its sequence can see it: a query at position q sees positions > q - window,
// so page j goes when (j + 1) * T - 1 <= computed - window. Its sequence keeps every page of the
// full group. A prefix hit must find the window pages its first computed position sees, so a
// hit is cut back to the longest prefix whose window pages are all cached. Admission reserves
// window pages for the prompt's first `first_chunk` positions only (a step computes at most the
// prefill chunk of one sequence); later steps grow it like the full group.
struct WindowGroup {
  int64_t window = 0;          // positions a query sees (its own included); 0: no window group
  int64_t pages_per_rank = 0;  // the window group's pages per rank
  int64_t first_chunk = 0;     // positions a sequence computes in one step at most
};

// Pages on demand: admission reserves the pages of a prompt's positions only (a resumed
// sequence's: of every token it holds); a sequence grows by the pages its next step's positions
// need beyond what it holds and has reserved (growth, grow). When a rank has none left, the
// scheduler preempts (preempt: every page released, tokens kept) and the sequence is admitted
// again later, recomputing what the prefix cache no longer holds.

// One rank's pages of one sequence, as a PagedEntry points into them.
struct EntryPages {
  std::vector<int32_t> ids;
  std::vector<int64_t> pos;
  std::vector<int32_t> len;
  int64_t index0 = 0;  // this rank's pages of the sequence before ids[0] (dropped window pages)
};

class KVManager {
 public:
  KVManager(int ranks, int64_t pages_per_rank, int64_t page_tokens, bool prefix_cache,
            WindowGroup window = {});

  PageTable& table() { return table_; }
  const PageTable& table() const { return table_; }
  // The window group's table (has_window() only).
  bool has_window() const { return window_.window > 0; }
  int64_t window() const { return window_.window; }
  PageTable& window_table() { return *wtable_; }
  const PageTable& window_table() const { return *wtable_; }
  // Entries of a need vector: one per rank of each group.
  std::size_t need_size() const {
    return static_cast<std::size_t>(ranks()) * (has_window() ? 2u : 1u);
  }
  // The first logical page that a query at position `pos` or later can still see.
  int64_t window_first_live(int64_t pos) const;
  int ranks() const { return table_.ranks(); }
  int64_t page_tokens() const { return T_; }
  bool prefix_cache() const { return prefix_cache_; }
  // Tokens one sequence can ever hold: p ranks of pages_per_rank pages of T tokens.
  int64_t max_sequence_tokens() const;
  // Full pages of an n-token prompt that can come from the prefix cache: all before its last
  // token, whose logits start the generation.
  int64_t reusable_pages(int64_t n) const { return (n - 1) / T_; }

  // The prefix hits of `tokens` and the pages per rank for its positions (every token's K/V
  // is stored as the prompt is prefilled); a cached hit counts against its rank's available
  // pages (it leaves the LRU).
  AdmissionFit fit(std::span<const TokenId> tokens) const;
  // Commits a fitting admission to s: references the hits, reserves `need`, and sets the
  // sequence's pages, hashes, computed and cached_tokens.
  void take(const AdmissionFit& fit, Sequence& s);
  // Allocates, on their owners, the pages of positions [s.computed, s.computed + n) that s does
  // not hold yet (from its reservation), in each group; appends to *mine (*window_mine) those
  // of rank `me`.
  Status allocate(Sequence& s, int64_t n, int me, std::vector<PageRef>* mine,
                  std::vector<PageRef>* window_mine = nullptr);
  // Per rank: the pages positions [s.computed, s.computed + n) need beyond those s holds and
  // has reserved.
  std::vector<int64_t> growth(const Sequence& s, int64_t n) const;
  // The first rank that cannot reserve `need` more pages, or -1.
  int short_rank(std::span<const int64_t> need) const;
  // Reserves `need` more pages for s (the caller checked short_rank).
  void grow(Sequence& s, std::span<const int64_t> need);
  // Hashes the pages that s.computed has filled since the last call and, with the prefix cache
  // on, indexes them (in both groups); then drops the window pages no later query sees.
  void index_full_pages(Sequence& s);
  // Releases s's pages and its unused reservation, deepest page first: released pages that are
  // indexed join the LRU list in that order, so eviction takes a chain from its tail and its
  // head stays a prefix hit while any of it is cached.
  void release(Sequence& s);
  // release(s), and s holds nothing: no pages, hashes or reservation, computed 0 (its tokens
  // stay, for a later fit and take).
  void preempt(Sequence& s);
  // Rank me's pages of s for positions [0, end), as the paged kernel reads them: of the full
  // group, or of the window group (the dropped ones counted in out.index0).
  void entry_pages(const Sequence& s, int64_t end, int me, EntryPages& out) const;
  void window_entry_pages(const Sequence& s, int64_t end, int me, EntryPages& out) const;
  // Consistency of both tables and of every live sequence's view (tests).
  Status check() const;

 private:
  PageTable& group(std::size_t i) { return i < static_cast<std::size_t>(ranks()) ? table_ : *wtable_; }
  const PageTable& group(std::size_t i) const {
    return i < static_cast<std::size_t>(ranks()) ? table_ : *wtable_;
  }
  void drop_window_pages(Sequence& s);

  PageTable table_;
  int64_t T_;
  bool prefix_cache_;
  WindowGroup window_;
  std::unique_ptr<PageTable> wtable_;
};

// Fills a page with NaN in every layer's pool (K and V), so a read of a stale or unwritten slot
// shows in the logits. kv_width: KV heads x head dim.
void poison_page(std::span<TiledKVCache> pools, PageRef page, int64_t page_tokens,
                 int64_t kv_width);

}  // namespace treeattn::engine
