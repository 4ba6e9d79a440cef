// Shape and KV-view validation, and the owning KVCache used by tests, benchmarks and the CLI.
#include "treeattn/shape.hpp"

#include <string>

#include "treeattn/kv_tiles.hpp"

namespace treeattn {
namespace {

bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool add_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

}  // namespace

bool head_dim_supported(int64_t head_dim) {
  for (int d : kSupportedHeadDims)
    if (d == head_dim) return true;
  return false;
}

std::string supported_head_dims_string() {
  std::string s;
  for (int d : kSupportedHeadDims) {
    if (!s.empty()) s += ", ";
    s += std::to_string(d);
  }
  return s;
}

std::string AttnShape::to_string() const {
  return "B=" + std::to_string(batch) + " H=" + std::to_string(heads) +
         " Hkv=" + std::to_string(kv_heads) + " D=" + std::to_string(head_dim) +
         " Q=" + std::to_string(q_len);
}

Status AttnShape::validate() const {
  auto positive = [](const char* what, int64_t v) -> Status {
    if (v <= 0) return invalid_argument(std::string(what) + " must be positive, got " +
                                        std::to_string(v));
    return Status::ok();
  };
  TREEATTN_RETURN_IF_ERROR(positive("batch", batch));
  TREEATTN_RETURN_IF_ERROR(positive("heads", heads));
  TREEATTN_RETURN_IF_ERROR(positive("kv_heads", kv_heads));
  TREEATTN_RETURN_IF_ERROR(positive("head_dim", head_dim));
  TREEATTN_RETURN_IF_ERROR(positive("q_len", q_len));
  if (heads % kv_heads != 0)
    return invalid_argument("heads (" + std::to_string(heads) +
                            ") must be a multiple of kv_heads (" + std::to_string(kv_heads) + ")");
  if (!head_dim_supported(head_dim))
    return unsupported("head_dim " + std::to_string(head_dim) +
                       " is not supported (supported: " + supported_head_dims_string() + ")");
  int64_t n = 0;
  if (!mul_ok(batch, q_len, &n) || !mul_ok(n, heads, &n) || !mul_ok(n, head_dim + 2, &n) ||
      !mul_ok(n, 8, &n))
    return invalid_argument("shape " + to_string() + " overflows 64-bit element counts");
  return Status::ok();
}

Status validate_placement(const AttnShape& shape, std::span<const int64_t> len,
                          std::span<const int64_t> pos_start, std::span<const int64_t> total_len,
                          int64_t pos_stride, const char* what, bool* any) {
  const auto batch = static_cast<std::size_t>(shape.batch);
  if (len.size() != batch || pos_start.size() != batch || total_len.size() != batch)
    return invalid_argument(std::string(what) + " describes " + std::to_string(len.size()) +
                            " lengths, " + std::to_string(pos_start.size()) +
                            " start positions and " + std::to_string(total_len.size()) +
                            " total lengths; batch is " + std::to_string(batch));
  if (pos_stride < 1)
    return invalid_argument(std::string(what) + " position stride must be >= 1, got " +
                            std::to_string(pos_stride));
  *any = false;
  for (std::size_t b = 0; b < batch; ++b) {
    const std::string row = "batch row " + std::to_string(b);
    if (len[b] < 0) return invalid_argument(row + ": negative KV length " + std::to_string(len[b]));
    if (total_len[b] < 0)
      return invalid_argument(row + ": negative total length " + std::to_string(total_len[b]));
    if (len[b] == 0) continue;
    *any = true;
    int64_t last = 0;
    if (pos_start[b] < 0 || !mul_ok(len[b] - 1, pos_stride, &last) ||
        !add_ok(last, pos_start[b], &last) || last >= total_len[b])
      return invalid_argument(row + ": shard tokens at positions " + std::to_string(pos_start[b]) +
                              " + j*" + std::to_string(pos_stride) + " for j < " +
                              std::to_string(len[b]) + " do not fit in a context of " +
                              std::to_string(total_len[b]) + " tokens");
  }
  return Status::ok();
}

Status KVShard::validate(const AttnShape& shape) const {
  if (tiled != nullptr) {
    if (tiled->dtype != dtype || tiled->memory != memory)
      return invalid_argument("KV shard: its tiled view holds " +
                              std::string(dtype_name(tiled->dtype)) + " in " +
                              (tiled->memory == MemorySpace::kHost ? "host" : "device") +
                              " memory, the shard says " + std::string(dtype_name(dtype)) +
                              " in " + (memory == MemorySpace::kHost ? "host" : "device") +
                              " memory");
    return tiled->validate(shape);
  }
  bool any = false;
  TREEATTN_RETURN_IF_ERROR(
      validate_placement(shape, len, pos_start, total_len, pos_stride, "KV shard", &any));
  const auto batch = static_cast<std::size_t>(shape.batch);
  for (std::size_t b = 0; b < batch; ++b) {
    if (len[b] == 0) continue;
    const std::string row = "batch row " + std::to_string(b);
    // The farthest element read must be addressable.
    int64_t far = 0, t = 0;
    if (!mul_ok(static_cast<int64_t>(b), stride_batch, &far) ||
        !mul_ok(shape.kv_heads - 1, stride_head, &t) || !add_ok(far, t, &far) ||
        !mul_ok(len[b] - 1, stride_token, &t) || !add_ok(far, t, &far) ||
        !add_ok(far, shape.head_dim, &far))
      return invalid_argument(row + ": KV length " + std::to_string(len[b]) +
                              " with the given strides overflows 64-bit offsets");
  }
  if (any) {
    if (k == nullptr || v == nullptr)
      return invalid_argument("KV shard has tokens but a null K or V pointer");
    if (stride_token < shape.head_dim)
      return invalid_argument("KV token stride " + std::to_string(stride_token) +
                              " is smaller than head_dim " + std::to_string(shape.head_dim));
    if (stride_batch < 0 || stride_head < 0)
      return invalid_argument("KV batch/head strides must be non-negative");
  }
  const bool quantized = dtype_is_quantized(dtype);
  if (!quantized && (k_scale != nullptr || v_scale != nullptr))
    return invalid_argument("KV shard of dtype " + std::string(dtype_name(dtype)) +
                            " has scale arrays; scales are only for quantized dtypes (fp8, int8)");
  if (quantized && any) {
    if (k_scale == nullptr || v_scale == nullptr)
      return invalid_argument("quantized KV shard (dtype " + std::string(dtype_name(dtype)) +
                              ") needs K and V scale arrays, got a null scale pointer");
    if (scale_stride_batch < 0 || scale_stride_head < 0 || scale_stride_token < 1)
      return invalid_argument("KV scale strides must be non-negative (token stride >= 1), got " +
                              std::to_string(scale_stride_batch) + ", " +
                              std::to_string(scale_stride_head) + ", " +
                              std::to_string(scale_stride_token));
    for (std::size_t b = 0; b < batch; ++b) {
      if (len[b] == 0) continue;
      int64_t far = 0, t = 0;
      if (!mul_ok(static_cast<int64_t>(b), scale_stride_batch, &far) ||
          !mul_ok(shape.kv_heads - 1, scale_stride_head, &t) || !add_ok(far, t, &far) ||
          !mul_ok(len[b] - 1, scale_stride_token, &t) || !add_ok(far, t, &far))
        return invalid_argument("batch row " + std::to_string(b) + ": KV length " +
                                std::to_string(len[b]) +
                                " with the given scale strides overflows 64-bit offsets");
    }
  }
  return Status::ok();
}

KVCache::KVCache(const AttnShape& shape, DType dtype, int64_t capacity)
    : shape_(shape), dtype_(dtype), capacity_(capacity) {
  const auto n = static_cast<std::size_t>(shape.batch * shape.kv_heads * capacity * shape.head_dim) *
                 dtype_size(dtype);
  k_.assign(n, 0);
  v_.assign(n, 0);
  if (dtype_is_quantized(dtype)) {
    const auto ns = static_cast<std::size_t>(shape.batch * shape.kv_heads * capacity);
    k_scale_.assign(ns, 0.0f);
    v_scale_.assign(ns, 0.0f);
  }
}

void KVCache::set_token(int64_t b, int64_t h, int64_t t, const float* k, const float* v) {
  const std::size_t base = index(b, h, t);
  if (dtype_is_quantized(dtype_)) {
    const auto n = static_cast<std::size_t>(shape_.head_dim);
    k_scale_[scale_index(b, h, t)] = quantize_token(k_.data(), dtype_, base, k, n);
    v_scale_[scale_index(b, h, t)] = quantize_token(v_.data(), dtype_, base, v, n);
    return;
  }
  const auto n = static_cast<std::size_t>(shape_.head_dim);
  store_row_from_float(k_.data(), dtype_, base, k, n);
  store_row_from_float(v_.data(), dtype_, base, v, n);
}

KVShard KVCache::view(int64_t first, std::span<const int64_t> len,
                      std::span<const int64_t> pos_start, std::span<const int64_t> total_len,
                      int64_t pos_stride) const {
  KVShard s;
  s.dtype = dtype_;
  const std::size_t off = static_cast<std::size_t>(first * stride_token()) * dtype_size(dtype_);
  s.k = k_.data() + off;
  s.v = v_.data() + off;
  s.stride_batch = stride_batch();
  s.stride_head = stride_head();
  s.stride_token = stride_token();
  s.len = len;
  s.pos_start = pos_start;
  s.total_len = total_len;
  s.pos_stride = pos_stride;
  if (dtype_is_quantized(dtype_)) {
    s.k_scale = k_scale_.data() + first;
    s.v_scale = v_scale_.data() + first;
    s.scale_stride_batch = shape_.kv_heads * capacity_;
    s.scale_stride_head = capacity_;
    s.scale_stride_token = 1;
  }
  return s;
}

}  // namespace treeattn
