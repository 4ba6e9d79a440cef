// BM_StreamOverlap (part of treeattn_microbench): how much arithmetic one thread of this CPU hides
// under a sequential read from DRAM. A loop reads a buffer once with 0, 8, 16 or 32 FMAs per
// 64-byte line (8 independent chains, AVX2), with no software prefetch (the hardware prefetchers
// only) or a prefetcht0 2 KiB ahead (the decode kernel's default distance), from a 512 MiB buffer
// (DRAM) and from a 256 KiB one (L2: the arithmetic's own time). Where the DRAM rate equals the
// lower of the FMA-free DRAM rate and the L2 rate, compute and memory overlap fully; where it is
// their harmonic sum, they do not overlap at all. The decode kernel's question (docs/kernels.md,
// what limits each case): it does about 8 FMAs per line of f32 K/V and 16 per line of bf16, with more
// instructions between them than this loop.
//   build/<dir>/bench/treeattn_microbench --benchmark_filter=StreamOverlap
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>

#include "stream_overlap.hpp"
#include "treeattn/kernel.hpp"

namespace {

using namespace treeattn;

using StreamFn = float (*)(const float*, int64_t, int, int64_t);

// One loop's benchmark. args: FMAs per line, prefetch distance in bytes, buffer bytes; each
// thread reads its own buffer.
void run_stream(benchmark::State& st, Isa isa, const char* lacks, StreamFn fn) {
  if (!isa_supported(isa)) {
    st.SkipWithError(lacks);
    return;
  }
  const int fmas = static_cast<int>(st.range(0));
  const int64_t pf = st.range(1);
  const int64_t n = st.range(2) / 4;
  const auto len = static_cast<std::size_t>(n + pf / 4);  // the prefetches' reach past the end
  std::unique_ptr<float[]> buf(new float[len]);
  for (std::size_t i = 0; i < len; ++i) buf[i] = 1e-9f * static_cast<float>(i & 1023);
  for (auto _ : st) benchmark::DoNotOptimize(fn(buf.get(), n, fmas, pf));
  st.SetBytesProcessed(st.iterations() * n * 4);
}

void BM_StreamOverlap(benchmark::State& st) {
  run_stream(st, Isa::kAvx2, "CPU lacks AVX2", bench::stream_with_fmas);
}

BENCHMARK(BM_StreamOverlap)
    ->ArgsProduct({{0, 8, 16, 32}, {0, 2048}, {int64_t{256} << 10, int64_t{512} << 20}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The decode kernel's question on AVX-512 (args as above, zmm FMAs). For llama3-8b's shape
// (group 4, head dim 128) a 16-bit KV line costs the kernel 8 zmm FMAs at the floor (64 per token
// and KV head, 8 lines), and its measured in-cache rate (treeattn_roofline --seq 256) is
// about that of 12 FMAs a line of this loop in L2: the 12-FMA row from DRAM with an 8 KiB prefetch
// (12 KiB for 16-bit K/V in the kernel now) is what a loop with the kernel's arithmetic and no
// other structure reads; compare it with `treeattn bench --kernel`.
//   build/<dir>/bench/treeattn_microbench --benchmark_filter=StreamOverlapAvx512
void BM_StreamOverlapAvx512(benchmark::State& st) {
  run_stream(st, Isa::kAvx512, "CPU lacks AVX-512", bench::stream_with_fmas_avx512);
}

BENCHMARK(BM_StreamOverlapAvx512)
    ->ArgsProduct({{0, 8, 12, 16}, {0, 8192}, {int64_t{256} << 10, int64_t{512} << 20}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Threads(1)
    ->Threads(2);

}  // namespace
