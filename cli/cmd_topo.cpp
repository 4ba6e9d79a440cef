// `treeattn topo`: the machine as data. --detect measures the running job's topology (nodes
// from the shared-memory split, ping-pong latency and bandwidth per level, the memory-bandwidth
// probe, the merge allreduce's fixed cost) and writes it in the topology file format
// (docs/topology.md); --show prints a file or preset, --list names the presets.
//
// From a plain shell --detect re-executes itself under mpirun with --ranks P (or on the
// emulated cluster with --cluster KxR); under an existing mpirun/srun it uses that job.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>
#include <memory>

#include "cluster.hpp"
#include "commands.hpp"
#include "options.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/detect.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/job_status.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/launch.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/topology.hpp"

namespace treeattn::cli {
namespace {

struct TopoFlags {
  bool detect = false, list = false;
  std::string show, out, name = "detected", cluster, link;
  int ranks = 2, nodes = 0;
  int threads = 0;  // kernel and probe threads per rank; 0: cores / ranks on the node
  int64_t probe_mib = 256;
  int latency_iters = 200, bandwidth_iters = 10, timeout_ms = 60000;
  int heads = 32, kv_heads = 8, head_dim = 128;
  std::string dtype = "bf16";
  int64_t kernel_tokens = 16384;
};

int fail(const Status& s) {
  std::fprintf(stderr, "treeattn topo: error: %s\n", s.to_string().c_str());
  return 2;
}

// One human-readable summary of a topology (the JSON follows it).
void print_summary(const Topology& t) {
  std::printf("topology %s: %s\n", t.name.c_str(), t.description.c_str());
  std::printf("  %d node(s) x %d rank(s), collectives %s (+%.2f us per call)\n", t.nodes,
              t.ranks_per_node, std::string(collective_library_name(t.collectives)).c_str(),
              t.collective_overhead_us);
  std::printf("  node level:    %8.2f us, %9.3f GB/s per direction per rank\n", t.node.latency_us,
              t.node.bandwidth_GBps);
  if (t.network)
    std::printf("  network level: %8.2f us, %9.3f GB/s per link, %d link(s) per node\n",
                t.network->latency_us, t.network->bandwidth_GBps, t.network->links_per_node);
  std::printf("  memory:        %9.1f GB/s per rank%s\n", t.memory_bandwidth_GBps,
              t.memory_capacity_GB ? fmt::format(", {} GB", *t.memory_capacity_GB).c_str() : "");
  std::printf("  compute:       kernel overhead %.1f us%s%s\n", t.kernel_overhead_us,
              t.peak_tflops ? fmt::format(", {} TFLOP/s", *t.peak_tflops).c_str() : "",
              t.max_concurrent_ranks > 0
                  ? fmt::format(", {} rank(s) compute at once", t.max_concurrent_ranks).c_str()
                  : "");
}

int show(const TopoFlags& f) {
  auto t = load_topology(f.show);
  if (!t.is_ok()) return fail(t.status());
  print_summary(*t);
  std::printf("\n%s\n", topology_to_json(*t).c_str());
  return 0;
}

// The MPI side of --detect.
int detect_job(const TopoFlags& f) {
  auto world_r = mpi_init_world(nullptr, nullptr);
  if (!world_r.is_ok()) return fail(world_r.status());
  std::unique_ptr<Communicator> world = std::move(world_r).value();
  world->set_timeout(std::chrono::milliseconds(f.timeout_ms));
  launch::rank_status_phase("topo --detect");
  DetectOptions o;
  o.name = f.name;
  o.kernel_threads = f.threads;
  o.probe_threads = f.threads;
  o.nodes = f.nodes;
  o.latency_iters = f.latency_iters;
  o.bandwidth_iters = f.bandwidth_iters;
  o.probe_bytes = f.probe_mib << 20;
  o.kernel_heads = f.heads;
  o.kernel_kv_heads = f.kv_heads;
  o.head_dim = f.head_dim;
  o.allreduce_records = f.heads;
  o.kernel_dtype = f.dtype;
  o.kernel_tokens = f.kernel_tokens;
  std::vector<std::string> notes;
  auto t = detect_topology(*world, o, &notes);
  int rc = 0;
  if (!t.is_ok()) {
    std::fprintf(stderr, "treeattn topo --detect: rank %d: error: %s\n", world->rank(),
                 t.status().to_string().c_str());
    if (t.status().code() == Code::kTimeout) launch::abort_job(3, "");
    rc = 2;
  } else if (world->rank() == 0) {
    for (const auto& n : notes) std::printf("  %s\n", n.c_str());
    std::printf("\n");
    print_summary(*t);
    const std::string json = topology_to_json(*t);
    if (f.out.empty()) {
      std::printf("\n%s\n", json.c_str());
    } else {
      std::ofstream out(f.out);
      out << json << "\n";
      if (!out) {
        std::fprintf(stderr, "treeattn topo: error: cannot write '%s'\n", f.out.c_str());
        rc = 2;
      } else {
        std::printf("\nwritten to %s (use it with --topology %s)\n", f.out.c_str(), f.out.c_str());
      }
    }
  }
  world.reset();
  (void)mpi_finalize();
  return rc;
}

int run_topo(TopoFlags& f, const CLI::App& sub, const Invocation& inv) {
  const int modes = (f.detect ? 1 : 0) + (f.show.empty() ? 0 : 1) + (f.list ? 1 : 0);
  if (modes != 1)
    return fail(invalid_argument("give exactly one of --detect, --show FILE|preset:NAME, --list"));
  if (f.list) {
    for (const auto& n : treeattn::preset_names()) {
      auto t = preset_topology(n);
      std::printf("preset:%-12s %s\n", n.c_str(), t.is_ok() ? t->description.c_str() : "?");
    }
    return 0;
  }
  if (!f.show.empty()) return show(f);
  if (f.ranks < 1 || f.ranks > 4096)
    return fail(invalid_argument(fmt::format("--ranks {} is out of range 1..4096", f.ranks)));
  if (f.nodes < 0 || f.nodes > f.ranks)
    return fail(invalid_argument(
        fmt::format("--nodes {} must be between 0 (the shared-memory split) and --ranks {}",
                    f.nodes, f.ranks)));
  if (f.probe_mib < 16)
    return fail(invalid_argument(fmt::format("--probe-mib {}: must be >= 16", f.probe_mib)));
  // Each count sets how long the job runs (per level: small ping-pongs of microseconds, 4 MiB
  // exchanges of milliseconds); the caps keep a typo from running until killed.
  if (Status s = check_range("--latency-iters", f.latency_iters, 1, 1'000'000); !s.is_ok())
    return fail(s);
  if (Status s = check_range("--bandwidth-iters", f.bandwidth_iters, 1, 10'000); !s.is_ok())
    return fail(s);
  if (Status s = check_thread_count(f.threads, "--threads"); !s.is_ok()) return fail(s);
  if (Status s = AttnShape{1, f.heads, f.kv_heads, f.head_dim, 1}.validate(); !s.is_ok())
    return fail(s);
  if (!parse_dtype(f.dtype))
    return fail(invalid_argument("--dtype: one of f32, f16, bf16, got '" + f.dtype + "'"));
  if (f.kernel_tokens < 0 || f.kernel_tokens > (int64_t{1} << 24))
    return fail(invalid_argument(
        fmt::format("--kernel-tokens must be in [0, 16M], got {}", f.kernel_tokens)));
  if (f.probe_mib > (int64_t{1} << 20))
    return fail(invalid_argument(
        fmt::format("--probe-mib must be in [16, 1048576] (1 TiB), got {}", f.probe_mib)));
  if (Status s = check_timeout_ms("--timeout-ms", f.timeout_ms); !s.is_ok()) return fail(s);
  if (!f.out.empty() && !launch::started_by_mpi_launcher())  // once, before the job starts
    if (Status s = check_output_file("--out", f.out); !s.is_ok()) return fail(s);
  std::optional<ClusterSpec> cluster;
  if (!f.cluster.empty()) {
    auto spec = parse_cluster(f.cluster, f.link);
    if (!spec.is_ok()) return fail(spec.status());
    cluster = *spec;
    if (sub.count("--ranks") == 0) f.ranks = spec->ranks();
  } else if (!f.link.empty()) {
    return fail(invalid_argument("--link " + f.link + " needs --cluster KxR"));
  }
  if (launch::started_by_mpi_launcher()) return detect_job(f);
  launch::LaunchOptions lo;
  lo.ranks = f.ranks;
  lo.who = "treeattn topo";
  if (cluster) {
    auto prefix = cluster_session_prefix(*cluster, f.ranks);
    if (!prefix.is_ok()) return fail(prefix.status());
    lo.session_prefix = std::move(prefix).value();
  }
  std::vector<std::string> args = inv.args;
  args.insert(args.end(), {"--ranks", std::to_string(f.ranks)});
  // Emulated hosts share this machine's cores (as in bench --cluster): size threads by the job.
  if (cluster && f.threads == 0) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    args.insert(args.end(), {"--threads", std::to_string(std::max(1, cores / f.ranks))});
  }
  auto rc = launch::run_under_mpirun(lo, args);
  if (!rc.is_ok()) return fail(rc.status());
  if (const int code = launch::report_interrupt("treeattn topo"); code != 0) return code;
  return rc.value();
}

}  // namespace

Runner add_topo_command(CLI::App& app, const Invocation& inv) {
  auto* sub =
      app.add_subcommand("topo",
                         "The machine as data: detect this job's topology (nodes, link latency and "
                         "bandwidth, memory bandwidth) or show a topology file or preset");
  auto f = std::make_shared<TopoFlags>();
  sub->add_flag("--detect", f->detect,
                "Measure the topology of a job of --ranks P ranks (or the running mpirun job)");
  sub->add_option("--show", f->show, "Print a topology: FILE or preset:NAME");
  sub->add_flag("--list", f->list, "List the built-in presets");
  sub->add_option("--ranks", f->ranks, "--detect: ranks to start (from a plain shell)")
      ->capture_default_str()
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  sub->add_option("--nodes", f->nodes,
                  "--detect: group the ranks into K equal blocks as nodes (0: the shared-memory "
                  "split finds them)")
      ->capture_default_str();
  sub->add_option(
      "--cluster", f->cluster,
      "--detect on an emulated cluster of K hosts x R ranks (KxR; tools/cluster, root)");
  sub->add_option("--link", f->link,
                  "With --cluster: shape each host's link (tc rate, e.g. 1gbit)");
  sub->add_option("--threads", f->threads,
                  "--detect: kernel and probe threads per rank (0: cores / ranks on the node; "
                  "with --cluster: cores / ranks of the job)")
      ->capture_default_str()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  sub->add_option("--out", f->out, "--detect: write the topology JSON here (default: stdout)");
  sub->add_option("--name", f->name, "--detect: the topology's name")->capture_default_str();
  sub->add_option("--probe-mib", f->probe_mib, "Memory-bandwidth probe buffer (MiB)")
      ->capture_default_str();
  sub->add_option("--latency-iters", f->latency_iters, "Small-message ping-pongs per level")
      ->capture_default_str();
  sub->add_option("--bandwidth-iters", f->bandwidth_iters, "4 MiB ping-pongs / exchanges per level")
      ->capture_default_str();
  sub->add_option("--timeout-ms", f->timeout_ms, "Per-operation timeout in ms (0: wait forever)")
      ->capture_default_str();
  sub->add_option("--heads", f->heads,
                  "--detect: query heads of the timed kernel (and of the "
                  "timed merge: one state per head)")
      ->capture_default_str();
  sub->add_option("--kv-heads", f->kv_heads, "--detect: KV heads of the timed kernel")
      ->capture_default_str();
  sub->add_option("--head-dim", f->head_dim, "--detect: head dimension")->capture_default_str();
  sub->add_option("--dtype", f->dtype, "--detect: KV type of the timed kernel")
      ->capture_default_str();
  sub->add_option("--kernel-tokens", f->kernel_tokens,
                  "--detect: tokens per rank of the timed kernel (its read rate becomes the "
                  "memory bandwidth; 0: use the streaming probe)")
      ->capture_default_str();
  return [f, sub, &inv] { return run_topo(*f, *sub, inv); };
}

}  // namespace treeattn::cli
