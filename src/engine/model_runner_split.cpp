// The dense split of ModelRunner (EngineConfig::dense = split): every rank holds slice r of each
// projection's output rows (model.hpp DenseWeights) and computes it for every row of the step;
// one all-gather per matrix group puts the whole outputs on every rank:
//   embedding      each row's token embedded by the rank whose vocabulary slice holds it;
//   q, k, v        each rank's rows of Q, K and V for every row; then every rank adds the biases,
//                  norms q and k and rotates them (finish_qkv) for every row;
//   attention out  each rank's rows of O over every row's attention output; x += it;
//   gate, up       each rank's rows of both, the gated activation on them (element by element),
//                  and the activations all-gathered ([rows][n_ff]);
//   down           each rank's rows of the down projection over the whole activations; x += it;
//   head           each rank's rows of the head (its vocabulary slice) for the sampled rows.
// Every output element is one dot product computed whole on one rank by the kernels that the
// replicated path runs (a row's bits do not depend on the rows beside it in its matrix or on
// how many tokens share the call: model.hpp, tested in test_int8_matmul's
// ARowSliceGivesTheWholeMatrixsBitsForItsRows), and everything else (norms, RoPE, the residual
// adds, the attention) is computed on every rank from the same inputs by the same code: the
// split's bits are the replicated ones and one rank's. The residual stream x of every row is
// replicated on every rank; attention is unchanged (sequence-sharded pages, the merge), except
// that the K/V exchange's rows, computed by their rank alone, have their attention outputs
// all-gathered.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "engine/model_runner.hpp"

namespace treeattn::engine {
namespace {

using model::Projection;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr Projection kQKV[] = {Projection::kQ, Projection::kK, Projection::kV};
constexpr Projection kOut[] = {Projection::kO};
constexpr Projection kGate[] = {Projection::kGate};
constexpr Projection kDown[] = {Projection::kDown};
constexpr Projection kHead[] = {Projection::kHead};

}  // namespace

ModelRunner::GroupSlot ModelRunner::group_slot(std::span<const Projection> ps,
                                               int64_t tokens) const {
  GroupSlot g;
  for (std::size_t i = 0; i < ps.size(); ++i) {
    int64_t widest = 0;
    for (int r = 0; r < p_; ++r) widest = std::max(widest, w_.rows(ps[i], r).size());
    g.at[i] = g.floats;
    g.floats += tokens * widest;
  }
  return g;
}

Status ModelRunner::gather_group(std::span<const Projection> ps, const GroupSlot& g, int64_t tokens,
                                 std::span<float* const> out) {
  const auto tg = Clock::now();
  const auto slot = static_cast<std::size_t>(std::max<int64_t>(g.floats, 1));
  grecv_.resize(slot * static_cast<std::size_t>(p_));
  TREEATTN_RETURN_IF_ERROR(comm_->allgather(gsend_.data(), slot * sizeof(float), grecv_.data()));
  for (int r = 0; r < p_; ++r)
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const model::RowRange rr = w_.rows(ps[i], r);
      const int64_t n = w_.full_rows(ps[i]);
      const float* src = grecv_.data() + static_cast<std::size_t>(r) * slot + g.at[i];
      for (int64_t t = 0; t < tokens && rr.size() > 0; ++t)
        std::memcpy(out[i] + t * n + rr.begin, src + t * rr.size(),
                    static_cast<std::size_t>(rr.size()) * sizeof(float));
    }
  times_.merge_s += seconds(Clock::now() - tg);
  return Status::ok();
}

// Every row's buffers, and the largest group slot (the FFN's, the head's or q/k/v's).
void ModelRunner::size_split_scratch(int64_t rows) {
  const auto& mc = model_->config();
  const int64_t E = mc.n_embd, qd = mc.n_head * mc.head_dim, kvd = mc.n_head_kv * mc.head_dim;
  const auto n = [](int64_t v) { return static_cast<std::size_t>(std::max<int64_t>(v, 1)); };
  x_.resize(n(rows * E));
  xn_.resize(n(rows * E));
  tmp_.resize(n(rows * E));
  q_.resize(n(rows * qd));
  k_.resize(n(rows * kvd));
  v_.resize(n(rows * kvd));
  attn_.resize(n(rows * qd));
  act_.resize(n(rows * mc.n_ff));
  up_.resize(n(rows * w_.rows(Projection::kUp).size()));
  int64_t slot = 0;
  for (const auto& ps : {std::span<const Projection>(kQKV), std::span<const Projection>(kOut),
                         std::span<const Projection>(kGate), std::span<const Projection>(kDown)})
    slot = std::max(slot, group_slot(ps, rows).floats);
  gsend_.resize(n(slot));
  grecv_.resize(n(slot) * static_cast<std::size_t>(p_));
}

// Every row's embedding: the rank whose vocabulary slice holds the row's token reads its row of
// the table (so no rank touches another's rows), and one all-gather of each rank's rows, in row
// order, padded to the busiest rank's count.
Status ModelRunner::split_embed(const Step& st) {
  const int64_t R = st.rows, E = model_->config().n_embd;
  std::vector<int> owner(static_cast<std::size_t>(R), -1);
  std::vector<int64_t> count(static_cast<std::size_t>(p_), 0);
  std::vector<TokenId> mine;
  for (int64_t row = 0; row < R; ++row) {
    const TokenId t = row_tok_[static_cast<std::size_t>(row)];
    int& o = owner[static_cast<std::size_t>(row)];
    for (int r = 0; r < p_ && o < 0; ++r) {
      const model::RowRange v = w_.rows(Projection::kHead, r);
      if (t >= v.begin && t < v.end) o = r;
    }
    if (o < 0)
      return invalid_argument("engine: token id " + std::to_string(t) +
                              " is outside the vocabulary");
    ++count[static_cast<std::size_t>(o)];
    if (o == me_) mine.push_back(t);
  }
  const int64_t most = *std::max_element(count.begin(), count.end());
  const auto slot = static_cast<std::size_t>(std::max<int64_t>(most * E, 1));
  gsend_.resize(std::max(gsend_.size(), slot));
  grecv_.resize(std::max(grecv_.size(), slot * static_cast<std::size_t>(p_)));
  if (!mine.empty()) TREEATTN_RETURN_IF_ERROR(model_->embed(w_, mine, gsend_.data()));
  const auto tg = Clock::now();
  TREEATTN_RETURN_IF_ERROR(comm_->allgather(gsend_.data(), slot * sizeof(float), grecv_.data()));
  times_.merge_s += seconds(Clock::now() - tg);
  std::vector<std::size_t> at(static_cast<std::size_t>(p_), 0);
  for (int64_t row = 0; row < R; ++row) {
    const auto o = static_cast<std::size_t>(owner[static_cast<std::size_t>(row)]);
    std::memcpy(x_.data() + row * E, grecv_.data() + o * slot + at[o],
                static_cast<std::size_t>(E) * sizeof(float));
    at[o] += static_cast<std::size_t>(E);
  }
  return Status::ok();
}

// Q, K and V of every row: this rank's rows of each, all-gathered, then the biases, q / k norms
// and RoPE on every rank.
Status ModelRunner::split_attention_inputs(int l, const Step& st) {
  const int64_t R = st.rows, E = model_->config().n_embd;
  const auto td = Clock::now();
  model_->attention_norm(l, x_.data(), R, xn_.data(), mv_);
  const GroupSlot g = group_slot(kQKV, R);
  gsend_.resize(static_cast<std::size_t>(std::max<int64_t>(g.floats, 1)));
  float* mine[] = {gsend_.data() + g.at[0], gsend_.data() + g.at[1], gsend_.data() + g.at[2]};
  TREEATTN_RETURN_IF_ERROR(model_->project(w_, l, kQKV, xn_.data(), R, E, mine, mv_));
  times_.dense_s += seconds(Clock::now() - td);
  float* whole[] = {q_.data(), k_.data(), v_.data()};
  TREEATTN_RETURN_IF_ERROR(gather_group(kQKV, g, R, whole));
  const auto tf = Clock::now();
  TREEATTN_RETURN_IF_ERROR(
      model_->finish_qkv(l, R, row_pos_.data(), q_.data(), k_.data(), v_.data(), fs_, mv_));
  times_.dense_s += seconds(Clock::now() - tf);
  return Status::ok();
}

// The K/V exchange's rows were attended by their rank alone (rows [lo, lo + mine) of them):
// their attention outputs, all-gathered. A step whose rows are not split (one row) computed
// them on every rank.
Status ModelRunner::gather_kv_rows_attention(const Step& st) {
  if (!st.split || st.rows_q >= st.rows) return Status::ok();
  const int64_t qd = model_->config().n_head * model_->config().head_dim;
  const auto fb = sizeof(float);
  const auto rows_of = [&](int r) {
    const int64_t a = std::max(st.rows_q, std::min(st.rows, r * st.per));
    return std::pair<int64_t, int64_t>{a, std::max(a, std::min(st.rows, (r + 1) * st.per))};
  };
  const auto slot = static_cast<std::size_t>(st.per * qd);
  gsend_.resize(slot);
  grecv_.resize(slot * static_cast<std::size_t>(p_));
  const auto [a, b] = rows_of(me_);
  std::memcpy(gsend_.data(), attn_.data() + a * qd, static_cast<std::size_t>((b - a) * qd) * fb);
  const auto tg = Clock::now();
  TREEATTN_RETURN_IF_ERROR(comm_->allgather(gsend_.data(), slot * fb, grecv_.data()));
  times_.merge_s += seconds(Clock::now() - tg);
  for (int r = 0; r < p_; ++r) {
    const auto [ra, rb] = rows_of(r);
    std::memcpy(attn_.data() + ra * qd, grecv_.data() + static_cast<std::size_t>(r) * slot,
                static_cast<std::size_t>((rb - ra) * qd) * fb);
  }
  return Status::ok();
}

// x += O a; x += FFN(x), for every row, each projection's rows from the rank that holds them.
Status ModelRunner::split_output_and_ffn(int l, const Step& st) {
  const auto& mc = model_->config();
  const int64_t R = st.rows, E = mc.n_embd, F = mc.n_ff, qd = mc.n_head * mc.head_dim;
  auto t0 = Clock::now();
  GroupSlot g = group_slot(kOut, R);
  gsend_.resize(static_cast<std::size_t>(std::max<int64_t>(g.floats, 1)));
  {
    float* mine[] = {gsend_.data()};
    TREEATTN_RETURN_IF_ERROR(model_->project(w_, l, kOut, attn_.data(), R, qd, mine, mv_));
  }
  times_.dense_s += seconds(Clock::now() - t0);
  {
    float* whole[] = {tmp_.data()};
    TREEATTN_RETURN_IF_ERROR(gather_group(kOut, g, R, whole));
  }
  t0 = Clock::now();
  model_->add_attention_output(l, tmp_.data(), R, x_.data(), mv_);
  model_->ffn_norm(l, x_.data(), R, xn_.data(), mv_);
  // gate and up (this rank's rows of both), the activation in the gate's slot.
  g = group_slot(kGate, R);
  gsend_.resize(static_cast<std::size_t>(std::max<int64_t>(g.floats, 1)));
  const int64_t wf = w_.rows(Projection::kGate).size();
  up_.resize(static_cast<std::size_t>(std::max<int64_t>(R * wf, 1)));
  {
    const Projection ps[] = {Projection::kGate, Projection::kUp};
    float* ys[] = {gsend_.data(), up_.data()};
    TREEATTN_RETURN_IF_ERROR(model_->project(w_, l, ps, xn_.data(), R, E, ys, mv_));
  }
  model_->ffn_activation(gsend_.data(), up_.data(), R, wf, mv_);
  times_.dense_s += seconds(Clock::now() - t0);
  {
    float* whole[] = {act_.data()};
    TREEATTN_RETURN_IF_ERROR(gather_group(kGate, g, R, whole));
  }
  t0 = Clock::now();
  g = group_slot(kDown, R);
  gsend_.resize(static_cast<std::size_t>(std::max<int64_t>(g.floats, 1)));
  {
    float* mine[] = {gsend_.data()};
    TREEATTN_RETURN_IF_ERROR(model_->project(w_, l, kDown, act_.data(), R, F, mine, mv_));
  }
  times_.dense_s += seconds(Clock::now() - t0);
  {
    float* whole[] = {tmp_.data()};
    TREEATTN_RETURN_IF_ERROR(gather_group(kDown, g, R, whole));
  }
  t0 = Clock::now();
  model_->add_ffn_output(l, tmp_.data(), R, x_.data(), mv_);
  times_.dense_s += seconds(Clock::now() - t0);
  return Status::ok();
}

Status ModelRunner::run_layer_split(int l, Step& st) {
  TREEATTN_RETURN_IF_ERROR(split_attention_inputs(l, st));
  TREEATTN_RETURN_IF_ERROR(attend(l, st));
  // Every rank's pass-Q rows (the merge left every row's states on every rank), this rank's K/V
  // rows, and the others' K/V rows from them.
  normalize_rows(0, st.rows_q, 0);
  const int64_t a = std::max(st.rows_q, st.lo), b = std::max(a, st.lo + st.mine);
  normalize_rows(a, b - a, a);
  TREEATTN_RETURN_IF_ERROR(gather_kv_rows_attention(st));
  return split_output_and_ffn(l, st);
}

// The logits of the sampled rows: this rank's vocabulary slice of each, all-gathered.
Status ModelRunner::split_logits(const Step& st, std::span<const std::size_t> sample_w) {
  const auto& mc = model_->config();
  const int64_t E = mc.n_embd, S = static_cast<int64_t>(sample_w.size());
  xs_.resize(static_cast<std::size_t>(S * E));
  for (int64_t i = 0; i < S; ++i) {
    const std::size_t w = sample_w[static_cast<std::size_t>(i)];
    const int64_t row = st.first_row[w] + st.work[w].second - 1;
    std::memcpy(xs_.data() + i * E, x_.data() + row * E,
                static_cast<std::size_t>(E) * sizeof(float));
  }
  const auto td = Clock::now();
  xn_.resize(std::max(xn_.size(), static_cast<std::size_t>(S * E)));
  model_->output_norm(xs_.data(), S, xn_.data());
  const GroupSlot g = group_slot(kHead, S);
  gsend_.resize(static_cast<std::size_t>(std::max<int64_t>(g.floats, 1)));
  float* mine[] = {gsend_.data()};
  TREEATTN_RETURN_IF_ERROR(model_->project(w_, -1, kHead, xn_.data(), S, E, mine, mv_));
  times_.dense_s += seconds(Clock::now() - td);
  float* whole[] = {logits_.data()};
  return gather_group(kHead, g, S, whole);
}

}  // namespace treeattn::engine
