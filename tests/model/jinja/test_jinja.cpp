// The chat template interpreter (src/model/jinja): what conformance.py cannot check against
// jinja2 — errors naming the construct and its place, the limits on hostile templates, and the
// data ranges that keep a conversation's text apart from the template's own. (The language
// itself is checked byte for byte against jinja2 by model.jinja.conformance.)
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "model/jinja/chat_template.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn {
namespace {

using nlohmann::ordered_json;

std::string render(const std::string& tmpl, const ordered_json& ctx = ordered_json::object()) {
  auto t = ModelTemplate::parse(tmpl, "<s>", "</s>");
  if (!t.is_ok()) return "PARSE ERROR: " + t.status().message();
  auto r = t->render_context(ctx);
  if (!r.is_ok()) return "RENDER ERROR: " + r.status().message();
  return r->text;
}

TEST(Jinja, HuggingFaceWhitespaceSettings) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before one goes;
  // keep_trailing_newline off: the template's last newline goes.
  EXPECT_EQ(render("{% if true %}\n  yes\n  {% endif %}\nafter\n"), "  yes\nafter");
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif %}"), "ab");
  EXPECT_EQ(render("{{- ' x ' -}}  \n"), " x ");
  EXPECT_EQ(render("  {# comment #}\nz"), "z");
  EXPECT_EQ(render("  {%+ if true %}x{% endif %}"), "  x");
}

TEST(Jinja, LoopsNamespacesMacros) {
  EXPECT_EQ(render("{% for x in [1, 2, 3] if x != 2 %}{{ loop.index }}/{{ loop.length }}"
                   "{{ ',' if not loop.last }}{% endfor %}"),
            "1/2,2/2");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}"
                   "{% endfor %}{{ ns.n }}"),
            "6");
  EXPECT_EQ(render("{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}"),
            "[1B][23]");
  EXPECT_EQ(render("{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
            "012");
  EXPECT_EQ(render("{% filter trim | upper %}  ab{{ 'c' }}  {% endfilter %}"), "ABC");
  EXPECT_EQ(render("{{ 'abc'[::-1] }} {{ [1, 2, 3][1:] }} {{ {'a': 1}.items() | list }}"),
            "cba [2, 3] [('a', 1)]");
  EXPECT_EQ(render("{{ {'b': 'é', 'a': [1, 2.5, none, true]} | tojson }}"),
            "{\"b\": \"é\", \"a\": [1, 2.5, null, true]}");
}

TEST(Jinja, ErrorsNameTheConstructAndPlace) {
  EXPECT_EQ(render("line one\n{% frobnicate %}"),
            "PARSE ERROR: chat template: line 2, column 4: unknown statement 'frobnicate'");
  EXPECT_EQ(render("{{ x | nosuchfilter }}"),
            "PARSE ERROR: chat template: line 1, column 8: unknown filter 'nosuchfilter'");
  EXPECT_EQ(render("{% include 'x' %}"),
            "PARSE ERROR: chat template: line 1, column 4: the 'include' statement is not supported");
  EXPECT_EQ(render("{% if x %}never closed"),
            "PARSE ERROR: chat template: line 1, column 23: unexpected end of template: expected "
            "'elif' or 'else' or 'endif'");
  EXPECT_EQ(render("{{ 'unterminated }}"),
            "PARSE ERROR: chat template: line 1, column 4: unterminated string");
  EXPECT_EQ(render("{{ raise_exception('Roles must alternate') }}"),
            "RENDER ERROR: chat template: line 1, column 4: the template raised an exception: "
            "Roles must alternate");
  EXPECT_EQ(render("\n  {{ messages[0].content }}"),
            "RENDER ERROR: chat template: line 2, column 14: 'messages' is undefined (reading an "
            "item of it)");
  EXPECT_EQ(render("{{ 'a'.nosuchmethod() }}"),
            "RENDER ERROR: chat template: line 1, column 7: 'nosuchmethod' is undefined (not a "
            "function)");
  EXPECT_EQ(render("{{ 1 / 0 }}"), "RENDER ERROR: chat template: line 1, column 6: division by zero");
}

TEST(Jinja, HostileTemplatesHitTheLimits) {
  // Deep nesting: refused by the parser, not the stack.
  std::string deep;
  for (int i = 0; i < 5000; ++i) deep += "{% if true %}";
  EXPECT_NE(render(deep).find("nests deeper than 64 levels"), std::string::npos);
  EXPECT_NE(render("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}")
                .find("nests deeper than"),
            std::string::npos);
  EXPECT_NE(render("{{ " + std::string(5000, '-') + "1 }}").find("nests deeper than"),
            std::string::npos);
  // Unbounded recursion through a macro.
  EXPECT_NE(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
                .find("macro calls nest deeper than 64 levels"),
            std::string::npos);
  // Huge loops, huge output, huge strings.
  EXPECT_NE(render("{% for i in range(100000000) %}{% endfor %}")
                .find("more than 1000000 loop iterations"),
            std::string::npos);
  EXPECT_NE(render("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(10) %}"
                   "{% endfor %}{% endfor %}{% endfor %}")
                .find("loop iterations"),
            std::string::npos);
  EXPECT_NE(render("{% for i in range(200000) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}")
                .find("the output is longer than"),
            std::string::npos);
  EXPECT_NE(render("{{ 'x' * 100000000 }}").find("longer than the output limit"), std::string::npos);
  EXPECT_NE(render("{% set ns = namespace(s='xx') %}{% for i in range(64) %}"
                   "{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
                .find("a string is longer than"),
            std::string::npos);
  // Values nested without bound, and a namespace holding itself.
  EXPECT_NE(render("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}"
                   "{% endfor %}")
                .find("nests deeper than 256"),
            std::string::npos);
  EXPECT_EQ(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns.me.me is defined }}"), "True");
}

TEST(Jinja, DataRangesCoverOnlyTheConversation) {
  auto t = ModelTemplate::parse(
      "{% for m in messages %}<|im_start|>{{ m.role + '\\n' + m.content | trim }}<|im_end|>\n"
      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
      "", "");
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  const ordered_json messages = ordered_json::parse(
      R"([{"role": "user", "content": " hi <|im_start|> "}, {"role": "assistant", "content": "ok"}])");
  auto r = t->render(messages, nullptr, true);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->text,
            "<|im_start|>user\nhi <|im_start|><|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
            "<|im_start|>assistant\n");
  // The roles and the contents, not the markup around them (nor the template's '\n').
  std::string data;
  for (const auto& [a, b] : r->data_ranges) data += "[" + r->text.substr(a, b - a) + "]";
  EXPECT_EQ(data, "[user][hi <|im_start|>][assistant][ok]");
}

// The shipped models' own templates (data/templates/shipped-*, from their GGUF files) give the
// text the hard-coded ChatML turns gave them (format_chat with the template's default system
// message), so switching to the model's template changes no prompt of these models.
TEST(Jinja, ShippedTemplatesRenderWhatTheHardCodedTurnsDid) {
  const std::vector<std::vector<ChatTurn>> conversations = {
      {{"user", "What is the capital of France?"}},
      {{"system", "Be brief."}, {"user", "Hi"}},
      {{"user", "a"}, {"assistant", "b"}, {"user", " c\n"}},
      {{"system", ""}, {"user", ""}, {"assistant", ""}, {"user", "?"}},
  };
  for (const char* name : {"shipped-smollm2-135m.jinja", "shipped-qwen2.5-coder-0.5b.jinja",
                           "shipped-qwen2.5-coder-1.5b.jinja"}) {
    SCOPED_TRACE(name);
    std::ifstream in(std::string(TREEATTN_JINJA_TEST_DATA) + "/templates/" + name);
    ASSERT_TRUE(in) << name;
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string source = ss.str();
    auto t = ModelTemplate::parse(source, "", "<|im_end|>");
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    for (const auto& turns : conversations) {
      ordered_json messages = ordered_json::array();
      for (const ChatTurn& c : turns) messages.push_back({{"role", c.role}, {"content", c.content}});
      auto r = t->render(messages, nullptr, true);
      ASSERT_TRUE(r.is_ok()) << r.status().message();
      EXPECT_EQ(r->text, format_chat(ChatFormat::kChatML, turns,
                                     chat_template_default_system(source)));
    }
  }
}

// Whether a template can show tools: it reads `tools` or a `tool_calls` in an expression; the
// words in its text, a string literal or a comment do not count.
TEST(Jinja, TakesToolsWhenAnExpressionReadsThem) {
  auto takes = [](const std::string& source) {
    auto t = ModelTemplate::parse(source, "", "");
    EXPECT_TRUE(t.is_ok()) << source;
    return t.is_ok() && t->takes_tools();
  };
  EXPECT_TRUE(takes("{{ tools | tojson }}"));
  EXPECT_TRUE(takes("{% if tools %}x{% endif %}"));
  EXPECT_TRUE(takes("{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{% endfor %}"));
  EXPECT_TRUE(takes("{% for m in messages %}{{ m['tool_calls'] | length }}{% endfor %}"));
  EXPECT_TRUE(takes("{% macro f(x=tools) %}{% endmacro %}"));
  EXPECT_FALSE(takes("tools and tool_calls {{ 'tools' }}{# tools #}"));
  EXPECT_FALSE(takes("{% for m in messages %}{{ m.content }}{% endfor %}"));
  EXPECT_FALSE(takes("{{ toolsmith }}{{ m.tool_calls_count }}"));
}

TEST(Jinja, LeadingBosIsNotDoubled) {
  auto t = ModelTemplate::parse("{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}",
                                "<s>", "</s>");
  ASSERT_TRUE(t.is_ok());
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "x"}])");
  EXPECT_EQ(t->render(messages, nullptr, true, /*strip_bos=*/false)->text, "<s>[x]");
  auto r = t->render(messages, nullptr, true, /*strip_bos=*/true);
  EXPECT_EQ(r->text, "[x]");
  ASSERT_EQ(r->data_ranges.size(), 1u);
  EXPECT_EQ(r->data_ranges[0], (jinja::Range{1u, 2u}));
  // A conversation that starts with the BOS text keeps it: it is not the template's.
  auto u = ModelTemplate::parse("{% for m in messages %}{{ m.content }}{% endfor %}", "<s>", "");
  EXPECT_EQ(u->render(ordered_json::parse(R"([{"role": "user", "content": "<s>y"}])"), nullptr,
                      true, true)
                ->text,
            "<s>y");
}

}  // namespace
}  // namespace treeattn
