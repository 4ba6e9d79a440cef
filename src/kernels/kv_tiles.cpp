// The tiled KV cache (include/treeattn/kv_tiles.hpp): allocation and growth, token writes and
// reads in the tile layout, and the validation of tiled views.
#include "treeattn/kv_tiles.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace treeattn {
namespace {

bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool add_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

Status check_tile_tokens(int64_t t) {
  if (t != 16 && (t < 32 || t > 256 || t % 32 != 0))
    return invalid_argument("tile_tokens must be 16 or a multiple of 32 up to 256, got " +
                            std::to_string(t));
  return Status::ok();
}

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// "0x1.8p-3": a float's exact value, for messages about bits.
std::string float_hex(float f) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%a", static_cast<double>(f));
  return buf;
}

}  // namespace

std::string_view kv_tile_layout_name(KVTileLayout layout) {
  switch (layout) {
    case KVTileLayout::kSplit: return "split";
    case KVTileLayout::kInterleaved: return "interleaved";
  }
  return "?";
}

Result<KVTileLayout> parse_kv_tile_layout(std::string_view name) {
  for (KVTileLayout l : {KVTileLayout::kSplit, KVTileLayout::kInterleaved})
    if (kv_tile_layout_name(l) == name) return l;
  return invalid_argument("unknown KV tile layout '" + std::string(name) +
                          "' (known: split, interleaved)");
}

Status TiledKVShard::validate(const AttnShape& shape) const {
  bool any = false;
  TREEATTN_RETURN_IF_ERROR(
      validate_placement(shape, len, pos_start, total_len, pos_stride, "tiled KV shard", &any));
  TREEATTN_RETURN_IF_ERROR(check_tile_tokens(tile_tokens));
  const auto batch = static_cast<std::size_t>(shape.batch);
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  const int64_t tile_bytes = shape.head_dim * tile_tokens * es;  // K^T or V of one tile
  for (std::size_t b = 0; b < batch; ++b) {
    if (len[b] == 0) continue;
    const std::string row = "batch row " + std::to_string(b);
    const int64_t tiles = (len[b] + tile_tokens - 1) / tile_tokens;
    int64_t far = 0, t = 0;
    if (!mul_ok(static_cast<int64_t>(b), batch_stride, &far) ||
        !mul_ok(shape.kv_heads - 1, head_stride, &t) || !add_ok(far, t, &far) ||
        !mul_ok(tiles - 1, tile_stride, &t) || !add_ok(far, t, &far) ||
        !add_ok(far, tile_bytes, &far))
      return invalid_argument(row + ": KV length " + std::to_string(len[b]) +
                              " with the given tile strides overflows 64-bit offsets");
    if (dtype_is_quantized(dtype)) {
      if (!mul_ok(static_cast<int64_t>(b), scale_batch_stride, &far) ||
          !mul_ok(shape.kv_heads - 1, scale_head_stride, &t) || !add_ok(far, t, &far) ||
          !mul_ok(tiles - 1, scale_tile_stride, &t) || !add_ok(far, t, &far) ||
          !add_ok(far, tile_tokens, &far))
        return invalid_argument(row + ": KV length " + std::to_string(len[b]) +
                                " with the given scale strides overflows 64-bit offsets");
    }
  }
  if (any) {
    if (k == nullptr || v == nullptr)
      return invalid_argument("tiled KV shard has tokens but a null K or V pointer");
    if (tile_stride < tile_bytes)
      return invalid_argument("tile stride " + std::to_string(tile_stride) +
                              " bytes is smaller than one tile (" + std::to_string(tile_bytes) +
                              " bytes for head_dim " + std::to_string(shape.head_dim) + " x " +
                              std::to_string(tile_tokens) + " tokens of " +
                              std::string(dtype_name(dtype)) + ")");
    if (batch_stride < 0 || head_stride < 0)
      return invalid_argument("tiled KV batch/head strides must be non-negative");
  }
  const bool quantized = dtype_is_quantized(dtype);
  if (!quantized && (k_scale != nullptr || v_scale != nullptr))
    return invalid_argument("tiled KV shard of dtype " + std::string(dtype_name(dtype)) +
                            " has scale arrays; scales are only for quantized dtypes (fp8, int8)");
  if (quantized && any) {
    if (k_scale == nullptr || v_scale == nullptr)
      return invalid_argument("quantized tiled KV shard (dtype " + std::string(dtype_name(dtype)) +
                              ") needs K and V scale arrays, got a null scale pointer");
    if (scale_batch_stride < 0 || scale_head_stride < 0 || scale_tile_stride < tile_tokens)
      return invalid_argument("tiled KV scale strides must be non-negative with a tile stride >= " +
                              std::to_string(tile_tokens) + ", got " +
                              std::to_string(scale_batch_stride) + ", " +
                              std::to_string(scale_head_stride) + ", " +
                              std::to_string(scale_tile_stride));
  }
  return Status::ok();
}

Result<TiledKVCache> TiledKVCache::create(const AttnShape& shape, DType dtype,
                                          int64_t capacity_tokens, KVTileLayout layout,
                                          int64_t tile_tokens) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  TREEATTN_RETURN_IF_ERROR(check_tile_tokens(tile_tokens));
  if (layout != KVTileLayout::kSplit && layout != KVTileLayout::kInterleaved)
    return invalid_argument("unknown KV tile layout " + std::to_string(static_cast<int>(layout)));
  if (capacity_tokens < 0)
    return invalid_argument("tiled KV cache capacity must be >= 0 tokens, got " +
                            std::to_string(capacity_tokens));
  TiledKVCache c;
  c.shape_ = shape;
  c.dtype_ = dtype;
  c.layout_ = layout;
  c.tile_ = tile_tokens;
  TREEATTN_RETURN_IF_ERROR(c.allocate((capacity_tokens + tile_tokens - 1) / tile_tokens));
  return c;
}

void TiledKVCache::Free::operator()(void* p) const {
  if (p == nullptr) return;
  if (mapped > 0) munmap(p, mapped);
  else std::free(p);
}

Status TiledKVCache::allocate(int64_t tiles) {
  const int64_t es = static_cast<int64_t>(dtype_size(dtype_));
  const int64_t T = tile_, D = shape_.head_dim, rows = shape_.batch * shape_.kv_heads;
  const bool quant = dtype_is_quantized(dtype_);
  const int64_t part = D * T * es;  // K^T or V of one tile
  constexpr auto kSB = static_cast<int64_t>(sizeof(bf16_t));  // bytes per scale
  int64_t total = 0;
  if (layout_ == KVTileLayout::kSplit) {
    int64_t region = 0, scales = 0;
    if (!mul_ok(rows, tiles, &region) || !mul_ok(region, part, &region) ||
        !mul_ok(rows * T, tiles, &scales) || !mul_ok(scales, quant ? kSB : 0, &scales) ||
        !add_ok(2 * round_up(region, 64), 2 * round_up(scales, 64), &total))
      return Status(Code::kOutOfMemory, "tiled KV cache of " + std::to_string(tiles) +
                                            " tiles per head overflows 64-bit sizes");
    tile_stride_ = part;
    head_stride_ = tiles * part;
    v_base_ = static_cast<std::size_t>(round_up(region, 64));
    kscale_base_ = static_cast<std::size_t>(2 * round_up(region, 64) / kSB);
    vscale_base_ = kscale_base_ + static_cast<std::size_t>(round_up(scales, 64) / kSB);
    scale_tile_stride_ = T;
    scale_head_stride_ = tiles * T;
  } else {
    const int64_t record = round_up(2 * part + (quant ? 2 * T * kSB : 0), 64);
    if (!mul_ok(rows, tiles, &total) || !mul_ok(total, record, &total))
      return Status(Code::kOutOfMemory, "tiled KV cache of " + std::to_string(tiles) +
                                            " tiles per head overflows 64-bit sizes");
    tile_stride_ = record;
    head_stride_ = tiles * record;
    v_base_ = static_cast<std::size_t>(part);
    kscale_base_ = static_cast<std::size_t>(2 * part / kSB);
    vscale_base_ = kscale_base_ + static_cast<std::size_t>(T);
    scale_tile_stride_ = record / kSB;
    scale_head_stride_ = tiles * record / kSB;
  }
  const auto bytes = static_cast<std::size_t>(std::max<int64_t>(round_up(total, 64), 64));
  // Large caches are anonymous mappings: zero pages the kernel commits as they are written, so a
  // serving engine's multi-gigabyte page pool costs neither start-up time nor memory until used.
  // They ask for transparent huge pages (honoured where the system's THP mode is madvise or
  // always; the pool then commits 2 MiB at a time): the decode kernels' software prefetch runs
  // kilobytes ahead of the reads, across page boundaries, and with 4 KiB pages (THP mode never)
  // 16-bit K/V read 1-5% slower (`treeattn_roofline --layouts tiled --seq 262144`, whose probe
  // reads the same pages). Small ones come from the heap, zeroed.
  constexpr std::size_t kMapFrom = std::size_t{2} << 20;
  void* p = nullptr;
  Free del;
  if (bytes >= kMapFrom) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) p = nullptr;
    if (p != nullptr) madvise(p, bytes, MADV_HUGEPAGE);  // advice: a refusal changes nothing
    del.mapped = bytes;
  } else {
    p = std::aligned_alloc(64, bytes);
    if (p != nullptr) std::memset(p, 0, bytes);
  }
  if (p == nullptr)
    return Status(Code::kOutOfMemory, "cannot allocate " + std::to_string(bytes) +
                                          " bytes for a tiled KV cache (" + shape_.to_string() +
                                          ", " + std::to_string(tiles * T) + " tokens)");
  mem_ = std::unique_ptr<uint8_t, Free>(static_cast<uint8_t*>(p), del);
  bytes_ = bytes;
  tiles_ = tiles;
  return Status::ok();
}

std::size_t TiledKVCache::k_tile_offset(int64_t b, int64_t h, int64_t t) const {
  return static_cast<std::size_t>((b * shape_.kv_heads + h) * head_stride_ +
                                  (t / tile_) * tile_stride_);
}

std::size_t TiledKVCache::v_tile_offset(int64_t b, int64_t h, int64_t t) const {
  return v_base_ + static_cast<std::size_t>((b * shape_.kv_heads + h) * head_stride_ +
                                            (t / tile_) * tile_stride_);
}

// K is transposed in panels: element d of a token sits one panel row (P elements) after d - 1.
void kv_tile_put_k(void* k_tile, int64_t T, int64_t D, int64_t l, const void* row,
                   std::size_t es) {
  const auto P = static_cast<std::size_t>(kv_tile_panel(T));
  uint8_t* col = static_cast<uint8_t*>(k_tile) + kv_tile_k_index(T, D, l, 0) * es;
  const auto* src = static_cast<const uint8_t*>(row);
  for (std::size_t d = 0; d < static_cast<std::size_t>(D); ++d)
    std::memcpy(col + d * P * es, src + d * es, es);
}

void kv_tile_get_k(const void* k_tile, int64_t T, int64_t D, int64_t l, void* row,
                   std::size_t es) {
  const auto P = static_cast<std::size_t>(kv_tile_panel(T));
  const uint8_t* col = static_cast<const uint8_t*>(k_tile) + kv_tile_k_index(T, D, l, 0) * es;
  auto* dst = static_cast<uint8_t*>(row);
  for (std::size_t d = 0; d < static_cast<std::size_t>(D); ++d)
    std::memcpy(dst + d * es, col + d * P * es, es);
}

void kv_tile_put_v(void* v_tile, int64_t T, int64_t D, int64_t l, const void* row,
                   std::size_t es) {
  for (int64_t p0 = 0; p0 < D; p0 += kKVTileVPanel)  // one panel row each
    std::memcpy(static_cast<uint8_t*>(v_tile) + kv_tile_v_index(T, D, l, p0) * es,
                static_cast<const uint8_t*>(row) + p0 * es,
                static_cast<std::size_t>(std::min(kKVTileVPanel, D - p0)) * es);
}

void kv_tile_get_v(const void* v_tile, int64_t T, int64_t D, int64_t l, void* row,
                   std::size_t es) {
  for (int64_t p0 = 0; p0 < D; p0 += kKVTileVPanel)
    std::memcpy(static_cast<uint8_t*>(row) + p0 * es,
                static_cast<const uint8_t*>(v_tile) + kv_tile_v_index(T, D, l, p0) * es,
                static_cast<std::size_t>(std::min(kKVTileVPanel, D - p0)) * es);
}

std::size_t TiledKVCache::scale_index(int64_t b, int64_t h, int64_t t) const {
  return static_cast<std::size_t>((b * shape_.kv_heads + h) * scale_head_stride_ +
                                  (t / tile_) * scale_tile_stride_ + t % tile_);
}

void TiledKVCache::set_token_raw(int64_t b, int64_t h, int64_t t, const void* k, const void* v,
                                 bf16_t k_scale, bf16_t v_scale) {
  const std::size_t es = dtype_size(dtype_);
  uint8_t* base = mem_.get();
  kv_tile_put_k(base + k_tile_offset(b, h, t), tile_, shape_.head_dim, t % tile_, k, es);
  kv_tile_put_v(base + v_tile_offset(b, h, t), tile_, shape_.head_dim, t % tile_, v, es);
  if (dtype_is_quantized(dtype_)) {
    auto* f = reinterpret_cast<bf16_t*>(base);
    f[kscale_base_ + scale_index(b, h, t)] = k_scale;
    f[vscale_base_ + scale_index(b, h, t)] = v_scale;
  }
}

void TiledKVCache::set_token(int64_t b, int64_t h, int64_t t, const float* k, const float* v) {
  const auto D = static_cast<std::size_t>(shape_.head_dim);
  // Encode into a token-major scratch first (KVCache's exact rules), then place it. The
  // scales are bfloat16 values (quantize_token()), so to_bf16 keeps them exactly.
  uint8_t kbuf[256 * 4], vbuf[256 * 4];
  bf16_t ks{}, vs{};
  if (dtype_is_quantized(dtype_)) {
    ks = to_bf16(quantize_token(kbuf, dtype_, 0, k, D));
    vs = to_bf16(quantize_token(vbuf, dtype_, 0, v, D));
  } else {
    for (std::size_t d = 0; d < D; ++d) {
      store_from_float(kbuf, dtype_, d, k[d]);
      store_from_float(vbuf, dtype_, d, v[d]);
    }
  }
  set_token_raw(b, h, t, kbuf, vbuf, ks, vs);
}

void TiledKVCache::set_tokens(int64_t b, int64_t t, const float* k, const float* v) {
  const int64_t D = shape_.head_dim;
  for (int64_t h = 0; h < shape_.kv_heads; ++h) set_token(b, h, t, k + h * D, v + h * D);
}

void TiledKVCache::read_token_raw(int64_t b, int64_t h, int64_t t, void* k, void* v,
                                  bf16_t* k_scale, bf16_t* v_scale) const {
  const std::size_t es = dtype_size(dtype_);
  const uint8_t* base = mem_.get();
  kv_tile_get_k(base + k_tile_offset(b, h, t), tile_, shape_.head_dim, t % tile_, k, es);
  kv_tile_get_v(base + v_tile_offset(b, h, t), tile_, shape_.head_dim, t % tile_, v, es);
  *k_scale = *v_scale = bf16_t{};
  if (dtype_is_quantized(dtype_)) {
    const auto* f = reinterpret_cast<const bf16_t*>(base);
    *k_scale = f[kscale_base_ + scale_index(b, h, t)];
    *v_scale = f[vscale_base_ + scale_index(b, h, t)];
  }
}

void TiledKVCache::read_token(int64_t b, int64_t h, int64_t t, float* k, float* v) const {
  const auto D = static_cast<std::size_t>(shape_.head_dim);
  uint8_t kbuf[256 * 4], vbuf[256 * 4];
  bf16_t ks{}, vs{};
  read_token_raw(b, h, t, kbuf, vbuf, &ks, &vs);
  for (std::size_t d = 0; d < D; ++d) {
    k[d] = dequantize(kbuf, dtype_, d, bf16_value(ks));
    v[d] = dequantize(vbuf, dtype_, d, bf16_value(vs));
  }
}

float tiled_element(const TiledKVShard& kv, int64_t head_dim, bool value, int64_t b, int64_t h,
                    int64_t t, int64_t d) {
  const int64_t T = kv.tile_tokens, tile = t / T, lane = t % T;
  const int64_t base = b * kv.batch_stride + h * kv.head_stride + tile * kv.tile_stride;
  const auto es = static_cast<int64_t>(dtype_size(kv.dtype));
  const int64_t elem =
      value ? kv_tile_v_index(T, head_dim, lane, d) : kv_tile_k_index(T, head_dim, lane, d);
  const auto* at = static_cast<const uint8_t*>(value ? kv.v : kv.k) + base + elem * es;
  float scale = 0.0f;
  if (dtype_is_quantized(kv.dtype)) {
    const int64_t si = b * kv.scale_batch_stride + h * kv.scale_head_stride +
                       tile * kv.scale_tile_stride + lane;
    scale = bf16_value((value ? kv.v_scale : kv.k_scale)[si]);
  }
  return dequantize(at, kv.dtype, 0, scale);
}

Status TiledKVCache::reserve(int64_t tokens) {
  if (tokens <= capacity()) return Status::ok();
  TiledKVCache grown;
  grown.shape_ = shape_;
  grown.dtype_ = dtype_;
  grown.layout_ = layout_;
  grown.tile_ = tile_;
  TREEATTN_RETURN_IF_ERROR(grown.allocate((tokens + tile_ - 1) / tile_));
  // Tiles of a (row, head) keep their index; copy tile by tile (K, V and scales).
  const std::size_t es = dtype_size(dtype_);
  const auto part = static_cast<std::size_t>(shape_.head_dim * tile_) * es;
  const bool quant = dtype_is_quantized(dtype_);
  const uint8_t* src = mem_.get();
  uint8_t* dst = grown.mem_.get();
  for (int64_t r = 0; r < shape_.batch * shape_.kv_heads; ++r)
    for (int64_t i = 0; i < tiles_; ++i) {
      const auto so = static_cast<std::size_t>(r * head_stride_ + i * tile_stride_);
      const auto d_o = static_cast<std::size_t>(r * grown.head_stride_ + i * grown.tile_stride_);
      std::memcpy(dst + d_o, src + so, part);
      std::memcpy(dst + grown.v_base_ + d_o, src + v_base_ + so, part);
      if (quant) {
        const auto ss = static_cast<std::size_t>(r * scale_head_stride_ + i * scale_tile_stride_);
        const auto ds =
            static_cast<std::size_t>(r * grown.scale_head_stride_ + i * grown.scale_tile_stride_);
        auto* fd = reinterpret_cast<bf16_t*>(dst);
        const auto* fs = reinterpret_cast<const bf16_t*>(src);
        const auto T = static_cast<std::size_t>(tile_);
        std::memcpy(fd + grown.kscale_base_ + ds, fs + kscale_base_ + ss, T * sizeof(bf16_t));
        std::memcpy(fd + grown.vscale_base_ + ds, fs + vscale_base_ + ss, T * sizeof(bf16_t));
      }
    }
  *this = std::move(grown);
  return Status::ok();
}

TiledKVShard TiledKVCache::view(std::span<const int64_t> len, std::span<const int64_t> pos_start,
                                std::span<const int64_t> total_len, int64_t pos_stride) const {
  TiledKVShard s;
  s.dtype = dtype_;
  s.tile_tokens = tile_;
  const uint8_t* base = mem_.get();
  s.k = base;
  s.v = base != nullptr ? base + v_base_ : nullptr;
  s.tile_stride = tile_stride_;
  s.head_stride = head_stride_;
  s.batch_stride = shape_.kv_heads * head_stride_;
  if (dtype_is_quantized(dtype_) && base != nullptr) {
    const auto* f = reinterpret_cast<const bf16_t*>(base);
    s.k_scale = f + kscale_base_;
    s.v_scale = f + vscale_base_;
    s.scale_tile_stride = scale_tile_stride_;
    s.scale_head_stride = scale_head_stride_;
    s.scale_batch_stride = shape_.kv_heads * scale_head_stride_;
  }
  s.len = len;
  s.pos_start = pos_start;
  s.total_len = total_len;
  s.pos_stride = pos_stride;
  return s;
}

Result<TiledKVCache> TiledKVCache::copy_from(const AttnShape& shape, const KVShard& src,
                                             int64_t capacity_tokens, KVTileLayout layout,
                                             int64_t tile_tokens) {
  TREEATTN_RETURN_IF_ERROR(src.validate(shape));
  if (src.memory != MemorySpace::kHost)
    return unsupported("TiledKVCache::copy_from reads host memory only");
  int64_t longest = 0;
  for (int64_t l : src.len) longest = std::max(longest, l);
  if (dtype_is_quantized(src.dtype))  // the tiles hold bf16 scales: refuse any other, unchanged
    for (int64_t b = 0; b < shape.batch; ++b)
      for (int64_t h = 0; h < shape.kv_heads; ++h)
        for (int64_t t = 0; t < src.len[static_cast<std::size_t>(b)]; ++t) {
          const int64_t si =
              b * src.scale_stride_batch + h * src.scale_stride_head + t * src.scale_stride_token;
          for (const float* sc : {src.k_scale, src.v_scale})
            if (!is_bf16_value(sc[si]))
              return invalid_argument(
                  "TiledKVCache::copy_from: batch row " + std::to_string(b) + ", KV head " +
                  std::to_string(h) + ", token " + std::to_string(t) + ": " +
                  (sc == src.k_scale ? "K" : "V") + " scale " + std::to_string(sc[si]) + " (" +
                  float_hex(sc[si]) +
                  ") is not a bfloat16 value; the tiled layout stores bf16 scales "
                  "(quantize_token() makes them)");
        }
  Result<TiledKVCache> c =
      create(shape, src.dtype, std::max(capacity_tokens, longest), layout, tile_tokens);
  if (!c.is_ok()) return c.status();
  // Tile by tile: V by memcpy per panel row, K transposed element by element (1, 2 or 4 bytes),
  // one (row, head) per OpenMP thread.
  const int64_t es = static_cast<int64_t>(dtype_size(src.dtype));
  const bool quant = dtype_is_quantized(src.dtype);
  const int64_t D = shape.head_dim, T = tile_tokens, Hkv = shape.kv_heads;
  TiledKVCache& dst = c.value();
  uint8_t* base = dst.mem_.get();
  auto* fbase = reinterpret_cast<bf16_t*>(base);
#pragma omp parallel for schedule(dynamic)
  for (int64_t bh = 0; bh < shape.batch * Hkv; ++bh) {
    const int64_t b = bh / Hkv, h = bh % Hkv;
    const int64_t n = src.len[static_cast<std::size_t>(b)];
    for (int64_t t0 = 0; t0 < n; t0 += T) {
      const int64_t m = std::min(T, n - t0);
      uint8_t* kt = base + dst.k_tile_offset(b, h, t0);
      uint8_t* vt = base + dst.v_tile_offset(b, h, t0);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t e = b * src.stride_batch + h * src.stride_head + (t0 + j) * src.stride_token;
        const uint8_t* ks = static_cast<const uint8_t*>(src.k) + e * es;
        kv_tile_put_v(vt, T, D, j, static_cast<const uint8_t*>(src.v) + e * es,
                      static_cast<std::size_t>(es));
        kv_tile_put_k(kt, T, D, j, ks, static_cast<std::size_t>(es));
        if (quant) {
          const int64_t si = b * src.scale_stride_batch + h * src.scale_stride_head +
                             (t0 + j) * src.scale_stride_token;
          fbase[dst.kscale_base_ + dst.scale_index(b, h, t0 + j)] = to_bf16(src.k_scale[si]);
          fbase[dst.vscale_base_ + dst.scale_index(b, h, t0 + j)] = to_bf16(src.v_scale[si]);
        }
      }
    }
  }
  return c;
}

}  // namespace treeattn
