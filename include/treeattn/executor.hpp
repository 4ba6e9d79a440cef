// The local executor: everything a strategy does on this rank besides talking to the others.
//
// Strategies are written against two interfaces: the Communicator (what crosses between ranks)
// and the Executor (what happens inside one rank: partial attention over a shard, merging,
// rescaling and copying state records, allocating buffers, waiting for queued work). Neither
// names a memory space in its calls; both report it (CommCapabilities::memory,
// Executor::memory()), and every pointer a strategy passes to them, every buffer it allocates
// through Executor::allocate and the KV shard it reads live in that space. The CPU executor
// (cpu_executor()) runs today's kernels on host memory; a device executor (CUDA) implements the
// same calls with kernels on its stream, so no strategy changes when it is added.
//
// Contract:
// - Calls may be queued (a device stream) and complete in order; synchronize() waits for all of
//   them. A host executor completes every call before returning. A stream-ordered executor and
//   the stream-ordered communicator it is paired with (NCCL) enqueue on the same stream, so a
//   strategy never synchronizes between an executor call and a collective that uses its result;
//   it synchronizes only before it reads device data on the host (to_host does that itself).
// - Host-visible results (to_host) are complete when to_host returns.
// - Records are packed states (state.hpp): n records of head_dim + 2 floats each.
// - Every merge is state_merge, so results are the same bits whichever executor runs them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include "treeattn/comm.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

class Executor;

// An owning buffer allocated by an Executor, in its memory space. Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Executor* owner, void* data, std::size_t bytes) : owner_(owner), data_(data), bytes_(bytes) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      owner_ = std::exchange(o.owner_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  void reset();

 private:
  Executor* owner_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual std::string_view name() const = 0;  // "cpu", "cuda"
  virtual MemorySpace memory() const = 0;

  // ---- memory --------------------------------------------------------------------------------
  // bytes == 0 gives an empty buffer. Out of memory is kOutOfMemory naming the size.
  virtual Result<Buffer> allocate(std::size_t bytes) = 0;
  // Called by Buffer; never directly.
  virtual void release(void* data, std::size_t bytes) noexcept = 0;
  // Copies inside this executor's memory space.
  virtual Status copy(void* dst, const void* src, std::size_t bytes) = 0;
  // Between host memory and this executor's memory (plain copies on the CPU executor).
  virtual Status to_host(void* host_dst, const void* src, std::size_t bytes) = 0;
  virtual Status from_host(void* dst, const void* host_src, std::size_t bytes) = 0;

  // ---- attention and state algebra ------------------------------------------------------------
  // states <- the partial states of q against kv (kernel.hpp decode_partial semantics).
  virtual Status partial(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                         const DecodeOptions& options) = 0;
  // The partial states of q against each chunk of chunk_tokens consecutive token slots of kv,
  // separately: chunk c covers slots [c * chunk_tokens, (c + 1) * chunk_tokens) of every batch
  // row (the last may be shorter) and its records go to states + c * records * (head_dim + 2),
  // for c < chunks = ceil(max row length / chunk_tokens). Each chunk is one kernel work item per
  // KV head, so every chunk's bits are independent of the thread count and of where the chunk
  // sits in memory (the deterministic strategy's leaves).
  virtual Status partial_chunks(const AttnShape& shape, const float* q, const KVShard& kv,
                                int64_t chunk_tokens, float* states,
                                const DecodeOptions& options) = 0;
  // n records set to the empty state.
  virtual Status set_empty(float* states, std::size_t n, std::size_t head_dim) = 0;
  // acc[i] <- acc[i] (+) x[i] for n records.
  virtual Status merge(float* acc, const float* x, std::size_t n, std::size_t head_dim) = 0;
  // out <- empty (+) parts[0] (+) parts[1] ... (+) parts[count - 1], left to right, where part k
  // is the n records at parts + k * part_stride floats: the canonical order that gives every
  // rank merging the same parts the same bits.
  virtual Status merge_ordered(const float* parts, std::size_t count, std::size_t part_stride,
                               std::size_t n, std::size_t head_dim, float* out) = 0;
  // lse[i] <- state_lse(record i).
  virtual Status lse(const float* states, std::size_t n, std::size_t head_dim, float* lse) = 0;
  // The paper's sum form (state.hpp state_to_sum_form) of n records given each record's global
  // max LSE: record i's weighted output at num + i * num_stride, its weight at den[i], or, when
  // den is null, at num[i * num_stride + head_dim] (the fused form, num_stride >= head_dim + 1).
  virtual Status to_sum_form(const float* states, const float* max_lse, std::size_t n,
                             std::size_t head_dim, float* num, std::size_t num_stride,
                             float* den) = 0;
  // The inverse after the sums (state_from_sum_form); den null: fused as above.
  virtual Status from_sum_form(const float* max_lse, const float* num, std::size_t num_stride,
                               const float* den, std::size_t n, std::size_t head_dim,
                               float* states) = 0;

  // out[i][0..head_dim) = o / l of record i and lse[i] = m + log(l) (state_normalize); lse may
  // be null. The empty state gives 0 and -inf.
  virtual Status normalize(const float* states, std::size_t n, std::size_t head_dim, float* out,
                           float* lse) = 0;

  // Waits for every queued call (a no-op on the CPU executor).
  virtual Status synchronize() { return Status::ok(); }
};

// The host executor: the CPU kernels (kernel.hpp) and the state algebra (state.hpp) on host
// memory. One instance serves every thread (it holds no per-call state).
Executor& cpu_executor();

inline void Buffer::reset() {
  if (owner_ && data_) owner_->release(data_, bytes_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace treeattn
