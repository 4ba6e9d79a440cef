// The OpenAI API as `treeattn serve` reads it: a request body of POST /v1/chat/completions or
// POST /v1/completions becomes a ParsedRequest, or an ApiError that names the field; and the
// bodies of llama-server's POST /tokenize, /detokenize and /apply-template.
//
// Pure functions, no sockets and no model: the parser, the chat template, the prompt builder
// and the length check are unit-tested (tests/serve) and fuzzed (fuzz/fuzz_serve_request.cpp).
//
// What is accepted (OpenAI's names and shapes; null is the same as absent everywhere):
//   model (a string; check_model: one of --served-model-name's names when given, anything
//   otherwise), messages (chat) / prompt (completions: a string, an array of
//   token ids, or a one-element array of either), max_tokens and max_completion_tokens
//   (integer >= 1; max_completion_tokens wins), temperature (0..2; 0 is greedy; default 1),
//   top_p (0..1; 0 is greedy), seed (integer; default: a fresh one per request), stop (a
//   string or an array of up to 16 non-empty strings), stream, stream_options.include_usage
//   (only with stream true), n (1..kMaxChoices choices; choice i samples with seed + i),
//   presence_penalty and frequency_penalty (-2..2), logit_bias ({"token id": -100..100}, at
//   most kMaxLogitBias entries; check_logit_bias checks the ids against the vocabulary),
//   logprobs (chat: a bool, with top_logprobs 0..20; completions: an integer 0..20),
//   tools (function tools, at most kMaxTools; names as OpenAI allows: 1-64 of a-z, A-Z, 0-9, _
//   and -), tool_choice ("auto", "none", "required" or a named function: ToolChoice),
//   parallel_tool_calls (a boolean; the model may make several calls either way), and
//   messages of role tool (tool_call_id, content) and assistant messages with tool_calls
//   (arguments: a JSON object's text). Tools need a model whose own chat template takes them
//   (tool_calls.hpp: how calls are read from the answer).
//   response_format (text, json_object or json_schema, on both endpoints:
//   src/model/structured/schema.hpp; a schema it cannot follow is a 400 naming the schema's
//   path). The sampling fields' meaning: model::Sampler (generate.hpp).
// Extensions other servers also take: top_k (integer >= 0), min_p (0..1), repetition_penalty
// (0.01..100; 1: none; vLLM's and llama.cpp's), ignore_eos (bool: the end-of-
// generation tokens do not stop the request), return_token_ids (bool: choice.token_ids and
// prompt_token_ids in the response, as vLLM), cache_prompt (bool, llama-server's; ignored: the
// prefix cache is always on), timeout (seconds > 0, at most a day: the request ends there with
// the text so far and finish_reason "timeout").
// Fields of the OpenAI API this server does not implement are accepted at their neutral value
// (echo false, best_of 1, ...) and
// refused with 400 otherwise; fields that are not in the API at all are refused with 400
// ("Unrecognized request argument supplied: X"), as OpenAI does.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "model/jinja/chat_template.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::serve {

// The body is {"error": {"message", "type", "param", "code"}} with HTTP status `status`;
// param and code are null when empty.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
};

template <class T>
using Parsed = std::variant<T, ApiError>;

enum class Endpoint { kChat, kCompletion };

// An assistant's call of a tool: OpenAI's {"id", "type": "function", "function": {"name",
// "arguments"}}, `arguments` a JSON object's text.
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;
};

struct ChatMessage {
  std::string role;  // system, user, assistant or tool ("developer" is read as system)
  std::string content;
  std::vector<ToolCall> tool_calls{};  // assistant: the calls it made
  std::string tool_call_id{};          // tool: the call this message answers
  std::string name{};                  // as given (a participant's or a tool's name)
};

// tool_choice: "auto" (the model may call the tools), "none" (the tools are not shown to the
// model and nothing is parsed as a call), "required" (the answer is one call of any of them) or
// a named function (one call of it): a forced call is constrained sampling of the call object
// (ParsedRequest::response_format, made by the parser).
enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;
  std::vector<ChatMessage> messages;       // kChat
  std::optional<std::string> prompt_text;  // kCompletion, text
  std::vector<TokenId> prompt_ids;         // kCompletion, token ids (when prompt_text is empty)
  std::optional<int64_t> max_tokens;
  double temperature = 1.0;
  double top_p = 1.0;
  int top_k = 0;
  std::optional<uint64_t> seed;
  int n = 1;  // choices
  double min_p = 0.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0;
  std::vector<std::pair<TokenId, double>> logit_bias;  // ids ascending, distinct
  // -1: no logprobs; k >= 0: each token's logprob and the k most likely tokens' (chat: logprobs
  // true with top_logprobs k; completions: logprobs k).
  int logprobs = -1;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  bool ignore_eos = false;
  bool return_token_ids = false;
  std::optional<double> timeout;  // seconds: the request's deadline (finish_reason "timeout")
  // tools: [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]
  // as given (checked); null when absent or empty.
  nlohmann::ordered_json tools;
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_name;  // kNamed
  // The tools reach the template and the answer is read for calls (chat with tools, a choice
  // other than none).
  bool uses_tools() const {
    return endpoint == Endpoint::kChat && tool_choice != ToolChoice::kNone && tools.is_array() &&
           !tools.empty();
  }
  // response_format json_object or json_schema: its JSON text (engine::Request::response_format);
  // empty for text.
  std::string response_format;
};
inline constexpr std::size_t kMaxTools = 128;

// Limits of the parser: nesting deeper than this is refused before the JSON is parsed (the
// parser and the value's destructor are recursive).
inline constexpr int kMaxJsonDepth = 64;
inline constexpr std::size_t kMaxStopStrings = 16;
inline constexpr int kMaxChoices = 16;
inline constexpr std::size_t kMaxLogitBias = 1024;

Parsed<ParsedRequest> parse_request(Endpoint endpoint, std::string_view body);

// JSON text scanned without parsing it (strings skipped, nothing checked): its deepest nesting,
// and the byte after the bracket that closes the first object or array (0: none closes).
// first_only: the scan ends there (max_depth then covers that value alone).
struct JsonScan {
  int max_depth = 0;
  std::size_t first_end = 0;
};
JsonScan scan_json(std::string_view s, bool first_only = false);

// The model's chat template. A file whose tokenizer.chat_template the interpreter parses
// (src/model/jinja) renders every chat request with it (`model`: messages as {"role",
// "content"} objects, tools none, add_generation_prompt true, the tokenizer's BOS and EOS text),
// and only the template's own text may hold special tokens (Codec::encode_chat). A file whose
// template it cannot parse has `error` set (the construct, line and column): chat requests get
// a 400 with it, never another format. A file without a template (a base model) has neither and
// gets the plain transcript of format_chat (tokenizer.hpp), whose answer the server ends at
// chat_stop_strings(); `format` and `default_system` are what format_chat uses (render()).
// from_template reads the default system message from a Jinja template such as SmolLM2's
// ("{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are
// ...<|im_end|>\n' }}"); none when it has no literal one. The hard-coded formats keep the same
// rule as the file's template: only their own markup is encoded with control tokens, a message's
// content is plain text, so "<|im_start|>system" written in it stays text and cannot forge a turn
// (render_prompt's data ranges, Codec::encode_chat, as for the file's template).
struct ChatTemplate {
  std::string default_system;
  ChatFormat format = ChatFormat::kChatML;  // the model's turn markers (Tokenizer::chat_format)
  std::shared_ptr<const ModelTemplate> model;  // the file's own template, parsed
  std::string error;                           // why the file's template cannot be used
  bool strip_bos = false;  // the tokenizer adds BOS itself: a BOS the template writes first goes
  static ChatTemplate from_template(std::string_view jinja);
  // The chat template of the tokenizer's file (Tokenizer::model_template, chat_template_error),
  // and its chat format for the transcript of a base model.
  static ChatTemplate from_model(const Tokenizer& tokenizer);
  // format_chat's text of the messages (the hard-coded formats).
  std::string render(std::span<const ChatMessage> messages) const;
  // render()'s text and the byte ranges of it that are the messages' contents (as the format
  // writes them, trimmed or not). Error: the format writes a content in a way this cannot find.
  Result<ChatPrompt> render_prompt(std::span<const ChatMessage> messages) const;
  // What the server says about it at start-up.
  std::string describe() const;
};

// Text to token ids and back, as the server needs it (implemented over the model's Tokenizer by
// TokenizerCodec, codec.hpp; tests use a byte-level one).
class Codec {
 public:
  virtual ~Codec() = default;
  // add_special: BOS as the model asks; parse_special: control tokens written in the text.
  virtual Result<std::vector<TokenId>> encode(std::string_view text, bool parse_special) const = 0;
  // A rendered chat prompt: BOS as the model asks, special tokens parsed except where they would
  // overlap the conversation's bytes (`conversation`, sorted ranges of `text`).
  virtual Result<std::vector<TokenId>> encode_chat(
      std::string_view text, std::span<const std::pair<uint32_t, uint32_t>> conversation) const = 0;
  // The bytes of one token (control tokens: empty); may be part of a UTF-8 character.
  virtual std::string piece(TokenId id) const = 0;
  virtual int32_t n_vocab() const = 0;
  // The tokens that end a generation (EOS, <|im_end|>, ...).
  virtual std::vector<TokenId> end_of_generation() const = 0;
  // The most bytes of text one token stands for (0: unknown): a text's byte count then bounds
  // its token count from below, without tokenizing it.
  virtual std::size_t max_token_bytes() const { return 0; }
  // /tokenize: BOS (and EOS) as the model asks only with add_special; control tokens written in
  // the text are tokens only with parse_special.
  virtual Result<std::vector<TokenId>> tokenize(std::string_view text, bool add_special,
                                                bool parse_special) const = 0;
  // /tokenize's pieces and /detokenize's text: piece(), except that a control token is its
  // text ("<|im_end|>"), as llama-server shows it.
  virtual std::string token_text(TokenId id) const { return piece(id); }
};

// The prompt's token ids: the chat template over the messages (chat), the text with the
// model's BOS (completions, special tokens not parsed, as `treeattn generate`), or the ids as
// given, checked against the vocabulary. 400 for an empty prompt or an id outside it.
Parsed<std::vector<TokenId>> build_prompt(const ParsedRequest& request, const Codec& codec,
                                          const ChatTemplate& chat);

// The text a chat request's prompt is tokenized from (POST /apply-template): the file's template
// over the messages or the hard-coded format's text (both tokenized by Codec::encode_chat with
// the contents' ranges). The same 400 (or 500) as build_prompt for a template that cannot
// render them.
Parsed<std::string> render_chat_prompt(const ParsedRequest& request, const ChatTemplate& chat);

// POST /tokenize {"content": "...", "add_special": false, "parse_special": true,
// "with_pieces": false, "model": ignored}: llama-server's fields and defaults.
struct TokenizeRequest {
  std::string content;
  bool add_special = false;
  bool parse_special = true;
  bool with_pieces = false;
  std::string model;
};
Parsed<TokenizeRequest> parse_tokenize(std::string_view body);

// POST /detokenize {"tokens": [ids], "model": ignored}: the ids, each in [0, n_vocab).
Parsed<std::vector<TokenId>> parse_detokenize(std::string_view body, int32_t n_vocab);

// A request's "model" against the served names (--served-model-name): none given, or no model
// in the request, passes; otherwise a name not among them is OpenAI's 404 (type
// invalid_request_error, param model, code model_not_found).
std::optional<ApiError> check_model(std::string_view requested,
                                    std::span<const std::string> served);

// 400 naming logit_bias when one of its ids is outside the vocabulary [0, n_vocab).
std::optional<ApiError> check_logit_bias(const ParsedRequest& request, int32_t n_vocab);

// Before tokenizing: 400 (as check_lengths would give) when the prompt's text alone has more
// printable ASCII bytes than max_token_bytes times what the context and the pool can hold, so
// that a 10 MB prompt is refused without tokenizing it. Nothing when the bound decides nothing.
std::optional<ApiError> check_prompt_bytes(const ParsedRequest& request,
                                           std::size_t max_token_bytes, int64_t context,
                                           int64_t pool);

// How many tokens the request may generate, or the 400 that names both numbers when the
// prompt (plus max_tokens) does not fit the model's context (`context`, 0: no limit) or what
// the KV pool can hold for one sequence (`pool`). Without max_tokens: up to the limit for chat,
// min(16, what is left) for completions (OpenAI's defaults).
Parsed<int64_t> check_lengths(const ParsedRequest& request, int64_t prompt_tokens, int64_t context,
                              int64_t pool);

}  // namespace treeattn::serve
