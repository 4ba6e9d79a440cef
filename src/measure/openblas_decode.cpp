// The OpenBLAS peer of the decode kernel (see include/treeattn/peer.hpp): SGEMM for the
// scores, a plain softmax, SGEMM for the output. Built only with TREEATTN_HAVE_OPENBLAS;
// otherwise it reports kUnsupported.
#include "treeattn/peer.hpp"

#include "treeattn/state.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#if defined(TREEATTN_HAVE_OPENBLAS)
#include <cblas.h>
#endif

namespace treeattn {

bool openblas_available() {
#if defined(TREEATTN_HAVE_OPENBLAS)
  return true;
#else
  return false;
#endif
}

Status openblas_decode_partial(const AttnShape& shape, const float* q, const KVShard& kv,
                               float* states, float scale, int threads) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  TREEATTN_RETURN_IF_ERROR(kv.validate(shape));
  if (q == nullptr || states == nullptr) return invalid_argument("query or state pointer is null");
#if !defined(TREEATTN_HAVE_OPENBLAS)
  (void)scale;
  (void)threads;
  return unsupported("this build has no OpenBLAS (install libopenblas-dev and reconfigure)");
#else
  if (kv.dtype != DType::kF32)
    return unsupported("the OpenBLAS peer supports f32 KV only, got " +
                       std::string(dtype_name(kv.dtype)));
  const int64_t B = shape.batch, H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim;
  const int64_t Q = shape.q_len, G = shape.group(), R = G * Q;
  if (scale == 0.0f) scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  if (threads > 0) openblas_set_num_threads(threads);
  int64_t maxlen = 0;
  for (int64_t b = 0; b < B; ++b) maxlen = std::max(maxlen, kv.len[static_cast<std::size_t>(b)]);
  if (maxlen > std::numeric_limits<int>::max() || kv.stride_token > std::numeric_limits<int>::max())
    return unsupported("the OpenBLAS peer needs lengths and strides below 2^31, got " +
                       std::to_string(maxlen) + " tokens");
  const std::size_t rec = static_cast<std::size_t>(D + 2);
  std::vector<float> qg(static_cast<std::size_t>(R * D));
  std::vector<float> p(static_cast<std::size_t>(R * std::max<int64_t>(maxlen, 1)));
  std::vector<float> o(static_cast<std::size_t>(R * D));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const auto* kbase = static_cast<const float*>(kv.k);
  const auto* vbase = static_cast<const float*>(kv.v);

  for (int64_t b = 0; b < B; ++b) {
    const auto ub = static_cast<std::size_t>(b);
    const int n = static_cast<int>(kv.len[ub]);
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            qg[static_cast<std::size_t>((i * G + g) * D + d)] = q[((b * Q + i) * H + kvh * G + g) * D + d];
      float* dst0 = states + static_cast<std::size_t>(b * Q * H) * rec;
      if (n == 0) {
        for (int64_t i = 0; i < Q; ++i)
          for (int64_t g = 0; g < G; ++g) state_set_empty(dst0 + static_cast<std::size_t>(i * H + kvh * G + g) * rec, static_cast<std::size_t>(D));
        continue;
      }
      const float* kp = kbase + b * kv.stride_batch + kvh * kv.stride_head;
      const float* vp = vbase + b * kv.stride_batch + kvh * kv.stride_head;
      const int ld = static_cast<int>(kv.stride_token);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(R), n,
                  static_cast<int>(D), scale, qg.data(), static_cast<int>(D), kp, ld, 0.0f,
                  p.data(), n);
      std::vector<float> m(static_cast<std::size_t>(R)), l(static_cast<std::size_t>(R));
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G;
        const int64_t limit = kv.total_len[ub] - Q + i;
        float* pr = p.data() + r * n;
        float mx = kNegInf;
        bool nan = false;
        for (int t = 0; t < n; ++t) {
          if (kv.pos_start[ub] + t * kv.pos_stride > limit) {
            pr[t] = kNegInf;
            continue;
          }
          if (std::isnan(pr[t])) nan = true;
          mx = pr[t] > mx ? pr[t] : mx;
        }
        if (nan) mx = std::numeric_limits<float>::quiet_NaN();
        float sum = 0.0f;
        if (mx == kNegInf) {
          for (int t = 0; t < n; ++t) pr[t] = 0.0f;
        } else {
          for (int t = 0; t < n; ++t) {
            pr[t] = pr[t] == kNegInf ? 0.0f : std::exp(pr[t] - mx);
            sum += pr[t];
          }
        }
        m[static_cast<std::size_t>(r)] = mx;
        l[static_cast<std::size_t>(r)] = sum;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(R),
                  static_cast<int>(D), n, 1.0f, p.data(), n, vp, ld, 0.0f, o.data(),
                  static_cast<int>(D));
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r / G, g = r % G;
        float* dst = dst0 + static_cast<std::size_t>(i * H + kvh * G + g) * rec;
        state_m(dst) = m[static_cast<std::size_t>(r)];
        state_l(dst) = l[static_cast<std::size_t>(r)];
        for (int64_t d = 0; d < D; ++d) state_o(dst)[d] = o[static_cast<std::size_t>(r * D + d)];
      }
    }
  }
  return Status::ok();
#endif
}

}  // namespace treeattn
