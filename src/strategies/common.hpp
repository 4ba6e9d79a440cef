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
    if (options_.root >= comm.size())
      return invalid_argument(who(comm) + std::string(name()) + ": root rank " +
                              std::to_string(options_.root) + " is outside [0, " +
                              std::to_string(comm.size()) + ")");
    if (executor.memory() != comm.capabilities().memory)
      return invalid_argument(who(comm) + std::string(name()) + ": the executor '" +
                              std::string(executor.name()) + "' and the communicator '" +
                              std::string(comm.backend_name()) +
                              "' work in different memory spaces");
    comm_ = &comm;
    exec_ = &executor;
    shape_ = shape;
    dtype_ = dtype;
    return setup_more(plan);
  }

 protected:
  virtual Status setup_more(const ShardPlan&) { return Status::ok(); }

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

  // out <- s_0 (+) s_1 (+) ... (+) s_{p-1}, left to right from the empty state: the canonical
  // order, so every rank that merges the same partials gets the same bits.
  Status merge_in_rank_order(const float* all, int p, float* out) const {
    return exec_->merge_ordered(all, static_cast<std::size_t>(p), state_floats(), records(),
                                head_dim(), out);
  }

  void note_buffers(std::size_t bytes) { peak_buffers_ = std::max(peak_buffers_, bytes); }
  std::size_t buffer_bytes() const override { return peak_buffers_; }

  Communicator* comm_ = nullptr;
  DType dtype_ = DType::kF32;
  std::size_t peak_buffers_ = 0;
};

// Binomial tree over n ranks rooted at 0 (relative ranks): the children of i.
inline std::vector<int> binomial_children(int i, int n) {
  std::vector<int> c;
  const int low = i == 0 ? (1 << 30) : (i & -i);
  for (int m = 1; m < low && i + m < n; m <<= 1) c.push_back(i + m);
  return c;
}

}  // namespace treeattn::strategies
