// A small GGUF writer for tests: builds valid files byte by byte (every metadata value type,
// tensors of any type id with explicit or computed offsets) and exposes the knobs to build
// invalid ones (raw values, wrong counts, bad offsets). Independent of the reader under test:
// it only shares the format's type numbers.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/gguf.hpp"

namespace treeattn::testing {

class GgufBuilder {
 public:
  using VT = gguf::ValueType;

  uint32_t version = 3;
  uint64_t alignment = 32;  // used to place tensor data; write general.alignment yourself
  // Overrides of the counts written in the header (to build lying headers).
  std::optional<uint64_t> n_tensors_override, n_kv_override;
  char magic[4] = {'G', 'G', 'U', 'F'};

  // ---- metadata ----
  template <class T>
  GgufBuilder& scalar(std::string_view key, VT type, T v) {
    begin_kv(key, type);
    put(kv_, v);
    return *this;
  }
  GgufBuilder& u8(std::string_view k, uint8_t v) { return scalar(k, VT::kUint8, v); }
  GgufBuilder& i8(std::string_view k, int8_t v) { return scalar(k, VT::kInt8, v); }
  GgufBuilder& u16(std::string_view k, uint16_t v) { return scalar(k, VT::kUint16, v); }
  GgufBuilder& i16(std::string_view k, int16_t v) { return scalar(k, VT::kInt16, v); }
  GgufBuilder& u32(std::string_view k, uint32_t v) { return scalar(k, VT::kUint32, v); }
  GgufBuilder& i32(std::string_view k, int32_t v) { return scalar(k, VT::kInt32, v); }
  GgufBuilder& u64(std::string_view k, uint64_t v) { return scalar(k, VT::kUint64, v); }
  GgufBuilder& i64(std::string_view k, int64_t v) { return scalar(k, VT::kInt64, v); }
  GgufBuilder& f32(std::string_view k, float v) { return scalar(k, VT::kFloat32, v); }
  GgufBuilder& f64(std::string_view k, double v) { return scalar(k, VT::kFloat64, v); }
  GgufBuilder& boolean(std::string_view k, bool v) {
    return scalar(k, VT::kBool, static_cast<uint8_t>(v));
  }
  GgufBuilder& str(std::string_view k, std::string_view v) {
    begin_kv(k, VT::kString);
    put_string(kv_, v);
    return *this;
  }
  template <class T>
  GgufBuilder& array(std::string_view k, VT elem, const std::vector<T>& v) {
    begin_kv(k, VT::kArray);
    put(kv_, static_cast<uint32_t>(elem));
    put(kv_, static_cast<uint64_t>(v.size()));
    for (const T& e : v) put(kv_, e);
    return *this;
  }
  template <class S>
  GgufBuilder& string_array(std::string_view k, const std::vector<S>& v) {
    begin_kv(k, VT::kArray);
    put(kv_, static_cast<uint32_t>(VT::kString));
    put(kv_, static_cast<uint64_t>(v.size()));
    for (const auto& e : v) put_string(kv_, e);
    return *this;
  }
  // A key with an arbitrary type number and payload bytes (for invalid values).
  GgufBuilder& raw_kv(std::string_view k, uint32_t type, const std::vector<uint8_t>& payload) {
    ++n_kv_;
    put_string(kv_, k);
    put(kv_, type);
    kv_.insert(kv_.end(), payload.begin(), payload.end());
    return *this;
  }
  // Copies one metadata value of an opened file (arrays included).
  GgufBuilder& copy(std::string_view key, const gguf::Value& v) {
    begin_kv(key, v.type);
    if (v.type == VT::kArray) {
      put(kv_, static_cast<uint32_t>(v.elem_type));
      put(kv_, v.count);
      if (v.elem_type == VT::kString) {
        for (const auto& s : v.strings) put_string(kv_, s);
      } else {
        const std::size_t es = elem_size(v.elem_type);
        kv_.insert(kv_.end(), v.raw, v.raw + v.count * es);
      }
    } else if (v.type == VT::kString) {
      put_string(kv_, v.str);
    } else {
      switch (v.type) {
        case VT::kUint8:
          put(kv_, static_cast<uint8_t>(v.u));
          break;
        case VT::kInt8:
          put(kv_, static_cast<int8_t>(v.i));
          break;
        case VT::kUint16:
          put(kv_, static_cast<uint16_t>(v.u));
          break;
        case VT::kInt16:
          put(kv_, static_cast<int16_t>(v.i));
          break;
        case VT::kUint32:
          put(kv_, static_cast<uint32_t>(v.u));
          break;
        case VT::kInt32:
          put(kv_, static_cast<int32_t>(v.i));
          break;
        case VT::kUint64:
          put(kv_, v.u);
          break;
        case VT::kInt64:
          put(kv_, v.i);
          break;
        case VT::kFloat32:
          put(kv_, static_cast<float>(v.f));
          break;
        case VT::kFloat64:
          put(kv_, v.f);
          break;
        case VT::kBool:
          put(kv_, static_cast<uint8_t>(v.u));
          break;
        default:
          break;
      }
    }
    return *this;
  }

  // ---- tensors ----
  // Data is placed after the previous tensor at the next multiple of `alignment`, unless
  // `offset` is given (then nothing is placed: the data must be added with raw_data()).
  GgufBuilder& tensor(std::string_view name, std::vector<uint64_t> dims, uint32_t type,
                      std::vector<uint8_t> data, std::optional<uint64_t> offset = {}) {
    tensors_.push_back({std::string(name), std::move(dims), type, std::move(data), offset});
    return *this;
  }
  GgufBuilder& n_dims_override(uint32_t n) {
    tensors_.back().n_dims = n;
    return *this;
  }
  // Extra bytes appended after all tensor data.
  GgufBuilder& trailing(std::vector<uint8_t> bytes) {
    trailing_ = std::move(bytes);
    return *this;
  }

  // The file's bytes. header_size (out) is where the header and tensor infos end.
  std::vector<uint8_t> build(std::size_t* header_size = nullptr) const {
    std::vector<uint8_t> out(magic, magic + 4);
    put(out, version);
    put(out, n_tensors_override.value_or(tensors_.size()));
    put(out, n_kv_override.value_or(n_kv_));
    out.insert(out.end(), kv_.begin(), kv_.end());
    // Offsets.
    std::vector<uint64_t> offs;
    uint64_t at = 0;
    for (const auto& t : tensors_) {
      if (t.offset) {
        offs.push_back(*t.offset);
        continue;
      }
      at = (at + alignment - 1) / alignment * alignment;
      offs.push_back(at);
      at += t.data.size();
    }
    for (std::size_t k = 0; k < tensors_.size(); ++k) {
      const auto& t = tensors_[k];
      put_string(out, t.name);
      put(out, t.n_dims.value_or(static_cast<uint32_t>(t.dims.size())));
      for (const uint64_t d : t.dims) put(out, d);
      put(out, t.type);
      put(out, offs[k]);
    }
    if (header_size) *header_size = out.size();
    while (out.size() % alignment != 0) out.push_back(0);
    const std::size_t data0 = out.size();
    for (std::size_t k = 0; k < tensors_.size(); ++k) {
      const auto& t = tensors_[k];
      if (t.offset) continue;
      if (out.size() < data0 + offs[k]) out.resize(data0 + offs[k], 0);
      out.insert(out.end(), t.data.begin(), t.data.end());
    }
    out.insert(out.end(), trailing_.begin(), trailing_.end());
    return out;
  }

  static void write(const std::string& path, const std::vector<uint8_t>& bytes) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  }

  template <class T>
  static void put(std::vector<uint8_t>& out, T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.insert(out.end(), b, b + sizeof(T));
  }
  static void put_string(std::vector<uint8_t>& out, std::string_view s) {
    put(out, static_cast<uint64_t>(s.size()));
    out.insert(out.end(), s.begin(), s.end());
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    std::vector<uint8_t> data;
    std::optional<uint64_t> offset;
    std::optional<uint32_t> n_dims = {};
  };
  static std::size_t elem_size(VT t) {
    switch (t) {
      case VT::kUint8:
      case VT::kInt8:
      case VT::kBool:
        return 1;
      case VT::kUint16:
      case VT::kInt16:
        return 2;
      case VT::kUint32:
      case VT::kInt32:
      case VT::kFloat32:
        return 4;
      default:
        return 8;
    }
  }
  void begin_kv(std::string_view key, VT type) {
    ++n_kv_;
    put_string(kv_, key);
    put(kv_, static_cast<uint32_t>(type));
  }

  uint64_t n_kv_ = 0;
  std::vector<uint8_t> kv_;
  std::vector<Tensor> tensors_;
  std::vector<uint8_t> trailing_;
};

}  // namespace treeattn::testing
