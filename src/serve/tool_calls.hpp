// Tool calls in a model's answer. The format is the one the Qwen2.5 (and Hermes, Qwen3) chat
// templates teach the model when a request has tools: each call a block
//
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
//
// ("<tool_call>" and "</tool_call>" are tokens of their own in those vocabularies). What the
// answer says before its first block is the message's content; the calls are its tool_calls.
// Text after the last block (the end-of-turn token's) is dropped. Small models often leave the
// tags out (Qwen2.5-Coder-0.5B answers with the bare object), as llama.cpp's Hermes parser also
// allows: an answer that is nothing but such objects (whitespace between them, optionally in one
// ```json fence) is calls too. An answer whose blocks (or bare objects) do not all hold a JSON
// object with a known function's "name" and an object "arguments" has no calls: its whole text
// is the content, as the model wrote it (vLLM's hermes parser does the same). A last block
// without its closing tag (the answer ended first) is read to the end of the text.
//
// Streamed: ToolCallStream sends the content as it comes, holding back what may be the start of
// "<tool_call>", nothing after a block starts, and the whole answer while it may be bare calls
// (its first non-blank character is '{' or '`'); the calls go out at the end, whole.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "serve/api.hpp"

namespace treeattn::serve {

inline constexpr std::string_view kToolCallOpen = "<tool_call>";
inline constexpr std::string_view kToolCallClose = "</tool_call>";

struct ToolCallReading {
  std::string content;          // the text before the first call (all of it: no calls)
  std::vector<ToolCall> calls;  // ids: id_base + "_" + the call's index
};

// `tools`: the request's tools array (the names a call may use).
ToolCallReading read_tool_calls(std::string_view text, const nlohmann::ordered_json& tools,
                                std::string_view id_base);

// How many bytes at the start of `text` are content whatever follows: up to the first
// "<tool_call>", short of a tail that may be its start; none while it may be bare calls.
// `from`: no call starts before it (what a stream has sent), so the search begins there.
std::size_t tool_call_free_prefix(std::string_view text, std::size_t from = 0);

class ToolCallStream {
 public:
  ToolCallStream(const nlohmann::ordered_json& tools, std::string id_base)
      : tools_(&tools), id_base_(std::move(id_base)) {}
  // The text to send now of what the answer has so far (`more` appended).
  std::string push(std::string_view more);
  // At the end of the answer: the content not sent yet and the calls.
  ToolCallReading finish() const;
  // A whole answer that was not streamed, with this stream's tools and ids.
  ToolCallReading read(std::string_view text) const {
    return read_tool_calls(text, *tools_, id_base_);
  }

 private:
  const nlohmann::ordered_json* tools_;
  std::string id_base_;
  std::string text_;
  std::size_t sent_ = 0;
};

}  // namespace treeattn::serve
