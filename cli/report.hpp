// Measured points and how they are reported: a table on stdout, JSON, CSV and a gnuplot PNG.
// Latency, communication volume and peak memory are kept as the separate results they are.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "treeattn/status.hpp"

namespace treeattn::cli {

struct LatencyStats {
  double min = 0, p50 = 0, p90 = 0, p99 = 0, mean = 0;
  double p10 = 0, max = 0;
  // (p90 - p10) / p50: how much the steps of one method scatter, for judging a difference.
  double spread() const { return p50 > 0 ? (p90 - p10) / p50 : 0; }
  static LatencyStats of(std::vector<double> samples_us);
};

struct Point {
  std::string method;
  int ranks = 1, nodes = 1;
  int64_t seq = 0, batch = 1, heads = 0, kv_heads = 0, head_dim = 0, q_len = 1;
  std::string dtype, shard;
  std::string kv_layout = "rows";  // the KV layout the method read (rows or tiled)
  std::string device = "cpu";      // where the ranks decoded: cpu or cuda (--device)
  int iterations = 0;
  LatencyStats latency_us;                  // per decode step, max over ranks of each step
  uint64_t bytes_sent_per_rank = 0;         // counted at the communicator, max over ranks
  std::optional<uint64_t> bytes_wire_per_rank;  // what the transport moved (monitoring), max
  uint64_t bytes_formula = 0;               // analytic, per rank
  uint64_t peak_bytes_per_rank = 0;         // attention working set, max over ranks
  uint64_t peak_bytes_formula = 0;
  uint64_t peak_rss_bytes = 0;              // process peak RSS, max over ranks
  uint64_t kv_bytes_read = 0;               // KV bytes all ranks' kernels read in one step
  double kv_gbps = 0;                       // kv_bytes_read / p50 latency (aggregate)
  double max_rel_err = 0;                   // vs the float64 reference, outside the timed loop
  std::string output_sha256;                // of the last step's output + LSE (rank 0's), measure.hpp
  double tolerance = 0;
  bool ok = true;

  nlohmann::json to_json() const;
  static Point from_json(const nlohmann::json& j);
};

// Prints the side-by-side table. speedup_base names the method others are compared with
// (its p50 latency over theirs), or empty for none.
void print_table(const std::vector<Point>& points, const std::string& speedup_base);

Status write_json(const std::string& path, const std::vector<Point>& points,
                  const nlohmann::json& meta);
Status write_csv(const std::string& path, const std::vector<Point>& points);
// Runs gnuplot on script, where every "$DATA" names a temporary file holding data; out_path
// is only used in the error message.
Status run_gnuplot(std::string script, const std::string& data, const std::string& out_path);

// Two panels: p50 latency vs context length per method, and bytes sent per rank vs context.
Status write_plot(const std::string& path, const std::vector<Point>& points,
                  const std::string& title);

}  // namespace treeattn::cli
