// A Codec for tests: token id b < 256 is the byte b, 256 is the end-of-generation token, 257 a
// control token that renders as nothing. Multi-byte UTF-8 characters span several tokens, as
// with byte-level BPE.
#pragma once

#include <string>
#include <vector>

#include "serve/api.hpp"

namespace treeattn::serve::testing {

inline constexpr TokenId kByteEos = 256;
inline constexpr TokenId kByteControl = 257;

class ByteCodec final : public Codec {
 public:
  Result<std::vector<TokenId>> encode(std::string_view text, bool) const override {
    std::vector<TokenId> ids;
    for (const char c : text) ids.push_back(static_cast<unsigned char>(c));
    return ids;
  }
  // No special tokens among bytes: the conversation's ranges change nothing.
  Result<std::vector<TokenId>> encode_chat(
      std::string_view text, std::span<const std::pair<uint32_t, uint32_t>>) const override {
    return encode(text, true);
  }
  std::string piece(TokenId id) const override {
    return id < 256 ? std::string(1, static_cast<char>(id)) : std::string();
  }
  int32_t n_vocab() const override { return 258; }
  std::vector<TokenId> end_of_generation() const override { return {kByteEos}; }
  std::size_t max_token_bytes() const override { return 1; }
  // No BOS, and no control token has a text: add_special and parse_special change nothing.
  Result<std::vector<TokenId>> tokenize(std::string_view text, bool, bool) const override {
    return encode(text, false);
  }
};

inline std::vector<TokenId> bytes_of(std::string_view s) {
  std::vector<TokenId> ids;
  for (const char c : s) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

}  // namespace treeattn::serve::testing
