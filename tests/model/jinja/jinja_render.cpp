// jinja_render TEMPLATE CONTEXT.json: renders the template with the context's keys as variables
// (ModelTemplate::render_context) and writes the text to stdout, or the error to stderr with
// exit 1. --ranges: writes the data ranges after the text as JSON on stderr.
// jinja_render TEMPLATE --batch CONTEXTS.jsonl: one context per line; writes one JSON line per
// context, {"text": ...} or {"error": ...} (exit 1 only when the template does not parse). The
// conformance test (conformance.py) compares its output with jinja2's.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "model/jinja/chat_template.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: jinja_render TEMPLATE CONTEXT.json [--ranges]\n";
    return 2;
  }
  const auto slurp = [](const char* path, std::string& out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return false;
    std::stringstream ss;
    ss << in.rdbuf();
    out = ss.str();
    return true;
  };
  std::string tmpl, ctx;
  const bool batch = std::string(argv[2]) == "--batch";
  if (batch && argc < 4) {
    std::cerr << "usage: jinja_render TEMPLATE --batch CONTEXTS.jsonl\n";
    return 2;
  }
  if (!slurp(argv[1], tmpl) || !slurp(argv[batch ? 3 : 2], ctx)) {
    std::cerr << "jinja_render: cannot read the inputs\n";
    return 2;
  }
  auto t = treeattn::ModelTemplate::parse(tmpl, "", "");
  if (!t.is_ok()) {
    std::cerr << t.status().message() << "\n";
    return 1;
  }
  if (batch) {
    std::stringstream lines(ctx);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty()) continue;
      nlohmann::ordered_json out;
      auto c = nlohmann::ordered_json::parse(line, nullptr, false);
      if (c.is_discarded()) {
        std::cerr << "jinja_render: bad context JSON line\n";
        return 2;
      }
      auto r = t->render_context(c);
      if (r.is_ok())
        out["text"] = r->text;
      else
        out["error"] = r.status().message();
      std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
    return 0;
  }
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(ctx);
  } catch (const std::exception& e) {
    std::cerr << "jinja_render: bad context JSON: " << e.what() << "\n";
    return 2;
  }
  auto r = t->render_context(j);
  if (!r.is_ok()) {
    std::cerr << r.status().message() << "\n";
    return 1;
  }
  std::fwrite(r->text.data(), 1, r->text.size(), stdout);
  if (argc > 3 && std::string(argv[3]) == "--ranges") {
    nlohmann::json ranges = nlohmann::json::array();
    for (const auto& [a, b] : r->data_ranges) ranges.push_back({a, b});
    std::cerr << ranges.dump() << "\n";
  }
  return 0;
}
