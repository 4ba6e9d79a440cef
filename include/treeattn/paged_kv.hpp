// Paged attention: the partial attention states of many sequences' queries against their pages
// of one rank's page pool, in one kernel pass.
//
// The pool is a tiled KV cache (kv_tiles.hpp) of batch 1 whose tiles are the pages: page `p` of
// KV head h is tile p of (row 0, head h), one page = tile_tokens consecutive global positions of
// one sequence. A serving engine (engine.hpp) keeps one pool per layer and per rank; a sequence
// is a list of pages spread over the ranks, and the pages it holds on this rank are given here
// in the sequence's logical order (page_pos ascending), with how many tokens each holds.
//
// Per sequence entry, query i (0 <= i < n_q) sees the tokens at global positions
// <= first_pos + i (the causal limit: a prefill chunk's T queries at positions first_pos ..
// first_pos + T - 1, or a decode step's one query at the sequence's last position). States are
// the records of state.hpp, [n_q][heads] per entry, unnormalized; an entry with no pages, or
// whose pages hold no visible token for a query, yields the empty state (m = -inf, l = 0,
// o = 0) for it.
//
// Determinism, the property a batch-invariant server is built on: the state of one query row is
// a function of that row's query vector, its causal limit and its pages' contents only. Pages
// are grouped in fixed groups of kPagedGroupPages pages by their index in the sequence's page
// list on this rank (page_index0 + their index in the entry's list);
// inside a group one online softmax runs over the pages in page order (each page continues the
// states the earlier ones left), then the groups are merged in order. Nothing depends on the other entries of the call,
// on n_q, on which other queries share a work item, or on the thread count. In particular a
// query computed as row i of a prefill chunk and the same query computed alone (n_q = 1) give
// the same bits.
//
// Work (paged_kernels.cpp): items of (entry, KV head, block of at most 16 queries, group), run
// on OpenMP threads; an item runs the tiled decode item kernel once per page (a one-tile chunk
// of page_len tokens), each page continuing the item's states; each query row then merges its
// groups. The
// item kernel computes every row on its own (per-row scores, softmax and value sums in token
// order), so the rows an item shares never change a row's bits. kReference runs a scalar page
// kernel in the same structure. Scratch is thread-local and grows only; group states are held
// in waves of at most 32 MiB, so a long prefill chunk needs no per-(query, group) buffer.
// Entries of at least kPagedBlockMinQueries queries (prefill chunks) run items of 64 queries
// with the prefill block kernel instead of the per-page decode item kernel (PagedKernelChoice
// below): same pages, same order, the same bits per row, loops ordered for compute.
#pragma once

#include <cstdint>
#include <span>

#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// Pages per merge group (256 tokens with 64-token pages: the decode kernel's chunk).
inline constexpr int64_t kPagedGroupPages = 4;

// One sequence's queries and its pages on this rank.
struct PagedEntry {
  const float* q = nullptr;  // [n_q][heads][head_dim] floats
  int64_t n_q = 1;           // >= 1
  int64_t first_pos = 0;     // >= 0; query i sees global positions <= first_pos + i
  int64_t window = 0;        // > 0: query i sees only positions > first_pos + i - window (a
                             // sliding window of `window` positions, its own included)
  std::span<const int32_t> pages;     // pool page indices, in the sequence's order (pages
                                      // are only read: entries may share pages, e.g. a prefix)
  std::span<const int64_t> page_pos;  // global position of slot 0 of each page (ascending)
  std::span<const int32_t> page_len;  // tokens held by each page, 1 .. tile_tokens
  int64_t page_index0 = 0;  // >= 0: the index of pages[0] in the sequence's pages on this rank
                            // (the pages before it were dropped: a sliding window no longer
                            // sees them); it fixes the merge groups, so dropping pages that no
                            // query sees changes no bit
  float* states = nullptr;            // out: [n_q][heads] records of head_dim + 2 floats,
                                      // every one overwritten
};

// pool: a view of the whole pool (TiledKVCache::view of batch 1; its len / pos_start / total_len
// spans are not used and may be empty), pool_pages its number of pages (capacity / tile_tokens).
// shape: heads, kv_heads and head_dim (batch and q_len are not used). Validates the shape, the
// pool (tile size, strides, pointers and scales for pool_pages pages, as TiledKVShard::validate)
// and every entry (page indices inside the pool, lengths in 1 .. tile_tokens, positions >= 0,
// ascending and non-overlapping, span sizes equal, n_q >= 1, first_pos >= 0, non-null q and
// states) before computing anything: kInvalidArgument naming the entry and the page
// ("paged entry 2, page 5: ..."). options: as decode_partial (kernel.hpp); chunk_tokens is not
// used (the group size above is fixed). Every Isa target gives results within the oracle
// tolerance; each target is bitwise deterministic as described above. Pages past every query's
// causal limit are never read; slots past page_len never reach a result.
Status decode_partial_paged(const AttnShape& shape, const TiledKVShard& pool, int64_t pool_pages,
                            std::span<const PagedEntry> entries,
                            const DecodeOptions& options = {});

// The item kernel decode_partial_paged runs for a query block. Both give every row the same
// bits (the block kernel only reorders loops; see paged_kernels.cpp), so the choice is a speed
// matter, exposed for the tests and benchmarks that compare them:
//   kPerPage: the tiled decode item kernel once per page (memory-streaming: each page's K and
//             V tiles pass once per query block of kPagedQueryBlock queries);
//   kBlock:   the prefill block kernel (compute-bound: a block of query rows against each K/V
//             tile held in cache, causal tiles above the diagonal never read);
//   kAuto:    kBlock for query blocks of at least kPagedBlockMinQueries queries, else kPerPage.
// The environment variable TREEATTN_PAGED_KERNEL=auto|page|block sets the initial choice
// (read once); set_paged_kernel_choice() overrides it (call it only while no paged kernel runs).
enum class PagedKernelChoice : uint8_t { kAuto, kPerPage, kBlock };
inline constexpr int64_t kPagedBlockMinQueries = 8;
PagedKernelChoice paged_kernel_choice();
void set_paged_kernel_choice(PagedKernelChoice choice);

}  // namespace treeattn
