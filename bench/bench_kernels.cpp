// Google Benchmark microbenchmarks of the decode kernel (per ISA target and dtype, llama3-8b
// head layout; the caller's row layout and the tiled layout of kv_tiles.hpp), of the state
// merge, of the weight matrix kernels (model::matmul per ISA and GGUF type) and of the int8
// multiply-add peak those kernels are held to (BM_Int8DotPeak). Not part of the
// test suite; run
//   build/<dir>/bench/treeattn_microbench --benchmark_filter=Decode
//   build/<dir>/bench/treeattn_microbench --benchmark_filter=Matmul
// Reported bytes/s count the KV bytes the kernel must read (Decode) or the weight bytes
// (Matmul: the matrix is read once per call, whatever the token count).
#include <benchmark/benchmark.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <random>
#include <utility>
#include <vector>

#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/model.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/state.hpp"

namespace {

using namespace treeattn;

// args: isa, dtype, tokens, q_len, threads
void BM_Decode(benchmark::State& st) {
  const auto isa = static_cast<Isa>(st.range(0));
  const auto dtype = static_cast<DType>(st.range(1));
  const int64_t n = st.range(2), Q = st.range(3);
  if (!isa_supported(isa)) {
    st.SkipWithError("CPU lacks this ISA");
    return;
  }
  const AttnShape s{1, 32, 8, 128, Q};
  KVCache cache(s, dtype, n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> k(128), v(128);
  for (int64_t h = 0; h < 8; ++h)
    for (int64_t t = 0; t < n; ++t) {
      for (auto& x : k) x = u(rng);
      for (auto& x : v) x = u(rng);
      cache.set_token(0, h, t, k.data(), v.data());
    }
  std::vector<float> q(static_cast<std::size_t>(Q * 32 * 128));
  for (auto& x : q) x = u(rng);
  std::vector<int64_t> len{n}, start{0};
  const KVShard kv = cache.view(0, len, start, len, 1);
  std::vector<float> states(static_cast<std::size_t>(Q * 32 * 130));
  DecodeOptions opt;
  opt.isa = isa;
  opt.threads = static_cast<int>(st.range(4));
  for (auto _ : st) {
    const Status r = decode_partial(s, q.data(), kv, states.data(), opt);
    if (!r.is_ok()) st.SkipWithError(r.message().c_str());
    benchmark::DoNotOptimize(states.data());
  }
  st.SetBytesProcessed(st.iterations() * static_cast<int64_t>(cache.bytes()));
  st.SetLabel(std::string(isa_name(isa)) + "/" + std::string(dtype_name(dtype)));
}

void decode_args(benchmark::internal::Benchmark* b) {
  for (Isa isa : {Isa::kReference, Isa::kGeneric, Isa::kAvx2, Isa::kAvx512})
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16})
      // 256: in L2 (1-2 MiB), the kernel's compute; 1024: in L3 (4-8 MiB); 65536: DRAM
      for (int64_t n : {256, 1024, 4096, 65536}) {
        if (isa == Isa::kReference && n > 4096) continue;
        b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(t), n, 1, 1});
      }
  b->Args({static_cast<int64_t>(Isa::kAvx512), static_cast<int64_t>(DType::kBF16), 65536, 4, 1});
}
BENCHMARK(BM_Decode)->Apply(decode_args)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The same decode on the tiled layout (kv_tiles.hpp, default tile size and placement).
// args: isa, dtype, tokens, q_len, threads
void BM_DecodeTiled(benchmark::State& st) {
  const auto isa = static_cast<Isa>(st.range(0));
  const auto dtype = static_cast<DType>(st.range(1));
  const int64_t n = st.range(2), Q = st.range(3);
  if (!isa_supported(isa)) {
    st.SkipWithError("CPU lacks this ISA");
    return;
  }
  const AttnShape s{1, 32, 8, 128, Q};
  Result<TiledKVCache> cache = TiledKVCache::create(s, dtype, n);
  if (!cache.is_ok()) {
    st.SkipWithError(cache.status().message().c_str());
    return;
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> k(128), v(128);
  for (int64_t h = 0; h < 8; ++h)
    for (int64_t t = 0; t < n; ++t) {
      for (auto& x : k) x = u(rng);
      for (auto& x : v) x = u(rng);
      cache->set_token(0, h, t, k.data(), v.data());
    }
  std::vector<float> q(static_cast<std::size_t>(Q * 32 * 128));
  for (auto& x : q) x = u(rng);
  std::vector<int64_t> len{n}, start{0};
  const TiledKVShard kv = cache->view(len, start, len, 1);
  std::vector<float> states(static_cast<std::size_t>(Q * 32 * 130));
  DecodeOptions opt;
  opt.isa = isa;
  opt.threads = static_cast<int>(st.range(4));
  for (auto _ : st) {
    const Status r = decode_partial_tiled(s, q.data(), kv, states.data(), opt);
    if (!r.is_ok()) st.SkipWithError(r.message().c_str());
    benchmark::DoNotOptimize(states.data());
  }
  // The KV bytes the kernel must read (tokens x heads x 128 x 2), not the padded allocation.
  st.SetBytesProcessed(st.iterations() * n * 8 * 128 * 2 * static_cast<int64_t>(dtype_size(dtype)));
  st.SetLabel(std::string(isa_name(isa)) + "/" + std::string(dtype_name(dtype)));
}
BENCHMARK(BM_DecodeTiled)->Apply(decode_args)->Unit(benchmark::kMicrosecond)->UseRealTime();

// Merging n records of head dim D into n others (one tree level on one rank).
void BM_Merge(benchmark::State& st) {
  const auto D = static_cast<std::size_t>(st.range(0));
  const auto n = static_cast<std::size_t>(st.range(1));
  std::vector<float> a(n * (D + 2)), b(n * (D + 2));
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < n; ++i) {
    a[i * (D + 2)] = u(rng);
    b[i * (D + 2)] = u(rng);
    a[i * (D + 2) + 1] = 1.0f + u(rng) * 0.5f;
    b[i * (D + 2) + 1] = 1.0f + u(rng) * 0.5f;
    for (std::size_t d = 0; d < D; ++d) {
      a[i * (D + 2) + 2 + d] = u(rng);
      b[i * (D + 2) + 2 + d] = u(rng);
    }
  }
  for (auto _ : st) {
    state_merge_n(a.data(), b.data(), n, D);
    benchmark::DoNotOptimize(a.data());
    // Keep values bounded: reset m so repeated merges do not drift to infinity.
    for (std::size_t i = 0; i < n; ++i) a[i * (D + 2) + 1] = 1.0f;
  }
  st.SetBytesProcessed(st.iterations() * static_cast<int64_t>(2 * n * (D + 2) * sizeof(float)));
}
BENCHMARK(BM_Merge)->Args({128, 32})->Args({128, 1024})->Args({256, 1024});

// One weight matrix of rows x cols (8192 x 4096: twice the 32 MB L3 of the test machines for the
// 4-bit types; and Qwen2.5-0.5B's shapes) against `tokens` activations. Random codes; every f16
// scale set to 2^-7 so that no value is a NaN or subnormal. bytes_per_second = weight bytes read.
// args: isa, ggml type, tokens, threads, mode (0 exact, 1 int8), rows, cols
void matmul_bench(benchmark::State& st, bool rows8) {
  const auto isa = static_cast<Isa>(st.range(0));
  const auto type = static_cast<uint32_t>(st.range(1));
  const int64_t tokens = st.range(2), rows = st.range(5), cols = st.range(6);
  if (!isa_supported(isa)) {
    st.SkipWithError("CPU lacks this ISA");
    return;
  }
  const gguf::BlockLayout bl = gguf::block_layout(type);
  const int64_t row_bytes = cols / bl.block_elems * bl.block_bytes;
  std::vector<uint8_t> w(static_cast<std::size_t>(rows * row_bytes));
  std::mt19937_64 rng(1);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::vector<int> f16_at;  // offsets of the f16 fields in a block
  switch (static_cast<gguf::TensorType>(type)) {
    case gguf::TensorType::kQ6_K:
      f16_at = {208};
      break;
    case gguf::TensorType::kQ4_1:
    case gguf::TensorType::kQ5_1:
    case gguf::TensorType::kQ4_K:
    case gguf::TensorType::kQ5_K:
      f16_at = {0, 2};
      break;
    default:
      f16_at = {0};
  }
  for (std::size_t b = 0; b < w.size(); b += bl.block_bytes)
    for (const int o : f16_at) {
      w[b + static_cast<std::size_t>(o)] = 0x00;
      w[b + static_cast<std::size_t>(o) + 1] = 0x20;  // 2^-7
    }
  model::WeightMatrix m;
  m.name = "bench";
  m.type = type;
  m.data = w.data();
  m.rows = rows;
  m.cols = cols;
  m.row_bytes = row_bytes;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens * cols)),
      y(static_cast<std::size_t>(tokens * rows));
  for (auto& v : x) v = u(rng);
  std::vector<uint8_t> packed;
  if (rows8) {
    packed.resize(model::rows8_bytes(m));
    model::pack_rows8(m, packed.data());
    m.rows8 = packed.data();
  }
  const model::WeightMatrix* mats[] = {&m};
  float* ys[] = {y.data()};
  model::MatvecOptions opt{static_cast<int>(st.range(3)), isa};
  opt.mode = st.range(4) != 0 ? model::MatmulMode::kInt8 : model::MatmulMode::kExact;
  for (auto _ : st) {
    const Status r = model::matmul(mats, x.data(), tokens, cols, ys, opt);
    if (!r.is_ok()) st.SkipWithError(r.message().c_str());
    benchmark::DoNotOptimize(y.data());
  }
  st.SetBytesProcessed(st.iterations() * static_cast<int64_t>(w.size()));
  st.counters["GFLOP/s"] = benchmark::Counter(
      static_cast<double>(st.iterations()) * 2.0 * static_cast<double>(rows * cols * tokens) / 1e9,
      benchmark::Counter::kIsRate);
  st.SetLabel(std::string(isa_name(isa)) + "/" + gguf::tensor_type_name(type) + "/" +
              (opt.mode == model::MatmulMode::kInt8
                   ? "int8:" + std::string(model::matmul_int8_target(opt))
                   : std::string("exact")) +
              (rows8 ? "/rows8" : ""));
}
void BM_Matmul(benchmark::State& st) { matmul_bench(st, false); }
// The same with the rows8 copy (Q4_K, Q6_K, Q8_0, Q5_0: 8 rows interleaved; read by int8 calls
// of up to 8 tokens).
void BM_MatmulRows8(benchmark::State& st) { matmul_bench(st, true); }

void matmul_args(benchmark::internal::Benchmark* b) {
  for (Isa isa : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512})
    for (const gguf::TensorType t :
         {gguf::TensorType::kQ8_0, gguf::TensorType::kQ4_0, gguf::TensorType::kQ4_1,
          gguf::TensorType::kQ5_0, gguf::TensorType::kQ5_1, gguf::TensorType::kQ4_K,
          gguf::TensorType::kQ5_K, gguf::TensorType::kQ6_K})
      for (int64_t tokens : {1, 16}) {
        if (isa == Isa::kGeneric && tokens > 1) continue;
        for (const int64_t mode : {0, 1})  // exact, int8 (MatmulMode)
          b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(t), tokens, 1, mode, 8192,
                   4096});
      }
  // Qwen2.5-Coder-0.5B's matrices (rows x cols: q/o 896 x 896, gate/up 4864 x 896, down 896 x
  // 4864, the head 151936 x 896), one token, int8, on AVX2: the decode step's weight types (its
  // Q4_K_M file has Q5_0, Q8_0, Q4_K and Q6_K; Q4_0 and Q4_1 for comparison). The K types need
  // cols % 256 == 0, so they run the down shape only.
  for (const gguf::TensorType t :
       {gguf::TensorType::kQ4_0, gguf::TensorType::kQ4_1, gguf::TensorType::kQ5_0,
        gguf::TensorType::kQ8_0, gguf::TensorType::kQ4_K, gguf::TensorType::kQ5_K,
        gguf::TensorType::kQ6_K})
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {896, 896}, {4864, 896}, {896, 4864}, {151936, 896}}) {
      if (gguf::block_layout(static_cast<uint32_t>(t)).block_elems == 256 && cols % 256 != 0)
        continue;
      b->Args({static_cast<int64_t>(Isa::kAvx2), static_cast<int64_t>(t), 1, 1, 1, rows, cols});
    }
  // Qwen2.5-Coder-1.5B's K-type shapes (q/o 1536 x 1536, gate/up 8960 x 1536, down 1536 x 8960)
  // and 512 x 1536 (442 KB of Q4_K: held in a 1 MB L2, so the kernel's arithmetic, not the
  // memory, is the limit), one token, 16, 48 (the prefill's token tile) and 512, int8, on AVX2 and
  // AVX-512 (skipped where absent). 512 tokens: a 512-token prefill's call, every token tile.
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512})
    for (const gguf::TensorType t : {gguf::TensorType::kQ4_K, gguf::TensorType::kQ6_K})
      for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {512, 1536}, {1536, 1536}, {8960, 1536}, {1536, 8960}})
        for (const int64_t tokens : {1, 4, 8, 16, 48, 512})
          b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(t), tokens, 1, 1, rows, cols});
  // Gemma-3-270M's gate / up shape (2048 x 640; its Q4_K_M file stores them as Q5_0, half its v
  // matrices as Q8_0), a 512-token prefill's call, int8, on AVX2 and AVX-512.
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512})
    for (const gguf::TensorType t : {gguf::TensorType::kQ5_0, gguf::TensorType::kQ8_0})
      b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(t), 512, 1, 1, 2048, 640});
  // SmolLM2-135M's Q4_1 shapes (q/o 576 x 576, gate/up 1536 x 576, down 576 x 1536), a 512-token
  // prefill's call in its default (exact) mode, on AVX2 and AVX-512: the float micro-tiles from
  // decoded rows, against the FMA peak (GFLOP/s counter).
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512})
    for (const auto& [rows, cols] :
         std::vector<std::pair<int64_t, int64_t>>{{576, 576}, {1536, 576}, {576, 1536}})
      b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(gguf::TensorType::kQ4_1), 512, 1, 0,
               rows, cols});
  // 65536 x 1536 (57-107 MB: past a 32 MB L3), one token: the decode step's case, the weights
  // streamed from DRAM (where the prefetch hint decides the speed: matvec_int8_impl.hpp).
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512})
    for (const gguf::TensorType t :
         {gguf::TensorType::kQ4_1, gguf::TensorType::kQ8_0, gguf::TensorType::kQ4_K,
          gguf::TensorType::kQ6_K})
      for (const int64_t int8 : {0, 1})
        b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(t), 1, 1, int8, 65536, 1536});
}
BENCHMARK(BM_Matmul)->Apply(matmul_args)->Unit(benchmark::kMillisecond)->UseRealTime();
// Q8_0 and Q5_0 at Qwen2.5-0.5B's gate / up and down (4864 x 896, 896 x 4864) and 65536 x 640
// (Gemma-3's head width, from DRAM), 1, 4 and 8 tokens (BM_Matmul runs them too).
void rows8_args32(benchmark::internal::Benchmark* b) {
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512})
    for (const gguf::TensorType t : {gguf::TensorType::kQ8_0, gguf::TensorType::kQ5_0})
      for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {4864, 896}, {896, 4864}, {65536, 640}})
        for (const int64_t tokens : {1, 4, 8})
          b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(t), tokens, 1, 1, rows, cols});
}
// Against BM_Matmul's same arguments: Qwen2.5-1.5B's shapes, 512 x 1536 (L2) and 65536 x 1536
// (DRAM), Q4_K and Q6_K, int8, on AVX2 and AVX-512; 1, 4, 8 and 16 tokens (a decode step's
// batch: calls of up to 8 tokens read the rows8 copy), 1 and 2 threads; and rows8_args32.
void rows8_args(benchmark::internal::Benchmark* b) {
  for (const Isa isa : {Isa::kAvx2, Isa::kAvx512})
    for (const gguf::TensorType t : {gguf::TensorType::kQ4_K, gguf::TensorType::kQ6_K})
      for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
               {512, 1536}, {1536, 1536}, {8960, 1536}, {1536, 8960}, {65536, 1536}})
        for (const int64_t tokens : {1, 4, 8, 16})
          for (const int64_t threads : {1, 2})
            b->Args({static_cast<int64_t>(isa), static_cast<int64_t>(t), tokens, threads, 1, rows,
                     cols});
  rows8_args32(b);
}
BENCHMARK(BM_MatmulRows8)->Apply(rows8_args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Matmul)->Apply(rows8_args32)->Unit(benchmark::kMillisecond)->UseRealTime();

#if defined(__x86_64__)
// The limit of the integer matrix kernels: one thread's 8-bit multiply-add peak, 12 independent
// chains of the kernels' dot instruction on ymm (VNNI: vpdpbusd, 32 products each; AVX2:
// vpmaddubsw + vpmaddwd + vpaddd), as G multiply-adds/s ("GMAC/s"). args: 1 VNNI, 0 AVX2.
__attribute__((target("avx512f,avx512vl,avx512vnni"))) int64_t dot_burn_vnni(int64_t n) {
  __m256i acc[12];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i w = _mm256_set1_epi8(3);
  const __m256i x = _mm256_set1_epi8(5);
  for (int64_t i = 0; i < n; ++i) {
    for (auto& a : acc) a = _mm256_dpbusd_epi32(a, w, x);
    __asm__ volatile("" : "+v"(w));  // not hoisted or folded
  }
  __m256i t = acc[0];
  for (int k = 1; k < 12; ++k) t = _mm256_add_epi32(t, acc[k]);
  return _mm256_extract_epi32(t, 0);
}
__attribute__((target("avx2"))) int64_t dot_burn_avx2(int64_t n) {
  __m256i acc[12];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i w = _mm256_set1_epi8(3);
  const __m256i x = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < n; ++i) {
    for (auto& a : acc)
      a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), one));
    __asm__ volatile("" : "+x"(w));
  }
  __m256i t = acc[0];
  for (int k = 1; k < 12; ++k) t = _mm256_add_epi32(t, acc[k]);
  return _mm256_extract_epi32(t, 0);
}

void BM_Int8DotPeak(benchmark::State& st) {
  const bool vnni = st.range(0) != 0;
  if (vnni ? !(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
           : !__builtin_cpu_supports("avx2")) {
    st.SkipWithError("CPU lacks this instruction set");
    return;
  }
  constexpr int64_t kIters = 1'000'000;
  for (auto _ : st) benchmark::DoNotOptimize(vnni ? dot_burn_vnni(kIters) : dot_burn_avx2(kIters));
  st.counters["GMAC/s"] = benchmark::Counter(static_cast<double>(st.iterations()) * kIters * 12 *
                                                 32 / 1e9,
                                             benchmark::Counter::kIsRate);
  st.SetLabel(vnni ? "vpdpbusd ymm" : "maddubs+madd ymm");
}
BENCHMARK(BM_Int8DotPeak)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();
#endif

}  // namespace

BENCHMARK_MAIN();
