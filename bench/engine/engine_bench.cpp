// Benchmarks of the serving engine (include/treeattn/engine.hpp) on a real model, run under
// mpirun (every rank runs this program; rank 0 submits and prints):
//
//   mpirun -np 2 build/release/bench/treeattn_engine_bench --model M throughput
//       decode throughput (generated tokens/s) at 1, 4 and 16 concurrent sequences of 2k-token
//       prompts (distinct random ids: no prefix sharing), measured over the steps in which every
//       sequence of the round is decoding; also the per-layer merge time per step on every rank.
//   mpirun -np 2 build/release/bench/treeattn_engine_bench --model M followup
//       a 16k-token document in the cache, then a 30-token question: time to first token cold
//       (the whole prompt) and warm (the document's pages reused, the question prefilled by the
//       tree merge: pass-Q), the bytes each rank sent for the warm prefill, and what moving the
//       cached prefix's K/V instead would send, timed with the same communicator (an all-gather
//       of the prefix's K/V bytes per layer).
//   mpirun -np 2 build/release/bench/treeattn_engine_bench --model M exchange [--prompt 4096]
//       pass-Q against the K/V exchange (EngineConfig::prefill_exchange): for each of pass-q, kv
//       and auto, a fresh engine prefills a fresh prompt (cold) and then the same prompt plus a
//       30-token question (warm: the prompt's pages reused); time to first token, rank 0's bytes
//       sent, the rows each way went, and whether the first token's logits have the same bits
//       under every policy.
//   mpirun -np 1 build/release/bench/treeattn_engine_bench --model M --threads 2 prefill
//       [--prompt 8192,32768]
//       the whole prefill of one fresh prompt per length (max_new_tokens = 1) against the FMA
//       peak measured in the same run: every rank runs the FMA probe with its threads at the same
//       moment, before and after each prefill, and the peaks are summed over ranks. The work
//       counted is the model's arithmetic, 2 flops a multiply-add: the layer matrices for every
//       prompt token, the output head once (the first token's logits) and causal attention (q.k
//       and p.v, 4 * head_dim flops per query head and visible position; sliding-window layers
//       see their window). The int8 matrices' integer multiply-adds count as flops too: the
//       ratio says how fast the whole prefill runs against the float FMA peak, not which unit did
//       the work.
//   mpirun -np 2 build/release/bench/treeattn_engine_bench --model M kv-dtype [--context 16384]
//       [--dtypes f16,int8,fp8] [--rounds 2]
//       KV page types at equal --kv-gib: for each round and type a fresh engine, one request of
//       a --context-token prompt greedily decoding --new tokens: the longest sequence the pools
//       hold, the decode inter-token latency (best round) and its ratio to the first type's, and
//       the tokens and first-token logits against the first type's (tokens equal until the
//       first difference; logits' largest error relative to their largest magnitude).
//   mpirun -np 2 build/release/bench/treeattn_engine_bench merge
//       the per-layer merge alone (SmolLM2 shape: 9 heads, head dim 64) for B = 1, 4, 16 decode
//       rows, each kind, median of many calls.
//
// The figures in docs/results.md come from these commands, as root (one command per two lines):
//   mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 2
//       build/release/bench/treeattn_engine_bench --model $(tools/model-path.sh) throughput
//   (the same with `followup`, and `merge` without --model), and across two emulated hosts:
//   tools/cluster/cluster.sh session 2 --slots 1 --link 10gbit -- -np 2
//       $PWD/build/release/bench/treeattn_engine_bench merge
//   (and --link 1gbit for the 1 Gbit figures); `throughput --context 256` for the short contexts.
// Not part of the test suite. Ratios are measured within one run.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "engine/layer_merge.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/model.hpp"
#include "treeattn/roofline.hpp"

using namespace treeattn;
using engine::Engine;
using engine::EngineConfig;
using engine::Request;
using engine::TokenEvent;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Tracker {
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  int64_t tokens = 0;
  std::vector<Clock::time_point> first, last;
  std::vector<Clock::time_point> stamps;  // every generated token
  // Engine metrics when the last sequence got its first token and when the first one ended:
  // the decode window's per-rank breakdown.
  const Engine* eng = nullptr;
  int firsts = 0, n_req = 0;
  bool ended = false;
  engine::EngineMetrics w0, w1;
  std::vector<int64_t> cached;
  std::vector<engine::RequestTimings> timings;
  void reset(int n) {
    std::lock_guard lk(mu);
    finished = 0;
    tokens = 0;
    first.assign(static_cast<std::size_t>(n), {});
    last.assign(static_cast<std::size_t>(n), {});
    cached.assign(static_cast<std::size_t>(n), 0);
    timings.assign(static_cast<std::size_t>(n), {});
    stamps.clear();
    firsts = 0;
    n_req = n;
    ended = false;
  }
  engine::TokenCallback callback(int i) {
    return [this, i](const TokenEvent& ev) {
      std::lock_guard lk(mu);
      const auto u = static_cast<std::size_t>(i);
      if (ev.token >= 0) {
        ++tokens;
        stamps.push_back(Clock::now());
        if (ev.index == 0) {
          first[u] = Clock::now();
          if (++firsts == n_req && eng != nullptr) w0 = eng->metrics();
        }
        last[u] = Clock::now();
      }
      cached[u] = ev.timings.cached_tokens;
      timings[u] = ev.timings;
      if (ev.finish != engine::FinishReason::kNone) {
        if (!ended && eng != nullptr) w1 = eng->metrics();
        ended = true;
        if (ev.finish == engine::FinishReason::kError)
          std::fprintf(stderr, "request %d failed: %s\n", i, ev.error.message().c_str());
        ++finished;
        cv.notify_all();
      }
    };
  }
  void wait(int n) {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return finished >= n; });
  }
};

std::vector<TokenId> random_prompt(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  std::uniform_int_distribution<int64_t> u(100, vocab - 1);
  std::vector<TokenId> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = static_cast<TokenId>(u(rng));
  return t;
}

// Submits one request and waits until it finishes: its time to first token (s) and that token's
// logits (when it asked for them); a refused submit or a failed request is an error.
struct OneRequest {
  double ttft = 0;
  std::vector<float> logits;
};
Result<OneRequest> run_one(Engine& en, Request r) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  OneRequest out;
  Status failed;
  Clock::time_point first;
  const auto t0 = Clock::now();
  auto id = en.submit(std::move(r), [&](const TokenEvent& ev) {
    std::lock_guard lk(mu);
    if (ev.token >= 0 && ev.index == 0) {
      first = Clock::now();
      out.logits = ev.logits;
    }
    if (ev.finish == engine::FinishReason::kError) failed = ev.error;
    if (ev.finish != engine::FinishReason::kNone) {
      done = true;
      cv.notify_all();
    }
  });
  if (!id.is_ok()) return id.status();
  std::unique_lock lk(mu);
  cv.wait(lk, [&] { return done; });
  if (!failed.is_ok()) return failed;
  out.ttft = std::chrono::duration<double>(first - t0).count();
  return out;
}

// kv-dtype's errors: named with the rank, then the job ends (as main's fail).
[[noreturn]] void fail_rank(const Communicator& comm, const Status& s) {
  std::fprintf(stderr, "rank %d: %s\n", comm.rank(), s.to_string().c_str());
  mpi_abort(1, "");
  std::abort();
}

// kv-dtype: one greedy request per engine, its tokens, every token's time and first logits.
struct Decoded {
  std::vector<TokenId> tokens;
  std::vector<Clock::time_point> at;
  std::vector<float> first_logits;
  int64_t max_sequence_tokens = 0;
};

Decoded decode_once(Communicator& comm, const model::LlamaModel& m, const EngineConfig& cfg,
                    const std::vector<TokenId>& prompt, int64_t new_tokens) {
  Decoded d;
  auto made = Engine::create(comm, m, cfg);
  if (!made.is_ok()) fail_rank(comm, made.status());
  Engine& en = **made;
  d.max_sequence_tokens = en.max_sequence_tokens();
  if (comm.rank() != 0) {
    if (auto s = en.run(); !s.is_ok()) fail_rank(comm, s);
    return d;
  }
  Status st;
  std::thread run([&] { st = en.run(); });
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status failed;
  Request r;
  r.prompt = prompt;
  r.max_new_tokens = new_tokens;
  r.return_logits = true;
  auto id = en.submit(std::move(r), [&](const TokenEvent& ev) {
    std::lock_guard lk(mu);
    if (ev.token >= 0) {
      d.tokens.push_back(ev.token);
      d.at.push_back(Clock::now());
      if (ev.index == 0) d.first_logits = ev.logits;
    }
    if (ev.finish == engine::FinishReason::kError) failed = ev.error;
    if (ev.finish != engine::FinishReason::kNone) {
      done = true;
      cv.notify_all();
    }
  });
  if (!id.is_ok()) fail_rank(comm, id.status());
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return done; });
  }
  en.stop(true);
  run.join();
  if (!failed.is_ok()) fail_rank(comm, failed);
  if (!st.is_ok()) fail_rank(comm, st);
  return d;
}

void run_kv_dtypes(Communicator& comm, const model::LlamaModel& m, const EngineConfig& base,
                   const std::vector<std::string>& names, int rounds, int64_t context,
                   int64_t new_tokens) {
  std::vector<DType> types;
  for (const auto& n : names) {
    const auto t = parse_dtype(n);
    if (!t) fail_rank(comm, invalid_argument("--dtypes: unknown KV type '" + n + "'"));
    types.push_back(*t);
  }
  std::mt19937_64 rng(5);
  const auto prompt = random_prompt(rng, context, m.config().n_vocab);
  std::vector<double> best(types.size(), 1e30);
  std::vector<Decoded> first(types.size());
  for (int round = 0; round < rounds; ++round)
    for (std::size_t i = 0; i < types.size(); ++i) {
      EngineConfig cfg = base;
      cfg.kv_dtype = types[i];
      Decoded d = decode_once(comm, m, cfg, prompt, new_tokens);
      if (comm.rank() != 0) continue;
      if (d.at.size() < 2) fail_rank(comm, internal_error("kv-dtype: fewer than 2 tokens decoded"));
      const double itl = std::chrono::duration<double>(d.at.back() - d.at.front()).count() /
                         static_cast<double>(d.at.size() - 1);
      best[i] = std::min(best[i], itl);
      if (round == 0) first[i] = std::move(d);
    }
  if (comm.rank() != 0) return;
  std::printf(
      "KV page types: %s, %d ranks x %d threads, %lld-token prompt, %lld new tokens, %.2f GiB "
      "of KV per rank, best of %d rounds\n  %-5s %14s %8s %9s %9s %14s %18s\n",
      m.config().name.c_str(), comm.size(), base.threads, static_cast<long long>(context),
      static_cast<long long>(new_tokens),
      static_cast<double>(base.kv_memory) / 1073741824.0, rounds, "type", "max seq tokens",
      "x ref", "ITL ms", "x ref", "tokens = ref", "logit err / max");
  const Decoded& ref = first[0];
  for (std::size_t i = 0; i < types.size(); ++i) {
    const Decoded& d = first[i];
    std::size_t same = 0;
    while (same < d.tokens.size() && same < ref.tokens.size() && d.tokens[same] == ref.tokens[same])
      ++same;
    float mag = 0, err = 0;
    for (std::size_t v = 0; v < ref.first_logits.size() && v < d.first_logits.size(); ++v) {
      mag = std::max(mag, std::fabs(ref.first_logits[v]));
      err = std::max(err, std::fabs(d.first_logits[v] - ref.first_logits[v]));
    }
    std::printf("  %-5s %14lld %8.3f %9.3f %9.3f %8zu of %-3zu %18.3g\n",
                std::string(dtype_name(types[i])).c_str(),
                static_cast<long long>(d.max_sequence_tokens),
                static_cast<double>(d.max_sequence_tokens) /
                    static_cast<double>(ref.max_sequence_tokens),
                1e3 * best[i], best[i] / best[0], same, d.tokens.size(),
                mag > 0 ? static_cast<double>(err / mag) : 0.0);
    std::printf(
        "KVDTYPE {\"type\": \"%s\", \"ranks\": %d, \"context\": %lld, "
        "\"max_sequence_tokens\": %lld, \"itl_ms\": %.4f, \"tokens_equal\": %zu, "
        "\"tokens\": %zu, \"logit_rel_err\": %.4g}\n",
        std::string(dtype_name(types[i])).c_str(), comm.size(), static_cast<long long>(context),
        static_cast<long long>(d.max_sequence_tokens), 1e3 * best[i], same, d.tokens.size(),
        mag > 0 ? static_cast<double>(err / mag) : 0.0);
  }
  std::fflush(stdout);
}

// The arithmetic of prefilling n prompt tokens (flops, an FMA = 2): the layer matrices per token,
// the output head once, causal attention per layer (position i sees i + 1 positions, a
// sliding-window layer at most its window).
struct PrefillWork {
  double dense = 0, attention = 0;
};
PrefillWork prefill_work(const model::LlamaConfig& c, int64_t n) {
  const double e = static_cast<double>(c.n_embd), f = static_cast<double>(c.n_ff);
  const double hq = static_cast<double>(c.n_head * c.head_dim);
  const double hkv = static_cast<double>(c.n_head_kv * c.head_dim);
  const double layer_macs = e * hq + 2 * e * hkv + hq * e + 3 * e * f;
  PrefillWork w;
  w.dense =
      2 * (static_cast<double>(n) * c.n_layers * layer_macs + static_cast<double>(c.n_vocab) * e);
  for (int l = 0; l < c.n_layers; ++l) {
    const bool local = c.sliding_window > 0 && l < static_cast<int>(c.local_layer.size()) &&
                       c.local_layer[static_cast<std::size_t>(l)] != 0;
    double visible = 0;
    for (int64_t i = 0; i < n; ++i)
      visible += static_cast<double>(local ? std::min(i + 1, c.sliding_window) : i + 1);
    w.attention += 4.0 * static_cast<double>(c.head_dim * c.n_head) * visible;
  }
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"treeattn serving engine benchmarks (run under mpirun)"};
  std::string model_path;
  int threads = 1;
  int64_t context = 2048, new_tokens = 64, doc = 16384, question = 30;
  std::vector<int> concurrency = {1, 4, 16};
  std::string merge = "tree";
  double kv_gib = 4.0;
  app.add_option("--model", model_path, "GGUF model file");
  app.add_option("--threads", threads, "threads per rank")->capture_default_str();
  app.add_option("--merge", merge,
                 "a strategy that merges a batch of states (tree, hier, allgather, tree-det, ...) "
                 "or auto")
      ->capture_default_str();
  app.add_option("--kv-gib", kv_gib, "KV pool GiB per rank")->capture_default_str();
  int64_t page_tokens = EngineConfig{}.page_tokens;
  app.add_option("--page-tokens", page_tokens, "tokens per KV page (16, or 32..256 by 32)")
      ->capture_default_str();
  std::string matmul = "int8";
  std::string isa_flag = "auto";
  app.add_option("--isa", isa_flag,
                 "auto | avx512 | avx2 | generic: the kernel target of the matrix and attention "
                 "kernels, and of the FMA peak the prefill is set against")
      ->capture_default_str();
  app.add_option("--matmul", matmul, "int8 | int8-ffn | exact (the quantized weights' matmul)")
      ->capture_default_str();
  auto* tp = app.add_subcommand("throughput", "decode tokens/s at several concurrencies");
  tp->add_option("--context", context, "prompt tokens per sequence")->capture_default_str();
  tp->add_option("--new", new_tokens, "generated tokens per sequence")->capture_default_str();
  tp->add_option("--concurrency", concurrency, "concurrent sequences")->delimiter(',');
  auto* fu = app.add_subcommand("followup", "cold vs cached-document time to first token");
  fu->add_option("--doc", doc, "document tokens")->capture_default_str();
  fu->add_option("--question", question, "question tokens")->capture_default_str();
  auto* mg = app.add_subcommand("merge", "the per-layer merge alone at B = 1, 4, 16");
  int64_t xprompt = 4096;
  std::string exchange = "auto";
  app.add_option("--prefill-exchange", exchange, "auto | pass-q | kv (throughput, followup)")
      ->capture_default_str();
  std::string dense = "auto";
  app.add_option("--dense", dense,
                 "split | replicated | auto: the dense layers over the ranks (EngineConfig::dense)")
      ->capture_default_str();
  auto* kd = app.add_subcommand("kv-dtype", "KV page types: capacity, decode ITL, tokens, logits");
  std::vector<std::string> kv_dtypes = {"f16", "int8", "fp8"};
  int kv_rounds = 2;
  kd->add_option("--context", context, "prompt tokens")->capture_default_str();
  kd->add_option("--new", new_tokens, "generated tokens")->capture_default_str();
  kd->add_option("--dtypes", kv_dtypes, "KV types; the first is the reference")->delimiter(',');
  kd->add_option("--rounds", kv_rounds, "rounds over the types (the best ITL is reported)")
      ->capture_default_str();
  auto* xc = app.add_subcommand("exchange", "pass-Q vs the K/V exchange: cold and warm prefill");
  xc->add_option("--prompt", xprompt, "fresh prompt tokens")->capture_default_str();
  xc->add_option("--question", question, "follow-up question tokens")->capture_default_str();
  auto* pf =
      app.add_subcommand("prefill", "the whole prefill against the FMA peak of the same run");
  std::vector<int64_t> pf_lens = {8192, 32768};
  pf->add_option("--prompt", pf_lens, "prompt lengths")->delimiter(',');
  app.require_subcommand(1);
  CLI11_PARSE(app, argc, argv);

  auto world = mpi_init_world(&argc, &argv);
  if (!world.is_ok()) {
    std::fprintf(stderr, "%s\n", world.status().to_string().c_str());
    return 2;
  }
  // Communicators go before MPI_Finalize.
  auto finalize = [&] {
    world.value().reset();
    (void)mpi_finalize();
  };
  Communicator& comm = **world;
  const int me = comm.rank(), p = comm.size();
  auto fail = [&](const Status& s) { fail_rank(comm, s); };

  if (mg->parsed()) {
    comm.set_timeout(std::chrono::milliseconds(60000));
    const std::size_t D = 64, H = 9;
    if (me == 0)
      std::printf("merge alone, %d ranks, %zu heads, head dim %zu (median of 2000 calls, us)\n", p,
                  H, D);
    // Interleaved: every round times B = 1, 4, 16 back to back, so noise hits all three alike.
    for (const char* kind_name : {"tree", "hier", "allgather", "tree-det", "auto"}) {
      engine::MergeRequest mr;
      mr.method = kind_name;
      mr.shape = AttnShape{16, static_cast<int>(H), 3, static_cast<int>(D), 1};
      auto lm = engine::LayerMerge::create(comm, mr);
      if (!lm.is_ok()) fail(lm.status());
      const int Bs[3] = {1, 4, 16};
      std::vector<double> t[3];
      std::vector<float> work;
      for (int it = 0; it < 2200; ++it)
        for (int b = 0; b < 3; ++b) {
          const std::size_t n = static_cast<std::size_t>(Bs[b]) * H;
          work.assign(n * (D + 2), 0.5f);
          const auto t0 = Clock::now();
          if (auto s = (*lm)->merge(work.data(), n); !s.is_ok()) fail(s);
          if (it >= 200) t[b].push_back(since(t0) * 1e6);
        }
      double med[3];
      for (int b = 0; b < 3; ++b) {
        std::sort(t[b].begin(), t[b].end());
        med[b] = t[b][t[b].size() / 2];
      }
      if (me == 0) {
        std::printf("  %-9s  B=1 %7.1f   B=4 %7.1f   B=16 %7.1f   B16/B1 %.2f   (%s)\n", kind_name,
                    med[0], med[1], med[2], med[2] / med[0],
                    engine::describe_merge((*lm)->choice()).c_str());
        std::printf(
            "MERGE {\"ranks\": %d, \"method\": \"%s\", \"merge\": \"%s\", \"us_b1\": %.3f, "
            "\"us_b4\": %.3f, \"us_b16\": %.3f}\n",
            p, kind_name, (*lm)->choice().strategy.c_str(), med[0], med[1], med[2]);
      }
    }
    finalize();
    return 0;
  }

  auto model = model::LlamaModel::load(model_path);
  if (!model.is_ok()) fail(model.status());
  const auto& mc = (*model)->config();
  EngineConfig cfg;
  if (auto i = parse_isa(isa_flag); !i.is_ok() || *i == Isa::kReference) {
    fail(invalid_argument("--isa " + isa_flag + ": expected auto, avx512, avx2 or generic"));
  } else {
    cfg.isa = *i;
  }
  const Isa run_isa = cfg.isa == Isa::kAuto ? best_isa() : cfg.isa;  // Engine::create checks it
  cfg.kv_dtype = DType::kF16;
  cfg.threads = threads;
  cfg.merge = merge;
  cfg.prefill_exchange = exchange;
  cfg.dense = dense;  // the engine copies its rows into the decode layout (rows8) itself
  if (auto mm = model::parse_matmul_mode(matmul); mm.is_ok())
    cfg.matmul = *mm;
  else
    fail(mm.status());
  cfg.max_batch = 16;
  cfg.prefill_chunk = 512;
  cfg.page_tokens = page_tokens;
  cfg.kv_memory = static_cast<std::size_t>(kv_gib * 1073741824.0);
  cfg.timeout = std::chrono::milliseconds(1800000);

  if (pf->parsed()) {
    // Every rank's FMA probe at the same moment, summed: the peak of this run's ranks x threads.
    auto peak = [&]() -> double {
      if (auto s = comm.barrier(); !s.is_ok()) fail(s);
      auto g = measure_peak_gflops(threads, run_isa, 3);
      if (!g.is_ok()) fail(g.status());
      float v = static_cast<float>(*g);
      if (auto s = comm.allreduce(&v, 1, ReduceOp::kSum); !s.is_ok()) fail(s);
      return v;
    };
    std::mt19937_64 prng(11);
    if (me == 0)
      std::printf(
          "whole prefill: %s, %d ranks x %d threads, matmul %s, prefill chunk %lld, "
          "pages of %lld tokens, merge %s\n  %7s %9s %9s %12s %12s %9s %11s %11s %8s  %s\n",
          mc.name.c_str(), p, threads,
          model::matmul_description({threads, run_isa, cfg.matmul}).c_str(),
          static_cast<long long>(cfg.prefill_chunk), static_cast<long long>(cfg.page_tokens),
          merge.c_str(), "tokens", "TTFT s", "tokens/s", "dense GFLOP", "attn GFLOP", "GFLOP/s",
          "peak before", "peak after", "of peak", "rank 0: dense / attention / merge+exchange s");
    for (const int64_t n : pf_lens) {
      const auto prompt = random_prompt(prng, n, mc.n_vocab);
      const double peak0 = peak();
      auto pe = Engine::create(comm, **model, cfg);
      if (!pe.is_ok()) fail(pe.status());
      Engine& en = **pe;
      double ttft = 0;
      engine::EngineMetrics m0, m1;
      if (me != 0) {
        if (auto s = en.run(); !s.is_ok()) fail(s);
      } else {
        Status st;
        std::thread run([&] { st = en.run(); });
        Request r;
        r.prompt = prompt;
        r.max_new_tokens = 1;
        m0 = en.metrics();
        auto one = run_one(en, std::move(r));
        if (!one.is_ok()) fail(one.status());
        ttft = one->ttft;
        std::this_thread::sleep_for(std::chrono::milliseconds(600));  // a step's metrics
        m1 = en.metrics();
        en.stop(true);
        run.join();
        if (!st.is_ok()) fail(st);
      }
      const double peak1 = peak();
      if (me == 0) {
        const PrefillWork w = prefill_work(mc, n);
        const double rate = (w.dense + w.attention) / ttft / 1e9;
        std::printf(
            "  %7lld %9.2f %9.1f %12.1f %12.1f %9.1f %11.1f %11.1f %8.3f  %.2f / %.2f / %.2f\n",
            static_cast<long long>(n), ttft, static_cast<double>(n) / ttft, w.dense / 1e9,
            w.attention / 1e9, rate, peak0, peak1, rate / std::max(peak0, peak1),
            m1.dense_seconds[0] - m0.dense_seconds[0],
            m1.attention_seconds[0] - m0.attention_seconds[0],
            m1.merge_seconds[0] - m0.merge_seconds[0]);
        std::fflush(stdout);
      }
    }
    if (me == 0)
      std::printf(
          "  (of peak: GFLOP/s against the higher of the two peaks; the int8 matrices' integer "
          "multiply-adds are counted as flops)\n");
    finalize();
    return 0;
  }

  if (kd->parsed()) {
    run_kv_dtypes(comm, **model, cfg, kv_dtypes, kv_rounds, context, new_tokens);
    finalize();
    return 0;
  }

  if (xc->parsed()) {
    // One engine per policy, on the same prompt and question, in one run.
    std::mt19937_64 xrng(7);
    const auto prompt = random_prompt(xrng, xprompt, mc.n_vocab);
    const auto q = random_prompt(xrng, question, mc.n_vocab);
    std::vector<float> ref_logits;
    if (me == 0)
      std::printf(
          "prefill exchange: %s, %d ranks x %d threads, merge %s, %lld-token prompt, then "
          "+%lld-token question, prefill chunk %lld\n"
          "  %-7s %-5s %10s %14s %10s %10s %s\n",
          mc.name.c_str(), p, threads, merge.c_str(), static_cast<long long>(xprompt),
          static_cast<long long>(question), static_cast<long long>(cfg.prefill_chunk), "policy",
          "turn", "TTFT s", "r0 sent MB", "K/V rows", "pass-Q rows",
          "rank 0: attention / merge+exchange / dense s; first token's logits");
    for (const char* policy : {"pass-q", "kv", "auto"}) {
      EngineConfig xcfg = cfg;
      xcfg.prefill_exchange = policy;
      auto xe = Engine::create(comm, **model, xcfg);
      if (!xe.is_ok()) fail(xe.status());
      Engine& en = **xe;
      if (me != 0) {
        if (auto s = en.run(); !s.is_ok()) fail(s);
        continue;
      }
      Status st;
      std::thread run([&] { st = en.run(); });
      for (int turn = 0; turn < 2; ++turn) {
        Request r;
        r.prompt = prompt;
        if (turn == 1) r.prompt.insert(r.prompt.end(), q.begin(), q.end());
        r.max_new_tokens = 1;
        r.return_logits = true;
        const auto m0 = en.metrics();
        auto res = run_one(en, std::move(r));
        if (!res.is_ok()) fail(res.status());
        const OneRequest& one = *res;
        const std::vector<float>& logits = one.logits;
        // The metrics snapshot is taken after a step; the token came out inside the step's
        // forward pass. The idle engine steps every idle_tick (250 ms): wait for one.
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        const auto m1 = en.metrics();
        const char* bits = "(reference)";
        if (turn == 0 && ref_logits.empty())
          ref_logits = logits;
        else if (turn == 0)
          bits = logits.size() == ref_logits.size() &&
                         std::equal(logits.begin(), logits.end(), ref_logits.begin(),
                                    [](float a, float b) { return std::memcmp(&a, &b, 4) == 0; })
                     ? "same bits as pass-q"
                     : "DIFFERENT bits from pass-q";
        else
          bits = "";
        std::printf("  %-7s %-5s %10.3f %14.3f %10lld %10lld   %.2f / %.2f / %.2f  %s\n", policy,
                    turn == 0 ? "cold" : "warm", one.ttft,
                    static_cast<double>(m1.bytes_sent - m0.bytes_sent) / 1e6,
                    static_cast<long long>(m1.rows_kv_exchange - m0.rows_kv_exchange),
                    static_cast<long long>(m1.rows_pass_q - m0.rows_pass_q),
                    m1.attention_seconds[0] - m0.attention_seconds[0],
                    m1.merge_seconds[0] - m0.merge_seconds[0],
                    m1.dense_seconds[0] - m0.dense_seconds[0], bits);
        std::fflush(stdout);
      }
      en.stop(true);
      run.join();
      if (!st.is_ok()) fail(st);
    }
    finalize();
    return 0;
  }
  auto eng = Engine::create(comm, **model, cfg);
  if (!eng.is_ok()) fail(eng.status());
  Engine& e = **eng;
  // The follow-up's alternative, timed after the engine stops: an all-gather per layer of each
  // rank's share of the cached prefix's K/V (f16), what a K/V exchange would move.
  const double kv_bytes =
      static_cast<double>(doc) * static_cast<double>(mc.kv_values_per_token()) * 2.0;
  auto time_kv_exchange = [&]() -> double {
    const auto per_rank = static_cast<std::size_t>(kv_bytes / mc.n_layers / p);
    std::vector<uint8_t> send(per_rank, 1), recv(per_rank * static_cast<std::size_t>(p));
    const auto t0 = Clock::now();
    for (int l = 0; l < mc.n_layers; ++l)
      if (auto s = comm.allgather(send.data(), per_rank, recv.data()); !s.is_ok()) fail(s);
    return since(t0);
  };
  std::thread runner;
  Status run_status;
  if (me != 0) {
    if (auto s = e.run(); !s.is_ok()) fail(s);
    if (fu->parsed()) (void)time_kv_exchange();
    eng.value().reset();  // its communicators (a strategy's sub-communicators) first
    finalize();
    return 0;
  }
  runner = std::thread([&] { run_status = e.run(); });
  std::mt19937_64 rng(42);
  Tracker tr;
  tr.eng = &e;

  if (tp->parsed()) {
    std::printf(
        "decode throughput: %s, %d ranks x %d threads, %lld-token prompts, %lld new tokens, merge "
        "%s, matmul %s\n",
        mc.name.c_str(), p, threads, static_cast<long long>(context),
        static_cast<long long>(new_tokens), engine::describe_merge(e.merge_choice()).c_str(),
        matmul.c_str());
    std::printf("  %-4s %12s %14s %16s %18s\n", "B", "decode tok/s", "ms per step", "prefill tok/s",
                "merge us/layer (r0)");
    double base = 0;
    for (const int B : concurrency) {
      // Phase 1 prefills the B prompts (one token each): their full pages stay cached. Phase 2
      // submits the same prompts for `new` tokens: each reuses its own pages (distinct prompts,
      // so every sequence still reads its own 2k-token cache) and recomputes only its last
      // page, so all B sequences decode together. Throughput counts the tokens generated while
      // all B are decoding (from the last first token to the first last token).
      std::vector<std::vector<TokenId>> prompts;
      for (int i = 0; i < B; ++i) prompts.push_back(random_prompt(rng, context, mc.n_vocab));
      tr.reset(B);
      const auto t0 = Clock::now();
      for (int i = 0; i < B; ++i) {
        Request r;
        r.prompt = prompts[static_cast<std::size_t>(i)];
        r.max_new_tokens = 1;
        if (auto id = e.submit(std::move(r), tr.callback(i)); !id.is_ok()) fail(id.status());
      }
      tr.wait(B);
      const double prefill = since(t0);
      tr.reset(B);
      const auto m0 = e.metrics();
      for (int i = 0; i < B; ++i) {
        Request r;
        r.prompt = prompts[static_cast<std::size_t>(i)];
        r.max_new_tokens = new_tokens;
        if (auto id = e.submit(std::move(r), tr.callback(i)); !id.is_ok()) fail(id.status());
      }
      tr.wait(B);
      const auto m1 = e.metrics();
      Clock::time_point w0 = tr.first[0], w1 = tr.last[0];
      int64_t cached = 0;
      for (int i = 0; i < B; ++i) {
        w0 = std::max(w0, tr.first[static_cast<std::size_t>(i)]);
        w1 = std::min(w1, tr.last[static_cast<std::size_t>(i)]);
        cached += tr.cached[static_cast<std::size_t>(i)];
      }
      int64_t in_window = 0;
      for (const auto& t : tr.stamps)
        if (t > w0 && t <= w1) ++in_window;
      const double window = std::chrono::duration<double>(w1 - w0).count();
      const double tok_s = window > 0 ? static_cast<double>(in_window) / window : 0.0;
      const double merge_us = (m1.merge_seconds[0] - m0.merge_seconds[0]) /
                              static_cast<double>(std::max<int64_t>(1, m1.merges - m0.merges)) *
                              1e6;
      if (base == 0) base = tok_s;
      const double wsteps = static_cast<double>(std::max<int64_t>(1, tr.w1.steps - tr.w0.steps));
      for (std::size_t r = 0; r < tr.w1.dense_seconds.size(); ++r)
        std::printf(
            "    rank %zu per decode step (%d steps): dense %.2f ms, attention %.2f ms, "
            "merge+exchange %.2f ms\n",
            r, static_cast<int>(wsteps),
            1e3 * (tr.w1.dense_seconds[r] - tr.w0.dense_seconds[r]) / wsteps,
            1e3 * (tr.w1.attention_seconds[r] - tr.w0.attention_seconds[r]) / wsteps,
            1e3 * (tr.w1.merge_seconds[r] - tr.w0.merge_seconds[r]) / wsteps);
      std::printf(
          "  %-4d %12.1f %14.2f %16.1f %18.1f   (x%.2f of B=%d; %lld tokens in the window, "
          "%lld cached prompt tokens)\n",
          B, tok_s, tok_s > 0 ? 1e3 * B / tok_s : 0.0, static_cast<double>(B * context) / prefill,
          merge_us, tok_s / base, concurrency[0], static_cast<long long>(in_window),
          static_cast<long long>(cached));
      // One machine-readable line per point (bench/engine/merge_methods.sh reads it).
      std::printf(
          "RESULT {\"ranks\": %d, \"method\": \"%s\", \"merge\": \"%s\", \"batch\": %d, "
          "\"context\": %lld, \"decode_tokens_per_s\": %.3f, \"itl_ms\": %.4f, "
          "\"merge_us_per_layer\": %.3f, \"prefill_tokens_per_s\": %.2f}\n",
          p, merge.c_str(), e.merge_choice().strategy.c_str(), B, static_cast<long long>(context),
          tok_s, tok_s > 0 ? 1e3 * B / tok_s : 0.0, merge_us,
          static_cast<double>(B * context) / prefill);
      std::fflush(stdout);
    }
  } else if (fu->parsed()) {
    const auto docs = random_prompt(rng, doc, mc.n_vocab);
    std::printf(
        "follow-up: %s, %d ranks x %d threads, %lld-token document + %lld-token questions\n",
        mc.name.c_str(), p, threads, static_cast<long long>(doc), static_cast<long long>(question));
    double ttft[2] = {0, 0};
    uint64_t bytes[2] = {0, 0};
    for (int turn = 0; turn < 2; ++turn) {
      tr.reset(1);
      Request r;
      r.prompt = docs;
      const auto q = random_prompt(rng, question, mc.n_vocab);
      r.prompt.insert(r.prompt.end(), q.begin(), q.end());
      r.max_new_tokens = 1;
      const uint64_t b0 = e.metrics().bytes_sent;
      const auto t0 = Clock::now();
      if (auto id = e.submit(std::move(r), tr.callback(0)); !id.is_ok()) fail(id.status());
      tr.wait(1);
      ttft[turn] = std::chrono::duration<double>(tr.first[0] - t0).count();
      bytes[turn] = e.metrics().bytes_sent - b0;
      std::printf("  %-5s TTFT %9.3f s   cached %6lld tokens   rank 0 sent %10.3f MB\n",
                  turn == 0 ? "cold" : "warm", ttft[turn], static_cast<long long>(tr.cached[0]),
                  static_cast<double>(bytes[turn]) / 1e6);
      std::fflush(stdout);
    }
    std::printf("  warm / cold TTFT = %.4f (target <= 0.05)\n", ttft[1] / ttft[0]);
    // The alternative for the warm turn: bring the cached prefix's K/V to the new queries'
    // rank(s): every rank would receive the other ranks' pages of every layer.
    std::printf(
        "  pass-Q moved %.3f MB from rank 0; a K/V exchange of the cached prefix moves %.1f MB "
        "per rank ((p-1)/p of %.1f MB, f16)\n",
        static_cast<double>(bytes[1]) / 1e6, kv_bytes * (p - 1) / p / 1e6, kv_bytes / 1e6);
    e.stop(true);
    runner.join();
    const double kv_s = time_kv_exchange();
    std::printf(
        "  the K/V exchange's all-gathers alone take %.3f s here (pass-Q's whole warm TTFT: %.3f "
        "s)\n",
        kv_s, ttft[1]);
    eng.value().reset();  // its communicators (a strategy's sub-communicators) first
    finalize();
    return 0;
  }
  e.stop(true);
  runner.join();
  if (!run_status.is_ok()) fail(run_status);
  eng.value().reset();  // its communicators (a strategy's sub-communicators) first
  finalize();
  return 0;
}
