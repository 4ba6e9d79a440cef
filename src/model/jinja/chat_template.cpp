// The model's chat template over a conversation (chat_template.hpp).
#include "model/jinja/chat_template.hpp"

namespace treeattn {

namespace jinja {
Value from_json(const nlohmann::ordered_json& j, bool data) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
    case nlohmann::ordered_json::value_t::discarded:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::number(static_cast<double>(u));
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>(), data);
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(from_json(x, data));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::dict();
      d.dict_mut().data_keys = data;
      for (const auto& [k, x] : j.items()) d.dict_mut().set(k, from_json(x, data));
      return d;
    }
    case nlohmann::ordered_json::value_t::binary:
      throw Error("binary JSON values are not supported");
  }
  return Value();
}
}  // namespace jinja

Result<ModelTemplate> ModelTemplate::parse(std::string_view source, std::string bos_token,
                                           std::string eos_token, const jinja::Limits& limits) {
  ModelTemplate t;
  try {
    t.tmpl_ = std::make_shared<const jinja::Template>(jinja::Template::parse(source, limits));
  } catch (const jinja::Error& e) {
    return invalid_argument(std::string("chat template: ") + e.what());
  } catch (const std::exception& e) {  // std::bad_alloc and the like: still an answer
    return internal_error(std::string("chat template: the interpreter failed: ") + e.what());
  }
  t.source_ = std::string(source);
  t.takes_tools_ = t.tmpl_->reads("tools") || t.tmpl_->reads("tool_calls");
  t.bos_ = std::move(bos_token);
  t.eos_ = std::move(eos_token);
  return t;
}

Result<ChatPrompt> ModelTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                         bool add_generation_prompt, bool strip_bos) const {
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = messages;
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  ctx["bos_token"] = bos_;
  ctx["eos_token"] = eos_;
  auto r = render_context(ctx);
  if (!r.is_ok() || !strip_bos || bos_.empty() || !r->text.starts_with(bos_)) return r;
  const auto n = static_cast<uint32_t>(bos_.size());
  if (!r->data_ranges.empty() && r->data_ranges.front().first < n) return r;
  r->text.erase(0, n);
  for (auto& [a, b] : r->data_ranges) {
    a -= n;
    b -= n;
  }
  return r;
}

Result<ChatPrompt> ModelTemplate::render_context(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) return invalid_argument("chat template: the context must be an object");
  try {
    std::map<std::string, jinja::Value, std::less<>> vars;
    for (const auto& [k, v] : context.items()) {
      const bool markup = k == "bos_token" || k == "eos_token" || k == "add_generation_prompt";
      vars[k] = jinja::from_json(v, !markup);
    }
    jinja::RenderOutput out = tmpl_->render(vars);
    return ChatPrompt{std::move(out.text), std::move(out.data_ranges)};
  } catch (const jinja::Error& e) {
    return invalid_argument(std::string("chat template: ") + e.what());
  } catch (const std::exception& e) {  // std::bad_alloc and the like: still an answer
    return internal_error(std::string("chat template: the interpreter failed: ") + e.what());
  }
}

}  // namespace treeattn
