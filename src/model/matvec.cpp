// The weight matrix-vector driver: checks the request, picks the ISA target, splits the rows of
// all matrices over OpenMP threads and the tokens into tiles, and calls the per-ISA row kernel
// (matvec_targets.hpp). Compiled for the baseline ISA.
//
// Work split: the rows of every matrix are concatenated and cut into chunks of kRowChunk rows;
// threads take chunks statically (the same chunks for every token tile). The tokens go in tiles
// (token_tile), outermost, so that a prefill streams its activations through memory once per
// tile while each thread's weight rows stay in its cache.
// Neither split changes a (row, token) result (see matvec_targets.hpp).
//
// MatmulMode::kInt8: first every token's activations are quantized (ActBlock, and ActBlockK for
// the K types; once per call, split over the threads by token; a token's blocks depend on that
// token only), then the quantized weight types run on the integer targets (matvec_int8_impl.hpp),
// the float types on the float targets, chunk by chunk as above.
#include <omp.h>
#if defined(TREEATTN_MODEL_X86)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "core/aligned.hpp"
#include "model/matmul_tuning.hpp"
#include "model/matvec_targets.hpp"
#include "treeattn/model.hpp"
#include "treeattn/tuning.hpp"

namespace treeattn::model {
namespace {

constexpr int64_t kRowChunk = 16;
// A multiple of the int8 targets' token groups (8: ActBlock8, ActBlockK8) and of the float
// targets' NT (3, 2, 1).
constexpr int64_t kTokenTile = 48;
static_assert(kTokenTile % 8 == 0, "a tile starts at a group of 8 tokens (RowsArgs::xt)");

// The tokens of a tile. A call whose matrices are all K types on the integer path: as many
// multiples of kTokenTile as keep the tile's 8-bit activation codes (which every row block of a
// chunk reads again) within tile_bytes (ActBlockK8's scales and sums add ~20%: ~600 KiB at 336
// tokens x 1536 columns), so that each row's per-tile work (decoding its super-blocks into the
// scratch, the weights' trip from memory) is spread over more tokens. The compiled-in 512 KiB
// (detail::kTileBytes) is half of Zen 4's L2 per core; on the Zen 4 VM (AVX-512 VNNI, 1 thread)
// it ran BM_Matmul's 512-token Q4_K / Q6_K 8960 x 1536 calls ~5% / ~10% faster than 48 tokens,
// and Qwen2.5-1.5B's 512-token prefill's matrices in 5.78-5.92 s against 6.07-7.51 s (three
// pairs, alternated). The best size follows the core's L2, so the kernel tuning measures it on
// each CPU (tuning.hpp, matmul_tuning.cpp); the tile changes no bit. Every other call:
// kTokenTile. The 32-value types decode cheaply; with 768-token tiles Gemma-3's gate / up (2048 x
// 640 Q5_0, 512 tokens) was no faster in BM_Matmul (7.6-8.7 ms against 6.9-8.5 ms, noisy), its
// activations read from L2 instead of L1. (The shipped files never mix the two kinds in one call.)
// On the AVX-512 VNNI target a K-type pass takes 32 tokens (4 groups on wide lanes, groupk), and
// a tile of 48 leaves a pass of 16 at half the rate (its 4 chains of vpdpbusd wait on latency):
// at 8960 columns (a down projection) that was a third of the work, and the 16-token passes
// 9% of Qwen2.5-1.5B's 512-token prefill (perf, Zen 5). There the tile is a multiple of 32
// tokens, at least 64 (64 x 8960 is 560 KiB of codes, inside Zen 4's and Zen 5's 1 MiB L2).
constexpr int64_t kWidePass = 32;
int64_t token_tile(int64_t cols, bool k_types_only, bool wide, int64_t tile_bytes) {
  if (!k_types_only) return kTokenTile;
  if (wide) return std::max<int64_t>(2, tile_bytes / cols / kWidePass) * kWidePass;
  return std::max<int64_t>(1, tile_bytes / cols / kTokenTile) * kTokenTile;
}

std::atomic<int64_t> g_forced_tile_bytes{0};

// The calling thread's buffers of matmul's 8-bit activations (grown, never shrunk), and each
// OpenMP thread's decoded rows: per thread, so that concurrent callers (in-process ranks) never
// share them.
struct ActBuffers {
  std::vector<detail::ActBlock> xq;
  std::vector<detail::ActBlockK> xk;
  std::vector<detail::ActBlock8> xt;
  std::vector<detail::ActBlockK8> xtk;
  AlignedVector<int8_t> xtk16;  // the AMX target's (RowsArgs::xtk16)
  std::vector<int32_t> xsum;
};
thread_local ActBuffers tl_act;
thread_local AlignedVector<float> tl_scratch;
// The calling thread's copy of a call's activations on cache-line boundaries, where the caller's
// are not (the float path's micro-tiles load them 16 floats at a time: a misaligned row splits
// every load).
thread_local AlignedVector<float> tl_xcopy;

template <class Vec>
void grow(Vec& v, int64_t n) {
  if (v.size() < static_cast<std::size_t>(n)) v.resize(static_cast<std::size_t>(n));
}

// The calling thread's activation buffers for `tokens` tokens of the 32-value types over cols32
// columns and of the K types over colsk columns (0: none of that kind): matmul's and
// reserve_matmul's one sizing.
void grow_act(int64_t tokens, int64_t cols32, int64_t colsk) {
  grow(tl_act.xq, tokens * (cols32 / 32));
  grow(tl_act.xk, tokens * (colsk / 256));
  if (tokens > 1) {  // several tokens: the blocks also 8 tokens to a group (ActBlock8, ActBlockK8)
    grow(tl_act.xt, (tokens + 7) / 8 * (cols32 / 32));
    // One group more than the tokens fill: the AMX target's passes take groups two at a time,
    // a last odd group with the spare one (its results are not stored).
    grow(tl_act.xtk, ((tokens + 7) / 8 + 1) * (colsk / 256));
  }
}

// Pair p of xtk's 8-token groups (groups 2 p and 2 p + 1, each `blocks` ActBlockK8) side by
// side, as RowsArgs::xtk16 holds them.
void pair_groups_k(const detail::ActBlockK8* xtk, int64_t blocks, int64_t p, int8_t* xtk16) {
  for (int64_t k = 0; k < blocks; ++k) {
    const detail::ActBlockK8& a = xtk[2 * p * blocks + k];
    const detail::ActBlockK8& b = xtk[(2 * p + 1) * blocks + k];
    int8_t* o = xtk16 + (p * blocks + k) * detail::kXtk16Bytes;
    for (int i = 0; i < 64; ++i) {
      std::memcpy(o + 64 * i, a.q[i], 32);
      std::memcpy(o + 64 * i + 32, b.q[i], 32);
    }
  }
}

detail::RowsFn rows_fn(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_MODEL_X86)
    case Isa::kAvx512:
      return detail::rows_avx512;
    case Isa::kAvx2:
      return detail::rows_avx2;
#endif
    default:
      return detail::rows_generic;
  }
}

// Whether the environment variable `name` is "0" (a kernel target switched off).
bool env_off(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr && std::string_view(e) == "0";
}

// TREEATTN_INT8_VNNI=0 in the environment (read once): the maddubs target even where the CPU
// has VNNI, as an AVX2-only CPU runs it (same bits; to compare the AVX2 kernels with llama.cpp's
// AVX2 build on one machine).
bool int8_vnni_allowed() {
  static const bool allowed = !env_off("TREEATTN_INT8_VNNI");
  return allowed;
}

#if defined(TREEATTN_MODEL_X86)
// Whether this process may run the AMX target (read once): the CPU has AMX-TILE and AMX-INT8
// (CPUID 7.0 EDX bits 24, 25), the OS saves the tile state (XCR0 bits 17, 18) and grants this
// process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: Linux enables it
// per process, on request), and TREEATTN_INT8_AMX=0 is not set.
bool amx_usable() {
  static const bool usable = [] {
    if (env_off("TREEATTN_INT8_AMX")) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d >> 24 & 1u) == 0 || (d >> 25 & 1u) == 0) return false;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c >> 27 & 1u) == 0) return false;  // OSXSAVE
    uint32_t xcr0 = 0, xcr0_hi = 0;
    asm volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0 >> 17 & 3u) != 3u) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}
#endif

// The integer target: VNNI where the CPU has it and the options allow it, on AVX-512 with the
// tile unit's K path where amx_usable().
detail::RowsFn rows_int8_fn(Isa isa, bool vnni, bool amx) {
  vnni = vnni && int8_vnni_allowed();
  switch (isa) {
#if defined(TREEATTN_MODEL_X86)
    case Isa::kAvx512:
      // No 512-bit integer kernel: the AVX-512 target runs the 256-bit ones (VNNI if present).
      if (vnni && amx && __builtin_cpu_supports("avx512vnni") && amx_usable())
        return detail::rows_int8_amx;
      if (vnni && __builtin_cpu_supports("avx512vnni")) return detail::rows_int8_avx512vnni;
      return detail::rows_int8_avx2;
    case Isa::kAvx2:
      if (vnni && __builtin_cpu_supports("avxvnni")) return detail::rows_int8_avxvnni;
      return detail::rows_int8_avx2;
#endif
    default:
      return detail::rows_int8_generic;
  }
}

// The types the targets read, in the order error messages list them.
constexpr uint32_t kKernelTypes[] = {
    detail::kTypeF32,  detail::kTypeF16,  detail::kTypeBF16, detail::kTypeQ8_0,
    detail::kTypeQ4_0, detail::kTypeQ4_1, detail::kTypeQ5_0, detail::kTypeQ5_1,
    detail::kTypeQ4_K, detail::kTypeQ5_K, detail::kTypeQ6_K,
};

bool kernel_type(uint32_t t) {
  return std::find(std::begin(kKernelTypes), std::end(kKernelTypes), t) != std::end(kKernelTypes);
}

std::string kernel_types() {
  std::string s;
  for (const uint32_t t : kKernelTypes) s += (s.empty() ? "" : ", ") + gguf::tensor_type_name(t);
  return s;
}

// A matrix the targets can read: a kernel type, whole blocks per row and rows of the block
// size times the blocks (the targets read exactly cols / block_elems blocks per row).
Status check_matrix(const char* who, const WeightMatrix& m) {
  if (!kernel_type(m.type))
    return unsupported(std::string(who) + "tensor '" + m.name + "' has type " +
                       gguf::tensor_type_name(m.type) + "; the matrix kernels read " +
                       kernel_types());
  const gguf::BlockLayout bl = gguf::block_layout(m.type);
  if (m.cols < 0 || m.cols % bl.block_elems != 0)
    return invalid_argument(std::string(who) + "tensor '" + m.name + "' (" +
                            gguf::tensor_type_name(m.type) + "): " + std::to_string(m.cols) +
                            " columns is not a whole number of " + std::to_string(bl.block_elems) +
                            "-value blocks");
  const int64_t need = m.cols / bl.block_elems * bl.block_bytes;
  if (m.row_bytes < need)
    return invalid_argument(std::string(who) + "tensor '" + m.name + "' (" +
                            gguf::tensor_type_name(m.type) + "): rows of " +
                            std::to_string(m.row_bytes) + " bytes, " + std::to_string(m.cols) +
                            " columns need " + std::to_string(need));
  return Status::ok();
}

}  // namespace

Result<WeightMatrix> WeightMatrix::from_tensor(const gguf::TensorInfo& t) {
  WeightMatrix m;
  m.name = std::string(t.name);
  m.type = t.type;
  if (!kernel_type(t.type))
    return unsupported("tensor '" + m.name + "' has type " + gguf::tensor_type_name(t.type) +
                       "; the matrix kernels read " + kernel_types());
  if (t.dims.empty() || t.dims.size() > 2)
    return invalid_argument("tensor '" + m.name + "' has " + std::to_string(t.dims.size()) +
                            " dimensions; a weight matrix has 1 or 2");
  m.data = t.data;
  m.cols = static_cast<int64_t>(t.dims[0]);
  m.rows = static_cast<int64_t>(t.n_rows());
  m.row_bytes = static_cast<int64_t>(t.row_bytes());
  TREEATTN_RETURN_IF_ERROR(check_matrix("", m));
  return m;
}

std::size_t rows8_bytes(const WeightMatrix& m) {
  return static_cast<std::size_t>(m.rows / 8 * (m.cols / detail::rows8_record_cols(m.type)) *
                                  detail::rows8_record_bytes(m.type));
}

void pack_rows8(const WeightMatrix& m, uint8_t* out) {
  if (rows8_bytes(m) > 0) detail::pack_rows8(m.type, m.data, m.rows, m.row_bytes, m.cols, out);
}

RowRange slice_rows(int64_t rows, int index, int count) {
  const auto at = [&](int i) -> int64_t {
    if (i >= count) return rows;
    // floor(i * rows / count) without overflow: rows = q count + r.
    const int64_t exact = rows / count * i + rows % count * i / count;
    return exact / kSliceRowAlign * kSliceRowAlign;
  };
  return RowRange{at(index), at(index + 1)};
}

Status check_row_slice(const WeightMatrix& m, RowRange r) {
  if (r.begin < 0 || r.end < r.begin || r.end > m.rows)
    return invalid_argument("tensor '" + m.name + "': rows [" + std::to_string(r.begin) + ", " +
                            std::to_string(r.end) + ") are not inside its " +
                            std::to_string(m.rows) + " rows");
  const gguf::BlockLayout bl = gguf::block_layout(m.type);
  if (bl.block_elems == 0 || m.cols % bl.block_elems != 0 ||
      m.row_bytes != m.cols / bl.block_elems * static_cast<int64_t>(bl.block_bytes))
    return unsupported("tensor '" + m.name + "' (" + gguf::tensor_type_name(m.type) + ", " +
                       std::to_string(m.rows) + " rows of " + std::to_string(m.cols) +
                       " values) cannot be split by output rows: its rows are " +
                       std::to_string(m.row_bytes) + " bytes apart, not " +
                       (bl.block_elems == 0
                            ? std::string("whole blocks of a known layout")
                            : std::to_string(m.cols / std::max<int64_t>(1, bl.block_elems) *
                                             static_cast<int64_t>(bl.block_bytes)) +
                                  " (whole blocks of " + std::to_string(bl.block_elems) +
                                  " values)") +
                       ", so a row's blocks are not its own (interleaved rows or shared scales)");
  return Status::ok();
}

WeightMatrix row_slice(const WeightMatrix& m, RowRange r) {
  WeightMatrix s = m;
  s.name = m.name + "[" + std::to_string(r.begin) + ":" + std::to_string(r.end) + "]";
  s.data = m.data + r.begin * m.row_bytes;
  s.rows = r.size();
  s.rows8 = nullptr;
  if (m.rows8 != nullptr && r.begin % 8 == 0 && rows8_bytes(m) > 0)
    s.rows8 = m.rows8 + r.begin / 8 * (m.cols / detail::rows8_record_cols(m.type)) *
                            detail::rows8_record_bytes(m.type);
  return s;
}

std::string_view matmul_mode_name(MatmulMode mode) {
  switch (mode) {
    case MatmulMode::kExact:
      return "exact";
    case MatmulMode::kInt8:
      return "int8";
    case MatmulMode::kInt8Ffn:
      return "int8-ffn";
  }
  return "exact";
}

Result<MatmulMode> parse_matmul_mode(std::string_view name) {
  for (const MatmulMode m : {MatmulMode::kExact, MatmulMode::kInt8, MatmulMode::kInt8Ffn})
    if (name == matmul_mode_name(m)) return m;
  return invalid_argument("matmul mode '" + std::string(name) +
                          "': expected exact, int8 or int8-ffn");
}

MatvecOptions for_role(MatvecOptions options, MatrixRole role) {
  if (options.mode == MatmulMode::kInt8Ffn)
    options.mode = role == MatrixRole::kAttention ? MatmulMode::kExact : MatmulMode::kInt8;
  return options;
}

std::string_view matmul_int8_target(const MatvecOptions& options) {
  const detail::RowsFn fn = rows_int8_fn(matmul_isa(options), options.vnni, options.amx);
#if defined(TREEATTN_MODEL_X86)
  if (fn == detail::rows_int8_amx) return "amx";
  if (fn == detail::rows_int8_avx512vnni) return "avx512vnni";
  if (fn == detail::rows_int8_avxvnni) return "avxvnni";
  if (fn == detail::rows_int8_avx2) return "avx2";
#endif
  return fn == detail::rows_int8_generic ? "generic" : "?";
}

namespace detail {
int64_t matmul_tile_bytes(int threads, Isa isa) {
  if (const int64_t f = g_forced_tile_bytes.load(std::memory_order_acquire); f > 0) return f;
  if (const int64_t t = tuned_matmul_tile_bytes(threads, isa); t > 0) return t;
  return kTileBytes;
}

void force_matmul_tile_bytes(int64_t bytes) {
  g_forced_tile_bytes.store(bytes > 0 ? bytes : 0, std::memory_order_release);
}
}  // namespace detail

std::string matmul_description(const MatvecOptions& options) {
  std::string s = std::string(isa_name(matmul_isa(options))) + " " +
                  std::string(matmul_mode_name(options.mode));
  if (options.mode != MatmulMode::kExact)
    s += " (" + std::string(matmul_int8_target(options)) + ")";
  return s;
}

Isa matmul_isa(const MatvecOptions& options) {
  Isa isa = options.isa == Isa::kAuto ? best_isa() : options.isa;
  if (isa == Isa::kReference) isa = Isa::kGeneric;
  return isa;
}

void reserve_matmul(std::span<const WeightMatrix* const> mats, int64_t tokens,
                    const MatvecOptions& options) {
  int64_t cols32 = 0, colsk = 0, cols = 0;
  for (const WeightMatrix* m : mats) {
    cols = std::max(cols, m->cols);
    if (options.mode != MatmulMode::kInt8 || !detail::int8_type(m->type)) continue;
    (detail::int8_k_type(m->type) ? colsk : cols32) =
        std::max(detail::int8_k_type(m->type) ? colsk : cols32, m->cols);
  }
  grow_act(tokens, cols32, colsk);
  const int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  grow(tl_scratch, detail::scratch_floats(cols));
}

Status matmul(std::span<const WeightMatrix* const> mats, const float* x, int64_t tokens,
              int64_t x_stride, std::span<float* const> ys, const MatvecOptions& options) {
  if (mats.empty() || mats.size() != ys.size())
    return invalid_argument("matmul: " + std::to_string(mats.size()) + " matrices and " +
                            std::to_string(ys.size()) + " outputs");
  if (tokens < 0) return invalid_argument("matmul: negative token count");
  const int64_t cols = mats[0]->cols;
  if (x_stride < cols)
    return invalid_argument("matmul: x_stride " + std::to_string(x_stride) + " < " +
                            std::to_string(cols) + " columns");
  for (std::size_t i = 0; i < mats.size(); ++i) {
    const WeightMatrix& m = *mats[i];
    if (m.cols != cols)
      return invalid_argument("matmul: '" + m.name + "' has " + std::to_string(m.cols) +
                              " columns, '" + mats[0]->name + "' " + std::to_string(cols));
    TREEATTN_RETURN_IF_ERROR(check_matrix("matmul: ", m));
    if (m.data == nullptr || ys[i] == nullptr)
      return invalid_argument("matmul: null data or output for '" + m.name + "'");
  }
  if (options.mode == MatmulMode::kInt8Ffn)  // a choice per matrix, which only the caller knows
    return invalid_argument(
        "matmul: mode int8-ffn chooses per matrix role; pass "
        "for_role(options, role) for '" +
        mats[0]->name + "'");
  const Isa isa = matmul_isa(options);
  TREEATTN_RETURN_IF_ERROR(check_isa_supported(isa, "matmul"));
  if (tokens == 0) return Status::ok();
  const detail::RowsFn fn = rows_fn(isa);
  const detail::RowsFn fn8 = rows_int8_fn(isa, options.vnni, options.amx);
  // Which activation blocks the call needs: 32 values (ActBlock) for the 32-value types, 256
  // (ActBlockK) for the K types.
  bool int8 = false, int8_32 = false, int8_k = false;
  if (options.mode == MatmulMode::kInt8)
    for (const WeightMatrix* m : mats)
      if (detail::int8_type(m->type)) (detail::int8_k_type(m->type) ? int8_k : int8_32) = true;
  int8 = int8_32 || int8_k;
  bool k_types_only = options.mode == MatmulMode::kInt8;
  for (const WeightMatrix* m : mats) k_types_only = k_types_only && detail::int8_k_type(m->type);
#if defined(TREEATTN_MODEL_X86)
  const bool wide = fn8 == detail::rows_int8_avx512vnni || fn8 == detail::rows_int8_amx;
#else
  const bool wide = false;
#endif
  const int64_t tile =
      token_tile(cols, k_types_only, wide,
                 k_types_only ? detail::matmul_tile_bytes(
                                    options.threads > 0 ? options.threads : omp_get_max_threads(),
                                    isa)
                              : detail::kTileBytes);
  // Quantized types have cols % 32 == 0, K types cols % 256 == 0 (check_matrix), so the blocks
  // cover every column.
  const int64_t xq_stride = cols / 32, xk_stride = cols / 256;
  grow_act(tokens, int8_32 ? cols : 0, int8_k ? cols : 0);
  const int64_t groups = (tokens + 7) / 8;
  // A batched call of the float path from activations off cache-line boundaries copies them once.
  bool float_path = false;
  for (const WeightMatrix* m : mats)
    float_path = float_path || !(int8 && detail::int8_type(m->type));
  const bool copy_x = float_path && tokens >= detail::kBatchTokens &&
                      (reinterpret_cast<uintptr_t>(x) % kCacheLine != 0 ||
                       x_stride % static_cast<int64_t>(kCacheLine / sizeof(float)) != 0);
  const int64_t xc_stride = (cols + 15) / 16 * 16;
  if (copy_x) grow(tl_xcopy, tokens * xc_stride);
  float* const xcopy = copy_x ? tl_xcopy.data() : nullptr;
  const bool int8_xt = int8_32 && tokens > 1, int8_xtk = int8_k && tokens > 1;
  // The rows8 copies are read by calls of up to kRows8MaxTokens tokens (the call's count, not a
  // tile's). Q5_0's offset there needs each block's integer sum of q.
  const bool rows8_call = options.mode == MatmulMode::kInt8 && tokens <= detail::kRows8MaxTokens;
  bool xsum_needed = false;
  if (rows8_call)
    for (const WeightMatrix* m : mats)
      xsum_needed = xsum_needed || (m->rows8 != nullptr && m->type == detail::kTypeQ5_0);
  if (xsum_needed) grow(tl_act.xsum, tokens * xq_stride);
  int32_t* const xsum = tl_act.xsum.data();
  detail::ActBlock8* const xt = tl_act.xt.data();
  detail::ActBlockK8* const xtk = tl_act.xtk.data();
#if defined(TREEATTN_MODEL_X86)
  const bool amx16 = int8_xtk && fn8 == detail::rows_int8_amx;
#else
  const bool amx16 = false;
#endif
  if (amx16) grow(tl_act.xtk16, (groups + 1) / 2 * xk_stride * detail::kXtk16Bytes);
  int8_t* const xtk16 = amx16 ? tl_act.xtk16.data() : nullptr;
  detail::ActBlock* const xq = tl_act.xq.data();
  detail::ActBlockK* const xk = tl_act.xk.data();

  // Chunk c covers rows [c * kRowChunk, ...) of the concatenation, clipped to one matrix.
  std::vector<int64_t> first_chunk(mats.size() + 1, 0);
  for (std::size_t i = 0; i < mats.size(); ++i)
    first_chunk[i + 1] = first_chunk[i] + (mats[i]->rows + kRowChunk - 1) / kRowChunk;
  const int64_t chunks = first_chunk.back();
  if (chunks == 0) return Status::ok();  // matrices of no rows (an empty slice)
  int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, chunks));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    grow(tl_scratch, detail::scratch_floats(cols));
    if (int8) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tokens; ++t) {
        if (int8_32) detail::quantize_activations(x + t * x_stride, cols, xq + t * xq_stride);
        if (xsum_needed)
          detail::activation_sums(xq + t * xq_stride, xq_stride, xsum + t * xq_stride);
        if (int8_k) detail::quantize_activations_k(x + t * x_stride, cols, xk + t * xk_stride);
      }
      if (int8_xt || int8_xtk) {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t n = std::min<int64_t>(8, tokens - 8 * g);
          if (int8_xt)
            detail::transpose_activations(xq + 8 * g * xq_stride, xq_stride, n, xq_stride,
                                          xt + g * xq_stride);
          if (int8_xtk)
            detail::transpose_activations_k(xk + 8 * g * xk_stride, xk_stride, n, xk_stride,
                                            xtk + g * xk_stride);
        }
      }
      if (xtk16 != nullptr) {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (groups + 1) / 2; ++p)
          pair_groups_k(xtk, xk_stride, p, xtk16);
      }
    }
    if (copy_x) {  // the float path's activations, aligned: the same values, so the same bits
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tokens; ++t)
        std::copy_n(x + t * x_stride, cols, xcopy + t * xc_stride);
    }
    const float* const xf = copy_x ? xcopy : x;
    const int64_t xf_stride = copy_x ? xc_stride : x_stride;
    for (int64_t t0 = 0; t0 < tokens; t0 += tile) {
      // The same static split every tile: each thread keeps its rows' weights in cache.
#pragma omp for schedule(static) nowait
      for (int64_t c = 0; c < chunks; ++c) {
        const auto it = std::upper_bound(first_chunk.begin(), first_chunk.end(), c);
        const std::size_t i = static_cast<std::size_t>(it - first_chunk.begin()) - 1;
        const WeightMatrix& m = *mats[i];
        detail::RowsArgs a;
        a.type = m.type;
        a.w = m.data;
        a.row_bytes = m.row_bytes;
        a.cols = cols;
        a.row_begin = (c - first_chunk[i]) * kRowChunk;
        a.row_end = std::min(m.rows, a.row_begin + kRowChunk);
        a.x = xf + t0 * xf_stride;
        a.x_stride = xf_stride;
        a.tokens = std::min(tile, tokens - t0);
        a.y = ys[i] + t0 * m.rows;
        a.y_stride = m.rows;
        a.scratch = tl_scratch.data();
        a.w8 = rows8_call ? m.rows8 : nullptr;
        if (int8 && detail::int8_type(m.type)) {
          if (detail::int8_k_type(m.type)) {
            a.xk = xk + t0 * xk_stride;
            a.xk_stride = xk_stride;
            if (int8_xtk) a.xtk = xtk + t0 / 8 * xk_stride;
            if (xtk16 != nullptr) a.xtk16 = xtk16 + t0 / 16 * xk_stride * detail::kXtk16Bytes;
          } else {
            a.xq = xq + t0 * xq_stride;
            a.xq_stride = xq_stride;
            if (xsum_needed) a.xsum = xsum + t0 * xq_stride;
            if (int8_xt) a.xt = xt + t0 / 8 * xq_stride;
          }
          fn8(a);
        } else {
          fn(a);
        }
      }
    }
  }
  return Status::ok();
}

}  // namespace treeattn::model
