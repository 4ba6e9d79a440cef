// GGUF model files (versions 2 and 3): metadata, tensor directory, and the row formats of the
// tensor types small real models ship in.
//
// A GGUF file is a little-endian header (magic "GGUF", version, tensor count, metadata count),
// the metadata key/value pairs, the tensor infos (name, dims, type, offset), padding to the
// alignment (metadata `general.alignment`, default 32), then the tensor data. Offsets in the
// tensor infos are relative to the start of the data section and must be multiples of the
// alignment.
//
// File::open maps the file read-only with MAP_SHARED, so every rank on a node that opens the
// same file shares one copy of the weights in the page cache. Opening parses and validates the
// whole header up front: every length, count, offset and size is checked against the file size
// with overflow-safe arithmetic, so that afterwards every string_view and tensor pointer handed
// out lies inside the mapping. A malformed or truncated file is a Status naming the file, the
// byte offset and what was wrong; nothing here throws or aborts.
//
// Tensor types: the directory records any ggml type whose block layout is known (so sizes are
// checked for all of them), but only F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K
// and Q6_K can be read (dequantize_row, dot_row_reference, File::tensor); the others (Q2_K,
// Q3_K, the IQ types, ...) are kUnsupported with the type and tensor named. A type id unknown to
// ggml makes the file unreadable (its size is unknown).
//
// Dimension order is ggml's: dims[0] is the contiguous (innermost) one, so a weight matrix of
// `rows x cols` (one output per row) has dims = {cols, rows} and rows of row_bytes() each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "treeattn/status.hpp"

namespace treeattn::gguf {

// Metadata value types, numbered as in the file format.
enum class ValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
// "uint32", "string", "array", ...; "type 77" for a number outside the format.
std::string value_type_name(ValueType t);

// ggml tensor types, numbered as in ggml.h: the ones supported for reading.
enum class TensorType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};
// "f32", "q4_1", "q6_K", ...; "type 77" for ids ggml does not define.
std::string tensor_type_name(uint32_t type);
// Whether dequantize_row / dot_row_reference / File::tensor serve this type.
bool tensor_type_supported(uint32_t type);

// Block layout of a ggml type: `block_elems` values are stored in `block_bytes` bytes.
struct BlockLayout {
  uint32_t block_elems = 0;
  uint32_t block_bytes = 0;
};
// The layout of every type ggml defines (supported or not); block_elems == 0 for unknown ids.
BlockLayout block_layout(uint32_t type);

// Block formats of the supported quantized types (ggml's ggml-common.h; d, m, dmin are IEEE f16,
// every field little-endian, blocks packed without padding):
// 32 values per block, j < 16:
//   Q8_0 (34 B): d, int8 q[32];                 x[j] = d * q[j]
//   Q4_0 (18 B): d, uint8 qs[16];               x[j] = d * ((qs[j] & 15) - 8),
//                                               x[j + 16] = d * ((qs[j] >> 4) - 8)
//   Q4_1 (20 B): d, m, uint8 qs[16];            x[j] = d * (qs[j] & 15) + m,
//                                               x[j + 16] = d * (qs[j] >> 4) + m
//   Q5_0 (22 B): d, uint32 qh, uint8 qs[16];    x[j] = d * (((qs[j] & 15) | h(j) << 4) - 16),
//                                               x[j + 16] = d * (((qs[j] >> 4) | h(j + 16) << 4)
//                                               - 16),   h(e) = (qh >> e) & 1
//   Q5_1 (24 B): d, m, uint32 qh, uint8 qs[16]; x[j] = d * ((qs[j] & 15) | h(j) << 4) + m,
//                                               x[j + 16] = d * ((qs[j] >> 4) | h(j + 16) << 4)
//                                               + m
// 256 values per super-block ("K" types), in sub-blocks s of 32 (Q4_K, Q5_K) or 16 (Q6_K):
//   Q4_K (144 B): d, dmin, uint8 scales[12], uint8 qs[128]
//       sub-block s < 8 has 6-bit scale sc(s) and min m(s) packed in `scales`:
//         s < 4: sc = scales[s] & 63,   m = scales[s + 4] & 63
//         s >= 4: sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4,
//                 m = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4
//       value l < 32 of sub-block s: q = (qs[32 * (s / 2) + l] >> 4 * (s % 2)) & 15,
//         x = (d * sc(s)) * q - dmin * m(s)
//   Q5_K (176 B): d, dmin, uint8 scales[12], uint8 qh[32], uint8 qs[128]
//       as Q4_K with a fifth bit: q |= ((qh[l] >> s) & 1) << 4
//   Q6_K (210 B): uint8 ql[128], uint8 qh[64], int8 scales[16], d   (d last)
//       value i = 128 h + 32 k + l (h < 2, k < 4, l < 32):
//         q = ((ql[64 h + 32 (k % 2) + l] >> 4 (k / 2)) & 15 | ((qh[32 h + l] >> 2 k) & 3) << 4)
//             - 32,
//         x = (d * scales[8 h + 2 k + l / 16]) * q
// Evaluated in float as written (d * sc and the products with q are exact in float; Q4_1, Q5_1,
// Q4_K and Q5_K round once, at the last addition), which gives the gguf package's values bit for
// bit (tests/model/test_kquants.cpp).
inline constexpr uint32_t kQuantBlock = 32;
inline constexpr uint32_t kSuperBlock = 256;

// Dequantizes n values (n a multiple of the type's block size: 32, or 256 for the K types)
// starting at `row` into dst.
// kUnsupported for other types, kInvalidArgument for a partial block.
Status dequantize_row(uint32_t type, const void* row, float* dst, std::size_t n);

// The scalar reference dot product of n values of a stored row with float x, accumulated in
// double, computed block by block from the codes (x[j] * q[j] sums scaled once per block)
// rather than by dequantizing first (K types: per sub-block, sum x q scaled by d * sc minus
// sum x scaled by dmin * m); the SIMD matvec kernels are checked against it.
Result<double> dot_row_reference(uint32_t type, const void* row, const float* x, std::size_t n);

// One metadata value. Strings and array payloads point into the mapping of the File they came
// from and live as long as it.
struct Value {
  ValueType type = ValueType::kUint8;
  // Scalars: integers (any width) in `i` (signed types) or `u` (unsigned types and bool),
  // floats in `f`, strings in `str`.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  std::string_view str;
  // Arrays: element type and count; numeric elements stay packed in the file at `raw`
  // (little-endian, possibly unaligned), string elements are listed in `strings`.
  ValueType elem_type = ValueType::kUint8;
  uint64_t count = 0;
  const uint8_t* raw = nullptr;
  std::vector<std::string_view> strings;
};

struct KeyValue {
  std::string_view key;
  Value value;
};

struct TensorInfo {
  std::string_view name;
  std::vector<uint64_t> dims;  // ggml order: dims[0] is contiguous
  uint32_t type = 0;           // a ggml type id (see TensorType); may be unsupported
  uint64_t offset = 0;         // relative to the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;  // inside the mapping

  uint64_t n_rows() const { return dims.empty() || dims[0] == 0 ? 0 : n_elements / dims[0]; }
  uint64_t row_bytes() const { return n_rows() == 0 ? 0 : n_bytes / n_rows(); }
  const uint8_t* row(uint64_t r) const { return data + r * row_bytes(); }
};

// A read-only mapping of some bytes of a file (File::map_again), unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
  const uint8_t* data() const { return data_; }  // the first byte asked for

 private:
  friend class File;
  void* addr_ = nullptr;  // page-aligned
  std::size_t len_ = 0;
  const uint8_t* data_ = nullptr;
};

class File {
 public:
  // Maps and validates `path`. kInvalidArgument for a missing, unreadable, malformed or
  // truncated file, kUnsupported for GGUF v1, big-endian files, nested arrays and tensor types
  // unknown to ggml; every message starts with "gguf <path>:".
  static Result<File> open(const std::string& path);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the data section
  uint64_t file_size() const { return size_; }

  // ---- metadata ----
  const std::vector<KeyValue>& metadata() const { return kvs_; }
  const Value* find(std::string_view key) const;  // nullptr when absent
  bool has(std::string_view key) const { return find(key) != nullptr; }

  // Typed accessors. Errors (kInvalidArgument) name the file, the key, the expected type and
  // the stored one: missing key, wrong type, or a value out of the requested range.
  Result<std::string_view> get_string(std::string_view key) const;
  Result<bool> get_bool(std::string_view key) const;
  // Any integer type whose value fits.
  Result<int64_t> get_int(std::string_view key) const;
  Result<uint64_t> get_uint(std::string_view key) const;
  // float32 or float64.
  Result<double> get_float(std::string_view key) const;
  // The same with a default for a missing key (a present key of the wrong type is an error).
  Result<std::string_view> get_string_or(std::string_view key, std::string_view def) const;
  Result<bool> get_bool_or(std::string_view key, bool def) const;
  Result<int64_t> get_int_or(std::string_view key, int64_t def) const;
  Result<uint64_t> get_uint_or(std::string_view key, uint64_t def) const;
  Result<double> get_float_or(std::string_view key, double def) const;
  // Arrays: strings; any integer element type (converted); float32/float64 elements.
  Result<std::vector<std::string_view>> get_string_array(std::string_view key) const;
  Result<std::vector<int64_t>> get_int_array(std::string_view key) const;
  Result<std::vector<double>> get_float_array(std::string_view key) const;

  // ---- tensors ----
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent
  // The named tensor if present and of a supported type: kInvalidArgument "tensor 'x' not
  // found", kUnsupported naming the tensor and its type.
  Result<const TensorInfo*> tensor(std::string_view name) const;

  // The `bytes` bytes at `at` (inside this file's mapping) mapped again on their own: a mapping
  // of just the pages that hold them, so that touching them never maps a neighbouring page of
  // the file into this process (the kernel's fault-around stops at a mapping's ends). The file
  // is opened again by its path and must still be the one mapped (same device, inode and size:
  // kInvalidArgument otherwise, as for an `at` outside the mapping).
  Result<Mapping> map_again(const uint8_t* at, std::size_t bytes) const;
  // Unmaps this process's resident pages of the file's mapping (madvise MADV_DONTNEED: the
  // page cache keeps them, and the next read of a byte maps its page again, so everything read
  // from the mapping stays valid). After loading, which reads the metadata and the small
  // tensors (and, by the kernel's fault-around, up to 64 KiB of weights around each), a process
  // that computes with slices mapped on their own (map_again) calls it to hold only those.
  void release_resident_pages() const;

 private:
  File() = default;
  void release();
  Status parse();

  std::string path_;
  const uint8_t* base_ = nullptr;  // the mapping
  uint64_t size_ = 0;
  uint64_t dev_ = 0, ino_ = 0;  // the file mapped (map_again checks it is still at path_)
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<KeyValue> kvs_;
  std::unordered_map<std::string_view, std::size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string_view, std::size_t> tensor_index_;
};

}  // namespace treeattn::gguf
