// The model's tokenizer as the server's Codec (api.hpp).
#pragma once

#include <vector>

#include "serve/api.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::serve {

class TokenizerCodec final : public Codec {
 public:
  explicit TokenizerCodec(const Tokenizer& tokenizer);
  Result<std::vector<TokenId>> encode(std::string_view text, bool parse_special) const override;
  Result<std::vector<TokenId>> encode_chat(
      std::string_view text,
      std::span<const std::pair<uint32_t, uint32_t>> conversation) const override;
  std::string piece(TokenId id) const override;
  int32_t n_vocab() const override;
  std::vector<TokenId> end_of_generation() const override { return eog_; }
  std::size_t max_token_bytes() const override { return max_token_bytes_; }
  Result<std::vector<TokenId>> tokenize(std::string_view text, bool add_special,
                                        bool parse_special) const override;
  std::string token_text(TokenId id) const override;

 private:
  const Tokenizer* tok_;
  std::vector<TokenId> eog_;
  std::size_t max_token_bytes_ = 0;
};

}  // namespace treeattn::serve
