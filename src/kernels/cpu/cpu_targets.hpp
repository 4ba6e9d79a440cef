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
// the per-block work (o reloads, block max, rescale): measured 1 thread, 256k tokens, medians
// of 3 runs of 5: f32 146 -> 129 ms, bf16 80.5 -> 75.5 ms; 2 threads f32 93.5 -> 80 ms.
inline constexpr int kBlockTokens = 64;

// Software prefetch distance: kDefaultPrefetchBytes of each of the K and V streams ahead of the
// score tiles, rounded up to whole tokens (see default_prefetch_tokens()), fetched into L2
// (prefetcht1). Measured on the quiet Zen 5 VM (1 and 2 threads, 256k tokens, llama3-8b
// shape, medians of 5, two rounds): none -> 2 KiB ahead: f32 1 thread 166 -> 138..152 ms,
// bf16 1 thread 116 -> 73..83 ms, f16 1 thread 119 -> 71 ms, bf16 2 threads 62..70 ->
// 43..46 ms. 1 KiB ahead was slower for bf16 (89 ms), 4 KiB and more slower for f32;
// prefetcht0 (into L1) at any distance gained nothing.
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

// One item of the tiled kernel (kv_tiles.hpp layout): the R = group * q_len query rows of one
// KV head against the tiles of one chunk. Tile i of the chunk: K transposed in panels of
// P = min(tile_tokens, 32) tokens, [tile_tokens / P][head_dim][P], at k + i * tile_stride,
// V [tile_tokens][head_dim] at v + i * tile_stride, and for fp8/int8 the scales of its tokens
// at k_scale + i * scale_tile_stride (v_scale alike).
struct TiledItemArgs {
  int head_dim = 0;
  DType dtype = DType::kF32;
  int tile_tokens = 0;            // T: 16 or a multiple of 32
  const char* k = nullptr;        // K^T of the chunk's first tile
  const char* v = nullptr;        // V of the chunk's first tile
  int64_t tile_stride = 0;        // bytes between tiles (K and V alike)
  const float* k_scale = nullptr; // quantized dtypes: scales of the first tile's tokens
  const float* v_scale = nullptr;
  int64_t scale_tile_stride = 0;  // floats between the scales of consecutive tiles
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
// values). Two passes over 4 tiles of 32 tokens cut the in-cache time (bf16 11.0 -> 10.0 ns per
// token and KV head, f32 11.5 -> 10.5) but read interleaved tiles out of memory order (K0..K3,
// then V0..V3): from DRAM, 1 thread, 64k tokens, bf16 0.73 -> 0.48 of the probe, f32 0.67 ->
// 0.51. A 64-token tile gets most of the larger block's in-cache gain in memory order.
inline constexpr int kTiledBlockTiles = 1;
// Software prefetch lead in bytes per stream (prefetcht0, requests spread over both passes).
// 1 thread / 2 threads, llama3-8b 256k, same run: lead 4096 / 8192 / 16384 bytes: bf16
// 0.79 / 0.89 / 0.85 and 0.63 / 0.69 / 0.60; f32 0.85 / 0.80 / 0.78 and 0.84 / 0.84 / 0.77;
// 32 KiB worse again. No software prefetch: 0.25-0.45 (the hardware prefetchers alone do
// not follow the tiles). prefetcht0 over prefetcht1, 1 thread: bf16 0.90 / 0.86 vs 0.76 / 0.73,
// f32 0.87 / 0.84 vs 0.81 / 0.81 (two runs each). On two threads too (Zen 5, 2026-12-05, the
// rounds whose probe read 59-73 GB/s): bf16 58 GB/s with prefetcht0, 52 with prefetcht1, 50 with
// prefetcht2; f32 64-65 / 55-58 / 56-57.
inline constexpr int64_t kTiledPrefetchBytes = 8192;
// The tiled driver's lead for 16-bit K/V with head_dim <= 128 (kTiledPrefetchBytes for every
// other case, and for the paged driver).
// Earlier sweeps stepped 4 / 8 / 16 KiB; the leads between, with items in memory order
// (583a8f0), Zen 5 (AVX-512 target), 2026-12-05, kernel GB/s, 256k tokens, the leads alternating
// inside each run: `build/release/bench/treeattn_roofline --dtype bf16,f16 --threads 1 --seq
// 262144 --repeats 5 --no-peer --no-check --layouts tiled --prefetch 8192,10240,12288,14336,16384`
// (f32: `--dtype f32 --prefetch 5120,6144,7168,8192,9216`; the other shapes `--heads H --kv-heads
// K --head-dim D --dtype f32,bf16,f16 --prefetch 8192,12288`; 2 threads `--threads 2`), 1 thread:
//   llama3-8b (group 4, D 128)  lead 8 / 10 / 12 / 14 / 16 KiB: bf16 31.3-31.8 / 32.8-33.5 /
//     32.9-33.5 / 33.0-33.5 / 30.6-31.4, f16 31.3-31.6 / 32.4-32.7 / 32.8-33.2 / 32.9-33.2 /
//     31.7-32.1 (three runs); f32 flat at 5-9 KiB (34.0-35.1) and slower at 10-12 (31.3-33.9).
//   8 / 12 KiB, two runs each: SmolLM2 (group 3, D 64) bf16 31.5-33.7 / 33.5-34.8, f16 32.9-34.9 /
//     35.2-36.5, f32 35.0-36.3 / 34.6-35.6; Qwen2.5-1.5B (group 6, D 128) bf16 24.4-24.7 /
//     24.9-25.4, f16 24.7-25.0 / 25.2-25.8; Qwen2.5-0.5B (group 7, D 64) bf16 20.4-20.8 /
//     21.0-21.3; Gemma-3 (group 4, D 256) bf16 27.5-28.1 / 26.8-27.6, f16 27.8-27.9 / 25.8-26.1;
//     fp8 and int8 (llama3-8b) alike at 8 and 12 (13.9-14.3, 21.3-21.9).
//   2 threads (llama3-8b, 8 / 12 KiB): in the rounds whose probe read 61-75 GB/s bf16 52-60 /
//     58-61, f16 55-58 / 56-59; in those at 37-45 GB/s bf16 43.6-43.8 / 41.4-43.0, f16 38.9-44.9 /
//     38.1-44.2. Again with this default built in (three runs, 08:50 UTC): 1 thread bf16
//     31.0-32.1 / 33.3-33.6, f16 32.1-32.5 / 33.4-34.0; 2 threads, probe 71-77 GB/s, bf16
//     59.4-59.8 / 60.1-61.3, f16 57.0-58.0 / 59.1-59.3.
inline constexpr int64_t kTiledPrefetchBytes16 = 12288;
struct TiledTuning {
  int block_tiles = kTiledBlockTiles;
  // -1: the default lead of the dtype and head_dim (tiled_prefetch_bytes()); 0: no software
  // prefetch; else this lead for every dtype.
  int64_t prefetch_bytes = -1;
};
// What the tiled driver uses: the defaults above, overridden by the environment variables
// TREEATTN_TILED_BLOCK_TILES and TREEATTN_TILED_PREFETCH_BYTES (read once), or by
// set_tiled_tuning() (benchmarks comparing alternatives in one run; call it only while no
// tiled kernel runs).
TiledTuning tiled_tuning();
void set_tiled_tuning(const TiledTuning& t);
// The software prefetch lead a tiled-driver item of this dtype and head_dim runs with under t:
// t.prefetch_bytes when it is set (>= 0), else kTiledPrefetchBytes16 for f16 and bf16 with
// head_dim <= 128 and kTiledPrefetchBytes otherwise.
int64_t tiled_prefetch_bytes(const TiledTuning& t, DType dtype, int64_t head_dim);
// The paged driver's lead under t: t.prefetch_bytes when it is set, else kTiledPrefetchBytes for
// every dtype. The tiled driver's longer lead for 16-bit K/V showed no gain there: `treeattn
// generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --prompt-tokens 16384 --new-tokens 33
// --ignore-eos --threads 1` (f16 KV, Zen 5, 2026-12-05, alternating 8 / 12 KiB by
// TREEATTN_TILED_PREFETCH_BYTES) took 19.43 / 19.64 and 18.82 / 19.11 ms a token, inside that
// command's run-to-run spread (5-10% between runs of one binary).
int64_t paged_prefetch_bytes(const TiledTuning& t);

// The default software prefetch distance in tokens for rows of row_bytes bytes;
// TREEATTN_PREFETCH_TOKENS in the environment overrides it (read once; 0 disables; for
// experiments on other CPUs).
int default_prefetch_tokens(int64_t row_bytes);

using ItemFn = void (*)(const ItemArgs&);

// Elementwise exp as used inside the kernel, exposed for the tests of its contract:
// exp(0) == 1 exactly, exp(-inf) == 0, NaN in -> NaN out, a few ulp elsewhere.
using ExpFn = void (*)(const float* in, float* out, int64_t n);

// Roofline probes, compiled per target with the kernel's instructions:
//   read_stream: sums n floats (n a multiple of 128) with independent vector accumulators, so
//                that only memory limits it; returns the sum so the reads cannot be dropped.
//   fma_burn:    iters rounds of independent FMA chains in registers; *flops receives the
//                floating-point operations performed (2 per lane per FMA).
using ReadStreamFn = float (*)(const float* p, int64_t n);
using FmaBurnFn = float (*)(int64_t iters, float seed, double* flops);

// The functions of a target, or nullptr when the target is not built.
ExpFn exp_for(Isa isa);
// The softmax's exp of s - m (<= 0, -inf or NaN): exp's bits for every such input, cheaper.
ExpFn exp_nonpos_for(Isa isa);
ReadStreamFn read_stream_for(Isa isa);
FmaBurnFn fma_burn_for(Isa isa);

namespace generic {
void decode_item(const ItemArgs& a);
void decode_tiled_item(const TiledItemArgs& a);
void prefill_block_item(const TiledItemArgs& a);
void exp_array(const float* in, float* out, int64_t n);
void exp_nonpos_array(const float* in, float* out, int64_t n);
float read_stream(const float* p, int64_t n);
float fma_burn(int64_t iters, float seed, double* flops);
}  // namespace generic
namespace avx2 {
void decode_item(const ItemArgs& a);
void decode_tiled_item(const TiledItemArgs& a);
void prefill_block_item(const TiledItemArgs& a);
void exp_array(const float* in, float* out, int64_t n);
void exp_nonpos_array(const float* in, float* out, int64_t n);
float read_stream(const float* p, int64_t n);
float fma_burn(int64_t iters, float seed, double* flops);
}  // namespace avx2
namespace avx512 {
void decode_item(const ItemArgs& a);
void decode_tiled_item(const TiledItemArgs& a);
void prefill_block_item(const TiledItemArgs& a);
void exp_array(const float* in, float* out, int64_t n);
void exp_nonpos_array(const float* in, float* out, int64_t n);
float read_stream(const float* p, int64_t n);
float fma_burn(int64_t iters, float seed, double* flops);
}  // namespace avx512

}  // namespace treeattn::kernels::cpu
