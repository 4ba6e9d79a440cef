// Plan's wire format: see step_plan.hpp.
#include "engine/step_plan.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

namespace treeattn::engine {
namespace {

int64_t bits_of(double d) { return std::bit_cast<int64_t>(d); }
double double_of(int64_t v) { return std::bit_cast<double>(v); }

constexpr std::size_t kRequestWords = 15;  // an admission's fixed words, before its lists

// A byte string: its length, then its bytes, eight a word.
void put_bytes(std::vector<int64_t>& w, const std::string& s) {
  w.push_back(static_cast<int64_t>(s.size()));
  for (std::size_t i = 0; i < s.size(); i += 8) {
    int64_t word = 0;
    std::memcpy(&word, s.data() + i, std::min<std::size_t>(8, s.size() - i));
    w.push_back(word);
  }
}

void put_request(std::vector<int64_t>& w, RequestId id, const Request& r) {
  const model::SamplingParams& sp = r.sampling;
  w.push_back(static_cast<int64_t>(id));
  w.push_back(static_cast<int64_t>(r.prompt.size()));
  w.push_back(r.max_new_tokens);
  w.push_back(bits_of(sp.temperature));
  w.push_back(sp.top_k);
  w.push_back(bits_of(sp.top_p));
  w.push_back(static_cast<int64_t>(sp.seed));
  for (const double d :
       {sp.min_p, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty})
    w.push_back(bits_of(d));
  w.push_back(r.return_logits ? 1 : 0);
  w.push_back(r.logprobs);
  w.push_back(static_cast<int64_t>(r.stop_tokens.size()));
  w.push_back(static_cast<int64_t>(sp.logit_bias.size()));
  for (TokenId t : r.stop_tokens) w.push_back(t);
  for (const auto& [t, bias] : sp.logit_bias) {
    w.push_back(t);
    w.push_back(bits_of(bias));
  }
  for (TokenId t : r.prompt) w.push_back(t);
  put_bytes(w, r.response_format);
}

// A cursor over the words that refuses, with the word's index, anything it cannot hold.
class Reader {
 public:
  explicit Reader(std::span<const int64_t> w) : w_(w) {}
  std::size_t left() const { return w_.size() - i_; }
  bool next(int64_t& out) {
    if (i_ >= w_.size()) return false;
    out = w_[i_++];
    return true;
  }
  // A count of items of `each` words that the remaining words can hold.
  bool count(int64_t& out, std::size_t each) {
    if (!next(out)) return false;
    return out >= 0 && static_cast<uint64_t>(out) <= left() / each;
  }
  Status bad(const std::string& why) const {
    return internal_error("malformed step description from rank 0 (word " + std::to_string(i_) +
                          " of " + std::to_string(w_.size()) + "): " + why);
  }

 private:
  std::span<const int64_t> w_;
  std::size_t i_ = 0;
};

Result<Plan::Admit> get_request(Reader& in) {
  Plan::Admit ad;
  model::SamplingParams& sp = ad.req.sampling;
  int64_t fixed[kRequestWords];
  for (int64_t& x : fixed)
    if (!in.next(x)) return in.bad("an admission is cut short");
  const int64_t np = fixed[1], ns = fixed[13], nb = fixed[14];
  // Prompt, stop tokens and two words per bias entry, within the words left (no overflow: each
  // is checked against what is left after the others).
  if (np < 0 || ns < 0 || nb < 0 || static_cast<uint64_t>(np) > in.left() ||
      static_cast<uint64_t>(ns) > in.left() - static_cast<uint64_t>(np) ||
      static_cast<uint64_t>(nb) > (in.left() - static_cast<uint64_t>(np + ns)) / 2)
    return in.bad("an admission's prompt (" + std::to_string(np) + "), stop tokens (" +
                  std::to_string(ns) + ") or logit_bias entries (" + std::to_string(nb) +
                  ") exceed the words left");
  ad.id = static_cast<RequestId>(fixed[0]);
  ad.req.max_new_tokens = fixed[2];
  sp.temperature = double_of(fixed[3]);
  sp.top_k = static_cast<int>(fixed[4]);
  sp.top_p = double_of(fixed[5]);
  sp.seed = static_cast<uint64_t>(fixed[6]);
  sp.min_p = double_of(fixed[7]);
  sp.presence_penalty = double_of(fixed[8]);
  sp.frequency_penalty = double_of(fixed[9]);
  sp.repetition_penalty = double_of(fixed[10]);
  ad.req.return_logits = fixed[11] != 0;
  ad.req.logprobs = static_cast<int>(fixed[12]);
  int64_t t = 0, b = 0;
  for (int64_t j = 0; j < ns && in.next(t); ++j)
    ad.req.stop_tokens.push_back(static_cast<TokenId>(t));
  for (int64_t j = 0; j < nb && in.next(t) && in.next(b); ++j)
    sp.logit_bias.emplace_back(static_cast<TokenId>(t), double_of(b));
  for (int64_t j = 0; j < np && in.next(t); ++j) ad.req.prompt.push_back(static_cast<TokenId>(t));
  int64_t nf = 0;
  if (!in.next(nf) || nf < 0 || static_cast<uint64_t>(nf) / 8 > in.left() ||
      (static_cast<uint64_t>(nf) + 7) / 8 > in.left())
    return in.bad("an admission's response format (" + std::to_string(nf) +
                  " bytes) exceeds the words left");
  ad.req.response_format.resize(static_cast<std::size_t>(nf));
  for (std::size_t i = 0; i < ad.req.response_format.size(); i += 8) {
    in.next(t);
    std::memcpy(ad.req.response_format.data() + i, &t,
                std::min<std::size_t>(8, ad.req.response_format.size() - i));
  }
  return ad;
}

}  // namespace

std::vector<int64_t> encode_plan(const Plan& pl) {
  std::vector<int64_t> w = {
      static_cast<int64_t>(pl.kind),          pl.waiting_after,
      static_cast<int64_t>(pl.cancels.size()), static_cast<int64_t>(pl.preempts.size()),
      static_cast<int64_t>(pl.resumes.size()), static_cast<int64_t>(pl.admits.size()),
      static_cast<int64_t>(pl.work.size())};
  for (const auto* ids : {&pl.cancels, &pl.preempts, &pl.resumes})
    for (RequestId id : *ids) w.push_back(static_cast<int64_t>(id));
  for (const auto& a : pl.admits) put_request(w, a.id, a.req);
  for (const auto& [id, n] : pl.work) {
    w.push_back(static_cast<int64_t>(id));
    w.push_back(n);
  }
  return w;
}

Result<Plan> decode_plan(std::span<const int64_t> words) {
  Reader in(words);
  Plan pl;
  int64_t kind = 0, nc = 0, np = 0, nr = 0, na = 0, nw = 0;
  if (!in.next(kind) || !in.next(pl.waiting_after)) return in.bad("the header is cut short");
  if (kind != static_cast<int64_t>(StepKind::kRun) &&
      kind != static_cast<int64_t>(StepKind::kStop) &&
      kind != static_cast<int64_t>(StepKind::kFail))
    return in.bad("unknown step kind " + std::to_string(kind));
  pl.kind = static_cast<StepKind>(kind);
  if (!in.count(nc, 1)) return in.bad("the cancel count is missing or out of range");
  if (!in.count(np, 1)) return in.bad("the preemption count is missing or out of range");
  if (!in.count(nr, 1)) return in.bad("the resumption count is missing or out of range");
  if (!in.count(na, kRequestWords)) return in.bad("the admission count is missing or out of range");
  if (!in.count(nw, 2)) return in.bad("the work count is missing or out of range");
  const std::pair<int64_t, std::vector<RequestId>*> lists[] = {
      {nc, &pl.cancels}, {np, &pl.preempts}, {nr, &pl.resumes}};
  for (const auto& [n, ids] : lists)
    for (int64_t c = 0; c < n; ++c) {
      int64_t id = 0;
      if (!in.next(id)) return in.bad("a cancel, preemption or resumption is cut short");
      ids->push_back(static_cast<RequestId>(id));
    }
  for (int64_t a = 0; a < na; ++a) {
    auto ad = get_request(in);
    TREEATTN_RETURN_IF_ERROR(ad.status());
    pl.admits.push_back(std::move(ad).value());
  }
  for (int64_t j = 0; j < nw; ++j) {
    int64_t id = 0, n = 0;
    if (!in.next(id) || !in.next(n)) return in.bad("a work item is cut short");
    pl.work.emplace_back(static_cast<RequestId>(id), n);
  }
  if (in.left() != 0) return in.bad(std::to_string(in.left()) + " words past the description");
  return pl;
}

}  // namespace treeattn::engine
