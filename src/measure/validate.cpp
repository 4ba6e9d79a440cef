// The model's validation experiment (validate.hpp): calibrate, measure, compare, per
// configuration. Part of the measurement library treeattn_measure.
#include "treeattn/validate.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "treeattn/cost_model.hpp"
#include "treeattn/measure.hpp"

namespace treeattn {

double load_average_1min() {
  std::ifstream f("/proc/loadavg");
  double v = -1;
  if (!(f >> v)) return -1;
  return v;
}

Status compare_with_model(const ValidationOptions& o, const ValidationSetup& setup,
                          const Topology& topo, const std::vector<MeasuredLatency>& measured,
                          ValidationReport& report) {
  std::map<int64_t, std::map<std::string, double>> by_seq;
  for (const MeasuredLatency& m : measured) {
    if (!(m.p50_us > 0))
      return invalid_argument(setup.label + ": " + m.method + " at " + std::to_string(m.seq) +
                              " tokens: no measured latency");
    CostQuery q;
    q.shape = m.shape;
    q.kv_dtype = m.dtype;
    q.context = m.seq;
    q.ranks = m.ranks;
    q.ranks_per_node = std::min(m.ranks, topo.ranks_per_node);
    q.hier_fanout = o.fanout;
    auto pr = predict(m.method, q, topo);
    TREEATTN_RETURN_IF_ERROR(pr.status());
    ValidationPoint v;
    v.config = setup.label;
    v.method = m.method;
    v.link = setup.link;
    v.ranks = m.ranks;
    v.hosts = setup.hosts;
    v.ranks_per_host = setup.ranks_per_host;
    v.seq = m.seq;
    v.predicted_us = pr->latency_us;
    v.measured_us = m.p50_us;
    v.rel_err = (v.predicted_us - v.measured_us) / v.measured_us;
    report.points.push_back(v);
    by_seq[m.seq][m.method] = m.p50_us;
  }
  for (const auto& [seq, by_method] : by_seq) {
    CostQuery q;
    q.shape = o.shape;
    q.kv_dtype = o.dtype;
    q.context = seq;
    q.ranks = setup.ranks();
    q.ranks_per_node = std::min(setup.ranks(), topo.ranks_per_node);
    q.hier_fanout = o.fanout;
    PlanOptions po;
    for (const auto& [m, _] : by_method) po.candidates.push_back(m);
    auto entries = plan(q, topo, po);
    TREEATTN_RETURN_IF_ERROR(entries.status());
    ValidationChoice c;
    c.config = setup.label;
    c.link = setup.link;
    c.hosts = setup.hosts;
    c.ranks_per_host = setup.ranks_per_host;
    c.seq = seq;
    c.choice = entries->front().prediction.strategy;
    if (entries->size() > 1)
      c.choice_predicted_margin = (*entries)[1].prediction.latency_us /
                                      entries->front().prediction.latency_us -
                                  1.0;
    for (const auto& [m, us] : by_method)
      if (c.best_measured.empty() || us < c.best_measured_us) {
        c.best_measured = m;
        c.best_measured_us = us;
      }
    c.choice_measured_us = by_method.at(c.choice);
    c.within = c.choice_measured_us <= (1.0 + o.choice_margin) * c.best_measured_us;
    report.choices.push_back(c);
  }
  std::vector<double> abs_err;
  for (const ValidationPoint& v : report.points) abs_err.push_back(std::abs(v.rel_err));
  report.median_abs_rel_error = percentile(abs_err, 0.5);
  report.choice_points = static_cast<int>(report.choices.size());
  report.choice_within_10pct = static_cast<int>(
      std::count_if(report.choices.begin(), report.choices.end(),
                    [](const ValidationChoice& c) { return c.within; }));
  return Status::ok();
}

Result<ValidationReport> run_validation(const ValidationOptions& o, const ValidationSteps& steps) {
  if (o.setups.empty()) return invalid_argument("validation: no configuration to validate");
  if (o.contexts.empty()) return invalid_argument("validation: no context length to measure");
  if (!steps.calibrate || !steps.measure)
    return invalid_argument("validation: both steps (calibrate, measure) are required");
  TREEATTN_RETURN_IF_ERROR(o.shape.validate());
  ValidationReport report;
  for (const ValidationSetup& setup : o.setups) {
    ValidationConfigResult cr;
    cr.setup = setup;
    cr.load_before = load_average_1min();
    auto topo = steps.calibrate(setup);
    if (!topo.is_ok())
      return Status(topo.status().code(), setup.label + ": " + topo.status().message());
    cr.topology = *topo;
    auto measured = steps.measure(setup);
    if (!measured.is_ok())
      return Status(measured.status().code(), setup.label + ": " + measured.status().message());
    cr.load_after = load_average_1min();
    report.configs.push_back(cr);
    TREEATTN_RETURN_IF_ERROR(compare_with_model(o, setup, *topo, *measured, report));
  }
  return report;
}

}  // namespace treeattn
