// The bodies `treeattn serve` writes: OpenAI's response objects, the server-sent-event chunks
// of a streamed response, error bodies, /v1/models and /health. Pure; unit-tested.
//
// Streamed (text/event-stream), in this order:
//   data: {chunk with the role}               chat only, written at once
//   : keep-alive                               a comment, every few seconds without output
//   data: {chunk with a content delta}         as the text grows
//   data: {chunk with finish_reason}           with `timings`
//   data: {chunk with choices [] and usage}    with stream_options.include_usage
//   data: [DONE]
// A request that fails after the headers went out ends with `data: {"error": {...}}` and
// `data: [DONE]` (the openai client raises it as an APIError).
//
// `timings` (non-standard, in every non-streamed response and in the finish chunk):
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

// The whole response of a request that was not streamed.
struct Completion {
  std::string text;
  Finish finish = Finish::kStop;
  Usage usage;
  nlohmann::json timings;
  const std::vector<TokenId>* token_ids = nullptr;   // return_token_ids
  const std::vector<TokenId>* prompt_ids = nullptr;  // return_token_ids
  std::vector<ToolCall> tool_calls{};  // chat: message.tool_calls (content null when empty)
};
std::string completion_body(const ResponseMeta& meta, const Completion& c);

// Server-sent events.
std::string sse_data(const nlohmann::json& j);        // "data: {...}\n\n"
std::string sse_done();                               // "data: [DONE]\n\n"
std::string sse_comment(std::string_view text);       // ": text\n\n"
nlohmann::json chunk_role(const ResponseMeta& meta);  // chat: delta {role, content ""}
nlohmann::json chunk_text(const ResponseMeta& meta, const std::string& text);
// chat: delta {tool_calls: [{index, id, type "function", function {name, arguments}}]}, every
// call whole in one chunk.
nlohmann::json chunk_tool_calls(const ResponseMeta& meta, std::span<const ToolCall> calls);
nlohmann::json chunk_finish(const ResponseMeta& meta, Finish finish, const nlohmann::json& timings,
                            const std::vector<TokenId>* token_ids = nullptr);
nlohmann::json chunk_usage(const ResponseMeta& meta, const Usage& usage);

// /v1/models: one entry per id (the served names, the first the model's id), each with `meta`.
std::string models_body(std::span<const std::string> model_ids, int64_t created,
                        const nlohmann::json& meta);

// POST /tokenize: {"tokens": [ids]}, or with_pieces {"tokens": [{"id": n, "piece": p}]}, p the
// token's text (Codec::token_text) as a string when it is valid UTF-8, else the array of its byte
// values (llama-server's shapes).
std::string tokenize_body(std::span<const TokenId> ids, const Codec& codec, bool with_pieces);

}  // namespace treeattn::serve
