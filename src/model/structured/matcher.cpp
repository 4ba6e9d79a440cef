// The byte-level matcher (matcher.hpp).
#include "model/structured/matcher.hpp"

#include <algorithm>
#include <limits>
#include <unordered_map>

namespace treeattn::structured {
namespace {

const Frame kDoneFrame{};

enum ObjectPhase : uint8_t { kObjOpen, kObjNeedKey, kObjColon, kObjAfterValue };
enum ArrayPhase : uint8_t { kArrOpen, kArrNeedItem, kArrAfterItem };
enum NumberPhase : uint8_t {
  kNumStart,
  kNumMinus,
  kNumZero,
  kNumInt,
  kNumDot,
  kNumFrac,
  kNumExp,
  kNumExpSign,
  kNumExpDigits
};

bool is_ws(uint8_t c) { return c == ' ' || c == '\n' || c == '\t'; }
bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// A UTF-8 lead byte: the continuation bytes it needs and the range of the first one.
bool utf8_lead(uint8_t c, uint8_t& count, uint8_t& lo, uint8_t& hi) {
  lo = 0x80;
  hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    count = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    count = 2;
    lo = c == 0xE0 ? 0xA0 : 0x80;
    hi = c == 0xED ? 0x9F : 0xBF;
  } else if (c >= 0xF0 && c <= 0xF4) {
    count = 3;
    lo = c == 0xF0 ? 0x90 : 0x80;
    hi = c == 0xF4 ? 0x8F : 0xBF;
  } else {
    return false;
  }
  return true;
}

bool number_may_end(const Frame& f) {
  return f.phase == kNumZero || f.phase == kNumInt || f.phase == kNumFrac ||
         f.phase == kNumExpDigits;
}

// One byte from the top frames of a state: every stack it leads to, emitted into `out`.
class Step {
 public:
  Step(const Grammar& g, FrameArena& arena, Tops& out) : g_(g), arena_(arena), out_(out) {}

  void feed(const Frame* f, uint8_t c) {
    switch (f->kind) {
      case FrameKind::kDone:
        return;
      case FrameKind::kValue:
        if (is_ws(c)) return whitespace(*f);
        return start(f->parent, f->node, f->depth, c);
      case FrameKind::kObject:
        return object(*f, c);
      case FrameKind::kArray:
        return array(*f, c);
      case FrameKind::kString:
      case FrameKind::kKey:
        return string(*f, c);
      case FrameKind::kNumber:
        return number(*f, c);
      case FrameKind::kLiteral:
        return literal(*f, c);
    }
  }

 private:
  const Node& node(int32_t i) const { return g_.nodes[static_cast<std::size_t>(i)]; }
  const TrieNode& trie(int32_t i) const { return g_.tries[static_cast<std::size_t>(i)]; }

  void emit(const Frame* f) {
    if (out_.size() >= kMaxStacks || std::find(out_.begin(), out_.end(), f) != out_.end()) return;
    out_.push_back(f);
  }
  void emit(const Frame& f) { emit(arena_.make(f)); }

  void whitespace(const Frame& f) {
    if (f.ws >= kMaxWhitespace) return;
    Frame n = f;
    ++n.ws;
    emit(n);
  }

  // The first byte of a value of `id` inside `parent`.
  void start(const Frame* parent, int32_t id, uint8_t depth, uint8_t c) {
    const Node& n = node(id);
    Frame f;
    f.parent = parent;
    f.node = id;
    f.depth = depth;
    switch (n.kind) {
      case Kind::kUnion:
        for (const int32_t alt : n.alts) start(parent, alt, depth, c);
        return;
      case Kind::kObject:
      case Kind::kArray:
        if (c != (n.kind == Kind::kObject ? '{' : '[') || depth + 1 > n.depth_cap) return;
        f.kind = n.kind == Kind::kObject ? FrameKind::kObject : FrameKind::kArray;
        f.depth = static_cast<uint8_t>(depth + 1);
        return emit(f);
      case Kind::kString:
        if (c != '"') return;
        f.kind = FrameKind::kString;
        return emit(f);
      case Kind::kNumber:
      case Kind::kInteger:
        f.kind = FrameKind::kNumber;
        f.phase = kNumStart;
        return number(f, c);
      case Kind::kLiteral:
        f.kind = FrameKind::kLiteral;
        f.a = n.literals;
        return literal(f, c);
    }
  }

  // The declared properties an object may name next: [lo, hi] (empty when lo > hi).
  static std::pair<int32_t, int32_t> candidates(const Node& n, int32_t next) {
    const int32_t size = static_cast<int32_t>(n.props.size());
    const int32_t req = n.next_required[static_cast<std::size_t>(next)];
    return {next, req < size ? req : size - 1};
  }
  static bool extras(const Node& n, int32_t next) {
    return n.additional >= 0 &&
           n.next_required[static_cast<std::size_t>(next)] == static_cast<int32_t>(n.props.size());
  }

  void object(const Frame& f, uint8_t c) {
    const Node& n = node(f.node);
    const auto size = static_cast<int32_t>(n.props.size());
    const bool may_close = n.next_required[static_cast<std::size_t>(f.a)] == size;
    const bool key_left = f.a < size || extras(n, f.a);
    if (is_ws(c)) return whitespace(f);
    Frame x = f;
    x.ws = 0;
    switch (f.phase) {
      case kObjOpen:
      case kObjNeedKey:
        if (c == '}' && f.phase == kObjOpen && may_close) return emit(f.parent);
        if (c != '"' || !key_left) return;
        {
          Frame k;
          k.parent = arena_.make(x);
          k.node = f.node;
          k.kind = FrameKind::kKey;
          k.b = n.keys;
          k.depth = f.depth;
          return emit(k);
        }
      case kObjColon:
        if (c != ':') return;
        x.phase = kObjAfterValue;
        {
          Frame v;
          v.parent = arena_.make(x);
          v.node = f.b >= 0 ? n.props[static_cast<std::size_t>(f.b)].node : n.additional;
          v.kind = FrameKind::kValue;
          v.depth = f.depth;
          return emit(v);
        }
      case kObjAfterValue:
        if (c == '}' && may_close) return emit(f.parent);
        if (c != ',' || !key_left) return;
        x.phase = kObjNeedKey;
        return emit(x);
      default:
        return;
    }
  }

  void array(const Frame& f, uint8_t c) {
    const Node& n = node(f.node);
    if (is_ws(c)) return whitespace(f);
    Frame x = f;
    x.ws = 0;
    if (f.phase == kArrAfterItem) {
      if (c == ']' && f.a >= n.min) return emit(f.parent);
      if (c != ',' || (n.max >= 0 && f.a >= n.max)) return;
      x.phase = kArrNeedItem;
      return emit(x);
    }
    if (c == ']' && f.phase == kArrOpen && n.min == 0) return emit(f.parent);
    if (n.max == 0) return;
    x.phase = kArrAfterItem;
    ++x.a;
    start(arena_.make(x), n.items, f.depth, c);
  }

  // A key's byte (after the string's own checks) against the declared keys it may still be.
  bool key_byte(Frame& k, uint8_t c) {
    if (k.b >= 0) k.b = trie(k.b).child(c);
    const Node& n = node(k.node);
    const int32_t next = k.parent->a;
    if (extras(n, next)) return true;
    if (k.b < 0) return false;
    const auto [lo, hi] = candidates(n, next);
    const auto& below = trie(k.b).below;
    const auto it = std::lower_bound(below.begin(), below.end(), lo);
    return it != below.end() && *it <= hi;
  }

  void close_key(const Frame& k) {
    const Node& n = node(k.node);
    const Frame& obj = *k.parent;
    int32_t declared = -1;
    if (k.b >= 0 && trie(k.b).terminal >= 0) {
      const int32_t p = trie(k.b).terminal;
      const auto [lo, hi] = candidates(n, obj.a);
      if (p < lo || p > hi) return;  // a name already written or passed over
      declared = p;
    } else if (!extras(n, obj.a)) {
      return;
    }
    Frame x = obj;
    x.phase = kObjColon;
    x.ws = 0;
    x.a = declared >= 0 ? declared + 1 : static_cast<int32_t>(n.props.size());
    x.b = declared;
    emit(x);
  }

  void string(const Frame& f, uint8_t c) {
    const bool key = f.kind == FrameKind::kKey;
    const int64_t min = key ? 0 : node(f.node).min;
    const int64_t max = key ? -1 : node(f.node).max;
    Frame n = f;
    if (f.esc == 1) {
      if (c == 'u') {
        n.esc = 2;
      } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' ||
                 c == 'r' || c == 't') {
        n.esc = 0;
      } else {
        return;
      }
    } else if (f.esc >= 2) {
      if (!is_hex(c)) return;
      if (f.esc == 6 && !(c >= '0' && c <= '7')) return;  // \uD800-\uDFFF: a surrogate
      n.esc = f.esc == 2   ? ((c == 'd' || c == 'D') ? 6 : 3)
              : f.esc == 6 ? 4
              : f.esc == 5 ? 0
                           : f.esc + 1;
    } else if (f.u8 > 0) {
      if (c < f.lo || c > f.hi) return;
      --n.u8;
      n.lo = 0x80;
      n.hi = 0xBF;
    } else if (c == '"') {
      if (key) return close_key(f);
      if (f.a >= min) emit(f.parent);
      return;
    } else {
      if (c < 0x20 || (max >= 0 && f.a >= max)) return;
      if (c == '\\') {
        n.esc = 1;
      } else if (c >= 0x80 && !utf8_lead(c, n.u8, n.lo, n.hi)) {
        return;
      }
      ++n.a;
    }
    if (key && !key_byte(n, c)) return;
    emit(n);
  }

  void number(const Frame& f, uint8_t c) {
    const bool integer = node(f.node).kind == Kind::kInteger;
    Frame n = f;
    auto to = [&](uint8_t phase, int32_t digits) {
      n.phase = phase;
      n.a = digits;
      emit(n);
    };
    auto digit = [&](int limit) {  // one more digit of the current part, up to `limit`
      if (f.a < limit) to(f.phase, f.a + 1);
    };
    switch (f.phase) {
      case kNumStart:
      case kNumMinus:
        if (c == '-' && f.phase == kNumStart) return to(kNumMinus, 0);
        if (c == '0') return to(kNumZero, 1);
        if (c >= '1' && c <= '9') return to(kNumInt, 1);
        return;
      case kNumInt:
        if (is_digit(c)) return digit(kMaxIntegerDigits);
        [[fallthrough]];
      case kNumZero:
        if (c == '.' && !integer) return to(kNumDot, 0);
        if ((c == 'e' || c == 'E') && !integer) return to(kNumExp, 0);
        if (is_digit(c)) return;  // no leading zero
        return feed(f.parent, c);
      case kNumDot:
        if (is_digit(c)) to(kNumFrac, 1);
        return;
      case kNumFrac:
        if (is_digit(c)) return digit(kMaxFractionDigits);
        if (c == 'e' || c == 'E') return to(kNumExp, 0);
        return feed(f.parent, c);
      case kNumExp:
      case kNumExpSign:
        if ((c == '+' || c == '-') && f.phase == kNumExp) return to(kNumExpSign, 0);
        if (is_digit(c)) to(kNumExpDigits, 1);
        return;
      case kNumExpDigits:
        if (is_digit(c)) return digit(kMaxExponentDigits);
        return feed(f.parent, c);
      default:
        return;
    }
  }

  void literal(const Frame& f, uint8_t c) {
    const TrieNode& t = trie(f.a);
    const int32_t nx = t.child(c);
    if (nx < 0) {
      if (t.terminal >= 0) feed(f.parent, c);  // the literal ended before c
      return;
    }
    if (trie(nx).terminal >= 0 && trie(nx).next.empty()) return emit(f.parent);
    Frame n = f;
    n.a = nx;
    emit(n);
  }

  const Grammar& g_;
  FrameArena& arena_;
  Tops& out_;
};

}  // namespace

bool string_text(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i++]);
    if (c < 0x20 || c == '"' || c == '\\') return false;
    if (c < 0x80) continue;
    uint8_t count = 0, lo = 0, hi = 0;
    if (!utf8_lead(c, count, lo, hi) || s.size() - i < count) return false;
    for (uint8_t k = 0; k < count; ++k, lo = 0x80, hi = 0xBF) {
      const auto x = static_cast<uint8_t>(s[i++]);
      if (x < lo || x > hi) return false;
    }
  }
  return true;
}

const Frame* FrameArena::make(const Frame& f) {
  if (used_ == kBlock) ++block_, used_ = 0;
  if (block_ == blocks_.size()) blocks_.push_back(std::make_unique<Frame[]>(kBlock));
  Frame* p = &blocks_[block_][used_++];
  *p = f;
  return p;
}

Matcher::Matcher(std::shared_ptr<const Grammar> grammar) : g_(std::move(grammar)) {
  Frame root;
  root.parent = &kDoneFrame;
  root.node = g_->root;
  root.kind = FrameKind::kValue;
  state_ = {arena_.make(root)};
}

void Matcher::feed(const Tops& from, uint8_t c, FrameArena& arena, Tops& out) const {
  out.clear();
  Step step(*g_, arena, out);
  for (const Frame* f : from) step.feed(f, c);
}

bool Matcher::can_end(const Tops& s) const {
  for (const Frame* f : s) {
    if (f->kind == FrameKind::kDone) return true;
    if (f->parent == nullptr || f->parent->kind != FrameKind::kDone) continue;
    if (f->kind == FrameKind::kNumber && number_may_end(*f)) return true;
    if (f->kind == FrameKind::kLiteral && g_->tries[static_cast<std::size_t>(f->a)].terminal >= 0)
      return true;
  }
  return false;
}

bool Matcher::done(const Tops& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(),
                                   [](const Frame* f) { return f->kind == FrameKind::kDone; });
}

int64_t Matcher::plain_room(const Tops& s) const {
  if (s.size() != 1) return -1;
  const Frame& f = *s[0];
  if (f.kind != FrameKind::kString || f.esc != 0 || f.u8 != 0) return -1;
  const int64_t max = g_->nodes[static_cast<std::size_t>(f.node)].max;
  return max < 0 ? std::numeric_limits<int64_t>::max() : max - f.a;
}

bool Matcher::advance(std::string_view bytes) {
  Tops cur = state_, next;
  scratch_.clear();
  for (const char ch : bytes) {
    feed(cur, static_cast<uint8_t>(ch), scratch_, next);
    if (next.empty()) return false;
    cur.swap(next);
  }
  // Copy the stacks into spare_ (sharing kept), which then holds the state.
  spare_.clear();
  std::unordered_map<const Frame*, const Frame*> copied;
  auto copy = [&](auto&& self, const Frame* f) -> const Frame* {
    if (f == nullptr || f->kind == FrameKind::kDone) return f;
    if (auto it = copied.find(f); it != copied.end()) return it->second;
    Frame x = *f;
    x.parent = self(self, f->parent);
    const Frame* p = spare_.make(x);
    copied.emplace(f, p);
    return p;
  };
  for (const Frame*& f : cur) f = copy(copy, f);
  std::swap(arena_, spare_);
  state_ = std::move(cur);
  return true;
}

}  // namespace treeattn::structured
