// The reference CPU decode kernel: scalar, one token at a time, easy to read.
//
// Work items are (batch row, KV head, chunk of chunk_tokens tokens). For each token of a chunk
// the key and value are widened to float once and then serve every query head of the KV
// head's group and every query position (grouped-query attention without repeating KV). Each
// (query, head) keeps an online-softmax state in float; chunk states are merged in chunk order
// with state_merge, so results do not depend on the number of threads.
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/kernel_impl.hpp"
#include "treeattn/state.hpp"

namespace treeattn::kernels {

Status decode_reference(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                        const ResolvedOptions& opt) {
  const int64_t B = shape.batch, H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim;
  const int64_t Q = shape.q_len, G = shape.group();
  const std::size_t rec = static_cast<std::size_t>(D + 2);
  const std::size_t rows_per_item = static_cast<std::size_t>(G * Q);

  // Enumerate work items: chunk c of (b, kvh) covers tokens [c*chunk, min(len, (c+1)*chunk)).
  std::vector<int64_t> first_chunk(static_cast<std::size_t>(B) + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = kv.len[static_cast<std::size_t>(b)];
    const int64_t chunks = (n + opt.chunk_tokens - 1) / opt.chunk_tokens;
    first_chunk[static_cast<std::size_t>(b) + 1] = first_chunk[static_cast<std::size_t>(b)] + chunks;
  }
  const int64_t chunks_total = first_chunk[static_cast<std::size_t>(B)];
  const int64_t items = chunks_total * Hkv;
  std::vector<float> scratch(static_cast<std::size_t>(items) * rows_per_item * rec);

  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

#pragma omp parallel for schedule(dynamic) num_threads(opt.threads)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t kvh = item % Hkv;
    const int64_t gchunk = item / Hkv;
    int64_t b = 0;
    while (first_chunk[static_cast<std::size_t>(b) + 1] <= gchunk) ++b;
    const int64_t c = gchunk - first_chunk[static_cast<std::size_t>(b)];
    const int64_t n = kv.len[static_cast<std::size_t>(b)];
    const int64_t t0 = c * opt.chunk_tokens;
    const int64_t t1 = std::min(n, t0 + opt.chunk_tokens);
    float* out = scratch.data() + static_cast<std::size_t>(item) * rows_per_item * rec;
    for (std::size_t r = 0; r < rows_per_item; ++r) state_set_empty(out + r * rec, static_cast<std::size_t>(D));

    std::vector<float> kf(static_cast<std::size_t>(D)), vf(static_cast<std::size_t>(D));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pos = kv.pos_start[static_cast<std::size_t>(b)] + t * kv.pos_stride;
      const int64_t base = b * kv.stride_batch + kvh * kv.stride_head + t * kv.stride_token;
      // Quantized dtypes: the token's scales (see dequantize() in dtype.hpp).
      float ks = 1.0f, vs = 1.0f;
      if (kv.k_scale != nullptr) {
        const int64_t si = b * kv.scale_stride_batch + kvh * kv.scale_stride_head + t * kv.scale_stride_token;
        ks = kv.k_scale[si];
        vs = kv.v_scale[si];
      }
      for (int64_t d = 0; d < D; ++d) {
        kf[static_cast<std::size_t>(d)] = dequantize(kv.k, kv.dtype, static_cast<std::size_t>(base + d), ks);
        vf[static_cast<std::size_t>(d)] = dequantize(kv.v, kv.dtype, static_cast<std::size_t>(base + d), vs);
      }
      for (int64_t i = 0; i < Q; ++i) {
        if (pos > kv.total_len[static_cast<std::size_t>(b)] - Q + i) continue;  // causal limit
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kvh * G + g;
          const float* qv = q + ((b * Q + i) * H + h) * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qv[d] * kf[static_cast<std::size_t>(d)];
          const float s = dot * opt.scale;
          if (s == kNegInf) continue;  // weight exactly 0 (only reachable with -inf inputs)
          float* st = out + static_cast<std::size_t>(i * G + g) * rec;
          float m = state_m(st);
          float m_new = (std::isnan(s) || std::isnan(m)) ? kNaN : (s > m ? s : m);
          if (m_new != m) {  // rescale what was accumulated so far (0 when it was empty)
            const float a = (m == kNegInf) ? 0.0f : std::exp(m - m_new);
            state_l(st) *= a;
            for (int64_t d = 0; d < D; ++d) state_o(st)[d] *= a;
            state_m(st) = m_new;
            m = m_new;
          }
          const float p = std::exp(s - m);
          state_l(st) += p;
          for (int64_t d = 0; d < D; ++d) state_o(st)[d] += p * vf[static_cast<std::size_t>(d)];
        }
      }
    }
  }

  // Merge chunks in order into the output records.
  for (std::size_t r = 0; r < static_cast<std::size_t>(B * Q * H); ++r)
    state_set_empty(states + r * rec, static_cast<std::size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = first_chunk[static_cast<std::size_t>(b)]; c < first_chunk[static_cast<std::size_t>(b) + 1]; ++c) {
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        const float* in = scratch.data() + static_cast<std::size_t>(c * Hkv + kvh) * rows_per_item * rec;
        for (int64_t i = 0; i < Q; ++i)
          for (int64_t g = 0; g < G; ++g)
            state_merge(states + static_cast<std::size_t>((b * Q + i) * H + kvh * G + g) * rec,
                        in + static_cast<std::size_t>(i * G + g) * rec, static_cast<std::size_t>(D));
      }
    }
  }
  return Status::ok();
}

}  // namespace treeattn::kernels
