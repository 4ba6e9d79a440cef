// Every strategy against the float64 oracle under real mpirun, at whatever rank count the job
// has (ctest runs it at 1, 2, 3, 4, 5, 7 and 8 ranks).
//
// Cases cover even, uneven, striped and explicit shards with empty ranks, odd and ragged
// lengths, GQA, batch > 1, q_len > 1, the five KV dtypes (fp8 and int8 with their scales),
// root-only delivery, `hier` with an explicit node grouping and by shared memory, and a
// multi-step decode with appends compared with decoding the whole sequence on one rank.
//
// Tolerance (documented rule): max |out - ref| <= 1e-5 * max(1, max |ref|), for every dtype.
// The oracle widens the very same f16/bf16 cache values exactly to double, so the only error
// left is our float32 accumulation (logits, exp, sums, merges), which is the same for every KV
// dtype; no dtype-specific slack is needed. All-rank strategies must also give byte-identical
// states on every rank (all-gather + memcmp).
//
// Exit status 0 when every case passes on every rank; failures are printed by the rank that
// saw them.
#include <cstdio>
#include <string>
#include <vector>

#include "treeattn/comm_mpi.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/workload.hpp"

using namespace treeattn;

namespace {

constexpr double kRelTol = 1e-5;

struct Case {
  std::string name;
  RunConfig config;
};

std::vector<int64_t> alternating_empty(int p, int64_t n) {
  // Odd ranks hold the tokens (rank 0 holds all when p == 1); even ranks hold none.
  std::vector<int64_t> lens(static_cast<std::size_t>(p), 0);
  if (p == 1) {
    lens[0] = n;
    return lens;
  }
  const int holders = p / 2;
  int64_t left = n;
  for (int r = 1, i = 0; r < p; r += 2, ++i) {
    const int64_t take = i + 1 == holders ? left : n / holders;
    lens[static_cast<std::size_t>(r)] = take;
    left -= take;
  }
  return lens;
}

std::vector<Case> make_cases(int p) {
  std::vector<Case> cases;
  auto add = [&](std::string name, AttnShape shape, DType dtype, std::vector<int64_t> n,
                 ShardKind kind, float q_scale) {
    Case c;
    c.name = std::move(name);
    c.config.shape = shape;
    c.config.dtype = dtype;
    c.config.total_len = std::move(n);
    c.config.shard = kind;
    c.config.q_scale = q_scale;
    c.config.seed = 7 + cases.size();
    c.config.timeout = std::chrono::milliseconds(20000);
    c.config.options.kernel.threads = 1;
    cases.push_back(std::move(c));
    return &cases.back().config;
  };
  add("f32 gqa even", {1, 4, 2, 64, 1}, DType::kF32, {97}, ShardKind::kEven, 2.0f);
  {
    // timeout 0: the backend's blocking MPI calls (Open MPI's tuned algorithms) instead of the
    // polled non-blocking ones; results must match the oracle and be identical across ranks too.
    RunConfig* c = add("f32 blocking-mpi uneven", {2, 4, 2, 128, 1}, DType::kF32, {61, 30},
                       ShardKind::kUneven, 2.0f);
    c->timeout = std::chrono::milliseconds(0);
  }
  add("f16 ragged-batch uneven", {2, 4, 4, 128, 1}, DType::kF16, {53, 17}, ShardKind::kUneven,
      3.0f);
  add("bf16 q3 striped", {1, 8, 2, 64, 3}, DType::kBF16, {113}, ShardKind::kStriped, 3.0f);
  {
    RunConfig* c = add("f32 b3 q2 explicit-empty", {3, 2, 1, 80, 2}, DType::kF32, {31},
                       ShardKind::kExplicit, 4.0f);
    c->explicit_len = alternating_empty(p, 31);
  }
  add("bf16 sharp logits even", {1, 2, 2, 64, 1}, DType::kBF16, {7}, ShardKind::kEven, 40.0f);
  {
    RunConfig* c = add("f32 appends striped q2", {2, 4, 2, 64, 2}, DType::kF32, {40, 23},
                       ShardKind::kStriped, 2.0f);
    c->steps = 3;
    c->append = true;
    c->check_every_step = true;  // the per-step agreement check must pass when ranks agree
  }
  {
    RunConfig* c =
        add("f16 appends even", {1, 4, 1, 96, 1}, DType::kF16, {29}, ShardKind::kEven, 2.0f);
    c->steps = 3;
    c->append = true;
  }
  {
    RunConfig* c =
        add("f32 root-only", {1, 4, 2, 64, 1}, DType::kF32, {50}, ShardKind::kEven, 2.0f);
    c->options.root = p - 1;
  }
  // Quantized KV (a float32 scale per token and KV head): the oracle reads the same codes and
  // scales (the dequantized cache); ring-kv carries the scales with the shards.
  {
    RunConfig* c = add("fp8 appends striped", {2, 4, 2, 64, 1}, DType::kFP8, {57, 21},
                       ShardKind::kStriped, 2.0f);
    c->steps = 2;
    c->append = true;
  }
  add("int8 q2 uneven", {1, 8, 2, 128, 2}, DType::kInt8, {90}, ShardKind::kUneven, 2.0f);
  return cases;
}

}  // namespace

int main(int argc, char** argv) {
  auto world = mpi_init_world(&argc, &argv);
  if (!world.is_ok()) {
    std::fprintf(stderr, "%s\n", world.status().to_string().c_str());
    return 2;
  }
  Communicator& comm = **world;
  const int p = comm.size(), me = comm.rank();
  const StrategyRegistry& registry = StrategyRegistry::for_backend(comm.capabilities());

  int failures = 0, runs = 0;
  auto fail = [&](const std::string& what) {
    ++failures;
    std::printf("FAIL rank %d p=%d %s\n", me, p, what.c_str());
    std::fflush(stdout);
  };

  for (const Case& base : make_cases(p)) {
    for (const StrategyInfo& info : registry.list()) {
      std::vector<RunConfig> variants;
      RunConfig c = base.config;
      c.strategy = std::string(info.name);
      variants.push_back(c);
      if (info.name == "hier") {  // also: an explicit grouping of two ranks per "node", fan-out 3
        RunConfig h = c;
        for (int r = 0; r < p; ++r) h.options.node_of_rank.push_back(r / 2);
        h.options.fanout = 3;
        variants.push_back(h);
      }
      for (const RunConfig& cfg : variants) {
        const std::string label = base.name + " [" + cfg.strategy +
                                  (cfg.options.node_of_rank.empty() ? "" : " nodes-of-2") + "]";
        ++runs;
        auto report = run_decode(comm, cfg);
        if (!report.is_ok()) {
          fail(label + ": " + report.status().to_string());
          continue;
        }
        for (std::size_t i = 0; i < report->states.size(); ++i) {
          const int64_t step = report->steps[i].step;
          if (report->has_result) {
            auto chk = check_against_oracle(cfg, step, report->states[i], kRelTol);
            if (!chk.is_ok())
              fail(label + ": " + chk.status().to_string());
            else if (!chk->passed)
              fail(label + " step " + std::to_string(step) + ": " + chk->detail);
          }
          if (cfg.options.root < 0) {
            Status same = check_identical_across_ranks(comm, report->states[i]);
            if (!same.is_ok()) fail(label + ": " + same.to_string());
          }
        }
        // Multi-step decode with appends equals decoding the whole sequence on one rank.
        if (cfg.append && report->has_result) {
          for (std::size_t i = 0; i < report->states.size(); ++i) {
            const int64_t step = report->steps[i].step;
            std::vector<int64_t> lens = cfg.total_len;
            for (int64_t& n : lens) n += step;
            WorkloadSpec spec{cfg.shape, cfg.dtype, cfg.seed, cfg.q_scale};
            KVCache full = make_full_cache(spec, lens);
            std::vector<int64_t> zeros(lens.size(), 0);
            std::vector<float> q(static_cast<std::size_t>(cfg.shape.batch * cfg.shape.q_len *
                                                          cfg.shape.heads * cfg.shape.head_dim));
            make_query(spec, step, q.data());
            StateBuffer one(static_cast<std::size_t>(cfg.shape.batch),
                            static_cast<std::size_t>(cfg.shape.q_len),
                            static_cast<std::size_t>(cfg.shape.heads),
                            static_cast<std::size_t>(cfg.shape.head_dim));
            Status s = decode_partial(cfg.shape, q.data(), full.view(0, lens, zeros, lens, 1),
                                      one.data(), cfg.options.kernel);
            if (!s.is_ok()) {
              fail(label + ": single-rank decode: " + s.to_string());
              continue;
            }
            const std::size_t D = one.head_dim();
            std::vector<float> a(D), b(D);
            double worst = 0, scale = 1;
            for (std::size_t r = 0; r < one.records(); ++r) {
              state_normalize(one.record(r), D, a.data(), static_cast<float*>(nullptr));
              state_normalize(report->states[i].record(r), D, b.data(),
                              static_cast<float*>(nullptr));
              for (std::size_t d = 0; d < D; ++d) {
                worst = std::max(worst, static_cast<double>(std::fabs(a[d] - b[d])));
                scale = std::max(scale, static_cast<double>(std::fabs(a[d])));
              }
            }
            if (!(worst <= kRelTol * scale))
              fail(label + " step " + std::to_string(step) + ": differs from one-rank decode of " +
                   "the whole sequence by " + std::to_string(worst));
          }
        }
      }
    }
  }

  float any = failures > 0 ? 1.0f : 0.0f;
  Status s = comm.allreduce(&any, 1, ReduceOp::kMax);
  if (me == 0)
    std::printf("%s: %d runs on %d ranks, %s\n", any > 0 ? "FAILED" : "PASSED", runs, p,
                any > 0 ? "see FAIL lines" : "all strategies match the oracle");
  world->reset();
  (void)mpi_finalize();
  return (!s.is_ok() || any > 0) ? 1 : 0;
}
