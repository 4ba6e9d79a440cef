// The flags' configuration handed to the measurement library (measure.hpp).
#include "measure.hpp"

#include "treeattn/job_status.hpp"

namespace treeattn::cli {

BenchConfig bench_config(const MeasureConfig& c) {
  BenchConfig b = c;
  const InjectSpec& inj = c.inject;
  using K = InjectSpec::Kind;
  if (inj.kind == K::kNan) b.faults.nan_rank = inj.rank;
  if (inj.kind == K::kNeverArrive) b.faults.never_arrive_rank = inj.rank;
  if (inj.kind == K::kKill) b.faults.kill_rank = inj.rank;
  if (inj.kind == K::kSlow) {
    b.faults.slow_rank = inj.rank;
    b.faults.slow_ms = inj.ms;
  }
  b.faults.step = inj.step;
  b.device_memory = c.device == Device::kCuda;
  b.on_phase = [](std::string_view what) { launch::rank_status_phase(what); };
  b.on_step = [](int64_t step) { launch::rank_status_step(step); };
  return b;
}

}  // namespace treeattn::cli
