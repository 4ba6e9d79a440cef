// Byte-level BPE tokenizer (tokenizer.ggml.model = "gpt2") built from GGUF metadata, behaving
// as llama.cpp's (src/llama-vocab.cpp, unicode.cpp) so that token ids match it.
//
// encode(text):
//   1. Special tokens: the text is partitioned on literal occurrences of the special tokens,
//      longest token first as llama.cpp does. Control tokens (<|im_start|>, ...) and the
//      unknown token are matched only with parse_special; user-defined tokens always.
//   2. Pre-tokenizer: each remaining fragment is split by the regexes llama.cpp uses for
//      tokenizer.ggml.pre (applied in sequence, each splitting the pieces of the previous one,
//      unmatched text kept as its own piece), run with PCRE2 in UTF mode with Unicode
//      properties. `\s` is written out as Unicode's White_Space set, llama.cpp's definition.
//   3. Byte-level mapping (GPT-2's bytes_to_unicode) of each piece, then BPE: merge the adjacent
//      pair of lowest merge rank (leftmost on ties) until none applies; pre-tokenizers of the
//      llama-bpe family first emit a whole piece that is itself a token (ignore_merges).
//   4. BOS first / EOS last when add_special and the file asks for them
//      (tokenizer.ggml.add_bos_token / add_eos_token, with llama.cpp's per-pre defaults).
// The input must be valid UTF-8 (an error names the first bad byte otherwise). A byte whose
// byte-level token the vocabulary lacks is dropped, as llama.cpp drops it (SmolLM2 has none
// for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d and the lead bytes 0xf1, 0xf2), so such text does not
// round-trip.
//
// decode(ids) maps each token back to bytes (byte-level mapping reversed; user-defined tokens
// verbatim; control tokens only with render_special) and concatenates them. The result is
// bytes: a cut in the middle of a multi-byte character is left as is.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "treeattn/gguf.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

using TokenId = int32_t;

// tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// How a conversation is written for the model (format_chat below): the turn markers of a chat
// model, or a plain transcript for a base model (a file without a chat template).
enum class ChatFormat : uint8_t { kChatML, kGemma, kTranscript };
struct ChatTurn;
class ModelTemplate;  // src/model/jinja/chat_template.hpp

class Tokenizer {
 public:
  // Reads tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id, eos_token_id,
  // unknown_token_id, padding_token_id, add_bos_token, add_eos_token}. kUnsupported for a
  // model other than gpt2 or an unknown pre-tokenizer (the message lists the supported ones);
  // kInvalidArgument for inconsistent metadata (ids out of range, malformed merges, ...).
  static Result<Tokenizer> from_gguf(const gguf::File& file);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // The supported tokenizer.ggml.pre names (a missing key means "default").
  static std::vector<std::string_view> supported_pre_tokenizers();

  // add_special: BOS/EOS as the file asks. parse_special: control tokens written in the text
  // (e.g. "<|im_start|>") become their ids; otherwise they are tokenized as plain text.
  Result<std::vector<TokenId>> encode(std::string_view text, bool add_special = true,
                                      bool parse_special = true) const;
  // As encode(text, add_special, true), except that no special token is matched where it would
  // overlap one of the byte ranges `plain` (sorted, not overlapping): a chat prompt's
  // conversation text, so that a user's "<|im_start|>" stays text while the chat template's own
  // markers become their tokens. Text is split and merged exactly as encode() splits it.
  Result<std::vector<TokenId>> encode(std::string_view text, bool add_special,
                                      std::span<const std::pair<uint32_t, uint32_t>> plain) const;
  // kInvalidArgument naming the position and id of a token outside [0, n_vocab).
  Result<std::string> decode(std::span<const TokenId> ids, bool render_special = false) const;
  Result<std::string> token_to_piece(TokenId id, bool render_special = false) const;

  int32_t n_vocab() const;
  std::string_view pre() const;                   // the pre-tokenizer in use
  std::string_view token_text(TokenId id) const;  // as stored (byte-level encoded); id checked
  TokenType token_type(TokenId id) const;
  TokenId find_token(std::string_view text) const;  // exact stored text; -1 when absent
  TokenId bos_id() const;                           // -1 when the file has none
  TokenId eos_id() const;
  TokenId unknown_id() const;
  TokenId padding_id() const;
  bool add_bos() const;
  bool add_eos() const;
  // The default system message of the file's chat template (tokenizer.chat_template), as
  // chat_template_default_system() reads it; empty when it has none.
  std::string_view default_system() const;
  // A file with a chat template (tokenizer.chat_template): kGemma when the vocabulary has the
  // control tokens <start_of_turn> and <end_of_turn> and no <|im_start|>, kChatML otherwise.
  // A file without one holds a base (pretrained) model, which was never taught turn markers
  // (Gemma-3-270M's pretrained file carries Gemma's markers in its vocabulary but answers in them
  // with noise): kTranscript.
  ChatFormat chat_format() const;
  bool has_chat_template() const;
  // The file's tokenizer.chat_template (empty: none), and why the Jinja interpreter cannot
  // render it (empty: it can, or there is none).
  std::string_view chat_template() const;
  std::string_view chat_template_error() const;
  // The file's template as the interpreter parsed it, with the vocabulary's BOS and EOS text
  // (null: none, or chat_template_error()).
  std::shared_ptr<const ModelTemplate> model_template() const;
  // The conversation as the model reads it, tokenized: the file's own chat template (messages
  // {"role", "content"}, add_generation_prompt, the vocabulary's BOS/EOS text; `system`, when
  // given and not empty, as a first system message unless the turns start with one), with
  // special tokens parsed only in the template's own text and a leading BOS not doubled. A file
  // without a template: format_chat's transcript (with `system`, or default_system()). A
  // template the interpreter cannot render: kInvalidArgument naming the construct (never
  // another format).
  Result<std::vector<TokenId>> encode_chat(std::span<const ChatTurn> turns,
                                           std::optional<std::string_view> system = {}) const;
  // End of generation: EOS, or a control token named <|im_end|>, <|endoftext|>, <|eot_id|>,
  // <end_of_turn>, <|end|> (what llama.cpp also treats as end-of-generation).
  bool is_end_of_generation(TokenId id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  Result<std::vector<TokenId>> encode_impl(std::string_view text, bool add_special,
                                           bool parse_special,
                                           std::span<const std::pair<uint32_t, uint32_t>> plain) const;
  std::unique_ptr<Impl> impl_;
};

// ChatML, the prompt format of SmolLM2-Instruct, Qwen and others:
//   [<|im_start|>system\n{system}<|im_end|>\n]<|im_start|>user\n{user}<|im_end|>\n
//   <|im_start|>assistant\n
// The system block is left out when `system` is empty. (A model's own template may insert a
// default system message when none is given: Tokenizer::default_system(); pass it as `system`
// to reproduce that exactly.) Encode the result with parse_special = true.
std::string format_chatml(std::string_view user, std::string_view system = {});

// A conversation as the model reads it (Tokenizer::chat_format): ChatML (<|im_start|>,
// SmolLM2, Qwen), Gemma's turns (<start_of_turn>, <end_of_turn>, Gemma 3's template), or a
// plain transcript for a base model:
//   [{system}\n\n]User: {user}\nAssistant: {assistant}\nUser: {user}\nAssistant:
// (contents trimmed; the answer ends where the model starts the next "\nUser:", which
// chat_stop_strings() gives). Gemma's turns:
//   <start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n ... <start_of_turn>model\n
// Gemma has no system role: the system message (given, or the default) goes before the first
// user message's text, a blank line between; the assistant's role is "model"; contents are
// trimmed of surrounding whitespace, as its template does. BOS comes from encode(add_special).
struct ChatTurn {
  std::string_view role;  // system, user, assistant
  std::string_view content;
};
// The turns followed by the assistant's opening; `default_system` is used when the first turn
// is not a system one (empty: none).
std::string format_chat(ChatFormat format, std::span<const ChatTurn> turns,
                        std::string_view default_system = {});

// Stop strings over a stream of text: push() hands out what is safe to show and holds back the
// end of the text while it may be the start of a stop string ("Hel" while "Hello" is one), so a
// reader never sees part of one. When one appears, `text` is what came before it and `stopped`
// is set; the stop string and whatever follows are dropped (OpenAI's behaviour).
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  struct Out {
    std::string text;      // safe to show
    bool stopped = false;  // a stop string was found: `text` is everything before it
  };
  Out push(std::string_view text);
  // At the end of generation: the text held back (it was not a stop string after all).
  std::string flush();
  std::size_t held() const { return held_.size(); }
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
};

// Text that ends the assistant's answer in this format beyond the end-of-generation tokens:
// {"\nUser:"} for kTranscript (a base model goes on to write the next turn), none otherwise.
std::vector<std::string> chat_stop_strings(ChatFormat format);

// The system message a ChatML Jinja template inserts when the conversation has none: the first
// literal text between "<|im_start|>system\n" and "<|im_end|>" (a part that inserts a message's
// content there is skipped). SmolLM2's template gives "You are a helpful AI assistant named
// SmolLM, trained by Hugging Face", Qwen2.5's "You are Qwen, created by Alibaba Cloud. You are a
// helpful assistant."; empty when the template has none.
std::string chat_template_default_system(std::string_view jinja);

}  // namespace treeattn
