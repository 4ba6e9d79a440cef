// The GGUF reader on the shipped real model, SmolLM2-135M-Instruct (Q4_1): metadata values, the
// tensor directory (names, dims, types, byte sizes), and dequantized rows compared with the
// `gguf` PyPI package's numpy dequantizer (data/smollm2_tensors.json) and cross-checked
// between the dequantize-then-dot and the dot-from-codes paths. Skipped when the model is
// absent.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "model/model_path.hpp"
#include "treeattn/gguf.hpp"

namespace treeattn {
namespace {

using gguf::File;
using gguf::TensorType;
constexpr uint32_t id(TensorType t) { return static_cast<uint32_t>(t); }

TEST(SmolLM2, Metadata) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Result<File> r = File::open(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const File& f = *r;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.metadata().size(), 33u);
  EXPECT_EQ(*f.get_string("general.architecture"), "llama");
  EXPECT_EQ(*f.get_uint("llama.block_count"), 30u);
  EXPECT_EQ(*f.get_uint("llama.context_length"), 8192u);
  EXPECT_EQ(*f.get_uint("llama.embedding_length"), 576u);
  EXPECT_EQ(*f.get_uint("llama.feed_forward_length"), 1536u);
  EXPECT_EQ(*f.get_uint("llama.attention.head_count"), 9u);
  EXPECT_EQ(*f.get_uint("llama.attention.head_count_kv"), 3u);
  EXPECT_EQ(*f.get_uint("llama.rope.dimension_count"), 64u);
  EXPECT_EQ(*f.get_uint("llama.vocab_size"), 49152u);
  EXPECT_EQ(*f.get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(*f.get_float("llama.attention.layer_norm_rms_epsilon"), double{1e-5f});
  EXPECT_EQ(f.find("llama.rope.freq_base")->type, gguf::ValueType::kFloat32);
  EXPECT_EQ(f.find("llama.block_count")->type, gguf::ValueType::kUint32);
  EXPECT_EQ(*f.get_uint("general.file_type"), 3u);  // mostly Q4_1
  EXPECT_EQ(*f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(*f.get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_FALSE(*f.get_bool("tokenizer.ggml.add_bos_token"));
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->size(), 49152u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.merges")->size(), 48900u);
  EXPECT_EQ(f.get_int_array("tokenizer.ggml.token_type")->size(), 49152u);
  EXPECT_EQ(*f.get_uint("tokenizer.ggml.bos_token_id"), 1u);
  EXPECT_EQ(*f.get_uint("tokenizer.ggml.eos_token_id"), 2u);
  EXPECT_EQ(f.get_string_array("general.languages")->size(), 1u);
  EXPECT_NE(f.get_string("tokenizer.chat_template")->find("<|im_start|>"), std::string::npos);
  EXPECT_FALSE(f.has("llama.rope.scaling.type"));
}

TEST(SmolLM2, TensorDirectory) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Result<File> r = File::open(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const File& f = *r;
  ASSERT_EQ(f.tensors().size(), 272u);
  std::map<uint32_t, int> by_type;
  uint64_t total = 0;
  for (const auto& t : f.tensors()) {
    ++by_type[t.type];
    total += t.n_bytes;
    EXPECT_TRUE(f.tensor(t.name).is_ok()) << t.name;  // every type is supported
  }
  EXPECT_EQ(by_type[id(TensorType::kQ4_1)], 210);
  EXPECT_EQ(by_type[id(TensorType::kF32)], 61);
  EXPECT_EQ(by_type[id(TensorType::kQ8_0)], 1);
  EXPECT_EQ(f.data_offset(), 1785664u);
  EXPECT_LE(f.data_offset() + total, f.file_size());
  EXPECT_GT(f.data_offset() + total + 32 * 272, f.file_size());  // only padding in between

  const gguf::TensorInfo* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->type, id(TensorType::kQ8_0));
  EXPECT_EQ(emb->dims, (std::vector<uint64_t>{576, 49152}));
  EXPECT_EQ(emb->n_bytes, 49152u * 18u * 34u);  // 18 blocks of 34 bytes per row
  EXPECT_EQ(emb->row_bytes(), 612u);
  EXPECT_EQ(f.find_tensor("output.weight"), nullptr);  // the head is tied to the embedding
  EXPECT_EQ(f.tensor("output.weight").status().code(), Code::kInvalidArgument);

  struct Want {
    const char* suffix;
    TensorType type;
    std::vector<uint64_t> dims;
  };
  const std::vector<Want> per_layer = {
      {"attn_norm.weight", TensorType::kF32, {576}},
      {"ffn_norm.weight", TensorType::kF32, {576}},
      {"attn_q.weight", TensorType::kQ4_1, {576, 576}},
      {"attn_k.weight", TensorType::kQ4_1, {576, 192}},
      {"attn_v.weight", TensorType::kQ4_1, {576, 192}},
      {"attn_output.weight", TensorType::kQ4_1, {576, 576}},
      {"ffn_gate.weight", TensorType::kQ4_1, {576, 1536}},
      {"ffn_up.weight", TensorType::kQ4_1, {576, 1536}},
      {"ffn_down.weight", TensorType::kQ4_1, {1536, 576}},
  };
  for (int layer = 0; layer < 30; ++layer) {
    for (const Want& w : per_layer) {
      const std::string name = "blk." + std::to_string(layer) + "." + w.suffix;
      const gguf::TensorInfo* t = f.find_tensor(name);
      ASSERT_NE(t, nullptr) << name;
      EXPECT_EQ(t->type, id(w.type)) << name;
      EXPECT_EQ(t->dims, w.dims) << name;
      const gguf::BlockLayout b = gguf::block_layout(t->type);
      EXPECT_EQ(t->n_bytes, t->n_elements / b.block_elems * b.block_bytes) << name;
      EXPECT_EQ(t->offset % 32, 0u) << name;
    }
  }
  const gguf::TensorInfo* onorm = f.find_tensor("output_norm.weight");
  ASSERT_NE(onorm, nullptr);
  EXPECT_EQ(onorm->dims, (std::vector<uint64_t>{576}));
}

// Dequantized rows against the gguf package's numpy dequantizer, and plausibility.
TEST(SmolLM2, DequantizedRowsMatchGgufPy) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Result<File> r = File::open(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const auto fixture = nlohmann::json::parse(testing::read_test_data("smollm2_tensors.json"));
  int rows_checked = 0;
  for (const auto& [name, want] : fixture.at("tensors").items()) {
    SCOPED_TRACE(name);
    Result<const gguf::TensorInfo*> ti = r->tensor(name);
    ASSERT_TRUE(ti.is_ok()) << ti.status().to_string();
    const gguf::TensorInfo& t = **ti;
    EXPECT_EQ(gguf::tensor_type_name(t.type), [](std::string s) {
      for (char& c : s) c = static_cast<char>(std::tolower(c));
      return s;
    }(want.at("type").get<std::string>()));
    EXPECT_EQ(t.dims, want.at("dims").get<std::vector<uint64_t>>());
    EXPECT_EQ(t.n_bytes, want.at("n_bytes").get<uint64_t>());
    const std::size_t n = t.dims[0];
    for (const auto& [row, vals] : want.at("rows").items()) {
      std::vector<float> x(n);
      ASSERT_TRUE(gguf::dequantize_row(t.type, t.row(std::stoull(row)), x.data(), n).is_ok());
      const auto first8 = vals.at("first8").get<std::vector<double>>();
      for (std::size_t j = 0; j < 8; ++j)
        EXPECT_NEAR(x[j], first8[j], 1e-6 * std::abs(first8[j]) + 1e-9) << "row " << row;
      double sum = 0, sumsq = 0, amax = 0;
      for (const float v : x) {
        ASSERT_TRUE(std::isfinite(v));
        sum += v;
        sumsq += double{v} * v;
        amax = std::max(amax, double{std::abs(v)});
      }
      EXPECT_NEAR(sum, vals.at("sum").get<double>(), 1e-5 * (1 + sumsq));
      EXPECT_NEAR(sumsq, vals.at("sumsq").get<double>(), 1e-5 * sumsq);
      // Plausible weights: finite, not all zero, no huge values.
      EXPECT_GT(sumsq, 0.0);
      EXPECT_LT(amax, 100.0);
      ++rows_checked;
    }
  }
  EXPECT_EQ(rows_checked, 8);
}

// Dot products two ways on real rows of every type in the file: dequantize then dot in double,
// and dot_row_reference straight from the codes. Q8_0 values (f16 scale x int8) are exact in
// float, so the two agree to double rounding; Q4_1's d*q + m is rounded to float once per
// value when dequantized, so they agree to 2^-24 of sum |w x|.
TEST(SmolLM2, DotFromCodesMatchesDequantizedDot) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  Result<File> r = File::open(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (const char* name : {"token_embd.weight", "blk.0.attn_q.weight", "blk.17.ffn_down.weight",
                           "blk.29.attn_v.weight", "output_norm.weight"}) {
    SCOPED_TRACE(name);
    const gguf::TensorInfo& t = **r->tensor(name);
    const std::size_t n = t.dims[0];
    std::vector<float> x(n), w(n);
    for (float& v : x) v = g(rng);
    for (const uint64_t row : {uint64_t{0}, t.n_rows() / 2, t.n_rows() - 1}) {
      ASSERT_TRUE(gguf::dequantize_row(t.type, t.row(row), w.data(), n).is_ok());
      double dq = 0.0, mag = 0.0;
      for (std::size_t j = 0; j < n; ++j) {
        dq += double{w[j]} * x[j];
        mag += std::abs(double{w[j]} * x[j]);
      }
      Result<double> ref = gguf::dot_row_reference(t.type, t.row(row), x.data(), n);
      ASSERT_TRUE(ref.is_ok());
      const double tol = t.type == id(TensorType::kQ4_1) ? 0x1p-24 * mag + 1e-12 : 1e-12 * mag;
      EXPECT_NEAR(*ref, dq, tol) << "row " << row;
    }
  }
}

}  // namespace
}  // namespace treeattn
