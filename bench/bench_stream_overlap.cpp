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

// A loop's benchmark. Args: FMAs per line, prefetch distance in bytes, then the buffer bytes at
// index bytes_arg; each thread reads its own buffer. read(p, n, fmas, pf) runs the loop once.
template <typename Read>
void run_stream(benchmark::State& st, Isa isa, const char* lacks, int bytes_arg, Read read) {
  if (!isa_supported(isa)) {
    st.SkipWithError(lacks);
    return;
  }
  const int fmas = static_cast<int>(st.range(0));
  const int64_t pf = st.range(1);
  const int64_t n = st.range(bytes_arg) / 4;
  const auto len = static_cast<std::size_t>(n + pf / 4);  // the prefetches' reach past the end
  std::unique_ptr<float[]> buf(new float[len]);
  for (std::size_t i = 0; i < len; ++i) buf[i] = 1e-9f * static_cast<float>(i & 1023);
  for (auto _ : st) benchmark::DoNotOptimize(read(buf.get(), n, fmas, pf));
  st.SetBytesProcessed(st.iterations() * n * 4);
}

void BM_StreamOverlap(benchmark::State& st) {
  run_stream(st, Isa::kAvx2, "CPU lacks AVX2", 2, bench::stream_with_fmas);
}

BENCHMARK(BM_StreamOverlap)
    ->ArgsProduct({{0, 8, 16, 32}, {0, 2048}, {int64_t{256} << 10, int64_t{512} << 20}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The decode kernel's question on AVX-512: args FMAs per line, prefetch distance, prefetch into
// L2 (prefetcht1, as the rows kernel) or L1 (prefetcht0), buffer bytes; zmm FMAs. For llama3-8b's
// shape (group 4, head dim 128) exact float arithmetic costs 8 zmm FMAs per line of 16-bit K/V
// (each of a line's 32 elements multiplied into 4 query rows) and 4 per line of f32: the best
// 8-FMA row from DRAM over the prefetch leads and hints against the 0-FMA row (the stream the
// roofline's probe reads) says how much of that arithmetic this CPU hides under its reads. The
// roofline's ceiling column runs the same kind of loop over the kernel's own pages.
//   build/<dir>/bench/treeattn_microbench --benchmark_filter=StreamOverlapAvx512
void BM_StreamOverlapAvx512(benchmark::State& st) {
  const bool into_l2 = st.range(2) != 0;
  run_stream(st, Isa::kAvx512, "CPU lacks AVX-512", 3,
             [into_l2](const float* p, int64_t n, int fmas, int64_t pf) {
               return bench::stream_with_fmas_avx512(p, n, fmas, pf, into_l2);
             });
}

// Without a prefetch the hint argument means nothing: only hint 0 is listed there.
void stream_overlap_avx512_args(benchmark::internal::Benchmark* b) {
  for (int64_t bytes : {int64_t{256} << 10, int64_t{512} << 20})
    for (int64_t fmas : {0, 8, 12, 16})
      for (int64_t pf : {0, 2048, 8192, 32768})
        for (int64_t into_l2 : {0, 1})
          if (pf > 0 || into_l2 == 0) b->Args({fmas, pf, into_l2, bytes});
}

BENCHMARK(BM_StreamOverlapAvx512)
    ->Apply(stream_overlap_avx512_args)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Threads(1)
    ->Threads(2);

}  // namespace
