// The CLI's side of measuring every method on the same data in the same job (measure.hpp):
// the flags' configuration handed to the measurement library's bench_strategies (bench.hpp),
// and its points turned into the report's.
#include "measure.hpp"

#include "job_status.hpp"

namespace treeattn::cli {
namespace {

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
  b.on_phase = [](std::string_view what) { rank_status_phase(what); };
  b.on_step = [](int64_t step) { rank_status_step(step); };
  return b;
}

}  // namespace

MemoryNeed memory_need(const MeasureConfig& config, int ranks) {
  return bench_memory_need(bench_config(config), ranks);
}

Result<std::vector<Point>> measure(Communicator& comm, const MeasureConfig& config) {
  auto bench = bench_strategies(comm, bench_config(config));
  TREEATTN_RETURN_IF_ERROR(bench.status());
  std::vector<Point> points;
  for (BenchPoint& b : *bench) {
    Point p;
    p.method = std::move(b.method);
    p.ranks = b.ranks;
    p.nodes = b.nodes;
    p.seq = b.seq;
    p.batch = b.batch;
    p.heads = b.heads;
    p.kv_heads = b.kv_heads;
    p.head_dim = b.head_dim;
    p.q_len = b.q_len;
    p.dtype = std::move(b.dtype);
    p.shard = std::move(b.shard);
    p.kv_layout = std::move(b.kv_layout);
    p.device = device_name(config.device);
    p.iterations = static_cast<int>(b.step_us.size());
    p.latency_us = LatencyStats::of(b.step_us);
    p.bytes_sent_per_rank = b.bytes_sent_per_rank;
    p.bytes_wire_per_rank = b.bytes_wire_per_rank;
    p.bytes_formula = b.bytes_formula;
    p.peak_bytes_per_rank = b.peak_bytes_per_rank;
    p.peak_bytes_formula = b.peak_bytes_formula;
    p.peak_rss_bytes = b.peak_rss_bytes;
    p.kv_bytes_read = b.kv_bytes_read;
    p.kv_gbps = p.latency_us.p50 > 0
                    ? static_cast<double>(p.kv_bytes_read) / (p.latency_us.p50 * 1e3)
                    : 0;
    p.max_rel_err = b.max_rel_err;
    p.output_sha256 = std::move(b.output_sha256);
    p.tolerance = b.tolerance;
    p.ok = b.ok;
    points.push_back(std::move(p));
  }
  return points;
}

}  // namespace treeattn::cli
