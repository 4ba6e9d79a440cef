// The CUDA executor's own device allocations, so that checking that a pointer is device memory of
// its device does not ask the driver (cudaPointerGetAttributes) about every pointer of every call.
// Host code without CUDA (tests/cuda/test_cuda_geometry.cpp checks it on any machine).
//
// The rule: a pointer inside [data, data + bytes) of an allocation the executor made
// (allocated()) and has not freed (freed()) is device memory of the executor's device; nothing
// else is known here. allocated() is called when cudaMalloc returns and freed() just before
// cudaFree, both by the executor itself, so an entry lives exactly as long as its memory: a
// buffer that GraphBuffers retires (graph_buffers.hpp) stays in until the last graph that may
// point at it is destroyed, since only then is it freed. Pointers of other allocations (a
// caller's cudaMalloc) are not cached: their frees are invisible to the executor, and a stale
// "device memory of this device" for an address freed and reused elsewhere (another device's
// memory) would turn the executor's kInvalidArgument into a kernel fault, so the executor asks
// the driver about them on every call.
//
// Thread-safe: Buffer destructors may run on another thread than the executor's calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace treeattn::gpu {

class DevicePointers {
 public:
  void allocated(const void* data, std::size_t bytes) {
    if (data == nullptr || bytes == 0) return;
    const std::lock_guard<std::mutex> lock(mu_);
    ranges_[address(data)] = bytes;
  }
  void freed(const void* data) {
    const std::lock_guard<std::mutex> lock(mu_);
    ranges_.erase(address(data));
  }
  // Whether p lies inside a live allocation of the executor.
  bool own(const void* p) const {
    const std::uintptr_t a = address(p);
    const std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(a);  // the first allocation starting after p
    if (it == ranges_.begin()) return false;
    --it;  // the last allocation starting at or before p
    return a - it->first < it->second;
  }
  std::size_t size() const {
    const std::lock_guard<std::mutex> lock(mu_);
    return ranges_.size();
  }

 private:
  static std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  mutable std::mutex mu_;
  std::map<std::uintptr_t, std::size_t> ranges_;  // start -> bytes, disjoint
};

}  // namespace treeattn::gpu
