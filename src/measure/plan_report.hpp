// What `treeattn plan` reports, as text and data: the table of every strategy's predicted cost
// at one context with the planner's choice (cost_model.hpp's plan), the paper-scale sweep
// (paper_sweep) with its plot, and plan --validate's comparison (validate.hpp's report). The CLI
// prints the texts and writes the documents (treeattn-plan/1, treeattn-sweep/1; the validation's
// is validate_report.hpp's).
//
// Part of the measurement library treeattn_measure, beside the validation experiment it reports
// (a private header: it speaks nlohmann::json, which the installed headers do not).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "measure/validate_report.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/status.hpp"
#include "treeattn/topology.hpp"

namespace treeattn {

// One context: the header line, a row per strategy (the choice starred, infeasible ones with
// their reason), the choice line, and the plan's entry of the document ("plans": [...]).
// dtype: the KV type as the command line named it.
struct PlanReport {
  std::string text;
  nlohmann::json json;
};
Result<PlanReport> plan_report(const CostQuery& query, const Topology& topology,
                               const PlanOptions& options, const std::string& dtype);

// The sweep's table (markdown) with the paper's quoted figures beside it, and its document.
std::string sweep_text(const Topology& topology, const std::vector<SweepRow>& rows);
nlohmann::json sweep_json(const Topology& topology, const std::vector<SweepRow>& rows);
// A PNG of the predicted speed-up per device count (gnuplot).
Status write_sweep_plot(const std::string& path, const std::vector<SweepRow>& rows,
                        const std::string& topology_name);

// plan --validate's tables: predicted vs measured per point, the choice vs the best measured,
// the load around each configuration, and the summary line.
std::string validation_text(const ValidationOptions& options, const ValidationReport& report,
                            const ValidationMeta& meta);

}  // namespace treeattn
