// The Llama forward pass and distributed generation on tiny random-weight GGUF files this test
// writes (tiny_llama.hpp):
// - the matrix kernels of every type and ISA against the reader's scalar float64 dot, and their
//   bits independent of batching and threads (what the deterministic decode relies on);
// - logits of prefill and decode steps against the independent float64 numpy reference
//   (llama_reference.py, dequantizing with the `gguf` package; skipped when python3, numpy or
//   gguf is missing), for a tied head and for an output.weight with Llama-3 rope_freqs;
// - greedy continuations at 1-4 in-process ranks for every strategy: identical to one rank, or a
//   divergence shown to be a near tie; with tree-det identical bits for every rank count;
// - the prefill's balanced compute placement, the sampler, and load errors (missing file, wrong
//   architecture, unsupported tensor type, missing tensor, bad shape).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>

#include "model/generate_harness.hpp"
#include "model/tiny_llama.hpp"
#include "treeattn/generate.hpp"
#include "treeattn/model.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {
namespace {

using model::LlamaModel;
using model::MatvecOptions;
using model::WeightMatrix;
using testing::ScratchDir;
using testing::TinyLlamaSpec;

std::vector<Isa> isas_here() {
  std::vector<Isa> v = {Isa::kGeneric};
  for (Isa i : {Isa::kAvx2, Isa::kAvx512})
    if (isa_supported(i)) v.push_back(i);
  return v;
}

WeightMatrix make_matrix(uint32_t type, int64_t rows, int64_t cols, std::vector<uint8_t>& store,
                         std::mt19937_64& rng) {
  store = testing::random_matrix(type, rows, cols, 0.5f, rng);
  WeightMatrix m;
  m.name = "w";
  m.type = type;
  m.data = store.data();
  m.rows = rows;
  m.cols = cols;
  m.row_bytes = static_cast<int64_t>(store.size()) / rows;
  return m;
}

TEST(Matmul, EveryTypeAndIsaMatchesTheFloat64Dot) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  for (const uint32_t type : testing::tiny_cycle()) {
    for (const int64_t cols : {int64_t{32}, int64_t{576}, int64_t{1536}}) {
      const int64_t rows = 37, tokens = 5;
      std::vector<uint8_t> store;
      const WeightMatrix m = make_matrix(type, rows, cols, store, rng);
      std::vector<float> x(static_cast<std::size_t>(tokens * cols));
      for (auto& v : x) v = nd(rng);
      for (const Isa isa : isas_here()) {
        std::vector<float> y(static_cast<std::size_t>(tokens * rows), NAN);
        const WeightMatrix* mats[] = {&m};
        float* ys[] = {y.data()};
        ASSERT_TRUE(model::matmul(mats, x.data(), tokens, cols, ys, {2, isa}).is_ok());
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t r = 0; r < rows; ++r) {
            const auto ref =
                gguf::dot_row_reference(type, m.data + r * m.row_bytes, x.data() + t * cols,
                                        static_cast<std::size_t>(cols));
            ASSERT_TRUE(ref.is_ok());
            // Float accumulation of `cols` products: |error| <= cols * eps * sum |w x|; the
            // sum of |w x| is bounded here by the row's dequantized magnitudes.
            std::vector<float> w(static_cast<std::size_t>(cols));
            ASSERT_TRUE(
                gguf::dequantize_row(type, m.data + r * m.row_bytes, w.data(), w.size()).is_ok());
            double mag = 0;
            for (int64_t c = 0; c < cols; ++c)
              mag += std::fabs(static_cast<double>(w[static_cast<std::size_t>(c)]) *
                               x[static_cast<std::size_t>(t * cols + c)]);
            const double err = std::fabs(y[static_cast<std::size_t>(t * rows + r)] - *ref);
            EXPECT_LE(err, 4 * 0x1p-24 * std::sqrt(static_cast<double>(cols)) * mag + 1e-30)
                << gguf::tensor_type_name(type) << " cols " << cols << " isa " << isa_name(isa)
                << " row " << r << " token " << t;
          }
      }
    }
  }
}

TEST(Matmul, BitsDoNotDependOnBatchingThreadsOrRowGrouping) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd;
  for (const uint32_t type : testing::tiny_cycle()) {
    const int64_t rows = 70, cols = 256, tokens = 41;
    std::vector<uint8_t> s1, s2;
    const WeightMatrix a = make_matrix(type, rows, cols, s1, rng);
    const WeightMatrix b = make_matrix(type, 19, cols, s2, rng);
    std::vector<float> x(static_cast<std::size_t>(tokens * cols));
    for (auto& v : x) v = nd(rng);
    for (const Isa isa : isas_here()) {
      std::vector<float> all(static_cast<std::size_t>(tokens * rows)),
          allb(static_cast<std::size_t>(tokens * 19));
      {
        const WeightMatrix* mats[] = {&a, &b};
        float* ys[] = {all.data(), allb.data()};
        ASSERT_TRUE(model::matmul(mats, x.data(), tokens, cols, ys, {3, isa}).is_ok());
      }
      for (const int threads : {1, 2}) {
        for (int64_t t = 0; t < tokens; ++t) {  // one token at a time, alone
          std::vector<float> one(static_cast<std::size_t>(rows));
          const WeightMatrix* mats[] = {&a};
          float* ys[] = {one.data()};
          ASSERT_TRUE(
              model::matmul(mats, x.data() + t * cols, 1, cols, ys, {threads, isa}).is_ok());
          ASSERT_EQ(0, std::memcmp(one.data(), all.data() + t * rows, one.size() * 4))
              << gguf::tensor_type_name(type) << " " << isa_name(isa) << " token " << t;
        }
        // Two tokens: the one-token passes, the first prefetching the next rows, the second not.
        std::vector<float> two(static_cast<std::size_t>(2 * rows));
        {
          const WeightMatrix* mats[] = {&a};
          float* ys[] = {two.data()};
          ASSERT_TRUE(model::matmul(mats, x.data() + 5 * cols, 2, cols, ys, {threads, isa}).is_ok());
          ASSERT_EQ(0, std::memcmp(two.data(), all.data() + 5 * rows, two.size() * 4))
              << gguf::tensor_type_name(type) << " " << isa_name(isa) << " two tokens";
        }
        // An odd batch starting at an odd token.
        std::vector<float> part(static_cast<std::size_t>(7 * rows));
        const WeightMatrix* mats[] = {&a};
        float* ys[] = {part.data()};
        ASSERT_TRUE(model::matmul(mats, x.data() + 3 * cols, 7, cols, ys, {threads, isa}).is_ok());
        ASSERT_EQ(0, std::memcmp(part.data(), all.data() + 3 * rows, part.size() * 4));
      }
    }
  }
}

// The batched float path reads its activations from a copy on cache-line boundaries when the
// caller's are not (matvec.cpp, copy_x): activations at every offset within a line and rows
// of every stride give the bits of an aligned call.
TEST(Matmul, ActivationsOffCacheLinesGiveTheSameBits) {
  std::mt19937_64 rng(12);
  std::normal_distribution<float> nd;
  const int64_t rows = 37, cols = 96, tokens = 50;  // two tiles of 48 from the one copy
  for (const uint32_t type : {3u, 0u}) {  // q4_1, f32
    std::vector<uint8_t> store;
    const WeightMatrix m = make_matrix(type, rows, cols, store, rng);
    std::vector<float> xs(static_cast<std::size_t>(tokens * cols));
    for (auto& v : xs) v = nd(rng);
    for (const Isa isa : isas_here()) {
      std::vector<float> want(static_cast<std::size_t>(tokens * rows));
      // 64-byte aligned, stride a multiple of 16 floats: no copy.
      std::vector<float> abuf(static_cast<std::size_t>(tokens * cols + 16));
      float* const xa = abuf.data() + (16 - reinterpret_cast<uintptr_t>(abuf.data()) / 4 % 16) % 16;
      std::copy(xs.begin(), xs.end(), xa);
      const WeightMatrix* mats[] = {&m};
      {
        float* ys[] = {want.data()};
        ASSERT_TRUE(model::matmul(mats, xa, tokens, cols, ys, {2, isa}).is_ok());
      }
      for (const int64_t offset : {1, 3, 8, 15})
        for (const int64_t stride : {cols, cols + 1, cols + 5}) {
          std::vector<float> buf(static_cast<std::size_t>(offset + tokens * stride + 16), NAN);
          float* const xb = buf.data() + (16 - reinterpret_cast<uintptr_t>(buf.data()) / 4 % 16) %
                                             16 + offset;
          for (int64_t t = 0; t < tokens; ++t)
            std::copy_n(xs.data() + t * cols, cols, xb + t * stride);
          std::vector<float> got(want.size());
          float* ys[] = {got.data()};
          ASSERT_TRUE(model::matmul(mats, xb, tokens, stride, ys, {2, isa}).is_ok());
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
              << gguf::tensor_type_name(type) << " " << isa_name(isa) << " offset " << offset
              << " stride " << stride;
        }
    }
  }
}

TEST(Matmul, RejectsMismatchedInputsAndUnsupportedTypes) {
  std::mt19937_64 rng(3);
  std::vector<uint8_t> s1, s2;
  WeightMatrix a = make_matrix(3, 4, 64, s1, rng);
  WeightMatrix b = make_matrix(3, 4, 96, s2, rng);
  std::vector<float> x(96), y1(4), y2(4);
  const WeightMatrix* mats[] = {&a, &b};
  float* ys[] = {y1.data(), y2.data()};
  Status s = model::matmul(mats, x.data(), 1, 96, ys);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("columns"), std::string::npos) << s.to_string();
  a.type = 10;  // q2_K
  const WeightMatrix* one[] = {&a};
  float* y[] = {y1.data()};
  s = model::matmul(one, x.data(), 1, 64, y);
  EXPECT_EQ(s.code(), Code::kUnsupported) << s.to_string();
  EXPECT_NE(s.message().find("q2_K"), std::string::npos) << s.to_string();
}

// max |ours - ref| / max |ref| over one logits vector.
double logit_error(const std::vector<float>& ours, const double* ref, std::size_t n) {
  double worst = 0, mag = 0;
  for (std::size_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::fabs(ours[i] - ref[i]));
    mag = std::max(mag, std::fabs(ref[i]));
  }
  return worst / mag;
}

int argmax(const double* v, std::size_t n) {
  return static_cast<int>(std::max_element(v, v + n) - v);
}

// Prefill `prompt` then feed `forced` one by one; compare every position's logits with the
// float64 reference (all positions of prompt + forced).
void check_against_reference(const TinyLlamaSpec& spec, DType kv, const std::string& kv_round,
                             double bound) {
  ScratchDir dir;
  const std::string path = dir.path("tiny.gguf");
  testing::GgufBuilder::write(path, testing::build_tiny_llama(spec));
  auto m = LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::mt19937_64 rng(spec.seed + 100);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.n_vocab - 1));
  std::vector<int32_t> prompt(9), forced(70);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : forced) t = tok(rng);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), forced.begin(), forced.end());
  std::string why;
  auto ref = testing::run_reference(path, all, true, kv_round, dir.path("ref.f64"), &why);
  if (!ref) {
    GTEST_SKIP() << why;
  }
  const auto nv = static_cast<std::size_t>(spec.n_vocab);
  ASSERT_EQ(ref->size(), all.size() * nv) << why;
  for (const int ranks : {1, 3}) {
    testing::GenCase c;
    c.kv = kv;
    c.steps = static_cast<int>(forced.size());
    c.forced = &forced;
    const auto run = testing::run_generation(**m, ranks, c, prompt);
    ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
    EXPECT_EQ(testing::ranks_agree(run), "");
    double worst = 0;
    for (std::size_t s = 0; s < run.logits[0].size(); ++s) {
      const std::size_t position = prompt.size() - 1 + s;
      const double* r = ref->data() + position * nv;
      const double e = logit_error(run.logits[0][s], r, nv);
      worst = std::max(worst, e);
      EXPECT_LE(e, bound) << "position " << position << " ranks " << ranks;
      const auto top = model::top_two(run.logits[0][s]);
      // Same argmax unless the reference itself has a near tie.
      std::vector<double> sorted(r, r + nv);
      std::sort(sorted.rbegin(), sorted.rend());
      if (sorted[0] - sorted[1] > 1e-3 * std::fabs(sorted[0])) {
        EXPECT_EQ(top.first, argmax(r, nv)) << "position " << position;
      }
    }
    std::printf(
        "[ reference ] %s kv %s ranks %d: %zu positions, max relative logit error %.2e "
        "(bound %.0e)\n",
        (spec.architecture + (spec.output_weight ? " output.weight" : " tied head") +
         (spec.rope_freqs ? "+rope_freqs" : "") + (spec.qkv_bias ? "+qkv bias" : ""))
            .c_str(),
        std::string(dtype_name(kv)).c_str(), ranks, run.logits[0].size(), worst, bound);
  }
}

// Bound: float32 activations and accumulation over a few layers of width 256-512 give errors
// of a few 1e-7 relative; quantized weights are the same values on both sides. 1e-5 leaves
// ample room yet catches any convention error (a wrong RoPE pairing or frequency, a missing
// factor), which moves logits by O(1).
TEST(TinyLlama, LogitsMatchTheFloat64ReferenceTiedHead) {
  check_against_reference(TinyLlamaSpec{}, DType::kF32, "none", 1e-5);
}

TEST(TinyLlama, LogitsMatchTheFloat64ReferenceOutputWeightAndRopeFreqs) {
  TinyLlamaSpec s;
  s.output_weight = true;
  s.rope_freqs = true;
  s.seed = 5;
  s.embd_type = 1;
  check_against_reference(s, DType::kF32, "none", 1e-5);
}

// With an f16 cache the reference rounds K and V the same way; the remaining differences are
// values that round to a neighbouring f16 on one side (a half-ulp of f16 is 5e-4 relative;
// measured: 2.4e-5 of the logit range).
TEST(TinyLlama, LogitsMatchTheFloat64ReferenceWithAnF16Cache) {
  TinyLlamaSpec s;
  s.seed = 9;
  check_against_reference(s, DType::kF16, "f16", 2e-4);
}

// qwen2 (Qwen2 / Qwen2.5): q/k/v biases, RoPE on the halves of each head on unpermuted weights,
// a separate output.weight. The reference adds the biases and rotates halves itself; a llama
// pairing or a missing bias moves logits by O(1), far beyond the bound.
TEST(TinyQwen2, LogitsMatchTheFloat64Reference) {
  TinyLlamaSpec s;
  s.architecture = "qwen2";
  s.qkv_bias = true;
  s.output_weight = true;
  s.rope_base = 1000000.0;
  s.seed = 13;
  check_against_reference(s, DType::kF32, "none", 1e-5);
}

// bf16 K/V rounded the same way in the reference; a value rounding to the neighbouring bf16 on one
// side moves by one bf16 ulp (7.8e-3 relative), diluted over the attention sum (measured 3.4e-5).
TEST(TinyQwen2, LogitsMatchTheFloat64ReferenceWithABf16CacheAndTiedHead) {
  TinyLlamaSpec s;
  s.architecture = "qwen2";
  s.qkv_bias = true;
  s.seed = 17;
  check_against_reference(s, DType::kBF16, "bf16", 2e-3);
}

// The architecture decides the RoPE pairing: the same tensors declared as qwen2 rotate
// (x[i], x[i + head_dim / 2]), declared as llama (x[2i], x[2i + 1]).
TEST(TinyQwen2, RotatesHalvesWhereLlamaRotatesAdjacentPairs) {
  ScratchDir dir;
  TinyLlamaSpec s;
  s.architecture = "qwen2";
  s.seed = 3;
  testing::GgufBuilder::write(dir.path("q.gguf"), testing::build_tiny_llama(s));
  s.architecture = "llama";
  testing::GgufBuilder::write(dir.path("l.gguf"), testing::build_tiny_llama(s));
  auto q = LlamaModel::load(dir.path("q.gguf"));
  auto l = LlamaModel::load(dir.path("l.gguf"));
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  ASSERT_TRUE(l.is_ok()) << l.status().to_string();
  EXPECT_EQ((*q)->config().rope_form, model::RopeForm::kHalves);
  EXPECT_EQ((*l)->config().rope_form, model::RopeForm::kAdjacentPairs);
  // RoPE alone: position 3 of a head whose values are their own indices.
  const int64_t hd = (*q)->config().head_dim, h = hd / 2;
  std::vector<float> a(static_cast<std::size_t>(hd)), b;
  for (int64_t i = 0; i < hd; ++i) a[static_cast<std::size_t>(i)] = static_cast<float>(i + 1);
  b = a;
  (*q)->apply_rope(a.data(), 1, 3);
  (*l)->apply_rope(b.data(), 1, 3);
  // Halves: pair 0 is (x[0], x[h]) rotated by 3 rad (theta_0 = pos).
  EXPECT_FLOAT_EQ(a[0], static_cast<float>(std::cos(3.0) - static_cast<double>(h + 1) * std::sin(3.0)));
  EXPECT_FLOAT_EQ(a[static_cast<std::size_t>(h)],
                  static_cast<float>(std::sin(3.0) + static_cast<double>(h + 1) * std::cos(3.0)));
  // Adjacent: pair 0 is (x[0], x[1]).
  EXPECT_FLOAT_EQ(b[0], static_cast<float>(1.0 * std::cos(3.0) - 2.0 * std::sin(3.0)));
  EXPECT_FLOAT_EQ(b[1], static_cast<float>(1.0 * std::sin(3.0) + 2.0 * std::cos(3.0)));
}

TEST(TinyQwen2, GreedyTokensAgreeAcrossRanksAndTreeDetIsBitIdentical) {
  ScratchDir dir;
  const std::string path = dir.path("tiny.gguf");
  TinyLlamaSpec spec;
  spec.architecture = "qwen2";
  spec.qkv_bias = true;
  spec.output_weight = true;
  spec.seed = 23;
  testing::GgufBuilder::write(path, testing::build_tiny_llama(spec));
  auto m = LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::vector<int32_t> prompt(101);
  for (std::size_t i = 0; i < prompt.size(); ++i)
    prompt[i] = static_cast<int32_t>((i * 53 + 7) % static_cast<std::size_t>(spec.n_vocab));
  testing::GenCase c;
  c.kv = DType::kF16;
  c.steps = 10;
  c.methods = {"tree-det"};
  const auto one = testing::run_generation(**m, 1, c, prompt);
  ASSERT_TRUE(one.status.is_ok()) << one.status.to_string();
  for (const int ranks : {2, 3, 4}) {
    const auto run = testing::run_generation(**m, ranks, c, prompt);
    ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
    ASSERT_EQ(testing::ranks_agree(run), "");
    ASSERT_EQ(run.tokens[0], one.tokens[0]) << "tree-det x" << ranks;
    for (std::size_t st = 0; st < run.logits[0].size(); ++st)
      ASSERT_EQ(0, std::memcmp(run.logits[0][st].data(), one.logits[0][st].data(),
                               run.logits[0][st].size() * 4))
          << "tree-det x" << ranks << " step " << st;
  }
  c.methods = {"tree"};
  const auto tree3 = testing::run_generation(**m, 3, c, prompt);
  ASSERT_TRUE(tree3.status.is_ok()) << tree3.status.to_string();
  for (std::size_t st = 0; st < tree3.tokens[0].size(); ++st) {
    if (tree3.tokens[0][st] == one.tokens[0][st]) continue;
    EXPECT_LT(model::top_two(one.logits[0][st]).gap(), 1e-4) << "tree x3 diverged at " << st;
    break;
  }
}

// gemma3: scaled embeddings, per-head q/k norms, post norms, tanh-GELU, rope base 10000 on the
// sliding-window layers and the file's base on every 6th: 6 layers hold both kinds. The reference
// implements each of these itself (llama_reference.py); any one missing moves logits by O(1).
TEST(TinyGemma3, LogitsMatchTheFloat64Reference) {
  TinyLlamaSpec s;
  s.architecture = "gemma3";
  s.layers = 6;
  s.sliding_window = 512;
  s.rope_base = 1000000.0;
  s.seed = 29;
  check_against_reference(s, DType::kF32, "none", 1e-5);
}

std::vector<std::string> every_strategy() {
  std::vector<std::string> v;
  for (const auto& i : StrategyRegistry::for_backend(CommCapabilities{}).list())
    v.emplace_back(i.name);
  v.emplace_back("tree-det");
  return v;
}

// Near-tie bound for greedy comparisons across rank counts: the merge order changes logits by
// float rounding only (measured differences here: ~1e-6 of the logit range), so tokens can
// only differ where the top two logits are within that of each other.
constexpr double kNearTie = 1e-4;

TEST(TinyLlama, GreedyContinuationsAgreeAcrossRanksAndStrategies) {
  ScratchDir dir;
  const std::string path = dir.path("tiny.gguf");
  TinyLlamaSpec spec;
  spec.seed = 21;
  testing::GgufBuilder::write(path, testing::build_tiny_llama(spec));
  auto m = LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::mt19937_64 rng(4);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.n_vocab - 1));
  std::vector<int32_t> prompt(150);
  for (auto& t : prompt) t = tok(rng);
  testing::GenCase base;
  base.kv = DType::kF16;
  base.steps = 12;
  const auto ref = testing::run_generation(**m, 1, base, prompt);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  const testing::GenRun* det1 = nullptr;
  testing::GenRun det1_run;
  int near_ties = 0;
  for (const std::string& method : every_strategy()) {
    for (const int ranks : {1, 2, 3, 4}) {
      testing::GenCase c = base;
      c.methods = {method};
      const auto run = testing::run_generation(**m, ranks, c, prompt);
      ASSERT_TRUE(run.status.is_ok()) << method << " x" << ranks << ": " << run.status.to_string();
      ASSERT_EQ(testing::ranks_agree(run), "") << method << " x" << ranks;
      if (method == "tree-det") {
        if (det1 == nullptr) {
          det1_run = run;
          det1 = &det1_run;
        }
        // No exemption: the same tokens and the same logits bits for every rank count.
        ASSERT_EQ(run.tokens[0], det1->tokens[0]) << "tree-det x" << ranks;
        for (std::size_t s = 0; s < run.logits[0].size(); ++s)
          ASSERT_EQ(0, std::memcmp(run.logits[0][s].data(), det1->logits[0][s].data(),
                                   run.logits[0][s].size() * 4))
              << "tree-det x" << ranks << " logits differ from 1 rank's at step " << s;
      }
      // Against the 1-rank tree run: equal, or the first difference is a near tie.
      for (std::size_t s = 0; s < run.tokens[0].size(); ++s) {
        if (run.tokens[0][s] == ref.tokens[0][s]) continue;
        const auto top = model::top_two(ref.logits[0][s]);
        std::printf(
            "[ near tie  ] %s x%d step %zu: token %d vs %d, reference top-2 gap %.3g "
            "(bound %.0e)\n",
            method.c_str(), ranks, s, run.tokens[0][s], ref.tokens[0][s],
            static_cast<double>(top.gap()), kNearTie);
        EXPECT_LT(top.gap(), kNearTie) << method << " x" << ranks << " diverged at step " << s
                                       << " where the reference's top two are not tied";
        ++near_ties;
        break;  // the continuations differ from here on
      }
    }
  }
  std::printf("[ greedy    ] %zu strategies x 1-4 ranks, %d near-tie divergences\n",
              every_strategy().size(), near_ties);
}

TEST(TinyLlama, EveryPlacementGivesTheSameGreedyTokens) {
  ScratchDir dir;
  const std::string path = dir.path("tiny.gguf");
  TinyLlamaSpec spec;
  spec.seed = 33;
  testing::GgufBuilder::write(path, testing::build_tiny_llama(spec));
  auto m = LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::vector<int32_t> prompt(97);
  for (std::size_t i = 0; i < prompt.size(); ++i)
    prompt[i] = static_cast<int32_t>((i * 37 + 11) % static_cast<std::size_t>(spec.n_vocab));
  testing::GenCase c;
  c.kv = DType::kBF16;
  c.steps = 10;
  const auto ref = testing::run_generation(**m, 1, c, prompt);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  for (const ShardKind k : {ShardKind::kUneven, ShardKind::kStriped}) {
    c.placement = k;
    const auto run = testing::run_generation(**m, 3, c, prompt);
    ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
    ASSERT_EQ(testing::ranks_agree(run), "");
    for (std::size_t s = 0; s < run.tokens[0].size(); ++s) {
      if (run.tokens[0][s] == ref.tokens[0][s]) continue;
      EXPECT_LT(model::top_two(ref.logits[0][s]).gap(), kNearTie)
          << shard_kind_name(k) << " diverged at step " << s << " without a near tie";
      break;
    }
  }
}

TEST(Prefill, BlocksCoverThePromptOnceAndBalanceTheWork) {
  const double w = 1152.0 / 3.54e6;  // SmolLM2's prefill_position_weight
  for (const int64_t n : {int64_t{1}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{1000},
                          int64_t{4096}, int64_t{8192}, int64_t{32768}})
    for (const int p : {1, 2, 3, 4, 7}) {
      std::vector<int> seen(static_cast<std::size_t>(n), 0);
      double most = 0, total = 0;
      for (int r = 0; r < p; ++r) {
        const auto pos = model::prefill_positions(n, p, r, w);
        ASSERT_TRUE(std::is_sorted(pos.begin(), pos.end()));
        double work = 0;
        for (const int64_t t : pos) {
          ++seen[static_cast<std::size_t>(t)];
          work += 1.0 + w * static_cast<double>(t);
        }
        most = std::max(most, work);
        total += work;
      }
      for (int64_t t = 0; t < n; ++t) ASSERT_EQ(seen[static_cast<std::size_t>(t)], 1) << t;
      // The busiest rank against the mean: within 6% at 4k (64 blocks over up to 7 ranks), 3%
      // from 8k; a contiguous split would give (2p - 1) / p at long prompts.
      const double imbalance = most / (total / p);
      if (n >= 8192) {
        EXPECT_LE(imbalance, 1.03) << "n " << n << " p " << p;
      } else if (n >= 4096) {
        EXPECT_LE(imbalance, 1.06) << "n " << n << " p " << p;
      }
    }
}

TEST(Sampler, GreedyTakesTheLowestIdOnTiesAndSamplingIsSeededAndRestricted) {
  std::vector<float> l = {0.5f, 2.0f, 2.0f, -1.0f, 1.9f};
  model::Sampler greedy({});
  EXPECT_EQ(greedy.sample(l), 1);
  model::SamplingParams sp;
  sp.temperature = 0.8;
  sp.top_k = 3;
  sp.seed = 42;
  model::Sampler a(sp), b(sp);
  std::set<int> seen;
  for (int i = 0; i < 200; ++i) {
    const int x = a.sample(l);
    EXPECT_EQ(x, b.sample(l));
    seen.insert(x);
  }
  EXPECT_EQ(seen, (std::set<int>{1, 2, 4}));  // top-3 only
  sp.top_k = 0;
  sp.top_p = 0.5;  // 1 and 2 carry about 0.66 together: the nucleus is {1, 2}
  model::Sampler c(sp);
  seen.clear();
  for (int i = 0; i < 200; ++i) seen.insert(c.sample(l));
  EXPECT_EQ(seen, (std::set<int>{1, 2}));
  sp.temperature = -1;
  EXPECT_EQ(sp.validate().code(), Code::kInvalidArgument);
}

// logit_bias, then repetition_penalty over prompt and output, then frequency and presence
// penalties over the output (generate.hpp), each stage in double rounded to float;
// the counts follow a growing history and are rebuilt for any other.
TEST(Sampler, ProcessAddsTheBiasThenThePenaltiesOverTheHistory) {
  const std::vector<float> l = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.0f};
  model::SamplingParams sp;
  model::Sampler none(sp);
  const std::vector<TokenId> history = {1, 3, 3, 0, 3, 1};  // prompt {1, 3, 3}, output {0, 3, 1}
  EXPECT_EQ(none.process(l, history, 3).data(), l.data());  // nothing applies: the logits
  sp.logit_bias = {{2, 10.0}, {4, -100.0}};
  sp.repetition_penalty = 2.0;
  sp.frequency_penalty = 0.5;
  sp.presence_penalty = 0.25;
  model::Sampler s(sp);
  std::vector<float> got;
  auto process = [&](std::span<const TokenId> h) {
    const auto out = s.process(l, h, 3);
    got.assign(out.begin(), out.end());
  };
  process(history);
  // 0: seen (output once) 2 / 2 - 0.5 - 0.25; 1: seen (prompt, output once) -1 * 2 - 0.75;
  // 2: bias only; 3: seen (prompt twice, output once) 3 / 2 - 0.75; 4: bias; 5: untouched.
  const std::vector<float> want = {0.25f, -2.75f, 10.5f, 0.75f, -102.0f, 1.0f};
  EXPECT_EQ(got, want);
  // A growing history: token 5 generated twice more.
  std::vector<TokenId> longer = history;
  longer.insert(longer.end(), {5, 5});
  process(longer);
  EXPECT_EQ(got[5], 0.5f - 1.0f - 0.25f);
  EXPECT_EQ(got[0], want[0]);
  // Another history (a shorter one) is counted from scratch: the same as a fresh sampler's.
  process(std::span<const TokenId>(history.data(), 4));
  model::Sampler fresh(sp);
  const auto f = fresh.process(l, std::span<const TokenId>(history.data(), 4), 3);
  EXPECT_EQ(got, std::vector<float>(f.begin(), f.end()));
  EXPECT_EQ(got[3], 1.5f);  // seen in the prompt, not generated: no presence penalty
  // Bad values are refused naming the field; bias ids against the vocabulary.
  EXPECT_TRUE(sp.validate(6).is_ok());
  auto refused = [](model::SamplingParams p, int64_t vocab, const std::string& field) {
    const Status st = p.validate(vocab);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << field;
    EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
  };
  refused(sp, 4, "logit_bias token id 4");
  model::SamplingParams b = sp;
  b.logit_bias = {{1, 100.5}};
  refused(b, 6, "logit_bias of token 1");
  b.logit_bias = {{2, 1.0}, {1, 1.0}};
  refused(b, 6, "ascending");
  b = sp;
  b.repetition_penalty = 0;
  refused(b, 6, "repetition_penalty");
  b = sp;
  b.presence_penalty = 2.5;
  refused(b, 6, "presence_penalty");
  b = sp;
  b.frequency_penalty = std::nan("");
  refused(b, 6, "frequency_penalty");
  b = sp;
  b.min_p = 1.5;
  refused(b, 6, "min_p");
}

// min_p keeps the tokens at least min_p times as likely as the most likely one (after the
// temperature); logprobs are log-softmax in double, the top ones in the total order.
TEST(Sampler, MinPCutsTheUnlikelyAndLogprobsAreTheLogSoftmax) {
  const std::vector<float> l = {0.0f, 2.0f, 2.0f, -3.0f, 1.0f};
  model::SamplingParams sp;
  sp.temperature = 1.0;
  sp.seed = 7;
  sp.min_p = 0.3;  // exp(1 - 2) = 0.37 stays, exp(0 - 2) = 0.14 goes
  model::Sampler s(sp);
  std::set<int> seen;
  for (int i = 0; i < 300; ++i) seen.insert(s.sample(l));
  EXPECT_EQ(seen, (std::set<int>{1, 2, 4}));
  sp.min_p = 1.0;  // only the ties at the top
  model::Sampler top(sp);
  seen.clear();
  for (int i = 0; i < 100; ++i) seen.insert(top.sample(l));
  EXPECT_EQ(seen, (std::set<int>{1, 2}));

  double sum = 0;
  for (const float x : l) sum += std::exp(static_cast<double>(x));
  const auto lp = model::token_logprobs(l, 4, 3);
  EXPECT_NEAR(lp.logprob, 1.0 - std::log(sum), 1e-12);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);  // the tie at 2.0: the lower id first
  EXPECT_EQ(lp.top[1].first, 2);
  EXPECT_EQ(lp.top[2].first, 4);
  EXPECT_EQ(lp.top[0].second, lp.top[1].second);
  EXPECT_NEAR(lp.top[2].second, lp.logprob, 0.0);
  EXPECT_TRUE(model::token_logprobs(l, 0, 0).top.empty());
  EXPECT_EQ(model::token_logprobs(l, 0, 99).top.size(), l.size());
}

void expect_load_error(const TinyLlamaSpec& spec, Code code, const std::string& fragment) {
  ScratchDir dir;
  const std::string path = dir.path("bad.gguf");
  testing::GgufBuilder::write(path, testing::build_tiny_llama(spec));
  auto m = LlamaModel::load(path);
  ASSERT_FALSE(m.is_ok()) << fragment;
  EXPECT_EQ(m.status().code(), code) << m.status().to_string();
  EXPECT_NE(m.status().message().find(fragment), std::string::npos) << m.status().to_string();
  EXPECT_NE(m.status().message().find(path), std::string::npos) << m.status().to_string();
}

TEST(LlamaModelLoad, ClearErrors) {
  {
    auto m = LlamaModel::load("/nonexistent/dir/model.gguf");
    ASSERT_FALSE(m.is_ok());
    EXPECT_NE(m.status().message().find("/nonexistent/dir/model.gguf"), std::string::npos)
        << m.status().to_string();
  }
  TinyLlamaSpec s;
  s.architecture = "gemma";
  expect_load_error(s, Code::kUnsupported, "architecture 'gemma' is not supported");
  expect_load_error(s, Code::kUnsupported, "llama, qwen2");  // the message lists what is
  s = {};
  s.override_type = 10;  // q2_K layer matrices
  expect_load_error(s, Code::kUnsupported, "q2_K");
  s = {};
  s.qkv_bias = true;  // a llama file with biases: not part of its forward pass
  expect_load_error(s, Code::kUnsupported, "blk.0.attn_q.bias");
  s = {};
  s.drop_tensor = "blk.1.ffn_up.weight";
  expect_load_error(s, Code::kInvalidArgument, "blk.1.ffn_up.weight");
  s = {};
  s.n_head = 8;  // head dim 32: no attention kernel
  expect_load_error(s, Code::kUnsupported, "head dim 32");
}

TEST(Generator, RejectsBadRequests) {
  ScratchDir dir;
  const std::string path = dir.path("tiny.gguf");
  testing::GgufBuilder::write(path, testing::build_tiny_llama(TinyLlamaSpec{}));
  auto m = LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok());
  Status st = run_local(2, [&](Communicator& comm) -> Status {
    model::GeneratorConfig gc;
    gc.threads = 1;
    gc.methods = {"tree-det"};
    gc.placement = ShardKind::kStriped;
    auto bad = model::Generator::create(comm, **m, gc);
    if (bad.is_ok()) return internal_error("tree-det over a striped placement was accepted");
    gc.methods = {"tree"};
    gc.placement = ShardKind::kEven;
    auto g = model::Generator::create(comm, **m, gc);
    TREEATTN_RETURN_IF_ERROR(g.status());
    std::vector<float> l;
    if ((*g)->step(1, l).is_ok()) return internal_error("a step before the prefill was accepted");
    const std::vector<int32_t> bad_ids = {1, 2, 9999};
    Status s = (*g)->prefill(bad_ids, l);
    if (s.is_ok() || s.message().find("9999") == std::string::npos)
      return internal_error("an out-of-vocabulary id was accepted: " + s.to_string());
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

}  // namespace
}  // namespace treeattn
