// The order the CPU decode driver (item_driver.hpp) hands its work items to threads in, apart
// from the driver so that it can be tested without OpenMP.
//
// Internal to the kernels.
#pragma once

#include <algorithm>
#include <cstdint>

namespace treeattn::kernels::cpu {

// The order items are handed to threads in, within a batch row. kChunksOuter: chunk by chunk,
// the KV heads of a chunk one after another (a layout with heads inside a token, [T][Hkv][D]).
// kHeadsOuter: head by head, a head's chunks one after another, so consecutive items continue
// one stream of memory (a layout with a head's tokens together, as the tiled one, [Hkv][tiles]).
// With the driver's runs of consecutive items, kHeadsOuter has a thread read a run of one head's
// chunks front to back; the calibration (tuning.hpp) picks the order per call shape.
enum class ItemOrder { kChunksOuter, kHeadsOuter };

// Row b, KV head and global chunk index (the row's chunks numbered after those of rows < b) of
// item `item` in `order`; first_chunk[b] is the global index of row b's first chunk
// (first_chunk[B] = all chunks). The item's slot is gchunk * Hkv + kv_head in either order.
struct ItemCoords {
  int64_t b = 0, kv_head = 0, gchunk = 0;
};
inline ItemCoords item_coords(int64_t item, const int64_t* first_chunk, int64_t B, int64_t Hkv,
                              ItemOrder order) {
  // Row b owns items [first_chunk[b] * Hkv, first_chunk[b + 1] * Hkv).
  const int64_t b =
      std::upper_bound(first_chunk, first_chunk + B + 1, item / Hkv) - first_chunk - 1;
  const int64_t local = item - first_chunk[b] * Hkv;
  const int64_t chunks = first_chunk[b + 1] - first_chunk[b];
  if (order == ItemOrder::kHeadsOuter) return {b, local / chunks, first_chunk[b] + local % chunks};
  return {b, local % Hkv, first_chunk[b] + local / Hkv};
}

}  // namespace treeattn::kernels::cpu
