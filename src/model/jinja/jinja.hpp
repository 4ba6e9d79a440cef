// A Jinja interpreter for chat templates (tokenizer.chat_template): the subset of Jinja2 that
// model chat templates use, rendered as Hugging Face transformers renders them (jinja2's
// ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks on, the loopcontrols
// extension, keep_trailing_newline off, and HF's tojson, raise_exception and strftime_now).
//
// Supported:
//   text, {{ expr }}, {# comments #}, whitespace control ({%- -%} {{- -}} {#- -#}, {%+ +%});
//   statements if/elif/else, for (with `if` filter, else, tuple unpacking, recursive is not),
//   break/continue, set (names, tuples, namespace attributes, block set), macro (defaults,
//   caller()), call, filter blocks, generation (HF's assistant-mask block, rendered as is);
//   expressions: literals (strings with Python escapes, ints, floats, true/false/none, lists,
//   tuples, dicts), names, attributes, subscripts and slices, calls with keyword arguments,
//   filters, tests (`is`, `is not`), `in`, `not in`, arithmetic + - * / // % **, `~`,
//   comparisons, and/or/not, inline if-else;
//   loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem/cycle;
//   globals range, namespace, dict, raise_exception, strftime_now;
//   the filters and tests listed by filter_names() / test_names(), Python string methods
//   (strip, lstrip, rstrip, split, rsplit, startswith, endswith, upper, lower, replace, title,
//   capitalize, join, find, count, isdigit, isalpha, isspace, splitlines) and dict methods
//   (get, items, keys, values).
// What it does not know is an error naming the construct and its line and column: at parse time
// for statements, filters and tests (as jinja2 does), at render time for names of methods.
// Known differences from Python: upper/lower/title/capitalize map the case of ASCII, Latin-1,
// Latin Extended-A, unaccented Greek and Cyrillic only (and no final sigma); repr() escapes the
// controls, separators and common format characters but not unassigned code points; `%` on
// strings, str.format and the wordcount filter are not supported.
//
// Bounded: the parser refuses nesting deeper than Limits::max_depth; a render stops with an error
// past max_depth macro calls, max_output bytes of output (or of any one string value), or
// max_iterations loop iterations in all.
//
// Provenance: strings that come from the caller's data (render's `data` values, e.g. message
// contents) keep the byte ranges they occupy through concatenation and into the output, so the
// caller can tell the template's own text from the data it inserted (RenderOutput::data_ranges).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace treeattn::jinja {

// A render or parse failure: the message names the construct; line and column (1-based, 0 when
// unknown) locate it in the template.
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, int line = 0, int column = 0);
  int line() const { return line_; }
  int column() const { return column_; }
  const std::string& what_only() const { return message_; }

 private:
  std::string message_;
  int line_, column_;
};

struct Limits {
  int max_depth = 64;                      // nesting of statements/expressions; macro call depth
  std::size_t max_output = 4u << 20;       // bytes of output and of any one string value
  int64_t max_iterations = 1'000'000;      // loop iterations (and range() elements) in all
};

// Byte range [begin, end) of a string.
using Range = std::pair<uint32_t, uint32_t>;

struct Callable;
struct Dict;
struct List;

// A Jinja value (Python's types as jinja2 sees them).
class Value {
 public:
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict,
                              kCallable };
  Value() = default;  // undefined
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double f);
  static Value string(std::string s, bool data = false);
  static Value string(std::string s, std::vector<Range> data_ranges);
  // Markup (jinja2's `safe` strings): `+` with a plain string HTML-escapes the plain one.
  static Value markup(std::string s, bool data);
  static Value markup(const Value& str);  // the same text and data ranges, as Markup
  bool is_markup() const;
  static Value list(std::vector<Value> items = {}, bool tuple = false);
  static Value dict();
  static Value callable(std::shared_ptr<const Callable> c);
  static Value undefined(std::string name);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return i_; }
  double as_float() const { return kind_ == Kind::kInt ? static_cast<double>(i_) : f_; }
  const std::string& str() const;            // kString
  const std::vector<Range>& ranges() const;  // kString: the data ranges
  const List& list_ref() const;
  List& list_mut() const;
  const Dict& dict_ref() const;
  Dict& dict_mut() const;
  const Callable& callable_ref() const { return *c_; }
  const std::string& undefined_name() const;  // kUndefined: the name that was looked up

  bool truthy() const;

 private:
  struct Str {
    std::string text;
    std::vector<Range> data;
    bool markup = false;
  };
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const Str> s_;  // kString, and kUndefined's name
  std::shared_ptr<List> l_;
  std::shared_ptr<Dict> d_;
  std::shared_ptr<const Callable> c_;
};

// Values nest at most this deep (lists and dicts inside each other): deeper ones are an Error,
// so that printing, comparing and freeing them stays within the stack.
inline constexpr int kMaxValueDepth = 256;
int value_depth(const Value& v);  // 0 for scalars, 1 + the deepest item for lists and dicts

struct List {
  std::vector<Value> items;
  bool tuple = false;
  int depth = 1;
  // What jinja2's select, reject, selectattr, rejectattr and map return: a generator, which is
  // always true, has no length and is not JSON (`| list` makes it a list).
  bool generator = false;
};

// Insertion-ordered string-keyed map (Python's dict). namespace() objects are dicts with
// `is_namespace` set: the only ones `set ns.attr = ...` may write.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  std::map<std::string, std::size_t, std::less<>> index;
  bool is_namespace = false;
  bool data_keys = false;  // keys came from the caller's data (their strings carry that)
  int depth = 1;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
};

class Template;

// The output of a render: the text, and the byte ranges of it that came from data strings.
struct RenderOutput {
  std::string text;
  std::vector<Range> data_ranges;
};

struct Node;

class Template {
 public:
  // Parses the template; throws Error (construct, line, column) for what it cannot parse or does
  // not support.
  static Template parse(std::string_view source, const Limits& limits = {});
  // Renders with `vars` as the template's variables (plus the globals); throws Error.
  RenderOutput render(const std::map<std::string, Value, std::less<>>& vars) const;
  // The template reads `name`: as a variable, an attribute (x.name) or a literal key
  // (x['name']) anywhere in its expressions (text and string literals do not count).
  bool reads(std::string_view name) const;

  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  ~Template();

 private:
  Template();
  std::shared_ptr<const Node> root_;
  Limits limits_;
};

// The supported filter and test names (for messages and tests).
std::vector<std::string_view> filter_names();
std::vector<std::string_view> test_names();

// Python's str() of a value, and json.dumps(value, ensure_ascii=False, indent=...) as HF's
// tojson writes it (indent < 0: none).
std::string to_python_str(const Value& v);
std::string to_json(const Value& v, int indent = -1, bool sort_keys = false);

}  // namespace treeattn::jinja
