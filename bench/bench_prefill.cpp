// Prefill attention on the paged KV cache (paged_kv.hpp), the way the serving engine runs it:
// one sequence of N prompt tokens on 64-token pages, prefilled in chunks of C tokens (the
// engine's prefill_chunk); chunk c is one decode_partial_paged call with n_q = C queries at
// positions c*C .. c*C + C - 1 against the pages of positions 0 .. c*C + C - 1 (causal). The
// time of all chunks is one layer's prefill attention.
//
// Limits first, in the same run: the FMA peak of the ISA target with the same threads
// (measure_peak_gflops), then each kernel of the paged driver (PagedKernelChoice: the per-page
// decode item kernel and the prefill block kernel), interleaved round by round. The work counted
// is 4 * head_dim flops per (query head, visible token) (q.k and p.v, an FMA = 2 flops); the
// causal half is all there is, so a kernel that reads tiles above the diagonal gets no credit.
// Correctness outside the timed region: the kernels' states must be bit-identical (the block
// kernel's contract), and a sample of rows within 1e-5 of the float64 oracle; a wrong element
// fails the run (exit 1).
//
// Run: treeattn_prefill_bench [--tokens 4096] [--chunk 256] [--threads 0] [--dtype f16]
//        [--heads 9] [--kv-heads 3] [--dim 64] [--page 64] [--rounds 5] [--isa auto]
//        [--only page|block]   (one kernel alone, e.g. under `perf stat -e cycles:u`, whose
//                               cycle counts a loaded machine's time slicing does not inflate)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "treeattn/dtype.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/paged_kv.hpp"
#include "treeattn/roofline.hpp"
#include "treeattn/state.hpp"

namespace {

using namespace treeattn;

struct Args {
  int64_t tokens = 4096, chunk = 256, heads = 9, kv_heads = 3, dim = 64, page = 64;
  int threads = 0, rounds = 5;
  std::string dtype = "f16", isa = "auto", only;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "treeattn_prefill_bench: %s\nflags: --tokens N --chunk C --threads T --dtype "
               "f32|f16|bf16 --heads H --kv-heads K --dim D --page P --rounds R --isa NAME\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) usage(("flag " + f + " needs a value").c_str());
    const char* v = argv[++i];
    if (f == "--tokens") a.tokens = std::atoll(v);
    else if (f == "--chunk") a.chunk = std::atoll(v);
    else if (f == "--threads") a.threads = std::atoi(v);
    else if (f == "--dtype") a.dtype = v;
    else if (f == "--heads") a.heads = std::atoll(v);
    else if (f == "--kv-heads") a.kv_heads = std::atoll(v);
    else if (f == "--dim") a.dim = std::atoll(v);
    else if (f == "--page") a.page = std::atoll(v);
    else if (f == "--rounds") a.rounds = std::atoi(v);
    else if (f == "--isa") a.isa = v;
    else if (f == "--only") a.only = v;
    else usage(("unknown flag " + f).c_str());
  }
  if (a.tokens < 1 || a.chunk < 0 || a.rounds < 1) usage("tokens >= 1, chunk >= 0, rounds >= 1");
  if (a.chunk == 0) a.chunk = a.tokens;
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  const std::optional<DType> dt = parse_dtype(a.dtype);
  if (!dt) usage(("unknown dtype " + a.dtype).c_str());
  auto isa_r = parse_isa(a.isa);
  if (!isa_r.is_ok()) usage(isa_r.status().to_string().c_str());
  const Isa isa = *isa_r == Isa::kAuto ? best_isa() : *isa_r;
  const int threads = a.threads > 0 ? a.threads : omp_get_max_threads();
  const AttnShape shape{1, a.heads, a.kv_heads, a.dim, 1};
  const int64_t H = a.heads, D = a.dim, T = a.page, N = a.tokens;
  const int64_t pages = (N + T - 1) / T;

  auto pool_r = TiledKVCache::create(shape, *dt, pages * T, kKVTileLayout, T);
  if (!pool_r.is_ok()) usage(pool_r.status().to_string().c_str());
  TiledKVCache pool = std::move(pool_r).value();
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> kf(static_cast<std::size_t>(a.kv_heads * D)), vf(kf.size());
  KVCache flat(shape, *dt, N);  // the same tokens for the oracle
  for (int64_t t = 0; t < N; ++t) {
    for (auto& x : kf) x = u(rng);
    for (auto& x : vf) x = u(rng);
    pool.set_tokens(0, t, kf.data(), vf.data());
    for (int64_t h = 0; h < a.kv_heads; ++h)
      flat.set_token(0, h, t, kf.data() + h * D, vf.data() + h * D);
  }
  std::vector<float> q(static_cast<std::size_t>(N * H * D));
  for (auto& x : q) x = u(rng);
  std::vector<int32_t> page_ids(static_cast<std::size_t>(pages));
  std::vector<int64_t> page_pos(page_ids.size());
  std::vector<int32_t> page_len(page_ids.size());
  for (int64_t p = 0; p < pages; ++p) {
    page_ids[static_cast<std::size_t>(p)] = static_cast<int32_t>(p);
    page_pos[static_cast<std::size_t>(p)] = p * T;
    page_len[static_cast<std::size_t>(p)] = static_cast<int32_t>(std::min(T, N - p * T));
  }
  const std::size_t rec = static_cast<std::size_t>(D) + 2;
  const TiledKVShard view = pool.view({}, {}, {});
  DecodeOptions opt;
  opt.threads = threads;
  opt.isa = isa;

  // One layer's prefill attention into `states` ([N][H] records).
  auto prefill = [&](std::vector<float>& states) {
    states.assign(static_cast<std::size_t>(N * H) * rec, 0.0f);
    for (int64_t c0 = 0; c0 < N; c0 += a.chunk) {
      const int64_t nq = std::min(a.chunk, N - c0);
      const int64_t np = (c0 + nq + T - 1) / T;
      PagedEntry e;
      e.q = q.data() + c0 * H * D;
      e.n_q = nq;
      e.first_pos = c0;
      e.pages = {page_ids.data(), static_cast<std::size_t>(np)};
      e.page_pos = {page_pos.data(), static_cast<std::size_t>(np)};
      e.page_len = {page_len.data(), static_cast<std::size_t>(np)};
      e.states = states.data() + static_cast<std::size_t>(c0 * H) * rec;
      const Status s = decode_partial_paged(shape, view, pages, {&e, 1}, opt);
      if (!s.is_ok()) {
        std::fprintf(stderr, "decode_partial_paged: %s\n", s.to_string().c_str());
        std::exit(1);
      }
    }
  };
  double flops = 0;
  for (int64_t i = 0; i < N; ++i) flops += static_cast<double>((i + 1) * H * 4 * D);

  auto peak = measure_peak_gflops(threads, isa, 5);
  if (!peak.is_ok()) usage(peak.status().to_string().c_str());
  std::printf("prefill attention: %lld tokens in chunks of %lld, H %lld / Hkv %lld, D %lld, %s KV, "
              "pages of %lld, isa %s, %d thread(s), %.2f GFLOP (causal)\n",
              static_cast<long long>(N), static_cast<long long>(a.chunk),
              static_cast<long long>(H), static_cast<long long>(a.kv_heads),
              static_cast<long long>(D), a.dtype.c_str(), static_cast<long long>(T),
              std::string(isa_name(isa)).c_str(), threads, flops / 1e9);
  std::printf("FMA peak (same threads, same ISA, this run): %.1f GFLOP/s\n", *peak);

  struct Kernel {
    const char* name;
    PagedKernelChoice choice;
    std::vector<double> secs, frac;  // per round: seconds, fraction of that round's peak
    std::vector<float> states;
  };
  std::vector<Kernel> kernels = {{"per-page (decode item)", PagedKernelChoice::kPerPage, {}, {}, {}},
                                 {"block (prefill)", PagedKernelChoice::kBlock, {}, {}, {}}};
  if (a.only == "page" || a.only == "block") {
    kernels.erase(kernels.begin() + (a.only == "page" ? 1 : 0));
    kernels.push_back(kernels[0]);  // the checks below compare two; the same kernel twice
    a.rounds = (a.rounds + 1) / 2;
  } else if (!a.only.empty()) {
    usage(("--only takes page or block, not " + a.only).c_str());
  }
  // On a shared machine the peak moves with the load: each kernel's run is also compared with
  // the FMA peak measured right before it.
  std::vector<double> peaks;
  for (int round = 0; round < a.rounds; ++round)
    for (Kernel& k : kernels) {
      auto p = a.only.empty() ? measure_peak_gflops(threads, isa, 3) : peak;
      if (!p.is_ok()) usage(p.status().to_string().c_str());
      peaks.push_back(*p);
      set_paged_kernel_choice(k.choice);
      const auto t0 = std::chrono::steady_clock::now();
      prefill(k.states);
      k.secs.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      k.frac.push_back(flops / k.secs.back() / 1e9 / *p);
    }
  set_paged_kernel_choice(PagedKernelChoice::kAuto);

  // Correctness, outside the timed region.
  int bad = 0;
  for (std::size_t i = 1; i < kernels.size(); ++i)
    if (std::memcmp(kernels[0].states.data(), kernels[i].states.data(),
                    kernels[0].states.size() * sizeof(float)) != 0) {
      std::printf("FAIL: %s states differ from %s's bits\n", kernels[i].name, kernels[0].name);
      ++bad;
    }
  double worst = 0;
  std::vector<double> out(static_cast<std::size_t>(H * D)), lse(static_cast<std::size_t>(H));
  std::vector<float> got(static_cast<std::size_t>(H * D));
  for (int64_t i : {int64_t{0}, N / 3, N / 2 + 1, N - 1}) {
    const std::vector<int64_t> len{i + 1}, start{0}, total{i + 1};
    AttnShape s1 = shape;
    const Status s = oracle_attention(s1, q.data() + i * H * D, flat.view(0, len, start, total, 1),
                                      out.data(), lse.data());
    if (!s.is_ok()) {
      std::printf("oracle: %s\n", s.to_string().c_str());
      return 1;
    }
    double ref_max = 1.0;
    for (double x : out) ref_max = std::max(ref_max, std::fabs(x));
    for (int64_t h = 0; h < H; ++h) {
      const float* st = kernels[1].states.data() + static_cast<std::size_t>(i * H + h) * rec;
      state_normalize(st, static_cast<std::size_t>(D), got.data() + h * D, static_cast<float*>(nullptr));
    }
    for (std::size_t j = 0; j < got.size(); ++j)
      worst = std::max(worst, std::fabs(got[j] - out[j]) / ref_max);
  }
  if (!(worst <= 1e-5)) {
    std::printf("FAIL: max relative error vs the float64 oracle %.3g > 1e-5\n", worst);
    ++bad;
  }

  std::printf("FMA peak before each run: median %.1f GFLOP/s, min %.1f, max %.1f\n", median(peaks),
              *std::min_element(peaks.begin(), peaks.end()),
              *std::max_element(peaks.begin(), peaks.end()));
  std::printf("%-24s %10s %10s %10s %9s %12s\n", "kernel", "median ms", "best ms", "GFLOP/s",
              "of peak", "of run peak");
  for (const Kernel& k : kernels) {
    const double m = median(k.secs), b = *std::min_element(k.secs.begin(), k.secs.end());
    std::printf("%-24s %10.2f %10.2f %10.1f %9.3f %12.3f\n", k.name, m * 1e3, b * 1e3,
                flops / m / 1e9, flops / m / 1e9 / *peak, median(k.frac));
  }
  std::printf("(of peak: median time against the first peak; of run peak: median over rounds of "
              "the run against the peak measured just before it)\n");
  std::vector<double> ratio;
  for (int r = 0; r < a.rounds; ++r) ratio.push_back(kernels[0].secs[static_cast<std::size_t>(r)] /
                                                     kernels[1].secs[static_cast<std::size_t>(r)]);
  std::printf("block speedup over per-page: %.2fx (median of per-round ratios); oracle max rel "
              "error %.2g; bits %s\n",
              median(ratio), worst, bad == 0 ? "identical" : "DIFFER");
  return bad == 0 ? 0 : 1;
}
