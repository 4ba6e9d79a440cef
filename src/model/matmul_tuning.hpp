// The matrix kernels' tuned choice (tuning.hpp, MatmulTuneEntry): the token tile of matmul calls
// on 8-bit activations of K-quant weights. Internal to the model library; the calibration
// (matmul_tuning.cpp) and the tests force candidates with it.
#pragma once

#include <cstdint>

#include "treeattn/kernel.hpp"

namespace treeattn::model::detail {

// The compiled-in tile: 512 KiB of activation codes (half of Zen 4's L2 per core; see
// matvec.cpp).
inline constexpr int64_t kTileBytes = 512 * 1024;

// The tile bytes a call of `threads` threads on target `isa` uses: the forced value when set,
// else the cache's entry for that target (tuned_matmul_tile_bytes), else kTileBytes.
int64_t matmul_tile_bytes(int threads, Isa isa);

// While > 0, every matmul call uses this many tile bytes (the calibration's candidates, the
// tests); 0 clears it. Only while no matmul runs elsewhere.
void force_matmul_tile_bytes(int64_t bytes);

}  // namespace treeattn::model::detail
