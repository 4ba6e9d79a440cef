// Token selection: the logits processed by logit_bias and the penalties over the token history,
// then greedy or temperature / top-k / min-p / top-p with a seeded splitmix64 stream; and the
// log-probabilities of a token. Pure functions of the logits bits, the parameters, the history
// and the number of draws so far, so every rank of a generation picks the same token without
// communicating. See include/treeattn/generate.hpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "treeattn/generate.hpp"

namespace treeattn::model {
namespace {

// Descending logit, ascending id on ties: a total order, so a candidate list is the same on
// every rank.
auto logit_order(std::span<const float> logits) {
  return [logits](TokenId a, TokenId b) {
    const float la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
}

}  // namespace

Status SamplingParams::validate(int64_t n_vocab) const {
  if (!(temperature >= 0.0) || !std::isfinite(temperature))
    return invalid_argument("--temperature " + std::to_string(temperature) +
                            " must be a finite number >= 0 (0: greedy)");
  if (top_k < 0) return invalid_argument("--top-k " + std::to_string(top_k) + " must be >= 0");
  if (!(top_p > 0.0 && top_p <= 1.0))
    return invalid_argument("--top-p " + std::to_string(top_p) + " must be in (0, 1]");
  if (!(min_p >= 0.0 && min_p <= 1.0))
    return invalid_argument("min_p " + std::to_string(min_p) + " must be in [0, 1]");
  if (!(presence_penalty >= -2.0 && presence_penalty <= 2.0))
    return invalid_argument("presence_penalty " + std::to_string(presence_penalty) +
                            " must be in [-2, 2]");
  if (!(frequency_penalty >= -2.0 && frequency_penalty <= 2.0))
    return invalid_argument("frequency_penalty " + std::to_string(frequency_penalty) +
                            " must be in [-2, 2]");
  if (!(repetition_penalty >= 0.01 && repetition_penalty <= 100.0))
    return invalid_argument("repetition_penalty " + std::to_string(repetition_penalty) +
                            " must be in [0.01, 100]");
  for (std::size_t i = 0; i < logit_bias.size(); ++i) {
    const auto [id, bias] = logit_bias[i];
    if (id < 0 || (n_vocab > 0 && id >= n_vocab) || (i > 0 && id <= logit_bias[i - 1].first))
      return invalid_argument("logit_bias token id " + std::to_string(id) +
                              " is outside the vocabulary [0, " + std::to_string(n_vocab) +
                              ") or not in ascending order");
    if (!(bias >= -100.0 && bias <= 100.0))
      return invalid_argument("logit_bias of token " + std::to_string(id) + " is " +
                              std::to_string(bias) + "; it must be in [-100, 100]");
  }
  return Status::ok();
}

TopTwo top_two(std::span<const float> logits) {
  TopTwo t;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const float x = logits[i];
    if (t.first < 0 || x > t.first_logit) {
      t.second = t.first;
      t.second_logit = t.first_logit;
      t.first = static_cast<TokenId>(i);
      t.first_logit = x;
    } else if (t.second < 0 || x > t.second_logit) {
      t.second = static_cast<TokenId>(i);
      t.second_logit = x;
    }
  }
  return t;
}

double Sampler::uniform() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1p-53;  // [0, 1)
}

void Sampler::absorb(std::span<const TokenId> history, int64_t prompt_len) {
  const auto plen = static_cast<std::size_t>(std::max<int64_t>(prompt_len, 0));
  if (prompt_len != prompt_len_ || history.size() < absorbed_) {  // not a growth: start over
    output_counts_.clear();
    seen_.clear();
    absorbed_ = 0;
    prompt_len_ = prompt_len;
  }
  for (std::size_t i = absorbed_; i < history.size(); ++i) {
    if (i >= plen) ++output_counts_[history[i]];
    if (p_.repetition_penalty != 1.0) seen_.insert(history[i]);
  }
  absorbed_ = history.size();
}

std::span<const float> Sampler::process(std::span<const float> logits,
                                        std::span<const TokenId> history, int64_t prompt_len) {
  if (p_.logit_bias.empty() && !p_.penalized()) return logits;
  absorb(history, prompt_len);
  processed_.assign(logits.begin(), logits.end());
  const auto n = static_cast<TokenId>(processed_.size());
  // Each step on one logit depends on that logit alone: the order of the ids does not matter.
  auto at = [&](TokenId id) -> float* {
    return id >= 0 && id < n ? &processed_[static_cast<std::size_t>(id)] : nullptr;
  };
  for (const auto& [id, bias] : p_.logit_bias)
    if (float* x = at(id)) *x = static_cast<float>(static_cast<double>(*x) + bias);
  const double r = p_.repetition_penalty;
  if (r != 1.0)
    for (const TokenId id : seen_)
      if (float* x = at(id))
        *x = static_cast<float>(*x > 0 ? static_cast<double>(*x) / r : static_cast<double>(*x) * r);
  if (p_.presence_penalty != 0.0 || p_.frequency_penalty != 0.0)
    for (const auto& [id, count] : output_counts_)
      if (float* x = at(id))
        *x = static_cast<float>(static_cast<double>(*x) -
                                static_cast<double>(count) * p_.frequency_penalty -
                                p_.presence_penalty);
  return processed_;
}

TokenId Sampler::sample(std::span<const float> logits) {
  if (logits.empty()) return -1;
  if (p_.temperature <= 0.0) return top_two(logits).first;
  std::vector<TokenId> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  const auto before = logit_order(logits);
  std::size_t k = ids.size();
  if (p_.top_k > 0 && static_cast<std::size_t>(p_.top_k) < k) {
    k = static_cast<std::size_t>(p_.top_k);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), before);
  } else {
    std::sort(ids.begin(), ids.end(), before);
  }
  ids.resize(k);
  const double mx = logits[static_cast<std::size_t>(ids[0])];
  std::vector<double> p(k);
  for (std::size_t i = 0; i < k; ++i)
    p[i] = std::exp((logits[static_cast<std::size_t>(ids[i])] - mx) / p_.temperature);
  // min_p: p[0] = 1 is the largest probability (unnormalized), so the cut is p >= min_p.
  if (p_.min_p > 0.0)
    while (k > 1 && p[k - 1] < p_.min_p) --k;
  double sum = 0.0;
  for (std::size_t i = 0; i < k; ++i) sum += p[i];
  std::size_t keep = k;
  if (p_.top_p < 1.0) {
    double c = 0.0;
    for (std::size_t i = 0; i < k; ++i) {
      c += p[i] / sum;
      if (c >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) total += p[i];
  const double u = uniform() * total;
  double c = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    c += p[i];
    if (u < c) return ids[i];
  }
  return ids[keep - 1];
}

TokenLogprobs token_logprobs(std::span<const float> logits, TokenId chosen, int top) {
  TokenLogprobs out;
  if (logits.empty()) return out;
  double mx = -std::numeric_limits<double>::infinity();
  for (const float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0.0;
  for (const float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  const double lse = mx + std::log(sum);
  auto logprob = [&](TokenId id) {
    return static_cast<double>(logits[static_cast<std::size_t>(id)]) - lse;
  };
  if (chosen >= 0 && static_cast<std::size_t>(chosen) < logits.size())
    out.logprob = logprob(chosen);
  const std::size_t k = std::min(static_cast<std::size_t>(std::max(top, 0)), logits.size());
  if (k == 0) return out;
  std::vector<TokenId> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(),
                    logit_order(logits));
  // Tokens a constraint masked (-inf) cannot come: they are not among the likely ones.
  for (std::size_t i = 0; i < k && std::isfinite(logprob(ids[i])); ++i)
    out.top.emplace_back(ids[i], logprob(ids[i]));
  return out;
}

}  // namespace treeattn::model
