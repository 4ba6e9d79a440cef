// The decode session: the library's one entry point for distributed exact attention decoding.
//
// A DecodeSession is created collectively by every rank of a communicator with the same
// configuration (it checks that they agree and names the ranks and fields that differ). It owns
// this rank's KV shards of every layer under one placement (ShardPlan, sharding.hpp) and the
// strategy (strategy.hpp) that merges the ranks' partial states. A model's decode step sees the
// new token's own key, so the order per token is grow, store, attend (what Generator::step does):
//
//   auto s = DecodeSession::create(comm, cfg);        // cfg.layers = 30, cfg.strategy = "tree"
//   s->extend(prompt_len);                            // lay the prompt out over the ranks
//   for each layer l, position pos this rank owns:    // prefill: each rank stores its part
//     s->store(l, b, pos, k, v);
//   loop (one new token per row at position pos = length):
//     s->extend(1);                                   // place it (every rank, same call)
//     for each layer l:
//       compute q_l, k_l, v_l of the token
//       if (s->owns(b, pos)) s->store(l, b, pos, k_l, v_l);   // its owner keeps it
//       s->attend(l, q_l, out_l);                     // merged exact attention over 0..pos
//
// append(k_all_layers, v_all_layers) is the same grow-and-store for callers that have every
// layer's K/V before attending (benchmarks); attending before it does not see the new token.
// Sequences that join, leave and grow on their own: the rows as sequence slots (add_sequence,
// extend(seq, n), store_range, attend(layer, seqs, ...), below). Paged KV shared between
// requests, prefix reuse and a scheduler: the serving engine (engine.hpp), which keeps its own
// pages and does not use this class.
//
// Memory: the KV shards, q, out and lse of attend live in the executor's memory space
// (executor.hpp; host memory for the CPU executor, device memory for the CUDA executor). store/
// append take host floats and narrow them to the cache dtype (quantized dtypes keep a per-token,
// per-KV-head scale); on a device executor they are staged and copied to the device before the
// next attention (LocalShard, sharding.hpp).
//
// Benchmarks and checks: several strategies on the very same shards and the merged state
// records (instead of normalised outputs) are not part of this class's public surface; the
// measurement library reaches them (measure::add_strategy, measure::attend_states, measure.hpp,
// treeattn_measure). Models use attend, delivers_result() and check_agreement.
//
// q_len (AttnShape::q_len) is fixed per session: every attend call passes q_len queries per
// batch row; query i sees the positions <= length - q_len + i (shape.hpp).
//
// Errors: every collective call returns a Status; the same error reaches every rank (shape or
// configuration mismatches are found at creation, a rank that never arrives is a kTimeout naming
// it after config.timeout). After a kTimeout the session is unusable.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/state_buffer.hpp"
#include "treeattn/status.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/topology.hpp"

namespace treeattn {

namespace measure {
struct SessionAccess;  // the benchmark and check calls of measure.hpp (src/measure)
}

struct SessionConfig {
  AttnShape shape;                // batch, heads, kv_heads, head_dim, q_len (queries per attend)
  DType dtype = DType::kBF16;     // KV cache element type
  int layers = 1;                 // KV caches kept, one per layer, all under one placement
  ShardKind placement = ShardKind::kEven;
  std::vector<int64_t> context;       // initial tokens per batch row (one value: every row); {} = 0
  std::vector<int64_t> explicit_len;  // ShardKind::kExplicit (see ShardPlan::make)
  int holder = 0;                     // ShardKind::kSingle
  int64_t reserve_tokens = 0;         // spare slots per row before a shard has to grow
  // How the shards store tokens (sharding.hpp): kAuto = the layout this CPU reads faster for
  // this shape, dtype and options.kernel, measured once and kept (host_kv_layout(workload),
  // strategy.hpp; rank 0's choice, broadcast), rows when the executor is a device
  // (choose_kv_layout); config() reports the layout chosen. Every strategy reads both.
  KVLayout layout = KVLayout::kAuto;
  // A name from StrategyRegistry::for_backend(comm), or "auto": the planner's choice
  // (choose_strategy, cost_model.hpp) for this shape, dtype, plan_context and rank count on
  // `topology`, among the strategies the backend offers. Every rank plans; rank 0's choice is
  // broadcast, so every rank runs the same strategy. config().strategy then names the choice
  // and auto_choice() holds the ranking with the predicted times.
  std::string strategy = "tree";
  // The machine `auto` plans on. Absent: this job as the communicator shows it: preset `local`
  // (this machine's links and memory) with the ranks grouped into nodes by shared memory
  // (split_shared, blocks of rank 0's node size), the network of preset `emu-veth` between
  // nodes and max_concurrent_ranks the cores of this machine. Measured numbers: detect_topology
  // (detect.hpp, `treeattn topo --detect`) or a topology file, passed here.
  std::optional<Topology> topology;
  // Tokens per sequence `auto` plans for; 0 = the longest row of `context`, or reserve_tokens
  // when the context is empty (at least 1).
  int64_t plan_context = 0;
  StrategyOptions options;            // root, fan-out, node grouping, kernel options
  std::chrono::milliseconds timeout{60000};  // per communicator operation; 0 = wait forever
  bool check_agreement = true;               // all-gather and compare the configuration at create
  // More fields every rank must agree on (name, value), checked with the configuration: callers
  // (the benchmark harness, a model) add what their run depends on.
  std::vector<std::pair<std::string, std::string>> agree_also;
  // Sequences (the serving shape): the batch rows are shape.batch sequence slots, all free at
  // creation (context must be empty), taken by add_sequence() and given back by
  // remove_sequence(). False: every row is a live sequence from the start (the batch shape).
  bool rows_start_free = false;
};

// The topology `auto` plans on when none is given (SessionConfig::topology, the serving
// engine's --method auto): this job as the communicator shows it (described above). Collective.
Result<Topology> job_topology_of(Communicator& comm, Executor& executor);

class DecodeSession {
 public:
  // Collective over comm. comm and executor must outlive the session. The strategy `single`
  // requires (and forces) ShardKind::kSingle with holder 0.
  static Result<std::unique_ptr<DecodeSession>> create(Communicator& comm,
                                                       const SessionConfig& config,
                                                       Executor& executor = cpu_executor());
  ~DecodeSession();
  DecodeSession(const DecodeSession&) = delete;
  DecodeSession& operator=(const DecodeSession&) = delete;

  const SessionConfig& config() const { return config_; }
  const AttnShape& shape() const { return config_.shape; }
  int layers() const { return config_.layers; }
  Communicator& comm() const { return *comm_; }
  Executor& executor() const { return *exec_; }
  const ShardPlan& plan() const { return plan_; }
  // With SessionConfig::strategy = "auto": the planner's ranking (best first, the strategy
  // run is its first entry, the same on every rank) and the topology's name; null otherwise.
  const StrategyChoice* auto_choice() const { return auto_ ? &*auto_ : nullptr; }
  int64_t length(int64_t b) const { return plan_.total_len(b); }

  // ---- the KV cache -----------------------------------------------------------------------------
  // Whether this rank holds position pos of row b (pos < length(b)).
  bool owns(int64_t b, int64_t pos) const;
  // Writes K and V ([kv_heads][head_dim] host floats) of position pos of row b in `layer`. Local:
  // kInvalidArgument when this rank does not own the position (see owns()).
  Status store(int layer, int64_t b, int64_t pos, const float* k, const float* v);
  // Collective. Appends one token to every row: k and v are [layers][batch][kv_heads][head_dim]
  // host floats, the same on every rank. The placement advances once (for all layers) and only
  // the owner stores the token.
  Status append(const float* k, const float* v);
  // Local and deterministic (every rank must call it with the same n). Grows every row by n
  // tokens whose K/V the owners then write with store(). On a session whose rows are all empty
  // the n tokens are laid out by the configured placement (a prefill); otherwise they are placed
  // as n appends would be.
  Status extend(int64_t n);
  // This rank's live tokens of one layer, as the kernels read them (on the tiled layout a
  // KVShard whose `tiled` view stays valid until the next view, store, append or extend).
  KVShard view(int layer) const;
  // Bytes of K and V (and scales) this rank holds for live tokens, over all layers.
  std::size_t live_kv_bytes() const;

  // ---- sequences ---------------------------------------------------------------------------------
  // Rows are sequences: each grows on its own, joins and leaves. Every call here is local and
  // deterministic: every rank makes the same calls in the same order (what a serving loop's
  // step description gives them), so every rank keeps the same placement with no message.
  // A model's step for a set S of live sequences, each with its new tokens:
  //
  //   for each seq in S: s->extend(seq, n_seq);          // place them (positions len .. len+n-1)
  //   for each layer l:
  //     compute q, k, v of the new tokens (in executor memory)
  //     for each seq in S: s->store_range(l, seq, len_seq, n_seq, k_seq, v_seq);  // owners keep
  //     s->attend(l, S, q, out);                          // exact attention, one merge for all
  //
  // (q_len = n_seq for every seq of one call; query i of a sequence sees positions
  // <= length - q_len + i.) attend before store_range would not see the new tokens.
  //
  // The lowest free row, now live and empty; kOutOfMemory when all shape.batch rows are live.
  Result<int64_t> add_sequence();
  // The row becomes free and empty (its slots are reused, never read before written again).
  Status remove_sequence(int64_t seq);
  bool live(int64_t seq) const;
  int64_t live_sequences() const;
  // Grows one live sequence by n tokens, placed like extend(n) places one row's tokens (an empty
  // sequence by the placement, then as appends); the owners then write them with store_range.
  // kExplicit: explicit_len must hold one length per rank (summing to n) for an empty sequence.
  Status extend(int64_t seq, int64_t n);
  // Writes K and V of positions pos0 .. pos0 + n - 1 of a live sequence in `layer`: k and v are
  // [n][kv_heads][head_dim] floats in the executor's memory (device memory for a device
  // executor), the same on every rank; each rank keeps the positions it owns and skips the
  // others. A device executor copies the range to the host once and stages it (one copy per
  // range, flushed in runs before the next attention), not per token.
  Status store_range(int layer, int64_t seq, int64_t pos0, int64_t n, const float* k,
                     const float* v);

  // ---- attention ---------------------------------------------------------------------------------
  // Collective. q [batch][q_len][heads][head_dim]; out the exact attention over every rank's
  // tokens of `layer`, [batch][q_len][heads][head_dim], and lse [batch][q_len][heads] (natural
  // log; may be null). Written where delivers_result() (every rank unless options.root >= 0).
  Status attend(int layer, const float* q, float* out, float* lse = nullptr);
  // Whether attend writes out and lse on this rank.
  bool delivers_result() const { return delivers_result(0); }
  // Collective. Exact attention for the live sequences `seqs` (distinct; every rank the same
  // list): q [seqs.size()][q_len][heads][head_dim] and out the same, lse [seqs.size()][q_len]
  // [heads], in the order of `seqs`, in the executor's memory. The other rows are not read; one
  // kernel pass and one merge serve them all.
  Status attend(int layer, std::span<const int64_t> seqs, const float* q, float* out,
                float* lse = nullptr);

  // Collective. All-gathers the configuration, the current placement and `extra`, and fails with
  // kMismatch naming the ranks and fields that differ (the check create() runs, again; a debug
  // aid before a step). `when` goes into the message ("at step 3").
  Status check_agreement(const std::string& when,
                         const std::vector<std::pair<std::string, std::string>>& extra = {});


 private:
  // The measurement library's calls (measure.hpp) read and add strategies through these.
  friend struct measure::SessionAccess;

  DecodeSession() = default;
  // Collective. The merged state records of strategy `strategy` (0 = the configured one) instead
  // of normalised outputs, host records on any executor.
  Status attend_states(int layer, const float* q, StateBuffer& states, int strategy);
  bool delivers_result(int strategy) const;
  // Collective. One more strategy on the same placement and shards; returns its index. `single`
  // cannot join a session whose placement is not ShardKind::kSingle.
  Result<int> add_strategy(const std::string& name, const StrategyOptions& options);
  int strategy_count() const { return static_cast<int>(strategies_.size()); }
  Status check_layer(int layer, const char* op) const;
  Status check_live(int64_t seq, const char* op) const;
  Status check_all_live(const char* op) const;
  // Grows every layer's shard to the plan; on failure restores `before` (no token is counted
  // that has no room) and returns the error.
  Status grow_shards(ShardPlan before, const char* op);
  // Device executors: runs the strategy into device_scratch_ (grown as needed).
  Status run_on_device(int layer, const float* q, int strategy);
  Status run_on_device(int layer, const float* q, int strategy, const ShardPlan& plan);

  SessionConfig config_;
  std::optional<StrategyChoice> auto_;  // strategy "auto": how it was resolved
  Communicator* comm_ = nullptr;
  Executor* exec_ = nullptr;
  ShardPlan plan_;
  std::vector<char> live_;          // per row
  std::vector<LocalShard> shards_;  // one per layer
  std::vector<std::unique_ptr<Strategy>> strategies_;
  StateBuffer scratch_;    // attend(): merged records before normalisation
  Buffer device_scratch_;  // the same in the executor's memory, for a device executor
  Buffer device_q_;        // attend(seqs): the batch's queries, on a device executor
  std::vector<float> q_full_, staging_;  // attend(seqs) and store_range on the host
};

}  // namespace treeattn
