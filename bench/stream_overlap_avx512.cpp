// See stream_overlap.hpp. Compiled with -mavx512f (bench/CMakeLists.txt).
#include <immintrin.h>

#include <cstdio>
#include <cstdlib>

#include "stream_overlap.hpp"

namespace treeattn::bench {
namespace {

// per 64-byte line, one zmm load, each FMA into its own accumulator; kLocality: 3 prefetcht0,
// 2 prefetcht1 (__builtin_prefetch's locality argument)
template <int kFmas, int kLocality>
float stream512_impl(const float* p, int64_t n, int64_t pf) {
  __m512 a[kFmas > 0 ? kFmas : 1];
  for (auto& v : a) v = _mm512_setzero_ps();
  __m512 sum = _mm512_setzero_ps();
  const __m512 c = _mm512_set1_ps(1.0000001f);
  for (int64_t i = 0; i < n; i += 16) {
    if (pf > 0) __builtin_prefetch(reinterpret_cast<const char*>(p + i) + pf, 0, kLocality);
    const __m512 x = _mm512_loadu_ps(p + i);
    if constexpr (kFmas == 0) {
      sum = _mm512_add_ps(sum, x);
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < kFmas; ++j) a[j] = _mm512_fmadd_ps(x, c, a[j]);
    }
  }
  for (const auto& v : a) sum = _mm512_add_ps(sum, v);
  alignas(64) float t[16];  // not _mm512_reduce_add_ps: GCC 12 warns inside it (bug 105593)
  _mm512_store_ps(t, sum);
  float r = 0.0f;
  for (float x : t) r += x;
  return r;
}

template <int kFmas>
float stream512_hint(const float* p, int64_t n, int64_t pf, bool into_l2) {
  return into_l2 ? stream512_impl<kFmas, 2>(p, n, pf) : stream512_impl<kFmas, 3>(p, n, pf);
}

}  // namespace

float stream_with_fmas_avx512(const float* p, int64_t n, int fmas, int64_t prefetch_bytes,
                              bool into_l2) {
  switch (fmas) {
    case 0: return stream512_hint<0>(p, n, prefetch_bytes, into_l2);
    case 8: return stream512_hint<8>(p, n, prefetch_bytes, into_l2);
    case 12: return stream512_hint<12>(p, n, prefetch_bytes, into_l2);
    case 16: return stream512_hint<16>(p, n, prefetch_bytes, into_l2);
  }
  std::fprintf(stderr, "stream_with_fmas_avx512: %d FMAs a line; 0, 8, 12 or 16\n", fmas);
  std::abort();
}

}  // namespace treeattn::bench
