// The streaming loop of BM_StreamOverlap (bench/stream_overlap_avx2.cpp, compiled with AVX2 and
// FMA flags; bench_stream_overlap.cpp calls it after checking the CPU).
#pragma once

#include <cstdint>

namespace treeattn::bench {

// Reads n floats (n a multiple of 16) once, in order, with `fmas` FMAs (0, 8, 16 or 32) per
// 64-byte line into 8 independent accumulators, none of them waiting on memory except through
// the line's two loads; prefetch_bytes > 0: a prefetcht0 that far ahead for every line (reading
// up to that many bytes past the end, so the buffer must be that much longer). Returns their sum
// so that nothing is dropped.
float stream_with_fmas(const float* p, int64_t n, int fmas, int64_t prefetch_bytes);

}  // namespace treeattn::bench
