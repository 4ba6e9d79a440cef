// std::vector storage on 64-byte (cache line) boundaries: a 512-bit load from such a buffer at a
// multiple of 16 floats never spans two lines (a split load costs a second cache access).
// glibc's malloc returns 16-byte aligned blocks (a large block is a mapping plus a 16-byte header),
// so a plain std::vector<float> splits every such load.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace treeattn {

inline constexpr std::size_t kCacheLine = 64;

template <class T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <class U>
  constexpr CacheAligned(const CacheAligned<U>& /*other*/) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine}));
  }
  void deallocate(T* p, std::size_t /*n*/) noexcept {
    ::operator delete(p, std::align_val_t{kCacheLine});
  }
  template <class U>
  bool operator==(const CacheAligned<U>& /*other*/) const noexcept {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheAligned<T>>;

}  // namespace treeattn
