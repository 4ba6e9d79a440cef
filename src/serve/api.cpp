// The request parser, the chat template and the length check (api.hpp).
#include "serve/api.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "treeattn/generate.hpp"
#include "model/structured/schema.hpp"

namespace treeattn::serve {

JsonScan scan_json(std::string_view s, bool first_only) {
  JsonScan out;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      out.max_depth = std::max(out.max_depth, ++depth);
    } else if (c == ']' || c == '}') {
      if (--depth == 0 && out.first_end == 0) {
        out.first_end = i + 1;
        if (first_only) break;
      }
    }
  }
  return out;
}

namespace {

int json_depth(std::string_view s) { return scan_json(s).max_depth; }

// Ordered: keys keep the body's order, which tools (printed by templates with tojson) and a
// schema's properties (generated in that order) need; one parse serves every field.
using json = nlohmann::ordered_json;

ApiError bad(std::string message, std::string param, std::string code = {}) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param),
                  std::move(code)};
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "an unknown value";
  }
}

ApiError wrong_type(const std::string& param, const char* expected, const json& v) {
  return bad(fmt::format("Invalid type for '{}': expected {}, but got {} instead.", param, expected,
                         type_name(v)),
             param, "invalid_type");
}

// An integer: a JSON integer, or a float with an integral value (some clients send 5.0).
std::optional<int64_t> as_int(const json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18)
      return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

Parsed<int64_t> get_int(const json& v, const std::string& param, int64_t lo, int64_t hi) {
  const auto i = as_int(v);
  if (!i) return wrong_type(param, "an integer", v);
  if (*i < lo || *i > hi)
    return bad(fmt::format("'{}' is {}; it must be between {} and {}.", param, *i, lo, hi), param,
               "invalid_value");
  return *i;
}

Parsed<double> get_number(const json& v, const std::string& param, double lo, double hi) {
  if (!v.is_number()) return wrong_type(param, "a number", v);
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi)
    return bad(fmt::format("'{}' is {}; it must be between {} and {}.", param, d, lo, hi), param,
               "invalid_value");
  return d;
}

Parsed<bool> get_bool(const json& v, const std::string& param) {
  if (!v.is_boolean()) return wrong_type(param, "a boolean", v);
  return v.get<bool>();
}

ApiError unsupported(const std::string& param, const std::string& what = {}) {
  return bad(
      fmt::format("'{}'{} is not supported by this server.", param, what.empty() ? "" : " " + what),
      param, "unsupported_parameter");
}

// A field of the API that this server does not implement: only its neutral value passes.
std::optional<ApiError> neutral_only(const std::string& key, const json& v) {
  auto empty_or_null = [&] {
    return v.is_null() || (v.is_array() && v.empty()) || (v.is_object() && v.empty()) ||
           (v.is_string() && v.get<std::string>().empty());
  };
  if (key == "echo" || key == "store") {
    auto b = get_bool(v, key);
    if (auto* e = std::get_if<ApiError>(&b)) return *e;
    if (std::get<bool>(b) && key == "echo") return unsupported(key, "true");
    return std::nullopt;
  }
  if (key == "best_of") {
    if (as_int(v) == 1) return std::nullopt;
    return unsupported(key, "other than 1");
  }
  if (key == "function_call") {
    if (v.is_string() && (v == "none" || v == "auto")) return std::nullopt;
    return unsupported(key);
  }
  if (key == "modalities") {
    if (v.is_array() && v.size() == 1 && v[0] == "text") return std::nullopt;
    return unsupported(key, "other than [\"text\"]");
  }
  if (key == "user" || key == "service_tier") {
    if (!v.is_string()) return wrong_type(key, "a string", v);
    return std::nullopt;
  }
  if (key == "metadata") {
    if (!v.is_object()) return wrong_type(key, "an object", v);
    return std::nullopt;
  }
  // functions, suffix, reasoning_effort, prediction, audio, ...
  if (empty_or_null()) return std::nullopt;
  return unsupported(key);
}

const std::set<std::string, std::less<>> kNeutralChat = {"user",
                                                         "functions",
                                                         "function_call",
                                                         "store",
                                                         "metadata",
                                                         "service_tier",
                                                         "modalities",
                                                         "reasoning_effort",
                                                         "prediction",
                                                         "audio"};
const std::set<std::string, std::less<>> kNeutralCompletion = {"user",
                                                               "echo",
                                                               "best_of",
                                                               "suffix"};

// A message's content: a string, or an array of {"type": "text", "text": ...} parts.
Parsed<std::string> message_content(const json& v, const std::string& param) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return std::string();
  if (!v.is_array()) return wrong_type(param, "a string or an array of content parts", v);
  std::string text;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const json& part = v[i];
    const std::string p = fmt::format("{}[{}]", param, i);
    if (!part.is_object()) return wrong_type(p, "an object", part);
    const auto type = part.find("type");
    if (type == part.end() || !type->is_string())
      return bad(fmt::format("'{}.type' is required and must be a string.", p), p + ".type");
    if (*type != "text")
      return unsupported(p + ".type", "'" + type->get<std::string>() + "' (only text parts)");
    const auto t = part.find("text");
    if (t == part.end() || !t->is_string())
      return bad(fmt::format("'{}.text' is required and must be a string.", p), p + ".text");
    for (const auto& [k, x] : part.items())
      if (k != "type" && k != "text")
        return bad(fmt::format("Unrecognized argument '{}.{}'.", p, k), p + "." + k,
                   "unknown_parameter");
    text += t->get<std::string>();
  }
  return text;
}

// A function's name as OpenAI allows it: 1-64 of a-z, A-Z, 0-9, '_' and '-'.
bool valid_function_name(std::string_view n) {
  if (n.empty() || n.size() > 64) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-';
  });
}

// Each key of object `v` (at `param`) must be one of `allowed`.
std::optional<ApiError> only_keys(const json& v, const std::string& param,
                                  std::initializer_list<std::string_view> allowed) {
  for (const auto& [k, x] : v.items())
    if (std::find(allowed.begin(), allowed.end(), k) == allowed.end())
      return bad(fmt::format("Unrecognized argument '{}.{}'.", param, k), param + "." + k,
                 "unknown_parameter");
  return std::nullopt;
}

// A required string member `key` of object `v` (at `param`).
Parsed<std::string> member_string(const json& v, const std::string& param, const char* key) {
  const auto it = v.find(key);
  const std::string at = param + "." + key;
  if (it == v.end() || it->is_null())
    return bad(fmt::format("'{}' is required.", at), at, "missing_required");
  if (!it->is_string()) return wrong_type(at, "a string", *it);
  return it->get<std::string>();
}

// An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
// "arguments"}}], arguments the text of a JSON object.
std::optional<ApiError> parse_tool_calls(const json& v, const std::string& param,
                                         std::vector<ToolCall>& out) {
  if (v.is_null()) return std::nullopt;
  if (!v.is_array()) return wrong_type(param, "an array", v);
  if (v.size() > kMaxTools)
    return bad(fmt::format("'{}' has {} calls; at most {}.", param, v.size(), kMaxTools), param,
               "invalid_value");
  for (std::size_t i = 0; i < v.size(); ++i) {
    const json& c = v[i];
    const std::string p = fmt::format("{}[{}]", param, i);
    if (!c.is_object()) return wrong_type(p, "an object", c);
    if (auto e = only_keys(c, p, {"id", "type", "function", "index"})) return e;
    ToolCall call;
    auto id = member_string(c, p, "id");
    if (auto* e = std::get_if<ApiError>(&id)) return *e;
    call.id = std::get<std::string>(id);
    if (const auto t = c.find("type"); t != c.end() && !t->is_null() && *t != "function")
      return bad(fmt::format("'{}.type' must be 'function'.", p), p + ".type", "invalid_value");
    const auto f = c.find("function");
    if (f == c.end() || !f->is_object())
      return bad(fmt::format("'{}.function' is required and must be an object.", p),
                 p + ".function", "missing_required");
    const std::string fp = p + ".function";
    if (auto e = only_keys(*f, fp, {"name", "arguments"})) return e;
    auto name = member_string(*f, fp, "name");
    if (auto* e = std::get_if<ApiError>(&name)) return *e;
    call.name = std::get<std::string>(name);
    auto args = member_string(*f, fp, "arguments");
    if (auto* e = std::get_if<ApiError>(&args)) return *e;
    call.arguments = std::get<std::string>(args);
    bool object = false;
    if (json_depth(call.arguments) <= kMaxJsonDepth) {
      try {
        object = json::parse(call.arguments).is_object();
      } catch (const json::exception&) {
      }
    }
    if (!object)
      return bad(fmt::format("'{}.arguments' must be the text of a JSON object.", fp),
                 fp + ".arguments", "invalid_value");
    out.push_back(std::move(call));
  }
  return std::nullopt;
}

// tools: [{"type": "function", "function": {"name", "description", "parameters", "strict"}}].
std::optional<ApiError> parse_tools(const json& v, json& out) {
  if (!v.is_array()) return wrong_type("tools", "an array", v);
  if (v.size() > kMaxTools)
    return bad(fmt::format("'tools' has {} tools; at most {}.", v.size(), kMaxTools), "tools",
               "invalid_value");
  std::set<std::string, std::less<>> names;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const json& t = v[i];
    const std::string p = fmt::format("tools[{}]", i);
    if (!t.is_object()) return wrong_type(p, "an object", t);
    if (auto e = only_keys(t, p, {"type", "function"})) return e;
    auto type = member_string(t, p, "type");
    if (auto* e = std::get_if<ApiError>(&type)) return *e;
    if (std::get<std::string>(type) != "function")
      return unsupported(p + ".type", "'" + std::get<std::string>(type) +
                                          "' (only function tools)");
    const auto f = t.find("function");
    const std::string fp = p + ".function";
    if (f == t.end() || !f->is_object())
      return bad(fmt::format("'{}' is required and must be an object.", fp), fp,
                 "missing_required");
    if (auto e = only_keys(*f, fp, {"name", "description", "parameters", "strict"})) return e;
    auto name = member_string(*f, fp, "name");
    if (auto* e = std::get_if<ApiError>(&name)) return *e;
    const std::string& n = std::get<std::string>(name);
    if (!valid_function_name(n))
      return bad(fmt::format("'{}.name' is '{}'; a function's name is 1 to 64 of a-z, A-Z, 0-9, "
                             "underscores and dashes.",
                             fp, n),
                 fp + ".name", "invalid_value");
    if (!names.insert(n).second)
      return bad(fmt::format("'{}.name': the function '{}' is defined twice.", fp, n),
                 fp + ".name", "invalid_value");
    if (const auto d = f->find("description");
        d != f->end() && !d->is_null() && !d->is_string())
      return wrong_type(fp + ".description", "a string", *d);
    if (const auto s = f->find("parameters"); s != f->end() && !s->is_null() && !s->is_object())
      return wrong_type(fp + ".parameters", "an object", *s);
    if (const auto s = f->find("strict"); s != f->end() && !s->is_null() && !s->is_boolean())
      return wrong_type(fp + ".strict", "a boolean", *s);
  }
  if (!v.empty()) out = v;
  return std::nullopt;
}

// tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name"}}.
std::optional<ApiError> parse_tool_choice(const json& v, ToolChoice& out, std::string& name) {
  if (v.is_string()) {
    if (v == "auto") {
      out = ToolChoice::kAuto;
    } else if (v == "none") {
      out = ToolChoice::kNone;
    } else if (v == "required") {
      out = ToolChoice::kRequired;
    } else {
      return bad(fmt::format("'tool_choice' is '{}'; it must be 'auto', 'none', 'required' or "
                             "an object naming a function.",
                             v.get<std::string>()),
                 "tool_choice", "invalid_value");
    }
    return std::nullopt;
  }
  if (!v.is_object()) return wrong_type("tool_choice", "a string or an object", v);
  if (auto e = only_keys(v, "tool_choice", {"type", "function"})) return e;
  if (const auto t = v.find("type"); t == v.end() || *t != "function")
    return bad("'tool_choice.type' must be 'function'.", "tool_choice.type", "invalid_value");
  const auto f = v.find("function");
  if (f == v.end() || !f->is_object())
    return bad("'tool_choice.function' is required and must be an object.",
               "tool_choice.function", "missing_required");
  if (auto e = only_keys(*f, "tool_choice.function", {"name"})) return e;
  auto n = member_string(*f, "tool_choice.function", "name");
  if (auto* e = std::get_if<ApiError>(&n)) return *e;
  out = ToolChoice::kNamed;
  name = std::get<std::string>(n);
  return std::nullopt;
}

// A forced call ("required", a named function): the answer is constrained to one call object,
// {"name": one of the functions, "arguments": what its parameters describe}, as a response
// format (structured output); the tool-call reader takes the bare object as the call.
std::optional<ApiError> forced_call_format(ParsedRequest& r) {
  if (r.tool_choice != ToolChoice::kRequired && r.tool_choice != ToolChoice::kNamed)
    return std::nullopt;
  if (!r.tools.is_array() || r.tools.empty())
    return bad("'tool_choice' forces a call, but the request has no 'tools'.", "tool_choice",
               "invalid_value");
  if (!r.response_format.empty())
    return bad("'tool_choice' forces a call, and a call's shape is the answer's: "
               "'response_format' cannot constrain it too.",
               "response_format", "invalid_value");
  nlohmann::ordered_json alts = nlohmann::ordered_json::array();
  for (const auto& t : r.tools) {
    const auto& f = t.at("function");
    const std::string name = f.at("name").get<std::string>();
    if (r.tool_choice == ToolChoice::kNamed && name != r.tool_choice_name) continue;
    const auto p = f.find("parameters");
    nlohmann::ordered_json params = p != f.end() && p->is_object()
                                        ? *p
                                        : nlohmann::ordered_json{{"type", "object"}};
    alts.push_back({{"type", "object"},
                    {"properties", {{"name", {{"const", name}}}, {"arguments", params}}},
                    {"required", {"name", "arguments"}},
                    {"additionalProperties", false}});
  }
  if (alts.empty())
    return bad(fmt::format("'tool_choice' names the function '{}', which is not among 'tools'.",
                           r.tool_choice_name),
               "tool_choice", "invalid_value");
  const nlohmann::ordered_json schema =
      alts.size() == 1 ? alts[0] : nlohmann::ordered_json{{"anyOf", alts}};
  const std::string text =
      nlohmann::ordered_json{{"type", "json_schema"},
                             {"json_schema", {{"name", "tool_call"}, {"schema", schema}}}}
          .dump();
  auto grammar = structured::compile_response_format(text);
  if (!grammar.is_ok())
    return bad(fmt::format("'tool_choice' forces a call, which needs each function's "
                           "'parameters' in the JSON schema subset of structured output: {}.",
                           grammar.status().message()),
               "tools", "invalid_value");
  r.response_format = text;
  return std::nullopt;
}

std::optional<ApiError> parse_messages(const json& v, std::vector<ChatMessage>& out) {
  if (!v.is_array()) return wrong_type("messages", "an array", v);
  if (v.empty()) return bad("'messages' must contain at least one message.", "messages");
  for (std::size_t i = 0; i < v.size(); ++i) {
    const json& m = v[i];
    const std::string p = fmt::format("messages[{}]", i);
    if (!m.is_object()) return wrong_type(p, "an object", m);
    ChatMessage msg;
    bool have_content = false;
    for (const auto& [k, x] : m.items()) {
      if (k == "role") {
        if (!x.is_string()) return wrong_type(p + ".role", "a string", x);
        msg.role = x.get<std::string>();
      } else if (k == "content") {
        auto c = message_content(x, p + ".content");
        if (auto* e = std::get_if<ApiError>(&c)) return *e;
        msg.content = std::move(std::get<std::string>(c));
        have_content = !x.is_null();
      } else if (k == "name") {
        if (!x.is_string()) return wrong_type(p + ".name", "a string", x);
        msg.name = x.get<std::string>();
      } else if (k == "tool_calls") {
        if (auto e = parse_tool_calls(x, p + ".tool_calls", msg.tool_calls)) return e;
      } else if (k == "tool_call_id") {
        if (!x.is_string()) return wrong_type(p + ".tool_call_id", "a string", x);
        msg.tool_call_id = x.get<std::string>();
      } else if (k == "refusal" || k == "function_call" || k == "annotations" || k == "audio") {
        if (!(x.is_null() || (x.is_array() && x.empty()))) return unsupported(p + "." + k);
      } else {
        return bad(fmt::format("Unrecognized argument '{}.{}'.", p, k), p + "." + k,
                   "unknown_parameter");
      }
    }
    if (msg.role.empty())
      return bad(fmt::format("'{}.role' is required.", p), p + ".role", "missing_required");
    if (msg.role == "developer") msg.role = "system";
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" &&
        msg.role != "tool")
      return bad(fmt::format("'{}.role' is '{}'; this server takes system, developer, user, "
                             "assistant and tool messages.",
                             p, msg.role),
                 p + ".role", "invalid_value");
    if (!have_content && msg.role != "assistant")
      return bad(fmt::format("'{}.content' is required.", p), p + ".content", "missing_required");
    if (!msg.tool_calls.empty() && msg.role != "assistant")
      return bad(fmt::format("'{}.tool_calls' is only for assistant messages.", p),
                 p + ".tool_calls", "invalid_value");
    if (msg.role == "tool" && msg.tool_call_id.empty())
      return bad(fmt::format("'{}.tool_call_id' is required for a tool message.", p),
                 p + ".tool_call_id", "missing_required");
    if (msg.role != "tool" && !msg.tool_call_id.empty())
      return bad(fmt::format("'{}.tool_call_id' is only for tool messages.", p),
                 p + ".tool_call_id", "invalid_value");
    out.push_back(std::move(msg));
  }
  return std::nullopt;
}

// prompt: a string, token ids, or a one-element array of either.
std::optional<ApiError> parse_prompt(const json& v, ParsedRequest& r) {
  const json* p = &v;
  if (v.is_array() && !v.empty() && (v[0].is_string() || v[0].is_array())) {
    if (v.size() > 1)
      return bad(
          fmt::format("'prompt' holds {} prompts; this server takes one per request.", v.size()),
          "prompt", "unsupported_value");
    p = &v[0];
  }
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();
    return std::nullopt;
  }
  if (!p->is_array()) return wrong_type("prompt", "a string or an array of token ids", v);
  if (p->empty()) return bad("'prompt' is empty.", "prompt", "invalid_value");
  r.prompt_ids.reserve(p->size());
  for (std::size_t i = 0; i < p->size(); ++i) {
    const auto id = as_int((*p)[i]);
    if (!id || *id < 0 || *id > std::numeric_limits<TokenId>::max())
      return bad(fmt::format("'prompt[{}]' must be a token id (a non-negative integer).", i),
                 "prompt", "invalid_value");
    r.prompt_ids.push_back(static_cast<TokenId>(*id));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_stop(const json& v, std::vector<std::string>& out) {
  if (v.is_string()) {
    if (v.get<std::string>().empty()) return bad("'stop' must not be empty.", "stop");
    out.push_back(v.get<std::string>());
    return std::nullopt;
  }
  if (!v.is_array()) return wrong_type("stop", "a string or an array of strings", v);
  if (v.size() > kMaxStopStrings)
    return bad(fmt::format("'stop' has {} strings; at most {}.", v.size(), kMaxStopStrings), "stop",
               "invalid_value");
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) return wrong_type(fmt::format("stop[{}]", i), "a string", v[i]);
    if (v[i].get<std::string>().empty())
      return bad(fmt::format("'stop[{}]' must not be empty.", i), "stop");
    out.push_back(v[i].get<std::string>());
  }
  return std::nullopt;
}

// logit_bias: {"token id": bias in [-100, 100]}, at most kMaxLogitBias entries; the ids
// ascending in `out` (check_logit_bias checks them against the vocabulary).
std::optional<ApiError> parse_logit_bias(const json& v,
                                         std::vector<std::pair<TokenId, double>>& out) {
  const std::string key = "logit_bias";
  if (!v.is_object()) return wrong_type(key, "an object mapping token ids to numbers", v);
  if (v.size() > kMaxLogitBias)
    return bad(fmt::format("'logit_bias' has {} entries; at most {}.", v.size(), kMaxLogitBias),
               key, "invalid_value");
  for (const auto& [k, x] : v.items()) {
    const std::string p = fmt::format("logit_bias.{}", k);
    TokenId id = -1;
    const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), id);
    if (k.empty() || ec != std::errc() || end != k.data() + k.size() || id < 0)
      return bad(fmt::format("'logit_bias' key '{}' must be a token id (a non-negative integer "
                             "written as a string).",
                             k),
                 key, "invalid_value");
    auto b = get_number(x, p, -100.0, 100.0);
    if (auto* e = std::get_if<ApiError>(&b)) {
      e->param = key;
      return *e;
    }
    out.emplace_back(id, std::get<double>(b));
  }
  std::sort(out.begin(), out.end());
  for (std::size_t i = 1; i < out.size(); ++i)
    if (out[i].first == out[i - 1].first)
      return bad(fmt::format("'logit_bias' names token id {} twice.", out[i].first), key,
                 "invalid_value");
  return std::nullopt;
}

// response_format: text (no constraint), json_object or json_schema, compiled here so that a
// schema the matcher cannot follow is a 400 naming its path. `out` gets the format's JSON text
// with the body's own order of properties (a schema's properties are generated in that order).
std::optional<ApiError> parse_response_format(const json& v, std::string& out) {
  if (!v.is_object()) return wrong_type("response_format", "an object", v);
  std::string text = v.dump();
  auto grammar = structured::compile_response_format(text);
  if (!grammar.is_ok())
    return bad(fmt::format("Invalid 'response_format': {}.", grammar.status().message()),
               "response_format", "invalid_value");
  if (*grammar != nullptr) out = std::move(text);
  return std::nullopt;
}

// A request body: a JSON object, nested at most kMaxJsonDepth deep.
Parsed<json> parse_body(std::string_view body) {
  if (json_depth(body) > kMaxJsonDepth)
    return bad(fmt::format("The request body nests deeper than {} levels.", kMaxJsonDepth), "");
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    return bad(fmt::format("We could not parse the JSON body of your request ({}).", e.what()), "",
               "invalid_json");
  }
  if (!j.is_object())
    return bad(fmt::format("The request body must be a JSON object, not {}.", type_name(j)), "",
               "invalid_json");
  return j;
}

ApiError unknown_field(const std::string& key) {
  return bad(fmt::format("Unrecognized request argument supplied: {}", key), key,
             "unknown_parameter");
}

ApiError missing(const char* what) {
  return bad(fmt::format("Missing required parameter: '{}'.", what), what, "missing_required");
}

}  // namespace

Parsed<ParsedRequest> parse_request(Endpoint endpoint, std::string_view body) {
  auto parsed_body = parse_body(body);
  if (auto* e = std::get_if<ApiError>(&parsed_body)) return *e;
  const json& j = std::get<json>(parsed_body);
  ParsedRequest r;
  r.endpoint = endpoint;
  const bool chat = endpoint == Endpoint::kChat;
  const auto& neutral = chat ? kNeutralChat : kNeutralCompletion;
  bool have_input = false, have_stream_options = false;
  std::optional<int64_t> max_tokens, max_completion_tokens, top_logprobs;
  bool chat_logprobs = false;
  for (const auto& [key, v] : j.items()) {
    if (v.is_null() && key != "messages" && key != "prompt") continue;  // null: absent
    std::optional<ApiError> err;
    auto take = [&](auto parsed, auto& into) {
      if (auto* e = std::get_if<ApiError>(&parsed))
        err = *e;
      else
        into = std::get<std::decay_t<decltype(into)>>(parsed);
    };
    if (key == "model") {
      if (!v.is_string())
        err = wrong_type(key, "a string", v);
      else
        r.model = v.get<std::string>();
    } else if (chat && key == "messages") {
      err = parse_messages(v, r.messages);
      have_input = true;
    } else if (!chat && key == "prompt") {
      err = parse_prompt(v, r);
      have_input = true;
    } else if (key == "max_tokens" || (chat && key == "max_completion_tokens")) {
      auto i = get_int(v, key, 1, std::numeric_limits<int32_t>::max());
      if (auto* e = std::get_if<ApiError>(&i))
        err = *e;
      else
        (key == "max_tokens" ? max_tokens : max_completion_tokens) = std::get<int64_t>(i);
    } else if (key == "temperature") {
      take(get_number(v, key, 0.0, 2.0), r.temperature);
    } else if (key == "top_p") {
      take(get_number(v, key, 0.0, 1.0), r.top_p);
    } else if (key == "top_k") {
      int64_t k = 0;
      take(get_int(v, key, 0, std::numeric_limits<int32_t>::max()), k);
      r.top_k = static_cast<int>(k);
    } else if (key == "seed") {
      const auto s = as_int(v);
      if (!s && !(v.is_number_unsigned()))
        err = wrong_type(key, "an integer", v);
      else
        r.seed = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(*s);
    } else if (key == "n") {
      int64_t n = 1;
      take(get_int(v, key, 1, kMaxChoices), n);
      r.n = static_cast<int>(n);
    } else if (key == "min_p") {
      take(get_number(v, key, 0.0, 1.0), r.min_p);
    } else if (key == "presence_penalty") {
      take(get_number(v, key, -2.0, 2.0), r.presence_penalty);
    } else if (key == "frequency_penalty") {
      take(get_number(v, key, -2.0, 2.0), r.frequency_penalty);
    } else if (key == "repetition_penalty") {
      take(get_number(v, key, 0.01, 100.0), r.repetition_penalty);
    } else if (key == "logit_bias") {
      err = parse_logit_bias(v, r.logit_bias);
    } else if (chat && key == "logprobs") {
      take(get_bool(v, key), chat_logprobs);
    } else if (chat && key == "top_logprobs") {
      int64_t k = 0;
      take(get_int(v, key, 0, model::kMaxTopLogprobs), k);
      top_logprobs = k;
    } else if (!chat && key == "logprobs") {
      int64_t k = 0;
      take(get_int(v, key, 0, model::kMaxTopLogprobs), k);
      r.logprobs = static_cast<int>(k);
    } else if (key == "stream") {
      take(get_bool(v, key), r.stream);
    } else if (key == "stream_options") {
      if (!v.is_object()) {
        err = wrong_type(key, "an object", v);
      } else {
        have_stream_options = true;
        for (const auto& [k, x] : v.items()) {
          if (k == "include_usage") {
            if (!x.is_null()) take(get_bool(x, "stream_options.include_usage"), r.include_usage);
          } else if (k == "continuous_usage_stats" || k == "include_obfuscation") {
            if (!(x.is_null() || x == false)) err = unsupported("stream_options." + k);
          } else {
            err = bad(fmt::format("Unrecognized argument 'stream_options.{}'.", k),
                      "stream_options." + k, "unknown_parameter");
          }
          if (err) break;
        }
      }
    } else if (key == "stop") {
      err = parse_stop(v, r.stop);
    } else if (key == "ignore_eos") {
      take(get_bool(v, key), r.ignore_eos);
    } else if (key == "return_token_ids") {
      take(get_bool(v, key), r.return_token_ids);
    } else if (key == "timeout") {
      double t = 0;
      take(get_number(v, key, 0.0, 86400.0), t);
      if (!err && t <= 0)
        err = bad("'timeout' must be a number of seconds > 0.", key, "invalid_value");
      if (!err) r.timeout = t;
    } else if (chat && key == "tools") {
      err = parse_tools(v, r.tools);
    } else if (chat && key == "tool_choice") {
      err = parse_tool_choice(v, r.tool_choice, r.tool_choice_name);
    } else if (chat && key == "parallel_tool_calls") {
      bool ignored = true;
      take(get_bool(v, key), ignored);
    } else if (key == "response_format") {
      err = parse_response_format(v, r.response_format);
    } else if (key == "cache_prompt") {
      bool ignored = true;
      take(get_bool(v, key), ignored);
    } else if (neutral.contains(key)) {
      err = neutral_only(key, v);
    } else {
      err = unknown_field(key);
    }
    if (err) return *err;
  }
  if (!have_input) return missing(chat ? "messages" : "prompt");
  if (have_stream_options && !r.stream)
    return bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
               "stream_options", "invalid_value");
  if (top_logprobs && !chat_logprobs)
    return bad("'top_logprobs' needs 'logprobs' to be true.", "top_logprobs", "invalid_value");
  if (chat_logprobs) r.logprobs = static_cast<int>(top_logprobs.value_or(0));
  r.max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  if (auto e = forced_call_format(r)) return *e;
  return r;
}

Parsed<TokenizeRequest> parse_tokenize(std::string_view body) {
  auto parsed_body = parse_body(body);
  if (auto* e = std::get_if<ApiError>(&parsed_body)) return *e;
  TokenizeRequest r;
  bool have_content = false;
  for (const auto& [key, v] : std::get<json>(parsed_body).items()) {
    if (v.is_null()) continue;  // null: absent
    std::optional<ApiError> err;
    auto flag = [&err, &v = v, &key = key](bool& into) {
      auto b = get_bool(v, key);
      if (auto* e = std::get_if<ApiError>(&b))
        err = *e;
      else
        into = std::get<bool>(b);
    };
    if (key == "content") {
      if (!v.is_string())
        err = wrong_type(key, "a string", v);
      else
        r.content = v.get<std::string>();
      have_content = true;
    } else if (key == "add_special") {
      flag(r.add_special);
    } else if (key == "parse_special") {
      flag(r.parse_special);
    } else if (key == "with_pieces") {
      flag(r.with_pieces);
    } else if (key == "model") {
      if (!v.is_string())
        err = wrong_type(key, "a string", v);
      else
        r.model = v.get<std::string>();
    } else {
      err = unknown_field(key);
    }
    if (err) return *err;
  }
  if (!have_content) return missing("content");
  return r;
}

Parsed<std::vector<TokenId>> parse_detokenize(std::string_view body, int32_t n_vocab) {
  auto parsed_body = parse_body(body);
  if (auto* e = std::get_if<ApiError>(&parsed_body)) return *e;
  std::optional<std::vector<TokenId>> ids;
  for (const auto& [key, v] : std::get<json>(parsed_body).items()) {
    if (v.is_null()) continue;  // null: absent
    if (key == "model") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
    } else if (key == "tokens") {
      if (!v.is_array()) return wrong_type(key, "an array of token ids", v);
      ids.emplace();
      ids->reserve(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) {
        const auto id = as_int(v[i]);
        if (!id) return wrong_type(fmt::format("tokens[{}]", i), "a token id (an integer)", v[i]);
        if (*id < 0 || *id >= n_vocab)
          return bad(fmt::format("'tokens[{}]' is token id {}, outside the vocabulary [0, {}).",
                                 i, *id, n_vocab),
                     "tokens", "invalid_value");
        ids->push_back(static_cast<TokenId>(*id));
      }
    } else {
      return unknown_field(key);
    }
  }
  if (!ids) return missing("tokens");
  return std::move(*ids);
}

std::optional<ApiError> check_model(std::string_view requested,
                                    std::span<const std::string> served) {
  if (served.empty() || requested.empty()) return std::nullopt;
  if (std::find(served.begin(), served.end(), requested) != served.end()) return std::nullopt;
  return ApiError{404, fmt::format("The model `{}` does not exist", requested),
                  "invalid_request_error", "model", "model_not_found"};
}

std::optional<ApiError> check_logit_bias(const ParsedRequest& request, int32_t n_vocab) {
  for (const auto& [id, bias] : request.logit_bias)
    if (id >= n_vocab)
      return bad(fmt::format("'logit_bias' names token id {}, outside the vocabulary [0, {}).", id,
                             n_vocab),
                 "logit_bias", "invalid_value");
  return std::nullopt;
}

ChatTemplate ChatTemplate::from_template(std::string_view jinja) {
  ChatTemplate t;
  t.default_system = chat_template_default_system(jinja);
  return t;
}

ChatTemplate ChatTemplate::from_model(const Tokenizer& tokenizer) {
  ChatTemplate t = from_template(tokenizer.chat_template());
  t.format = tokenizer.chat_format();
  t.model = tokenizer.model_template();
  t.error = std::string(tokenizer.chat_template_error());
  t.strip_bos = tokenizer.add_bos();
  return t;
}

std::string ChatTemplate::describe() const {
  if (!error.empty())
    return "the model's chat template cannot be rendered (" + error +
           "): chat requests are refused with 400";
  if (model) return "the model's own chat template (tokenizer.chat_template)";
  return "no chat template in the file: chat requests get a plain User/Assistant transcript";
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages) const {
  std::vector<ChatTurn> turns;
  turns.reserve(messages.size());
  for (const ChatMessage& m : messages) turns.push_back({m.role, m.content});
  return format_chat(format, turns, default_system);
}

Result<ChatPrompt> ChatTemplate::render_prompt(std::span<const ChatMessage> messages) const {
  // The skeleton: each content replaced by a marker "\x02<index>\x03" (no whitespace, so a
  // format's trimming leaves it whole), which splits the markup from the contents.
  std::vector<ChatMessage> marked(messages.begin(), messages.end());
  for (std::size_t i = 0; i < marked.size(); ++i)
    marked[i].content = "\x02" + std::to_string(i) + "\x03";
  const std::string skeleton = render(marked);
  struct Part {
    std::string markup;
    int content = -1;  // the message whose content goes here
  };
  std::vector<Part> parts;
  std::size_t pos = 0;
  while (pos < skeleton.size()) {
    const std::size_t open = skeleton.find('\x02', pos);
    const std::size_t close = open == std::string::npos ? open : skeleton.find('\x03', open);
    if (open == std::string::npos || close == std::string::npos) {
      parts.push_back({skeleton.substr(pos), -1});
      break;
    }
    if (open > pos) parts.push_back({skeleton.substr(pos, open - pos), -1});
    parts.push_back({"", std::atoi(skeleton.c_str() + open + 1)});
    pos = close + 1;
  }
  const std::string whole = render(messages);
  constexpr std::string_view kWs = " \t\n\r\f\v";
  for (const bool trimmed : {false, true}) {  // ChatML writes contents as given; others trim
    ChatPrompt out;
    for (const Part& p : parts) {
      if (p.content < 0 || static_cast<std::size_t>(p.content) >= messages.size()) {
        out.text += p.markup;
        continue;
      }
      std::string_view c = messages[static_cast<std::size_t>(p.content)].content;
      if (trimmed) {
        const auto a = c.find_first_not_of(kWs);
        c = a == std::string_view::npos ? std::string_view()
                                        : c.substr(a, c.find_last_not_of(kWs) - a + 1);
      }
      const auto at = static_cast<uint32_t>(out.text.size());
      out.text += c;
      if (!c.empty()) out.data_ranges.emplace_back(at, static_cast<uint32_t>(out.text.size()));
    }
    if (out.text == whole) return out;
  }
  return internal_error("the chat format writes a message's content in a way the server cannot "
                        "separate from its markup");
}

std::optional<ApiError> check_prompt_bytes(const ParsedRequest& request,
                                           std::size_t max_token_bytes, int64_t context,
                                           int64_t pool) {
  if (max_token_bytes == 0) return std::nullopt;
  auto printable = [](std::string_view s) {
    return static_cast<int64_t>(
        std::count_if(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; }));
  };
  int64_t bytes = 0;
  if (request.endpoint == Endpoint::kChat)
    for (const ChatMessage& m : request.messages) bytes += printable(m.content);
  else if (request.prompt_text)
    bytes = printable(*request.prompt_text);
  // Every printable ASCII byte has a token of its own in a byte-level vocabulary, and no token
  // stands for more than max_token_bytes of text.
  const int64_t at_least = bytes / static_cast<int64_t>(max_token_bytes);
  int64_t limit = 0;
  if (context > 0) limit = context;
  if (pool > 0 && (limit == 0 || pool < limit)) limit = pool;
  if (limit == 0 || at_least + 1 <= limit) return std::nullopt;
  const char* where = request.endpoint == Endpoint::kChat ? "messages" : "prompt";
  return ApiError{400,
                  fmt::format("A sequence holds at most {} tokens (the model's context and the "
                              "KV cache pool). However, your {} has at least {} tokens ({} "
                              "bytes). Please reduce the length of the {}.",
                              limit, where, at_least, bytes, where),
                  "invalid_request_error", where, "context_length_exceeded"};
}

namespace {

// The messages as a template reads them (Hugging Face's conventions, as vLLM passes them):
// {"role", "content"}, an assistant's "tool_calls" with each call's arguments as an object
// (templates write them with tojson), a tool message's "tool_call_id", and "name" when given.
nlohmann::ordered_json template_messages(std::span<const ChatMessage> in) {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  for (const ChatMessage& m : in) {
    nlohmann::ordered_json j = {{"role", m.role}, {"content", m.content}};
    if (!m.tool_calls.empty()) {
      nlohmann::ordered_json calls = nlohmann::ordered_json::array();
      for (const ToolCall& c : m.tool_calls)
        calls.push_back({{"id", c.id},
                         {"type", "function"},
                         {"function",
                          {{"name", c.name},
                           {"arguments", nlohmann::ordered_json::parse(c.arguments)}}}});
      j["tool_calls"] = std::move(calls);
    }
    if (!m.tool_call_id.empty()) j["tool_call_id"] = m.tool_call_id;
    if (!m.name.empty()) j["name"] = m.name;
    messages.push_back(std::move(j));
  }
  return messages;
}

// A chat request's messages through the file's template (chat.model) or the hard-coded format
// (otherwise), with the contents' byte ranges: what build_prompt tokenizes (special tokens only
// outside those ranges) and render_chat_prompt returns.
Parsed<ChatPrompt> render_chat(const ParsedRequest& request, const ChatTemplate& chat) {
  if (!chat.error.empty())
    return bad("The model's chat template cannot be used: " + chat.error, "messages",
               "unsupported_chat_template");
  const bool tool_turns = std::any_of(
      request.messages.begin(), request.messages.end(),
      [](const ChatMessage& m) { return m.role == "tool" || !m.tool_calls.empty(); });
  if (chat.model) {
    if ((request.uses_tools() || tool_turns) && !chat.model->takes_tools())
      return bad("The model's chat template does not take tools (it never reads 'tools' or a "
                 "message's 'tool_calls'), so tools and tool messages cannot be shown to it.",
                 request.uses_tools() ? "tools" : "messages", "unsupported_value");
    auto p = chat.model->render(template_messages(request.messages),
                                request.uses_tools() ? request.tools : nlohmann::ordered_json(),
                                /*add_generation_prompt=*/true, chat.strip_bos);
    if (!p.is_ok())
      return bad(fmt::format("The messages cannot be rendered with the model's chat template: {}",
                             p.status().message()),
                 "messages", "invalid_value");
    return std::move(p).value();
  }
  if (request.uses_tools() || tool_turns)
    return bad("This model has no chat template of its own, and its plain transcript has no "
               "place for tools or tool messages.",
               request.uses_tools() ? "tools" : "messages", "unsupported_value");
  auto p = chat.render_prompt(request.messages);
  if (!p.is_ok()) return ApiError{500, p.status().message(), "server_error", "", ""};
  return std::move(p).value();
}

}  // namespace

Parsed<std::string> render_chat_prompt(const ParsedRequest& request, const ChatTemplate& chat) {
  auto rendered = render_chat(request, chat);
  if (auto* e = std::get_if<ApiError>(&rendered)) return *e;
  return std::move(std::get<ChatPrompt>(rendered).text);
}

Parsed<std::vector<TokenId>> build_prompt(const ParsedRequest& request, const Codec& codec,
                                          const ChatTemplate& chat) {
  const char* param = request.endpoint == Endpoint::kChat ? "messages" : "prompt";
  std::vector<TokenId> ids;
  if (request.endpoint == Endpoint::kChat || request.prompt_text) {
    Result<std::vector<TokenId>> enc = std::vector<TokenId>{};
    if (request.endpoint == Endpoint::kChat) {
      auto r = render_chat(request, chat);
      if (auto* e = std::get_if<ApiError>(&r)) return *e;
      const ChatPrompt& p = std::get<ChatPrompt>(r);
      enc = codec.encode_chat(p.text, p.data_ranges);
    } else {
      enc = codec.encode(*request.prompt_text, false);
    }
    if (!enc.is_ok())
      return bad(fmt::format("The {} cannot be tokenized: {}", param, enc.status().message()),
                 param, "invalid_value");
    ids = std::move(enc).value();
  } else {
    ids = request.prompt_ids;
    const int32_t n_vocab = codec.n_vocab();
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || ids[i] >= n_vocab)
        return bad(fmt::format("'prompt[{}]' is token id {}, outside the vocabulary [0, {}).", i,
                               ids[i], n_vocab),
                   "prompt", "invalid_value");
  }
  if (ids.empty())
    return bad(fmt::format("The {} is empty after tokenization.", param), param, "invalid_value");
  return ids;
}

Parsed<int64_t> check_lengths(const ParsedRequest& request, int64_t prompt_tokens, int64_t context,
                              int64_t pool) {
  const char* where = request.endpoint == Endpoint::kChat ? "messages" : "prompt";
  struct Limit {
    int64_t tokens;
    std::string name;
  };
  std::vector<Limit> limits;
  if (context > 0) limits.push_back({context, "This model's maximum context length is"});
  if (pool > 0)
    limits.push_back({pool, "The KV cache pool (--kv-memory, over all ranks) holds at most"});
  for (const Limit& l : limits)
    if (prompt_tokens + 1 > l.tokens)
      return bad(fmt::format("{} {} tokens. However, your {} has {} tokens (and at least 1 is "
                             "generated). Please reduce the length of the {}.",
                             l.name, l.tokens, where, prompt_tokens, where),
                 where, "context_length_exceeded");
  if (request.max_tokens) {
    const int64_t m = *request.max_tokens;
    for (const Limit& l : limits)
      if (prompt_tokens + m > l.tokens)
        return bad(fmt::format("{} {} tokens. However, you requested {} tokens ({} in the {}, {} "
                               "in the completion). Please reduce the length of the {} or "
                               "completion.",
                               l.name, l.tokens, prompt_tokens + m, prompt_tokens, where, m, where),
                   "max_tokens", "context_length_exceeded");
    return m;
  }
  int64_t left = std::numeric_limits<int32_t>::max();
  for (const Limit& l : limits) left = std::min(left, l.tokens - prompt_tokens);
  return request.endpoint == Endpoint::kChat ? left : std::min<int64_t>(16, left);
}

}  // namespace treeattn::serve
