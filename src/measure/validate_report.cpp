// The files of plan --validate (validate_report.hpp).
#include "measure/validate_report.hpp"

#include <fstream>

#include "measure/bench_results.hpp"

namespace treeattn {

Result<std::vector<MeasuredLatency>> read_measured_latencies(const std::string& bfile) {
  nlohmann::json j;
  std::vector<MeasuredLatency> out;
  try {
    std::ifstream in(bfile);
    in >> j;
    for (const auto& pj : j.at("points")) {
      const BenchResult pt = bench_result_from_json(pj);
      MeasuredLatency m;
      m.method = pt.method;
      m.ranks = pt.ranks;
      m.seq = pt.seq;
      m.shape = AttnShape{pt.batch, pt.heads, pt.kv_heads, pt.head_dim, pt.q_len};
      const auto dtype = parse_dtype(pt.dtype);
      if (!dtype) return internal_error("bench's JSON '" + bfile + "': unknown dtype " + pt.dtype);
      m.dtype = *dtype;
      m.p50_us = pt.latency_us.p50;
      m.steps = pt.iterations;
      out.push_back(m);
    }
  } catch (const std::exception& e) {
    return internal_error("cannot read bench's JSON '" + bfile + "': " + e.what());
  }
  return out;
}

nlohmann::json validation_json(const ValidationOptions& o, const ValidationReport& r,
                               const ValidationMeta& meta) {
  const AttnShape& shape = o.shape;
  nlohmann::json jpoints = nlohmann::json::array();
  for (const auto& v : r.points)
    jpoints.push_back({{"config", v.config},
                       {"hosts", v.hosts},
                       {"ranks_per_host", v.ranks_per_host},
                       {"ranks", v.ranks},
                       {"link", v.link},
                       {"seq", v.seq},
                       {"method", v.method},
                       {"predicted_us", v.predicted_us},
                       {"measured_us", v.measured_us},
                       {"rel_err", v.rel_err}});
  nlohmann::json choices = nlohmann::json::array();
  for (const auto& c : r.choices)
    choices.push_back({{"config", c.config},
                       {"hosts", c.hosts},
                       {"ranks_per_host", c.ranks_per_host},
                       {"seq", c.seq},
                       {"choice", c.choice},
                       {"choice_measured_us", c.choice_measured_us},
                       {"choice_predicted_margin", c.choice_predicted_margin},
                       {"best_measured", c.best_measured},
                       {"best_measured_us", c.best_measured_us},
                       {"within_10_percent", c.within}});
  nlohmann::json topologies = nlohmann::json::object();
  nlohmann::json configs = nlohmann::json::array();
  for (const auto& c : r.configs) {
    topologies[c.setup.label] = nlohmann::json::parse(topology_to_json(c.topology));
    configs.push_back(
        {{"config", c.setup.label},
         {"hosts", c.setup.hosts},
         {"ranks_per_host", c.setup.ranks_per_host},
         {"link", c.setup.link},
         {"threads_per_rank", meta.threads_per_rank ? meta.threads_per_rank(c.setup.ranks()) : 0},
         {"load_before", c.load_before},
         {"load_after", c.load_after}});
  }
  return {{"format", "treeattn-validate/1"},
          {"shape",
           {{"batch", shape.batch},
            {"heads", shape.heads},
            {"kv_heads", shape.kv_heads},
            {"head_dim", shape.head_dim},
            {"q_len", shape.q_len},
            {"dtype", meta.dtype}}},
          {"warmup", meta.warmup},
          {"iterations", meta.iterations},
          {"protocol",
           "per configuration: topo --detect, then one bench job measuring every strategy "
           "interleaved (one step of each in turn, the first rotating every step), kernel "
           "threads per rank = cores / ranks; p50 of the timed steps (slowest rank per step)"},
          {"points", jpoints},
          {"choices", choices},
          {"configs", configs},
          {"median_abs_rel_error", r.median_abs_rel_error},
          {"choice_within_10pct", r.choice_within_10pct},
          {"choice_points", r.choice_points},
          {"choices_within_10_percent", r.choice_within_10pct},
          {"choices_total", r.choice_points},
          {"target_median_abs_rel_error", meta.target_median_abs_rel_error},
          {"topologies", topologies}};
}

}  // namespace treeattn
