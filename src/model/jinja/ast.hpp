// The parsed template (parse.cpp builds it, render.cpp walks it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/jinja/jinja.hpp"

namespace treeattn::jinja {

// Appends code point cp (< 0x110000) to out as UTF-8 (parse.cpp: string escapes; render.cpp:
// case mapping).
void append_utf8(std::string& out, uint32_t cp);

struct Pos {
  int line = 0;
  int column = 0;
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

// The variable that holds a filter block's rendered body (not a name a template can write).
inline constexpr const char* kBlockInput = "\x01filter-block";

struct Arg {
  std::string name;  // empty: positional
  ExprPtr value;
};

struct Expr {
  enum class Kind {
    kLiteral,    // value
    kName,       // name
    kList,       // children
    kTuple,      // children
    kDict,       // children: key, value, key, value...
    kAttr,       // children[0] . name
    kItem,       // children[0] [ children[1] ]
    kSlice,      // children[0] [ children[1] : children[2] : children[3] ] (null: absent)
    kCall,       // children[0] ( args )
    kFilter,     // children[0] | name ( args ); children empty for a filter block's input
    kTest,       // children[0] is [not] name ( args ); negate
    kUnary,      // op children[0]: "not", "-", "+"
    kBinary,     // children[0] op children[1]
    kCondition,  // children[1] if children[0] else children[2] (children[2] null: undefined)
  };
  Kind kind;
  Pos pos;
  Value value;
  std::string name;  // kName, kAttr, kFilter, kTest; kUnary/kBinary: the operator
  bool negate = false;
  std::vector<ExprPtr> children;
  std::vector<Arg> args;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Node {
  enum class Kind {
    kBody,      // children
    kText,      // text
    kOutput,    // expr
    kIf,        // conds[i] -> bodies[i]; bodies.size() == conds.size() + 1 for an else
    kFor,       // targets in expr [if cond]: bodies[0]; bodies[1]: else (optional)
    kSet,       // targets (names) / attr target = expr; or block set: bodies[0]
    kMacro,     // name(params): bodies[0]
    kCallBlock, // expr is the call; params: caller's parameters; bodies[0] caller body
    kBreak,
    kContinue,
    kFilterBlock,  // {% filter f(args) | g %} bodies[0] {% endfilter %}: expr filters kBlockInput
  };
  Kind kind;
  Pos pos;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<ExprPtr> conds;
  std::vector<NodePtr> bodies;
  std::vector<NodePtr> children;
  std::vector<std::string> targets;
  std::string attr;    // kSet: `set ns.attr = ...`
  std::string name;    // kMacro
  std::vector<MacroParam> params;
  bool block = false;  // kSet: block set
};

}  // namespace treeattn::jinja
