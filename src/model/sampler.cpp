// Token selection (greedy, temperature / top-k / top-p with a seeded splitmix64 stream): a pure
// function of the logits bits, the parameters and the number of draws so far, so every rank of a
// generation picks the same token without communicating. See include/treeattn/generate.hpp.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "treeattn/generate.hpp"

namespace treeattn::model {

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0) || !std::isfinite(temperature))
    return invalid_argument("--temperature " + std::to_string(temperature) +
                            " must be a finite number >= 0 (0: greedy)");
  if (top_k < 0) return invalid_argument("--top-k " + std::to_string(top_k) + " must be >= 0");
  if (!(top_p > 0.0 && top_p <= 1.0))
    return invalid_argument("--top-p " + std::to_string(top_p) + " must be in (0, 1]");
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

TokenId Sampler::sample(std::span<const float> logits) {
  if (logits.empty()) return -1;
  if (p_.temperature <= 0.0) return top_two(logits).first;
  std::vector<TokenId> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  // Descending logit, ascending id on ties: a total order, so the candidate list is the same
  // on every rank.
  auto before = [&](TokenId a, TokenId b) {
    const float la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
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
  double sum = 0.0;
  for (std::size_t i = 0; i < k; ++i) {
    p[i] = std::exp((logits[static_cast<std::size_t>(ids[i])] - mx) / p_.temperature);
    sum += p[i];
  }
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

}  // namespace treeattn::model
