// The host executor (executor.hpp): today's CPU kernels and the state algebra on host memory.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "treeattn/executor.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace {

class CpuExecutor final : public Executor {
 public:
  std::string_view name() const override { return "cpu"; }
  MemorySpace memory() const override { return MemorySpace::kHost; }

  Result<Buffer> allocate(std::size_t bytes) override {
    if (bytes == 0) return Buffer();
    // 64-byte alignment: whole cache lines for the kernels' vector loads.
    const std::size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p)
      return Status(Code::kOutOfMemory,
                    "cpu executor: cannot allocate " + std::to_string(bytes) + " bytes");
    return Buffer(this, p, bytes);
  }
  void release(void* data, std::size_t) noexcept override { std::free(data); }

  Status copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
    return Status::ok();
  }
  Status to_host(void* host_dst, const void* src, std::size_t bytes) override {
    return copy(host_dst, src, bytes);
  }
  Status from_host(void* dst, const void* host_src, std::size_t bytes) override {
    return copy(dst, host_src, bytes);
  }

  Status partial(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                 const DecodeOptions& options) override {
    return decode_partial(shape, q, kv, states, options);
  }
  Status partial_chunks(const AttnShape& shape, const float* q, const KVShard& kv,
                        int64_t chunk_tokens, float* states,
                        const DecodeOptions& options) override {
    if (chunk_tokens < 1)
      return invalid_argument("partial_chunks: chunk_tokens must be >= 1, got " +
                              std::to_string(chunk_tokens));
    TREEATTN_RETURN_IF_ERROR(check_thread_count(options.threads));
    if (kv.tiled != nullptr)
      return invalid_argument(
          "partial_chunks: the KV shard is in the tiled layout; chunks are cut from row views "
          "(a decode session for the deterministic strategy stores rows)");
    TREEATTN_RETURN_IF_ERROR(kv.validate(shape));
    int64_t longest = 0;
    for (int64_t n : kv.len) longest = std::max(longest, n);
    const int64_t chunks = (longest + chunk_tokens - 1) / chunk_tokens;
    const auto B = static_cast<std::size_t>(shape.batch);
    const std::size_t per_chunk = static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads) *
                                  state_record_floats(static_cast<std::size_t>(shape.head_dim));
    const std::size_t es = dtype_size(kv.dtype);
    DecodeOptions one = options;
    one.threads = 1;               // chunks in parallel, each one work item per KV head
    one.chunk_tokens = chunk_tokens;
    const int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
    Status first;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
      std::vector<int64_t> len(B), pos(B);
      for (std::size_t b = 0; b < B; ++b) {
        len[b] = std::clamp<int64_t>(kv.len[b] - c * chunk_tokens, 0, chunk_tokens);
        pos[b] = kv.pos_start[b] + c * chunk_tokens * kv.pos_stride;
      }
      KVShard part = kv;
      const auto off = static_cast<std::size_t>(c * chunk_tokens * kv.stride_token) * es;
      part.k = static_cast<const uint8_t*>(kv.k) + off;
      part.v = static_cast<const uint8_t*>(kv.v) + off;
      if (kv.k_scale) {
        const auto soff = static_cast<std::size_t>(c * chunk_tokens * kv.scale_stride_token);
        part.k_scale = kv.k_scale + soff;
        part.v_scale = kv.v_scale + soff;
      }
      part.len = len;
      part.pos_start = pos;
      Status s = decode_partial(shape, q, part, states + static_cast<std::size_t>(c) * per_chunk, one);
      if (!s.is_ok()) {
#pragma omp critical
        if (first.is_ok()) first = s;
      }
    }
    return first;
  }
  Status set_empty(float* states, std::size_t n, std::size_t d) override {
    const std::size_t r = state_record_floats(d);
    for (std::size_t i = 0; i < n; ++i) state_set_empty(states + i * r, d);
    return Status::ok();
  }
  Status merge(float* acc, const float* x, std::size_t n, std::size_t d) override {
    state_merge_n(acc, x, n, d);
    return Status::ok();
  }
  Status merge_ordered(const float* parts, std::size_t count, std::size_t part_stride,
                       std::size_t n, std::size_t d, float* out) override {
    TREEATTN_RETURN_IF_ERROR(set_empty(out, n, d));
    for (std::size_t k = 0; k < count; ++k) state_merge_n(out, parts + k * part_stride, n, d);
    return Status::ok();
  }
  Status lse(const float* states, std::size_t n, std::size_t d, float* out) override {
    const std::size_t r = state_record_floats(d);
    for (std::size_t i = 0; i < n; ++i) out[i] = state_lse(states + i * r);
    return Status::ok();
  }
  Status to_sum_form(const float* states, const float* max_lse, std::size_t n, std::size_t d,
                     float* num, std::size_t num_stride, float* den) override {
    const std::size_t r = state_record_floats(d);
    for (std::size_t i = 0; i < n; ++i) {
      float* dst = num + i * num_stride;
      state_to_sum_form(states + i * r, max_lse[i], d, dst, den ? den + i : dst + d);
    }
    return Status::ok();
  }
  Status from_sum_form(const float* max_lse, const float* num, std::size_t num_stride,
                       const float* den, std::size_t n, std::size_t d, float* states) override {
    const std::size_t r = state_record_floats(d);
    for (std::size_t i = 0; i < n; ++i) {
      const float* src = num + i * num_stride;
      state_from_sum_form(max_lse[i], src, den ? den[i] : src[d], d, states + i * r);
    }
    return Status::ok();
  }
  Status normalize(const float* states, std::size_t n, std::size_t d, float* out,
                   float* lse) override {
    const std::size_t r = state_record_floats(d);
    for (std::size_t i = 0; i < n; ++i)
      state_normalize(states + i * r, d, out + i * d, lse ? lse + i : nullptr);
    return Status::ok();
  }
};

}  // namespace

Executor& cpu_executor() {
  static CpuExecutor e;
  return e;
}

}  // namespace treeattn
