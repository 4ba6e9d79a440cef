// `treeattn plan`: what every strategy will cost on a topology, and how far to trust it.
//
//   plan --topology FILE|preset:NAME [shape] [--ranks P]   predicted latency, bytes sent and
//        peak memory per strategy and the planner's choice (cost_model.hpp)
//   plan --sweep                                           the paper's experiment (Fig. 3) on
//        preset:dgx-h100x16: tree vs the KV-rotating ring, 8/64/128 devices, 80k..5.12M tokens,
//        next to the figures the paper quotes, with a plot of the predicted speed-up
//   plan --validate                                        predicted vs measured: for each
//        emulated cluster KxR and link, `topo --detect` calibrates a topology and `bench`
//        measures every strategy interleaved in one job (both run as subprocesses of this
//        executable, with cores / ranks kernel threads per rank); the experiment's loop and
//        the comparison are the measurement library's run_validation (validate.hpp): median
//        |relative error| and whether the planner's choice is within 10% of the best measured.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <nlohmann/json.hpp>

#include "cluster.hpp"
#include "commands.hpp"
#include "options.hpp"
#include "measure/bench_results.hpp"
#include "measure/plan_report.hpp"
#include "measure/validate_report.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/launch.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/topology.hpp"
#include "treeattn/validate.hpp"

namespace treeattn::cli {
namespace {

struct PlanFlags {
  ShapeFlags shape;
  std::string topology;
  int ranks = 0;
  int ranks_per_node = 0;
  int fanout = 2;
  std::string methods;  // candidates; empty = all but single
  bool include_single = false;
  std::string json;
  // --sweep
  bool sweep = false;
  std::string plot, devices;
  // --validate
  bool validate = false;
  std::string clusters = "1x2,1x4,2x2,4x1";
  std::string links = "none,1gbit";
  std::string seq_list = "32k,256k";
  int warmup = 2;
  // Enough steps that one strategy's p50 moves less between runs on shared cores than the
  // one-collective strategies differ from each other.
  int iters = 30;
  double target = 0.20;
  bool keep = false;
};

int fail(const Status& s) {
  std::fprintf(stderr, "treeattn plan: error: %s\n", s.to_string().c_str());
  return 2;
}

Result<std::vector<std::string>> candidates(const std::string& text) {
  std::vector<std::string> out;
  if (text.empty() || text == "all") return out;
  for (const auto& m : split_list(text)) {
    const auto& known = modeled_strategies();
    if (std::find(known.begin(), known.end(), m) == known.end()) {
      std::string k;
      for (const auto& s : known) k += (k.empty() ? "" : ", ") + s;
      return invalid_argument("--methods: unknown strategy '" + m + "' (known: " + k + ")");
    }
    out.push_back(m);
  }
  return out;
}

Status write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  if (!f) return invalid_argument("cannot write '" + path + "'");
  f << text;
  return f ? Status::ok() : internal_error("writing '" + path + "' failed");
}

// ---- plan: the table ---------------------------------------------------------------------

int plan_table(PlanFlags& f) {
  auto topo = load_topology(f.topology.empty() ? "preset:local" : f.topology);
  if (!topo.is_ok()) return fail(topo.status());
  auto cands = candidates(f.methods);
  if (!cands.is_ok()) return fail(cands.status());
  const DType dt = *parse_dtype(f.shape.dtype);
  nlohmann::json out = nlohmann::json::array();
  for (int64_t seq : f.shape.seqs) {
    CostQuery q;
    q.shape = f.shape.shape();
    q.kv_dtype = dt;
    q.context = seq;
    q.ranks = f.ranks;
    q.ranks_per_node = f.ranks_per_node;
    q.hier_fanout = f.fanout;
    PlanOptions po;
    po.candidates = *cands;
    po.include_single = f.include_single;
    auto report = plan_report(q, *topo, po, f.shape.dtype);
    if (!report.is_ok()) return fail(report.status());
    std::fputs(report->text.c_str(), stdout);
    out.push_back(report->json);
  }
  if (!f.json.empty()) {
    nlohmann::json j = {{"format", "treeattn-plan/1"}, {"plans", out}};
    if (Status s = write_text(f.json, j.dump(2) + "\n"); !s.is_ok()) return fail(s);
  }
  return 0;
}

// ---- plan --sweep: the paper's experiment ----------------------------------------------------

int plan_sweep(PlanFlags& f, const CLI::App& sub) {
  auto topo = load_topology(f.topology.empty() ? "preset:dgx-h100x16" : f.topology);
  if (!topo.is_ok()) return fail(topo.status());
  SweepOptions so;
  if (!f.devices.empty()) {
    auto d = parse_size_list(f.devices);
    if (!d.is_ok()) return fail(invalid_argument("--devices: " + d.status().message()));
    for (int64_t v : *d) {
      if (v < 1 || v > (1 << 20))
        return fail(invalid_argument(
            fmt::format("--devices: {} is not a device count (1 to 1048576)", v)));
      so.devices.push_back(static_cast<int>(v));
    }
  }
  // The paper's contexts are decimal (80k = 80,000 ... 5.12M = 5,120,000); an explicit --seq
  // (binary suffixes, as everywhere in this CLI) replaces them.
  if (sub.count("--seq") > 0) so.contexts = f.shape.seqs;
  auto rows = paper_sweep(*topo, so);
  if (!rows.is_ok()) return fail(rows.status());
  std::fputs(sweep_text(*topo, *rows).c_str(), stdout);
  if (!f.plot.empty()) {
    if (Status s = write_sweep_plot(f.plot, *rows, topo->name); !s.is_ok()) return fail(s);
    std::printf("\nplot written to %s\n", f.plot.c_str());
  }
  if (!f.json.empty())
    if (Status s = write_text(f.json, sweep_json(*topo, *rows).dump(2) + "\n"); !s.is_ok())
      return fail(s);
  return 0;
}

// ---- plan --validate: predicted vs measured -------------------------------------------------

// Runs this executable with args and waits; its output goes to ours (prefixed by nothing).
Result<int> run_self(const std::vector<std::string>& args) {
  std::vector<std::string> cmd = {launch::self_exe()};
  cmd.insert(cmd.end(), args.begin(), args.end());
  std::string line;
  for (const auto& a : cmd) line += (line.empty() ? "" : " ") + a;
  std::fprintf(stderr, "$ %s\n", line.c_str());
  unsetenv("TREEATTN_LAUNCHED");  // the child is a fresh command, not a rank of a job
  // Stop signals are forwarded to the child (which forwards them to its mpirun).
  auto rc = launch::run_child(cmd);
  if (rc.is_ok() && launch::interrupted_by() != 0)
    std::fprintf(stderr, "treeattn plan: interrupted by signal %d (%s)\n",
                 launch::interrupted_by(), strsignal(launch::interrupted_by()));
  return rc;
}

std::string temp_path(const char* what) { return launch::make_temp_file(what); }

// The steps of the experiment that run jobs: this executable's `topo --detect` and `bench` as
// subprocesses, on the emulated cluster where the setup has more than one host.
struct SelfSteps {
  const PlanFlags& f;
  std::string mlist;
  AttnShape shape;

  std::vector<std::string> where(const ValidationSetup& c) const {
    std::vector<std::string> w = {"--ranks", std::to_string(c.ranks()), "--threads",
                                  std::to_string(default_threads(c.ranks()))};
    if (c.hosts > 1) {
      w.insert(w.end(), {"--cluster", fmt::format("{}x{}", c.hosts, c.ranks_per_host)});
      if (c.link != "veth") w.insert(w.end(), {"--link", c.link});
    }
    return w;
  }

  Result<Topology> calibrate(const ValidationSetup& c) const {
    if (!f.topology.empty()) return load_topology(f.topology);
    const std::string tfile = temp_path("topo");
    std::vector<std::string> args = {
        "topo",        "--detect",
        "--out",       tfile,
        "--name",      "detected " + c.label,
        "--probe-mib", "128",
        "--heads",     std::to_string(shape.heads * shape.q_len * shape.batch),
        "--kv-heads",  std::to_string(shape.kv_heads),
        "--head-dim",  std::to_string(shape.head_dim),
        "--dtype",     f.shape.dtype};
    const auto w = where(c);
    args.insert(args.end(), w.begin(), w.end());
    auto rc = run_self(args);
    if (!rc.is_ok() || *rc != 0) std::remove(tfile.c_str());
    if (!rc.is_ok()) return rc.status();
    if (*rc != 0) return internal_error(fmt::format("topo --detect failed (exit {})", *rc));
    auto t = load_topology(tfile);
    if (!f.keep) std::remove(tfile.c_str());
    return t;
  }

  Result<std::vector<MeasuredLatency>> measure(const ValidationSetup& c) const {
    const std::string bfile = temp_path("bench");
    std::vector<std::string> args = {"bench",      "--methods",  mlist,
                                     "--seq",      f.seq_list,   "--batch",
                                     std::to_string(shape.batch), "--heads",
                                     std::to_string(shape.heads), "--kv-heads",
                                     std::to_string(shape.kv_heads), "--head-dim",
                                     std::to_string(shape.head_dim), "--q-len",
                                     std::to_string(shape.q_len), "--dtype",
                                     f.shape.dtype,              "--warmup",
                                     std::to_string(f.warmup),   "--iters",
                                     std::to_string(f.iters),    "--fanout",
                                     std::to_string(f.fanout),   "--json",
                                     bfile};
    const auto w = where(c);
    args.insert(args.end(), w.begin(), w.end());
    auto rc = run_self(args);
    if (!rc.is_ok() || *rc != 0) std::remove(bfile.c_str());
    if (!rc.is_ok()) return rc.status();
    if (*rc != 0) return internal_error(fmt::format("bench failed (exit {})", *rc));
    auto out = read_measured_latencies(bfile);
    if (out.is_ok() && !f.keep) std::remove(bfile.c_str());
    return out;
  }
};

int plan_validate(PlanFlags& f) {
  ValidationOptions o;
  std::vector<std::string> links = split_list(f.links);
  if (links.empty()) links = {"none"};
  for (const auto& c : split_list(f.clusters)) {
    for (const auto& l : links) {
      const std::string link = l == "none" ? "" : l;
      auto spec = parse_cluster(c, "");
      if (!spec.is_ok()) return fail(spec.status());
      if (spec->hosts == 1 && !link.empty()) continue;  // one host: no network to shape
      if (!link.empty())
        if (auto r = link_rate_GBps(link); !r.is_ok()) return fail(r.status());
      if (spec->emulated())
        if (auto s = cluster_script(); !s.is_ok()) return fail(s.status());
      ValidationSetup v;
      v.hosts = spec->hosts;
      v.ranks_per_host = spec->ranks_per_host;
      v.link = link.empty() ? (spec->emulated() ? "veth" : "shm") : link;
      v.label = fmt::format("{}x{} {}", v.hosts, v.ranks_per_host, v.link);
      o.setups.push_back(v);
    }
  }
  if (o.setups.empty()) return fail(invalid_argument("--cluster: no configuration to validate"));
  auto seqs = parse_size_list(f.seq_list);
  if (!seqs.is_ok()) return fail(invalid_argument("--seq-list: " + seqs.status().message()));
  o.contexts = *seqs;
  auto cands = candidates(f.methods);
  if (!cands.is_ok()) return fail(cands.status());
  o.methods = *cands;
  if (o.methods.empty())
    for (const auto& m : modeled_strategies())
      if (StrategyRegistry::for_backend(CommCapabilities{}).info(m)->placement !=
          PlacementNeed::kAllOnRoot)
        o.methods.push_back(m);
  std::string mlist;
  for (const auto& m : o.methods) mlist += (mlist.empty() ? "" : ",") + m;
  if (!f.topology.empty())
    if (auto t = load_topology(f.topology); !t.is_ok()) return fail(t.status());
  o.shape = f.shape.shape();
  o.dtype = *parse_dtype(f.shape.dtype);
  o.fanout = f.fanout;

  const SelfSteps self{f, mlist, o.shape};
  ValidationSteps steps;
  steps.calibrate = [&self](const ValidationSetup& c) { return self.calibrate(c); };
  steps.measure = [&self](const ValidationSetup& c) { return self.measure(c); };
  auto report = run_validation(o, steps);
  if (!report.is_ok()) {
    if (launch::interrupted_by() != 0) return 128 + launch::interrupted_by();
    std::fprintf(stderr, "treeattn plan --validate: %s\n", report.status().to_string().c_str());
    return report.status().code() == Code::kInternal ? 1 : 2;
  }
  const ValidationMeta meta{f.shape.dtype, f.warmup, f.iters, f.target, default_threads};
  std::fputs(validation_text(o, *report, meta).c_str(), stdout);
  if (!f.json.empty())
    if (Status s = write_text(f.json, validation_json(o, *report, meta).dump(2) + "\n");
        !s.is_ok())
      return fail(s);
  return 0;
}

int run_plan(PlanFlags& f, const CLI::App& sub) {
  if (f.sweep && f.validate)
    return fail(invalid_argument("give at most one of --sweep, --validate"));
  if (f.shape.seq.empty()) f.shape.seq = "64k";
  if (Status s = f.shape.resolve(sub); !s.is_ok()) return fail(s);
  if (!parse_dtype(f.shape.dtype))
    return fail(invalid_argument("--dtype: one of f32, f16, bf16, got '" + f.shape.dtype + "'"));
  if (f.ranks < 0)
    return fail(invalid_argument(
        fmt::format("--ranks must be >= 0 (0 = every rank of the topology), got {}", f.ranks)));
  if (f.ranks_per_node < 0)
    return fail(invalid_argument(fmt::format(
        "--ranks-per-node must be >= 0 (0 = the topology's), got {}", f.ranks_per_node)));
  if (f.fanout < 1)
    return fail(invalid_argument(fmt::format("--fanout must be >= 1, got {}", f.fanout)));
  if (!f.devices.empty() && !f.sweep)
    return fail(invalid_argument("--devices is a --sweep option"));
  if (!f.plot.empty() && !f.sweep) return fail(invalid_argument("--plot is a --sweep option"));
  // Outputs before any work.
  if (!f.json.empty())
    if (Status s = check_output_file("--json", f.json); !s.is_ok()) return fail(s);
  if (!f.plot.empty())
    if (Status s = check_plot_output("--plot", f.plot); !s.is_ok()) return fail(s);
  if (f.sweep) return plan_sweep(f, sub);
  if (f.validate) {
    if (f.warmup < 0 || f.iters < 1)
      return fail(invalid_argument("--warmup must be >= 0 and --iters >= 1"));
    return plan_validate(f);
  }
  return plan_table(f);
}

}  // namespace

Runner add_plan_command(CLI::App& app, const Invocation&) {
  auto* sub = app.add_subcommand(
      "plan",
      "Predicted latency, bytes sent and peak memory of every strategy on a topology "
      "and the planner's choice; --sweep: the paper's clusters; --validate: predicted "
      "vs measured");
  auto f = std::make_shared<PlanFlags>();
  f->shape.preset = "llama3-8b";
  f->shape.seq = "64k";
  f->shape.add_to(*sub, false);
  sub->add_option("--topology", f->topology,
                  "FILE or preset:NAME (default preset:local; --sweep: preset:dgx-h100x16; "
                  "--validate: detected per configuration)");
  sub->add_option("--ranks", f->ranks, "Ranks (0: every rank of the topology)")
      ->capture_default_str();
  sub->add_option("--ranks-per-node", f->ranks_per_node, "Placement (0: the topology's)")
      ->capture_default_str();
  sub->add_option("--fanout", f->fanout, "hier: children per leader in the inter-node tree")
      ->capture_default_str();
  sub->add_option("--methods", f->methods,
                  "Candidate strategies (comma-separated; default all but single)");
  sub->add_flag("--include-single", f->include_single, "Also rank `single` (all KV on one rank)");
  sub->add_option("--json", f->json, "Write the result as JSON");
  sub->add_flag("--sweep", f->sweep,
                "The paper's experiment: tree vs ring-kv, 8/64/128 devices, 80k..5.12M tokens");
  sub->add_option("--devices", f->devices, "--sweep: device counts (default 8,64,128)");
  sub->add_option("--plot", f->plot, "--sweep: write a PNG of the predicted speed-up (gnuplot)");
  sub->add_flag("--validate", f->validate,
                "Measure (bench) and compare with the model on local ranks or emulated clusters");
  sub->add_option("--cluster", f->clusters,
                  "--validate: configurations, K hosts x R ranks each (1xR: local ranks)")
      ->capture_default_str();
  sub->add_option("--link", f->links, "--validate: link rates (none = unshaped veth)")
      ->capture_default_str();
  sub->add_option("--seq-list", f->seq_list, "--validate: context lengths")->capture_default_str();
  sub->add_option("--warmup", f->warmup, "--validate: untimed steps per point")
      ->capture_default_str();
  sub->add_option("--iters", f->iters, "--validate: timed steps per point")->capture_default_str();
  sub->add_flag("--keep", f->keep, "--validate: keep the temporary topology and bench files");
  return [f, sub] { return run_plan(*f, *sub); };
}

}  // namespace treeattn::cli
