// Shard plans, the rank-local shard and appends: every position has exactly one owner and one
// slot under every kind, rank count and length; appends route tokens to the owning rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "treeattn/kv_tiles.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/workload.hpp"

namespace treeattn {
namespace {

const ShardKind kAllKinds[] = {ShardKind::kEven, ShardKind::kUneven, ShardKind::kStriped,
                               ShardKind::kExplicit, ShardKind::kSingle};

std::vector<int64_t> explicit_lengths(int p, int64_t n) {
  // Alternating empty ranks, the remainder on the last rank.
  std::vector<int64_t> v(static_cast<std::size_t>(p), 0);
  int64_t left = n;
  for (int r = 1; r < p; r += 2) {
    v[static_cast<std::size_t>(r)] = n / p;
    left -= n / p;
  }
  v.back() += left;
  return v;
}

Result<ShardPlan> plan_for(ShardKind k, int p, std::vector<int64_t> n) {
  if (k == ShardKind::kExplicit) {
    if (n.size() != 1) {
      // [rank][batch] lengths, one row split per rank.
      std::vector<int64_t> e(static_cast<std::size_t>(p) * n.size(), 0);
      for (std::size_t b = 0; b < n.size(); ++b) {
        auto row = explicit_lengths(p, n[b]);
        for (int r = 0; r < p; ++r)
          e[static_cast<std::size_t>(r) * n.size() + b] = row[static_cast<std::size_t>(r)];
      }
      return ShardPlan::make(k, p, std::move(n), e);
    }
    auto e = explicit_lengths(p, n[0]);
    return ShardPlan::make(k, p, std::move(n), e);
  }
  return ShardPlan::make(k, p, std::move(n), {}, p - 1);
}

// Every global position of every row is held by exactly one (rank, slot), and owner() agrees.
void expect_partition(const ShardPlan& plan) {
  for (int64_t b = 0; b < plan.batch(); ++b) {
    std::vector<int> seen(static_cast<std::size_t>(plan.total_len(b)), 0);
    for (int r = 0; r < plan.ranks(); ++r)
      for (int64_t j = 0; j < plan.len(r, b); ++j) {
        const int64_t pos = plan.pos_start(r, b) + j * plan.pos_stride();
        ASSERT_GE(pos, 0);
        ASSERT_LT(pos, plan.total_len(b)) << plan.to_string() << " rank " << r;
        seen[static_cast<std::size_t>(pos)] += 1;
        EXPECT_EQ(plan.owner(b, pos), r) << plan.to_string() << " pos " << pos;
      }
    for (std::size_t t = 0; t < seen.size(); ++t)
      ASSERT_EQ(seen[t], 1) << plan.to_string() << " row " << b << " position " << t;
  }
}

TEST(ShardPlan, EveryKindPartitionsEveryPosition) {
  for (ShardKind k : kAllKinds)
    for (int p = 1; p <= 9; ++p)
      for (int64_t n : {0, 1, 2, 3, 7, 16, 17, 41}) {
        auto plan = plan_for(k, p, {n, n / 2 + 1, 0});
        ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
        expect_partition(*plan);
      }
}

TEST(ShardPlan, EvenSplitsBalanced) {
  auto plan = ShardPlan::make(ShardKind::kEven, 4, {10});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(std::vector<int64_t>(plan->lens(0).begin(), plan->lens(0).end()),
            std::vector<int64_t>{3});
  const int64_t want_len[] = {3, 3, 2, 2}, want_start[] = {0, 3, 6, 8};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan->len(r, 0), want_len[r]);
    EXPECT_EQ(plan->pos_start(r, 0), want_start[r]);
  }
}

TEST(ShardPlan, UnevenGivesTheLastRankMost) {
  auto plan = ShardPlan::make(ShardKind::kUneven, 4, {100});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->len(0, 0), 10);
  EXPECT_EQ(plan->len(3, 0), 40);
}

TEST(ShardPlan, StripedPlacesTokenTOnRankTModP) {
  auto plan = ShardPlan::make(ShardKind::kStriped, 3, {8});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->pos_stride(), 3);
  for (int64_t t = 0; t < 8; ++t) EXPECT_EQ(plan->owner(0, t), static_cast<int>(t % 3));
  EXPECT_EQ(plan->len(0, 0), 3);
  EXPECT_EQ(plan->len(1, 0), 3);
  EXPECT_EQ(plan->len(2, 0), 2);
}

// One row on its own (a session's sequence): extend_row lays an empty row out as make() would,
// then grows it exactly as that many append_one() calls; clear_row and only_rows empty rows.
TEST(ShardPlan, ExtendRowIsAPrefillThenAppendsAndOnlyRowsKeepsTheListedRows) {
  for (ShardKind kind : {ShardKind::kEven, ShardKind::kUneven, ShardKind::kStriped})
    for (int ranks : {1, 3, 4}) {
      auto grown = ShardPlan::make(kind, ranks, {0, 5});
      ASSERT_TRUE(grown.is_ok());
      ASSERT_TRUE(grown->extend_row(0, 10).is_ok());
      ASSERT_TRUE(grown->extend_row(0, 7).is_ok());
      auto ref = ShardPlan::make(kind, ranks, {10});
      ASSERT_TRUE(ref.is_ok());
      for (int i = 0; i < 7; ++i) ref->append_one();
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(grown->len(r, 0), ref->len(r, 0)) << shard_kind_name(kind) << " rank " << r;
        EXPECT_EQ(grown->pos_start(r, 0), ref->pos_start(r, 0)) << shard_kind_name(kind);
      }
      EXPECT_EQ(grown->total_len(1), 5);  // the other row is untouched
      const std::vector<int64_t> keep = {1};
      const ShardPlan only = grown->only_rows(keep);
      EXPECT_EQ(only.total_len(0), 0);
      EXPECT_EQ(only.total_len(1), 5);
      for (int r = 0; r < ranks; ++r) EXPECT_EQ(only.len(r, 0), 0);
      grown->clear_row(0);
      EXPECT_EQ(grown->fingerprint(), only.fingerprint());
      EXPECT_FALSE(grown->extend_row(2, 1).is_ok());
      EXPECT_FALSE(grown->extend_row(0, -1).is_ok());
    }
}

TEST(ShardPlan, RejectsBadInputsWithMessages) {
  const int64_t bad_sum[] = {1, 2, 3};
  auto a = ShardPlan::make(ShardKind::kExplicit, 3, {7}, bad_sum);
  ASSERT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("sum to 6, but the row has 7 tokens"), std::string::npos)
      << a.status().message();
  const int64_t two[] = {3, 4};
  auto b = ShardPlan::make(ShardKind::kExplicit, 3, {7}, two);
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("got 2 values, expected 3"), std::string::npos);
  const int64_t neg[] = {8, -1};
  EXPECT_FALSE(ShardPlan::make(ShardKind::kExplicit, 2, {7}, neg).is_ok());
  EXPECT_FALSE(ShardPlan::make(ShardKind::kEven, 0, {7}).is_ok());
  EXPECT_FALSE(ShardPlan::make(ShardKind::kEven, 2, {-1}).is_ok());
  EXPECT_FALSE(ShardPlan::make(ShardKind::kSingle, 2, {7}, {}, 2).is_ok());
  EXPECT_FALSE(ShardPlan::make(ShardKind::kEven, 2, {7}, two).is_ok());
  EXPECT_FALSE(parse_shard_kind("diagonal").is_ok());
  EXPECT_EQ(parse_shard_kind("striped").value(), ShardKind::kStriped);
}

TEST(ShardPlan, AppendsKeepThePartitionAndStripedStaysBalanced) {
  for (ShardKind k : kAllKinds)
    for (int p : {1, 2, 3, 5}) {
      auto plan = plan_for(k, p, {11, 4});
      ASSERT_TRUE(plan.is_ok());
      for (int i = 0; i < 9; ++i) {
        const int owner0 = plan->append_owner(0);
        const int64_t before = plan->len(owner0, 0);
        plan->append_one();
        EXPECT_EQ(plan->len(owner0, 0), before + 1);
        expect_partition(*plan);
      }
      EXPECT_EQ(plan->total_len(0), 20);
      if (k == ShardKind::kStriped) {
        auto fresh = ShardPlan::make(ShardKind::kStriped, p, {20, 13});
        EXPECT_EQ(plan->fingerprint(), fresh->fingerprint());
      }
    }
}

TEST(ShardPlan, FingerprintSeesEveryLength) {
  auto a = ShardPlan::make(ShardKind::kEven, 3, {10});
  auto b = ShardPlan::make(ShardKind::kEven, 3, {10});
  auto c = ShardPlan::make(ShardKind::kUneven, 3, {10});
  auto d = ShardPlan::make(ShardKind::kEven, 3, {11});
  EXPECT_EQ(a->fingerprint(), b->fingerprint());
  EXPECT_NE(a->fingerprint(), c->fingerprint());
  EXPECT_NE(a->fingerprint(), d->fingerprint());
}

// Every slot of every rank's shard holds the workload token of its global position, also after
// appends that outgrow the shard's capacity.
TEST(LocalShard, HoldsItsTokensThroughAppendsAndGrowth) {
  const AttnShape shape{2, 4, 2, 64, 1};
  for (KVLayout layout : {KVLayout::kRows, KVLayout::kTiled})
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (ShardKind kind : {ShardKind::kEven, ShardKind::kStriped}) {
      const int p = 3;
      auto plan0 = ShardPlan::make(kind, p, {10, 5});
      ASSERT_TRUE(plan0.is_ok());
      const WorkloadSpec spec{shape, dt, 99, 1.0f};
      std::vector<ShardPlan> plans(p, *plan0);
      std::vector<LocalShard> shards;
      for (int r = 0; r < p; ++r) {
        auto s = LocalShard::create(shape, dt, *plan0, r, /*spare_tokens=*/0, nullptr, layout);
        ASSERT_TRUE(s.is_ok());
        ASSERT_EQ(s->layout(), layout);
        ASSERT_TRUE(fill_local_shard(spec, *plan0, *s).is_ok());
        shards.push_back(std::move(*s));
      }
      const std::size_t per_row = static_cast<std::size_t>(shape.kv_heads * shape.head_dim);
      std::vector<float> kn(2 * per_row), vn(2 * per_row);
      for (int step = 0; step < 7; ++step) {
        for (int64_t b = 0; b < 2; ++b)
          make_token(spec, b, plans[0].total_len(b), kn.data() + b * per_row,
                     vn.data() + b * per_row);
        for (int r = 0; r < p; ++r)
          ASSERT_TRUE(append_token(plans[static_cast<std::size_t>(r)],
                                   shards[static_cast<std::size_t>(r)], kn.data(), vn.data())
                          .is_ok());
      }
      std::vector<float> k(per_row), v(per_row);
      for (int r = 0; r < p; ++r) {
        const ShardPlan& plan = plans[static_cast<std::size_t>(r)];
        const KVShard view = shards[static_cast<std::size_t>(r)].view(plan);
        ASSERT_TRUE(view.validate(shape).is_ok());
        ASSERT_EQ(view.tiled != nullptr, layout == KVLayout::kTiled);
        ASSERT_TRUE(shards[static_cast<std::size_t>(r)].status().is_ok());
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t j = 0; j < plan.len(r, b); ++j) {
            const int64_t pos = plan.pos_start(r, b) + j * plan.pos_stride();
            make_token(spec, b, pos, k.data(), v.data());
            for (int64_t h = 0; h < shape.kv_heads; ++h)
              for (int64_t d = 0; d < shape.head_dim; ++d) {
                const auto idx = static_cast<std::size_t>(
                    b * view.stride_batch + h * view.stride_head + j * view.stride_token + d);
                const float gk = view.tiled ? tiled_element(*view.tiled, 64, false, b, h, j, d)
                                            : load_as_float(view.k, dt, idx);
                const float gv = view.tiled ? tiled_element(*view.tiled, 64, true, b, h, j, d)
                                            : load_as_float(view.v, dt, idx);
                ASSERT_EQ(gk, k[static_cast<std::size_t>(h * shape.head_dim + d)]);
                ASSERT_EQ(gv, v[static_cast<std::size_t>(h * shape.head_dim + d)]);
              }
          }
      }
    }
}

}  // namespace
}  // namespace treeattn
