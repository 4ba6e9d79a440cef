// The reported results of run and bench (bench_results.hpp).
#include "measure/bench_results.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include "core/units.hpp"
#include "treeattn/measure.hpp"

namespace treeattn {
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

// A step's time in the table: "812.3us", "1.25ms", "12.3ms", "1.20s".
std::string us(double v) {
  char buf[32];
  if (v >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fs", v / 1e6);
  else if (v >= 1e4)
    std::snprintf(buf, sizeof buf, "%.1fms", v / 1e3);
  else if (v >= 1e3)
    std::snprintf(buf, sizeof buf, "%.2fms", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.1fus", v);
  return buf;
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

BenchResult summarize(BenchPoint point, const std::string& device) {
  BenchResult r;
  static_cast<BenchPoint&>(r) = std::move(point);
  r.device = device;
  r.iterations = static_cast<int>(r.step_us.size());
  r.latency_us = LatencyStats::of(r.step_us);
  r.kv_gbps =
      r.latency_us.p50 > 0 ? static_cast<double>(r.kv_bytes_read) / (r.latency_us.p50 * 1e3) : 0;
  return r;
}

nlohmann::json to_json(const BenchResult& p) {
  const LatencyStats& l = p.latency_us;
  nlohmann::json j = {
      {"method", p.method},
      {"ranks", p.ranks},
      {"nodes", p.nodes},
      {"seq", p.seq},
      {"batch", p.batch},
      {"heads", p.heads},
      {"kv_heads", p.kv_heads},
      {"head_dim", p.head_dim},
      {"q_len", p.q_len},
      {"dtype", p.dtype},
      {"shard", p.shard},
      {"kv_layout", p.kv_layout},
      {"device", p.device},
      {"iterations", p.iterations},
      {"latency_us",
       {{"min", l.min},
        {"p10", l.p10},
        {"p50", l.p50},
        {"p90", l.p90},
        {"p99", l.p99},
        {"max", l.max},
        {"mean", l.mean},
        {"spread", l.spread()}}},
      {"bytes_sent_per_rank", p.bytes_sent_per_rank},
      {"bytes_formula", p.bytes_formula},
      {"peak_bytes_per_rank", p.peak_bytes_per_rank},
      {"peak_bytes_formula", p.peak_bytes_formula},
      {"peak_rss_bytes", p.peak_rss_bytes},
      {"kv_bytes_read", p.kv_bytes_read},
      {"kv_gbps", p.kv_gbps},
      {"max_rel_err", p.max_rel_err},
      {"output_sha256", p.output_sha256},
      {"tolerance", p.tolerance},
      {"ok", p.ok},
  };
  j["bytes_wire_per_rank"] =
      p.bytes_wire_per_rank ? nlohmann::json(*p.bytes_wire_per_rank) : nlohmann::json();
  return j;
}

BenchResult bench_result_from_json(const nlohmann::json& j) {
  BenchResult p;
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
  p.latency_us = {l.at("min"),  l.at("p50"),         l.at("p90"),        l.at("p99"),
                  l.at("mean"), l.value("p10", 0.0), l.value("max", 0.0)};
  p.bytes_sent_per_rank = j.at("bytes_sent_per_rank");
  if (!j.at("bytes_wire_per_rank").is_null())
    p.bytes_wire_per_rank = j.at("bytes_wire_per_rank").get<uint64_t>();
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

std::string format_bench_table(const std::vector<BenchResult>& points,
                               const std::string& speedup_base) {
  std::map<std::tuple<int, int64_t, int64_t>, double> base;  // (ranks, seq, batch) -> p50
  for (const auto& p : points)
    if (p.method == speedup_base) base[{p.ranks, p.seq, p.batch}] = p.latency_us.p50;
  std::string out;
  appendf(out,
          "%-12s %5s %6s %5s | %9s %9s %9s %6s | %9s | %11s %11s | %11s %11s | %10s %8s | %8s %s\n",
          "method", "ranks", "seq", "batch", "p50", "p90", "min", "spread",
          speedup_base.empty() ? "" : ("vs " + speedup_base).c_str(), "sent/rank", "formula",
          "peak/rank", "formula", "peak RSS", "KV GB/s", "rel err", "");
  std::string last_group;
  for (const auto& p : points) {
    const std::string group =
        std::to_string(p.ranks) + "-" + std::to_string(p.seq) + "-" + std::to_string(p.batch);
    if (!last_group.empty() && group != last_group) out += "\n";
    last_group = group;
    std::string speed;
    auto it = base.find({p.ranks, p.seq, p.batch});
    if (it != base.end() && p.latency_us.p50 > 0)
      appendf(speed, "%.2fx", it->second / p.latency_us.p50);
    appendf(out,
            "%-12s %5d %6s %5lld | %9s %9s %9s %5.0f%% | %9s | %11s %11s | %11s %11s | %10s %8.2f "
            "| %8.1e %s\n",
            p.method.c_str(), p.ranks, format_size(p.seq).c_str(), static_cast<long long>(p.batch),
            us(p.latency_us.p50).c_str(), us(p.latency_us.p90).c_str(),
            us(p.latency_us.min).c_str(), 100.0 * p.latency_us.spread(), speed.c_str(),
            format_bytes(static_cast<double>(p.bytes_sent_per_rank)).c_str(),
            format_bytes(static_cast<double>(p.bytes_formula)).c_str(),
            format_bytes(static_cast<double>(p.peak_bytes_per_rank)).c_str(),
            format_bytes(static_cast<double>(p.peak_bytes_formula)).c_str(),
            format_bytes(static_cast<double>(p.peak_rss_bytes)).c_str(), p.kv_gbps, p.max_rel_err,
            p.ok ? "ok" : "FAIL");
  }
  return out;
}

Status write_bench_json(const std::string& path, const std::vector<BenchResult>& results,
                        const nlohmann::json& meta) {
  nlohmann::json j;
  j["meta"] = meta;
  j["points"] = nlohmann::json::array();
  for (const auto& p : results) j["points"].push_back(to_json(p));
  std::ofstream f(path);
  if (!f) return invalid_argument("cannot write JSON file '" + path + "'");
  f << j.dump(2) << "\n";
  return f ? Status::ok() : internal_error("writing '" + path + "' failed");
}

Status write_bench_csv(const std::string& path, const std::vector<BenchResult>& results) {
  std::ofstream f(path);
  if (!f) return invalid_argument("cannot write CSV file '" + path + "'");
  f << "method,ranks,nodes,seq,batch,heads,kv_heads,head_dim,q_len,dtype,shard,iterations,"
       "lat_min_us,lat_p50_us,lat_p90_us,lat_p99_us,bytes_sent_per_rank,bytes_wire_per_rank,"
       "bytes_formula,peak_bytes_per_rank,peak_bytes_formula,peak_rss_bytes,kv_bytes_read,"
       "kv_gbps,max_rel_err,ok,device\n";
  char buf[1024];
  for (const auto& p : results) {
    const std::string wire = p.bytes_wire_per_rank ? std::to_string(*p.bytes_wire_per_rank) : "";
    std::snprintf(buf, sizeof buf,
                  "%s,%d,%d,%lld,%lld,%lld,%lld,%lld,%lld,%s,%s,%d,%.3f,%.3f,%.3f,%.3f,%llu,%s,"
                  "%llu,%llu,%llu,%llu,%llu,%.3f,%.3e,%d,%s\n",
                  p.method.c_str(), p.ranks, p.nodes, static_cast<long long>(p.seq),
                  static_cast<long long>(p.batch), static_cast<long long>(p.heads),
                  static_cast<long long>(p.kv_heads), static_cast<long long>(p.head_dim),
                  static_cast<long long>(p.q_len), p.dtype.c_str(), p.shard.c_str(), p.iterations,
                  p.latency_us.min, p.latency_us.p50, p.latency_us.p90, p.latency_us.p99,
                  static_cast<unsigned long long>(p.bytes_sent_per_rank), wire.c_str(),
                  static_cast<unsigned long long>(p.bytes_formula),
                  static_cast<unsigned long long>(p.peak_bytes_per_rank),
                  static_cast<unsigned long long>(p.peak_bytes_formula),
                  static_cast<unsigned long long>(p.peak_rss_bytes),
                  static_cast<unsigned long long>(p.kv_bytes_read), p.kv_gbps, p.max_rel_err,
                  p.ok ? 1 : 0, p.device.c_str());
    f << buf;
  }
  return f ? Status::ok() : internal_error("writing '" + path + "' failed");
}

BenchFile read_bench_file(const std::string& path) {
  BenchFile out;
  std::ifstream in(path);
  nlohmann::json j;
  try {
    if (in) in >> j;
  } catch (...) {
  }
  if (j.contains("meta") && j["meta"].is_object()) {
    out.device_description = j["meta"].value("device_description", std::string());
    out.kv_layout = j["meta"].value("kv_layout", std::string());
  }
  if (j.contains("points"))
    for (const auto& pj : j["points"]) {
      out.inexact = out.inexact || !pj.value("ok", true);
      out.results.push_back(bench_result_from_json(pj));
    }
  return out;
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
  for (std::size_t at = script.find("$DATA"); at != std::string::npos;
       at = script.find("$DATA", at))
    script.replace(at, 5, path);
  FILE* gp = popen("gnuplot 2>&1", "w");
  if (gp == nullptr) {
    std::remove(path.c_str());
    return internal_error("cannot start gnuplot (apt-get install gnuplot-nox)");
  }
  std::fputs(script.c_str(), gp);
  const int rc = pclose(gp);
  std::remove(path.c_str());
  if (rc != 0)
    return internal_error("gnuplot failed (exit " + std::to_string(rc) + ") writing " + out_path);
  return Status::ok();
}

Status write_bench_plot(const std::string& path, const std::vector<BenchResult>& results,
                        const std::string& title) {
  // One data block per (method, ranks) series, sorted by context length.
  std::map<std::string, std::vector<const BenchResult*>> series;
  for (const auto& p : results) series[p.method + " p=" + std::to_string(p.ranks)].push_back(&p);
  std::ostringstream f;
  for (auto& [name, pts] : series) {
    std::sort(pts.begin(), pts.end(), [](auto* a, auto* b) { return a->seq < b->seq; });
    f << "# " << name << "\n";
    for (const BenchResult* p : pts)
      f << p->seq << " " << p->latency_us.p50 << " "
        << std::max<uint64_t>(1, p->bytes_sent_per_rank) << "\n";
    f << "\n\n";
  }
  std::string script =
      "set terminal pngcairo size 1400,600 font 'sans,10'\n"
      "set output '" +
      gnuplot_quoted(path) +
      "'\n"
      "set multiplot layout 1,2 title '" +
      gnuplot_quoted(title) +
      "'\n"
      "set logscale xy\nset grid\nset key left top\n"
      "set xlabel 'context tokens'\nset ylabel 'p50 latency per decode step (us)'\n";
  auto plot_cmd = [&](int col) {
    std::string s = "plot ";
    int idx = 0;
    for (const auto& entry : series) {
      if (idx) s += ", ";
      s += "'$DATA' index " + std::to_string(idx) + " using 1:" + std::to_string(col) +
           " with linespoints title '" + entry.first + "'";
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

Status check_bench_memory(const BenchConfig& c, int ranks) {
  const MemoryNeed need = bench_memory_need(c, ranks);
  if (need.available_bytes <= 0 || need.per_job_bytes <= 0.9 * need.available_bytes)
    return Status::ok();
  std::string msg;
  appendf(msg,
          "a context of %lld tokens (%s, batch %lld) on %d ranks needs about %s of memory; this "
          "machine has %s available (%s of KV cache, %s of queries, outputs and states)",
          static_cast<long long>(c.seq), c.shape.to_string().c_str(),
          static_cast<long long>(c.shape.batch), ranks, format_bytes(need.per_job_bytes).c_str(),
          format_bytes(need.available_bytes).c_str(), format_bytes(need.kv_bytes).c_str(),
          format_bytes(need.state_bytes).c_str());
  return Status(Code::kOutOfMemory, msg);
}

Result<std::vector<BenchResult>> bench_sweep(Communicator& comm, const BenchSweep& sweep) {
  std::vector<BenchResult> out;
  const std::size_t total = sweep.seqs.size() * sweep.batches.size();
  std::size_t done = 0;
  for (int64_t batch : sweep.batches)
    for (int64_t seq : sweep.seqs) {
      BenchConfig c = sweep.base;
      c.shape.batch = batch;
      c.seq = seq;
      if (sweep.methods_for) {
        auto m = sweep.methods_for(c);
        TREEATTN_RETURN_IF_ERROR(m.status());
        c.methods = std::move(m).value();
      }
      if (sweep.progress) sweep.progress(++done, total, c);
      auto points = bench_strategies(comm, c);
      TREEATTN_RETURN_IF_ERROR(points.status());
      for (BenchPoint& p : *points) out.push_back(summarize(std::move(p), sweep.device));
    }
  return out;
}

}  // namespace treeattn
