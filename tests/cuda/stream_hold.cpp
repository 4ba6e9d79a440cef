// StreamHold (stream_hold.hpp): a host function on the stream that waits for release().
#include "stream_hold.hpp"

#include <chrono>
#include <condition_variable>
#include <mutex>

#if TREEATTN_TEST_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace treeattn::test {

struct StreamHold::State {
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
};

void StreamHold::release() {
  if (!state_) return;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->released = true;
  }
  state_->cv.notify_all();
}

#if TREEATTN_TEST_HAVE_CUDA
namespace {

// Runs on CUDA's callback thread: blocks the stream until released (at most 30 s), then drops
// its reference to the state (the hold itself may be gone by then).
void CUDART_CB wait_for_release(void* p) {
  auto* state = static_cast<std::shared_ptr<StreamHold::State>*>(p);
  {
    std::unique_lock<std::mutex> lk((*state)->mu);
    (*state)->cv.wait_for(lk, std::chrono::seconds(30), [&] { return (*state)->released; });
  }
  delete state;
}

}  // namespace

Result<std::unique_ptr<StreamHold>> StreamHold::start(void* stream) {
  std::unique_ptr<StreamHold> h(new StreamHold());
  h->state_ = std::make_shared<State>();
  auto* ref = new std::shared_ptr<State>(h->state_);
  const cudaError_t e =
      cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), wait_for_release, ref);
  if (e != cudaSuccess) {
    delete ref;
    return internal_error(std::string("cudaLaunchHostFunc: ") + cudaGetErrorString(e));
  }
  return h;
}
#else
Result<std::unique_ptr<StreamHold>> StreamHold::start(void*) {
  return unsupported("StreamHold: this build has no CUDA");
}
#endif

}  // namespace treeattn::test
