// The validation experiment's comparison (validate.hpp): relative errors against the model's
// predictions on the calibrated topology, their median, and whether the planner's choice
// measured within 10% of the best, on hand-written measurements of a synthetic machine.
#include "treeattn/validate.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "treeattn/cost_model.hpp"

namespace treeattn {
namespace {

Topology machine() {
  Topology t;
  t.name = "synthetic";
  t.nodes = 2;
  t.ranks_per_node = 2;
  t.node = LinkLevel{"node", 1.0, 5.0, 1};
  t.network = LinkLevel{"network", 30.0, 0.1, 1};
  t.network->call_overhead_us = 200.0;
  t.memory_bandwidth_GBps = 10.0;
  return t;
}

ValidationOptions options() {
  ValidationOptions o;
  o.shape = AttnShape{1, 8, 2, 64, 1};
  o.dtype = DType::kBF16;
  o.contexts = {4096, 65536};
  o.methods = {"tree", "allgather", "ring-kv"};
  ValidationSetup s;
  s.hosts = 2;
  s.ranks_per_host = 2;
  s.link = "1gbit";
  s.label = "2x2 1gbit";
  o.setups = {s};
  return o;
}

// The 2x2 setup's query at one context.
CostQuery query(const ValidationOptions& o, int64_t seq) {
  CostQuery q;
  q.shape = o.shape;
  q.kv_dtype = o.dtype;
  q.context = seq;
  q.ranks = 4;
  q.ranks_per_node = 2;
  return q;
}

double predicted(const std::string& m, int64_t seq, const ValidationOptions& o,
                 const Topology& t) {
  auto p = predict(m, query(o, seq), t);
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  return p.is_ok() ? p->latency_us : 0;
}

// Measured = predicted x factor[method]; the planner's choice per context from plan().
std::vector<MeasuredLatency> measured(const ValidationOptions& o, const Topology& t,
                                      const std::map<std::string, double>& factor) {
  std::vector<MeasuredLatency> out;
  for (int64_t seq : o.contexts)
    for (const auto& m : o.methods) {
      MeasuredLatency x;
      x.method = m;
      x.ranks = 4;
      x.seq = seq;
      x.shape = o.shape;
      x.dtype = o.dtype;
      x.p50_us = predicted(m, seq, o, t) * factor.at(m);
      x.steps = 12;
      out.push_back(x);
    }
  return out;
}

std::string choice(const ValidationOptions& o, const Topology& t, int64_t seq) {
  PlanOptions po;
  po.candidates = o.methods;
  auto e = plan(query(o, seq), t, po);
  EXPECT_TRUE(e.is_ok());
  return e->front().prediction.strategy;
}

TEST(Validate, ErrorsMedianAndChoicesFromHandWrittenMeasurements) {
  const ValidationOptions o = options();
  const Topology t = machine();
  // Errors of -50% (measured 2x), +25% (measured 0.8x) and 0: |err| 0.5, 0.25, 0 per context.
  std::map<std::string, double> f = {{"tree", 2.0}, {"allgather", 0.8}, {"ring-kv", 1.0}};
  ValidationReport r;
  ASSERT_TRUE(compare_with_model(o, o.setups[0], t, measured(o, t, f), r).is_ok());
  ASSERT_EQ(r.points.size(), 6u);
  for (const auto& p : r.points) {
    const double want = p.method == "tree" ? -0.5 : p.method == "allgather" ? 0.25 : 0.0;
    EXPECT_NEAR(p.rel_err, want, 1e-12) << p.method << " " << p.seq;
    EXPECT_EQ(p.config, "2x2 1gbit");
  }
  EXPECT_NEAR(r.median_abs_rel_error, 0.25, 1e-12);  // {0, 0, .25, .25, .5, .5}
  ASSERT_EQ(r.choice_points, 2);
  ASSERT_EQ(r.choices.size(), 2u);
  for (const auto& c : r.choices) {
    EXPECT_EQ(c.choice, choice(o, t, c.seq));
    // The choice's measured time is the one written for it; the best is the minimum.
    double best = 1e300;
    std::string best_m;
    for (const auto& m : o.methods) {
      const double us = predicted(m, c.seq, o, t) * f.at(m);
      if (us < best) {
        best = us;
        best_m = m;
      }
    }
    EXPECT_EQ(c.best_measured, best_m);
    EXPECT_DOUBLE_EQ(c.best_measured_us, best);
    EXPECT_DOUBLE_EQ(c.choice_measured_us, predicted(c.choice, c.seq, o, t) * f.at(c.choice));
    EXPECT_EQ(c.within, c.choice_measured_us <= 1.1 * best);
  }
  EXPECT_EQ(r.choice_within_10pct,
            static_cast<int>(r.choices[0].within) + static_cast<int>(r.choices[1].within));
}

TEST(Validate, ChoiceWithinTenPercentIsCounted) {
  const ValidationOptions o = options();
  const Topology t = machine();
  // Measured exactly as predicted: the choice is the best measured at every context.
  std::map<std::string, double> exact = {{"tree", 1.0}, {"allgather", 1.0}, {"ring-kv", 1.0}};
  ValidationReport r;
  ASSERT_TRUE(compare_with_model(o, o.setups[0], t, measured(o, t, exact), r).is_ok());
  EXPECT_DOUBLE_EQ(r.median_abs_rel_error, 0.0);
  EXPECT_EQ(r.choice_within_10pct, 2);
  // The choice measured 20% slower than predicted while the others are as predicted: it is
  // not within 10% wherever another was predicted within 20% of it (tree and allgather are
  // close on this machine at 4k), and still is wherever the others are far behind.
  const std::string c4k = choice(o, t, 4096);
  std::map<std::string, double> slow = exact;
  slow[c4k] = 1.2;
  ValidationReport r2;
  ASSERT_TRUE(compare_with_model(o, o.setups[0], t, measured(o, t, slow), r2).is_ok());
  const auto& ch = r2.choices[0];
  ASSERT_EQ(ch.seq, 4096);
  double runner_up = 1e300;
  for (const auto& m : o.methods)
    if (m != c4k) runner_up = std::min(runner_up, predicted(m, 4096, o, t));
  const bool expect_within = 1.2 * predicted(c4k, 4096, o, t) <= 1.1 * runner_up;
  EXPECT_EQ(ch.within, expect_within);
  EXPECT_NEAR(ch.choice_predicted_margin, runner_up / predicted(c4k, 4096, o, t) - 1.0, 1e-12);
}

TEST(Validate, RunsTheStepsPerSetupAndNamesTheFailingOne) {
  ValidationOptions o = options();
  ValidationSetup second = o.setups[0];
  second.label = "2x2 veth";
  second.link = "veth";
  o.setups.push_back(second);
  const Topology t = machine();
  std::vector<std::string> calls;
  ValidationSteps steps;
  steps.calibrate = [&](const ValidationSetup& s) -> Result<Topology> {
    calls.push_back("calibrate " + s.label);
    return t;
  };
  steps.measure = [&](const ValidationSetup& s) -> Result<std::vector<MeasuredLatency>> {
    calls.push_back("measure " + s.label);
    return measured(o, t, {{"tree", 1.0}, {"allgather", 1.0}, {"ring-kv", 1.0}});
  };
  auto r = run_validation(o, steps);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(calls, (std::vector<std::string>{"calibrate 2x2 1gbit", "measure 2x2 1gbit",
                                             "calibrate 2x2 veth", "measure 2x2 veth"}));
  EXPECT_EQ(r->configs.size(), 2u);
  EXPECT_EQ(r->points.size(), 12u);
  EXPECT_EQ(r->choice_points, 4);
  EXPECT_EQ(r->configs[1].topology, t);

  steps.measure = [&](const ValidationSetup& s) -> Result<std::vector<MeasuredLatency>> {
    if (s.link == "veth") return internal_error("bench failed (exit 3)");
    return measured(o, t, {{"tree", 1.0}, {"allgather", 1.0}, {"ring-kv", 1.0}});
  };
  auto bad = run_validation(o, steps);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(), "2x2 veth: bench failed (exit 3)");
  // A point without a measured latency is an error, not a division by zero.
  auto m = measured(o, t, {{"tree", 1.0}, {"allgather", 1.0}, {"ring-kv", 1.0}});
  m[1].p50_us = 0;
  ValidationReport r3;
  EXPECT_FALSE(compare_with_model(o, o.setups[0], t, m, r3).is_ok());
}

}  // namespace
}  // namespace treeattn
