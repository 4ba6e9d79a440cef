// libFuzzer target: `treeattn serve`'s request parser (src/serve/api.hpp) on arbitrary bodies.
// The first input byte picks the endpoint (bit 0: chat or completions; bits 3-4: 1 the body of
// /tokenize, 2 of /detokenize instead) and the limits given to the length check; the rest is the
// body. /tokenize and /detokenize bodies are parsed, tokenized or checked against the vocabulary,
// and answered as JSON. A refused body must give a 400 whose error body is
// JSON with the four OpenAI fields; an accepted one is taken through what the server does
// next: the chat template, the prompt over a byte-level codec, the length check, and its
// prompt's bytes as generated tokens through the UTF-8 assembler and the stop strings, whose
// output must be valid UTF-8 and never contain a stop string, with each text token's logprobs
// handed out once, in order (logprobs asked for). The sampling fields (n, min_p, the penalties,
// logit_bias, logprobs) must be within their ranges, logit_bias's ids checked against the
// vocabulary, and the response body with n choices JSON. The byte-count pre-check
// (check_prompt_bytes) must never refuse a prompt the token count accepts.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "serve/api.hpp"
#include "serve/byte_codec.hpp"
#include "serve/format.hpp"
#include "serve/text.hpp"
#include "serve/tool_calls.hpp"

namespace {

using namespace treeattn;
using namespace treeattn::serve;

void check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const Endpoint ep = (data[0] & 1) != 0 ? Endpoint::kChat : Endpoint::kCompletion;
  const int64_t context = (data[0] & 2) != 0 ? 64 : 0;
  const int64_t pool = (data[0] & 4) != 0 ? 100 : 1 << 20;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  auto refused = [](const ApiError& e) {
    check(e.status == 400 && !e.message.empty());
    const auto j = nlohmann::json::parse(error_body(e));
    for (const char* k : {"message", "type", "param", "code"}) check(j["error"].contains(k));
  };
  testing::ByteCodec codec;
  if ((data[0] & 0x18) == 0x08) {  // /tokenize
    auto t = parse_tokenize(body);
    if (auto* e = std::get_if<ApiError>(&t)) return refused(*e), 0;
    const TokenizeRequest& tr = std::get<TokenizeRequest>(t);
    auto ids = codec.tokenize(tr.content, tr.add_special, tr.parse_special);
    check(ids.is_ok());
    const auto j = nlohmann::json::parse(tokenize_body(*ids, codec, tr.with_pieces));
    check(j["tokens"].size() == ids->size());
    return 0;
  }
  if ((data[0] & 0x18) == 0x10) {  // /detokenize
    auto d = parse_detokenize(body, codec.n_vocab());
    if (auto* e = std::get_if<ApiError>(&d)) return refused(*e), 0;
    for (const TokenId id : std::get<std::vector<TokenId>>(d))
      check(id >= 0 && id < codec.n_vocab());
    return 0;
  }
  auto parsed = parse_request(ep, body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return refused(*e), 0;
  const ParsedRequest& r = std::get<ParsedRequest>(parsed);
  check(!r.max_tokens || *r.max_tokens >= 1);
  check(r.temperature >= 0 && r.temperature <= 2 && r.top_p >= 0 && r.top_p <= 1);
  check(r.stop.size() <= kMaxStopStrings);
  check(!r.timeout || (*r.timeout > 0 && *r.timeout <= 86400));
  if (ep == Endpoint::kChat) {
    // Tools and tool turns through a template that takes them (the transcript below refuses
    // them): a prompt or a 400, never a crash. The last message's content read as an answer
    // that may hold calls, whole and streamed in pieces: the calls' arguments are JSON objects,
    // an answer without calls is its content, and the stream sends exactly the content.
    static const ChatTemplate tool_template = [] {
      ChatTemplate t;
      t.model = std::make_shared<const ModelTemplate>(
          ModelTemplate::parse("{{ tools | tojson }}{% for m in messages %}{{ m.role }}:"
                               "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function "
                               "| tojson }}{% endfor %}{{ m.tool_call_id }}{% endfor %}",
                               "", "")
              .value());
      return t;
    }();
    auto rendered = render_chat_prompt(r, tool_template);
    if (auto* e = std::get_if<ApiError>(&rendered)) check(e->status == 400);
    const std::string& answer = r.messages.back().content;
    const ToolCallReading read = read_tool_calls(answer, r.tools, "c");
    for (const ToolCall& call : read.calls)
      check(nlohmann::json::parse(call.arguments).is_object());
    if (read.calls.empty()) check(read.content == answer);
    ToolCallStream stream(r.tools, "c");
    std::string sent;
    const std::size_t piece = 1 + data[0] % 7;
    for (std::size_t i = 0; i < answer.size(); i += piece) sent += stream.push(answer.substr(i, piece));
    const ToolCallReading end = stream.finish();
    check(sent + end.content == read.content && end.calls.size() == read.calls.size());
  }
  // The sampling fields within their ranges; logit_bias ascending, distinct, in [-100, 100],
  // and its ids checked against the vocabulary with a 400 naming it.
  check(r.n >= 1 && r.n <= kMaxChoices && r.logprobs >= -1 && r.logprobs <= 20);
  check(r.min_p >= 0 && r.min_p <= 1 && r.repetition_penalty >= 0.01 &&
        r.repetition_penalty <= 100);
  check(std::fabs(r.presence_penalty) <= 2 && std::fabs(r.frequency_penalty) <= 2);
  check(r.logit_bias.size() <= kMaxLogitBias);
  for (std::size_t i = 0; i < r.logit_bias.size(); ++i) {
    const auto [id, bias] = r.logit_bias[i];
    check(id >= 0 && std::fabs(bias) <= 100 && (i == 0 || id > r.logit_bias[i - 1].first));
  }
  if (auto e = check_logit_bias(r, codec.n_vocab())) {
    check(e->param == "logit_bias");
    return refused(*e), 0;
  }
  ChatTemplate chat;
  chat.default_system = "S";
  auto prompt = build_prompt(r, codec, chat);
  if (auto* e = std::get_if<ApiError>(&prompt)) {
    check(e->status == 400);
    return 0;
  }
  const auto& ids = std::get<std::vector<TokenId>>(prompt);
  check(!ids.empty());
  // /apply-template's text is the chat prompt's bytes.
  if (ep == Endpoint::kChat) {
    auto text = render_chat_prompt(r, chat);
    check(std::holds_alternative<std::string>(text) &&
          testing::bytes_of(std::get<std::string>(text)) == ids);
  }
  auto max_new = check_lengths(r, static_cast<int64_t>(ids.size()), context, pool);
  // The byte-count pre-check (before tokenizing) refuses only what the token count refuses;
  // the chat template's pieces join to its text.
  if (check_prompt_bytes(r, codec.max_token_bytes(), context, pool))
    check(std::holds_alternative<ApiError>(max_new));
  if (ep == Endpoint::kChat) {
    auto prompt = chat.render_prompt(r.messages);
    check(prompt.is_ok());
    check(prompt->text == chat.render(r.messages));
    uint32_t last = 0;  // the contents' ranges: sorted, disjoint, inside the text
    for (const auto& [a, b] : prompt->data_ranges) {
      check(a >= last && a < b && b <= prompt->text.size());
      last = b;
    }
  }
  if (auto* n = std::get_if<int64_t>(&max_new)) {
    check(*n >= 1);
    if (context > 0) check(static_cast<int64_t>(ids.size()) + *n <= context);
    check(static_cast<int64_t>(ids.size()) + *n <= pool);
  }
  // The prompt's bytes as a generation, ended by the end token; with logprobs, one per token
  // that is text, in order, offsets ascending.
  Generation g(codec, r.stop, r.logprobs >= 0);
  std::size_t handed = 0;
  for (std::size_t i = 0; i < ids.size() && !g.done(); ++i) {
    engine::TokenEvent ev;
    ev.token = ids[i] < 256 ? ids[i] : 'x';
    ev.logprobs.logprob = -static_cast<double>(i);
    handed += g.on_event(ev).logprobs.size();
  }
  engine::TokenEvent end;
  end.token = testing::kByteEos;
  end.finish = engine::FinishReason::kStop;
  handed += g.on_event(end).logprobs.size();
  check(g.done());
  const std::string& text = g.text();
  Utf8Assembler u;  // valid UTF-8 passes through unchanged
  check(u.push(text) == text && u.held() == 0);
  for (const std::string& s : r.stop) check(text.find(s) == std::string::npos);
  const auto& lps = g.logprobs();
  check(r.logprobs >= 0 || lps.empty());
  for (std::size_t i = 1; i < lps.size(); ++i)
    check(lps[i].text_offset >= lps[i - 1].text_offset &&
          lps[i].lp.logprob < lps[i - 1].lp.logprob);
  check(handed == lps.size());
  for (const TokenLogprob& l : lps) check(l.text_offset <= static_cast<int64_t>(text.size()));
  // And the response body it would make is JSON, with its n choices.
  ResponseMeta meta{ep, "id", 0, "m"};
  Completion c;
  for (int i = 0; i < r.n; ++i)
    c.choices.push_back({text, Finish::kStop, nullptr,
                         r.logprobs >= 0 ? logprobs_json(ep, lps, codec) : nlohmann::json()});
  const auto body_json = nlohmann::json::parse(completion_body(meta, c));
  check(body_json["choices"].size() == static_cast<std::size_t>(r.n));
  return 0;
}
