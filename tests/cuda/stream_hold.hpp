// A CUDA stream held still for a test: everything enqueued on it after StreamHold::start waits
// until release() (or the hold's destruction, or 30 s at most), so that an operation behind it
// stays incomplete as one waiting for a dead rank would. For the NCCL watchdog tests on one GPU
// (test_nccl_comm.cpp). In a build without CUDA, start() is kUnsupported.
#pragma once

#include <memory>

#include "treeattn/status.hpp"

namespace treeattn::test {

class StreamHold {
 public:
  // Enqueues the hold on `stream` (a cudaStream_t, e.g. cuda_stream(executor)).
  static Result<std::unique_ptr<StreamHold>> start(void* stream);
  ~StreamHold() { release(); }
  StreamHold(const StreamHold&) = delete;
  StreamHold& operator=(const StreamHold&) = delete;
  void release();

  struct State;

 private:
  StreamHold() = default;
  std::shared_ptr<State> state_;
};

}  // namespace treeattn::test
