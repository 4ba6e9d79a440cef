// The chat request -> prompt path with the model's own chat template (api.hpp ChatTemplate,
// build_prompt): the template renders the messages; a template the interpreter cannot parse, or
// one that raises, is a 400 naming the construct or the template's message, never another
// format; and with the real SmolLM2 file the file's template gives the hard-coded ChatML text.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <variant>

#include "model/model_path.hpp"
#include "serve/api.hpp"
#include "serve/byte_codec.hpp"
#include "treeattn/gguf.hpp"

namespace treeattn::serve {
namespace {

using testing::ByteCodec;
using testing::bytes_of;

ParsedRequest chat(const std::string& body) {
  auto r = parse_request(Endpoint::kChat, body);
  EXPECT_TRUE(std::holds_alternative<ParsedRequest>(r));
  return std::get<ParsedRequest>(r);
}

ChatTemplate with_model(const std::string& jinja) {
  ChatTemplate t;
  auto m = ModelTemplate::parse(jinja, "<s>", "</s>");
  if (!m.is_ok()) {
    t.error = m.status().message();
  } else {
    t.model = std::make_shared<const ModelTemplate>(std::move(m).value());
  }
  return t;
}

TEST(ServeTemplate, TheModelsTemplateRendersTheMessages) {
  const ChatTemplate t = with_model(
      "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}");
  ByteCodec codec;
  auto p = build_prompt(
      chat(R"({"messages":[{"role":"system","content":" S "},{"role":"user","content":"U"}]})"),
      codec, t);
  ASSERT_TRUE(std::holds_alternative<std::vector<TokenId>>(p));
  EXPECT_EQ(std::get<std::vector<TokenId>>(p),
            bytes_of("<system>S</system><user>U</user><assistant>"));
  EXPECT_EQ(t.describe(), "the model's own chat template (tokenizer.chat_template)");
}

TEST(ServeTemplate, AnUnusableTemplateIsA400NamingTheConstruct) {
  const ChatTemplate t = with_model("{% for m in messages %}{{ m.content | frobnicate }}{% endfor %}");
  ASSERT_FALSE(t.error.empty());
  EXPECT_NE(t.describe().find("unknown filter 'frobnicate'"), std::string::npos) << t.describe();
  ByteCodec codec;
  auto p = build_prompt(chat(R"({"messages":[{"role":"user","content":"x"}]})"), codec, t);
  ASSERT_TRUE(std::holds_alternative<ApiError>(p));
  const ApiError& e = std::get<ApiError>(p);
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "messages");
  EXPECT_EQ(e.message,
            "The model's chat template cannot be used: chat template: line 1, column 39: unknown "
            "filter 'frobnicate'");
  // Completions do not use the template.
  auto c = parse_request(Endpoint::kCompletion, R"({"prompt":"ab"})");
  EXPECT_TRUE(std::holds_alternative<std::vector<TokenId>>(
      build_prompt(std::get<ParsedRequest>(c), codec, t)));
}

TEST(ServeTemplate, ATemplateThatRaisesIsA400WithItsMessage) {
  const ChatTemplate t = with_model(
      "{% for m in messages %}{% if m.role == 'system' %}"
      "{{ raise_exception('System role not supported') }}{% endif %}{{ m.content }}{% endfor %}");
  ByteCodec codec;
  auto p = build_prompt(
      chat(R"({"messages":[{"role":"system","content":"S"},{"role":"user","content":"U"}]})"),
      codec, t);
  ASSERT_TRUE(std::holds_alternative<ApiError>(p));
  EXPECT_EQ(std::get<ApiError>(p).message,
            "The messages cannot be rendered with the model's chat template: chat template: line "
            "1, column 54: the template raised an exception: System role not supported");
}

nlohmann::ordered_json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  return nlohmann::ordered_json::parse(in);
}

// A request in OpenAI's shape (tools, an assistant's tool_calls with arguments as JSON text, a
// tool message) renders with every collected template that takes tools exactly as that template
// renders the same conversation in Hugging Face's shape (arguments as objects, a null content as
// ""), which model.jinja.conformance checks against jinja2; a template that raises on it is a 400
// both ways.
TEST(ServeTemplate, ToolCallRequestsRenderAsTheHuggingFaceConversation) {
  const std::filesystem::path data = TREEATTN_JINJA_TEST_DATA;
  const auto conversations = read_json(data / "conversations.json");
  const auto meta = read_json(data / "templates.json");
  nlohmann::ordered_json hf;
  for (const auto& c : conversations)
    if (c["name"] == "tool_call_round_trip") hf = c;
  ASSERT_FALSE(hf.is_null());
  nlohmann::ordered_json body = {{"messages", nlohmann::ordered_json::array()},
                                 {"tools", hf["tools"]}};
  for (auto m : hf["messages"]) {
    if (m.contains("tool_calls"))
      for (auto& call : m["tool_calls"])
        call["function"]["arguments"] = call["function"]["arguments"].dump();
    body["messages"].push_back(m);
  }
  for (auto& m : hf["messages"])
    if (m["content"].is_null()) m["content"] = "";
  const ParsedRequest request = chat(body.dump());
  ASSERT_TRUE(request.uses_tools());
  int compared = 0;
  for (const auto& entry : std::filesystem::directory_iterator(data / "templates")) {
    std::ifstream in(entry.path());
    const std::string source((std::istreambuf_iterator<char>(in)), {});
    const std::string name = entry.path().filename().string();
    const auto& tokens = meta.contains(name) ? meta[name] : meta["default"];
    auto parsed = ModelTemplate::parse(source, tokens["bos_token"], tokens["eos_token"]);
    if (!parsed.is_ok() || !parsed->takes_tools()) continue;
    ChatTemplate t;
    t.model = std::make_shared<const ModelTemplate>(std::move(parsed).value());
    auto want = t.model->render(hf["messages"], hf["tools"], true);
    auto got = render_chat_prompt(request, t);
    if (!want.is_ok()) {
      EXPECT_TRUE(std::holds_alternative<ApiError>(got)) << name;
      continue;
    }
    ASSERT_TRUE(std::holds_alternative<std::string>(got))
        << name << ": " << std::get<ApiError>(got).message;
    EXPECT_EQ(std::get<std::string>(got), want->text) << name;
    ++compared;
  }
  EXPECT_GE(compared, 10);
}

// Tools and tool turns need a template that shows them: one that never names tools, or a file
// without a template (the plain transcript), is a 400 rather than a prompt without the tools.
TEST(ServeTemplate, ToolsWithATemplateThatDropsThemAreA400) {
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}])";
  const ChatTemplate plain = with_model("{% for m in messages %}{{ m.content }}{% endfor %}");
  ByteCodec codec;
  for (const ChatTemplate* t : {&plain, static_cast<const ChatTemplate*>(nullptr)}) {
    const ChatTemplate none;
    const ChatTemplate& tmpl = t != nullptr ? *t : none;
    auto p = build_prompt(chat(R"({"messages":[{"role":"user","content":"x"}],)" + tools + "}"),
                          codec, tmpl);
    ASSERT_TRUE(std::holds_alternative<ApiError>(p));
    EXPECT_EQ(std::get<ApiError>(p).param, "tools");
    auto q = build_prompt(
        chat(R"({"messages":[{"role":"user","content":"x"},{"role":"tool","tool_call_id":"c",)"
             R"("content":"y"}]})"),
        codec, tmpl);
    ASSERT_TRUE(std::holds_alternative<ApiError>(q));
    EXPECT_EQ(std::get<ApiError>(q).param, "messages");
    // tool_choice "none": the tools are not shown, so any template renders the request.
    auto r = build_prompt(chat(R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"none",)" +
                               tools + "}"),
                          codec, tmpl);
    EXPECT_TRUE(std::holds_alternative<std::vector<TokenId>>(r));
  }
}

TEST(ServeTemplate, SmolLM2FileTemplateGivesTheChatMLTurns) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  auto file = gguf::File::open(path);
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  auto tok = Tokenizer::from_gguf(*file);
  ASSERT_TRUE(tok.is_ok());
  const ChatTemplate t = ChatTemplate::from_model(*tok);
  ASSERT_TRUE(t.error.empty()) << t.error;
  ASSERT_TRUE(t.model);
  const std::vector<ChatMessage> messages = {{"user", "Hi <|im_start|>"}, {"assistant", "A"},
                                             {"user", "B"}};
  auto r = t.model->render(
      nlohmann::ordered_json::parse(R"([{"role":"user","content":"Hi <|im_start|>"},)"
                                    R"({"role":"assistant","content":"A"},)"
                                    R"({"role":"user","content":"B"}])"),
      nullptr, true, t.strip_bos);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->text, t.render(messages));
  // The user's "<|im_start|>" stays text: one fewer control token than the hard-coded path.
  auto with_ranges = tok->encode(r->text, true, r->data_ranges);
  auto all_special = tok->encode(t.render(messages), true, true);
  const TokenId im_start = tok->find_token("<|im_start|>");
  EXPECT_EQ(std::count(with_ranges->begin(), with_ranges->end(), im_start) + 1,
            std::count(all_special->begin(), all_special->end(), im_start));
}

}  // namespace
}  // namespace treeattn::serve
