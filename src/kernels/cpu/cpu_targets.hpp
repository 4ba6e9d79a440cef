// Internal interface between the CPU kernel driver (cpu_kernels.cpp) and the per-ISA item
// kernels (kernel_avx512.cpp, kernel_avx2.cpp, kernel_generic.cpp).
//
// The driver, compiled for the baseline ISA, validates nothing (dispatch.cpp did), cuts the
// shard into work items (batch row, KV head, chunk of tokens), runs them on OpenMP threads and
// merges the chunk states in chunk order. A target only computes ONE item: the partial states
// of the R = group * q_len query rows of one KV head over one chunk of tokens.
//
// Each target translation unit is compiled with its own -m flags and puts everything it
// defines in its own namespace (or internal linkage). It must not odr-use inline functions or
// templates shared with other translation units (std containers, state.hpp, dtype.hpp
// converters): the linker keeps one copy of such a function, and an AVX-512 copy picked for
// baseline code would crash on a CPU without AVX-512. That is why this header is plain data.
#pragma once

#include <cstdint>

#include "treeattn/dtype.hpp"

namespace treeattn {
enum class Isa : uint8_t;  // kernel.hpp
}

namespace treeattn::kernels::cpu {

// Offsets of m, l and o in a packed state record: state.hpp's kStateM / kStateL / kStateO, by
// name (cpu_kernels.cpp checks that they agree; this header cannot include state.hpp).
inline constexpr int kM = 0, kL = 1, kO = 2;

// Tokens per softmax block inside an item. Every target uses the same value, a multiple of
// every vector width (16 floats for AVX-512, 8 for AVX2 and generic). 64 rather than 32 halves
// the per-block work (o reloads, block max, rescale); measured by `treeattn bench --kernel
// --kv-layout rows --threads 1,2` at 256k tokens, both values built in turn.
inline constexpr int kBlockTokens = 64;

// Software prefetch distance of the rows kernel: kDefaultPrefetchBytes of each of the K and V
// streams ahead of the score tiles, rounded up to whole tokens (DriverChoice,
// driver_tuning.hpp), fetched into L2 (prefetcht1). The compiled-in default; the calibration
// (tuning.hpp) picks the lead on each CPU. On the development Xeon shorter leads arrived late
// for 16-bit K/V and longer ones evicted f32 data before use; prefetcht0 gained nothing.
inline constexpr int kDefaultPrefetchBytes = 2048;

struct ItemArgs {
  int head_dim = 0;
  DType dtype = DType::kF32;
  const void* k = nullptr;        // element (token 0 of the chunk, dim 0) of this KV head
  const void* v = nullptr;
  int64_t stride_token = 0;       // elements between consecutive tokens (>= head_dim)
  int64_t tokens = 0;             // tokens any row of this item may see (>= 1)
  int rows = 0;                   // R = group * q_len; row r = query (r / group), head r % group
  const float* q = nullptr;       // R rows of head_dim floats, contiguous
  const int64_t* visible = nullptr;  // per row: tokens of this chunk the row sees, in [0, tokens]
  float scale = 1.0f;
  float* out = nullptr;           // R records [m, l, o_0..o_{D-1}] (head_dim + 2 floats each)
  // Quantized dtypes (fp8, int8): per-token scales of K and V from token 0 of the chunk,
  // scale_stride_token floats apart; null otherwise.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_stride_token = 1;
  float* scores = nullptr;        // scratch: (R + 2) * kBlockTokens floats
  int prefetch_tokens = 0;        // software prefetch distance in tokens (0: none)
};

// Elements of head_dim per V column panel: kv_tiles.hpp's kKVTileVPanel (cpu_kernels.cpp
// checks that they agree).
inline constexpr int kVPanel = 64;

// One item of the tiled kernel (kv_tiles.hpp layout): the R = group * q_len query rows of one
// KV head against the tiles of one chunk. Tile i of the chunk: K transposed in panels of
// P = min(tile_tokens, 32) tokens, [tile_tokens / P][head_dim][P], at k + i * tile_stride,
// V in column panels of up to kVPanel elements ([head_dim / kVPanel][tile_tokens][kVPanel], then
// the rest of head_dim as one narrower panel) at v + i * tile_stride, and for fp8/int8 the
// scales of its tokens at k_scale + i * scale_tile_stride (v_scale alike; bfloat16, widened
// exactly to float).
struct TiledItemArgs {
  int head_dim = 0;
  DType dtype = DType::kF32;
  int tile_tokens = 0;            // T: 16 or a multiple of 32
  const char* k = nullptr;        // K^T of the chunk's first tile
  const char* v = nullptr;        // V of the chunk's first tile
  int64_t tile_stride = 0;        // bytes between tiles (K and V alike)
  const bf16_t* k_scale = nullptr;  // quantized dtypes: scales of the first tile's tokens
  const bf16_t* v_scale = nullptr;
  int64_t scale_tile_stride = 0;  // bf16_t elements between the scales of consecutive tiles
  int64_t tokens = 0;             // tokens any row of this item may see (>= 1)
  int rows = 0;                   // R = group * q_len; row r = query (r / group), head r % group
  const float* q = nullptr;       // R rows of head_dim floats, contiguous
  const int64_t* visible = nullptr;  // per row: tokens of this chunk the row sees, in [0, tokens]
  // Per row, or null (0 for every row): the first token of the chunk the row sees; the tokens
  // before it are scored -inf (a sliding window's lower edge). Their weights are exactly 0, so
  // the result equals the one without them (their V values are finite: the sequence's own).
  const int64_t* visible_from = nullptr;
  float scale = 1.0f;
  float* out = nullptr;           // R records [m, l, o_0..o_{D-1}]
  // false: the records start empty; true: out holds each row's state over the tokens before
  // this chunk (the paged driver's earlier pages of the item) and the chunk's tokens continue
  // its online softmax, as if they followed in the same chunk.
  bool keep = false;
  int block_tiles = 1;            // tiles per online-softmax block
  float* scores = nullptr;        // scratch: (R + 2) * ld floats, ld = block tokens rounded
                                  // up to 32 (tiled_score_ld())
  int64_t prefetch_bytes = 0;     // software prefetch distance per stream (0: none)
  bool prefetch_l2 = false;       // the prefetch into L2 (prefetcht1), else into L1 (prefetcht0)
};

using TiledItemFn = void (*)(const TiledItemArgs&);
// The tiled item kernel of a target, or nullptr when the target is not built (kAuto and
// kReference have none). Used by the tiled driver and the paged one (paged_kernels.cpp).
TiledItemFn tiled_item_for(Isa isa);

// The prefill block kernel of a target (prefill_block_impl.hpp), or nullptr when the target is
// not built: the tiled item kernel's contract and bits for a one-tile chunk (block_tiles 1,
// tokens <= tile_tokens), looped for many rows per tile (the tile widened to floats once, rows
// in fused tiles, the causal part above the diagonal skipped). Its scratch (the `scores`
// field) holds prefill_block_scratch_floats() floats. Used by the paged driver.
TiledItemFn prefill_block_for(Isa isa);
// K and V of one tile in floats, 8 rows of scores (the most rows per fused tile of any target)
// and the two quantization scale rows, each row tiled_score_ld(tile_tokens) floats.
inline constexpr int64_t prefill_block_scratch_floats(int64_t tile_tokens, int64_t head_dim) {
  return 2 * tile_tokens * head_dim + (8 + 2) * ((tile_tokens + 31) / 32 * 32);
}

// Tiles per online-softmax block of the tiled kernel (one fused pass per tile: scores, softmax,
// values). Larger blocks are faster in cache but read tiles out of memory order (K0..K3, then
// V0..V3), which is slower from DRAM; a 64-token tile gets most of the gain in memory order.
// Measure: `build/release/bench/treeattn_roofline --block-tiles 1,2,4 --seq 65536`.
inline constexpr int kTiledBlockTiles = 1;
// Software prefetch lead in bytes per stream (prefetcht0, requests spread over both passes):
// the compiled-in default of the tiled and paged drivers. The hardware prefetchers alone do not
// follow the tiles. The best lead differs between CPUs (how a core overlaps prefetch with
// arithmetic), so the calibration (tuning.hpp, `treeattn tune`) picks it per CPU, dtype, head
// dim, group and thread count from candidates around these. Compare leads by hand, alternating
// inside one run: `build/release/bench/treeattn_roofline --dtype f32,bf16,f16 --threads 1,2
// --seq 262144 --repeats 5 --no-peer --no-check --layouts tiled --prefetch 4096,8192,12288,16384`.
inline constexpr int64_t kTiledPrefetchBytes = 8192;
// The tiled driver's default lead for 16-bit K/V with head_dim <= 128 (kTiledPrefetchBytes for
// every other case, and for the paged driver): a longer lead read faster there on the
// development Xeon, not for f32, fp8, int8 or head_dim 256.
inline constexpr int64_t kTiledPrefetchBytes16 = 12288;
struct TiledTuning {
  int block_tiles = kTiledBlockTiles;
  // -1: the tuned lead (driver_tuning.hpp); 0: no software prefetch; else this lead for every
  // dtype, in the tiled and the paged driver.
  int64_t prefetch_bytes = -1;
  // -1: the tuned level; 1: the prefetch into L1 (prefetcht0); 2: into L2 (prefetcht1), in the
  // tiled and the paged driver.
  int prefetch_level = -1;
};
// What the tiled driver uses: the defaults above, overridden by the environment variables
// TREEATTN_TILED_BLOCK_TILES, TREEATTN_TILED_PREFETCH_BYTES and TREEATTN_TILED_PREFETCH_LEVEL
// (1 or 2; read once), or by set_tiled_tuning() (benchmarks comparing alternatives in one run;
// call it only while no tiled kernel runs). block_tiles changes the online-softmax blocking,
// hence the bits: it is an experiment's knob, never tuned.
TiledTuning tiled_tuning();
void set_tiled_tuning(const TiledTuning& t);
// The compiled-in lead of the tiled driver for this dtype and head_dim: kTiledPrefetchBytes16
// for f16 and bf16 with head_dim <= 128, kTiledPrefetchBytes otherwise. The paged driver's is
// kTiledPrefetchBytes for every dtype.
int64_t default_tiled_prefetch_bytes(DType dtype, int64_t head_dim);

using ItemFn = void (*)(const ItemArgs&);

// Elementwise exp as used inside the kernel, exposed for the tests of its contract:
// exp(0) == 1 exactly, exp(-inf) == 0, NaN in -> NaN out, a few ulp elsewhere.
using ExpFn = void (*)(const float* in, float* out, int64_t n);

// Roofline probes, compiled per target with the kernel's instructions:
//   read_stream: sums n floats (n a multiple of 128) with independent vector accumulators, so
//                that only memory limits it; returns the sum so the reads cannot be dropped.
//   fma_burn:    iters rounds of independent FMA chains in registers; *flops receives the
//                floating-point operations performed (2 per lane per FMA).
//   fma_stream:  the decode kernel's least arithmetic over a stream, the roofline's ceiling:
//                reads `bytes` (rounded down to a multiple of 64) of `dtype` elements at p one
//                64-byte line at a time, widens each vector as the kernel does and multiplies it
//                into `rows` (1 to 8) independent accumulators, row r by c * (r + 1), as exact
//                attention multiplies each K and V element into the rows of its group, each by
//                its own q or p; prefetch_bytes > 0 adds a prefetcht1 that far ahead of every
//                line (never past p + bytes). Returns c * (1 + 2 + ... + rows) * (the sum of the
//                elements, as the kernel reads them: fp8 / int8 codes unscaled), summed in an
//                unspecified order.
using ReadStreamFn = float (*)(const float* p, int64_t n);
using FmaBurnFn = float (*)(int64_t iters, float seed, double* flops);
using FmaStreamFn = float (*)(const void* p, int64_t bytes, DType dtype, int rows,
                              int64_t prefetch_bytes, float c);

// The functions of a target, or nullptr when the target is not built.
ExpFn exp_for(Isa isa);
// The softmax's exp of s - m (<= 0, -inf or NaN): exp's bits for every such input, cheaper.
ExpFn exp_nonpos_for(Isa isa);
ReadStreamFn read_stream_for(Isa isa);
FmaBurnFn fma_burn_for(Isa isa);
FmaStreamFn fma_stream_for(Isa isa);

namespace generic {
void decode_item(const ItemArgs& a);
void decode_tiled_item(const TiledItemArgs& a);
void prefill_block_item(const TiledItemArgs& a);
void exp_array(const float* in, float* out, int64_t n);
void exp_nonpos_array(const float* in, float* out, int64_t n);
float read_stream(const float* p, int64_t n);
float fma_burn(int64_t iters, float seed, double* flops);
float fma_stream(const void* p, int64_t bytes, DType dtype, int rows, int64_t prefetch_bytes,
                 float c);
}  // namespace generic
namespace avx2 {
void decode_item(const ItemArgs& a);
void decode_tiled_item(const TiledItemArgs& a);
void prefill_block_item(const TiledItemArgs& a);
void exp_array(const float* in, float* out, int64_t n);
void exp_nonpos_array(const float* in, float* out, int64_t n);
float read_stream(const float* p, int64_t n);
float fma_burn(int64_t iters, float seed, double* flops);
float fma_stream(const void* p, int64_t bytes, DType dtype, int rows, int64_t prefetch_bytes,
                 float c);
}  // namespace avx2
namespace avx512 {
void decode_item(const ItemArgs& a);
void decode_tiled_item(const TiledItemArgs& a);
void prefill_block_item(const TiledItemArgs& a);
void exp_array(const float* in, float* out, int64_t n);
void exp_nonpos_array(const float* in, float* out, int64_t n);
float read_stream(const float* p, int64_t n);
float fma_burn(int64_t iters, float seed, double* flops);
float fma_stream(const void* p, int64_t bytes, DType dtype, int rows, int64_t prefetch_bytes,
                 float c);
}  // namespace avx512

}  // namespace treeattn::kernels::cpu
