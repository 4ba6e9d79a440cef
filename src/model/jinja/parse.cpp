// The lexer and parser: jinja2's lexer rules with trim_blocks, lstrip_blocks and
// keep_trailing_newline=False, and its expression grammar (jinja2/parser.py).
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <set>

#include "model/jinja/ast.hpp"

namespace treeattn::jinja {

namespace {

struct Token {
  enum class Type { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt,
                    kFloat, kOp, kEof };
  Type type;
  std::string text;  // kText, kName, kString (unescaped), kOp, kInt/kFloat (source)
  Pos pos;
};

const char* type_name(Token::Type t) {
  switch (t) {
    case Token::Type::kText: return "text";
    case Token::Type::kVarBegin: return "'{{'";
    case Token::Type::kVarEnd: return "'}}'";
    case Token::Type::kBlockBegin: return "'{%'";
    case Token::Type::kBlockEnd: return "'%}'";
    case Token::Type::kName: return "a name";
    case Token::Type::kString: return "a string";
    case Token::Type::kInt: return "an integer";
    case Token::Type::kFloat: return "a number";
    case Token::Type::kOp: return "an operator";
    case Token::Type::kEof: return "the end of the template";
  }
  return "?";
}

std::string describe(const Token& t) {
  if (t.type == Token::Type::kName || t.type == Token::Type::kOp || t.type == Token::Type::kInt ||
      t.type == Token::Type::kFloat)
    return "'" + t.text + "'";
  return type_name(t.type);
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Python's whitespace (str.strip(), the regex \s jinja2's lexer uses for '-' whitespace
// control): the length of the whitespace character at s[i], 0 when there is none.
std::size_t space_at(const std::string& s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) ? 1 : 0;
  const auto b = [&](std::size_t k) {
    return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0;
  };
  if (c == 0xc2 && (b(1) == 0x85 || b(1) == 0xa0)) return 2;
  if (c == 0xe1 && b(1) == 0x9a && b(2) == 0x80) return 3;                 // U+1680
  if (c == 0xe2 && b(1) == 0x80 && (b(2) <= 0x8a || b(2) == 0xa8 || b(2) == 0xa9 || b(2) == 0xaf))
    return 3;                                                               // U+2000-200A, 2028, 2029, 202F
  if (c == 0xe2 && b(1) == 0x81 && b(2) == 0x9f) return 3;                 // U+205F
  if (c == 0xe3 && b(1) == 0x80 && b(2) == 0x80) return 3;                 // U+3000
  return 0;
}

void strip_left(std::string& s) {
  std::size_t a = 0;
  for (std::size_t n; a < s.size() && (n = space_at(s, a)) > 0;) a += n;
  s.erase(0, a);
}

void strip_right(std::string& s) {
  // Walk forward so that multi-byte characters are recognised; keep the end of the last
  // non-space character.
  std::size_t keep = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = space_at(s, i);
    if (n > 0) {
      i += n;
    } else {
      const auto c = static_cast<unsigned char>(s[i]);
      i += c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
      keep = std::min(i, s.size());
    }
  }
  s.erase(keep);
}


class Lexer {
 public:
  explicit Lexer(std::string_view src) {
    // Newlines normalized to \n; one trailing newline dropped (keep_trailing_newline=False).
    src_.reserve(src.size());
    for (std::size_t k = 0; k < src.size(); ++k) {
      if (src[k] == '\r') {
        src_ += '\n';
        if (k + 1 < src.size() && src[k + 1] == '\n') ++k;
      } else {
        src_ += src[k];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (std::size_t k = 0; k < src_.size(); ++k)
      if (src_[k] == '\n') line_starts_.push_back(k + 1);
  }

  std::vector<Token> run() {
    std::vector<Token> out;
    std::size_t pos = 0;
    bool line_starting = true;
    bool strip_next = false;  // the previous tag ended with '-'
    const std::size_t n = src_.size();
    while (pos < n) {
      std::size_t m = pos;
      for (;; ++m) {
        m = src_.find('{', m);
        if (m == std::string::npos || m + 1 >= n) {
          m = std::string::npos;
          break;
        }
        const char k = src_[m + 1];
        if (k == '{' || k == '%' || k == '#') break;
      }
      std::string text = src_.substr(pos, m == std::string::npos ? std::string::npos : m - pos);
      if (strip_next) {
        strip_left(text);
        strip_next = false;
      }
      if (m == std::string::npos) {
        if (!text.empty()) out.push_back({Token::Type::kText, text, at(pos)});
        break;
      }
      const char kind = src_[m + 1];
      const char mod = m + 2 < n ? src_[m + 2] : '\0';
      if (mod == '-') {
        strip_right(text);
      } else if (mod != '+' && kind != '{') {
        const std::size_t nl = text.rfind('\n');
        const std::size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if (l_pos > 0 || line_starting) {
          bool blank = true;
          for (std::size_t k = l_pos; k < text.size(); ++k)
            if (text[k] != ' ' && text[k] != '\t') blank = false;
          if (blank) text.erase(l_pos);
        }
      }
      if (!text.empty()) out.push_back({Token::Type::kText, text, at(pos)});
      std::size_t p = m + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      if (kind == '#') {
        const std::size_t e = src_.find("#}", p);
        if (e == std::string::npos) throw Error("unclosed comment ('{#' without '#}')", at(m).line, at(m).column);
        const char before = e > p ? src_[e - 1] : '\0';
        p = e + 2;
        if (before == '-') {
          strip_next = true;
        } else if (before != '+' && p < n && src_[p] == '\n') {
          ++p;
        }
        line_starting = src_[p - 1] == '\n';
        pos = p;
        continue;
      }
      const bool block = kind == '%';
      out.push_back({block ? Token::Type::kBlockBegin : Token::Type::kVarBegin,
                     block ? "{%" : "{{", at(m)});
      p = lex_tag(p, block, out, strip_next);
      line_starting = src_[p - 1] == '\n';
      pos = p;
    }
    out.push_back({Token::Type::kEof, "", at(n)});
    return out;
  }

 private:
  Pos at(std::size_t off) const {
    std::size_t lo = 0, hi = line_starts_.size();
    while (hi - lo > 1) {
      const std::size_t mid = (lo + hi) / 2;
      if (line_starts_[mid] <= off) lo = mid;
      else hi = mid;
    }
    return {static_cast<int>(lo + 1), static_cast<int>(off - line_starts_[lo] + 1)};
  }

  // Tokens of one {{ }} or {% %} tag from `p`; returns the offset after the tag (and the newline
  // trim_blocks removes).
  std::size_t lex_tag(std::size_t p, bool block, std::vector<Token>& out, bool& strip_next) {
    const std::size_t n = src_.size();
    const char close = block ? '%' : '}';
    const Pos open = out.back().pos;
    int depth = 0;  // brackets: '}}' inside a dict literal is not the end
    while (true) {
      while (p < n && is_space(src_[p])) ++p;
      if (p >= n)
        throw Error(std::string("unclosed tag ('") + (block ? "{%" : "{{") + "' without '" +
                        (block ? "%}" : "}}") + "')",
                    open.line, open.column);
      const char c = src_[p];
      // The end of the tag, with its whitespace control.
      if (depth == 0 || block) {
        if ((c == '-' || c == '+') && p + 2 < n + 0 && src_[p + 1] == close && src_[p + 2] == '}') {
          out.push_back({block ? Token::Type::kBlockEnd : Token::Type::kVarEnd, "", at(p)});
          if (c == '-') strip_next = true;
          return p + 3;
        }
        if (c == close && p + 1 < n && src_[p + 1] == '}' && (block || depth == 0)) {
          out.push_back({block ? Token::Type::kBlockEnd : Token::Type::kVarEnd, "", at(p)});
          p += 2;
          if (block && p < n && src_[p] == '\n') ++p;  // trim_blocks
          return p;
        }
      }
      const Pos here = at(p);
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        std::size_t e = p;
        while (e < n && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        out.push_back({Token::Type::kName, src_.substr(p, e - p), here});
        p = e;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        std::size_t e = p;
        bool is_float = false;
        while (e < n && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        if (e + 1 < n && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < n && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        }
        if (e < n && (src_[e] == 'e' || src_[e] == 'E')) {
          std::size_t f = e + 1;
          if (f < n && (src_[f] == '+' || src_[f] == '-')) ++f;
          if (f < n && std::isdigit(static_cast<unsigned char>(src_[f]))) {
            is_float = true;
            e = f;
            while (e < n && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string num;
        for (std::size_t k = p; k < e; ++k)
          if (src_[k] != '_') num += src_[k];
        out.push_back({is_float ? Token::Type::kFloat : Token::Type::kInt, num, here});
        p = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        std::string s;
        std::size_t k = p + 1;
        for (;; ++k) {
          if (k >= n) throw Error("unterminated string", here.line, here.column);
          const char ch = src_[k];
          if (ch == c) break;
          if (ch != '\\') {
            s += ch;
            continue;
          }
          if (++k >= n) throw Error("unterminated string", here.line, here.column);
          const char e = src_[k];
          switch (e) {
            case 'n': s += '\n'; break;
            case 't': s += '\t'; break;
            case 'r': s += '\r'; break;
            case '\\': s += '\\'; break;
            case '\'': s += '\''; break;
            case '"': s += '"'; break;
            case 'a': s += '\a'; break;
            case 'b': s += '\b'; break;
            case 'f': s += '\f'; break;
            case 'v': s += '\v'; break;
            case '\n': break;  // a line continuation
            case '0': case '1': case '2': case '3': case '4': case '5': case '6': case '7': {
              uint32_t v = 0;
              int d = 0;
              while (d < 3 && k < n && src_[k] >= '0' && src_[k] <= '7') {
                v = v * 8 + static_cast<uint32_t>(src_[k] - '0');
                ++k;
                ++d;
              }
              --k;
              append_utf8(s, v);
              break;
            }
            case 'x': case 'u': case 'U': {
              const int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
              uint32_t v = 0;
              for (int d = 0; d < digits; ++d) {
                ++k;
                if (k >= n || !std::isxdigit(static_cast<unsigned char>(src_[k])))
                  throw Error(std::string("truncated \\") + e + " escape in a string", here.line,
                              here.column);
                const char h = src_[k];
                v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                       ? h - '0'
                                                       : (std::tolower(h) - 'a' + 10));
              }
              if (v > 0x10ffff || (v >= 0xd800 && v < 0xe000))
                throw Error("a \\" + std::string(1, e) + " escape outside Unicode's scalar values",
                            here.line, here.column);
              append_utf8(s, v);
              break;
            }
            default:
              s += '\\';
              s += e;
          }
        }
        out.push_back({Token::Type::kString, s, here});
        p = k + 1;
        continue;
      }
      static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/",
                                         "%",  "~",  "<",  ">",  "=",  ".", ",", ":", "|", "(",
                                         ")",  "[",  "]",  "{",  "}"};
      bool found = false;
      for (const char* op : kOps) {
        const std::size_t len = std::char_traits<char>::length(op);
        if (src_.compare(p, len, op) == 0) {
          out.push_back({Token::Type::kOp, op, here});
          if (op[0] == '(' || op[0] == '[' || op[0] == '{') ++depth;
          if ((op[0] == ')' || op[0] == ']' || op[0] == '}') && depth > 0) --depth;
          p += len;
          found = true;
          break;
        }
      }
      if (!found) {
        std::string ch(1, c);
        throw Error("unexpected character '" + ch + "'", here.line, here.column);
      }
    }
  }

  std::string src_;
  std::vector<std::size_t> line_starts_;
};

const std::set<std::string, std::less<>>& known_filters() {
  static const std::set<std::string, std::less<>> s = [] {
    std::set<std::string, std::less<>> r;
    for (auto n : filter_names()) r.emplace(n);
    return r;
  }();
  return s;
}
const std::set<std::string, std::less<>>& known_tests() {
  static const std::set<std::string, std::less<>> s = [] {
    std::set<std::string, std::less<>> r;
    for (auto n : test_names()) r.emplace(n);
    return r;
  }();
  return s;
}

class Parser {
 public:
  Parser(std::vector<Token> tokens, const Limits& limits)
      : t_(std::move(tokens)), limits_(limits) {}

  NodePtr parse_template() {
    auto body = parse_body({}, nullptr);
    return body;
  }

 private:
  struct DepthGuard {
    Parser& p;
    DepthGuard(Parser& parser, const Pos& pos) : p(parser) {
      if (++p.depth_ > p.limits_.max_depth)
        throw Error("the template nests deeper than " + std::to_string(p.limits_.max_depth) +
                        " levels",
                    pos.line, pos.column);
    }
    ~DepthGuard() { --p.depth_; }
  };

  const Token& cur() const { return t_[i_]; }
  const Token& peek(std::size_t k = 1) const {
    return t_[std::min(i_ + k, t_.size() - 1)];
  }
  Token next() {
    Token t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  [[noreturn]] void fail(const std::string& msg, const Pos& p) const {
    throw Error(msg, p.line, p.column);
  }
  [[noreturn]] void unexpected(const std::string& wanted) const {
    fail("expected " + wanted + ", got " + describe(cur()), cur().pos);
  }
  bool is_op(std::string_view op) const {
    return cur().type == Token::Type::kOp && cur().text == op;
  }
  bool is_name(std::string_view name) const {
    return cur().type == Token::Type::kName && cur().text == name;
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) unexpected("'" + std::string(op) + "'");
    next();
  }
  std::string expect_name() {
    if (cur().type != Token::Type::kName) unexpected("a name");
    return next().text;
  }
  void expect_block_end() {
    if (cur().type != Token::Type::kBlockEnd) unexpected("'%}'");
    next();
  }

  // Statements until `{% NAME` with NAME in `ends` (consumed up to NAME; *which set to it), or
  // until the end of the template when `ends` is empty.
  NodePtr parse_body(const std::vector<std::string_view>& ends, std::string* which) {
    auto body = std::make_unique<Node>();
    body->kind = Node::Kind::kBody;
    body->pos = cur().pos;
    while (true) {
      const Token& tk = cur();
      if (tk.type == Token::Type::kEof) {
        if (!ends.empty()) {
          std::string list;
          for (auto e : ends) list += (list.empty() ? "'" : " or '") + std::string(e) + "'";
          fail("unexpected end of template: expected " + list, tk.pos);
        }
        return body;
      }
      if (tk.type == Token::Type::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kText;
        n->pos = tk.pos;
        n->text = tk.text;
        body->children.push_back(std::move(n));
        next();
        continue;
      }
      if (tk.type == Token::Type::kVarBegin) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kOutput;
        n->pos = tk.pos;
        next();
        n->expr = parse_tuple(true);
        if (cur().type != Token::Type::kVarEnd) unexpected("'}}'");
        next();
        body->children.push_back(std::move(n));
        continue;
      }
      if (tk.type != Token::Type::kBlockBegin) unexpected("text, '{{' or '{%'");
      const Pos at = tk.pos;
      next();
      if (cur().type != Token::Type::kName) unexpected("a statement name");
      const std::string name = cur().text;
      for (auto e : ends)
        if (name == e) {
          next();
          if (which) *which = name;
          return body;
        }
      body->children.push_back(parse_statement(at));
    }
  }

  NodePtr parse_statement(const Pos& at) {
    DepthGuard guard(*this, at);
    const Token name_tok = next();
    const std::string& name = name_tok.text;
    auto n = std::make_unique<Node>();
    n->pos = at;
    if (name == "if") {
      n->kind = Node::Kind::kIf;
      n->conds.push_back(parse_expression());
      expect_block_end();
      while (true) {
        std::string which;
        n->bodies.push_back(parse_body({"elif", "else", "endif"}, &which));
        if (which == "elif") {
          n->conds.push_back(parse_expression());
          expect_block_end();
          continue;
        }
        if (which == "else") {
          expect_block_end();
          n->bodies.push_back(parse_body({"endif"}, nullptr));
        }
        expect_block_end();
        return n;
      }
    }
    if (name == "for") {
      n->kind = Node::Kind::kFor;
      n->targets = parse_targets();
      if (!is_name("in")) unexpected("'in'");
      next();
      n->expr = parse_tuple(false);
      if (is_name("if")) {
        next();
        n->cond = parse_expression();
      }
      if (is_name("recursive")) fail("'for ... recursive' is not supported", cur().pos);
      expect_block_end();
      std::string which;
      ++loop_depth_;
      n->bodies.push_back(parse_body({"else", "endfor"}, &which));
      --loop_depth_;
      if (which == "else") {
        expect_block_end();
        n->bodies.push_back(parse_body({"endfor"}, nullptr));
      }
      expect_block_end();
      return n;
    }
    if (name == "set") {
      n->kind = Node::Kind::kSet;
      if (cur().type == Token::Type::kName && peek().type == Token::Type::kOp &&
          peek().text == ".") {
        n->targets.push_back(next().text);
        next();
        n->attr = expect_name();
      } else {
        n->targets = parse_targets();
      }
      if (is_op("=")) {
        next();
        n->expr = parse_tuple(true);
        expect_block_end();
        return n;
      }
      if (!n->attr.empty() || n->targets.size() != 1)
        unexpected("'=' (a block set takes one name)");
      if (is_op("|")) fail("a filtered block set ('set x | filter') is not supported", cur().pos);
      expect_block_end();
      n->block = true;
      n->bodies.push_back(parse_body({"endset"}, nullptr));
      expect_block_end();
      return n;
    }
    if (name == "macro") {
      n->kind = Node::Kind::kMacro;
      n->name = expect_name();
      n->params = parse_params();
      expect_block_end();
      const int loops = loop_depth_;
      loop_depth_ = 0;
      n->bodies.push_back(parse_body({"endmacro"}, nullptr));
      loop_depth_ = loops;
      if (cur().type == Token::Type::kName) next();  // {% endmacro name %}
      expect_block_end();
      return n;
    }
    if (name == "call") {
      n->kind = Node::Kind::kCallBlock;
      if (is_op("(")) n->params = parse_params();
      n->expr = parse_expression();
      if (n->expr->kind != Expr::Kind::kCall) fail("'call' needs a macro call", n->expr->pos);
      expect_block_end();
      n->bodies.push_back(parse_body({"endcall"}, nullptr));
      expect_block_end();
      return n;
    }
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail("'" + name + "' outside a for loop", at);
      n->kind = name == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      expect_block_end();
      return n;
    }
    if (name == "filter") {
      n->kind = Node::Kind::kFilterBlock;
      auto input = make(Expr::Kind::kName, cur().pos);
      input->name = kBlockInput;
      // The first filter's name (no leading '|'), then the rest of the chain.
      const Pos p = cur().pos;
      std::string fname = expect_name();
      if (!known_filters().contains(fname)) fail("unknown filter '" + fname + "'", p);
      auto f = make(Expr::Kind::kFilter, p);
      f->name = fname;
      f->children.push_back(std::move(input));
      if (is_op("(")) f->args = parse_args();
      n->expr = parse_filter_expr(std::move(f));
      expect_block_end();
      n->bodies.push_back(parse_body({"endfilter"}, nullptr));
      expect_block_end();
      return n;
    }
    if (name == "generation") {
      // HF's AssistantTracker block: marks the assistant's text for training masks; renders
      // its body unchanged.
      expect_block_end();
      auto body = parse_body({"endgeneration"}, nullptr);
      expect_block_end();
      return body;
    }
    static const std::set<std::string, std::less<>> kUnsupported = {
        "raw", "include", "extends", "import", "from", "block", "with", "autoescape",
        "do", "trans", "pluralize"};
    if (kUnsupported.contains(name))
      fail("the '" + name + "' statement is not supported", name_tok.pos);
    fail("unknown statement '" + name + "'", name_tok.pos);
  }

  // Needs the for loop depth for break/continue: tracked around for bodies.
  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = is_op("(");
    if (paren) next();
    names.push_back(expect_name());
    while (is_op(",")) {
      next();
      if (cur().type != Token::Type::kName) break;
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    return names;
  }

  std::vector<MacroParam> parse_params() {
    std::vector<MacroParam> params;
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      MacroParam p;
      p.name = expect_name();
      if (is_op("=")) {
        next();
        p.default_value = parse_expression();
      }
      params.push_back(std::move(p));
    }
    next();
    return params;
  }

  ExprPtr make(Expr::Kind k, const Pos& p) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = p;
    return e;
  }

  // An expression, or a tuple of them without parentheses (`a, b`).
  ExprPtr parse_tuple(bool with_condexpr) {
    const Pos p = cur().pos;
    auto first = with_condexpr ? parse_expression() : parse_or();
    if (!is_op(",")) return first;
    auto t = make(Expr::Kind::kTuple, p);
    t->children.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (cur().type == Token::Type::kBlockEnd || cur().type == Token::Type::kVarEnd ||
          is_op(")"))
        break;
      t->children.push_back(with_condexpr ? parse_expression() : parse_or());
    }
    return t;
  }

  ExprPtr parse_expression() {
    DepthGuard guard(*this, cur().pos);
    auto e = parse_or();
    while (is_name("if")) {
      const Pos p = cur().pos;
      next();
      auto c = make(Expr::Kind::kCondition, p);
      auto cond = parse_or();
      ExprPtr other;
      if (is_name("else")) {
        next();
        other = parse_expression();
      }
      c->children.push_back(std::move(cond));
      c->children.push_back(std::move(e));
      c->children.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(std::string op, ExprPtr a, ExprPtr b, const Pos& p) {
    auto e = make(Expr::Kind::kBinary, p);
    e->name = std::move(op);
    e->children.push_back(std::move(a));
    e->children.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    auto e = parse_and();
    while (is_name("or")) {
      const Pos p = next().pos;
      e = binary("or", std::move(e), parse_and(), p);
    }
    return e;
  }
  ExprPtr parse_and() {
    auto e = parse_not();
    while (is_name("and")) {
      const Pos p = next().pos;
      e = binary("and", std::move(e), parse_not(), p);
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this, cur().pos);
      const Pos p = next().pos;
      auto e = make(Expr::Kind::kUnary, p);
      e->name = "not";
      e->children.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    auto e = parse_math1();
    ExprPtr result;
    ExprPtr left_copy_src;  // chained comparisons: a < b < c is (a < b) and (b < c)
    while (true) {
      std::string op;
      const Pos p = cur().pos;
      if (cur().type == Token::Type::kOp &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
           cur().text == ">" || cur().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().type == Token::Type::kName && peek().text == "in") {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      auto rhs = parse_math1();
      if (!result) {
        result = binary(op, std::move(e), std::move(rhs), p);
      } else {
        // Chains are rare in templates: evaluate the middle operand twice.
        fail("chained comparisons ('a < b < c') are not supported", p);
      }
    }
    return result ? std::move(result) : std::move(e);
  }
  ExprPtr parse_math1() {
    auto e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token t = next();
      e = binary(t.text, std::move(e), parse_concat(), t.pos);
    }
    return e;
  }
  ExprPtr parse_concat() {
    auto e = parse_math2();
    while (is_op("~")) {
      const Pos p = next().pos;
      e = binary("~", std::move(e), parse_math2(), p);
    }
    return e;
  }
  ExprPtr parse_math2() {
    auto e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token t = next();
      e = binary(t.text, std::move(e), parse_pow(), t.pos);
    }
    return e;
  }
  ExprPtr parse_pow() {
    auto e = parse_unary(true);
    while (is_op("**")) {
      const Pos p = next().pos;
      e = binary("**", std::move(e), parse_unary(true), p);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this, cur().pos);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token t = next();
      e = make(Expr::Kind::kUnary, t.pos);
      e->name = t.text;
      e->children.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token t = cur();
    switch (t.type) {
      case Token::Type::kName: {
        next();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto e = make(Expr::Kind::kLiteral, t.pos);
          e->value = Value::boolean(t.text[0] == 't' || t.text[0] == 'T');
          return e;
        }
        if (t.text == "none" || t.text == "None") {
          auto e = make(Expr::Kind::kLiteral, t.pos);
          e->value = Value::none();
          return e;
        }
        auto e = make(Expr::Kind::kName, t.pos);
        e->name = t.text;
        return e;
      }
      case Token::Type::kString: {
        std::string s;
        while (cur().type == Token::Type::kString) s += next().text;  // adjacent literals join
        auto e = make(Expr::Kind::kLiteral, t.pos);
        e->value = Value::string(std::move(s));
        return e;
      }
      case Token::Type::kInt: {
        next();
        auto e = make(Expr::Kind::kLiteral, t.pos);
        errno = 0;
        const long long v = std::strtoll(t.text.c_str(), nullptr, 10);
        if (errno == ERANGE) fail("integer literal out of range: " + t.text, t.pos);
        e->value = Value::integer(v);
        return e;
      }
      case Token::Type::kFloat: {
        next();
        auto e = make(Expr::Kind::kLiteral, t.pos);
        e->value = Value::number(std::strtod(t.text.c_str(), nullptr));
        return e;
      }
      case Token::Type::kOp:
        if (t.text == "(") {
          next();
          if (is_op(")")) {
            next();
            auto e = make(Expr::Kind::kTuple, t.pos);
            return e;
          }
          auto inner = parse_expression();
          if (is_op(",")) {
            auto tup = make(Expr::Kind::kTuple, t.pos);
            tup->children.push_back(std::move(inner));
            while (is_op(",")) {
              next();
              if (is_op(")")) break;
              tup->children.push_back(parse_expression());
            }
            inner = std::move(tup);
          }
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          next();
          auto e = make(Expr::Kind::kList, t.pos);
          while (!is_op("]")) {
            if (!e->children.empty()) {
              expect_op(",");
              if (is_op("]")) break;
            }
            e->children.push_back(parse_expression());
          }
          next();
          return e;
        }
        if (t.text == "{") {
          next();
          auto e = make(Expr::Kind::kDict, t.pos);
          while (!is_op("}")) {
            if (!e->children.empty()) {
              expect_op(",");
              if (is_op("}")) break;
            }
            e->children.push_back(parse_expression());
            expect_op(":");
            e->children.push_back(parse_expression());
          }
          next();
          return e;
        }
        break;
      default:
        break;
    }
    unexpected("an expression");
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const Pos p = next().pos;
        if (cur().type == Token::Type::kName) {
          auto a = make(Expr::Kind::kAttr, p);
          a->name = next().text;
          a->children.push_back(std::move(e));
          e = std::move(a);
        } else if (cur().type == Token::Type::kInt) {
          auto a = make(Expr::Kind::kItem, p);
          a->children.push_back(std::move(e));
          auto idx = make(Expr::Kind::kLiteral, cur().pos);
          idx->value = Value::integer(std::strtoll(next().text.c_str(), nullptr, 10));
          a->children.push_back(std::move(idx));
          e = std::move(a);
        } else {
          unexpected("an attribute name");
        }
      } else if (is_op("[")) {
        const Pos p = next().pos;
        ExprPtr parts[3];
        int colons = 0;
        while (!is_op("]")) {
          if (is_op(":")) {
            next();
            if (++colons > 2) unexpected("']'");
            continue;
          }
          if (parts[colons]) unexpected("':' or ']'");
          parts[colons] = parse_expression();
        }
        next();
        if (colons == 0) {
          if (!parts[0]) fail("empty subscript", p);
          auto a = make(Expr::Kind::kItem, p);
          a->children.push_back(std::move(e));
          a->children.push_back(std::move(parts[0]));
          e = std::move(a);
        } else {
          auto a = make(Expr::Kind::kSlice, p);
          a->children.push_back(std::move(e));
          for (auto& x : parts) a->children.push_back(std::move(x));
          e = std::move(a);
        }
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Arg> parse_args() {
    std::vector<Arg> args;
    expect_op("(");
    bool kw = false;
    while (!is_op(")")) {
      if (!args.empty()) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) fail("'*args' and '**kwargs' are not supported", cur().pos);
      Arg a;
      if (cur().type == Token::Type::kName && peek().type == Token::Type::kOp &&
          peek().text == "=") {
        a.name = next().text;
        next();
        kw = true;
      } else if (kw) {
        fail("a positional argument after a keyword argument", cur().pos);
      }
      a.value = parse_expression();
      args.push_back(std::move(a));
    }
    next();
    return args;
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = make(Expr::Kind::kCall, callee->pos);  // errors point at what is called
    e->children.push_back(std::move(callee));
    e->args = parse_args();
    return e;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        next();
        const Pos p = cur().pos;
        std::string name = expect_name();
        while (is_op(".")) {
          next();
          name += "." + expect_name();
        }
        if (!known_filters().contains(name)) fail("unknown filter '" + name + "'", p);
        auto f = make(Expr::Kind::kFilter, p);
        f->name = name;
        f->children.push_back(std::move(e));
        if (is_op("(")) f->args = parse_args();
        e = std::move(f);
      } else if (is_name("is")) {
        next();
        auto t = make(Expr::Kind::kTest, cur().pos);
        if (is_name("not")) {
          next();
          t->negate = true;
        }
        const Pos p = cur().pos;
        std::string name = expect_name();
        while (is_op(".")) {
          next();
          name += "." + expect_name();
        }
        if (!known_tests().contains(name)) fail("unknown test '" + name + "'", p);
        t->name = name;
        t->children.push_back(std::move(e));
        if (is_op("(")) {
          t->args = parse_args();
        } else if ((cur().type == Token::Type::kName || cur().type == Token::Type::kString ||
                    cur().type == Token::Type::kInt || cur().type == Token::Type::kFloat ||
                    is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") &&
                   !is_name("in") && !is_name("not")) {
          if (is_name("is")) fail("tests cannot be chained with 'is'", cur().pos);
          Arg a;
          a.value = parse_postfix(parse_primary());
          t->args.push_back(std::move(a));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  friend struct DepthGuard;
  std::vector<Token> t_;
  std::size_t i_ = 0;
  Limits limits_;
  int depth_ = 0;
  int loop_depth_ = 0;  // for loops around the statement being parsed (break, continue)
};

}  // namespace

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

NodePtr parse_template_source(std::string_view source, const Limits& limits) {
  Lexer lexer(source);
  Parser parser(lexer.run(), limits);
  return parser.parse_template();
}

}  // namespace treeattn::jinja
