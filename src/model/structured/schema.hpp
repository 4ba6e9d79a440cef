// Structured output, part 1: a response format (OpenAI's `response_format`) compiled into a
// Grammar, the graph of value shapes that the matcher (matcher.hpp) follows byte by byte.
//
// Accepted response formats:
//   {"type": "json_object"}: any JSON object.
//   {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: a JSON
//   value that validates against `schema` (absent: any JSON value).
// Supported schema keywords (others are refused, naming the keyword and its path):
//   type (a name or an array of names: object, array, string, number, integer, boolean, null);
//   properties, required, additionalProperties (false, true or a schema);
//   items (a schema), minItems, maxItems; minLength, maxLength (code points);
//   enum, const (any JSON values, with `type` only); anyOf; allOf with one schema; $ref to
//   "#", "#/$defs/NAME" or "#/definitions/NAME", with $defs / definitions; boolean schemas;
//   the annotations title, description, default, examples, $schema, $id, $comment, deprecated,
//   readOnly, writeOnly.
// What the grammar generates is a subset of what validates, chosen so that every prefix it
// accepts can be completed:
//   - an object's properties come in the order the schema's text lists them, each required one
//   present, optional
//     ones possibly left out; keys not in `properties` only when additionalProperties is true or
//     a schema (an absent additionalProperties allows none, as under strict), after the
//     declared ones;
//   - numbers have at most kMaxIntegerDigits digits before the point, kMaxFractionDigits after
//     it and kMaxExponentDigits in the exponent; integers are written without point or exponent;
//   - a run of whitespace between tokens has at most kMaxWhitespace bytes (space, tab, newline);
//     none after the value;
//   - strings are valid UTF-8 without control bytes; \u escapes of surrogates are not written;
//   - enum and const values are written as compact JSON (nlohmann::json::dump).
// `strict` (OpenAI's structured outputs) refuses an additionalProperties other than false.
// A schema that admits no value (an empty enum, a required property whose schema is false,
// minItems above maxItems, ...) is refused, naming its path.
//
// Bounded for hostile schemas: kMaxSchemaDepth nesting of the schema text, kMaxNodes shapes,
// kMaxLiteralBytes of enum/const values in all, kMaxProperties properties per object; the
// matcher nests values at most kMaxNesting deep.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "treeattn/status.hpp"

namespace treeattn::structured {

inline constexpr int kMaxSchemaDepth = 64;
inline constexpr std::size_t kMaxNodes = 8192;
inline constexpr std::size_t kMaxLiteralBytes = std::size_t{1} << 16;
inline constexpr std::size_t kMaxProperties = 1024;
inline constexpr int kMaxNesting = 64;     // open objects and arrays at once
inline constexpr int kAnyMaxNesting = 16;  // ... inside a value the schema leaves free
inline constexpr int kMaxIntegerDigits = 16;
inline constexpr int kMaxFractionDigits = 16;
inline constexpr int kMaxExponentDigits = 2;  // 16 digits times 1e99 is a finite double
inline constexpr int kMaxWhitespace = 24;

enum class Kind : uint8_t { kObject, kArray, kString, kNumber, kInteger, kLiteral, kUnion };

// A byte trie of JSON texts: an object's keys (escaped as in JSON, without the quotes) or a
// set of literal values (true, false, null, enum and const values).
struct TrieNode {
  std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
  int32_t terminal = -1;                          // the key's property index; 0 for a literal
  std::vector<int32_t> below;                     // terminals in this subtree, sorted
  int32_t child(uint8_t c) const;                 // -1: none
};

struct Property {
  std::string key;  // escaped as in JSON, without the quotes
  int32_t node = -1;
  bool required = false;
};

struct Node {
  Kind kind = Kind::kUnion;
  std::vector<Property> props;         // kObject, in the order they are generated
  std::vector<int32_t> next_required;  // kObject: [i] = first required index >= i (or size)
  int32_t additional = -1;             // kObject: other keys' values; -1: no other keys
  int32_t keys = -1;                   // kObject: root of the props' key trie
  int32_t items = -1;                  // kArray
  int64_t min = 0, max = -1;           // kArray items, kString code points; max -1: unbounded
  int32_t literals = -1;               // kLiteral: root of its trie
  std::vector<int32_t> alts;           // kUnion (any value: object, array, string, number, literal)
  int depth_cap = kMaxNesting;         // kObject, kArray: opened only below this nesting
};

struct Grammar {
  std::vector<Node> nodes;
  std::vector<TrieNode> tries;
  int32_t root = -1;
};

// The response format as JSON text (an object with "type"). "text" gives a null grammar (no
// constraint). kInvalidArgument naming the path for anything else it cannot take, e.g.
// "response_format.json_schema.schema.properties.age: unsupported keyword 'minimum'".
Result<std::shared_ptr<const Grammar>> compile_response_format(std::string_view json_text);

}  // namespace treeattn::structured
