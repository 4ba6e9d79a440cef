// GGUF reader: maps the file, validates the whole header against the file size, and serves
// typed metadata, the tensor directory and row dequantization (see include/treeattn/gguf.hpp).
//
// Everything read from the file is untrusted. All reads go through Cursor, which checks each
// length against the bytes left before touching them; counts are checked against what the
// remaining bytes could possibly hold before anything is reserved; sizes and offsets are
// computed with overflow-checked arithmetic. Errors carry the file name and the byte offset.
#include "treeattn/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>

#include "treeattn/dtype.hpp"

namespace treeattn::gguf {
namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS

struct TypeDesc {
  const char* name;
  uint32_t block_elems;
  uint32_t block_bytes;
};

// ggml's type table (ggml.c type_traits), by id. Ids 4, 5 and 31-33, 36-38 were removed from
// ggml; they are unknown here as there.
constexpr TypeDesc kTypes[] = {
    {"f32", 1, 4},        {"f16", 1, 2},       {"q4_0", 32, 18},     {"q4_1", 32, 20},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {"q5_0", 32, 22},     {"q5_1", 32, 24},
    {"q8_0", 32, 34},     {"q8_1", 32, 36},    {"q2_K", 256, 84},    {"q3_K", 256, 110},
    {"q4_K", 256, 144},   {"q5_K", 256, 176},  {"q6_K", 256, 210},   {"q8_K", 256, 292},
    {"iq2_xxs", 256, 66}, {"iq2_xs", 256, 74}, {"iq3_xxs", 256, 98}, {"iq1_s", 256, 50},
    {"iq4_nl", 32, 18},   {"iq3_s", 256, 110}, {"iq2_s", 256, 82},   {"iq4_xs", 256, 136},
    {"i8", 1, 1},         {"i16", 1, 2},       {"i32", 1, 4},        {"i64", 1, 8},
    {"f64", 1, 8},        {"iq1_m", 256, 56},  {"bf16", 1, 2},       {nullptr, 0, 0},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {"tq1_0", 256, 54},   {"tq2_0", 256, 66},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {nullptr, 0, 0},      {"mxfp4", 32, 17},
};

const TypeDesc* type_desc(uint32_t type) {
  if (type >= std::size(kTypes) || kTypes[type].name == nullptr) return nullptr;
  return &kTypes[type];
}

uint32_t value_size(ValueType t) {
  switch (t) {
    case ValueType::kUint8:
    case ValueType::kInt8:
    case ValueType::kBool:
      return 1;
    case ValueType::kUint16:
    case ValueType::kInt16:
      return 2;
    case ValueType::kUint32:
    case ValueType::kInt32:
    case ValueType::kFloat32:
      return 4;
    case ValueType::kUint64:
    case ValueType::kInt64:
    case ValueType::kFloat64:
      return 8;
    case ValueType::kString:
    case ValueType::kArray:
      return 0;
  }
  return 0;
}

bool is_valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::kFloat64); }
bool is_signed(ValueType t) {
  return t == ValueType::kInt8 || t == ValueType::kInt16 || t == ValueType::kInt32 ||
         t == ValueType::kInt64;
}
bool is_unsigned(ValueType t) {
  return t == ValueType::kUint8 || t == ValueType::kUint16 || t == ValueType::kUint32 ||
         t == ValueType::kUint64;
}
bool is_float(ValueType t) { return t == ValueType::kFloat32 || t == ValueType::kFloat64; }

template <class T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;  // GGUF v2/v3 here are little-endian, as is every host this builds for
}
static_assert(std::endian::native == std::endian::little, "the GGUF reader assumes a LE host");

// Reads one scalar of type t at p into the integer / float fields of v.
void decode_scalar(ValueType t, const uint8_t* p, Value& v) {
  switch (t) {
    case ValueType::kUint8:
      v.u = load_le<uint8_t>(p);
      break;
    case ValueType::kInt8:
      v.i = load_le<int8_t>(p);
      break;
    case ValueType::kUint16:
      v.u = load_le<uint16_t>(p);
      break;
    case ValueType::kInt16:
      v.i = load_le<int16_t>(p);
      break;
    case ValueType::kUint32:
      v.u = load_le<uint32_t>(p);
      break;
    case ValueType::kInt32:
      v.i = load_le<int32_t>(p);
      break;
    case ValueType::kUint64:
      v.u = load_le<uint64_t>(p);
      break;
    case ValueType::kInt64:
      v.i = load_le<int64_t>(p);
      break;
    case ValueType::kFloat32:
      v.f = load_le<float>(p);
      break;
    case ValueType::kFloat64:
      v.f = load_le<double>(p);
      break;
    case ValueType::kBool:
      v.u = load_le<uint8_t>(p) != 0 ? 1 : 0;
      break;
    case ValueType::kString:
    case ValueType::kArray:
      break;
  }
}

// A bounds-checked reader over the mapping.
class Cursor {
 public:
  Cursor(const std::string& path, const uint8_t* base, uint64_t size)
      : path_(path), base_(base), size_(size) {}
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  Status fail(const std::string& what) const {
    return invalid_argument("gguf " + path_ + ": " + what + " (at byte " + std::to_string(pos_) +
                            " of " + std::to_string(size_) + ")");
  }
  Status need(uint64_t n, const std::string& what) const {
    if (n > left())
      return fail("truncated: " + what + " needs " + std::to_string(n) + " bytes, " +
                  std::to_string(left()) + " left");
    return Status::ok();
  }
  template <class T>
  Status read(T& out, const std::string& what) {
    TREEATTN_RETURN_IF_ERROR(need(sizeof(T), what));
    out = load_le<T>(base_ + pos_);
    pos_ += sizeof(T);
    return Status::ok();
  }
  Status read_string(std::string_view& out, const std::string& what) {
    uint64_t len = 0;
    TREEATTN_RETURN_IF_ERROR(read(len, what + " length"));
    if (len > left())
      return fail("truncated or corrupt: " + what + " has length " + std::to_string(len) +
                  ", but only " + std::to_string(left()) + " bytes are left");
    out = std::string_view(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return Status::ok();
  }
  const uint8_t* here() const { return base_ + pos_; }
  void skip(uint64_t n) { pos_ += n; }  // after need()

 private:
  const std::string& path_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

std::string quoted(std::string_view s) {
  std::string out = "'";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 15];
    } else {
      out += c;
    }
    if (out.size() > 80) {
      out += "...";
      break;
    }
  }
  return out + "'";
}

float f16_at(const uint8_t* p) { return f16_to_float(load_le<uint16_t>(p)); }

// The 5-bit code e < 32 of a Q5_0 / Q5_1 block (qh: the 32 fifth bits, qs: the nibbles).
int q5_code(uint32_t qh, const uint8_t* qs, int e) {
  const int lo = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
  return lo | static_cast<int>((qh >> e) & 1u) << 4;
}

// Scale and min of sub-block s < 8 of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
void k_scale_min(const uint8_t* scales, int s, int& sc, int& m) {
  if (s < 4) {
    sc = scales[s] & 63;
    m = scales[s + 4] & 63;
  } else {
    sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4;
    m = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4;
  }
}

// Code l < 32 of sub-block s < 8 of a Q4_K (qh == nullptr) or Q5_K super-block.
int k_code(const uint8_t* qs, const uint8_t* qh, int s, int l) {
  int q = (qs[32 * (s / 2) + l] >> 4 * (s % 2)) & 15;
  if (qh != nullptr) q |= ((qh[l] >> s) & 1) << 4;
  return q;
}

// Code i < 256 of a Q6_K super-block (-32 .. 31) and the index of its scale.
int q6k_code(const uint8_t* b, int i) {
  const int h = i / 128, k = (i % 128) / 32, l = i % 32;
  const int lo = (b[64 * h + 32 * (k % 2) + l] >> 4 * (k / 2)) & 15;
  const int hi = (b[128 + 32 * h + l] >> 2 * k) & 3;
  return (lo | hi << 4) - 32;
}
int q6k_scale_index(int i) { return 8 * (i / 128) + 2 * ((i % 128) / 32) + (i % 32) / 16; }

// Block sizes of the formats below (bytes).
constexpr int kQ5_0Bytes = 22, kQ5_1Bytes = 24, kQ4_KBytes = 144, kQ5_KBytes = 176,
              kQ6_KBytes = 210;

}  // namespace

std::string value_type_name(ValueType t) {
  switch (t) {
    case ValueType::kUint8:
      return "uint8";
    case ValueType::kInt8:
      return "int8";
    case ValueType::kUint16:
      return "uint16";
    case ValueType::kInt16:
      return "int16";
    case ValueType::kUint32:
      return "uint32";
    case ValueType::kInt32:
      return "int32";
    case ValueType::kFloat32:
      return "float32";
    case ValueType::kBool:
      return "bool";
    case ValueType::kString:
      return "string";
    case ValueType::kArray:
      return "array";
    case ValueType::kUint64:
      return "uint64";
    case ValueType::kInt64:
      return "int64";
    case ValueType::kFloat64:
      return "float64";
  }
  return "type " + std::to_string(static_cast<uint32_t>(t));
}

std::string tensor_type_name(uint32_t type) {
  const TypeDesc* d = type_desc(type);
  return d ? d->name : "type " + std::to_string(type);
}

namespace {
// The readable types, in the order error messages list them.
constexpr TensorType kSupported[] = {
    TensorType::kF32,  TensorType::kF16,  TensorType::kBF16, TensorType::kQ8_0,
    TensorType::kQ4_0, TensorType::kQ4_1, TensorType::kQ5_0, TensorType::kQ5_1,
    TensorType::kQ4_K, TensorType::kQ5_K, TensorType::kQ6_K,
};

// "(supported: f32, f16, ...)" for error messages.
std::string supported_list() {
  std::string s;
  for (const TensorType t : kSupported)
    s += (s.empty() ? "(supported: " : ", ") + tensor_type_name(static_cast<uint32_t>(t));
  return s + ")";
}
}  // namespace

bool tensor_type_supported(uint32_t type) {
  for (const TensorType t : kSupported)
    if (static_cast<uint32_t>(t) == type) return true;
  return false;
}

BlockLayout block_layout(uint32_t type) {
  const TypeDesc* d = type_desc(type);
  return d ? BlockLayout{d->block_elems, d->block_bytes} : BlockLayout{};
}

// ---- rows -------------------------------------------------------------------------------

namespace {
Status check_row(const char* fn, uint32_t type, std::size_t n) {
  if (!tensor_type_supported(type))
    return unsupported(std::string(fn) + ": tensor type " + tensor_type_name(type) +
                       " is not supported " + supported_list());
  const BlockLayout b = block_layout(type);
  if (n % b.block_elems != 0)
    return invalid_argument(std::string(fn) + ": " + std::to_string(n) + " values of " +
                            tensor_type_name(type) + " are not a whole number of blocks of " +
                            std::to_string(b.block_elems));
  return Status::ok();
}
}  // namespace

Status dequantize_row(uint32_t type, const void* row, float* dst, std::size_t n) {
  TREEATTN_RETURN_IF_ERROR(check_row("dequantize_row", type, n));
  const auto* p = static_cast<const uint8_t*>(row);
  switch (static_cast<TensorType>(type)) {
    case TensorType::kF32:
      std::memcpy(dst, p, n * sizeof(float));
      break;
    case TensorType::kF16:
      for (std::size_t j = 0; j < n; ++j) dst[j] = f16_at(p + 2 * j);
      break;
    case TensorType::kBF16:
      for (std::size_t j = 0; j < n; ++j) dst[j] = bf16_to_float(load_le<uint16_t>(p + 2 * j));
      break;
    case TensorType::kQ8_0:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += 34, dst += kQuantBlock) {
        const float d = f16_at(p);
        const auto* q = reinterpret_cast<const int8_t*>(p + 2);
        for (uint32_t j = 0; j < kQuantBlock; ++j) dst[j] = d * static_cast<float>(q[j]);
      }
      break;
    case TensorType::kQ4_0:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += 18, dst += kQuantBlock) {
        const float d = f16_at(p);
        const uint8_t* qs = p + 2;
        for (uint32_t j = 0; j < 16; ++j) {
          dst[j] = d * static_cast<float>((qs[j] & 15) - 8);
          dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
        }
      }
      break;
    case TensorType::kQ4_1:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += 20, dst += kQuantBlock) {
        const float d = f16_at(p), m = f16_at(p + 2);
        const uint8_t* qs = p + 4;
        for (uint32_t j = 0; j < 16; ++j) {
          dst[j] = d * static_cast<float>(qs[j] & 15) + m;
          dst[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
        }
      }
      break;
    case TensorType::kQ5_0:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += kQ5_0Bytes, dst += kQuantBlock) {
        const float d = f16_at(p);
        const uint32_t qh = load_le<uint32_t>(p + 2);
        for (int e = 0; e < 32; ++e) dst[e] = d * static_cast<float>(q5_code(qh, p + 6, e) - 16);
      }
      break;
    case TensorType::kQ5_1:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += kQ5_1Bytes, dst += kQuantBlock) {
        const float d = f16_at(p), m = f16_at(p + 2);
        const uint32_t qh = load_le<uint32_t>(p + 4);
        for (int e = 0; e < 32; ++e) dst[e] = d * static_cast<float>(q5_code(qh, p + 8, e)) + m;
      }
      break;
    case TensorType::kQ4_K:
    case TensorType::kQ5_K: {
      const bool five = type == static_cast<uint32_t>(TensorType::kQ5_K);
      const int bytes = five ? kQ5_KBytes : kQ4_KBytes;
      for (std::size_t b = 0; b < n / kSuperBlock; ++b, p += bytes) {
        const float d = f16_at(p), dmin = f16_at(p + 2);
        const uint8_t* qh = five ? p + 16 : nullptr;
        const uint8_t* qs = five ? p + 48 : p + 16;
        for (int s = 0; s < 8; ++s, dst += 32) {
          int sc = 0, m = 0;
          k_scale_min(p + 4, s, sc, m);
          const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
          for (int l = 0; l < 32; ++l) dst[l] = ds * static_cast<float>(k_code(qs, qh, s, l)) - dm;
        }
      }
      break;
    }
    case TensorType::kQ6_K:
      for (std::size_t b = 0; b < n / kSuperBlock; ++b, p += kQ6_KBytes, dst += kSuperBlock) {
        const float d = f16_at(p + 208);
        const auto* scales = reinterpret_cast<const int8_t*>(p + 192);
        for (int i = 0; i < 256; ++i)
          dst[i] = d * static_cast<float>(scales[q6k_scale_index(i)]) *
                   static_cast<float>(q6k_code(p, i));
      }
      break;
  }
  return Status::ok();
}

Result<double> dot_row_reference(uint32_t type, const void* row, const float* x, std::size_t n) {
  TREEATTN_RETURN_IF_ERROR(check_row("dot_row_reference", type, n));
  const auto* p = static_cast<const uint8_t*>(row);
  double acc = 0.0;
  switch (static_cast<TensorType>(type)) {
    case TensorType::kF32:
      for (std::size_t j = 0; j < n; ++j) acc += double{load_le<float>(p + 4 * j)} * x[j];
      break;
    case TensorType::kF16:
      for (std::size_t j = 0; j < n; ++j) acc += double{f16_at(p + 2 * j)} * x[j];
      break;
    case TensorType::kBF16:
      for (std::size_t j = 0; j < n; ++j)
        acc += double{bf16_to_float(load_le<uint16_t>(p + 2 * j))} * x[j];
      break;
    case TensorType::kQ8_0:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += 34, x += kQuantBlock) {
        const auto* q = reinterpret_cast<const int8_t*>(p + 2);
        double s = 0.0;
        for (uint32_t j = 0; j < kQuantBlock; ++j) s += double{x[j]} * q[j];
        acc += double{f16_at(p)} * s;
      }
      break;
    case TensorType::kQ4_0:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += 18, x += kQuantBlock) {
        const uint8_t* qs = p + 2;
        double s = 0.0;
        for (uint32_t j = 0; j < 16; ++j)
          s += double{x[j]} * ((qs[j] & 15) - 8) + double{x[j + 16]} * ((qs[j] >> 4) - 8);
        acc += double{f16_at(p)} * s;
      }
      break;
    case TensorType::kQ4_1:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += 20, x += kQuantBlock) {
        const uint8_t* qs = p + 4;
        double s = 0.0, sx = 0.0;
        for (uint32_t j = 0; j < 16; ++j) {
          s += double{x[j]} * (qs[j] & 15) + double{x[j + 16]} * (qs[j] >> 4);
          sx += double{x[j]} + double{x[j + 16]};
        }
        acc += double{f16_at(p)} * s + double{f16_at(p + 2)} * sx;
      }
      break;
    case TensorType::kQ5_0:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += kQ5_0Bytes, x += kQuantBlock) {
        const uint32_t qh = load_le<uint32_t>(p + 2);
        double s = 0.0;
        for (int e = 0; e < 32; ++e) s += double{x[e]} * (q5_code(qh, p + 6, e) - 16);
        acc += double{f16_at(p)} * s;
      }
      break;
    case TensorType::kQ5_1:
      for (std::size_t b = 0; b < n / kQuantBlock; ++b, p += kQ5_1Bytes, x += kQuantBlock) {
        const uint32_t qh = load_le<uint32_t>(p + 4);
        double s = 0.0, sx = 0.0;
        for (int e = 0; e < 32; ++e) {
          s += double{x[e]} * q5_code(qh, p + 8, e);
          sx += double{x[e]};
        }
        acc += double{f16_at(p)} * s + double{f16_at(p + 2)} * sx;
      }
      break;
    case TensorType::kQ4_K:
    case TensorType::kQ5_K: {
      const bool five = type == static_cast<uint32_t>(TensorType::kQ5_K);
      const int bytes = five ? kQ5_KBytes : kQ4_KBytes;
      for (std::size_t b = 0; b < n / kSuperBlock; ++b, p += bytes) {
        const double d = f16_at(p), dmin = f16_at(p + 2);
        const uint8_t* qh = five ? p + 16 : nullptr;
        const uint8_t* qs = five ? p + 48 : p + 16;
        for (int s = 0; s < 8; ++s, x += 32) {
          int sc = 0, m = 0;
          k_scale_min(p + 4, s, sc, m);
          double sq = 0.0, sx = 0.0;
          for (int l = 0; l < 32; ++l) {
            sq += double{x[l]} * k_code(qs, qh, s, l);
            sx += double{x[l]};
          }
          acc += d * sc * sq - dmin * m * sx;
        }
      }
      break;
    }
    case TensorType::kQ6_K:
      for (std::size_t b = 0; b < n / kSuperBlock; ++b, p += kQ6_KBytes, x += kSuperBlock) {
        const double d = f16_at(p + 208);
        const auto* scales = reinterpret_cast<const int8_t*>(p + 192);
        for (int sub = 0; sub < 16; ++sub) {  // 16 values share a scale
          double sq = 0.0;
          for (int i = 16 * sub; i < 16 * sub + 16; ++i) sq += double{x[i]} * q6k_code(p, i);
          acc += d * scales[q6k_scale_index(16 * sub)] * sq;
        }
      }
      break;
  }
  return acc;
}

// ---- File -------------------------------------------------------------------------------

File::File(File&& o) noexcept
    : path_(std::move(o.path_)),
      base_(o.base_),
      size_(o.size_),
      dev_(o.dev_),
      ino_(o.ino_),
      version_(o.version_),
      alignment_(o.alignment_),
      data_offset_(o.data_offset_),
      kvs_(std::move(o.kvs_)),
      kv_index_(std::move(o.kv_index_)),
      tensors_(std::move(o.tensors_)),
      tensor_index_(std::move(o.tensor_index_)) {
  o.base_ = nullptr;
  o.size_ = 0;
}

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    base_ = o.base_;
    size_ = o.size_;
    dev_ = o.dev_;
    ino_ = o.ino_;
    version_ = o.version_;
    alignment_ = o.alignment_;
    data_offset_ = o.data_offset_;
    kvs_ = std::move(o.kvs_);
    kv_index_ = std::move(o.kv_index_);
    tensors_ = std::move(o.tensors_);
    tensor_index_ = std::move(o.tensor_index_);
    o.base_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

File::~File() { release(); }

Mapping::Mapping(Mapping&& o) noexcept : addr_(o.addr_), len_(o.len_), data_(o.data_) {
  o.addr_ = nullptr;
  o.len_ = 0;
  o.data_ = nullptr;
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    if (addr_ != nullptr) munmap(addr_, len_);
    addr_ = o.addr_;
    len_ = o.len_;
    data_ = o.data_;
    o.addr_ = nullptr;
    o.len_ = 0;
    o.data_ = nullptr;
  }
  return *this;
}

Mapping::~Mapping() {
  if (addr_ != nullptr) munmap(addr_, len_);
}

void File::release_resident_pages() const {
  if (base_ != nullptr) madvise(const_cast<uint8_t*>(base_), size_, MADV_DONTNEED);
}

Result<Mapping> File::map_again(const uint8_t* at, std::size_t bytes) const {
  const std::string file = "gguf " + path_ + ": ";
  if (base_ == nullptr || at < base_ || static_cast<uint64_t>(at - base_) > size_ ||
      bytes > size_ - static_cast<uint64_t>(at - base_))
    return invalid_argument(file + "map_again: " + std::to_string(bytes) +
                            " bytes outside the file's mapping");
  Mapping m;
  if (bytes == 0) {
    m.data_ = at;  // nothing to map: the bytes (none) are read from the whole mapping
    return m;
  }
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return invalid_argument(file + "cannot open it again: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_dev) != dev_ ||
      static_cast<uint64_t>(st.st_ino) != ino_ || static_cast<uint64_t>(st.st_size) != size_) {
    ::close(fd);
    return invalid_argument(file + "the file at this path is no longer the one loaded");
  }
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const auto offset = static_cast<uint64_t>(at - base_);
  const uint64_t first = offset / page * page;
  const uint64_t len = offset + bytes - first;
  void* p = mmap(nullptr, static_cast<std::size_t>(len), PROT_READ, MAP_SHARED, fd,
                 static_cast<off_t>(first));
  const int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) return invalid_argument(file + "mmap of a range: " + std::strerror(e));
  m.addr_ = p;
  m.len_ = static_cast<std::size_t>(len);
  m.data_ = static_cast<const uint8_t*>(p) + (offset - first);
  return m;
}

void File::release() {
  if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), size_);
  base_ = nullptr;
}

Result<File> File::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return invalid_argument("gguf " + path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return invalid_argument("gguf " + path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("gguf " + path + ": not a regular file");
  }
  if (st.st_size == 0) {
    ::close(fd);
    return invalid_argument("gguf " + path + ": the file is empty, expected a GGUF header");
  }
  void* m = mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);  // the mapping keeps the file
  if (m == MAP_FAILED) return invalid_argument("gguf " + path + ": mmap: " + std::strerror(e));
  File f;
  f.path_ = path;
  f.base_ = static_cast<const uint8_t*>(m);
  f.size_ = static_cast<uint64_t>(st.st_size);
  f.dev_ = static_cast<uint64_t>(st.st_dev);
  f.ino_ = static_cast<uint64_t>(st.st_ino);
  TREEATTN_RETURN_IF_ERROR(f.parse());  // ~File unmaps on error
  return f;
}

Status File::parse() {
  Cursor c(path_, base_, size_);
  const std::string file = "gguf " + path_ + ": ";

  // Header.
  if (size_ < 4 || std::memcmp(base_, "GGUF", 4) != 0) {
    std::string magic;
    for (uint64_t k = 0; k < std::min<uint64_t>(size_, 4); ++k) {
      static const char* hex = "0123456789abcdef";
      magic += hex[base_[k] >> 4];
      magic += hex[base_[k] & 15];
    }
    return invalid_argument(file + "not a GGUF file: the first bytes are 0x" + magic +
                            ", expected the magic \"GGUF\" (0x47475546)");
  }
  c.skip(4);
  TREEATTN_RETURN_IF_ERROR(c.read(version_, "version"));
  if (version_ != 2 && version_ != 3) {
    if (version_ == 1) return unsupported(file + "GGUF version 1 is not supported (only 2 and 3)");
    if ((version_ & 0xffffu) == 0 &&
        (__builtin_bswap32(version_) == 2 || __builtin_bswap32(version_) == 3))
      return unsupported(file + "big-endian GGUF files are not supported");
    return unsupported(file + "GGUF version " + std::to_string(version_) +
                       " is not supported (only 2 and 3)");
  }
  uint64_t n_tensors = 0, n_kv = 0;
  TREEATTN_RETURN_IF_ERROR(c.read(n_tensors, "tensor count"));
  TREEATTN_RETURN_IF_ERROR(c.read(n_kv, "metadata count"));
  // The smallest key/value takes 13 bytes (empty key, type, one byte); the smallest tensor
  // info 24 (empty name, n_dims = 0, type, offset).
  if (n_kv > c.left() / 13)
    return c.fail("truncated or corrupt: metadata count " + std::to_string(n_kv) +
                  " cannot fit in the " + std::to_string(c.left()) + " bytes left");
  if (n_tensors > c.left() / 24)
    return c.fail("truncated or corrupt: tensor count " + std::to_string(n_tensors) +
                  " cannot fit in the " + std::to_string(c.left()) + " bytes left");

  // Metadata.
  kvs_.reserve(static_cast<std::size_t>(n_kv));
  for (uint64_t k = 0; k < n_kv; ++k) {
    KeyValue kv;
    const std::string nth = "metadata key " + std::to_string(k);
    TREEATTN_RETURN_IF_ERROR(c.read_string(kv.key, nth));
    const std::string key = "key " + quoted(kv.key);
    uint32_t type = 0;
    TREEATTN_RETURN_IF_ERROR(c.read(type, key + " type"));
    if (!is_valid_value_type(type))
      return c.fail(key + " has value type " + std::to_string(type) +
                    ", which is not a GGUF type (0..12)");
    Value& v = kv.value;
    v.type = static_cast<ValueType>(type);
    if (v.type == ValueType::kString) {
      TREEATTN_RETURN_IF_ERROR(c.read_string(v.str, key + " value"));
    } else if (v.type == ValueType::kArray) {
      uint32_t et = 0;
      TREEATTN_RETURN_IF_ERROR(c.read(et, key + " array element type"));
      if (!is_valid_value_type(et))
        return c.fail(key + " is an array of type " + std::to_string(et) +
                      ", which is not a GGUF type (0..12)");
      v.elem_type = static_cast<ValueType>(et);
      TREEATTN_RETURN_IF_ERROR(c.read(v.count, key + " array length"));
      if (v.elem_type == ValueType::kArray)
        return unsupported(file + key + " is an array of arrays, which is not supported");
      if (v.elem_type == ValueType::kString) {
        if (v.count > c.left() / 8)
          return c.fail("truncated or corrupt: " + key + " claims " + std::to_string(v.count) +
                        " strings, more than the " + std::to_string(c.left()) +
                        " bytes left can hold");
        v.strings.resize(static_cast<std::size_t>(v.count));
        for (uint64_t j = 0; j < v.count; ++j)
          TREEATTN_RETURN_IF_ERROR(
              c.read_string(v.strings[j], key + " element " + std::to_string(j)));
      } else {
        const uint32_t es = value_size(v.elem_type);
        if (v.count > c.left() / es)
          return c.fail("truncated or corrupt: " + key + " claims " + std::to_string(v.count) +
                        " " + value_type_name(v.elem_type) + " elements, more than the " +
                        std::to_string(c.left()) + " bytes left can hold");
        v.raw = c.here();
        c.skip(v.count * es);
      }
    } else {
      const uint32_t es = value_size(v.type);
      TREEATTN_RETURN_IF_ERROR(c.need(es, key + " value"));
      decode_scalar(v.type, c.here(), v);
      c.skip(es);
    }
    if (!kv_index_.emplace(kv.key, kvs_.size()).second) return c.fail("duplicate metadata " + key);
    kvs_.push_back(std::move(kv));
  }

  // Alignment.
  Result<uint64_t> align = get_uint_or("general.alignment", kDefaultAlignment);
  if (!align.is_ok()) return align.status();
  alignment_ = *align;
  if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0)
    return invalid_argument(file + "general.alignment " + std::to_string(alignment_) +
                            " is not a power of two");

  // Tensor infos.
  tensors_.reserve(static_cast<std::size_t>(n_tensors));
  for (uint64_t k = 0; k < n_tensors; ++k) {
    TensorInfo t;
    TREEATTN_RETURN_IF_ERROR(c.read_string(t.name, "tensor " + std::to_string(k) + " name"));
    // Metadata keys are "general.*" and "<arch>.*"; a tensor directory that starts with one is
    // metadata the header's count left out (the count is wrong, not the tensor's shape).
    if (t.name.rfind("general.", 0) == 0)
      return c.fail("tensor " + std::to_string(k) + " is named " + quoted(t.name) +
                    ", a metadata key: the header's metadata count (" + std::to_string(n_kv) +
                    ") is smaller than the metadata that follows it");
    const std::string tn = "tensor " + quoted(t.name);
    uint32_t n_dims = 0;
    TREEATTN_RETURN_IF_ERROR(c.read(n_dims, tn + " dimension count"));
    if (n_dims > kMaxDims)
      return c.fail(tn + " has " + std::to_string(n_dims) + " dimensions, at most " +
                    std::to_string(kMaxDims) + " are allowed");
    t.dims.resize(n_dims);
    t.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      TREEATTN_RETURN_IF_ERROR(c.read(t.dims[d], tn + " dimension " + std::to_string(d)));
      if (t.dims[d] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(t.n_elements, t.dims[d], &t.n_elements) ||
          t.n_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return c.fail(tn + " has dimensions whose product overflows 63 bits");
    }
    TREEATTN_RETURN_IF_ERROR(c.read(t.type, tn + " type"));
    TREEATTN_RETURN_IF_ERROR(c.read(t.offset, tn + " offset"));
    const BlockLayout b = block_layout(t.type);
    if (b.block_elems == 0)
      return unsupported(file + tn + " has tensor type id " + std::to_string(t.type) +
                         ", which ggml does not define");
    const uint64_t row = n_dims == 0 ? 1 : t.dims[0];
    if (row % b.block_elems != 0)
      return c.fail(tn + " has a first dimension of " + std::to_string(row) +
                    ", not a multiple of the " + tensor_type_name(t.type) + " block of " +
                    std::to_string(b.block_elems));
    if (__builtin_mul_overflow(t.n_elements / b.block_elems, uint64_t{b.block_bytes}, &t.n_bytes))
      return c.fail(tn + " has a byte size that overflows 64 bits");
    if (t.offset % alignment_ != 0)
      return c.fail(tn + " has offset " + std::to_string(t.offset) +
                    ", not a multiple of the alignment " + std::to_string(alignment_));
    if (!tensor_index_.emplace(t.name, tensors_.size()).second) return c.fail("duplicate " + tn);
    tensors_.push_back(std::move(t));
  }

  // Data section: starts at the next multiple of the alignment; every tensor inside the file.
  const uint64_t pad = (alignment_ - c.pos() % alignment_) % alignment_;
  if (__builtin_add_overflow(c.pos(), pad, &data_offset_))
    return c.fail("the data section offset overflows 64 bits");
  if (!tensors_.empty() && data_offset_ > size_)
    return invalid_argument(file + "the data section would start at byte " +
                            std::to_string(data_offset_) + ", past the end of the " +
                            std::to_string(size_) + "-byte file (truncated)");
  const uint64_t data_size = tensors_.empty() ? 0 : size_ - data_offset_;
  for (TensorInfo& t : tensors_) {
    if (t.offset > data_size || t.n_bytes > data_size - t.offset)
      return invalid_argument(file + "tensor " + quoted(t.name) + " (" + tensor_type_name(t.type) +
                              ", " + std::to_string(t.n_bytes) + " bytes at data offset " +
                              std::to_string(t.offset) +
                              ") ends past the end of the file: the data section has " +
                              std::to_string(data_size) + " bytes (truncated or corrupt)");
    t.data = base_ + data_offset_ + t.offset;
  }
  // No two tensors may overlap.
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors_.size());
  for (const TensorInfo& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (std::size_t k = 1; k < by_offset.size(); ++k) {
    const TensorInfo& a = *by_offset[k - 1];
    const TensorInfo& b = *by_offset[k];
    if (a.offset + a.n_bytes > b.offset)
      return invalid_argument(file + "tensors " + quoted(a.name) + " (bytes " +
                              std::to_string(a.offset) + ".." +
                              std::to_string(a.offset + a.n_bytes) + ") and " + quoted(b.name) +
                              " (from " + std::to_string(b.offset) + ") overlap");
  }
  return Status::ok();
}

// ---- metadata accessors -----------------------------------------------------------------

const Value* File::find(std::string_view key) const {
  const auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

namespace {
std::string stored_type(const Value& v) {
  return v.type == ValueType::kArray ? "array of " + value_type_name(v.elem_type)
                                     : value_type_name(v.type);
}
}  // namespace

#define TREEATTN_GGUF_LOOKUP(expected)                                                   \
  const Value* v = find(key);                                                            \
  if (v == nullptr)                                                                      \
    return invalid_argument("gguf " + path_ + ": metadata key " + quoted(key) +          \
                            " is missing (expected " + (expected) + ")");                \
  const auto wrong_type = [&]() {                                                        \
    return invalid_argument("gguf " + path_ + ": metadata key " + quoted(key) + " is " + \
                            stored_type(*v) + ", expected " + (expected));               \
  }

Result<std::string_view> File::get_string(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("a string");
  if (v->type != ValueType::kString) return wrong_type();
  return v->str;
}

Result<bool> File::get_bool(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("a bool");
  if (v->type != ValueType::kBool) return wrong_type();
  return v->u != 0;
}

Result<int64_t> File::get_int(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("an integer");
  if (is_signed(v->type)) return v->i;
  if (!is_unsigned(v->type)) return wrong_type();
  if (v->u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return invalid_argument("gguf " + path_ + ": metadata key " + quoted(key) + " = " +
                            std::to_string(v->u) + " does not fit in int64");
  return static_cast<int64_t>(v->u);
}

Result<uint64_t> File::get_uint(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("a non-negative integer");
  if (is_unsigned(v->type)) return v->u;
  if (!is_signed(v->type)) return wrong_type();
  if (v->i < 0)
    return invalid_argument("gguf " + path_ + ": metadata key " + quoted(key) + " = " +
                            std::to_string(v->i) + ", expected a non-negative integer");
  return static_cast<uint64_t>(v->i);
}

Result<double> File::get_float(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("a float32 or float64");
  if (!is_float(v->type)) return wrong_type();
  return v->f;
}

Result<std::string_view> File::get_string_or(std::string_view key, std::string_view def) const {
  return has(key) ? get_string(key) : Result<std::string_view>(def);
}
Result<bool> File::get_bool_or(std::string_view key, bool def) const {
  return has(key) ? get_bool(key) : Result<bool>(def);
}
Result<int64_t> File::get_int_or(std::string_view key, int64_t def) const {
  return has(key) ? get_int(key) : Result<int64_t>(def);
}
Result<uint64_t> File::get_uint_or(std::string_view key, uint64_t def) const {
  return has(key) ? get_uint(key) : Result<uint64_t>(def);
}
Result<double> File::get_float_or(std::string_view key, double def) const {
  return has(key) ? get_float(key) : Result<double>(def);
}

Result<std::vector<std::string_view>> File::get_string_array(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("an array of string");
  if (v->type != ValueType::kArray || v->elem_type != ValueType::kString) return wrong_type();
  return v->strings;
}

Result<std::vector<int64_t>> File::get_int_array(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("an array of integers");
  if (v->type != ValueType::kArray || !(is_signed(v->elem_type) || is_unsigned(v->elem_type)))
    return wrong_type();
  std::vector<int64_t> out(static_cast<std::size_t>(v->count));
  const uint32_t es = value_size(v->elem_type);
  for (std::size_t j = 0; j < out.size(); ++j) {
    Value e;
    decode_scalar(v->elem_type, v->raw + j * es, e);
    if (is_unsigned(v->elem_type) &&
        e.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return invalid_argument("gguf " + path_ + ": metadata key " + quoted(key) + " element " +
                              std::to_string(j) + " = " + std::to_string(e.u) +
                              " does not fit in int64");
    out[j] = is_signed(v->elem_type) ? e.i : static_cast<int64_t>(e.u);
  }
  return out;
}

Result<std::vector<double>> File::get_float_array(std::string_view key) const {
  TREEATTN_GGUF_LOOKUP("an array of float32 or float64");
  if (v->type != ValueType::kArray || !is_float(v->elem_type)) return wrong_type();
  std::vector<double> out(static_cast<std::size_t>(v->count));
  const uint32_t es = value_size(v->elem_type);
  for (std::size_t j = 0; j < out.size(); ++j) {
    Value e;
    decode_scalar(v->elem_type, v->raw + j * es, e);
    out[j] = e.f;
  }
  return out;
}

#undef TREEATTN_GGUF_LOOKUP

// ---- tensors ----------------------------------------------------------------------------

const TensorInfo* File::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

Result<const TensorInfo*> File::tensor(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (t == nullptr)
    return invalid_argument("gguf " + path_ + ": tensor " + quoted(name) +
                            " not found (the file has " + std::to_string(tensors_.size()) +
                            " tensors)");
  if (!tensor_type_supported(t->type))
    return unsupported("gguf " + path_ + ": tensor " + quoted(name) + " has type " +
                       tensor_type_name(t->type) + ", which is not supported " + supported_list());
  return t;
}

}  // namespace treeattn::gguf
