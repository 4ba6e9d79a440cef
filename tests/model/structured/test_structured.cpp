// Structured output (src/model/structured): the compiler's refusals name the keyword and the
// path; the matcher accepts every prefix of a valid document and refuses an invalid one at its
// first wrong byte; the token mask equals a token-by-token check, and random walks through the
// mask end in complete documents.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "model/structured/constraint.hpp"

namespace treeattn::structured {
namespace {

using json = nlohmann::ordered_json;

std::shared_ptr<const Grammar> grammar_of(const json& schema, bool strict = false) {
  const json rf = {{"type", "json_schema"},
                   {"json_schema", {{"name", "t"}, {"schema", schema}, {"strict", strict}}}};
  auto g = compile_response_format(rf.dump());
  EXPECT_TRUE(g.is_ok()) << g.status().to_string() << "\n" << schema.dump();
  return g.is_ok() ? *g : nullptr;
}

std::string refusal(const std::string& response_format) {
  auto g = compile_response_format(response_format);
  EXPECT_FALSE(g.is_ok()) << response_format;
  return g.is_ok() ? std::string() : g.status().message();
}

std::string schema_refusal(const json& schema, bool strict = false) {
  const json rf = {{"type", "json_schema"},
                   {"json_schema", {{"name", "t"}, {"schema", schema}, {"strict", strict}}}};
  return refusal(rf.dump());
}

// The number of bytes of `text` the matcher takes (text.size(): all), and whether it is then a
// complete value.
std::pair<std::size_t, bool> run(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  Matcher m(g);
  for (std::size_t i = 0; i < text.size(); ++i)
    if (!m.advance(text.substr(i, 1))) return {i, false};
  return {text.size(), m.can_end(m.state())};
}

void expect_valid(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  const auto [n, complete] = run(g, text);
  EXPECT_EQ(n, text.size()) << "refused at byte " << n << " of " << text;
  EXPECT_TRUE(complete) << text << " is not complete";
}

void expect_invalid(const std::shared_ptr<const Grammar>& g, const std::string& text,
                    std::size_t at) {
  const auto [n, complete] = run(g, text);
  if (at == text.size()) {
    EXPECT_EQ(n, text.size()) << text;
    EXPECT_FALSE(complete) << text << " should be incomplete";
  } else {
    EXPECT_EQ(n, at) << text;
  }
}

TEST(StructuredCompiler, RefusalsNameTheKeywordAndThePath) {
  EXPECT_EQ(schema_refusal({{"type", "object"},
                            {"properties", {{"age", {{"type", "integer"}, {"minimum", 0}}}}}}),
            "response_format.json_schema.schema.properties.age: unsupported keyword 'minimum'");
  EXPECT_EQ(schema_refusal({{"type", "array"}, {"items", {{"type", "string"}, {"pattern", "a"}}}}),
            "response_format.json_schema.schema.items: unsupported keyword 'pattern'");
  EXPECT_EQ(schema_refusal({{"type", "strin"}}),
            "response_format.json_schema.schema.type: unknown type \"strin\" (object, array, "
            "string, number, integer, boolean, null)");
  EXPECT_EQ(schema_refusal({{"type", "array"}, {"minItems", 3}, {"maxItems", 2}}),
            "response_format.json_schema.schema: minItems 3 is above maxItems 2");
  EXPECT_EQ(schema_refusal({{"type", "object"}, {"required", {"x"}}}),
            "response_format.json_schema.schema.required: names 'x', which is not one of the "
            "properties");
  EXPECT_EQ(schema_refusal({{"type", "object"}, {"additionalProperties", true}}, true),
            "response_format.json_schema.schema.additionalProperties: strict requires "
            "additionalProperties false");
  EXPECT_EQ(schema_refusal({{"$ref", "http://example.com/s.json"}}),
            "response_format.json_schema.schema.$ref: 'http://example.com/s.json' is not a "
            "reference this server resolves (#, #/$defs/NAME or #/definitions/NAME of the root "
            "schema)");
  EXPECT_EQ(schema_refusal({{"enum", json::array()}}),
            "response_format.json_schema.schema: enum is empty");
  EXPECT_EQ(
      schema_refusal({{"type", "object"}, {"properties", {{"a", false}}}, {"required", {"a"}}}),
      "response_format.json_schema.schema: the schema admits no value");
  EXPECT_EQ(schema_refusal({{"anyOf", {{{"type", "string"}}}}, {"type", "string"}}),
            "response_format.json_schema.schema: 'anyOf' together with 'type' is not supported");
  EXPECT_EQ(schema_refusal({{"type", "integer"}, {"enum", {"a", "b"}}}),
            "response_format.json_schema.schema: no enum value is of the schema's type");
  EXPECT_EQ(refusal(R"({"type":"json_schema","json_schema":{"schema":{}}})"),
            "response_format.json_schema.name: required, a string");
  EXPECT_EQ(refusal(R"({"type":"json_schema","json_schema":{"name":"a b","schema":{}}})"),
            "response_format.json_schema.name: must be 1 to 64 of a-z, A-Z, 0-9, _ and -");
  EXPECT_EQ(refusal(R"({"type":"xml"})"),
            "response_format.type: 'xml' is not one of 'text', 'json_object', 'json_schema'");
  EXPECT_EQ(refusal(R"({"type":"json_object","schema":{}})"),
            "response_format: type json_object takes no other field");
  std::string deep = R"({"type":"json_schema","json_schema":{"name":"d","schema":)";
  for (int i = 0; i < 100; ++i) deep += R"({"type":"array","items":)";
  deep += "{}" + std::string(100, '}') + "}}";
  EXPECT_NE(refusal(deep).find("deeper than"), std::string::npos);
  EXPECT_NE(refusal("{\"type\":").find("not valid JSON"), std::string::npos);
  json big = json::array();
  for (int i = 0; i < 20000; ++i) big.push_back("value number " + std::to_string(i));
  EXPECT_NE(schema_refusal({{"enum", big}}).find("bytes in all"), std::string::npos);
}

TEST(StructuredCompiler, TextIsNoConstraint) {
  auto g = compile_response_format(R"({"type":"text"})");
  ASSERT_TRUE(g.is_ok());
  EXPECT_EQ(*g, nullptr);
}

TEST(StructuredMatcher, ObjectsFollowTheSchemasOrderWithRequiredAndOptionalProperties) {
  auto g = grammar_of({{"type", "object"},
                       {"properties",
                        {{"name", {{"type", "string"}}},
                         {"age", {{"type", "integer"}}},
                         {"tags", {{"type", "array"}, {"items", {{"type", "string"}}}}}}},
                       {"required", {"name", "tags"}},
                       {"additionalProperties", false}});
  // In the schema's order: name, age, tags.
  expect_valid(g, R"({"name": "x", "age": 3, "tags": []})");
  expect_valid(g, R"({"name":"x","tags":["a","b"]})");
  expect_valid(g, "{\n  \"name\": \"\\u00e9\\n\",\n  \"tags\": [ \"\xc3\xa9\" ]\n}");
  expect_invalid(g, R"({"name":"x"})", 11);           // tags is required
  expect_invalid(g, R"({"tags":[],"name":"x"})", 2);  // name comes before tags ("t" refused)
  expect_invalid(g, R"({"age":1,"name":"x"})", 2);    // name is required before age
  expect_invalid(g, R"({"name":"x","tags":[],"age":1})", 21);  // no key may follow tags
  expect_invalid(g, R"({"name":"x","age":1.5,"tags":[]})", 19);
  expect_invalid(g, R"({"name":"x","age":01})", 19);
  expect_invalid(g, R"({"name":"x","tags":[],"other":1})", 21);
  expect_invalid(g, R"({"name":"x)", 10);
  expect_invalid(g, "{\"name\":\"\x01\"", 9);
  expect_invalid(g, "{\"name\":\"\xc0\xaf\"", 9);       // an overlong encoding
  expect_invalid(g, "{\"name\":\"\\ud800\"", 12);       // an escaped surrogate
  expect_invalid(g, R"({"name":"x","tags":[]} )", 22);  // nothing after the value
}

TEST(StructuredMatcher, ScalarsEnumsConstUnionsAndBounds) {
  auto num = grammar_of({{"type", "number"}});
  for (const char* t : {"0", "-0", "12", "1.5", "-1.25e+10", "3E2", "0.0"}) expect_valid(num, t);
  expect_invalid(num, "01", 1);
  expect_invalid(num, "1.", 2);
  expect_invalid(num, "-", 1);
  expect_invalid(num, "+1", 0);
  expect_invalid(num, "1e123", 4);
  expect_invalid(num, std::string(17, '1'), 16);
  auto integer = grammar_of({{"type", "integer"}});
  expect_valid(integer, "-42");
  expect_invalid(integer, "4.0", 1);
  auto e = grammar_of({{"enum", {"red", 1, 12, nullptr, json::object({{"a", true}})}}});
  for (const char* t : {"\"red\"", "1", "12", "null", R"({"a":true})"}) expect_valid(e, t);
  expect_invalid(e, "\"re\"", 3);
  expect_invalid(e, "2", 0);
  auto c = grammar_of({{"const", "fixed"}});
  expect_valid(c, "\"fixed\"");
  expect_invalid(c, "\"fixes\"", 5);
  auto u = grammar_of(
      {{"anyOf",
        {{{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"required", {"a"}}},
         {{"type", "object"}, {"properties", {{"b", {{"type", "string"}}}}}, {"required", {"b"}}},
         {{"type", "null"}}}}});
  for (const char* t : {R"({"a":1})", R"({"b":"x"})", "null"}) expect_valid(u, t);
  expect_invalid(u, R"({"c":1})", 2);
  expect_invalid(u, R"({"a":"x"})", 5);
  auto s = grammar_of({{"type", "string"}, {"minLength", 2}, {"maxLength", 3}});
  for (const char* t : {"\"ab\"", "\"a\\nb\"", "\"\xc3\xa9\xc3\xa9\xc3\xa9\""}) expect_valid(s, t);
  expect_invalid(s, "\"a\"", 2);
  expect_invalid(s, "\"abcd\"", 4);
  auto a = grammar_of(
      {{"type", "array"}, {"items", {{"type", "boolean"}}}, {"minItems", 1}, {"maxItems", 2}});
  expect_valid(a, "[true]");
  expect_valid(a, "[true, false]");
  expect_invalid(a, "[]", 1);
  expect_invalid(a, "[true,false,true]", 11);
  auto types = grammar_of({{"type", {"string", "null"}}});
  expect_valid(types, "null");
  expect_valid(types, "\"n\"");
}

TEST(StructuredMatcher, RefsDefsRecursionAndAdditionalProperties) {
  auto tree = grammar_of(json::parse(R"({
    "$defs": {"node": {"type": "object",
                       "properties": {"v": {"type": "integer"},
                                      "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                       "required": ["v", "kids"]}},
    "$ref": "#/$defs/node"})"));
  expect_valid(tree, R"({"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4,"kids":[]}]}]})");
  expect_invalid(tree, R"({"v":1,"kids":[{"v":2}]})", 21);
  // A union that names itself through references is no loop.
  auto self = grammar_of(json::parse(R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"},
    {"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}]}},
    "$ref": "#/$defs/a"})"));
  expect_valid(self, "null");
  expect_valid(self, "[null,[[],null]]");
  expect_invalid(self, "1", 0);
  EXPECT_EQ(schema_refusal({{"$ref", "#"}}),
            "response_format.json_schema.schema: the schema admits no value");
  auto map = grammar_of({{"type", "object"},
                         {"properties", {{"id", {{"type", "integer"}}}}},
                         {"required", {"id"}},
                         {"additionalProperties", {{"type", "integer"}}}});
  expect_valid(map, R"({"id":1,"x":2,"y":3})");
  expect_valid(map, R"({"id":1,"idx":2})");
  expect_invalid(map, R"({"id":1,"id":2})", 11);  // a name already written
  expect_invalid(map, R"({"id":1,"x":"s"})", 12);
  auto any = compile_response_format(R"({"type":"json_object"})");
  ASSERT_TRUE(any.is_ok());
  expect_valid(*any, R"({"a":[1,{"b":null}],"c":"d","e":-1.5e3,"f":true})");
  expect_invalid(*any, "[1]", 0);
  std::string deep = "{\"a\":";
  for (int i = 0; i < kAnyMaxNesting; ++i) deep += "[";
  expect_invalid(*any, deep, deep.size() - 1);  // free values nest at most kAnyMaxNesting deep
}

// A vocabulary of every single byte, some longer pieces (JSON-ish and not), two control tokens
// (no bytes) and an end token.
std::shared_ptr<const Vocabulary> test_vocabulary() {
  std::vector<std::string> pieces;
  for (int c = 0; c < 256; ++c) pieces.push_back(std::string(1, static_cast<char>(c)));
  for (const char* p :
       {"{\"",   "\":",      "\",",         "\"}",  "true",  "false", "null", "\": \"",
        "name",  "age",      "  ",          "\n  ", "\n",    "12",    "3.",   "e+",
        "\\u00", "\xc3\xa9", "hello world", " the", "[\"",   "\"]",   "}}",   "]}",
        ", \"",  "\":[",     "\xe2\x82",    "\xac", "abc\"", "\"abc", "x\\\""})
    pieces.emplace_back(p);
  pieces.emplace_back();  // control tokens: no bytes
  pieces.emplace_back();
  const auto end = static_cast<TokenId>(pieces.size());
  pieces.emplace_back();
  return std::make_shared<Vocabulary>(pieces, std::vector<TokenId>{end});
}

// The mask, token by token: every byte of the token follows the state (end tokens: the output
// may end).
std::vector<uint8_t> brute_mask(const Matcher& m, const Vocabulary& v) {
  std::vector<uint8_t> keep(static_cast<std::size_t>(v.size()), 0);
  FrameArena arena;
  Tops cur, next;
  for (TokenId t = 0; t < v.size(); ++t) {
    if (v.is_end(t)) {
      keep[static_cast<std::size_t>(t)] = m.can_end(m.state()) ? 1 : 0;
      continue;
    }
    const std::string& p = v.piece(t);
    if (p.empty()) continue;
    cur = m.state();
    for (const char ch : p) {
      m.feed(cur, static_cast<uint8_t>(ch), arena, next);
      cur.swap(next);
      if (cur.empty()) break;
    }
    keep[static_cast<std::size_t>(t)] = cur.empty() ? 0 : 1;
  }
  return keep;
}

std::vector<json> walk_schemas() {
  std::ifstream in(std::string(TREEATTN_STRUCTURED_TEST_DATA) + "/schemas.json");
  std::vector<json> out;
  for (const json& c : json::parse(in)) out.push_back(c["schema"]);
  for (json s : std::vector<json>{
           json::parse(R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},
        "age":{"type":"integer"},"ok":{"type":"boolean"}},"required":["name","age","ok"]})"),
           json::parse(R"({"type":"array","items":{"enum":["red","green",3,null]},"maxItems":4})"),
           json::parse(R"({"anyOf":[{"type":"number"},{"type":"string","maxLength":5},
        {"type":"array","items":{"type":"null"},"maxItems":2}]})"),
           json::parse(R"({"type":"object","properties":{"k":{"type":"integer"}},
        "additionalProperties":{"type":"string","maxLength":4}})"),
           json::parse(R"({"type":"number"})"),
       })
    out.push_back(std::move(s));
  return out;
}

// The 20 schemas of data/schemas.json (the e2e test's) and a few more: walks of up to 200 tokens
// through the mask, each token drawn uniformly from those it keeps:
// the mask equals the token-by-token check at every step, never keeps nothing, and every walk
// that ends (an end token) holds a complete value that parses as JSON.
TEST(StructuredMask, EqualsTheTokenByTokenCheckAndWalksEndInValidJson) {
  auto vocab = test_vocabulary();
  std::mt19937 rng(7);
  int ended = 0;
  for (const json& schema : walk_schemas()) {
    auto g = grammar_of(schema);
    ASSERT_NE(g, nullptr);
    for (int walk = 0; walk < 8; ++walk) {
      TokenConstraint tc(g, vocab);
      std::string text;
      for (int step = 0; step < 200; ++step) {
        std::vector<float> logits(static_cast<std::size_t>(vocab->size()), 0.0f);
        const std::vector<uint8_t> keep = tc.allowed(logits);
        ASSERT_EQ(keep, brute_mask(tc.matcher(), *vocab)) << schema.dump() << " after " << text;
        std::vector<TokenId> ids;
        for (TokenId t = 0; t < vocab->size(); ++t)
          if (keep[static_cast<std::size_t>(t)]) ids.push_back(t);
        ASSERT_FALSE(ids.empty()) << text;
        const TokenId t = ids[std::uniform_int_distribution<std::size_t>(0, ids.size() - 1)(rng)];
        const auto r = tc.accept(t);
        ASSERT_NE(r, TokenConstraint::Step::kRefused);
        if (r == TokenConstraint::Step::kEnded) {
          ++ended;
          EXPECT_TRUE(json::accept(text)) << text;
          break;
        }
        text += vocab->piece(t);
      }
    }
  }
  EXPECT_GT(ended, 40);
}

}  // namespace
}  // namespace treeattn::structured
