// libFuzzer target: the chat template interpreter (src/model/jinja) on arbitrary templates. The
// input is a template, optionally followed by a NUL byte and a JSON object of variables (the
// conversation); without one (or when it is not JSON) a fixed conversation with a system
// message, turns, a tool call and tools is used. Every template must either parse and render
// or fail with an Error naming the construct (ModelTemplate's Result), within the limits: small
// ones here (depth 32, 64 KiB of output, 20,000 loop iterations) so that hostile templates
// (deep nesting, huge loops, recursion through macros, self-referencing namespaces) hit them
// quickly. The data ranges of the output must be sorted, disjoint and inside the text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "model/jinja/chat_template.hpp"

namespace {

const nlohmann::ordered_json& default_context() {
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Hi <|im_start|> {{ x }}"},
      {"role": "assistant", "content": "",
       "tool_calls": [{"id": "call12345", "type": "function",
                       "function": {"name": "f", "arguments": {"a": 1, "b": [true, null, 2.5]}}}]},
      {"role": "tool", "content": "ok", "tool_call_id": "call12345"},
      {"role": "user", "content": " caf\u00e9 \u2603 "}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d",
               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})");
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = in.find('\0');
  const std::string_view source = in.substr(0, nul);
  nlohmann::ordered_json ctx = default_context();
  if (nul != std::string_view::npos) {
    auto parsed = nlohmann::ordered_json::parse(in.substr(nul + 1), nullptr, false);
    if (!parsed.is_discarded() && parsed.is_object()) ctx = std::move(parsed);
  }
  treeattn::jinja::Limits limits;
  limits.max_depth = 32;
  limits.max_output = 64 << 10;
  limits.max_iterations = 20000;
  auto t = treeattn::ModelTemplate::parse(source, "<s>", "</s>", limits);
  if (!t.is_ok()) {
    if (t.status().message().empty()) std::abort();
    return 0;
  }
  auto r = t->render_context(ctx);
  if (!r.is_ok()) {
    if (r.status().message().empty()) std::abort();
    return 0;
  }
  if (r->text.size() > limits.max_output) std::abort();
  uint32_t end = 0;
  for (const auto& [a, b] : r->data_ranges) {
    if (a < end || b <= a || b > r->text.size()) std::abort();
    end = b;
  }
  return 0;
}
