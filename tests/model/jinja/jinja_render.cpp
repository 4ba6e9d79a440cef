// jinja_render TEMPLATE CONTEXT.json: renders the template with the context's keys as variables
// (ModelTemplate::render_context) and writes the text to stdout, or the error to stderr with
// exit 1. --ranges: writes the data ranges after the text as JSON on stderr. The conformance test
// (conformance.py) compares its output with jinja2's.
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
  if (!slurp(argv[1], tmpl) || !slurp(argv[2], ctx)) {
    std::cerr << "jinja_render: cannot read the inputs\n";
    return 2;
  }
  auto t = treeattn::ModelTemplate::parse(tmpl, "", "");
  if (!t.is_ok()) {
    std::cerr << t.status().message() << "\n";
    return 1;
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
