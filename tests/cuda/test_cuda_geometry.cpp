// Host tests of the CUDA decode kernel's plain arithmetic (src/kernels/cuda/decode_geometry.hpp):
// the causal limit against a brute-force count, the block index codec and the merge tickets,
// lane roles and the shuffle partners the kernel uses, the 16-byte loads of every dtype (each
// element of an iteration's tokens loaded once), the token walk (every slot read exactly once, the
// unguarded main loop only below the slots every row sees), the 8-bit scales (each loaded by one
// lane of the token and shuffled from there), the 32-bit slot offsets and their bound, the logits'
// reduce-scatter (run on a simulated warp: one thread per lane, shuffles through a barrier), the
// query-row groups (every (query, head) served once), record indices, the split planner (whole
// waves), the launch bounds' register cap, the lifetime rule of the buffers CUDA graphs point at
// (graph_buffers.hpp) and the executor's cache of its own allocations (device_pointers.hpp).
// These run on any machine; the kernel itself is checked on a GPU (test_cuda_executor,
// tools/gpu-check.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda/decode_geometry.hpp"
#include "kernels/cuda/device_pointers.hpp"
#include "kernels/cuda/graph_buffers.hpp"
#include "treeattn/state_buffer.hpp"

namespace treeattn::gpu {
namespace {

constexpr DType kAllTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8};

TEST(CudaGeometry, VisibleCountMatchesTheCausalRuleSlotBySlot) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t stride = 1 + static_cast<int64_t>(rng() % 5);
    const int64_t total = static_cast<int64_t>(rng() % 60);
    const int64_t q_len = 1 + static_cast<int64_t>(rng() % 6);
    const int64_t pos0 = total ? static_cast<int64_t>(rng() % static_cast<uint64_t>(total)) : 0;
    const int64_t room = total > pos0 ? (total - 1 - pos0) / stride + 1 : 0;
    const int64_t len = room ? static_cast<int64_t>(rng() % static_cast<uint64_t>(room + 1)) : 0;
    for (int64_t i = 0; i < q_len; ++i) {
      int64_t brute = 0;
      for (int64_t j = 0; j < len; ++j)
        if (pos0 + j * stride <= total - q_len + i) brute = j + 1;  // a prefix: positions grow
      ASSERT_EQ(visible_count(len, pos0, total, stride, q_len, i), brute)
          << "len " << len << " pos0 " << pos0 << " stride " << stride << " N " << total << " Q "
          << q_len << " i " << i;
    }
  }
  // Q larger than the context: early queries see nothing.
  EXPECT_EQ(visible_count(3, 0, 3, 1, 5, 0), 0);
  EXPECT_EQ(visible_count(3, 0, 3, 1, 5, 2), 1);
  EXPECT_EQ(visible_count(3, 0, 3, 1, 5, 4), 3);
  EXPECT_EQ(visible_count(0, 0, 10, 1, 1, 0), 0);
}

TEST(CudaGeometry, BlockIndexCodecIsABijection) {
  for (uint32_t splits : {1u, 3u, 128u})
    for (uint32_t groups : {1u, 2u, 5u})
      for (uint32_t heads : {1u, 8u}) {
        const uint32_t rows = 7;
        std::set<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>> seen;
        std::map<uint32_t, std::set<uint32_t>> splits_of_ticket;
        const uint32_t blocks = splits * groups * heads * rows;
        for (uint32_t blk = 0; blk < blocks; ++blk) {
          const ItemIndex it = decode_item(blk, splits, groups, heads);
          ASSERT_LT(it.split, splits);
          ASSERT_LT(it.row_group, groups);
          ASSERT_LT(it.kv_head, heads);
          ASSERT_LT(it.batch_in_launch, rows);
          ASSERT_EQ(encode_item(it, splits, groups, heads), blk);
          // The row group is the fastest index: a split's row groups are neighbouring blocks.
          ASSERT_EQ(it.row_group, blk % groups);
          ASSERT_EQ(decode_item(blk - it.row_group, splits, groups, heads).split, it.split);
          seen.insert({it.split, it.row_group, it.kv_head, it.batch_in_launch});
          // The merge ticket: one counter per (row, head, row group), within the launch's count.
          const uint32_t tk = ticket_index(it, groups, heads);
          ASSERT_LT(static_cast<int64_t>(tk), tickets_per_launch(rows, heads, groups));
          ASSERT_TRUE(splits_of_ticket[tk].insert(it.split).second);
        }
        EXPECT_EQ(static_cast<uint32_t>(seen.size()), blocks);
        // Every counter is taken by exactly the item's splits, each once: the last of `splits`
        // tickets comes to exactly one block.
        EXPECT_EQ(static_cast<int64_t>(splits_of_ticket.size()),
                  tickets_per_launch(rows, heads, groups));
        for (const auto& [tk, ss] : splits_of_ticket) ASSERT_EQ(ss.size(), splits) << tk;
      }
  // The largest grid a launch may have still decodes in 32 bits.
  const uint32_t big = 0x7fffffffu;
  const ItemIndex it = decode_item(big, 1024, 1, 8);
  EXPECT_EQ(encode_item(it, 1024, 1, 8), big);
}

TEST(CudaGeometry, LaneGeometryOfTheCompiledHeadDims) {
  for (DType t : kAllTypes)
    for (int d : kCudaHeadDims) {
      ASSERT_TRUE(geometry_valid(t, d)) << dtype_name(t) << " " << d;
      const int lanes = lanes_per_token(t, d), tpw = tokens_per_warp(t, d);
      EXPECT_EQ(lanes * tpw, kWarpSize);
      EXPECT_EQ(lanes * vec_elems(t), d);
      EXPECT_EQ(token_groups(t, d), kDecodeWarps * tpw);
      // Every (token slot, element) of a warp has exactly one lane.
      std::map<std::pair<int, int>, int> owner;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const LaneRole r = lane_role(lane, t, d);
        ASSERT_LT(r.token_slot, tpw);
        for (int e = 0; e < vec_elems(t); ++e) {
          ASSERT_LT(r.dim0 + e, d);
          ASSERT_TRUE(owner.emplace(std::pair{r.token_slot, r.dim0 + e}, lane).second);
        }
        // The dot product's butterfly (xor offsets below lanes_per_token) stays inside the
        // token's lanes; the group merge (offsets lanes_per_token .. 16) pairs lanes holding the
        // same elements of other tokens.
        for (int off = lanes / 2; off > 0; off >>= 1)
          EXPECT_EQ(lane_role(lane ^ off, t, d).token_slot, r.token_slot);
        for (int off = lanes; off < kWarpSize; off <<= 1) {
          EXPECT_EQ(lane_role(lane ^ off, t, d).dim0, r.dim0);
          EXPECT_NE(lane_role(lane ^ off, t, d).token_slot, r.token_slot);
        }
      }
      EXPECT_EQ(static_cast<int>(owner.size()), tpw * d);
    }
  // The CUDA kernels exist for 64 and 128 only (the executor names them for other head dims).
  EXPECT_EQ(std::size(kCudaHeadDims), 2u);
  EXPECT_FALSE(geometry_valid(DType::kF32, 80));   // 20 lanes do not tile a warp
  EXPECT_FALSE(geometry_valid(DType::kBF16, 96));  // 12 lanes
  EXPECT_FALSE(geometry_valid(DType::kF32, 256));  // 64 lanes
}

// Every lane's 16 bytes of a token are 16-byte aligned, and over one iteration of a CTA (every
// warp, lane and unrolled load) each element of each token the iteration reads is loaded by
// exactly one lane's 16-byte vector, for every head dim and rows-per-block variant.
TEST(CudaGeometry, SixteenByteLoadsCoverEveryElementOnce) {
  for (DType t : kAllTypes)
    for (int d : kCudaHeadDims)
      for (int rows_tpl : {1, 2, 4, 8}) {
        if (rows_tpl > max_rows_per_cta(t)) continue;
        SCOPED_TRACE(std::string(dtype_name(t)) + " D=" + std::to_string(d) + " rows " +
                     std::to_string(rows_tpl));
        const int tpw = tokens_per_warp(t, d), ng = token_groups(t, d);
        const int u_count = unroll_tokens(rows_tpl), ve = vec_elems(t);
        // A view whose token stride is a multiple of the vector (the executor's rule), starting
        // at a slot other than 0.
        const int64_t stride = d + 2 * ve, first = 3;
        std::map<std::pair<int64_t, int>, int> loads;  // (slot, element) -> times loaded
        for (int warp = 0; warp < kDecodeWarps; ++warp)
          for (int lane = 0; lane < kWarpSize; ++lane) {
            const LaneRole r = lane_role(lane, t, d);
            for (int u = 0; u < u_count; ++u) {
              const int j = lane_slot(warp_first_slot(warp, tpw), r.token_slot, u, ng);
              const int64_t elem = kv_offset(0, 0, first + j, r.dim0, 0, 0, stride);
              ASSERT_EQ(elem * elem_bytes(t) % kVecBytes, 0) << "unaligned 16-byte load";
              for (int e = 0; e < ve; ++e) {
                ASSERT_LT(r.dim0 + e, d);
                ++loads[{j, r.dim0 + e}];
              }
            }
          }
        // Exactly the iteration's cta_slot_step slots, each element once.
        EXPECT_EQ(static_cast<int64_t>(loads.size()),
                  static_cast<int64_t>(cta_slot_step(ng, u_count)) * d);
        for (const auto& [where, count] : loads) {
          ASSERT_EQ(count, 1) << "slot " << where.first << " element " << where.second;
          ASSERT_LT(where.first, cta_slot_step(ng, u_count));
        }
      }
}

// Simulates decode_split_kernel's token walk for one item: the unguarded main loop (iterations
// whose slots every row sees, below n_main) and the guarded tail up to n1, counting how often each
// slot is read and checking that no unguarded load reaches n_main.
TEST(CudaGeometry, MainLoopAndTailReadEverySlotOnce) {
  for (DType t : kAllTypes)
    for (int d : kCudaHeadDims)
      for (int rows_tpl : {1, 2, 4, 8}) {
        if (rows_tpl > max_rows_per_cta(t)) continue;
        const int tpw = tokens_per_warp(t, d), ng = token_groups(t, d);
        const int u = unroll_tokens(rows_tpl);
        const int step = cta_slot_step(ng, u), span = warp_span(tpw, u, ng);
        for (int n1 : {0, 1, 7, 31, 32, 33, 64, 255, 1000, 1001, 65537})
          for (int lag : {0, 1, 3, 40}) {  // n1 - n_main: the rows that see fewer slots
            const int n_main = std::max(0, n1 - lag);
            std::vector<int> reads(static_cast<std::size_t>(n1), 0);
            int64_t unguarded = 0;
            for (int warp = 0; warp < kDecodeWarps; ++warp) {
              int wl = warp_first_slot(warp, tpw);
              for (; unguarded_iteration(wl, span, n_main); wl += step, ++unguarded)
                for (int slot = 0; slot < tpw; ++slot)
                  for (int k = 0; k < u; ++k) {
                    const int j = lane_slot(wl, slot, k, ng);
                    ASSERT_GE(j, wl);
                    ASSERT_LT(j, wl + span);
                    ASSERT_LT(j, n_main) << "an unguarded load past the slots every row sees";
                    ++reads[static_cast<std::size_t>(j)];
                  }
              for (; wl < n1; wl += step)  // the tail: guarded (j < n1)
                for (int slot = 0; slot < tpw; ++slot)
                  for (int k = 0; k < u; ++k) {
                    const int j = lane_slot(wl, slot, k, ng);
                    ASSERT_GE(j, 0);
                    if (j < n1) ++reads[static_cast<std::size_t>(j)];
                  }
            }
            for (int j = 0; j < n1; ++j)
              ASSERT_EQ(reads[static_cast<std::size_t>(j)], 1)
                  << dtype_name(t) << " D=" << d << " rows " << rows_tpl << " n1 " << n1
                  << " n_main " << n_main << " slot " << j;
            // Long splits run almost entirely unguarded: of the slots every row sees, at most one
            // CTA iteration's (step) are left to the tail. `unguarded` counts warp iterations,
            // each reading tpw * u slots.
            if (n_main >= 1000) {
              EXPECT_GE(unguarded * tpw * u, static_cast<int64_t>(n_main) - step)
                  << dtype_name(t) << " D=" << d << " rows " << rows_tpl << " n_main " << n_main;
            }
          }
      }
}

TEST(CudaGeometry, LocalLimitsClampToTheSplit) {
  EXPECT_EQ(local_limit(100, 0, 64), 64);
  EXPECT_EQ(local_limit(100, 64, 64), 36);
  EXPECT_EQ(local_limit(100, 128, 64), 0);  // the split starts past the limit
  EXPECT_EQ(local_limit(0, 0, 64), 0);
  // 64-bit positions far past 2^31 still give a local count inside the split.
  const int64_t big = int64_t{3} << 32;
  EXPECT_EQ(local_limit(big + 5, big, 4096), 5);
  EXPECT_EQ(local_limit(big * 2, big, 4096), 4096);
  EXPECT_EQ(local_limit(big - 1, big, 4096), 0);
}

// 32-bit slot offsets: the largest split the bound accepts has its last slot's offset in 32 bits,
// one slot more is refused; local slot arithmetic (a split plus two iterations' steps) stays in
// int32.
TEST(CudaGeometry, SlotOffsetsFitIn32Bits) {
  for (int64_t stride : {1, 64, 128, 144, 1024, 4096, 40960}) {
    SCOPED_TRACE("stride " + std::to_string(stride));
    const int64_t largest = std::min(kMaxSplitSlots, kMaxSlotOffset / stride + 1);
    ASSERT_TRUE(slot_offsets_fit(largest, stride));
    EXPECT_FALSE(slot_offsets_fit(largest + 1, stride));
    EXPECT_LE((largest - 1) * stride, kMaxSlotOffset);
    if (largest < kMaxSplitSlots) {
      EXPECT_GT(largest * stride, kMaxSlotOffset);  // one more slot would wrap
    }
    // The kernel's offset of the last slot is exact.
    const int j = static_cast<int>(largest - 1);
    EXPECT_EQ(static_cast<int64_t>(slot_offset(j, static_cast<uint32_t>(stride))),
              (largest - 1) * stride);
    EXPECT_TRUE(slot_offsets_fit(1, stride));
    EXPECT_FALSE(slot_offsets_fit(0, stride));
  }
  // Head dim 128 rows: 2^25 slots a split, 2^25 + 1 refused.
  EXPECT_TRUE(slot_offsets_fit(int64_t{1} << 25, 128));
  EXPECT_FALSE(slot_offsets_fit((int64_t{1} << 25) + 1, 128));
  // Scales (stride 1 float): up to kMaxSplitSlots.
  EXPECT_TRUE(slot_offsets_fit(kMaxSplitSlots, 1));
  EXPECT_FALSE(slot_offsets_fit(kMaxSplitSlots + 1, 1));
  EXPECT_TRUE(slot_offsets_fit(kMaxSplitSlots, 0));
  EXPECT_FALSE(slot_offsets_fit(16, -1));
  // max_split_slots is the largest chunk slot_offsets_fit accepts at each stride; a negative
  // stride (a shard without tokens, whose strides nothing checks) has none, without a division.
  for (int64_t stride :
       {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{64}, int64_t{128}, int64_t{144},
        int64_t{4096}, int64_t{40960}, int64_t{1} << 31, int64_t{1} << 40}) {
    const int64_t most = max_split_slots(stride);
    EXPECT_TRUE(slot_offsets_fit(most, stride)) << stride;
    EXPECT_FALSE(slot_offsets_fit(most + 1, stride)) << stride;
  }
  EXPECT_EQ(max_split_slots(64), int64_t{1} << 26);
  EXPECT_EQ(max_split_slots(int64_t{1} << 31), 2);
  EXPECT_EQ(max_split_slots(int64_t{1} << 40), 1);
  EXPECT_EQ(max_split_slots(-1), 0);
  EXPECT_EQ(max_split_slots(-64), 0);
  // A shard's bound: its K/V stride's, and the scales' too for 8-bit K/V only.
  EXPECT_EQ(max_split_slots(DType::kBF16, 64, int64_t{1} << 31), int64_t{1} << 26);
  EXPECT_EQ(max_split_slots(DType::kFP8, 64, int64_t{1} << 31), 2);
  EXPECT_EQ(max_split_slots(DType::kInt8, int64_t{1} << 31, 1), 2);
  EXPECT_EQ(max_split_slots(DType::kInt8, 128, 8), max_split_slots(128));
  // Local slots of the largest split, plus two iterations of the widest step, are int32.
  for (DType t : kAllTypes)
    for (int d : kCudaHeadDims)
      for (int rows : {1, 2, 4, 8})
        EXPECT_LT(kMaxSplitSlots + 2 * cta_slot_step(token_groups(t, d), unroll_tokens(rows)),
                  int64_t{1} << 31);
  // The split plan's default chunks at a million tokens fit with room to spare.
  const SplitPlan l = plan_decode(DType::kFP8, 1, 8, 4, 1, 1 << 20, 0);
  EXPECT_TRUE(slot_offsets_fit(l.chunk, 128));
  // The automatic plan keeps every split within the bound of a huge stride (max_chunk), with or
  // without a wave, splitting more finely than kMinSplitTokens and kMaxSplits where it must.
  for (int64_t stride : {int64_t{1} << 22, int64_t{3} << 24, int64_t{1} << 31, int64_t{1} << 33})
    for (int64_t vis : {1, 2, 3, 100, 4096, 1 << 20})
      for (int64_t wave : {0, 132 * 3}) {
        const int64_t most = max_split_slots(stride);
        const SplitPlan h = plan_decode(DType::kBF16, 1, 8, 4, 1, vis, 0, wave, most);
        SCOPED_TRACE("stride " + std::to_string(stride) + " vis " + std::to_string(vis));
        EXPECT_TRUE(slot_offsets_fit(h.chunk, stride)) << h.chunk;
        EXPECT_GE(h.splits * h.chunk, vis);
        EXPECT_LT((h.splits - 1) * h.chunk, vis);
        if (most >= kSplitAlign) {
          EXPECT_EQ(h.chunk % kSplitAlign, 0);
        }
      }
  // A stride whose bound is above the usual chunk leaves the plan as it is.
  for (int64_t wave : {0, 132 * 3}) {
    const SplitPlan a = plan_decode(DType::kBF16, 1, 8, 4, 1, 1 << 20, 0, wave);
    const SplitPlan b =
        plan_decode(DType::kBF16, 1, 8, 4, 1, 1 << 20, 0, wave, max_split_slots(128));
    EXPECT_EQ(a.chunk, b.chunk);
    EXPECT_EQ(a.splits, b.splits);
  }
}

// Each of a token group's 2U scales (K of every unrolled load, then V) is loaded by the one lane
// scale_lane in register scale_reg (lanes past 2U load copies from the same addresses), and every
// K scale is in register 0, where the kernel reads the K scale of a held value whose load index
// is known only at run time.
TEST(CudaGeometry, ScalesAreLoadedOncePerTokenGroup) {
  for (DType t : {DType::kFP8, DType::kInt8})
    for (int d : kCudaHeadDims)
      for (int rows : {1, 2, 4}) {
        const int lpt = lanes_per_token(t, d), u_count = unroll_tokens(rows);
        SCOPED_TRACE("D " + std::to_string(d) + " rows " + std::to_string(rows));
        ASSERT_TRUE(scales_valid(u_count, lpt));
        const int sl = scale_loads_per_lane(u_count, lpt);
        // The (lane, register) pairs that load each scale.
        std::map<int, std::set<std::pair<int, int>>> loaders;
        for (int lane = 0; lane < lpt; ++lane)
          for (int k = 0; k < sl; ++k) {
            const int s = scale_of_lane(lane, k, u_count, lpt);
            ASSERT_GE(s, 0);
            ASSERT_LT(s, 2 * u_count);
            loaders[s].insert({lane, k});
          }
        ASSERT_EQ(static_cast<int>(loaders.size()), 2 * u_count);  // every scale is loaded
        // lpt * sl loads for 2U scales: each scale by lpt * sl / 2U lanes, all at its address.
        for (const auto& [s, who] : loaders)
          ASSERT_EQ(static_cast<int>(who.size()), lpt * sl / (2 * u_count)) << "scale " << s;
        for (int u = 0; u < u_count; ++u) {
          for (int s : {k_scale_index(u), v_scale_index(u, u_count)}) {
            const std::pair<int, int> src{scale_lane(s, lpt), scale_reg(s, lpt)};
            ASSERT_LT(src.first, lpt);
            ASSERT_LT(src.second, sl);
            EXPECT_EQ(scale_of_lane(src.first, src.second, u_count, lpt), s);
            EXPECT_EQ(loaders[s].count(src), 1u);
          }
          EXPECT_EQ(scale_reg(k_scale_index(u), lpt), 0);
          EXPECT_NE(k_scale_index(u), v_scale_index(u, u_count));
        }
      }
  EXPECT_FALSE(scales_valid(8, 4));  // a K scale past register 0
  EXPECT_FALSE(scales_valid(3, 8));
}

// ---- the logits' reduce-scatter, on a simulated token group -----------------------------------

// LPT threads in lockstep: xor_fn(x, off) publishes x, waits for every lane, reads lane t ^ off.
template <int N, int LPT>
struct SimulatedTokenLanes {
  std::vector<float> board = std::vector<float>(LPT);
  std::barrier<> sync{LPT};
  std::vector<int> shuffles = std::vector<int>(LPT, 0);

  // Runs rs_reduce in every lane on in[lane][v]; returns the lanes' arrays afterwards.
  std::vector<std::vector<float>> run(const std::vector<std::vector<float>>& in) {
    std::vector<std::vector<float>> out(LPT, std::vector<float>(N));
    std::vector<std::thread> lanes;
    for (int t = 0; t < LPT; ++t)
      lanes.emplace_back([&, t] {
        float a[N];
        for (int v = 0; v < N; ++v)
          a[v] = in[static_cast<std::size_t>(t)][static_cast<std::size_t>(v)];
        rs_reduce<N, LPT>(a, t, [&](float x, int off) {
          board[static_cast<std::size_t>(t)] = x;
          ++shuffles[static_cast<std::size_t>(t)];
          sync.arrive_and_wait();
          const float r = board[static_cast<std::size_t>(t ^ off)];
          sync.arrive_and_wait();
          return r;
        });
        for (int v = 0; v < N; ++v)
          out[static_cast<std::size_t>(t)][static_cast<std::size_t>(v)] = a[v];
      });
    for (auto& th : lanes) th.join();
    return out;
  }
};

template <int U, int ROWS, int LPT>
void check_reduce_scatter() {
  constexpr int N = U * ROWS;
  constexpr int P = rs_per_lane(N, LPT), LV = rs_replicas(N, LPT), RL = rs_row_lanes(U, N, LPT);
  SCOPED_TRACE("U " + std::to_string(U) + " rows " + std::to_string(ROWS) + " LPT " +
               std::to_string(LPT));
  ASSERT_TRUE(rs_valid(U, ROWS, LPT));
  ASSERT_EQ(P * LPT, LV * N);  // every value's P-slot appears LV times over the lanes
  std::mt19937_64 rng(U * 1000 + ROWS * 100 + LPT);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<std::vector<float>> in(LPT, std::vector<float>(N));
    std::vector<double> want(N, 0.0);
    for (int t = 0; t < LPT; ++t)
      for (int v = 0; v < N; ++v) {
        const float x = dist(rng);
        in[static_cast<std::size_t>(t)][static_cast<std::size_t>(v)] = x;
        want[static_cast<std::size_t>(v)] += x;
      }
    SimulatedTokenLanes<N, LPT> sim;
    const auto out = sim.run(in);
    // Shuffles: N/2 + N/4 + ... down to one value, then one per remaining stage.
    int expect_shuffles = 0, k = N;
    for (int off = LPT / 2; off > 0; off >>= 1) {
      expect_shuffles += k > 1 ? k / 2 : 1;
      if (k > 1) k /= 2;
    }
    for (int t = 0; t < LPT; ++t)
      ASSERT_EQ(sim.shuffles[static_cast<std::size_t>(t)], expect_shuffles);
    std::map<int, std::vector<int>> holders;  // value -> lanes that hold it
    for (int t = 0; t < LPT; ++t)
      for (int i = 0; i < P; ++i) {
        const int v = rs_value(t, i, N, LPT);
        ASSERT_GE(v, 0);
        ASSERT_LT(v, N);
        const float got = out[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)];
        // The whole sum of the LPT partials (float sums in another order: within LPT ulps of
        // the largest partial sum's magnitude).
        ASSERT_NEAR(got, want[static_cast<std::size_t>(v)], 4.0 * LPT * 4.0 * 1.2e-7)
            << "lane " << t << " slot " << i << " value " << v;
        holders[v].push_back(t);
        // The lane's values are all of one row (the kernel keeps one running max per lane).
        ASSERT_EQ(value_row(v, U), value_row(rs_value(t, 0, N, LPT), U));
        // The value's first holder and its slot there.
        const int h = rs_holder(v, N, LPT);
        ASSERT_EQ(rs_value(h, rs_slot(v, N, LPT), N, LPT), v);
        ASSERT_LE(h, t);
      }
    ASSERT_EQ(static_cast<int>(holders.size()), N);  // every value is held somewhere
    for (const auto& [v, lanes] : holders) {
      ASSERT_EQ(static_cast<int>(lanes.size()), LV) << "value " << v;
      // Replicas agree to the bit (the kernel's lanes must agree on every max and weight).
      const int i = rs_slot(v, N, LPT);
      for (int t : lanes)
        ASSERT_EQ(std::memcmp(&out[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)],
                              &out[static_cast<std::size_t>(lanes[0])][static_cast<std::size_t>(i)],
                              sizeof(float)),
                  0);
    }
  }
  // A row's values lie in the RL lanes [r * RL, (r + 1) * RL): the kernel's row max (xor
  // offsets LV .. RL/2) stays inside them and reaches every value of the row.
  for (int r = 0; r < ROWS; ++r) {
    std::set<int> seen;
    for (int t = r * RL; t < (r + 1) * RL; ++t)
      for (int i = 0; i < P; ++i) {
        const int v = rs_value(t, i, N, LPT);
        ASSERT_EQ(value_row(v, U), r);
        seen.insert(value_load(v, U));
      }
    ASSERT_EQ(static_cast<int>(seen.size()), U);
    ASSERT_EQ(rs_holder(r * U, N, LPT), r * RL);  // where the kernel reads row r's max
    for (int t = r * RL; t < (r + 1) * RL; ++t) {
      std::set<int> reach{t};
      for (int off = LV; off < RL; off <<= 1) {
        std::set<int> next = reach;
        for (int x : reach) next.insert(x ^ off);
        reach = next;
      }
      for (int x : reach) ASSERT_EQ(x / RL, r);
      // With the replicas (offsets below LV, already equal) every lane of the row is reached.
      std::set<int> blocks;
      for (int x : reach) blocks.insert(x / LV);
      ASSERT_EQ(static_cast<int>(blocks.size()), RL / LV);
    }
  }
}

TEST(CudaGeometry, ReduceScatterLeavesEachLaneWholeLogits) {
  // Every (U, rows) of unroll_tokens and every lanes-per-token of the compiled instances.
  std::set<std::tuple<int, int, int>> instances;  // (U, rows, LPT)
  for (DType t : kAllTypes)
    for (int d : kCudaHeadDims) {
      const int lpt = lanes_per_token(t, d);
      EXPECT_TRUE(lpt == 4 || lpt == 8 || lpt == 16 || lpt == 32) << dtype_name(t) << " " << d;
      for (int rows : {1, 2, 4, 8}) {
        if (rows > max_rows_per_cta(t)) continue;
        EXPECT_TRUE(rs_valid(unroll_tokens(rows), rows, lpt));
        instances.insert({unroll_tokens(rows), rows, lpt});
      }
    }
  static_assert(unroll_tokens(1) == 4 && unroll_tokens(2) == 4 && unroll_tokens(4) == 4 &&
                unroll_tokens(8) == 2);
  // The instances checked below are all of them.
  const std::set<std::tuple<int, int, int>> checked{
      {4, 1, 4},  {4, 2, 4},  {4, 4, 4},  {4, 1, 8},  {4, 2, 8}, {4, 4, 8},  {4, 1, 16}, {4, 2, 16},
      {4, 4, 16}, {4, 1, 32}, {4, 2, 32}, {4, 4, 32}, {2, 8, 8}, {2, 8, 16}, {2, 8, 32}};
  for (const auto& i : instances) EXPECT_EQ(checked.count(i), 1u);
  check_reduce_scatter<4, 1, 4>();
  check_reduce_scatter<4, 2, 4>();
  check_reduce_scatter<4, 4, 4>();
  check_reduce_scatter<4, 1, 8>();
  check_reduce_scatter<4, 1, 16>();
  check_reduce_scatter<4, 1, 32>();
  check_reduce_scatter<4, 2, 8>();
  check_reduce_scatter<4, 2, 16>();
  check_reduce_scatter<4, 2, 32>();
  check_reduce_scatter<4, 4, 8>();
  check_reduce_scatter<4, 4, 16>();
  check_reduce_scatter<4, 4, 32>();
  check_reduce_scatter<2, 8, 8>();
  check_reduce_scatter<2, 8, 16>();
  check_reduce_scatter<2, 8, 32>();
  // The llama3 instance (bf16, D 128, 4 rows): 15 shuffles where an all-reduce takes 64.
  EXPECT_EQ(rs_per_lane(16, 16), 1);
  EXPECT_EQ(rs_replicas(16, 16), 1);
  EXPECT_FALSE(rs_valid(3, 4, 16));
  EXPECT_FALSE(rs_valid(2, 16, 8));  // 4 values per lane do not divide U = 2
}

TEST(CudaGeometry, LaunchBoundsRegisterCap) {
  for (DType t : kAllTypes)
    for (int rows : {1, 2, 4, 8}) {
      if (rows > max_rows_per_cta(t)) continue;
      const int blocks = min_blocks_per_sm(t, rows), cap = register_cap(t, rows);
      EXPECT_GE(blocks, 2);
      EXPECT_LE(static_cast<int64_t>(blocks) * kDecodeThreads * cap, 65536);
      EXPECT_LE(cap, 255);
      // Room for q and the accumulators (2 * rows * vec floats) and two sets of U 16-byte loads
      // of K and V (2 * 2 * U * 4), the figures decode_kernel.cuh records from ptxas.
      EXPECT_GE(cap, 2 * rows * vec_elems(t) + 16 * unroll_tokens(rows) + 32)
          << dtype_name(t) << " rows " << rows;
    }
  EXPECT_EQ(register_cap(DType::kBF16, 4), 170);
  EXPECT_EQ(register_cap(DType::kBF16, 8), 255);
  EXPECT_EQ(register_cap(DType::kFP8, 2), 170);
  EXPECT_EQ(register_cap(DType::kInt8, 4), 255);
}

TEST(CudaGeometry, RowGroupsServeEveryQueryHeadOnce) {
  for (DType t : kAllTypes)
    for (int64_t group : {1, 2, 3, 4, 7, 8, 16})
      for (int64_t q_len : {1, 2, 3, 5}) {
        const RowSplit rs = split_rows(t, group, q_len);
        EXPECT_EQ(rs.rows_total, group * q_len);
        EXPECT_TRUE(rs.rows_tpl == 1 || rs.rows_tpl == 2 || rs.rows_tpl == 4 || rs.rows_tpl == 8);
        EXPECT_LE(rs.rows_tpl, max_rows_per_cta(t));
        EXPECT_GE(rs.rows_tpl * rs.row_groups, rs.rows_total);
        EXPECT_LT(rs.rows_tpl * (rs.row_groups - 1), rs.rows_total);
        if (rs.rows_total <= max_rows_per_cta(t)) {
          EXPECT_EQ(rs.row_groups, 1);  // GQA: the KV head is read once for all its rows
        }
        for (int64_t kvh : {0, 3}) {
          std::set<std::pair<int64_t, int64_t>> seen;
          for (int64_t rg = 0; rg < rs.row_groups; ++rg)
            for (int r = 0; r < rs.rows_tpl; ++r) {
              const int64_t gr = rg * rs.rows_tpl + r;
              if (gr >= rs.rows_total) continue;
              const RowTarget tg = row_target(gr, group, kvh);
              ASSERT_LT(tg.query, q_len);
              ASSERT_GE(tg.head, kvh * group);
              ASSERT_LT(tg.head, (kvh + 1) * group);
              ASSERT_TRUE(seen.insert({tg.query, tg.head}).second);
            }
          EXPECT_EQ(static_cast<int64_t>(seen.size()), group * q_len);
        }
      }
}

TEST(CudaGeometry, RecordIndexIsStateBufferOrder) {
  const std::size_t B = 3, Q = 2, H = 5, D = 64;
  StateBuffer buf(B, Q, H, D);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t q = 0; q < Q; ++q)
      for (std::size_t h = 0; h < H; ++h)
        EXPECT_EQ(buf.record(b, q, h) - buf.data(),
                  record_index(static_cast<int64_t>(b), static_cast<int64_t>(q),
                               static_cast<int64_t>(h), Q, H) *
                      static_cast<int64_t>(D + 2));
}

TEST(CudaGeometry, KvOffsetUsesTheViewStrides) {
  // KVCache layout [batch][kv_heads][capacity][head_dim].
  const int64_t Hkv = 4, cap = 100, D = 128;
  const int64_t sb = Hkv * cap * D, sh = cap * D, st = D;
  EXPECT_EQ(kv_offset(2, 3, 17, 8, sb, sh, st), ((2 * Hkv + 3) * cap + 17) * D + 8);
  // A view that starts at slot 40 is the same offsets shifted by 40 * stride_token.
  EXPECT_EQ(kv_offset(1, 0, 5, 0, sb, sh, st) + 40 * st, kv_offset(1, 0, 45, 0, sb, sh, st));
}

TEST(CudaGeometry, SplitPlanCoversTheVisibleSlots) {
  for (int64_t batch : {1, 4, 16, 65, 200})
    for (int64_t kv_heads : {1, 8})
      for (int64_t group : {1, 4})
        for (int64_t q_len : {1, 3})
          for (int64_t vis : {0, 1, 63, 64, 257, 4096, 65536, 1 << 20, (1 << 20) + 3}) {
            const SplitPlan p = plan_decode(DType::kBF16, batch, kv_heads, group, q_len, vis, 0);
            ASSERT_GE(p.splits, 1);
            ASSERT_LE(p.splits, kMaxSplits);
            ASSERT_GE(p.chunk, 1);
            if (vis > 0) {
              EXPECT_GE(p.splits * p.chunk, vis);        // every visible slot has a split
              EXPECT_LT((p.splits - 1) * p.chunk, vis);  // and no split is empty everywhere
              EXPECT_EQ(p.chunk % kSplitAlign, 0);
              if (p.splits > 1) {
                EXPECT_GE(p.chunk, kMinSplitTokens);
              }
            }
            EXPECT_EQ(p.launches, (batch + kMaxBatchPerLaunch - 1) / kMaxBatchPerLaunch);
            EXPECT_EQ(p.blocks_per_batch_row, p.splits * p.rows.row_groups * kv_heads);
            // About the targeted number of blocks (kTargetCtas, or kMaxSplits splits, or splits
            // of kMinSplitTokens), less at most a quarter lost to the alignment of the split
            // length.
            const int64_t per_split = batch * kv_heads * p.rows.row_groups;
            const int64_t want = std::min({(kTargetCtas + per_split - 1) / per_split, kMaxSplits,
                                           std::max<int64_t>(1, vis / kMinSplitTokens)});
            EXPECT_GE(4 * p.splits, 3 * want) << "vis " << vis << " per split " << per_split;
            // The same inputs give the same plan (no device property enters it).
            const SplitPlan again =
                plan_decode(DType::kBF16, batch, kv_heads, group, q_len, vis, 0);
            EXPECT_EQ(again.chunk, p.chunk);
            EXPECT_EQ(again.splits, p.splits);
          }
  // A fixed chunk length.
  const SplitPlan f = plan_decode(DType::kBF16, 2, 8, 4, 1, 1000, 256);
  EXPECT_EQ(f.chunk, 256);
  EXPECT_EQ(f.splits, 4);
  // A fixed chunk of the visible slots or more is one split of exactly those slots (the kernel
  // reads no slot past them), so "one split" (a huge chunk_tokens) fits the 32-bit slot offsets.
  for (int64_t chunk : {int64_t{1000}, int64_t{1001}, (int64_t{1} << 26) + 1, int64_t{1} << 40}) {
    const SplitPlan one = plan_decode(DType::kBF16, 2, 8, 4, 1, 1000, chunk);
    EXPECT_EQ(one.chunk, 1000) << chunk;
    EXPECT_EQ(one.splits, 1) << chunk;
    EXPECT_TRUE(slot_offsets_fit(one.chunk, 64)) << chunk;
  }
  EXPECT_EQ(plan_decode(DType::kBF16, 2, 8, 4, 1, 1000, 999).splits, 2);
  // llama3-8b (8 KV heads, 4 query heads each), batch 1, 1M tokens: 256 splits of 4096 slots,
  // 2048 blocks of 4 rows.
  const SplitPlan l = plan_decode(DType::kBF16, 1, 8, 4, 1, 1 << 20, 0);
  EXPECT_EQ(l.rows.rows_tpl, 4);
  EXPECT_EQ(l.rows.row_groups, 1);
  EXPECT_EQ(l.splits, 256);
  EXPECT_EQ(l.chunk, 4096);
  EXPECT_EQ(l.blocks_per_batch_row, 2048);
  // Batch 16 at 64k tokens: 16 splits of 4096.
  const SplitPlan m = plan_decode(DType::kBF16, 16, 8, 4, 1, 65536, 0);
  EXPECT_EQ(m.splits, 16);
  EXPECT_EQ(m.chunk, 4096);
  // 8-bit K/V: at most 4 rows a block, so 8 query heads a KV head make two row groups (the
  // second reads the KV head's tokens from L2), and llama3-8b's 4 are one.
  const SplitPlan q8 = plan_decode(DType::kInt8, 1, 8, 8, 1, 1 << 20, 0);
  EXPECT_EQ(q8.rows.rows_tpl, 4);
  EXPECT_EQ(q8.rows.row_groups, 2);
  EXPECT_EQ(q8.blocks_per_batch_row, q8.splits * 2 * 8);
  EXPECT_EQ(plan_decode(DType::kFP8, 1, 8, 4, 1, 1 << 20, 0).rows.row_groups, 1);
  EXPECT_EQ(plan_decode(DType::kBF16, 1, 8, 8, 1, 1 << 20, 0).rows.row_groups, 1);
  EXPECT_EQ(plan_chunks(DType::kFP8, 1, 8, 4, 2, 1000, 256).rows.row_groups, 2);
}

TEST(CudaGeometry, SplitPlanFillsWholeWaves) {
  // Waves of 132 SMs x 2..4 resident blocks (H100 / H200), 108 SMs (A100), 142 (L40S).
  for (int64_t wave :
       {int64_t{132 * 3}, int64_t{132 * 4}, int64_t{132 * 2}, int64_t{108 * 3}, int64_t{142 * 3}})
    for (int64_t batch : {1, 2, 4, 16, 64, 200})
      for (int64_t kv_heads : {1, 8})
        for (int64_t group : {1, 4})
          for (int64_t vis : {0, 1, 300, 4096, 65536, 262144, 1 << 20, (1 << 20) + 3}) {
            const SplitPlan p = plan_decode(DType::kBF16, batch, kv_heads, group, 1, vis, 0, wave);
            ASSERT_GE(p.splits, 1);
            ASSERT_LE(p.splits, kMaxSplits);
            if (vis > 0) {
              EXPECT_GE(p.splits * p.chunk, vis);
              EXPECT_LT((p.splits - 1) * p.chunk, vis);
              EXPECT_EQ(p.chunk % kSplitAlign, 0);
              EXPECT_GE(p.chunk, kMinSplitTokens);
            }
            const int64_t nb = std::min(batch, int64_t{kMaxBatchPerLaunch});
            const int64_t blocks = nb * p.blocks_per_batch_row;
            const double fill = wave_fill(blocks, wave);
            // Never a worse last wave than the device-independent plan's...
            const SplitPlan old = plan_decode(DType::kBF16, batch, kv_heads, group, 1, vis, 0);
            EXPECT_GE(fill + 1e-9, wave_fill(nb * old.blocks_per_batch_row, wave))
                << "wave " << wave << " B " << batch << " Hkv " << kv_heads << " vis " << vis;
            // ...and, where the tokens allow kMaxWaves waves of splits, at least 0.85 of whole
            // waves (the 17%-full last wave cannot happen).
            const int64_t per = nb * kv_heads * p.rows.row_groups;
            if (vis / kMinSplitTokens >= kMaxWaves * wave / per && per <= wave) {
              EXPECT_GE(fill, 0.85) << "wave " << wave << " B " << batch << " Hkv " << kv_heads
                                    << " G " << group << " vis " << vis << " splits " << p.splits;
            }
            // The same inputs and wave give the same plan.
            const SplitPlan again =
                plan_decode(DType::kBF16, batch, kv_heads, group, 1, vis, 0, wave);
            EXPECT_EQ(again.chunk, p.chunk);
            // A fixed chunk length ignores the device.
            EXPECT_EQ(plan_decode(DType::kBF16, batch, kv_heads, group, 1, vis, 1000, wave).chunk,
                      vis > 0 ? std::min<int64_t>(vis, 1000) : 1);
          }
  // llama3-8b, batch 1, 1M tokens on 132 SMs x 3 blocks: 8 blocks per split index, so 49 splits
  // (1 wave: 392 of 396 slots) or more; the plan's last wave is at least 0.98 full.
  const SplitPlan l = plan_decode(DType::kBF16, 1, 8, 4, 1, 1 << 20, 0, 132 * 3);
  EXPECT_GE(wave_fill(l.blocks_per_batch_row, 132 * 3), 0.98);
  EXPECT_EQ(wave_fill(396, 396), 1.0);
  EXPECT_DOUBLE_EQ(wave_fill(397, 396), 397.0 / 792.0);
}

TEST(CudaGeometry, ChunkPlanCountsChunksByLength) {
  // partial_chunks: ceil(max len / chunk) chunks, as the CPU executor; a chunk past the longest
  // row is one split of the longest row's slots (split 0 starts at slot 0).
  for (int64_t len : {1, 255, 256, 257, 100000})
    for (int64_t chunk :
         {int64_t{1}, int64_t{256}, int64_t{1000}, (int64_t{1} << 26) + 1, int64_t{1} << 40}) {
      const SplitPlan p = plan_chunks(DType::kBF16, 3, 2, 2, 1, len, chunk);
      EXPECT_EQ(p.chunk, std::min(chunk, len));
      EXPECT_EQ(p.splits, (len + chunk - 1) / chunk);
      EXPECT_TRUE(slot_offsets_fit(p.chunk, 64) || len > max_split_slots(64));
    }
}

TEST(CudaGeometry, StateKernelLaneElements) {
  // One warp per record; lane l holds o[l + 32 k] for k < state_lane_elems.
  for (int64_t d = 1; d <= 256; ++d) {
    const int k = state_lane_elems(d);
    ASSERT_GT(k, 0);
    EXPECT_GE(k * kWarpSize, d);
    EXPECT_TRUE(k == 2 || k == 4 || k == 8);
  }
  EXPECT_EQ(state_lane_elems(257), 0);
  EXPECT_EQ(state_lane_elems(64), 2);
  EXPECT_EQ(state_lane_elems(128), 4);
}

// A stand-in for the executor's Buffer that records which allocations are still alive.
struct CountedBuffer {
  static inline std::set<int> alive;
  int id = 0;  // 0: empty
  CountedBuffer() = default;
  explicit CountedBuffer(int i) : id(i) { alive.insert(i); }
  CountedBuffer(CountedBuffer&& o) noexcept : id(std::exchange(o.id, 0)) {}
  CountedBuffer& operator=(CountedBuffer&& o) noexcept {
    if (this != &o) {
      if (id) alive.erase(id);
      id = std::exchange(o.id, 0);
    }
    return *this;
  }
  ~CountedBuffer() {
    if (id) alive.erase(id);
  }
  bool empty() const { return id == 0; }
};

TEST(CudaGeometry, GrownBuffersLiveWhileAGraphMayPointAtThem) {
  CountedBuffer::alive.clear();
  GraphBuffers<CountedBuffer> keep;
  CountedBuffer workspace, tickets;
  int next = 1;
  auto make = [&] { return Result<CountedBuffer>(CountedBuffer(next++)); };
  // No graph: the old buffer is freed before the new one is made (its memory may be needed).
  ASSERT_TRUE(keep.replace(workspace, make).is_ok());
  ASSERT_TRUE(keep.replace(tickets, make).is_ok());
  ASSERT_TRUE(keep.replace(workspace,
                           [&] {
                             EXPECT_EQ(CountedBuffer::alive.count(1), 0u) << "freed first";
                             return make();
                           })
                  .is_ok());
  EXPECT_EQ(workspace.id, 3);
  EXPECT_EQ(CountedBuffer::alive, (std::set<int>{2, 3}));
  // Two graphs captured with workspace 3 and tickets 2: growing keeps both old buffers.
  keep.graph_created();
  keep.graph_created();
  ASSERT_TRUE(keep.replace(workspace, make).is_ok());
  ASSERT_TRUE(keep.replace(tickets, make).is_ok());
  ASSERT_TRUE(keep.replace(workspace, make).is_ok());
  EXPECT_EQ(workspace.id, 6);
  EXPECT_EQ(tickets.id, 5);
  EXPECT_EQ(keep.retired(), 3u);
  EXPECT_EQ(CountedBuffer::alive, (std::set<int>{2, 3, 4, 5, 6}));
  // A failed make() leaves the slot as it was and retires nothing.
  const Status oom = keep.replace(
      workspace, [] { return Result<CountedBuffer>(Status(Code::kOutOfMemory, "no memory")); });
  EXPECT_EQ(oom.code(), Code::kOutOfMemory);
  EXPECT_EQ(workspace.id, 6);
  EXPECT_EQ(keep.retired(), 3u);
  // One graph gone, one left: still kept. The last gone: the retired ones are freed, the
  // current ones stay.
  keep.graph_destroyed();
  EXPECT_EQ(keep.retired(), 3u);
  keep.graph_destroyed();
  EXPECT_EQ(keep.retired(), 0u);
  EXPECT_EQ(CountedBuffer::alive, (std::set<int>{5, 6}));
  keep.graph_destroyed();  // more destructions than creations change nothing
  EXPECT_EQ(keep.graphs(), 0);
}

// The executor's own allocations (device_pointers.hpp): a pointer anywhere inside one is known
// without the driver, one past its end or before its start is not, and a freed one is gone.
TEST(CudaGeometry, OwnAllocationsAreKnownUntilFreed) {
  DevicePointers own;
  alignas(256) static unsigned char pool[4096];
  unsigned char* const a = pool + 16;    // [16, 1016)
  unsigned char* const b = pool + 1024;  // [1024, 3072)
  own.allocated(a, 1000);
  own.allocated(b, 2048);
  own.allocated(pool + 3500, 0);  // an empty allocation is nothing
  EXPECT_EQ(own.size(), 2u);
  EXPECT_TRUE(own.own(a));
  EXPECT_TRUE(own.own(a + 999));
  EXPECT_FALSE(own.own(a + 1000));  // one past the end
  EXPECT_FALSE(own.own(a + 1007));  // between the two
  EXPECT_TRUE(own.own(b));
  EXPECT_TRUE(own.own(b + 2047));
  EXPECT_FALSE(own.own(b + 2048));
  EXPECT_FALSE(own.own(pool + 3500));
  EXPECT_FALSE(own.own(pool + 15));  // before the first
  EXPECT_FALSE(own.own(nullptr));
  own.freed(a);
  EXPECT_FALSE(own.own(a));
  EXPECT_FALSE(own.own(a + 500));
  EXPECT_TRUE(own.own(b + 1));
  // The same address allocated again (the driver reuses it) is known again, with its new size.
  own.allocated(a, 16);
  EXPECT_TRUE(own.own(a + 15));
  EXPECT_FALSE(own.own(a + 16));
  own.freed(a);
  own.freed(b);
  own.freed(b);  // a second free changes nothing
  EXPECT_EQ(own.size(), 0u);
  EXPECT_FALSE(own.own(b));
}

// A stand-in for the executor's Buffer: made by "allocate", freed (and forgotten by the cache) on
// destruction, as Buffer calls the executor's release().
struct TrackedBuffer {
  static inline DevicePointers* cache = nullptr;
  unsigned char* data = nullptr;
  TrackedBuffer() = default;
  TrackedBuffer(unsigned char* p, std::size_t bytes) : data(p) { cache->allocated(p, bytes); }
  TrackedBuffer(TrackedBuffer&& o) noexcept : data(std::exchange(o.data, nullptr)) {}
  TrackedBuffer& operator=(TrackedBuffer&& o) noexcept {
    if (this != &o) {
      if (data) cache->freed(data);
      data = std::exchange(o.data, nullptr);
    }
    return *this;
  }
  ~TrackedBuffer() {
    if (data) cache->freed(data);
  }
  bool empty() const { return data == nullptr; }
};

// The buffer lifetime rule with the cache: a workspace that a live graph may point at stays
// known (and allocated) after it is replaced, until the last graph goes; then it is forgotten.
TEST(CudaGeometry, RetiredBuffersStayKnownWhileAGraphLives) {
  DevicePointers own;
  TrackedBuffer::cache = &own;
  alignas(256) static unsigned char pool[3 * 256];
  GraphBuffers<TrackedBuffer> keep;
  TrackedBuffer workspace;
  int next = 0;
  auto make = [&] { return Result<TrackedBuffer>(TrackedBuffer(pool + 256 * next++, 200)); };
  ASSERT_TRUE(keep.replace(workspace, make).is_ok());
  EXPECT_TRUE(own.own(pool + 10));
  keep.graph_created();  // a graph captured with workspace 0
  ASSERT_TRUE(keep.replace(workspace, make).is_ok());
  EXPECT_EQ(workspace.data, pool + 256);
  EXPECT_TRUE(own.own(pool + 10)) << "retired while a graph lives: still allocated, still known";
  EXPECT_TRUE(own.own(pool + 256 + 199));
  keep.graph_destroyed();  // freed now: the cache forgets it
  EXPECT_FALSE(own.own(pool + 10));
  EXPECT_TRUE(own.own(pool + 256));
  // No graph: the old buffer is freed (and forgotten) before the new one is made.
  ASSERT_TRUE(keep.replace(workspace,
                           [&] {
                             EXPECT_FALSE(own.own(pool + 256));
                             return make();
                           })
                  .is_ok());
  EXPECT_TRUE(own.own(pool + 512));
  workspace = TrackedBuffer();
  EXPECT_EQ(own.size(), 0u);
  TrackedBuffer::cache = nullptr;
}

}  // namespace
}  // namespace treeattn::gpu
