// Tests of the cost model and the planner on synthetic topologies: limiting cases computed by
// hand, monotonicity, the hierarchy's effect (hier vs tree when the network is slow), how the
// KV-rotating ring scales with context and rank count, the planner's choices, and the paper
// sweep.
#include "treeattn/cost_model.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace treeattn {
namespace {

// A machine with round numbers: 1 GB/s = 1000 bytes per microsecond.
Topology synthetic(int nodes, int rpn, double a_node, double b_node, double a_net, double b_net,
                   double mem_gbps, int links = 1) {
  Topology t;
  t.name = "synthetic";
  t.nodes = nodes;
  t.ranks_per_node = rpn;
  t.node = LinkLevel{"node", a_node, b_node, 1};
  if (nodes > 1) t.network = LinkLevel{"network", a_net, b_net, links};
  t.memory_bandwidth_GBps = mem_gbps;
  return t;
}

CostQuery small_query(int64_t context, int ranks) {
  CostQuery q;
  q.shape = AttnShape{1, 1, 1, 64, 1};  // S = 66 * 4 = 264 B, q = 256 B
  q.kv_dtype = DType::kF32;
  q.context = context;
  q.ranks = ranks;
  return q;
}

CostQuery paper_query(int64_t context, int ranks) {
  CostQuery q;
  q.shape = AttnShape{1, 16, 16, 128, 1};
  q.kv_dtype = DType::kBF16;
  q.context = context;
  q.ranks = ranks;
  return q;
}

Prediction must(Result<Prediction> r) {
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? r.value() : Prediction{};
}

TEST(CostModel, ReplaceAutoKeepsOrderAndDropsTheDuplicate) {
  using V = std::vector<std::string>;
  EXPECT_EQ(replace_auto(V{"auto", "tree"}, "tree"), V{"tree"});
  EXPECT_EQ(replace_auto(V{"ring-kv", "auto"}, "tree"), (V{"ring-kv", "tree"}));
  EXPECT_EQ(replace_auto(V{"single"}, "tree"), V{"single"});
}

// p = 2 on one node, alpha = 1 us, beta = 1 GB/s, memory 1 GB/s, N = 1000 f32 tokens:
//   t = 500, KV(t) = 2 * 500 * 64 * 4 = 256000 B, local = (256000 + 256 + 264) / 1000 us.
//   tree: one recursive-doubling round: 1 us + 264 B / 1000 + merge 3 * 264 B / 1000.
TEST(CostModel, TreeOnTwoRanksByHand) {
  const Topology t = synthetic(1, 2, 1.0, 1.0, 0, 0, 1.0);
  const Prediction p = must(predict("tree", small_query(1000, 2), t));
  const double local = (256000.0 + 256 + 264) / 1000;
  const double comm = 1.0 + 0.264 + 3 * 0.264;
  EXPECT_NEAR(p.local_us, local, 1e-9);
  EXPECT_NEAR(p.comm_us, comm, 1e-9);
  EXPECT_NEAR(p.latency_us, local + comm, 1e-9);
  EXPECT_DOUBLE_EQ(p.bytes_sent_per_rank, 264.0);
  EXPECT_EQ(p.collective_calls, 1);
  EXPECT_EQ(p.comm_rounds, 1);
  EXPECT_DOUBLE_EQ(p.peak_bytes, 256000.0 + 256 + 264 + 264);
}

// Same machine, ring-kv: local, then one step of max(local, 1 us + 256000 B / 1000), then
// the merge of the 2 partials (3 * 264 B at 1000 B/us). Buffers: own shard + 1 receive
// buffer (p = 2) + 2 partial states.
TEST(CostModel, RingKvOnTwoRanksByHand) {
  const Topology t = synthetic(1, 2, 1.0, 1.0, 0, 0, 1.0);
  const Prediction p = must(predict("ring-kv", small_query(1000, 2), t));
  const double loc = (256000.0 + 256 + 264) / 1000;
  const double comm_step = 1.0 + 256.0;
  EXPECT_NEAR(p.latency_us, loc + std::max(loc, comm_step) + 3 * 0.264, 1e-9);
  EXPECT_DOUBLE_EQ(p.bytes_sent_per_rank, 256000.0);
  EXPECT_DOUBLE_EQ(p.peak_bytes, 2 * 256000.0 + 256 + 264 + 2 * 264);
  // From 3 ranks on, two receive buffers.
  const Prediction p3 =
      must(predict("ring-kv", small_query(1500, 3), synthetic(1, 3, 1, 1, 0, 0, 1)));
  EXPECT_DOUBLE_EQ(p3.peak_bytes, 3 * 256000.0 + 256 + 264 + 3 * 264);
}

// Recursive doubling on 8 ranks = 2 nodes x 4: log2(4) = 2 node rounds + 1 network round.
TEST(CostModel, RecursiveDoublingUsesEachLinkClassByHand) {
  const Topology t = synthetic(2, 4, 1.0, 1000.0, 50.0, 1000.0, 1e6, 4);
  const Prediction p = must(predict("tree", small_query(8000, 8), t));
  const double per_round_bytes = 0.264 / 1000 + 3 * 0.264 / 1e6;
  EXPECT_NEAR(p.comm_us, 2 * 1.0 + 50.0 + 3 * per_round_bytes, 1e-6);
  EXPECT_EQ(p.comm_rounds, 3);
  EXPECT_DOUBLE_EQ(p.bytes_sent_per_rank, 3 * 264.0);
}

TEST(CostModel, OneRankMatchesSingleAndSendsNothing) {
  const Topology t = synthetic(1, 4, 1.0, 10.0, 0, 0, 20.0);
  const CostQuery q = small_query(50000, 1);
  const Prediction single = must(predict("single", q, t));
  for (const std::string& s : modeled_strategies()) {
    const Prediction p = must(predict(s, q, t));
    EXPECT_DOUBLE_EQ(p.bytes_sent_per_rank, 0.0) << s;
    EXPECT_NEAR(p.latency_us, single.latency_us, 0.01 * single.latency_us) << s;
  }
  EXPECT_NEAR(single.latency_us, (2.0 * 50000 * 64 * 4 + 256 + 264) / 20e3, 1e-9);
}

// single: rank 0 reads the whole cache; with p > 1 it then broadcasts the result.
TEST(CostModel, SingleComputesTheWholeContextThenBroadcasts) {
  const Topology t = synthetic(2, 4, 1.0, 10.0, 10.0, 1.0, 20.0);
  const Prediction a = must(predict("single", small_query(40000, 8), t));
  const Prediction b = must(predict("single", small_query(40000, 1), t));
  EXPECT_DOUBLE_EQ(a.local_us, b.local_us);
  EXPECT_DOUBLE_EQ(b.comm_us, 0.0);
  EXPECT_GT(a.comm_us, 10.0);   // the broadcast crosses the network once at least
  EXPECT_EQ(a.comm_rounds, 3);  // binomial broadcast over 8 ranks
  EXPECT_DOUBLE_EQ(a.peak_bytes, 2.0 * 40000 * 64 * 4 + 256 + 264);
}

TEST(CostModel, MonotoneInContextBandwidthAndLatency) {
  const Topology base = synthetic(4, 4, 0.5, 10.0, 10.0, 1.0, 30.0);
  for (const std::string& s : modeled_strategies()) {
    double prev = 0;
    for (int64_t n = 1000; n <= 1'024'000; n *= 4) {
      const double lat = must(predict(s, paper_query(n, 16), base)).latency_us;
      EXPECT_GE(lat, prev) << s << " at N=" << n;
      prev = lat;
    }
    Topology faster_mem = base;
    faster_mem.memory_bandwidth_GBps *= 4;
    Topology slower_net = base;
    slower_net.network->latency_us *= 10;
    slower_net.network->bandwidth_GBps /= 10;
    const CostQuery q = paper_query(256000, 16);
    const double lat = must(predict(s, q, base)).latency_us;
    EXPECT_LE(must(predict(s, q, faster_mem)).latency_us, lat) << s;
    EXPECT_GE(must(predict(s, q, slower_net)).latency_us, lat) << s;
  }
}

TEST(CostModel, MoreCollectivesCostMoreWhenLatencyBound) {
  const Topology t = synthetic(4, 8, 1.0, 50.0, 20.0, 10.0, 100.0);
  const CostQuery q = paper_query(64000, 32);
  const double tree = must(predict("tree", q, t)).latency_us;
  const double tree2 = must(predict("tree2", q, t)).latency_us;
  const double paper = must(predict("tree-paper", q, t)).latency_us;
  EXPECT_LT(tree, tree2);
  EXPECT_LT(tree2, paper);
  EXPECT_EQ(must(predict("tree-paper", q, t)).collective_calls, 3);
  EXPECT_EQ(must(predict("tree2", q, t)).collective_calls, 2);
}

// 8 ranks per node share ONE slow network link: recursive doubling sends 8 states across at
// once per network round, hier sends one per node, so hier wins.
TEST(CostModel, HierBeatsTreeWhenTheSharedNetworkIsSlow) {
  const Topology t = synthetic(4, 8, 0.5, 10.0, 20.0, 0.1, 30.0, /*links=*/1);
  const CostQuery q = paper_query(320000, 32);
  const Prediction tree = must(predict("tree", q, t));
  const Prediction hier = must(predict("hier", q, t));
  EXPECT_LT(hier.latency_us, tree.latency_us);
  EXPECT_LT(hier.bytes_sent_per_rank, tree.bytes_sent_per_rank);
  // With one link per rank (DGX-style) and a fast network, the flat tree needs fewer
  // sequential network rounds (log2 4 = 2) than hier's reduce + broadcast (2 + 2).
  const Topology fast = synthetic(4, 8, 0.5, 10.0, 20.0, 50.0, 30.0, /*links=*/8);
  EXPECT_LT(must(predict("tree", q, fast)).latency_us, must(predict("hier", q, fast)).latency_us);
}

TEST(CostModel, HierFanoutChangesTheTreeDepth) {
  const Topology t = synthetic(16, 2, 0.5, 10.0, 20.0, 10.0, 30.0);
  CostQuery q = paper_query(320000, 32);
  q.hier_fanout = 2;
  const Prediction f2 = must(predict("hier", q, t));
  q.hier_fanout = 16;
  const Prediction f16 = must(predict("hier", q, t));
  // Fan-out 2 over 16 leaders: 4 rounds up and 4 down; fan-out 16: 1 and 1.
  EXPECT_EQ(f2.comm_rounds, 1 + 4 + 4 + 1);
  EXPECT_EQ(f16.comm_rounds, 1 + 1 + 1 + 1);
  EXPECT_LT(f16.latency_us, f2.latency_us);  // latency-bound: fewer rounds win
}

// The ring moves the whole KV cache: comm-bound, its time grows linearly with N and does not
// shrink with p, while the tree's local time shrinks as 1/p.
TEST(CostModel, RingKvScalesWithContextNotWithRanks) {
  const Topology t = synthetic(16, 1, 1.0, 10.0, 5.0, 1.0, 100.0);
  const double r1 = must(predict("ring-kv", paper_query(1'000'000, 16), t)).latency_us;
  const double r2 = must(predict("ring-kv", paper_query(2'000'000, 16), t)).latency_us;
  EXPECT_NEAR(r2 / r1, 2.0, 0.02);
  const double p4 = must(predict("ring-kv", paper_query(1'000'000, 4), t)).latency_us;
  const double p16 = must(predict("ring-kv", paper_query(1'000'000, 16), t)).latency_us;
  EXPECT_GT(p16 / p4, 0.9);
  EXPECT_LT(p16 / p4, 1.5);
  const double t4 = must(predict("tree", paper_query(1'000'000, 4), t)).latency_us;
  const double t16 = must(predict("tree", paper_query(1'000'000, 16), t)).latency_us;
  EXPECT_LT(t16, t4 / 3);
  // Bytes: (p - 1) KV shards per rank.
  const Prediction p = must(predict("ring-kv", paper_query(1'600'000, 16), t));
  EXPECT_DOUBLE_EQ(p.bytes_sent_per_rank, 15.0 * 2 * 100'000 * 16 * 128 * 2);
}

TEST(CostModel, RingKvHidesCommunicationWhenComputeDominates) {
  // Memory 1 GB/s, network 1000 GB/s: each step is compute-bound, so latency = p * local.
  const Topology t = synthetic(8, 1, 1.0, 10.0, 1.0, 1000.0, 1.0);
  const Prediction p = must(predict("ring-kv", paper_query(80000, 8), t));
  EXPECT_NEAR(p.comm_us, 0.0, 1e-9);
  EXPECT_NEAR(p.latency_us, p.local_us, 1e-9);
}

TEST(CostModel, OversubscribedRanksSlowTheLocalPhase) {
  Topology t = synthetic(2, 2, 0.5, 8.0, 12.0, 1.0, 30.0);
  const double free_cores = must(predict("tree", small_query(400000, 4), t)).local_us;
  t.max_concurrent_ranks = 2;
  const double shared = must(predict("tree", small_query(400000, 4), t)).local_us;
  EXPECT_NEAR(shared, 2 * free_cores, 1e-9);
}

TEST(CostModel, OversubscribedRingKvDoesNotOverlapTransfers) {
  // Compute-bound steps (fast network): overlapped, latency = p * local. With more ranks than
  // cores, each step pays local + transfer instead.
  Topology t = synthetic(4, 1, 1.0, 10.0, 1.0, 1000.0, 1.0);
  const Prediction free_cores = must(predict("ring-kv", paper_query(80000, 4), t));
  EXPECT_NEAR(free_cores.comm_us, 0.0, 1e-9);
  t.max_concurrent_ranks = 2;
  const Prediction shared = must(predict("ring-kv", paper_query(80000, 4), t));
  // Local phase doubles (2 ranks per core) and the 3 transfers are added, not hidden.
  // (the final merge of the 4 partials does not double, hence the loose tolerance)
  EXPECT_NEAR(shared.local_us, 2 * free_cores.local_us, free_cores.local_us * 1e-3);
  EXPECT_NEAR(shared.latency_us, shared.local_us + shared.comm_us, 1e-6);
  const double kv = 2.0 * 20000 * 16 * 128 * 2;  // KV(t) of a 20000-token bf16 shard
  const double step_comm = 1.0 + kv / 1000.0 / 1000.0;
  EXPECT_NEAR(shared.comm_us, 3 * step_comm, 1e-6);
  EXPECT_NE(shared.algorithm.find("not overlapped"), std::string::npos) << shared.algorithm;
}

TEST(CostModel, NetworkCallOverheadIsPaidOncePerCrossingCall) {
  Topology t = synthetic(2, 2, 0.5, 8.0, 12.0, 1.0, 30.0);
  const CostQuery q = small_query(4000, 4);
  const Prediction tree0 = must(predict("tree", q, t));
  const Prediction paper0 = must(predict("tree-paper", q, t));
  const Prediction hier0 = must(predict("hier", q, t));
  const Prediction ring0 = must(predict("ring-state", q, t));
  t.network->call_overhead_us = 1000.0;
  // tree: one allreduce across nodes; tree-paper: three; hier: the inter-leader reduce and
  // broadcast cross nodes, its two intra-node calls do not; ring-state: 3 crossing steps.
  EXPECT_NEAR(must(predict("tree", q, t)).latency_us - tree0.latency_us, 1000.0, 1e-6);
  EXPECT_NEAR(must(predict("tree-paper", q, t)).latency_us - paper0.latency_us, 3000.0, 1e-6);
  EXPECT_NEAR(must(predict("hier", q, t)).latency_us - hier0.latency_us, 2000.0, 1e-6);
  EXPECT_NEAR(must(predict("ring-state", q, t)).latency_us - ring0.latency_us, 3000.0, 1e-6);
  // On one node nothing crosses the network: the overhead is not paid.
  const CostQuery q1 = small_query(4000, 2);
  Topology t0 = t;
  t0.network->call_overhead_us = 0.0;
  EXPECT_NEAR(must(predict("tree", q1, t)).latency_us, must(predict("tree", q1, t0)).latency_us,
              1e-9);
}

TEST(Planner, FewestCrossingCallsWinWhenCallsAreExpensive) {
  // The emulated cluster's situation: each call that crosses hosts costs milliseconds.
  Topology t = synthetic(2, 2, 10.0, 10.0, 16.0, 1.5, 7.0);
  t.max_concurrent_ranks = 2;
  t.network->call_overhead_us = 5000.0;
  auto entries = plan(small_query(32768, 4), t);
  ASSERT_TRUE(entries.is_ok()) << entries.status().to_string();
  const std::string choice = entries->front().prediction.strategy;
  EXPECT_TRUE(choice == "tree" || choice == "allgather") << choice;
  for (const auto& e : *entries) {
    if (e.prediction.strategy == "tree-paper" || e.prediction.strategy == "ring-state") {
      EXPECT_GT(e.prediction.latency_us, entries->front().prediction.latency_us + 9000.0);
    }
  }
}

TEST(CostModel, AllgatherAndGatherRootHoldAllStates) {
  const Topology t = synthetic(2, 4, 0.5, 8.0, 12.0, 1.0, 30.0);
  const CostQuery q = paper_query(80000, 8);
  const double S = 16 * 130 * 4.0;
  const double kv = 2.0 * 10000 * 16 * 128 * 2;
  EXPECT_DOUBLE_EQ(must(predict("allgather", q, t)).peak_bytes, kv + 16 * 128 * 4 + S + 8 * S);
  EXPECT_DOUBLE_EQ(must(predict("gather-root", q, t)).peak_bytes, kv + 16 * 128 * 4 + S + 8 * S);
  // Recursive doubling allgather on 8 ranks: 1 + 2 + 4 blocks sent by every rank.
  EXPECT_DOUBLE_EQ(must(predict("allgather", q, t)).bytes_sent_per_rank, 7 * S);
}

TEST(CostModel, NcclAllreducePicksTheCheaperOfRingAndTree) {
  Topology t = synthetic(16, 8, 0.5, 450.0, 5.0, 50.0, 3350.0, 8);
  t.collectives = CollectiveLibrary::kNccl;
  t.collective_overhead_us = 4.4;
  // tree2's two built-in allreduces (NCCL has them; `tree`'s user-defined one it has not).
  const Prediction p = must(predict("tree2", paper_query(5'120'000, 128), t));
  // Tree: 2 * ((8 - 1) * 0.5 + log2(16) * 5) = 47 us of hops, plus 4.4 overhead and bytes,
  // for MAX of m (16 floats) and SUM of (l, o) (16 x 129 floats).
  EXPECT_NE(p.algorithm.find("NCCL tree allreduce"), std::string::npos) << p.algorithm;
  const double row = 16 * 4.0;
  EXPECT_NEAR(p.comm_us, 2 * (4.4 + 47.0) + 2 * (row + 129 * row) / 50e3, 1e-6);
}

// NCCL has no user-defined reductions: `tree` runs as the all-gather of states there
// (allgather.cpp), and predict("tree") prices that, not an allreduce.
TEST(CostModel, TreeOnNcclIsPricedAsTheAllgatherFormNcclRuns) {
  Topology t = synthetic(2, 4, 0.5, 450.0, 5.0, 50.0, 3350.0, 4);
  t.collectives = CollectiveLibrary::kNccl;
  t.collective_overhead_us = 4.4;
  const CostQuery q = paper_query(1'000'000, 8);
  const Prediction tree = must(predict("tree", q, t));
  const Prediction ag = must(predict("allgather", q, t));
  EXPECT_EQ(tree.strategy, "tree");
  EXPECT_NE(tree.algorithm.find("NCCL ring allgather"), std::string::npos) << tree.algorithm;
  EXPECT_EQ(tree.algorithm.find("allreduce"), std::string::npos) << tree.algorithm;
  EXPECT_DOUBLE_EQ(tree.latency_us, ag.latency_us);
  EXPECT_DOUBLE_EQ(tree.bytes_sent_per_rank, ag.bytes_sent_per_rank);
  EXPECT_DOUBLE_EQ(tree.peak_bytes, ag.peak_bytes);  // it holds all p states, as NCCL's does
  // The user-defined operation's extra is an MPI figure: NCCL's tree does not pay it.
  t.node.user_op_overhead_us = 500.0;
  EXPECT_DOUBLE_EQ(must(predict("tree", q, t)).latency_us, ag.latency_us);
  // The planner's ranking prices it the same way (choose_strategy without user reductions).
  auto entries = plan(q, t);
  ASSERT_TRUE(entries.is_ok()) << entries.status().to_string();
  auto choice = choose_strategy(q, t, /*user_reductions=*/false);
  ASSERT_TRUE(choice.is_ok()) << choice.status().to_string();
  for (const auto& list : {*entries, choice->ranking}) {
    for (const PlanEntry& e : list) {
      if (e.prediction.strategy == "tree") {
        EXPECT_DOUBLE_EQ(e.prediction.latency_us, ag.latency_us);
      }
    }
  }
  // On MPI the same machine runs tree as one allreduce with the merge as a user-defined op.
  t.collectives = CollectiveLibrary::kMpi;
  EXPECT_NE(must(predict("tree", q, t)).algorithm.find("allreduce"), std::string::npos);
}

// node.user_op_overhead_us and network.user_op_overhead_us (what topo --detect measured the
// user-defined-reduction allreduce to cost beyond a built-in one) are added to `tree`'s one
// allreduce, the network's only when it crosses nodes, and to nothing else.
TEST(CostModel, UserOpOverheadIsPaidByTreeOnly) {
  Topology t = synthetic(2, 2, 0.5, 8.0, 12.0, 1.0, 30.0);
  const CostQuery q = small_query(4000, 4);
  const CostQuery q1 = small_query(4000, 2);  // 2 ranks on one node: nothing crosses
  const CostQuery q0 = small_query(4000, 1);
  const Prediction tree = must(predict("tree", q, t));
  const Prediction tree1 = must(predict("tree", q1, t));
  const Prediction tree0 = must(predict("tree", q0, t));
  std::vector<Prediction> others;
  for (const char* s : {"tree-paper", "tree2", "allgather", "gather-root", "ring-state"})
    others.push_back(must(predict(s, q, t)));
  t.node.user_op_overhead_us = 100.0;
  t.network->user_op_overhead_us = 1000.0;
  const Prediction with = must(predict("tree", q, t));
  EXPECT_NEAR(with.latency_us - tree.latency_us, 1100.0, 1e-9);
  EXPECT_NEAR(with.comm_us - tree.comm_us, 1100.0, 1e-9);
  EXPECT_NE(with.algorithm.find("user-defined op"), std::string::npos) << with.algorithm;
  EXPECT_NEAR(must(predict("tree", q1, t)).latency_us - tree1.latency_us, 100.0, 1e-9);
  EXPECT_DOUBLE_EQ(must(predict("tree", q0, t)).latency_us, tree0.latency_us);  // no call
  for (const Prediction& o : others) {
    EXPECT_DOUBLE_EQ(must(predict(o.strategy, q, t)).latency_us, o.latency_us) << o.strategy;
  }
  // The planner sees it: with a large enough extra, tree is no longer the choice among tree
  // and allgather, which the model rates close without it.
  PlanOptions po;
  po.candidates = {"tree", "allgather"};
  t.network->user_op_overhead_us = 0.0;
  t.node.user_op_overhead_us = 0.0;
  const double gap = std::abs(must(predict("tree", q, t)).latency_us -
                              must(predict("allgather", q, t)).latency_us);
  t.network->user_op_overhead_us = gap + 50.0;
  auto entries = plan(q, t, po);
  ASSERT_TRUE(entries.is_ok()) << entries.status().to_string();
  EXPECT_EQ(entries->front().prediction.strategy, "allgather");
}

TEST(CostModel, ErrorsNameTheValue) {
  const Topology t = synthetic(2, 4, 0.5, 8.0, 12.0, 1.0, 30.0);
  Result<Prediction> r = predict("butterfly", small_query(1000, 2), t);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("unknown strategy 'butterfly' (known: tree, tree-paper"),
            std::string::npos)
      << r.status().message();
  r = predict("tree", small_query(1000, 9), t);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("ranks must be in [1, 8]"), std::string::npos)
      << r.status().message();
  r = predict("tree", small_query(0, 2), t);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("context must be >= 1 token, got 0"), std::string::npos);
  CostQuery q = small_query(1000, 8);
  q.ranks_per_node = 2;  // 8 ranks at 2 per node need 4 nodes
  r = predict("tree", q, t);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("need 4 nodes, topology 'synthetic' has 2"),
            std::string::npos)
      << r.status().message();
}

TEST(Planner, PrefersTreeOverRingForLongContexts) {
  const Topology t = synthetic(4, 8, 0.5, 100.0, 5.0, 25.0, 1000.0, 8);
  Result<std::vector<PlanEntry>> pl = plan(paper_query(1'000'000, 32), t);
  ASSERT_TRUE(pl.is_ok()) << pl.status().to_string();
  ASSERT_EQ(pl->size(), modeled_strategies().size() - 1);  // all but single
  EXPECT_EQ(pl->front().prediction.strategy, "tree");
  EXPECT_EQ(pl->back().prediction.strategy, "ring-kv");
  for (std::size_t i = 1; i < pl->size(); ++i)
    EXPECT_LE((*pl)[i - 1].prediction.latency_us, (*pl)[i].prediction.latency_us);
}

TEST(Planner, ChoosesHierOnASharedSlowNetwork) {
  const Topology t = synthetic(4, 8, 0.5, 10.0, 20.0, 0.1, 30.0, 1);
  Result<std::vector<PlanEntry>> pl = plan(paper_query(320000, 32), t);
  ASSERT_TRUE(pl.is_ok());
  EXPECT_EQ(pl->front().prediction.strategy, "hier");
}

// 5 ranks, one per node, 500 us network latency, tiny context: the latency rounds decide.
// Recursive doubling on 5 needs 1 + 2 + 1 = 4 rounds, ring-state 4, hier (binary heap of 5)
// 2 up + 2 down, gather-root 3 + 3, Bruck all-gather ceil(log2 5) = 3: allgather wins.
TEST(Planner, ChoosesAllgatherForNonPowerOfTwoLatencyBoundJobs) {
  const Topology t = synthetic(5, 1, 0.5, 10.0, 500.0, 1.0, 30.0);
  Result<std::vector<PlanEntry>> pl = plan(paper_query(512, 5), t);
  ASSERT_TRUE(pl.is_ok());
  EXPECT_EQ(pl->front().prediction.strategy, "allgather");
  EXPECT_EQ(pl->front().prediction.comm_rounds, 3);
  // With 4 ranks recursive doubling needs only log2 4 = 2 rounds and the tree wins.
  pl = plan(paper_query(512, 4), t);
  ASSERT_TRUE(pl.is_ok());
  EXPECT_EQ(pl->front().prediction.strategy, "tree");
}

TEST(Planner, RanksSingleOnlyWhenAsked) {
  const Topology t = synthetic(2, 4, 0.5, 10.0, 10.0, 1.0, 30.0);
  Result<std::vector<PlanEntry>> pl = plan(paper_query(1'000'000, 8), t);
  ASSERT_TRUE(pl.is_ok());
  for (const PlanEntry& e : *pl) EXPECT_NE(e.prediction.strategy, "single");
  PlanOptions opts;
  opts.include_single = true;
  pl = plan(paper_query(1'000'000, 8), t, opts);
  ASSERT_TRUE(pl.is_ok());
  ASSERT_EQ(pl->size(), modeled_strategies().size());
  EXPECT_NE(pl->front().prediction.strategy, "single");  // 8x the memory traffic
}

TEST(Planner, MemoryCapacityMakesPlansInfeasible) {
  Topology t = synthetic(1, 4, 0.5, 10.0, 0, 0, 30.0);
  // KV shard at N = 400k over 4 ranks: 2 * 100k * 16 * 128 * 2 B = 819.2 MB; ring-kv holds 3.
  t.memory_capacity_GB = 1.5;
  PlanOptions opts;
  opts.candidates = {"ring-kv", "tree"};
  opts.include_single = true;  // single holds the whole 3.3 GB cache
  Result<std::vector<PlanEntry>> pl = plan(paper_query(400000, 4), t, opts);
  ASSERT_TRUE(pl.is_ok());
  ASSERT_EQ(pl->size(), 3u);
  EXPECT_EQ((*pl)[0].prediction.strategy, "tree");
  EXPECT_TRUE((*pl)[0].feasible);
  for (std::size_t i = 1; i < 3; ++i) {
    EXPECT_FALSE((*pl)[i].feasible) << (*pl)[i].prediction.strategy;
    EXPECT_NE((*pl)[i].reason.find("exceeds 1.5"), std::string::npos) << (*pl)[i].reason;
  }
}

TEST(Planner, UnknownCandidateIsAnError) {
  const Topology t = synthetic(1, 2, 0.5, 10.0, 0, 0, 30.0);
  PlanOptions opts;
  opts.candidates = {"tree", "ring-q"};
  Result<std::vector<PlanEntry>> pl = plan(small_query(1000, 2), t, opts);
  ASSERT_FALSE(pl.is_ok());
  EXPECT_NE(pl.status().message().find("unknown strategy 'ring-q'"), std::string::npos);
}

TEST(PaperSweep, CoversThePapersGridAndTreeWins) {
  Result<Topology> dgx = preset_topology("dgx-h100x16");
  ASSERT_TRUE(dgx.is_ok());
  Result<std::vector<SweepRow>> rows = paper_sweep(*dgx);
  ASSERT_TRUE(rows.is_ok()) << rows.status().to_string();
  ASSERT_EQ(rows->size(), 3u * 7u);
  EXPECT_EQ(rows->front().devices, 8);
  EXPECT_EQ(rows->front().context, 80'000);
  EXPECT_EQ(rows->back().devices, 128);
  EXPECT_EQ(rows->back().context, 5'120'000);
  for (const SweepRow& r : *rows) {
    EXPECT_GT(r.speedup, 1.0) << r.devices << " devices, N=" << r.context;
    EXPECT_GE(r.speedup_tree, r.speedup);  // one collective is never slower than three
    EXPECT_NEAR(r.speedup, r.ring_kv_us / r.tree_paper_us, 1e-9);
  }
  // At 128 devices the speedup grows with the context.
  for (std::size_t i = 1; i < 7; ++i)
    EXPECT_GT((*rows)[14 + i].speedup, (*rows)[14 + i - 1].speedup);
  Result<Topology> mi = preset_topology("mi300x4");
  ASSERT_TRUE(mi.is_ok());
  Result<std::vector<SweepRow>> mrows = paper_sweep(*mi);
  ASSERT_TRUE(mrows.is_ok());
  ASSERT_EQ(mrows->size(), 7u);
  EXPECT_EQ(mrows->front().devices, 4);
}

}  // namespace
}  // namespace treeattn

namespace treeattn {
namespace {

// The dense layers (predict_dense): a query of round numbers, checked by hand, then the
// crossover between split and replicated.
DenseQuery dense_query(double weight_bytes, int layers, int ranks) {
  DenseQuery q;
  q.weight_bytes = weight_bytes;
  q.layers = layers;
  q.qkv_width = 1000;
  q.o_width = 1000;
  q.ffn_width = 2000;
  q.down_width = 1000;
  q.head_width = 4000;
  q.embd_width = 1000;
  q.ranks = ranks;
  return q;
}

TEST(DenseCost, TwoRanksByHand) {
  // 1 GB/s memory: 1000 B/us; node links 1 us + 1000 B/us; 2 ranks on one node.
  const Topology t = synthetic(1, 2, 1.0, 1.0, 0, 0, 1.0);
  auto d = predict_dense(dense_query(1e6, 2, 2), t);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_DOUBLE_EQ(d->replicated_us, 1000.0);      // 1 MB at 1000 B/us
  EXPECT_DOUBLE_EQ(d->split_compute_us, 500.0);    // half of it
  EXPECT_EQ(d->collectives, 4 * 2 + 2);
  // One row: each all-gather moves width * 4 / 2 bytes from each rank, one round of 1 us + m /
  // 1000: per layer (2000 + 2000 + 4000 + 2000) B -> 4 us + 10 us; the head 8000 B -> 1 + 8;
  // the embedding, one whole row from its owner, 4000 B -> 1 + 4.
  EXPECT_NEAR(d->split_comm_us, 2 * (4.0 + 10.0) + 9.0 + 5.0, 1e-9);
  EXPECT_NEAR(d->bytes_sent_per_rank, 2 * 10000.0 + 8000.0 + 4000.0, 1e-9);
  EXPECT_TRUE(d->split_wins());
  // One rank: nothing to gather, the two are the same.
  auto one = predict_dense(dense_query(1e6, 2, 1), t);
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one->split_us, one->replicated_us);
  EXPECT_EQ(one->collectives, 0);
}

TEST(DenseCost, SmallModelsOnSlowLinksStayReplicated) {
  // SmolLM2-like: 30 layers, ~100 MB of weights; Qwen2.5-1.5B-like: 28 layers, ~1 GB.
  auto q_small = dense_query(1e8, 30, 2), q_big = dense_query(1e9, 28, 2);
  q_small.head_width = 49152;
  q_big.head_width = 151936;
  auto local = preset_topology("local"), slow = preset_topology("emu-1gbit");
  ASSERT_TRUE(local.is_ok() && slow.is_ok());
  // One node (shared memory, ~1 us a call): both split.
  for (const auto* q : {&q_small, &q_big}) {
    auto d = predict_dense(*q, *local);
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    EXPECT_TRUE(d->split_wins()) << q->weight_bytes;
  }
  // Two emulated hosts over a 1 Gbit link (12 us a message, 121 MB/s): the small model's saved
  // reads (~1.5 ms) are less than 122 network all-gathers; the large one's (~15 ms) are more.
  q_small.ranks_per_node = q_big.ranks_per_node = 1;
  auto small = predict_dense(q_small, *slow), big = predict_dense(q_big, *slow);
  ASSERT_TRUE(small.is_ok() && big.is_ok());
  EXPECT_FALSE(small->split_wins()) << small->split_us << " vs " << small->replicated_us;
  EXPECT_TRUE(big->split_wins()) << big->split_us << " vs " << big->replicated_us;
  // The kernels measured to read the weights at 10 GB/s (a quantized decode on one CPU thread),
  // not the topology's 32: the reads the split saves grow threefold, and the small model splits
  // too.
  q_small.weight_gbps = 10;
  auto measured = predict_dense(q_small, *slow);
  ASSERT_TRUE(measured.is_ok());
  EXPECT_NEAR(measured->replicated_us, 1e8 / 10e3, 1e-6);
  EXPECT_TRUE(measured->split_wins()) << measured->split_us << " vs " << measured->replicated_us;
  q_small.weight_gbps = 100;  // faster than memory: memory bounds it
  auto capped = predict_dense(q_small, *slow);
  ASSERT_TRUE(capped.is_ok());
  EXPECT_DOUBLE_EQ(capped->replicated_us, small->replicated_us);
  // More weights: the replicated time grows by all of them, the split by its slice.
  auto bigger = dense_query(2e9, 28, 2);
  auto b2 = predict_dense(bigger, *slow);
  ASSERT_TRUE(b2.is_ok());
  EXPECT_GT(b2->replicated_us - big->replicated_us, b2->split_us - big->split_us);
}

TEST(DenseCost, BadQueriesAreRefused) {
  const Topology t = synthetic(1, 2, 1.0, 1.0, 0, 0, 1.0);
  EXPECT_FALSE(predict_dense(dense_query(0, 2, 2), t).is_ok());
  EXPECT_FALSE(predict_dense(dense_query(1e6, 0, 2), t).is_ok());
  const auto many = predict_dense(dense_query(1e6, 2, 3), t);
  EXPECT_EQ(many.status().code(), Code::kInvalidArgument);
  EXPECT_NE(many.status().message().find("ranks must be in [1, 2]"), std::string::npos)
      << many.status().message();
}

}  // namespace
}  // namespace treeattn
