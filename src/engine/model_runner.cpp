// ModelRunner: see model_runner.hpp. The K/V exchange's part is in model_runner_kv.cpp, except
// its local merge (merge_exchange_states), which is here with the other call into the merge.
#include "engine/model_runner.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>

#include "treeattn/state.hpp"

namespace treeattn::engine {
namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The merge receives every rank's states (the exchange's byte model: p - 1 records a record).
bool merge_gathers(const Communicator& comm, const std::string& strategy) {
  const StrategyInfo* i = StrategyRegistry::for_backend(comm.capabilities()).info(strategy);
  return i != nullptr && i->holds_every_state;
}

}  // namespace

ModelRunner::ModelRunner(Communicator& comm, const model::LlamaModel& model,
                         const EngineConfig& cfg, std::unique_ptr<LayerMerge> merge,
                         ExchangePolicy exchange, std::vector<TiledKVCache> pools, KVManager& kv,
                         model::DenseWeights weights, bool dense_split)
    : comm_(&comm),
      model_(&model),
      w_(std::move(weights)),
      dense_split_(dense_split),
      cfg_(cfg),
      kv_(kv),
      merge_(std::move(merge)),
      exchange_(exchange),
      p_(comm.size()),
      me_(comm.rank()),
      T_(kv.page_tokens()),
      pools_(std::move(pools)) {
  mv_.threads = cfg.threads;
  mv_.isa = cfg.isa;
  mv_.mode = cfg.matmul;
  dopt_.threads = cfg.threads;
  dopt_.isa = cfg.isa;
  const auto& mc = model.config();
  xshape_ = ExchangeShape{
      p_,
      mc.n_head,
      mc.n_head_kv,
      mc.head_dim,
      static_cast<std::size_t>(mc.n_head_kv) *
          kv_head_token_bytes(static_cast<std::size_t>(mc.head_dim), cfg.kv_dtype),
      merge_gathers(comm, merge_->choice().strategy),
      merge_->choice().local_twin};
}

// The step scratch of the largest step: prefill_chunk prompt rows (at most what the KV pool
// holds) and a decode row for each other sequence of the batch, split over the ranks as
// forward() splits them (dense split: every rank holds every row). A fresh allocation's pages
// are mapped on first write, which the first request would otherwise pay for (llama.cpp's
// servers run a warm-up batch for the same reason).
void ModelRunner::reserve_step_scratch() {
  const auto& mc = model_->config();
  const int64_t E = mc.n_embd, H = mc.n_head, D = mc.head_dim, F = mc.n_ff;
  const int64_t qd = H * D, kvd = mc.n_head_kv * D, packed = qd + 2 * kvd;
  const int64_t rows = std::min(cfg_.prefill_chunk, kv_.max_sequence_tokens()) + cfg_.max_batch - 1;
  if (dense_split_) {
    const auto z = [](auto& buf) { std::fill(buf.begin(), buf.end(), 0.0f); };
    size_split_scratch(rows);
    for (auto* buf : {&x_, &q_, &k_, &v_, &attn_, &xn_, &tmp_, &act_, &up_, &gsend_, &grecv_})
      z(*buf);
    states_.assign(static_cast<std::size_t>(rows * H * (D + 2)), 0.0f);
    model_->reserve_forward(w_, rows, mv_);
    return;
  }
  const int64_t mine = p_ > 1 ? (rows + p_ - 1) / p_ : rows;
  const auto z = [](auto& buf, int64_t n) { buf.assign(static_cast<std::size_t>(n), {}); };
  z(x_, mine * E);
  z(q_, rows * qd);
  z(k_, rows * kvd);
  z(v_, rows * kvd);
  z(attn_, mine * qd);
  z(states_, rows * H * (D + 2));
  if (p_ > 1) {
    z(qkv_send_, mine * packed);
    z(qkv_recv_, p_ * mine * packed);
  }
  z(qkv_local_, mine * packed);
  z(fs_.xn, mine * E);
  z(fs_.tmp, mine * E);
  z(fs_.gate, mine * F);
  z(fs_.up, mine * F);
  model_->reserve_forward(w_, mine, mv_);  // this thread's: create and run share one
}

void ModelRunner::try_reserve_step_scratch() {
  try {
    reserve_step_scratch();
  } catch (const std::bad_alloc&) {
    for (auto* buf :
         {&x_, &q_, &k_, &v_, &attn_, &states_, &qkv_send_, &qkv_recv_, &qkv_local_, &fs_.xn,
          &fs_.tmp, &fs_.gate, &fs_.up, &xn_, &tmp_, &act_, &up_, &gsend_, &grecv_})
      std::vector<float>().swap(*buf);
  }
}

// Pass-Q items first, then those computed by the K/V exchange (exchange.hpp), decided from the
// replicated state alone, so identically on every rank. The order of the items only changes
// which rank computes a row's dense part, never its bits.
Status ModelRunner::order_work(Scheduler& sched, std::span<const WorkItem> planned, Step& st) {
  std::vector<WorkItem> kv_work;
  for (const auto& item : planned) {
    const Sequence* s = sched.find(item.first);
    if (s == nullptr)
      return internal_error("engine step: request " + std::to_string(item.first) +
                            " is not running");
    if (use_kv_exchange(exchange_, xshape_, item.second, s->computed))
      kv_work.push_back(item);
    else
      st.work.push_back(item);
  }
  st.n_passq = st.work.size();
  st.work.insert(st.work.end(), kv_work.begin(), kv_work.end());
  for (const auto& item : st.work) st.seqs.push_back(sched.find(item.first));
  return Status::ok();
}

// Rows, and pages for the positions they store (allocated on every rank's table).
Status ModelRunner::lay_out_rows(Step& st) {
  row_tok_.clear();
  row_pos_.clear();
  std::vector<PageRef> mine, wmine;  // pages of this rank allocated now (full, window group)
  for (std::size_t w = 0; w < st.work.size(); ++w) {
    Sequence& s = *st.seqs[w];
    const int64_t n = st.work[w].second;
    st.first_row.push_back(st.rows);
    for (int64_t pos = s.computed; pos < s.computed + n; ++pos) {
      row_tok_.push_back(s.tokens[static_cast<std::size_t>(pos)]);
      row_pos_.push_back(pos);
    }
    TREEATTN_RETURN_IF_ERROR(kv_.allocate(s, n, me_, &mine, &wmine));
    st.rows += n;
  }
  if (cfg_.poison_pages) {
    const auto& mc = model_->config();
    for (int l = 0; l < mc.n_layers; ++l)
      for (const PageRef& pg : window_layer(l) ? wmine : mine)
        poison_page({&pools_[static_cast<std::size_t>(l)], 1}, pg, T_,
                    mc.n_head_kv * mc.head_dim);
  }
  return Status::ok();
}

bool ModelRunner::window_layer(int l) const {
  return kv_.has_window() && model_->config().local_layer[static_cast<std::size_t>(l)] != 0;
}

// The dense part is split: rank r computes rows [lo, lo + mine) (embedding, projections, output
// projection, FFN); per layer the ranks all-gather q, k and v of every row, so that the owners
// store K/V and every rank computes its pages' partial states for every row. A row's bits do not
// depend on which rank computes it or on how many rows it is computed with (matmul per token,
// model.hpp), so the split changes no bit. One row (a lone decode step) is computed by every
// rank instead: splitting it would only add an all-gather per layer.
void ModelRunner::split_rows(Step& st) {
  const auto& mc = model_->config();
  const int64_t E = mc.n_embd, H = mc.n_head, D = mc.head_dim;
  const int64_t qd = H * D, kvd = mc.n_head_kv * D, packed = qd + 2 * kvd;
  const int64_t rows = st.rows;
  st.rows_q = st.n_passq < st.work.size() ? st.first_row[st.n_passq] : rows;
  times_.rows_pass_q += st.rows_q;
  times_.rows_kv += rows - st.rows_q;
  st.split = p_ > 1 && rows > 1;
  st.per = st.split ? (rows + p_ - 1) / p_ : rows;  // rows per rank (slots)
  st.lo = st.split ? std::min(rows, me_ * st.per) : 0;
  st.mine = std::min(rows, st.lo + st.per) - st.lo;
  // A rank's slot of the all-gather: its rows' q, k, v (pass-Q rows) or k, v (K/V rows), padded
  // to the largest slot.
  row_off_.assign(static_cast<std::size_t>(rows), 0);
  st.gslot = 0;  // floats
  for (int r = 0; r < p_ && st.split; ++r) {
    int64_t off = 0;
    for (int64_t row = std::min(rows, r * st.per); row < std::min(rows, (r + 1) * st.per); ++row) {
      row_off_[static_cast<std::size_t>(row)] = off;
      off += row < st.rows_q ? packed : 2 * kvd;
    }
    st.gslot = std::max(st.gslot, off);
  }
  if (dense_split_) {  // every rank holds every row's activations
    size_split_scratch(rows);
    states_.resize(static_cast<std::size_t>(rows * H * (D + 2)));
    return;
  }
  const int64_t mine1 = std::max<int64_t>(st.mine, 1), gslot1 = std::max<int64_t>(st.gslot, 1);
  x_.resize(static_cast<std::size_t>(mine1 * E));
  q_.resize(static_cast<std::size_t>(rows * qd));
  k_.resize(static_cast<std::size_t>(rows * kvd));
  v_.resize(k_.size());
  attn_.resize(static_cast<std::size_t>(mine1 * qd));
  states_.resize(static_cast<std::size_t>(rows * H * (D + 2)));
  qkv_send_.resize(static_cast<std::size_t>(gslot1));
  qkv_recv_.resize(static_cast<std::size_t>(p_ * gslot1));
  qkv_local_.resize(static_cast<std::size_t>(mine1 * packed));
}

// This rank's pages of each pass-Q item's sequence, as the kernel reads them.
void ModelRunner::build_entries(Step& st) {
  const auto& mc = model_->config();
  const int64_t H = mc.n_head, qd = H * mc.head_dim;
  const auto rec = static_cast<std::size_t>(mc.head_dim + 2);
  const bool wg = kv_.has_window();
  st.ep.assign(st.n_passq, {});
  st.entries.assign(st.n_passq, {});
  st.wep.assign(wg ? st.n_passq : 0, {});
  st.wentries.assign(wg ? st.n_passq : 0, {});
  for (std::size_t w = 0; w < st.n_passq; ++w) {
    const Sequence& s = *st.seqs[w];
    const int64_t end = s.computed + st.work[w].second;
    kv_.entry_pages(s, end, me_, st.ep[w]);
    if (wg) kv_.window_entry_pages(s, end, me_, st.wep[w]);
    for (int g = 0; g < (wg ? 2 : 1); ++g) {
      const EntryPages& pages = g == 0 ? st.ep[w] : st.wep[w];
      PagedEntry& e = g == 0 ? st.entries[w] : st.wentries[w];
      e.q = q_.data() + st.first_row[w] * qd;
      e.n_q = st.work[w].second;
      e.first_pos = s.computed;
      e.pages = pages.ids;
      e.page_pos = pages.pos;
      e.page_len = pages.len;
      e.page_index0 = pages.index0;
      e.states = states_.data() + static_cast<std::size_t>(st.first_row[w] * H) * rec;
    }
  }
}

Result<StepLogits> ModelRunner::forward(Scheduler& sched, std::span<const WorkItem> planned) {
  Step st;
  TREEATTN_RETURN_IF_ERROR(order_work(sched, planned, st));
  TREEATTN_RETURN_IF_ERROR(lay_out_rows(st));
  if (st.rows == 0) return StepLogits{};
  split_rows(st);
  // Replicated: this rank's rows; split: every row, each embedded by the rank that holds its
  // token's row of the table.
  if (dense_split_) {
    TREEATTN_RETURN_IF_ERROR(split_embed(st));
  } else if (st.mine > 0) {
    TREEATTN_RETURN_IF_ERROR(model_->embed(
        std::span<const TokenId>(row_tok_.data() + st.lo, static_cast<std::size_t>(st.mine)),
        x_.data()));
  }
  build_entries(st);
  for (int l = 0; l < model_->config().n_layers; ++l) {
    TREEATTN_RETURN_IF_ERROR(dense_split_ ? run_layer_split(l, st) : run_layer(l, st));
    layers_done_.fetch_add(1, std::memory_order_relaxed);
  }
  advance(st);
  return compute_logits(st);
}

// q, k, v of every row from the ranks that computed them: pass-Q rows' q, k and v travel; a
// K/V row's q stays on its rank.
Status ModelRunner::gather_qkv(const Step& st, const float* ql, const float* kl, const float* vl) {
  const auto& mc = model_->config();
  const int64_t qd = mc.n_head * mc.head_dim, kvd = mc.n_head_kv * mc.head_dim;
  const auto fb = static_cast<std::size_t>(sizeof(float));
  const int64_t rows = st.rows, lo = st.lo, mine = st.mine;
  if (!st.split) {
    std::memcpy(q_.data(), ql, static_cast<std::size_t>(rows * qd) * fb);
    std::memcpy(k_.data(), kl, static_cast<std::size_t>(rows * kvd) * fb);
    std::memcpy(v_.data(), vl, static_cast<std::size_t>(rows * kvd) * fb);
    return Status::ok();
  }
  for (int64_t i = 0; i < mine; ++i) {
    float* dst = qkv_send_.data() + row_off_[static_cast<std::size_t>(lo + i)];
    if (lo + i < st.rows_q) {
      std::memcpy(dst, ql + i * qd, static_cast<std::size_t>(qd) * fb);
      dst += qd;
    }
    std::memcpy(dst, kl + i * kvd, static_cast<std::size_t>(kvd) * fb);
    std::memcpy(dst + kvd, vl + i * kvd, static_cast<std::size_t>(kvd) * fb);
  }
  const auto tg = Clock::now();
  TREEATTN_RETURN_IF_ERROR(comm_->allgather(
      qkv_send_.data(), static_cast<std::size_t>(st.gslot) * fb, qkv_recv_.data()));
  times_.merge_s += seconds(Clock::now() - tg);
  for (int64_t row = 0; row < rows; ++row) {
    const float* src =
        qkv_recv_.data() + (row / st.per) * st.gslot + row_off_[static_cast<std::size_t>(row)];
    if (row < st.rows_q) {
      std::memcpy(q_.data() + row * qd, src, static_cast<std::size_t>(qd) * fb);
      src += qd;
    } else if (row >= lo && row < lo + mine) {
      std::memcpy(q_.data() + row * qd, ql + (row - lo) * qd, static_cast<std::size_t>(qd) * fb);
    }
    std::memcpy(k_.data() + row * kvd, src, static_cast<std::size_t>(kvd) * fb);
    std::memcpy(v_.data() + row * kvd, src + kvd, static_cast<std::size_t>(kvd) * fb);
  }
  return Status::ok();
}

// The owners store K and V of every row in layer l's pool.
void ModelRunner::store_kv(int l, const Step& st) {
  const int64_t kvd = model_->config().n_head_kv * model_->config().head_dim;
  TiledKVCache& pool = pools_[static_cast<std::size_t>(l)];
  const bool wg = window_layer(l);
  for (std::size_t w = 0; w < st.work.size(); ++w) {
    const Sequence& s = *st.seqs[w];
    for (int64_t i = 0; i < st.work[w].second; ++i) {
      const int64_t row = st.first_row[w] + i, pos = s.computed + i;
      const PageRef& pg = page_of(s, pos / T_, wg);
      if (pg.rank != me_) continue;
      pool.set_tokens(0, static_cast<int64_t>(pg.id) * T_ + pos % T_, k_.data() + row * kvd,
                      v_.data() + row * kvd);
    }
  }
}

// ---- the calls into the merge (layer_merge.hpp) ----

Status ModelRunner::check_exchange_policy() const {
  return check_exchange(exchange_, xshape_, merge_->choice().strategy);
}

// The one merge of the ranks' partial states of the pass-Q rows per layer: one collective
// pattern of the strategy for every row of the step.
Status ModelRunner::merge_layer_states(int64_t rows_q) {
  const auto& mc = model_->config();
  TREEATTN_RETURN_IF_ERROR(
      merge_->merge(states_.data(), static_cast<std::size_t>(rows_q * mc.n_head)));
  ++times_.merges;
  return Status::ok();
}

// The K/V exchange, 3. The owners' states of this rank's K/V rows, merged as the merge
// collective would (the strategy's local twin): one call per span, whose rows are consecutive
// both in each owner's block of kv_states_ and in states_ (records merge independently).
Status ModelRunner::merge_exchange_states(const Step& st) {
  const auto& mc = model_->config();
  const auto H = static_cast<std::size_t>(mc.n_head);
  const auto rec = static_cast<std::size_t>(mc.head_dim + 2);
  const auto up = static_cast<std::size_t>(p_);
  std::vector<const float*> parts(up);
  for (const Span& sp : spans_) {
    if (sp.b <= sp.a) continue;
    for (std::size_t o = 0; o < up; ++o)
      parts[o] = kv_states_.data() +
                 (o * static_cast<std::size_t>(st.mine) + static_cast<std::size_t>(sp.a - st.lo)) *
                     H * rec;
    TREEATTN_RETURN_IF_ERROR(merge_->merge_local(
        parts.data(), p_, static_cast<std::size_t>(sp.b - sp.a) * H,
        states_.data() + static_cast<std::size_t>(sp.a) * H * rec));
  }
  return Status::ok();
}

// The attention of layer l: K/V stored by their owners, the partial states of this rank's pages,
// the merge of the pass-Q rows and the K/V exchange of the others.
Status ModelRunner::attend(int l, Step& st) {
  const auto& mc = model_->config();
  store_kv(l, st);
  // Sliding-window layers (gemma3): each rank attends to the window's part of its pages, and the
  // merge is the same as for a global layer (a rank with no page in the window contributes the
  // identity); the window's pages stay where the placement put them. With a window group their
  // pages are the group's, which drops what the window no longer sees (kv_manager.hpp).
  const int64_t window = mc.sliding_window > 0 && mc.local_layer[static_cast<std::size_t>(l)] != 0
                             ? mc.sliding_window
                             : 0;
  const bool wg = window_layer(l);
  std::vector<PagedEntry>& entries = wg ? st.wentries : st.entries;
  for (PagedEntry& e : entries) e.window = window;
  const TiledKVCache& pool = pools_[static_cast<std::size_t>(l)];
  const std::vector<int64_t> no_len;
  const auto ta = Clock::now();
  if (!entries.empty())
    TREEATTN_RETURN_IF_ERROR(decode_partial_paged(
        AttnShape{1, mc.n_head, mc.n_head_kv, mc.head_dim, 1}, pool.view(no_len, no_len, no_len, 1),
        (wg ? kv_.window_table() : kv_.table()).pages_per_rank(), entries, dopt_));
  const auto tm = Clock::now();
  times_.attn_s += seconds(tm - ta);
  if (st.rows_q > 0) TREEATTN_RETURN_IF_ERROR(merge_layer_states(st.rows_q));
  times_.merge_s += seconds(Clock::now() - tm);
  if (st.rows_q < st.rows) TREEATTN_RETURN_IF_ERROR(kv_exchange_attention(pool, st, window, wg));
  return Status::ok();
}

void ModelRunner::normalize_rows(int64_t first, int64_t n, int64_t dst) {
  const auto& mc = model_->config();
  const int64_t H = mc.n_head, D = mc.head_dim;
  const auto rec = static_cast<std::size_t>(D + 2);
  for (int64_t r = 0; r < n * H; ++r)
    state_normalize(states_.data() + static_cast<std::size_t>(first * H + r) * rec,
                    static_cast<std::size_t>(D), attn_.data() + (dst * H + r) * D,
                    static_cast<float*>(nullptr));
}

Status ModelRunner::run_layer(int l, Step& st) {
  const auto& mc = model_->config();
  const int64_t qd = mc.n_head * mc.head_dim, kvd = mc.n_head_kv * mc.head_dim;
  const int64_t lo = st.lo, mine = st.mine, mine1 = std::max<int64_t>(mine, 1);
  float* ql = qkv_local_.data();
  float* kl = ql + mine1 * qd;
  float* vl = kl + mine1 * kvd;
  const auto td = Clock::now();
  if (mine > 0)
    TREEATTN_RETURN_IF_ERROR(model_->attention_inputs(w_, l, x_.data(), mine, row_pos_.data() + lo,
                                                      ql, kl, vl, fs_, mv_));
  times_.dense_s += seconds(Clock::now() - td);
  TREEATTN_RETURN_IF_ERROR(gather_qkv(st, ql, kl, vl));
  TREEATTN_RETURN_IF_ERROR(attend(l, st));
  normalize_rows(lo, mine, 0);
  const auto tf = Clock::now();
  if (mine > 0)
    TREEATTN_RETURN_IF_ERROR(
        model_->attention_output_and_ffn(w_, l, attn_.data(), mine, x_.data(), fs_, mv_));
  times_.dense_s += seconds(Clock::now() - tf);
  return Status::ok();
}

// Bookkeeping: positions stored, full pages indexed.
void ModelRunner::advance(Step& st) {
  for (std::size_t w = 0; w < st.work.size(); ++w) {
    st.seqs[w]->computed += st.work[w].second;
    kv_.index_full_pages(*st.seqs[w]);
  }
}

// Logits of the rows that end a sequence's known tokens, identical on every rank.
Result<StepLogits> ModelRunner::compute_logits(const Step& st) {
  std::vector<std::size_t> sample_w;
  for (std::size_t w = 0; w < st.work.size(); ++w)
    if (st.seqs[w]->computed == static_cast<int64_t>(st.seqs[w]->tokens.size()))
      sample_w.push_back(w);
  if (sample_w.empty()) return StepLogits{};
  const auto& mc = model_->config();
  const int64_t E = mc.n_embd, S = static_cast<int64_t>(sample_w.size());
  logits_.resize(static_cast<std::size_t>(S * mc.n_vocab));
  if (dense_split_) {
    TREEATTN_RETURN_IF_ERROR(split_logits(st, sample_w));
  } else if (!st.split) {  // every rank computed every row: the same logits everywhere
    xs_.resize(static_cast<std::size_t>(S * E));
    for (int64_t i = 0; i < S; ++i) {
      const std::size_t w = sample_w[static_cast<std::size_t>(i)];
      const int64_t row = st.first_row[w] + st.work[w].second - 1;
      std::memcpy(xs_.data() + i * E, x_.data() + row * E,
                  static_cast<std::size_t>(E) * sizeof(float));
    }
    TREEATTN_RETURN_IF_ERROR(model_->logits(w_, xs_.data(), S, logits_.data(), fs_, mv_));
  } else {
    TREEATTN_RETURN_IF_ERROR(gather_logits(st, sample_w));
  }
  StepLogits out;
  for (std::size_t w : sample_w) out.seqs.push_back(st.seqs[w]);
  out.logits = logits_;
  return out;
}

// Each rank computes the logits of the sampled rows it computed, and an all-gather gives every
// rank all of them, so every rank samples the same tokens. The output projection is the step's
// largest matrix: computing it for every row on every rank would cost each rank as much as all
// the ranks' shares together. A row's logits do not depend on the rows computed with it.
Status ModelRunner::gather_logits(const Step& st, std::span<const std::size_t> sample_w) {
  const auto& mc = model_->config();
  const int64_t E = mc.n_embd, V = mc.n_vocab, S = static_cast<int64_t>(sample_w.size());
  std::vector<int64_t> owner(static_cast<std::size_t>(S)), slot(static_cast<std::size_t>(S));
  std::vector<int64_t> count(static_cast<std::size_t>(p_), 0);
  for (int64_t i = 0; i < S; ++i) {
    const std::size_t w = sample_w[static_cast<std::size_t>(i)];
    const int64_t o = (st.first_row[w] + st.work[w].second - 1) / st.per;
    owner[static_cast<std::size_t>(i)] = o;
    slot[static_cast<std::size_t>(i)] = count[static_cast<std::size_t>(o)]++;
  }
  const int64_t most = *std::max_element(count.begin(), count.end());
  const int64_t have = count[static_cast<std::size_t>(me_)];
  xs_.resize(static_cast<std::size_t>(std::max<int64_t>(have, 1) * E));
  for (int64_t i = 0; i < S; ++i) {
    if (owner[static_cast<std::size_t>(i)] != me_) continue;
    const std::size_t w = sample_w[static_cast<std::size_t>(i)];
    const int64_t row = st.first_row[w] + st.work[w].second - 1;
    std::memcpy(xs_.data() + slot[static_cast<std::size_t>(i)] * E, x_.data() + (row - st.lo) * E,
                static_cast<std::size_t>(E) * sizeof(float));
  }
  // This rank's rows, then padding up to `most` rows that no rank reads (not cleared).
  xs_all_.resize(static_cast<std::size_t>(most * V));
  if (have > 0)
    TREEATTN_RETURN_IF_ERROR(model_->logits(w_, xs_.data(), have, xs_all_.data(), fs_, mv_));
  logits_all_.resize(static_cast<std::size_t>(p_ * most * V));
  TREEATTN_RETURN_IF_ERROR(comm_->allgather(
      xs_all_.data(), static_cast<std::size_t>(most * V) * sizeof(float), logits_all_.data()));
  for (int64_t i = 0; i < S; ++i)
    std::memcpy(
        logits_.data() + i * V,
        logits_all_.data() +
            (owner[static_cast<std::size_t>(i)] * most + slot[static_cast<std::size_t>(i)]) * V,
        static_cast<std::size_t>(V) * sizeof(float));
  return Status::ok();
}

}  // namespace treeattn::engine
