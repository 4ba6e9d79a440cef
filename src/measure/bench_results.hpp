// What `treeattn run` and `bench` report of bench_strategies' points (bench.hpp), as data: the
// latency summary of the per-step times (percentile(), measure.hpp: the one definition), the
// result of one strategy at one configuration with it, the sweep over contexts and batches a job
// measures, and the files: the JSON every consumer reads (the launching shell merging its jobs,
// plan --validate, tests/, bench/, the Python tools), the table, the CSV and the gnuplot PNG.
//
// Part of the measurement library treeattn_measure (a private header: it speaks nlohmann::json,
// which the installed headers do not); the CLI prints what it returns.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "treeattn/bench.hpp"
#include "treeattn/comm.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

struct LatencyStats {
  double min = 0, p50 = 0, p90 = 0, p99 = 0, mean = 0;
  double p10 = 0, max = 0;
  // (p90 - p10) / p50: how much the steps of one method scatter, for judging a difference.
  double spread() const { return p50 > 0 ? (p90 - p10) / p50 : 0; }
  // min, max, mean and p10/p50/p90/p99 by percentile() (linear interpolation); zeros for none.
  static LatencyStats of(std::vector<double> samples_us);
};

// One strategy at one configuration, as reported: bench_strategies' point with its summary.
// step_us is empty in a result read back from JSON (the file keeps the summary only).
struct BenchResult : BenchPoint {
  std::string device = "cpu";  // where the ranks decoded: cpu or cuda
  int iterations = 0;          // timed steps
  LatencyStats latency_us;     // per decode step, max over ranks of each step
  double kv_gbps = 0;          // kv_bytes_read / p50 latency (aggregate)
};

// The summary of a measured point (iterations, latency, KV GB/s), labelled with its device.
BenchResult summarize(BenchPoint point, const std::string& device);

// The JSON record of one result ("points" of the files below) and back. from_json throws
// nlohmann::json's exceptions on a record that lacks a key; files written before the tiled
// layout read as rows, before --device as cpu.
nlohmann::json to_json(const BenchResult& r);
BenchResult bench_result_from_json(const nlohmann::json& j);

// The side-by-side table run and bench print: one row per result, a blank line between
// (ranks, seq, batch) groups, and a speed-up column against speedup_base's p50 (empty: none).
std::string format_bench_table(const std::vector<BenchResult>& results,
                               const std::string& speedup_base);

// {"meta": meta, "points": [...]} (indented), the file --json and --child-json write.
Status write_bench_json(const std::string& path, const std::vector<BenchResult>& results,
                        const nlohmann::json& meta);
Status write_bench_csv(const std::string& path, const std::vector<BenchResult>& results);

// A file write_bench_json wrote, as the launching shell reads one job's: its results, whether
// any of them is not exact, and the meta's device_description ("" when absent). A file that is
// missing or does not parse reads as no results (the job failed; its exit code says how).
struct BenchFile {
  std::vector<BenchResult> results;
  bool inexact = false;
  std::string device_description;
  std::string kv_layout;  // the job's KV layout as its lead rank chose it ("" when not written)
};
BenchFile read_bench_file(const std::string& path);

// Runs gnuplot on script, where every "$DATA" names a temporary file holding data; out_path
// is only used in the error message.
Status run_gnuplot(std::string script, const std::string& data, const std::string& out_path);
// Two panels: p50 latency vs context length per method and rank count, and bytes sent per rank
// vs context.
Status write_bench_plot(const std::string& path, const std::vector<BenchResult>& results,
                        const std::string& title);

// The job's memory need (bench_memory_need, bench.hpp) against what this machine has: above 90%
// of it, kOutOfMemory naming the context, shape, ranks and the parts, before anything is
// allocated. OK when the available memory is unknown.
Status check_bench_memory(const BenchConfig& config, int ranks);

// The points a job measures: every (batch, seq) of the lists, batch outer, one
// bench_strategies call each on `base` with that batch and context. methods_for (optional)
// gives the methods of a point (the CLI resolves `auto` there); progress (optional) is called
// before each point with its number from 1 and the total. Collective; the first error stops it.
struct BenchSweep {
  BenchConfig base;
  std::vector<int64_t> seqs, batches;
  std::string device = "cpu";  // the results' label
  std::function<Result<std::vector<std::string>>(const BenchConfig&)> methods_for;
  std::function<void(std::size_t done, std::size_t total, const BenchConfig&)> progress;
};
Result<std::vector<BenchResult>> bench_sweep(Communicator& comm, const BenchSweep& sweep);

}  // namespace treeattn
