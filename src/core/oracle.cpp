// The float64 oracle (see include/treeattn/oracle.hpp). Deliberately plain: two passes per
// query row (max, then exp-sum), every element widened exactly to double.
#include "treeattn/oracle.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "treeattn/state.hpp"

namespace treeattn {
namespace {

// Element i of K or V as the kernels see it (dequantized with the token's scale, which is
// ignored for unquantized dtypes).
double load(const void* base, DType t, int64_t i, float scale) {
  return static_cast<double>(dequantize(base, t, static_cast<std::size_t>(i), scale));
}

float token_scale(const float* scales, const KVShard& kv, int64_t b, int64_t h, int64_t j) {
  if (scales == nullptr) return 1.0f;
  return scales[b * kv.scale_stride_batch + h * kv.scale_stride_head + j * kv.scale_stride_token];
}

// Writes one float64 record [m, l, o...] per (b, i, h) for the visible keys of the shard.
Status partial_records(const AttnShape& shape, const float* q, const KVShard& kv, double* states,
                       double scale) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  TREEATTN_RETURN_IF_ERROR(kv.validate(shape));
  if (q == nullptr) return invalid_argument("query pointer is null");
  if (states == nullptr) return invalid_argument("output pointer is null");
  const int64_t D = shape.head_dim, Q = shape.q_len, H = shape.heads, B = shape.batch;
  const int64_t group = shape.group();
  if (scale == 0.0) scale = 1.0 / std::sqrt(static_cast<double>(D));
  const std::size_t rec = static_cast<std::size_t>(D + 2);
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();

#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / group;
      const int64_t n = kv.len[static_cast<std::size_t>(b)];
      std::vector<double> s(static_cast<std::size_t>(n));
      for (int64_t i = 0; i < Q; ++i) {
        double* out = states + static_cast<std::size_t>((b * Q + i) * H + h) * rec;
        const float* qv = q + ((b * Q + i) * H + h) * D;
        const int64_t limit = kv.total_len[static_cast<std::size_t>(b)] - Q + i;
        double m = kNegInf;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t pos = kv.pos_start[static_cast<std::size_t>(b)] + j * kv.pos_stride;
          if (pos > limit) {
            s[static_cast<std::size_t>(j)] = kNegInf;
            continue;
          }
          const int64_t base = b * kv.stride_batch + kvh * kv.stride_head + j * kv.stride_token;
          const float ks = token_scale(kv.k_scale, kv, b, kvh, j);
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d)
            dot += static_cast<double>(qv[d]) * load(kv.k, kv.dtype, base + d, ks);
          const double sj = dot * scale;
          s[static_cast<std::size_t>(j)] = sj;
          if (std::isnan(sj) || std::isnan(m)) m = kNaN;
          else if (sj > m) m = sj;
        }
        state_set_empty(out, static_cast<std::size_t>(D));
        state_m(out) = m;
        if (m == kNegInf) continue;  // nothing visible: the empty state
        for (int64_t j = 0; j < n; ++j) {
          const double sj = s[static_cast<std::size_t>(j)];
          if (sj == kNegInf) continue;
          const double p = std::exp(sj - m);
          state_l(out) += p;
          const int64_t base = b * kv.stride_batch + kvh * kv.stride_head + j * kv.stride_token;
          const float vs = token_scale(kv.v_scale, kv, b, kvh, j);
          for (int64_t d = 0; d < D; ++d) state_o(out)[d] += p * load(kv.v, kv.dtype, base + d, vs);
        }
      }
    }
  }
  return Status::ok();
}

}  // namespace

Status oracle_partial(const AttnShape& shape, const float* q, const KVShard& kv, double* states,
                      double scale) {
  return partial_records(shape, q, kv, states, scale);
}

Status oracle_attention(const AttnShape& shape, const float* q, const KVShard& kv, double* out,
                        double* lse, double scale) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  if (out == nullptr || lse == nullptr) return invalid_argument("output pointer is null");
  const std::size_t rows = static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads);
  const std::size_t D = static_cast<std::size_t>(shape.head_dim);
  std::vector<double> states(rows * (D + 2));
  TREEATTN_RETURN_IF_ERROR(partial_records(shape, q, kv, states.data(), scale));
  for (std::size_t r = 0; r < rows; ++r) state_normalize(states.data() + r * (D + 2), D, out + r * D, lse + r);
  return Status::ok();
}

}  // namespace treeattn
