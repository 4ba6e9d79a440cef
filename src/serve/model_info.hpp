// What `treeattn serve` tells its clients about the model it serves (/v1/models, the chat
// template, the "meta" facts a load test sizes itself by), from the loaded model, its tokenizer
// and the engine over it.
#pragma once

#include <cstdint>
#include <string>

#include "serve/server.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/model.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::serve {

// 2 x the multiply-adds of one token's projections, feed-forward network and output head.
int64_t matmul_flops_per_token(const model::LlamaConfig& c);

// The ModelInfo of model_path served by `engine` (configured with `config`, over `ranks`
// ranks): id = the file's name, context = `context` (0: the model's training context), the
// chat template of the file with the tokenizer's chat format, and meta: n_ctx, n_ctx_train,
// ranks, merge (the strategy that merges; merge_requested, merge_how, merge_batch_invariant,
// merge_candidates: auto's ranking with predicted per-layer times), kv_dtype, page_tokens, kv_pages_per_rank, max_sequence_tokens, max_batch,
// threads_per_rank, weight_bytes_per_token, kv_bytes_per_token, matmul_flops_per_token,
// attention_flops_per_token_per_position.
ModelInfo engine_model_info(const std::string& model_path, const model::LlamaModel& model,
                            const Tokenizer& tokenizer, const engine::Engine& engine,
                            const engine::EngineConfig& config, int ranks, int64_t context);

}  // namespace treeattn::serve
