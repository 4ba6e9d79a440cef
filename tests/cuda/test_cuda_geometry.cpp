// Host tests of the CUDA decode kernel's plain arithmetic (src/kernels/cuda/decode_geometry.hpp):
// the causal limit against a brute-force count, the block index codec, lane roles and the
// shuffle partners the kernel uses, the token walk (every slot read exactly once), the query-row
// groups (every (query, head) served once), record indices, and the split planner. These run on
// any machine; the kernel itself is checked on a GPU (test_cuda_executor, tools/gpu-check.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/cuda/decode_geometry.hpp"
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
  for (int64_t splits : {1, 3, 128})
    for (int64_t groups : {1, 2, 5})
      for (int64_t heads : {1, 8}) {
        const int64_t rows = 7;
        std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> seen;
        const int64_t blocks = splits * groups * heads * rows;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const ItemIndex it = decode_item(blk, splits, groups, heads);
          ASSERT_LT(it.split, splits);
          ASSERT_LT(it.row_group, groups);
          ASSERT_LT(it.kv_head, heads);
          ASSERT_LT(it.batch_in_launch, rows);
          ASSERT_EQ(encode_item(it, splits, groups, heads), blk);
          seen.insert({it.split, it.row_group, it.kv_head, it.batch_in_launch});
        }
        EXPECT_EQ(static_cast<int64_t>(seen.size()), blocks);
      }
}

TEST(CudaGeometry, LaneGeometryOfTheCompiledHeadDims) {
  for (DType t : kAllTypes)
    for (int d : kCudaHeadDims) {
      ASSERT_TRUE(geometry_valid(t, d)) << dtype_name(t) << " " << d;
      const int lanes = lanes_per_token(t, d), tpw = tokens_per_warp(t, d);
      EXPECT_EQ(lanes * tpw, kWarpSize);
      EXPECT_EQ(lanes * vec_elems(t), d);
      EXPECT_LE(vec_bytes(t), 16);
      EXPECT_EQ(vec_bytes(t) % 8, 0);  // 8- or 16-byte loads
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

// Simulates the loops of decode_split_kernel's token walk for one item and counts how often each
// slot is read and whether a lane would read past t1.
TEST(CudaGeometry, TokenWalkReadsEverySlotOfTheSplitOnce) {
  for (DType t : kAllTypes)
    for (int d : kCudaHeadDims)
      for (int rows_tpl : {1, 2, 4, 8}) {
        const int tpw = tokens_per_warp(t, d), ng = token_groups(t, d), u = unroll_tokens(rows_tpl);
        for (int64_t t0 : {0, 5, 1000})
          for (int64_t n : {0, 1, 7, 31, 32, 33, 64, 255, 1001}) {
            const int64_t t1 = t0 + n;
            std::vector<int> reads(static_cast<std::size_t>(n), 0);
            for (int warp = 0; warp < kDecodeWarps; ++warp)
              for (int64_t w0 = warp_first_token(t0, warp, tpw); w0 < t1;
                   w0 += cta_token_step(ng, u))
                for (int slot = 0; slot < tpw; ++slot)
                  for (int k = 0; k < u; ++k) {
                    const int64_t j = lane_token(w0, slot, k, ng);
                    ASSERT_GE(j, t0);
                    if (j < t1) ++reads[static_cast<std::size_t>(j - t0)];
                  }
            for (int64_t j = 0; j < n; ++j)
              ASSERT_EQ(reads[static_cast<std::size_t>(j)], 1)
                  << dtype_name(t) << " D=" << d << " rows " << rows_tpl << " t0 " << t0 << " n "
                  << n << " slot " << j;
          }
      }
}

TEST(CudaGeometry, RowGroupsServeEveryQueryHeadOnce) {
  for (int64_t group : {1, 2, 3, 4, 7, 8, 16})
    for (int64_t q_len : {1, 2, 3, 5}) {
      const RowSplit rs = split_rows(group, q_len);
      EXPECT_EQ(rs.rows_total, group * q_len);
      EXPECT_TRUE(rs.rows_tpl == 1 || rs.rows_tpl == 2 || rs.rows_tpl == 4 || rs.rows_tpl == 8);
      EXPECT_LE(rs.rows_tpl, kMaxRowsPerCta);
      EXPECT_GE(rs.rows_tpl * rs.row_groups, rs.rows_total);
      EXPECT_LT(rs.rows_tpl * (rs.row_groups - 1), rs.rows_total);
      if (rs.rows_total <= kMaxRowsPerCta) {
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
            const SplitPlan p = plan_decode(batch, kv_heads, group, q_len, vis, 0);
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
            const SplitPlan again = plan_decode(batch, kv_heads, group, q_len, vis, 0);
            EXPECT_EQ(again.chunk, p.chunk);
            EXPECT_EQ(again.splits, p.splits);
          }
  // A fixed chunk length.
  const SplitPlan f = plan_decode(2, 8, 4, 1, 1000, 256);
  EXPECT_EQ(f.chunk, 256);
  EXPECT_EQ(f.splits, 4);
  // llama3-8b (8 KV heads, 4 query heads each), batch 1, 1M tokens: 256 splits of 4096 slots,
  // 2048 blocks of 4 rows.
  const SplitPlan l = plan_decode(1, 8, 4, 1, 1 << 20, 0);
  EXPECT_EQ(l.rows.rows_tpl, 4);
  EXPECT_EQ(l.rows.row_groups, 1);
  EXPECT_EQ(l.splits, 256);
  EXPECT_EQ(l.chunk, 4096);
  EXPECT_EQ(l.blocks_per_batch_row, 2048);
  // Batch 16 at 64k tokens: 16 splits of 4096.
  const SplitPlan m = plan_decode(16, 8, 4, 1, 65536, 0);
  EXPECT_EQ(m.splits, 16);
  EXPECT_EQ(m.chunk, 4096);
}

TEST(CudaGeometry, ChunkPlanCountsChunksByLength) {
  // partial_chunks: ceil(max len / chunk) chunks, as the CPU executor.
  for (int64_t len : {1, 255, 256, 257, 100000})
    for (int64_t chunk : {1, 256, 1000}) {
      const SplitPlan p = plan_chunks(3, 2, 2, 1, len, chunk);
      EXPECT_EQ(p.chunk, chunk);
      EXPECT_EQ(p.splits, (len + chunk - 1) / chunk);
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

}  // namespace
}  // namespace treeattn::gpu
