// The shape of one decode step and the KV-cache views kernels read.
//
// Layouts (all strides in elements, innermost dimension contiguous):
//   q       float32 [batch][q_len][heads][head_dim], contiguous.
//   K, V    [batch][kv_heads][tokens][head_dim] with strides (stride_batch, stride_head,
//           stride_token); the head_dim elements of one token are contiguous. Any sub-range of
//           tokens of a larger cache is therefore a view: offset the pointers, keep the strides.
//   states  float32 [batch][q_len][heads] records of head_dim + 2 floats (see state.hpp).
//   scales  quantized K/V only (dtype fp8 or int8, see dtype.hpp): float32
//           [batch][kv_heads][tokens], one scale per (token, KV head), separate arrays for K
//           and V, with their own strides (scale_stride_*); element (b, h, t, d) of K is
//           dequantize(k, dtype, elem, k_scale[b*sb + h*sh + t*st]). Null for other dtypes.
//           Any finite float is a valid scale here (the kernels are exact over it); the ones
//           quantize_token() makes are bfloat16 values, which is what the tiled layout
//           (kv_tiles.hpp, 2-byte scales) can take from a KVShard.
//
// Grouped-query attention: query head h reads KV head h / (heads / kv_heads).
//
// Multi-token queries (q_len = Q > 1, as in speculative decoding): for a sequence whose whole
// context (over all shards) has N tokens at global positions 0..N-1, query i (0 <= i < Q) may
// see the keys at global positions p <= N - Q + i. A shard records where its tokens sit
// globally (first position and stride), so this causal limit stays right when the cache is
// split contiguously or striped over ranks.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "treeattn/dtype.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// Head dims with a compiled kernel. Everything else is rejected with kUnsupported.
inline constexpr int kSupportedHeadDims[] = {64, 80, 96, 128, 192, 256};
bool head_dim_supported(int64_t head_dim);
std::string supported_head_dims_string();  // "64, 80, 96, 128, 192, 256"

struct AttnShape {
  int64_t batch = 1;
  int64_t heads = 1;     // query heads
  int64_t kv_heads = 1;  // must divide heads
  int64_t head_dim = 128;
  int64_t q_len = 1;

  int64_t group() const { return heads / kv_heads; }
  // Rejects zero/negative sizes, heads % kv_heads != 0, unsupported head dims and sizes whose
  // element counts overflow int64.
  Status validate() const;
  std::string to_string() const;  // "B=1 H=32 Hkv=8 D=128 Q=1"
  bool operator==(const AttnShape&) const = default;
};

// Where a buffer lives: host memory, or the memory of one accelerator (a CUDA device).
enum class MemorySpace : uint8_t { kHost, kDevice };

struct TiledKVShard;  // kv_tiles.hpp

// The placement part of a shard view's validation, shared by KVShard and TiledKVShard: spans
// sized batch, pos_stride >= 1, non-negative lengths, and every row's tokens at positions
// pos_start + j * pos_stride inside [0, total_len). `what` names the view in messages
// ("KV shard"). Sets *any to whether some row holds tokens.
Status validate_placement(const AttnShape& shape, std::span<const int64_t> len,
                          std::span<const int64_t> pos_start, std::span<const int64_t> total_len,
                          int64_t pos_stride, const char* what, bool* any);

// A read-only view of one shard of the KV cache.
struct KVShard {
  DType dtype = DType::kF32;
  MemorySpace memory = MemorySpace::kHost;  // where k, v and the scales live (the spans: host)
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t stride_batch = 0;  // elements between batch rows
  int64_t stride_head = 0;   // elements between KV heads
  int64_t stride_token = 0;  // elements between tokens (>= head_dim)
  // Per batch row: number of tokens of this shard, global position of its first token, and
  // the total context length N of the sequence over all shards (for the causal limit).
  std::span<const int64_t> len;
  std::span<const int64_t> pos_start;
  std::span<const int64_t> total_len;
  int64_t pos_stride = 1;  // global position of token j = pos_start[b] + j * pos_stride
  // Quantized dtypes only: per-(token, KV head) scales of K and V, same token numbering as
  // k and v (token 0 of the view is scale element 0 of its row). Strides in floats.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_stride_batch = 0;
  int64_t scale_stride_head = 0;
  int64_t scale_stride_token = 1;
  // Set when the shard's tokens are in the library's tiled layout (kv_tiles.hpp; what a decode
  // session stores by default on the host) rather than in rows: decode_partial() and the CPU
  // executor's partial() read *tiled, and k, v, the strides and the scales above are unused
  // (null / 0). The view's dtype, memory and the len / pos_start / total_len / pos_stride spans
  // are the same as *tiled's. Code that walks rows (offsetting k and v, sending them) must check
  // it; Executor::partial_chunks rejects it.
  const TiledKVShard* tiled = nullptr;

  // Checks that the view is consistent with the shape: spans sized batch, non-negative
  // lengths, pointers non-null where any length is non-zero, strides large enough and
  // positions inside [0, total_len); scale pointers present exactly for quantized dtypes.
  Status validate(const AttnShape& shape) const;
};

// An owning, contiguous KV cache [batch][kv_heads][capacity][head_dim] that hands out
// shard views. Used by tests, benchmarks and the CLI; production callers may bring their own
// memory and build KVShard views directly.
class KVCache {
 public:
  KVCache() = default;
  // Capacity is the number of token slots per (batch, kv head).
  KVCache(const AttnShape& shape, DType dtype, int64_t capacity);

  DType dtype() const { return dtype_; }
  int64_t capacity() const { return capacity_; }
  // Bytes of K and V (and of their scales for quantized dtypes).
  std::size_t bytes() const { return (k_.size() + k_scale_.size() * sizeof(float)) * 2; }
  void* k_data() { return k_.data(); }
  void* v_data() { return v_.data(); }
  const void* k_data() const { return k_.data(); }
  const void* v_data() const { return v_.data(); }
  int64_t stride_batch() const { return shape_.kv_heads * capacity_ * shape_.head_dim; }
  int64_t stride_head() const { return capacity_ * shape_.head_dim; }
  int64_t stride_token() const { return shape_.head_dim; }
  // Element index of (b, h, t, 0).
  std::size_t index(int64_t b, int64_t h, int64_t t) const {
    return static_cast<std::size_t>(b * stride_batch() + h * stride_head() + t * stride_token());
  }
  // Quantized dtypes: scales [batch][kv_heads][capacity] (empty otherwise).
  float* k_scale_data() { return k_scale_.data(); }
  float* v_scale_data() { return v_scale_.data(); }
  const float* k_scale_data() const { return k_scale_.data(); }
  const float* v_scale_data() const { return v_scale_.data(); }
  std::size_t scale_index(int64_t b, int64_t h, int64_t t) const {
    return static_cast<std::size_t>((b * shape_.kv_heads + h) * capacity_ + t);
  }
  // Write one token's K and V (head_dim floats each, narrowed to the cache dtype; quantized
  // dtypes store codes and a per-token scale, see quantize_token() in dtype.hpp).
  void set_token(int64_t b, int64_t h, int64_t t, const float* k, const float* v);

  // A view of token slots [first, first + len[b]) of every batch row. The spans must outlive
  // the view.
  KVShard view(int64_t first, std::span<const int64_t> len, std::span<const int64_t> pos_start,
               std::span<const int64_t> total_len, int64_t pos_stride) const;

 private:
  AttnShape shape_;
  DType dtype_ = DType::kF32;
  int64_t capacity_ = 0;
  std::vector<uint8_t> k_, v_;
  std::vector<float> k_scale_, v_scale_;
};

}  // namespace treeattn
