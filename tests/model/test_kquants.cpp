// The GGUF types of real Q4_K_M / Q5_0 files: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (gguf.hpp gives the
// block layouts).
// - Dequantization type by type equals the `gguf` package's (gguf-py) bit for bit, on random
//   blocks stored in data/kquant_dequant.bin (make_kquant_fixture.py; the older types too).
// - The matrix kernels of every type and ISA here against a float64 dot of the dequantized row,
//   within a bound derived below; odd row counts, one-token and batched paths.
// - Sizes that are not whole blocks are refused, naming the tensor: by the reader, by
//   WeightMatrix::from_tensor, by matmul and by dequantize_row.
// - Batch invariance: a token's output bits are the same alone and in any batch.
// - A tiny random-weight model whose layer matrices and embeddings are of these types loads and
//   runs: its logits equal bit for bit those of the same model with every such matrix stored as
//   the f32 of its dequantized values, and match the float64 numpy reference (skipped without
//   python3, numpy and gguf).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "model/generate_harness.hpp"
#include "model/tiny_llama.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/gguf.hpp"
#include "treeattn/model.hpp"

namespace treeattn {
namespace {

using gguf::TensorType;
using model::LlamaModel;
using model::WeightMatrix;
using testing::ScratchDir;

constexpr uint32_t id(TensorType t) { return static_cast<uint32_t>(t); }

const std::vector<uint32_t>& new_types() {
  static const std::vector<uint32_t> v = {id(TensorType::kQ5_0), id(TensorType::kQ5_1),
                                          id(TensorType::kQ4_K), id(TensorType::kQ5_K),
                                          id(TensorType::kQ6_K)};
  return v;
}

std::vector<Isa> isas_here() {
  std::vector<Isa> v = {Isa::kGeneric};
  for (Isa i : {Isa::kAvx2, Isa::kAvx512})
    if (isa_supported(i)) v.push_back(i);
  return v;
}

// ---- random blocks --------------------------------------------------------------------------

// Random rows of a new type: every code and packed scale byte random, the f16 scales sized so
// that values are about `scale` in magnitude.
std::vector<uint8_t> random_rows(uint32_t type, int64_t rows, int64_t cols, float scale,
                                 std::mt19937_64& rng) {
  std::vector<uint8_t> out;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  auto put16 = [&](float v) {
    const uint16_t h = float_to_f16(v);
    out.push_back(static_cast<uint8_t>(h & 0xff));
    out.push_back(static_cast<uint8_t>(h >> 8));
  };
  auto bytes = [&](int n) {
    for (int i = 0; i < n; ++i) out.push_back(static_cast<uint8_t>(byte(rng)));
  };
  auto mag = [&](float s) { return s * (0.5f + 0.5f * std::fabs(u(rng))); };
  const gguf::BlockLayout bl = gguf::block_layout(type);
  const int64_t blocks = rows * (cols / bl.block_elems);
  for (int64_t b = 0; b < blocks; ++b) {
    switch (static_cast<TensorType>(type)) {
      case TensorType::kQ5_0:  // d * (q - 16)
        put16(mag(scale / 16.0f));
        bytes(20);
        break;
      case TensorType::kQ5_1: {  // d * q + m
        const float d = mag(scale / 16.0f);
        put16(d);
        put16(-16.0f * d + 0.1f * scale * u(rng));
        bytes(20);
        break;
      }
      case TensorType::kQ4_K:  // d * sc * q - dmin * m, sc, m < 64, q < 16 (Q5_K: < 32)
      case TensorType::kQ5_K: {
        const float qmid = type == id(TensorType::kQ4_K) ? 7.5f : 15.5f;
        const float d = mag(scale / (32.0f * qmid));
        put16(d);
        put16(d * qmid * (0.8f + 0.4f * std::fabs(u(rng))));
        bytes(static_cast<int>(bl.block_bytes) - 4);
        break;
      }
      case TensorType::kQ6_K:  // d * sc * (q - 32), |sc| <= 128
        bytes(208);
        put16(mag(scale / (64.0f * 16.0f)));
        break;
      default:
        ADD_FAILURE() << "random_rows: type " << type;
        return out;
    }
  }
  return out;
}

// Random rows of any kernel type.
std::vector<uint8_t> random_any(uint32_t type, int64_t rows, int64_t cols, float scale,
                                std::mt19937_64& rng) {
  for (const uint32_t t : new_types())
    if (t == type) return random_rows(type, rows, cols, scale, rng);
  return testing::random_matrix(type, rows, cols, scale, rng);
}

WeightMatrix make_matrix(uint32_t type, int64_t rows, int64_t cols, std::vector<uint8_t>& store,
                         std::mt19937_64& rng) {
  store = random_any(type, rows, cols, 0.5f, rng);
  WeightMatrix m;
  m.name = "w_" + gguf::tensor_type_name(type);
  m.type = type;
  m.data = store.data();
  m.rows = rows;
  m.cols = cols;
  m.row_bytes = static_cast<int64_t>(store.size()) / rows;
  return m;
}

// How far gguf::dot_row_reference (exact products of the codes, summed in double) may be from
// the float64 dot of the dequantized floats, relative to sum |w x|: double rounding, plus for
// the types whose values round once in float (Q4_1, Q5_1, Q4_K, Q5_K: gguf.hpp) half an ulp of
// each value, 2^-24 relative.
double reference_tolerance(uint32_t type) {
  const bool rounded = type == id(TensorType::kQ4_1) || type == id(TensorType::kQ5_1) ||
                       type == id(TensorType::kQ4_K) || type == id(TensorType::kQ5_K);
  return (rounded ? 0x1p-24 : 0.0) + 1e-12;
}

std::vector<float> dequantized(uint32_t type, const uint8_t* row, int64_t n) {
  std::vector<float> w(static_cast<std::size_t>(n));
  const Status s = gguf::dequantize_row(type, row, w.data(), w.size());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return w;
}

// ---- (a) dequantization against the gguf package ---------------------------------------------

struct FixtureEntry {
  uint32_t type = 0;
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};

// data/kquant_dequant.bin (format in make_kquant_fixture.py).
std::vector<FixtureEntry> read_fixture() {
  const std::string path = std::string(TREEATTN_MODEL_TEST_DATA) + "/kquant_dequant.bin";
  std::ifstream f(path, std::ios::binary);
  std::vector<FixtureEntry> out;
  if (!f) {
    ADD_FAILURE() << "cannot open " << path;
    return out;
  }
  auto u32 = [&]() {
    uint32_t v = 0;
    f.read(reinterpret_cast<char*>(&v), 4);
    return v;
  };
  char magic[4] = {};
  f.read(magic, 4);
  if (std::memcmp(magic, "TAKQ", 4) != 0 || u32() != 1) {
    ADD_FAILURE() << path << ": not a version 1 TAKQ fixture";
    return out;
  }
  const uint32_t n = u32();
  for (uint32_t k = 0; k < n && f; ++k) {
    FixtureEntry e;
    e.type = u32();
    const uint32_t values = u32(), bytes = u32();
    e.bytes.resize(bytes);
    e.values.resize(values);
    f.read(reinterpret_cast<char*>(e.bytes.data()), bytes);
    f.read(reinterpret_cast<char*>(e.values.data()), static_cast<std::streamsize>(values) * 4);
    out.push_back(std::move(e));
  }
  if (!f) ADD_FAILURE() << path << ": truncated";
  return out;
}

TEST(KQuants, DequantizationEqualsTheGgufPackageBitForBit) {
  const std::vector<FixtureEntry> entries = read_fixture();
  std::set<uint32_t> seen;
  for (const FixtureEntry& e : entries) {
    SCOPED_TRACE(gguf::tensor_type_name(e.type));
    seen.insert(e.type);
    ASSERT_TRUE(gguf::tensor_type_supported(e.type));
    const gguf::BlockLayout bl = gguf::block_layout(e.type);
    ASSERT_EQ(e.bytes.size() / bl.block_bytes * bl.block_elems, e.values.size());
    std::vector<float> got(e.values.size());
    ASSERT_TRUE(gguf::dequantize_row(e.type, e.bytes.data(), got.data(), got.size()).is_ok());
    int wrong = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      uint32_t a, b;
      std::memcpy(&a, &got[i], 4);
      std::memcpy(&b, &e.values[i], 4);
      if (a != b && ++wrong <= 5)
        ADD_FAILURE() << "value " << i << " (block " << i / bl.block_elems << "): " << got[i]
                      << " (0x" << std::hex << a << "), gguf " << e.values[i] << " (0x" << b
                      << std::dec << ")";
    }
    EXPECT_EQ(wrong, 0);
    // The reference dot from the codes agrees with the float64 dot of these values (to the
    // rounding of the values themselves where there is one).
    std::mt19937 rng(e.type);
    std::normal_distribution<float> nd;
    std::vector<float> x(got.size());
    for (float& v : x) v = nd(rng);
    double want = 0, mag = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      want += double{e.values[i]} * x[i];
      mag += std::fabs(double{e.values[i]} * x[i]);
    }
    const Result<double> ref = gguf::dot_row_reference(e.type, e.bytes.data(), x.data(), x.size());
    ASSERT_TRUE(ref.is_ok()) << ref.status().to_string();
    EXPECT_NEAR(*ref, want, reference_tolerance(e.type) * mag);
  }
  for (const uint32_t t : new_types())
    EXPECT_TRUE(seen.count(t)) << gguf::tensor_type_name(t) << " missing from the fixture";
}

TEST(KQuants, BlockLayoutsAndNames) {
  const auto L = [](TensorType t) { return gguf::block_layout(id(t)); };
  EXPECT_EQ(L(TensorType::kQ5_0).block_elems, 32u);
  EXPECT_EQ(L(TensorType::kQ5_0).block_bytes, 22u);
  EXPECT_EQ(L(TensorType::kQ5_1).block_bytes, 24u);
  EXPECT_EQ(L(TensorType::kQ4_K).block_elems, 256u);
  EXPECT_EQ(L(TensorType::kQ4_K).block_bytes, 144u);
  EXPECT_EQ(L(TensorType::kQ5_K).block_bytes, 176u);
  EXPECT_EQ(L(TensorType::kQ6_K).block_bytes, 210u);
  EXPECT_EQ(gguf::tensor_type_name(id(TensorType::kQ4_K)), "q4_K");
  for (const uint32_t t : new_types()) EXPECT_TRUE(gguf::tensor_type_supported(t));
  // Still unsupported: Q2_K, Q3_K, Q8_K, the IQ types.
  for (const uint32_t t : {10u, 11u, 15u, 16u, 23u}) {
    EXPECT_FALSE(gguf::tensor_type_supported(t)) << t;
    std::vector<float> out(256);
    std::vector<uint8_t> in(512);
    const Status s = gguf::dequantize_row(t, in.data(), out.data(), 256);
    EXPECT_EQ(s.code(), Code::kUnsupported);
    EXPECT_NE(s.message().find(gguf::tensor_type_name(t)), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("q6_K"), std::string::npos) << s.message();  // the list
  }
}

// ---- (b) matvec against float64 ---------------------------------------------------------------

// Bound. The kernels compute w exactly as dequantize_row does (matvec_impl.hpp), so the only
// error is the float accumulation of w * x. Each lane of each of the kVB accumulators is a chain
// of cols / 32 fused multiply-adds (one rounding each); then kVB - 1 <= 3 vector additions and
// log2(W) <= 4 lane additions. Every partial sum is a sum of a subset of the products, so with
// u = 2^-24 and n = cols / 32 + 7 roundings on any path, |y - sum w x| <= n u sum |w x|
// (first order; the u^2 terms are far below the 1.01 factor). The float64 sum of the products
// (exact products of floats, double rounding) is the reference.
TEST(KQuants, MatmulOfEveryNewTypeAndIsaMatchesTheFloat64Dot) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  for (const uint32_t type : new_types()) {
    const bool k = gguf::block_layout(type).block_elems == 256;
    for (const int64_t cols : {k ? int64_t{256} : int64_t{32}, int64_t{768}, int64_t{1536}}) {
      for (const int64_t tokens : {int64_t{1}, int64_t{3}, int64_t{5}}) {  // 5: batched path
        const int64_t rows = 37;
        std::vector<uint8_t> store;
        const WeightMatrix m = make_matrix(type, rows, cols, store, rng);
        std::vector<float> x(static_cast<std::size_t>(tokens * cols));
        for (auto& v : x) v = nd(rng);
        for (const Isa isa : isas_here()) {
          std::vector<float> y(static_cast<std::size_t>(tokens * rows), NAN);
          const WeightMatrix* mats[] = {&m};
          float* ys[] = {y.data()};
          ASSERT_TRUE(model::matmul(mats, x.data(), tokens, cols, ys, {2, isa}).is_ok());
          for (int64_t r = 0; r < rows; ++r) {
            const std::vector<float> w = dequantized(type, m.data + r * m.row_bytes, cols);
            for (int64_t t = 0; t < tokens; ++t) {
              const float* xt = x.data() + t * cols;
              double want = 0, mag = 0;
              for (int64_t c = 0; c < cols; ++c) {
                const double p = double{w[static_cast<std::size_t>(c)]} * xt[c];
                want += p;
                mag += std::fabs(p);
              }
              const double n = static_cast<double>(cols / 32 + 7);
              const double got = y[static_cast<std::size_t>(t * rows + r)];
              EXPECT_LE(std::fabs(got - want), 1.01 * n * 0x1p-24 * mag + 1e-30)
                  << gguf::tensor_type_name(type) << " cols " << cols << " tokens " << tokens
                  << " isa " << isa_name(isa) << " row " << r << " token " << t;
              // The reader's scalar reference (from the codes) agrees too.
              const auto ref = gguf::dot_row_reference(type, m.data + r * m.row_bytes, xt,
                                                       static_cast<std::size_t>(cols));
              ASSERT_TRUE(ref.is_ok());
              EXPECT_NEAR(*ref, want, reference_tolerance(type) * mag);
            }
          }
        }
      }
    }
  }
}

// The fixture's blocks (gguf-checked values, extreme scales included) through the kernels too.
TEST(KQuants, MatmulOfTheFixtureBlocksMatchesTheFloat64Dot) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (const FixtureEntry& e : read_fixture()) {
    const gguf::BlockLayout bl = gguf::block_layout(e.type);
    const int64_t per_row = bl.block_elems == 256 ? 8 : 16;  // blocks per row
    WeightMatrix m;
    m.name = "fixture";
    m.type = e.type;
    m.data = e.bytes.data();
    m.cols = per_row * bl.block_elems;
    m.row_bytes = per_row * bl.block_bytes;
    m.rows = static_cast<int64_t>(e.bytes.size()) / m.row_bytes;
    std::vector<float> x(static_cast<std::size_t>(5 * m.cols));
    for (auto& v : x) v = nd(rng);
    for (const Isa isa : isas_here())
      for (const int64_t tokens : {int64_t{1}, int64_t{5}}) {
        std::vector<float> y(static_cast<std::size_t>(tokens * m.rows));
        const WeightMatrix* mats[] = {&m};
        float* ys[] = {y.data()};
        ASSERT_TRUE(model::matmul(mats, x.data(), tokens, m.cols, ys, {1, isa}).is_ok());
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t r = 0; r < m.rows; ++r) {
            double want = 0, mag = 0;
            for (int64_t c = 0; c < m.cols; ++c) {
              const double p =
                  double{e.values[static_cast<std::size_t>(r * m.cols + c)]} * x[t * m.cols + c];
              want += p;
              mag += std::fabs(p);
            }
            const double n = static_cast<double>(m.cols / 32 + 7);
            EXPECT_LE(std::fabs(y[t * m.rows + r] - want), 1.01 * n * 0x1p-24 * mag + 1e-30)
                << gguf::tensor_type_name(e.type) << " " << isa_name(isa) << " row " << r;
          }
      }
  }
}

TEST(KQuants, PartialBlocksAreRefusedNamingTheTensor) {
  // The reader: a first dimension that is not whole blocks.
  ScratchDir dir;
  testing::GgufBuilder b;
  b.tensor("blk.0.ffn_down.weight", {300, 2}, id(TensorType::kQ4_K), std::vector<uint8_t>(288));
  const std::string path = dir.path("partial.gguf");
  testing::GgufBuilder::write(path, b.build());
  const Result<gguf::File> f = gguf::File::open(path);
  ASSERT_FALSE(f.is_ok());
  for (const char* part : {"'blk.0.ffn_down.weight'", "300", "q4_K block of 256"})
    EXPECT_NE(f.status().message().find(part), std::string::npos) << f.status().to_string();

  // WeightMatrix::from_tensor on a directory entry that claims it anyway.
  std::vector<uint8_t> bytes(2 * 176);
  gguf::TensorInfo ti;
  ti.name = "blk.1.attn_q.weight";
  ti.dims = {384, 1};
  ti.type = id(TensorType::kQ5_K);
  ti.n_elements = 384;
  ti.n_bytes = bytes.size();
  ti.data = bytes.data();
  const auto m = WeightMatrix::from_tensor(ti);
  ASSERT_FALSE(m.is_ok());
  EXPECT_EQ(m.status().code(), Code::kInvalidArgument);
  for (const char* part : {"'blk.1.attn_q.weight'", "384 columns", "256-value blocks"})
    EXPECT_NE(m.status().message().find(part), std::string::npos) << m.status().to_string();

  // matmul on hand-made matrices: columns not whole blocks, rows too short.
  std::mt19937_64 rng(1);
  std::vector<uint8_t> store;
  WeightMatrix w = make_matrix(id(TensorType::kQ6_K), 3, 512, store, rng);
  std::vector<float> x(512), y(3);
  const WeightMatrix* mats[] = {&w};
  float* ys[] = {y.data()};
  w.cols = 480;
  Status s = model::matmul(mats, x.data(), 1, 512, ys);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  for (const char* part : {"'w_q6_K'", "q6_K", "480 columns", "256-value blocks"})
    EXPECT_NE(s.message().find(part), std::string::npos) << s.to_string();
  w.cols = 512;
  w.row_bytes = 300;
  s = model::matmul(mats, x.data(), 1, 512, ys);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("'w_q6_K'"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("need 420"), std::string::npos) << s.to_string();

  // dequantize_row and the reference dot.
  std::vector<float> out(512);
  for (const auto& [type, n] :
       {std::pair{id(TensorType::kQ5_0), 48}, std::pair{id(TensorType::kQ4_K), 300}}) {
    const Status d = gguf::dequantize_row(type, store.data(), out.data(), n);
    EXPECT_EQ(d.code(), Code::kInvalidArgument);
    EXPECT_NE(d.message().find(gguf::tensor_type_name(type)), std::string::npos) << d.message();
    EXPECT_EQ(gguf::dot_row_reference(type, store.data(), x.data(), n).status().code(),
              Code::kInvalidArgument);
  }
}

// ---- (c) batch invariance -----------------------------------------------------------------------

TEST(KQuants, BitsDoNotDependOnBatchingThreadsOrRowGrouping) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd;
  for (const uint32_t type : new_types()) {
    const int64_t rows = 70, cols = 512, tokens = 41;
    std::vector<uint8_t> s1, s2;
    const WeightMatrix a = make_matrix(type, rows, cols, s1, rng);
    const WeightMatrix b = make_matrix(type, 19, cols, s2, rng);
    std::vector<float> x(static_cast<std::size_t>(tokens * cols));
    for (auto& v : x) v = nd(rng);
    for (const Isa isa : isas_here()) {
      SCOPED_TRACE(gguf::tensor_type_name(type) + " " + std::string(isa_name(isa)));
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
              << "token " << t << " threads " << threads;
        }
        // Odd batches (the one-token path below 4 tokens, the batched path from 4) at odd starts.
        for (const int64_t n : {int64_t{2}, int64_t{7}}) {
          std::vector<float> part(static_cast<std::size_t>(n * rows));
          const WeightMatrix* mats[] = {&a};
          float* ys[] = {part.data()};
          ASSERT_TRUE(
              model::matmul(mats, x.data() + 3 * cols, n, cols, ys, {threads, isa}).is_ok());
          ASSERT_EQ(0, std::memcmp(part.data(), all.data() + 3 * rows, part.size() * 4))
              << n << " tokens, threads " << threads;
        }
      }
    }
  }
}

// ---- (d) a tiny model of the new types --------------------------------------------------------

// The tiny Llama of tiny_llama.hpp with its embeddings in Q6_K and its layer matrices cycling
// through the new types (each n_embd = 256 and n_ff = 512 wide, whole K blocks). With `as_f32`
// the same values are stored as f32 instead (the dequantized twin).
std::vector<uint8_t> build_kquant_llama(const testing::TinyLlamaSpec& spec, bool as_f32) {
  ScratchDir dir;
  const std::string base = dir.path("base.gguf");
  testing::GgufBuilder::write(base, testing::build_tiny_llama(spec));
  Result<gguf::File> f = gguf::File::open(base);
  if (!f.is_ok()) {
    ADD_FAILURE() << f.status().to_string();
    return {};
  }
  testing::GgufBuilder g;
  for (const gguf::KeyValue& kv : f->metadata()) g.copy(kv.key, kv.value);
  std::mt19937_64 rng(spec.seed + 77);
  std::size_t k = 0;
  for (const gguf::TensorInfo& t : f->tensors()) {
    const std::string name(t.name);
    std::vector<uint64_t> dims = t.dims;
    uint32_t type = 0;
    float scale = 0;
    if (name == "token_embd.weight") {
      type = id(TensorType::kQ6_K);
      scale = 1.0f;
    } else if (name.rfind("blk.", 0) == 0 && dims.size() == 2) {
      type = new_types()[k++ % new_types().size()];
      scale = 1.7f / std::sqrt(static_cast<float>(dims[0]));
    }
    if (scale == 0) {  // norms: as they are
      g.tensor(name, dims, t.type, std::vector<uint8_t>(t.data, t.data + t.n_bytes));
      continue;
    }
    const auto cols = static_cast<int64_t>(dims[0]), rows = static_cast<int64_t>(dims[1]);
    std::vector<uint8_t> q = random_rows(type, rows, cols, scale, rng);
    if (as_f32) {
      const std::vector<float> w = dequantized(type, q.data(), rows * cols);
      g.tensor(name, dims, id(TensorType::kF32), testing::f32_vector(w));
    } else {
      g.tensor(name, dims, type, std::move(q));
    }
  }
  return g.build();
}

TEST(KQuantModel, LoadsAndItsLogitsEqualItsDequantizedF32TwinBitForBit) {
  ScratchDir dir;
  testing::TinyLlamaSpec spec;
  spec.seed = 21;
  const std::string pq = dir.path("kq.gguf"), pf = dir.path("f32.gguf");
  testing::GgufBuilder::write(pq, build_kquant_llama(spec, false));
  testing::GgufBuilder::write(pf, build_kquant_llama(spec, true));
  auto mq = LlamaModel::load(pq);
  ASSERT_TRUE(mq.is_ok()) << mq.status().to_string();
  auto mf = LlamaModel::load(pf);
  ASSERT_TRUE(mf.is_ok()) << mf.status().to_string();
  const std::string types = (*mq)->weight_types();
  for (const uint32_t t : new_types())
    EXPECT_NE(types.find(gguf::tensor_type_name(t)), std::string::npos) << types;

  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.n_vocab - 1));
  std::vector<int32_t> prompt(9), forced(6);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : forced) t = tok(rng);
  testing::GenCase c;
  c.steps = static_cast<int>(forced.size());
  c.forced = &forced;
  // The kernels compute each weight as its dequantized float and accumulate the f32 twin's
  // values in the same order (matvec_impl.hpp), so every logit is the same bits.
  const auto rq = testing::run_generation(**mq, 1, c, prompt);
  const auto rf = testing::run_generation(**mf, 1, c, prompt);
  ASSERT_TRUE(rq.status.is_ok()) << rq.status.to_string();
  ASSERT_TRUE(rf.status.is_ok()) << rf.status.to_string();
  ASSERT_EQ(rq.logits[0].size(), forced.size() + 1);
  for (std::size_t s = 0; s < rq.logits[0].size(); ++s) {
    const auto& a = rq.logits[0][s];
    const auto& b = rf.logits[0][s];
    ASSERT_EQ(a.size(), static_cast<std::size_t>(spec.n_vocab));
    for (const float v : a) ASSERT_TRUE(std::isfinite(v)) << "step " << s;
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "step " << s;
  }
}

// pack_rows8 (the decode steps' layout of the Q4_K / Q6_K matrices) changes no logit bit of the
// int8 path, on 1 and 3 ranks; kExact packs nothing, kInt8Ffn only the FFN and the head.
TEST(KQuantModel, Rows8CopyKeepsEveryInt8LogitBit) {
  ScratchDir dir;
  testing::TinyLlamaSpec spec;
  spec.seed = 29;
  const std::string path = dir.path("kq.gguf");
  testing::GgufBuilder::write(path, build_kquant_llama(spec, false));
  auto plain = LlamaModel::load(path);
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  auto packed = LlamaModel::load(path);
  ASSERT_TRUE(packed.is_ok()) << packed.status().to_string();
  (*packed)->pack_rows8(model::MatmulMode::kExact);
  EXPECT_EQ((*packed)->rows8_bytes(), 0u);
  auto ffn = LlamaModel::load(path);
  ASSERT_TRUE(ffn.is_ok()) << ffn.status().to_string();
  (*ffn)->pack_rows8(model::MatmulMode::kInt8Ffn, 2);
  (*packed)->pack_rows8(model::MatmulMode::kInt8, 2);
  EXPECT_GT((*ffn)->rows8_bytes(), 0u);
  EXPECT_GT((*packed)->rows8_bytes(), (*ffn)->rows8_bytes());
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.n_vocab - 1));
  std::vector<int32_t> prompt(6), forced(5);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : forced) t = tok(rng);
  testing::GenCase c;
  c.steps = static_cast<int>(forced.size());
  c.forced = &forced;
  c.matmul = model::MatmulMode::kInt8;
  for (const int ranks : {1, 3}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    const auto a = testing::run_generation(**plain, ranks, c, prompt);
    const auto b = testing::run_generation(**packed, ranks, c, prompt);
    ASSERT_TRUE(a.status.is_ok()) << a.status.to_string();
    ASSERT_TRUE(b.status.is_ok()) << b.status.to_string();
    ASSERT_EQ(a.logits[0].size(), forced.size() + 1);
    for (std::size_t st = 0; st < a.logits[0].size(); ++st)
      EXPECT_EQ(0, std::memcmp(a.logits[0][st].data(), b.logits[0][st].data(),
                               a.logits[0][st].size() * 4))
          << "step " << st;
  }
}

#ifdef TREEATTN_LLAMA_REFERENCE
// Against llama_reference.py (float64 numpy, dequantizing with the gguf package): the same 1e-5
// bound as test_llama's tiny models (float32 activations and accumulation over 3 layers of width
// 256-512 are a few 1e-7 relative; the weights are the same values on both sides).
TEST(KQuantModel, LogitsMatchTheFloat64Reference) {
  ScratchDir dir;
  testing::TinyLlamaSpec spec;
  spec.seed = 23;
  const std::string path = dir.path("kq.gguf");
  testing::GgufBuilder::write(path, build_kquant_llama(spec, false));
  auto m = LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::mt19937_64 rng(4);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(spec.n_vocab - 1));
  std::vector<int32_t> prompt(7), forced(8);
  for (auto& t : prompt) t = tok(rng);
  for (auto& t : forced) t = tok(rng);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), forced.begin(), forced.end());
  std::string why;
  auto ref = testing::run_reference(path, all, true, "none", dir.path("ref.f64"), &why);
  if (!ref) GTEST_SKIP() << why;
  const auto nv = static_cast<std::size_t>(spec.n_vocab);
  ASSERT_EQ(ref->size(), all.size() * nv) << why;
  testing::GenCase c;
  c.steps = static_cast<int>(forced.size());
  c.forced = &forced;
  const auto run = testing::run_generation(**m, 1, c, prompt);
  ASSERT_TRUE(run.status.is_ok()) << run.status.to_string();
  double worst = 0;
  for (std::size_t s = 0; s < run.logits[0].size(); ++s) {
    const double* r = ref->data() + (prompt.size() - 1 + s) * nv;
    double err = 0, mag = 0;
    for (std::size_t i = 0; i < nv; ++i) {
      err = std::max(err, std::fabs(run.logits[0][s][i] - r[i]));
      mag = std::max(mag, std::fabs(r[i]));
    }
    worst = std::max(worst, err / mag);
    EXPECT_LE(err / mag, 1e-5) << "step " << s;
  }
  std::printf("[ reference ] k-quant tiny model: max relative logit error %.2e (bound 1e-5)\n",
              worst);
}
#endif  // TREEATTN_LLAMA_REFERENCE

}  // namespace
}  // namespace treeattn
