// The bit-neutral choices a CPU decode driver call runs with (tuning.hpp): the software prefetch
// leads and the item order. Internal to the kernels; used by the baseline-ISA drivers
// (cpu_kernels.cpp, tiled_kernels.cpp, paged_kernels.cpp) and the calibration, never by the
// per-ISA item kernels (which get plain numbers in their arguments).
#pragma once

#include <cstdint>

#include "kernels/cpu/item_order.hpp"
#include "treeattn/tuning.hpp"

namespace treeattn::kernels::cpu {

struct DriverChoice {
  int64_t tiled_prefetch = 0;  // bytes per stream ahead of the block read (0: none)
  int64_t paged_prefetch = 0;
  bool tiled_l2 = false;       // the tiled driver's prefetch into L2 (prefetcht1), else into L1
  bool paged_l2 = false;       // the same for the paged driver
  int64_t rows_prefetch = 0;   // bytes per stream; rows_prefetch_tokens() makes it tokens
  int rows_tokens = -1;        // TREEATTN_PREFETCH_TOKENS (>= 0) when it overrides rows_prefetch
  ItemOrder order = ItemOrder::kHeadsOuter;  // for layouts whose heads are outer in memory

  // The rows kernel's lead in tokens for rows of row_bytes bytes: rows_tokens when set, else
  // rows_prefetch rounded up to whole rows (0 stays 0).
  int rows_prefetch_tokens(int64_t row_bytes) const {
    if (rows_tokens >= 0) return rows_tokens;
    return static_cast<int>((rows_prefetch + row_bytes - 1) / row_bytes);
  }
};

// For a call of this dtype, head dim, group and thread count on `isa`, in order of precedence:
//   1. the choice a calibration forces (force_driver_choice);
//   2. the environment's and the benchmarks' overrides: TiledTuning::prefetch_bytes >= 0
//      (TREEATTN_TILED_PREFETCH_BYTES, set_tiled_tuning) for the tiled and paged leads,
//      TREEATTN_PREFETCH_TOKENS for the rows lead (rows_tokens, read once; 0 disables);
//   3. the cache's entry for the call (tuned_choice: the nearest entry, or the defaults).
DriverChoice driver_choice(DType dtype, int64_t head_dim, int64_t group, int threads, Isa isa);

// While set (not null), every driver call runs with this choice, whatever the cache and the
// overrides say: the calibration's candidates. Only while no kernel call runs elsewhere.
void force_driver_choice(const TuneChoice* choice);

}  // namespace treeattn::kernels::cpu
