// Internal interface between the weight matrix-vector driver (matvec.cpp) and the per-ISA row
// kernels (matvec_avx512.cpp, matvec_avx2.cpp, matvec_generic.cpp).
//
// The driver, compiled for the baseline ISA, splits the rows of one or more weight matrices over
// OpenMP threads and the tokens into tiles that stay in L2; a target computes one RowsArgs job:
// y[t][r] = <row r of W, x[t]> for a range of rows and a range of tokens.
//
// Bits: every (row, token) dot product is computed by the same sequence of operations whatever
// the thread count, the row range, the token range and the number of tokens that share the
// decoded weights (the targets process up to a few tokens at a time, each with its own
// accumulators in the same order). So one token's output is the same bits in a one-token
// decode step and in any prefill batch, on any rank, which the deterministic decode needs.
// (Different ISA targets give different bits; every rank of a job runs the same one.)
//
// Like cpu_targets.hpp this header is plain data: each target translation unit is compiled with
// its own -m flags and must not odr-use inline functions shared with other translation units.
#pragma once

#include <cstdint>
#include <vector>

namespace treeattn::model::detail {

// ggml type ids the targets read (gguf.hpp TensorType): F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6,
// Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, BF16 30.
inline constexpr uint32_t kTypeF32 = 0, kTypeF16 = 1, kTypeQ4_0 = 2, kTypeQ4_1 = 3, kTypeQ5_0 = 6,
                          kTypeQ5_1 = 7, kTypeQ8_0 = 8, kTypeQ4_K = 12, kTypeQ5_K = 13,
                          kTypeQ6_K = 14, kTypeBF16 = 30;

struct ActBlock;
struct ActBlock8;
struct ActBlockK;
struct ActBlockK8;

struct RowsArgs {
  uint32_t type = 0;
  const uint8_t* w = nullptr;  // row 0 of the matrix
  int64_t row_bytes = 0;
  int64_t cols = 0;  // quantized types: a multiple of the block (32, or 256 for K types)
  int64_t row_begin = 0, row_end = 0;
  const float* x = nullptr;  // token 0 of the range: cols floats, x_stride floats apart
  int64_t x_stride = 0;
  int64_t tokens = 0;
  float* y = nullptr;  // (token 0 of the range, row 0 of the matrix), y_stride apart
  int64_t y_stride = 0;
  float* scratch = nullptr;  // scratch_floats(cols) floats, 64-byte aligned (decoded rows)
  // The integer (int8 activation) targets read these instead of x: token 0 of the range,
  // cols / 32 blocks per token, xq_stride blocks apart (quantize_activations).
  const ActBlock* xq = nullptr;
  int64_t xq_stride = 0;
  // The K types (Q4_K, Q5_K, Q6_K) read these instead: cols / 256 blocks per token, xk_stride
  // blocks apart (quantize_activations_k).
  const ActBlockK* xk = nullptr;
  int64_t xk_stride = 0;
  // Several tokens of the 32-value types: xq's blocks 8 tokens to a group, tokens in lanes
  // (transpose_activations): group 0 of the range (token 0 is a group's first), cols / 32 blocks
  // per group. Null for one token.
  const ActBlock8* xt = nullptr;
  // Several tokens of the K types: xk's blocks 8 tokens to a group (transpose_activations_k),
  // group 0 of the range, cols / 256 blocks per group. Null for one token.
  const ActBlockK8* xtk = nullptr;
  // The AMX target's copy of xtk with two groups side by side (16 tokens, tokens in the order of
  // the token range): pair p of the range, block k at xtk16 + (p * blocks + k) * kXtk16Bytes,
  // row i (the 4 columns 4 i .. 4 i + 3) 64 bytes, token t's 4 at 4 t. The token range starts
  // at a multiple of 16. Null elsewhere.
  const int8_t* xtk16 = nullptr;
  // The matrix's rows 8 at a time in the decode layout of Q4_K / Q6_K / Q8_0 / Q5_0
  // (WeightMatrix::rows8, pack_rows8 below): group g holds rows 8 g .. 8 g + 7, rows / 8 groups;
  // null where absent and in calls of more than kRows8MaxTokens tokens (the driver decides by the
  // call's count, so a prefill's short last tile keeps the row layout). Q5_0 also reads xsum:
  // token t's block b's integer sum of q at xsum[t * xq_stride + b] (its offset).
  const uint8_t* w8 = nullptr;
  const int32_t* xsum = nullptr;
};

// The locality hint of the weight prefetch in the one-token passes (both matrix paths:
// matvec_impl.hpp, matvec_int8_impl.hpp): 1, prefetcht2, not 3 (prefetcht0). On the Zen 4 VM
// (AVX-512 VNNI, 1 thread) prefetcht0 held the decode step to ~10 GB/s of weights, as if the L1's
// outstanding misses capped it; with prefetcht2 the K-quant and Q5_0 / Q8_0 files' steps got
// 1.15-1.3x faster, SmolLM2's (85 MB, compute-bound) did not move, and the prefetch distance (1
// to 8 passes) changed nothing. Measure:
// `bench/model/vs_llamacpp.py --contexts 512` with each hint built in turn. The hint changes no arithmetic.
inline constexpr int kWeightPrefetchLocality = 1;

// How far ahead that prefetch reads: whole passes (a pass's rows are contiguous, so the same
// column offset RBn rows further on), at least kWeightPrefetchBytes. With one pass (2.7-20 KB
// for the shipped files' matrices) the Q8_0 head of Gemma-3 and Qwen2.5-0.5B streamed at ~10 GB/s
// from DRAM against the one-thread read probe's ~20 (Zen 4 VM, 1 thread); 32 KB ahead (and every
// line of the 32-value types' rows prefetched, not every other block's) made their decode steps
// 1.15-1.6x faster. It stays far inside L2.
inline constexpr int64_t kWeightPrefetchBytes = 32768;
// pass_bytes = RBn * row_bytes > 0. Internal linkage: each target compiles its own copy.
static constexpr int64_t weight_prefetch_ahead(int64_t pass_bytes) {
  return (kWeightPrefetchBytes + pass_bytes - 1) / pass_bytes * pass_bytes;
}

// The most rows a target decodes together (its Ops::RB <= this).
inline constexpr int kMaxRowBlock = 8;
// The float path's decoded rows lie a cache line further apart than their length
// (matvec_impl.hpp, rows_block: at 1536 columns, 6 KiB, the 8 rows a micro-tile reads would
// otherwise start at the same offsets of 4 KiB pages).
inline constexpr int64_t decoded_row_stride(int64_t cols) { return cols + 16; }
// The batched paths' scratch (RowsArgs::scratch) in floats: room for kMaxRowBlock decoded float
// rows and for the AMX target's 16 rows of 640 bytes per super-block (kScratchRows of them).
inline constexpr int kScratchRows = 10;
inline constexpr int64_t scratch_floats(int64_t cols) {
  return kScratchRows * decoded_row_stride(cols);
}
inline constexpr int64_t kXtk16Bytes = 64 * 64;  // RowsArgs::xtk16's block
// From this many tokens on, the float path's batched micro-tiles (matvec_impl.hpp).
inline constexpr int64_t kBatchTokens = 4;

using RowsFn = void (*)(const RowsArgs&);

void rows_generic(const RowsArgs& a);
#if defined(TREEATTN_MODEL_X86)
void rows_avx2(const RowsArgs& a);
void rows_avx512(const RowsArgs& a);
#endif

// The integer path (MatmulMode::kInt8, matvec_int8_impl.hpp): 32 activations of one token as
// 8-bit integers and a float scale, x[i] ~ d * q[i], and s = d * (q[0] + ... + q[31]) rounded
// once (the weight types with a min, w = a * code + m, need m * sum(x)).
struct ActBlock {
  float d;
  float s;
  int8_t q[32];
};
static_assert(sizeof(ActBlock) == 40);

// Quantizes `cols` floats (a multiple of 32) into cols / 32 blocks: per block amax = max |x|,
// d = amax / 127 (rounded once), q = round-to-nearest-even(x / d) (one division, rounded once),
// clamped to [-127, 127]; d = 0 gives q = 0. So |x - d q| <= (amax / 254) (1 + 2^-15) per
// element (matvec_int8_impl.hpp has the derivation) while d is a normal float (amax >= 127 *
// 2^-126); below, |x - d q| <= amax < 1.5e-36. A NaN or infinite x: d = s = NaN, q = 0 (that
// token's outputs are NaN). Compiled once (matvec_int8.cpp): every
// target reads the same blocks.
void quantize_activations(const float* x, int64_t cols, ActBlock* out);

// The K types' activations (as llama.cpp's Q8_K): 256 activations of one token as 8-bit integers
// and one float scale, x[i] ~ d * q[i], and the sums of q over each 32 (bsum[j] = q[32 j] + ...
// + q[32 j + 31], |bsum| <= 4064; the mins of Q4_K / Q5_K need them) and over each 16 (bsum16,
// |bsum16| <= 2032: Q6_K's offset term). One scale per 256 lets a K super-block be one integer
// sum and one float multiply-add (matvec_int8_impl.hpp).
struct ActBlockK {
  float d;
  int16_t bsum[8];
  int16_t bsum16[16];
  int8_t q[256];
};
static_assert(sizeof(ActBlockK) == 308);

// Block b of 8 tokens (a group), transposed for dot products with tokens in lanes: 4-byte group
// i of token t's q at q[i][4 t ..]; its d, s and the integer sum of its 32 q. The batched path of
// the 32-value types broadcasts 4 weight codes against q[i] (8 tokens at once) and scales a
// block's 8 integer sums with one vector multiply-add. Tokens past the end: all zero. 32-byte
// aligned (ActBlockK8 says why).
struct alignas(32) ActBlock8 {
  int8_t q[8][32];
  float d[8];
  float s[8];
  int32_t sum[8];
};
static_assert(sizeof(ActBlock8) == 352);

// Each block's integer sum of q (RowsArgs::xsum).
void activation_sums(const ActBlock* xq, int64_t blocks, int32_t* out);

// xq: `tokens` tokens' blocks (blocks per token, xq_stride apart) into ceil(tokens / 8) groups of
// `blocks` ActBlock8 each (group g: tokens 8 g .. 8 g + 7).
void transpose_activations(const ActBlock* xq, int64_t xq_stride, int64_t tokens, int64_t blocks,
                           ActBlock8* out);

// Quantizes `cols` floats (a multiple of 256) into cols / 256 blocks, each as quantize_activations
// quantizes a block but with amax, d and the clamp taken over 256 values (so the per-element
// bound is (amax_256 / 254) (1 + 2^-15)); a NaN or infinite x: d = NaN, q = 0, bsum = 0.
void quantize_activations_k(const float* x, int64_t cols, ActBlockK* out);

// The quantizations above compiled for each vector width this CPU runs (matvec_int8_generic.cpp),
// widest last: "default" (the baseline ISA) everywhere, "avx2" and "avx512" on x86 CPUs that have
// them; quantize_activations and quantize_activations_k call the widest. One source, every
// operation exactly rounded (|x|, max, x / d, the rounding add, the clamp), so the same bits on
// each; the tests run every variant here. The width matters: on the baseline ISA (4-wide
// divisions, scalar maxima) quantize_activations_k took 4.4% of Qwen2.5-1.5B's 512-token prefill
// on Zen 5 (perf).
struct QuantizeVariant {
  const char* name;
  void (*q32)(const float* x, int64_t cols, ActBlock* out);
  void (*qk)(const float* x, int64_t cols, ActBlockK* out);
};
std::vector<QuantizeVariant> quantize_variants();

// Super-block b of 8 tokens, transposed as ActBlock8 for the K types' batched path: 4-byte
// group i (< 64) of token t's q at q[i][4 t ..]; its d; and its sums of q laid out as int16
// pairs for a multiply-add with a row's pair of multipliers: s16[j][2 t], s16[j][2 t + 1] are
// the sums over values 32 j .. 32 j + 15 and 32 j + 16 .. 32 j + 31 (|.| <= 2032; Q6_K's pair:
// minus 32 times its two sub-scales), s32[j][2 t], s32[j][2 t + 1] the sums over 64 j .. 64 j +
// 31 and 64 j + 32 .. 64 j + 63 (|.| <= 4064; Q4_K / Q5_K's pair: the mins of the two 32-value
// chunks). Tokens past the end: all zero. 32-byte aligned, so that no 32-byte load of q[i]
// crosses a cache line: the buffers of large batches come from mmap at 16 mod 32, where every
// other load split across two lines (a Zen 3 loop of the batched kernel's loads and maddubs ran
// 20-25% slower with its activations at 16 mod 32).
struct alignas(32) ActBlockK8 {
  int8_t q[64][32];
  float d[8];
  int16_t s16[8][16];
  int16_t s32[4][16];
};
static_assert(sizeof(ActBlockK8) == 2464);

// xk: `tokens` tokens' K blocks (blocks per token, xk_stride apart) into ceil(tokens / 8)
// groups of `blocks` ActBlockK8 each (group g: tokens 8 g .. 8 g + 7).
void transpose_activations_k(const ActBlockK* xk, int64_t xk_stride, int64_t tokens, int64_t blocks,
                             ActBlockK8* out);

// Rows in lanes: the decode layout (MatmulMode::kInt8, calls of up to kRows8MaxTokens tokens) of
// Q4_K and Q6_K, and below of Q8_0 and Q5_0. The rows of a matrix
// go 8 to a group; a group's super-block k (256 columns of its 8 rows) is one record of
// kRows8BytesQ4K / kRows8BytesQ6K bytes, the records of a group in column order. In a record,
// every 32-byte vector holds 4 bytes per row (lane r: row r), so one load, a mask or a shift and
// one vpdpbusd against 4 activation bytes broadcast to every lane do 32 products for 8 rows,
// with no per-row horizontal sums, sub-scale shuffles or int16 stage (the row layout's
// superblock() needs those: BM_Matmul's one-token Q4_K call ran at ~40 GMAC/s there, ~0.18 of
// the int8 peak, on the Zen 4 VM). The integers are the same (exact in any order) and the float
// operations per row are the same sequence, so the bits are those of the row layout.
//   Q4_K (1184 bytes; 8 x 144 in the rows):
//     [0, 1024)     chunk j < 8 (columns 32 j ..), step s < 4: 32 bytes at 128 j + 32 s; byte
//                   4 r + t: code of column 32 j + 8 s + t (low nibble), 32 j + 8 s + 4 + t (high)
//     [1024, 1088)  scale of chunk j, row r at 1024 + 8 j + r (6 bits)
//     [1088, 1152)  mins of chunks 2 p, 2 p + 1, row r at 1088 + 16 p + 2 r (+1) (6 bits)
//     [1152, 1168)  d of row r (f16) at 1152 + 2 r;  [1168, 1184) dmin likewise
//   Q6_K (1680 bytes; 8 x 210): codes u = q + 32 (0 .. 63)
//     [0, 1024)     chunk c < 16 (columns 16 c ..), step s < 2: 32 bytes at 64 c + 32 s; byte
//                   4 r + t: low 4 bits of column 16 c + 8 s + t (low nibble), + 4 + t (high)
//     [1024, 1536)  chunk c: 32 bytes at 1024 + 32 c; byte 4 r + t: the top 2 bits of columns
//                   16 c + t, + 4 + t, + 8 + t, + 12 + t at bits 0, 2, 4, 6
//     [1536, 1664)  sub-scale of chunk c, row r (int8) at 1536 + 8 c + r
//     [1664, 1680)  d of row r (f16) at 1664 + 2 r
// Two 32-value types, a record per block of 32 columns (Q5_0's offset, -16 sum(q) of the token's
// block, from RowsArgs::xsum, as the row layout's S = dot(c, q) - 16 sum(q)):
//   Q8_0 (272 bytes; 8 x 34): the signed codes w as stored (no offset)
//     [0, 256)      step s < 8: 32 bytes at 32 s; byte 4 r + t: column 4 s + t
//     [256, 272)    d of row r (f16) at 256 + 2 r
//   Q5_0 (176 bytes; 8 x 22): codes 0 .. 31 (off 16)
//     [0, 128)      step s < 4: 32 bytes at 32 s; byte 4 r + t: low 4 bits of column 8 s + t
//                   (low nibble), of 8 s + 4 + t (high nibble)
//     [128, 160)    byte 4 r + t: the fifth bit of column 8 s + t at bit s, of 8 s + 4 + t at
//                   bit 4 + s (s < 4)
//     [160, 176)    d of row r (f16) at 160 + 2 r
inline constexpr int64_t kRows8BytesQ4K = 1184, kRows8BytesQ6K = 1680, kRows8BytesQ8_0 = 272,
                         kRows8BytesQ5_0 = 176;
// Calls of up to this many tokens (a decode step's batch) read the rows8 copy where the matrix has
// one, each record's codes decoded once per 4 tokens; longer ones (prefill, larger batches)
// decode rows into the batched path's scratch and put 8 tokens in the lanes. BM_Matmul and
// BM_MatmulRows8 on the Zen 4 VM (AVX-512 VNNI, 1 thread, L3-resident Qwen2.5-1.5B shapes,
// 8960 x 1536 / 1536 x 8960), ms, rows8 against the batched path:
//   Q4_K  4 tokens 0.53-0.62 / 1.28-1.36; 8: 1.02-1.47 / 1.31-1.44; 16: 2.14-2.49 / 1.85-2.17
//   Q6_K  4 tokens 0.88-1.01 / 1.72-1.82; 8: 1.68-1.77 / 1.82-2.27; 16: 3.17-3.82 / 2.31-2.71
// (the batched path costs about the same for 1-8 tokens: its lanes hold 8).
inline constexpr int64_t kRows8MaxTokens = 8;
// Bytes per group's super-block record, 0 for the other types.
static constexpr int64_t rows8_record_bytes(uint32_t type) {  // internal linkage, as above
  return type == kTypeQ4_K   ? kRows8BytesQ4K
         : type == kTypeQ6_K ? kRows8BytesQ6K
         : type == kTypeQ8_0 ? kRows8BytesQ8_0
         : type == kTypeQ5_0 ? kRows8BytesQ5_0
                             : 0;
}
// Columns per record: 256 for the K types, 32 for the others.
static constexpr int64_t rows8_record_cols(uint32_t type) {
  return type == kTypeQ4_K || type == kTypeQ6_K ? 256 : 32;
}
// rows / 8 groups (the rest of the rows stay in the row layout only) of a matrix in the row
// layout (row_bytes apart, cols a multiple of rows8_record_cols) into out (rows / 8 * cols /
// rows8_record_cols records).
void pack_rows8(uint32_t type, const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t cols,
                uint8_t* out);

// Whether the integer targets read this weight type (the float types stay on the float path),
// and whether they read it with 256-value activation blocks (ActBlockK: the K types).
bool int8_type(uint32_t type);
bool int8_k_type(uint32_t type);

// Integer row kernels: rows_int8_generic (plain C++, every machine), rows_int8_avx2 (maddubs +
// madd), rows_int8_avxvnni (AVX-VNNI vpdpbusd on ymm), rows_int8_avx512vnni (AVX-512 VNNI's
// vpdpbusd on ymm and zmm), rows_int8_amx (that one with the K types' batched sums on AMX-INT8's
// tiles). All give the same bits: the integer lane sums are exact on every target
// and the float operations after them are the same sequence.
void rows_int8_generic(const RowsArgs& a);
#if defined(TREEATTN_MODEL_X86)
void rows_int8_avx2(const RowsArgs& a);
void rows_int8_avxvnni(const RowsArgs& a);
void rows_int8_avx512vnni(const RowsArgs& a);
void rows_int8_amx(const RowsArgs& a);
#endif

}  // namespace treeattn::model::detail
