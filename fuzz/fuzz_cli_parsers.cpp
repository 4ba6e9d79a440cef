// libFuzzer target: the CLI's value parsers (cli/options.hpp) on arbitrary text: sizes and size
// lists ("64k", "1.5M", "1k,4k"), counts, comma lists and the --inject spec. Each must return a
// value or a Status, never crash, throw or overflow, and what they accept must be consistent:
// a size is in [0, 9e15] and format_size of it parses back to it; an accepted --inject spec
// prints as text that parses back to the same spec; a list's items are its non-empty parts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "options.hpp"

namespace {

void check(bool ok, const char* what, const std::string& input) {
  if (ok) return;
  std::fprintf(stderr, "%s for input '%s'\n", what, input.c_str());
  __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  using namespace treeattn::cli;
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 5) {
    case 0: {
      auto v = parse_size(text);
      if (v.is_ok()) {
        check(*v >= 0 && *v <= 9'000'000'000'000'000, "size out of range", text);
        auto again = parse_size(format_size(*v));
        check(again.is_ok() && *again == *v, "format_size does not parse back", text);
      }
      break;
    }
    case 1: {
      auto v = parse_size_list(text);
      if (v.is_ok()) {
        check(!v->empty(), "empty list accepted", text);
        check(v->size() == split_list(text).size(), "list length differs from its items", text);
      }
      break;
    }
    case 2: {
      auto v = parse_count(text, 1'000'000'000);
      if (v.is_ok()) check(*v >= 0 && *v <= 1'000'000'000, "count out of range", text);
      break;
    }
    case 3: {
      std::size_t total = 0;
      for (const auto& item : split_list(text)) {
        check(!item.empty() && item.find(',') == std::string::npos, "bad list item", text);
        total += item.size();
      }
      check(total <= text.size(), "list items longer than the text", text);
      break;
    }
    case 4: {
      auto v = parse_inject(text);
      if (v.is_ok()) {
        check(v->rank >= 0, "negative rank", text);
        auto again = parse_inject(v->to_string());
        check(again.is_ok() && again->kind == v->kind && again->rank == v->rank &&
                  again->step == v->step && again->ms == v->ms,
              "--inject spec does not print back", text);
      }
      break;
    }
  }
  return 0;
}
