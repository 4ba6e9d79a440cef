// KVManager: see kv_manager.hpp.
#include "engine/kv_manager.hpp"

#include <algorithm>
#include <limits>

namespace treeattn::engine {

KVManager::KVManager(int ranks, int64_t pages_per_rank, int64_t page_tokens, bool prefix_cache)
    : table_(ranks, pages_per_rank, page_tokens), T_(page_tokens), prefix_cache_(prefix_cache) {}

int64_t KVManager::max_sequence_tokens() const {
  return static_cast<int64_t>(table_.ranks()) * table_.pages_per_rank() * T_;
}

AdmissionFit KVManager::fit(std::span<const TokenId> prompt) const {
  AdmissionFit f;
  const auto n = static_cast<int64_t>(prompt.size());
  // Prefix hits: full pages of the prompt, leaving at least the last prompt token to compute.
  uint64_t parent = PageTable::kRootHash;
  if (prefix_cache_) {
    const int64_t max_hits = reusable_pages(n);
    for (int64_t j = 0; j < max_hits; ++j) {
      const auto toks =
          prompt.subspan(static_cast<std::size_t>(j * T_), static_cast<std::size_t>(T_));
      const uint64_t h = PageTable::chain_hash(parent, toks);
      const PageRef ref = table_.lookup(h, parent, toks);
      if (ref.rank < 0) break;
      f.hits.push_back(ref);
      f.hashes.push_back(h);
      parent = h;
    }
  }
  const int64_t end_page = (n + T_ - 1) / T_;
  f.need = table_.pages_needed(static_cast<int64_t>(f.hits.size()), end_page);
  std::vector<int64_t> taken = f.need;  // and the cached hits, which leave the LRU
  for (const PageRef& h : f.hits)
    if (table_.refcount(h) == 0) ++taken[static_cast<std::size_t>(h.rank)];
  f.short_rank = short_rank(taken);
  return f;
}

void KVManager::take(const AdmissionFit& f, Sequence& s) {
  for (const PageRef& h : f.hits) table_.acquire(h);
  table_.reserve(f.need);
  s.reserve_left = f.need;
  s.pages = f.hits;
  s.hashes = f.hashes;
  s.computed = static_cast<int64_t>(f.hits.size()) * T_;
  s.cached_tokens = s.computed;
}

Status KVManager::allocate(Sequence& s, int64_t n, int me, std::vector<PageRef>* mine) {
  for (int64_t pos = s.computed; pos < s.computed + n; ++pos) {
    const int64_t j = pos / T_;
    if (j != static_cast<int64_t>(s.pages.size())) continue;
    const int owner = table_.owner(j);
    auto pg = table_.allocate(owner);
    TREEATTN_RETURN_IF_ERROR(pg.status());
    --s.reserve_left[static_cast<std::size_t>(owner)];
    s.pages.push_back(*pg);
    if (owner == me && mine != nullptr) mine->push_back(*pg);
  }
  return Status::ok();
}

std::vector<int64_t> KVManager::growth(const Sequence& s, int64_t n) const {
  const auto held = static_cast<int64_t>(s.pages.size());
  const int64_t end_page = (s.computed + n + T_ - 1) / T_;
  std::vector<int64_t> need = table_.pages_needed(std::min(held, end_page), end_page);
  for (int r = 0; r < ranks(); ++r) {
    auto& x = need[static_cast<std::size_t>(r)];
    x = std::max<int64_t>(0, x - s.reserve_left[static_cast<std::size_t>(r)]);
  }
  return need;
}

int KVManager::short_rank(std::span<const int64_t> need) const {
  for (int r = 0; r < ranks(); ++r)
    if (need[static_cast<std::size_t>(r)] > table_.available(r)) return r;
  return -1;
}

void KVManager::grow(Sequence& s, std::span<const int64_t> need) {
  table_.reserve(need);
  for (int r = 0; r < ranks(); ++r)
    s.reserve_left[static_cast<std::size_t>(r)] += need[static_cast<std::size_t>(r)];
}

void KVManager::index_full_pages(Sequence& s) {
  while (static_cast<int64_t>(s.hashes.size() + 1) * T_ <= s.computed) {
    const int64_t j = static_cast<int64_t>(s.hashes.size());
    const uint64_t parent = j == 0 ? PageTable::kRootHash : s.hashes.back();
    const std::span<const TokenId> toks(s.tokens.data() + j * T_, static_cast<std::size_t>(T_));
    const uint64_t h = PageTable::chain_hash(parent, toks);
    s.hashes.push_back(h);
    if (prefix_cache_) table_.insert(h, parent, toks, s.pages[static_cast<std::size_t>(j)]);
  }
}

void KVManager::release(Sequence& s) {
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) table_.release(*it);
  table_.unreserve(s.reserve_left);
}

void KVManager::preempt(Sequence& s) {
  release(s);
  s.pages.clear();
  s.hashes.clear();
  s.reserve_left.assign(static_cast<std::size_t>(ranks()), 0);
  s.computed = 0;
}

void KVManager::entry_pages(const Sequence& s, int64_t end, int me, EntryPages& out) const {
  for (int64_t j = 0; j * T_ < end; ++j) {
    const PageRef& pg = s.pages[static_cast<std::size_t>(j)];
    if (pg.rank != me) continue;
    out.ids.push_back(pg.id);
    out.pos.push_back(j * T_);
    out.len.push_back(static_cast<int32_t>(std::min(T_, end - j * T_)));
  }
}

void poison_page(std::span<TiledKVCache> pools, PageRef page, int64_t page_tokens,
                 int64_t kv_width) {
  const std::vector<float> nan(static_cast<std::size_t>(kv_width),
                               std::numeric_limits<float>::quiet_NaN());
  for (TiledKVCache& pool : pools)
    for (int64_t t = 0; t < page_tokens; ++t)
      pool.set_tokens(0, static_cast<int64_t>(page.id) * page_tokens + t, nan.data(), nan.data());
}

}  // namespace treeattn::engine
