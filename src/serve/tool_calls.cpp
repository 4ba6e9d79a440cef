// Reading tool calls out of an answer (tool_calls.hpp).
#include "serve/tool_calls.hpp"

#include <algorithm>
#include <optional>
#include <nlohmann/json.hpp>

namespace treeattn::serve {
namespace {

bool known_function(const nlohmann::ordered_json& tools, const std::string& name) {
  if (!tools.is_array()) return false;
  return std::any_of(tools.begin(), tools.end(), [&](const nlohmann::ordered_json& t) {
    const auto f = t.find("function");
    if (f == t.end() || !f->is_object()) return false;
    const auto n = f->find("name");
    return n != f->end() && n->is_string() && *n == name;
  });
}

bool blank(std::string_view s) {
  return s.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

// One call object: {"name": a known function, "arguments": an object}.
std::optional<ToolCall> call_of(const nlohmann::ordered_json& j,
                                const nlohmann::ordered_json& tools) {
  const auto name = j.is_object() ? j.find("name") : j.end();
  const auto args = j.is_object() ? j.find("arguments") : j.end();
  if (name == j.end() || !name->is_string() || args == j.end() || !args->is_object() ||
      !known_function(tools, name->get<std::string>()))
    return std::nullopt;
  return ToolCall{{}, name->get<std::string>(), args->dump()};
}

std::string_view trim(std::string_view s) {
  const std::size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string_view::npos) return {};
  return s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
}

// An answer that is nothing but call objects (whitespace between them, at most one ```json
// fence around them): the calls; none otherwise.
std::vector<ToolCall> bare_calls(std::string_view text, const nlohmann::ordered_json& tools) {
  std::string_view t = trim(text);
  if (t.starts_with("```")) {
    const std::size_t nl = t.find('\n');
    if (nl == std::string_view::npos || !t.ends_with("```") || t.size() < nl + 4) return {};
    const std::string_view lang = trim(t.substr(3, nl - 3));
    if (!lang.empty() && lang != "json") return {};
    t = trim(t.substr(nl + 1, t.size() - 3 - (nl + 1)));
  }
  std::vector<ToolCall> calls;
  while (!t.empty()) {
    if (t.front() != '{') return {};
    const std::size_t end = scan_json(t, /*first_only=*/true).first_end;
    if (end == 0) return {};
    try {
      auto call = call_of(nlohmann::ordered_json::parse(t.substr(0, end)), tools);
      if (!call) return {};
      calls.push_back(std::move(*call));
    } catch (const nlohmann::json::exception&) {
      return {};
    }
    t = trim(t.substr(end));
  }
  return calls;
}

void number(std::vector<ToolCall>& calls, std::string_view id_base) {
  for (std::size_t i = 0; i < calls.size(); ++i)
    calls[i].id = std::string(id_base) + "_" + std::to_string(i);
}

}  // namespace

ToolCallReading read_tool_calls(std::string_view text, const nlohmann::ordered_json& tools,
                                std::string_view id_base) {
  ToolCallReading out;
  const std::size_t first = text.find(kToolCallOpen);
  if (first == std::string_view::npos) {
    out.calls = bare_calls(text, tools);
    number(out.calls, id_base);
    if (out.calls.empty()) out.content = std::string(text);
    return out;
  }
  std::vector<ToolCall> calls;
  std::size_t at = first;
  bool ok = true;
  while (ok && at != std::string_view::npos) {
    const std::size_t body = at + kToolCallOpen.size();
    const std::size_t close = text.find(kToolCallClose, body);
    const std::string_view json_text =
        text.substr(body, close == std::string_view::npos ? std::string_view::npos : close - body);
    ok = false;
    try {
      if (auto call = call_of(nlohmann::ordered_json::parse(json_text), tools)) {
        calls.push_back(std::move(*call));
        ok = true;
      }
    } catch (const nlohmann::json::exception&) {
    }
    if (close == std::string_view::npos) break;
    // After a block: another block, or text to the end (dropped).
    const std::size_t next = text.find(kToolCallOpen, close + kToolCallClose.size());
    if (next != std::string_view::npos &&
        !blank(text.substr(close + kToolCallClose.size(), next - close - kToolCallClose.size())))
      break;  // prose between calls: what follows is not read as calls
    at = next;
  }
  if (!ok || calls.empty()) {
    out.content = std::string(text);
    return out;
  }
  out.content = blank(text.substr(0, first)) ? std::string() : std::string(text.substr(0, first));
  out.calls = std::move(calls);
  number(out.calls, id_base);
  return out;
}

std::size_t tool_call_free_prefix(std::string_view text, std::size_t from) {
  const std::size_t lead = text.find_first_not_of(" \t\r\n");
  if (lead == std::string_view::npos) return 0;  // blank so far: what comes decides
  if (text[lead] == '{' || text[lead] == '`') return 0;  // may be bare calls
  std::size_t cut = text.find(kToolCallOpen, std::min(from, text.size()));
  if (cut == std::string_view::npos) {
    // The longest tail that is a proper prefix of "<tool_call>" is held back.
    cut = text.size();
    for (std::size_t k = std::min(text.size(), kToolCallOpen.size() - 1); k > 0; --k)
      if (text.substr(text.size() - k) == kToolCallOpen.substr(0, k)) {
        cut = text.size() - k;
        break;
      }
  }
  // Blank text before a call is no content (read_tool_calls): it is not sent either.
  return lead >= cut ? 0 : cut;
}

std::string ToolCallStream::push(std::string_view more) {
  text_ += more;
  const std::size_t free = tool_call_free_prefix(text_, sent_);
  if (free <= sent_) return {};
  std::string out = text_.substr(sent_, free - sent_);
  sent_ = free;
  return out;
}

ToolCallReading ToolCallStream::finish() const {
  ToolCallReading r = read_tool_calls(text_, *tools_, id_base_);
  // What was sent is content either way: the calls' content is a prefix of the text (before the
  // first block), and without calls the content is the whole text.
  r.content = r.content.size() > sent_ ? r.content.substr(sent_) : std::string();
  return r;
}

}  // namespace treeattn::serve
