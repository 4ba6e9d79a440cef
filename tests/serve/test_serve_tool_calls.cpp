// Tool calls read out of a model's answer (src/serve/tool_calls.hpp): the Hermes/Qwen2.5 blocks,
// bare call objects, answers that are not calls, and the streamed reading (content before a
// call goes out at once, nothing of a call leaks as content, the calls at the end).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "serve/format.hpp"
#include "serve/tool_calls.hpp"

namespace treeattn::serve {
namespace {

const nlohmann::ordered_json kTools = nlohmann::ordered_json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])");

ToolCallReading read(std::string_view text) { return read_tool_calls(text, kTools, "call_x"); }

TEST(ToolCalls, HermesBlocksAreCallsAndTheTextBeforeThemIsContent) {
  const auto r = read(
      "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n"
      "</tool_call>");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.content, "Let me look.\n");
  EXPECT_EQ(r.calls[0].id, "call_x_0");
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(r.calls[1].id, "call_x_1");
  EXPECT_EQ(r.calls[1].name, "get_time");
  EXPECT_EQ(r.calls[1].arguments, "{}");
  // Only whitespace before the call: no content.
  EXPECT_EQ(read("\n<tool_call>{\"name\":\"get_time\",\"arguments\":{}}</tool_call>").content, "");
}

TEST(ToolCalls, AnUnclosedLastBlockIsReadToTheEnd) {
  const auto r = read("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, R"({"tz":"UTC"})");
}

TEST(ToolCalls, BareCallObjectsAreCalls) {
  for (const std::string text :
       {"{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
        "  {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "{\"name\": \"get_time\", \"arguments\": {}}\n",
        "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
        "```\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"} { \\\" \"}}\n```"}) {
    const auto r = read(text);
    ASSERT_FALSE(r.calls.empty()) << text;
    EXPECT_EQ(r.content, "") << text;
    EXPECT_EQ(r.calls[0].name, "get_weather");
  }
}

TEST(ToolCalls, WhatIsNotACallStaysContent) {
  for (const std::string text : {
           "The weather is fine.",
           "",
           // an unknown function, arguments that are not an object, no name, broken JSON
           "<tool_call>{\"name\": \"launch\", \"arguments\": {}}</tool_call>",
           "<tool_call>{\"name\": \"get_time\", \"arguments\": \"now\"}</tool_call>",
           "<tool_call>{\"arguments\": {}}</tool_call>",
           "<tool_call>{\"name\": \"get_time\", \"arguments\": {</tool_call>",
           // one good block and one bad: no calls at all
           "<tool_call>{\"name\":\"get_time\",\"arguments\":{}}</tool_call>"
           "<tool_call>oops</tool_call>",
           // prose between blocks: the second is not read, the first alone is not the answer
           // (the text after a call is dropped, so it must be blank for the calls to stand)
           "{\"name\": \"get_time\", \"arguments\": {}} and then some prose",
           "Use {\"name\": \"get_time\", \"arguments\": {}} like this.",
           "```python\n{\"name\": \"get_time\", \"arguments\": {}}\n```",
           "{\"name\": \"get_time\", \"arguments\": {}",
       }) {
    const auto r = read(text);
    EXPECT_TRUE(r.calls.empty()) << text;
    EXPECT_EQ(r.content, text);
  }
}

// Streaming: the text arrives in pieces; what push() sends plus finish()'s content is the whole
// content, and no byte of a call is sent as content.
struct Streamed {
  std::string sent;
  ToolCallReading end;
};
Streamed stream(std::string_view text, std::size_t piece) {
  ToolCallStream s(kTools, "call_x");
  Streamed out;
  for (std::size_t i = 0; i < text.size(); i += piece) out.sent += s.push(text.substr(i, piece));
  out.end = s.finish();
  return out;
}

TEST(ToolCalls, StreamedContentStopsWhereACallStarts) {
  const std::string text =
      "Checking now.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
  for (std::size_t piece = 1; piece <= text.size(); ++piece) {
    const Streamed s = stream(text, piece);
    EXPECT_EQ(s.sent + s.end.content, "Checking now.\n") << piece;
    EXPECT_EQ(s.sent.find('<'), std::string::npos) << piece;
    ASSERT_EQ(s.end.calls.size(), 1u) << piece;
    EXPECT_EQ(s.end.calls[0].name, "get_time");
  }
  // Content is sent as it comes, short of what may begin "<tool_call>".
  ToolCallStream s(kTools, "c");
  EXPECT_EQ(s.push("Hello <tool"), "Hello ");
  EXPECT_EQ(s.push("box> there"), "<toolbox> there");
  EXPECT_EQ(s.finish().content, "");
}

TEST(ToolCalls, BlankTextBeforeACallIsNeverSent) {
  const std::string text = "\n\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>";
  for (std::size_t piece = 1; piece <= text.size(); ++piece) {
    const Streamed s = stream(text, piece);
    EXPECT_EQ(s.sent, "") << piece;
    EXPECT_EQ(s.end.content, "") << piece;
    EXPECT_EQ(s.end.calls.size(), 1u) << piece;
  }
}

TEST(ToolCalls, AStreamThatMayBeBareCallsIsHeldToTheEnd) {
  const std::string call = "{\"name\": \"get_time\", \"arguments\": {}}";
  for (std::size_t piece : {1u, 5u, 100u}) {
    const Streamed s = stream(call, piece);
    EXPECT_EQ(s.sent, "");
    EXPECT_EQ(s.end.content, "");
    EXPECT_EQ(s.end.calls.size(), 1u);
  }
  // Not calls after all: the whole text goes out at the end, once.
  const std::string json_answer = "{\"answer\": 42}";
  const Streamed s = stream(json_answer, 3);
  EXPECT_EQ(s.sent + s.end.content, json_answer);
  EXPECT_TRUE(s.end.calls.empty());
  // Prose after an invalid call: content whole, nothing lost or doubled.
  const std::string bad = "Hi <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> bye";
  const Streamed b = stream(bad, 4);
  EXPECT_EQ(b.sent + b.end.content, bad);
  EXPECT_TRUE(b.end.calls.empty());
}

TEST(ToolCalls, FreePrefix) {
  EXPECT_EQ(tool_call_free_prefix("abc"), 3u);
  EXPECT_EQ(tool_call_free_prefix("abc<"), 3u);
  EXPECT_EQ(tool_call_free_prefix("abc<tool_cal"), 3u);
  EXPECT_EQ(tool_call_free_prefix("abc<tool_call>x"), 3u);
  EXPECT_EQ(tool_call_free_prefix("a<b"), 3u);
  EXPECT_EQ(tool_call_free_prefix("  "), 0u);
  EXPECT_EQ(tool_call_free_prefix("\n<tool"), 0u);
  EXPECT_EQ(tool_call_free_prefix("\n<tool_call>"), 0u);
  EXPECT_EQ(tool_call_free_prefix("\nA<tool_call>"), 2u);
  EXPECT_EQ(tool_call_free_prefix(" {\"a\""), 0u);
  EXPECT_EQ(tool_call_free_prefix("```json"), 0u);
}

// OpenAI's shapes: message.tool_calls with a null content and finish_reason "tool_calls"; a
// streamed delta carries each call whole with its index.
TEST(ToolCalls, ResponseShapes) {
  const ResponseMeta meta{Endpoint::kChat, "chatcmpl-00ff", 1, "m"};
  EXPECT_EQ(tool_call_id_base(meta), "call_00ff");
  Completion c;
  ChoiceOut o;
  o.finish = Finish::kToolCalls;
  o.tool_calls = {{"call_00ff_0", "get_time", "{}"}, {"call_00ff_1", "get_weather", R"({"a":1})"}};
  c.choices = {o};
  const auto j = nlohmann::json::parse(completion_body(meta, c));
  const auto& choice = j["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 2u);
  EXPECT_EQ(choice["message"]["tool_calls"][1],
            nlohmann::json::parse(R"({"id":"call_00ff_1","type":"function",
                                       "function":{"name":"get_weather","arguments":"{\"a\":1}"}})"));
  c.choices[0].text = "Sure.";
  EXPECT_EQ(nlohmann::json::parse(completion_body(meta, c))["choices"][0]["message"]["content"],
            "Sure.");
  const auto chunk = chunk_tool_calls(meta, o.tool_calls, 2);
  EXPECT_EQ(chunk["choices"][0]["index"], 2);
  const auto& calls = chunk["choices"][0]["delta"]["tool_calls"];
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[1]["index"], 1);
  EXPECT_EQ(calls[1]["function"]["name"], "get_weather");
  EXPECT_EQ(finish_name(Finish::kToolCalls), std::string("tool_calls"));
}

}  // namespace
}  // namespace treeattn::serve
