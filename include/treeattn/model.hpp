// A decoder model of the Llama family (llama, qwen2: see Architecture below) read from a GGUF
// file, and the CPU pieces of its forward pass.
//
// LlamaModel::load maps the file (gguf.hpp: MAP_SHARED, so the ranks of a node share one copy of
// the weights), reads the hyper-parameters from `llama.*` metadata and checks every tensor's
// presence, type and shape before anything is computed. The weights stay in the file's format;
// the matrix-vector kernels read them in place.
//
// Forward pass of one token x (n_embd floats) through layer l, as llama.cpp computes it:
//   xn = rmsnorm(x) * attn_norm                 rmsnorm(x) = x / sqrt(mean(x^2) + eps)
//   q = Wq xn, k = Wk xn, v = Wv xn              q: n_head heads, k and v: n_head_kv heads
//   q, k, v += bq, bk, bv                       qwen2 only, where the file has them
//   q, k <- rmsnorm per head * q_norm, k_norm   gemma3 only
//   q, k <- RoPE(pos)                           see below
//   a = attention(q, K, V)                      grouped-query attention over positions <= pos,
//                                               scale 1/sqrt(head_dim): the caller's job
//                                               (a DecodeSession in decode, generate.hpp)
//   x += Wo a
//   xn = rmsnorm(x) * ffn_norm
//   x += Wdown (silu(Wgate xn) * Wup xn)        silu(g) = g / (1 + exp(-g))
// then logits = Wout (rmsnorm(x) * output_norm), Wout = output.weight or, when the file has none,
// token_embd.weight (tied).
//
// RoPE: llama.cpp's converter stores the rows of Wq and Wk permuted within each head so that the
// rotation acts on ADJACENT pairs (x[2i], x[2i+1]) (ggml's "normal" rope mode); Hugging Face's
// rotate-half form on the unpermuted weights is the same function. For pair i < rope_dim / 2:
//   theta_i = (pos / linear_factor) * base^(-2i / rope_dim) / freq_factor_i
//   (x[2i], x[2i+1]) <- (x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos)
// qwen2 files are not permuted and rotate the halves instead (RopeForm::kHalves, ggml's "neox"):
//   (x[i], x[i+h]) <- (x[i] cos - x[i+h] sin, x[i] sin + x[i+h] cos),  h = rope_dim / 2
// with freq_factor_i from the tensor rope_freqs.weight when present (how GGUF carries Llama-3.1's
// rope scaling), else 1, and linear_factor from rope.scaling.type = linear. The angle and its
// cosine and sine are computed in double (llama.cpp accumulates the angle in float, which is off
// by ~1e-3 rad at 32k positions), then rounded to float.
//
// Matrix-vector kernels (matmul below): F32, F16, BF16, Q8_0, Q4_0 and Q4_1 rows against float
// activations, accumulated in float with FMA, SIMD per ISA (AVX-512, AVX2, generic; chosen at
// run time like the attention kernel), rows split over OpenMP threads. The bits of one
// (row, token) dot product do not depend on the thread count or on how many tokens are computed
// together, so a token's hidden states are the same bits in a prefill batch and in a one-token
// step, on every rank (the deterministic decode relies on it). Activations are not quantized
// (llama.cpp quantizes them to 8 bits for its integer kernels; here they stay float, which keeps
// the forward pass within float rounding of a float64 reference).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/gguf.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/status.hpp"
#include "treeattn/tokenizer.hpp"
#include "treeattn/tuning.hpp"

namespace treeattn::model {

// One weight matrix in the file's format: `rows` outputs of `cols` inputs, row r at
// data + r * row_bytes.
struct WeightMatrix {
  std::string name;
  uint32_t type = 0;  // ggml type id (gguf::TensorType)
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_bytes = 0;
  // Optional (Q4_K, Q6_K, Q8_0, Q5_0): the rows 8 at a time in the decode layout, filled by
  // pack_rows8 below and owned by the caller. MatmulMode::kInt8's calls of up to 8 tokens read it
  // instead of `data` (same bits, fewer instructions per weight: src/model/matvec_targets.hpp);
  // every other call reads `data`.
  const uint8_t* rows8 = nullptr;

  static Result<WeightMatrix> from_tensor(const gguf::TensorInfo& t);
  std::size_t bytes() const { return static_cast<std::size_t>(rows * row_bytes); }
};

// The bytes of m's rows8 copy: rows / 8 groups of cols / 256 (K types) or cols / 32 records (the
// remaining rows % 8 rows are read from `data`); 0 for the types without one (all but Q4_K,
// Q6_K, Q8_0 and Q5_0).
std::size_t rows8_bytes(const WeightMatrix& m);
// Writes m's rows8 copy (rows8_bytes(m) bytes) to out; m.data must be valid. Point m.rows8 at it.
void pack_rows8(const WeightMatrix& m, uint8_t* out);

// Output rows [begin, end) of a matrix.
struct RowRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const RowRange&) const = default;
};
// Slice boundaries fall on multiples of this many rows: the rows8 groups, so that a slice of a
// packed matrix is a run of its groups and each slice's own rows8 copy holds all but its last
// rows % 8.
inline constexpr int64_t kSliceRowAlign = 8;
// Slice `index` of `count` of `rows` output rows: consecutive ranges that cover [0, rows) in
// index order, each boundary the multiple of kSliceRowAlign nearest below index * rows / count
// (the last is rows), so slices differ by at most kSliceRowAlign rows and one is empty where
// rows < count * kSliceRowAlign. Requires 0 <= index < count.
RowRange slice_rows(int64_t rows, int index, int count);
// Whether rows r of m can be multiplied as a matrix of their own: r inside [0, m.rows] and m's
// format keeping each output row whole and apart (row r at data + r * row_bytes, its cols /
// block values in whole blocks: row_bytes == cols / block_elems * block_bytes, no block or
// scale shared between rows). Every type the kernels read is stored that way; a format that
// interleaves rows or shares scales between them is refused here (kUnsupported, naming the
// tensor, its type and why) before any rank computes with it.
Status check_row_slice(const WeightMatrix& m, RowRange r);
// Rows r of m as a matrix of r.size() rows that reads m's bytes in place (check_row_slice
// first). Its rows8 is a view of m's copy where m has one and r.begin is a multiple of 8 (m's
// groups r.begin / 8 ...), else null. The name is m's with "[begin:end]".
WeightMatrix row_slice(const WeightMatrix& m, RowRange r);

// How matmul multiplies the quantized weight types (Q4_0 .. Q6_K; F32, F16 and BF16 weights are
// always multiplied as floats):
//   kExact  float activations against the weights decoded to floats (exact up to float
//           accumulation; the reference the float64 tests compare against);
//   kInt8   each token's activations quantized once per call to 8-bit integers in blocks of 32
//           with a float scale, integer dot products per block (src/model/matvec_int8_impl.hpp:
//           |error| <= sum over blocks of (amax_block / 254) * sum |w| plus float rounding);
//   kInt8Ffn a model's choice per matrix (for_role below): the attention's projections (Q, K, V
//           and the output) as kExact, the FFN and the output head as kInt8; on SmolLM2-135M it
//           halves kInt8's first-token logit error for about a quarter of its decode time (the
//           docs/models.md, matrix modes). matmul() itself, which sees no roles, refuses it
//           (kInvalidArgument).
// Either way a token's result does not depend on the batch, the threads or the rows' split.
enum class MatmulMode : uint8_t { kExact, kInt8, kInt8Ffn };
std::string_view matmul_mode_name(MatmulMode mode);           // "exact", "int8", "int8-ffn"
Result<MatmulMode> parse_matmul_mode(std::string_view name);  // kInvalidArgument otherwise

struct MatvecOptions {
  int threads = 0;       // 0: every thread OpenMP offers
  Isa isa = Isa::kAuto;  // kAuto: best_isa(); kReference runs the generic target
  MatmulMode mode = MatmulMode::kExact;
  // kInt8 on a CPU with AVX-512 VNNI (isa avx512) or AVX-VNNI (isa avx2): false runs the
  // maddubs target instead (the same bits; for tests and benchmarks). TREEATTN_INT8_VNNI=0 in
  // the environment does the same for every call of the process (docs/models.md, --isa).
  bool vnni = true;
  // kInt8 with vnni on a CPU with AMX-INT8 (isa avx512): the K types' batched sums on the tile
  // unit (the same bits); false keeps them on AVX-512 VNNI. TREEATTN_INT8_AMX=0 in the
  // environment does the same for every call of the process.
  bool amx = true;
};

// What a weight matrix does in the forward pass, for the modes that choose per matrix.
enum class MatrixRole : uint8_t { kAttention, kFfn, kHead };
// The options matmul runs one role's matrices with: kInt8Ffn becomes kExact for kAttention and
// kInt8 for the others; every other mode is kept.
MatvecOptions for_role(MatvecOptions options, MatrixRole role);

// ys[i][t * mats[i]->rows + r] = <row r of mats[i], x + t * x_stride> for every matrix i, row r
// and token t < tokens. The matrices share the input (cols equal); their rows are split over
// the threads together. kInvalidArgument for mismatched sizes, kUnsupported for a type without
// a kernel or an ISA this CPU lacks.
Status matmul(std::span<const WeightMatrix* const> mats, const float* x, int64_t tokens,
              int64_t x_stride, std::span<float* const> ys, const MatvecOptions& options = {});
// Sizes the calling thread's matmul buffers (the 8-bit activations and every OpenMP thread's
// decoded rows) for calls of up to `tokens` tokens on these matrices with these options, so
// that the first call does not map their pages (the serving engine, at creation, on the thread
// that later runs its steps). Calls grow them anyway; this only moves the cost earlier.
void reserve_matmul(std::span<const WeightMatrix* const> mats, int64_t tokens,
                    const MatvecOptions& options = {});
// The ISA matmul runs with these options ("avx512", "avx2", "generic").
Isa matmul_isa(const MatvecOptions& options);
// The integer target matmul runs with these options in kInt8 mode: "amx", "avx512vnni",
// "avxvnni", "avx2" or "generic".
std::string_view matmul_int8_target(const MatvecOptions& options);
// "ISA MODE" with the integer target where the mode uses one, for start lines and reports:
// "avx512 int8 (avx512vnni)", "avx2 int8-ffn (avxvnni)", "avx512 exact".
std::string matmul_description(const MatvecOptions& options);

// The kernel tuning of matmul (tuning.hpp, MatmulTuneEntry): the token tile of calls on 8-bit
// activations of K-quant weights, in bytes of activation codes. The candidates a calibration
// times (the compiled-in 512 KiB among them); every one gives the same bits.
std::vector<int64_t> matmul_tile_candidates();
struct MatmulTuneOptions {
  int threads = 1;
  double seconds = 0.4;  // measuring time after the set-up (rounds continue until it)
  int min_rounds = 3;
  int max_rounds = 12;
  double margin = 0.03;  // a candidate replaces the default only when its median ratio to the
                         // default over the rounds beats 1 by more than this
  int64_t tokens = 512;  // tokens per call (a prefill chunk)
  int64_t rows = 4096, cols = 1536;  // the Q4_K matrix timed (cols a multiple of 256)
};
struct MatmulTuneResult {
  MatmulTuneEntry entry;
  std::vector<TuneCandidate> candidates;  // knob "matmul_tile", value the bytes; gbps: GOPS
  int rounds = 0;
  double seconds = 0;
};
// Times matmul in MatmulMode::kInt8 on a random Q4_K matrix with each candidate tile, the
// candidates alternating inside one run (rounds in a rotating order), on this CPU's best target;
// a candidate is compared with the default round by round (TuneCandidate::vs_default), its
// figure its fastest round. Stores nothing. While it runs no other matmul may
// run in the process.
Result<MatmulTuneResult> calibrate_matmul(const MatmulTuneOptions& options);

// What differs between the decoder architectures this forward pass runs (general.architecture),
// declared once per architecture in src/model/architecture.cpp; the forward pass above is
// composed from it, not copied per model.
//   llama  Llama 1-3, SmolLM2, Mistral-style files: no biases, RoPE on adjacent pairs (the
//          converter permuted Wq and Wk's rows for it).
//   qwen2  Qwen2 / Qwen2.5: optional q, k, v biases (added after the projection, before RoPE),
//          RoPE on the two halves of each head (ggml's "neox" mode: pair i is (x[i],
//          x[i + rope_dim / 2]); the converter does not permute), eps and rope base from the file.
//   gemma3 Gemma 3: embeddings scaled by sqrt(n_embd); RMSNorm of each q and k head before RoPE
//          (attn_q_norm, attn_k_norm); the attention and FFN outputs normed again before their
//          residual adds (post_attention_norm, post_ffw_norm); GeGLU with tanh-GELU; RoPE on
//          halves; sliding-window layers: layer l is local unless l % 6 == 5 (or
//          {arch}.attention.sliding_window_pattern), local layers use rope base
//          {arch}.rope.freq_base_swa (default 10000) and see the last `sliding_window` positions
//          (the engine's paged attention applies the window, PagedEntry::window; the
//          DecodeSession path of Generator does not, and refuses sequences longer than it).
enum class RopeForm : uint8_t { kAdjacentPairs, kHalves };
enum class FfnActivation : uint8_t { kSilu, kGeluTanh };
struct Architecture {
  std::string_view name;
  RopeForm rope = RopeForm::kAdjacentPairs;
  bool qkv_bias = false;  // blk.N.attn_{q,k,v}.bias are read (each optional); other biases refused
  bool qk_norm = false;   // blk.N.attn_{q,k}_norm.weight, required
  bool post_norms = false;   // blk.N.post_attention_norm / post_ffw_norm.weight, required
  bool embed_scale = false;  // x = embedding * sqrt(n_embd)
  FfnActivation ffn = FfnActivation::kSilu;
  int swa_pattern = 0;         // 0: no sliding-window layers
  double swa_rope_base = 0.0;  // rope base of local layers when the file does not give one
};
// The architecture named `name`, or nullptr. supported_architectures(): "llama, qwen2, gemma3".
const Architecture* find_architecture(std::string_view name);
std::string supported_architectures();

// Hyper-parameters from the file's metadata (`{arch}.` keys).
struct LlamaConfig {
  std::string architecture;  // general.architecture
  std::string name;          // general.name (may be empty)
  int n_layers = 0;
  int64_t n_embd = 0;
  int64_t n_ff = 0;
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t head_dim = 0;
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;  // context_length (0: not given)
  double rms_eps = 1e-5;
  double rope_base = 10000.0;
  int64_t rope_dim = 0;
  double rope_linear_factor = 1.0;  // rope.scaling.type = linear: positions divided by it
  bool rope_freq_factors = false;   // rope_freqs.weight present (Llama-3.1 style scaling)
  bool tied_output = false;         // no output.weight: the head is token_embd.weight
  RopeForm rope_form = RopeForm::kAdjacentPairs;  // from the architecture
  bool qkv_bias = false;                          // the file has q/k/v bias tensors
  const Architecture* arch = nullptr;             // what the forward pass composes
  int64_t sliding_window = 0;                     // 0: every layer global
  std::vector<uint8_t> local_layer;               // per layer: 1 = sliding-window layer
  double rope_base_local = 0.0;                   // of the local layers

  // KV cache values per token over all layers (K and V): 2 * n_layers * n_head_kv * head_dim.
  int64_t kv_values_per_token() const { return 2 * n_layers * n_head_kv * head_dim; }
  std::string to_string() const;
};

// Temporary activations of the forward pieces; one per thread that calls them (a LlamaModel
// is shared read-only by every rank thread of a process).
struct ForwardScratch {
  std::vector<float> xn, gate, up, tmp;
  // RoPE's cos and sin for the positions of the last call (rope_pairs floats per token; [0] the
  // global layers' frequencies, [1] the sliding-window layers'): the layers of one forward pass
  // compute them once, not once per layer and per q and k. Reused only for the same positions
  // and frequencies.
  std::vector<int64_t> rope_pos[2];
  std::vector<double> rope_freqs[2];
  std::vector<float> rope_cos[2], rope_sin[2];
};

// The projections of the forward pass: per layer Q, K, V, the attention output (O), the FFN's
// gate, up and down, and the output head (one for the model).
enum class Projection : uint8_t { kQ, kK, kV, kO, kGate, kUp, kDown, kHead };
inline constexpr int kProjections = 8;
// The tensor name's stem: "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
// "ffn_down", "output".
std::string_view projection_name(Projection p);

// The matrices a forward pass multiplies with: every layer's projections and the output head,
// either whole (a LlamaModel's own, LlamaModel::weights(): slice 0 of 1) or slice `index` of
// `count` of each one's output rows (LlamaModel::slice: rows slice_rows(full rows, index, count)
// of every matrix), with the rows8 copy of those rows; and the embedding table's rows of the
// same vocabulary slice as the head (the head's own where the two are tied). A slice of more
// than one maps each of its matrices' rows from the file on their own (gguf::File::map_again),
// so that a process computing with it only ever has its rows' pages (and at most a page beyond
// each end) resident. Move-only: the matrices point into the mappings and the copy it owns.
class DenseWeights {
 public:
  DenseWeights() = default;
  DenseWeights(DenseWeights&&) noexcept = default;
  DenseWeights& operator=(DenseWeights&&) noexcept = default;
  DenseWeights(const DenseWeights&) = delete;
  DenseWeights& operator=(const DenseWeights&) = delete;

  int index() const { return index_; }
  int count() const { return count_; }
  bool whole() const { return count_ == 1; }
  int layers() const { return static_cast<int>(layers_.size()); }
  // Projection p's output rows (the same in every layer): all of them, and slice `index`'s.
  int64_t full_rows(Projection p) const { return full_rows_[static_cast<std::size_t>(p)]; }
  RowRange rows(Projection p, int index) const { return slice_rows(full_rows(p), index, count_); }
  RowRange rows(Projection p) const { return rows(p, index_); }
  // Layer `layer`'s matrix p (kHead: the head, whatever the layer), of rows(p).size() rows.
  const WeightMatrix& matrix(int layer, Projection p) const;
  // The embedding table's rows rows(kHead) (token ids in that range; LlamaModel::embed).
  const WeightMatrix& embedding() const { return embedding_; }
  // Bytes of these rows of every matrix: what one token's forward pass reads of them.
  std::size_t bytes() const;
  // Bytes of the rows8 copies these weights own (a slice of a packed model views the model's).
  std::size_t rows8_bytes() const;
  // The rows8 copy (WeightMatrix::rows8) of the matrices `mode` multiplies with 8-bit activations
  // (kInt8: all; kInt8Ffn: the FFN and the head; kExact: none) that have none yet: only these
  // rows are read and copied. `threads` OpenMP threads (0: the default).
  void pack_rows8(MatmulMode mode, int threads = 0);

 private:
  friend class LlamaModel;
  std::vector<std::array<WeightMatrix, kProjections - 1>> layers_;
  WeightMatrix head_, embedding_;
  int index_ = 0, count_ = 1;
  std::vector<gguf::Mapping> maps_;  // a slice's own mappings of its rows
  std::array<int64_t, kProjections> full_rows_{};
  std::vector<std::vector<uint8_t>> rows8_;  // one buffer per pack_rows8 call that copied
};

class LlamaModel {
 public:
  // Opens and checks the file: kInvalidArgument for a missing or malformed file or tensor shape
  // (naming the file, the key or the tensor, what was expected and what was found),
  // kUnsupported for an architecture not in supported_architectures(), a tensor type without a
  // kernel, a bias tensor the architecture does not have, YaRN rope scaling or a head dim
  // without an attention kernel.
  static Result<std::unique_ptr<LlamaModel>> load(const std::string& path);

  const LlamaConfig& config() const { return cfg_; }
  const gguf::File& file() const { return file_; }
  const std::string& path() const { return file_.path(); }
  // Bytes of weights one decoded token reads: every layer matrix, the output head, one
  // embedding row (what bounds decode speed from below at short contexts).
  std::size_t weight_bytes_per_token() const;
  // The types of the layer matrices, e.g. "q4_1 (210), q8_0 (1)", for reports.
  std::string weight_types() const;
  // Copies the Q4_K / Q6_K / Q8_0 / Q5_0 matrices that `mode` multiplies with 8-bit activations
  // (kInt8: all; kInt8Ffn: the FFN and the output head; kExact: none) into the rows8 layout,
  // which the calls of up to 8 tokens (decode steps) then read: the same bits, fewer instructions
  // per weight (WeightMatrix::rows8). Costs rows8_bytes() of memory, about those matrices' own
  // size (the file's mapping stays: the longer calls and the exact path read it). Once per model,
  // before it is shared; `threads` OpenMP threads (0: the default). (The serving engine packs
  // the weights it computes with itself: DenseWeights::pack_rows8 of its slice.)
  void pack_rows8(MatmulMode mode, int threads = 0) { weights_.pack_rows8(mode, threads); }
  std::size_t rows8_bytes() const { return weights_.rows8_bytes(); }
  // The model's own matrices, whole.
  const DenseWeights& weights() const { return weights_; }
  // Slice `index` of `count` of every projection's output rows (DenseWeights), viewing this
  // model's mapping (and its rows8 copies where it has them): nothing is read. kUnsupported from
  // check_row_slice for a matrix whose format cannot be sliced by rows (the message names the
  // tensor and why); kInvalidArgument for index outside [0, count). The model must outlive it.
  Result<DenseWeights> slice(int index, int count) const;
  // reserve_matmul for a forward pass of `tokens` rows (each role's matrices with its options)
  // on the calling thread, with w's matrices (the model's own by default).
  void reserve_forward(int64_t tokens, const MatvecOptions& options) const {
    reserve_forward(weights_, tokens, options);
  }
  void reserve_forward(const DenseWeights& w, int64_t tokens, const MatvecOptions& options) const;

  // x[t] = the embedding of tokens[t] (n_embd floats each). kInvalidArgument for an id outside
  // [0, n_vocab).
  Status embed(std::span<const TokenId> tokens, float* x) const;
  // The same from w's embedding rows: every id must be in w.rows(Projection::kHead)
  // (kInvalidArgument otherwise); the same bits as embed().
  Status embed(const DenseWeights& w, std::span<const TokenId> tokens, float* x) const;
  // For T tokens at positions pos[t]: q [T][n_head * head_dim], k and v [T][n_head_kv *
  // head_dim], RoPE applied to q and k.
  Status attention_inputs(int layer, const float* x, int64_t tokens, const int64_t* pos, float* q,
                          float* k, float* v, ForwardScratch& scratch,
                          const MatvecOptions& options) const;
  // x += Wo a; x += FFN(x) for T tokens (a: [T][n_head * head_dim]).
  Status attention_output_and_ffn(int layer, const float* a, int64_t tokens, float* x,
                                  ForwardScratch& scratch, const MatvecOptions& options) const;
  // logits (n_vocab floats) of one hidden state.
  Status logits(const float* x, float* logits, ForwardScratch& scratch,
                const MatvecOptions& options) const;
  // The same for T hidden states x [T][n_embd] -> logits [T][n_vocab], the output head read once
  // for all of them (the serving engine's batched step); each token's bits equal the one-token
  // call's (matmul's bits per token do not depend on the token count).
  Status logits(const float* x, int64_t tokens, float* logits, ForwardScratch& scratch,
                const MatvecOptions& options) const;

  // The same three with other weights of this model: whole ones (w.whole(), e.g. a slice of 1
  // with its own rows8 copy); kInvalidArgument for a slice of more.
  Status attention_inputs(const DenseWeights& w, int layer, const float* x, int64_t tokens,
                          const int64_t* pos, float* q, float* k, float* v, ForwardScratch& scratch,
                          const MatvecOptions& options) const;
  Status attention_output_and_ffn(const DenseWeights& w, int layer, const float* a, int64_t tokens,
                                  float* x, ForwardScratch& scratch,
                                  const MatvecOptions& options) const;
  Status logits(const DenseWeights& w, const float* x, int64_t tokens, float* logits,
                ForwardScratch& scratch, const MatvecOptions& options) const;

  // The dense layers in pieces, for a caller that computes each projection's output rows on a
  // different rank and gathers them between the pieces (the serving engine's --dense split).
  // The three calls above are composed of exactly these, in this order, so the pieces give
  // their bits:
  //   attention_inputs          = attention_norm, project {Q, K, V}, finish_qkv
  //   attention_output_and_ffn  = project {O}, add_attention_output, ffn_norm,
  //                               project {gate, up}, ffn_activation, project {down},
  //                               add_ffn_output
  //   logits                    = output_norm, project {head}
  // x, xn: [tokens][n_embd]; every piece is row by row (its bits do not depend on `tokens`).
  // xn = rmsnorm(x) * attn_norm of `layer`.
  void attention_norm(int layer, const float* x, int64_t tokens, float* xn,
                      const MatvecOptions& options) const;
  // ys[i] = x times w's matrix ps[i] of `layer` for `tokens` rows of x (x_stride floats apart):
  // [tokens][w.rows(ps[i]).size()], with each projection's role's options (for_role). The
  // projections share their input width. Empty slices compute nothing.
  Status project(const DenseWeights& w, int layer, std::span<const Projection> ps, const float* x,
                 int64_t tokens, int64_t x_stride, std::span<float* const> ys,
                 const MatvecOptions& options) const;
  // q, k, v as projected ([tokens][n_head * head_dim], [tokens][n_head_kv * head_dim] twice) ->
  // the attention's inputs: the biases, the q / k norms, RoPE at positions pos, in place.
  Status finish_qkv(int layer, int64_t tokens, const int64_t* pos, float* q, float* k, float* v,
                    ForwardScratch& scratch, const MatvecOptions& options) const;
  // x += post_attention_norm(o) (the norm where the architecture has it; o is overwritten).
  void add_attention_output(int layer, float* o, int64_t tokens, float* x,
                            const MatvecOptions& options) const;
  // xn = rmsnorm(x) * ffn_norm of `layer`.
  void ffn_norm(int layer, const float* x, int64_t tokens, float* xn,
                const MatvecOptions& options) const;
  // gate[i] = act(gate[i]) * up[i] for i < tokens * width (the architecture's gated activation,
  // element by element: its bits do not depend on where an element sits).
  void ffn_activation(float* gate, const float* up, int64_t tokens, int64_t width,
                      const MatvecOptions& options) const;
  // x += post_ffw_norm(d) (d is overwritten where the architecture has the norm).
  void add_ffn_output(int layer, float* d, int64_t tokens, float* x,
                      const MatvecOptions& options) const;
  // xn = rmsnorm(x) * output_norm (one thread, as logits computes it).
  void output_norm(const float* x, int64_t tokens, float* xn) const;

  // RoPE of `heads` heads (head_dim floats each, contiguous) at position pos, in place, with
  // the frequencies of a global layer (of `layer`'s kind when given).
  void apply_rope(float* heads, int64_t n_heads, int64_t pos, int layer = -1) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;
    std::vector<float> bq, bk, bv;                                     // empty: no bias
    std::vector<float> q_norm, k_norm, post_attn_norm, post_ffn_norm;  // empty: none
  };
  explicit LlamaModel(gguf::File file) : file_(std::move(file)) {}
  Status init();
  // out[r] = rmsnorm(x[r]) * w for `rows` vectors of w.size() floats (in place allowed); the
  // rows split over `threads` OpenMP threads (the same bits at any count).
  void rmsnorm(const float* x, const std::vector<float>& w, int64_t rows, float* out,
               int threads = 1) const;
  // The frequencies of `layer`'s kind (the global ones for layer < 0).
  const std::vector<double>& rope_freqs(int layer) const;
  // cos / sin of pos * freq for each freq, rounded to float from double.
  static void rope_angles(const std::vector<double>& freqs, int64_t pos, float* cs, float* sn);
  // Rotates the pairs of each of n_heads heads by the angles' cos / sin.
  void rope_rotate(float* heads, int64_t n_heads, const float* cs, const float* sn) const;

  const Layer& layer_of(int layer) const { return layers_[static_cast<std::size_t>(layer)]; }
  Status embed_row(const WeightMatrix& table, int64_t row, float* x) const;
  Status check_whole(const DenseWeights& w, const char* fn) const;

  gguf::File file_;
  LlamaConfig cfg_;
  WeightMatrix tok_embd_;
  std::vector<float> output_norm_;
  std::vector<Layer> layers_;
  DenseWeights weights_;                // every projection and the head, whole
  std::vector<double> inv_freq_;        // per rotated pair, factors applied
  std::vector<double> inv_freq_local_;  // the same for sliding-window layers
};

}  // namespace treeattn::model
