// TokenizerCodec (codec.hpp).
#include "serve/codec.hpp"

#include <algorithm>

namespace treeattn::serve {

TokenizerCodec::TokenizerCodec(const Tokenizer& tokenizer) : tok_(&tokenizer) {
  for (TokenId id = 0; id < tok_->n_vocab(); ++id) {
    if (tok_->is_end_of_generation(id)) eog_.push_back(id);
    const std::string_view text = tok_->token_text(id);
    // Stored text: byte-level encoded (at least as long as the bytes it stands for), control
    // tokens verbatim.
    max_token_bytes_ = std::max(max_token_bytes_, text.size());
  }
}

Result<std::vector<TokenId>> TokenizerCodec::encode(std::string_view text,
                                                    bool parse_special) const {
  return tok_->encode(text, /*add_special=*/true, parse_special);
}

Result<std::vector<TokenId>> TokenizerCodec::encode_chat(
    std::string_view text, std::span<const std::pair<uint32_t, uint32_t>> conversation) const {
  return tok_->encode(text, /*add_special=*/true, conversation);
}

Result<std::vector<TokenId>> TokenizerCodec::tokenize(std::string_view text, bool add_special,
                                                      bool parse_special) const {
  return tok_->encode(text, add_special, parse_special);
}

std::string TokenizerCodec::token_text(TokenId id) const {
  auto p = tok_->token_to_piece(id, /*render_special=*/true);
  return p.is_ok() ? std::move(p).value() : std::string();
}

std::string TokenizerCodec::piece(TokenId id) const {
  auto p = tok_->token_to_piece(id);
  return p.is_ok() ? std::move(p).value() : std::string();
}

int32_t TokenizerCodec::n_vocab() const { return tok_->n_vocab(); }

}  // namespace treeattn::serve
