// The bodies `treeattn serve` writes: OpenAI's response objects, the server-sent-event chunks
// of a streamed response, error bodies, /v1/models and /health. Pure; unit-tested.
//
// Streamed (text/event-stream), in this order:
//   data: {chunk with the role}               chat only, one per choice, written at once
//   : keep-alive                               a comment, every few seconds without output
//   data: {chunk with a content delta}         as a choice's text grows (its logprobs with it)
//   data: {chunk with finish_reason}           as a choice ends, with `timings`
//   data: {chunk with choices [] and usage}    with stream_options.include_usage, at the end
//   data: [DONE]
// Each chunk names its choice's `index` (n > 1: the choices' chunks interleave).
// A request that fails after the headers went out ends with `data: {"error": {...}}` and
// `data: [DONE]` (the openai client raises it as an APIError).
//
// `timings` (non-standard, in every non-streamed response, of its first choice, and in each
// choice's finish chunk):
//   queue_ms             submit -> admitted by the engine
//   prefill_ms           admitted -> first token (the prompt's uncached tokens)
//   decode_ms            first -> last token
//   decode_ms_per_token  decode_ms / (generated_tokens - 1)
//   prompt_tokens, cached_tokens (taken from the prefix cache), generated_tokens
//   ranks, method        the job's rank count and per-layer merge
//   bytes_sent_per_token rank 0's bytes sent (communicator counters) over the request's life,
//                        per token the engine computed meanwhile (prompt tokens not cached and
//                        generated ones, of every request in the batch: a step's merges carry
//                        all rows, so one request's share is not separable)
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "serve/api.hpp"
#include "serve/text.hpp"
#include "treeattn/engine.hpp"

namespace treeattn::serve {

struct ResponseMeta {
  Endpoint endpoint = Endpoint::kChat;
  std::string id;  // chatcmpl-... / cmpl-...
  int64_t created = 0;
  std::string model;
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
};

struct TimingsInfo {
  engine::RequestTimings timings;
  int64_t generated_tokens = 0;
  int ranks = 1;
  std::string method;
  double bytes_sent_per_token = 0;
};

// A new response id: prefix + 24 hex digits (random, unique per process).
std::string make_response_id(Endpoint endpoint);

// The ids of a response's tool calls: "call_" + the response id's digits (+ "_" + the index).
std::string tool_call_id_base(const ResponseMeta& meta);

std::string dump(const nlohmann::json& j);  // compact; invalid UTF-8 replaced
std::string error_body(const ApiError& e);
nlohmann::json usage_json(const Usage& u);
nlohmann::json timings_json(const TimingsInfo& t);

// A choice's `logprobs` for its tokens (none: null). Chat: {"content": [{"token", "logprob",
// "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}; completions
// (the legacy shape): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}: the top
// ones and the chosen one], "text_offset"}. A token's text is Codec::token_text (a control
// token's name); text invalid as UTF-8 is replaced when written, its `bytes` are exact.
nlohmann::json logprobs_json(Endpoint endpoint, std::span<const TokenLogprob> tokens,
                             const Codec& codec);

// One choice of a response that was not streamed.
struct ChoiceOut {
  std::string text;
  Finish finish = Finish::kStop;
  const std::vector<TokenId>* token_ids = nullptr;  // return_token_ids
  nlohmann::json logprobs;                          // logprobs_json, or null
  std::vector<ToolCall> tool_calls{};  // chat: message.tool_calls (content null when empty)
};

// The whole response of a request that was not streamed: its choices, index 0 first.
struct Completion {
  std::vector<ChoiceOut> choices;
  Usage usage;
  nlohmann::json timings;
  const std::vector<TokenId>* prompt_ids = nullptr;  // return_token_ids
};
std::string completion_body(const ResponseMeta& meta, const Completion& c);

// Server-sent events.
std::string sse_data(const nlohmann::json& j);        // "data: {...}\n\n"
std::string sse_done();                               // "data: [DONE]\n\n"
std::string sse_comment(std::string_view text);       // ": text\n\n"
// chat: delta {role, content ""}
nlohmann::json chunk_role(const ResponseMeta& meta, int index = 0);
nlohmann::json chunk_text(const ResponseMeta& meta, const std::string& text, int index = 0,
                          const nlohmann::json& logprobs = nullptr);
// chat: delta {tool_calls: [{index, id, type "function", function {name, arguments}}]}, every
// call whole in one chunk.
nlohmann::json chunk_tool_calls(const ResponseMeta& meta, std::span<const ToolCall> calls,
                                int index = 0);
nlohmann::json chunk_finish(const ResponseMeta& meta, Finish finish, const nlohmann::json& timings,
                            const std::vector<TokenId>* token_ids = nullptr, int index = 0);
nlohmann::json chunk_usage(const ResponseMeta& meta, const Usage& usage);

// /v1/models: one entry per id (the served names, the first the model's id), each with `meta`.
std::string models_body(std::span<const std::string> model_ids, int64_t created,
                        const nlohmann::json& meta);

// POST /tokenize: {"tokens": [ids]}, or with_pieces {"tokens": [{"id": n, "piece": p}]}, p the
// token's text (Codec::token_text) as a string when it is valid UTF-8, else the array of its byte
// values (llama-server's shapes).
std::string tokenize_body(std::span<const TokenId> ids, const Codec& codec, bool with_pieces);

}  // namespace treeattn::serve
