// The engine's forward pass of one step over the ranks (engine.hpp's "One step"): the dense
// layers either replicated (every rank holds the whole model and computes its share of the
// step's rows; per layer the all-gather of q/k/v) or split (EngineConfig::dense: every rank
// holds a slice of each projection's output rows and computes it for every row; one all-gather
// per matrix group, model_runner_split.cpp); then the owners' page stores, the paged kernel over
// this rank's pages, the merge of the ranks' states (pass-Q) or the K/V exchange (exchange.hpp),
// and the logits of the rows that end a sequence's known tokens. The merge is a strategy's merge
// stage (layer_merge.hpp), called in merge_layer_states and merge_exchange_states
// (model_runner.cpp).
#pragma once

#include <atomic>

#include <cstdint>
#include <span>
#include <vector>

#include "engine/exchange.hpp"
#include "engine/kv_manager.hpp"
#include "engine/layer_merge.hpp"
#include "engine/scheduler.hpp"
#include "engine/sequence.hpp"
#include "treeattn/comm.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/model.hpp"
#include "treeattn/paged_kv.hpp"

namespace treeattn::engine {

// Counters of this rank's forward passes.
struct RunnerTimes {
  double merge_s = 0, attn_s = 0, dense_s = 0;
  int64_t merges = 0, rows_pass_q = 0, rows_kv = 0, kv_bytes_sent = 0;
};

// The rows of a step that end a sequence's known tokens, and their logits [S][n_vocab]
// (identical on every rank).
struct StepLogits {
  std::vector<Sequence*> seqs;
  std::span<const float> logits;
};

class ModelRunner {
 public:
  // pools: this rank's pages of each layer; kv and the model outlive the runner. weights: what
  // this rank multiplies with (dense_plan.hpp): the whole model's (replicated) or this rank's
  // slice of every projection (dense_split).
  ModelRunner(Communicator& comm, const model::LlamaModel& model, const EngineConfig& cfg,
              std::unique_ptr<LayerMerge> merge, ExchangePolicy exchange,
              std::vector<TiledKVCache> pools, KVManager& kv, model::DenseWeights weights,
              bool dense_split);

  // Whether the prefill exchange policy can run with this merge at this rank count (kv needs a
  // merge with a local twin).
  Status check_exchange_policy() const;
  const MergeChoice& merge_choice() const { return merge_->choice(); }
  // Allocates and writes the scratch of the largest step once, so that the first request does
  // not pay for it; without the memory, steps grow their buffers as they go.
  void try_reserve_step_scratch();
  // Runs the work items (checked by Scheduler::check_work): stores their K/V, advances and
  // indexes their sequences, and returns the logits to sample from.
  Result<StepLogits> forward(Scheduler& sched, std::span<const WorkItem> planned);
  const RunnerTimes& times() const { return times_; }
  // Layers this rank has completed, over all steps; any thread may read it (the server's progress
  // watchdog: a long prefill step advances it layer by layer, a stalled rank stops it at the
  // layer whose collectives wait).
  int64_t layers_done() const { return layers_done_.load(std::memory_order_relaxed); }

 private:
  // One step's rows: items, their sequences, and this rank's share of the dense part.
  struct Step {
    std::vector<WorkItem> work;  // pass-Q items, then the K/V exchange's
    std::size_t n_passq = 0;
    std::vector<Sequence*> seqs;
    std::vector<int64_t> first_row;
    int64_t rows = 0, rows_q = 0;  // all rows; pass-Q rows [0, rows_q)
    // Rows split over the ranks: replicated's dense part, and in both modes the K/V exchange's
    // attention (rank r computes rows [lo, lo + mine)).
    bool split = false;
    int64_t per = 0, lo = 0, mine = 0, gslot = 0;
    std::vector<EntryPages> ep;  // this rank's pages of each pass-Q item
    std::vector<PagedEntry> entries;
    std::vector<EntryPages> wep;  // the same in the window group (kv_manager.hpp), if any
    std::vector<PagedEntry> wentries;
  };

  // Whether layer l keeps its K/V in the window group's pages.
  bool window_layer(int l) const;
  // Sequence s's page of logical page j in layer l's group (invalid: a dropped window page).
  const PageRef& page_of(const Sequence& s, int64_t j, bool window) const {
    return (window ? s.window_pages : s.pages)[static_cast<std::size_t>(j)];
  }

  void reserve_step_scratch();
  Status order_work(Scheduler& sched, std::span<const WorkItem> planned, Step& st);
  Status lay_out_rows(Step& st);
  void split_rows(Step& st);
  void build_entries(Step& st);
  Status run_layer(int l, Step& st);
  Status gather_qkv(const Step& st, const float* ql, const float* kl, const float* vl);
  void store_kv(int l, const Step& st);
  Status merge_layer_states(int64_t rows_q);
  void advance(Step& st);
  Result<StepLogits> compute_logits(const Step& st);
  Status gather_logits(const Step& st, std::span<const std::size_t> sample_w);

  // The K/V exchange (model_runner_kv.cpp) for items [n_passq, work.size()) in layer `pool`.
  // window: the layer's sliding window (0: none); in_window_group: its pages are the window
  // group's.
  Status kv_exchange_attention(const TiledKVCache& pool, const Step& st, int64_t window,
                               bool in_window_group);
  Result<std::size_t> exchange_cached_pages(const TiledKVCache& pool, const Step& st, bool wg);
  Status copy_exchange_pages(const Step& st, std::size_t slot, bool wg,
                             std::vector<EntryPages>& ep, std::size_t& n_spans);
  Status merge_exchange_states(const Step& st);

  // The attention of layer l for every row: K/V stored, this rank's pages' partial states,
  // merged (pass-Q) or exchanged (the K/V rows, this rank's only).
  Status attend(int l, Step& st);
  // attn_ rows [dst, dst + n) = the normalized states of rows [first, first + n).
  void normalize_rows(int64_t first, int64_t n, int64_t dst);

  // ---- dense split (model_runner_split.cpp) ----
  // A matrix group's all-gather for `tokens` rows: a rank's slot holds each projection's
  // [tokens][its rows], padded to the widest rank's; at[i]: projection i's offset in the slot.
  struct GroupSlot {
    int64_t floats = 0;
    int64_t at[3] = {0, 0, 0};
  };
  GroupSlot group_slot(std::span<const model::Projection> ps, int64_t tokens) const;
  // Every rank's slot (this rank's in gsend_) all-gathered; out[i] = projection i's
  // [tokens][all rows].
  Status gather_group(std::span<const model::Projection> ps, const GroupSlot& g, int64_t tokens,
                      std::span<float* const> out);
  void size_split_scratch(int64_t rows);
  Status split_embed(const Step& st);
  Status run_layer_split(int l, Step& st);
  Status split_attention_inputs(int l, const Step& st);
  Status gather_kv_rows_attention(const Step& st);
  Status split_output_and_ffn(int l, const Step& st);
  Status split_logits(const Step& st, std::span<const std::size_t> sample_w);
  Communicator* comm_;
  const model::LlamaModel* model_;
  model::DenseWeights w_;  // this rank's matrices: the whole model's, or its slice
  bool dense_split_ = false;
  const EngineConfig& cfg_;
  KVManager& kv_;
  model::MatvecOptions mv_;
  DecodeOptions dopt_;  // the paged kernel's threads and ISA
  std::unique_ptr<LayerMerge> merge_;  // the per-layer merge (a strategy's merge stage)
  ExchangePolicy exchange_;
  ExchangeShape xshape_;
  int p_ = 1, me_ = 0;
  int64_t T_ = 64;
  std::vector<TiledKVCache> pools_;  // one per layer: this rank's pages
  RunnerTimes times_;
  std::atomic<int64_t> layers_done_{0};

  // ---- step scratch ----
  model::ForwardScratch fs_;
  std::vector<float> x_, q_, k_, v_, attn_, states_, xs_, xs_all_, logits_, logits_all_;
  std::vector<float> qkv_send_, qkv_recv_, qkv_local_;
  // Dense split: the normed activations and a projection's gathered output of every row, the
  // FFN's activations of every row ([rows][n_ff]) and this rank's up projection, the group
  // all-gather's slots.
  std::vector<float> xn_, tmp_, act_, up_, gsend_, grecv_;
  std::vector<int64_t> row_off_;  // a row's offset (floats) in its rank's all-gather slot
  std::vector<TokenId> row_tok_;
  std::vector<int64_t> row_pos_;
  // The K/V exchange: its rows' spans on this rank, cached pages sent and received, the
  // per-owner states [owner rank][this rank's rows][heads] records, and the copies of the pages
  // its rows read.
  struct Span {
    std::size_t w;
    int64_t a, b;  // this rank's rows of item w
  };
  std::vector<Span> spans_;
  std::vector<uint8_t> page_send_, page_recv_;
  std::vector<float> kv_states_;
  TiledKVCache xpool_;
  int64_t xpool_pages_ = 0;
};

}  // namespace treeattn::engine
