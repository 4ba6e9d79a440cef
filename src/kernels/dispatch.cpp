// decode_partial(): validation, defaults and the one place where a run-time ISA choice is made.
#include <omp.h>

#include <cmath>
#include <string>

#include "kernels/kernel_impl.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"

namespace treeattn {

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kReference: return "reference";
    case Isa::kGeneric: return "generic";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

Result<Isa> parse_isa(std::string_view name) {
  for (Isa i : {Isa::kAuto, Isa::kReference, Isa::kGeneric, Isa::kAvx2, Isa::kAvx512})
    if (isa_name(i) == name) return i;
  return invalid_argument("unknown ISA '" + std::string(name) +
                          "' (known: auto, reference, generic, avx2, avx512)");
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
    case Isa::kReference:
    case Isa::kGeneric: return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  return false;
}

Status check_isa_supported(Isa isa, std::string_view who) {
  if (isa_supported(isa)) return Status::ok();
  return unsupported(std::string(who) + ": this CPU cannot run the " + std::string(isa_name(isa)) +
                     " target (" +
                     (isa == Isa::kAvx512 ? "it needs AVX-512 F, BW, VL and DQ"
                                          : "it needs AVX2, FMA and F16C") +
                     "); the best it runs is " + std::string(isa_name(best_isa())));
}

Isa best_isa() {
  for (Isa i : {Isa::kAvx512, Isa::kAvx2, Isa::kGeneric})
    if (isa_supported(i) && kernels::cpu_kernel_for(i) != nullptr) return i;
  return Isa::kReference;
}

Status check_thread_count(int64_t threads, std::string_view what) {
  if (threads >= 0 && threads <= kMaxThreads) return Status::ok();
  return invalid_argument(std::string(what) + " " + std::to_string(threads) +
                          ": must be between 0 (the default) and " + std::to_string(kMaxThreads) +
                          " (more threads only oversubscribe the cores)");
}

namespace kernels {
Result<ResolvedOptions> resolve_options(const AttnShape& shape, const float* q,
                                        const float* states, const DecodeOptions& options) {
  if (q == nullptr) return invalid_argument("query pointer is null");
  if (states == nullptr) return invalid_argument("state output pointer is null");
  TREEATTN_RETURN_IF_ERROR(check_thread_count(options.threads));
  if (options.chunk_tokens < 0)
    return invalid_argument("chunk_tokens must be >= 0, got " +
                            std::to_string(options.chunk_tokens));
  if (!(options.scale >= 0.0f) || std::isinf(options.scale))
    return invalid_argument("scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got " +
                            std::to_string(options.scale));
  ResolvedOptions r{};
  r.scale = options.scale != 0.0f
                ? options.scale
                : static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
  r.threads = options.threads > 0 ? options.threads : omp_get_max_threads();
  r.chunk_tokens = options.chunk_tokens > 0 ? options.chunk_tokens : kDefaultChunkTokens;
  r.isa = options.isa == Isa::kAuto ? best_isa() : options.isa;
  TREEATTN_RETURN_IF_ERROR(check_isa_supported(r.isa, "decode kernel"));
  return r;
}
}  // namespace kernels

Status decode_partial(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                      const DecodeOptions& options) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  TREEATTN_RETURN_IF_ERROR(kv.validate(shape));
  // A shard in the library's tiled layout (a decode session's own cache) has its own kernels.
  if (kv.tiled != nullptr) return decode_partial_tiled(shape, q, *kv.tiled, states, options);
  auto r = kernels::resolve_options(shape, q, states, options);
  TREEATTN_RETURN_IF_ERROR(r.status());
  if (r->isa == Isa::kReference) return kernels::decode_reference(shape, q, kv, states, *r);
  kernels::KernelFn fn = kernels::cpu_kernel_for(r->isa);
  if (fn == nullptr)
    return unsupported("ISA target " + std::string(isa_name(r->isa)) +
                       " is not built into this library");
  return fn(shape, q, kv, states, *r);
}

}  // namespace treeattn
