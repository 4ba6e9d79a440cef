// host_kv_layout(workload) and choose_kv_layout(..., workload) (strategy.hpp): the KV layout
// the kernel tuning (tuning.hpp) measured for the workload on this CPU, else the rule by ISA.
#include <omp.h>

#include <string>

#include "treeattn/strategy.hpp"
#include "treeattn/tuning.hpp"

namespace treeattn {

namespace {

// Why the rule by ISA decides: what the tuning state lacks.
std::string without_tuning(const TuneKey& key) {
  const TuningState& s = kernel_tuning();
  switch (s.source) {
    case TuningState::Source::kSkipped:
      return "TREEATTN_TUNE=0";
    case TuningState::Source::kNone:
      return "this CPU is not tuned yet: treeattn tune";
    case TuningState::Source::kIgnored:
      return "the tuning cache was ignored: " + s.detail;
    case TuningState::Source::kCache:
      break;
  }
  return "no tuned entry for " + std::string(dtype_name(key.dtype)) + " head_dim " +
         std::to_string(key.head_dim);
}

}  // namespace

HostKVLayout host_kv_layout(const KVLayoutWorkload& w) {
  const Isa isa = w.kernel.isa == Isa::kAuto ? best_isa() : w.kernel.isa;
  const int threads = w.kernel.threads > 0 ? w.kernel.threads : omp_get_max_threads();
  const TuneKey key{w.dtype, w.shape.head_dim, w.shape.group(), threads};
  if (const TuneEntry* e = find_tuning(key, isa))
    return {e->choice.layout, "tuned on this CPU for " + e->key.to_string()};
  return {host_kv_layout(isa), "by the CPU's kernel target (" + without_tuning(key) + ")"};
}

Result<KVLayout> choose_kv_layout(KVLayout requested, MemorySpace memory,
                                  std::span<const std::string> strategies,
                                  const KVLayoutWorkload& workload) {
  auto layout = choose_kv_layout(requested, memory, strategies);
  TREEATTN_RETURN_IF_ERROR(layout.status());
  if (requested != KVLayout::kAuto || memory != MemorySpace::kHost) return layout;
  return host_kv_layout(workload).layout;
}

}  // namespace treeattn
