// Structured output, part 3: the tokens a constrained request may sample next.
//
// Vocabulary (built once per model): every token's bytes (what it adds to the text), sorted, as
// a trie in pre-order: a node is a prefix, its subtree the contiguous run of sorted tokens that
// start with it, the tokens equal to it first. Per node: whether the bytes below it are, for
// every token, string text (string_text: complete UTF-8 characters other than '"', '\' and
// controls) and how many bytes lie below it at most. Tokens without bytes (control tokens) are
// never sampled inside an output; the end-of-generation tokens may come once the output is a
// complete value.
//
// TokenConstraint (one per request): mask() walks the trie depth first from the matcher's
// state, feeding each edge's byte (Matcher::feed); a subtree whose first byte cannot follow is
// skipped whole, and a subtree of string text inside a string with room for it (its bytes bound
// its code points) is allowed whole without a walk (most of a string's tokens). The tokens whose
// every byte follows keep their logits; the others become -inf; where the output is a complete
// value the end tokens are kept too, and where nothing may follow it they are all that is kept.
// accept() advances the matcher by the sampled token. All of it is a function of the grammar, the
// vocabulary and the tokens so far: every rank computes the same mask.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/structured/matcher.hpp"
#include "treeattn/tokenizer.hpp"  // TokenId

namespace treeattn::structured {

class Vocabulary {
 public:
  // pieces[id]: the bytes token id adds to the text (empty for control tokens); end: the
  // end-of-generation tokens.
  Vocabulary(std::span<const std::string> pieces, std::vector<TokenId> end);

  int32_t size() const { return static_cast<int32_t>(pieces_.size()); }
  const std::string& piece(TokenId id) const { return pieces_[static_cast<std::size_t>(id)]; }
  bool is_end(TokenId id) const;
  const std::vector<TokenId>& end_tokens() const { return end_; }

 private:
  friend class TokenConstraint;
  struct TrieNode {
    int32_t end = 0;                    // one past this node's subtree, in nodes_
    int32_t lo = 0, exact = 0, hi = 0;  // sorted_: [lo, hi) its subtree, [lo, exact) equal to it
    int32_t below = 0;                  // the most bytes below it
    uint8_t byte = 0;                   // the edge into it
    bool plain = true;                  // the bytes below it are string text, for every token
  };
  int32_t build(int32_t lo, int32_t hi, std::size_t depth, uint8_t byte);

  std::vector<std::string> pieces_;
  std::vector<TokenId> end_;     // sorted
  std::vector<TokenId> sorted_;  // the tokens with bytes, by their bytes
  std::vector<TrieNode> nodes_;  // pre-order; 0 is the empty prefix
  std::size_t longest_ = 0;
};

// The vocabulary of a model's tokenizer: each token's piece (control tokens: none), the
// end-of-generation tokens (Tokenizer::is_end_of_generation); n_vocab ids (the model's).
std::shared_ptr<const Vocabulary> vocabulary_of(const Tokenizer& tokenizer, int32_t n_vocab);

class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab);

  // logits: one per token of the vocabulary. The logits of tokens that cannot come next
  // become -inf.
  void mask(std::span<float> logits);
  // The tokens mask() keeps, as a flag per token id (tests, the benchmark).
  const std::vector<uint8_t>& allowed(std::span<float> logits) {
    mask(logits);
    return keep_;
  }

  enum class Step : uint8_t {
    kContinue,  // the token's bytes extend the output
    kEnded,     // an end token after a complete value: the output is finished
    kRefused,   // the token cannot come next (only when mask() was not applied)
  };
  Step accept(TokenId token);
  bool complete() const { return matcher_.can_end(matcher_.state()); }
  const Matcher& matcher() const { return matcher_; }

 private:
  void walk(int32_t node, const Tops& state, std::size_t depth);
  void keep_sorted(int32_t lo, int32_t hi);

  Matcher matcher_;
  std::shared_ptr<const Vocabulary> vocab_;
  FrameArena arena_;
  std::vector<Tops> scratch_;  // per walk depth
  std::vector<uint8_t> keep_;  // per token id
};

}  // namespace treeattn::structured
