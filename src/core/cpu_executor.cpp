// The host executor (executor.hpp): today's CPU kernels and the state algebra on host memory.
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "treeattn/executor.hpp"
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
