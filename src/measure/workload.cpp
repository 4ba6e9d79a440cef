// Deterministic workload data: counter-based random values, per-rank shards, the full cache.
#include "treeattn/workload.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace treeattn {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One key per (tensor, row, head, position): four mixes, then one mix per element.
uint64_t row_key(uint64_t seed, WorkloadTensor t, int64_t b, int64_t h, int64_t pos) {
  uint64_t x = splitmix64(seed ^ (static_cast<uint64_t>(t) << 56));
  x = splitmix64(x ^ static_cast<uint64_t>(b));
  x = splitmix64(x ^ static_cast<uint64_t>(h));
  return splitmix64(x ^ static_cast<uint64_t>(pos));
}

// 24 random bits -> [-1, 1), exactly representable (through a 32-bit integer: x >> 40 < 2^24,
// which the vectorized elements() below needs; AVX2 has no 64-bit integer to float conversion).
float element(uint64_t key, int64_t d) {
  const uint64_t x = splitmix64(key ^ static_cast<uint64_t>(d));
  return static_cast<float>(static_cast<int32_t>(x >> 40) - (int32_t{1} << 23)) * 0x1p-23f;
}

// out[d] = element(key, d) for d < n. Most of a large run's set-up is this loop (256k tokens x 8
// heads x 128 x K and V, once per method); the compiler vectorizes it, and the AVX2 clone makes 4
// elements per instruction.
__attribute__((target_clones("avx2", "default"))) void elements(uint64_t key, int64_t n,
                                                                float* out) {
  for (int64_t d = 0; d < n; ++d) out[d] = element(key, d);
}

}  // namespace

float workload_uniform(uint64_t seed, WorkloadTensor t, int64_t b, int64_t h, int64_t pos,
                       int64_t d) {
  return element(row_key(seed, t, b, h, pos), d);
}

void make_query(const WorkloadSpec& w, int64_t step, float* q) {
  const AttnShape& s = w.shape;
  std::size_t i = 0;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t qi = 0; qi < s.q_len; ++qi)
      for (int64_t h = 0; h < s.heads; ++h) {
        const uint64_t key = row_key(w.seed, WorkloadTensor::kQuery, b, h, step * s.q_len + qi);
        for (int64_t d = 0; d < s.head_dim; ++d) q[i++] = w.q_scale * element(key, d);
      }
}

void make_token(const WorkloadSpec& w, int64_t b, int64_t pos, float* k, float* v) {
  const AttnShape& s = w.shape;
  const int64_t D = s.head_dim;
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    elements(row_key(w.seed, WorkloadTensor::kKey, b, h, pos), D, k + h * D);
    elements(row_key(w.seed, WorkloadTensor::kValue, b, h, pos), D, v + h * D);
  }
  const auto n = static_cast<std::size_t>(s.kv_heads * D);
  round_to_dtype(w.dtype, k, n);
  round_to_dtype(w.dtype, v, n);
}

Status fill_local_shard(const WorkloadSpec& w, const ShardPlan& plan, LocalShard& shard) {
  if (shard.dtype() != w.dtype)
    return invalid_argument("shard dtype " + std::string(dtype_name(shard.dtype())) +
                            " differs from the workload's " + std::string(dtype_name(w.dtype)));
  const int r = shard.rank();
  if (plan.max_len(r) > shard.capacity()) shard.reserve(plan.max_len(r));
  const auto per_token = static_cast<std::size_t>(w.shape.kv_heads * w.shape.head_dim);
  for (int64_t b = 0; b < w.shape.batch; ++b) {
    const int64_t n = plan.len(r, b), start = plan.pos_start(r, b), stride = plan.pos_stride();
    // Threads only pay off for large shards (and spin-waiting threads hurt oversubscribed ranks).
#pragma omp parallel if (n * static_cast <int64_t>(per_token) >= (int64_t{1} << 20))
    {
      std::vector<float> k(per_token), v(per_token);
#pragma omp for schedule(static)
      for (int64_t j = 0; j < n; ++j) {
        make_token(w, b, start + j * stride, k.data(), v.data());
        shard.set_slot(b, j, k.data(), v.data());
      }
    }
  }
  return Status::ok();
}

KVCache make_full_cache(const WorkloadSpec& w, std::span<const int64_t> lens) {
  int64_t cap = 0;
  for (int64_t n : lens) cap = std::max(cap, n);
  KVCache cache(w.shape, w.dtype, cap);
  const auto per_token = static_cast<std::size_t>(w.shape.kv_heads * w.shape.head_dim);
  const auto D = static_cast<std::size_t>(w.shape.head_dim);
  for (int64_t b = 0; b < static_cast<int64_t>(lens.size()); ++b) {
    const int64_t n = lens[static_cast<std::size_t>(b)];
#pragma omp parallel if (n * static_cast<int64_t>(per_token) >= (int64_t{1} << 20))
    {
      std::vector<float> k(per_token), v(per_token);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < n; ++t) {
        make_token(w, b, t, k.data(), v.data());
        for (int64_t h = 0; h < w.shape.kv_heads; ++h)
          cache.set_token(b, h, t, k.data() + static_cast<std::size_t>(h) * D,
                          v.data() + static_cast<std::size_t>(h) * D);
      }
    }
  }
  return cache;
}

}  // namespace treeattn
