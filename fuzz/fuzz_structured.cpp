// libFuzzer target: structured output (src/model/structured) on arbitrary response formats. The
// input is a response_format's JSON text, optionally followed by a NUL byte and bytes that
// steer a walk. Every format must either compile or be refused with a message naming the path
// (deep nesting, huge enums, recursive references and unsatisfiable schemas included), within
// the compiler's limits. A compiled grammar then drives a TokenConstraint over a small
// vocabulary (every single byte, some JSON-shaped pieces, a control token and an end token):
// at each of up to 64 steps the mask must keep a token (never nothing: every accepted prefix
// can be completed), the steering byte picks one of the kept tokens, and accept() must take it;
// an end token is only kept where the output is a complete value.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "model/structured/constraint.hpp"

namespace {

const std::shared_ptr<const treeattn::structured::Vocabulary>& vocabulary() {
  static const auto v = [] {
    std::vector<std::string> pieces;
    for (int c = 0; c < 256; ++c) pieces.emplace_back(1, static_cast<char>(c));
    for (const char* p :
         {"{\"",  "\":",  "\",",  "\"}",      "true",  "false",    "null", "\": \"", "  ",
          "\n  ", "12",   "3.",   "e+",       "\\u00", "\xc3\xa9", "[\"",  "\"]",    "}}",
          "]}",   ", \"", "\":[", "\xe2\x82", "abc\"", "x\\\"",    "-0",   "[]",     "{}"})
      pieces.emplace_back(p);
    pieces.emplace_back();  // a control token: no bytes
    pieces.emplace_back();  // the end token
    const auto end = static_cast<treeattn::TokenId>(pieces.size() - 1);
    return std::make_shared<const treeattn::structured::Vocabulary>(
        pieces, std::vector<treeattn::TokenId>{end});
  }();
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  using treeattn::structured::TokenConstraint;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = in.find('\0');
  const std::string_view format = in.substr(0, nul);
  const std::string_view steer = nul == std::string_view::npos ? "" : in.substr(nul + 1);
  auto g = treeattn::structured::compile_response_format(format);
  if (!g.is_ok()) {
    if (g.status().message().find("response_format") != 0) std::abort();  // names the path
    return 0;
  }
  if (*g == nullptr) return 0;  // text
  const auto& vocab = vocabulary();
  TokenConstraint tc(*g, vocab);
  std::vector<float> logits(static_cast<std::size_t>(vocab->size()));
  for (std::size_t step = 0; step < 64; ++step) {
    std::fill(logits.begin(), logits.end(), 0.0f);
    tc.mask(logits);
    std::vector<treeattn::TokenId> kept;
    for (treeattn::TokenId t = 0; t < vocab->size(); ++t)
      if (logits[static_cast<std::size_t>(t)] == 0.0f) kept.push_back(t);
    if (kept.empty()) std::abort();
    const bool can_end = tc.complete();
    for (const treeattn::TokenId t : vocab->end_tokens())
      if ((logits[static_cast<std::size_t>(t)] == 0.0f) != can_end) std::abort();
    const auto pick = step < steer.size() ? static_cast<uint8_t>(steer[step]) : 0;
    const treeattn::TokenId t = kept[pick % kept.size()];
    const auto r = tc.accept(t);
    if (r == TokenConstraint::Step::kRefused) std::abort();
    if (r == TokenConstraint::Step::kEnded) break;
  }
  return 0;
}
