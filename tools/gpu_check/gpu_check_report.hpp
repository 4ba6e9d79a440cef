// The findings of the GPU check (gpu_check.cpp) and their JSON: checks with their verdicts, the
// exit status they add up to, bandwidth and virtual-rank rows. Host code only, so that
// tests/cuda/test_gpu_check_report.cpp checks the verdicts on any machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "treeattn/status.hpp"

namespace gpucheck {

inline std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      o += buf;
    } else {
      o += c;
    }
  }
  return o + "\"";
}
inline std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

struct Check {
  Check(std::string s, std::string n, bool k = true, double e = 0, std::string d = "")
      : section(std::move(s)), name(std::move(n)), ok(k), error(e), detail(std::move(d)) {}
  std::string section, name;
  bool ok = true;
  double error = 0;  // worst relative error where it applies (state kernels: of the bound)
  std::string detail;
  // A failed set-up (no executor, an NCCL communicator that cannot be made): the environment,
  // exit 2, not a wrong result (exit 1).
  bool environment = false;
};

// An environment check: a set-up that failed, or succeeded.
inline Check environment_check(std::string section, std::string name, const treeattn::Status& s) {
  Check c(std::move(section), std::move(name), s.is_ok(), 0, s.is_ok() ? "ok" : s.to_string());
  c.environment = true;
  return c;
}

struct BandwidthRow {
  std::string dtype = "bf16";  // of K and V
  int64_t batch = 0, tokens = 0, splits = 0, chunk = 0;
  // kv_bytes: what the kernel reads of K and V (codes and, for fp8 / int8, their scales).
  double kv_bytes = 0, eager_ms = 0, graph_ms = 0, gbps = 0, frac_copy = 0, frac_read = 0;
  // The split merge fused into the decode kernel: partial's time less that of partial_chunks
  // over the same splits (the same blocks without the tickets and the merge), in us; 0 with one
  // split (nothing to merge) or when it was not measured.
  double fused_merge_us = 0;
};

struct VrankRow {
  int p = 0;
  double single_ms = 0, sharded_ms = 0, merge_us = 0, merge_graph_us = 0, error = 0;
};

struct Report {
  std::string device;
  std::vector<std::pair<std::string, std::string>> device_fields;
  std::vector<Check> checks;
  double copy_gbps = 0, read_gbps = 0;
  std::vector<BandwidthRow> bandwidth;
  std::vector<VrankRow> vranks;
  std::vector<std::string> notes;

  void add(Check c) {
    std::printf("  %-4s %-12s %-58s %s\n",
                c.ok            ? "ok"
                : c.environment ? "ENV"
                                : "FAIL",
                c.section.c_str(), c.name.c_str(), c.detail.c_str());
    std::fflush(stdout);
    checks.push_back(std::move(c));
  }
  std::size_t wrong_results() const {
    return static_cast<std::size_t>(std::count_if(
        checks.begin(), checks.end(), [](const Check& c) { return !c.ok && !c.environment; }));
  }
  std::size_t environment_failures() const {
    return static_cast<std::size_t>(std::count_if(
        checks.begin(), checks.end(), [](const Check& c) { return !c.ok && c.environment; }));
  }
  bool all_ok() const { return wrong_results() == 0 && environment_failures() == 0; }
  // 0 every check ran and is correct; 1 a wrong result (whatever else happened); 2 no wrong
  // result, but a set-up failed (the environment: no GPU, no NCCL communicator).
  int exit_code() const { return wrong_results() > 0 ? 1 : environment_failures() > 0 ? 2 : 0; }

  // complete: false while sections are still to run (the file is rewritten after each one, so
  // that a crash leaves what was found so far).
  std::string json(bool complete = true) const {
    std::ostringstream o;
    o << "{\n  \"tool\": \"gpu_check\",\n  \"complete\": " << (complete ? "true" : "false")
      << ",\n  \"ok\": " << (all_ok() ? "true" : "false")
      << ",\n  \"wrong_results\": " << wrong_results()
      << ",\n  \"environment_failures\": " << environment_failures()
      << ",\n  \"exit_code\": " << exit_code() << ",\n";
    o << "  \"device\": {";
    for (std::size_t i = 0; i < device_fields.size(); ++i)
      o << (i ? ", " : "") << json_str(device_fields[i].first) << ": " << device_fields[i].second;
    o << "},\n  \"checks\": [\n";
    for (std::size_t i = 0; i < checks.size(); ++i) {
      const Check& c = checks[i];
      o << "    {\"section\": " << json_str(c.section) << ", \"name\": " << json_str(c.name)
        << ", \"ok\": " << (c.ok ? "true" : "false")
        << ", \"environment\": " << (c.environment ? "true" : "false")
        << ", \"error\": " << json_num(c.error) << ", \"detail\": " << json_str(c.detail) << "}"
        << (i + 1 < checks.size() ? "," : "") << "\n";
    }
    o << "  ],\n  \"probes\": {\"copy_gbps\": " << json_num(copy_gbps)
      << ", \"read_gbps\": " << json_num(read_gbps) << "},\n  \"bandwidth\": [\n";
    for (std::size_t i = 0; i < bandwidth.size(); ++i) {
      const BandwidthRow& b = bandwidth[i];
      o << "    {\"shape\": \"llama3-8b\", \"dtype\": " << json_str(b.dtype)
        << ", \"batch\": " << b.batch << ", \"tokens\": " << b.tokens
        << ", \"kv_bytes\": " << json_num(b.kv_bytes) << ", \"splits\": " << b.splits
        << ", \"chunk\": " << b.chunk << ", \"eager_ms\": " << json_num(b.eager_ms)
        << ", \"graph_ms\": " << json_num(b.graph_ms) << ", \"gbps\": " << json_num(b.gbps)
        << ", \"fraction_of_copy\": " << json_num(b.frac_copy)
        << ", \"fraction_of_read\": " << json_num(b.frac_read)
        << ", \"fused_merge_us\": " << json_num(b.fused_merge_us) << "}"
        << (i + 1 < bandwidth.size() ? "," : "") << "\n";
    }
    o << "  ],\n  \"virtual_ranks\": [\n";
    for (std::size_t i = 0; i < vranks.size(); ++i) {
      const VrankRow& v = vranks[i];
      o << "    {\"p\": " << v.p << ", \"single_ms\": " << json_num(v.single_ms)
        << ", \"sharded_ms\": " << json_num(v.sharded_ms)
        << ", \"merge_us\": " << json_num(v.merge_us)
        << ", \"merge_graph_us\": " << json_num(v.merge_graph_us)
        << ", \"max_rel_error\": " << json_num(v.error) << "}" << (i + 1 < vranks.size() ? "," : "")
        << "\n";
    }
    o << "  ],\n  \"notes\": [";
    for (std::size_t i = 0; i < notes.size(); ++i) o << (i ? ", " : "") << json_str(notes[i]);
    o << "]\n}\n";
    return o.str();
  }
};

}  // namespace gpucheck
