// The AVX2 target's batched integer kernels alone (part of treeattn_microbench): one call of 4
// rows against 8 tokens, every operand in L1, so the figure is the core's, not the memory's.
// groupk (the K types: Q4_K, Q5_K, Q6_K, 6 super-blocks = 1536 columns) and group8 (the 32-value
// types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, 20 blocks = 640 columns) from rows decoded as the matmul
// decodes them. Counter maddubs: vpmaddubsw-equivalents (32 products each) a second; over the
// core's clock, a cycle (the README's figures: 3.2 GHz). This file is
// compiled with the AVX2 target's flags and includes its kernel header, as
// src/model/matvec_int8_avx2.cpp does.
#define TREEATTN_INT8_DOT 0
#define TREEATTN_INT8_NS int8_avx2_bench
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

// The header's entry point (rows_int8_impl) is not called here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "model/matvec_int8_x86.hpp"
#pragma GCC diagnostic pop
#include "treeattn/kernel.hpp"

namespace {

using namespace treeattn::model::detail;
using namespace treeattn::model::detail::int8_avx2_bench;

bool have_avx2() { return treeattn::isa_supported(treeattn::Isa::kAvx2); }

// f16 2^-7 at byte offsets `at` of every block: finite, normal scales.
void set_scales(std::vector<uint8_t>& w, int block_bytes, std::initializer_list<int> at) {
  for (std::size_t b = 0; b < w.size(); b += static_cast<std::size_t>(block_bytes))
    for (const int o : at) {
      w[b + static_cast<std::size_t>(o)] = 0x00;
      w[b + static_cast<std::size_t>(o) + 1] = 0x20;
    }
}

template <uint32_t T>
void BM_Int8InnerK(benchmark::State& st) {
  if (!have_avx2()) {
    st.SkipWithError("CPU lacks AVX2");
    return;
  }
  constexpr int64_t kBlocks = 6;
  using CK = CodeK<T>;
  std::mt19937_64 rng(1);
  std::vector<uint8_t> w(4 * kBlocks * CK::kBytes);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  if constexpr (T == kTypeQ6_K) set_scales(w, CK::kBytes, {208});
  else set_scales(w, CK::kBytes, {0, 2});
  std::vector<uint8_t> dec(4 * kBlocks * kDecKBytes);
  for (int64_t rb = 0; rb < 4 * kBlocks; ++rb)
    decode_k<T>(&w[static_cast<std::size_t>(rb * CK::kBytes)],
                &dec[static_cast<std::size_t>(rb * kDecKBytes)]);
  std::vector<ActBlockK8> xt(kBlocks);
  for (auto& x : xt) {
    for (auto& q : x.q)
      for (auto& c : q) c = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    for (auto& d : x.d) d = 0.01f;
    for (auto& s : x.s16)
      for (auto& c : s) c = static_cast<int16_t>(static_cast<int>(rng() % 2001) - 1000);
    for (auto& s : x.s32)
      for (auto& c : s) c = static_cast<int16_t>(static_cast<int>(rng() % 4001) - 2000);
  }
  float y[32];
  for (auto _ : st) {
    groupk<T, 4, 1, NarrowLanes>(dec.data(), kBlocks, xt.data(), 8, y, 4, nullptr, 0);
    benchmark::DoNotOptimize(y);
    benchmark::ClobberMemory();
  }
  st.counters["maddubs"] = benchmark::Counter(
      static_cast<double>(kBlocks * 64 * 4) * static_cast<double>(st.iterations()),
      benchmark::Counter::kIsRate);
}

template <uint32_t T>
void BM_Int8Inner32(benchmark::State& st) {
  if (!have_avx2()) {
    st.SkipWithError("CPU lacks AVX2");
    return;
  }
  constexpr int64_t kBlocks = 20;
  using C = Code<T>;
  std::mt19937_64 rng(1);
  std::vector<uint8_t> w(4 * kBlocks * C::kBytes);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  if constexpr (C::kMin) set_scales(w, C::kBytes, {0, 2});
  else set_scales(w, C::kBytes, {0});
  std::vector<uint8_t> dec(4 * kBlocks * kGroupBytes);
  for (int64_t rb = 0; rb < 4 * kBlocks; ++rb) {
    Dec d;
    C::decode(&w[static_cast<std::size_t>(rb * C::kBytes)], d);
    store_dec(&dec[static_cast<std::size_t>(rb * kGroupBytes)], d);
  }
  std::vector<ActBlock8> xt(kBlocks);
  for (auto& x : xt) {
    for (auto& q : x.q)
      for (auto& c : q) c = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    for (int t = 0; t < 8; ++t) {
      x.d[t] = 0.01f;
      x.s[t] = 0.5f;
      int32_t sum = 0;
      for (const auto& q : x.q)
        for (int i = 0; i < 4; ++i) sum += q[4 * t + i];
      x.sum[t] = sum;
    }
  }
  float y[32];
  for (auto _ : st) {
    group8<T, 4, 1>(dec.data(), kBlocks, xt.data(), 8, y, 4);
    benchmark::DoNotOptimize(y);
    benchmark::ClobberMemory();
  }
  st.counters["maddubs"] = benchmark::Counter(
      static_cast<double>(kBlocks * 8 * 4) * static_cast<double>(st.iterations()),
      benchmark::Counter::kIsRate);
}

BENCHMARK(BM_Int8InnerK<kTypeQ4_K>)->Name("BM_Int8InnerAvx2/q4_K");
BENCHMARK(BM_Int8InnerK<kTypeQ5_K>)->Name("BM_Int8InnerAvx2/q5_K");
BENCHMARK(BM_Int8InnerK<kTypeQ6_K>)->Name("BM_Int8InnerAvx2/q6_K");
BENCHMARK(BM_Int8Inner32<kTypeQ4_0>)->Name("BM_Int8InnerAvx2/q4_0");
BENCHMARK(BM_Int8Inner32<kTypeQ4_1>)->Name("BM_Int8InnerAvx2/q4_1");
BENCHMARK(BM_Int8Inner32<kTypeQ5_0>)->Name("BM_Int8InnerAvx2/q5_0");
BENCHMARK(BM_Int8Inner32<kTypeQ5_1>)->Name("BM_Int8InnerAvx2/q5_1");
BENCHMARK(BM_Int8Inner32<kTypeQ8_0>)->Name("BM_Int8InnerAvx2/q8_0");

}  // namespace
