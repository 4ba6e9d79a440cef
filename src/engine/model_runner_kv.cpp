// The K/V exchange of ModelRunner (exchange.hpp) for work items [n_passq, work.size()) in one
// layer: every rank sends its pages' cached tokens of those sequences (positions before this
// step; encoded as stored, with their per-token bfloat16 scales for fp8 and int8: records of
// kv_head_token_bytes() per KV head) to every rank; each rank copies the pages its own rows
// read into xpool (cached tokens from their owners, this step's from the all-gathered k and v,
// narrowed as the owners store them), computes per owner rank the partial states over that
// rank's pages (the entries the owner would have computed under pass-Q, so the same bits), and
// merges them locally in the merge collective's association into `states`.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "engine/model_runner.hpp"

namespace treeattn::engine {
namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

// 1. Every rank's cached tokens of these sequences, item by item, page by page, all-gathered
// into page_recv_; returns each rank's slot in bytes.
Result<std::size_t> ModelRunner::exchange_cached_pages(const TiledKVCache& pool, const Step& st,
                                                       bool wg) {
  const auto& mc = model_->config();
  const int64_t Hkv = mc.n_head_kv;
  const std::size_t head_bytes = static_cast<std::size_t>(mc.head_dim) * dtype_size(cfg_.kv_dtype);
  const std::size_t rec_bytes = kv_head_token_bytes(static_cast<std::size_t>(mc.head_dim), cfg_.kv_dtype);
  const std::size_t tok_bytes = static_cast<std::size_t>(Hkv) * rec_bytes;
  const auto up = static_cast<std::size_t>(p_);
  std::vector<std::size_t> bytes_of(up, 0);
  for (std::size_t w = st.n_passq; w < st.work.size(); ++w) {
    const Sequence& s = *st.seqs[w];
    for (int64_t j = 0; j * T_ < s.computed; ++j) {
      const PageRef& pg = page_of(s, j, wg);
      if (pg.rank < 0) continue;  // a dropped window page: no row of this step sees it
      bytes_of[static_cast<std::size_t>(pg.rank)] +=
          static_cast<std::size_t>(std::min(T_, s.computed - j * T_)) * tok_bytes;
    }
  }
  const std::size_t slot = *std::max_element(bytes_of.begin(), bytes_of.end());
  if (slot == 0) return slot;
  const auto ta = Clock::now();
  page_send_.resize(slot);
  page_recv_.resize(slot * up);
  uint8_t* dst = page_send_.data();
  const bool scaled = dtype_is_quantized(cfg_.kv_dtype);
  bf16_t sc[2] = {};
  for (std::size_t w = st.n_passq; w < st.work.size(); ++w) {
    const Sequence& s = *st.seqs[w];
    for (int64_t j = 0; j * T_ < s.computed; ++j) {
      const PageRef& pg = page_of(s, j, wg);
      if (pg.rank != me_) continue;
      for (int64_t t = 0; t < std::min(T_, s.computed - j * T_); ++t)
        for (int64_t h = 0; h < Hkv; ++h, dst += rec_bytes) {
          pool.read_token_raw(0, h, static_cast<int64_t>(pg.id) * T_ + t, dst, dst + head_bytes,
                              &sc[0], &sc[1]);
          if (scaled) std::memcpy(dst + 2 * head_bytes, sc, sizeof(sc));
        }
    }
  }
  const auto tg = Clock::now();
  times_.attn_s += seconds(tg - ta);
  TREEATTN_RETURN_IF_ERROR(comm_->allgather(page_send_.data(), slot, page_recv_.data()));
  times_.merge_s += seconds(Clock::now() - tg);
  times_.kv_bytes_sent += static_cast<int64_t>(slot);
  return slot;
}

// 2. The pages this rank's rows read, copied into xpool_; per (span, owner rank) one entry's
// pages in ep[span * p + owner].
Status ModelRunner::copy_exchange_pages(const Step& st, std::size_t slot, bool wg,
                                        std::vector<EntryPages>& ep, std::size_t& n_spans) {
  const auto& mc = model_->config();
  const int64_t Hkv = mc.n_head_kv, kvd = Hkv * mc.head_dim;
  const std::size_t head_bytes = static_cast<std::size_t>(mc.head_dim) * dtype_size(cfg_.kv_dtype);
  const std::size_t rec_bytes = kv_head_token_bytes(static_cast<std::size_t>(mc.head_dim), cfg_.kv_dtype);
  const std::size_t tok_bytes = static_cast<std::size_t>(Hkv) * rec_bytes;
  const bool scaled = dtype_is_quantized(cfg_.kv_dtype);
  const auto up = static_cast<std::size_t>(p_);
  spans_.clear();
  int64_t need_pages = 0;
  for (std::size_t w = st.n_passq; w < st.work.size(); ++w) {
    const int64_t a = std::max(st.lo, st.first_row[w]);
    const int64_t b = std::min(st.lo + st.mine, st.first_row[w] + st.work[w].second);
    if (a >= b) continue;
    spans_.push_back({w, a, b});
    need_pages += (st.seqs[w]->computed + st.work[w].second + T_ - 1) / T_;
  }
  n_spans = spans_.size();
  if (need_pages > xpool_pages_) {
    auto c = TiledKVCache::create(AttnShape{1, mc.n_head, Hkv, mc.head_dim, 1}, cfg_.kv_dtype,
                                  need_pages * T_, kKVTileLayout, T_);
    TREEATTN_RETURN_IF_ERROR(c.status());
    xpool_ = std::move(c).value();
    xpool_pages_ = need_pages;
  }
  ep.assign(spans_.size() * up, {});
  std::vector<int64_t> cursor(up, 0);  // read offset in each rank's part of page_recv
  int32_t xid = 0;
  std::size_t si = 0;
  for (std::size_t w = st.n_passq; w < st.work.size(); ++w) {
    const Sequence& s = *st.seqs[w];
    const int64_t C = s.computed, end = C + st.work[w].second;
    const bool read = si < spans_.size() && spans_[si].w == w;
    for (int64_t j = 0; j * T_ < end; ++j) {
      const PageRef& pg = page_of(s, j, wg);
      if (pg.rank < 0) {  // dropped by its owner, as that rank's pass-Q entry counts it
        if (read) ++ep[si * up + static_cast<std::size_t>(kv_.table().owner(j))].index0;
        continue;
      }
      const auto o = static_cast<std::size_t>(pg.rank);
      const int64_t cached = j * T_ < C ? std::min(T_, C - j * T_) : 0;
      if (read) {
        const int32_t id = xid++;
        const uint8_t* src = page_recv_.data() + o * slot + static_cast<std::size_t>(cursor[o]);
        for (int64_t t = 0; t < cached; ++t)
          for (int64_t h = 0; h < Hkv; ++h, src += rec_bytes) {
            bf16_t sc[2] = {};
            if (scaled) std::memcpy(sc, src + 2 * head_bytes, sizeof(sc));
            xpool_.set_token_raw(0, h, static_cast<int64_t>(id) * T_ + t, src, src + head_bytes,
                                 sc[0], sc[1]);
          }
        for (int64_t pos = std::max(j * T_, C); pos < std::min(end, (j + 1) * T_); ++pos) {
          const int64_t row = st.first_row[w] + pos - C;
          xpool_.set_tokens(0, static_cast<int64_t>(id) * T_ + pos - j * T_, k_.data() + row * kvd,
                            v_.data() + row * kvd);
        }
        EntryPages& e = ep[si * up + o];
        e.ids.push_back(id);
        e.pos.push_back(j * T_);
        e.len.push_back(static_cast<int32_t>(std::min(T_, end - j * T_)));
      }
      cursor[o] += cached * static_cast<int64_t>(tok_bytes);
    }
    if (read) ++si;
  }
  return Status::ok();
}

Status ModelRunner::kv_exchange_attention(const TiledKVCache& pool, const Step& st,
                                          int64_t window, bool in_window_group) {
  const auto& mc = model_->config();
  const int64_t H = mc.n_head, D = mc.head_dim, qd = H * D;
  const auto rec = static_cast<std::size_t>(D + 2);
  const auto up = static_cast<std::size_t>(p_);
  auto slot = exchange_cached_pages(pool, st, in_window_group);
  TREEATTN_RETURN_IF_ERROR(slot.status());
  const auto tc = Clock::now();
  std::vector<EntryPages> ep;
  std::size_t n_spans = 0;
  TREEATTN_RETURN_IF_ERROR(copy_exchange_pages(st, *slot, in_window_group, ep, n_spans));
  kv_states_.resize(up * static_cast<std::size_t>(std::max<int64_t>(st.mine, 1) * H) * rec);
  std::vector<PagedEntry> entries(n_spans * up);
  for (std::size_t i = 0; i < n_spans; ++i) {
    const Span& sp = spans_[i];
    for (std::size_t o = 0; o < up; ++o) {
      PagedEntry& e = entries[i * up + o];
      const EntryPages& pages = ep[i * up + o];
      e.q = q_.data() + sp.a * qd;
      e.n_q = sp.b - sp.a;
      e.first_pos = st.seqs[sp.w]->computed + (sp.a - st.first_row[sp.w]);
      e.pages = pages.ids;
      e.page_pos = pages.pos;
      e.page_len = pages.len;
      e.page_index0 = pages.index0;
      e.window = window;
      e.states = kv_states_.data() +
                 (o * static_cast<std::size_t>(st.mine) + static_cast<std::size_t>(sp.a - st.lo)) *
                     static_cast<std::size_t>(H) * rec;
    }
  }
  const std::vector<int64_t> no_len;
  if (!entries.empty())
    TREEATTN_RETURN_IF_ERROR(decode_partial_paged(AttnShape{1, H, mc.n_head_kv, D, 1},
                                                  xpool_.view(no_len, no_len, no_len, 1),
                                                  xpool_pages_, entries, dopt_));
  TREEATTN_RETURN_IF_ERROR(merge_exchange_states(st));
  times_.attn_s += seconds(Clock::now() - tc);
  return Status::ok();
}

}  // namespace treeattn::engine
