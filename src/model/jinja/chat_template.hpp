// A model's own chat template (the GGUF's tokenizer.chat_template) rendered into a prompt with the
// Jinja interpreter (jinja.hpp), with the variables Hugging Face transformers passes to
// apply_chat_template: messages, tools (none when absent), documents (none),
// add_generation_prompt, bos_token and eos_token.
//
// The prompt keeps the byte ranges that came from the conversation (message contents and roles,
// tool definitions): only the template's own text may hold special tokens
// (Tokenizer::encode's `plain` ranges), so a user who writes "<|im_start|>" gets those
// characters, not the control token.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/jinja/jinja.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

struct ChatPrompt {
  std::string text;
  std::vector<jinja::Range> data_ranges;  // bytes of `text` from the conversation
};

class ModelTemplate {
 public:
  // kInvalidArgument naming the construct, line and column when the interpreter cannot parse
  // the template (or does not support what it uses).
  static Result<ModelTemplate> parse(std::string_view source, std::string bos_token,
                                     std::string eos_token, const jinja::Limits& limits = {});

  // messages: an array of {"role", "content", ...} objects as the OpenAI API has them; tools:
  // null or an array. kInvalidArgument naming the construct (or the template's own
  // raise_exception message) when the render fails.
  // strip_bos: the tokenizer adds BOS itself, so a BOS text the template writes first (not from
  // the conversation) is removed, as llama.cpp does, rather than doubled.
  Result<ChatPrompt> render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                            bool add_generation_prompt, bool strip_bos = false) const;

  // Every key of `context` (an object) as a variable; bos_token, eos_token and
  // add_generation_prompt are the template's own text, the rest is data. For tests and tools.
  Result<ChatPrompt> render_context(const nlohmann::ordered_json& context) const;

  const std::string& source() const { return source_; }
  // The template reads `tools` or a `tool_calls` (jinja::Template::reads): it can show a
  // request's tools and tool turns to the model. A template that reads neither would drop them.
  bool takes_tools() const { return takes_tools_; }

 private:
  std::shared_ptr<const jinja::Template> tmpl_;
  std::string source_, bos_, eos_;
  bool takes_tools_ = false;
};

namespace jinja {
// A JSON value as a Jinja value; `data`: its strings (and object keys) are the caller's data.
// kMaxValueDepth bounds the nesting (Error beyond it).
Value from_json(const nlohmann::ordered_json& j, bool data);
}  // namespace jinja

}  // namespace treeattn
