// decode_partial_paged() (include/treeattn/paged_kv.hpp): validation, the work plan, the page
// driver and the scalar reference page kernel.
//
// Vocabulary. An entry is one sequence's queries and its pages on this rank. A query block is
// at most kPagedQueryBlock consecutive queries of one entry; a group is kPagedGroupPages
// consecutive pages of the entry's page list (group g = pages [4g, 4g + 4)). A work item is
// (entry, KV head, query block, group); its rows are the R = group * (queries in the block)
// query rows that read that KV head, row r = query (r / group), head (r % group) as in the
// tiled item kernel. A cell is (entry, KV head, query block): its items are its groups.
//
// An item runs the tiled item kernel (cpu_targets.hpp; unchanged) once per page with the
// page's tile as a one-tile chunk: tokens = page_len, and per row the tokens of the page its
// query sees, clamp(first_pos + i + 1 - page_pos, 0, page_len). The first page's states are
// written into the item's slot; each later page continues them (TiledItemArgs::keep: the
// kernel's online softmax goes on from the slot's records, in page order), which saves the two
// exps and three passes over each record per page and row of a separate state_merge. Pages no row of the item sees are skipped (they
// would add nothing). Afterwards each query row's states are the merge of
// its cell's group slots in group order, starting from the empty state.
//
// Why a row's bits depend only on its query, its causal limit and its pages' contents: the
// item kernel computes every row on its own (per-row score accumulators of the same FMA
// sequence whatever the row grouping, per-row online softmax over a block of exactly page_len
// tokens, value accumulation per row in token order; rows that share a value tile and rows
// that finish alone run the same FMAs), the page set of a group is fixed by the page list, and
// the merges run in a fixed order. The query block, the other entries, the thread count and
// the item a row shares do not enter any row's arithmetic. Only the last query of a block
// decides how many groups the cell has; groups past a row's limit are empty for that row.
//
// Prefill (cells of entries with >= kPagedBlockMinQueries queries, PagedKernelChoice): cells
// of kPagedBlockQueryBlock queries, and the page kernel is the prefill block kernel
// (prefill_block_impl.hpp), which has the tiled item kernel's contract and bits for a one-tile
// chunk; the plan, the page order and the merges are the same, so a row's bits are too.
//
// kReference runs the same driver with a scalar page kernel (decode_tiled_reference's
// per-token online softmax), so it follows the same page and group merge structure.
//
// Compiled for the baseline ISA; only the item kernels are per target.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/cpu/driver_tuning.hpp"
#include "kernels/cpu/item_driver.hpp"
#include "kernels/kernel_impl.hpp"
#include "treeattn/paged_kv.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace kernels {
namespace {

using cpu::TiledItemArgs;
using cpu::TiledItemFn;

// Queries per work item. A fixed number, never derived from the thread count or the call:
// with the group, it bounds the rows an item kernel runs (16 queries x group 4 = 64 rows) and
// the score scratch; prefill chunks longer than this read each page once per block.
constexpr int64_t kPagedQueryBlock = 16;
// Queries per work item for the prefill block kernel: 64 queries x group 3 = 192 rows per
// widened page in L1 (the widening and the page's trip from L2 amortised over them); also a
// fixed number.
constexpr int64_t kPagedBlockQueryBlock = 64;
// Slot floats per wave of items (below): 32 MiB. A decode step's wave holds every item; a
// prefill chunk of 512 queries over 32k tokens (group 4, 8 KV heads, D 128: ~1 GiB of group
// states) runs in waves of about a thousand items.
constexpr std::size_t kPagedWaveFloats = std::size_t{8} << 20;

// The scalar reference page kernel, with the tiled item kernel's contract (one chunk of
// a.tokens tokens in tiles, per-row visible counts): decode_tiled_reference's per-token online
// softmax in float, reading K and V through the tile addressing.
void reference_tiled_item(const TiledItemArgs& a) {
  const int64_t D = a.head_dim, T = a.tile_tokens;
  const auto d_size = static_cast<std::size_t>(D);
  const std::size_t rec = d_size + 2;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  if (!a.keep)  // else continue the records' states
    for (int r = 0; r < a.rows; ++r)
      state_set_empty(a.out + static_cast<std::size_t>(r) * rec, d_size);
  int64_t seen = 0;  // tokens some row sees
  for (int r = 0; r < a.rows; ++r) seen = std::max(seen, a.visible[r]);
  std::vector<float> kf(d_size), vf(d_size);
  for (int64_t t = 0; t < seen; ++t) {
    const int64_t tile = t / T, lane = t % T;
    const auto* kt = reinterpret_cast<const uint8_t*>(a.k + tile * a.tile_stride);
    const auto* vt = reinterpret_cast<const uint8_t*>(a.v + tile * a.tile_stride);
    float ks = 1.0f, vs = 1.0f;
    if (a.k_scale != nullptr) {
      ks = bf16_value(a.k_scale[tile * a.scale_tile_stride + lane]);
      vs = bf16_value(a.v_scale[tile * a.scale_tile_stride + lane]);
    }
    for (int64_t d = 0; d < D; ++d) {
      kf[static_cast<std::size_t>(d)] = dequantize(
          kt, a.dtype, static_cast<std::size_t>(kv_tile_k_index(T, D, lane, d)), ks);
      vf[static_cast<std::size_t>(d)] =
          dequantize(vt, a.dtype, static_cast<std::size_t>(kv_tile_v_index(T, D, lane, d)), vs);
    }
    for (int r = 0; r < a.rows; ++r) {
      if (t >= a.visible[r]) continue;
      if (a.visible_from != nullptr && t < a.visible_from[r]) continue;
      const float* qv = a.q + r * D;
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += qv[d] * kf[static_cast<std::size_t>(d)];
      const float s = dot * a.scale;
      if (s == kNegInf) continue;
      float* st = a.out + static_cast<std::size_t>(r) * rec;
      float m = state_m(st);
      const float m_new = (std::isnan(s) || std::isnan(m)) ? kNaN : (s > m ? s : m);
      if (m_new != m) {
        const float al = (m == kNegInf) ? 0.0f : std::exp(m - m_new);
        state_l(st) *= al;
        for (int64_t d = 0; d < D; ++d) state_o(st)[d] *= al;
        state_m(st) = m_new;
        m = m_new;
      }
      const float p = std::exp(s - m);
      state_l(st) += p;
      for (int64_t d = 0; d < D; ++d) state_o(st)[d] += p * vf[static_cast<std::size_t>(d)];
    }
  }
}

// One cell: the `nq` queries from q0 of entry e against KV head kvh; its items (groups) are
// [first, first + groups) of the plan.
struct PagedCell {
  int64_t e, kvh, q0, nq, first, groups;
  bool block;  // runs the prefill block kernel (else the tiled item kernel per page)
};
// One work item: pages [p0, p1) of its cell's entry; its R = group * nq state records start
// `slot` floats after the first item's.
struct PagedItem {
  int64_t cell, p0, p1;
  std::size_t slot;
};

std::string where(std::size_t e, std::size_t j) {
  return "paged entry " + std::to_string(e) + ", page " + std::to_string(j);
}

Status validate_entries(const TiledKVShard& pool, int64_t pool_pages,
                        std::span<const PagedEntry> entries) {
  const int64_t T = pool.tile_tokens;
  for (std::size_t e = 0; e < entries.size(); ++e) {
    const PagedEntry& en = entries[e];
    const std::string name = "paged entry " + std::to_string(e);
    if (en.n_q < 1)
      return invalid_argument(name + ": n_q must be >= 1, got " + std::to_string(en.n_q));
    if (en.q == nullptr) return invalid_argument(name + ": query pointer is null");
    if (en.states == nullptr) return invalid_argument(name + ": state output pointer is null");
    int64_t limit = 0;
    if (en.first_pos < 0 || __builtin_add_overflow(en.first_pos, en.n_q, &limit))
      return invalid_argument(name + ": first_pos " + std::to_string(en.first_pos) +
                              " must be >= 0 (with first_pos + n_q inside int64)");
    if (en.window < 0)
      return invalid_argument(name + ": window must be >= 0 (0: none), got " +
                              std::to_string(en.window));
    if (en.page_index0 < 0)
      return invalid_argument(name + ": page_index0 must be >= 0, got " +
                              std::to_string(en.page_index0));
    if (en.page_pos.size() != en.pages.size() || en.page_len.size() != en.pages.size())
      return invalid_argument(
          name + ": pages, page_pos and page_len must have the same size, got " +
          std::to_string(en.pages.size()) + ", " + std::to_string(en.page_pos.size()) + ", " +
          std::to_string(en.page_len.size()));
    int64_t prev_end = 0;  // first position after the previous page
    for (std::size_t j = 0; j < en.pages.size(); ++j) {
      const int64_t page = en.pages[j], pos = en.page_pos[j], len = en.page_len[j];
      if (page < 0 || page >= pool_pages)
        return invalid_argument(where(e, j) + ": pool page index " + std::to_string(page) +
                                " is outside the pool of " + std::to_string(pool_pages) + " pages");
      if (len < 1 || len > T)
        return invalid_argument(where(e, j) + ": page_len " + std::to_string(len) +
                                " must be in 1.." + std::to_string(T) + " (the tile size)");
      int64_t end = 0;
      if (pos < 0 || __builtin_add_overflow(pos, len, &end))
        return invalid_argument(where(e, j) + ": page_pos " + std::to_string(pos) +
                                " must be >= 0 (with page_pos + page_len inside int64)");
      if (j > 0 && pos < prev_end)
        return invalid_argument(where(e, j) + ": page_pos " + std::to_string(pos) +
                                " overlaps or precedes page " + std::to_string(j - 1) +
                                " (positions " + std::to_string(en.page_pos[j - 1]) + ".." +
                                std::to_string(prev_end - 1) +
                                "); pages must be in ascending, non-overlapping positions");
      prev_end = end;
    }
  }
  return Status::ok();
}

// Pages of an entry that a query with causal limit `limit` needs: the prefix whose first
// position is <= limit (positions ascend).
int64_t pages_needed(const PagedEntry& en, int64_t limit) {
  return std::upper_bound(en.page_pos.begin(), en.page_pos.end(), limit) - en.page_pos.begin();
}

// Runs one item: pages [p0, p1) of the cell's entry, page by page, into its slot.
void run_item(TiledItemFn page_fn, TiledItemFn block_fn, const AttnShape& shape, const TiledKVShard& pool,
              const PagedEntry& en, const PagedCell& cell, int64_t p0, int64_t p1, float* slot,
              float scale, int64_t prefetch_bytes, bool prefetch_l2) {
  const int64_t H = shape.heads, D = shape.head_dim, G = shape.group();
  const int64_t T = pool.tile_tokens;
  const std::size_t rec = static_cast<std::size_t>(D) + 2;
  const int64_t ld = (T + 31) / 32 * 32;  // tiled_score_ld() of a one-tile block
  const int64_t R = G * cell.nq;
  const auto ur = static_cast<std::size_t>(R);
  // Per-thread scratch, grown only: query rows, visible counts, scores, one page's states.
  struct ThreadScratch {
    std::vector<float> q, scores;
    std::vector<int64_t> visible, from;
  };
  thread_local ThreadScratch ts;
  cpu::grow(ts.q, ur * static_cast<std::size_t>(D));
  cpu::grow(ts.visible, ur);
  cpu::grow(ts.from, ur);
  cpu::grow(ts.scores, cell.block ? static_cast<std::size_t>(cpu::prefill_block_scratch_floats(T, D))
                                  : (ur + 2) * static_cast<std::size_t>(ld));
  if (cell.block) page_fn = block_fn;
  for (int64_t qi = 0; qi < cell.nq; ++qi)
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(ts.q.data() + (qi * G + g) * D,
                  en.q + ((cell.q0 + qi) * H + cell.kvh * G + g) * D,
                  static_cast<std::size_t>(D) * sizeof(float));

  TiledItemArgs a;
  a.head_dim = static_cast<int>(D);
  a.dtype = pool.dtype;
  a.tile_tokens = static_cast<int>(T);
  a.tile_stride = pool.tile_stride;
  a.scale_tile_stride = pool.scale_tile_stride;
  a.rows = static_cast<int>(R);
  a.q = ts.q.data();
  a.visible = ts.visible.data();
  a.visible_from = en.window > 0 ? ts.from.data() : nullptr;
  a.scale = scale;
  a.block_tiles = 1;
  a.scores = ts.scores.data();
  a.prefetch_bytes = prefetch_bytes;
  a.prefetch_l2 = prefetch_l2;
  // The next page's prefetch (below): one stream when a page's V lies inside its K record (the
  // interleaved layout, as the item kernel decides), and at most one record of it.
  const char* const k0 = static_cast<const char*>(pool.k);
  const char* const v0 = static_cast<const char*>(pool.v);
  const bool one_stream = v0 > k0 && v0 < k0 + pool.tile_stride;
  const int64_t next_bytes = std::min(prefetch_bytes, pool.tile_stride);
  bool first = true;
  for (int64_t j = p0; j < p1; ++j) {
    const auto uj = static_cast<std::size_t>(j);
    const int64_t pos = en.page_pos[uj], len = en.page_len[uj];
    int64_t any = 0;
    for (int64_t qi = 0; qi < cell.nq; ++qi) {
      const int64_t at = en.first_pos + cell.q0 + qi;  // the query's position
      int64_t vis = std::clamp<int64_t>(at + 1 - pos, 0, len);
      // A sliding window: the query sees positions > at - window only.
      const int64_t from = en.window > 0 ? std::clamp<int64_t>(at - en.window + 1 - pos, 0, len) : 0;
      if (from >= vis) vis = 0;  // the whole page is outside the window
      any = std::max(any, vis);
      for (int64_t g = 0; g < G; ++g) {
        ts.visible[static_cast<std::size_t>(qi * G + g)] = vis;
        ts.from[static_cast<std::size_t>(qi * G + g)] = from;
      }
    }
    if (any == 0) continue;  // empty states for every row: the merge identity
    const int64_t page = en.pages[uj];
    const int64_t off = cell.kvh * pool.head_stride + page * pool.tile_stride;
    a.k = k0 + off;
    a.v = v0 + off;
    if (dtype_is_quantized(pool.dtype)) {
      const int64_t soff = cell.kvh * pool.scale_head_stride + page * pool.scale_tile_stride;
      a.k_scale = pool.k_scale + soff;
      a.v_scale = pool.v_scale + soff;
    }
    a.tokens = len;
    a.out = slot;
    a.keep = !first;
    // The item kernel's prefetch stops at its page's end. Where the next page is not the pool
    // record that follows (a sequence's pages once the free list has been churned), request its
    // first lines now, while this page is computed: the hardware prefetchers cannot guess it.
    // Measure: PagedKernel.DISABLED_ThroughputVsTiled (shuffled pages;
    // --gtest_also_run_disabled_tests). Where the next page does follow (a fresh engine's pages)
    // nothing is requested: requesting it there too was slower in `treeattn generate --model
    // smollm2-135m --prompt-tokens 16384 --new-tokens 33 --ignore-eos --threads 1`.
    if (next_bytes > 0 && j + 1 < p1 && en.pages[uj + 1] != page + 1) {
      const int64_t next = cell.kvh * pool.head_stride + en.pages[uj + 1] * pool.tile_stride;
      const char* nk = k0 + next;
      const char* nv = v0 + next;
      auto fetch = [&](auto locality) {
        for (int64_t b = 0; b < next_bytes; b += 64) {
          __builtin_prefetch(nk + b, 0, decltype(locality)::value);
          if (!one_stream) __builtin_prefetch(nv + b, 0, decltype(locality)::value);
        }
      };
      if (prefetch_l2)
        fetch(std::integral_constant<int, 2>{});  // prefetcht1: into L2
      else
        fetch(std::integral_constant<int, 3>{});  // prefetcht0: into L1
    }
    page_fn(a);
    first = false;
  }
  if (first)
    for (std::size_t r = 0; r < ur; ++r)
      state_set_empty(slot + r * rec, static_cast<std::size_t>(D));
}

Status run_paged(TiledItemFn page_fn, TiledItemFn block_fn, const AttnShape& shape, const TiledKVShard& pool,
                 std::span<const PagedEntry> entries, const ResolvedOptions& opt) {
  const int64_t H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim, G = shape.group();
  const std::size_t rec = static_cast<std::size_t>(D) + 2;
  const cpu::DriverChoice tuned = cpu::driver_choice(pool.dtype, D, G, opt.threads, opt.isa);
  const int64_t prefetch_bytes = tuned.paged_prefetch;

  // The plan: cells, items and slots (grown only, owned by the calling thread).
  struct Plan {
    std::vector<PagedCell> cells;
    std::vector<PagedItem> items;
    std::vector<float> slots;
  };
  thread_local Plan plan;
  plan.cells.clear();
  plan.items.clear();
  std::size_t slot_floats = 0;
  const PagedKernelChoice choice = paged_kernel_choice();
  for (std::size_t e = 0; e < entries.size(); ++e) {
    const PagedEntry& en = entries[e];
    const bool block =
        choice == PagedKernelChoice::kBlock ||
        (choice == PagedKernelChoice::kAuto && en.n_q >= kPagedBlockMinQueries);
    const int64_t qblock = block ? kPagedBlockQueryBlock : kPagedQueryBlock;
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t q0 = 0; q0 < en.n_q; q0 += qblock) {
        const int64_t nq = std::min(qblock, en.n_q - q0);
        const int64_t needed = pages_needed(en, en.first_pos + q0 + nq - 1);
        // Groups are fixed by a page's index in the sequence's list (page_index0 + j), so an
        // entry whose leading pages were dropped groups the rest as the full list would.
        const int64_t g0 = en.page_index0 / kPagedGroupPages;
        const int64_t groups =
            needed == 0 ? 0 : (en.page_index0 + needed - 1) / kPagedGroupPages + 1 - g0;
        const auto cell = static_cast<int64_t>(plan.cells.size());
        plan.cells.push_back({static_cast<int64_t>(e), kvh, q0, nq,
                              static_cast<int64_t>(plan.items.size()), groups, block});
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t p0 = std::max<int64_t>(0, (g0 + g) * kPagedGroupPages - en.page_index0);
          const int64_t p1 = std::min(needed, (g0 + g + 1) * kPagedGroupPages - en.page_index0);
          plan.items.push_back({cell, p0, p1, slot_floats});
          slot_floats += static_cast<std::size_t>(G * nq) * rec;
        }
      }
  }
  const int64_t n_items = static_cast<int64_t>(plan.items.size());
  const int64_t n_cells = static_cast<int64_t>(plan.cells.size());
  const PagedItem* items = plan.items.data();
  const PagedCell* cells = plan.cells.data();
  auto dst_of = [&](const PagedCell& cell, int64_t qi, int64_t g) {
    return entries[static_cast<std::size_t>(cell.e)].states +
           static_cast<std::size_t>((cell.q0 + qi) * H + cell.kvh * G + g) * rec;
  };

  // Every query row starts empty and gets its cell's group states merged in group order. Rows
  // of cells without a group (no page visible to the block) stay empty.
  for (int64_t c = 0; c < n_cells; ++c)
    if (cells[c].groups == 0)
      for (int64_t qi = 0; qi < cells[c].nq; ++qi)
        for (int64_t g = 0; g < G; ++g)
          state_set_empty(dst_of(cells[c], qi, g), static_cast<std::size_t>(D));

  // Items run in waves of at most kPagedWaveFloats floats of slots (one item at least), so a
  // long prefill chunk does not need a slot per (query row, group) of the whole call at once.
  // Each wave merges its slots into the rows after its items ran; waves run in item order, so
  // every row still gets its groups merged in group order (waves change no bit). A wave's items
  // run on a guided schedule, as the decode driver's (item_driver.hpp): a thread takes runs of
  // consecutive groups of a cell, so that it reads a sequence's pages in order rather than every
  // other group of them.
  auto slot_end = [&](int64_t i) {
    return items[i].slot + static_cast<std::size_t>(G * cells[items[i].cell].nq) * rec;
  };
  for (int64_t i0 = 0; i0 < n_items;) {
    const std::size_t base = items[i0].slot;
    int64_t i1 = i0 + 1;
    while (i1 < n_items && slot_end(i1) - base <= kPagedWaveFloats) ++i1;
    cpu::grow(plan.slots, slot_end(i1 - 1) - base);
    float* slots = plan.slots.data();

#pragma omp parallel for schedule(guided) num_threads(opt.threads)
    for (int64_t i = i0; i < i1; ++i) {
      const PagedItem& it = items[i];
      const PagedCell& cell = cells[it.cell];
      run_item(page_fn, block_fn, shape, pool, entries[static_cast<std::size_t>(cell.e)], cell, it.p0, it.p1,
               slots + (it.slot - base), opt.scale, prefetch_bytes, tuned.paged_l2);
    }

    const int64_t c0 = items[i0].cell, c1 = items[i1 - 1].cell + 1;
#pragma omp parallel for schedule(static) num_threads(opt.threads)
    for (int64_t c = c0; c < c1; ++c) {
      const PagedCell& cell = cells[c];
      const int64_t k0 = std::max(cell.first, i0), k1 = std::min(cell.first + cell.groups, i1);
      for (int64_t qi = 0; qi < cell.nq; ++qi)
        for (int64_t g = 0; g < G; ++g) {
          float* dst = dst_of(cell, qi, g);
          if (k0 == cell.first) state_set_empty(dst, static_cast<std::size_t>(D));
          for (int64_t k = k0; k < k1; ++k)
            state_merge(dst,
                        slots + (items[k].slot - base) + static_cast<std::size_t>(qi * G + g) * rec,
                        static_cast<std::size_t>(D));
        }
    }
    i0 = i1;
  }
  return Status::ok();
}

std::atomic<int> g_choice{-1};  // -1: not read from the environment yet

PagedKernelChoice choice_from_env() {
  const char* e = std::getenv("TREEATTN_PAGED_KERNEL");
  if (e == nullptr) return PagedKernelChoice::kAuto;
  const std::string v = e;
  if (v == "page") return PagedKernelChoice::kPerPage;
  if (v == "block") return PagedKernelChoice::kBlock;
  return PagedKernelChoice::kAuto;
}

}  // namespace
}  // namespace kernels

PagedKernelChoice paged_kernel_choice() {
  int c = kernels::g_choice.load(std::memory_order_relaxed);
  if (c < 0) {
    c = static_cast<int>(kernels::choice_from_env());
    kernels::g_choice.store(c, std::memory_order_relaxed);
  }
  return static_cast<PagedKernelChoice>(c);
}

void set_paged_kernel_choice(PagedKernelChoice choice) {
  kernels::g_choice.store(static_cast<int>(choice), std::memory_order_relaxed);
}

Status decode_partial_paged(const AttnShape& shape, const TiledKVShard& pool, int64_t pool_pages,
                            std::span<const PagedEntry> entries, const DecodeOptions& options) {
  AttnShape s = shape;
  s.batch = 1;
  s.q_len = 1;
  TREEATTN_RETURN_IF_ERROR(s.validate());
  if (pool.memory != MemorySpace::kHost)
    return unsupported("decode_partial_paged runs on host memory; the page pool is device memory");
  if (pool_pages < 0)
    return invalid_argument("pool_pages must be >= 0, got " + std::to_string(pool_pages));
  int64_t pool_tokens = 0;
  if (__builtin_mul_overflow(pool_pages, pool.tile_tokens, &pool_tokens))
    return invalid_argument("pool of " + std::to_string(pool_pages) + " pages of " +
                            std::to_string(pool.tile_tokens) + " tokens overflows int64");
  {
    // The pool as one batch row holding every page: the tiled view's checks of the tile size,
    // strides, pointers and scales.
    TiledKVShard whole = pool;
    const int64_t zero = 0;
    whole.len = {&pool_tokens, 1};
    whole.pos_start = {&zero, 1};
    whole.total_len = {&pool_tokens, 1};
    whole.pos_stride = 1;
    whole.batch_stride = 0;
    whole.scale_batch_stride = 0;
    const Status st = whole.validate(s);
    if (!st.is_ok()) return Status(st.code(), "page pool: " + st.message());
  }
  TREEATTN_RETURN_IF_ERROR(kernels::validate_entries(pool, pool_pages, entries));
  static const float kAny = 0.0f;  // resolve_options checks pointers; entries were checked above
  auto r = kernels::resolve_options(s, &kAny, &kAny, options);
  TREEATTN_RETURN_IF_ERROR(r.status());
  // kReference runs its scalar page kernel for every query block.
  kernels::cpu::TiledItemFn fn = &kernels::reference_tiled_item, block_fn = fn;
  if (r->isa != Isa::kReference) {
    fn = kernels::cpu::tiled_item_for(r->isa);
    block_fn = kernels::cpu::prefill_block_for(r->isa);
    if (fn == nullptr || block_fn == nullptr)
      return unsupported("ISA target " + std::string(isa_name(r->isa)) +
                         " is not built into this library");
  }
  return kernels::run_paged(fn, block_fn, s, pool, entries, *r);
}

}  // namespace treeattn
