// The serving engine (include/treeattn/engine.hpp) on tiny random-weight Llama models, with
// threads as ranks: agreement with the Generator's decode (itself checked against the float64
// reference in tests/model), batch invariance (a request's tokens and logits bits are the same
// alone and in a staggered batch with chunked prefill and prefix reuse, and after preemption
// and resumption, at 1-4 ranks), prefix reuse for follow-up turns, admission under memory
// pressure with eviction, cancellation, bad requests and a rank that never arrives.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "model/generate_harness.hpp"
#include "engine/dense_plan.hpp"
#include "model/tiny_llama.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/kernel.hpp"

namespace treeattn::engine {
namespace {

using testing::ScratchDir;

struct Submitted {
  int at_step = 0;
  Request req;
};

struct Outcome {
  std::vector<TokenId> tokens;
  std::vector<std::vector<float>> logits;
  std::vector<model::TokenLogprobs> logprobs;
  FinishReason finish = FinishReason::kNone;
  int64_t cached = -1;
  Status error;
};

struct RunResult {
  std::vector<Outcome> out;
  EngineMetrics metrics;
  Status status;
};

class TinyModel {
 public:
  explicit TinyModel(testing::TinyLlamaSpec spec = {}) {
    path_ = dir_.path("tiny.gguf");
    testing::GgufBuilder::write(path_, testing::build_tiny_llama(spec));
    auto m = model::LlamaModel::load(path_);
    EXPECT_TRUE(m.is_ok()) << m.status().to_string();
    model_ = std::move(m).value();
  }
  const model::LlamaModel& operator*() const { return *model_; }

 private:
  ScratchDir dir_;
  std::string path_;
  std::unique_ptr<model::LlamaModel> model_;
};

EngineConfig base_config() {
  EngineConfig c;
  c.kv_dtype = DType::kF32;
  c.page_tokens = 16;
  c.kv_pages = 64;
  c.threads = 1;
  c.timeout = std::chrono::milliseconds(60000);
  c.idle_tick = std::chrono::milliseconds(1);
  c.poison_pages = true;  // a stale or unwritten slot read anywhere would make NaN logits
  c.matmul = model::MatmulMode::kExact;  // as testing::run_generation's, compared with it
  return c;
}

// Runs the requests through one engine over p in-process ranks. alone: one request at a time
// (each submitted when the previous one finished); otherwise request i is submitted before
// step subs[i].at_step.
RunResult run_engine(const model::LlamaModel& m, int p, const EngineConfig& cfg,
                     const std::vector<Submitted>& subs, bool alone,
                     const std::function<void(Engine&, RequestId, const TokenEvent&)>& hook = {}) {
  RunResult res;
  res.out.resize(subs.size());
  std::mutex mu;
  std::map<RequestId, std::size_t> index;
  res.status = run_local(p, [&](Communicator& comm) -> Status {
    auto e = Engine::create(comm, m, cfg);
    TREEATTN_RETURN_IF_ERROR(e.status());
    Engine& eng = **e;
    if (comm.rank() != 0) return eng.run();
    auto cb = [&](const TokenEvent& ev) {
      std::lock_guard lk(mu);
      Outcome& o = res.out[index.at(ev.id)];
      if (ev.token >= 0) o.tokens.push_back(ev.token);
      if (!ev.logits.empty()) o.logits.push_back(ev.logits);
      if (ev.token >= 0 && subs[index.at(ev.id)].req.logprobs >= 0)
        o.logprobs.push_back(ev.logprobs);
      o.cached = ev.timings.cached_tokens;
      if (ev.finish != FinishReason::kNone) {
        o.finish = ev.finish;
        o.error = ev.error;
      }
      if (hook) hook(eng, ev.id, ev);
    };
    auto submit = [&](std::size_t i) -> Status {
      std::lock_guard lk(mu);
      auto id = eng.submit(subs[i].req, cb);
      TREEATTN_RETURN_IF_ERROR(id.status());
      index[*id] = i;
      return Status::ok();
    };
    Status st;
    if (alone) {
      for (std::size_t i = 0; i < subs.size() && st.is_ok(); ++i) {
        st = submit(i);
        for (bool more = true; more && st.is_ok();) {
          auto r = eng.step();
          if (!r.is_ok()) st = r.status();
          else more = *r;
        }
      }
    } else {
      std::size_t next = 0;
      for (int s = 0; st.is_ok(); ++s) {
        while (next < subs.size() && subs[next].at_step <= s && st.is_ok()) st = submit(next++);
        auto r = eng.step();
        if (!r.is_ok()) st = r.status();
        else if (!*r && next == subs.size()) break;
      }
    }
    eng.stop(false);
    auto last = eng.step();  // the stop step: every rank's run() returns
    res.metrics = eng.metrics();
    TREEATTN_RETURN_IF_ERROR(st);
    return last.status();
  });
  return res;
}

std::vector<TokenId> random_tokens(std::mt19937_64& rng, int n, int vocab) {
  std::uniform_int_distribution<int> u(0, vocab - 1);
  std::vector<TokenId> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = u(rng);
  return t;
}

Request greedy(std::vector<TokenId> prompt, int64_t max_new) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  r.return_logits = true;
  return r;
}

std::string same_bits(const Outcome& a, const Outcome& b) {
  if (a.tokens != b.tokens) return "tokens differ";
  if (a.logits.size() != b.logits.size()) return "logit counts differ";
  if (a.logits.empty()) return "no logits";
  for (const auto& l : a.logits)
    for (const float x : l)
      if (!std::isfinite(x)) return "a logit is not finite (a stale or unwritten KV slot was read?)";
  for (std::size_t s = 0; s < a.logits.size(); ++s)
    if (a.logits[s].size() != b.logits[s].size() ||
        std::memcmp(a.logits[s].data(), b.logits[s].data(), a.logits[s].size() * 4) != 0)
      return "logits of generated token " + std::to_string(s) + " differ";
  if (a.logprobs.size() != b.logprobs.size()) return "logprob counts differ";
  for (std::size_t s = 0; s < a.logprobs.size(); ++s)
    if (a.logprobs[s].logprob != b.logprobs[s].logprob || a.logprobs[s].top != b.logprobs[s].top)
      return "logprobs of generated token " + std::to_string(s) + " differ";
  return "";
}

// Every page back after a run: none referenced, all free or cached.
void expect_every_page_back(const RunResult& res, int p, int64_t pages_per_rank) {
  for (int r = 0; r < p; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    EXPECT_EQ(res.metrics.pages_used[ur], 0) << "rank " << r;
    EXPECT_EQ(res.metrics.pages_free[ur] + res.metrics.pages_cached[ur], pages_per_rank)
        << "rank " << r;
  }
}

TEST(Engine, GreedyDecodeMatchesTheGeneratorWithinFloatRounding) {
  TinyModel m;
  std::mt19937_64 rng(3);
  const auto prompt = random_tokens(rng, 40, 320);
  for (int p : {1, 3}) {
    const auto res = run_engine(*m, p, base_config(), {{0, greedy(prompt, 8)}}, true);
    ASSERT_TRUE(res.status.is_ok()) << res.status.to_string();
    const Outcome& o = res.out[0];
    ASSERT_EQ(o.tokens.size(), 8u);
    EXPECT_EQ(o.finish, FinishReason::kLength);
    // The Generator fed the engine's tokens: the logits of every position agree.
    testing::GenCase c;
    c.kv = DType::kF32;
    c.steps = 7;
    std::vector<int32_t> forced(o.tokens.begin(), o.tokens.end() - 1);
    c.forced = &forced;
    const auto gen = testing::run_generation(*m, p, c, prompt);
    ASSERT_TRUE(gen.status.is_ok()) << gen.status.to_string();
    for (std::size_t s = 0; s < 8; ++s) {
      const auto& a = o.logits[s];
      const auto& b = gen.logits[0][s];
      float mag = 0, err = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        mag = std::max(mag, std::fabs(b[i]));
        err = std::max(err, std::fabs(a[i] - b[i]));
      }
      EXPECT_LE(err, 1e-5f * mag) << "p " << p << " generated token " << s;
      const auto top = model::top_two(b);
      if (top.gap() > 1e-4f * mag) {
        EXPECT_EQ(o.tokens[s], top.first) << "p " << p << " token " << s;
      }
    }
  }
}

// 16 requests of different lengths, 6 of them sharing a 70-token prefix, 2 asking for stop
// tokens; alone (no prefix cache, whole-prompt prefill) vs staggered in one batch (prefix cache,
// 24-token prefill chunks, max batch 16).
std::vector<Submitted> mixed_requests(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto shared = random_tokens(rng, 70, 320);
  std::vector<Submitted> subs;
  for (int i = 0; i < 16; ++i) {
    std::vector<TokenId> prompt;
    if (i % 3 == 0) prompt = shared;
    const auto tail = random_tokens(rng, 1 + (i * 37) % 90, 320);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    Request r = greedy(prompt, 3 + i % 6);
    if (i == 5 || i == 11) r.stop_tokens = {static_cast<TokenId>(i), 7, 100};
    subs.push_back({i / 2, std::move(r)});
  }
  return subs;
}

TEST(Engine, BatchInvarianceTokensAndLogitsBitsAreTheSameAloneAndInABatch) {
  TinyModel m;
  const auto subs = mixed_requests(11);
  for (int p : {1, 2, 3, 4}) {
    EngineConfig alone_cfg = base_config();
    alone_cfg.prefix_cache = false;
    alone_cfg.prefill_chunk = 4096;
    const auto alone = run_engine(*m, p, alone_cfg, subs, true);
    ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
    EngineConfig batch_cfg = base_config();
    batch_cfg.prefill_chunk = 24;
    const auto batch = run_engine(*m, p, batch_cfg, subs, false);
    ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
    int64_t cached = 0;
    for (std::size_t i = 0; i < subs.size(); ++i) {
      EXPECT_EQ(same_bits(alone.out[i], batch.out[i]), "") << "p " << p << " request " << i;
      EXPECT_NE(batch.out[i].finish, FinishReason::kNone);
      EXPECT_EQ(alone.out[i].cached, 0);
      cached += batch.out[i].cached;
    }
    EXPECT_GE(cached, 64) << "p " << p << ": the shared prefix was never reused";
    expect_every_page_back(batch, p, batch_cfg.kv_pages);
  }
}

// Request i's logits processors (generate.hpp): every third one none; the others penalties,
// logit_bias and min_p in turn, and logprobs.
void with_processors(Request& r, int i) {
  model::SamplingParams& sp = r.sampling;
  switch (i % 3) {
    case 0:
      return;
    case 1:
      sp.repetition_penalty = 1.0 + 0.15 * (i % 4);
      sp.presence_penalty = 0.5;
      sp.logit_bias = {{5, 4.0}, {static_cast<TokenId>(40 + i), -100.0}, {300, 2.5}};
      break;
    default:
      sp.frequency_penalty = 0.75;
      sp.repetition_penalty = 0.9;
      sp.min_p = 0.05;
      break;
  }
  r.logprobs = i % 5;
}

// Pages on demand: six requests whose prompts fit a pool of 8 pages of 16 tokens (over all
// ranks) but whose generations do not, so running requests are preempted and resumed, some of
// them several times, four of them sampling at temperature 8 (the tiny model's logits are
// peaked: hotter, and the sampler's state, which must go on across a preemption, would not
// matter), four with penalties (their counts, over the prompt and the tokens generated, must
// be the same after a resumption). Every request gives exactly the tokens and logits bits it gives
// alone in a large pool, at 1-4 ranks, and every page comes back.
TEST(Engine, PreemptedAndResumedRequestsGiveTheirAloneBits) {
  TinyModel m;
  std::mt19937_64 rng(21);
  std::vector<Submitted> subs;
  for (int i = 0; i < 6; ++i) {
    Request r = greedy(random_tokens(rng, 20 + 5 * i, 320), 30 + 3 * i);
    if (i != 0 && i != 3) {
      r.sampling.temperature = 8.0;
      r.sampling.seed = 1000 + static_cast<uint64_t>(i);
    }
    with_processors(r, i);
    subs.push_back({i / 3, std::move(r)});
  }
  for (int p : {1, 2, 3, 4}) {
    EngineConfig alone_cfg = base_config();
    alone_cfg.prefix_cache = false;
    const auto alone = run_engine(*m, p, alone_cfg, subs, true);
    ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
    int64_t not_argmax = 0;  // the sampled requests did draw from their distributions
    for (const auto& o : alone.out)
      for (std::size_t t = 0; t < o.tokens.size() && t < o.logits.size(); ++t)
        not_argmax += o.tokens[t] != model::top_two(o.logits[t]).first;
    EXPECT_GT(not_argmax, 10) << "p " << p;
    EngineConfig tight = base_config();
    tight.kv_pages = (8 + p - 1) / p;
    tight.prefill_chunk = 24;
    const auto batch = run_engine(*m, p, tight, subs, false);
    ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
    for (std::size_t i = 0; i < subs.size(); ++i) {
      EXPECT_EQ(same_bits(alone.out[i], batch.out[i]), "") << "p " << p << " request " << i;
      EXPECT_EQ(batch.out[i].finish, FinishReason::kLength) << "p " << p << " request " << i;
    }
    EXPECT_GE(batch.metrics.preemptions_total, 2) << "p " << p;
    EXPECT_EQ(batch.metrics.preempted, 0);
    expect_every_page_back(batch, p, tight.kv_pages);
  }
}

// The processed logits of generated token `t` of a request, computed independently in double
// from the model's logits (return_logits): logit_bias, then repetition_penalty over the prompt
// and the tokens before t, then frequency and presence penalties over the tokens before t.
std::vector<double> processed_reference(const Request& r, const Outcome& o, std::size_t t) {
  const std::vector<float>& raw = o.logits[t];
  std::vector<double> x(raw.begin(), raw.end());
  const model::SamplingParams& sp = r.sampling;
  for (const auto& [id, b] : sp.logit_bias) x[static_cast<std::size_t>(id)] += b;
  std::map<TokenId, int> count;
  std::set<TokenId> seen(r.prompt.begin(), r.prompt.end());
  for (std::size_t j = 0; j < t; ++j) {
    ++count[o.tokens[j]];
    seen.insert(o.tokens[j]);
  }
  if (sp.repetition_penalty != 1.0)
    for (const TokenId id : seen) {
      double& v = x[static_cast<std::size_t>(id)];
      v = v > 0 ? v / sp.repetition_penalty : v * sp.repetition_penalty;
    }
  for (const auto& [id, c] : count)
    x[static_cast<std::size_t>(id)] -= c * sp.frequency_penalty + sp.presence_penalty;
  return x;
}

// Every sampling field at once on 12 requests (greedy and temperature 1, penalties, logit_bias,
// min_p, top-k, logprobs up to 20): each token's logprob and top logprobs are the log-softmax
// of the processed logits, checked against a float64 reference from the model's logits; greedy
// picks the reference's most likely token, a -100 bias is never picked, a +100 one always; and
// the tokens, logits and logprobs are the same bits alone and in a staggered batch with prefix
// reuse, at 1 and 2 ranks.
TEST(Engine, LogprobsAreTheLogSoftmaxOfTheProcessedLogitsAndEveryFieldIsBatchInvariant) {
  TinyModel m;
  std::mt19937_64 rng(5);
  const auto shared = random_tokens(rng, 40, 320);
  std::vector<Submitted> subs;
  for (int i = 0; i < 12; ++i) {
    std::vector<TokenId> prompt = random_tokens(rng, 3 + 7 * i, 320);
    prompt.insert(prompt.begin(), shared.begin(), shared.end());
    Request r = greedy(prompt, 12);
    with_processors(r, i);
    if (i % 2 == 1) {
      r.sampling.temperature = 1.0;
      r.sampling.top_k = i % 4 == 1 ? 0 : 50;
      r.sampling.seed = 77 + static_cast<uint64_t>(i);
    }
    if (i == 6) r.sampling.logit_bias = {{9, 100.0}};  // always 9
    if (i == 8 || i == 9) r.logprobs = model::kMaxTopLogprobs;
    subs.push_back({i / 3, std::move(r)});
  }
  for (int p : {1, 2}) {
    EngineConfig alone_cfg = base_config();
    alone_cfg.prefix_cache = false;
    const auto alone = run_engine(*m, p, alone_cfg, subs, true);
    ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
    EngineConfig batch_cfg = base_config();
    batch_cfg.prefill_chunk = 24;
    const auto batch = run_engine(*m, p, batch_cfg, subs, false);
    ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
    for (std::size_t i = 0; i < subs.size(); ++i) {
      const Request& r = subs[i].req;
      const Outcome& o = batch.out[i];
      EXPECT_EQ(same_bits(alone.out[i], o), "") << "p " << p << " request " << i;
      ASSERT_EQ(o.tokens.size(), 12u);
      ASSERT_EQ(o.logprobs.size(), r.logprobs >= 0 ? o.tokens.size() : 0u) << i;
      for (std::size_t t = 0; t < o.tokens.size(); ++t) {
        const std::vector<double> x = processed_reference(r, o, t);
        double mx = -std::numeric_limits<double>::infinity(), mag = 1;
        for (const double v : x) {
          mx = std::max(mx, v);
          mag = std::max(mag, std::fabs(v));
        }
        double sum = 0;
        for (const double v : x) sum += std::exp(v - mx);
        const double lse = mx + std::log(sum);
        const auto argmax = static_cast<TokenId>(std::max_element(x.begin(), x.end()) - x.begin());
        const TokenId tok = o.tokens[t];
        if (r.sampling.temperature == 0) {
          EXPECT_EQ(tok, argmax) << "greedy takes the processed logits' top: request " << i;
        }
        for (const auto& [id, b] : r.sampling.logit_bias) {
          if (b == -100.0) {
            EXPECT_NE(tok, id) << "request " << i;
          }
          if (b == 100.0) {
            EXPECT_EQ(tok, id) << "request " << i;
          }
        }
        if (r.logprobs < 0) continue;
        const model::TokenLogprobs& lp = o.logprobs[t];
        const double tol = 1e-5 * mag;
        EXPECT_NEAR(lp.logprob, x[static_cast<std::size_t>(tok)] - lse, tol)
            << "p " << p << " request " << i << " token " << t;
        ASSERT_EQ(lp.top.size(), static_cast<std::size_t>(r.logprobs));
        for (std::size_t k = 0; k < lp.top.size(); ++k) {
          const auto [id, v] = lp.top[k];
          EXPECT_NEAR(v, x[static_cast<std::size_t>(id)] - lse, tol) << "request " << i;
          if (k > 0) {
            EXPECT_LE(v, lp.top[k - 1].second) << "request " << i;
          }
          if (id == tok) {
            EXPECT_EQ(v, lp.logprob);
          }
        }
        if (!lp.top.empty()) {
          EXPECT_NEAR(lp.top[0].second, mx - lse, tol) << "the top one is the most likely";
          if (r.sampling.temperature == 0) {
            EXPECT_EQ(lp.top[0].first, tok);
          }
        }
      }
    }
    expect_every_page_back(batch, p, batch_cfg.kv_pages);
  }
}

// fp8 and int8 KV pages (a scale per token and KV head): attention is exact over the stored
// values, so batch invariance holds as for f16 (alone vs a staggered batch with prefix reuse,
// the K/V exchange, whose pages travel with their scales, against pass-Q), at 1-3 ranks. Against
// f16 pages the logits differ by the quantization: the largest error relative to the logits'
// magnitude is printed, and greedy tokens agree until the first step where f16's top two logits
// are a near tie (closer than twice that error), where the comparison of the request ends.
TEST(Engine, QuantizedKVPagesAreBatchInvariantAndCloseToF16) {
  TinyModel m;
  const auto subs = mixed_requests(13);
  for (const DType dt : {DType::kInt8, DType::kFP8}) {
    for (int p : {1, 2, 3}) {
      EngineConfig ref_cfg = base_config();
      ref_cfg.kv_dtype = DType::kF16;
      ref_cfg.prefix_cache = false;
      ref_cfg.prefill_chunk = 4096;
      const auto ref = run_engine(*m, p, ref_cfg, subs, true);
      ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
      EngineConfig alone_cfg = ref_cfg;
      alone_cfg.kv_dtype = dt;
      const auto alone = run_engine(*m, p, alone_cfg, subs, true);
      ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
      for (const char* exchange : {"pass-q", "kv"}) {
        EngineConfig batch_cfg = base_config();
        batch_cfg.kv_dtype = dt;
        batch_cfg.prefill_chunk = 24;
        batch_cfg.prefill_exchange = exchange;
        const auto batch = run_engine(*m, p, batch_cfg, subs, false);
        ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
        for (std::size_t i = 0; i < subs.size(); ++i)
          EXPECT_EQ(same_bits(alone.out[i], batch.out[i]), "")
              << dtype_name(dt) << " " << exchange << " p " << p << " request " << i;
      }
      float worst = 0;  // max |quantized - f16| / max |f16| over the steps both saw
      int equal = 0, parted = 0;
      for (std::size_t i = 0; i < subs.size(); ++i) {
        const Outcome &q = alone.out[i], &f = ref.out[i];
        for (std::size_t t = 0; t < q.tokens.size() && t < f.tokens.size(); ++t) {
          float mag = 0, err = 0;
          for (std::size_t v = 0; v < f.logits[t].size(); ++v) {
            mag = std::max(mag, std::fabs(f.logits[t][v]));
            err = std::max(err, std::fabs(q.logits[t][v] - f.logits[t][v]));
          }
          worst = std::max(worst, err / mag);
          if (q.tokens[t] == f.tokens[t]) {
            ++equal;
            continue;
          }
          const auto top = model::top_two(f.logits[t]);
          EXPECT_LT(top.gap(), 2 * err) << dtype_name(dt) << " p " << p << " request " << i
                                        << " step " << t << ": not a near tie";
          ++parted;
          break;
        }
      }
      std::printf("[ kv %-4s   ] p %d: logits vs f16 pages: max error %.3g of the largest logit; "
                  "%d greedy tokens equal, %d requests parted at a near tie\n",
                  std::string(dtype_name(dt)).c_str(), p, static_cast<double>(worst), equal,
                  parted);
      EXPECT_LT(worst, dt == DType::kInt8 ? 0.05f : 0.1f) << dtype_name(dt) << " p " << p;
      EXPECT_GT(equal, 40);
    }
  }
}

// Capacity at equal KV memory: a page of int8 or fp8 holds 2 * head_dim + 4 bytes per token and
// KV head (bfloat16 scales), f16 4 * head_dim, so at the tiny model's head dim 64 the quantized
// pools hold 256 / 132 = 1.94x f16's tokens (>= 1.9x, issue 50's target): max_sequence_tokens
// (what /v1/models reports) is p x the pages kv_memory buys per rank x the page tokens, on 1 and
// 2 ranks.
TEST(Engine, QuantizedPagesHoldAtLeast1Point9TimesF16sTokensInTheSameKVMemory) {
  TinyModel m;  // 3 layers, 2 KV heads of head dim 64
  for (int p : {1, 2}) {
    int64_t f16_tokens = 0;
    for (const DType dt : {DType::kF16, DType::kInt8, DType::kFP8}) {
      EngineConfig cfg = base_config();
      cfg.kv_dtype = dt;
      cfg.kv_pages = 0;
      cfg.kv_memory = std::size_t{3} << 20;
      int64_t tokens = 0;
      const Status st = run_local(p, [&](Communicator& comm) -> Status {
        auto e = Engine::create(comm, *m, cfg);
        TREEATTN_RETURN_IF_ERROR(e.status());
        if (comm.rank() == 0) {
          tokens = (*e)->max_sequence_tokens();
          (*e)->stop(true);
        }
        return (*e)->run();
      });
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const std::size_t page = 3 * 2 * 16 * kv_head_token_bytes(64, dt);  // every layer's
      EXPECT_EQ(page, dt == DType::kF16 ? 3u * 2 * 16 * 256 : 3u * 2 * 16 * 132);
      EXPECT_EQ(tokens, p * static_cast<int64_t>(cfg.kv_memory / page) * 16) << dtype_name(dt);
      if (dt == DType::kF16) {
        f16_tokens = tokens;
        continue;
      }
      const double ratio = static_cast<double>(tokens) / static_cast<double>(f16_tokens);
      std::printf("[ kv %-4s   ] p %d: %lld tokens in %zu bytes per rank, %.3fx f16's\n",
                  std::string(dtype_name(dt)).c_str(), p, static_cast<long long>(tokens),
                  cfg.kv_memory, ratio);
      EXPECT_GE(ratio, 1.9) << dtype_name(dt) << " p " << p;
    }
  }
}

// The K/V exchange (exchange.hpp) gives pass-Q's bits: the same requests, staggered, chunked and
// with prefix reuse, under prefill_exchange pass-q, kv and auto, for every merge that allows kv,
// at 1-4 ranks; on a Llama-style model and on a Gemma-3-style one (sliding-window layers:
// the exchanged pages are cut at the window like the owners' own).
TEST(Engine, KVExchangeGivesPassQsBitsForEveryMergeAndRankCount) {
  for (const bool windows : {false, true}) {
    testing::TinyLlamaSpec spec;
    if (windows) {
      spec.architecture = "gemma3";
      spec.layers = 6;  // five local layers and one global
      spec.sliding_window = 20;
    }
    TinyModel m(spec);
    auto subs = mixed_requests(windows ? 17 : 13);
    subs.resize(10);
    for (int p : {1, 2, 3, 4})
      for (const std::string merge : {"tree", "allgather", "hier", "tree-det", "ring-state"}) {
        EngineConfig cfg = base_config();
        cfg.merge = merge;
        cfg.prefill_chunk = 40;
        cfg.prefill_exchange = "pass-q";
        const auto ref = run_engine(*m, p, cfg, subs, false);
        ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
        EXPECT_EQ(ref.metrics.rows_kv_exchange, 0);
        for (const std::string x : {"kv", "auto"}) {
          cfg.prefill_exchange = x;
          const auto got = run_engine(*m, p, cfg, subs, false);
          ASSERT_TRUE(got.status.is_ok()) << got.status.to_string();
          for (std::size_t i = 0; i < subs.size(); ++i)
            EXPECT_EQ(same_bits(ref.out[i], got.out[i]), "")
                << (windows ? "gemma3 " : "llama ") << x << " p " << p << " merge " << merge
                << " request " << i;
          if (p == 1) {
            EXPECT_EQ(got.metrics.rows_kv_exchange, 0) << "one rank has nothing to exchange";
          } else {
            EXPECT_GT(got.metrics.rows_kv_exchange, 0) << x << " p " << p;
            EXPECT_GT(got.metrics.kv_exchange_bytes, 0) << x << " p " << p;
            if (x == "auto") EXPECT_GT(got.metrics.rows_pass_q, 0) << "decode rows pass queries";
            else EXPECT_EQ(got.metrics.rows_pass_q, 0) << "kv: every row moves K/V";
          }
        }
      }
  }
}

// --dense split (EngineConfig::dense): each rank computes its slice of every projection's output
// rows for every row, and the all-gathered outputs give exactly the replicated path's bits. On
// llama (tied head), qwen2 (q/k/v biases, an output head) and gemma3 (q/k norms, post norms,
// GELU, sliding windows) files, exact and int8, at 1-4 ranks (3: uneven slices): the staggered
// batch (chunked prefill, prefix reuse, the K/V exchange of fresh prompts) gives every request
// the bits it gets alone, split or replicated, and those are the replicated path's bits at the
// same rank count. (Across rank counts the attention's merge order changes the last bits, split
// or not: DenseSplitWithinOnePageGivesOneRanksBitsAtEveryRankCount compares them where it does
// not.)
TEST(Engine, DenseSplitGivesTheReplicatedBitsAloneAndInABatchAtOneToFourRanks) {
  std::vector<testing::TinyLlamaSpec> specs(3);
  specs[1].architecture = "qwen2";
  specs[1].qkv_bias = true;
  specs[1].output_weight = true;
  specs[1].n_vocab = 301;  // the head's last slice ends mid-group
  specs[2].architecture = "gemma3";
  specs[2].layers = 6;
  specs[2].sliding_window = 20;
  for (std::size_t k = 0; k < specs.size(); ++k) {
    TinyModel m(specs[k]);
    auto subs = mixed_requests(31 + k);
    subs.resize(9);
    for (auto& sub : subs)
      for (auto& t : sub.req.prompt) t %= static_cast<TokenId>(specs[k].n_vocab);
    for (const model::MatmulMode mode : {model::MatmulMode::kExact, model::MatmulMode::kInt8})
      for (int p : {1, 2, 3, 4}) {
        SCOPED_TRACE(specs[k].architecture + " " + std::string(model::matmul_mode_name(mode)) +
                     " p " + std::to_string(p));
        EngineConfig alone_cfg = base_config();
        alone_cfg.matmul = mode;
        alone_cfg.prefix_cache = false;
        alone_cfg.prefill_chunk = 4096;
        alone_cfg.dense = "replicated";
        const auto ref = run_engine(*m, p, alone_cfg, subs, true);
        ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
        alone_cfg.dense = "split";
        const auto alone = run_engine(*m, p, alone_cfg, subs, true);
        ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
        EngineConfig batch_cfg = alone_cfg;
        batch_cfg.prefix_cache = true;
        batch_cfg.prefill_chunk = 24;
        const auto batch = run_engine(*m, p, batch_cfg, subs, false);
        ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
        int64_t cached = 0;
        for (std::size_t i = 0; i < subs.size(); ++i) {
          EXPECT_EQ(same_bits(ref.out[i], alone.out[i]), "") << "split alone, request " << i;
          EXPECT_EQ(same_bits(ref.out[i], batch.out[i]), "") << "split in a batch, request " << i;
          cached += batch.out[i].cached;
        }
        EXPECT_GT(cached, 0) << "the shared prefix was never reused";
        if (p > 1) {
          EXPECT_GT(alone.metrics.rows_kv_exchange, 0) << "fresh prompts move K/V";
          EXPECT_GT(batch.metrics.rows_kv_exchange, 0);
        }
        expect_every_page_back(batch, p, batch_cfg.kv_pages);
      }
  }
}

// Where a sequence fits one page (page 0 lives on rank 0), the other ranks' attention states
// are the merge's identity and the merge adds nothing: then the logits are one rank's bits at
// every rank count, and split gives them too, exact and int8, alone and in a batch.
TEST(Engine, DenseSplitWithinOnePageGivesOneRanksBitsAtEveryRankCount) {
  testing::TinyLlamaSpec spec;
  spec.architecture = "qwen2";
  spec.qkv_bias = true;
  TinyModel m(spec);
  std::mt19937_64 rng(8);
  std::vector<Submitted> subs;
  for (int i = 0; i < 5; ++i) subs.push_back({i, greedy(random_tokens(rng, 30 + 40 * i, 320), 9)});
  for (const model::MatmulMode mode : {model::MatmulMode::kExact, model::MatmulMode::kInt8}) {
    EngineConfig cfg = base_config();
    cfg.matmul = mode;
    cfg.page_tokens = 256;
    cfg.kv_pages = 8;
    cfg.prefill_chunk = 64;
    cfg.dense = "replicated";
    const auto one = run_engine(*m, 1, cfg, subs, true);
    ASSERT_TRUE(one.status.is_ok()) << one.status.to_string();
    for (int p : {2, 3, 4})
      for (const std::string dense : {"split", "replicated"})
        for (const bool alone : {true, false}) {
          cfg.dense = dense;
          const auto got = run_engine(*m, p, cfg, subs, alone);
          ASSERT_TRUE(got.status.is_ok()) << got.status.to_string();
          for (std::size_t i = 0; i < subs.size(); ++i)
            EXPECT_EQ(same_bits(one.out[i], got.out[i]), "")
                << model::matmul_mode_name(mode) << " p " << p << " " << dense
                << (alone ? " alone" : " batch") << " request " << i;
        }
  }
}

// The choice is named, the same on every rank; split holds about 1/p of the weights per rank
// (uneven at 3), its rows8 copy only its rows; replicated and one rank hold them all; a bad
// name is refused on every rank.
TEST(Engine, DenseChoiceIsNamedAndSplitHoldsASliceOfTheWeightsOnEachRank) {
  testing::TinyLlamaSpec spec;
  spec.override_type = 8;  // q8_0: every matrix has a rows8 layout
  TinyModel m(spec);
  const std::size_t whole = (*m).weights().bytes();
  for (int p : {1, 2, 3, 4})
    for (const std::string dense : {"split", "replicated", "auto"}) {
      std::vector<DenseChoice> got(static_cast<std::size_t>(p));
      const Status st = run_local(p, [&](Communicator& comm) -> Status {
        EngineConfig cfg = base_config();
        cfg.dense = dense;
        cfg.matmul = model::MatmulMode::kInt8;
        auto e = Engine::create(comm, *m, cfg);
        TREEATTN_RETURN_IF_ERROR(e.status());
        got[static_cast<std::size_t>(comm.rank())] = (*e)->dense_choice();
        return Status::ok();
      });
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      std::size_t sum = 0, sum8 = 0;
      for (const DenseChoice& c : got) {
        EXPECT_EQ(c.split, got[0].split);
        EXPECT_EQ(c.how, got[0].how);
        sum += c.weight_bytes;
        sum8 += c.rows8_bytes;
        EXPECT_NE(describe_dense(c).find(c.mode()), std::string::npos);
      }
      if (p == 1) {
        EXPECT_FALSE(got[0].split) << dense << ": one rank has nothing to split";
      }
      if (dense == "split" && p > 1) {
        EXPECT_TRUE(got[0].split);
        EXPECT_EQ(sum, whole) << "the slices partition the weights";
        EXPECT_GT(sum8, 0u);
        for (const DenseChoice& c : got) {
          EXPECT_LE(c.weight_bytes, whole / static_cast<std::size_t>(p) * 3 / 2) << "p " << p;
          EXPECT_LE(c.rows8_bytes, sum8 / static_cast<std::size_t>(p) * 3 / 2) << "p " << p;
        }
      }
      if (dense == "replicated" || p == 1) {
        for (const DenseChoice& c : got) EXPECT_EQ(c.weight_bytes, whole);
      }
      if (dense == "auto" && p > 1) {
        EXPECT_EQ(got[0].how.rfind("auto: planned on topology", 0), 0u) << got[0].how;
        EXPECT_GT(got[0].predicted_split_us, 0);
        EXPECT_GT(got[0].predicted_replicated_us, 0);
        EXPECT_EQ(got[0].collectives_per_token, 4 * spec.layers + 2);
        EXPECT_EQ(got[0].split, got[0].predicted_split_us < got[0].predicted_replicated_us);
        EXPECT_GT(got[0].weight_gbps, 0) << "rank 0's measured weight read rate";
        for (const DenseChoice& c : got) EXPECT_EQ(c.weight_gbps, got[0].weight_gbps);
      }
    }
  // The planner's per-rank share is counted from the row ranges without mapping the slices: it
  // is the largest of the slices LlamaModel::slice maps.
  for (int p : {1, 2, 3, 4, 7}) {
    double largest = 0;
    for (int i = 0; i < p; ++i) {
      auto s = (*m).slice(i, p);
      ASSERT_TRUE(s.is_ok()) << s.status().to_string();
      largest = std::max(largest, static_cast<double>(s->bytes()));
    }
    const DenseQuery q = dense_query(*m, p);
    EXPECT_EQ(q.slice_bytes, largest) << p << " ranks";
    EXPECT_EQ(q.weight_bytes, static_cast<double>(whole));
  }
  std::vector<std::string> msgs(2);
  const Status bad = run_local(2, [&](Communicator& comm) -> Status {
    EngineConfig cfg = base_config();
    cfg.dense = "sharded";
    auto e = Engine::create(comm, *m, cfg);
    msgs[static_cast<std::size_t>(comm.rank())] = e.status().message();
    return e.status();
  });
  EXPECT_FALSE(bad.is_ok());
  for (const auto& s : msgs)
    EXPECT_NE(s.find("dense 'sharded': expected split, replicated or auto"), std::string::npos)
        << s;
}

// Sliding-window layers keep their K/V in window pages that a sequence drops once its window
// has passed them (kv_manager.hpp). On a gemma3 model (five local layers of window 20, one
// global), every request gives the bits it gives with every position kept (kv_window_pages 0,
// alone): in a staggered batch with prefix reuse, in a window pool so small that requests are
// preempted, at 1-4 ranks; and a long request alone holds at most the pages its window and a
// prefill chunk span while its full pages grow with it.
TEST(Engine, WindowPagesDropWhatTheWindowPassedAndChangeNoBit) {
  testing::TinyLlamaSpec spec;
  spec.architecture = "gemma3";
  spec.layers = 6;
  spec.sliding_window = 20;
  TinyModel m(spec);
  auto subs = mixed_requests(23);
  std::mt19937_64 rng(5);
  subs.push_back({2, greedy(random_tokens(rng, 200, 320), 60)});
  for (int p : {1, 2, 3, 4}) {
    EngineConfig all_cfg = base_config();
    all_cfg.prefix_cache = false;
    all_cfg.prefill_chunk = 4096;
    all_cfg.kv_window_pages = 0;
    const auto ref = run_engine(*m, p, all_cfg, subs, true);
    ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
    EXPECT_EQ(ref.metrics.window_pages_per_rank, 0);

    EngineConfig cfg = base_config();
    cfg.prefill_chunk = 24;
    const auto batch = run_engine(*m, p, cfg, subs, false);
    ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
    ASSERT_GT(batch.metrics.window_pages_per_rank, 0) << "p " << p;
    ASSERT_EQ(batch.metrics.layer_in_window,
              (std::vector<uint8_t>{1, 1, 1, 1, 1, 0}));
    int64_t cached = 0;
    for (std::size_t i = 0; i < subs.size(); ++i) {
      EXPECT_EQ(same_bits(ref.out[i], batch.out[i]), "") << "p " << p << " request " << i;
      cached += batch.out[i].cached;
    }
    EXPECT_GE(cached, 64) << "p " << p << ": the shared prefix was never reused";
    expect_every_page_back(batch, p, cfg.kv_pages);
    for (int r = 0; r < p; ++r)
      EXPECT_EQ(batch.metrics.window_pages_used[static_cast<std::size_t>(r)], 0);

    // The smallest window pool the engine accepts: one sequence's window and chunk.
    EngineConfig tight = cfg;
    tight.kv_window_pages = lone_sequence_window_pages(tight, *m, p);
    ASSERT_GT(tight.kv_window_pages, 0);
    const auto small = run_engine(*m, p, tight, subs, false);
    ASSERT_TRUE(small.status.is_ok()) << small.status.to_string();
    for (std::size_t i = 0; i < subs.size(); ++i)
      EXPECT_EQ(same_bits(ref.out[i], small.out[i]), "") << "p " << p << " request " << i;
    EXPECT_GE(small.metrics.preemptions_total, 1) << "p " << p;
    tight.kv_window_pages -= 1;
    const auto refused = run_engine(*m, p, tight, subs, false);
    EXPECT_EQ(refused.status.code(), Code::kInvalidArgument) << refused.status.to_string();
    EXPECT_NE(refused.status.message().find("kv_window_pages"), std::string::npos)
        << refused.status.to_string();

    // The long request alone: window pages in use (over the ranks) at every token.
    int64_t most_window = 0, most_full = 0;
    const std::vector<Submitted> one{subs.back()};
    const auto alone = run_engine(*m, p, cfg, one, true,
                                  [&](Engine& eng, RequestId, const TokenEvent&) {
                                    const EngineMetrics em = eng.metrics();
                                    int64_t w = 0, f = 0;
                                    for (int r = 0; r < p; ++r) {
                                      w += em.window_pages_used[static_cast<std::size_t>(r)];
                                      f += em.pages_used[static_cast<std::size_t>(r)];
                                    }
                                    most_window = std::max(most_window, w);
                                    most_full = std::max(most_full, f);
                                  });
    ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
    EXPECT_EQ(same_bits(ref.out.back(), alone.out[0]), "") << "p " << p;
    // A decode step's query sees 20 positions: at most 3 pages of 16 (2 and a partial one).
    EXPECT_LE(most_window, 3) << "p " << p;
    EXPECT_GE(most_full, (200 + 58) / 16) << "p " << p;
  }
}

TEST(Engine, KVExchangeWithAMergeWithoutALocalTwinIsRefusedOnEveryRank) {
  TinyModel m;
  EngineConfig cfg = base_config();
  cfg.merge = "tree-paper";  // rescales into the sum form: no local twin
  cfg.prefill_exchange = "kv";
  std::vector<std::string> errors(3);
  const Status st = run_local(3, [&](Communicator& comm) -> Status {
    auto e = Engine::create(comm, *m, cfg);
    errors[static_cast<std::size_t>(comm.rank())] = e.status().message();
    return e.status();
  });
  EXPECT_FALSE(st.is_ok());
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(errors[static_cast<std::size_t>(r)].find("rank"), std::string::npos) << errors[r];
  EXPECT_NE(errors[0].find("tree-paper"), std::string::npos) << errors[0];
  cfg.prefill_exchange = "sideways";
  const Status bad = run_local(2, [&](Communicator& comm) -> Status {
    return Engine::create(comm, *m, cfg).status();
  });
  EXPECT_NE(bad.message().find("auto, pass-q, kv"), std::string::npos) << bad.to_string();
}

TEST(Engine, AllgatherMergeIsBatchInvariantAndAgreesWithTheTreeWithinRounding) {
  TinyModel m;
  auto subs = mixed_requests(12);
  subs.resize(8);
  EngineConfig cfg = base_config();
  cfg.merge = "allgather";
  cfg.prefix_cache = false;
  const auto alone = run_engine(*m, 3, cfg, subs, true);
  ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
  cfg.prefix_cache = true;
  cfg.prefill_chunk = 20;
  const auto batch = run_engine(*m, 3, cfg, subs, false);
  ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
  for (std::size_t i = 0; i < subs.size(); ++i)
    EXPECT_EQ(same_bits(alone.out[i], batch.out[i]), "") << "request " << i;
}

TEST(Engine, FollowUpTurnReusesTheConversationsPagesAndGivesTheSameBits) {
  TinyModel m;
  std::mt19937_64 rng(21);
  const auto doc = random_tokens(rng, 100, 320);
  EngineConfig cfg = base_config();
  // Turn 1, then turn 2 = turn 1's prompt + its answer + a question, in one engine.
  const auto first = run_engine(*m, 2, cfg, {{0, greedy(doc, 12)}}, true);
  ASSERT_TRUE(first.status.is_ok()) << first.status.to_string();
  std::vector<TokenId> follow = doc;
  follow.insert(follow.end(), first.out[0].tokens.begin(), first.out[0].tokens.end());
  const auto question = random_tokens(rng, 9, 320);
  follow.insert(follow.end(), question.begin(), question.end());
  const auto both = run_engine(*m, 2, cfg, {{0, greedy(doc, 12)}, {0, greedy(follow, 6)}}, true);
  ASSERT_TRUE(both.status.is_ok()) << both.status.to_string();
  // doc (100) + 11 stored answer tokens = 111 positions: 6 full pages of 16 = 96 tokens.
  EXPECT_EQ(both.out[1].cached, 96);
  cfg.prefix_cache = false;
  const auto cold = run_engine(*m, 2, cfg, {{0, greedy(follow, 6)}}, true);
  ASSERT_TRUE(cold.status.is_ok());
  EXPECT_EQ(cold.out[0].cached, 0);
  EXPECT_EQ(same_bits(both.out[1], cold.out[0]), "");
}

// Four requests for one 100-token document (different questions) arrive in the same step with
// an unrelated one: the document is prefilled once; the other three wait for its pages and
// take them from the cache (6 full pages of 16), the unrelated request does not wait behind
// them, and every request gets the bits it gets alone.
TEST(Engine, RequestsArrivingTogetherForOneDocumentPrefillItOnce) {
  TinyModel m;
  std::mt19937_64 rng(33);
  const auto doc = random_tokens(rng, 100, 320);
  std::vector<Submitted> subs;
  for (int i = 0; i < 4; ++i) {
    auto prompt = doc;
    const auto question = random_tokens(rng, 5 + i, 320);
    prompt.insert(prompt.end(), question.begin(), question.end());
    subs.push_back({0, greedy(prompt, 4)});
    if (i == 1) subs.push_back({0, greedy(random_tokens(rng, 40, 320), 4)});
  }
  EngineConfig cfg = base_config();
  cfg.prefix_cache = false;
  const auto alone = run_engine(*m, 2, cfg, subs, true);
  ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
  cfg.prefix_cache = true;
  cfg.prefill_chunk = 20;
  const auto batch = run_engine(*m, 2, cfg, subs, false);
  ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
  EXPECT_EQ(batch.out[0].cached, 0);
  EXPECT_EQ(batch.out[2].cached, 0);  // the unrelated one
  for (std::size_t i : {1u, 3u, 4u}) EXPECT_EQ(batch.out[i].cached, 96) << "request " << i;
  EXPECT_EQ(batch.metrics.cached_tokens_total, 3 * 96);
  for (std::size_t i = 0; i < subs.size(); ++i)
    EXPECT_EQ(same_bits(alone.out[i], batch.out[i]), "") << "request " << i;
}

TEST(Engine, AdmissionWaitsForPagesEvictsCachedOnesAndLeaksNothing) {
  TinyModel m;
  std::mt19937_64 rng(5);
  EngineConfig cfg = base_config();
  cfg.kv_pages = 6;  // per rank; 2 ranks: 12 pages of 16 = 192 positions
  std::vector<Submitted> subs;
  for (int i = 0; i < 10; ++i) subs.push_back({0, greedy(random_tokens(rng, 60 + i, 320), 4)});
  const auto res = run_engine(*m, 2, cfg, subs, false);
  ASSERT_TRUE(res.status.is_ok()) << res.status.to_string();
  for (const auto& o : res.out) EXPECT_EQ(o.finish, FinishReason::kLength);
  expect_every_page_back(res, 2, 6);
  EXPECT_EQ(res.metrics.running, 0);
  EXPECT_EQ(res.metrics.generated_tokens_total, 40);
}

TEST(Engine, CancelEndsTheRequestAndFreesItsPages) {
  TinyModel m;
  std::mt19937_64 rng(8);
  EngineConfig cfg = base_config();
  std::vector<Submitted> subs = {{0, greedy(random_tokens(rng, 50, 320), 200)},
                                 {0, greedy(random_tokens(rng, 30, 320), 5)}};
  const auto res = run_engine(*m, 3, cfg, subs, false,
                              [](Engine& e, RequestId id, const TokenEvent& ev) {
                                if (ev.index == 2 && ev.finish == FinishReason::kNone && id == 1)
                                  e.cancel(id);
                              });
  ASSERT_TRUE(res.status.is_ok()) << res.status.to_string();
  EXPECT_EQ(res.out[0].finish, FinishReason::kCancelled);
  EXPECT_LT(res.out[0].tokens.size(), 10u);
  EXPECT_EQ(res.out[1].finish, FinishReason::kLength);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(res.metrics.pages_used[static_cast<std::size_t>(r)], 0);
}

TEST(Engine, BadRequestsAreRefusedWithTheirReason) {
  TinyModel m;
  const Status st = run_local(2, [&](Communicator& comm) -> Status {
    EngineConfig cfg = base_config();
    cfg.kv_pages = 4;  // 2 ranks x 4 pages x 16 tokens = 128 positions
    auto e = Engine::create(comm, *m, cfg);
    TREEATTN_RETURN_IF_ERROR(e.status());
    Engine& eng = **e;
    if (comm.rank() == 1) {
      auto r = eng.submit(greedy({1, 2}, 1), {});
      EXPECT_FALSE(r.is_ok());
      EXPECT_NE(r.status().message().find("only rank 0"), std::string::npos);
      return eng.run();
    }
    EXPECT_EQ(eng.max_sequence_tokens(), 128);
    auto expect_refused = [&](Request r, const std::string& words) {
      auto id = eng.submit(std::move(r), {});
      ASSERT_FALSE(id.is_ok()) << words;
      EXPECT_EQ(id.status().code(), Code::kInvalidArgument);
      EXPECT_NE(id.status().message().find(words), std::string::npos) << id.status().message();
    };
    expect_refused(greedy({}, 4), "empty");
    expect_refused(greedy({1, 320}, 4), "outside the vocabulary");
    expect_refused(greedy({1, 2}, 0), "max_new_tokens");
    Request stop = greedy({1, 2}, 3);
    stop.stop_tokens = {-1};
    expect_refused(stop, "stop token");
    std::vector<TokenId> longp(120, 3);
    expect_refused(greedy(longp, 10), "129 positions to store");  // both numbers named
    expect_refused(greedy(longp, 10), "at most 128");
    expect_refused(greedy({1, 2}, std::numeric_limits<int64_t>::max() - 2), "max_new_tokens");
    Request hot = greedy({1, 2}, 3);
    hot.sampling.top_p = 0;
    expect_refused(hot, "top-p");
    Request bias = greedy({1, 2}, 3);
    bias.sampling.logit_bias = {{320, 1.0}};
    expect_refused(bias, "logit_bias token id 320");
    Request lp = greedy({1, 2}, 3);
    lp.logprobs = model::kMaxTopLogprobs + 1;
    expect_refused(lp, "logprobs");
    eng.stop(false);
    auto last = eng.step();
    return last.status();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(Engine, MismatchedConfigurationsAndUnknownMergeAreNamedOnEveryRank) {
  TinyModel m;
  std::vector<std::string> msgs(2);
  Status st = run_local(2, [&](Communicator& comm) -> Status {
    EngineConfig cfg = base_config();
    cfg.max_batch = comm.rank() == 1 ? 7 : 16;
    auto e = Engine::create(comm, *m, cfg);
    msgs[static_cast<std::size_t>(comm.rank())] = e.status().message();
    return e.status();
  });
  EXPECT_FALSE(st.is_ok());
  for (const auto& s : msgs) EXPECT_NE(s.find("rank 1's model or engine configuration"), std::string::npos) << s;
  st = run_local(2, [&](Communicator& comm) -> Status {
    EngineConfig cfg = base_config();
    cfg.merge = "ring";
    return Engine::create(comm, *m, cfg).status();
  });
  EXPECT_NE(st.message().find("--method 'ring' is not a strategy"), std::string::npos)
      << st.to_string();
  st = run_local(2, [&](Communicator& comm) -> Status {
    EngineConfig cfg = base_config();
    cfg.merge = "ring-kv";
    return Engine::create(comm, *m, cfg).status();
  });
  EXPECT_NE(st.message().find("cannot merge a batch of states"), std::string::npos)
      << st.to_string();
}

// An explicit kernel target the CPU lacks is refused at creation on every rank, by name (not by
// the first matmul of a request, or a SIGILL); one it has is taken. Each x86 target is checked
// on the branch this CPU takes (an AVX-512 machine takes the second for both).
TEST(Engine, AnIsaThisCpuCannotRunIsRefusedOnEveryRankAtCreation) {
  TinyModel m;
  for (const Isa isa : {Isa::kAvx512, Isa::kAvx2}) {
    std::vector<std::string> msgs(2);
    const Status st = run_local(2, [&](Communicator& comm) -> Status {
      EngineConfig cfg = base_config();
      cfg.isa = isa;
      auto e = Engine::create(comm, *m, cfg);
      msgs[static_cast<std::size_t>(comm.rank())] = e.status().message();
      return e.status();
    });
    if (isa_supported(isa)) {
      EXPECT_TRUE(st.is_ok()) << isa_name(isa) << ": " << st.to_string();
      continue;
    }
    EXPECT_FALSE(st.is_ok()) << isa_name(isa);
    for (const auto& s : msgs)
      EXPECT_NE(s.find("cannot run the " + std::string(isa_name(isa)) + " target"),
                std::string::npos)
          << s;
  }
}

TEST(Engine, ARankThatNeverArrivesEndsEveryRequestWithAnErrorNotAHang) {
  TinyModel m;
  std::mt19937_64 rng(9);
  std::vector<Outcome> got(1);
  int finals = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = run_local(3, [&](Communicator& comm) -> Status {
    EngineConfig cfg = base_config();
    cfg.timeout = std::chrono::milliseconds(2000);
    auto e = Engine::create(comm, *m, cfg);
    TREEATTN_RETURN_IF_ERROR(e.status());
    if (comm.rank() == 2) return Status::ok();  // leaves: its communicator goes away
    if (comm.rank() == 1) return (*e)->run();
    auto id = (*e)->submit(greedy(random_tokens(rng, 20, 320), 50), [&](const TokenEvent& ev) {
      if (ev.finish != FinishReason::kNone) {
        ++finals;
        got[0].finish = ev.finish;
        got[0].error = ev.error;
      }
    });
    TREEATTN_RETURN_IF_ERROR(id.status());
    const Status st0 = (*e)->run();
    // After a failure the engine stays failed: no more steps, no more events, no new requests.
    auto again = (*e)->step();
    EXPECT_FALSE(again.is_ok());
    EXPECT_FALSE((*e)->submit(greedy({1, 2}, 2), {}).is_ok());
    EXPECT_EQ((*e)->metrics().running, 0);
    return st0;
  });
  EXPECT_EQ(finals, 1);
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(got[0].finish, FinishReason::kError);
  EXPECT_FALSE(got[0].error.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(Engine, RequestsStillQueuedWhenTheEngineGoesAwayEndCancelled) {
  TinyModel m;
  std::vector<FinishReason> ends;
  const Status st = run_local(1, [&](Communicator& comm) -> Status {
    auto e = Engine::create(comm, *m, base_config());
    TREEATTN_RETURN_IF_ERROR(e.status());
    for (int i = 0; i < 2; ++i) {
      auto id = (*e)->submit(greedy({1, 2, 3}, 4), [&](const TokenEvent& ev) {
        if (ev.finish != FinishReason::kNone) ends.push_back(ev.finish);
      });
      TREEATTN_RETURN_IF_ERROR(id.status());
    }
    return Status::ok();  // the engine is destroyed without a step
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(ends, (std::vector<FinishReason>{FinishReason::kCancelled, FinishReason::kCancelled}));
}

}  // namespace
}  // namespace treeattn::engine
