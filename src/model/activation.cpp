// The gated activation's generic target and the dispatch over threads and targets
// (activation.hpp). Compiled for the baseline ISA.
#include "model/activation.hpp"

#include <omp.h>

#include <algorithm>

namespace treeattn::model {
namespace detail {

void gated_generic(FfnActivation act, float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gated_one(act, gate[i], up[i]);
}

void exp_generic(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = expf_glibc(x[i]);
}

}  // namespace detail

void gated_activation(FfnActivation act, float* gate, const float* up, int64_t n, Isa isa,
                      int threads) {
  if (isa == Isa::kAuto) isa = best_isa();
  auto fn = detail::gated_generic;
#if defined(TREEATTN_MODEL_X86)
  if (isa == Isa::kAvx512)
    fn = detail::gated_avx512;
  else if (isa == Isa::kAvx2)
    fn = detail::gated_avx2;
#endif
  // Threads take whole vectors of 16 elements (the bits do not depend on the split anyway).
  constexpr int64_t kGrain = 16 * 1024;
  if (threads <= 0) threads = omp_get_max_threads();
  threads = static_cast<int>(std::clamp<int64_t>((n + kGrain - 1) / kGrain, 1, threads));
  if (threads == 1) return fn(act, gate, up, n);
#pragma omp parallel num_threads(threads)
  {
    const int64_t per = (n / threads + 15) / 16 * 16;
    const int64_t lo = std::min(n, per * omp_get_thread_num());
    const int64_t hi = omp_get_thread_num() == threads - 1 ? n : std::min(n, lo + per);
    fn(act, gate + lo, up + lo, hi - lo);
  }
}

}  // namespace treeattn::model
