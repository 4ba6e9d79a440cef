// The streaming loops of BM_StreamOverlap (bench/stream_overlap_avx2.cpp, compiled with AVX2 and
// FMA flags) and BM_StreamOverlapAvx512 (bench/stream_overlap_avx512.cpp, AVX-512F);
// bench_stream_overlap.cpp calls them after checking the CPU.
#pragma once

#include <cstdint>

namespace treeattn::bench {

// Reads n floats (n a multiple of 16) once, in order, with `fmas` FMAs (0, 8, 16 or 32) per
// 64-byte line into 8 independent accumulators, none of them waiting on memory except through
// the line's two loads; prefetch_bytes > 0: a prefetcht0 that far ahead for every line (reading
// up to that many bytes past the end, so the buffer must be that much longer). Returns their sum
// so that nothing is dropped.
float stream_with_fmas(const float* p, int64_t n, int fmas, int64_t prefetch_bytes);

// The same with 512-bit vectors: one zmm load per line and `fmas` (0, 8, 12 or 16) zmm FMAs,
// each into its own accumulator (at 2 FMAs a cycle none waits on its chain's latency); the
// prefetch is prefetcht1 (into L2, as the rows decode kernel's) when into_l2, else prefetcht0.
float stream_with_fmas_avx512(const float* p, int64_t n, int fmas, int64_t prefetch_bytes,
                              bool into_l2);

}  // namespace treeattn::bench
