// The response format's compiler (schema.hpp): JSON Schema to a Grammar.
#include "model/structured/schema.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

namespace treeattn::structured {

int32_t TrieNode::child(uint8_t c) const {
  for (const auto& [b, n] : next)
    if (b == c) return n;
  return -1;
}

namespace {

// ordered: an object's properties are generated in the order the schema lists them.
using json = nlohmann::ordered_json;

// A refusal, unwound to compile_response_format: its message names the path.
struct Refusal : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void refuse(const std::string& path, const std::string& why) {
  throw Refusal(path + ": " + why);
}

const std::set<std::string, std::less<>> kAnnotations = {
    "title",    "description", "default",  "examples",  "$schema", "$id",
    "$comment", "deprecated",  "readOnly", "writeOnly", "$defs",   "definitions"};
const std::set<std::string, std::less<>> kObjectWords = {"properties", "required",
                                                         "additionalProperties"};
const std::set<std::string, std::less<>> kArrayWords = {"items", "minItems", "maxItems"};
const std::set<std::string, std::less<>> kStringWords = {"minLength", "maxLength"};
const std::set<std::string, std::less<>> kOtherWords = {"type",  "enum",  "const",
                                                        "anyOf", "allOf", "$ref"};

std::string escaped(const std::string& key) {
  const std::string q = json(key).dump();
  return q.substr(1, q.size() - 2);
}

bool of_type(const json& v, const std::string& type) {
  if (type == "object") return v.is_object();
  if (type == "array") return v.is_array();
  if (type == "string") return v.is_string();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "number") return v.is_number();
  if (type == "integer") {
    if (v.is_number_integer()) return true;
    if (!v.is_number_float()) return false;
    const double d = v.get<double>();
    return d == static_cast<double>(static_cast<int64_t>(d));
  }
  return false;
}

class Compiler {
 public:
  Compiler(const json& root, bool strict) : root_(root), strict_(strict) {}

  Grammar take(int32_t root_node, const std::string& root_path) {
    g_.root = root_node;
    settle(root_path);
    return std::move(g_);
  }

  int32_t any() {
    if (any_ >= 0) return any_;
    any_ = add(Node{});
    Node obj;
    obj.kind = Kind::kObject;
    obj.additional = any_;
    obj.depth_cap = kAnyMaxNesting;
    Node arr;
    arr.kind = Kind::kArray;
    arr.items = any_;
    arr.depth_cap = kAnyMaxNesting;
    Node str, num;
    str.kind = Kind::kString;
    num.kind = Kind::kNumber;
    const std::vector<int32_t> alts = {add(std::move(obj)), add(std::move(arr)),
                                       add(std::move(str)), add(std::move(num)),
                                       literal({"true", "false", "null"}, "")};
    g_.nodes[static_cast<std::size_t>(any_)].alts = alts;
    return any_;
  }

  int32_t any_object() {
    const int32_t a = any();
    return g_.nodes[static_cast<std::size_t>(a)].alts[0];
  }

  int32_t schema(const json& s, const std::string& path, int depth) {
    if (depth > kMaxSchemaDepth)
      refuse(path, "the schema nests deeper than " + std::to_string(kMaxSchemaDepth) + " levels");
    if (s.is_boolean()) return s.get<bool>() ? any() : add(Node{});
    if (!s.is_object()) refuse(path, "a schema must be an object or a boolean");
    std::vector<std::string> words;  // the keywords that constrain the value
    for (const auto& [k, v] : s.items()) {
      if (kAnnotations.contains(k)) continue;
      if (!kObjectWords.contains(k) && !kArrayWords.contains(k) && !kStringWords.contains(k) &&
          !kOtherWords.contains(k))
        refuse(path, "unsupported keyword '" + k + "'");
      words.push_back(k);
    }
    auto alone = [&](const char* word) {
      for (const std::string& w : words)
        if (w != word)
          refuse(path, std::string("'") + word + "' together with '" + w + "' is not supported");
    };
    if (s.contains("$ref")) {
      alone("$ref");
      return ref(s["$ref"], path + ".$ref", depth);
    }
    if (s.contains("allOf")) {
      alone("allOf");
      const json& a = s["allOf"];
      if (!a.is_array() || a.size() != 1)
        refuse(path + ".allOf", "only an allOf of exactly one schema is supported");
      return schema(a[0], path + ".allOf[0]", depth + 1);
    }
    if (s.contains("anyOf")) {
      alone("anyOf");
      const json& a = s["anyOf"];
      if (!a.is_array() || a.empty()) refuse(path + ".anyOf", "must be a non-empty array");
      Node u;
      for (std::size_t i = 0; i < a.size(); ++i)
        u.alts.push_back(schema(a[i], path + ".anyOf[" + std::to_string(i) + "]", depth + 1));
      return add(std::move(u));
    }
    const std::vector<std::string> types = type_names(s, path);
    if (s.contains("enum") || s.contains("const")) return literals(s, types, path);
    std::vector<int32_t> alts;
    for (const std::string& t : types) {
      if (t == "integer" && std::find(types.begin(), types.end(), "number") != types.end())
        continue;  // a number already admits every integer
      alts.push_back(typed(s, t, path, depth));
    }
    if (alts.empty()) return any();
    if (alts.size() == 1) return alts[0];
    Node u;
    u.alts = std::move(alts);
    return add(std::move(u));
  }

 private:
  int32_t add(Node n) {
    if (g_.nodes.size() >= kMaxNodes)
      throw Refusal("response_format: the schema needs more than " + std::to_string(kMaxNodes) +
                    " shapes");
    g_.nodes.push_back(std::move(n));
    return static_cast<int32_t>(g_.nodes.size() - 1);
  }

  Node& node(int32_t i) { return g_.nodes[static_cast<std::size_t>(i)]; }

  // The type names of `s`: its "type", else those its keywords imply, else none (any value).
  std::vector<std::string> type_names(const json& s, const std::string& path) {
    static const std::set<std::string, std::less<>> known = {
        "object", "array", "string", "number", "integer", "boolean", "null"};
    std::vector<std::string> out;
    if (s.contains("type")) {
      const json& t = s["type"];
      const std::vector<json> list = t.is_array() ? t.get<std::vector<json>>() : std::vector{t};
      if (list.empty()) refuse(path + ".type", "must name at least one type");
      for (const json& n : list) {
        if (!n.is_string() || !known.contains(n.get<std::string>()))
          refuse(path + ".type", "unknown type " + n.dump() +
                                     " (object, array, string, number, integer, boolean, null)");
        if (std::find(out.begin(), out.end(), n.get<std::string>()) == out.end())
          out.push_back(n.get<std::string>());
      }
      return out;
    }
    if (s.contains("enum") || s.contains("const")) return out;
    for (const auto& [k, v] : s.items()) {
      const char* t = kObjectWords.contains(k)   ? "object"
                      : kArrayWords.contains(k)  ? "array"
                      : kStringWords.contains(k) ? "string"
                                                 : nullptr;
      if (t != nullptr && std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
    }
    return out;
  }

  int64_t count(const json& s, const char* word, const std::string& path) {
    const json& v = s[word];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      refuse(path + "." + word, "must be a non-negative integer");
    return std::min<int64_t>(v.get<int64_t>(), int64_t{1} << 40);
  }

  void bounds(const json& s, const char* lo, const char* hi, const std::string& path, Node& n) {
    if (s.contains(lo)) n.min = count(s, lo, path);
    if (s.contains(hi)) n.max = count(s, hi, path);
    if (n.max >= 0 && n.min > n.max)
      refuse(path, std::string(lo) + " " + std::to_string(n.min) + " is above " + hi + " " +
                       std::to_string(n.max));
  }

  int32_t typed(const json& s, const std::string& t, const std::string& path, int depth) {
    Node n;
    if (t == "string") {
      n.kind = Kind::kString;
      bounds(s, "minLength", "maxLength", path, n);
      return add(std::move(n));
    }
    if (t == "number" || t == "integer") {
      n.kind = t == "number" ? Kind::kNumber : Kind::kInteger;
      return add(std::move(n));
    }
    if (t == "boolean") return literal({"true", "false"}, path);
    if (t == "null") return literal({"null"}, path);
    if (t == "array") {
      n.kind = Kind::kArray;
      bounds(s, "minItems", "maxItems", path, n);
      if (s.contains("items")) {
        if (s["items"].is_array())
          refuse(path + ".items", "an array of schemas (tuple items) is not supported");
        n.items = schema(s["items"], path + ".items", depth + 1);
      } else {
        n.items = any();
      }
      return add(std::move(n));
    }
    return object(s, path, depth);
  }

  int32_t object(const json& s, const std::string& path, int depth) {
    Node n;
    n.kind = Kind::kObject;
    if (s.contains("properties")) {
      const json& ps = s["properties"];
      if (!ps.is_object()) refuse(path + ".properties", "must be an object");
      if (ps.size() > kMaxProperties)
        refuse(path + ".properties", "more than " + std::to_string(kMaxProperties) + " properties");
      for (const auto& [k, v] : ps.items())
        n.props.push_back(
            Property{escaped(k), schema(v, path + ".properties." + k, depth + 1), false});
    }
    if (s.contains("required")) {
      const json& r = s["required"];
      if (!r.is_array()) refuse(path + ".required", "must be an array of property names");
      for (const json& name : r) {
        if (!name.is_string()) refuse(path + ".required", "must be an array of property names");
        const std::string key = escaped(name.get<std::string>());
        auto it = std::find_if(n.props.begin(), n.props.end(),
                               [&](const Property& p) { return p.key == key; });
        if (it == n.props.end())
          refuse(path + ".required",
                 "names '" + name.get<std::string>() + "', which is not one of the properties");
        it->required = true;
      }
    }
    if (s.contains("additionalProperties")) {
      const json& a = s["additionalProperties"];
      if (!(a.is_boolean() && !a.get<bool>())) {
        if (strict_)
          refuse(path + ".additionalProperties", "strict requires additionalProperties false");
        n.additional = schema(a, path + ".additionalProperties", depth + 1);
      }
    }
    return add(std::move(n));
  }

  int32_t literals(const json& s, const std::vector<std::string>& types, const std::string& path) {
    std::vector<json> values;
    if (s.contains("enum")) {
      if (!s["enum"].is_array()) refuse(path + ".enum", "must be an array");
      values = s["enum"].get<std::vector<json>>();
    }
    if (s.contains("const")) {
      const json& c = s["const"];
      if (s.contains("enum") && std::find(values.begin(), values.end(), c) == values.end())
        refuse(path, "const is not one of enum's values");
      values = {c};
    }
    std::vector<std::string> texts;
    for (const json& v : values) {
      const bool typed_ok = types.empty() || std::any_of(types.begin(), types.end(),
                                                         [&](auto& t) { return of_type(v, t); });
      if (typed_ok) texts.push_back(v.dump());
    }
    if (texts.empty())
      refuse(path, values.empty() ? "enum is empty" : "no enum value is of the schema's type");
    return literal(texts, path);
  }

  int32_t literal(const std::vector<std::string>& texts, const std::string& path) {
    for (const std::string& t : texts) {
      literal_bytes_ += t.size();
      if (literal_bytes_ > kMaxLiteralBytes)
        refuse(path, "enum and const values take more than " + std::to_string(kMaxLiteralBytes) +
                         " bytes in all");
    }
    Node n;
    n.kind = Kind::kLiteral;
    n.literals = trie(texts, false);
    return add(std::move(n));
  }

  // A trie of `texts`; terminal: the text's index (keys) or 0 (literals).
  int32_t trie(const std::vector<std::string>& texts, bool indexed) {
    const auto root = static_cast<int32_t>(g_.tries.size());
    g_.tries.emplace_back();
    for (std::size_t i = 0; i < texts.size(); ++i) {
      int32_t at = root;
      const auto id = indexed ? static_cast<int32_t>(i) : 0;
      g_.tries[static_cast<std::size_t>(at)].below.push_back(id);
      for (const char ch : texts[i]) {
        const auto c = static_cast<uint8_t>(ch);
        int32_t nx = g_.tries[static_cast<std::size_t>(at)].child(c);
        if (nx < 0) {
          nx = static_cast<int32_t>(g_.tries.size());
          g_.tries.emplace_back();
          auto& next = g_.tries[static_cast<std::size_t>(at)].next;
          next.insert(std::upper_bound(next.begin(), next.end(), std::make_pair(c, int32_t{-1})),
                      {c, nx});
        }
        at = nx;
        g_.tries[static_cast<std::size_t>(at)].below.push_back(id);
      }
      g_.tries[static_cast<std::size_t>(at)].terminal = id;
    }
    for (std::size_t t = static_cast<std::size_t>(root); t < g_.tries.size(); ++t) {
      auto& b = g_.tries[t].below;
      std::sort(b.begin(), b.end());
      b.erase(std::unique(b.begin(), b.end()), b.end());
    }
    return root;
  }

  int32_t ref(const json& r, const std::string& path, int depth) {
    if (!r.is_string()) refuse(path, "must be a string");
    const std::string target = r.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) return it->second;
    const json* s = nullptr;
    std::string where = "response_format.json_schema.schema";
    if (target == "#") {
      s = &root_;
    } else {
      for (const char* defs : {"#/$defs/", "#/definitions/"}) {
        const std::string prefix = defs;
        if (target.rfind(prefix, 0) != 0) continue;
        std::string name;  // JSON pointer: ~1 is '/', ~0 is '~'
        const std::string raw = target.substr(prefix.size());
        for (std::size_t i = 0; i < raw.size(); ++i) {
          if (raw[i] == '~' && i + 1 < raw.size() && (raw[i + 1] == '0' || raw[i + 1] == '1')) {
            name += raw[i + 1] == '0' ? '~' : '/';
            ++i;
          } else {
            name += raw[i];
          }
        }
        const std::string section = prefix.substr(2, prefix.size() - 3);
        if (root_.is_object() && root_.contains(section) && root_[section].is_object() &&
            root_[section].contains(name)) {
          s = &root_[section][name];
          where += "." + section + "." + name;
        }
      }
    }
    if (s == nullptr)
      refuse(path, "'" + target +
                       "' is not a reference this server resolves (#, #/$defs/NAME or "
                       "#/definitions/NAME of the root schema)");
    const int32_t placeholder = add(Node{});  // a union of one: the target, once compiled
    refs_[target] = placeholder;
    const int32_t t = schema(*s, where, depth + 1);  // a chain of references nests
    node(placeholder).alts = {t};
    return placeholder;
  }

  // Which nodes admit a value (least fixed point), then: unsatisfiable alternatives, optional
  // properties and other keys' schemas are dropped, so every prefix the matcher accepts can be
  // completed; the key tries are built.
  void settle(const std::string& root_path) {
    const std::size_t n = g_.nodes.size();
    std::vector<char> sat(n, 0);
    auto ok = [&](int32_t i) { return i >= 0 && sat[static_cast<std::size_t>(i)] != 0; };
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t i = 0; i < n; ++i) {
        if (sat[i]) continue;
        const Node& x = g_.nodes[i];
        bool s = false;
        switch (x.kind) {
          case Kind::kObject:
            s = std::all_of(x.props.begin(), x.props.end(),
                            [&](const Property& p) { return !p.required || ok(p.node); });
            break;
          case Kind::kArray:
            s = x.min == 0 || ok(x.items);
            break;
          case Kind::kString:
          case Kind::kNumber:
          case Kind::kInteger:
            s = true;
            break;
          case Kind::kLiteral:
            s = !g_.tries[static_cast<std::size_t>(x.literals)].below.empty();
            break;
          case Kind::kUnion:
            s = std::any_of(x.alts.begin(), x.alts.end(), ok);
            break;
        }
        if (s) sat[i] = 1, changed = true;
      }
    }
    if (!ok(g_.root)) refuse(root_path, "the schema admits no value");
    for (Node& x : g_.nodes) {
      std::erase_if(x.alts, [&](int32_t a) { return !ok(a); });
      std::erase_if(x.props, [&](const Property& p) { return !p.required && !ok(p.node); });
      if (x.additional >= 0 && !ok(x.additional)) x.additional = -1;
      if (x.kind == Kind::kArray && !ok(x.items)) x.max = 0;
      if (x.kind != Kind::kObject) continue;
      std::vector<std::string> keys;
      for (const Property& p : x.props) keys.push_back(p.key);
      x.next_required.assign(x.props.size() + 1, static_cast<int32_t>(x.props.size()));
      for (std::size_t i = x.props.size(); i-- > 0;)
        x.next_required[i] = x.props[i].required ? static_cast<int32_t>(i) : x.next_required[i + 1];
      x.keys = trie(keys, true);
    }
    flatten_unions();
  }

  // Every union's alternatives as the shapes that are not unions, reached through unions
  // (first come first, once each): a union that names itself through references ({"anyOf":
  // [{"$ref": "#"}, ...]}) is no loop for the matcher, which starts each alternative directly.
  void flatten_unions() {
    std::vector<std::vector<int32_t>> flat(g_.nodes.size());
    std::vector<std::size_t> seen(g_.nodes.size(), 0);  // i + 1: reached from union i
    for (std::size_t i = 0; i < g_.nodes.size(); ++i) {
      if (g_.nodes[i].kind != Kind::kUnion) continue;
      std::vector<int32_t> todo(g_.nodes[i].alts.rbegin(), g_.nodes[i].alts.rend());
      seen[i] = i + 1;
      while (!todo.empty()) {
        const int32_t a = todo.back();
        todo.pop_back();
        if (seen[static_cast<std::size_t>(a)] == i + 1) continue;
        seen[static_cast<std::size_t>(a)] = i + 1;
        const Node& x = node(a);
        if (x.kind != Kind::kUnion) {
          flat[i].push_back(a);
          continue;
        }
        todo.insert(todo.end(), x.alts.rbegin(), x.alts.rend());
      }
    }
    for (std::size_t i = 0; i < g_.nodes.size(); ++i)
      if (g_.nodes[i].kind == Kind::kUnion) g_.nodes[i].alts = std::move(flat[i]);
  }

  const json& root_;
  bool strict_;
  Grammar g_;
  int32_t any_ = -1;
  std::size_t literal_bytes_ = 0;
  std::map<std::string, int32_t> refs_;
};

struct TooDeep {};

Result<json> parse_limited(std::string_view text) {
  try {
    return json::parse(text, [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxSchemaDepth + 4) throw TooDeep{};
      return true;
    });
  } catch (const TooDeep&) {
    return invalid_argument("response_format: nests deeper than " +
                            std::to_string(kMaxSchemaDepth + 4) + " levels");
  } catch (const json::exception& e) {
    return invalid_argument(std::string("response_format: not valid JSON (") + e.what() + ")");
  }
}

Result<std::shared_ptr<const Grammar>> compile_schema_format(const json& rf) {
  for (const auto& [k, v] : rf.items())
    if (k != "type" && k != "json_schema")
      return invalid_argument("response_format." + k + ": unknown field");
  if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
    return invalid_argument("response_format.json_schema: required, an object");
  const json& js = rf["json_schema"];
  bool strict = false;
  for (const auto& [k, v] : js.items()) {
    const std::string path = "response_format.json_schema." + k;
    if (k == "name") {
      const std::string name = v.is_string() ? v.get<std::string>() : std::string();
      const bool good =
          !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
            return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                   c == '_' || c == '-';
          });
      if (!good) return invalid_argument(path + ": must be 1 to 64 of a-z, A-Z, 0-9, _ and -");
    } else if (k == "description") {
      if (!v.is_string()) return invalid_argument(path + ": must be a string");
    } else if (k == "strict") {
      if (!v.is_null() && !v.is_boolean()) return invalid_argument(path + ": must be a boolean");
      strict = v.is_boolean() && v.get<bool>();
    } else if (k != "schema") {
      return invalid_argument(path + ": unknown field");
    }
  }
  if (!js.contains("name"))
    return invalid_argument("response_format.json_schema.name: required, a string");
  const json schema = js.contains("schema") ? js["schema"] : json(true);
  const std::string path = "response_format.json_schema.schema";
  try {
    Compiler c(schema, strict);
    const int32_t root = c.schema(schema, path, 1);
    return std::shared_ptr<const Grammar>(std::make_shared<Grammar>(c.take(root, path)));
  } catch (const Refusal& e) {
    return invalid_argument(e.what());
  } catch (const json::exception& e) {
    return invalid_argument(path + ": " + e.what());
  }
}

}  // namespace

Result<std::shared_ptr<const Grammar>> compile_response_format(std::string_view json_text) {
  auto parsed = parse_limited(json_text);
  TREEATTN_RETURN_IF_ERROR(parsed.status());
  const json& rf = *parsed;
  if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
    return invalid_argument("response_format.type: required, a string");
  const std::string type = rf["type"].get<std::string>();
  if (type == "text") {
    if (rf.size() != 1) return invalid_argument("response_format: type text takes no other field");
    return std::shared_ptr<const Grammar>();
  }
  if (type == "json_object") {
    if (rf.size() != 1)
      return invalid_argument("response_format: type json_object takes no other field");
    Compiler c(json(true), false);
    const int32_t root = c.any_object();
    return std::shared_ptr<const Grammar>(
        std::make_shared<Grammar>(c.take(root, "response_format")));
  }
  if (type == "json_schema") return compile_schema_format(rf);
  return invalid_argument("response_format.type: '" + type +
                          "' is not one of 'text', 'json_object', 'json_schema'");
}

}  // namespace treeattn::structured
