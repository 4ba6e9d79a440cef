// The strategy registries, the analytic cost model, tree helpers and workload determinism.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "strategies/common.hpp"
#include "treeattn/workload.hpp"

namespace treeattn {
namespace {

TEST(Registry, HostBackendOffersEveryStrategy) {
  const auto& reg = StrategyRegistry::for_backend(CommCapabilities{});
  std::vector<std::string> names;
  for (const StrategyInfo& i : reg.list()) names.emplace_back(i.name);
  EXPECT_EQ(names, (std::vector<std::string>{"tree", "tree-paper", "tree2", "hier", "ring-kv",
                                             "ring-state", "allgather", "gather-root", "single"}));
  for (const std::string& n : names) {
    auto s = reg.create(n, {});
    ASSERT_TRUE(s.is_ok()) << n;
    EXPECT_EQ((*s)->name(), n);
  }
  auto bad = reg.create("butterfly", {});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("unknown strategy 'butterfly' (known: tree, tree-paper"),
            std::string::npos)
      << bad.status().message();
}

TEST(Registry, BackendWithoutUserReductionsMapsTreeToAllgather) {
  CommCapabilities nccl_like;
  nccl_like.memory = MemorySpace::kDevice;
  nccl_like.user_reductions = false;
  const auto& reg = StrategyRegistry::for_backend(nccl_like);
  EXPECT_FALSE(reg.contains("hier"));
  ASSERT_TRUE(reg.contains("tree"));
  bool described = false;
  for (const StrategyInfo& i : reg.list())
    if (i.name == "tree")
      described = std::string(i.summary).find("all-gather") != std::string::npos;
  EXPECT_TRUE(described);
}

TEST(BinomialTree, EveryRankButTheRootHasExactlyOneParent) {
  for (int n = 1; n <= 33; ++n) {
    std::multiset<int> children;
    for (int i = 0; i < n; ++i)
      for (int c : strategies::binomial_children(i, n)) {
        EXPECT_GT(c, i);
        children.insert(c);
      }
    ASSERT_EQ(static_cast<int>(children.size()), n - 1) << "n=" << n;
    for (int i = 1; i < n; ++i) EXPECT_EQ(children.count(i), 1u) << "n=" << n << " rank " << i;
  }
}

TEST(AnalyticCost, MatchesThePaperFormulas) {
  const AttnShape shape{1, 32, 8, 128, 1};
  const double S = 32.0 * 130 * 4;  // state records of one step
  auto plan = ShardPlan::make(ShardKind::kEven, 4, {4000});
  ASSERT_TRUE(plan.is_ok());
  auto tree = analytic_cost("tree", shape, DType::kBF16, *plan, 1);
  ASSERT_TRUE(tree.is_ok());
  EXPECT_DOUBLE_EQ(tree->bytes_sent, 2.0 * 3 / 4 * S);
  const double kv = 1000.0 * 2 * 8 * 128 * 2;  // 1000 tokens of K and V, bf16
  EXPECT_DOUBLE_EQ(tree->working_set_bytes, kv + 32.0 * 128 * 4 + S);
  auto ring = analytic_cost("ring-kv", shape, DType::kBF16, *plan, 2);
  ASSERT_TRUE(ring.is_ok());
  EXPECT_DOUBLE_EQ(ring->bytes_sent, 3 * kv + 3 * 4 * 8.0);
  EXPECT_DOUBLE_EQ(ring->working_set_bytes, kv + 32.0 * 128 * 4 + S + 2 * kv + 4 * S);
  auto rs = analytic_cost("ring-state", shape, DType::kBF16, *plan, 0);
  EXPECT_DOUBLE_EQ(rs->bytes_sent, 3 * S);
  auto one = ShardPlan::make(ShardKind::kEven, 1, {4000});
  for (const char* n :
       {"tree", "tree-paper", "tree2", "hier", "ring-state", "allgather", "gather-root"})
    EXPECT_EQ(analytic_cost(n, shape, DType::kBF16, *one, 0)->bytes_sent, 0.0) << n;
  EXPECT_FALSE(analytic_cost("butterfly", shape, DType::kBF16, *plan, 0).is_ok());
  EXPECT_FALSE(analytic_cost("tree", shape, DType::kBF16, *plan, 4).is_ok());
}

TEST(Workload, ValuesAreDeterministicAndSpreadOverTheRange) {
  double lo = 1, hi = -1, sum = 0;
  std::set<float> distinct;
  for (int64_t t = 0; t < 4096; ++t) {
    const float x = workload_uniform(5, WorkloadTensor::kKey, 0, 1, t, 3);
    ASSERT_EQ(x, workload_uniform(5, WorkloadTensor::kKey, 0, 1, t, 3));
    ASSERT_GE(x, -1.0f);
    ASSERT_LT(x, 1.0f);
    lo = std::min(lo, static_cast<double>(x));
    hi = std::max(hi, static_cast<double>(x));
    sum += x;
    distinct.insert(x);
  }
  EXPECT_LT(lo, -0.99);
  EXPECT_GT(hi, 0.99);
  EXPECT_LT(std::abs(sum / 4096), 0.05);
  EXPECT_GT(distinct.size(), 4000u);
  EXPECT_NE(workload_uniform(5, WorkloadTensor::kKey, 0, 1, 7, 3),
            workload_uniform(5, WorkloadTensor::kValue, 0, 1, 7, 3));
  EXPECT_NE(workload_uniform(5, WorkloadTensor::kKey, 0, 1, 7, 3),
            workload_uniform(6, WorkloadTensor::kKey, 0, 1, 7, 3));
}

TEST(Workload, TokensAreExactlyRepresentableInTheirDtype) {
  const AttnShape shape{1, 2, 2, 64, 1};
  for (DType dt : {DType::kF16, DType::kBF16}) {
    std::vector<float> k(128), v(128);
    make_token({shape, dt, 3, 1.0f}, 0, 11, k.data(), v.data());
    for (float x : k) {
      std::vector<uint32_t> w(1);  // room for any dtype
      store_from_float(w.data(), dt, 0, x);
      EXPECT_EQ(load_as_float(w.data(), dt, 0), x);
    }
  }
}

// make_token's vectorized generation (the AVX2 clone where the CPU has it) gives the scalar
// workload_uniform's values, rounded to the dtype, at every element; the first values are pinned
// so that a change of the generator shows (fixtures and the Python checks rebuild the same data).
TEST(Workload, TokensAreTheScalarValuesRoundedToTheirDtype) {
  const AttnShape shape{1, 3, 3, 80, 1};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8})
    for (int64_t pos : {0, 1, 4095, 1 << 20}) {
      std::vector<float> k(240), v(240);
      make_token({shape, dt, 9, 1.0f}, 2, pos, k.data(), v.data());
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t d = 0; d < 80; ++d) {
          float ek = workload_uniform(9, WorkloadTensor::kKey, 2, h, pos, d);
          float ev = workload_uniform(9, WorkloadTensor::kValue, 2, h, pos, d);
          if (dt == DType::kF16 || dt == DType::kBF16) {
            std::vector<uint32_t> w(2);
            store_from_float(w.data(), dt, 0, ek);
            store_from_float(w.data(), dt, 1, ev);
            ek = load_as_float(w.data(), dt, 0);
            ev = load_as_float(w.data(), dt, 1);
          }
          ASSERT_EQ(k[static_cast<std::size_t>(h * 80 + d)], ek) << dtype_name(dt) << " " << pos;
          ASSERT_EQ(v[static_cast<std::size_t>(h * 80 + d)], ev) << dtype_name(dt) << " " << pos;
        }
    }
  // Pinned: seed 5, key tensor, row 0, head 1, position 7, elements 0..2.
  EXPECT_EQ(workload_uniform(5, WorkloadTensor::kKey, 0, 1, 7, 0), -0x1.dfd794p-1f);
  EXPECT_EQ(workload_uniform(5, WorkloadTensor::kKey, 0, 1, 7, 1), 0x1.2bdeep-3f);
  EXPECT_EQ(workload_uniform(5, WorkloadTensor::kKey, 0, 1, 7, 2), 0x1.937d18p-1f);
}

}  // namespace
}  // namespace treeattn
