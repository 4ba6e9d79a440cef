// Distributed generation with a Llama model: the prompt's KV cache sharded over the ranks of a
// communicator, decode through a DecodeSession (session.hpp) per layer.
//
// Every rank holds the whole model (the weights are mapped from one file, shared by the ranks of
// a node) and the KV cache of the positions its session places on it.
//
// Prefill (Generator::prefill), layer by layer on every rank:
//   1. compute placement: the prompt is cut into blocks of kPrefillBlock positions aligned on
//      global positions, and the blocks are dealt to the ranks longest-processing-time first
//      (the latest, costliest block to the least loaded rank) under the cost model
//      cost(position t) = 1 + w t, w = prefill_position_weight() (the attention multiply-adds a
//      position adds per token, relative to the projections'). Causal attention work grows with
//      the position, so a contiguous split would give the last rank up to (2p-1)/p times the
//      mean work; this assignment is within 2% of the mean from 8k tokens at p <= 7 (at 4k and
//      p = 7, 5%: 64 blocks over 7 ranks), better than a zig-zag of 2p segments (8% at 8k, p = 7).
//   2. each rank projects its positions (q, k, v), rounds k and v to the cache dtype and the
//      ranks all-gather them: after it every rank has the layer's whole K and V. For this model
//      class that is cheap next to the compute: a position's K and V are 2 * n_head_kv *
//      head_dim values (768 bytes for SmolLM2 in f16), against ~3.5 M multiply-adds of
//      projections and ~35 * pos multiply-adds of attention per layer.
//   3. the owner of each position under the session's placement stores its K and V (so the
//      compute placement and the storage placement are independent: `single`, even and the
//      contiguous placements tree-det needs all work);
//   4. each rank computes causal attention for its query blocks against K/V [0, block end) with
//      the decode kernel (decode_partial with q_len = block, one block per thread), then the
//      output projection and the feed-forward network.
//   The rank holding the last block broadcasts the final hidden state; every rank computes the
//   logits. Every value a position gets is computed by the same operations whatever the rank
//   count (the blocks are aligned globally; matmul bits do not depend on batching, model.hpp;
//   the attention kernel merges fixed chunks in a fixed order), so the prefill gives the same
//   bits on 1 rank or 16.
// Decode (Generator::step): every rank embeds the token and computes the same small vectors;
// per layer the session grows by the new position (its owner stores K and V) and attend()
// merges the ranks' partial states through the session's strategy; the logits are then the
// same bits on every rank (strategies deliver bit-identical results), so every rank samples the
// same token and none is broadcast. With strategy tree-det the logits are also the same bits for
// any rank count.
//
// Several methods: GeneratorConfig::methods may name several strategies; each gets its own
// session (placement `single` for `single`, else the configured one), the prefill stores into all
// of them, and step(token, m) decodes through session m, so methods can be compared on one
// prefill (the benchmarks do).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/model.hpp"
#include "treeattn/session.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/status.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::model {

inline constexpr int64_t kPrefillBlock = 64;

// Token selection from logits, in two stages, each a pure function of its inputs (the logits
// bits, the parameters, the token history and the number of draws so far), so every rank of a
// job picks the same token without communicating.
//
// Sampler::process, the logits a token is drawn from (vLLM's order):
//   1. logit_bias: bias[id] added to the logit of id;
//   2. repetition_penalty r over every token id seen in the history (prompt and output, the
//      whole of both: vLLM's window; llama.cpp's default looks at the last 64): a positive
//      logit is divided by r, a negative one multiplied by r (vLLM's and llama.cpp's rule);
//   3. frequency_penalty and presence_penalty over the output only (OpenAI's definition):
//      logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c[j] the times j
//      was generated so far.
// Each stage computes a logit in double from the float it is given and rounds it to float.
// Sampler::sample, one token from processed logits: temperature 0 is greedy (the largest
// logit, the lowest id on a tie); otherwise the candidates in a total order (descending logit,
// ascending id), the top_k first ones (0: all), of those the ones whose probability (softmax
// of logits / temperature, in double) is at least min_p times the largest one's, then the
// smallest prefix of those whose renormalized probability reaches top_p, then one draw from a
// splitmix64 stream seeded with `seed`.
struct SamplingParams {
  double temperature = 0.0;
  int top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 0;
  double min_p = 0.0;               // [0, 1]
  double presence_penalty = 0.0;    // [-2, 2]
  double frequency_penalty = 0.0;   // [-2, 2]
  double repetition_penalty = 1.0;  // [0.01, 100]; 1: none
  // (token id, bias in [-100, 100]), ids ascending and distinct.
  std::vector<std::pair<TokenId, double>> logit_bias;
  // n_vocab > 0: the bias ids must be inside [0, n_vocab).
  Status validate(int64_t n_vocab = 0) const;
  bool penalized() const {
    return presence_penalty != 0.0 || frequency_penalty != 0.0 || repetition_penalty != 1.0;
  }
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : p_(params), state_(params.seed) {}
  // The processed logits (stage 1 above) for the next token of `history`: the prompt (its
  // first prompt_len ids) then the tokens generated so far. `logits` itself when no bias or
  // penalty applies, else the sampler's buffer (valid until the next call). The counts are
  // kept across calls and extended by the ids past the previous call's history, for a caller
  // that passes one sequence's growing history (a shorter history or another prompt length
  // starts them over), so they are those of `history` alone.
  std::span<const float> process(std::span<const float> logits, std::span<const TokenId> history,
                                 int64_t prompt_len);
  // One token from processed logits (stage 2 above); one draw unless greedy.
  TokenId sample(std::span<const float> logits);

 private:
  void absorb(std::span<const TokenId> history, int64_t prompt_len);
  double uniform();
  SamplingParams p_;
  uint64_t state_;
  // The history absorbed so far: its length and prompt length, each id's count in the output,
  // and the ids seen anywhere (prompt or output) once each.
  std::size_t absorbed_ = 0;
  int64_t prompt_len_ = -1;
  std::unordered_map<TokenId, int64_t> output_counts_;
  std::unordered_set<TokenId> seen_;
  std::vector<float> processed_;
};

// The most top logprobs a request may ask for (OpenAI's limit).
inline constexpr int kMaxTopLogprobs = 20;

// Log-probabilities under softmax(logits) over the whole vocabulary, in double: the chosen
// token's, and the `top` most likely tokens' in the sampler's total order (descending logit,
// ascending id).
struct TokenLogprobs {
  double logprob = 0;
  std::vector<std::pair<TokenId, double>> top;
};
TokenLogprobs token_logprobs(std::span<const float> logits, TokenId chosen, int top);

// The largest and second largest logit (ids and values): the "near tie" measure.
struct TopTwo {
  TokenId first = -1, second = -1;
  float first_logit = 0, second_logit = 0;
  float gap() const { return first_logit - second_logit; }
};
TopTwo top_two(std::span<const float> logits);

struct GeneratorConfig {
  std::vector<std::string> methods = {"tree"};  // strategies (strategy.hpp), one session each
  ShardKind placement = ShardKind::kEven;       // for every method but `single`
  // The sessions' KV layout (sharding.hpp); kAuto: tiled for every method that reads either
  // layout, rows for ring-kv and tree-det.
  KVLayout kv_layout = KVLayout::kAuto;
  DType kv_dtype = DType::kF16;
  int threads = 0;  // matmul and attention threads per rank (0: OpenMP's default)
  Isa isa = Isa::kAuto;
  // The quantized weights' matmul (model.hpp): int8 activations by default, exact for the
  // float64 comparisons. Every rank of a job must use the same.
  MatmulMode matmul = MatmulMode::kInt8;
  int64_t reserve_tokens = 0;  // decode steps expected after the prefill (slots kept free)
  int fanout = 2;              // hier
  std::chrono::milliseconds timeout{600000};  // per communicator operation; 0 = forever
};

// Bytes one rank needs, estimated before anything is allocated: its KV shards of every session
// (the largest over ranks), the prefill's working set (its positions' activations, the
// all-gathered K/V of one layer) and the decode buffers.
struct MemoryEstimate {
  std::size_t kv_bytes = 0;
  std::size_t prefill_bytes = 0;
  std::size_t total() const { return kv_bytes + prefill_bytes; }
};
MemoryEstimate estimate_memory(const LlamaConfig& cfg, const GeneratorConfig& gen, int ranks,
                               int64_t prompt_tokens, int64_t new_tokens);

// The weight w of the prefill cost model: 2 n_head head_dim (attention multiply-adds per earlier
// position) over the multiply-adds of a layer's projections per token (3.3e-4 for SmolLM2).
double prefill_position_weight(const LlamaConfig& cfg);
// Which prompt positions rank `rank` of `ranks` computes in the prefill (the balanced blocks
// above), ascending.
std::vector<int64_t> prefill_positions(int64_t prompt_tokens, int ranks, int rank,
                                       double position_weight);

struct PrefillStats {
  double seconds = 0;
  int64_t positions_computed = 0;  // by this rank
  uint64_t bytes_sent = 0;         // by this rank (communicator counters)
  double attention_seconds = 0;    // this rank's time in the prefill attention
  double wait_seconds = 0;         // this rank's time in the all-gathers and broadcast
};

class Generator {
 public:
  // Collective over comm (it creates the sessions). model and comm must outlive it.
  static Result<std::unique_ptr<Generator>> create(Communicator& comm, const LlamaModel& model,
                                                   const GeneratorConfig& config);
  ~Generator();

  // Collective. Computes the prompt across the ranks (see the file comment), stores its K/V in
  // every session and leaves the logits of its last position in `logits` on every rank.
  // progress(layer_done, layers) is called on every rank after each layer.
  Status prefill(std::span<const TokenId> prompt, std::vector<float>& logits,
                 const std::function<void(int, int)>& progress = {});
  // Collective, for decode benchmarks at long contexts: lays out n positions like prefill() but
  // fills their K/V with seeded values in [-1, 1) instead of computing them (no model work, no
  // communication). The text decoded after it is meaningless; its speed is that of a real one
  // (attention reads every cached value whatever it is).
  Status prefill_synthetic(int64_t n, uint64_t seed);
  // Collective. Runs `token` at the next position through session `method` and leaves the
  // logits of that position in `logits` on every rank.
  Status step(TokenId token, std::vector<float>& logits, int method = 0);

  int methods() const { return static_cast<int>(sessions_.size()); }
  const std::string& method(int m) const { return config_.methods[static_cast<std::size_t>(m)]; }
  DecodeSession& session(int m) { return *sessions_[static_cast<std::size_t>(m)]; }
  int64_t length(int m = 0) const { return sessions_[static_cast<std::size_t>(m)]->length(0); }
  const PrefillStats& prefill_stats() const { return prefill_stats_; }
  const LlamaModel& model() const { return *model_; }
  Communicator& comm() const { return *comm_; }

 private:
  Generator() = default;
  Status prefill_layer_attention(const float* q, const std::vector<int64_t>& pos, const void* k,
                                 const void* v, int64_t n, float* out);

  Communicator* comm_ = nullptr;
  const LlamaModel* model_ = nullptr;
  GeneratorConfig config_;
  MatvecOptions mv_;
  std::vector<std::unique_ptr<DecodeSession>> sessions_;
  PrefillStats prefill_stats_;
  ForwardScratch scratch_;
  std::vector<float> x_, q_, k_, v_, attn_;  // decode step buffers
};

}  // namespace treeattn::model
