// Response bodies and server-sent events (format.hpp).
#include "serve/format.hpp"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <random>

namespace treeattn::serve {

using nlohmann::json;

std::string make_response_id(Endpoint endpoint) {
  // A per-process random base plus a counter: unique without a lock.
  static const uint64_t base = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  static std::atomic<uint64_t> counter{0};
  const uint64_t n = counter.fetch_add(1, std::memory_order_relaxed);
  return fmt::format("{}{:016x}{:08x}", endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-", base,
                     static_cast<uint32_t>(n));
}

std::string tool_call_id_base(const ResponseMeta& meta) {
  const std::size_t dash = meta.id.find('-');
  return "call_" + (dash == std::string::npos ? meta.id : meta.id.substr(dash + 1));
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return dump(json{{"error", err}});
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json timings_json(const TimingsInfo& t) {
  const auto& r = t.timings;
  const double decode_ms = r.decode_seconds * 1e3;
  return {{"queue_ms", r.queue_seconds * 1e3},
          {"prefill_ms", r.prefill_seconds * 1e3},
          {"decode_ms", decode_ms},
          {"decode_ms_per_token",
           t.generated_tokens > 1 ? decode_ms / static_cast<double>(t.generated_tokens - 1) : 0.0},
          {"prompt_tokens", r.prompt_tokens},
          {"cached_tokens", r.cached_tokens},
          {"generated_tokens", t.generated_tokens},
          {"ranks", t.ranks},
          {"method", t.method},
          {"bytes_sent_per_token", t.bytes_sent_per_token}};
}

namespace {

json finish_json(Finish f) {
  if (f == Finish::kNone) return nullptr;
  return finish_name(f);
}

json envelope(const ResponseMeta& meta, bool chunk) {
  const bool chat = meta.endpoint == Endpoint::kChat;
  return {
      {"id", meta.id},
      {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
      {"created", meta.created},
      {"model", meta.model},
      {"system_fingerprint", "treeattn"}};
}

json choice(const ResponseMeta& meta, int index, const std::string* text, bool delta, Finish finish,
            const json& logprobs = nullptr) {
  json c = {{"index", index}};
  if (meta.endpoint == Endpoint::kChat) {
    json m = json::object();
    if (!delta) m["role"] = "assistant";
    if (text != nullptr) m["content"] = *text;
    c[delta ? "delta" : "message"] = std::move(m);
  } else {
    c["text"] = text != nullptr ? *text : std::string();
  }
  c["logprobs"] = logprobs;
  c["finish_reason"] = finish_json(finish);
  return c;
}

json tool_calls_json(std::span<const ToolCall> calls, bool with_index) {
  json a = json::array();
  for (std::size_t i = 0; i < calls.size(); ++i) {
    json c = json::object();
    if (with_index) c["index"] = i;
    c["id"] = calls[i].id;
    c["type"] = "function";
    c["function"] = {{"name", calls[i].name}, {"arguments", calls[i].arguments}};
    a.push_back(std::move(c));
  }
  return a;
}

json bytes_of(const std::string& s) {
  json b = json::array();
  for (const char ch : s) b.push_back(static_cast<unsigned char>(ch));
  return b;
}

}  // namespace

json logprobs_json(Endpoint endpoint, std::span<const TokenLogprob> tokens, const Codec& codec) {
  if (endpoint == Endpoint::kChat) {
    json content = json::array();
    for (const TokenLogprob& t : tokens) {
      const std::string text = codec.token_text(t.token);
      json top = json::array();
      for (const auto& [id, lp] : t.lp.top) {
        const std::string tt = codec.token_text(id);
        top.push_back({{"token", tt}, {"logprob", lp}, {"bytes", bytes_of(tt)}});
      }
      content.push_back({{"token", text},
                         {"logprob", t.lp.logprob},
                         {"bytes", bytes_of(text)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  json toks = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (const TokenLogprob& t : tokens) {
    const std::string text = codec.token_text(t.token);
    toks.push_back(text);
    lps.push_back(t.lp.logprob);
    json top = json::object();
    for (const auto& [id, lp] : t.lp.top) top[codec.token_text(id)] = lp;
    top[text] = t.lp.logprob;
    tops.push_back(std::move(top));
    offsets.push_back(t.text_offset);
  }
  return {{"tokens", std::move(toks)},
          {"token_logprobs", std::move(lps)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

std::string completion_body(const ResponseMeta& meta, const Completion& c) {
  json j = envelope(meta, false);
  json choices = json::array();
  for (std::size_t i = 0; i < c.choices.size(); ++i) {
    const ChoiceOut& o = c.choices[i];
    json ch = choice(meta, static_cast<int>(i), &o.text, false, o.finish, o.logprobs);
    if (!o.tool_calls.empty() && meta.endpoint == Endpoint::kChat) {
      json& m = ch["message"];
      if (o.text.empty()) m["content"] = nullptr;
      m["tool_calls"] = tool_calls_json(o.tool_calls, false);
    }
    if (o.token_ids != nullptr) ch["token_ids"] = *o.token_ids;
    choices.push_back(std::move(ch));
  }
  j["choices"] = std::move(choices);
  j["usage"] = usage_json(c.usage);
  if (c.prompt_ids != nullptr) j["prompt_token_ids"] = *c.prompt_ids;
  if (!c.timings.is_null()) j["timings"] = c.timings;
  return dump(j);
}

std::string sse_data(const json& j) { return "data: " + dump(j) + "\n\n"; }
std::string sse_done() { return "data: [DONE]\n\n"; }
std::string sse_comment(std::string_view text) { return ": " + std::string(text) + "\n\n"; }

json chunk_role(const ResponseMeta& meta, int index) {
  json j = envelope(meta, true);
  json c = {{"index", index},
            {"delta", {{"role", "assistant"}, {"content", ""}}},
            {"logprobs", nullptr},
            {"finish_reason", nullptr}};
  j["choices"] = json::array({std::move(c)});
  return j;
}

json chunk_text(const ResponseMeta& meta, const std::string& text, int index,
                const json& logprobs) {
  json j = envelope(meta, true);
  j["choices"] = json::array({choice(meta, index, &text, true, Finish::kNone, logprobs)});
  return j;
}

json chunk_tool_calls(const ResponseMeta& meta, std::span<const ToolCall> calls, int index) {
  json j = envelope(meta, true);
  json c = {{"index", index},
            {"delta", {{"tool_calls", tool_calls_json(calls, true)}}},
            {"logprobs", nullptr},
            {"finish_reason", nullptr}};
  j["choices"] = json::array({std::move(c)});
  return j;
}

json chunk_finish(const ResponseMeta& meta, Finish finish, const json& timings,
                  const std::vector<TokenId>* token_ids, int index) {
  json j = envelope(meta, true);
  json c = choice(meta, index, nullptr, true, finish);
  if (token_ids != nullptr) c["token_ids"] = *token_ids;
  j["choices"] = json::array({std::move(c)});
  if (!timings.is_null()) j["timings"] = timings;
  return j;
}

json chunk_usage(const ResponseMeta& meta, const Usage& usage) {
  json j = envelope(meta, true);
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return j;
}

std::string models_body(std::span<const std::string> model_ids, int64_t created,
                        const json& meta) {
  json data = json::array();
  for (const std::string& id : model_ids) {
    json m = {{"id", id}, {"object", "model"}, {"created", created}, {"owned_by", "treeattn"}};
    if (!meta.is_null()) m["meta"] = meta;
    data.push_back(std::move(m));
  }
  return dump(json{{"object", "list"}, {"data", std::move(data)}});
}

std::string tokenize_body(std::span<const TokenId> ids, const Codec& codec, bool with_pieces) {
  json tokens = json::array();
  for (const TokenId id : ids) {
    if (!with_pieces) {
      tokens.push_back(id);
      continue;
    }
    const std::string text = codec.token_text(id);
    Utf8Assembler utf8;  // valid UTF-8 passes through whole
    json piece = utf8.push(text) == text && utf8.held() == 0 ? json(text) : bytes_of(text);
    tokens.push_back({{"id", id}, {"piece", std::move(piece)}});
  }
  return dump(json{{"tokens", std::move(tokens)}});
}

}  // namespace treeattn::serve
