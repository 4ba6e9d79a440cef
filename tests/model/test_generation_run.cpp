// generation::run_generation (generation.hpp), the library call behind `treeattn generate`, at
// 1 and 2 in-process ranks on the real model (skipped without it): the session path gives the
// Generator's greedy tokens on every rank, the engine path a full answer with every rank's
// numbers, "auto" one choice on every rank, errors as values; and the engine's int8 and fp8 KV
// pages against f16 pages on the real model (the quantization error, printed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <mutex>

#include "model/generate_harness.hpp"
#include "engine/layer_merge.hpp"
#include "model/model_path.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/generation.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn {
namespace {

using generation::Output;
using generation::Request;

Request base_request(const std::string& path) {
  Request r;
  r.model_path = path;
  r.prompt.synthetic_tokens = 24;
  r.prompt.seed = 3;
  r.new_tokens = 6;
  r.ignore_eos = true;
  r.matmul = model::MatmulMode::kExact;
  r.kv_dtype = DType::kF32;
  r.threads = 1;
  r.timeout = std::chrono::milliseconds(120000);
  return r;
}

// Every rank's output.
std::vector<Output> run(int ranks, const Request& r, const generation::Hooks& hooks = {}) {
  std::vector<Output> out(static_cast<std::size_t>(ranks));
  const Status st = run_local(ranks, [&](Communicator& comm) -> Status {
    out[static_cast<std::size_t>(comm.rank())] = generation::run_generation(comm, r, hooks);
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

TEST(GenerationRun, MissingModelIsAnErrorValue) {
  Request r;
  r.model_path = "/nonexistent/model.gguf";
  const auto out = run(2, r);
  for (const Output& o : out) {
    EXPECT_FALSE(o.status.is_ok());
    EXPECT_FALSE(o.must_abort);
  }
}

TEST(GenerationRun, SessionPathGivesTheGeneratorsTokensOnEveryRank) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  auto m = model::LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto tok = Tokenizer::from_gguf((*m)->file());
  ASSERT_TRUE(tok.is_ok());
  Request r = base_request(path);
  r.methods = {"tree", "ring-kv"};
  auto prompt = generation::make_prompt(r.prompt, *tok);
  ASSERT_TRUE(prompt.is_ok()) << prompt.status().to_string();
  ASSERT_EQ(prompt->size(), 24u);
  for (const int P : {1, 2}) {
    testing::GenCase c;
    c.kv = DType::kF32;
    c.steps = static_cast<int>(r.new_tokens);
    const auto want = testing::run_generation(**m, P, c, *prompt);
    ASSERT_TRUE(want.status.is_ok()) << want.status.to_string();
    std::string streamed;
    generation::Hooks hooks;
    hooks.text = [&](std::string_view s) { streamed += s; };  // rank 0 only
    const auto out = run(P, r, hooks);
    for (int q = 0; q < P; ++q) {
      const Output& o = out[static_cast<std::size_t>(q)];
      ASSERT_TRUE(o.status.is_ok()) << "P=" << P << " rank " << q << ": " << o.status.to_string();
      EXPECT_EQ(o.prompt, *prompt);
      ASSERT_EQ(o.methods.size(), 2u);
      EXPECT_EQ(o.methods[0].method, "tree");
      EXPECT_EQ(o.methods[0].tokens, want.tokens[0]) << "P=" << P << " rank " << q;
      EXPECT_EQ(o.methods[0].step_ms.size(), static_cast<std::size_t>(r.new_tokens - 1));
      EXPECT_EQ(o.methods[1].tokens.size(), o.methods[0].tokens.size());
      EXPECT_TRUE(o.ranks_agree);
      EXPECT_EQ(o.token_hash_by_rank.size(), static_cast<std::size_t>(P));
      EXPECT_EQ(o.peak_rss_by_rank.size(), static_cast<std::size_t>(P));
      EXPECT_EQ(o.methods[0].bytes_sent_per_token_by_rank.size(), static_cast<std::size_t>(P));
      if (P > 1) {
        EXPECT_GT(o.methods[0].bytes_sent_per_token_by_rank[0], 0.0);
      }
    }
    auto text = tok->decode(want.tokens[0]);
    ASSERT_TRUE(text.is_ok());
    EXPECT_EQ(out[0].text, *text);
    EXPECT_EQ(streamed, *text);  // whole, in order, nothing held back at the end
  }
}

// Every strategy that merges a batch of states, as the engine's --method at 2, 3 and 4 ranks on
// the shipped model: the greedy tokens of one rank (a clear argmax at every step of this prompt).
TEST(GenerationRun, EveryEngineMethodGivesTheGreedyTokensOfOneRank) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Request r = base_request(path);
  r.engine = true;
  r.kv_dtype = DType::kF16;
  r.methods = {"auto"};
  const auto one = run(1, r);
  ASSERT_TRUE(one[0].status.is_ok()) << one[0].status.to_string();
  ASSERT_EQ(one[0].tokens.size(), static_cast<std::size_t>(r.new_tokens));
  for (const std::string& method : engine::merge_methods(CommCapabilities{}))
    for (int P : {2, 3, 4}) {
      r.methods = {method};
      const auto out = run(P, r);
      for (const Output& o : out) ASSERT_TRUE(o.status.is_ok()) << method << ": " << o.status.to_string();
      EXPECT_EQ(out[0].merge_choice.strategy, method);
      EXPECT_EQ(out[0].tokens, one[0].tokens) << method << " at " << P << " ranks";
    }
}

TEST(GenerationRun, EnginePathAnswersWithEveryRanksNumbers) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Request r = base_request(path);
  r.engine = true;
  r.kv_dtype = DType::kF16;
  std::vector<TokenId> first;
  for (const int P : {1, 2}) {
    int started = 0;
    generation::Hooks hooks;
    hooks.started = [&](const generation::Start& s) {
      ++started;
      EXPECT_EQ(s.ranks, P);
      // auto (the default): the planner's batch-invariant choice, named in the banner.
      ASSERT_EQ(s.methods.size(), 1u);
      EXPECT_NE(s.methods[0], "auto");
      const std::string how = P == 1 ? " (auto: one rank" : " (auto on topology";
      EXPECT_NE(s.merge_description.find(s.methods[0] + how), std::string::npos)
          << s.merge_description;
      EXPECT_NE(s.merge_description.find(", batch invariant"), std::string::npos)
          << s.merge_description;
      EXPECT_GT(s.pages_per_rank, 0);
    };
    const auto out = run(P, r, hooks);
    EXPECT_EQ(started, 1);
    for (const Output& o : out) ASSERT_TRUE(o.status.is_ok()) << o.status.to_string();
    const Output& o = out[0];
    EXPECT_TRUE(o.merge_choice.batch_invariant);
    EXPECT_EQ(o.merge_choice.ranking.empty(), P == 1);
    ASSERT_EQ(o.tokens.size(), static_cast<std::size_t>(r.new_tokens));
    EXPECT_EQ(o.token_ms.size(), o.tokens.size() - 1);
    EXPECT_EQ(o.bytes_sent_by_rank.size(), static_cast<std::size_t>(P));
    EXPECT_EQ(o.peak_rss_by_rank.size(), static_cast<std::size_t>(P));
    EXPECT_FALSE(o.text.empty());
    if (P == 1) {
      first = o.tokens;
    } else {
      EXPECT_GT(o.merges, 0);
      EXPECT_EQ(o.tokens.front(), first.front());  // the prefill's argmax, a clear one here
    }
  }
}

// `auto` at 2 ranks: the planner is asked once (rank 0's hook) and every rank runs its choice.
void expect_one_planned_method(const Request& r) {
  std::string planned;
  generation::Hooks hooks;
  hooks.planned = [&](const StrategyChoice& c) { planned = c.strategy; };
  const auto out = run(2, r, hooks);
  ASSERT_FALSE(planned.empty());
  for (const Output& o : out) {
    ASSERT_TRUE(o.status.is_ok()) << o.status.to_string();
    ASSERT_EQ(o.methods.size(), 1u);
    EXPECT_EQ(o.methods[0].method, planned);
  }
}

TEST(GenerationRun, AutoIsOneChoiceOnEveryRank) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Request r = base_request(path);
  r.methods = {"auto"};
  r.new_tokens = 2;
  auto t = preset_topology("local");
  ASSERT_TRUE(t.is_ok());
  r.topology = *t;
  r.topology->ranks_per_node = 2;
  r.ranks_per_node = 2;
  expect_one_planned_method(r);
}

// A library caller that names no topology: "auto" plans on the job's own (job_topology_of),
// as the engine path does, on the session path too.
TEST(GenerationRun, AutoWithoutATopologyPlansOnTheJob) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Request r = base_request(path);
  r.methods = {"auto"};
  r.new_tokens = 2;
  ASSERT_FALSE(r.topology.has_value());
  expect_one_planned_method(r);
}

// One greedy request through the engine at `ranks` in-process ranks: its tokens and the logits
// each was chosen from.
struct Greedy {
  std::vector<TokenId> tokens;
  std::vector<std::vector<float>> logits;
};
Greedy engine_greedy(const model::LlamaModel& m, int ranks, DType kv, std::vector<TokenId> prompt,
                     int64_t n) {
  Greedy g;
  engine::EngineConfig cfg;
  cfg.kv_dtype = kv;
  cfg.kv_pages = 64;
  cfg.threads = 1;
  cfg.matmul = model::MatmulMode::kExact;
  cfg.idle_tick = std::chrono::milliseconds(1);
  cfg.timeout = std::chrono::milliseconds(120000);
  const Status st = run_local(ranks, [&](Communicator& comm) -> Status {
    auto e = engine::Engine::create(comm, m, cfg);
    TREEATTN_RETURN_IF_ERROR(e.status());
    if (comm.rank() != 0) return (*e)->run();
    engine::Request r;
    r.prompt = prompt;
    r.max_new_tokens = n;
    r.return_logits = true;
    bool done = false;
    auto id = (*e)->submit(r, [&](const engine::TokenEvent& ev) {
      if (ev.token >= 0) {
        g.tokens.push_back(ev.token);
        g.logits.push_back(ev.logits);
      }
      done = ev.finish != engine::FinishReason::kNone;
    });
    TREEATTN_RETURN_IF_ERROR(id.status());
    while (!done) TREEATTN_RETURN_IF_ERROR((*e)->step().status());
    (*e)->stop(false);
    return (*e)->step().status();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return g;
}

// int8 and fp8 KV pages (a scale per token and KV head) against f16 pages, 2 ranks, greedy, on
// natural prompts: attention is exact over the stored values, so what differs is the values'
// rounding. Printed: the largest logit error relative to the largest logit magnitude, over the
// steps where both saw the same tokens; greedy tokens equal f16's until a step whose f16 top two
// logits are a near tie, where a prompt's comparison ends: a gap below 0.5 (the rule of the
// int8 matmul tests) or below twice that step's largest logit error, which can swap two logits
// that close (fp8's reaches 1.4 on SmolLM2, and which near tie a given prompt parts at changes
// with any change of the values' rounding: with float32 scales one fp8 prompt parted at a gap of
// 0.12, with bfloat16 scales rounded up two at 0.007 and 0.55); the error bounds below are the
// check of the rounding itself.
TEST(EngineKVPages, Int8AndFp8PagesAgreeWithF16UpToNearTiesOnTheRealModel) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  auto m = model::LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto tok = Tokenizer::from_gguf((*m)->file());
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  const char* prompts[] = {"The capital of France is", "def fibonacci(n): return",
                           "Once upon a time, in a small village by the sea,",
                           "Water boils at a temperature of"};
  constexpr float kNearTie = 0.5f;
  for (const DType kv : {DType::kInt8, DType::kFP8}) {
    float worst = 0;
    int equal = 0, total = 0, parted = 0;
    for (const char* text : prompts) {
      auto ids = tok->encode(text);
      ASSERT_TRUE(ids.is_ok());
      const Greedy ref = engine_greedy(**m, 2, DType::kF16, *ids, 16);
      const Greedy q = engine_greedy(**m, 2, kv, *ids, 16);
      ASSERT_EQ(ref.tokens.size(), 16u);
      ASSERT_EQ(q.tokens.size(), 16u);
      total += 16;
      for (std::size_t t = 0; t < 16; ++t) {
        float mag = 0, err = 0;
        for (std::size_t v = 0; v < ref.logits[t].size(); ++v) {
          mag = std::max(mag, std::fabs(ref.logits[t][v]));
          err = std::max(err, std::fabs(q.logits[t][v] - ref.logits[t][v]));
        }
        worst = std::max(worst, err / mag);
        if (q.tokens[t] == ref.tokens[t]) {
          ++equal;
          continue;
        }
        const auto top = model::top_two(ref.logits[t]);
        std::printf(
            "[ near tie  ] kv %s, \"%s\" step %zu: f16 %d, %s %d, f16's top-2 gap %.4f, "
            "this step's largest logit error %.4f of %.4f\n",
            std::string(dtype_name(kv)).c_str(), text, t, ref.tokens[t],
            std::string(dtype_name(kv)).c_str(), q.tokens[t], static_cast<double>(top.gap()),
            static_cast<double>(err), static_cast<double>(mag));
        EXPECT_LT(top.gap(), std::max(kNearTie, 2 * err))
            << dtype_name(kv) << " \"" << text << "\" step " << t;
        ++parted;
        break;
      }
    }
    std::printf("[ kv %-4s   ] SmolLM2, 2 ranks: logits vs f16 pages: max error %.3g of the "
                "largest logit; %d of %d greedy tokens equal before any parting, %d prompts "
                "parted at a near tie\n",
                std::string(dtype_name(kv)).c_str(), static_cast<double>(worst), equal, total,
                parted);
    EXPECT_LT(worst, kv == DType::kInt8 ? 0.05f : 0.1f) << dtype_name(kv);
  }
}

}  // namespace
}  // namespace treeattn
