// One generation run over a sharded KV cache: what `treeattn generate` does between parsing its
// flags and printing its report, as a library call.
//
//   run_generation(comm, request)   collective over comm; every rank calls it with the same
//                                   request (the caller's flags). Loads the model, builds the
//                                   prompt, then either
//     - engine path (request.engine): the prompt as one request of the serving engine
//       (engine.hpp), paged KV over the ranks, prefill by the tree merge in chunks: the same
//       tokens bit for bit as a `treeattn serve` request with the same prompt and sampling; or
//     - session path: a model::Generator (generate.hpp) with one DecodeSession per method: the
//       prefill across the ranks, then method 0 decodes up to new_tokens and every other method
//       decodes as many tokens from the same prefill, with the same sampler draws.
//   The output holds every rank's peak RSS and bytes sent (all-gathered), the tokens, the
//   per-step times and the prefill statistics: everything the CLI's report and JSON print.
//
// Errors are values: Output::status, and Output::must_abort when the ranks may be out of step
// (a collective failed part way: the caller ends the job, no rank may wait for another).
// A divergence of the ranks' token streams is not an error: Output::ranks_agree, divergence.
//
// Hooks (each optional) are called on rank 0 only, except phase/step, called on every rank:
// planned (the choice for "auto"), started (before the prefill), prefill_layer (session path,
// after each layer), text (the decoded text of method 0 as it is produced, never ending inside
// a UTF-8 sequence; what was held back comes at the end).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/generate.hpp"
#include "treeattn/model.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/status.hpp"
#include "treeattn/tokenizer.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/topology.hpp"

namespace treeattn::generation {

// Where the prompt comes from: text (or the file's text), or synthetic_tokens > 0 seeded draws
// among the normal tokens (BOS first when the model adds one), for timing.
struct PromptSpec {
  std::string text;
  std::string file;  // when not empty, the prompt is this file's text
  int64_t synthetic_tokens = 0;
  bool chat = false;                  // wrap in the model's chat format (format_chat)
  std::optional<std::string> system;  // with chat; absent: the template's default
  uint64_t seed = 1;                  // of the synthetic draws
};

// `file` names something a prompt can be read from (before the model is loaded).
Status check_prompt_file(const std::string& path);
// The prompt's token ids, the same on every rank.
Result<std::vector<TokenId>> make_prompt(const PromptSpec& spec, const Tokenizer& tok);


struct Request {
  std::string model_path;
  PromptSpec prompt;
  int64_t new_tokens = 64;
  bool ignore_eos = false;
  model::SamplingParams sampling;
  model::MatmulMode matmul = model::MatmulMode::kInt8;
  // The rows8 copy of the quantized matrices (model.hpp; --no-rows8: false): the session path's
  // LlamaModel::pack_rows8 after loading, the engine's of the rows it computes with.
  bool rows8 = true;
  Isa isa = Isa::kAuto;  // the CPU kernel target of the matmul and attention kernels
  DType kv_dtype = DType::kF16;
  int threads = 1;  // per rank
  std::chrono::milliseconds timeout{600000};

  bool engine = false;
  // engine: one strategy that merges a batch of states, or "auto" (EngineConfig::merge).
  // Session path: strategies, "auto" allowed (the planner's choice on `topology`,
  // choose_strategy).
  std::vector<std::string> methods = {"auto"};
  // engine only
  std::size_t kv_memory = 0;  // 0: the pages this prompt needs on each rank, and a few more
  int64_t kv_window_pages = -1;  // EngineConfig::kv_window_pages
  std::string prefill_exchange = "auto";
  // The engine's dense layers (EngineConfig::dense): split, replicated or auto.
  std::string dense = "auto";
  std::string topology_file;  // EngineConfig::topology: what "auto" plans on (empty: the job)
  // Hash every generated token's logits (Output::logits_hash), to compare the bits of runs; the
  // engine then copies each token's logits to rank 0's callback.
  bool hash_logits = false;
  // session path only
  ShardKind placement = ShardKind::kEven;
  KVLayout kv_layout = KVLayout::kAuto;
  int fanout = 2;  // hier's fan-out (both paths)
  bool synthetic_kv = false;  // fill the prompt's KV with seeded values (needs a synthetic prompt)
  bool check = false;         // compare the ranks' token-stream hashes after every step
  // What "auto" plans on; absent: this job as the communicator shows it (job_topology_of,
  // session.hpp), as the engine path does without topology_file.
  std::optional<Topology> topology;
  int ranks_per_node = 1;
};

// The Generator's configuration for the session path (methods as requested).
model::GeneratorConfig generator_config(const Request& request);

// What started() is told (rank 0).
struct Start {
  const model::LlamaConfig* config = nullptr;
  int ranks = 0;
  int threads = 0;
  int64_t prompt_tokens = 0;
  std::vector<std::string> methods;             // resolved (session path) or {merge} (engine)
  int64_t page_tokens = 0, pages_per_rank = 0;  // engine
  std::string merge_description;                // engine: describe_merge(merge_choice())
  std::string dense_description;                // engine: describe_dense(dense_choice())
};

struct Hooks {
  std::function<void(const StrategyChoice&)> planned;  // "auto" was resolved (session path)
  std::function<void(const Start&)> started;
  std::function<void(int layer, int layers, double seconds)> prefill_layer;
  std::function<void(std::string_view)> text;
  std::function<void(const std::string&)> phase;  // every rank: what it is doing now
  std::function<void(int64_t)> step;              // every rank: decode step of method 0
};

struct MethodResult {
  std::string method;
  std::vector<TokenId> tokens;
  std::vector<double> step_ms;  // per decode step
  double decode_s = 0;
  int first_diff = -1;  // first token differing from method 0's, -1: none
  std::vector<double> bytes_sent_per_token_by_rank;
};

// A divergence caught by Request::check, after `tokens` tokens.
struct Divergence {
  std::size_t tokens = 0;
  int rank = 0;
  uint64_t hash = 0, hash_rank0 = 0;
};

struct Output {
  Status status;
  bool must_abort = false;  // the ranks may be out of step: end the job

  std::vector<TokenId> prompt;
  std::string config_text;  // the model's configuration (LlamaConfig::to_string)
  std::string text;         // method 0's tokens decoded (empty when they do not decode)
  std::optional<Divergence> check_divergence;
  std::vector<uint64_t> peak_rss_by_rank;

  // session path
  std::vector<MethodResult> methods;
  double ttft_ms = 0, prefill_s = 0;
  model::PrefillStats prefill;  // rank 0's
  std::vector<double> prefill_busy_s_by_rank, prefill_attention_s_by_rank;
  std::vector<int64_t> prefill_positions_by_rank;
  uint64_t token_hash = 0;
  bool ranks_agree = true;
  std::vector<uint64_t> token_hash_by_rank;

  // engine path (rank 0 only)
  std::vector<TokenId> tokens;
  std::vector<double> token_ms;  // between consecutive tokens
  int64_t cached_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  double bytes_per_token = 0;  // rank 0's, decode steps
  std::vector<uint64_t> bytes_sent_by_rank;
  int64_t merges = 0, rows_pass_q = 0, rows_kv_exchange = 0;
  uint64_t bytes_sent_rank0 = 0;
  engine::MergeChoice merge_choice;  // the merge the engine ran and why
  engine::DenseChoice dense_choice;  // how the dense layers ran (rank 0's figures) and why
  // Per rank: the resident bytes of the model file's mapping (what that rank's computation
  // touched of the weights) plus its own rows8 copy, at the end of the run.
  std::vector<uint64_t> weights_resident_by_rank;
  // Per rank, ms per decode step: the dense part, the paged attention, and the merge with the
  // all-gathers (q/k/v; with dense split every matrix group's), from EngineMetrics.
  std::vector<double> decode_dense_ms_by_rank, decode_attention_ms_by_rank, decode_comm_ms_by_rank;
  // Request::hash_logits: a 64-bit hash of every generated token's logits bits, in order, as 16
  // hex digits (empty otherwise).
  std::string logits_hash;
  // KV pages: per rank, and the most in use over all ranks at a token (full pages: every
  // position of the global layers; window pages: sliding-window layers, 0 when none) with their
  // bytes (pages x page_tokens x the layers' K/V bytes per token).
  int64_t page_tokens = 0, pages_per_rank = 0, window_pages_per_rank = 0;
  int64_t pages_used_peak = 0, window_pages_used_peak = 0;
  uint64_t kv_bytes_used_peak = 0, window_kv_bytes_used_peak = 0;
};

Output run_generation(Communicator& comm, const Request& request, const Hooks& hooks = {});

}  // namespace treeattn::generation
