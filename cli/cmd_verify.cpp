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
#include <random>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "device.hpp"
#include "job_status.hpp"
#include "launcher.hpp"
#include "options.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/strategy.hpp"
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

// The KV layout of one check: the flag's, or with auto the tiled layout on odd seeds and rows
// on even ones, so that both are checked (every strategy reads both).
KVLayout check_layout(const std::string& flag, uint64_t seed, Device device) {
  if (device == Device::kCuda) return KVLayout::kRows;  // device shards are rows
  if (flag != "auto") return *parse_kv_layout(flag);
  return seed % 2 == 1 ? KVLayout::kTiled : KVLayout::kRows;
}

// --save DIR (created now) and --json FILE, before any case runs.
Status check_outputs(const VerifyFlags& f) {
  if (!f.save.empty()) TREEATTN_RETURN_IF_ERROR(prepare_output_dir("--save", f.save));
  if (!f.json.empty()) TREEATTN_RETURN_IF_ERROR(check_output_file("--json", f.json));
  return Status::ok();
}

struct Case {
  uint64_t seed;
  RunConfig config;
  std::string describe() const {
    std::string lens;
    for (int64_t n : config.total_len) lens += (lens.empty() ? "" : "/") + std::to_string(n);
    return fmt::format("{} N={} {} {}", config.shape.to_string(), lens,
                       dtype_name(config.dtype), shard_kind_name(config.shard));
  }
};

// Everything about case `seed` follows from the seed, so `--seed S --cases 1` reruns it.
Case make_case(uint64_t seed, int ranks, const std::vector<DType>& types, bool contiguous) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 17);
  auto pick = [&](auto const& options) { return options[rng() % options.size()]; };
  const std::vector<std::pair<int64_t, int64_t>> heads = {{1, 1}, {4, 1}, {4, 4}, {8, 2}, {32, 8}, {32, 4}};
  const std::vector<int64_t> dims = {64, 80, 96, 128, 192, 256};
  const std::vector<int64_t> qlens = {1, 1, 2, 4};
  const std::vector<std::string> shards =
      contiguous ? std::vector<std::string>{"even", "uneven", "empty", "explicit"}
                 : std::vector<std::string>{"even", "uneven", "striped", "empty", "explicit"};
  Case c;
  c.seed = seed;
  RunConfig& r = c.config;
  const auto hc = pick(heads);
  r.shape = AttnShape{1 + static_cast<int64_t>(rng() % 3), hc.first, hc.second, pick(dims), pick(qlens)};
  r.dtype = pick(types);
  for (int64_t b = 0; b < r.shape.batch; ++b) {
    const int64_t kind = static_cast<int64_t>(rng() % 4);
    r.total_len.push_back(kind == 0 ? static_cast<int64_t>(rng() % 4) : static_cast<int64_t>(rng() % 3000));
  }
  const std::string shard = pick(shards);
  if ((shard == "empty" || shard == "explicit") && ranks > 1) {
    // Per-rank lengths: random cuts, with rank 0 (empty) or random ranks holding nothing.
    r.shard = ShardKind::kExplicit;
    for (int64_t b = 0; b < r.shape.batch; ++b) {
      std::vector<int64_t> cut(static_cast<std::size_t>(ranks), 0);
      int64_t left = r.total_len[static_cast<std::size_t>(b)];
      for (int q = 0; q < ranks; ++q) {
        const bool empty = (shard == "empty" && q == 0) || (shard == "explicit" && rng() % 3 == 0);
        const int64_t take = q == ranks - 1 ? left
                             : empty       ? 0
                                           : static_cast<int64_t>(rng() % static_cast<uint64_t>(left + 1));
        cut[static_cast<std::size_t>(q)] = take;
        left -= take;
      }
      r.explicit_len.insert(r.explicit_len.end(), cut.begin(), cut.end());
    }
    // explicit_len is [rank][batch]; we built [batch][rank]: transpose.
    std::vector<int64_t> t(r.explicit_len.size());
    for (int64_t b = 0; b < r.shape.batch; ++b)
      for (int q = 0; q < ranks; ++q)
        t[static_cast<std::size_t>(q) * static_cast<std::size_t>(r.shape.batch) + static_cast<std::size_t>(b)] =
            r.explicit_len[static_cast<std::size_t>(b) * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(q)];
    r.explicit_len = t;
  } else {
    r.shard = (shard == "empty" || shard == "explicit") ? ShardKind::kEven : parse_shard_kind(shard).value();
  }
  r.seed = seed;
  r.warmup = 1;
  r.steps = 2;
  r.append = true;
  r.spare_tokens = 4;
  r.options.kernel.threads = 1;
  return c;
}

template <class T>
void write_npy(const std::filesystem::path& path, const char* descr, const std::vector<int64_t>& shape,
               const T* data, std::size_t n) {
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ",";
  if (shape.size() > 1) dims.pop_back();
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, dims);
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  f.write(reinterpret_cast<const char*>(&len), 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n * sizeof(T)));
}

// Writes the case's query, keys, values (widened to float32 exactly) and merged output/LSE.
nlohmann::json save_case(const std::filesystem::path& dir, const Case& c, const StateBuffer& st,
                         const std::string& method) {
  const RunConfig& r = c.config;
  const int64_t step = r.warmup + r.steps - 1;
  WorkloadSpec w{r.shape, r.dtype, r.seed, r.q_scale};
  std::vector<int64_t> lens = r.total_len;
  for (auto& n : lens) n += step;  // one append per earlier step
  const int64_t nmax = *std::max_element(lens.begin(), lens.end());
  const KVCache cache = make_full_cache(w, lens);
  const auto B = r.shape.batch, H = r.shape.heads, Hkv = r.shape.kv_heads, D = r.shape.head_dim, Q = r.shape.q_len;
  std::vector<float> q(static_cast<std::size_t>(B * Q * H * D));
  make_query(w, step, q.data());
  std::vector<float> k(static_cast<std::size_t>(B * Hkv * std::max<int64_t>(nmax, 0) * D), 0.0f), v(k.size(), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t = 0; t < lens[static_cast<std::size_t>(b)]; ++t)
        for (int64_t d = 0; d < D; ++d) {
          const std::size_t src = cache.index(b, h, t) + static_cast<std::size_t>(d);
          const std::size_t dst = static_cast<std::size_t>(((b * Hkv + h) * nmax + t) * D + d);
          if (dtype_is_quantized(r.dtype)) {  // codes times the token's scale, as the kernels read them
            const std::size_t si = cache.scale_index(b, h, t);
            k[dst] = dequantize(cache.k_data(), r.dtype, src, cache.k_scale_data()[si]);
            v[dst] = dequantize(cache.v_data(), r.dtype, src, cache.v_scale_data()[si]);
          } else {
            k[dst] = load_as_float(cache.k_data(), r.dtype, src);
            v[dst] = load_as_float(cache.v_data(), r.dtype, src);
          }
        }
  std::vector<float> out(static_cast<std::size_t>(B * Q * H * D)), lse(static_cast<std::size_t>(B * Q * H));
  for (std::size_t i = 0; i < st.records(); ++i)
    state_normalize(st.record(i), static_cast<std::size_t>(D), out.data() + i * static_cast<std::size_t>(D), lse.data() + i);
  const std::string stem = fmt::format("case-{}", c.seed);
  std::filesystem::create_directories(dir);
  write_npy(dir / (stem + "-q.npy"), "<f4", {B, Q, H, D}, q.data(), q.size());
  write_npy(dir / (stem + "-k.npy"), "<f4", {B, Hkv, nmax, D}, k.data(), k.size());
  write_npy(dir / (stem + "-v.npy"), "<f4", {B, Hkv, nmax, D}, v.data(), v.size());
  write_npy(dir / (stem + "-out.npy"), "<f4", {B, Q, H, D}, out.data(), out.size());
  write_npy(dir / (stem + "-lse.npy"), "<f4", {B, Q, H}, lse.data(), lse.size());
  return {{"seed", c.seed}, {"method", method}, {"batch", B}, {"heads", H}, {"kv_heads", Hkv},
          {"head_dim", D}, {"q_len", Q}, {"kv_lengths", lens}, {"dtype", dtype_name(r.dtype)},
          {"scale", 1.0 / std::sqrt(static_cast<double>(D))},
          {"causal", "query i of q_len sees keys at positions <= kv_length - q_len + i"},
          {"files", {{"q", stem + "-q.npy"}, {"k", stem + "-k.npy"}, {"v", stem + "-v.npy"},
                     {"out", stem + "-out.npy"}, {"lse", stem + "-lse.npy"}}},
          {"note", "k and v are the cache values widened exactly to float32 (quantized: code times "
                   "the token's scale; padding rows are 0); "
                   "lse is natural-log"}};
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
  nlohmann::json saved = nlohmann::json::array();
  nlohmann::json records = nlohmann::json::array();
  for (int i = 0; i < f.cases; ++i) {
    Case c = make_case(f.seed + static_cast<uint64_t>(i), P, types, f.deterministic);
    c.config.timeout = std::chrono::milliseconds(f.timeout_ms);
    for (const auto& m : methods) {
      rank_status_phase(fmt::format("verify: case seed {} method {}", c.seed, m));
      RunConfig rc = c.config;
      rc.strategy = m;
      rc.kv_layout = check_layout(f.kv_layout, c.seed, f.device_kind);
      rc.executor = dev.executor.get();  // null on the CPU: the CPU executor
      rc.device_comm = dev.comm.get();
      const std::string label = m + (rc.kv_layout == KVLayout::kTiled ? "/tiled" : "");
      auto rep = run_decode(*world, rc);
      double err = 0;
      std::string hash;
      bool ok = rep.is_ok();
      std::string why = ok ? "" : rep.status().to_string();
      if (ok) {
        const StateBuffer& st = rep.value().states.back();
        if (lead) {
          auto chk = check_against_oracle(rc, rc.warmup + rc.steps - 1, st, f.tolerance);
          if (!chk.is_ok()) { ok = false; why = chk.status().to_string(); }
          else {
            err = chk.value().rel_error();
            ok = chk.value().passed;
            if (!ok) why = chk.value().detail;
          }
          hash = output_sha256(st);
          if (!f.save.empty() && m == methods.front()) {
            try {
              saved.push_back(save_case(f.save, c, st, m));
            } catch (const std::exception& e) {  // the disk filled up, the directory went away
              ok = false;
              why = "cannot save the case to " + f.save + ": " + e.what();
            }
          }
        }
        Status same = check_identical_across_ranks(*world, st);
        if (!same.is_ok()) { ok = false; why = same.to_string(); }
        double flag[2] = {ok ? 0.0 : 1.0, err};
        (void)world->broadcast(flag, sizeof(flag), 0);
        ok = flag[0] == 0.0;
        err = flag[1];
      } else if (rep.status().code() == Code::kTimeout || rep.status().code() == Code::kInternal) {
        abort_job(3, fmt::format("treeattn verify: rank {}: case seed {} method {}: {}",
                                 world->rank(), c.seed, m, why));
      }
      if (lead)
        records.push_back({{"seed", c.seed}, {"case", c.describe()}, {"method", m}, {"ranks", P},
                           {"kv_layout", std::string(kv_layout_name(rc.kv_layout))},
                           {"max_rel_err", err}, {"ok", ok}, {"output_sha256", hash}});
      if (lead) {
        std::printf("%-6llu %-58s %-16s %10.2e %s\n", static_cast<unsigned long long>(c.seed),
                    c.describe().c_str(), label.c_str(), err, ok ? "ok" : "FAIL");
        if (!ok)
          std::printf("       %s\n       rerun: treeattn verify --ranks %d --seed %llu --cases 1 --methods %s\n",
                      why.c_str(), P, static_cast<unsigned long long>(c.seed), m.c_str());
        std::fflush(stdout);
      }
      if (!ok) ++failures;
    }
  }
  if (lead) {
    if (!f.save.empty()) {
      std::ofstream idx(std::filesystem::path(f.save) / "index.json");
      idx << nlohmann::json{{"ranks", P}, {"cases", saved}}.dump(2) << "\n";
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
    if (started_by_mpi_launcher()) return verify_job(*f, methods, types);
    // Outputs before the run, not after it (the job's rank 0 checks again, harmlessly).
    if (Status s = check_outputs(*f); !s.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", s.to_string().c_str());
      return 2;
    }
    LaunchOptions lo;
    lo.ranks = f->ranks;
    lo.who = "treeattn verify";
    auto rc = run_under_mpirun(lo, inv.args);
    if (!rc.is_ok()) {
      std::fprintf(stderr, "treeattn verify: error: %s\n", rc.status().to_string().c_str());
      return 2;
    }
    if (const int sig = interrupted_by(); sig != 0) {
      std::fprintf(stderr, "treeattn verify: interrupted by signal %d (%s); the job was stopped\n",
                   sig, strsignal(sig));
      return 128 + sig;
    }
    return rc.value();
  };
}

}  // namespace treeattn::cli
