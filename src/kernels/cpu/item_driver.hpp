// The work-item driver of the CPU decode kernels, shared by the caller's row layout
// (cpu_kernels.cpp) and the tiled layout (tiled_kernels.cpp); only how an item finds its K and V
// differs, and the caller supplies that.
//
// Work items are (batch row b, chunk c, KV head), chunk c of row b covering tokens
// [c * chunk, (c + 1) * chunk) of the tokens some query of the row can see (tokens past every
// query's causal limit are never read). Items run on OpenMP threads in the order the caller's
// layout stores them (ItemOrder) on a guided schedule: a thread takes runs of consecutive items,
// so that in the heads-outer order it reads one stream of memory rather than every other chunk
// of a head (which two threads read slower from DRAM), and the runs shrink toward the end, so
// that uneven items and a thread held up elsewhere still balance. Each item writes the states of
// its R = group * q_len rows into its own slot, and the slots are merged in chunk order with
// state_merge. The chunk size is an input, never derived from the thread count, and the slot of
// an item does not depend on the order or the schedule, so results are bitwise identical for any
// thread count and either order. Scratch memory is thread-local and grows only, so steady-state
// calls do not allocate.
//
// Internal to the kernels; compiled for the baseline ISA.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kernels/cpu/item_order.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/state.hpp"

namespace treeattn::kernels::cpu {

template <class T>
void grow(std::vector<T>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
}

// Tokens of a shard row that a query with causal limit `limit` sees: positions
// pos_start + t * stride <= limit.
inline int64_t visible_tokens(int64_t len, int64_t pos_start, int64_t pos_stride, int64_t limit) {
  if (limit < pos_start) return 0;
  const int64_t last = (limit - pos_start) / pos_stride;  // last visible token index
  return std::min(len, last + 1);
}

// What an item kernel gets from the driver: its row, KV head and token range, the R query rows
// (packed), how many of its tokens each row sees, a score scratch of the requested size, and
// the slot its R state records go to.
struct DriverItem {
  int64_t b = 0, kv_head = 0, t0 = 0, t1 = 0;
  const float* q = nullptr;
  const int64_t* visible = nullptr;
  float* scores = nullptr;
  float* out = nullptr;
};

// Runs run_item(const DriverItem&) for every item of the shard described by the placement
// spans, in `order`, and merges the slots into states ([batch][q_len][heads] records).
// score_floats: the scratch an item needs.
template <class RunItem>
void drive_items(const AttnShape& shape, const float* q, std::span<const int64_t> len,
                 std::span<const int64_t> pos_start, std::span<const int64_t> total_len,
                 int64_t pos_stride, int64_t chunk, std::size_t score_floats, int threads,
                 ItemOrder order, float* states, RunItem run_item) {
  const int64_t B = shape.batch, H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim;
  const int64_t Q = shape.q_len, G = shape.group();
  const int64_t R = G * Q;
  const std::size_t rec = static_cast<std::size_t>(D + 2);
  const std::size_t item_floats = static_cast<std::size_t>(R) * rec;

  // Per-call scratch owned by the calling thread: chunk prefix sums and chunk states.
  struct CallScratch {
    std::vector<int64_t> first_chunk, needed;
    std::vector<float> chunk_states;
  };
  thread_local CallScratch cs;
  grow(cs.first_chunk, static_cast<std::size_t>(B) + 1);
  grow(cs.needed, static_cast<std::size_t>(B));
  cs.first_chunk[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const auto ub = static_cast<std::size_t>(b);
    // The last query sees the most; tokens past its limit are never read.
    const int64_t need = visible_tokens(len[ub], pos_start[ub], pos_stride, total_len[ub] - 1);
    cs.needed[ub] = need;
    cs.first_chunk[ub + 1] = cs.first_chunk[ub] + (need + chunk - 1) / chunk;
  }
  const int64_t items = cs.first_chunk[static_cast<std::size_t>(B)] * Hkv;
  grow(cs.chunk_states, static_cast<std::size_t>(items) * item_floats);
  float* chunk_states = cs.chunk_states.data();
  const int64_t* first_chunk = cs.first_chunk.data();
  const int64_t* needed = cs.needed.data();

#pragma omp parallel for schedule(guided) num_threads(threads)
  for (int64_t n = 0; n < items; ++n) {
    const ItemCoords at = item_coords(n, first_chunk, B, Hkv, order);
    const int64_t b = at.b, kvh = at.kv_head, gchunk = at.gchunk;
    const int64_t item = gchunk * Hkv + kvh;  // its slot
    const auto ub = static_cast<std::size_t>(b);
    const int64_t t0 = (gchunk - first_chunk[ub]) * chunk;
    const int64_t t1 = std::min(needed[ub], t0 + chunk);

    // Per-thread scratch: query rows, visible counts and the item kernel's score block.
    struct ThreadScratch {
      std::vector<float> q, scores;
      std::vector<int64_t> visible;
    };
    thread_local ThreadScratch ts;
    grow(ts.q, static_cast<std::size_t>(R * D));
    grow(ts.visible, static_cast<std::size_t>(R));
    grow(ts.scores, score_floats);
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t vis = visible_tokens(len[ub], pos_start[ub], pos_stride, total_len[ub] - Q + i);
      const int64_t in_chunk = std::clamp<int64_t>(vis - t0, 0, t1 - t0);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        ts.visible[static_cast<std::size_t>(r)] = in_chunk;
        std::memcpy(ts.q.data() + r * D, q + ((b * Q + i) * H + kvh * G + g) * D,
                    static_cast<std::size_t>(D) * sizeof(float));
      }
    }
    run_item(DriverItem{b, kvh, t0, t1, ts.q.data(), ts.visible.data(), ts.scores.data(),
                        chunk_states + static_cast<std::size_t>(item) * item_floats});
  }

  // Merge the chunk states of each (b, kv head) in chunk order.
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t b = bh / Hkv, kvh = bh % Hkv;
    const auto ub = static_cast<std::size_t>(b);
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t g = 0; g < G; ++g) {
        float* dst = states + static_cast<std::size_t>((b * Q + i) * H + kvh * G + g) * rec;
        state_set_empty(dst, static_cast<std::size_t>(D));
        for (int64_t c = first_chunk[ub]; c < first_chunk[ub + 1]; ++c) {
          const float* src = chunk_states + static_cast<std::size_t>(c * Hkv + kvh) * item_floats +
                             static_cast<std::size_t>(i * G + g) * rec;
          state_merge(dst, src, static_cast<std::size_t>(D));
        }
      }
  }
}

}  // namespace treeattn::kernels::cpu
