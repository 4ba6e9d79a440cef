// Byte-level BPE tokenizer from GGUF metadata (see include/treeattn/tokenizer.hpp).
//
// Followed: llama.cpp's src/llama-vocab.cpp (pre-tokenizer regexes per tokenizer.ggml.pre,
// special-token partition, BPE with a priority queue of bigrams ranked by merge index,
// token_to_piece) and src/unicode.cpp (sequential regex splitting, GPT-2 byte mapping),
// as vendored in llama-cpp-python 0.3.x. The expected ids in tests/model/data were produced
// by that llama.cpp (tests/model/make_tokenizer_fixture.py).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "treeattn/tokenizer.hpp"

#include <pcre2.h>

#include <algorithm>
#include <array>
#include <functional>
#include <queue>
#include <unordered_map>

#include "model/jinja/chat_template.hpp"

namespace treeattn {
namespace {

// Unicode White_Space, which is what llama.cpp's unicode tables call whitespace; PCRE2's own
// \s under UCP adds U+180E, so the regexes below spell the set out. Written for use inside a
// character class.
#define TA_WS                                                                        \
  "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}" \
  "\\x{202F}\\x{205F}\\x{3000}"

// GPT-2's pattern as llama.cpp writes it for LLAMA_VOCAB_PRE_TYPE_GPT2 (and as the second
// pattern of SMOLLM / STARCODER / ...):
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
// (its hand-written matcher, unicode_regex_split_custom_gpt2, also takes a lone \s+ last).
constexpr const char* kGpt2Regex = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" TA_WS
                                   "\\p{L}\\p{N}]+|[" TA_WS "]+(?![^" TA_WS "])|[" TA_WS "]+";

// LLAMA_VOCAB_PRE_TYPE_LLAMA3 ("llama3", "llama-v3", "llama-bpe", "falcon3", ...), llama.cpp's
// adaptation (case-insensitive contractions spelled out) of Llama 3's tokenizer.json pattern:
//   (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|
//   \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
constexpr const char* kLlama3Regex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^" TA_WS "\\p{L}\\p{N}]+[\\r\\n]*|[" TA_WS "]*[\\r\\n]+|[" TA_WS "]+(?![^" TA_WS
    "])|[" TA_WS "]+";

// LLAMA_VOCAB_PRE_TYPE_QWEN2 ("qwen2", "deepseek-r1-qwen"): Llama 3's pattern with every digit
// a piece of its own (\p{N} instead of \p{N}{1,3}), as Qwen2's tokenizer.json writes it.
constexpr const char* kQwen2Regex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^" TA_WS "\\p{L}\\p{N}]+[\\r\\n]*|[" TA_WS "]*[\\r\\n]+|[" TA_WS "]+(?![^" TA_WS
    "])|[" TA_WS "]+";

struct PreTokenizer {
  std::string_view name;
  std::vector<const char*> regexes;  // applied in sequence
  bool ignore_merges;                // emit a whole piece that is a token without BPE
  bool default_add_bos;
};

// LLAMA_VOCAB_PRE_TYPE_DEFAULT (no or "default" tokenizer.ggml.pre).
constexpr const char* kDefaultPunct = "[\\p{P}\\$\\+<=>\\^~\\|]+";

// Every name pre_tokenizer() accepts (llama.cpp's names, plus "gpt2").
constexpr std::string_view kPreNames[] = {
    "default",   "gpt-2",  "gpt2",       "smollm",    "starcoder", "refact",  "command-r",
    "codeshell", "exaone", "minerva-7b", "llama-bpe", "llama3",    "llama-v3",
    "qwen2",     "deepseek-r1-qwen"};

std::string supported_list() {
  std::string s;
  for (const std::string_view n : kPreNames) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

Result<PreTokenizer> pre_tokenizer(std::string_view pre) {
  if (pre == "default")
    return PreTokenizer{
        pre, {kDefaultPunct, kGpt2Regex, "\\p{N}+", "[0-9][0-9][0-9]"}, false, false};
  // llama.cpp's name is "gpt-2"; "gpt2" is accepted as well.
  if (pre == "gpt-2" || pre == "gpt2") return PreTokenizer{pre, {kGpt2Regex}, false, false};
  // SMOLLM shares its patterns with STARCODER, REFACT, COMMAND_R, CODESHELL, EXAONE, MINERVA:
  // every digit a piece of its own, then GPT-2's pattern.
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "command-r" ||
      pre == "codeshell" || pre == "exaone" || pre == "minerva-7b")
    return PreTokenizer{pre, {"\\p{N}", kGpt2Regex}, false, false};
  if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3")
    return PreTokenizer{pre, {kLlama3Regex}, true, true};
  if (pre == "qwen2" || pre == "deepseek-r1-qwen")
    return PreTokenizer{pre, {kQwen2Regex}, false, false};
  return unsupported("tokenizer.ggml.pre '" + std::string(pre) +
                     "' is not supported (supported: " + supported_list() + ")");
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order.
struct ByteMap {
  std::array<uint32_t, 256> cp{};
  std::array<std::string, 256> utf8;
  std::array<int16_t, 324> byte_of{};  // codepoint -> byte, -1 if not a mapped codepoint
  ByteMap() {
    byte_of.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      cp[b] = keep ? b : next++;
      byte_of[cp[b]] = static_cast<int16_t>(b);
      const uint32_t c = cp[b];
      utf8[b] = c < 0x80 ? std::string(1, static_cast<char>(c))
                         : std::string{static_cast<char>(0xC0 | (c >> 6)),
                                       static_cast<char>(0x80 | (c & 0x3F))};
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// Length of the valid UTF-8 sequence at s[i], or 0 if invalid (overlong, surrogate, > U+10FFFF,
// truncated). Also yields the codepoint.
std::size_t utf8_seq(std::string_view s, std::size_t i, uint32_t* cp_out = nullptr) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  std::size_t n;
  uint32_t cp;
  if (c < 0x80) {
    if (cp_out) *cp_out = c;
    return 1;
  } else if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
      (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
    return 0;
  if (cp_out) *cp_out = cp;
  return n;
}

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

}  // namespace

struct Tokenizer::Impl {
  PreTokenizer pre;
  std::string pre_name;
  std::vector<std::unique_ptr<pcre2_code, CodeDeleter>> regexes;
  std::vector<std::string> text;   // stored token text
  std::vector<std::string> bytes;  // decoded bytes of normal/byte tokens
  std::vector<TokenType> type;
  StringMap<TokenId> id_of;
  StringMap<int32_t> merge_rank;  // "left right" -> rank
  std::vector<TokenId> specials;  // control/user-defined/unknown, longest text first
  std::vector<bool> eog;
  TokenId bos = -1, eos = -1, unk = -1, pad = -1;
  bool add_bos = false, add_eos = false;
  std::string default_system;  // of tokenizer.chat_template
  bool has_chat_template = false;
  std::string chat_template;   // tokenizer.chat_template
  // The template parsed (at from_gguf), or why it cannot be (chat_template_error).
  std::shared_ptr<const ModelTemplate> model_template;
  std::string chat_template_error;
  // SentencePiece-style vocabulary (tokenizer.ggml.model = "llama"): no pre-tokenizer or merges;
  // pieces merge by score, spaces are U+2581, unknown bytes fall back to <0xXX> tokens.
  bool spm = false;
  bool add_space_prefix = false;
  std::vector<float> score;
  std::array<TokenId, 256> byte_token{};

  Status split(std::string_view text, std::vector<std::string_view>& pieces) const;
  void bpe(std::string_view word, std::vector<TokenId>& out) const;
  void spm_encode(std::string_view str, std::vector<TokenId>& out) const;
  TokenId lookup(std::string_view s) const {
    const auto it = id_of.find(s);
    return it == id_of.end() ? -1 : it->second;
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::vector<std::string_view> Tokenizer::supported_pre_tokenizers() {
  return {std::begin(kPreNames), std::end(kPreNames)};
}

Result<Tokenizer> Tokenizer::from_gguf(const gguf::File& f) {
  const std::string file = "gguf " + f.path() + ": ";
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;

  Result<std::string_view> model = f.get_string("tokenizer.ggml.model");
  if (!model.is_ok()) return model.status();
  if (*model != "gpt2" && *model != "llama")
    return unsupported(file + "tokenizer.ggml.model is '" + std::string(*model) +
                       "', only 'gpt2' (byte-level BPE) and 'llama' (SentencePiece-style) are "
                       "supported");
  t.spm = *model == "llama";
  Result<std::string_view> pre =
      t.spm ? Result<std::string_view>(std::string_view("default"))
            : f.get_string_or("tokenizer.ggml.pre", "default");
  if (!pre.is_ok()) return pre.status();
  t.pre_name = std::string(*pre);
  Result<PreTokenizer> pt = pre_tokenizer(t.pre_name);
  if (!pt.is_ok()) return Status(pt.status().code(), file + pt.status().message());
  t.pre = std::move(pt.value());
  t.pre.name = t.pre_name;
  for (const char* rx : t.spm ? std::vector<const char*>{} : t.pre.regexes) {
    int err = 0;
    PCRE2_SIZE at = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rx), PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP, &err, &at, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return internal_error("tokenizer: PCRE2 cannot compile the " + t.pre_name +
                            " pre-tokenizer pattern at offset " + std::to_string(at) + ": " +
                            reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // optional speed-up; interpreted otherwise
    t.regexes.emplace_back(code);
  }

  // Vocabulary.
  Result<std::vector<std::string_view>> tokens = f.get_string_array("tokenizer.ggml.tokens");
  if (!tokens.is_ok()) return tokens.status();
  if (tokens->empty() || tokens->size() > static_cast<std::size_t>(INT32_MAX))
    return invalid_argument(file + "tokenizer.ggml.tokens has " + std::to_string(tokens->size()) +
                            " entries");
  const auto n = static_cast<TokenId>(tokens->size());
  t.type.assign(static_cast<std::size_t>(n), TokenType::kNormal);
  if (f.has("tokenizer.ggml.token_type")) {
    Result<std::vector<int64_t>> types = f.get_int_array("tokenizer.ggml.token_type");
    if (!types.is_ok()) return types.status();
    if (types->size() != tokens->size())
      return invalid_argument(file + "tokenizer.ggml.token_type has " +
                              std::to_string(types->size()) + " entries, tokenizer.ggml.tokens " +
                              std::to_string(tokens->size()));
    for (TokenId i = 0; i < n; ++i) {
      const int64_t v = (*types)[i];
      if (v < 0 || v > 6)
        return invalid_argument(file + "tokenizer.ggml.token_type[" + std::to_string(i) +
                                "] = " + std::to_string(v) + ", expected 0..6");
      t.type[i] = static_cast<TokenType>(v);
    }
  }
  const ByteMap& bm = byte_map();
  t.text.reserve(static_cast<std::size_t>(n));
  t.bytes.resize(static_cast<std::size_t>(n));
  t.id_of.reserve(static_cast<std::size_t>(n));
  for (TokenId i = 0; i < n; ++i) {
    const std::string_view s = (*tokens)[i];
    t.text.emplace_back(s);
    t.id_of[t.text.back()] = i;  // a duplicate text maps to its last id, as in llama.cpp
    // Decoded bytes: each codepoint of the stored text back through the byte map; a codepoint
    // outside it (possible only in a vocabulary that is not byte-level) passes through as is.
    std::string& out = t.bytes[i];
    if (t.spm) {  // U+2581 is a space; <0xXX> byte tokens are that byte
      if (t.type[i] == TokenType::kByte && s.size() == 6 && s.starts_with("<0x") && s[5] == '>') {
        out += static_cast<char>(std::stoi(std::string(s.substr(3, 2)), nullptr, 16));
        continue;
      }
      for (std::size_t k = 0; k < s.size();) {
        if (s.substr(k, 3) == "\xe2\x96\x81") {
          out += ' ';
          k += 3;
        } else {
          out += s[k++];
        }
      }
      continue;
    }
    for (std::size_t k = 0; k < s.size();) {
      uint32_t cp = 0;
      const std::size_t len = utf8_seq(s, k, &cp);
      if (len == 0) {
        out += s[k++];
        continue;
      }
      if (cp < bm.byte_of.size() && bm.byte_of[cp] >= 0)
        out += static_cast<char>(bm.byte_of[cp]);
      else
        out.append(s.substr(k, len));
      k += len;
    }
  }

  if (t.spm) {
    Result<std::vector<double>> sc = f.get_float_array("tokenizer.ggml.scores");
    if (!sc.is_ok()) return sc.status();
    if (sc->size() != tokens->size())
      return invalid_argument(file + "tokenizer.ggml.scores has " + std::to_string(sc->size()) +
                              " entries, tokenizer.ggml.tokens " + std::to_string(tokens->size()));
    t.score.assign(sc->begin(), sc->end());
    for (int b = 0; b < 256; ++b) {  // llama.cpp's byte_to_token: <0xXX>, else the byte itself
      static const char* hex = "0123456789ABCDEF";
      const std::string name = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
      TokenId id = t.lookup(name);
      if (id < 0) id = t.lookup(std::string(1, static_cast<char>(b)));
      t.byte_token[static_cast<std::size_t>(b)] = id;
    }
    Result<bool> asp = f.get_bool_or("tokenizer.ggml.add_space_prefix", true);
    if (!asp.is_ok()) return asp.status();
    t.add_space_prefix = *asp;
  }

  // Merges (byte-level BPE only).
  Result<std::vector<std::string_view>> merges =
      t.spm ? Result<std::vector<std::string_view>>(std::vector<std::string_view>{})
            : f.get_string_array("tokenizer.ggml.merges");
  if (!merges.is_ok()) return merges.status();
  t.merge_rank.reserve(merges->size());
  for (std::size_t r = 0; r < merges->size(); ++r) {
    const std::string_view m = (*merges)[r];
    const std::size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
    if (sp == std::string_view::npos || sp + 1 >= m.size())
      return invalid_argument(file + "tokenizer.ggml.merges[" + std::to_string(r) + "] '" +
                              std::string(m.substr(0, 60)) + "' is not 'left right'");
    t.merge_rank.emplace(std::string(m), static_cast<int32_t>(r));  // first rank wins
  }

  // Special ids and BOS/EOS rules.
  const auto id_key = [&](const char* key, TokenId& out) -> Status {
    if (!f.has(key)) return Status::ok();
    Result<int64_t> v = f.get_int(key);
    if (!v.is_ok()) return v.status();
    if (*v < -1 || *v >= n)
      return invalid_argument(file + key + " = " + std::to_string(*v) +
                              " is outside the vocabulary of " + std::to_string(n) + " tokens");
    out = static_cast<TokenId>(*v);
    return Status::ok();
  };
  TREEATTN_RETURN_IF_ERROR(id_key("tokenizer.ggml.bos_token_id", t.bos));
  TREEATTN_RETURN_IF_ERROR(id_key("tokenizer.ggml.eos_token_id", t.eos));
  TREEATTN_RETURN_IF_ERROR(id_key("tokenizer.ggml.unknown_token_id", t.unk));
  TREEATTN_RETURN_IF_ERROR(id_key("tokenizer.ggml.padding_token_id", t.pad));
  Result<bool> add_bos =
      f.get_bool_or("tokenizer.ggml.add_bos_token", t.spm || t.pre.default_add_bos);
  if (!add_bos.is_ok()) return add_bos.status();
  Result<bool> add_eos = f.get_bool_or("tokenizer.ggml.add_eos_token", false);
  if (!add_eos.is_ok()) return add_eos.status();
  t.add_bos = *add_bos;
  t.add_eos = *add_eos;
  if (t.add_bos && t.bos < 0)
    return invalid_argument(file + "BOS is to be added but tokenizer.ggml.bos_token_id is missing");
  if (t.add_eos && t.eos < 0)
    return invalid_argument(file + "EOS is to be added but tokenizer.ggml.eos_token_id is missing");

  Result<std::string_view> tmpl = f.get_string_or("tokenizer.chat_template", "");
  if (!tmpl.is_ok()) return tmpl.status();
  t.default_system = chat_template_default_system(*tmpl);
  t.has_chat_template = !tmpl->empty();
  t.chat_template = std::string(*tmpl);

  // Special tokens, longest first; end-of-generation set.
  t.eog.assign(static_cast<std::size_t>(n), false);
  for (TokenId i = 0; i < n; ++i) {
    const TokenType ty = t.type[i];
    if ((ty == TokenType::kControl || ty == TokenType::kUserDefined || ty == TokenType::kUnknown) &&
        !t.text[i].empty())
      t.specials.push_back(i);
    const std::string& s = t.text[i];
    if (ty == TokenType::kControl &&
        (s == "<|im_end|>" || s == "<|endoftext|>" || s == "<|eot_id|>" || s == "<|eom_id|>" ||
         s == "<end_of_turn>" || s == "<|end|>"))
      t.eog[i] = true;
  }
  if (t.eos >= 0) t.eog[t.eos] = true;
  std::stable_sort(t.specials.begin(), t.specials.end(),
                   [&](TokenId a, TokenId b) { return t.text[a].size() > t.text[b].size(); });
  Tokenizer tok(std::move(impl));
  if (!tok.impl_->chat_template.empty()) {
    // The model's own chat template, with the vocabulary's BOS and EOS text; a template the
    // interpreter cannot parse leaves its reason for encode_chat to report.
    const auto text_of = [&](TokenId id) {
      if (id < 0) return std::string();
      auto p = tok.token_to_piece(id, /*render_special=*/true);
      return p.is_ok() ? std::move(p).value() : std::string();
    };
    auto m = ModelTemplate::parse(tok.impl_->chat_template, text_of(tok.impl_->bos),
                                  text_of(tok.impl_->eos));
    if (m.is_ok())
      tok.impl_->model_template = std::make_shared<const ModelTemplate>(std::move(m).value());
    else
      tok.impl_->chat_template_error = m.status().message();
  }
  return tok;
}

// Splits `fragment` (valid UTF-8) into pre-tokenizer pieces: each regex in turn splits every piece
// of the previous pass into its matches and the unmatched text between them.
Status Tokenizer::Impl::split(std::string_view fragment,
                              std::vector<std::string_view>& pieces) const {
  pieces.assign(1, fragment);
  std::vector<std::string_view> next;
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> md;
  for (const auto& rx : regexes) {
    md.reset(pcre2_match_data_create_from_pattern(rx.get(), nullptr));
    if (!md) return Status(Code::kOutOfMemory, "tokenizer: cannot allocate PCRE2 match data");
    next.clear();
    for (const std::string_view piece : pieces) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
      std::size_t pos = 0, emitted = 0;
      while (pos < piece.size()) {
        const int rc = pcre2_match(rx.get(), subject, piece.size(), pos, PCRE2_NO_UTF_CHECK,
                                   md.get(), nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
          PCRE2_UCHAR msg[256];
          pcre2_get_error_message(rc, msg, sizeof(msg));
          return internal_error("tokenizer: PCRE2 match failed: " +
                                std::string(reinterpret_cast<const char*>(msg)));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
        const std::size_t b = ov[0], e = ov[1];
        if (e == b) {  // an empty match (none of the patterns has one): step one character
          pos = b + std::max<std::size_t>(1, utf8_seq(piece, b));
          continue;
        }
        if (b > emitted) next.push_back(piece.substr(emitted, b - emitted));
        next.push_back(piece.substr(b, e - b));
        emitted = pos = e;
      }
      if (emitted < piece.size()) next.push_back(piece.substr(emitted));
    }
    pieces.swap(next);
  }
  return Status::ok();
}

// BPE over one pre-tokenizer piece (raw bytes), as llama.cpp's llm_tokenizer_bpe_session.
void Tokenizer::Impl::bpe(std::string_view raw, std::vector<TokenId>& out) const {
  const ByteMap& bm = byte_map();
  std::string word;
  word.reserve(raw.size() * 2);
  for (const char ch : raw) word += bm.utf8[static_cast<unsigned char>(ch)];
  if (pre.ignore_merges) {
    const TokenId whole = lookup(word);
    if (whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  struct Symbol {
    int prev, next;
    std::size_t start, len;
  };
  std::vector<Symbol> sym;
  for (std::size_t k = 0; k < word.size();) {
    const std::size_t len = utf8_seq(word, k);  // 1 or 2: the byte map's codepoints
    sym.push_back({static_cast<int>(sym.size()) - 1, static_cast<int>(sym.size()) + 1, k, len});
    k += len;
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  struct Bigram {
    int32_t rank;
    int left, right;
    std::size_t len;
  };
  const auto worse = [](const Bigram& a, const Bigram& b) {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  };
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
  std::string key;
  const auto add = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    key.assign(word, sym[l].start, sym[l].len);
    key += ' ';
    key.append(word, sym[r].start, sym[r].len);
    const auto it = merge_rank.find(std::string_view(key));
    if (it != merge_rank.end()) queue.push({it->second, l, r, sym[l].len + sym[r].len});
  };
  for (int i = 1; i < static_cast<int>(sym.size()); ++i) add(i - 1, i);
  while (!queue.empty()) {
    const Bigram bg = queue.top();
    queue.pop();
    Symbol& l = sym[bg.left];
    Symbol& r = sym[bg.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != bg.len) continue;  // outdated
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = bg.left;
    add(l.prev, bg.left);
    add(bg.left, l.next);
  }
  for (int i = 0; i >= 0; i = sym[i].next) {
    const std::string_view s(word.data() + sym[i].start, sym[i].len);
    TokenId id = lookup(s);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    // Not in the vocabulary (a byte whose token the vocabulary lacks, or a merge result of an
    // inconsistent vocabulary): its byte tokens, and bytes without a token are dropped, as
    // llama.cpp drops them (SmolLM2 has no token for bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d,
    // nor for the lead bytes 0xf1, 0xf2 of planes 4-12). Emitting the unknown token instead
    // would put <|endoftext|> into SmolLM2 prompts.
    for (std::size_t k = 0; k < s.size();) {
      const std::size_t len = std::max<std::size_t>(1, utf8_seq(s, k));
      id = lookup(s.substr(k, len));
      if (id >= 0) out.push_back(id);
      k += len;
    }
  }
}

// SentencePiece-style merging, as llama.cpp's llm_tokenizer_spm_session: start from UTF-8
// characters, repeatedly merge the adjacent pair whose concatenation is the vocabulary token of
// highest score (leftmost on ties), then emit each symbol's token, or its bytes' <0xXX> tokens
// when the symbol (a single character) is not in the vocabulary. A merged symbol is always a
// token (a pair is queued only when its text is one), so llama.cpp's re-segmentation of merged
// symbols never applies to them.
void Tokenizer::Impl::spm_encode(std::string_view str, std::vector<TokenId>& out) const {
  struct Symbol {
    int prev, next;
    std::size_t start, len;
  };
  std::vector<Symbol> sym;
  for (std::size_t k = 0; k < str.size();) {
    const std::size_t len = std::min(str.size() - k, std::max<std::size_t>(1, utf8_seq(str, k)));
    sym.push_back({static_cast<int>(sym.size()) - 1, static_cast<int>(sym.size()) + 1, k, len});
    k += len;
  }
  if (sym.empty()) return;
  sym.back().next = -1;
  struct Bigram {
    float score;
    int left, right;
    std::size_t len;
  };
  const auto worse = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
  const auto add = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    const TokenId id = lookup(str.substr(sym[l].start, sym[l].len + sym[r].len));
    if (id >= 0) queue.push({score[static_cast<std::size_t>(id)], l, r, sym[l].len + sym[r].len});
  };
  for (int i = 1; i < static_cast<int>(sym.size()); ++i) add(i - 1, i);
  while (!queue.empty()) {
    const Bigram bg = queue.top();
    queue.pop();
    Symbol& l = sym[bg.left];
    Symbol& r = sym[bg.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != bg.len) continue;  // outdated
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = bg.left;
    add(l.prev, bg.left);
    add(bg.left, l.next);
  }
  for (int i = 0; i >= 0; i = sym[i].next) {
    const std::string_view s = str.substr(sym[i].start, sym[i].len);
    const TokenId id = lookup(s);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (const char ch : s) {
      const TokenId b = byte_token[static_cast<unsigned char>(ch)];
      if (b >= 0)
        out.push_back(b);
      else if (unk >= 0)
        out.push_back(unk);  // llama.cpp throws where neither exists
    }
  }
}

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text, bool add_special,
                                               bool parse_special) const {
  return encode_impl(text, add_special, parse_special, {});
}

Result<std::vector<TokenId>> Tokenizer::encode(
    std::string_view text, bool add_special,
    std::span<const std::pair<uint32_t, uint32_t>> plain) const {
  return encode_impl(text, add_special, true, plain);
}

Result<std::vector<TokenId>> Tokenizer::encode_impl(
    std::string_view text, bool add_special, bool parse_special,
    std::span<const std::pair<uint32_t, uint32_t>> plain) const {
  const Impl& t = *impl_;
  // Whether [a, b) overlaps a plain range (binary search over the sorted ranges).
  const auto in_plain = [&](std::size_t a, std::size_t b) {
    auto it = std::upper_bound(plain.begin(), plain.end(), a,
                               [](std::size_t x, const auto& r) { return x < r.second; });
    return it != plain.end() && it->first < b;
  };
  for (std::size_t k = 0; k < text.size();) {
    const std::size_t len = utf8_seq(text, k);
    if (len == 0) {
      static const char* hex = "0123456789abcdef";
      const auto c = static_cast<unsigned char>(text[k]);
      return invalid_argument(std::string("tokenizer: the text is not valid UTF-8 at byte ") +
                              std::to_string(k) + " (0x" + hex[c >> 4] + hex[c & 15] + ")");
    }
    k += len;
  }

  // Partition on special tokens: fragments are either a token id or a span of raw text.
  struct Fragment {
    TokenId id;  // -1 for text
    std::string_view text;
  };
  std::vector<Fragment> frags{{-1, text}};
  for (const TokenId sid : t.specials) {
    const TokenType ty = t.type[sid];
    if (!parse_special && (ty == TokenType::kControl || ty == TokenType::kUnknown)) continue;
    const std::string& st = t.text[sid];
    std::vector<Fragment> next;
    next.reserve(frags.size());
    for (const Fragment& fr : frags) {
      if (fr.id >= 0) {
        next.push_back(fr);
        continue;
      }
      std::size_t from = 0;
      for (std::size_t at, look = 0; (at = fr.text.find(st, look)) != std::string_view::npos;) {
        const auto abs = static_cast<std::size_t>(fr.text.data() - text.data()) + at;
        if (!plain.empty() && in_plain(abs, abs + st.size())) {
          look = at + 1;  // conversation text: not a token here
          continue;
        }
        if (at > from) next.push_back({-1, fr.text.substr(from, at - from)});
        next.push_back({sid, {}});
        from = look = at + st.size();
      }
      if (from < fr.text.size()) next.push_back({-1, fr.text.substr(from)});
    }
    frags.swap(next);
  }

  std::vector<TokenId> out;
  if (add_special && t.add_bos) out.push_back(t.bos);
  std::vector<std::string_view> pieces;
  bool prev_special = true;  // SentencePiece: a space prefix at the start and after specials
  for (const Fragment& fr : frags) {
    if (fr.id >= 0) {
      out.push_back(fr.id);
      prev_special = true;
      continue;
    }
    if (t.spm) {
      std::string escaped = t.add_space_prefix && prev_special ? "\xe2\x96\x81" : "";
      for (const char ch : fr.text) {
        if (ch == ' ')
          escaped += "\xe2\x96\x81";
        else
          escaped += ch;
      }
      t.spm_encode(escaped, out);
      prev_special = false;
      continue;
    }
    TREEATTN_RETURN_IF_ERROR(t.split(fr.text, pieces));
    for (const std::string_view p : pieces) t.bpe(p, out);
  }
  if (add_special && t.add_eos) out.push_back(t.eos);
  return out;
}

Result<std::string> Tokenizer::token_to_piece(TokenId id, bool render_special) const {
  const Impl& t = *impl_;
  if (id < 0 || id >= n_vocab())
    return invalid_argument("tokenizer: token id " + std::to_string(id) +
                            " is outside the vocabulary of " + std::to_string(n_vocab()) +
                            " tokens");
  switch (t.type[id]) {
    case TokenType::kControl:
    case TokenType::kUnknown:
      return render_special ? t.text[id] : std::string();
    case TokenType::kUserDefined:
      return t.text[id];
    case TokenType::kUnused:
    case TokenType::kUndefined:
    case TokenType::kNormal:
    case TokenType::kByte:
      return t.bytes[id];
  }
  return std::string();
}

Result<std::string> Tokenizer::decode(std::span<const TokenId> ids, bool render_special) const {
  std::string out;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    Result<std::string> piece = token_to_piece(ids[k], render_special);
    if (!piece.is_ok())
      return invalid_argument(piece.status().message() + " (at position " + std::to_string(k) +
                              " of " + std::to_string(ids.size()) + ")");
    out += *piece;
  }
  return out;
}

int32_t Tokenizer::n_vocab() const { return static_cast<int32_t>(impl_->text.size()); }
std::string_view Tokenizer::pre() const { return impl_->pre_name; }
std::string_view Tokenizer::token_text(TokenId id) const {
  return id >= 0 && id < n_vocab() ? std::string_view(impl_->text[id]) : std::string_view();
}
TokenType Tokenizer::token_type(TokenId id) const {
  return id >= 0 && id < n_vocab() ? impl_->type[id] : TokenType::kUndefined;
}
TokenId Tokenizer::find_token(std::string_view text) const { return impl_->lookup(text); }
TokenId Tokenizer::bos_id() const { return impl_->bos; }
TokenId Tokenizer::eos_id() const { return impl_->eos; }
TokenId Tokenizer::unknown_id() const { return impl_->unk; }
TokenId Tokenizer::padding_id() const { return impl_->pad; }
bool Tokenizer::add_bos() const { return impl_->add_bos; }
bool Tokenizer::add_eos() const { return impl_->add_eos; }
std::string_view Tokenizer::default_system() const { return impl_->default_system; }
std::string_view Tokenizer::chat_template() const { return impl_->chat_template; }
std::string_view Tokenizer::chat_template_error() const { return impl_->chat_template_error; }
std::shared_ptr<const ModelTemplate> Tokenizer::model_template() const {
  return impl_->model_template;
}

Result<std::vector<TokenId>> Tokenizer::encode_chat(std::span<const ChatTurn> turns,
                                                    std::optional<std::string_view> system) const {
  const Impl& t = *impl_;
  const bool has_system = !turns.empty() && turns[0].role == "system";
  if (!t.chat_template_error.empty())
    return invalid_argument("the model's chat template cannot be rendered: " +
                            t.chat_template_error);
  if (!t.model_template) {
    // No template (a base model): the plain transcript.
    const std::string text = format_chat(ChatFormat::kTranscript, turns,
                                         system ? *system : default_system());
    return encode(text, true, true);
  }
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (!has_system && system && !system->empty())
    messages.push_back({{"role", "system"}, {"content", std::string(*system)}});
  for (const ChatTurn& c : turns)
    messages.push_back({{"role", std::string(c.role)}, {"content", std::string(c.content)}});
  auto p = t.model_template->render(messages, nullptr, /*add_generation_prompt=*/true, t.add_bos);
  if (!p.is_ok()) return p.status();
  return encode(p->text, true, p->data_ranges);
}
bool Tokenizer::has_chat_template() const { return impl_->has_chat_template; }
ChatFormat Tokenizer::chat_format() const {
  if (!impl_->has_chat_template) return ChatFormat::kTranscript;
  const auto control = [&](std::string_view t) {
    const TokenId id = find_token(t);
    return id >= 0 && token_type(id) == TokenType::kControl;
  };
  return control("<start_of_turn>") && control("<end_of_turn>") && find_token("<|im_start|>") < 0
             ? ChatFormat::kGemma
             : ChatFormat::kChatML;
}
bool Tokenizer::is_end_of_generation(TokenId id) const {
  return id >= 0 && id < n_vocab() && impl_->eog[id];
}

std::string format_chatml(std::string_view user, std::string_view system) {
  const ChatTurn turn{"user", user};
  return format_chat(ChatFormat::kChatML, std::span<const ChatTurn>(&turn, 1), system);
}

namespace {
std::string_view trim(std::string_view v) {
  constexpr std::string_view kWs = " \t\n\r\f\v";
  const auto a = v.find_first_not_of(kWs);
  if (a == std::string_view::npos) return {};
  return v.substr(a, v.find_last_not_of(kWs) - a + 1);
}
}  // namespace

std::string format_chat(ChatFormat format, std::span<const ChatTurn> turns,
                        std::string_view default_system) {
  std::string s;
  const bool has_system = !turns.empty() && turns[0].role == "system";
  if (format == ChatFormat::kChatML) {
    if (!has_system && !default_system.empty())
      s += "<|im_start|>system\n" + std::string(default_system) + "<|im_end|>\n";
    for (const ChatTurn& t : turns)
      s += "<|im_start|>" + std::string(t.role) + "\n" + std::string(t.content) + "<|im_end|>\n";
    s += "<|im_start|>assistant\n";
    return s;
  }
  if (format == ChatFormat::kTranscript) {
    std::size_t first = 0;
    if (has_system) {
      s += std::string(trim(turns[0].content)) + "\n\n";
      first = 1;
    } else if (!default_system.empty()) {
      s += std::string(trim(default_system)) + "\n\n";
    }
    for (std::size_t i = first; i < turns.size(); ++i)
      s += std::string(turns[i].role == "assistant" ? "Assistant: " : "User: ") +
           std::string(trim(turns[i].content)) + "\n";
    s += "Assistant:";
    return s;
  }
  std::string prefix;  // Gemma: the system text goes into the first user turn
  std::size_t first = 0;
  if (has_system) {
    prefix = std::string(trim(turns[0].content)) + "\n\n";
    first = 1;
  } else if (!default_system.empty()) {
    prefix = std::string(default_system) + "\n\n";
  }
  for (std::size_t i = first; i < turns.size(); ++i) {
    const std::string_view role = turns[i].role == "assistant" ? "model" : turns[i].role;
    s += "<start_of_turn>" + std::string(role) + "\n" + (i == first ? prefix : std::string()) +
         std::string(trim(turns[i].content)) + "<end_of_turn>\n";
  }
  s += "<start_of_turn>model\n";
  return s;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

StopMatcher::Out StopMatcher::push(std::string_view text) {
  held_.append(text);
  Out out;
  std::size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    out.text = held_.substr(0, first);
    out.stopped = true;
    held_.clear();
    return out;
  }
  // Hold back the longest end of the text that is a proper prefix of a stop string.
  std::size_t hold = 0;
  for (const std::string& s : stops_)
    for (std::size_t k = std::min(s.size() - 1, held_.size()); k > hold; --k)
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  out.text = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

std::vector<std::string> chat_stop_strings(ChatFormat format) {
  if (format == ChatFormat::kTranscript) return {"\nUser:"};
  return {};
}

std::string chat_template_default_system(std::string_view jinja) {
  // The newline after "system" is a newline character in some templates (SmolLM2's) and the
  // escape \n inside a Jinja string literal in others (Qwen2.5's).
  constexpr std::string_view kOpen = "<|im_start|>system";
  for (auto a = jinja.find(kOpen); a != std::string_view::npos; a = jinja.find(kOpen, a + 1)) {
    std::string_view rest = jinja.substr(a + kOpen.size());
    bool escaped = false;
    if (rest.starts_with("\\n")) {
      escaped = true;
      rest.remove_prefix(2);
    } else if (rest.starts_with('\n')) {
      rest.remove_prefix(1);
    } else {
      continue;
    }
    const auto b = rest.find("<|im_end|>");
    if (b == std::string_view::npos) break;
    const std::string_view text = rest.substr(0, b);
    // Only a literal: where the template inserts a message's content here the text between the
    // markers has quotes, braces or a '+'.
    if (text.empty() || text.find_first_of("'\"{}+") != std::string_view::npos) continue;
    std::string out;
    for (std::size_t k = 0; k < text.size(); ++k) {
      if (escaped && text[k] == '\\' && k + 1 < text.size() && text[k + 1] == 'n') {
        out += '\n';
        ++k;
      } else {
        out += text[k];
      }
    }
    return out;
  }
  return {};
}

}  // namespace treeattn
