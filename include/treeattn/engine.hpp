// The serving engine: many requests decoded together over one KV cache sharded over the ranks
// of a communicator, in pages, with prefix reuse.
//
// Every rank of the job creates an Engine over the same model and configuration. Rank 0 takes
// requests (submit, cancel: thread-safe, from any thread, e.g. HTTP handlers), schedules them
// and broadcasts one step description per step; every rank applies it identically and runs the
// same batched forward pass, so every rank samples the same tokens and nothing else is sent.
// Tokens come out on rank 0 through each request's callback, on the thread that runs the steps.
//
// The KV cache (paged_kv.hpp): every rank keeps, per layer, a pool of pages of page_tokens
// tokens. Logical page j of a sequence (positions [j T, (j + 1) T)) lives on rank j mod p. The
// page table, the free lists of every rank and the prefix index are replicated: every rank
// applies the same step descriptions to them in the same order, so each rank knows where every
// page is without a page table ever being sent, and rank 0 knows every rank's free pages when it
// admits a request. A rank stores K/V only in the pages it owns.
//
// One step = one forward pass over a batch of rows: a chunk of prompt tokens for each sequence
// still prefilling (at most prefill_chunk tokens over all of them) and one token for each
// sequence decoding. With replicated dense layers (EngineConfig::dense) the rows are split over
// the ranks: rank r embeds and projects rows [r R/p, (r+1) R/p) (rounded up). Per layer: each
// rank projects q, k, v of its rows and the ranks all-gather them ((n_head + 2 n_head_kv)
// head_dim floats per row); the owners store k and v into their pages; every rank computes the
// partial states of every row's queries over its own pages in one kernel pass
// (decode_partial_paged); one merge per layer combines the ranks' states of all rows
// (EngineConfig::merge); each rank then runs the output projection and the feed-forward network
// for its own rows. Each rank computes the logits of its own rows that
// end a sequence's known tokens, an all-gather gives every rank all of them (one row on its
// own is computed by every rank), and every rank samples the same tokens. That is pass-Q: a
// follow-up against cached pages is prefilled by the tree merge, the new queries travel and the
// cached K/V stays where it is. A chunk for which moving K/V costs fewer bytes (a fresh prompt,
// the first chunks of a long one; EngineConfig::prefill_exchange) goes the other way: the
// all-gather carries its rows' k and v only, the ranks all-gather their pages of its sequence,
// and each rank computes its own rows' attention alone, per owner's pages and merged locally
// in the merge's association (src/engine/exchange.hpp), so its bits are pass-Q's. With split
// dense layers each rank computes its slice of every projection's outputs for every row instead
// and the ranks all-gather each matrix group's (src/engine/model_runner_split.cpp); the
// attention is the same, and so are the bits.
//
// Exactness and batch invariance: attention is exact softmax attention (float accumulation,
// states merged as state.hpp). A request's logits do not depend on what else is in the batch,
// how its prompt was chunked, or whether its prefix came from the cache: the matrix kernels'
// bits per token do not depend on how many tokens are computed together (model.hpp), a query's
// paged partial state depends only on its own pages (paged_kv.hpp), and a batch-invariant merge
// (MergeChoice::batch_invariant: allgather, tree-det, ring-state, gather-root everywhere; tree
// at two ranks; hier with up to two ranks a node) combines each record's states in an
// association fixed by the rank count (never by the number of records, unlike an MPI allreduce
// at more than two ranks, whose algorithm and segmentation change with the message size). So
// greedy tokens through the engine are the same bits as the request run alone, at any batch and
// chunk size, for a given rank count.
//
// Admission: a request is admitted when every rank has the pages its whole prompt plus
// max_new_tokens need (counted per rank under the placement rule, minus the prefix pages it
// reuses), taking free pages first and then evicting unreferenced cached pages (least recently
// used first). Admitted requests never run out of pages. A request that could never fit the
// pools is refused by submit(); a full queue is refused with kOutOfMemory (a server's 429).
//
// Prefix reuse: a page whose tokens are all written is indexed by a hash chain of the token ids
// of the sequence up to its end (h_j = H(h_{j-1}, tokens of page j)); a new request whose prompt
// starts with indexed pages takes them (reference counts) and prefills only the rest. At least
// the prompt's last token is always computed (its logits start the generation). Pages hold
// generated tokens too, so a follow-up turn that repeats the conversation reuses them.
// A request whose prompt shares full pages with a sequence that is still prefilling them
// waits in the queue until they are computed and indexed, then takes them (requests behind it
// may be admitted meanwhile), so requests that arrive together for one document prefill it once.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/generate.hpp"  // SamplingParams
#include "treeattn/kernel.hpp"
#include "treeattn/model.hpp"
#include "treeattn/status.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::engine {

using RequestId = uint64_t;

enum class FinishReason : uint8_t {
  kNone,       // more tokens follow
  kStop,       // a stop token was sampled (it is the event's token; not part of the text)
  kLength,     // max_new_tokens reached
  kCancelled,  // cancel() or stop(false)
  kError,      // the engine failed (TokenEvent::error says why)
};
const char* finish_reason_name(FinishReason r);  // "none", "stop", "length", "cancelled", "error"

struct Request {
  std::vector<TokenId> prompt;          // >= 1 token ids inside the vocabulary
  model::SamplingParams sampling;       // temperature 0: greedy
  int64_t max_new_tokens = 16;          // >= 1
  std::vector<TokenId> stop_tokens;     // generation ends when one is sampled
  bool return_logits = false;           // copy the logits of every sampled position (tests)
  // >= 0: every token's event carries its log-probability and those of the `logprobs` most
  // likely tokens (at most model::kMaxTopLogprobs), under the processed logits it was sampled
  // from (model::Sampler::process: after logit_bias and the penalties; before temperature and
  // truncation); -1: none.
  int logprobs = -1;
  // Structured output: empty for free text, else a response format as JSON text
  // ({"type": "json_object"} or {"type": "json_schema", ...}: src/model/structured/schema.hpp).
  // Every rank compiles it and masks, before each draw, the tokens that cannot continue a valid
  // output (the model's end-of-generation tokens once the value is complete, and only those
  // where nothing may follow it); an end-of-generation token after a complete value ends the
  // request with kStop, whatever stop_tokens holds.
  std::string response_format;
};

struct RequestTimings {
  double queue_seconds = 0;    // submit -> admitted
  double prefill_seconds = 0;  // admitted -> first token
  double decode_seconds = 0;   // first token -> last token
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;     // prompt tokens taken from the prefix cache
  int64_t generated_tokens = 0;
};

// What a request's callback receives, on rank 0, on the engine's thread (keep it short).
struct TokenEvent {
  RequestId id = 0;
  TokenId token = -1;             // -1 on events that carry no token (cancelled, error)
  int64_t index = 0;              // index of this generated token (0 = the first)
  FinishReason finish = FinishReason::kNone;  // != kNone: the request's last event
  Status error;                   // finish == kError
  RequestTimings timings;         // up to this event
  std::vector<float> logits;      // Request::return_logits only (the model's, unprocessed)
  model::TokenLogprobs logprobs;  // Request::logprobs >= 0 only
};
using TokenCallback = std::function<void(const TokenEvent&)>;

struct EngineConfig {
  DType kv_dtype = DType::kF16;  // f32, f16 or bf16
  // Tokens per page: 16 or a multiple of 32 up to 256 (kv_tiles). A page is also the online
  // softmax's block, so each page costs every query row a fixed step (max, rescale, sums);
  // 128 halves that against 64 (`treeattn_engine_bench prefill` measures the whole prefill
  // against the FMA peak) at the price of a coarser prefix reuse (whole pages only).
  int64_t page_tokens = 128;
  int64_t kv_pages = 0;          // pages per rank; 0: from kv_memory
  std::size_t kv_memory = 0;     // bytes of KV pages per rank; 0: half of MemAvailable
  // Sliding-window layers (gemma3's local layers) keep their K/V in pages of their own, which
  // a sequence drops once its window has passed them (src/engine/kv_manager.hpp): this many
  // pages per rank, at most kv_pages; -1 (auto): enough for max_batch sequences' windows and a
  // step's prefill chunk; 0: those layers keep every position in the full pages, as global
  // layers do. kv_memory is then shared: the window pages first, the rest to the full pages.
  // A model whose layers are all global, or all windowed, has no window pages.
  int64_t kv_window_pages = -1;
  int max_batch = 16;            // sequences in one step (prefilling and decoding)
  int64_t prefill_chunk = 256;   // prompt tokens per step over all prefilling sequences
  int max_queue = 256;           // waiting requests; submit() refuses beyond (kOutOfMemory)
  bool prefix_cache = true;
  // How the ranks' states are merged each layer: a strategy (strategy.hpp) whose merge stage
  // merges a batch of states (tree, tree-paper, tree2, hier, ring-state, allgather, gather-root,
  // tree-det), run through Strategy::merge, one collective pattern per layer for the whole
  // batch; or "auto": the planner's choice (choose_strategy, cost_model.hpp) on `topology` for
  // one layer's states of max_batch sequences, among the merges that are batch invariant at this
  // rank count (Engine::merge_choice() names it with every candidate's predicted time). A merge
  // whose association the collective library picks by message size (tree, tree-paper and tree2
  // over MPI at more than two ranks, hier with more than two ranks a node) runs when named, and
  // merge_choice().batch_invariant says its bits may then depend on the batch.
  std::string merge = "auto";
  // The topology `auto` plans on: a file or preset (topology.hpp load_topology); empty: this
  // job as the communicator shows it (job_topology_of, session.hpp).
  std::string topology;
  int fanout = 2;  // hier: children per leader in the inter-node tree
  // How a prefill chunk's attention crosses the ranks: "pass-q" (its queries travel to the
  // cached K/V, one merge per layer), "kv" (the cached K/V travels to the ranks computing the
  // chunk's rows, no merge for them), or "auto": per chunk, whichever moves fewer bytes (a fresh
  // prompt and the first chunks of a long one move K/V; a short question against a long cached
  // document passes its queries; src/engine/exchange.hpp has the byte counts and the
  // crossover). Both give the same bits; "kv" needs the tree or allgather merge above two ranks.
  std::string prefill_exchange = "auto";
  // Fill every page with NaN when it is allocated (K and V of every layer, on its owner), so that
  // a read of a stale or unwritten slot turns the logits into NaN (tests; costs a write of the
  // page per allocation).
  bool poison_pages = false;
  int threads = 0;  // per rank, matmul and attention (0: OpenMP's default)
  Isa isa = Isa::kAuto;
  // The quantized weights' matmul (model.hpp): int8 activations by default; exact is the
  // reference path (and what a comparison with the Generator needs on both sides).
  model::MatmulMode matmul = model::MatmulMode::kInt8;
  // How the dense layers (the projections, the FFN and the output head) are spread over the
  // ranks:
  //   "replicated"  every rank computes with the whole model: a step's rows split over the ranks
  //                 (a lone row is computed by every rank), as the header comment describes;
  //   "split"       rank r holds slice r of every projection's output rows (model.hpp
  //                 DenseWeights, LlamaModel::slice: about 1/p of the weights, read in place from
  //                 the file's mapping) and computes them for every row of the step; per layer
  //                 one all-gather each of q/k/v, the attention output, the FFN's activations and
  //                 its down projection, and per step one of the embeddings (each row's token
  //                 embedded by the rank whose vocabulary slice holds it) and one of the logits;
  //                 every output element is still one whole dot product on one rank, so the bits
  //                 are the replicated ones;
  //   "auto"        the cost model's choice for one decoding sequence (predict_dense,
  //                 cost_model.hpp) on `topology`: the weight bytes each rank reads per token
  //                 against the split's all-gathers on the job's links; split at one rank is
  //                 replicated.
  // Engine::dense_choice() says which ran and why.
  std::string dense = "auto";
  // The decode steps' Q4_K / Q6_K / Q8_0 / Q5_0 layout (rows8: model.hpp), about those matrices'
  // size again in memory: the engine copies the rows it computes with (the whole model's,
  // or only its slice's with dense split) unless the model already has a copy; false:
  // --no-rows8.
  bool rows8 = true;
  std::chrono::milliseconds timeout{10000};    // per communicator operation; 0 = forever
  // An idle rank 0 broadcasts an empty step at least this often (a heartbeat: a rank that died
  // is found within it plus the timeout). Requests, cancels and stops wake it at once.
  std::chrono::milliseconds idle_tick{250};
};

struct EngineMetrics {
  int64_t running = 0;  // admitted, not finished
  int64_t waiting = 0;  // submitted, not admitted (preempted ones included)
  int64_t preempted = 0;          // preempted, waiting to be admitted again
  int64_t preemptions_total = 0;  // times a running request was preempted for pages
  int64_t requests_total = 0;
  int64_t prompt_tokens_total = 0;
  int64_t cached_tokens_total = 0;
  int64_t generated_tokens_total = 0;
  int64_t steps = 0;
  int64_t pages_per_rank = 0;
  // The window pages (EngineConfig::kv_window_pages; 0 pages: none), per rank as below, and
  // per layer whether it keeps its K/V there (1) or in the full pages (0).
  int64_t window_pages_per_rank = 0;
  std::vector<int64_t> window_pages_used, window_pages_cached, window_pages_free;
  std::vector<uint8_t> layer_in_window;
  std::vector<int64_t> pages_used;    // per rank: referenced by a live sequence
  std::vector<int64_t> pages_cached;  // per rank: unreferenced, kept for prefix reuse (evictable)
  std::vector<int64_t> pages_free;    // per rank: on the free list
  // per rank: time in the per-layer merge and the all-gathers (q/k/v; with dense split, every
  // matrix group's outputs and the logits)
  std::vector<double> merge_seconds;
  std::vector<double> attention_seconds;  // per rank: time in the paged kernel, total
  std::vector<double> dense_seconds;      // per rank: projections, output projection and FFN
  int64_t merges = 0;                 // per-layer merges run (each rank ran this many)
  int64_t rows_pass_q = 0;            // rows (tokens) computed by pass-Q, over all steps
  int64_t rows_kv_exchange = 0;       // rows computed by the K/V exchange (prefill_exchange)
  int64_t kv_exchange_bytes = 0;      // rank 0's bytes of cached K/V sent for them
  uint64_t bytes_sent = 0;            // rank 0's bytes sent (communicator counters)
  bool failed = false;
  std::string error;
};

// The merge the engine runs, the same on every rank (rank 0's choice).
struct MergeChoice {
  std::string strategy;          // the strategy that merges (never "auto")
  std::string how;               // "by name" or "auto: planned on topology NAME"
  bool batch_invariant = false;  // its merge's bits do not depend on the batch at this rank count
  bool local_twin = false;       // it has a local twin: the K/V exchange may run
  // auto, rank 0: every candidate the planner priced, best first (predicted per-layer times).
  std::vector<PlanEntry> ranking;
  std::string topology;  // the topology auto planned on
};

// One line for banners: "hier (auto on topology job, batch invariant; predicted per layer:
// hier 31.0 us, tree 33.5 us, ...)".
std::string describe_merge(const MergeChoice& choice);

// How the dense layers run (EngineConfig::dense), the same on every rank (rank 0's choice).
struct DenseChoice {
  bool split = false;    // dense split; false: replicated
  std::string how;       // "by name", "auto: one rank", "auto: planned on topology NAME"
  std::string topology;  // the topology auto planned on
  // auto at more than one rank: the cost model's times of one decoding token's dense part
  // (predict_dense), and the split's all-gathers per token.
  double predicted_split_us = 0, predicted_replicated_us = 0;
  int collectives_per_token = 0;
  double weight_gbps = 0;  // rank 0's kernels' measured weight read rate the prediction used
  // This rank's projection and head weights (its slice's, or the whole model's) and its own
  // rows8 copy of them (0 where the model's copy is viewed).
  std::size_t weight_bytes = 0;
  std::size_t rows8_bytes = 0;
  const char* mode() const { return split ? "split" : "replicated"; }
};
// One line for banners: "split (auto on topology job; predicted per token: split 1.200 ms,
// replicated 3.400 ms, 122 all-gathers, weights read at 10.2 GB/s; 46.0 MB of weights on this
// rank)" (4 L + 2 all-gathers for L layers; "+ X MB rows8" where the rank has its own copy).
std::string describe_dense(const DenseChoice& choice);

// Window pages per rank that one sequence alone needs (its window and a prefill chunk, over
// `ranks` ranks): the least kv_window_pages the engine accepts, and what a one-request run
// (generate) asks for. 0 when the model has no window pages (EngineConfig::kv_window_pages).
int64_t lone_sequence_window_pages(const EngineConfig& config, const model::LlamaModel& model,
                                   int ranks);

class Engine {
 public:
  // Collective over comm: checks that the ranks agree on the model and the configuration and
  // allocates the page pools. model and comm must outlive the engine.
  static Result<std::unique_ptr<Engine>> create(Communicator& comm, const model::LlamaModel& model,
                                                const EngineConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Rank 0, thread-safe. Queues a request; its events go to `callback` (rank 0's step thread).
  // kInvalidArgument: empty prompt, ids outside the vocabulary, max_new_tokens < 1, bad
  // sampling, or prompt + max_new_tokens more than the pools can ever hold for one sequence
  // (message names both numbers); kOutOfMemory: the queue is full; kInternal: the engine failed
  // or is stopping; kInvalidArgument on ranks other than 0.
  Result<RequestId> submit(Request request, TokenCallback callback);
  // Rank 0, thread-safe. The request ends with a kCancelled event (unless it already ended) and
  // its pages are released at the next step.
  void cancel(RequestId id);
  // Rank 0, thread-safe: makes run() return on every rank. drain: after every admitted and
  // queued request has finished (new submits are refused); otherwise at the next step, with the
  // requests in flight cancelled.
  void stop(bool drain);

  // Collective: steps until stop() (rank 0 decides; every rank returns together) or an error.
  // On an error every request in flight ends with a kError event and the error is returned.
  Status run();
  // Collective: one step. Returns, identically on every rank, whether work remains (admitted or
  // queued requests) after it.
  Result<bool> step();

  // Tokens one sequence can ever hold (prompt + generated): every rank's pool, under the
  // placement rule.
  int64_t max_sequence_tokens() const;
  // Steps plus layers this rank has completed: a count that moves while the engine works, even
  // within one long step (thread-safe; what a progress watchdog samples).
  int64_t progress() const;
  EngineMetrics metrics() const;  // rank 0 (thread-safe)
  const EngineConfig& config() const;
  const MergeChoice& merge_choice() const;
  const DenseChoice& dense_choice() const;
  const model::LlamaModel& model() const;
  Communicator& comm() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace treeattn::engine
