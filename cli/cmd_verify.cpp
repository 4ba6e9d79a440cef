// `treeattn verify`: exactness of every strategy over random cases (shapes, GQA, head dims,
// ragged batches, multi-token queries, dtypes, shard placements incl. empty shards), a short
// decode loop with appends each, against the float64 oracle; bit-identical results across
// ranks. Exits non-zero on any violation and prints the command that reruns the failing case.
// --save DIR writes each case's inputs and merged output as .npy files with a JSON index.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "device.hpp"
#include "options.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/job_status.hpp"
#include "treeattn/launch.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/verify.hpp"
#include "treeattn/workload.hpp"

namespace treeattn::cli {
namespace {

constexpr int kMaxCases = 100000;

struct VerifyFlags {
  int ranks = 4;
  int cases = 12;
  uint64_t seed = 1;
  std::string methods = "all";
  std::string save;
  int timeout_ms = 60000;
  double tolerance = 1e-5;
  std::string dtypes = "f32,f16,bf16";  // the KV types cases draw from
  bool deterministic = false;           // tree-det (plus --methods); contiguous placements only
  std::string json;                     // one record per check, with output_sha256
  std::string kv_layout = "auto";       // auto: cases alternate rows and tiled
  std::string device = "cpu";           // --device
  Device device_kind = Device::kCpu;
};

// --save DIR (created now) and --json FILE, before any case runs.
Status check_outputs(const VerifyFlags& f) {
  if (!f.save.empty()) TREEATTN_RETURN_IF_ERROR(prepare_output_dir("--save", f.save));
  if (!f.json.empty()) TREEATTN_RETURN_IF_ERROR(check_output_file("--json", f.json));
  return Status::ok();
}

int verify_job(VerifyFlags& f, const std::vector<std::string>& methods,
               const std::vector<DType>& types) {
  auto world_r = mpi_init_world(nullptr, nullptr);
  if (!world_r.is_ok()) {
    std::fprintf(stderr, "treeattn verify: error: %s\n", world_r.status().to_string().c_str());
    return 2;
  }
  std::unique_ptr<Communicator> world = std::move(world_r).value();
  const int P = world->size();
  const bool lead = world->rank() == 0;
  {
    // A job started by an outside mpirun has not had its outputs checked: rank 0 does it.
    const Status s = lead ? check_outputs(f) : Status::ok();
    float bad = s.is_ok() ? 0.0f : 1.0f;
    const Status agreed = world->allreduce(&bad, 1, ReduceOp::kMax);
    if (!agreed.is_ok() || bad != 0.0f) {
      if (!s.is_ok()) std::fprintf(stderr, "treeattn verify: error: %s\n", s.to_string().c_str());
      world.reset();
      (void)mpi_finalize();
      return 2;
    }
  }
  // --device cuda: this rank's GPU and the NCCL communicator, or every rank stops with the
  // first failing rank's message. The NCCL set-up honours world's timeout and the communicator
  // starts with it: --timeout-ms, as for decode (0: NCCL's finite default, comm_nccl.hpp).
  world->set_timeout(std::chrono::milliseconds(f.timeout_ms));
  auto dev_r = open_device(*world, f.device_kind);
  if (!dev_r.is_ok()) {
    if (lead) std::fprintf(stderr, "treeattn verify: error: %s\n", dev_r.status().message().c_str());
    world.reset();
    (void)mpi_finalize();
    return 2;
  }
  RankDevice dev = std::move(dev_r).value();
  if (lead && f.device_kind == Device::kCuda) std::printf("%s\n", dev.description.c_str());
  if (lead)
    std::printf("treeattn verify: %d random cases x %zu methods on %d ranks, tolerance %.0e "
                "relative to max(1, max|ref|), float64 oracle; /tiled: the check read the tiled KV "
                "layout\n\n%-6s %-58s %-16s %10s %s\n",
                f.cases, methods.size(), P, f.tolerance, "seed", "case", "method", "rel err", "");
  int failures = 0;
  std::vector<std::string> saved;
  nlohmann::json records = nlohmann::json::array();
  verify::CheckOptions o;
  o.tolerance = f.tolerance;
  o.layout = *parse_kv_layout(f.kv_layout);
  o.executor = dev.executor.get();
  o.device_comm = dev.comm.get();
  o.timeout = std::chrono::milliseconds(f.timeout_ms);
  for (int i = 0; i < f.cases; ++i) {
    const verify::Case c = verify::make_case(f.seed + static_cast<uint64_t>(i), P, types, f.deterministic);
    for (const auto& m : methods) {
      launch::rank_status_phase(fmt::format("verify: case seed {} method {}", c.seed, m));
      o.save_dir = m == methods.front() ? f.save : std::string();
      const verify::Check chk = verify::check_case(*world, c, m, o);
      if (chk.must_abort)
        launch::abort_job(3, fmt::format("treeattn verify: rank {}: case seed {} method {}: {}",
                                         world->rank(), c.seed, m, chk.why));
      if (!chk.saved.empty()) saved.push_back(chk.saved);
      if (lead) {
        records.push_back({{"seed", c.seed}, {"case", c.describe()}, {"method", m}, {"ranks", P},
                           {"kv_layout", std::string(kv_layout_name(chk.layout))},
                           {"max_rel_err", chk.rel_error}, {"ok", chk.ok},
                           {"output_sha256", chk.output_sha256}});
        const std::string label = m + (chk.layout == KVLayout::kTiled ? "/tiled" : "");
        std::printf("%-6llu %-58s %-16s %10.2e %s\n", static_cast<unsigned long long>(c.seed),
                    c.describe().c_str(), label.c_str(), chk.rel_error, chk.ok ? "ok" : "FAIL");
        if (!chk.ok)
          std::printf("       %s\n       rerun: treeattn verify --ranks %d --seed %llu --cases 1 --methods %s\n",
                      chk.why.c_str(), P, static_cast<unsigned long long>(c.seed), m.c_str());
        std::fflush(stdout);
      }
      if (!chk.ok) ++failures;
    }
  }
  if (lead) {
    if (!f.save.empty()) {
      (void)verify::write_index(f.save, P, saved);
      std::printf("\nsaved %zu cases to %s (index.json + .npy files)\n", saved.size(), f.save.c_str());
    }
    if (!f.json.empty()) {
      std::ofstream out(f.json);
      out << nlohmann::json{{"ranks", P}, {"checks", records}}.dump(2) << "\n";
      if (!out) std::fprintf(stderr, "treeattn verify: cannot write %s\n", f.json.c_str());
    }
    std::printf("\n%s: %d of %zu checks failed\n", failures ? "FAILED" : "PASSED", failures,
                static_cast<std::size_t>(f.cases) * methods.size());
  }
  dev = RankDevice();  // NCCL, then the executor, before the world they use
  world.reset();
  (void)mpi_finalize();
  return failures ? 1 : 0;
}

}  // namespace

Runner add_verify_command(CLI::App& app, const Invocation& inv) {
  auto* sub = app.add_subcommand("verify", "Exactness of every strategy over random shapes, "
                                           "shards and dtypes against the float64 oracle");
  auto f = std::make_shared<VerifyFlags>();
  sub->add_option("--ranks", f->ranks, "MPI ranks (from a plain shell treeattn starts them)")
      ->capture_default_str()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  sub->add_option("--cases", f->cases, "Random cases; case i uses seed + i")->capture_default_str();
  sub->add_option("--seed", f->seed, "Seed of the first case")->capture_default_str();
  sub->add_option("--methods", f->methods, "Strategies (comma-separated) or all")->capture_default_str();
  sub->add_option("--save", f->save, "Write each case's q, k, v, output and LSE as .npy + index.json");
  sub->add_option("--tolerance", f->tolerance, "Max error relative to max(1, max|ref|)")->capture_default_str();
  sub->add_option("--timeout-ms", f->timeout_ms, "Per-operation timeout in ms (0: wait forever)")
      ->capture_default_str();
  sub->add_option("--dtype", f->dtypes,
                  "KV types the cases draw from (comma-separated: f32, f16, bf16, fp8, int8; "
                  "quantized types are checked against the oracle on the dequantized cache)")
      ->capture_default_str();
  sub->add_flag("--deterministic", f->deterministic,
                "Check tree-det (the same bits for any rank count) alone, or with --methods; "
                "cases use contiguous placements only");
  sub->add_option("--json", f->json, "Write one record per check (error, ok, output_sha256)");
  sub->add_option("--kv-layout", f->kv_layout,
                  "KV layout of the checks: auto (odd seeds tiled, even seeds rows), rows or tiled")
      ->capture_default_str();
  sub->add_option("--device", f->device,
                  "Where each rank runs the checks: cpu, or cuda (one GPU per rank, NCCL between "
                  "ranks, KV layout rows; needs a treeattn built with CUDA and NCCL)")
      ->capture_default_str();
  return [f, &inv, sub] {
    auto device = parse_device(f->device);
    Status dev_ok = device.is_ok() ? check_device_built(*device) : device.status();
    if (!dev_ok.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", dev_ok.to_string().c_str());
      return 2;
    }
    f->device_kind = *device;
    if (f->device_kind == Device::kCuda && f->kv_layout == "tiled") {
      std::fprintf(stderr, "treeattn verify: error: --kv-layout tiled is the CPU kernel's layout "
                   "in host memory; with --device cuda the shards are rows (use --kv-layout "
                   "auto or rows)\n");
      return 2;
    }
    if (split_list(f->methods).empty()) {
      std::fprintf(stderr, "treeattn verify: error: --methods '%s': no method given (name "
                   "strategies, comma-separated, or all)\n", f->methods.c_str());
      return 2;
    }
    auto resolved = resolve_methods(f->methods, f->device_kind);
    if (resolved.is_ok() && std::find(resolved->begin(), resolved->end(), "auto") != resolved->end())
      resolved = invalid_argument("--methods: verify checks strategies; auto is the planner's "
                                  "choice among them, not one");
    if (!resolved.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", resolved.status().to_string().c_str());
      return 2;
    }
    std::vector<std::string> methods = std::move(resolved).value();
    // Once the flags are known good: a machine without a GPU for --device cuda.
    if (Status s = check_device_here(f->device_kind); !s.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", s.to_string().c_str());
      return 2;
    }
    if (f->deterministic) {
      std::vector<std::string> m = {std::string(deterministic_strategy())};
      if (sub->count("--methods") > 0)
        for (const auto& x : methods)
          if (std::find(m.begin(), m.end(), x) == m.end()) m.push_back(x);
      methods = m;
    }
    if (f->ranks < 1) {
      std::fprintf(stderr, "treeattn verify: error: --ranks must be >= 1\n");
      return 2;
    }
    // Each case takes a fraction of a second to seconds; the cap keeps a typo from running
    // until killed (and --seed + i from wrapping).
    if (Status s = check_range("--cases", f->cases, 1, kMaxCases); !s.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", s.to_string().c_str());
      return 2;
    }
    if (!std::isfinite(f->tolerance) || f->tolerance < 0) {
      std::fprintf(stderr, "treeattn verify: error: --tolerance %g: must be a finite number >= 0 "
                   "(relative to max(1, max|ref|); default 1e-5)\n", f->tolerance);
      return 2;
    }
    if (Status s = check_timeout_ms("--timeout-ms", f->timeout_ms); !s.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", s.to_string().c_str());
      return 2;
    }
    std::vector<DType> types;
    for (const auto& name : split_list(f->dtypes)) {
      const auto t = parse_dtype(name);
      if (!t) {
        std::fprintf(stderr,
                     "treeattn verify: error: --dtype: unknown type '%s' (known: f32, f16, bf16, "
                     "fp8, int8)\n",
                     name.c_str());
        return 2;
      }
      types.push_back(*t);
    }
    if (types.empty()) {
      std::fprintf(stderr, "treeattn verify: error: --dtype: no type given\n");
      return 2;
    }
    if (auto l = parse_kv_layout(f->kv_layout); !l.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: --kv-layout: %s\n", l.status().message().c_str());
      return 2;
    }
    if (launch::started_by_mpi_launcher()) return verify_job(*f, methods, types);
    // Outputs before the run, not after it (the job's rank 0 checks again, harmlessly).
    if (Status s = check_outputs(*f); !s.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", s.to_string().c_str());
      return 2;
    }
    launch::LaunchOptions lo;
    lo.ranks = f->ranks;
    lo.who = "treeattn verify";
    auto rc = launch::run_under_mpirun(lo, inv.args);
    if (!rc.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", rc.status().to_string().c_str());
      return 2;
    }
    if (const int code = launch::report_interrupt("treeattn verify"); code != 0) return code;
    return rc.value();
  };
}

}  // namespace treeattn::cli
