// Internal helpers shared by the strategy implementations: the local partial, canonical merges,
// the binomial tree. Each strategy is reached through its descriptor (descriptor.hpp).
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "treeattn/strategy.hpp"

namespace treeattn::strategies {

// DecodeOptions whose split plan is the same on every device: chunk_tokens as given, or
// kDefaultChunkTokens where it is 0 (the CPU's default, so CPU results keep their bits; the
// CUDA executor would otherwise size splits to its device's SM count).
inline DecodeOptions fixed_split_options(DecodeOptions o) {
  if (o.chunk_tokens == 0) o.chunk_tokens = kDefaultChunkTokens;
  return o;
}

// Common state: the communicator, the executor, the shape, and the peak of the buffers.
class StrategyBase : public Strategy {
 public:
  explicit StrategyBase(StrategyOptions options) : Strategy(std::move(options)) {}

  Status do_setup(Communicator& comm, Executor& executor, const AttnShape& shape, DType dtype,
                  const ShardPlan& plan) override {
    TREEATTN_RETURN_IF_ERROR(shape.validate());
    if (plan.ranks() != comm.size())
      return invalid_argument(who(comm) + std::string(name()) + ": the shard plan is for " +
                              std::to_string(plan.ranks()) + " ranks, the communicator has " +
                              std::to_string(comm.size()));
    if (plan.batch() != shape.batch)
      return invalid_argument(who(comm) + std::string(name()) + ": the shard plan has " +
                              std::to_string(plan.batch()) + " batch rows, the shape has batch " +
                              std::to_string(shape.batch));
    TREEATTN_RETURN_IF_ERROR(check_root_and_memory(comm, executor));
    comm_ = &comm;
    exec_ = &executor;
    shape_ = shape;
    dtype_ = dtype;
    TREEATTN_RETURN_IF_ERROR(setup_groups());
    return setup_more(plan);
  }

  // setup_merge (strategy.hpp): the checks of do_setup that do not need a shape or a plan.
  Status do_setup_merge(Communicator& comm, Executor& executor, std::size_t head_dim) override {
    if (!merges_states())
      return unsupported(who(comm) + std::string(name()) +
                         " does not merge a batch of states (it needs the KV shards)");
    if (head_dim == 0)
      return invalid_argument(who(comm) + std::string(name()) + ": head_dim must be > 0");
    TREEATTN_RETURN_IF_ERROR(check_root_and_memory(comm, executor));
    comm_ = &comm;
    exec_ = &executor;
    shape_ = AttnShape{};
    shape_.head_dim = static_cast<int>(head_dim);
    return setup_groups();
  }

  // A strategy that merges states: its local partial, then its merge stage.
  Status run(const float* q, const KVShard& local, const ShardPlan&, float* out) override {
    TREEATTN_RETURN_IF_ERROR(local_partial(q, local, out));
    return merge_n(out, records());
  }

  // The merge stage (strategy.hpp): merge_n with the batch's record count. A strategy without
  // one keeps merge_n's default, which says so (setup_merge refused it already).
  Status merge(float* records, std::size_t n) override {
    if (!comm_) return internal_error(std::string(name()) + ": merge() before setup_merge()");
    if (n == 0 || records == nullptr) return Status::ok();
    return merge_n(records, n);
  }

 protected:
  // StrategyInfo::merges_states of this strategy's descriptor (registry.cpp).
  bool merges_states() const;
  // Sub-communicators and other set-up that needs only the communicator (both setups).
  virtual Status setup_groups() { return Status::ok(); }
  virtual Status setup_more(const ShardPlan&) { return Status::ok(); }
  // The merge stage over n records already in `out` (run() after its local partial).
  virtual Status merge_n(float*, std::size_t) {
    return unsupported(who() + std::string(name()) + " does not merge a batch of states");
  }
  bool fixed_order() const { return comm_->capabilities().fixed_reduction_order; }

  Status check_root_and_memory(const Communicator& comm, const Executor& executor) const {
    if (options_.root >= comm.size())
      return invalid_argument(who(comm) + std::string(name()) + ": root rank " +
                              std::to_string(options_.root) + " is outside [0, " +
                              std::to_string(comm.size()) + ")");
    if (executor.memory() != comm.capabilities().memory)
      return invalid_argument(who(comm) + std::string(name()) + ": the executor '" +
                              std::string(executor.name()) + "' and the communicator '" +
                              std::string(comm.backend_name()) +
                              "' work in different memory spaces");
    return Status::ok();
  }

  static std::string who(const Communicator& c) {
    return "rank " + std::to_string(c.world_rank()) + ": ";
  }
  std::string who() const { return who(*comm_); }

  std::size_t records() const {
    return static_cast<std::size_t>(shape_.batch * shape_.q_len * shape_.heads);
  }
  std::size_t rec_floats() const {
    return state_record_floats(static_cast<std::size_t>(shape_.head_dim));
  }
  std::size_t state_floats() const { return records() * rec_floats(); }
  std::size_t state_bytes() const { return state_floats() * sizeof(float); }
  std::size_t floats_of(std::size_t n) const { return n * rec_floats(); }
  std::size_t bytes_of(std::size_t n) const { return floats_of(n) * sizeof(float); }
  std::size_t head_dim() const { return static_cast<std::size_t>(shape_.head_dim); }

  // Makes buf hold at least `bytes` in the executor's memory (contents are not kept when it
  // grows).
  Status ensure(Buffer& buf, std::size_t bytes) const {
    if (buf.bytes() >= bytes) return Status::ok();
    // A buffer that grows (ring-kv's receive buffers grow with every appended token) gets 1/8
    // of headroom, so a decode loop reallocates (and faults in fresh pages) every few thousand
    // steps instead of every step; untouched headroom is not resident.
    const std::size_t want = buf.empty() ? bytes : std::max(bytes, buf.bytes() + buf.bytes() / 8);
    buf.reset();
    auto b = exec_->allocate(want);
    TREEATTN_RETURN_IF_ERROR(b.status());
    buf = std::move(*b);
    return Status::ok();
  }

  Status local_partial(const float* q, const KVShard& kv, float* states) const {
    return exec_->partial(shape_, q, kv, states, options_.kernel);
  }
  // The partial of q against a shard that other ranks compute too, whose bits must agree
  // (ring-kv): with the split length fixed (fixed_split_options), since the CUDA executor's own
  // plan follows the device's SM count, which differs between GPU models in one job.
  Status shared_partial(const float* q, const KVShard& kv, float* states) const {
    return exec_->partial(shape_, q, kv, states, fixed_split_options(options_.kernel));
  }

  // out <- s_0 (+) s_1 (+) ... (+) s_{p-1}, left to right from the empty state: the canonical
  // order, so every rank that merges the same partials gets the same bits.
  Status merge_in_rank_order(const float* all, int p, float* out) const {
    return merge_in_rank_order(all, p, records(), out);
  }
  Status merge_in_rank_order(const float* all, int p, std::size_t n, float* out) const {
    return exec_->merge_ordered(all, static_cast<std::size_t>(p), floats_of(n), n, head_dim(),
                                out);
  }
  // slots[r] (n records each, p slots back to back in the executor's memory) merged along a
  // perfect binary tree over the ranks, padded with empty leaves (the identity bit for bit): in
  // round d = 1, 2, 4, ... slot r (r mod 2d == 0) takes slot r (+) slot r + d. Slot 0 holds
  // the result; its association depends on p alone.
  Status fold_binary_in_place(float* slots, int p, std::size_t n) const {
    for (int d = 1; d < p; d *= 2)
      for (int r = 0; r + d < p; r += 2 * d)
        TREEATTN_RETURN_IF_ERROR(exec_->merge(slots + static_cast<std::size_t>(r) * floats_of(n),
                                              slots + static_cast<std::size_t>(r + d) * floats_of(n),
                                              n, head_dim()));
    return Status::ok();
  }
  // The local twin of a rank-order merge (host parts): parts[0] (+) parts[1] ... in rank order.
  Status fold_in_rank_order(const float* const* parts, int p, std::size_t n, float* out) const {
    std::copy(parts[0], parts[0] + floats_of(n), out);
    for (int q = 1; q < p; ++q)
      TREEATTN_RETURN_IF_ERROR(exec_->merge(out, parts[q], n, head_dim()));
    return Status::ok();
  }

  void note_buffers(std::size_t bytes) { peak_buffers_ = std::max(peak_buffers_, bytes); }
  std::size_t buffer_bytes() const override { return peak_buffers_; }

  Communicator* comm_ = nullptr;
  DType dtype_ = DType::kF32;
  std::size_t peak_buffers_ = 0;
};

// A strategy whose merge gathers every rank's states and folds them in rank order 0..p-1
// (allgather, gather-root, ring-state): batch invariant everywhere, its local twin the same fold.
class RankOrderMerge : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;
  bool merge_batch_invariant() const override { return true; }
  bool merge_local_supported(int) const override { return true; }
  Status merge_local(const float* const* parts, int p, std::size_t n, float* out) override {
    return fold_in_rank_order(parts, p, n, out);
  }
};

// Binomial tree over n ranks rooted at 0 (relative ranks): the children of i.
inline std::vector<int> binomial_children(int i, int n) {
  std::vector<int> c;
  const int low = i == 0 ? (1 << 30) : (i & -i);
  for (int m = 1; m < low && i + m < n; m <<= 1) c.push_back(i + m);
  return c;
}

}  // namespace treeattn::strategies
