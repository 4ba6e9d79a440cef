// `treeattn run` and `treeattn bench`: decode steps on P ranks for every requested method on
// the same generated data, checked against the float64 oracle outside the timed loop, with
// latency, bytes sent and peak memory reported side by side as separate results.
//
// From a plain shell both re-execute themselves under mpirun (one job per rank count); under
// an existing mpirun/srun they use that job's world.
//
// --device cuda: every rank decodes on one GPU (the CUDA executor on device local rank % GPUs)
// and the sessions merge over NCCL, bootstrapped over the MPI world; the measuring (barriers,
// timings, checks) stays on MPI in host memory (workload.hpp). What the build lacks is refused
// before any rank starts; a rank without a GPU fails the set-up on every rank, and rank 0 names
// it.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#include "cluster.hpp"
#include "cmd_kernel.hpp"
#include "device.hpp"
#include "commands.hpp"
#include "measure.hpp"
#include "measure/bench_results.hpp"
#include "options.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/comm_nccl.hpp"
#include "treeattn/executor_cuda.hpp"
#include "treeattn/job_status.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/launch.hpp"
#include "treeattn/strategy.hpp"
#include "tuning.hpp"

namespace treeattn::cli {
namespace {

struct DecodeFlags {
  ShapeFlags shape;
  std::string ranks = "4";
  std::string methods = "all";
  int warmup = 2;
  int iters = 5;
  bool append = true;
  int nodes = 1;
  int fanout = 2;
  int root = -1;
  int threads = 0;
  int timeout_ms = 60000;
  bool no_check = false;
  std::string json, csv, plot, child_json;
  std::string baseline = "ring-kv";
  // Emulated cluster and topology (cluster.hpp): --cluster KxR [--link RATE], and the topology
  // `auto` is planned on (--topology FILE|preset:NAME; default: this machine or the cluster).
  std::string cluster, link, topology;
  // bench --kernel: the local kernel's roofline instead of a distributed sweep.
  bool kernel = false;
  bool kernel_cases = false;
  int repeats = 5;
  std::string isa = "auto";
  bool no_peer = false;
  bool ranks_given = false;  // --ranks on the command line (not the default)
  std::string inject;        // --inject (debug): one fault
  InjectSpec inject_spec;
  bool deterministic = false;  // add tree-det (the same bits for any rank count) to the methods
  std::string device = "cpu";  // --device
  Device device_kind = Device::kCpu;
  bool no_tune = false;        // --no-tune
};

// The layout run_interleaved will choose (choose_kv_layout, strategy.hpp): rows on a GPU, else
// what host_kv_layout measures (or has measured) for this shape, dtype and kernel threads; in a
// job, rank 0's, which the driver gives every rank.
std::string layout_label(const std::string& flag, const std::vector<std::string>& methods,
                         Device d, const KVLayoutWorkload& workload) {
  if (flag != "auto") return flag;
  if (d == Device::kCuda) return "rows (auto: the GPU's shards)";
  auto layout = choose_kv_layout(KVLayout::kAuto, MemorySpace::kHost, methods);
  if (!layout.is_ok()) return "auto";
  const HostKVLayout h = host_kv_layout(workload);
  return std::string(kv_layout_name(h.layout)) + " (auto, " + h.how + ")";
}

// --threads: the kernels' one cap (kernel.hpp, kMaxThreads), with the same message everywhere.
Status check_threads(int threads) { return check_thread_count(threads, "--threads"); }

// Caps of the counts that set how long a run takes (a typo must not run until killed): decode
// steps (warm-up and timed, each kept per method for the report) and bench --kernel's repeats.
constexpr int kMaxSteps = 100000;
constexpr int kMaxRepeats = 10000;

// --nodes and --root against a job of `ranks` ranks.
Status check_job_flags(const DecodeFlags& f, int64_t ranks) {
  if (f.nodes < 1 || f.nodes > ranks)
    return invalid_argument(
        fmt::format("--nodes {} must be between 1 and the {} ranks", f.nodes, ranks));
  if (f.root < -1 || f.root >= ranks)
    return invalid_argument(fmt::format(
        "--root {} must be -1 (every rank gets the result) or a rank of the {}-rank job (0..{})",
        f.root, ranks, ranks - 1));
  return Status::ok();
}

// --inject against the job: the rank exists and the step is one the run has.
Status check_inject(const DecodeFlags& f, int64_t ranks) {
  const InjectSpec& i = f.inject_spec;
  if (i.kind == InjectSpec::Kind::kNone) return Status::ok();
  if (i.rank >= ranks)
    return invalid_argument(fmt::format("--inject {}: there is no rank {} in a job of {} ranks",
                                        i.to_string(), i.rank, ranks));
  if ((i.kind == InjectSpec::Kind::kKill || i.kind == InjectSpec::Kind::kNeverArrive) &&
      i.step >= f.warmup + f.iters)
    return invalid_argument(fmt::format(
        "--inject {}: step {} is past the run's {} steps (warm-up steps count from 0)",
        i.to_string(), i.step, f.warmup + f.iters));
  return Status::ok();
}

// The output flags, checked before any work (in a job started by an outside mpirun: on rank 0).
Status check_outputs(const DecodeFlags& f) {
  if (!f.json.empty()) TREEATTN_RETURN_IF_ERROR(check_output_file("--json", f.json));
  if (!f.csv.empty()) TREEATTN_RETURN_IF_ERROR(check_output_file("--csv", f.csv));
  if (!f.plot.empty()) TREEATTN_RETURN_IF_ERROR(check_plot_output("--plot", f.plot));
  return Status::ok();
}

// One point's configuration from the flags (threads and `auto` methods are resolved in the job).
MeasureConfig measure_config(const DecodeFlags& f, const std::vector<std::string>& methods,
                             int64_t seq, int64_t batch) {
  MeasureConfig mc;
  mc.methods = methods;
  mc.shape = f.shape.shape();
  mc.shape.batch = batch;
  mc.dtype = *parse_dtype(f.shape.dtype);
  mc.seq = seq;
  mc.shard = f.shape.shard;
  mc.kv_layout = *parse_kv_layout(f.shape.kv_layout);
  mc.seed = f.shape.seed;
  mc.warmup = f.warmup;
  mc.iters = f.iters;
  mc.append = f.append;
  mc.nodes = f.nodes;
  mc.fanout = f.fanout;
  mc.root = f.root;
  mc.timeout_ms = f.timeout_ms;
  mc.check = !f.no_check;
  mc.inject = f.inject_spec;
  return mc;
}

// The MPI side: one job, one rank count, every (seq, batch, method) point.
int run_job(const char* cmd, DecodeFlags& f, const std::vector<std::string>& methods,
            bool bench) {
  auto world_r = mpi_init_world(nullptr, nullptr);
  if (!world_r.is_ok()) return fail(cmd, world_r.status());
  std::unique_ptr<Communicator> world = std::move(world_r).value();
  const int P = world->size();
  const bool lead = world->rank() == 0;
  const auto requested = parse_size_list(f.ranks);
  if (f.ranks_given && requested.is_ok() && requested.value().size() == 1 &&
      requested.value()[0] != P && f.child_json.empty()) {
    if (lead)
      std::fprintf(stderr, "treeattn %s: error: --ranks %s but the MPI job has %d ranks\n", cmd,
                   f.ranks.c_str(), P);
    world.reset();
    (void)mpi_finalize();
    return 2;
  }
  if (Status s = check_job_flags(f, P); !s.is_ok()) {
    if (lead) std::fprintf(stderr, "treeattn %s: error: %s\n", cmd, s.to_string().c_str());
    world.reset();
    (void)mpi_finalize();
    return 2;
  }
  {
    // What depends on the job (its size, this host) or what a job started by an outside mpirun
    // has not been checked for: every rank stops, rank 0 says why.
    Status s = check_threads(f.threads);
    if (s.is_ok()) s = check_inject(f, P);
    if (s.is_ok() && lead && f.child_json.empty()) s = check_outputs(f);
    float bad = s.is_ok() ? 0.0f : 1.0f;
    const Status agreed = world->allreduce(&bad, 1, ReduceOp::kMax);
    if (!agreed.is_ok() || bad != 0.0f) {
      if (lead && !s.is_ok()) std::fprintf(stderr, "treeattn %s: error: %s\n", cmd, s.to_string().c_str());
      world.reset();
      (void)mpi_finalize();
      return 2;
    }
  }
  // --device cuda: this rank's GPU and the NCCL communicator, or every rank stops and rank 0
  // names the first rank that has none.
  world->set_timeout(std::chrono::milliseconds(f.timeout_ms));
  auto dev_r = open_device(*world, f.device_kind);
  if (!dev_r.is_ok()) {
    if (lead)
      std::fprintf(stderr, "treeattn %s: error: %s\n", cmd, dev_r.status().message().c_str());
    world.reset();
    (void)mpi_finalize();
    return 2;
  }
  RankDevice dev = std::move(dev_r).value();
  const bool cuda = f.device_kind == Device::kCuda;
  const std::string kernel_label = cuda ? "cuda" : std::string(isa_name(best_isa()));
  if (f.inject_spec.kind == InjectSpec::Kind::kMismatch && world->rank() == f.inject_spec.rank)
    f.shape.head_dim = f.shape.head_dim == 64 ? 128 : 64;  // the set-up agreement must name it
  const int threads = f.threads > 0 ? f.threads : default_threads(local_ranks(P));
  // Rank 0's layout is the job's (the driver broadcasts it); measured here first, the driver
  // finds it in this process.
  DecodeOptions kernel_options;
  kernel_options.threads = threads;
  const std::string layout_text =
      lead ? layout_label(f.shape.kv_layout, methods, f.device_kind,
                          KVLayoutWorkload{f.shape.shape(), *parse_dtype(f.shape.dtype),
                                           kernel_options})
           : std::string();
  if (lead && !bench && f.child_json.empty()) {
    const AttnShape s = f.shape.shape();
    const std::string threads_text = cuda ? "" : fmt::format(", {} thread(s) per rank", threads);
    std::printf(
        "treeattn run: %d ranks, %s, %s KV, %s tokens (%s shards), %d warm-up + %d decode "
        "steps%s; kernel %s, KV layout %s%s\n",
        P, s.to_string().c_str(), f.shape.dtype.c_str(), format_size(f.shape.seqs[0]).c_str(),
        f.shape.shard.c_str(), f.warmup, f.iters, f.append ? " with appends" : "",
        kernel_label.c_str(), layout_text.c_str(), threads_text.c_str());
    std::printf("%s\n", dev.description.c_str());
    std::printf("checking every method against the float64 oracle (max rel err <= 1e-5) and "
                "bit-identical results on all ranks\n\n");
    std::fflush(stdout);
  }
  MeasureConfig mc = measure_config(f, methods, f.shape.seqs[0], f.shape.batches[0]);
  mc.threads = threads;
  mc.device = f.device_kind;
  mc.executor = dev.executor.get();
  mc.device_comm = dev.comm.get();
  mc.progress = !f.child_json.empty() || bench;
  BenchSweep sweep;
  sweep.base = bench_config(mc);
  sweep.seqs = f.shape.seqs;
  sweep.batches = f.shape.batches;
  sweep.device = device_name(f.device_kind);
  sweep.methods_for = [&](const BenchConfig& c) {
    return resolve_auto_methods(c.methods, c.shape, c.dtype, c.seq, P, f.topology, f.cluster,
                                f.link, f.fanout, lead);
  };
  sweep.progress = [&](std::size_t done, std::size_t total, const BenchConfig& c) {
    if (lead)
      std::fprintf(stderr, "[%zu/%zu] p=%d seq=%s batch=%lld\n", done, total, P,
                   format_size(c.seq).c_str(), static_cast<long long>(c.shape.batch));
  };
  auto measured = bench_sweep(*world, sweep);
  const Status status = measured.status();
  if (!status.is_ok()) {
    std::fprintf(stderr, "treeattn %s: rank %d: error: %s\n", cmd, world->rank(),
                 status.to_string().c_str());
    if (status.code() == Code::kTimeout || status.code() == Code::kInternal ||
        status.code() == Code::kMismatch)
      launch::abort_job(3, "");
    dev = RankDevice();  // NCCL, then the executor, before the world they use
    world.reset();
    (void)mpi_finalize();
    return 2;
  }
  const std::vector<BenchResult>& points = *measured;
  bool all_ok = true;
  for (const auto& p : points) all_ok = all_ok && p.ok;
  int rc = all_ok ? 0 : 1;
  if (lead) {
    if (!f.child_json.empty()) {
      // The launching shell prints the header: it learns the device from here.
      Status s = write_bench_json(f.child_json, points,
                                  {{"device_description", dev.description}, {"kv_layout", layout_text}});
      if (!s.is_ok()) rc = fail(cmd, s);
    } else {
      if (bench) std::printf("%s\n", dev.description.c_str());
      std::fputs(format_bench_table(points, f.baseline).c_str(), stdout);
      std::fflush(stdout);
      nlohmann::json meta = {{"command", cmd},
                             {"kernel_isa", kernel_label},
                             {"threads_per_rank", threads},
                             {"warmup", f.warmup},
                             {"iterations", f.iters},
                             {"append", f.append},
                             {"device", device_name(f.device_kind)},
                             {"device_description", dev.description},
                             {"kv_layout", layout_text}};
      if (!f.json.empty()) if (Status s = write_bench_json(f.json, points, meta); !s.is_ok()) rc = fail(cmd, s);
      if (!f.csv.empty()) if (Status s = write_bench_csv(f.csv, points); !s.is_ok()) rc = fail(cmd, s);
      if (!f.plot.empty()) if (Status s = write_bench_plot(f.plot, points, "treeattn bench"); !s.is_ok()) rc = fail(cmd, s);
      if (!all_ok) std::printf("\nFAILED: at least one method is not exact (see the rel err column)\n");
    }
  }
  dev = RankDevice();
  world.reset();
  (void)mpi_finalize();
  return rc;
}

// The shell side: validate everything before any rank starts, then one mpirun per rank count.
int run_command(const char* cmd, DecodeFlags& f, const CLI::App& sub, const Invocation& inv,
                bool bench) {
  apply_no_tune(f.no_tune);
  if (Status s = f.shape.resolve(sub); !s.is_ok()) return fail(cmd, s);
  // --device: what this build can run, before any rank starts (whether this machine has a GPU:
  // after the flags, below).
  auto device = parse_device(f.device);
  if (!device.is_ok()) return fail(cmd, device.status());
  f.device_kind = *device;
  if (Status s = check_device_built(f.device_kind); !s.is_ok()) return fail(cmd, s);
  if (f.device_kind == Device::kCuda && f.shape.kv_layout == "tiled")
    return fail(cmd, invalid_argument("--kv-layout tiled is the CPU kernel's layout in host "
                                      "memory; with --device cuda the shards are rows (use "
                                      "--kv-layout auto or rows)"));
  // Counts and thread numbers first: bench --kernel takes them too.
  if (Status s = check_threads(f.threads); !s.is_ok()) return fail(cmd, s);
  if (bench && f.kernel) {
    if (Status s = check_range("--repeats", f.repeats, 1, kMaxRepeats); !s.is_ok())
      return fail(cmd, s);
    return kernel_bench(KernelBenchFlags{f.shape, f.shape.dtype, f.threads, f.repeats, f.isa,
                                         f.no_peer, f.kernel_cases, f.json, f.device_kind});
  }
  auto methods = resolve_methods(f.methods, f.device_kind);
  if (!methods.is_ok()) return fail(cmd, methods.status());
  // --device cuda on this machine's ranks: a machine without a usable GPU is refused here, once
  // the flags are known good, not by every rank after mpirun has started them (ranks on named
  // hosts find out for themselves).
  if (Status s = check_device_here(f.device_kind); !s.is_ok()) return fail(cmd, s);
  if (f.deterministic) {  // tree-det first; with the default `all`, compared with tree only
    std::vector<std::string> m = {std::string(deterministic_strategy())};
    const std::vector<std::string> tree_only = {"tree"};
    for (const auto& x : sub.count("--methods") == 0 ? tree_only : *methods)
      if (std::find(m.begin(), m.end(), x) == m.end()) m.push_back(x);
    methods = m;
    if (f.shape.shard == "striped")
      return fail(cmd, invalid_argument("--deterministic needs a contiguous placement (even, "
                                        "uneven or empty), not --shard striped"));
  }
  if (!StrategyRegistry::for_backend(CommCapabilities{}).contains(f.baseline)) {
    std::string known;
    for (const auto& k : all_methods()) known += (known.empty() ? "" : ", ") + k;
    return fail(cmd, invalid_argument("--baseline: unknown method '" + f.baseline + "' (known: " +
                                      known + ")"));
  }
  if (!parse_dtype(f.shape.dtype))
    return fail(cmd, invalid_argument("--dtype '" + f.shape.dtype + "': run and bench take one of "
                                      "f32, f16, bf16, fp8, int8 (lists: bench --kernel)"));
  if (Status s = check_range("--warmup", f.warmup, 0, kMaxSteps); !s.is_ok()) return fail(cmd, s);
  if (Status s = check_range(bench ? "--iters" : "--steps", f.iters, 1, kMaxSteps); !s.is_ok())
    return fail(cmd, s);
  if (f.fanout < 1) return fail(cmd, invalid_argument("--fanout must be >= 1"));
  if (Status s = check_timeout_ms("--timeout-ms", f.timeout_ms); !s.is_ok()) return fail(cmd, s);
  if (!f.inject.empty()) {
    auto spec = parse_inject(f.inject);
    if (!spec.is_ok()) return fail(cmd, spec.status());
    f.inject_spec = *spec;
  }
  if (!f.cluster.empty() && sub.count("--ranks") == 0)  // --cluster KxR implies K x R ranks
    if (auto spec = parse_cluster(f.cluster, f.link); spec.is_ok()) f.ranks = std::to_string(spec->ranks());
  auto ranks = parse_size_list(f.ranks);
  if (!ranks.is_ok()) return fail(cmd, invalid_argument("--ranks: " + ranks.status().message()));
  for (int64_t p : ranks.value()) {
    if (p < 1 || p > 4096) return fail(cmd, invalid_argument(fmt::format("--ranks {} is out of range 1..4096", p)));
    if (Status s = check_inject(f, p); !s.is_ok()) return fail(cmd, s);
    // What the job would refuse once started, refused before mpirun starts it (a job started
    // by an outside mpirun checks again against its own size: run_job).
    if (Status s = check_job_flags(f, p); !s.is_ok()) return fail(cmd, s);
  }
  if (!bench && (ranks.value().size() > 1 || f.shape.seqs.size() > 1 || f.shape.batches.size() > 1))
    return fail(cmd, invalid_argument("run takes one --ranks, --seq and --batch; use bench to sweep"));
  if (!launch::started_by_mpi_launcher())
    for (int64_t p : ranks.value()) {
      launch::LaunchOptions lo;
      lo.ranks = static_cast<int>(p);
      if (Status s = launch::check_local_rank_count(lo, "--ranks"); !s.is_ok()) return fail(cmd, s);
    }
  for (int64_t seq : f.shape.seqs)
    for (int64_t b : f.shape.batches) {
      const MeasureConfig mc = measure_config(f, methods.value(), seq, b);
      for (int64_t p : ranks.value()) {
        if (Status s = check_bench_memory(bench_config(mc), static_cast<int>(p)); !s.is_ok())
          return fail(cmd, s);
      }
    }

  std::optional<ClusterSpec> cluster;
  if (!f.cluster.empty()) {
    auto spec = parse_cluster(f.cluster, f.link);
    if (!spec.is_ok()) return fail(cmd, spec.status());
    cluster = *spec;
  } else if (!f.link.empty()) {
    return fail(cmd, invalid_argument("--link " + f.link + " needs --cluster KxR"));
  }
  if (!f.topology.empty())
    if (auto t = load_topology(f.topology); !t.is_ok()) return fail(cmd, t.status());

  // Under an existing mpirun/srun the job's world is used; --ranks, if given, must match it.
  f.ranks_given = sub.count("--ranks") > 0;
  if (launch::started_by_mpi_launcher()) return run_job(cmd, f, methods.value(), bench);

  // Plain shell: every output path is checked before the first job starts.
  if (Status s = check_outputs(f); !s.is_ok()) return fail(cmd, s);
  // The CPU kernels' tuning for what each job runs (its threads per rank), measured now while
  // no rank runs; the ranks read it from the cache.
  if (f.device_kind == Device::kCpu) {
    std::vector<TuneKey> keys;
    const AttnShape s = f.shape.shape();
    for (int64_t p : ranks.value())
      keys.push_back(TuneKey{*parse_dtype(f.shape.dtype), s.head_dim, s.group(),
                             f.threads > 0 ? f.threads : default_threads(static_cast<int>(p))});
    tune_at_start(cmd, keys);
  }
  // One mpirun per rank count, results gathered here.
  std::vector<BenchResult> points;
  int worst = 0;
  std::string device_description;  // rank 0's of the first job (jobs write it with their points)
  std::string layout_text;         // the first job's KV layout, as its rank 0 chose it
  for (int64_t p : ranks.value()) {
    const std::string tmpl_path = launch::make_temp_file("points");
    if (tmpl_path.empty()) return fail(cmd, internal_error("cannot create a temporary file in /tmp"));
    const char* tmpl = tmpl_path.c_str();
    std::vector<std::string> args = inv.args;
    args.insert(args.end(), {"--ranks", std::to_string(p), "--child-json", tmpl});
    // Emulated hosts all share this machine's cores, which the per-host local rank count
    // does not show: size the kernel's threads by the whole job.
    if (cluster && f.threads == 0)
      args.insert(args.end(), {"--threads", std::to_string(default_threads(static_cast<int>(p)))});
    launch::LaunchOptions lo;
    lo.ranks = static_cast<int>(p);
    lo.who = std::string("treeattn ") + cmd;
    if (cluster) {
      auto prefix = cluster_session_prefix(*cluster, lo.ranks);
      if (!prefix.is_ok()) return fail(cmd, prefix.status());
      lo.session_prefix = std::move(prefix).value();
    }
    auto rc = launch::run_under_mpirun(lo, args);
    if (!rc.is_ok()) {
      std::remove(tmpl);
      return fail(cmd, rc.status());
    }
    if (const int code = launch::report_interrupt(lo.who, lo.ranks); code != 0) {
      std::remove(tmpl);
      return code;
    }
    BenchFile job = read_bench_file(tmpl);
    std::remove(tmpl);
    // Exit 1 means "not exact" only when the job's points say so; a rank that ended otherwise
    // (a library's exit(1)) is a failed job, named by the launcher's lines above.
    if (rc.value() != 0 && !(rc.value() == 1 && job.inexact)) {
      std::fprintf(stderr, "treeattn %s: the %lld-rank job failed (exit %d)\n", cmd,
                   static_cast<long long>(p), rc.value());
      return rc.value() == 1 ? 2 : rc.value();
    }
    worst = std::max(worst, rc.value());
    if (device_description.empty()) device_description = job.device_description;
    if (layout_text.empty()) layout_text = job.kv_layout;
    points.insert(points.end(), job.results.begin(), job.results.end());
  }
  const bool cuda = f.device_kind == Device::kCuda;
  const std::string kernel_label = cuda ? "cuda" : std::string(isa_name(best_isa()));
  if (device_description.empty()) device_description = std::string("device ") + f.device;
  if (!bench) {
    const AttnShape s = f.shape.shape();
    std::printf(
        "treeattn run: %s ranks, %s, %s KV, %s tokens (%s shards), %d warm-up + %d decode "
        "steps%s; kernel %s, KV layout %s\n",
        f.ranks.c_str(), s.to_string().c_str(), f.shape.dtype.c_str(),
        format_size(f.shape.seqs[0]).c_str(), f.shape.shard.c_str(), f.warmup, f.iters,
        f.append ? " with appends" : "", kernel_label.c_str(),
        layout_text.empty() ? f.shape.kv_layout.c_str() : layout_text.c_str());
    std::printf("%s\n", device_description.c_str());
    std::printf("every method checked against the float64 oracle (max rel err <= 1e-5) and for "
                "bit-identical results on all ranks\n\n");
  } else {
    std::printf("%s\n", device_description.c_str());
  }
  std::fputs(format_bench_table(points, f.baseline).c_str(), stdout);
  std::fflush(stdout);
  nlohmann::json meta = {{"command", cmd},
                         {"kernel_isa", kernel_label},
                         {"warmup", f.warmup},
                         {"iterations", f.iters},
                         {"append", f.append},
                         {"device", device_name(f.device_kind)},
                         {"device_description", device_description},
                         {"kv_layout", layout_text}};
  if (!f.json.empty()) if (Status s = write_bench_json(f.json, points, meta); !s.is_ok()) return fail(cmd, s);
  if (!f.csv.empty()) if (Status s = write_bench_csv(f.csv, points); !s.is_ok()) return fail(cmd, s);
  if (!f.plot.empty()) {
    if (Status s = write_bench_plot(f.plot, points, fmt::format("treeattn bench: {} {}", f.shape.shape().to_string(), f.shape.dtype)); !s.is_ok())
      return fail(cmd, s);
    std::printf("\nplot written to %s\n", f.plot.c_str());
  }
  if (worst != 0) std::printf("\nFAILED: at least one method is not exact (see the rel err column)\n");
  return worst;
}

void add_common(CLI::App* sub, DecodeFlags& f, bool bench) {
  f.shape.add_to(*sub, bench);
  sub->add_option("--ranks", f.ranks,
                  bench ? "MPI ranks (list to sweep); from a shell each count is one mpirun job"
                        : "MPI ranks; from a plain shell treeattn starts them with mpirun")
      ->capture_default_str()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  sub->add_option("--methods,--method", f.methods, "Strategies (comma-separated), auto (the planner's choice) or all: " +
                                              [] { std::string s; for (auto& m : all_methods()) s += (s.empty() ? "" : ", ") + m; return s; }())
      ->capture_default_str();
  sub->add_option("--warmup", f.warmup, "Untimed decode steps before the timed ones")->capture_default_str();
  sub->add_option(bench ? "--iters" : "--steps", f.iters, "Timed decode steps per method")->capture_default_str();
  sub->add_flag("--append,!--no-append", f.append,
                "Append the decoded token's K/V after each step (a real decode loop)")->capture_default_str();
  sub->add_option("--nodes", f.nodes, "Group the ranks into K emulated nodes (for hier)")->capture_default_str();
  sub->add_option("--fanout", f.fanout, "hier: children per node leader in the inter-node tree")->capture_default_str();
  sub->add_option("--root", f.root, "Deliver the result to this rank only (-1: every rank)")->capture_default_str();
  sub->add_option("--threads", f.threads, "Kernel threads per rank (0: cores / ranks on the host)")->capture_default_str();
  sub->add_option("--timeout-ms", f.timeout_ms,
                  "Per-operation timeout in ms (0: wait forever); a missing rank is named after it")
      ->capture_default_str();
  sub->add_option("--inject", f.inject,
                  "Debug: inject one fault to see the failure behaviour: never-arrive:RANK@STEP, "
                  "kill:RANK@STEP (SIGKILL), nan:RANK, slow:RANK:MS, mismatch:RANK (steps count "
                  "warm-up steps from 0)")
      ->group("Debug");
  sub->add_option("--device", f.device,
                  "Where each rank decodes: cpu, or cuda (one GPU per rank: GPU = local rank % "
                  "GPUs on the host, NCCL between ranks; needs a treeattn built with CUDA and "
                  "NCCL and a GPU for every rank; KV layout rows; not with bench --kernel: "
                  "tools/gpu-check.sh)")
      ->capture_default_str();
  sub->add_flag("--no-check", f.no_check, "Skip the float64 oracle check (not recommended)");
  add_no_tune_flag(*sub, f.no_tune);
  sub->add_flag("--deterministic", f.deterministic,
                "Decode with tree-det: output and LSE the same bits whatever the rank count, "
                "placement and threads (compared with tree, or with --methods)");
  sub->add_option("--baseline", f.baseline, "Method the speed-up column compares against")->capture_default_str();
  sub->add_option("--json", f.json, "Write every measured point as JSON");
  sub->add_option("--csv", f.csv, "Write every measured point as CSV");
  sub->add_option("--child-json", f.child_json, "(internal) where a launched job writes its points")
      ->group("");
  if (bench) {
    sub->add_option("--plot", f.plot, "Write a PNG: latency and bytes sent vs context (gnuplot)");
    sub->add_flag("--kernel", f.kernel,
                  "Roofline of the local kernel instead: measured read bandwidth and FMA peak, "
                  "then GB/s per shape and dtype (--dtype may be a list) and the OpenBLAS peer");
    sub->add_flag("--kernel-cases", f.kernel_cases,
                  "With --kernel: the standard cases (llama3-8b B1 256k, B16 16k, B1 Q4 64k)");
    sub->add_option("--repeats", f.repeats, "With --kernel: timed runs per case (median)")
        ->capture_default_str();
    sub->add_option("--isa", f.isa, "With --kernel: auto, reference, generic, avx2, avx512")
        ->capture_default_str();
    sub->add_flag("--no-peer", f.no_peer, "With --kernel: skip the OpenBLAS peer");
  }
  sub->add_option("--cluster", f.cluster,
                  "Run each job on an emulated cluster of K hosts x R ranks (KxR, e.g. 2x2; "
                  "tools/cluster/cluster.sh, root): up, run, always down");
  sub->add_option("--link", f.link, "With --cluster: shape each host's link (tc rate, e.g. 1gbit)");
  sub->add_option("--topology", f.topology,
                  "Topology the `auto` method is planned on: FILE or preset:NAME (default: this "
                  "machine, or the emulated cluster's preset resized to KxR)");
}

}  // namespace

Runner add_run_command(CLI::App& app, const Invocation& inv) {
  auto* sub = app.add_subcommand(
      "run", "The main job: a few decode steps of a long context on P ranks with every strategy, "
             "each checked against the float64 oracle, side by side");
  auto f = std::make_shared<DecodeFlags>();
  f->shape.preset = "llama3-8b";
  f->shape.seq = "256k";
  add_common(sub, *f, false);
  return [f, sub, &inv] { return run_command("run", *f, *sub, inv, false); };
}

Runner add_bench_command(CLI::App& app, const Invocation& inv) {
  auto* sub = app.add_subcommand(
      "bench", "Sweep context length, ranks, batch and methods: latency (min/p50/p90/p99), bytes "
               "sent per rank, peak memory, KV GB/s and exactness per point");
  auto f = std::make_shared<DecodeFlags>();
  f->shape.preset = "llama3-8b";
  f->shape.seq = "64k";
  f->ranks = "4";
  f->warmup = 3;
  f->iters = 20;
  f->append = false;
  add_common(sub, *f, true);
  return [f, sub, &inv] { return run_command("bench", *f, *sub, inv, true); };
}

}  // namespace treeattn::cli
