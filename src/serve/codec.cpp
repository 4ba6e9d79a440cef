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
    const TokenType type = tok_->token_type(id);
    if ((type == TokenType::kControl || type == TokenType::kUnknown) && !text.empty())
      control_.emplace_back(std::string(text), id);
  }
  std::stable_sort(control_.begin(), control_.end(), [](const auto& a, const auto& b) {
    return a.first.size() > b.first.size();
  });
}

Result<std::vector<TokenId>> TokenizerCodec::encode_prompt(
    std::span<const PromptPiece> pieces) const {
  std::vector<TokenId> ids;
  if (tok_->add_bos() && tok_->bos_id() >= 0) ids.push_back(tok_->bos_id());
  std::string plain;  // text between two control tokens: one fragment, control tokens not parsed
  auto flush = [&]() -> Status {
    if (plain.empty()) return Status::ok();
    auto enc = tok_->encode(plain, /*add_special=*/false, /*parse_special=*/false);
    if (!enc.is_ok()) return enc.status();
    ids.insert(ids.end(), enc->begin(), enc->end());
    plain.clear();
    return Status::ok();
  };
  for (const PromptPiece& p : pieces) {
    if (!p.markup) {
      plain += p.text;
      continue;
    }
    const std::string_view m = p.text;
    for (std::size_t i = 0; i < m.size();) {
      const auto hit = std::find_if(control_.begin(), control_.end(), [&](const auto& c) {
        return m.substr(i).starts_with(c.first);
      });
      if (hit == control_.end()) {
        plain += m[i++];
        continue;
      }
      TREEATTN_RETURN_IF_ERROR(flush());
      ids.push_back(hit->second);
      i += hit->first.size();
    }
  }
  TREEATTN_RETURN_IF_ERROR(flush());
  if (tok_->add_eos() && tok_->eos_id() >= 0) ids.push_back(tok_->eos_id());
  return ids;
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
