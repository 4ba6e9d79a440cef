// The files of `plan --validate` (validate.hpp's experiment) as data: the measure step's reading
// of bench's JSON into the measured latencies the comparison takes, and the treeattn-validate/1
// document of a report (its keys are what tools/results.sh, tests/ and the plots read).
//
// Part of the measurement library treeattn_measure (a private header: it speaks nlohmann::json,
// which the installed headers do not).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "treeattn/status.hpp"
#include "treeattn/validate.hpp"

namespace treeattn {

// Every point of a file bench --json wrote (bench_results.hpp), as a measured latency (p50 of its
// timed steps). kInternal naming the file when it cannot be read or a point lacks a key.
Result<std::vector<MeasuredLatency>> read_measured_latencies(const std::string& bench_json);

// What the document says of the run besides the report: the KV type as the command line named
// it, the steps per point, the target median error, and the kernel threads each configuration's
// ranks ran with.
struct ValidationMeta {
  std::string dtype;
  int warmup = 0, iterations = 0;
  double target_median_abs_rel_error = 0.20;
  std::function<int(int ranks)> threads_per_rank;
};

// {"format": "treeattn-validate/1", shape, protocol, points, choices, configs (with their
// calibrated topologies), median_abs_rel_error, choice_within_10pct, choice_points, ...}.
nlohmann::json validation_json(const ValidationOptions& options, const ValidationReport& report,
                               const ValidationMeta& meta);

}  // namespace treeattn
