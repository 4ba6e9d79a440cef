// The engine's per-layer merge (src/engine/merge.hpp) over the in-process communicator: every
// kind equals the float64 merge of all ranks' states, every rank gets the same bits, and the
// tree and all-gather kinds give a record the same bits whatever the number of records merged
// with it (the batch invariance the engine relies on).
#include "engine/merge.hpp"

#include "engine/exchange.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/state.hpp"

namespace treeattn::engine {
namespace {

constexpr std::size_t kD = 8;
constexpr std::size_t kRec = kD + 2;

// Rank r's partial states: n records, some empty (the rank holds no visible token).
std::vector<float> rank_states(int rank, std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed * 131 + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> s(n * kRec);
  for (std::size_t i = 0; i < n; ++i) {
    float* rec = s.data() + i * kRec;
    if ((i + static_cast<std::size_t>(rank)) % 5 == 0) {
      state_set_empty(rec, kD);
      continue;
    }
    rec[0] = u(rng);
    rec[1] = 1.0f + std::fabs(u(rng));
    for (std::size_t d = 0; d < kD; ++d) rec[2 + d] = u(rng);
  }
  return s;
}

// Float64 merge of every rank's record i, normalized (o / l).
std::vector<double> oracle(int p, std::size_t n, uint64_t seed, std::size_t i) {
  std::vector<double> acc(kRec);
  acc[0] = -INFINITY;
  for (int r = 0; r < p; ++r) {
    const auto s = rank_states(r, n, seed);
    std::vector<double> x(s.begin() + static_cast<std::ptrdiff_t>(i * kRec),
                          s.begin() + static_cast<std::ptrdiff_t>((i + 1) * kRec));
    state_merge(acc.data(), x.data(), kD);
  }
  std::vector<double> out(kD);
  for (std::size_t d = 0; d < kD; ++d) out[d] = acc[0] == -INFINITY ? 0.0 : acc[2 + d] / acc[1];
  return out;
}

std::vector<std::vector<float>> run(int p, MergeKind kind, std::size_t n, uint64_t seed) {
  std::vector<std::vector<float>> out(static_cast<std::size_t>(p));
  const Status st = run_local(p, [&](Communicator& c) -> Status {
    c.set_timeout(std::chrono::milliseconds(20000));
    auto s = rank_states(c.rank(), n, seed);
    std::vector<float> scratch;
    TREEATTN_RETURN_IF_ERROR(merge_states(c, kind, s.data(), n, kD, scratch));
    out[static_cast<std::size_t>(c.rank())] = s;
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

TEST(EngineMerge, EveryKindMatchesTheFloat64MergeOnEveryRankAndRankCount) {
  for (const MergeKind kind : {MergeKind::kTree, MergeKind::kAllreduce, MergeKind::kAllgather})
    for (int p = 1; p <= 8; ++p) {
      const std::size_t n = 23;
      const auto got = run(p, kind, n, 5);
      for (int r = 1; r < p; ++r)
        EXPECT_EQ(std::memcmp(got[static_cast<std::size_t>(r)].data(), got[0].data(), n * kRec * 4), 0)
            << merge_name(kind) << " p " << p << " rank " << r << " differs from rank 0";
      for (std::size_t i = 0; i < n; ++i) {
        const auto ref = oracle(p, n, 5, i);
        std::vector<float> o(kD);
        state_normalize(got[0].data() + i * kRec, kD, o.data(), static_cast<float*>(nullptr));
        for (std::size_t d = 0; d < kD; ++d)
          EXPECT_NEAR(o[d], ref[d], 1e-5 * (1.0 + std::fabs(ref[d])))
              << merge_name(kind) << " p " << p << " record " << i;
      }
    }
}

TEST(EngineMerge, TreeAndAllgatherBitsOfARecordDoNotDependOnTheOtherRecords) {
  // Record i of a 1-record merge vs the same record inside a merge of many: same bits.
  for (const MergeKind kind : {MergeKind::kTree, MergeKind::kAllgather})
    for (int p : {2, 3, 4, 5, 7}) {
      const std::size_t n = 4000;  // large enough that an MPI allreduce would segment it
      const auto many = run(p, kind, n, 9);
      for (std::size_t i : {std::size_t{1}, std::size_t{1777}, std::size_t{3999}}) {
        std::vector<std::vector<float>> one(static_cast<std::size_t>(p));
        const Status st = run_local(p, [&](Communicator& c) -> Status {
          c.set_timeout(std::chrono::milliseconds(20000));
          const auto all = rank_states(c.rank(), n, 9);
          std::vector<float> s(all.begin() + static_cast<std::ptrdiff_t>(i * kRec),
                               all.begin() + static_cast<std::ptrdiff_t>((i + 1) * kRec));
          std::vector<float> scratch;
          TREEATTN_RETURN_IF_ERROR(merge_states(c, kind, s.data(), 1, kD, scratch));
          one[static_cast<std::size_t>(c.rank())] = s;
          return Status::ok();
        });
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        EXPECT_EQ(std::memcmp(one[0].data(), many[0].data() + i * kRec, kRec * 4), 0)
            << merge_name(kind) << " p " << p << " record " << i;
      }
    }
}

TEST(EngineMerge, LocalTwinGivesTheCollectivesBitsOnEveryRankCount) {
  for (const MergeKind kind : {MergeKind::kTree, MergeKind::kAllgather, MergeKind::kAllreduce})
    for (int p = 1; p <= 8; ++p) {
      const std::size_t n = 37;
      std::vector<std::vector<float>> parts;
      std::vector<const float*> ptr;
      for (int r = 0; r < p; ++r) parts.push_back(rank_states(r, n, 77));
      for (const auto& v : parts) ptr.push_back(v.data());
      std::vector<float> out(n * kRec), scratch;
      const Status st = merge_states_local(kind, p, ptr.data(), n, kD, out.data(), scratch);
      if (kind == MergeKind::kAllreduce && p > 2) {
        EXPECT_EQ(st.code(), Code::kUnsupported) << p;
        continue;
      }
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      const auto got = run(p, kind, n, 77);
      EXPECT_EQ(std::memcmp(out.data(), got[0].data(), n * kRec * 4), 0)
          << merge_name(kind) << " p " << p;
    }
}

TEST(EngineExchange, BytesAndTheCrossoverFollowTheWrittenFormula) {
  // SmolLM2-135M: 9 heads, 3 KV heads, head dim 64, f16 cache (768 B per token and layer).
  ExchangeShape s{2, 9, 3, 64, 768, MergeKind::kTree};
  // A 30-token question on a 16k-token document: pass-Q 30 x 4,296 B, K/V 30 x 768 + 16,384 x 384.
  auto b = exchange_bytes(s, 30, 16384);
  EXPECT_DOUBLE_EQ(b.pass_q, 30.0 * (1920 + 2376));
  EXPECT_DOUBLE_EQ(b.kv, 30.0 * 768 + 16384.0 * 384);
  EXPECT_FALSE(use_kv_exchange(ExchangePolicy::kAuto, s, 30, 16384));
  // The crossover at two ranks: K/V while C < 9.19 n.
  EXPECT_TRUE(use_kv_exchange(ExchangePolicy::kAuto, s, 256, 0));
  EXPECT_TRUE(use_kv_exchange(ExchangePolicy::kAuto, s, 256, 2351));
  EXPECT_FALSE(use_kv_exchange(ExchangePolicy::kAuto, s, 256, 2352)) << "a tie goes to pass-Q";
  EXPECT_FALSE(use_kv_exchange(ExchangePolicy::kAuto, s, 1, 10)) << "a decode row passes its query";
  // Forced policies, one rank, and the allreduce above two ranks.
  EXPECT_TRUE(use_kv_exchange(ExchangePolicy::kKV, s, 1, 100000));
  EXPECT_FALSE(use_kv_exchange(ExchangePolicy::kPassQ, s, 256, 0));
  ExchangeShape one = s;
  one.ranks = 1;
  EXPECT_FALSE(use_kv_exchange(ExchangePolicy::kKV, one, 256, 0));
  ExchangeShape ar = s;
  ar.ranks = 4;
  ar.merge = MergeKind::kAllreduce;
  EXPECT_FALSE(use_kv_exchange(ExchangePolicy::kAuto, ar, 256, 0));
  EXPECT_FALSE(check_exchange(ExchangePolicy::kKV, MergeKind::kAllreduce, 4).is_ok());
  EXPECT_TRUE(check_exchange(ExchangePolicy::kKV, MergeKind::kAllreduce, 2).is_ok());
  // The all-gather merge receives p - 1 copies of the records: pass-Q costs more, K/V longer.
  ExchangeShape ag = s;
  ag.ranks = 4;
  ag.merge = MergeKind::kAllgather;
  const auto g = exchange_bytes(ag, 10, 0);
  EXPECT_DOUBLE_EQ(g.pass_q, 10.0 * 3840 * 0.75 + 10.0 * 2376 * 3);
  EXPECT_FALSE(parse_exchange("both").is_ok());
  EXPECT_EQ(std::string(exchange_name(*parse_exchange("pass-q"))), "pass-q");
}

TEST(EngineMerge, UnknownKindIsRefusedByName) {
  auto k = parse_merge("ring");
  ASSERT_FALSE(k.is_ok());
  EXPECT_NE(k.status().message().find("tree, allreduce, allgather"), std::string::npos);
}

}  // namespace
}  // namespace treeattn::engine
