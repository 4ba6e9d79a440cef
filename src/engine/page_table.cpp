// PageTable: see page_table.hpp.
#include "engine/page_table.hpp"

#include <algorithm>
#include <functional>

namespace treeattn::engine {
namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64 finaliser over (h + v): a 64-bit chain hash; collisions are checked anyway.
  uint64_t z = h + 0x9e3779b97f4a7c15ull + v * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string where(PageRef p) {
  return "rank " + std::to_string(p.rank) + " page " + std::to_string(p.id);
}

}  // namespace

PageTable::PageTable(int ranks, int64_t pages_per_rank, int64_t page_tokens)
    : ranks_(ranks), pages_(pages_per_rank), page_tokens_(page_tokens) {
  ranks_v_.resize(static_cast<std::size_t>(ranks));
  for (Rank& r : ranks_v_) {
    r.pages.resize(static_cast<std::size_t>(pages_per_rank));
    r.free.resize(static_cast<std::size_t>(pages_per_rank));
    for (int64_t i = 0; i < pages_per_rank; ++i)
      r.free[static_cast<std::size_t>(i)] = static_cast<int32_t>(i);
    std::make_heap(r.free.begin(), r.free.end(), std::greater<>());
  }
}

std::vector<int64_t> PageTable::pages_needed(int64_t first_page, int64_t end_page) const {
  std::vector<int64_t> n(static_cast<std::size_t>(ranks_), 0);
  for (int64_t j = first_page; j < end_page; ++j) ++n[static_cast<std::size_t>(owner(j))];
  return n;
}

int64_t PageTable::free_pages(int rank) const {
  return static_cast<int64_t>(ranks_v_[static_cast<std::size_t>(rank)].free.size());
}
int64_t PageTable::cached_pages(int rank) const {
  return static_cast<int64_t>(ranks_v_[static_cast<std::size_t>(rank)].lru.size());
}
int64_t PageTable::used_pages(int rank) const {
  return ranks_v_[static_cast<std::size_t>(rank)].used;
}
int64_t PageTable::reserved(int rank) const {
  return ranks_v_[static_cast<std::size_t>(rank)].reserved;
}
int64_t PageTable::available(int rank) const {
  return free_pages(rank) + cached_pages(rank) - reserved(rank);
}

void PageTable::reserve(std::span<const int64_t> count) {
  for (int r = 0; r < ranks_; ++r) ranks_v_[static_cast<std::size_t>(r)].reserved += count[static_cast<std::size_t>(r)];
}
void PageTable::unreserve(std::span<const int64_t> count) {
  for (int r = 0; r < ranks_; ++r) ranks_v_[static_cast<std::size_t>(r)].reserved -= count[static_cast<std::size_t>(r)];
}

Result<PageRef> PageTable::allocate(int rank) {
  Rank& R = ranks_v_[static_cast<std::size_t>(rank)];
  if (R.reserved <= 0)
    return internal_error("page table: allocation on rank " + std::to_string(rank) +
                          " without a reservation");
  PageRef ref{rank, -1};
  if (!R.free.empty()) {
    std::pop_heap(R.free.begin(), R.free.end(), std::greater<>());
    ref.id = R.free.back();
    R.free.pop_back();
  } else if (!R.lru.empty()) {
    ref.id = R.lru.front();
    R.lru.pop_front();
    Page& p = page(ref);
    index_.erase(p.hash);
    p.is_indexed = false;
    p.hash = 0;
  } else {
    return internal_error("page table: rank " + std::to_string(rank) +
                          " has a reservation but no free or cached page");
  }
  Page& p = page(ref);
  p.on_free_list = false;
  p.refs = 1;
  --R.reserved;
  ++R.used;
  return ref;
}

void PageTable::acquire(PageRef ref) {
  Page& p = page(ref);
  Rank& R = ranks_v_[static_cast<std::size_t>(ref.rank)];
  if (p.refs == 0) {  // cached: leaves the LRU list
    R.lru.erase(p.lru);
    ++R.used;
  }
  ++p.refs;
}

void PageTable::release(PageRef ref) {
  Page& p = page(ref);
  Rank& R = ranks_v_[static_cast<std::size_t>(ref.rank)];
  if (p.refs <= 0) return;  // check() reports it; never below zero
  if (--p.refs > 0) return;
  --R.used;
  if (p.is_indexed) {
    R.lru.push_back(ref.id);
    p.lru = std::prev(R.lru.end());
  } else {
    p.on_free_list = true;
    R.free.push_back(ref.id);
    std::push_heap(R.free.begin(), R.free.end(), std::greater<>());
  }
}

uint64_t PageTable::chain_hash(uint64_t parent, std::span<const TokenId> tokens) {
  uint64_t h = mix(parent, static_cast<uint64_t>(tokens.size()));
  for (const TokenId t : tokens) h = mix(h, static_cast<uint64_t>(static_cast<uint32_t>(t)));
  return h;
}

PageRef PageTable::lookup(uint64_t hash, uint64_t parent, std::span<const TokenId> tokens) const {
  const auto it = index_.find(hash);
  if (it == index_.end()) return {};
  const Entry& e = it->second;
  if (e.parent != parent || !std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end()))
    return {};
  return e.page;
}

bool PageTable::insert(uint64_t hash, uint64_t parent, std::span<const TokenId> tokens,
                       PageRef ref) {
  Page& p = page(ref);
  if (p.is_indexed || index_.count(hash) != 0) return false;
  index_.emplace(hash, Entry{ref, parent, std::vector<TokenId>(tokens.begin(), tokens.end())});
  p.is_indexed = true;
  p.hash = hash;
  return true;
}

bool PageTable::indexed(PageRef ref) const { return page(ref).is_indexed; }

int32_t PageTable::refcount(PageRef ref) const { return page(ref).refs; }

Status PageTable::check() const {
  for (int r = 0; r < ranks_; ++r) {
    const Rank& R = ranks_v_[static_cast<std::size_t>(r)];
    int64_t free = 0, cached = 0, used = 0;
    for (int64_t i = 0; i < pages_; ++i) {
      const Page& p = R.pages[static_cast<std::size_t>(i)];
      const PageRef ref{r, static_cast<int32_t>(i)};
      if (p.refs < 0) return internal_error(where(ref) + ": negative refcount");
      if (p.on_free_list) {
        ++free;
        if (p.refs != 0 || p.is_indexed) return internal_error(where(ref) + ": free but in use");
      } else if (p.refs == 0) {
        ++cached;
        if (!p.is_indexed) return internal_error(where(ref) + ": unreferenced, not free, not indexed");
      } else {
        ++used;
      }
      if (p.is_indexed) {
        const auto it = index_.find(p.hash);
        if (it == index_.end() || !(it->second.page == ref))
          return internal_error(where(ref) + ": indexed page missing from the index");
      }
    }
    if (free != static_cast<int64_t>(R.free.size()) || cached != static_cast<int64_t>(R.lru.size()) ||
        used != R.used)
      return internal_error("rank " + std::to_string(r) + ": page counts disagree (free " +
                            std::to_string(free) + "/" + std::to_string(R.free.size()) +
                            ", cached " + std::to_string(cached) + "/" +
                            std::to_string(R.lru.size()) + ", used " + std::to_string(used) +
                            "/" + std::to_string(R.used) + ")");
    if (R.reserved < 0 || R.reserved > free + cached)
      return internal_error("rank " + std::to_string(r) + ": reservation " +
                            std::to_string(R.reserved) + " outside [0, free + cached]");
  }
  for (const auto& [h, e] : index_)
    if (!page(e.page).is_indexed || page(e.page).hash != h)
      return internal_error(where(e.page) + ": index entry without its page");
  return Status::ok();
}

}  // namespace treeattn::engine
