// Jinja values: construction, Python's str() and repr(), and json.dumps as HF's tojson calls it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "model/jinja/jinja.hpp"

namespace treeattn::jinja {

namespace {
std::string position_prefix(int line, int column) {
  if (line <= 0) return {};
  return "line " + std::to_string(line) + ", column " + std::to_string(column) + ": ";
}
}  // namespace

Error::Error(const std::string& message, int line, int column)
    : std::runtime_error(position_prefix(line, column) + message),
      message_(message),
      line_(line),
      column_(column) {}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.b_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.i_ = i;
  return v;
}
Value Value::number(double f) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.f_ = f;
  return v;
}
Value Value::string(std::string s, bool data) {
  std::vector<Range> r;
  if (data && !s.empty()) r.push_back({0u, static_cast<uint32_t>(s.size())});
  return string(std::move(s), std::move(r));
}
Value Value::string(std::string s, std::vector<Range> data_ranges) {
  Value v;
  v.kind_ = Kind::kString;
  v.s_ = std::make_shared<const Str>(Str{std::move(s), std::move(data_ranges)});
  return v;
}
Value Value::markup(std::string s, bool data) {
  Value v = string(std::move(s), data);
  std::const_pointer_cast<Str>(v.s_)->markup = true;
  return v;
}
Value Value::markup(const Value& str) {
  Value v = string(str.str(), str.ranges());
  std::const_pointer_cast<Str>(v.s_)->markup = true;
  return v;
}
bool Value::is_markup() const { return kind_ == Kind::kString && s_->markup; }

Value Value::list(std::vector<Value> items, bool tuple) {
  int depth = 0;
  for (const Value& x : items) depth = std::max(depth, value_depth(x));
  if (depth + 1 > kMaxValueDepth)
    throw Error("a list nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
  Value v;
  v.kind_ = Kind::kList;
  v.l_ = std::make_shared<List>(List{std::move(items), tuple, depth + 1});
  return v;
}

int value_depth(const Value& v) {
  if (v.is_list()) return v.list_ref().depth;
  if (v.is_dict()) return v.dict_ref().depth;
  return 0;
}
Value Value::dict() {
  Value v;
  v.kind_ = Kind::kDict;
  v.d_ = std::make_shared<Dict>();
  return v;
}
Value Value::callable(std::shared_ptr<const Callable> c) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.c_ = std::move(c);
  return v;
}
Value Value::undefined(std::string name) {
  Value v;
  v.s_ = std::make_shared<const Str>(Str{std::move(name), {}});
  return v;
}

const std::string& Value::str() const { return s_->text; }
const std::vector<Range>& Value::ranges() const { return s_->data; }
const List& Value::list_ref() const { return *l_; }
List& Value::list_mut() const { return *l_; }
const Dict& Value::dict_ref() const { return *d_; }
Dict& Value::dict_mut() const { return *d_; }
const std::string& Value::undefined_name() const {
  static const std::string kEmpty;
  return s_ ? s_->text : kEmpty;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return f_ != 0;
    case Kind::kString:
      return !s_->text.empty();
    case Kind::kList:
      return l_->generator || !l_->items.empty();
    case Kind::kDict:
      return !d_->items.empty();
    case Kind::kCallable:
      return true;
  }
  return false;
}

const Value* Dict::find(std::string_view key) const {
  const auto it = index.find(key);
  return it == index.end() ? nullptr : &items[it->second].second;
}

void Dict::set(const std::string& key, Value v) {
  const int d = value_depth(v) + 1;
  if (d > kMaxValueDepth)
    throw Error("a dict nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
  depth = std::max(depth, d);
  const auto it = index.find(key);
  if (it != index.end()) {
    items[it->second].second = std::move(v);
    return;
  }
  index.emplace(key, items.size());
  items.emplace_back(key, std::move(v));
}

namespace {

// Python's repr(float): the shortest digits that read back the same, in fixed notation for
// exponents -4..15 and scientific otherwise.
std::string float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
  char buf[64];
  int prec = 1;
  for (; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, f);
    if (std::strtod(buf, nullptr) == f) break;
  }
  // buf: [-]d.ddde[+-]xx
  std::string s = buf;
  const bool neg = s[0] == '-';
  if (neg) s.erase(0, 1);
  const auto e = s.find('e');
  const int exp = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (std::size_t k = 0; k < e; ++k)
    if (s[k] != '.') digits += s[k];
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      std::string ip = digits.substr(0, std::min<std::size_t>(digits.size(), exp + 1));
      while (static_cast<int>(ip.size()) < exp + 1) ip += '0';
      std::string fp = digits.size() > static_cast<std::size_t>(exp + 1) ? digits.substr(exp + 1)
                                                                         : std::string("0");
      out = ip + "." + fp;
    } else {
      out = "0." + std::string(static_cast<std::size_t>(-exp - 1), '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

// Characters Python's repr() writes as escapes (not str.isprintable()): controls, separators
// other than the space, and the common format characters (unassigned code points are not known
// here and print as they are).
bool py_unprintable(uint32_t c) {
  return c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
         (c >= 0x205f && c <= 0x2064) || (c >= 0x2066 && c <= 0x206f) || c == 0x3000 ||
         c == 0xfeff || (c >= 0xd800 && c <= 0xdfff) || (c >= 0xe000 && c <= 0xf8ff) ||
         (c >= 0xfff9 && c <= 0xfffb) || c == 0x110bd || c == 0xe0001 ||
         (c >= 0xe0020 && c <= 0xe007f) || c >= 0xf0000;
}

// Python's repr(str): single quotes unless the text has a single quote and no double quote.
std::string string_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (std::size_t i = 0; i < s.size();) {
    const auto c0 = static_cast<unsigned char>(s[i]);
    std::size_t n = c0 < 0x80 ? 1 : (c0 >> 5) == 6 ? 2 : (c0 >> 4) == 14 ? 3 : (c0 >> 3) == 30 ? 4 : 1;
    n = std::min(n, s.size() - i);
    uint32_t c = n == 1 ? c0 : (c0 & (0xff >> (n + 1)));
    for (std::size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    const char ch = s[i];
    if (n == 1 && (ch == q || ch == '\\')) {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (py_unprintable(c)) {
      char b[16];
      if (c < 0x100) std::snprintf(b, sizeof b, "\\x%02x", c);
      else if (c < 0x10000) std::snprintf(b, sizeof b, "\\u%04x", c);
      else std::snprintf(b, sizeof b, "\\U%08x", c);
      out += b;
    } else {
      out.append(s, i, n);
    }
    i += n;
  }
  out += q;
  return out;
}

std::string repr(const Value& v);

std::string container_str(const Value& v) {
  std::string out;
  if (v.is_list()) {
    const List& l = v.list_ref();
    if (l.generator) throw Error("printing a generator (select, reject, map: add '| list')");
    out = l.tuple ? "(" : "[";
    for (std::size_t k = 0; k < l.items.size(); ++k) {
      if (k) out += ", ";
      out += repr(l.items[k]);
    }
    if (l.tuple && l.items.size() == 1) out += ",";
    out += l.tuple ? ")" : "]";
    return out;
  }
  const Dict& d = v.dict_ref();
  if (d.is_namespace) return "<Namespace " + std::to_string(d.items.size()) + ">";
  out = "{";
  for (std::size_t k = 0; k < d.items.size(); ++k) {
    if (k) out += ", ";
    out += string_repr(d.items[k].first) + ": " + repr(d.items[k].second);
  }
  return out + "}";
}

std::string repr(const Value& v) {
  if (v.is_string()) return string_repr(v.str());
  return to_python_str(v);
}

void json_string(const std::string& s, std::string& out) {
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

void json_value(const Value& v, int indent, bool sort_keys, int level, std::string& out) {
  const auto newline = [&](int lv) {
    out += '\n';
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(lv), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      throw Error("tojson: an undefined value ('" + v.undefined_name() +
                  "') is not JSON serializable");
    case Value::Kind::kCallable:
      throw Error("tojson: a function is not JSON serializable");
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.as_int());
      return;
    case Value::Kind::kFloat: {
      const double f = v.as_float();
      if (std::isnan(f)) out += "NaN";
      else if (std::isinf(f)) out += f < 0 ? "-Infinity" : "Infinity";
      else out += float_repr(f);
      return;
    }
    case Value::Kind::kString:
      json_string(v.str(), out);
      return;
    case Value::Kind::kList: {
      if (v.list_ref().generator) throw Error("tojson: Object of type generator is not JSON serializable");
      const auto& items = v.list_ref().items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (std::size_t k = 0; k < items.size(); ++k) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(level + 1);
        json_value(items[k], indent, sort_keys, level + 1, out);
      }
      if (indent >= 0) newline(level);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      const Dict& d = v.dict_ref();
      // As in Python; and a namespace is the one value that can hold itself.
      if (d.is_namespace) throw Error("tojson: Object of type Namespace is not JSON serializable");
      if (d.items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : d.items) items.push_back(&kv);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (std::size_t k = 0; k < items.size(); ++k) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(level + 1);
        json_string(items[k]->first, out);
        out += ": ";
        json_value(items[k]->second, indent, sort_keys, level + 1, out);
      }
      if (indent >= 0) newline(level);
      out += '}';
      return;
    }
  }
}

}  // namespace

std::string to_python_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.as_int());
    case Value::Kind::kFloat:
      return float_repr(v.as_float());
    case Value::Kind::kString:
      return v.str();
    case Value::Kind::kList:
    case Value::Kind::kDict:
      return container_str(v);
    case Value::Kind::kCallable:
      return "<function>";
  }
  return {};
}

std::string to_json(const Value& v, int indent, bool sort_keys) {
  std::string out;
  json_value(v, indent, sort_keys, 0, out);
  return out;
}

}  // namespace treeattn::jinja
