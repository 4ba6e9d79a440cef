// generation::run_generation (generation.hpp), the library call behind `treeattn generate`, at
// 1 and 2 in-process ranks on the real model (skipped without it): the session path gives the
// Generator's greedy tokens on every rank, the engine path a full answer with every rank's
// numbers, "auto" one choice on every rank, errors as values.
#include <gtest/gtest.h>

#include <mutex>

#include "model/generate_harness.hpp"
#include "engine/layer_merge.hpp"
#include "model/model_path.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/generation.hpp"

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

TEST(GenerationRun, AutoIsOneChoiceOnEveryRank) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Request r = base_request(path);
  r.methods = {"auto"};
  r.new_tokens = 2;
  auto t = preset_topology("local");
  ASSERT_TRUE(t.is_ok());
  r.topology = *t;
  r.topology.ranks_per_node = 2;
  r.ranks_per_node = 2;
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

}  // namespace
}  // namespace treeattn
