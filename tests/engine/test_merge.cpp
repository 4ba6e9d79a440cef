// The engine's per-layer merge (src/engine/layer_merge.hpp: a strategy's merge stage) over the
// in-process communicator: every strategy that merges a batch of states equals the float64
// merge of all ranks' states with the same bits on every rank, gives the bits of the strategy's
// run() over real shards (one code path: the engine has no merge of its own), gives a record the
// same bits whatever the number of records merged with it where it says it is batch invariant,
// and its local twin gives the collective's bits. auto picks a batch-invariant merge; a name that cannot
// merge a batch, or a topology that does not fit the job, is refused on every rank.
#include "engine/layer_merge.hpp"

#include "engine/exchange.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/state.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/workload.hpp"

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

// Every rank merges its states through LayerMerge::create(method); returns each rank's records.
std::vector<std::vector<float>> run(int p, const std::string& method, std::size_t n,
                                    uint64_t seed, MergeChoice* choice = nullptr) {
  std::vector<std::vector<float>> out(static_cast<std::size_t>(p));
  const Status st = run_local(p, [&](Communicator& c) -> Status {
    c.set_timeout(std::chrono::milliseconds(20000));
    MergeRequest req;
    req.method = method;
    req.shape = AttnShape{4, 2, 1, static_cast<int>(kD), 1};
    auto lm = LayerMerge::create(c, req);
    TREEATTN_RETURN_IF_ERROR(lm.status());
    if (choice && c.rank() == 0) *choice = (*lm)->choice();
    auto s = rank_states(c.rank(), n, seed);
    TREEATTN_RETURN_IF_ERROR((*lm)->merge(s.data(), n));
    out[static_cast<std::size_t>(c.rank())] = s;
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << method << " p " << p << ": " << st.to_string();
  return out;
}

std::vector<std::string> methods() { return merge_methods(CommCapabilities{}); }

TEST(EngineMerge, TheMethodsAreTheStrategiesThatMergeStates) {
  const auto m = methods();
  for (const char* name : {"tree", "tree-paper", "tree2", "hier", "ring-state", "allgather",
                           "gather-root", "tree-det"})
    EXPECT_NE(std::find(m.begin(), m.end(), name), m.end()) << name;
  for (const char* name : {"ring-kv", "single", "allreduce"})
    EXPECT_EQ(std::find(m.begin(), m.end(), name), m.end()) << name;
}

TEST(EngineMerge, EveryMethodMatchesTheFloat64MergeOnEveryRankAndRankCount) {
  for (const std::string& method : methods())
    for (int p = 1; p <= 8; ++p) {
      const std::size_t n = 23;
      const auto got = run(p, method, n, 5);
      for (int r = 1; r < p; ++r)
        EXPECT_EQ(std::memcmp(got[static_cast<std::size_t>(r)].data(), got[0].data(), n * kRec * 4), 0)
            << method << " p " << p << " rank " << r << " differs from rank 0";
      for (std::size_t i = 0; i < n; ++i) {
        const auto ref = oracle(p, n, 5, i);
        std::vector<float> o(kD);
        state_normalize(got[0].data() + i * kRec, kD, o.data(), static_cast<float*>(nullptr));
        for (std::size_t d = 0; d < kD; ++d)
          EXPECT_NEAR(o[d], ref[d], 1e-5 * (1.0 + std::fabs(ref[d])))
              << method << " p " << p << " record " << i;
      }
    }
}

TEST(EngineMerge, RunIsTheLocalPartialThenTheEnginesMergeBitForBit) {
  // What `run`/`bench` time and what the server runs are one code path: a strategy's run() over
  // real shards gives the bits of the kernel's partial states merged by the engine's LayerMerge,
  // on every rank, at 1-4 ranks, uneven rows. tree-det is the exception by design: its run()
  // merges 256-token chunk leaves (rank-count invariant), its merge stage the ranks' partials.
  const AttnShape shape{2, 4, 2, 64, 1};
  const std::vector<int64_t> lens{300, 177};
  DecodeOptions kernel;
  kernel.threads = 1;
  for (const std::string& method : methods()) {
    if (method == deterministic_strategy()) continue;
    for (int p = 1; p <= 4; ++p) {
      auto plan = ShardPlan::make(ShardKind::kEven, p, lens);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      const std::size_t records = static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads);
      const std::size_t floats = records * (static_cast<std::size_t>(shape.head_dim) + 2);
      std::vector<std::vector<float>> ran(static_cast<std::size_t>(p)), served(ran.size());
      const Status st = run_local(p, [&](Communicator& c) -> Status {
        c.set_timeout(std::chrono::milliseconds(20000));
        const WorkloadSpec spec{shape, DType::kF32, 17, 1.0f};
        auto shard = LocalShard::create(shape, DType::kF32, *plan, c.rank(), 0);
        TREEATTN_RETURN_IF_ERROR(shard.status());
        TREEATTN_RETURN_IF_ERROR(fill_local_shard(spec, *plan, *shard));
        std::vector<float> q(records * static_cast<std::size_t>(shape.head_dim));
        make_query(spec, 0, q.data());
        const KVShard view = shard->view(*plan);
        StrategyOptions so;
        so.kernel = kernel;
        auto s = StrategyRegistry::for_backend(c.capabilities()).create(method, so);
        TREEATTN_RETURN_IF_ERROR(s.status());
        TREEATTN_RETURN_IF_ERROR((*s)->setup(c, shape, DType::kF32, *plan));
        auto& a = ran[static_cast<std::size_t>(c.rank())];
        a.resize(floats);
        TREEATTN_RETURN_IF_ERROR((*s)->run(q.data(), view, *plan, a.data()));
        auto& b = served[static_cast<std::size_t>(c.rank())];
        b.resize(floats);
        TREEATTN_RETURN_IF_ERROR(cpu_executor().partial(shape, q.data(), view, b.data(), kernel));
        MergeRequest req;
        req.method = method;
        req.shape = AttnShape{4, shape.heads, shape.kv_heads, shape.head_dim, 1};
        auto lm = LayerMerge::create(c, req);
        TREEATTN_RETURN_IF_ERROR(lm.status());
        return (*lm)->merge(b.data(), records);
      });
      ASSERT_TRUE(st.is_ok()) << method << " p " << p << ": " << st.to_string();
      for (int r = 0; r < p; ++r)
        EXPECT_EQ(std::memcmp(ran[static_cast<std::size_t>(r)].data(),
                              served[static_cast<std::size_t>(r)].data(), floats * 4),
                  0)
            << method << " p " << p << " rank " << r;
    }
  }
}

TEST(EngineMerge, ABatchInvariantMergeGivesARecordTheSameBitsAloneAndInABatch) {
  for (const std::string& method : methods())
    for (int p : {2, 3, 4, 5, 7}) {
      const std::size_t n = 4000;  // large enough that an MPI allreduce would segment it
      MergeChoice choice;
      const auto many = run(p, method, n, 9, &choice);
      // The in-process backend reduces in rank order: every merge is batch invariant there.
      EXPECT_TRUE(choice.batch_invariant) << method << " p " << p;
      for (std::size_t i : {std::size_t{1}, std::size_t{1777}, std::size_t{3999}}) {
        std::vector<std::vector<float>> one(static_cast<std::size_t>(p));
        const Status st = run_local(p, [&](Communicator& c) -> Status {
          c.set_timeout(std::chrono::milliseconds(20000));
          MergeRequest req;
          req.method = method;
          req.shape = AttnShape{4, 2, 1, static_cast<int>(kD), 1};
          auto lm = LayerMerge::create(c, req);
          TREEATTN_RETURN_IF_ERROR(lm.status());
          const auto all = rank_states(c.rank(), n, 9);
          std::vector<float> s(all.begin() + static_cast<std::ptrdiff_t>(i * kRec),
                               all.begin() + static_cast<std::ptrdiff_t>((i + 1) * kRec));
          TREEATTN_RETURN_IF_ERROR((*lm)->merge(s.data(), 1));
          one[static_cast<std::size_t>(c.rank())] = s;
          return Status::ok();
        });
        ASSERT_TRUE(st.is_ok()) << st.to_string();
        EXPECT_EQ(std::memcmp(one[0].data(), many[0].data() + i * kRec, kRec * 4), 0)
            << method << " p " << p << " record " << i;
      }
    }
}

TEST(EngineMerge, TheLocalTwinGivesTheCollectivesBitsOnEveryRankCount) {
  for (const std::string& method : methods())
    for (int p = 1; p <= 8; ++p) {
      const std::size_t n = 37;
      std::vector<std::vector<float>> parts;
      std::vector<const float*> ptr;
      for (int r = 0; r < p; ++r) parts.push_back(rank_states(r, n, 77));
      for (const auto& v : parts) ptr.push_back(v.data());
      std::vector<float> twin(n * kRec);
      MergeChoice choice;
      std::vector<std::vector<float>> got(static_cast<std::size_t>(p));
      const Status st = run_local(p, [&](Communicator& c) -> Status {
        c.set_timeout(std::chrono::milliseconds(20000));
        MergeRequest req;
        req.method = method;
        req.shape = AttnShape{4, 2, 1, static_cast<int>(kD), 1};
        auto lm = LayerMerge::create(c, req);
        TREEATTN_RETURN_IF_ERROR(lm.status());
        if (c.rank() == 0) {
          choice = (*lm)->choice();
          if (choice.local_twin) TREEATTN_RETURN_IF_ERROR((*lm)->merge_local(ptr.data(), p, n, twin.data()));
        }
        auto s = parts[static_cast<std::size_t>(c.rank())];
        TREEATTN_RETURN_IF_ERROR((*lm)->merge(s.data(), n));
        got[static_cast<std::size_t>(c.rank())] = s;
        return Status::ok();
      });
      ASSERT_TRUE(st.is_ok()) << method << ": " << st.to_string();
      // tree-paper and tree2 rescale into the sum form: no local twin.
      if (method == "tree-paper" || method == "tree2") {
        EXPECT_FALSE(choice.local_twin) << method;
        continue;
      }
      ASSERT_TRUE(choice.local_twin) << method << " p " << p;
      EXPECT_EQ(std::memcmp(twin.data(), got[0].data(), n * kRec * 4), 0) << method << " p " << p;
    }
}

TEST(EngineMerge, AutoChoosesABatchInvariantMergeAndRanksTheCandidates) {
  {
    MergeChoice one;
    run(1, "auto", 5, 3, &one);
    EXPECT_EQ(one.strategy, "tree");
    EXPECT_EQ(one.how, "auto: one rank, nothing to merge");
    EXPECT_TRUE(one.batch_invariant);
  }
  for (int p : {2, 3, 4}) {
    MergeChoice choice;
    run(p, "auto", 5, 3, &choice);
    EXPECT_TRUE(choice.batch_invariant) << p;
    EXPECT_NE(choice.strategy, "auto");
    EXPECT_EQ(choice.how.rfind("auto", 0), 0u) << choice.how;
    ASSERT_FALSE(choice.ranking.empty());
    for (const PlanEntry& e : choice.ranking) {
      EXPECT_NE(e.prediction.strategy, "ring-kv");
      EXPECT_NE(e.prediction.strategy, "single");
      EXPECT_GT(e.prediction.latency_us, 0.0);
    }
    EXPECT_NE(describe_merge(choice).find("predicted per layer"), std::string::npos);
  }
}

// Every rank gets the refusal, with rank 0's message.
void expect_refused(int p, const MergeRequest& req, const std::string& needle) {
  std::vector<std::string> messages(static_cast<std::size_t>(p));
  const Status st = run_local(p, [&](Communicator& c) -> Status {
    c.set_timeout(std::chrono::milliseconds(20000));
    auto lm = LayerMerge::create(c, req);
    messages[static_cast<std::size_t>(c.rank())] = lm.is_ok() ? "ok" : lm.status().message();
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (int r = 0; r < p; ++r) {
    const std::string& m = messages[static_cast<std::size_t>(r)];
    EXPECT_NE(m.find(needle), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_NE(m.find("rank " + std::to_string(r)), std::string::npos) << m;
  }
}

TEST(EngineMerge, AMethodThatCannotMergeABatchOrAMisfitTopologyIsRefusedOnEveryRank) {
  MergeRequest req;
  req.shape = AttnShape{4, 2, 1, static_cast<int>(kD), 1};
  req.method = "ring-kv";
  expect_refused(3, req, "'ring-kv' cannot merge a batch of states");
  req.method = "single";
  expect_refused(2, req, "'single' cannot merge a batch");
  req.method = "allreduce";
  expect_refused(2, req, "'allreduce' is not a strategy");
  req.method = "auto";
  req.topology = "no-such-file.json";
  expect_refused(2, req, "no-such-file.json");
}

TEST(EngineExchange, BytesAndTheCrossoverFollowTheWrittenFormula) {
  // SmolLM2-135M: 9 heads, 3 KV heads, head dim 64, f16 cache (768 B per token and layer).
  ExchangeShape s{2, 9, 3, 64, 768, false, true};
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
  ar.local_twin = false;  // e.g. tree over MPI at four ranks
  EXPECT_FALSE(use_kv_exchange(ExchangePolicy::kAuto, ar, 256, 0));
  EXPECT_FALSE(check_exchange(ExchangePolicy::kKV, ar, "tree").is_ok());
  EXPECT_TRUE(check_exchange(ExchangePolicy::kKV, s, "tree").is_ok());
  // The all-gather merge receives p - 1 copies of the records: pass-Q costs more, K/V longer.
  ExchangeShape ag = s;
  ag.ranks = 4;
  ag.merge_gathers = true;
  const auto g = exchange_bytes(ag, 10, 0);
  EXPECT_DOUBLE_EQ(g.pass_q, 10.0 * 3840 * 0.75 + 10.0 * 2376 * 3);
  EXPECT_FALSE(parse_exchange("both").is_ok());
  EXPECT_EQ(std::string(exchange_name(*parse_exchange("pass-q"))), "pass-q");
}

}  // namespace
}  // namespace treeattn::engine
