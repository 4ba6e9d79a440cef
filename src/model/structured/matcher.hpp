// Structured output, part 2: the byte-level matcher of a Grammar (schema.hpp), a pushdown
// automaton whose stack is a chain of Frames.
//
// A frame is one value being written: a value not yet begun (kValue: whitespace may come
// first), an object (its phase, the next property it may write, the property whose value comes
// next), an array (its phase, the items so far), a string or an object's key (code points so
// far, the UTF-8 and escape state, for a key the node of the key trie), a number (its phase and
// the digits of the current part) or a literal (the node of its trie). Its parent is the value
// it is inside; the bottom is the shared kDone frame: a stack whose top is kDone holds a
// complete value, after which no byte may come. Frames are immutable: feeding a byte makes new
// top frames over the same parents, so a state is copied by copying pointers and the token
// walk (constraint.hpp) tries every byte from one state without undoing anything.
//
// A state is a set of stacks (Tops), at most kMaxStacks: an anyOf whose alternatives start with
// the same byte follows them all until the bytes tell them apart (a stack beyond the cap is
// dropped, which only narrows the output). A number or a literal that may still grow ("12",
// or "1" of enum [1, 12]) stays on top until a byte it cannot take, which is then fed to its
// parent.
//
// Every state the matcher reaches can be completed (the grammar's unsatisfiable parts are pruned
// and every phase's checks look ahead: a ',' only when another property or item may follow, a
// key's byte only when a property it may still name starts with it), so a constrained
// generation never reaches a state where no token is allowed.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "model/structured/schema.hpp"

namespace treeattn::structured {

enum class FrameKind : uint8_t { kDone, kValue, kObject, kArray, kString, kKey, kNumber, kLiteral };

struct Frame {
  const Frame* parent = nullptr;
  int32_t node = -1;  // the grammar node (kKey: the object's)
  // kObject: the next property it may write; kArray: items so far; kString, kKey: code points
  // so far; kNumber: digits of the current part; kLiteral: its trie node
  int32_t a = 0;
  int32_t b = -1;  // kObject: the property whose value comes next (-1: another key's); kKey: key
                   // trie node (-1: no declared key)
  FrameKind kind = FrameKind::kDone;
  uint8_t phase = 0;
  uint8_t ws = 0;                // whitespace bytes in the current run
  uint8_t esc = 0;               // kString, kKey: 1 after '\', 2..6 inside \uXXXX
  uint8_t u8 = 0;                // kString, kKey: UTF-8 continuation bytes still expected ...
  uint8_t lo = 0x80, hi = 0xBF;  // ... and the range of the next one
  uint8_t depth = 0;             // objects and arrays open at or below this frame
};

// Frames in blocks; clear() keeps the blocks for the next walk.
class FrameArena {
 public:
  const Frame* make(const Frame& f);
  void clear() { block_ = 0, used_ = 0; }

 private:
  static constexpr std::size_t kBlock = 4096;
  std::vector<std::unique_ptr<Frame[]>> blocks_;
  std::size_t block_ = 0, used_ = 0;
};

inline constexpr std::size_t kMaxStacks = 32;
using Tops = std::vector<const Frame*>;  // the top frame of each stack

// Whether `s` may stand inside a string as it is, from one character's start: complete UTF-8
// characters, none of them '"', '\' or a control character.
bool string_text(std::string_view s);

class Matcher {
 public:
  explicit Matcher(std::shared_ptr<const Grammar> grammar);

  const Tops& state() const { return state_; }
  // The stacks after byte c from `from`, into `out` (cleared first; empty: c cannot follow).
  void feed(const Tops& from, uint8_t c, FrameArena& arena, Tops& out) const;
  // The bytes so far are a complete value (an end of generation may follow).
  bool can_end(const Tops& s) const;
  // A complete value after which no byte may follow.
  static bool done(const Tops& s);
  // Code points string text (string_text) may still add: the state is one stack inside a string
  // (not a key) between characters; -1 otherwise.
  int64_t plain_room(const Tops& s) const;
  // Feeds `bytes` and keeps the result; false (and no change) when one cannot follow.
  bool advance(std::string_view bytes);

 private:
  std::shared_ptr<const Grammar> g_;
  Tops state_;
  FrameArena arena_, spare_;  // state_'s frames; the next state's while it is copied
  FrameArena scratch_;
};

}  // namespace treeattn::structured
