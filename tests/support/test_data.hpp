// Shared helpers for tests: deterministic random inputs, whole-cache views and comparison of
// kernel states against the float64 oracle with the project's tolerance rule.
//
// Tolerance rule (../shared/research/reliability.md): states are float32 and K/V in f16/bf16
// are widened to float32 exactly, so for every KV dtype the kernel's only error is float32
// accumulation. We require max|out - ref| <= 1e-5 * max(1, max|ref|) on the normalized output
// and |lse - ref_lse| <= 1e-5 * max(1, |ref_lse|), against the float64 oracle on the same
// (widened) cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "treeattn/kernel.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/state.hpp"

namespace treeattn::testing {

// A whole cache with ragged per-row lengths and a query, filled with uniform values.
struct Problem {
  AttnShape shape;
  DType dtype = DType::kF32;
  std::vector<int64_t> len, start, total;
  KVCache cache;
  std::vector<float> q;

  Problem(const AttnShape& s, DType t, std::vector<int64_t> lengths, uint64_t seed,
          float q_scale = 1.0f)
      : shape(s), dtype(t), len(std::move(lengths)) {
    const int64_t cap = std::max<int64_t>(1, *std::max_element(len.begin(), len.end()));
    cache = KVCache(shape, dtype, cap);
    start.assign(len.size(), 0);
    total = len;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> k(static_cast<std::size_t>(s.head_dim)), v(k.size());
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < s.kv_heads; ++h)
        for (int64_t tok = 0; tok < len[static_cast<std::size_t>(b)]; ++tok) {
          for (auto& x : k) x = u(rng);
          for (auto& x : v) x = u(rng);
          cache.set_token(b, h, tok, k.data(), v.data());
        }
    q.resize(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
    for (auto& x : q) x = u(rng) * q_scale;
  }
  KVShard whole() const { return cache.view(0, len, start, total, 1); }
  std::size_t rows() const { return static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads); }
};

struct Errors {
  double out_abs = 0, ref_max = 0, lse_abs = 0;
  bool nan_mismatch = false;
  double out_rel() const { return out_abs / std::max(1.0, ref_max); }
};

// Compare float32 state records with the float64 oracle's normalized output and LSE.
inline Errors compare_states(const AttnShape& shape, const float* states, const double* ref_out,
                             const double* ref_lse) {
  Errors e;
  const std::size_t D = static_cast<std::size_t>(shape.head_dim);
  const std::size_t rows = static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads);
  std::vector<float> out(D);
  for (std::size_t r = 0; r < rows; ++r) {
    float lse = 0;
    state_normalize(states + r * (D + 2), D, out.data(), &lse);
    const double rl = ref_lse[r];
    if (std::isnan(rl) != std::isnan(lse)) e.nan_mismatch = true;
    if (std::isinf(rl) || std::isinf(lse)) {
      if (rl != static_cast<double>(lse)) e.lse_abs = std::numeric_limits<double>::infinity();
    } else if (!std::isnan(rl)) {
      e.lse_abs = std::max(e.lse_abs, std::abs(rl - lse) / std::max(1.0, std::abs(rl)));
    }
    for (std::size_t d = 0; d < D; ++d) {
      const double ref = ref_out[r * D + d];
      if (std::isnan(ref) != std::isnan(out[d])) e.nan_mismatch = true;
      if (std::isnan(ref)) continue;
      e.out_abs = std::max(e.out_abs, std::abs(ref - out[d]));
      e.ref_max = std::max(e.ref_max, std::abs(ref));
    }
  }
  return e;
}

// Runs the kernel and the oracle on p and returns the errors (fails the Status on error).
inline Status kernel_vs_oracle(const Problem& p, const DecodeOptions& opt, Errors* e) {
  std::vector<float> states(p.rows() * static_cast<std::size_t>(p.shape.head_dim + 2));
  TREEATTN_RETURN_IF_ERROR(decode_partial(p.shape, p.q.data(), p.whole(), states.data(), opt));
  std::vector<double> out(p.rows() * static_cast<std::size_t>(p.shape.head_dim)), lse(p.rows());
  TREEATTN_RETURN_IF_ERROR(oracle_attention(p.shape, p.q.data(), p.whole(), out.data(), lse.data(),
                                            static_cast<double>(opt.scale)));
  *e = compare_states(p.shape, states.data(), out.data(), lse.data());
  return Status::ok();
}

// Every ISA target this build and CPU can run, reference first.
inline std::vector<Isa> runnable_isas() {
  std::vector<Isa> v{Isa::kReference};
  for (Isa i : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(i)) continue;
    std::vector<float> st(3);
    AttnShape s{1, 1, 1, 64, 1};
    std::vector<int64_t> z{0};
    KVShard kv;
    kv.len = z; kv.pos_start = z; kv.total_len = z;
    std::vector<float> q(64), rec(66);
    if (decode_partial(s, q.data(), kv, rec.data(), DecodeOptions{0, 1, 0, i}).is_ok()) v.push_back(i);
  }
  return v;
}

}  // namespace treeattn::testing
