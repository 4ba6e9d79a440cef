// KVManager: see kv_manager.hpp.
#include "engine/kv_manager.hpp"

#include <algorithm>
#include <limits>

namespace treeattn::engine {

KVManager::KVManager(int ranks, int64_t pages_per_rank, int64_t page_tokens, bool prefix_cache,
                     WindowGroup window)
    : table_(ranks, pages_per_rank, page_tokens),
      T_(page_tokens),
      prefix_cache_(prefix_cache),
      window_(window) {
  if (has_window())
    wtable_ = std::make_unique<PageTable>(ranks, window.pages_per_rank, page_tokens);
}

int64_t KVManager::max_sequence_tokens() const {
  return static_cast<int64_t>(table_.ranks()) * table_.pages_per_rank() * T_;
}

int64_t KVManager::window_first_live(int64_t pos) const {
  const int64_t x = pos - window_.window + 1;  // the first position a query at pos sees
  return x <= 0 ? 0 : x / T_;
}

AdmissionFit KVManager::fit(std::span<const TokenId> prompt) const {
  AdmissionFit f;
  const auto n = static_cast<int64_t>(prompt.size());
  // Prefix hits: full pages of the prompt, leaving at least the last prompt token to compute.
  uint64_t parent = PageTable::kRootHash;
  std::vector<PageRef> whit;  // the window page of each hit, where cached
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
      if (has_window()) whit.push_back(wtable_->lookup(h, parent, toks));
      parent = h;
    }
  }
  if (has_window()) {
    // The longest hit whose window pages (those its first computed position sees) are cached.
    auto k = static_cast<int64_t>(f.hits.size());
    for (; k > 0; --k) {
      const int64_t first = window_first_live(k * T_);
      bool all = true;
      for (int64_t j = first; j < k && all; ++j) all = whit[static_cast<std::size_t>(j)].rank >= 0;
      if (all) break;
    }
    f.hits.resize(static_cast<std::size_t>(k));
    f.hashes.resize(static_cast<std::size_t>(k));
    f.window_first = window_first_live(k * T_);
    for (int64_t j = f.window_first; j < k; ++j)
      f.window_hits.push_back(whit[static_cast<std::size_t>(j)]);
  }
  const auto hits = static_cast<int64_t>(f.hits.size());
  const int64_t end_page = (n + T_ - 1) / T_;
  f.need = table_.pages_needed(hits, end_page);
  std::vector<int64_t> taken = f.need;  // and the cached hits, which leave the LRU
  for (const PageRef& h : f.hits)
    if (table_.refcount(h) == 0) ++taken[static_cast<std::size_t>(h.rank)];
  if (has_window()) {
    const int64_t wend = std::min(end_page, (hits * T_ + window_.first_chunk + T_ - 1) / T_);
    const std::vector<int64_t> wneed = wtable_->pages_needed(hits, std::max(hits, wend));
    f.need.insert(f.need.end(), wneed.begin(), wneed.end());
    taken.insert(taken.end(), wneed.begin(), wneed.end());
    for (const PageRef& h : f.window_hits)
      if (wtable_->refcount(h) == 0) ++taken[static_cast<std::size_t>(ranks() + h.rank)];
  }
  f.short_rank = short_rank(taken);
  return f;
}

void KVManager::take(const AdmissionFit& f, Sequence& s) {
  for (const PageRef& h : f.hits) table_.acquire(h);
  const std::size_t up = static_cast<std::size_t>(ranks());
  table_.reserve(std::span(f.need).first(up));
  s.reserve_left = f.need;
  s.pages = f.hits;
  s.hashes = f.hashes;
  s.computed = static_cast<int64_t>(f.hits.size()) * T_;
  s.cached_tokens = s.computed;
  s.window_pages.clear();
  s.window_dropped = 0;
  if (has_window()) {
    for (const PageRef& h : f.window_hits) wtable_->acquire(h);
    wtable_->reserve(std::span(f.need).subspan(up));
    s.window_dropped = f.window_first;
    s.window_pages.assign(static_cast<std::size_t>(f.window_first), PageRef{});
    s.window_pages.insert(s.window_pages.end(), f.window_hits.begin(), f.window_hits.end());
  }
}

Status KVManager::allocate(Sequence& s, int64_t n, int me, std::vector<PageRef>* mine,
                           std::vector<PageRef>* window_mine) {
  for (int64_t pos = s.computed; pos < s.computed + n; ++pos) {
    const int64_t j = pos / T_;
    if (j != static_cast<int64_t>(s.pages.size())) continue;
    const int owner = table_.owner(j);
    auto pg = table_.allocate(owner);
    TREEATTN_RETURN_IF_ERROR(pg.status());
    --s.reserve_left[static_cast<std::size_t>(owner)];
    s.pages.push_back(*pg);
    if (owner == me && mine != nullptr) mine->push_back(*pg);
    if (!has_window()) continue;
    auto wp = wtable_->allocate(owner);
    TREEATTN_RETURN_IF_ERROR(wp.status());
    --s.reserve_left[static_cast<std::size_t>(ranks() + owner)];
    s.window_pages.push_back(*wp);
    if (owner == me && window_mine != nullptr) window_mine->push_back(*wp);
  }
  return Status::ok();
}

std::vector<int64_t> KVManager::growth(const Sequence& s, int64_t n) const {
  const int64_t end_page = (s.computed + n + T_ - 1) / T_;
  std::vector<int64_t> need;
  for (std::size_t g = 0; g < need_size(); g += static_cast<std::size_t>(ranks())) {
    const PageTable& t = group(g);
    const auto held = static_cast<int64_t>(g == 0 ? s.pages.size() : s.window_pages.size());
    std::vector<int64_t> more = t.pages_needed(std::min(held, end_page), end_page);
    for (int r = 0; r < ranks(); ++r) {
      auto& x = more[static_cast<std::size_t>(r)];
      x = std::max<int64_t>(0, x - s.reserve_left[g + static_cast<std::size_t>(r)]);
    }
    need.insert(need.end(), more.begin(), more.end());
  }
  return need;
}

int KVManager::short_rank(std::span<const int64_t> need) const {
  for (std::size_t i = 0; i < need.size(); ++i) {
    const int r = static_cast<int>(i % static_cast<std::size_t>(ranks()));
    if (need[i] > group(i).available(r)) return r;
  }
  return -1;
}

void KVManager::grow(Sequence& s, std::span<const int64_t> need) {
  const std::size_t up = static_cast<std::size_t>(ranks());
  table_.reserve(need.first(up));
  if (has_window()) wtable_->reserve(need.subspan(up));
  for (std::size_t i = 0; i < need.size(); ++i) s.reserve_left[i] += need[i];
}

void KVManager::index_full_pages(Sequence& s) {
  while (static_cast<int64_t>(s.hashes.size() + 1) * T_ <= s.computed) {
    const int64_t j = static_cast<int64_t>(s.hashes.size());
    const uint64_t parent = j == 0 ? PageTable::kRootHash : s.hashes.back();
    const std::span<const TokenId> toks(s.tokens.data() + j * T_, static_cast<std::size_t>(T_));
    const uint64_t h = PageTable::chain_hash(parent, toks);
    s.hashes.push_back(h);
    if (!prefix_cache_) continue;
    table_.insert(h, parent, toks, s.pages[static_cast<std::size_t>(j)]);
    if (has_window() && j >= s.window_dropped)
      wtable_->insert(h, parent, toks, s.window_pages[static_cast<std::size_t>(j)]);
  }
  if (has_window()) drop_window_pages(s);
}

// Oldest first: the LRU list then evicts a chain's earliest window pages first, which are the
// first a longer prefix hit stops needing.
void KVManager::drop_window_pages(Sequence& s) {
  const int64_t live = std::min(window_first_live(s.computed),
                                static_cast<int64_t>(s.window_pages.size()));
  for (; s.window_dropped < live; ++s.window_dropped) {
    PageRef& pg = s.window_pages[static_cast<std::size_t>(s.window_dropped)];
    wtable_->release(pg);
    pg = PageRef{};
  }
}

void KVManager::release(Sequence& s) {
  const std::size_t up = static_cast<std::size_t>(ranks());
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) table_.release(*it);
  table_.unreserve(std::span(s.reserve_left).first(up));
  if (!has_window()) return;
  for (auto it = s.window_pages.rbegin(); it != s.window_pages.rend(); ++it)
    if (it->rank >= 0) wtable_->release(*it);
  wtable_->unreserve(std::span(s.reserve_left).subspan(up));
}

void KVManager::preempt(Sequence& s) {
  release(s);
  s.pages.clear();
  s.hashes.clear();
  s.window_pages.clear();
  s.window_dropped = 0;
  s.reserve_left.assign(need_size(), 0);
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

void KVManager::window_entry_pages(const Sequence& s, int64_t end, int me,
                                   EntryPages& out) const {
  for (int64_t j = 0; j * T_ < end; ++j) {
    if (table_.owner(j) != me) continue;
    const PageRef& pg = s.window_pages[static_cast<std::size_t>(j)];
    if (pg.rank < 0) {
      ++out.index0;
      continue;
    }
    out.ids.push_back(pg.id);
    out.pos.push_back(j * T_);
    out.len.push_back(static_cast<int32_t>(std::min(T_, end - j * T_)));
  }
}

Status KVManager::check() const {
  TREEATTN_RETURN_IF_ERROR(table_.check());
  if (has_window()) TREEATTN_RETURN_IF_ERROR(wtable_->check());
  return Status::ok();
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
