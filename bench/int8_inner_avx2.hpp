// The AVX2 target's batched integer kernels called alone (bench/int8_inner_avx2.cpp, compiled
// with that target's flags; BM_Int8InnerAvx2 in bench_int8_inner.cpp calls them). Plain
// functions, so that nothing built for AVX2 runs before the benchmark has checked the CPU.
#pragma once

#include <cstdint>

namespace treeattn::bench {

// The batched path's scratch bytes for 4 rows of `blocks` blocks (256 columns for the K types,
// 32 for the others) of a ggml type.
int64_t int8_inner_dec_bytes(uint32_t type, int64_t blocks);
// 4 rows (row r's blocks at rows + r * blocks * block_bytes) decoded into dec as the matmul
// decodes them. False for a type the batched kernels do not read.
bool int8_inner_decode(uint32_t type, const uint8_t* rows, int64_t blocks, uint8_t* dec);
// One call of the kernel: the 4 decoded rows against `groups` groups of 8 tokens (xt: `blocks`
// ActBlockK8 a group for the K types, ActBlock8 for the others), y[t * 4 + r]. groups: 1, or 2
// for the K types (the matmul's pass of two groups, groupk_pairs4 with two vectors).
void int8_inner_run(uint32_t type, const uint8_t* dec, int64_t blocks, const void* xt, float* y,
                    int groups);

}  // namespace treeattn::bench
