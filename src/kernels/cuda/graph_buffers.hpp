// The lifetime rule for the buffers of its own that a CUDA executor's graphs point at (the split
// workspace and the ticket counters of partial()): a captured graph keeps the addresses it was
// captured with, so a buffer that grows may be freed only when no graph of the executor lives.
// GraphBuffers<B> replaces such a buffer and keeps the old one (retired) while a graph lives; the
// last graph's destruction frees the retired ones. Host code without CUDA (B is Buffer in the
// executor, a counting stand-in in tests/cuda/test_cuda_geometry.cpp). Called from one thread at
// a time, as every call of an executor.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "treeattn/status.hpp"

namespace treeattn::gpu {

template <class B>
class GraphBuffers {
 public:
  // Replaces `slot` by the buffer make() returns (a Result<B>): with no live graph the old buffer
  // is freed first (the new one may need its memory); with one, the new buffer is made first and
  // the old one retired, so a failed make() leaves `slot` as it was. Returns make()'s error.
  template <class Make>
  Status replace(B& slot, Make&& make) {
    if (graphs_ == 0) slot = B();
    auto next = make();
    if (!next.is_ok()) return next.status();
    if (graphs_ > 0 && !slot.empty()) retired_.push_back(std::move(slot));
    slot = std::move(*next);
    return Status::ok();
  }
  void graph_created() { ++graphs_; }
  // The last live graph gone: nothing points at the retired buffers any more.
  void graph_destroyed() {
    if (graphs_ > 0 && --graphs_ == 0) retired_.clear();
  }
  int graphs() const { return graphs_; }
  std::size_t retired() const { return retired_.size(); }

 private:
  int graphs_ = 0;
  std::vector<B> retired_;
};

}  // namespace treeattn::gpu
