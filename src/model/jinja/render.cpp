// The renderer: statements, expressions with Python's semantics, filters, tests, globals and
// methods, within Limits.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <set>

#include "model/jinja/ast.hpp"

namespace treeattn::jinja {

NodePtr parse_template_source(std::string_view source, const Limits& limits);

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

class Renderer;

struct Callable {
  std::string name;
  std::function<Value(Renderer&, CallArgs&, const Pos&)> fn;
};

namespace {

// ---- UTF-8 and Python string helpers ------------------------------------------------------

std::size_t cp_len(const std::string& s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size() - i);
}

uint32_t cp_at(const std::string& s, std::size_t i, std::size_t n) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (n == 1) return c;
  uint32_t v = c & (0xff >> (n + 1));
  for (std::size_t k = 1; k < n; ++k) v = (v << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return v;
}

// Byte offsets of each code point, plus the end.
std::vector<std::size_t> cp_offsets(const std::string& s) {
  std::vector<std::size_t> o;
  for (std::size_t i = 0; i < s.size(); i += cp_len(s, i)) o.push_back(i);
  o.push_back(s.size());
  return o;
}

int64_t cp_count(const std::string& s) {
  int64_t n = 0;
  for (std::size_t i = 0; i < s.size(); i += cp_len(s, i)) ++n;
  return n;
}

// Python's str.isspace() characters.
bool py_space(uint32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  std::set<uint32_t> set;
  if (chars)
    for (std::size_t i = 0; i < chars->size(); i += cp_len(*chars, i))
      set.insert(cp_at(*chars, i, cp_len(*chars, i)));
  const auto strip = [&](uint32_t c) { return chars ? set.contains(c) : py_space(c); };
  const auto off = cp_offsets(s);
  std::size_t a = 0, b = off.size() - 1;
  if (left)
    while (a < b && strip(cp_at(s, off[a], off[a + 1] - off[a]))) ++a;
  if (right)
    while (b > a && strip(cp_at(s, off[b - 1], off[b] - off[b - 1]))) --b;
  return s.substr(off[a], off[b] - off[a]);
}

// Python's str.splitlines(): \n, \r, \r\n, \v, \f, \x1c-\x1e, \x85, U+2028, U+2029 end lines.
std::vector<std::string> py_splitlines(const std::string& s) {
  std::vector<std::string> lines;
  std::size_t start = 0, i = 0;
  while (i < s.size()) {
    const std::size_t n = cp_len(s, i);
    const uint32_t c = cp_at(s, i, n);
    const bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || (c >= 0x1c && c <= 0x1e) ||
                     c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) {
      i += n;
      continue;
    }
    lines.push_back(s.substr(start, i - start));
    i += (c == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ? 2 : n;
    start = i;
  }
  if (start < s.size()) lines.push_back(s.substr(start));
  return lines;
}

char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }
bool ascii_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }


// Unicode case mapping for ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic (Python maps
// every script; characters outside these keep their case here).
uint32_t cp_lower(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if ((c >= 0xc0 && c <= 0xde && c != 0xd7)) return c + 32;
  if (c >= 0x100 && c <= 0x137 && c % 2 == 0) return c + 1;
  if (c >= 0x139 && c <= 0x148 && c % 2 == 1) return c + 1;
  if (c >= 0x14a && c <= 0x177 && c % 2 == 0) return c + 1;
  if (c == 0x178) return 0xff;
  if (c == 0x179 || c == 0x17b || c == 0x17d) return c + 1;
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 32;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}
uint32_t cp_upper(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if ((c >= 0xe0 && c <= 0xfe && c != 0xf7)) return c - 32;
  if (c == 0xff) return 0x178;
  if (c == 0xb5) return 0x39c;
  if (c >= 0x101 && c <= 0x137 && c % 2 == 1) return c - 1;
  if (c >= 0x13a && c <= 0x148 && c % 2 == 0) return c - 1;
  if (c >= 0x14b && c <= 0x177 && c % 2 == 1) return c - 1;
  if (c == 0x17a || c == 0x17c || c == 0x17e) return c - 1;
  if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) return c - 32;
  if (c == 0x3c2) return 0x3a3;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}
bool cp_cased(uint32_t c) { return cp_lower(c) != c || cp_upper(c) != c || c == 0xdf; }

enum class Case { kUpper, kLower, kTitle, kCapitalize };

std::string py_case(const std::string& s, Case mode) {
  std::string r;
  r.reserve(s.size());
  bool prev_cased = false;
  bool first = true;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = cp_len(s, i);
    const uint32_t c = cp_at(s, i, n);
    bool up = false;
    switch (mode) {
      case Case::kUpper: up = true; break;
      case Case::kLower: up = false; break;
      case Case::kTitle: up = !prev_cased; break;
      case Case::kCapitalize: up = first; break;
    }
    if (c == 0xdf && up) {
      r += mode == Case::kUpper ? "SS" : "Ss";  // ß
    } else if (n == 1 && c >= 0x80) {
      r += s[i];  // a stray byte: kept
    } else {
      append_utf8(r, up ? cp_upper(c) : cp_lower(c));
    }
    prev_cased = cp_cased(c);
    first = false;
    i += n;
  }
  return r;
}


std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count, std::size_t limit) {
  std::string r;
  if (from.empty()) {
    // Python inserts `to` around every code point.
    const auto off = cp_offsets(s);
    int64_t done = 0;
    for (std::size_t k = 0; k + 1 < off.size(); ++k) {
      if (count < 0 || done < count) {
        r += to;
        ++done;
      }
      r.append(s, off[k], off[k + 1] - off[k]);
      if (r.size() > limit) throw Error("replace: the result is longer than the output limit");
    }
    if (count < 0 || done < count) r += to;
    return r;
  }
  std::size_t pos = 0;
  int64_t done = 0;
  for (std::size_t at; (count < 0 || done < count) && (at = s.find(from, pos)) != std::string::npos;
       ++done) {
    r.append(s, pos, at - pos);
    r += to;
    pos = at + from.size();
    if (r.size() > limit) throw Error("replace: the result is longer than the output limit");
  }
  r.append(s, pos);
  return r;
}

const char* kind_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kList: return v.list_ref().tuple ? "tuple" : "list";
    case Value::Kind::kDict: return v.dict_ref().is_namespace ? "Namespace" : "dict";
    case Value::Kind::kCallable: return "function";
  }
  return "?";
}

bool has_data(const Value& v) {
  if (v.is_string()) return !v.ranges().empty();
  if (v.is_list()) {
    for (const Value& x : v.list_ref().items)
      if (has_data(x)) return true;
  } else if (v.is_dict() && !v.dict_ref().is_namespace) {
    if (v.dict_ref().data_keys && !v.dict_ref().items.empty()) return true;
    for (const auto& kv : v.dict_ref().items)
      if (has_data(kv.second)) return true;
  }
  return false;
}

// A string computed from inputs: data as a whole when any input carried data.
Value derived(std::string s, bool data) { return Value::string(std::move(s), data); }

bool is_numeric(const Value& v) {
  return v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kFloat ||
         v.kind() == Value::Kind::kBool;
}
bool is_integral(const Value& v) {
  return v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool;
}
int64_t int_of(const Value& v) {
  return v.kind() == Value::Kind::kBool ? (v.as_bool() ? 1 : 0) : v.as_int();
}
double float_of(const Value& v) {
  return v.kind() == Value::Kind::kFloat ? v.as_float() : static_cast<double>(int_of(v));
}

bool equals(const Value& a, const Value& b) {
  if (is_numeric(a) && is_numeric(b)) {
    if (is_integral(a) && is_integral(b)) return int_of(a) == int_of(b);
    return float_of(a) == float_of(b);
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.str() == b.str();
    case Value::Kind::kList: {
      const auto& x = a.list_ref();
      const auto& y = b.list_ref();
      if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
      for (std::size_t k = 0; k < x.items.size(); ++k)
        if (!equals(x.items[k], y.items[k])) return false;
      return true;
    }
    case Value::Kind::kDict: {
      const auto& x = a.dict_ref();
      const auto& y = b.dict_ref();
      if (x.is_namespace || y.is_namespace) return &x == &y;
      if (x.items.size() != y.items.size()) return false;
      for (const auto& kv : x.items) {
        const Value* o = y.find(kv.first);
        if (!o || !equals(kv.second, *o)) return false;
      }
      return true;
    }
    case Value::Kind::kCallable:
      return &a.callable_ref() == &b.callable_ref();
    default:
      return false;
  }
}

// -1, 0, 1; Error for types Python does not order.
int compare(const Value& a, const Value& b, const std::string& op) {
  if (is_numeric(a) && is_numeric(b)) {
    if (is_integral(a) && is_integral(b)) {
      const int64_t x = int_of(a), y = int_of(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    const double x = float_of(a), y = float_of(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.str().compare(b.str());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_list() && b.is_list() && a.list_ref().tuple == b.list_ref().tuple) {
    const auto& x = a.list_ref().items;
    const auto& y = b.list_ref().items;
    for (std::size_t k = 0; k < std::min(x.size(), y.size()); ++k) {
      if (equals(x[k], y[k])) continue;
      return compare(x[k], y[k], op);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  throw Error("'" + op + "' is not supported between instances of '" + kind_name(a) + "' and '" +
              kind_name(b) + "'");
}

const Value* kwarg(CallArgs& a, std::string_view name) {
  for (auto& kv : a.kw)
    if (kv.first == name) return &kv.second;
  return nullptr;
}

// Argument `i` by position or `name` by keyword; null when neither was given.
const Value* arg(CallArgs& a, std::size_t i, std::string_view name) {
  if (i < a.pos.size()) return &a.pos[i];
  return kwarg(a, name);
}

}  // namespace

// ---- the renderer ---------------------------------------------------------------------------

struct Scope {
  std::map<std::string, Value, std::less<>> vars;
  const Scope* parent = nullptr;
  const Value* find(std::string_view name) const {
    for (const Scope* s = this; s; s = s->parent) {
      const auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

struct Out {
  std::string text;
  std::vector<Range> ranges;
};

class Renderer {
 public:
  Renderer(const Limits& limits, const std::map<std::string, Value, std::less<>>& vars)
      : limits_(limits) {
    install_globals();
    for (const auto& [k, v] : vars) root_.vars[k] = v;
  }
  ~Renderer() {
    // Namespaces may hold themselves (`set ns.x = ns`): break such cycles.
    for (auto& d : namespaces_) d.second->items.clear();
  }

  RenderOutput run(const Node& root) {
    Out out;
    const Flow f = exec(root, root_, out);
    if (f != Flow::kNormal) throw Error("'break' or 'continue' outside a for loop");
    return {std::move(out.text), std::move(out.ranges)};
  }

  enum class Flow { kNormal, kBreak, kContinue };

  // ---- output ----
  void emit(Out& out, const std::string& s, const std::vector<Range>& ranges, const Pos& p) {
    if (out.text.size() + s.size() > limits_.max_output)
      fail("the output is longer than " + std::to_string(limits_.max_output) + " bytes", p);
    const auto base = static_cast<uint32_t>(out.text.size());
    for (const Range& r : ranges) add_range(out.ranges, {base + r.first, base + r.second});
    out.text += s;
  }
  static void add_range(std::vector<Range>& v, Range r) {
    if (r.first == r.second) return;
    if (!v.empty() && v.back().second == r.first)
      v.back().second = r.second;
    else
      v.push_back(r);
  }
  void emit_value(Out& out, const Value& v, const Pos& p) {
    if (v.is_string()) {
      emit(out, v.str(), v.ranges(), p);
      return;
    }
    const std::string s = to_python_str(v);
    std::vector<Range> r;
    if (has_data(v) && !s.empty()) r.push_back({0u, static_cast<uint32_t>(s.size())});
    emit(out, s, r, p);
  }

  Value to_string_value(const Value& v) {
    if (v.is_string()) return v;
    return derived(to_python_str(v), has_data(v));
  }

  Value concat(const Value& a, const Value& b, const Pos& p) {
    const std::string& x = a.str();
    const std::string& y = b.str();
    if (x.size() + y.size() > limits_.max_output)
      fail("a string is longer than " + std::to_string(limits_.max_output) + " bytes", p);
    std::vector<Range> r = a.ranges();
    const auto base = static_cast<uint32_t>(x.size());
    for (const Range& q : b.ranges()) add_range(r, {base + q.first, base + q.second});
    return Value::string(x + y, std::move(r));
  }

  [[noreturn]] void fail(const std::string& msg, const Pos& p) const {
    throw Error(msg, p.line, p.column);
  }

  void count_iteration(const Pos& p) {
    if (++iterations_ > limits_.max_iterations)
      fail("the template ran more than " + std::to_string(limits_.max_iterations) +
               " loop iterations",
           p);
  }

  // ---- statements ----
  Flow exec(const Node& n, Scope& scope, Out& out) {
    switch (n.kind) {
      case Node::Kind::kBody:
        for (const NodePtr& c : n.children) {
          const Flow f = exec(*c, scope, out);
          if (f != Flow::kNormal) return f;
        }
        return Flow::kNormal;
      case Node::Kind::kText:
        emit(out, n.text, {}, n.pos);
        return Flow::kNormal;
      case Node::Kind::kOutput:
        emit_value(out, eval(*n.expr, scope), n.pos);
        return Flow::kNormal;
      case Node::Kind::kIf:
        for (std::size_t k = 0; k < n.conds.size(); ++k)
          if (eval(*n.conds[k], scope).truthy()) return exec(*n.bodies[k], scope, out);
        if (n.bodies.size() > n.conds.size()) return exec(*n.bodies.back(), scope, out);
        return Flow::kNormal;
      case Node::Kind::kFor:
        exec_for(n, scope, out);
        return Flow::kNormal;
      case Node::Kind::kSet: {
        Value v;
        if (n.block) {
          Out captured;
          const Flow f = exec(*n.bodies[0], scope, captured);
          v = Value::string(std::move(captured.text), std::move(captured.ranges));
          if (f != Flow::kNormal) {
            assign(n, scope, v);
            return f;
          }
        } else {
          v = eval(*n.expr, scope);
        }
        assign(n, scope, v);
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        scope.vars[n.name] = make_macro(n, scope);
        return Flow::kNormal;
      case Node::Kind::kCallBlock: {
        // caller(): the block's body as a macro, passed to the called macro.
        const Expr& call = *n.expr;
        Value callee = eval(*call.children[0], scope);
        CallArgs args = eval_args(call, scope);
        auto caller = std::make_shared<Callable>();
        const Node* node = &n;
        auto defining = capture(scope);
        caller->name = "caller";
        caller->fn = [node, defining](Renderer& r, CallArgs& a, const Pos& p) {
          return r.call_macro_body(*node, *node->bodies[0], defining ? *defining : r.root_, a, p,
                                   Value());
        };
        args.kw.emplace_back("caller", Value::callable(caller));
        emit_value(out, call_value(callee, args, call.pos), n.pos);
        return Flow::kNormal;
      }
      case Node::Kind::kFilterBlock: {
        Out captured;
        const Flow f = exec(*n.bodies[0], scope, captured);
        Scope s;
        s.parent = &scope;
        s.vars[kBlockInput] = Value::string(std::move(captured.text), std::move(captured.ranges));
        emit_value(out, eval(*n.expr, s), n.pos);
        return f;
      }
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void assign(const Node& n, Scope& scope, const Value& v) {
    if (!n.attr.empty()) {
      const Value* ns = scope.find(n.targets[0]);
      if (!ns || !ns->is_dict() || !ns->dict_ref().is_namespace)
        fail("cannot assign attribute '" + n.attr + "' on '" + n.targets[0] +
                 "': it is not a namespace()",
             n.pos);
      ns->dict_mut().set(n.attr, v);
      return;
    }
    bind_targets(n.targets, v, scope, n.pos);
  }

  void bind_targets(const std::vector<std::string>& targets, const Value& v, Scope& scope,
                    const Pos& p) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = v;
      return;
    }
    std::vector<Value> items = iterate(v, p);
    if (items.size() != targets.size())
      fail("cannot unpack " + std::to_string(items.size()) + " values into " +
               std::to_string(targets.size()) + " names",
           p);
    for (std::size_t k = 0; k < targets.size(); ++k) scope.vars[targets[k]] = items[k];
  }

  void exec_for(const Node& n, Scope& scope, Out& out) {
    const Value seq = eval(*n.expr, scope);
    std::vector<Value> items = iterate(seq, n.expr->pos);
    if (n.cond) {
      std::vector<Value> kept;
      for (Value& x : items) {
        count_iteration(n.pos);
        Scope s;
        s.parent = &scope;
        bind_targets(n.targets, x, s, n.pos);
        if (eval(*n.cond, s).truthy()) kept.push_back(std::move(x));
      }
      items.swap(kept);
    }
    if (items.empty()) {
      if (n.bodies.size() > 1) exec(*n.bodies[1], scope, out);
      return;
    }
    const auto len = static_cast<int64_t>(items.size());
    auto cycle = std::make_shared<Callable>();
    cycle->name = "loop.cycle";
    auto index = std::make_shared<int64_t>(0);
    cycle->fn = [index](Renderer& r, CallArgs& a, const Pos& p) {
      if (a.pos.empty()) r.fail("loop.cycle() needs at least one value", p);
      return a.pos[static_cast<std::size_t>(*index) % a.pos.size()];
    };
    const Value cycle_value = Value::callable(cycle);
    // One loop object whose fields change as the loop goes on (jinja2's LoopContext is one
    // object too).
    Value loop = Value::dict();
    Dict& d = loop.dict_mut();
    for (const char* k : {"index", "index0", "revindex", "revindex0", "first", "last", "length",
                          "depth", "depth0", "previtem", "nextitem", "cycle"})
      d.set(k, Value());
    d.items[6].second = Value::integer(len);
    d.items[7].second = Value::integer(1);
    d.items[8].second = Value::integer(0);
    d.items[11].second = cycle_value;
    for (int64_t i = 0; i < len; ++i) {
      count_iteration(n.pos);
      *index = i;
      Scope s;
      s.parent = &scope;
      bind_targets(n.targets, items[static_cast<std::size_t>(i)], s, n.pos);
      d.items[0].second = Value::integer(i + 1);
      d.items[1].second = Value::integer(i);
      d.items[2].second = Value::integer(len - i);
      d.items[3].second = Value::integer(len - i - 1);
      d.items[4].second = Value::boolean(i == 0);
      d.items[5].second = Value::boolean(i == len - 1);
      d.items[9].second =
          i > 0 ? items[static_cast<std::size_t>(i - 1)] : Value::undefined("loop.previtem");
      d.items[10].second =
          i + 1 < len ? items[static_cast<std::size_t>(i + 1)] : Value::undefined("loop.nextitem");
      d.depth = 1 + std::max(value_depth(d.items[9].second), value_depth(d.items[10].second));
      if (d.depth > kMaxValueDepth)
        fail("loop.previtem or loop.nextitem nests deeper than " +
                 std::to_string(kMaxValueDepth) + " levels",
             n.pos);
      s.vars["loop"] = loop;
      const Flow f = exec(*n.bodies[0], s, out);
      if (f == Flow::kBreak) break;
    }
  }

  // The items a for loop (or list()) visits: a list's items, a dict's keys, a string's
  // characters; undefined is empty.
  std::vector<Value> iterate(const Value& v, const Pos& p) {
    switch (v.kind()) {
      case Value::Kind::kUndefined:
        return {};
      case Value::Kind::kList:
        return v.list_ref().items;
      case Value::Kind::kDict: {
        if (v.dict_ref().is_namespace) fail("a namespace() is not iterable", p);
        std::vector<Value> keys;
        for (const auto& kv : v.dict_ref().items)
          keys.push_back(Value::string(kv.first, v.dict_ref().data_keys));
        return keys;
      }
      case Value::Kind::kString: {
        std::vector<Value> chars;
        const std::string& s = v.str();
        const bool data = !v.ranges().empty();
        for (std::size_t i = 0; i < s.size(); i += cp_len(s, i))
          chars.push_back(derived(s.substr(i, cp_len(s, i)), data));
        return chars;
      }
      default:
        fail(std::string("'") + kind_name(v) + "' object is not iterable", p);
    }
  }

  // ---- macros ----
  // The scope a macro (or a call block's caller) sees: the template's own (null: read at call
  // time) or, inside loops and macros, a copy of the variables visible where it was defined
  // (the callable may outlive that scope).
  std::shared_ptr<const Scope> capture(const Scope& scope) {
    if (&scope == &root_) return nullptr;
    auto snap = std::make_shared<Scope>();
    for (const Scope* s = &scope; s && s != &root_; s = s->parent)
      for (const auto& [k, v] : s->vars) snap->vars.emplace(k, v);  // inner names first
    snap->parent = &root_;
    return snap;
  }

  Value make_macro(const Node& n, Scope& scope) {
    auto c = std::make_shared<Callable>();
    c->name = n.name;
    const Node* node = &n;
    auto defining = capture(scope);
    c->fn = [node, defining](Renderer& r, CallArgs& a, const Pos& p) {
      Value caller;
      for (auto it = a.kw.begin(); it != a.kw.end(); ++it)
        if (it->first == "caller") {
          caller = it->second;
          a.kw.erase(it);
          break;
        }
      return r.call_macro_body(*node, *node->bodies[0], defining ? *defining : r.root_, a, p,
                               caller);
    };
    return Value::callable(c);
  }

  Value call_macro_body(const Node& def, const Node& body, const Scope& defining, CallArgs& a,
                        const Pos& p, const Value& caller) {
    if (++call_depth_ > limits_.max_depth) {
      --call_depth_;
      fail("macro calls nest deeper than " + std::to_string(limits_.max_depth) + " levels", p);
    }
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{call_depth_};
    Scope s;
    // A macro sees the variables of the scope it was defined in (the template's, for top-level
    // macros) as they are when it is called.
    s.parent = &defining;
    const std::string name = def.kind == Node::Kind::kMacro ? def.name : "caller";
    if (a.pos.size() > def.params.size())
      fail("macro '" + name + "' takes not more than " + std::to_string(def.params.size()) +
               " argument(s)",
           p);
    for (std::size_t k = 0; k < def.params.size(); ++k) {
      const MacroParam& prm = def.params[k];
      if (k < a.pos.size()) {
        s.vars[prm.name] = a.pos[k];
      } else if (const Value* v = kwarg(a, prm.name)) {
        s.vars[prm.name] = *v;
      } else if (prm.default_value) {
        s.vars[prm.name] = eval(*prm.default_value, s);
      } else {
        s.vars[prm.name] = Value::undefined(prm.name);
      }
    }
    for (const auto& kv : a.kw) {
      bool known = false;
      for (const MacroParam& prm : def.params) known = known || prm.name == kv.first;
      if (!known) fail("macro '" + name + "' takes no keyword argument '" + kv.first + "'", p);
    }
    if (!caller.is_undefined()) s.vars["caller"] = caller;
    Out out;
    const Flow f = exec(body, s, out);
    if (f != Flow::kNormal) fail("'break' or 'continue' outside a for loop", p);
    return Value::string(std::move(out.text), std::move(out.ranges));
  }

  Value call_value(const Value& callee, CallArgs& args, const Pos& p) {
    if (callee.is_undefined())
      fail("'" + callee.undefined_name() + "' is undefined (not a function)", p);
    if (callee.kind() != Value::Kind::kCallable)
      fail(std::string("'") + kind_name(callee) + "' object is not callable", p);
    return callee.callable_ref().fn(*this, args, p);
  }

  // ---- expressions ----
  CallArgs eval_args(const Expr& e, Scope& scope) {
    CallArgs a;
    for (const Arg& x : e.args) {
      if (x.name.empty())
        a.pos.push_back(eval(*x.value, scope));
      else
        a.kw.emplace_back(x.name, eval(*x.value, scope));
    }
    return a;
  }

  Value eval(const Expr& e, Scope& scope) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.value;
      case Expr::Kind::kName: {
        const Value* v = scope.find(e.name);
        return v ? *v : Value::undefined(e.name);
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        for (const ExprPtr& c : e.children) items.push_back(eval(*c, scope));
        return Value::list(std::move(items), e.kind == Expr::Kind::kTuple);
      }
      case Expr::Kind::kDict: {
        Value d = Value::dict();
        for (std::size_t k = 0; k + 1 < e.children.size(); k += 2) {
          const Value key = eval(*e.children[k], scope);
          if (!key.is_string())
            fail(std::string("dict keys must be strings here, not '") + kind_name(key) + "'",
                 e.children[k]->pos);
          d.dict_mut().set(key.str(), eval(*e.children[k + 1], scope));
        }
        return d;
      }
      case Expr::Kind::kAttr:
        return get_attr(eval(*e.children[0], scope), e.name, e, scope);
      case Expr::Kind::kItem:
        return get_item(eval(*e.children[0], scope), eval(*e.children[1], scope), e);
      case Expr::Kind::kSlice:
        return slice(e, scope);
      case Expr::Kind::kCall: {
        const Value callee = eval(*e.children[0], scope);
        CallArgs args = eval_args(e, scope);
        return call_value(callee, args, e.pos);
      }
      case Expr::Kind::kFilter:
        return apply_filter(e, scope);
      case Expr::Kind::kTest: {
        const bool r = apply_test(e, scope);
        return Value::boolean(e.negate ? !r : r);
      }
      case Expr::Kind::kUnary: {
        const Value v = eval(*e.children[0], scope);
        if (e.name == "not") return Value::boolean(!v.truthy());
        require_defined(v, e.pos);
        if (v.kind() == Value::Kind::kFloat)
          return Value::number(e.name == "-" ? -v.as_float() : v.as_float());
        if (is_integral(v)) {
          const int64_t x = int_of(v);
          if (e.name == "-" && x == INT64_MIN) fail("integer overflow", e.pos);
          return Value::integer(e.name == "-" ? -x : x);
        }
        fail(std::string("bad operand type for unary ") + e.name + ": '" + kind_name(v) + "'",
             e.pos);
      }
      case Expr::Kind::kBinary:
        return binary(e, scope);
      case Expr::Kind::kCondition:
        if (eval(*e.children[0], scope).truthy()) return eval(*e.children[1], scope);
        if (e.children[2]) return eval(*e.children[2], scope);
        return Value::undefined("the inline if's else");
    }
    return Value();
  }

  void require_defined(const Value& v, const Pos& p) {
    if (v.is_undefined()) fail("'" + v.undefined_name() + "' is undefined", p);
  }

  Value binary(const Expr& e, Scope& scope) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = eval(*e.children[0], scope);
      return a.truthy() ? eval(*e.children[1], scope) : a;
    }
    if (op == "or") {
      Value a = eval(*e.children[0], scope);
      return a.truthy() ? a : eval(*e.children[1], scope);
    }
    const Value a = eval(*e.children[0], scope);
    const Value b = eval(*e.children[1], scope);
    if (op == "==") return Value::boolean(equals(a, b));
    if (op == "!=") return Value::boolean(!equals(a, b));
    if (op == "~") return concat(to_string_value(a), to_string_value(b), e.pos);
    if (op == "in" || op == "not in") {
      const bool r = contains(b, a, e.pos);
      return Value::boolean(op == "in" ? r : !r);
    }
    require_defined(a, e.children[0]->pos);
    require_defined(b, e.children[1]->pos);
    try {
      if (op == "<") return Value::boolean(compare(a, b, op) < 0);
      if (op == "<=") return Value::boolean(compare(a, b, op) <= 0);
      if (op == ">") return Value::boolean(compare(a, b, op) > 0);
      if (op == ">=") return Value::boolean(compare(a, b, op) >= 0);
    } catch (const Error& err) {
      fail(err.what_only(), e.pos);
    }
    return arithmetic(op, a, b, e.pos);
  }

  Value arithmetic(const std::string& op, const Value& a, const Value& b, const Pos& p) {
    const auto unsupported = [&]() -> Value {
      fail("unsupported operand types for " + op + ": '" + kind_name(a) + "' and '" +
               kind_name(b) + "'",
           p);
    };
    if (op == "+") {
      if (a.is_string() && b.is_string()) {
        if (a.is_markup() == b.is_markup()) {
          Value r = concat(a, b, p);
          return a.is_markup() ? Value::markup(r) : r;
        }
        // Markup + str (or str + Markup): the plain string is HTML-escaped, the result is Markup.
        CallArgs none;
        const Value x = a.is_markup() ? a : filter("escape", a, none, p);
        const Value y = b.is_markup() ? b : filter("escape", b, none, p);
        return Value::markup(concat(x, y, p));
      }
      if (a.is_list() && b.is_list() && a.list_ref().tuple == b.list_ref().tuple) {
        std::vector<Value> items = a.list_ref().items;
        if (items.size() + b.list_ref().items.size() > limits_.max_output)
          fail("a list is longer than the output limit", p);
        items.insert(items.end(), b.list_ref().items.begin(), b.list_ref().items.end());
        return Value::list(std::move(items), a.list_ref().tuple);
      }
    }
    if (op == "*") {
      const Value* seq = a.is_string() || a.is_list() ? &a : b.is_string() || b.is_list() ? &b : nullptr;
      const Value* num = seq == &a ? &b : &a;
      if (seq && is_integral(*num)) {
        const int64_t n = std::max<int64_t>(0, int_of(*num));
        const std::size_t unit = seq->is_string() ? seq->str().size() : seq->list_ref().items.size();
        if (unit > 0 && static_cast<uint64_t>(n) > limits_.max_output / unit)
          fail("the repeated value is longer than the output limit", p);
        if (seq->is_string()) {
          std::string r;
          for (int64_t k = 0; k < n; ++k) r += seq->str();
          return derived(std::move(r), has_data(*seq));
        }
        std::vector<Value> items;
        for (int64_t k = 0; k < n; ++k)
          items.insert(items.end(), seq->list_ref().items.begin(), seq->list_ref().items.end());
        return Value::list(std::move(items), seq->list_ref().tuple);
      }
    }
    if (!is_numeric(a) || !is_numeric(b)) return unsupported();
    const bool ints = is_integral(a) && is_integral(b);
    if (op == "/") {
      if (float_of(b) == 0) fail("division by zero", p);
      return Value::number(float_of(a) / float_of(b));
    }
    if (ints) {
      const int64_t x = int_of(a), y = int_of(b);
      int64_t r = 0;
      if (op == "+") {
        if (__builtin_add_overflow(x, y, &r)) fail("integer overflow", p);
        return Value::integer(r);
      }
      if (op == "-") {
        if (__builtin_sub_overflow(x, y, &r)) fail("integer overflow", p);
        return Value::integer(r);
      }
      if (op == "*") {
        if (__builtin_mul_overflow(x, y, &r)) fail("integer overflow", p);
        return Value::integer(r);
      }
      if (op == "//" || op == "%") {
        if (y == 0) fail("integer division or modulo by zero", p);
        if (x == INT64_MIN && y == -1) fail("integer overflow", p);
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --q;
          m += y;
        }
        return Value::integer(op == "//" ? q : m);
      }
      if (op == "**") {
        if (y < 0) return Value::number(std::pow(static_cast<double>(x), static_cast<double>(y)));
        if (x == 0 || x == 1) return Value::integer(y == 0 ? 1 : x);
        if (x == -1) return Value::integer(y % 2 == 0 ? 1 : -1);
        int64_t acc = 1;
        for (int64_t k = 0; k < y; ++k) {
          if (__builtin_mul_overflow(acc, x, &acc)) fail("integer overflow", p);
        }
        return Value::integer(acc);
      }
    }
    const double x = float_of(a), y = float_of(b);
    if (op == "+") return Value::number(x + y);
    if (op == "-") return Value::number(x - y);
    if (op == "*") return Value::number(x * y);
    if (op == "//" || op == "%") {
      if (y == 0) fail("float division or modulo by zero", p);
      double m = std::fmod(x, y);
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return Value::number(op == "%" ? m : std::floor((x - m) / y + 0.5));
    }
    if (op == "**") return Value::number(std::pow(x, y));
    return unsupported();
  }

  bool contains(const Value& container, const Value& item, const Pos& p) {
    switch (container.kind()) {
      case Value::Kind::kString:
        if (!item.is_string())
          fail(std::string("'in <string>' requires a string as left operand, not '") +
                   kind_name(item) + "'",
               p);
        return container.str().find(item.str()) != std::string::npos;
      case Value::Kind::kList:
        for (const Value& x : container.list_ref().items)
          if (equals(x, item)) return true;
        return false;
      case Value::Kind::kDict:
        return item.is_string() && container.dict_ref().find(item.str()) != nullptr;
      case Value::Kind::kUndefined:
        return false;  // jinja2's Undefined iterates as empty
      default:
        fail(std::string("argument of type '") + kind_name(container) + "' is not iterable", p);
    }
  }

  // obj.name: an attribute (method) first, then an item (jinja2's getattr).
  Value get_attr(const Value& obj, const std::string& name, const Expr& e, Scope&) {
    if (obj.is_undefined())
      fail("'" + obj.undefined_name() + "' is undefined (reading its attribute '" + name + "')",
           e.pos);
    if (Value m = method(obj, name); !m.is_undefined()) return m;
    if (obj.is_dict()) {
      const Value* v = obj.dict_ref().find(name);
      if (v) return *v;
    }
    return Value::undefined(name);
  }

  // obj[key]: an item first, then an attribute (jinja2's getitem).
  Value get_item(const Value& obj, const Value& key, const Expr& e) {
    if (obj.is_undefined())
      fail("'" + obj.undefined_name() + "' is undefined (reading an item of it)", e.pos);
    if (obj.is_dict()) {
      if (key.is_string()) {
        if (const Value* v = obj.dict_ref().find(key.str())) return *v;
        if (Value m = method(obj, key.str()); !m.is_undefined()) return m;
        return Value::undefined(key.str());
      }
      return Value::undefined(to_python_str(key));
    }
    if (obj.is_list() && obj.list_ref().generator)
      fail("'generator' object is not subscriptable (add '| list')", e.pos);
    if ((obj.is_list() || obj.is_string()) && is_integral(key)) {
      int64_t i = int_of(key);
      if (obj.is_list()) {
        const auto n = static_cast<int64_t>(obj.list_ref().items.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undefined("index " + std::to_string(int_of(key)));
        return obj.list_ref().items[static_cast<std::size_t>(i)];
      }
      const auto off = cp_offsets(obj.str());
      const auto n = static_cast<int64_t>(off.size() - 1);
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined("index " + std::to_string(int_of(key)));
      const auto k = static_cast<std::size_t>(i);
      return derived(obj.str().substr(off[k], off[k + 1] - off[k]), has_data(obj));
    }
    if (key.is_string()) {
      if (Value m = method(obj, key.str()); !m.is_undefined()) return m;
    }
    return Value::undefined(to_python_str(key));
  }

  Value slice(const Expr& e, Scope& scope) {
    const Value obj = eval(*e.children[0], scope);
    require_defined(obj, e.pos);
    std::optional<int64_t> parts[3];
    for (int k = 0; k < 3; ++k) {
      if (!e.children[k + 1]) continue;
      const Value v = eval(*e.children[k + 1], scope);
      if (v.is_none()) continue;
      if (!is_integral(v)) fail("slice indices must be integers or None", e.children[k + 1]->pos);
      parts[k] = int_of(v);
    }
    const int64_t step = parts[2].value_or(1);
    if (step == 0) fail("slice step cannot be zero", e.pos);
    std::vector<std::size_t> off;
    int64_t n;
    if (obj.is_string()) {
      off = cp_offsets(obj.str());
      n = static_cast<int64_t>(off.size() - 1);
    } else if (obj.is_list()) {
      n = static_cast<int64_t>(obj.list_ref().items.size());
    } else {
      fail(std::string("'") + kind_name(obj) + "' object is not subscriptable", e.pos);
    }
    // Python's slice.indices.
    const auto adjust = [&](std::optional<int64_t> v, int64_t dflt, bool stop) -> int64_t {
      if (!v) return dflt;
      int64_t x = *v;
      if (x < 0) x += n;
      if (step > 0) return std::clamp<int64_t>(x, 0, n);
      (void)stop;
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t start = adjust(parts[0], step > 0 ? 0 : n - 1, false);
    const int64_t stop = adjust(parts[1], step > 0 ? n : -1, true);
    std::vector<int64_t> idx;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) idx.push_back(i);
    if (obj.is_string()) {
      std::string r;
      for (int64_t i : idx) {
        const auto k = static_cast<std::size_t>(i);
        r.append(obj.str(), off[k], off[k + 1] - off[k]);
      }
      return derived(std::move(r), has_data(obj));
    }
    std::vector<Value> items;
    for (int64_t i : idx) items.push_back(obj.list_ref().items[static_cast<std::size_t>(i)]);
    return Value::list(std::move(items), obj.list_ref().tuple);
  }

  static Value generator(std::vector<Value> items) {
    Value v = Value::list(std::move(items));
    v.list_mut().generator = true;
    return v;
  }

  static Value bound(std::string name, std::function<Value(Renderer&, CallArgs&, const Pos&)> f) {
    auto c = std::make_shared<Callable>();
    c->name = std::move(name);
    c->fn = std::move(f);
    return Value::callable(c);
  }

  std::string str_arg(CallArgs& a, std::size_t i, std::string_view name, const std::string& fn,
                      const Pos& p) {
    const Value* v = arg(a, i, name);
    if (!v || !v->is_string())
      fail(fn + ": argument '" + std::string(name) + "' must be a string", p);
    return v->str();
  }

  // Python methods of strings, dicts and lists (read-only: the sandbox is immutable).
  Value method(const Value& obj, const std::string& name) {
    if (obj.is_string()) {
      const Value self = obj;
      const bool data = has_data(obj);
      const std::string fn = "str." + name;
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        return bound(fn, [self, data, name](Renderer&, CallArgs& a, const Pos&) {
          const Value* c = arg(a, 0, "chars");
          const std::string* chars = c && c->is_string() ? &c->str() : nullptr;
          return derived(py_strip(self.str(), chars, name != "rstrip", name != "lstrip"), data);
        });
      }
      if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
        return bound(fn, [self, data, name](Renderer&, CallArgs&, const Pos&) {
          std::string s = self.str();
          s = py_case(s, name == "upper"  ? Case::kUpper
                         : name == "lower" ? Case::kLower
                         : name == "title" ? Case::kTitle
                                           : Case::kCapitalize);
          return derived(std::move(s), data);
        });
      }
      if (name == "startswith" || name == "endswith") {
        return bound(fn, [self, name](Renderer& r, CallArgs& a, const Pos& p) {
          const Value* v = arg(a, 0, "prefix");
          if (!v) r.fail("str." + name + " needs an argument", p);
          std::vector<std::string> opts;
          if (v->is_string()) {
            opts.push_back(v->str());
          } else if (v->is_list()) {
            for (const Value& x : v->list_ref().items) {
              if (!x.is_string()) r.fail("str." + name + ": a tuple of strings is needed", p);
              opts.push_back(x.str());
            }
          } else {
            r.fail("str." + name + ": the argument must be a string or a tuple of strings", p);
          }
          const std::string& s = self.str();
          for (const std::string& o : opts) {
            if (name == "startswith" ? s.starts_with(o) : s.ends_with(o))
              return Value::boolean(true);
          }
          return Value::boolean(false);
        });
      }
      if (name == "split" || name == "rsplit") {
        return bound(fn, [self, data, name](Renderer& r, CallArgs& a, const Pos& p) {
          const Value* sep = arg(a, 0, "sep");
          const Value* maxv = arg(a, 1, "maxsplit");
          int64_t maxsplit = maxv && is_integral(*maxv) ? int_of(*maxv) : -1;
          const std::string& s = self.str();
          std::vector<std::string> parts;
          if (!sep || sep->is_none()) {
            // Runs of whitespace; no empty parts.
            const auto off = cp_offsets(s);
            std::vector<std::pair<std::size_t, std::size_t>> words;
            std::size_t k = 0;
            const std::size_t n = off.size() - 1;
            const auto space = [&](std::size_t i) {
              return py_space(cp_at(s, off[i], off[i + 1] - off[i]));
            };
            while (k < n) {
              while (k < n && space(k)) ++k;
              if (k >= n) break;
              std::size_t e = k;
              while (e < n && !space(e)) ++e;
              words.push_back({off[k], off[e]});
              k = e;
            }
            if (name == "rsplit" && maxsplit >= 0 &&
                static_cast<int64_t>(words.size()) > maxsplit + 1) {
              const std::size_t keep = words.size() - static_cast<std::size_t>(maxsplit);
              std::string head = py_strip(s.substr(0, words[keep - 1].second), nullptr, true, false);
              parts.push_back(head);
              for (std::size_t w = keep; w < words.size(); ++w)
                parts.push_back(s.substr(words[w].first, words[w].second - words[w].first));
            } else {
              for (std::size_t w = 0; w < words.size(); ++w) {
                if (maxsplit >= 0 && static_cast<int64_t>(w) == maxsplit) {
                  parts.push_back(py_strip(s.substr(words[w].first), nullptr, false, true));
                  break;
                }
                parts.push_back(s.substr(words[w].first, words[w].second - words[w].first));
              }
            }
          } else {
            if (!sep->is_string()) r.fail("str." + name + ": sep must be a string", p);
            const std::string& d = sep->str();
            if (d.empty()) r.fail("str." + name + ": empty separator", p);
            if (name == "split") {
              std::size_t pos = 0;
              int64_t done = 0;
              for (std::size_t at;
                   (maxsplit < 0 || done < maxsplit) && (at = s.find(d, pos)) != std::string::npos;
                   ++done) {
                parts.push_back(s.substr(pos, at - pos));
                pos = at + d.size();
              }
              parts.push_back(s.substr(pos));
            } else {
              std::size_t end = s.size();
              int64_t done = 0;
              std::vector<std::string> rev;
              while (maxsplit < 0 || done < maxsplit) {
                if (end < d.size()) break;
                const std::size_t at = s.rfind(d, end - d.size());
                if (at == std::string::npos) break;
                rev.push_back(s.substr(at + d.size(), end - at - d.size()));
                end = at;
                ++done;
              }
              rev.push_back(s.substr(0, end));
              parts.assign(rev.rbegin(), rev.rend());
            }
          }
          std::vector<Value> items;
          for (std::string& x : parts) items.push_back(derived(std::move(x), data));
          return Value::list(std::move(items));
        });
      }
      if (name == "replace") {
        return bound(fn, [self, data](Renderer& r, CallArgs& a, const Pos& p) {
          const std::string from = r.str_arg(a, 0, "old", "str.replace", p);
          const std::string to = r.str_arg(a, 1, "new", "str.replace", p);
          const Value* c = arg(a, 2, "count");
          return derived(replace_all(self.str(), from, to, c && is_integral(*c) ? int_of(*c) : -1,
                                     r.limits_.max_output),
                         data || has_data(*arg(a, 1, "new")));
        });
      }
      if (name == "join") {
        return bound(fn, [self](Renderer& r, CallArgs& a, const Pos& p) {
          const Value* v = arg(a, 0, "iterable");
          if (!v) r.fail("str.join needs an argument", p);
          Value out = Value::string("");
          bool first = true;
          for (const Value& x : r.iterate(*v, p)) {
            if (!x.is_string()) r.fail("str.join: the items must be strings", p);
            if (!first) out = r.concat(out, self, p);
            out = r.concat(out, x, p);
            first = false;
          }
          return out;
        });
      }
      if (name == "find" || name == "count") {
        return bound(fn, [self, name](Renderer& r, CallArgs& a, const Pos& p) {
          const std::string sub = r.str_arg(a, 0, "sub", "str." + name, p);
          const std::string& s = self.str();
          if (name == "find") {
            const std::size_t at = s.find(sub);
            if (at == std::string::npos) return Value::integer(-1);
            return Value::integer(cp_count(s.substr(0, at)));
          }
          if (sub.empty()) return Value::integer(cp_count(s) + 1);
          int64_t n = 0;
          for (std::size_t pos = 0; (pos = s.find(sub, pos)) != std::string::npos; pos += sub.size())
            ++n;
          return Value::integer(n);
        });
      }
      if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isalnum" ||
          name == "islower" || name == "isupper") {
        return bound(fn, [self, name](Renderer&, CallArgs&, const Pos&) {
          const std::string& s = self.str();
          if (s.empty()) return Value::boolean(false);
          if (name == "isspace") {
            for (std::size_t i = 0; i < s.size(); i += cp_len(s, i))
              if (!py_space(cp_at(s, i, cp_len(s, i)))) return Value::boolean(false);
            return Value::boolean(true);
          }
          bool cased = false;
          for (const char c : s) {
            const bool dig = c >= '0' && c <= '9', al = ascii_alpha(c);
            if (name == "isdigit" && !dig) return Value::boolean(false);
            if (name == "isalpha" && !al) return Value::boolean(false);
            if (name == "isalnum" && !dig && !al) return Value::boolean(false);
            if (name == "islower" && c >= 'A' && c <= 'Z') return Value::boolean(false);
            if (name == "isupper" && c >= 'a' && c <= 'z') return Value::boolean(false);
            cased = cased || al;
          }
          return Value::boolean(name == "islower" || name == "isupper" ? cased : true);
        });
      }
      if (name == "splitlines") {
        return bound(fn, [self, data](Renderer&, CallArgs&, const Pos&) {
          std::vector<Value> items;
          for (std::string& l : py_splitlines(self.str())) items.push_back(derived(std::move(l), data));
          return Value::list(std::move(items));
        });
      }
      return Value();
    }
    if (obj.is_dict() && !obj.dict_ref().is_namespace) {
      const Value self = obj;
      if (name == "get") {
        return bound("dict.get", [self](Renderer& r, CallArgs& a, const Pos& p) {
          const Value* k = arg(a, 0, "key");
          if (!k) r.fail("dict.get needs a key", p);
          if (k->is_string())
            if (const Value* v = self.dict_ref().find(k->str())) return *v;
          const Value* d = arg(a, 1, "default");
          return d ? *d : Value::none();
        });
      }
      if (name == "items" || name == "keys" || name == "values") {
        return bound("dict." + name, [self, name](Renderer&, CallArgs&, const Pos&) {
          std::vector<Value> items;
          const Dict& d = self.dict_ref();
          for (const auto& kv : d.items) {
            Value key = Value::string(kv.first, d.data_keys);
            if (name == "keys") items.push_back(key);
            else if (name == "values") items.push_back(kv.second);
            else items.push_back(Value::list({key, kv.second}, true));
          }
          return Value::list(std::move(items));
        });
      }
      return Value();
    }
    if (obj.is_list()) {
      const Value self = obj;
      if (name == "index" || name == "count") {
        return bound("list." + name, [self, name](Renderer& r, CallArgs& a, const Pos& p) {
          const Value* x = arg(a, 0, "value");
          if (!x) r.fail("list." + name + " needs an argument", p);
          int64_t n = 0;
          const auto& items = self.list_ref().items;
          for (std::size_t k = 0; k < items.size(); ++k) {
            if (!equals(items[k], *x)) continue;
            if (name == "index") return Value::integer(static_cast<int64_t>(k));
            ++n;
          }
          if (name == "index") r.fail("list.index: the value is not in the list", p);
          return Value::integer(n);
        });
      }
      if (name == "append" || name == "pop" || name == "extend" || name == "insert" ||
          name == "remove" || name == "clear" || name == "sort" || name == "reverse") {
        const std::string n = name;
        return bound("list." + name, [n](Renderer& r, CallArgs&, const Pos& p) -> Value {
          r.fail("list." + n + "() modifies a list, which the sandbox does not allow", p);
        });
      }
    }
    return Value();
  }

  // ---- filters ----
  Value apply_filter(const Expr& e, Scope& scope) {
    Value v = eval(*e.children[0], scope);
    CallArgs a = eval_args(e, scope);
    return filter(e.name, v, a, e.pos);
  }

  Value attr_path(const Value& item, const std::string& path, const Pos& p) {
    Value cur = item;
    std::size_t start = 0;
    while (true) {
      const std::size_t dot = path.find('.', start);
      const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      Expr fake;
      fake.pos = p;
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (cur.is_undefined()) return cur;
      if (digits && part.size() > 18) fail("an attribute path index is too large: " + part, p);
      cur = get_item(cur, digits ? Value::integer(std::strtoll(part.c_str(), nullptr, 10))
                                 : Value::string(part),
                     fake);
      if (dot == std::string::npos) return cur;
      start = dot + 1;
    }
  }

  Value filter(const std::string& name, const Value& v, CallArgs& a, const Pos& p) {
    const auto need_string = [&](const Value& x) -> const Value& {
      if (x.is_undefined()) return x;
      return x;
    };
    (void)need_string;
    if (name == "safe") {
      return Value::markup(to_string_value(v));
    }
    if (name == "string") return to_string_value(v);
    if (name == "trim") {
      const Value s = to_string_value(v);
      const Value* c = arg(a, 0, "chars");
      return derived(py_strip(s.str(), c && c->is_string() ? &c->str() : nullptr, true, true),
                     has_data(s));
    }
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      const Value s = to_string_value(v);
      std::string r = s.str();
      r = py_case(r, name == "upper"  ? Case::kUpper
                     : name == "lower" ? Case::kLower
                     : name == "title" ? Case::kTitle
                                       : Case::kCapitalize);
      return derived(std::move(r), has_data(s));
    }
    if (name == "replace") {
      const Value s = to_string_value(v);
      const Value* from = arg(a, 0, "old");
      const Value* to = arg(a, 1, "new");
      if (!from || !to) fail("replace needs two arguments", p);
      const Value fs = to_string_value(*from), ts = to_string_value(*to);
      const Value* c = arg(a, 2, "count");
      return derived(replace_all(s.str(), fs.str(), ts.str(),
                                 c && is_integral(*c) ? int_of(*c) : -1, limits_.max_output),
                     has_data(s) || has_data(ts));
    }
    if (name == "tojson") {
      const Value* ind = arg(a, 0, "indent");
      const Value* sk = kwarg(a, "sort_keys");
      int indent = -1;
      if (ind && !ind->is_none()) {
        if (!is_integral(*ind)) fail("tojson: indent must be an integer", p);
        indent = static_cast<int>(std::clamp<int64_t>(int_of(*ind), 0, 64));
      }
      try {
        std::string s = to_json(v, indent, sk && sk->truthy());
        if (s.size() > limits_.max_output) fail("tojson: the result is longer than the output limit", p);
        return derived(std::move(s), has_data(v));
      } catch (const Error& err) {
        fail(err.what_only(), p);
      }
    }
    if (name == "length" || name == "count") {
      switch (v.kind()) {
        case Value::Kind::kUndefined: return Value::integer(0);
        case Value::Kind::kString: return Value::integer(cp_count(v.str()));
        case Value::Kind::kList:
          if (v.list_ref().generator)
            fail("object of type 'generator' has no len() (add '| list' before '| " + name + "')", p);
          return Value::integer(static_cast<int64_t>(v.list_ref().items.size()));
        case Value::Kind::kDict: return Value::integer(static_cast<int64_t>(v.dict_ref().items.size()));
        default: fail(std::string("object of type '") + kind_name(v) + "' has no len()", p);
      }
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::list();
      if (!v.is_dict()) fail(std::string("items: '") + kind_name(v) + "' is not a mapping", p);
      CallArgs none;
      return call_value(method(v, "items"), none, p);
    }
    if (name == "list") {
      if (v.is_list() && !v.list_ref().tuple && !v.list_ref().generator) return v;
      return Value::list(iterate(v, p));
    }
    if (name == "first" || name == "last") {
      std::vector<Value> items = iterate(v, p);
      if (items.empty()) return Value::undefined("the " + name + " item of an empty sequence");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "reverse") {
      if (v.is_string()) {
        const auto off = cp_offsets(v.str());
        std::string r;
        for (std::size_t k = off.size() - 1; k > 0; --k) r.append(v.str(), off[k - 1], off[k] - off[k - 1]);
        return derived(std::move(r), has_data(v));
      }
      std::vector<Value> items = iterate(v, p);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    if (name == "default" || name == "d") {
      const Value* dv = arg(a, 0, "default_value");
      const Value* boolean = arg(a, 1, "boolean");
      const bool use = v.is_undefined() || (boolean && boolean->truthy() && !v.truthy());
      if (use) return dv ? *dv : Value::string("");
      return v;
    }
    if (name == "join") {
      const Value* sepv = arg(a, 0, "d");
      const Value* attr = arg(a, 1, "attribute");
      Value sep = sepv ? to_string_value(*sepv) : Value::string("");
      Value out = Value::string("");
      bool first = true;
      for (const Value& x0 : iterate(v, p)) {
        const Value x = attr ? attr_path(x0, to_python_str(*attr), p) : x0;
        if (!first) out = concat(out, sep, p);
        out = concat(out, to_string_value(x), p);
        first = false;
      }
      return out;
    }
    if (name == "int") {
      const Value* dv = arg(a, 0, "default");
      const Value dflt = dv ? *dv : Value::integer(0);
      if (is_integral(v)) return Value::integer(int_of(v));
      if (v.kind() == Value::Kind::kFloat) {
        const double f = v.as_float();
        if (!std::isfinite(f) || std::fabs(f) > 9.2e18) return dflt;
        return Value::integer(static_cast<int64_t>(f));
      }
      if (v.is_string()) {
        const std::string s = py_strip(v.str(), nullptr, true, true);
        char* end = nullptr;
        errno = 0;
        const long long i = std::strtoll(s.c_str(), &end, 10);
        if (!s.empty() && end && *end == '\0' && errno == 0) return Value::integer(i);
        const double f = std::strtod(s.c_str(), &end);
        if (!s.empty() && end && *end == '\0' && std::isfinite(f) && std::fabs(f) < 9.2e18)
          return Value::integer(static_cast<int64_t>(f));
      }
      return dflt;
    }
    if (name == "float") {
      const Value* dv = arg(a, 0, "default");
      if (is_numeric(v)) return Value::number(float_of(v));
      if (v.is_string()) {
        const std::string s = py_strip(v.str(), nullptr, true, true);
        char* end = nullptr;
        const double f = std::strtod(s.c_str(), &end);
        if (!s.empty() && end && *end == '\0') return Value::number(f);
      }
      return dv ? *dv : Value::number(0.0);
    }
    if (name == "abs") {
      if (v.kind() == Value::Kind::kFloat) return Value::number(std::fabs(v.as_float()));
      if (is_integral(v)) {
        if (int_of(v) == INT64_MIN) fail("integer overflow", p);
        return Value::integer(std::llabs(int_of(v)));
      }
      fail(std::string("bad operand type for abs(): '") + kind_name(v) + "'", p);
    }
    if (name == "round") {
      const Value* pr = arg(a, 0, "precision");
      const Value* me = arg(a, 1, "method");
      const int64_t prec = pr && is_integral(*pr) ? int_of(*pr) : 0;
      if (!is_numeric(v)) fail("round: the value must be a number", p);
      const std::string method_name = me && me->is_string() ? me->str() : "common";
      const double x = float_of(v);
      if (method_name == "common") {
        // Python's round(): the exact binary value rounded half to even, as printf rounds it.
        if (prec >= 0 && std::isfinite(x)) {
          char buf[512];
          std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(std::min<int64_t>(prec, 300)), x);
          return Value::number(std::strtod(buf, nullptr));
        }
        const double scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(-prec, 0, 300)));
        return Value::number(std::nearbyint(x / scale) * scale);
      }
      const double scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(prec, -300, 300)));
      if (method_name == "ceil") return Value::number(std::ceil(x * scale) / scale);
      if (method_name == "floor") return Value::number(std::floor(x * scale) / scale);
      fail("round: method must be common, ceil or floor", p);
    }
    if (name == "attr") {
      const Value* n = arg(a, 0, "name");
      if (!n || !n->is_string()) fail("attr needs an attribute name", p);
      Expr fake;
      fake.pos = p;
      Scope s;
      return get_attr(v, n->str(), fake, s);
    }
    if ((name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject" ||
         name == "map") &&
        !v.truthy())
      return generator({});  // jinja2 iterates only a true value
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      const bool by_attr = name.ends_with("attr");
      const bool keep_true = name.starts_with("select");
      std::size_t k = 0;
      std::string attr;
      if (by_attr) {
        if (a.pos.empty() || !a.pos[0].is_string()) fail(name + " needs an attribute name", p);
        attr = a.pos[0].str();
        k = 1;
      }
      std::string test;
      if (a.pos.size() > k) {
        if (!a.pos[k].is_string()) fail(name + ": the test must be named by a string", p);
        test = a.pos[k].str();
        if (!is_known_test(test)) fail(name + ": unknown test '" + test + "'", p);
      }
      std::vector<Value> targs(a.pos.begin() + static_cast<std::ptrdiff_t>(std::min(a.pos.size(), k + 1)), a.pos.end());
      std::vector<Value> out;
      for (const Value& x : iterate(v, p)) {
        const Value y = by_attr ? attr_path(x, attr, p) : x;
        const bool r = test.empty() ? y.truthy() : run_test(test, y, targs, p);
        if (r == keep_true) out.push_back(x);
      }
      return generator(std::move(out));
    }
    if (name == "map") {
      std::vector<Value> out;
      if (const Value* attr = kwarg(a, "attribute")) {
        const Value* dflt = kwarg(a, "default");
        for (const Value& x : iterate(v, p)) {
          Value y = attr_path(x, to_python_str(*attr), p);
          if (y.is_undefined() && dflt) y = *dflt;
          out.push_back(y);
        }
        return generator(std::move(out));
      }
      if (a.pos.empty() || !a.pos[0].is_string()) fail("map needs a filter name or attribute=", p);
      const std::string f = a.pos[0].str();
      if (!is_known_filter(f)) fail("map: unknown filter '" + f + "'", p);
      CallArgs rest;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const Value& x : iterate(v, p)) {
        CallArgs copy = rest;
        out.push_back(filter(f, x, copy, p));
      }
      return generator(std::move(out));
    }
    if (name == "unique") {
      std::vector<Value> out;
      for (const Value& x : iterate(v, p)) {
        bool seen = false;
        for (const Value& y : out) seen = seen || equals(x, y);
        if (!seen) out.push_back(x);
      }
      return Value::list(std::move(out));
    }
    if (name == "sort") {
      const Value* rev = arg(a, 0, "reverse");
      const Value* attr = arg(a, 2, "attribute");
      std::vector<Value> items = iterate(v, p);
      std::vector<std::pair<Value, Value>> keyed;
      for (const Value& x : items)
        keyed.push_back({attr ? attr_path(x, to_python_str(*attr), p) : x, x});
      std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
        return compare(x.first, y.first, "<") < 0;
      });
      if (rev && rev->truthy()) std::reverse(keyed.begin(), keyed.end());
      std::vector<Value> out;
      for (auto& kv : keyed) out.push_back(kv.second);
      return Value::list(std::move(out));
    }
    if (name == "dictsort") {
      if (!v.is_dict()) fail("dictsort needs a mapping", p);
      std::vector<Value> items;
      for (const auto& kv : v.dict_ref().items)
        items.push_back(Value::list({Value::string(kv.first, v.dict_ref().data_keys), kv.second}, true));
      std::stable_sort(items.begin(), items.end(), [](const Value& x, const Value& y) {
        std::string a1 = x.list_ref().items[0].str(), b1 = y.list_ref().items[0].str();
        std::transform(a1.begin(), a1.end(), a1.begin(), ascii_lower);
        std::transform(b1.begin(), b1.end(), b1.begin(), ascii_lower);
        return a1 < b1;
      });
      return Value::list(std::move(items));
    }
    if (name == "sum") {
      const Value* attr = arg(a, 0, "attribute");
      const Value* start = arg(a, 1, "start");
      Value acc = start ? *start : Value::integer(0);
      for (const Value& x : iterate(v, p))
        acc = arithmetic("+", acc, attr ? attr_path(x, to_python_str(*attr), p) : x, p);
      return acc;
    }
    if (name == "min" || name == "max") {
      std::vector<Value> items = iterate(v, p);
      if (items.empty()) return Value::undefined("the " + name + " of an empty sequence");
      Value best = items[0];
      for (const Value& x : items) {
        const int c = compare(x, best, "<");
        if (name == "min" ? c < 0 : c > 0) best = x;
      }
      return best;
    }
    if (name == "indent") {
      // jinja2's do_indent, quirk included: the text gets a newline before it is split.
      const Value s = to_string_value(v);
      const Value* w = arg(a, 0, "width");
      const Value* first = arg(a, 1, "first");
      const Value* blank = arg(a, 2, "blank");
      const std::string pad =
          w && w->is_string()
              ? w->str()
              : std::string(static_cast<std::size_t>(std::clamp<int64_t>(
                                w && is_integral(*w) ? int_of(*w) : 4, 0, 256)),
                            ' ');
      const std::vector<std::string> lines = py_splitlines(s.str() + "\n");
      std::string r;
      for (std::size_t k = 0; k < lines.size(); ++k) {
        if (k > 0) {
          r += '\n';
          if (blank && blank->truthy()) r += pad;
          else if (!lines[k].empty()) r += pad;
        }
        r += lines[k];
        if (r.size() > limits_.max_output) fail("indent: the result is longer than the output limit", p);
      }
      if (first && first->truthy()) r = pad + r;
      return derived(std::move(r), has_data(s));
    }
    if (name == "escape" || name == "e") {
      if (v.is_markup()) return v;
      const Value s = to_string_value(v);
      std::string r;
      for (const char c : s.str()) {
        switch (c) {
          case '&': r += "&amp;"; break;
          case '<': r += "&lt;"; break;
          case '>': r += "&gt;"; break;
          case '"': r += "&#34;"; break;
          case '\'': r += "&#39;"; break;
          default: r += c;
        }
      }
      return Value::markup(std::move(r), has_data(s));
    }
    fail("unknown filter '" + name + "'", p);
  }

  static bool is_known_filter(const std::string& n) {
    for (auto f : filter_names())
      if (f == n) return true;
    return false;
  }
  static bool is_known_test(const std::string& n) {
    for (auto f : test_names())
      if (f == n) return true;
    return false;
  }

  // ---- tests ----
  bool apply_test(const Expr& e, Scope& scope) {
    const Value v = eval(*e.children[0], scope);
    CallArgs a = eval_args(e, scope);
    return run_test(e.name, v, a.pos, e.pos);
  }

  bool run_test(const std::string& name, const Value& v, const std::vector<Value>& args,
                const Pos& p) {
    const auto arg0 = [&]() -> const Value& {
      if (args.empty()) fail("the test '" + name + "' needs an argument", p);
      return args[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.kind() == Value::Kind::kBool;
    if (name == "true") return v.kind() == Value::Kind::kBool && v.as_bool();
    if (name == "false") return v.kind() == Value::Kind::kBool && !v.as_bool();
    if (name == "integer") return v.kind() == Value::Kind::kInt;
    if (name == "float") return v.kind() == Value::Kind::kFloat;
    if (name == "number") return is_numeric(v);
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict() && !v.dict_ref().is_namespace;
    if (name == "iterable") return v.is_string() || v.is_list() || (v.is_dict() && !v.dict_ref().is_namespace);
    if (name == "sequence") return v.is_string() || v.is_list() || (v.is_dict() && !v.dict_ref().is_namespace);
    if (name == "callable") return v.kind() == Value::Kind::kCallable;
    if (name == "odd" || name == "even") {
      if (!is_integral(v)) fail("the test '" + name + "' needs an integer", p);
      const bool odd = (int_of(v) % 2) != 0;
      return name == "odd" ? odd : !odd;
    }
    if (name == "divisibleby") {
      const Value& d = arg0();
      if (!is_integral(v) || !is_integral(d) || int_of(d) == 0)
        fail("divisibleby needs integers and a non-zero divisor", p);
      return int_of(v) % int_of(d) == 0;
    }
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) return false;
      const std::string& s = v.str();
      bool cased = false;
      for (std::size_t i = 0; i < s.size(); i += cp_len(s, i))
        cased = cased || cp_cased(cp_at(s, i, cp_len(s, i)));
      return cased && s == py_case(s, name == "lower" ? Case::kLower : Case::kUpper);
    }
    if (name == "eq" || name == "equalto" || name == "==") return equals(v, arg0());
    if (name == "ne" || name == "!=") return !equals(v, arg0());
    if (name == "sameas") {
      const Value& o = arg0();
      if (v.kind() != o.kind()) return false;
      if (v.is_none() || v.is_undefined()) return true;
      if (v.kind() == Value::Kind::kBool) return v.as_bool() == o.as_bool();
      return equals(v, o) && (!v.is_list() || &v.list_ref() == &o.list_ref()) &&
             (!v.is_dict() || &v.dict_ref() == &o.dict_ref());
    }
    try {
      if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg0(), "<") < 0;
      if (name == "le" || name == "<=") return compare(v, arg0(), "<=") <= 0;
      if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg0(), ">") > 0;
      if (name == "ge" || name == ">=") return compare(v, arg0(), ">=") >= 0;
    } catch (const Error& err) {
      fail(err.what_only(), p);
    }
    if (name == "in") return contains(arg0(), v, p);
    fail("unknown test '" + name + "'", p);
  }

  // ---- globals ----
  void install_globals() {
    root_.vars["range"] = bound("range", [](Renderer& r, CallArgs& a, const Pos& p) {
      int64_t start = 0, stop = 0, step = 1;
      for (const Value& x : a.pos)
        if (!is_integral(x)) r.fail("range() takes integers", p);
      if (a.pos.size() == 1) {
        stop = int_of(a.pos[0]);
      } else if (a.pos.size() == 2 || a.pos.size() == 3) {
        start = int_of(a.pos[0]);
        stop = int_of(a.pos[1]);
        if (a.pos.size() == 3) step = int_of(a.pos[2]);
      } else {
        r.fail("range() takes 1 to 3 arguments", p);
      }
      if (step == 0) r.fail("range() step must not be zero", p);
      std::vector<Value> items;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        r.count_iteration(p);
        items.push_back(Value::integer(i));
        if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
      }
      return Value::list(std::move(items));
    });
    root_.vars["namespace"] = bound("namespace", [](Renderer& r, CallArgs& a, const Pos& p) {
      Value ns = Value::dict();
      ns.dict_mut().is_namespace = true;
      for (const Value& x : a.pos) {
        if (!x.is_dict()) r.fail("namespace() takes a mapping or keyword arguments", p);
        for (const auto& kv : x.dict_ref().items) ns.dict_mut().set(kv.first, kv.second);
      }
      for (const auto& kv : a.kw) ns.dict_mut().set(kv.first, kv.second);
      r.namespaces_.push_back({ns, &ns.dict_mut()});
      return ns;
    });
    root_.vars["dict"] = bound("dict", [](Renderer& r, CallArgs& a, const Pos& p) {
      Value d = Value::dict();
      for (const Value& x : a.pos) {
        if (!x.is_dict()) r.fail("dict() takes a mapping or keyword arguments", p);
        for (const auto& kv : x.dict_ref().items) d.dict_mut().set(kv.first, kv.second);
      }
      for (const auto& kv : a.kw) d.dict_mut().set(kv.first, kv.second);
      return d;
    });
    root_.vars["raise_exception"] = bound("raise_exception", [](Renderer& r, CallArgs& a, const Pos& p) -> Value {
      const std::string msg = a.pos.empty() ? std::string() : to_python_str(a.pos[0]);
      r.fail("the template raised an exception: " + msg, p);
    });
    root_.vars["strftime_now"] = bound("strftime_now", [](Renderer& r, CallArgs& a, const Pos& p) {
      if (a.pos.empty() || !a.pos[0].is_string()) r.fail("strftime_now needs a format string", p);
      const std::string& f = a.pos[0].str();
      if (f.size() > 256) r.fail("strftime_now: the format is longer than 256 bytes", p);
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[1024];
      const std::size_t n = f.empty() ? 0 : std::strftime(buf, sizeof buf, f.c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
  }

  const Limits limits_;
  Scope root_;
  int64_t iterations_ = 0;
  int call_depth_ = 0;
  std::vector<std::pair<Value, Dict*>> namespaces_;
};

std::vector<std::string_view> filter_names() {
  return {"abs",     "attr",     "capitalize", "count", "d",       "default", "dictsort",
          "e",       "escape",   "first",      "float", "indent",  "int",     "items",
          "join",    "last",     "length",     "list",  "lower",   "map",     "max",
          "min",     "reject",   "rejectattr", "replace", "reverse", "round", "safe",
          "select",  "selectattr", "sort",     "string", "sum",    "title",   "tojson",
          "trim",    "unique",   "upper"};
}

std::vector<std::string_view> test_names() {
  return {"boolean", "callable", "defined", "divisibleby", "eq", "equalto", "even", "false",
          "float", "ge", "gt", "greaterthan", "in", "integer", "iterable", "le", "lessthan",
          "lower", "lt", "mapping", "ne", "none", "number", "odd", "sameas", "sequence",
          "string", "true", "undefined", "upper", "==", "!=", "<", "<=", ">", ">="};
}

Template::Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

Template Template::parse(std::string_view source, const Limits& limits) {
  Template t;
  t.root_ = parse_template_source(source, limits);
  t.limits_ = limits;
  return t;
}

namespace {

bool expr_reads(const Expr* e, std::string_view name) {
  if (e == nullptr) return false;
  if ((e->kind == Expr::Kind::kName || e->kind == Expr::Kind::kAttr) && e->name == name)
    return true;
  if (e->kind == Expr::Kind::kItem && e->children.size() > 1 && e->children[1] != nullptr &&
      e->children[1]->kind == Expr::Kind::kLiteral && e->children[1]->value.is_string() &&
      e->children[1]->value.str() == name)
    return true;
  for (const ExprPtr& c : e->children)
    if (expr_reads(c.get(), name)) return true;
  for (const Arg& a : e->args)
    if (expr_reads(a.value.get(), name)) return true;
  return false;
}

bool node_reads(const Node* n, std::string_view name) {
  if (n == nullptr) return false;
  if (expr_reads(n->expr.get(), name) || expr_reads(n->cond.get(), name)) return true;
  for (const ExprPtr& c : n->conds)
    if (expr_reads(c.get(), name)) return true;
  for (const MacroParam& p : n->params)
    if (expr_reads(p.default_value.get(), name)) return true;
  for (const auto* list : {&n->bodies, &n->children})
    for (const NodePtr& c : *list)
      if (node_reads(c.get(), name)) return true;
  return false;
}

}  // namespace

bool Template::reads(std::string_view name) const { return node_reads(root_.get(), name); }

RenderOutput Template::render(const std::map<std::string, Value, std::less<>>& vars) const {
  Renderer r(limits_, vars);
  return r.run(*root_);
}

}  // namespace treeattn::jinja
