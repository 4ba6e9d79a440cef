// The vocabulary trie and the per-request token mask (constraint.hpp).
#include "model/structured/constraint.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

namespace treeattn::structured {

Vocabulary::Vocabulary(std::span<const std::string> pieces, std::vector<TokenId> end)
    : pieces_(pieces.begin(), pieces.end()), end_(std::move(end)) {
  std::sort(end_.begin(), end_.end());
  end_.erase(std::unique(end_.begin(), end_.end()), end_.end());
  std::erase_if(end_, [&](TokenId t) { return t < 0 || t >= size(); });
  for (TokenId id = 0; id < size(); ++id)
    if (!pieces_[static_cast<std::size_t>(id)].empty()) sorted_.push_back(id);
  std::stable_sort(sorted_.begin(), sorted_.end(),
                   [&](TokenId a, TokenId b) { return piece(a) < piece(b); });
  build(0, static_cast<int32_t>(sorted_.size()), 0, 0);
}

bool Vocabulary::is_end(TokenId id) const {
  return std::binary_search(end_.begin(), end_.end(), id);
}

int32_t Vocabulary::build(int32_t lo, int32_t hi, std::size_t depth, uint8_t byte) {
  const auto at = static_cast<int32_t>(nodes_.size());
  nodes_.push_back(TrieNode{});
  int32_t exact = lo;
  while (exact < hi && piece(sorted_[static_cast<std::size_t>(exact)]).size() == depth) ++exact;
  longest_ = std::max(longest_, depth);
  bool plain = true;  // every token's bytes below this node are string text
  for (int32_t i = exact; i < hi && plain; ++i)
    plain =
        string_text(std::string_view(piece(sorted_[static_cast<std::size_t>(i)])).substr(depth));
  int32_t below = 0;
  for (int32_t i = exact; i < hi;) {
    const auto c = static_cast<uint8_t>(piece(sorted_[static_cast<std::size_t>(i)])[depth]);
    int32_t j = i;
    while (j < hi && static_cast<uint8_t>(piece(sorted_[static_cast<std::size_t>(j)])[depth]) == c)
      ++j;
    const int32_t child = build(i, j, depth + 1, c);
    const TrieNode& ch = nodes_[static_cast<std::size_t>(child)];
    below = std::max(below, ch.below + 1);
    i = j;
  }
  nodes_[static_cast<std::size_t>(at)] =
      TrieNode{static_cast<int32_t>(nodes_.size()), lo, exact, hi, below, byte, plain};
  return at;
}

std::shared_ptr<const Vocabulary> vocabulary_of(const Tokenizer& tokenizer, int32_t n_vocab) {
  std::vector<std::string> pieces(static_cast<std::size_t>(std::max(n_vocab, 0)));
  std::vector<TokenId> end;
  for (TokenId id = 0; id < tokenizer.n_vocab() && id < n_vocab; ++id) {
    if (tokenizer.is_end_of_generation(id)) end.push_back(id);
    auto piece = tokenizer.token_to_piece(id);
    if (piece.is_ok()) pieces[static_cast<std::size_t>(id)] = std::move(piece).value();
  }
  return std::make_shared<Vocabulary>(pieces, std::move(end));
}

TokenConstraint::TokenConstraint(std::shared_ptr<const Grammar> grammar,
                                 std::shared_ptr<const Vocabulary> vocab)
    : matcher_(std::move(grammar)), vocab_(std::move(vocab)) {
  scratch_.resize(vocab_->longest_ + 2);
  keep_.assign(static_cast<std::size_t>(vocab_->size()), 0);
}

void TokenConstraint::keep_sorted(int32_t lo, int32_t hi) {
  for (int32_t i = lo; i < hi; ++i)
    keep_[static_cast<std::size_t>(vocab_->sorted_[static_cast<std::size_t>(i)])] = 1;
}

void TokenConstraint::walk(int32_t node, const Tops& state, std::size_t depth) {
  const auto& nodes = vocab_->nodes_;
  Tops& next = scratch_[depth];
  for (int32_t c = node + 1; c < nodes[static_cast<std::size_t>(node)].end;
       c = nodes[static_cast<std::size_t>(c)].end) {
    const auto& n = nodes[static_cast<std::size_t>(c)];
    matcher_.feed(state, n.byte, arena_, next);
    if (next.empty()) continue;
    if (n.plain && matcher_.plain_room(next) >= n.below) {
      keep_sorted(n.lo, n.hi);
      continue;
    }
    keep_sorted(n.lo, n.exact);
    walk(c, next, depth + 1);
  }
}

void TokenConstraint::mask(std::span<float> logits) {
  std::fill(keep_.begin(), keep_.end(), 0);
  const Tops& state = matcher_.state();
  if (!Matcher::done(state)) {
    arena_.clear();
    walk(0, state, 0);
  }
  const bool any = std::find(keep_.begin(), keep_.end(), 1) != keep_.end();
  // An end token where the output may end; also where nothing else is kept (a state the grammar
  // should never reach: the request then ends rather than sample from nothing).
  if (matcher_.can_end(state) || !any)
    for (const TokenId t : vocab_->end_tokens()) keep_[static_cast<std::size_t>(t)] = 1;
  const std::size_t n = std::min(logits.size(), keep_.size());
  for (std::size_t i = 0; i < n; ++i)
    if (!keep_[i]) logits[i] = -std::numeric_limits<float>::infinity();
}

TokenConstraint::Step TokenConstraint::accept(TokenId token) {
  if (token < 0 || token >= vocab_->size()) return Step::kRefused;
  if (vocab_->is_end(token)) return Step::kEnded;
  const std::string& bytes = vocab_->piece(token);
  if (bytes.empty() || !matcher_.advance(bytes)) return Step::kRefused;
  return Step::kContinue;
}

}  // namespace treeattn::structured
