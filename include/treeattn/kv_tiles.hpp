// The tiled KV cache: the layout the library stores appended tokens in when it owns the cache,
// chosen so that the CPU decode kernel reads it at the memory limit.
//
// Every (batch row, KV head) holds a sequence of fixed-size token tiles. Inside tile i, which
// holds tokens [i*T, (i+1)*T) of the row (T = tile_tokens):
//   K   transposed in panels of P = kv_tile_panel(T) = min(T, 32) tokens, [T/P][head_dim][P]:
//       the P keys' element d are contiguous, so the scores of a panel are vertical FMAs of a
//       broadcast q[d] with vectors of tokens, no horizontal reduction (the caller layout
//       [N][head_dim] needs one transposing sum per 16 scores), and the kernel reads each
//       panel front to back (a panel is the AVX-512 kernel's 32-token score unit);
//   V   in column panels of up to kKVTileVPanel (64) elements of head_dim: [head_dim/64][T][64],
//       then, where head_dim is not a multiple of 64, one panel [T][head_dim % 64]
//       (kv_tile_v_index()): the output update broadcasts p[t] and reads a panel row per token,
//       so each D slice of the value pass reads its panel front to back (a hardware prefetcher
//       streams it) instead of every other part of each row;
//   scales (fp8, int8 only): bfloat16 k_scale[T] and v_scale[T] (bf16_t, 2 bytes), one per
//       token: KVShard's float32 scale, which quantize_token() makes a bfloat16 value, so a
//       page holds 2 * head_dim + 4 bytes per token and KV head (kv_head_token_bytes()).
//       Readers widen a scale exactly (bf16_to_float) before they use it, so every kernel sees
//       the float32 value the caller layout would hold.
// Element widths and encodings are dtype.hpp's; the last tile of a row may be partly filled
// (slots past the row's length are never read into a result).
//
// Two placements of the tiles (KVTileLayout): kSplit keeps all K tiles of a (row, head) in one
// region and all V tiles in another (two sequential streams, like the caller layout);
// kInterleaved stores tile i as one record [K^T][V][k_scale][v_scale] (one stream).
//
// How the decode session should use it (it owns the KV shards through LocalShard):
//   1. create:  auto c = TiledKVCache::create(shape, dtype, capacity_tokens);  // per layer
//   2. append:  c->set_tokens(b, slot, k, v) with k, v [kv_heads][head_dim] floats (narrowed or
//               quantized exactly like KVCache::set_token); before writing slot >= capacity(),
//               c->reserve(2 * capacity()) (keeps the contents, may fail with kOutOfMemory).
//               Caches that already hold codes: set_token_raw(); a whole KVShard: copy_from()
//               (which refuses a scale that is not a bfloat16 value rather than change it).
//   3. attend:  TiledKVShard view = c->view(len, pos_start, total_len, pos_stride);
//               decode_partial_tiled(shape, q, view, states, options);
//      with exactly the len / pos_start / total_len / pos_stride spans LocalShard::view() puts
//      into a KVShard today (local slot j of row b at global position pos_start[b] + j*stride).
//      The states, the causal rule for q_len > 1, the -inf/NaN rules, the chunking and the
//      bitwise independence of the thread count are decode_partial()'s (kernel.hpp); results
//      are not bit-identical to decode_partial() (other summation order), both are within the
//      oracle tolerance.
//   A view stays valid until the next reserve() (which moves the memory); writes and decodes
//   must not overlap in time (no internal locking). Memory: kv_head_token_bytes() per token and KV
//   head (the caller layout's, with 2-byte scales for fp8 / int8) rounded up to whole tiles
//   and 64-byte records (bytes()).
//   Strategies that move KV between ranks move whole tiles (ring-kv rotates tiles into tiled
//   caches of the same geometry); read_token() / read_token_raw() give one token back (the
//   engine's K/V exchange), copy_from() takes a caller-layout KVShard.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string_view>

#include "treeattn/dtype.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// Tokens per tile: 16 or a multiple of 32 up to 256 (whole vectors and whole K panels). 64 reads
// at or near the best fraction of the probe for every dtype from DRAM; 16 pairs two tiles per
// 32-token score unit and pads every block. Measure: `build/release/bench/treeattn_roofline
// --layouts tiled --tile-tokens 16,32,64,128 --seq 65536,262144`.
inline constexpr int64_t kKVTileTokens = 64;

enum class KVTileLayout : uint8_t {
  kSplit,        // K tiles of a (row, head) contiguous, V tiles contiguous elsewhere
  kInterleaved,  // tile i = [K^T][V][k_scale][v_scale], tiles contiguous
};
// The placement TiledKVCache uses unless told otherwise. `treeattn_roofline --seq 65536,262144
// --layouts tiled --tile-tokens 16,32,64,128 --tile-layout interleaved,split --dtype f32,bf16
// --threads 1 --repeats 3 --no-peer --no-check` on a Zen 4 (avx512 target, tuned leads), 256k
// tokens, fraction of the probe, interleaved vs split for T 16/32/64/128: bf16
// 0.50/0.54/0.62/0.65 vs 0.27/0.29/0.33/0.41, f32 0.51/0.78/0.75/0.75 vs 0.35/0.64/0.69/0.71.
// Interleaved tiles are one stream read front to back (K panels, then V panels, then the next
// tile), which the hardware prefetcher follows and a software prefetch leads with one pointer;
// split tiles are two streams whose requests compete.
inline constexpr KVTileLayout kKVTileLayout = KVTileLayout::kInterleaved;

// Tokens per K panel of a tile of tile_tokens tokens.
constexpr int64_t kv_tile_panel(int64_t tile_tokens) { return tile_tokens < 32 ? tile_tokens : 32; }

// Elements of head_dim per V column panel (the last panel of a head holds the rest).
inline constexpr int64_t kKVTileVPanel = 64;

// Where element d of lane l (0 <= l < T) sits in a tile of T tokens, in elements from the
// tile's K (kv_tile_k_index) or V (kv_tile_v_index) base, for head dim D.
constexpr int64_t kv_tile_k_index(int64_t T, int64_t D, int64_t l, int64_t d) {
  const int64_t P = kv_tile_panel(T);
  return (l / P) * D * P + d * P + l % P;
}
constexpr int64_t kv_tile_v_index(int64_t T, int64_t D, int64_t l, int64_t d) {
  const int64_t p0 = d / kKVTileVPanel * kKVTileVPanel;  // the panel's first element
  const int64_t w = D - p0 < kKVTileVPanel ? D - p0 : kKVTileVPanel;
  return p0 * T + l * w + (d - p0);
}

// One token's K or V (D elements of es bytes, in order) into / out of lane l of a K or V tile.
void kv_tile_put_k(void* k_tile, int64_t T, int64_t D, int64_t l, const void* row,
                   std::size_t es);
void kv_tile_get_k(const void* k_tile, int64_t T, int64_t D, int64_t l, void* row,
                   std::size_t es);
void kv_tile_put_v(void* v_tile, int64_t T, int64_t D, int64_t l, const void* row,
                   std::size_t es);
void kv_tile_get_v(const void* v_tile, int64_t T, int64_t D, int64_t l, void* row,
                   std::size_t es);

std::string_view kv_tile_layout_name(KVTileLayout layout);  // "split", "interleaved"
Result<KVTileLayout> parse_kv_tile_layout(std::string_view name);

// A read-only view of a tiled KV shard. Token t of (batch row b, KV head h) is lane l = t % T of
// tile t / T; with base(b, h, i) = b * batch_stride + h * head_stride + i * tile_stride bytes
// and P = kv_tile_panel(T):
//   K element d   at (const char*)k + base + kv_tile_k_index(T, head_dim, l, d) * dtype_size(dtype)
//                    (that is ((l / P) * head_dim * P + d * P + l % P) elements)
//   V element d   at (const char*)v + base + kv_tile_v_index(T, head_dim, l, d) * dtype_size(dtype)
//   scales        k_scale[b * scale_batch_stride + h * scale_head_stride +
//                         (t / T) * scale_tile_stride + t % T]   (and v_scale alike):
//                 bf16_t elements, strides counted in them (2 bytes)
// len, pos_start, total_len and pos_stride mean exactly what they mean in KVShard: row b has
// len[b] tokens (slots 0 .. len[b]-1) at global positions pos_start[b] + j * pos_stride in a
// context of total_len[b] tokens.
struct TiledKVShard {
  DType dtype = DType::kF32;
  MemorySpace memory = MemorySpace::kHost;
  int64_t tile_tokens = kKVTileTokens;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t tile_stride = 0;   // bytes between consecutive tiles of one (row, head)
  int64_t head_stride = 0;   // bytes between KV heads
  int64_t batch_stride = 0;  // bytes between batch rows
  const bf16_t* k_scale = nullptr;  // quantized dtypes only: bfloat16 scales
  const bf16_t* v_scale = nullptr;
  int64_t scale_tile_stride = 0;  // bf16_t elements
  int64_t scale_head_stride = 0;
  int64_t scale_batch_stride = 0;
  std::span<const int64_t> len;
  std::span<const int64_t> pos_start;
  std::span<const int64_t> total_len;
  int64_t pos_stride = 1;

  // The checks of KVShard::validate (spans, lengths, positions, pointers, scales) plus the
  // tile size (16 or a multiple of 32 up to 256) and tile strides that hold a whole tile.
  Status validate(const AttnShape& shape) const;
};

// An owning tiled cache of `capacity` token slots per (batch row, KV head), 64-byte aligned,
// zero-filled. Not copyable (it may hold gigabytes); movable.
class TiledKVCache {
 public:
  TiledKVCache() = default;
  TiledKVCache(TiledKVCache&&) noexcept = default;
  TiledKVCache& operator=(TiledKVCache&&) noexcept = default;

  // capacity_tokens >= 0 (rounded up to whole tiles). Fails on an invalid shape, a tile size
  // other than 16 or a multiple of 32 up to 256, or when the memory cannot be allocated.
  static Result<TiledKVCache> create(const AttnShape& shape, DType dtype, int64_t capacity_tokens,
                                     KVTileLayout layout = kKVTileLayout,
                                     int64_t tile_tokens = kKVTileTokens);
  // The same tokens as a caller-layout view (raw copy: codes and scales are kept, so the
  // cache holds bit-identical values). shape.batch rows, len[b] tokens each. fp8 / int8: every
  // scale must be a bfloat16 value (is_bf16_value(); quantize_token()'s are), else
  // kInvalidArgument naming the row, head, token and scale (nothing is rounded).
  static Result<TiledKVCache> copy_from(const AttnShape& shape, const KVShard& src,
                                        int64_t capacity_tokens = 0,
                                        KVTileLayout layout = kKVTileLayout,
                                        int64_t tile_tokens = kKVTileTokens);

  const AttnShape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  KVTileLayout layout() const { return layout_; }
  int64_t tile_tokens() const { return tile_; }
  int64_t capacity() const { return tiles_ * tile_; }  // token slots per (row, head)
  std::size_t bytes() const { return bytes_; }           // everything allocated
  const uint8_t* data() const { return mem_.get(); }    // its first byte (null when empty)

  // Writes slot t of (b, h) from head_dim floats each, narrowed (f16/bf16, round to nearest
  // even) or quantized with a per-token scale (fp8/int8, quantize_token() in dtype.hpp) exactly
  // as KVCache::set_token does. Requires 0 <= b < batch, 0 <= h < kv_heads, 0 <= t < capacity().
  void set_token(int64_t b, int64_t h, int64_t t, const float* k, const float* v);
  // set_token for every KV head of slot t: k, v are [kv_heads][head_dim] floats (the form
  // LocalShard::set_slot and the session's appends take).
  void set_tokens(int64_t b, int64_t t, const float* k, const float* v);
  // Writes already-encoded elements (head_dim elements of dtype() each) and, for fp8/int8, the
  // token's scales as stored (bfloat16 bits; ignored otherwise).
  void set_token_raw(int64_t b, int64_t h, int64_t t, const void* k, const void* v,
                     bf16_t k_scale = {}, bf16_t v_scale = {});
  // Reads slot t of (b, h) back: dequantize() of each element (exact for every dtype).
  void read_token(int64_t b, int64_t h, int64_t t, float* k, float* v) const;
  // Reads the encoded elements and scales back as stored (bfloat16 bits; 0 for unquantized
  // dtypes).
  void read_token_raw(int64_t b, int64_t h, int64_t t, void* k, void* v, bf16_t* k_scale,
                      bf16_t* v_scale) const;

  // Makes room for at least `tokens` slots per (row, head), keeping every written slot.
  Status reserve(int64_t tokens);

  // A view of slots [0, len[b]) of every batch row; the spans must outlive the view.
  TiledKVShard view(std::span<const int64_t> len, std::span<const int64_t> pos_start,
                    std::span<const int64_t> total_len, int64_t pos_stride = 1) const;

 private:
  // Frees what allocate() took: munmap for a mapping (`mapped` bytes), std::free otherwise.
  struct Free {
    Free() noexcept : mapped(0) {}  // (no default member initializer: CWG 1397)
    explicit Free(std::size_t m) noexcept : mapped(m) {}
    std::size_t mapped;
    void operator()(void* p) const;
  };
  // Byte offsets of slot t's K tile and V tile, and its scale's index in bf16_t elements.
  std::size_t k_tile_offset(int64_t b, int64_t h, int64_t t) const;
  std::size_t v_tile_offset(int64_t b, int64_t h, int64_t t) const;
  std::size_t scale_index(int64_t b, int64_t h, int64_t t) const;
  Status allocate(int64_t tiles);

  AttnShape shape_;
  DType dtype_ = DType::kF32;
  KVTileLayout layout_ = kKVTileLayout;
  int64_t tile_ = kKVTileTokens;
  int64_t tiles_ = 0;        // tiles per (row, head)
  int64_t tile_stride_ = 0;  // bytes between tiles of a (row, head)
  int64_t head_stride_ = 0;  // bytes
  int64_t scale_tile_stride_ = 0, scale_head_stride_ = 0;  // bf16_t elements
  std::size_t v_base_ = 0;      // byte offset of V tile 0 of (0, 0)
  std::size_t kscale_base_ = 0;  // bf16_t offsets of the scales of tile 0 of (0, 0)
  std::size_t vscale_base_ = 0;
  std::size_t bytes_ = 0;
  std::unique_ptr<uint8_t, Free> mem_;
};

// Element d of token t (a slot of the view, t < len[b]) of KV head h in batch row b, K
// (value = false) or V, dequantized (exact for every dtype), read through the view's addressing
// above. For checks that walk a shard (the harness's NaN scan); kernels do not use it.
float tiled_element(const TiledKVShard& kv, int64_t head_dim, bool value, int64_t b, int64_t h,
                    int64_t t, int64_t d);

// decode_partial() on a tiled shard: same contract (states, defaults, determinism, errors),
// every Isa target (kReference is a scalar loop over the tiles). options.chunk_tokens is
// rounded up to a whole number of tiles.
Status decode_partial_tiled(const AttnShape& shape, const float* q, const TiledKVShard& kv,
                            float* states, const DecodeOptions& options = {});

}  // namespace treeattn
