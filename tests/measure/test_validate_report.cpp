// The files of plan --validate (src/measure/validate_report.hpp): bench's JSON read into the
// measured latencies the comparison takes (and refused clearly when it is not one), and the
// treeattn-validate/1 document of a hand-made report: its keys and the figures it carries.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>

#include "measure/bench_results.hpp"
#include "measure/validate_report.hpp"

namespace treeattn {
namespace {

std::string temp_path(const char* what) {
  return std::string("/tmp/treeattn-test-") + what + "-" + std::to_string(getpid()) + ".json";
}

TEST(ValidateReport, ReadsBenchsPointsAsMeasuredLatencies) {
  BenchPoint p;
  p.method = "allgather";
  p.ranks = 4;
  p.seq = 32768;
  p.batch = 1;
  p.heads = 32;
  p.kv_heads = 8;
  p.head_dim = 128;
  p.q_len = 1;
  p.dtype = "bf16";
  p.shard = "even";
  p.step_us = {300, 100, 200};
  const std::string path = temp_path("validate-bench");
  ASSERT_TRUE(write_bench_json(path, {summarize(p, "cpu")}, nlohmann::json::object()).is_ok());
  auto m = read_measured_latencies(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  ASSERT_EQ(m->size(), 1u);
  const MeasuredLatency& l = (*m)[0];
  EXPECT_EQ(l.method, "allgather");
  EXPECT_EQ(l.ranks, 4);
  EXPECT_EQ(l.seq, 32768);
  EXPECT_EQ(l.shape.heads, 32);
  EXPECT_EQ(l.shape.kv_heads, 8);
  EXPECT_EQ(l.dtype, DType::kBF16);
  EXPECT_DOUBLE_EQ(l.p50_us, 200);
  EXPECT_EQ(l.steps, 3);

  p.dtype = "f7";
  ASSERT_TRUE(write_bench_json(path, {summarize(p, "cpu")}, nlohmann::json::object()).is_ok());
  EXPECT_EQ(read_measured_latencies(path).status().code(), Code::kInternal);
  {
    std::ofstream out(path);
    out << "{\"points\": [{\"method\": \"tree\"}]}";  // a point without its keys
  }
  EXPECT_EQ(read_measured_latencies(path).status().code(), Code::kInternal);
  std::remove(path.c_str());
  const auto missing = read_measured_latencies(path);
  EXPECT_EQ(missing.status().code(), Code::kInternal);
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
}

TEST(ValidateReport, Document) {
  ValidationOptions o;
  o.shape = AttnShape{1, 8, 2, 64, 1};
  ValidationReport r;
  ValidationConfigResult c;
  c.setup = ValidationSetup{2, 2, "1gbit", "2x2 1gbit"};
  c.topology.name = "detected 2x2 1gbit";
  c.load_before = 1.5;
  c.load_after = 2.5;
  r.configs = {c};
  ValidationPoint v;
  v.config = "2x2 1gbit";
  v.method = "tree";
  v.predicted_us = 110;
  v.measured_us = 100;
  v.rel_err = 0.1;
  r.points = {v};
  ValidationChoice ch;
  ch.config = "2x2 1gbit";
  ch.choice = "tree";
  ch.best_measured = "allgather";
  ch.within = true;
  r.choices = {ch};
  r.median_abs_rel_error = 0.1;
  r.choice_within_10pct = 1;
  r.choice_points = 1;
  ValidationMeta meta{"bf16", 2, 12, 0.2, [](int ranks) { return 16 / ranks; }};
  const nlohmann::json j = validation_json(o, r, meta);
  std::set<std::string> keys;
  for (const auto& [k, val] : j.items()) keys.insert(k);
  EXPECT_EQ(keys, (std::set<std::string>{"format", "shape", "warmup", "iterations", "protocol",
                                         "points", "choices", "configs", "median_abs_rel_error",
                                         "choice_within_10pct", "choice_points",
                                         "choices_within_10_percent", "choices_total",
                                         "target_median_abs_rel_error", "topologies"}));
  EXPECT_EQ(j["format"], "treeattn-validate/1");
  EXPECT_EQ(j["shape"]["dtype"], "bf16");
  EXPECT_EQ(j["shape"]["kv_heads"], 2);
  EXPECT_EQ(j["iterations"], 12);
  EXPECT_EQ(j["points"][0]["rel_err"], 0.1);
  EXPECT_EQ(j["choices"][0]["within_10_percent"], true);
  EXPECT_EQ(j["choices"][0]["best_measured"], "allgather");
  EXPECT_EQ(j["configs"][0]["threads_per_rank"], 4);
  EXPECT_EQ(j["configs"][0]["load_after"], 2.5);
  EXPECT_EQ(j["median_abs_rel_error"], 0.1);
  EXPECT_EQ(j["choice_within_10pct"], 1);
  EXPECT_EQ(j["choice_points"], 1);
  ASSERT_TRUE(j["topologies"].contains("2x2 1gbit"));
  EXPECT_EQ(j["topologies"]["2x2 1gbit"]["name"], "detected 2x2 1gbit");
}

}  // namespace
}  // namespace treeattn
