// The served model's description (model_info.hpp).
#include "serve/model_info.hpp"

#include <ctime>
#include <filesystem>

namespace treeattn::serve {

int64_t matmul_flops_per_token(const model::LlamaConfig& c) {
  const int64_t e = c.n_embd, kv = c.n_head_kv * c.head_dim, q = c.n_head * c.head_dim;
  const int64_t layer = e * q + 2 * e * kv + q * e + 3 * e * c.n_ff;
  return 2 * (c.n_layers * layer + c.n_vocab * e);
}

ModelInfo engine_model_info(const std::string& model_path, const model::LlamaModel& model,
                            const Tokenizer& tokenizer, const engine::Engine& engine,
                            const engine::EngineConfig& ec, int ranks, int64_t context) {
  const model::LlamaConfig& cfg = model.config();
  ModelInfo info;
  info.id = std::filesystem::path(model_path).filename().string();
  info.created = static_cast<int64_t>(std::time(nullptr));
  info.context = context > 0 ? context : cfg.n_ctx_train;
  info.chat = ChatTemplate::from_model(tokenizer);
  info.ranks = ranks;
  const engine::MergeChoice& mc = engine.merge_choice();
  info.method = mc.strategy;
  const engine::EngineMetrics em = engine.metrics();
  // The merge and, for auto, every candidate's predicted per-layer time (rank 0's ranking).
  nlohmann::json candidates = nlohmann::json::array();
  for (const PlanEntry& e : mc.ranking)
    candidates.push_back({{"method", e.prediction.strategy},
                          {"predicted_layer_us", e.prediction.latency_us},
                          {"predicted_comm_us", e.prediction.comm_us},
                          {"feasible", e.feasible}});
  info.meta = {
      {"n_ctx", info.context},
      {"n_ctx_train", cfg.n_ctx_train},
      {"ranks", ranks},
      {"merge", mc.strategy},
      {"merge_requested", ec.merge},
      {"merge_how", mc.how},
      {"merge_batch_invariant", mc.batch_invariant},
      {"merge_candidates", candidates},
      {"dense", engine.dense_choice().mode()},
      {"dense_requested", ec.dense},
      {"dense_how", engine.dense_choice().how},
      {"dense_predicted_split_us", engine.dense_choice().predicted_split_us},
      {"dense_predicted_replicated_us", engine.dense_choice().predicted_replicated_us},
      {"weight_bytes_rank0", engine.dense_choice().weight_bytes},
      {"kv_dtype", std::string(dtype_name(ec.kv_dtype))},
      {"page_tokens", ec.page_tokens},
      {"kv_pages_per_rank", em.pages_per_rank},
      {"kv_window_pages_per_rank", em.window_pages_per_rank},
      {"max_sequence_tokens", engine.max_sequence_tokens()},
      {"max_batch", ec.max_batch},
      {"threads_per_rank", ec.threads},
      // For the limits of a load test (bench/serve/loadgen.py): what one decoded token reads of
      // the weights, its KV bytes over all layers, its matmul flops.
      {"weight_bytes_per_token", model.weight_bytes_per_token()},
      {"kv_bytes_per_token",
       cfg.n_layers * cfg.n_head_kv *
           static_cast<int64_t>(kv_head_token_bytes(static_cast<std::size_t>(cfg.head_dim),
                                                    ec.kv_dtype))},
      {"matmul_flops_per_token", matmul_flops_per_token(cfg)},
      {"attention_flops_per_token_per_position", 4 * cfg.n_layers * cfg.n_head * cfg.head_dim}};
  return info;
}

}  // namespace treeattn::serve
