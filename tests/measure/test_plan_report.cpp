// What `treeattn plan` reports (src/measure/plan_report.hpp): the plan table of a preset with
// the planner's choice starred and its document agreeing with it, the paper sweep's table and
// document, plan --validate's tables of a hand-made report, and the units they are written in.
#include <gtest/gtest.h>

#include <set>
#include <sstream>

#include "core/units.hpp"
#include "measure/plan_report.hpp"

namespace treeattn {
namespace {

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

TEST(PlanReport, Units) {
  EXPECT_EQ(format_size(65536), "64k");
  EXPECT_EQ(format_size(3 << 20), "3M");
  EXPECT_EQ(format_size(1000), "1000");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3.0 * (1 << 30)), "3.00 GiB");
  EXPECT_EQ(format_us(12.34), "12.3 us");
  EXPECT_EQ(format_us(1250), "1.25 ms");
  EXPECT_EQ(format_us(2e6), "2.00 s");
  std::string s = "a";
  appendf(s, "%d-%s", 7, "b");
  EXPECT_EQ(s, "a7-b");
}

TEST(PlanReport, TableAndDocumentAgree) {
  auto topo = preset_topology("dgx-h100x16");
  ASSERT_TRUE(topo.is_ok()) << topo.status().to_string();
  CostQuery q;
  q.shape = AttnShape{1, 32, 8, 128, 1};
  q.kv_dtype = DType::kBF16;
  q.context = 65536;
  q.ranks = 16;
  q.ranks_per_node = 8;
  auto r = plan_report(q, *topo, PlanOptions{}, "bf16");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const auto l = lines(r->text);
  ASSERT_GE(l.size(), 4u);
  EXPECT_EQ(l[0].rfind("plan on topology '" + topo->name + "': ", 0), 0u) << l[0];
  EXPECT_NE(l[0].find("bf16 KV, 64k tokens, 16 ranks (8 per node, 2 node(s))"), std::string::npos)
      << l[0];
  const auto& rows = r->json["strategies"];
  ASSERT_EQ(l.size(), rows.size() + 4);  // header, column names, rows, choice, blank line
  const std::string choice = r->json["choice"];
  EXPECT_EQ(rows[0]["strategy"], choice);
  EXPECT_EQ(l[2].rfind("* " + choice + " ", 0), 0u) << l[2];
  EXPECT_EQ(l[l.size() - 2].rfind("choice: " + choice + " (", 0), 0u);
  for (std::size_t i = 1; i < rows.size(); ++i) {
    EXPECT_EQ(l[2 + i][0], ' ');
    EXPECT_LE(rows[i - 1]["latency_us"].get<double>(), rows[i]["latency_us"].get<double>() + 1e-9)
        << "ranked by predicted latency";
  }
  EXPECT_EQ(r->json["ranks"], 16);
  EXPECT_EQ(r->json["ranks_per_node"], 8);
  EXPECT_EQ(r->json["seq"], 65536);
  EXPECT_EQ(r->json["dtype"], "bf16");

  CostQuery bad = q;
  bad.shape.kv_heads = 7;  // does not divide the query heads
  EXPECT_FALSE(plan_report(bad, *topo, PlanOptions{}, "bf16").is_ok());
}

TEST(PlanReport, Sweep) {
  auto topo = preset_topology("dgx-h100x16");
  ASSERT_TRUE(topo.is_ok());
  auto rows = paper_sweep(*topo);
  ASSERT_TRUE(rows.is_ok()) << rows.status().to_string();
  const std::string text = sweep_text(*topo, *rows);
  EXPECT_EQ(text.rfind("paper-scale sweep on topology '" + topo->name + "'", 0), 0u);
  EXPECT_NE(text.find("the model at that point: "), std::string::npos);  // 128 GPUs, 5.12M
  EXPECT_NE(text.find("| 128 | 5.12M | "), std::string::npos);
  const nlohmann::json j = sweep_json(*topo, *rows);
  EXPECT_EQ(j["format"], "treeattn-sweep/1");
  ASSERT_EQ(j["rows"].size(), rows->size());
  EXPECT_EQ(j["rows"][0]["speedup_vs_tree"], (*rows)[0].speedup_tree);
  EXPECT_EQ(j["paper_quoted"]["speedup"], 8);
}

TEST(PlanReport, ValidationTables) {
  ValidationOptions o;
  o.shape = AttnShape{1, 8, 2, 64, 1};
  ValidationReport r;
  ValidationPoint v;
  v.hosts = 2;
  v.ranks_per_host = 2;
  v.link = "1gbit";
  v.seq = 32768;
  v.method = "tree";
  v.predicted_us = 1100;
  v.measured_us = 1000;
  v.rel_err = 0.1;
  r.points = {v};
  ValidationChoice c;
  c.hosts = 2;
  c.ranks_per_host = 2;
  c.link = "1gbit";
  c.seq = 32768;
  c.choice = "tree";
  c.choice_predicted_margin = 0.05;
  c.choice_measured_us = 1000;
  c.best_measured = "allgather";
  c.best_measured_us = 950;
  c.within = true;
  r.choices = {c};
  ValidationConfigResult cfg;
  cfg.setup.label = "2x2 1gbit";
  cfg.load_before = 1;
  cfg.load_after = 2;
  r.configs = {cfg};
  r.median_abs_rel_error = 0.1;
  r.choice_within_10pct = 1;
  r.choice_points = 1;
  const std::string t = validation_text(o, r, ValidationMeta{"bf16", 2, 12, 0.2, nullptr});
  EXPECT_NE(t.find("bf16 KV; 2 warm-up + 12 timed steps per point"), std::string::npos);
  EXPECT_NE(t.find("| 2x2 | 1gbit | 32k | tree | 1.10 ms | 1.00 ms | +10% |\n"), std::string::npos);
  EXPECT_NE(t.find("| 2x2 | 1gbit | 32k | tree (5.0%) | 1.00 ms | 950.0 us (allgather) | yes |\n"),
            std::string::npos);
  EXPECT_NE(t.find(" 2x2 1gbit 1.00 / 2.00;"), std::string::npos);
  EXPECT_NE(t.find("median |relative error| 10.0% over 1 points (target 20%); planner's choice "
                   "within 10% of the best measured at 1 of 1 points\n"),
            std::string::npos);
}

}  // namespace
}  // namespace treeattn
