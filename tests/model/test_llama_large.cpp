// Label `large`: the real model's logits against the float64 numpy reference, and greedy
// continuations of 64 tokens after prompts of 100, 1000 and 4000 tokens on
// the real model (SmolLM2-135M-Instruct; skipped when absent), at 1, 2, 3 and 4 in-process ranks
// for every strategy. One prefill per rank count feeds one session per strategy
// (GeneratorConfig::methods), then each strategy decodes from its own session. Every
// continuation must equal the 1-rank one of the same strategy, or differ first where that
// run's top two logits are a near tie (printed); tree-det must give the same tokens and
// logits bits at every rank count, with no exemption.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "model/generate_harness.hpp"
#include "model/model_path.hpp"
#include "model/tiny_llama.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/generate.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {
namespace {

std::vector<int32_t> long_prompt(const Tokenizer& tok, int64_t n) {
  std::vector<int32_t> out;
  for (int section = 1; static_cast<int64_t>(out.size()) < n; ++section) {
    const std::string text =
        "Section " + std::to_string(section) +
        ". The river valley was settled early: farmers grew barley and flax, traders carried "
        "salt and copper upstream, and every spring flood rebuilt the fields. Record " +
        std::to_string(section * 37 % 101) +
        " lists the harvest, the number of boats and the "
        "names of the families who kept the granaries. ";
    auto ids = tok.encode(text, false, false);
    if (!ids.is_ok()) break;
    out.insert(out.end(), ids->begin(), ids->end());
  }
  out.resize(static_cast<std::size_t>(n));
  return out;
}

// Logits of the real model against the float64 reference (about 30 s of numpy). Bound: 30 layers
// of float32 activations with float accumulation, against float64 on the same dequantized
// weights. Measured: 1.0e-6 of the logit range (AVX-512); 2e-5 leaves room for other ISAs'
// summation orders while a convention error (RoPE pairing, frequencies, norm epsilon) moves the
// logits by O(1) of the range.
TEST(SmolLM2Large, LogitsMatchTheFloat64Reference) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  auto loaded = model::LlamaModel::load(path);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  const std::vector<int32_t> prompt = {504, 3575, 282, 4649, 314};  // "The capital of France is"
  const std::vector<int32_t> forced = {7042, 30, 198, 198, 504, 3575};  // " Paris." ... (fed)
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), forced.begin(), forced.end());
  testing::ScratchDir dir;
  std::string why;
  auto ref = testing::run_reference(path, all, true, "none", dir.path("ref.f64"), &why);
  if (!ref) {
    GTEST_SKIP() << why;
  }
  const std::size_t nv = 49152;
  ASSERT_EQ(ref->size(), all.size() * nv) << why;
  testing::GenCase c;
  c.kv = DType::kF32;
  c.steps = static_cast<int>(forced.size());
  c.forced = &forced;
  c.threads = 2;
  const auto run = testing::run_generation(**loaded, 1, c, prompt);
  ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
  double worst = 0;
  for (std::size_t s = 0; s < run.logits[0].size(); ++s) {
    const double* r = ref->data() + (prompt.size() - 1 + s) * nv;
    double e = 0, mag = 0;
    for (std::size_t i = 0; i < nv; ++i) {
      e = std::max(e, std::fabs(run.logits[0][s][i] - r[i]));
      mag = std::max(mag, std::fabs(r[i]));
    }
    worst = std::max(worst, e / mag);
    EXPECT_LE(e / mag, 2e-5) << "position " << prompt.size() - 1 + s;
    EXPECT_EQ(model::top_two(run.logits[0][s]).first,
              static_cast<int>(std::max_element(r, r + nv) - r))
        << "position " << prompt.size() - 1 + s;
  }
  std::printf("[ reference ] SmolLM2 %zu positions: max relative logit error %.2e (bound 2e-5)\n",
              run.logits[0].size(), worst);
}

TEST(SmolLM2Large, GreedySixtyFourTokensAgreeForEveryStrategyAndRankCount) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  auto m = model::LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto tok = Tokenizer::from_gguf((*m)->file());
  ASSERT_TRUE(tok.is_ok());
  const std::vector<std::string> methods = testing::sweep_methods();
  constexpr int kSteps = 64;
  for (const int64_t n : {int64_t{100}, int64_t{1000}, int64_t{4000}}) {
    const auto prompt = long_prompt(*tok, n);
    auto one = testing::run_all(**m, 1, methods, prompt, kSteps);
    ASSERT_TRUE(one.is_ok()) << one.status().to_string();
    int near = 0;
    for (const int ranks : {2, 3, 4}) {
      auto run = testing::run_all(**m, ranks, methods, prompt, kSteps);
      ASSERT_TRUE(run.is_ok()) << run.status().to_string();
      EXPECT_EQ(testing::compare_to_one_rank(methods, *run, *one, 1e-3,
                                             "prompt " + std::to_string(n) + " x" +
                                                 std::to_string(ranks),
                                             &near),
                "");
    }
    std::printf(
        "[ greedy    ] prompt %lld: %zu strategies x 2-4 ranks vs 1 rank, %d tokens, "
        "%d near-tie divergences\n",
        static_cast<long long>(n), methods.size(), kSteps, near);
  }
}

}  // namespace
}  // namespace treeattn
