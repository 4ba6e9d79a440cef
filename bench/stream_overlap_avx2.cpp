// See stream_overlap.hpp. Compiled with -mavx2 -mfma (bench/CMakeLists.txt).
#include "stream_overlap.hpp"

#include <immintrin.h>

#include <cstdio>
#include <cstdlib>

namespace treeattn::bench {
namespace {

template <int kRounds>  // kRounds x 8 FMAs per line
float stream_impl(const float* p, int64_t n, int64_t pf) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  __m256 sum = _mm256_setzero_ps();
  const __m256 c = _mm256_set1_ps(1.0000001f);
  for (int64_t i = 0; i < n; i += 16) {
    if (pf > 0) _mm_prefetch(reinterpret_cast<const char*>(p + i) + pf, _MM_HINT_T0);
    const __m256 x = _mm256_loadu_ps(p + i), y = _mm256_loadu_ps(p + i + 8);
    if constexpr (kRounds == 0) {
      sum = _mm256_add_ps(sum, _mm256_add_ps(x, y));
    } else {
      for (int r = 0; r < kRounds; ++r)
        for (int j = 0; j < 8; j += 2) {
          a[j] = _mm256_fmadd_ps(x, c, a[j]);
          a[j + 1] = _mm256_fmadd_ps(y, c, a[j + 1]);
        }
    }
  }
  for (const auto& v : a) sum = _mm256_add_ps(sum, v);
  alignas(32) float t[8];
  _mm256_store_ps(t, sum);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

}  // namespace

float stream_with_fmas(const float* p, int64_t n, int fmas, int64_t prefetch_bytes) {
  switch (fmas) {
    case 0: return stream_impl<0>(p, n, prefetch_bytes);
    case 8: return stream_impl<1>(p, n, prefetch_bytes);
    case 16: return stream_impl<2>(p, n, prefetch_bytes);
    case 32: return stream_impl<4>(p, n, prefetch_bytes);
  }
  std::fprintf(stderr, "stream_with_fmas: %d FMAs a line; 0, 8, 16 or 32\n", fmas);
  std::abort();
}

}  // namespace treeattn::bench
