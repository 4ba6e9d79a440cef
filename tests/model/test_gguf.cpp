// The GGUF reader on files this test writes itself: every metadata value type through the typed
// accessors and their errors; every supported tensor type dequantized against values worked
// out by hand and dotted two ways; alignment; and malformed files (truncated at every byte,
// wrong magic and version, huge counts and lengths, bad alignment, offsets past the end,
// overlaps, unknown types, random corruption), each of which must be a Status error naming the
// file, never a crash.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "model/gguf_builder.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/gguf.hpp"

namespace treeattn {
namespace {

using gguf::File;
using gguf::TensorType;
using gguf::ValueType;
using testing::GgufBuilder;
namespace fs = std::filesystem;

constexpr uint32_t id(TensorType t) { return static_cast<uint32_t>(t); }

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "treeattn_gguf_XXXXXX").string();
    dir_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
};

std::string write(const TempDir& d, const std::string& name, const std::vector<uint8_t>& b) {
  const std::string p = d.path(name);
  GgufBuilder::write(p, b);
  return p;
}

// Expects an error of `code` whose message names the file and contains `fragment`.
void expect_error(const Result<File>& r, Code code, const std::string& path,
                  const std::string& fragment) {
  ASSERT_FALSE(r.is_ok()) << "opened a file that should have been rejected: " << fragment;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
  EXPECT_NE(r.status().message().find(fragment), std::string::npos)
      << "'" << fragment << "' not in: " << r.status().to_string();
}

std::vector<uint8_t> f16_bytes(float v) {
  std::vector<uint8_t> b;
  GgufBuilder::put(b, float_to_f16(v));
  return b;
}

// ---- metadata ----------------------------------------------------------------------------

GgufBuilder all_types() {
  GgufBuilder b;
  b.u8("u8", 200).i8("i8", -100).u16("u16", 60000).i16("i16", -30000);
  b.u32("u32", 4000000000u).i32("i32", -2000000000).u64("u64", 18000000000000000000ull);
  b.i64("i64", -9000000000000000000ll).f32("f32", 1.5f).f64("f64", -2.25e300);
  b.boolean("yes", true).boolean("no", false).str("s", "héllo wörld").str("empty", "");
  b.array("a_u8", ValueType::kUint8, std::vector<uint8_t>{1, 2, 255});
  b.array("a_i8", ValueType::kInt8, std::vector<int8_t>{-1, 0, 127});
  b.array("a_u16", ValueType::kUint16, std::vector<uint16_t>{65535});
  b.array("a_i16", ValueType::kInt16, std::vector<int16_t>{-32768, 5});
  b.array("a_u32", ValueType::kUint32, std::vector<uint32_t>{7, 4294967295u});
  b.array("a_i32", ValueType::kInt32, std::vector<int32_t>{-7, 0, 1, 2, 3});
  b.array("a_u64", ValueType::kUint64, std::vector<uint64_t>{1ull << 40});
  b.array("a_u64_big", ValueType::kUint64, std::vector<uint64_t>{~0ull});
  b.array("a_i64", ValueType::kInt64, std::vector<int64_t>{-(1ll << 50)});
  b.array("a_f32", ValueType::kFloat32, std::vector<float>{0.5f, -1.0f});
  b.array("a_f64", ValueType::kFloat64, std::vector<double>{1e-300});
  b.array("a_bool", ValueType::kBool, std::vector<uint8_t>{1, 0, 1});
  b.array("a_empty", ValueType::kInt32, std::vector<int32_t>{});
  b.string_array("a_str", std::vector<std::string>{"a", "", "日本", std::string("n\0l", 3)});
  return b;
}

TEST(Gguf, EveryValueTypeReadsBack) {
  TempDir d;
  for (const uint32_t version : {2u, 3u}) {
    GgufBuilder b = all_types();
    b.version = version;
    const std::string p = write(d, "all.gguf", b.build());
    Result<File> r = File::open(p);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    const File& f = *r;
    EXPECT_EQ(f.version(), version);
    EXPECT_EQ(f.metadata().size(), 28u);
    EXPECT_EQ(f.alignment(), 32u);
    EXPECT_EQ(*f.get_uint("u8"), 200u);
    EXPECT_EQ(*f.get_int("i8"), -100);
    EXPECT_EQ(*f.get_uint("u16"), 60000u);
    EXPECT_EQ(*f.get_int("i16"), -30000);
    EXPECT_EQ(*f.get_uint("u32"), 4000000000u);
    EXPECT_EQ(*f.get_int("u32"), 4000000000);
    EXPECT_EQ(*f.get_int("i32"), -2000000000);
    EXPECT_EQ(*f.get_uint("u64"), 18000000000000000000ull);
    EXPECT_EQ(*f.get_int("i64"), -9000000000000000000ll);
    EXPECT_EQ(*f.get_float("f32"), 1.5);
    EXPECT_EQ(*f.get_float("f64"), -2.25e300);
    EXPECT_TRUE(*f.get_bool("yes"));
    EXPECT_FALSE(*f.get_bool("no"));
    EXPECT_EQ(*f.get_string("s"), "héllo wörld");
    EXPECT_EQ(*f.get_string("empty"), "");
    EXPECT_EQ(*f.get_int_array("a_u8"), (std::vector<int64_t>{1, 2, 255}));
    EXPECT_EQ(*f.get_int_array("a_i8"), (std::vector<int64_t>{-1, 0, 127}));
    EXPECT_EQ(*f.get_int_array("a_u16"), (std::vector<int64_t>{65535}));
    EXPECT_EQ(*f.get_int_array("a_i16"), (std::vector<int64_t>{-32768, 5}));
    EXPECT_EQ(*f.get_int_array("a_u32"), (std::vector<int64_t>{7, 4294967295}));
    EXPECT_EQ(*f.get_int_array("a_i32"), (std::vector<int64_t>{-7, 0, 1, 2, 3}));
    EXPECT_EQ(*f.get_int_array("a_u64"), (std::vector<int64_t>{1ll << 40}));
    EXPECT_EQ(*f.get_int_array("a_i64"), (std::vector<int64_t>{-(1ll << 50)}));
    EXPECT_EQ(*f.get_float_array("a_f32"), (std::vector<double>{0.5, -1.0}));
    EXPECT_EQ(*f.get_float_array("a_f64"), (std::vector<double>{1e-300}));
    EXPECT_TRUE(f.get_int_array("a_empty")->empty());
    const gguf::Value* ab = f.find("a_bool");
    ASSERT_NE(ab, nullptr);
    EXPECT_EQ(ab->type, ValueType::kArray);
    EXPECT_EQ(ab->elem_type, ValueType::kBool);
    EXPECT_EQ(ab->count, 3u);
    EXPECT_EQ(ab->raw[0], 1);
    EXPECT_EQ(ab->raw[1], 0);
    const auto strs = f.get_string_array("a_str");
    ASSERT_TRUE(strs.is_ok());
    ASSERT_EQ(strs->size(), 4u);
    EXPECT_EQ((*strs)[0], "a");
    EXPECT_EQ((*strs)[1], "");
    EXPECT_EQ((*strs)[2], "日本");
    EXPECT_EQ((*strs)[3], std::string_view("n\0l", 3));
    EXPECT_TRUE(f.tensors().empty());
  }
}

TEST(Gguf, AccessorErrorsNameFileKeyAndExpectation) {
  TempDir d;
  const std::string p = write(d, "all.gguf", all_types().build());
  Result<File> r = File::open(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const File& f = *r;
  const auto check = [&](const Status& s, const std::vector<std::string>& parts) {
    ASSERT_FALSE(s.is_ok());
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find(p), std::string::npos) << s.message();
    for (const auto& part : parts)
      EXPECT_NE(s.message().find(part), std::string::npos) << "'" << part << "' in " << s.message();
  };
  check(f.get_uint("nope").status(), {"'nope'", "missing", "non-negative integer"});
  check(f.get_string("u32").status(), {"'u32'", "is uint32", "expected a string"});
  check(f.get_float("u32").status(), {"'u32'", "is uint32", "float32 or float64"});
  check(f.get_bool("s").status(), {"'s'", "is string", "expected a bool"});
  check(f.get_int("f32").status(), {"'f32'", "is float32", "integer"});
  check(f.get_uint("i8").status(), {"'i8'", "-100", "non-negative"});
  check(f.get_int("u64").status(), {"'u64'", "does not fit in int64"});
  check(f.get_string_array("a_i32").status(), {"'a_i32'", "array of int32", "array of string"});
  check(f.get_int_array("a_str").status(), {"'a_str'", "array of string", "integers"});
  check(f.get_float_array("a_u8").status(), {"'a_u8'", "array of uint8"});
  check(f.get_int_array("a_u64_big").status(), {"'a_u64_big'", "element 0", "int64"});
  check(f.get_int_array("u32").status(), {"'u32'", "is uint32"});
  // Defaults apply only to missing keys.
  EXPECT_EQ(*f.get_uint_or("nope", 7), 7u);
  EXPECT_EQ(*f.get_int_or("nope", -7), -7);
  EXPECT_EQ(*f.get_float_or("nope", 0.25), 0.25);
  EXPECT_EQ(*f.get_bool_or("nope", true), true);
  EXPECT_EQ(*f.get_string_or("nope", "x"), "x");
  EXPECT_EQ(*f.get_uint_or("u8", 7), 200u);
  check(f.get_uint_or("s", 7).status(), {"'s'", "is string"});
  check(f.get_string_or("u8", "x").status(), {"'u8'", "is uint8"});
}

// ---- tensors -----------------------------------------------------------------------------

struct Blocks {
  std::vector<uint8_t> bytes;
  std::vector<float> expected;  // the values worked out from the format's definition
};

// Two blocks of each quantized type with codes 0..15 / -128..127 at known places.
Blocks q8_0_blocks() {
  Blocks b;
  for (const float d : {0.5f, -0.0625f}) {
    auto h = f16_bytes(d);
    b.bytes.insert(b.bytes.end(), h.begin(), h.end());
    for (int j = 0; j < 32; ++j) {
      const int q = j * 8 - 128 + (d < 0 ? 7 : 0);  // -128 .. 127
      b.bytes.push_back(static_cast<uint8_t>(static_cast<int8_t>(q)));
      b.expected.push_back(d * static_cast<float>(q));
    }
  }
  return b;
}
Blocks q4_0_blocks() {
  Blocks b;
  for (const float d : {0.25f, 3.0f}) {
    auto h = f16_bytes(d);
    b.bytes.insert(b.bytes.end(), h.begin(), h.end());
    std::vector<float> lo(16), hi(16);
    for (int j = 0; j < 16; ++j) {
      const int l = j, u = 15 - j;  // nibble codes
      b.bytes.push_back(static_cast<uint8_t>(l | (u << 4)));
      lo[j] = d * static_cast<float>(l - 8);
      hi[j] = d * static_cast<float>(u - 8);
    }
    b.expected.insert(b.expected.end(), lo.begin(), lo.end());  // x[j] from low nibbles
    b.expected.insert(b.expected.end(), hi.begin(), hi.end());  // x[j + 16] from high ones
  }
  return b;
}
Blocks q4_1_blocks() {
  Blocks b;
  for (const auto& [d, m] : {std::pair{0.125f, -1.0f}, std::pair{2.0f, 0.5f}}) {
    auto hd = f16_bytes(d), hm = f16_bytes(m);
    b.bytes.insert(b.bytes.end(), hd.begin(), hd.end());
    b.bytes.insert(b.bytes.end(), hm.begin(), hm.end());
    std::vector<float> lo(16), hi(16);
    for (int j = 0; j < 16; ++j) {
      const int l = (j * 7) % 16, u = (j * 5 + 3) % 16;
      b.bytes.push_back(static_cast<uint8_t>(l | (u << 4)));
      lo[j] = d * static_cast<float>(l) + m;
      hi[j] = d * static_cast<float>(u) + m;
    }
    b.expected.insert(b.expected.end(), lo.begin(), lo.end());
    b.expected.insert(b.expected.end(), hi.begin(), hi.end());
  }
  return b;
}
Blocks plain_blocks(TensorType t) {
  Blocks b;
  for (int j = 0; j < 64; ++j) {
    const float v = static_cast<float>(j - 20) * 0.375f;  // exact in f16 and bf16
    b.expected.push_back(v);
    if (t == TensorType::kF32) GgufBuilder::put(b.bytes, v);
    if (t == TensorType::kF16) GgufBuilder::put(b.bytes, float_to_f16(v));
    if (t == TensorType::kBF16) GgufBuilder::put(b.bytes, float_to_bf16(v));
  }
  return b;
}

TEST(Gguf, BlockLayoutsMatchGgml) {
  const auto L = [](TensorType t) { return gguf::block_layout(id(t)); };
  EXPECT_EQ(L(TensorType::kF32).block_bytes, 4u);
  EXPECT_EQ(L(TensorType::kF16).block_bytes, 2u);
  EXPECT_EQ(L(TensorType::kBF16).block_bytes, 2u);
  EXPECT_EQ(L(TensorType::kQ8_0).block_elems, 32u);
  EXPECT_EQ(L(TensorType::kQ8_0).block_bytes, 34u);
  EXPECT_EQ(L(TensorType::kQ4_0).block_bytes, 18u);
  EXPECT_EQ(L(TensorType::kQ4_1).block_bytes, 20u);
  EXPECT_EQ(gguf::block_layout(10).block_bytes, 84u);  // q2_K, known but unsupported
  EXPECT_EQ(gguf::block_layout(4).block_elems, 0u);    // removed from ggml
  EXPECT_EQ(gguf::tensor_type_name(10), "q2_K");
  EXPECT_EQ(gguf::tensor_type_name(1000), "type 1000");
}

TEST(Gguf, EverySupportedTypeDequantizesAndDotsTwoWays) {
  TempDir d;
  GgufBuilder b;
  b.u32("general.alignment", 64).alignment = 64;
  const std::vector<std::pair<TensorType, Blocks>> cases = {
      {TensorType::kF32, plain_blocks(TensorType::kF32)},
      {TensorType::kF16, plain_blocks(TensorType::kF16)},
      {TensorType::kBF16, plain_blocks(TensorType::kBF16)},
      {TensorType::kQ8_0, q8_0_blocks()},
      {TensorType::kQ4_0, q4_0_blocks()},
      {TensorType::kQ4_1, q4_1_blocks()},
  };
  for (const auto& [t, blk] : cases) {
    // Two rows of 32 values each ({32, 2} in ggml order).
    b.tensor(gguf::tensor_type_name(id(t)), {32, 2}, id(t), blk.bytes);
  }
  const std::string p = write(d, "types.gguf", b.build());
  Result<File> r = File::open(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->alignment(), 64u);
  EXPECT_EQ(r->data_offset() % 64, 0u);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const auto& [t, blk] : cases) {
    SCOPED_TRACE(gguf::tensor_type_name(id(t)));
    Result<const gguf::TensorInfo*> ti = r->tensor(gguf::tensor_type_name(id(t)));
    ASSERT_TRUE(ti.is_ok()) << ti.status().to_string();
    const gguf::TensorInfo& info = **ti;
    EXPECT_EQ(info.offset % 64, 0u);
    EXPECT_EQ(info.n_elements, 64u);
    EXPECT_EQ(info.n_bytes, blk.bytes.size());
    EXPECT_EQ(info.n_rows(), 2u);
    EXPECT_EQ(info.row_bytes() * 2, blk.bytes.size());
    std::vector<float> out(64);
    ASSERT_TRUE(gguf::dequantize_row(info.type, info.data, out.data(), 64).is_ok());
    EXPECT_EQ(out, blk.expected);
    // Row 1 alone.
    std::vector<float> row1(32);
    ASSERT_TRUE(gguf::dequantize_row(info.type, info.row(1), row1.data(), 32).is_ok());
    EXPECT_TRUE(std::equal(row1.begin(), row1.end(), blk.expected.begin() + 32));
    // The reference dot from the codes equals the dot of the dequantized values (exact
    // products here: the values above are short binary fractions).
    std::vector<float> x(64);
    for (float& v : x) v = u(rng);
    double want = 0.0;
    for (int j = 0; j < 64; ++j) want += double{blk.expected[j]} * x[j];
    Result<double> got = gguf::dot_row_reference(info.type, info.data, x.data(), 64);
    ASSERT_TRUE(got.is_ok());
    EXPECT_NEAR(*got, want, 1e-12 * (1.0 + std::abs(want)));
  }
  // Partial blocks and unsupported types are errors, not reads past the row.
  std::vector<float> out(64);
  const Status partial =
      gguf::dequantize_row(id(TensorType::kQ4_1), q4_1_blocks().bytes.data(), out.data(), 31);
  EXPECT_EQ(partial.code(), Code::kInvalidArgument);
  EXPECT_NE(partial.message().find("q4_1"), std::string::npos) << partial.message();
  const Status q2 = gguf::dequantize_row(10, q4_1_blocks().bytes.data(), out.data(), 256);
  EXPECT_EQ(q2.code(), Code::kUnsupported);
  EXPECT_NE(q2.message().find("q2_K"), std::string::npos) << q2.message();
  EXPECT_EQ(gguf::dot_row_reference(10, out.data(), out.data(), 256).status().code(),
            Code::kUnsupported);
}

TEST(Gguf, UnsupportedTypeOpensButTensorIsUnsupported) {
  TempDir d;
  GgufBuilder b;
  b.tensor("ok", {32}, id(TensorType::kF32), std::vector<uint8_t>(128, 0));
  b.tensor("blk.3.ffn_down.weight", {256, 2}, 10, std::vector<uint8_t>(168, 0));  // q2_K
  const std::string p = write(d, "q2k.gguf", b.build());
  Result<File> r = File::open(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->find_tensor("blk.3.ffn_down.weight")->n_bytes, 168u);
  const Status s = r->tensor("blk.3.ffn_down.weight").status();
  EXPECT_EQ(s.code(), Code::kUnsupported);
  for (const char* part : {"'blk.3.ffn_down.weight'", "q2_K", "supported: f32"})
    EXPECT_NE(s.message().find(part), std::string::npos) << s.message();
  const Status missing = r->tensor("output.weight").status();
  EXPECT_EQ(missing.code(), Code::kInvalidArgument);
  EXPECT_NE(missing.message().find("'output.weight' not found"), std::string::npos);
  EXPECT_NE(missing.message().find(p), std::string::npos);
  EXPECT_TRUE(r->tensor("ok").is_ok());
}

// ---- malformed files ---------------------------------------------------------------------

// A valid file with metadata of several types and three tensors.
GgufBuilder valid_file() {
  GgufBuilder b;
  b.str("general.architecture", "llama").u32("llama.block_count", 2).f32("x.eps", 1e-5f);
  b.string_array("tokenizer.ggml.tokens", std::vector<std::string>{"a", "b", "ab"});
  b.array("tokenizer.ggml.token_type", ValueType::kInt32, std::vector<int32_t>{1, 1, 1});
  b.tensor("w", {32, 2}, id(TensorType::kQ4_1), q4_1_blocks().bytes);
  b.tensor("n", {8}, id(TensorType::kF32), std::vector<uint8_t>(32, 0));
  b.tensor("e", {32, 2}, id(TensorType::kQ8_0), q8_0_blocks().bytes);
  return b;
}

TEST(GgufMalformed, EveryTruncationIsAnError) {
  TempDir d;
  std::size_t header = 0;
  const std::vector<uint8_t> full = valid_file().build(&header);
  const std::string p = write(d, "full.gguf", full);
  ASSERT_TRUE(File::open(p).is_ok());
  ASSERT_GT(header, 150u);
  // Every prefix of the file, header and data alike, is rejected with a message naming it.
  for (std::size_t len = 0; len < full.size(); ++len) {
    const std::string tp =
        write(d, "t.gguf", std::vector<uint8_t>(full.begin(), full.begin() + len));
    Result<File> r = File::open(tp);
    ASSERT_FALSE(r.is_ok()) << "prefix of " << len << " bytes opened";
    EXPECT_NE(r.status().message().find(tp), std::string::npos) << r.status().message();
    if (len > 24 && len < header) {
      EXPECT_NE(r.status().message().find("truncated"), std::string::npos)
          << len << ": " << r.status().message();
    }
  }
}

TEST(GgufMalformed, HeaderErrors) {
  TempDir d;
  int n = 0;
  const auto open_bytes = [&](const std::vector<uint8_t>& bytes) {
    const std::string p = write(d, "m" + std::to_string(n++) + ".gguf", bytes);
    return std::pair{p, File::open(p)};
  };
  {
    auto [p, r] = open_bytes({});
    expect_error(r, Code::kInvalidArgument, p, "empty");
  }
  {
    GgufBuilder b = valid_file();
    std::memcpy(b.magic, "GGML", 4);
    auto [p, r] = open_bytes(b.build());
    expect_error(r, Code::kInvalidArgument, p, "not a GGUF file");
  }
  for (const uint32_t v : {0u, 1u, 4u, 0x03000000u}) {
    GgufBuilder b = valid_file();
    b.version = v;
    auto [p, r] = open_bytes(b.build());
    expect_error(r, Code::kUnsupported, p,
                 v == 1             ? "version 1"
                 : v == 0x03000000u ? "big-endian"
                                    : "version");
  }
  {
    GgufBuilder b = valid_file();
    b.n_kv_override = 1ull << 62;
    auto [p, r] = open_bytes(b.build());
    expect_error(r, Code::kInvalidArgument, p, "metadata count 4611686018427387904");
  }
  {
    GgufBuilder b = valid_file();
    b.n_tensors_override = ~0ull;
    auto [p, r] = open_bytes(b.build());
    expect_error(r, Code::kInvalidArgument, p, "tensor count");
  }
  {  // One key more than the file has: reads the tensor infos as metadata, then runs out.
    GgufBuilder b = valid_file();
    b.n_kv_override = 6;
    auto [p, r] = open_bytes(b.build());
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find(p), std::string::npos);
  }
  {
    auto [p, r] = open_bytes(GgufBuilder().str("k", "v").str("k", "w").build());
    expect_error(r, Code::kInvalidArgument, p, "duplicate metadata key 'k'");
  }
  {  // A string claiming 2^63 bytes.
    std::vector<uint8_t> payload;
    GgufBuilder::put(payload, uint64_t{1} << 63);
    auto [p, r] = open_bytes(GgufBuilder().raw_kv("s", 8, payload).build());
    expect_error(r, Code::kInvalidArgument, p, "has length 9223372036854775808");
  }
  {  // Arrays claiming more elements than the file holds.
    for (const uint32_t et : {4u /*u32*/, 12u /*f64*/, 8u /*string*/, 7u /*bool*/}) {
      std::vector<uint8_t> payload;
      GgufBuilder::put(payload, et);
      GgufBuilder::put(payload, uint64_t{1} << 61);
      auto [p, r] = open_bytes(GgufBuilder().raw_kv("arr", 9, payload).build());
      expect_error(r, Code::kInvalidArgument, p, "claims 2305843009213693952");
    }
  }
  {
    auto [p, r] = open_bytes(GgufBuilder().raw_kv("bad", 13, {0, 0, 0, 0}).build());
    expect_error(r, Code::kInvalidArgument, p, "value type 13");
  }
  {
    std::vector<uint8_t> payload;
    GgufBuilder::put(payload, uint32_t{77});
    GgufBuilder::put(payload, uint64_t{0});
    auto [p, r] = open_bytes(GgufBuilder().raw_kv("arr", 9, payload).build());
    expect_error(r, Code::kInvalidArgument, p, "array of type 77");
  }
  {
    std::vector<uint8_t> payload;
    GgufBuilder::put(payload, uint32_t{9});
    GgufBuilder::put(payload, uint64_t{1});
    auto [p, r] = open_bytes(GgufBuilder().raw_kv("nested", 9, payload).build());
    expect_error(r, Code::kUnsupported, p, "array of arrays");
  }
}

TEST(GgufMalformed, AlignmentErrors) {
  TempDir d;
  int n = 0;
  const auto open_b = [&](GgufBuilder b) {
    const std::string p = d.path("a" + std::to_string(n++) + ".gguf");
    GgufBuilder::write(p, b.build());
    return std::pair{p, File::open(p)};
  };
  for (const uint32_t a : {0u, 3u, 48u}) {
    GgufBuilder b = valid_file();
    b.u32("general.alignment", a);
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "general.alignment " + std::to_string(a));
  }
  {
    GgufBuilder b = valid_file();
    b.str("general.alignment", "32");
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "'general.alignment' is string");
  }
  {  // A huge power of two: the data section would start past the end.
    GgufBuilder b = valid_file();
    b.u64("general.alignment", uint64_t{1} << 62);
    b.alignment = 32;
    auto [p, r] = open_b(b);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find(p), std::string::npos);
  }
  {  // A valid alignment other than the default with data placed for it.
    GgufBuilder b = valid_file();
    b.u32("general.alignment", 256).alignment = 256;
    auto [p, r] = open_b(b);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r->data_offset() % 256, 0u);
    for (const auto& t : r->tensors()) EXPECT_EQ(t.offset % 256, 0u);
  }
}

TEST(GgufMalformed, TensorInfoErrors) {
  TempDir d;
  int n = 0;
  const auto open_b = [&](const GgufBuilder& b) {
    const std::string p = d.path("t" + std::to_string(n++) + ".gguf");
    GgufBuilder::write(p, b.build());
    return std::pair{p, File::open(p)};
  };
  const std::vector<uint8_t> f32x32(128, 0);
  {
    GgufBuilder b;
    b.tensor("past_eof", {32}, 0, {}, 4096);
    b.trailing(std::vector<uint8_t>(100, 0));
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "'past_eof'");
    EXPECT_NE(r.status().message().find("past the end"), std::string::npos);
  }
  {  // Offset near 2^64: offset + size must not wrap around.
    GgufBuilder b;
    b.tensor("wrap", {32}, 0, {}, ~uint64_t{0} - 31);
    b.trailing(f32x32);
    auto [p, r] = open_b(b);
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("'wrap'"), std::string::npos) << r.status().message();
  }
  {
    GgufBuilder b;
    b.tensor("unaligned", {32}, 0, {}, 8);
    b.trailing(std::vector<uint8_t>(256, 0));
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "offset 8, not a multiple of the alignment 32");
  }
  {
    GgufBuilder b;
    b.tensor("x", {32}, 0, f32x32).tensor("x", {32}, 0, f32x32);
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "duplicate tensor 'x'");
  }
  {
    GgufBuilder b;
    b.tensor("a", {64}, 0, {}, 0).tensor("b", {32}, 0, {}, 128);
    b.trailing(std::vector<uint8_t>(512, 0));
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "overlap");
  }
  {
    GgufBuilder b;
    b.tensor("five", {1, 1, 1, 1, 32}, 0, f32x32);
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "5 dimensions");
  }
  {
    GgufBuilder b;
    b.tensor("lies", {32}, 0, f32x32).n_dims_override(1000000);
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "1000000 dimensions");
  }
  {
    GgufBuilder b;
    b.tensor("huge", {1ull << 32, 1ull << 32}, 0, f32x32);
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "overflows");
  }
  {  // Element count fits but the byte size (4 bytes each) does not.
    GgufBuilder b;
    b.tensor("bytes", {1ull << 31, 1ull << 31}, 0, f32x32);
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "'bytes'");
  }
  {
    GgufBuilder b;
    b.tensor("partial", {48, 2}, id(TensorType::kQ4_0), std::vector<uint8_t>(54, 0));
    auto [p, r] = open_b(b);
    expect_error(r, Code::kInvalidArgument, p, "not a multiple of the q4_0 block of 32");
  }
  for (const uint32_t t : {4u, 31u, 40u, 1000u}) {
    GgufBuilder b;
    b.tensor("odd", {32}, t, f32x32);
    auto [p, r] = open_b(b);
    expect_error(r, Code::kUnsupported, p, "type id " + std::to_string(t));
  }
}

// Random corruption of the header region: whatever happens, no crash, and whatever opens has
// every tensor inside the file.
TEST(GgufMalformed, RandomCorruptionNeverCrashes) {
  TempDir d;
  std::size_t header = 0;
  const std::vector<uint8_t> full = valid_file().build(&header);
  std::mt19937 rng(12345);
  std::uniform_int_distribution<std::size_t> pos(0, header - 1);
  std::uniform_int_distribution<int> byte(0, 255), count(1, 8);
  int opened = 0;
  const std::string p = d.path("c.gguf");
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<uint8_t> b = full;
    for (int k = count(rng); k > 0; --k) b[pos(rng)] = static_cast<uint8_t>(byte(rng));
    GgufBuilder::write(p, b);
    Result<File> r = File::open(p);
    if (!r.is_ok()) {
      EXPECT_NE(r.status().message().find(p), std::string::npos) << r.status().message();
      continue;
    }
    ++opened;
    for (const auto& t : r->tensors()) {
      ASSERT_LE(r->data_offset(), r->file_size());
      ASSERT_LE(t.offset, r->file_size() - r->data_offset());
      ASSERT_LE(t.n_bytes, r->file_size() - r->data_offset() - t.offset);
      if (gguf::tensor_type_supported(t.type) && t.n_rows() > 0 &&
          t.row_bytes() * t.n_rows() == t.n_bytes) {
        std::vector<float> row(static_cast<std::size_t>(t.n_elements / t.n_rows()));
        EXPECT_TRUE(
            gguf::dequantize_row(t.type, t.row(t.n_rows() - 1), row.data(), row.size()).is_ok());
      }
    }
  }
  EXPECT_GT(opened, 0);  // some corruptions (string contents) leave a valid file
}

TEST(GgufMalformed, MissingFileAndDirectory) {
  TempDir d;
  const std::string missing = d.path("nope.gguf");
  Result<File> r = File::open(missing);
  expect_error(r, Code::kInvalidArgument, missing, "cannot open");
  const std::string dir = d.path("");
  Result<File> rd = File::open(dir);
  ASSERT_FALSE(rd.is_ok());
}

}  // namespace
}  // namespace treeattn
