// The model's validation experiment (`treeattn plan --validate`): for each configuration (an
// emulated cluster of K hosts x R ranks on a link, or R local ranks), calibrate a topology on
// it (topo --detect), measure every strategy on it (bench: the strategies of one point
// interleaved step by step in one job), and compare what the cost model predicts on the
// calibrated topology with what was measured: the relative error per point, its median, and
// per (configuration, context) whether the planner's choice measured within 10% of the best.
//
// Part of the measurement library treeattn_measure. The two steps that run jobs are the
// caller's (ValidationSteps: the CLI runs its own `topo --detect` and `bench` as subprocesses on
// the emulated cluster); the experiment's loop, the comparison and the summary are here.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "treeattn/dtype.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"
#include "treeattn/topology.hpp"

namespace treeattn {

// One configuration of the experiment.
struct ValidationSetup {
  int hosts = 1;           // emulated hosts (1: local ranks, no network)
  int ranks_per_host = 1;
  std::string link;        // "veth" (unshaped), a rate such as "1gbit", or "shm" (one host)
  std::string label;       // "2x2 1gbit"
  int ranks() const { return hosts * ranks_per_host; }
};

// What the measurement of one configuration reports per (strategy, context).
struct MeasuredLatency {
  std::string method;
  int ranks = 0;
  int64_t seq = 0;
  AttnShape shape;
  DType dtype = DType::kBF16;
  double p50_us = 0;  // the median step (slowest rank per step)
  int steps = 0;      // timed steps behind the median
};

struct ValidationOptions {
  std::vector<ValidationSetup> setups;
  std::vector<int64_t> contexts;
  std::vector<std::string> methods;  // the strategies measured and ranked
  AttnShape shape;
  DType dtype = DType::kBF16;
  int fanout = 2;
  double choice_margin = 0.10;  // "within 10% of the best measured"
};

// The steps that run jobs, one call per configuration each.
struct ValidationSteps {
  std::function<Result<Topology>(const ValidationSetup&)> calibrate;
  std::function<Result<std::vector<MeasuredLatency>>(const ValidationSetup&)> measure;
};

struct ValidationPoint {
  std::string config, method, link;
  int ranks = 0, hosts = 0, ranks_per_host = 0;
  int64_t seq = 0;
  double predicted_us = 0, measured_us = 0;
  double rel_err = 0;  // (predicted - measured) / measured
};

struct ValidationChoice {
  std::string config, link;
  int hosts = 0, ranks_per_host = 0;
  int64_t seq = 0;
  std::string choice;  // the planner's, among the measured strategies
  double choice_measured_us = 0;
  std::string best_measured;
  double best_measured_us = 0;
  double choice_predicted_margin = 0;  // the runner-up's predicted latency over the choice's - 1
  bool within = false;                 // choice_measured_us <= (1 + margin) best_measured_us
};

struct ValidationConfigResult {
  ValidationSetup setup;
  Topology topology;                  // as calibrated
  double load_before = -1, load_after = -1;  // 1-minute load average around its two steps
};

struct ValidationReport {
  std::vector<ValidationConfigResult> configs;
  std::vector<ValidationPoint> points;
  std::vector<ValidationChoice> choices;
  double median_abs_rel_error = 0;  // over all points
  int choice_within_10pct = 0;      // choices within the margin of the best measured
  int choice_points = 0;            // (configuration, context) pairs
};

// Runs the experiment: for each setup calibrate, then measure, then compare. Stops at the
// first error of a step (the caller's status, prefixed with the configuration's label).
Result<ValidationReport> run_validation(const ValidationOptions& options,
                                        const ValidationSteps& steps);

// The comparison of one configuration (what run_validation does after its two steps): appends
// its points and choices to report and updates the summary. Exposed for tests and for callers
// that measured elsewhere.
Status compare_with_model(const ValidationOptions& options, const ValidationSetup& setup,
                          const Topology& topo, const std::vector<MeasuredLatency>& measured,
                          ValidationReport& report);

// The 1-minute load average of this machine (/proc/loadavg), -1 where it cannot be read.
double load_average_1min();

}  // namespace treeattn
