// BM_Int8InnerAvx2 (part of treeattn_microbench): the AVX2 target's batched integer kernels
// alone, one call of 4 rows against 8 tokens (the K types also against 16, "/16tokens": the
// matmul's pass of two groups) with every operand in L1, so the figure is the core's, not the
// memory's. groupk (the K types: Q4_K, Q5_K, Q6_K, 6 super-blocks = 1536 columns, 3 against
// 16 tokens) and group8 (the 32-value types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, 20 blocks = 640 columns)
// on rows decoded as the matmul decodes them (int8_inner_avx2.cpp, built with the target's
// flags). Counter maddubs: vpmaddubsw-equivalents (32 products each) a second; over the core's
// clock, a cycle (pass the CPU's clock).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "int8_inner_avx2.hpp"
#include "model/matvec_targets.hpp"
#include "treeattn/gguf.hpp"
#include "treeattn/kernel.hpp"

namespace {

using namespace treeattn;
using model::detail::ActBlock8;
using model::detail::ActBlockK8;

// Random activation codes in +-127, as quantize_block makes them.
int8_t code(std::mt19937_64& rng) {
  return static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
}

void BM_Int8InnerAvx2(benchmark::State& st, uint32_t type, int groups) {
  if (!isa_supported(Isa::kAvx2)) {
    st.SkipWithError("CPU lacks AVX2");
    return;
  }
  const gguf::BlockLayout bl = gguf::block_layout(type);
  const bool k = bl.block_elems == 256;
  // K types: 6 super-blocks against 8 tokens, 3 against 16, so the tokens' 15 KiB and the rows
  // stay in L1 either way
  const int64_t blocks = k ? 6 / groups : 20;
  std::mt19937_64 rng(1);
  std::vector<uint8_t> w(static_cast<std::size_t>(4 * blocks) * bl.block_bytes);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  // f16 2^-7 for every scale field (Q6_K's d at 208; the others' d, and m / dmin, at 0 and 2)
  const bool two = type != static_cast<uint32_t>(gguf::TensorType::kQ4_0) &&
                   type != static_cast<uint32_t>(gguf::TensorType::kQ5_0) &&
                   type != static_cast<uint32_t>(gguf::TensorType::kQ8_0);
  for (std::size_t b = 0; b < w.size(); b += bl.block_bytes) {
    const bool q6k = type == static_cast<uint32_t>(gguf::TensorType::kQ6_K);
    for (const std::size_t o : q6k ? std::vector<std::size_t>{208}
                               : two ? std::vector<std::size_t>{0, 2}
                                     : std::vector<std::size_t>{0}) {
      w[b + o] = 0x00;
      w[b + o + 1] = 0x20;
    }
  }
  std::vector<uint8_t> dec(static_cast<std::size_t>(bench::int8_inner_dec_bytes(type, blocks)));
  if (!bench::int8_inner_decode(type, w.data(), blocks, dec.data())) {
    st.SkipWithError("not a batched integer type");
    return;
  }
  std::vector<ActBlockK8> xk(k ? static_cast<std::size_t>(groups * blocks) : 0);
  std::vector<ActBlock8> x8(k ? 0 : static_cast<std::size_t>(blocks));
  for (auto& x : xk) {
    for (auto& q : x.q)
      for (auto& c : q) c = code(rng);
    for (auto& d : x.d) d = 0.01f;
    for (auto& s : x.s16)
      for (auto& c : s) c = static_cast<int16_t>(static_cast<int>(rng() % 2001) - 1000);
    for (auto& s : x.s32)
      for (auto& c : s) c = static_cast<int16_t>(static_cast<int>(rng() % 4001) - 2000);
  }
  for (auto& x : x8) {
    for (auto& q : x.q)
      for (auto& c : q) c = code(rng);
    for (int t = 0; t < 8; ++t) {
      x.d[t] = 0.01f;
      x.s[t] = 0.5f;
      int32_t sum = 0;
      for (const auto& q : x.q)
        for (int i = 0; i < 4; ++i) sum += q[4 * t + i];
      x.sum[t] = sum;
    }
  }
  const void* xt = k ? static_cast<const void*>(xk.data()) : static_cast<const void*>(x8.data());
  float y[64];
  for (auto _ : st) {
    bench::int8_inner_run(type, dec.data(), blocks, xt, y, groups);
    benchmark::DoNotOptimize(y);
    benchmark::ClobberMemory();
  }
  // vpmaddubsw-equivalents a call: 64 groups x 4 rows a super-block, 8 x 4 a 32-value block
  st.counters["maddubs"] = benchmark::Counter(
      static_cast<double>(blocks * (k ? 64 : 8) * 4 * groups) *
          static_cast<double>(st.iterations()),
      benchmark::Counter::kIsRate);
  st.SetLabel(gguf::tensor_type_name(type));
}

void register_all() {
  for (const gguf::TensorType t :
       {gguf::TensorType::kQ4_K, gguf::TensorType::kQ5_K, gguf::TensorType::kQ6_K,
        gguf::TensorType::kQ4_0, gguf::TensorType::kQ4_1, gguf::TensorType::kQ5_0,
        gguf::TensorType::kQ5_1, gguf::TensorType::kQ8_0}) {
    const auto type = static_cast<uint32_t>(t);
    benchmark::RegisterBenchmark(("BM_Int8InnerAvx2/" + gguf::tensor_type_name(type)).c_str(),
                                 BM_Int8InnerAvx2, type, 1);
    if (gguf::block_layout(type).block_elems == 256)  // the K types' pass of two groups
      benchmark::RegisterBenchmark(
          ("BM_Int8InnerAvx2/" + gguf::tensor_type_name(type) + "/16tokens").c_str(),
          BM_Int8InnerAvx2, type, 2);
  }
}
const bool registered = (register_all(), true);

}  // namespace
