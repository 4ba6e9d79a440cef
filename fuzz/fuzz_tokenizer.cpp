// libFuzzer target: the byte-level BPE tokenizer's encoder (include/treeattn/tokenizer.hpp) on
// arbitrary bytes, with every supported pre-tokenizer over a small vocabulary (the 256 byte
// tokens, merges, control and user-defined tokens, as tests/model/test_tokenizer.cpp builds it)
// and, when the real model is on disk ($TREEATTN_MODEL or models/), SmolLM2's 49,152-token
// vocabulary. The first input byte picks the tokenizer and the flags, the rest is the text.
// Invalid UTF-8 must be an error; valid text must encode to ids in [0, n_vocab) that decode;
// over the small vocabulary (every byte has a token) decode(encode(text)) must give the text
// back byte for byte.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "model/gguf_builder.hpp"
#include "treeattn/tokenizer.hpp"

namespace {

using treeattn::Tokenizer;
using treeattn::gguf::File;

// GPT-2's bytes_to_unicode: the text of the token for byte b.
std::string byte_token(int b) {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int next = 256;
    for (int c = 0; c < 256; ++c) {
      const bool keep = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE);
      const int cp = keep ? c : next++;
      t[c] = cp < 0x80 ? std::string(1, static_cast<char>(cp))
                       : std::string{static_cast<char>(0xC0 | (cp >> 6)),
                                     static_cast<char>(0x80 | (cp & 0x3F))};
    }
    return t;
  }();
  return table[static_cast<std::size_t>(b)];
}

struct Loaded {
  std::unique_ptr<File> file;  // the tokenizer's strings point into it
  std::unique_ptr<Tokenizer> tok;
  bool every_byte = false;     // round trips exactly
};

std::vector<Loaded> load_all() {
  std::vector<Loaded> out;
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(byte_token(b));
    types.push_back(1);
  }
  const std::vector<std::pair<std::string, int32_t>> extra = {
      {"Ġt", 1},  {"he", 1}, {"Ġthe", 1}, {"<|im_start|>", 3}, {"<|im_end|>", 3},
      {"<user_tok>", 4}, {"bc", 1}, {"ab", 1}, {"12", 1}, {"the", 1}, {"123", 1},
      {"ĠĠ", 1}, {"ĊĊ", 1}, {"Ã©", 1}};
  for (const auto& [t, ty] : extra) {
    tokens.push_back(t);
    types.push_back(ty);
  }
  const std::vector<std::string> merges = {"Ġ t", "h e", "Ġt he", "b c", "a b",
                                           "1 2", "12 3", "Ġ Ġ", "Ċ Ċ", "Ã ©"};
  char dir_tmpl[] = "/tmp/treeattn_fuzz_tok_XXXXXX";
  const std::string dir = mkdtemp(dir_tmpl);
  for (std::string_view pre : Tokenizer::supported_pre_tokenizers()) {
    treeattn::testing::GgufBuilder b;
    b.str("tokenizer.ggml.model", "gpt2").str("tokenizer.ggml.pre", pre);
    b.string_array("tokenizer.ggml.tokens", tokens);
    b.array("tokenizer.ggml.token_type", treeattn::gguf::ValueType::kInt32, types);
    b.string_array("tokenizer.ggml.merges", merges);
    b.u32("tokenizer.ggml.bos_token_id", 256 + 3).u32("tokenizer.ggml.eos_token_id", 256 + 4);
    const std::string path = dir + "/" + std::string(pre) + ".gguf";
    treeattn::testing::GgufBuilder::write(path, b.build());
    auto f = File::open(path);
    if (!f.is_ok()) {
      std::fprintf(stderr, "fuzz_tokenizer: %s\n", f.status().to_string().c_str());
      std::abort();
    }
    Loaded l;
    l.file = std::make_unique<File>(std::move(f).value());
    auto t = Tokenizer::from_gguf(*l.file);
    if (!t.is_ok()) {
      std::fprintf(stderr, "fuzz_tokenizer: pre %s: %s\n", std::string(pre).c_str(),
                   t.status().to_string().c_str());
      std::abort();
    }
    l.tok = std::make_unique<Tokenizer>(std::move(t).value());
    l.every_byte = true;
    out.push_back(std::move(l));
    std::filesystem::remove(path);  // the mapping stays valid
  }
  std::filesystem::remove(dir);
  std::string model;
  if (const char* env = std::getenv("TREEATTN_MODEL")) model = env;
  if (model.empty()) model = TREEATTN_FUZZ_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (std::filesystem::is_regular_file(model)) {
    auto f = File::open(model);
    if (f.is_ok()) {
      Loaded l;
      l.file = std::make_unique<File>(std::move(f).value());
      auto t = Tokenizer::from_gguf(*l.file);
      if (t.is_ok()) {
        l.tok = std::make_unique<Tokenizer>(std::move(t).value());
        out.push_back(std::move(l));
        std::fprintf(stderr, "fuzz_tokenizer: with the real vocabulary of %s\n", model.c_str());
      }
    }
  }
  return out;
}

bool valid_utf8(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
    else return false;
    if (i + static_cast<std::size_t>(n) >= s.size()) return false;  // truncated
    for (int k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += static_cast<std::size_t>(n) + 1;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  static const std::vector<Loaded> all = load_all();
  if (size == 0) return 0;
  const Loaded& l = all[data[0] % all.size()];
  const bool add_special = (data[0] / all.size()) % 2 == 1;
  const bool parse_special = (data[0] / all.size() / 2) % 2 == 1;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto ids = l.tok->encode(text, add_special, parse_special);
  const bool utf8 = valid_utf8(text);
  if (ids.is_ok() != utf8) {
    std::fprintf(stderr, "encode %s text that is %s UTF-8\n", ids.is_ok() ? "accepted" : "refused",
                 utf8 ? "valid" : "invalid");
    __builtin_trap();
  }
  if (!ids.is_ok()) return 0;
  for (auto id : *ids)
    if (id < 0 || id >= l.tok->n_vocab()) __builtin_trap();
  auto back = l.tok->decode(*ids, /*render_special=*/true);
  if (!back.is_ok()) __builtin_trap();
  if (l.every_byte && !add_special && *back != text) {
    std::fprintf(stderr, "round trip: %zu bytes in, %zu bytes out\n", text.size(), back->size());
    __builtin_trap();
  }
  return 0;
}
