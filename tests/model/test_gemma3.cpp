// Gemma 3: the SentencePiece-style tokenizer on a tiny vocabulary, Gemma's chat turns, and, when
// the real file is present (tools/fetch-model.sh gemma-3-270m), token ids and greedy tokens
// against llama.cpp's own (data/gemma3_llamacpp.json, written by make_gemma3_fixture.py with
// llama-server), the same tokens at 1 and 2 ranks, and the sliding-window limit refused up front.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/generate_harness.hpp"
#include "model/tiny_llama.hpp"
#include "treeattn/model.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn {
namespace {

using model::LlamaModel;
using testing::GgufBuilder;
using testing::ScratchDir;

// A SentencePiece-style vocabulary: specials, the 256 byte tokens, then pieces with scores.
struct SpmVocab {
  std::vector<std::string> tokens = {"<pad>", "<eos>", "<bos>", "<unk>"};
  std::vector<float> scores = {0, 0, 0, 0};
  std::vector<int32_t> types = {3, 3, 3, 2};
  SpmVocab() {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      add(name, 0, 6);
    }
  }
  int32_t add(const std::string& t, float score, int32_t type = 1) {
    tokens.push_back(t);
    scores.push_back(score);
    types.push_back(type);
    return static_cast<int32_t>(tokens.size() - 1);
  }
  GgufBuilder builder(bool space_prefix) const {
    GgufBuilder g;
    g.str("tokenizer.ggml.model", "llama");
    g.string_array("tokenizer.ggml.tokens", tokens);
    g.array("tokenizer.ggml.scores", gguf::ValueType::kFloat32, scores);
    g.array("tokenizer.ggml.token_type", gguf::ValueType::kInt32, types);
    g.u32("tokenizer.ggml.bos_token_id", 2);
    g.u32("tokenizer.ggml.eos_token_id", 1);
    g.u32("tokenizer.ggml.unknown_token_id", 3);
    g.boolean("tokenizer.ggml.add_space_prefix", space_prefix);
    return g;
  }
};

Result<Tokenizer> load(const ScratchDir& d, const GgufBuilder& b, const std::string& name) {
  GgufBuilder::write(d.path(name), b.build());
  auto f = gguf::File::open(d.path(name));
  if (!f.is_ok()) return f.status();
  return Tokenizer::from_gguf(*f);
}

const std::string kSp = "\xe2\x96\x81";  // U+2581, SentencePiece's space

TEST(SpmTokenizer, MergesByScoreFallsBackToBytesAndDecodes) {
  SpmVocab v;
  const int32_t a = v.add("a", -5), b = v.add("b", -5), c = v.add("c", -5), sp = v.add(kSp, -4);
  const int32_t ab = v.add("ab", -2), bc = v.add("bc", -1), spa = v.add(kSp + "a", -3);
  const int32_t abc = v.add("abc", -0.5f);
  const int32_t start = v.add("<start_of_turn>", 0, 3), end = v.add("<end_of_turn>", 0, 3);
  ScratchDir d;
  auto t = load(d, v.builder(false), "spm.gguf");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  // "abc": bc (-1) merges before ab (-2), then a + bc into abc. "cab": only ab is a token.
  EXPECT_EQ(*t->encode("abc", false), (std::vector<TokenId>{abc}));
  EXPECT_EQ(*t->encode("cab", false), (std::vector<TokenId>{c, ab}));
  // "ab": the only pair. "ab c": a space is U+2581 and no prefix space (add_space_prefix off).
  EXPECT_EQ(*t->encode("ab", false), (std::vector<TokenId>{ab}));
  EXPECT_EQ(*t->encode("ab c", false), (std::vector<TokenId>{ab, sp, c}));
  EXPECT_EQ(*t->encode("b a", true), (std::vector<TokenId>{2, b, spa}));
  // A character without a token: its UTF-8 bytes' <0xXX> tokens (4 + byte).
  EXPECT_EQ(*t->encode("\xc3\xa9", false), (std::vector<TokenId>{4 + 0xC3, 4 + 0xA9}));
  EXPECT_EQ(*t->decode(*t->encode("ab c \xc3\xa9 bc", false)), "ab c \xc3\xa9 bc");
  (void)bc;
  // Control tokens split the text when parsed; decode hides them unless asked.
  EXPECT_EQ(*t->encode("<start_of_turn>a<end_of_turn>", false),
            (std::vector<TokenId>{start, a, end}));
  EXPECT_EQ(*t->decode(*t->encode("<start_of_turn>a", false)), "a");
  EXPECT_EQ(t->chat_format(), ChatFormat::kGemma);
  // With add_space_prefix, a space starts the text and each text after a special token.
  auto tp = load(d, v.builder(true), "spm_prefix.gguf");
  ASSERT_TRUE(tp.is_ok()) << tp.status().to_string();
  EXPECT_EQ(*tp->encode("a", false), (std::vector<TokenId>{spa}));
  EXPECT_EQ(*tp->encode("<end_of_turn>a", false), (std::vector<TokenId>{end, spa}));
}

TEST(SpmTokenizer, ScoresMustMatchTheVocabulary) {
  SpmVocab v;
  GgufBuilder g = v.builder(false);
  ScratchDir d;
  SpmVocab w;
  w.scores.pop_back();
  auto t = load(d, w.builder(false), "bad.gguf");
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("tokenizer.ggml.scores"), std::string::npos)
      << t.status().to_string();
}

TEST(ChatFormat, GemmaTurns) {
  const std::vector<ChatTurn> one = {{"user", " What is it? \n"}};
  EXPECT_EQ(format_chat(ChatFormat::kGemma, one),
            "<start_of_turn>user\nWhat is it?<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(format_chat(ChatFormat::kGemma, one, "Be brief."),
            "<start_of_turn>user\nBe brief.\n\nWhat is it?<end_of_turn>\n<start_of_turn>model\n");
  const std::vector<ChatTurn> many = {
      {"system", "S"}, {"user", "U1"}, {"assistant", "A1"}, {"user", "U2"}};
  EXPECT_EQ(format_chat(ChatFormat::kGemma, many, "ignored"),
            "<start_of_turn>user\nS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
            "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(format_chat(ChatFormat::kChatML, one, "D"),
            "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\n What is it? \n<|im_end|>\n"
            "<|im_start|>assistant\n");
}

// ---- the real file ----

std::string gemma_path() {
  const std::string cmd = std::string(TREEATTN_SOURCE_DIR) + "/tools/model-path.sh gemma-3-270m 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {};
  char buf[4096];
  std::string out;
  while (fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  if (pclose(p) != 0) return {};
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

nlohmann::json fixture() {
  std::ifstream in(std::string(TREEATTN_MODEL_TEST_DATA) + "/gemma3_llamacpp.json");
  return nlohmann::json::parse(in);
}

class Gemma3Real : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = gemma_path();
    if (path_.empty())
      GTEST_SKIP() << "gemma-3-270m is not in models/ (tools/fetch-model.sh gemma-3-270m)";
  }
  std::string path_;
};

TEST_F(Gemma3Real, TokenIdsEqualLlamaCpps) {
  auto f = gguf::File::open(path_);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  auto t = Tokenizer::from_gguf(*f);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  int n = 0;
  const nlohmann::json fx = fixture();
  for (const auto& c : fx["tokenize"]) {
    const std::string text = c["text"];
    auto ids = t->encode(text, true, c["parse_special"].get<bool>());
    ASSERT_TRUE(ids.is_ok()) << ids.status().to_string();
    EXPECT_EQ(*ids, c["ids"].get<std::vector<TokenId>>()) << "text: " << text;
    ++n;
  }
  EXPECT_GE(n, 80);  // 41 strings x (special tokens parsed or not)
  std::printf("[ gemma3    ] %d tokenizations equal to llama.cpp's\n", n);
}

// Greedy tokens against llama.cpp's: equal until a step where llama.cpp's own top two are within
// kNearTie of each other in log-probability (its f16 KV cache and table GELU round differently
// from this float32 forward pass by about 1e-2 in the logits of a Q4_K file); the rest of that
// continuation is not compared. 1 and 2 ranks (tree, engine-free Generator) must agree with each
// other within the same exemption.
TEST_F(Gemma3Real, GreedyTokensEqualLlamaCppsAndAnswerParis) {
  constexpr double kNearTie = 0.1;
  auto m = LlamaModel::load(path_);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_EQ((*m)->config().sliding_window, 512);
  EXPECT_EQ((*m)->config().max_positions, 512);
  auto f = gguf::File::open(path_);
  auto tok = Tokenizer::from_gguf(*f);
  ASSERT_TRUE(tok.is_ok());
  int compared = 0, excused = 0;
  const nlohmann::json fx = fixture();
  ASSERT_FALSE(fx["generate"].empty());
  for (const auto& g : fx["generate"]) {
    const auto prompt = g["prompt"].get<std::vector<int32_t>>();
    const auto want = g["tokens"].get<std::vector<int32_t>>();
    testing::GenCase c;
    c.kv = DType::kF32;
    c.steps = static_cast<int>(want.size());
    for (const int ranks : {1, 2}) {
      const auto run = testing::run_generation(**m, ranks, c, prompt);
      ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
      ASSERT_EQ(testing::ranks_agree(run), "");
      for (std::size_t s = 0; s < want.size(); ++s) {
        const auto& top = g["top3"][s];
        if (run.tokens[0][s] == want[s]) {
          ++compared;
          continue;
        }
        const double gap = top[0][1].get<double>() - top[1][1].get<double>();
        std::printf("[ near tie  ] x%d step %zu: %d vs llama.cpp's %d, its top-2 gap %.3f\n",
                    ranks, s, run.tokens[0][s], want[s], gap);
        EXPECT_LT(gap, kNearTie) << "x" << ranks << " diverged from llama.cpp at step " << s;
        ++excused;
        break;
      }
    }
    if (g["text"].get<std::string>().starts_with("Question:")) {
      const auto run = testing::run_generation(**m, 2, c, prompt);
      auto text = tok->decode(run.tokens[0]);
      ASSERT_TRUE(text.is_ok());
      EXPECT_NE(text->find("Paris"), std::string::npos) << *text;
    }
  }
  std::printf("[ gemma3    ] %d greedy tokens equal to llama.cpp's, %d near-tie divergences\n",
              compared, excused);
}

TEST_F(Gemma3Real, PromptsPastTheSlidingWindowAreRefused) {
  auto m = LlamaModel::load(path_);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::vector<int32_t> prompt(513, 818);
  testing::GenCase c;
  c.steps = 1;
  const auto run = testing::run_generation(**m, 1, c, prompt);
  ASSERT_FALSE(run.status.is_ok());
  EXPECT_NE(run.status.message().find("sliding-window"), std::string::npos)
      << run.status.to_string();
}

}  // namespace
}  // namespace treeattn
