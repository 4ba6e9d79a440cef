// decode_partial_tiled() (include/treeattn/kv_tiles.hpp): validation and defaults, the scalar
// reference over tiles, and the work-item driver of the SIMD tiled item kernels.
//
// The driver is the row kernels' (item_driver.hpp), with the chunk a whole number of tiles and
// each item's K and V found through the tile addressing.
//
// Compiled for the baseline ISA; only the item kernels (cpu_targets.hpp) are per target.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/cpu/driver_tuning.hpp"
#include "kernels/cpu/item_driver.hpp"
#include "kernels/kernel_impl.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace kernels {
namespace {

using cpu::TiledItemArgs;
using cpu::TiledItemFn;

// Byte offset of tile i of (b, h), and the offset of its scales in bf16_t elements.
int64_t tile_offset(const TiledKVShard& kv, int64_t b, int64_t h, int64_t i) {
  return b * kv.batch_stride + h * kv.head_stride + i * kv.tile_stride;
}
int64_t scale_offset(const TiledKVShard& kv, int64_t b, int64_t h, int64_t i) {
  return b * kv.scale_batch_stride + h * kv.scale_head_stride + i * kv.scale_tile_stride;
}

// The scalar reference over tiles: decode_reference's per-token online softmax (one token at a
// time, float), reading K and V through the tile layout.
Status decode_tiled_reference(const AttnShape& shape, const float* q, const TiledKVShard& kv,
                              float* states, const ResolvedOptions& opt) {
  const int64_t B = shape.batch, H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim;
  const int64_t Q = shape.q_len, G = shape.group(), T = kv.tile_tokens;
  const std::size_t rec = static_cast<std::size_t>(D + 2);
  const std::size_t rows_per_item = static_cast<std::size_t>(G * Q);
  const int64_t chunk = (opt.chunk_tokens + T - 1) / T * T;

  std::vector<int64_t> first_chunk(static_cast<std::size_t>(B) + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = kv.len[static_cast<std::size_t>(b)];
    first_chunk[static_cast<std::size_t>(b) + 1] =
        first_chunk[static_cast<std::size_t>(b)] + (n + chunk - 1) / chunk;
  }
  const int64_t items = first_chunk[static_cast<std::size_t>(B)] * Hkv;
  std::vector<float> scratch(static_cast<std::size_t>(items) * rows_per_item * rec);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

#pragma omp parallel for schedule(dynamic) num_threads(opt.threads)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t kvh = item % Hkv, gchunk = item / Hkv;
    int64_t b = 0;
    while (first_chunk[static_cast<std::size_t>(b) + 1] <= gchunk) ++b;
    const auto ub = static_cast<std::size_t>(b);
    const int64_t t0 = (gchunk - first_chunk[ub]) * chunk;
    const int64_t t1 = std::min(kv.len[ub], t0 + chunk);
    float* out = scratch.data() + static_cast<std::size_t>(item) * rows_per_item * rec;
    for (std::size_t r = 0; r < rows_per_item; ++r)
      state_set_empty(out + r * rec, static_cast<std::size_t>(D));
    std::vector<float> kf(static_cast<std::size_t>(D)), vf(kf.size());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pos = kv.pos_start[ub] + t * kv.pos_stride;
      const int64_t tile = t / T, lane = t % T;
      const auto* kt = static_cast<const uint8_t*>(kv.k) + tile_offset(kv, b, kvh, tile);
      const auto* vt = static_cast<const uint8_t*>(kv.v) + tile_offset(kv, b, kvh, tile);
      float ks = 1.0f, vs = 1.0f;
      if (kv.k_scale != nullptr) {
        ks = bf16_value(kv.k_scale[scale_offset(kv, b, kvh, tile) + lane]);
        vs = bf16_value(kv.v_scale[scale_offset(kv, b, kvh, tile) + lane]);
      }
      for (int64_t d = 0; d < D; ++d) {
        kf[static_cast<std::size_t>(d)] = dequantize(
            kt, kv.dtype, static_cast<std::size_t>(kv_tile_k_index(T, D, lane, d)), ks);
        vf[static_cast<std::size_t>(d)] =
            dequantize(vt, kv.dtype, static_cast<std::size_t>(kv_tile_v_index(T, D, lane, d)), vs);
      }
      for (int64_t i = 0; i < Q; ++i) {
        if (pos > kv.total_len[ub] - Q + i) continue;  // causal limit
        for (int64_t g = 0; g < G; ++g) {
          const float* qv = q + ((b * Q + i) * H + kvh * G + g) * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qv[d] * kf[static_cast<std::size_t>(d)];
          const float s = dot * opt.scale;
          if (s == kNegInf) continue;
          float* st = out + static_cast<std::size_t>(i * G + g) * rec;
          float m = state_m(st);
          const float m_new = (std::isnan(s) || std::isnan(m)) ? kNaN : (s > m ? s : m);
          if (m_new != m) {
            const float a = (m == kNegInf) ? 0.0f : std::exp(m - m_new);
            state_l(st) *= a;
            for (int64_t d = 0; d < D; ++d) state_o(st)[d] *= a;
            state_m(st) = m_new;
            m = m_new;
          }
          const float p = std::exp(s - m);
          state_l(st) += p;
          for (int64_t d = 0; d < D; ++d) state_o(st)[d] += p * vf[static_cast<std::size_t>(d)];
        }
      }
    }
  }
  for (std::size_t r = 0; r < static_cast<std::size_t>(B * Q * H); ++r)
    state_set_empty(states + r * rec, static_cast<std::size_t>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = first_chunk[static_cast<std::size_t>(b)];
         c < first_chunk[static_cast<std::size_t>(b) + 1]; ++c)
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        const float* in = scratch.data() + static_cast<std::size_t>(c * Hkv + kvh) * rows_per_item * rec;
        for (int64_t i = 0; i < Q; ++i)
          for (int64_t g = 0; g < G; ++g)
            state_merge(states + static_cast<std::size_t>((b * Q + i) * H + kvh * G + g) * rec,
                        in + static_cast<std::size_t>(i * G + g) * rec, static_cast<std::size_t>(D));
      }
  return Status::ok();
}

Status run_tiled_driver(TiledItemFn item_fn, const AttnShape& shape, const float* q,
                        const TiledKVShard& kv, float* states, const ResolvedOptions& opt) {
  const int64_t T = kv.tile_tokens;
  const int64_t R = shape.group() * shape.q_len;
  const int64_t chunk = (opt.chunk_tokens + T - 1) / T * T;
  // A block holds at least one 32-token score unit (smaller blocks would pad every unit).
  const cpu::TiledTuning tuning = cpu::tiled_tuning();
  const int block_tiles = std::max<int>(tuning.block_tiles, static_cast<int>((32 + T - 1) / T));
  const int64_t ld = (block_tiles * T + 31) / 32 * 32;  // tiled_score_ld() in the item kernel
  const cpu::DriverChoice choice =
      cpu::driver_choice(kv.dtype, shape.head_dim, shape.group(), opt.threads, opt.isa);
  const int64_t prefetch_bytes = choice.tiled_prefetch;
  const bool quant = dtype_is_quantized(kv.dtype);
  cpu::drive_items(
      shape, q, kv.len, kv.pos_start, kv.total_len, kv.pos_stride, chunk,
      static_cast<std::size_t>((R + 2) * ld), opt.threads,
      kv.head_stride > kv.tile_stride ? choice.order : cpu::ItemOrder::kChunksOuter, states,
      [&](const cpu::DriverItem& it) {
        const int64_t tile0 = it.t0 / T;
        TiledItemArgs a;
        a.head_dim = static_cast<int>(shape.head_dim);
        a.dtype = kv.dtype;
        a.tile_tokens = static_cast<int>(T);
        a.k = static_cast<const char*>(kv.k) + tile_offset(kv, it.b, it.kv_head, tile0);
        a.v = static_cast<const char*>(kv.v) + tile_offset(kv, it.b, it.kv_head, tile0);
        a.tile_stride = kv.tile_stride;
        if (quant) {
          a.k_scale = kv.k_scale + scale_offset(kv, it.b, it.kv_head, tile0);
          a.v_scale = kv.v_scale + scale_offset(kv, it.b, it.kv_head, tile0);
          a.scale_tile_stride = kv.scale_tile_stride;
        }
        a.tokens = it.t1 - it.t0;
        a.rows = static_cast<int>(R);
        a.q = it.q;
        a.visible = it.visible;
        a.scale = opt.scale;
        a.out = it.out;
        a.block_tiles = block_tiles;
        a.scores = it.scores;
        a.prefetch_bytes = prefetch_bytes;
        a.prefetch_l2 = choice.tiled_l2;
        item_fn(a);
      });
  return Status::ok();
}

// An integer from the environment, or `fallback` when unset or empty; clamped to [lo, hi].
int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return fallback;
  const long long v = std::strtoll(e, nullptr, 10);
  return std::clamp<int64_t>(v, lo, hi);
}

}  // namespace

namespace cpu {
namespace {
std::atomic<int> g_block_tiles{
    static_cast<int>(env_int("TREEATTN_TILED_BLOCK_TILES", kTiledBlockTiles, 1, 64))};
std::atomic<int64_t> g_prefetch_bytes{
    env_int("TREEATTN_TILED_PREFETCH_BYTES", -1, 0, int64_t{1} << 20)};
std::atomic<int> g_prefetch_level{
    static_cast<int>(env_int("TREEATTN_TILED_PREFETCH_LEVEL", -1, 1, 2))};
}  // namespace

TiledItemFn tiled_item_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &generic::decode_tiled_item;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &avx2::decode_tiled_item;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &avx512::decode_tiled_item;
#endif
    default: return nullptr;
  }
}

TiledItemFn prefill_block_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &generic::prefill_block_item;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &avx2::prefill_block_item;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &avx512::prefill_block_item;
#endif
    default: return nullptr;
  }
}

TiledTuning tiled_tuning() {
  TiledTuning t;
  t.block_tiles = g_block_tiles.load(std::memory_order_relaxed);
  t.prefetch_bytes = g_prefetch_bytes.load(std::memory_order_relaxed);
  t.prefetch_level = g_prefetch_level.load(std::memory_order_relaxed);
  return t;
}

void set_tiled_tuning(const TiledTuning& t) {
  g_block_tiles.store(std::clamp(t.block_tiles, 1, 64), std::memory_order_relaxed);
  g_prefetch_bytes.store(std::clamp<int64_t>(t.prefetch_bytes, -1, int64_t{1} << 20),
                         std::memory_order_relaxed);
  g_prefetch_level.store(t.prefetch_level == 1 || t.prefetch_level == 2 ? t.prefetch_level : -1,
                         std::memory_order_relaxed);
}

int64_t default_tiled_prefetch_bytes(DType dtype, int64_t head_dim) {
  const bool sixteen = dtype == DType::kF16 || dtype == DType::kBF16;
  return sixteen && head_dim <= 128 ? kTiledPrefetchBytes16 : kTiledPrefetchBytes;
}

namespace {
std::atomic<const TuneChoice*> g_forced{nullptr};

// TREEATTN_PREFETCH_TOKENS: the rows kernel's lead in tokens (-1 when unset), read once.
int rows_tokens_from_env() {
  static const int from_env = static_cast<int>(env_int("TREEATTN_PREFETCH_TOKENS", -1, 0, 4096));
  return from_env;
}
}  // namespace

void force_driver_choice(const TuneChoice* choice) {
  g_forced.store(choice, std::memory_order_release);
}

DriverChoice driver_choice(DType dtype, int64_t head_dim, int64_t group, int threads, Isa isa) {
  DriverChoice d;
  auto take = [&](const TuneChoice& c) {
    d.tiled_prefetch = c.tiled_prefetch;
    d.paged_prefetch = c.paged_prefetch;
    d.tiled_l2 = c.tiled_l2;
    d.paged_l2 = c.paged_l2;
    d.rows_prefetch = c.rows_prefetch;
    d.order = c.chunks_outer ? ItemOrder::kChunksOuter : ItemOrder::kHeadsOuter;
  };
  if (const TuneChoice* forced = g_forced.load(std::memory_order_acquire)) {
    take(*forced);
    return d;
  }
  take(tuned_choice(TuneKey{dtype, head_dim, group, threads}, isa));
  const int64_t lead = g_prefetch_bytes.load(std::memory_order_relaxed);
  if (lead >= 0) d.tiled_prefetch = d.paged_prefetch = lead;
  const int level = g_prefetch_level.load(std::memory_order_relaxed);
  if (level > 0) d.tiled_l2 = d.paged_l2 = level == 2;
  d.rows_tokens = rows_tokens_from_env();
  return d;
}
}  // namespace cpu
}  // namespace kernels

Status decode_partial_tiled(const AttnShape& shape, const float* q, const TiledKVShard& kv,
                            float* states, const DecodeOptions& options) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  TREEATTN_RETURN_IF_ERROR(kv.validate(shape));
  if (kv.memory != MemorySpace::kHost)
    return unsupported("decode_partial_tiled runs on host memory; the tiled shard is device memory");
  auto r = kernels::resolve_options(shape, q, states, options);
  TREEATTN_RETURN_IF_ERROR(r.status());
  if (r->isa == Isa::kReference) return kernels::decode_tiled_reference(shape, q, kv, states, *r);
  const kernels::cpu::TiledItemFn fn = kernels::cpu::tiled_item_for(r->isa);
  if (fn == nullptr)
    return unsupported("ISA target " + std::string(isa_name(r->isa)) +
                       " is not built into this library");
  return kernels::run_tiled_driver(fn, shape, q, kv, states, *r);
}

}  // namespace treeattn
