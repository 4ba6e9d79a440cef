// Reporting (see report.hpp).
#include "report.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "options.hpp"
#include "treeattn/measure.hpp"

namespace treeattn::cli {
namespace {

// Text inside a gnuplot single-quoted string: a quote is written twice.
std::string gnuplot_quoted(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '\'') out += '\'';
    if (c != '\n') out += c;
  }
  return out;
}

std::string us(double v) {
  if (v >= 1e6) return fmt::format("{:.2f}s", v / 1e6);
  if (v >= 1e4) return fmt::format("{:.1f}ms", v / 1e3);
  if (v >= 1e3) return fmt::format("{:.2f}ms", v / 1e3);
  return fmt::format("{:.1f}us", v);
}

}  // namespace

LatencyStats LatencyStats::of(std::vector<double> s) {
  LatencyStats r;
  if (s.empty()) return r;
  std::sort(s.begin(), s.end());
  r.min = s.front();
  r.max = s.back();
  r.p10 = percentile(s, 0.10);
  r.p50 = percentile(s, 0.50);
  r.p90 = percentile(s, 0.90);
  r.p99 = percentile(s, 0.99);
  double sum = 0;
  for (double v : s) sum += v;
  r.mean = sum / static_cast<double>(s.size());
  return r;
}

nlohmann::json Point::to_json() const {
  nlohmann::json j = {
      {"method", method},
      {"ranks", ranks},
      {"nodes", nodes},
      {"seq", seq},
      {"batch", batch},
      {"heads", heads},
      {"kv_heads", kv_heads},
      {"head_dim", head_dim},
      {"q_len", q_len},
      {"dtype", dtype},
      {"shard", shard},
      {"kv_layout", kv_layout},
      {"device", device},
      {"iterations", iterations},
      {"latency_us",
       {{"min", latency_us.min}, {"p10", latency_us.p10}, {"p50", latency_us.p50},
        {"p90", latency_us.p90}, {"p99", latency_us.p99}, {"max", latency_us.max},
        {"mean", latency_us.mean}, {"spread", latency_us.spread()}}},
      {"bytes_sent_per_rank", bytes_sent_per_rank},
      {"bytes_formula", bytes_formula},
      {"peak_bytes_per_rank", peak_bytes_per_rank},
      {"peak_bytes_formula", peak_bytes_formula},
      {"peak_rss_bytes", peak_rss_bytes},
      {"kv_bytes_read", kv_bytes_read},
      {"kv_gbps", kv_gbps},
      {"max_rel_err", max_rel_err},
      {"output_sha256", output_sha256},
      {"tolerance", tolerance},
      {"ok", ok},
  };
  j["bytes_wire_per_rank"] = bytes_wire_per_rank ? nlohmann::json(*bytes_wire_per_rank) : nlohmann::json();
  return j;
}

Point Point::from_json(const nlohmann::json& j) {
  Point p;
  p.method = j.at("method");
  p.ranks = j.at("ranks");
  p.nodes = j.at("nodes");
  p.seq = j.at("seq");
  p.batch = j.at("batch");
  p.heads = j.at("heads");
  p.kv_heads = j.at("kv_heads");
  p.head_dim = j.at("head_dim");
  p.q_len = j.at("q_len");
  p.dtype = j.at("dtype");
  p.shard = j.at("shard");
  p.kv_layout = j.value("kv_layout", "rows");  // files written before the tiled layout: rows
  p.device = j.value("device", "cpu");         // files written before --device: cpu
  p.iterations = j.at("iterations");
  const auto& l = j.at("latency_us");
  p.latency_us = {l.at("min"), l.at("p50"), l.at("p90"), l.at("p99"), l.at("mean"),
                  l.value("p10", 0.0), l.value("max", 0.0)};
  p.bytes_sent_per_rank = j.at("bytes_sent_per_rank");
  if (!j.at("bytes_wire_per_rank").is_null()) p.bytes_wire_per_rank = j.at("bytes_wire_per_rank").get<uint64_t>();
  p.bytes_formula = j.at("bytes_formula");
  p.peak_bytes_per_rank = j.at("peak_bytes_per_rank");
  p.peak_bytes_formula = j.at("peak_bytes_formula");
  p.peak_rss_bytes = j.at("peak_rss_bytes");
  p.kv_bytes_read = j.at("kv_bytes_read");
  p.kv_gbps = j.at("kv_gbps");
  p.max_rel_err = j.at("max_rel_err");
  p.output_sha256 = j.value("output_sha256", std::string());
  p.tolerance = j.at("tolerance");
  p.ok = j.at("ok");
  return p;
}

void print_table(const std::vector<Point>& points, const std::string& speedup_base) {
  std::map<std::tuple<int, int64_t, int64_t>, double> base;  // (ranks, seq, batch) -> p50
  for (const auto& p : points)
    if (p.method == speedup_base) base[{p.ranks, p.seq, p.batch}] = p.latency_us.p50;
  std::printf("%-12s %5s %6s %5s | %9s %9s %9s %6s | %9s | %11s %11s | %11s %11s | %10s %8s | %8s %s\n",
              "method", "ranks", "seq", "batch", "p50", "p90", "min", "spread",
              speedup_base.empty() ? "" : ("vs " + speedup_base).c_str(), "sent/rank",
              "formula", "peak/rank", "formula", "peak RSS", "KV GB/s", "rel err", "");
  std::string last_group;
  for (const auto& p : points) {
    const std::string group = fmt::format("{}-{}-{}", p.ranks, p.seq, p.batch);
    if (!last_group.empty() && group != last_group) std::printf("\n");
    last_group = group;
    std::string speed;
    auto it = base.find({p.ranks, p.seq, p.batch});
    if (it != base.end() && p.latency_us.p50 > 0)
      speed = fmt::format("{:.2f}x", it->second / p.latency_us.p50);
    std::printf("%-12s %5d %6s %5lld | %9s %9s %9s %5.0f%% | %9s | %11s %11s | %11s %11s | %10s %8.2f | %8.1e %s\n",
                p.method.c_str(), p.ranks, format_size(p.seq).c_str(),
                static_cast<long long>(p.batch), us(p.latency_us.p50).c_str(),
                us(p.latency_us.p90).c_str(), us(p.latency_us.min).c_str(),
                100.0 * p.latency_us.spread(), speed.c_str(),
                format_bytes(static_cast<double>(p.bytes_sent_per_rank)).c_str(),
                format_bytes(static_cast<double>(p.bytes_formula)).c_str(),
                format_bytes(static_cast<double>(p.peak_bytes_per_rank)).c_str(),
                format_bytes(static_cast<double>(p.peak_bytes_formula)).c_str(),
                format_bytes(static_cast<double>(p.peak_rss_bytes)).c_str(), p.kv_gbps,
                p.max_rel_err, p.ok ? "ok" : "FAIL");
  }
  std::fflush(stdout);
}

Status write_json(const std::string& path, const std::vector<Point>& points,
                  const nlohmann::json& meta) {
  nlohmann::json j;
  j["meta"] = meta;
  j["points"] = nlohmann::json::array();
  for (const auto& p : points) j["points"].push_back(p.to_json());
  std::ofstream f(path);
  if (!f) return invalid_argument("cannot write JSON file '" + path + "'");
  f << j.dump(2) << "\n";
  return f ? Status::ok() : internal_error("writing '" + path + "' failed");
}

Status write_csv(const std::string& path, const std::vector<Point>& points) {
  std::ofstream f(path);
  if (!f) return invalid_argument("cannot write CSV file '" + path + "'");
  f << "method,ranks,nodes,seq,batch,heads,kv_heads,head_dim,q_len,dtype,shard,iterations,"
       "lat_min_us,lat_p50_us,lat_p90_us,lat_p99_us,bytes_sent_per_rank,bytes_wire_per_rank,"
       "bytes_formula,peak_bytes_per_rank,peak_bytes_formula,peak_rss_bytes,kv_bytes_read,"
       "kv_gbps,max_rel_err,ok,device\n";
  for (const auto& p : points)
    f << fmt::format(
        "{},{},{},{},{},{},{},{},{},{},{},{},{:.3f},{:.3f},{:.3f},{:.3f},"
        "{},{},{},{},{},{},{},{:.3f},{:.3e},{},{}\n",
        p.method, p.ranks, p.nodes, p.seq, p.batch, p.heads, p.kv_heads, p.head_dim, p.q_len,
        p.dtype, p.shard, p.iterations, p.latency_us.min, p.latency_us.p50, p.latency_us.p90,
        p.latency_us.p99, p.bytes_sent_per_rank,
        p.bytes_wire_per_rank ? std::to_string(*p.bytes_wire_per_rank) : "", p.bytes_formula,
        p.peak_bytes_per_rank, p.peak_bytes_formula, p.peak_rss_bytes, p.kv_bytes_read, p.kv_gbps,
        p.max_rel_err, p.ok ? 1 : 0, p.device);
  return f ? Status::ok() : internal_error("writing '" + path + "' failed");
}

Status write_plot(const std::string& path, const std::vector<Point>& points,
                  const std::string& title) {
  // One data block per (method, ranks) series, sorted by context length.
  std::map<std::string, std::vector<const Point*>> series;
  for (const auto& p : points)
    series[fmt::format("{} p={}", p.method, p.ranks)].push_back(&p);
  std::ostringstream f;
  for (auto& [name, pts] : series) {
    std::sort(pts.begin(), pts.end(), [](auto* a, auto* b) { return a->seq < b->seq; });
    f << "# " << name << "\n";
    for (const Point* p : pts)
      f << p->seq << " " << p->latency_us.p50 << " " << std::max<uint64_t>(1, p->bytes_sent_per_rank) << "\n";
    f << "\n\n";
  }
  const std::string data = "$DATA";
  std::string script = fmt::format(
      "set terminal pngcairo size 1400,600 font 'sans,10'\n"
      "set output '{}'\n"
      "set multiplot layout 1,2 title '{}'\n"
      "set logscale xy\nset grid\nset key left top\n"
      "set xlabel 'context tokens'\nset ylabel 'p50 latency per decode step (us)'\n",
      gnuplot_quoted(path), gnuplot_quoted(title));
  auto plot_cmd = [&](int col) {
    std::string s = "plot ";
    int idx = 0;
    for (const auto& [name, pts] : series) {
      if (idx) s += ", ";
      s += fmt::format("'{}' index {} using 1:{} with linespoints title '{}'", data, idx, col, name);
      ++idx;
    }
    return s + "\n";
  };
  script += plot_cmd(2);
  script += "set ylabel 'bytes sent per rank per step'\n";
  script += plot_cmd(3);
  script += "unset multiplot\n";
  return run_gnuplot(script, f.str(), path);
}

Status run_gnuplot(std::string script, const std::string& data, const std::string& out_path) {
  char tmpl[] = "/tmp/treeattn-plot-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return internal_error("cannot create a temporary file for gnuplot");
  close(fd);
  const std::string path = tmpl;
  {
    std::ofstream out(path);
    out << data;
  }
  for (std::size_t at = script.find("$DATA"); at != std::string::npos; at = script.find("$DATA", at))
    script.replace(at, 5, path);
  FILE* gp = popen("gnuplot 2>&1", "w");
  if (gp == nullptr) {
    std::remove(path.c_str());
    return internal_error("cannot start gnuplot (apt-get install gnuplot-nox)");
  }
  std::fputs(script.c_str(), gp);
  const int rc = pclose(gp);
  std::remove(path.c_str());
  if (rc != 0) return internal_error("gnuplot failed (exit " + std::to_string(rc) + ") writing " + out_path);
  return Status::ok();
}

}  // namespace treeattn::cli
