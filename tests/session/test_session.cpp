// The decode session (session.hpp) over the in-process communicator: a multi-layer model-like
// loop (prefill by owners, attend per layer, append for all layers) against the float64 oracle
// at 1..8 ranks for every placement, quantized caches, multi-token queries, root delivery,
// extra strategies on the same shards, and the errors (ownership, layers, mismatched
// configurations, unknown strategies) reaching every rank without a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"

namespace treeattn {
namespace {

// Deterministic values in [-1, 1) for (layer, kind, b, pos, i), exactly representable.
float value(int layer, int kind, int64_t b, int64_t pos, int64_t i) {
  uint64_t x = (static_cast<uint64_t>(layer) << 56) ^ (static_cast<uint64_t>(kind) << 48) ^
               (static_cast<uint64_t>(b) << 40) ^ (static_cast<uint64_t>(pos) << 16) ^
               static_cast<uint64_t>(i);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) * 0x1p-23f;
}

std::vector<float> token(const AttnShape& s, int layer, int kind, int64_t b, int64_t pos) {
  std::vector<float> t(static_cast<std::size_t>(s.kv_heads * s.head_dim));
  for (std::size_t i = 0; i < t.size(); ++i)
    t[i] = value(layer, kind, b, pos, static_cast<int64_t>(i));
  return t;
}

std::vector<float> query(const AttnShape& s, int layer, int step) {
  std::vector<float> q(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = 2.0f * value(layer, 9, step, 0, static_cast<int64_t>(i));
  return q;
}

// The float64 oracle over the whole cache of one layer at the given row lengths (the same
// values the owners stored, narrowed to the dtype by the same KVCache code).
void oracle(const AttnShape& s, DType dtype, int layer, const std::vector<int64_t>& lens,
            const float* q, std::vector<double>& out, std::vector<double>& lse) {
  const int64_t cap = std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end()));
  KVCache cache(s, dtype, cap);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < lens[static_cast<std::size_t>(b)]; ++t) {
      const auto k = token(s, layer, 1, b, t), v = token(s, layer, 2, b, t);
      for (int64_t h = 0; h < s.kv_heads; ++h)
        cache.set_token(b, h, t, k.data() + h * s.head_dim, v.data() + h * s.head_dim);
    }
  std::vector<int64_t> zeros(lens.size(), 0);
  const KVShard view = cache.view(0, lens, zeros, lens, 1);
  out.assign(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim), 0.0);
  lse.assign(static_cast<std::size_t>(s.batch * s.q_len * s.heads), 0.0);
  ASSERT_TRUE(oracle_attention(s, q, view, out.data(), lse.data()).is_ok());
}

// Max |out - ref| relative to max(1, max|ref|), and LSE the same way.
double rel_error(const std::vector<float>& out, const std::vector<float>& lse,
                 const std::vector<double>& ref_out, const std::vector<double>& ref_lse) {
  double worst = 0, ref_max = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    worst = std::max(worst, std::fabs(out[i] - ref_out[i]));
    ref_max = std::max(ref_max, std::fabs(ref_out[i]));
  }
  double err = worst / std::max(1.0, ref_max);
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i]) || std::isinf(lse[i])) {
      if (static_cast<double>(lse[i]) != ref_lse[i]) return INFINITY;
      continue;
    }
    err = std::max(err, std::fabs(lse[i] - ref_lse[i]) / std::max(1.0, std::fabs(ref_lse[i])));
  }
  return err;
}

struct LoopCase {
  std::string name;
  AttnShape shape;
  DType dtype = DType::kF32;
  ShardKind placement = ShardKind::kEven;
  std::string strategy = "tree";
  int64_t prompt = 0;
  int appends = 3;
  int layers = 3;
  bool explicit_empty = false;  // kExplicit with every even rank empty
  KVLayout layout = KVLayout::kAuto;
};

// The model-shaped loop on p ranks; every rank checks its own output against the oracle and
// the bits against rank 0's. Returns the first failure as a message ("" when all passed).
std::string run_loop(const LoopCase& c, int p) {
  std::mutex mu;
  std::vector<std::vector<float>> outs(static_cast<std::size_t>(p));
  std::string failure;
  auto fail = [&](std::string m) {
    std::lock_guard<std::mutex> lock(mu);
    if (failure.empty()) failure = std::move(m);
  };
  Status st = run_local(p, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = c.shape;
    cfg.dtype = c.dtype;
    cfg.layers = c.layers;
    cfg.placement = c.placement;
    cfg.strategy = c.strategy;
    cfg.layout = c.layout;
    cfg.timeout = std::chrono::milliseconds(20000);
    cfg.options.kernel.threads = 1;
    if (c.explicit_empty) {
      cfg.placement = ShardKind::kExplicit;
      std::vector<int64_t> lens(static_cast<std::size_t>(p), 0);
      int holders = 0;
      for (int r = 0; r < p; ++r) holders += (r % 2 == 1 || p == 1) ? 1 : 0;
      int64_t left = c.prompt;
      for (int r = 0, i = 0; r < p; ++r)
        if (r % 2 == 1 || p == 1) {
          const int64_t take = ++i == holders ? left : c.prompt / holders;
          lens[static_cast<std::size_t>(r)] = take;
          left -= take;
        }
      cfg.explicit_len = lens;
    }
    auto session = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(session.status());
    DecodeSession& s = **session;
    const AttnShape& sh = c.shape;
    // Prefill: lay the prompt out, each rank stores only the positions it owns.
    TREEATTN_RETURN_IF_ERROR(s.extend(c.prompt));
    for (int l = 0; l < c.layers; ++l)
      for (int64_t b = 0; b < sh.batch; ++b)
        for (int64_t pos = 0; pos < c.prompt; ++pos) {
          if (!s.owns(b, pos)) continue;
          TREEATTN_RETURN_IF_ERROR(
              s.store(l, b, pos, token(sh, l, 1, b, pos).data(), token(sh, l, 2, b, pos).data()));
        }
    const auto per_layer = static_cast<std::size_t>(sh.batch * sh.kv_heads * sh.head_dim);
    for (int step = 0; step <= c.appends; ++step) {
      std::vector<int64_t> lens;
      for (int64_t b = 0; b < sh.batch; ++b) lens.push_back(s.length(b));
      if (lens[0] != c.prompt + step) fail("row length " + std::to_string(lens[0]) +
                                           " after " + std::to_string(step) + " appends");
      for (int l = 0; l < c.layers; ++l) {
        const auto q = query(sh, l, step);
        std::vector<float> out(q.size(), NAN), lse(static_cast<std::size_t>(sh.batch * sh.q_len *
                                                                             sh.heads), NAN);
        TREEATTN_RETURN_IF_ERROR(s.attend(l, q.data(), out.data(), lse.data()));
        if (!s.delivers_result()) continue;
        std::vector<double> ref_out, ref_lse;
        oracle(sh, c.dtype, l, lens, q.data(), ref_out, ref_lse);
        const double e = rel_error(out, lse, ref_out, ref_lse);
        if (!(e <= 1e-5))
          fail("rank " + std::to_string(comm.rank()) + " layer " + std::to_string(l) + " step " +
               std::to_string(step) + ": relative error " + std::to_string(e));
        if (step == c.appends && l == c.layers - 1) {
          std::lock_guard<std::mutex> lock(mu);
          outs[static_cast<std::size_t>(comm.rank())] = out;
        }
      }
      if (step == c.appends) break;
      // The next token of every row, for every layer; only its owner keeps it.
      std::vector<float> k(per_layer * static_cast<std::size_t>(c.layers)), v(k.size());
      for (int l = 0; l < c.layers; ++l)
        for (int64_t b = 0; b < sh.batch; ++b) {
          const auto kt = token(sh, l, 1, b, s.length(b)), vt = token(sh, l, 2, b, s.length(b));
          const std::size_t off = static_cast<std::size_t>(l) * per_layer +
                                  static_cast<std::size_t>(b * sh.kv_heads * sh.head_dim);
          std::copy(kt.begin(), kt.end(), k.begin() + static_cast<std::ptrdiff_t>(off));
          std::copy(vt.begin(), vt.end(), v.begin() + static_cast<std::ptrdiff_t>(off));
        }
      TREEATTN_RETURN_IF_ERROR(s.append(k.data(), v.data()));
    }
    return Status::ok();
  });
  if (!st.is_ok()) return st.to_string();
  if (!failure.empty()) return failure;
  for (int r = 1; r < p; ++r)
    if (!outs[static_cast<std::size_t>(r)].empty() &&
        std::memcmp(outs[static_cast<std::size_t>(r)].data(), outs[0].data(),
                    outs[0].size() * sizeof(float)) != 0)
      return "rank " + std::to_string(r) + "'s output differs from rank 0's";
  return "";
}

class SessionLoop : public ::testing::TestWithParam<int> {};

TEST_P(SessionLoop, EveryPlacementMatchesTheOracleAcrossLayersAndAppends) {
  const int p = GetParam();
  const AttnShape gqa{2, 8, 2, 64, 1};
  std::vector<LoopCase> cases = {
      {"even", gqa, DType::kF32, ShardKind::kEven, "tree", 97},
      {"uneven-bf16", gqa, DType::kBF16, ShardKind::kUneven, "tree", 131},
      {"striped-f16-allgather", gqa, DType::kF16, ShardKind::kStriped, "allgather", 61},
      {"explicit-empty-ringkv", gqa, DType::kF32, ShardKind::kExplicit, "ring-kv", 77, 3, 2, true},
      {"single", gqa, DType::kF32, ShardKind::kSingle, "single", 50, 2, 2},
      {"qlen4-tree2", AttnShape{1, 4, 1, 128, 4}, DType::kF32, ShardKind::kEven, "tree2", 45},
      {"fp8-ringkv", gqa, DType::kFP8, ShardKind::kEven, "ring-kv", 70, 2, 2},
      {"int8-tree-paper", gqa, DType::kInt8, ShardKind::kStriped, "tree-paper", 70, 2, 2},
      {"empty-prompt", gqa, DType::kF32, ShardKind::kEven, "tree", 0, 3, 1},
  };
  // Every case on both layouts, named (auto picks one of them by the CPU's kernel target,
  // host_kv_layout; KVLayoutAutoIsTheHostLayoutForEveryStrategy checks that).
  for (KVLayout layout : {KVLayout::kTiled, KVLayout::kRows})
    for (LoopCase c : cases) {
      c.layout = layout;
      EXPECT_EQ(run_loop(c, p), "")
          << c.name << " at " << p << " ranks, layout " << kv_layout_name(layout);
    }
}

INSTANTIATE_TEST_SUITE_P(Ranks, SessionLoop, ::testing::Values(1, 2, 3, 5, 8));

TEST(Session, AppendAdvancesThePlacementOnceForAllLayers) {
  ASSERT_TRUE(run_local(3, [](Communicator& comm) -> Status {
                SessionConfig cfg;
                cfg.shape = AttnShape{1, 2, 1, 64, 1};
                cfg.layers = 4;
                cfg.placement = ShardKind::kStriped;
                cfg.context = {10};
                auto s = DecodeSession::create(comm, cfg);
                TREEATTN_RETURN_IF_ERROR(s.status());
                std::vector<float> kv(4 * 64, 0.5f);
                TREEATTN_RETURN_IF_ERROR((*s)->append(kv.data(), kv.data()));
                if ((*s)->length(0) != 11) return internal_error("length " + std::to_string((*s)->length(0)));
                // Striped: position 10 lives on rank 10 mod 3 = 1, in every layer.
                const bool mine = (*s)->owns(0, 10);
                if (mine != (comm.rank() == 1)) return internal_error("owner of position 10");
                return Status::ok();
              }).is_ok());
}

TEST(Session, StoreNamesTheOwnerAndRejectsBadLayersAndPositions) {
  std::vector<std::string> msgs(2);
  Status st = run_local(2, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{1, 2, 1, 64, 1};
    cfg.layers = 2;
    cfg.context = {8};
    auto s = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(s.status());
    std::vector<float> kv(64, 1.0f);
    const int64_t theirs = comm.rank() == 0 ? 7 : 0;  // even split: 0..3 on rank 0, 4..7 on 1
    Status a = (*s)->store(0, 0, theirs, kv.data(), kv.data());
    Status b = (*s)->store(2, 0, 0, kv.data(), kv.data());
    Status c = (*s)->store(0, 0, 8, kv.data(), kv.data());
    msgs[static_cast<std::size_t>(comm.rank())] = a.to_string() + "|" + b.to_string() + "|" + c.to_string();
    if (a.code() != Code::kInvalidArgument || b.code() != Code::kInvalidArgument ||
        c.code() != Code::kInvalidArgument)
      return internal_error("expected three kInvalidArgument");
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_NE(msgs[0].find("belongs to rank 1"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[1].find("belongs to rank 0"), std::string::npos) << msgs[1];
  EXPECT_NE(msgs[0].find("layer 2 is outside [0, 2)"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[0].find("position 8 of row 0 is outside [0, 8)"), std::string::npos) << msgs[0];
}

TEST(Session, MismatchedConfigurationsFailOnEveryRankNamingTheField) {
  std::vector<Status> got(4);
  Status st = run_local(4, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{1, 4, 2, comm.rank() == 2 ? 128 : 64, 1};
    cfg.context = {100};
    cfg.timeout = std::chrono::milliseconds(5000);
    got[static_cast<std::size_t>(comm.rank())] = DecodeSession::create(comm, cfg).status();
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (int r = 0; r < 4; ++r) {
    const Status& s = got[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), Code::kMismatch) << r << ": " << s.to_string();
    EXPECT_NE(s.message().find("rank 0 has head_dim=64, rank 2 has head_dim=128"),
              std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("ranks differing from the majority: 2"), std::string::npos);
  }
}

TEST(Session, OneRanksInvalidConfigurationReachesEveryRank) {
  std::vector<Status> got(3);
  Status st = run_local(3, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{1, 4, 2, 64, 1};
    cfg.context = {100};
    cfg.strategy = comm.rank() == 1 ? "no-such-strategy" : "tree";
    got[static_cast<std::size_t>(comm.rank())] = DecodeSession::create(comm, cfg).status();
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const Status& s : got) {
    EXPECT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("rank 1 rejected the run configuration at setup"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find("unknown strategy 'no-such-strategy'"), std::string::npos);
  }
}

TEST(Session, ExtraStrategiesShareTheShardsAndSingleCannotJoin) {
  Status st = run_local(4, [](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{1, 4, 2, 64, 1};
    cfg.context = {300};
    cfg.options.kernel.threads = 1;
    auto s = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(s.status());
    DecodeSession& ses = **s;
    for (int64_t pos = 0; pos < 300; ++pos)
      if (ses.owns(0, pos))
        TREEATTN_RETURN_IF_ERROR(ses.store(0, 0, pos, token(cfg.shape, 0, 1, 0, pos).data(),
                                           token(cfg.shape, 0, 2, 0, pos).data()));
    const auto q = query(cfg.shape, 0, 0);
    std::vector<double> ref_out, ref_lse;
    oracle(cfg.shape, cfg.dtype, 0, {300}, q.data(), ref_out, ref_lse);
    for (const char* name : {"ring-state", "hier", "gather-root"}) {
      auto idx = measure::add_strategy(ses, name, cfg.options);
      TREEATTN_RETURN_IF_ERROR(idx.status());
      StateBuffer states;
      TREEATTN_RETURN_IF_ERROR(measure::attend_states(ses, 0, q.data(), states, *idx));
      std::vector<float> out(q.size()), lse(states.records());
      for (std::size_t i = 0; i < states.records(); ++i)
        state_normalize(states.record(i), 64, out.data() + i * 64, lse.data() + i);
      const double e = rel_error(out, lse, ref_out, ref_lse);
      if (!(e <= 1e-5)) return internal_error(std::string(name) + ": error " + std::to_string(e));
    }
    auto single = measure::add_strategy(ses, "single", cfg.options);
    if (single.is_ok()) return internal_error("single joined an even placement");
    if (single.status().message().find("needs the whole KV cache on rank 0") == std::string::npos)
      return internal_error("unexpected: " + single.status().to_string());
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

// The layout a session chooses: the same for every strategy on the host, host_kv_layout's for
// the workload (tuned, or by the CPU's kernel target with TREEATTN_TUNE=0 as in
// the test presets; ring-kv rotates tiles, tree-det copies its chunks out of them), and
// strategies that join a tiled session read the same tiled shards to the oracle's tolerance.
TEST(Session, KVLayoutAutoIsTheHostLayoutForEveryStrategy) {
  Status st = run_local(3, [](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{1, 4, 2, 64, 1};
    cfg.context = {300};
    cfg.options.kernel.threads = 1;
    std::vector<std::string> names;
    for (const StrategyInfo& i : StrategyRegistry::for_backend(comm.capabilities()).list())
      names.emplace_back(i.name);
    names.emplace_back(deterministic_strategy());
    for (const std::string& name : names) {
      cfg.strategy = name;
      auto s = DecodeSession::create(comm, cfg);
      TREEATTN_RETURN_IF_ERROR(s.status());
      const KVLayout want =
          host_kv_layout(KVLayoutWorkload{cfg.shape, cfg.dtype, cfg.options.kernel}).layout;
      if ((*s)->config().layout != want)
        return internal_error(name + ": layout " +
                              std::string(kv_layout_name((*s)->config().layout)) + ", expected " +
                              std::string(kv_layout_name(want)));
      if (((*s)->view(0).tiled != nullptr) != (want == KVLayout::kTiled))
        return internal_error(name + ": the view does not match the layout");
    }
    cfg.layout = KVLayout::kTiled;
    cfg.strategy = "tree";
    auto s = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(s.status());
    DecodeSession& ses = **s;
    for (int64_t pos = 0; pos < 300; ++pos)
      if (ses.owns(0, pos))
        TREEATTN_RETURN_IF_ERROR(ses.store(0, 0, pos, token(cfg.shape, 0, 1, 0, pos).data(),
                                           token(cfg.shape, 0, 2, 0, pos).data()));
    const auto q = query(cfg.shape, 0, 0);
    std::vector<double> ref_out, ref_lse;
    oracle(cfg.shape, cfg.dtype, 0, {300}, q.data(), ref_out, ref_lse);
    for (const char* name : {"ring-kv", "tree-det", "ring-state"}) {
      auto idx = measure::add_strategy(ses, name, cfg.options);
      TREEATTN_RETURN_IF_ERROR(idx.status());
      StateBuffer states;
      TREEATTN_RETURN_IF_ERROR(measure::attend_states(ses, 0, q.data(), states, *idx));
      std::vector<float> out(q.size()), lse(states.records());
      for (std::size_t i = 0; i < states.records(); ++i)
        state_normalize(states.record(i), 64, out.data() + i * 64, lse.data() + i);
      const double e = rel_error(out, lse, ref_out, ref_lse);
      if (!(e <= 1e-5))
        return internal_error(std::string(name) + " on tiles: error " + std::to_string(e));
    }
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

// The tiled and the rows layout hold the same values: every strategy's merged output on each
// agrees to the oracle's tolerance, and the tiled results do not depend on the kernel threads.
TEST(Session, TiledAndRowsLayoutsAgreeAndTiledIsThreadCountIndependent) {
  const AttnShape sh{2, 9, 3, 64, 1};  // the SmolLM2 attention shape, two rows
  const int64_t n = 1000;              // > one tile per rank, a partial last tile
  std::vector<std::vector<float>> results;
  for (const auto& [layout, threads] : std::vector<std::pair<KVLayout, int>>{
           {KVLayout::kRows, 1}, {KVLayout::kTiled, 1}, {KVLayout::kTiled, 2}}) {
    std::vector<float> got;
    std::mutex mu;
    Status st = run_local(2, [&](Communicator& comm) -> Status {
      SessionConfig cfg;
      cfg.shape = sh;
      cfg.dtype = DType::kBF16;
      cfg.context = {n, n - 333};
      cfg.layout = layout;
      cfg.options.kernel.threads = threads;
      cfg.options.kernel.chunk_tokens = 128;  // several work items per row and KV head
      auto s = DecodeSession::create(comm, cfg);
      TREEATTN_RETURN_IF_ERROR(s.status());
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t pos = 0; pos < (*s)->length(b); ++pos)
          if ((*s)->owns(b, pos))
            TREEATTN_RETURN_IF_ERROR((*s)->store(0, b, pos, token(sh, 0, 1, b, pos).data(),
                                                 token(sh, 0, 2, b, pos).data()));
      const auto q = query(sh, 0, 0);
      std::vector<float> out(q.size()), lse(static_cast<std::size_t>(2 * 9));
      TREEATTN_RETURN_IF_ERROR((*s)->attend(0, q.data(), out.data(), lse.data()));
      std::vector<double> ref_out, ref_lse;
      oracle(sh, cfg.dtype, 0, {n, n - 333}, q.data(), ref_out, ref_lse);
      const double e = rel_error(out, lse, ref_out, ref_lse);
      if (!(e <= 1e-5)) return internal_error("error " + std::to_string(e));
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0) got = out;
      return Status::ok();
    });
    ASSERT_TRUE(st.is_ok()) << st.to_string() << " (layout " << kv_layout_name(layout)
                            << ", " << threads << " threads)";
    results.push_back(got);
  }
  EXPECT_EQ(std::memcmp(results[1].data(), results[2].data(), results[1].size() * sizeof(float)),
            0)
      << "the tiled layout's output changed with the thread count";
}

TEST(Session, RootDeliveryWritesOnlyTheRoot) {
  Status st = run_local(3, [](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{1, 2, 1, 64, 1};
    cfg.context = {40};
    cfg.options.root = 2;
    auto s = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(s.status());
    for (int64_t pos = 0; pos < 40; ++pos)
      if ((*s)->owns(0, pos))
        TREEATTN_RETURN_IF_ERROR((*s)->store(0, 0, pos, token(cfg.shape, 0, 1, 0, pos).data(),
                                             token(cfg.shape, 0, 2, 0, pos).data()));
    const auto q = query(cfg.shape, 0, 0);
    std::vector<float> out(q.size(), -7.0f);
    TREEATTN_RETURN_IF_ERROR((*s)->attend(0, q.data(), out.data()));
    const bool untouched = std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; });
    if ((comm.rank() == 2) == untouched) return internal_error("root delivery wrote the wrong ranks");
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

// strategy "auto": resolved inside the session, collectively: at every rank count the ranks run
// the same strategy, the one the planner ranks first on the topology, and it computes the
// exact attention (checked against the float64 oracle).
TEST(SessionAuto, EveryRankGetsTheSameChoiceAt1To8Ranks) {
  const AttnShape sh{1, 8, 2, 64, 1};
  const int64_t n = 700;
  for (int p = 1; p <= 8; ++p) {
    std::vector<std::string> chosen(static_cast<std::size_t>(p));
    std::vector<double> predicted(static_cast<std::size_t>(p), 0.0);
    Status st = run_local(p, [&](Communicator& comm) -> Status {
      SessionConfig cfg;
      cfg.shape = sh;
      cfg.dtype = DType::kF32;
      cfg.context = {n};
      cfg.strategy = "auto";
      cfg.options.kernel.threads = 1;
      auto s = DecodeSession::create(comm, cfg);
      TREEATTN_RETURN_IF_ERROR(s.status());
      DecodeSession& ses = **s;
      const StrategyChoice* c = ses.auto_choice();
      if (c == nullptr || c->ranking.empty()) return internal_error("no auto_choice()");
      if (c->strategy != ses.config().strategy ||
          c->ranking.front().prediction.strategy != c->strategy)
        return internal_error("the choice " + c->strategy + " is not what runs (" +
                              ses.config().strategy + ") or not ranked first");
      if (!StrategyRegistry::for_backend(comm.capabilities()).contains(c->strategy))
        return internal_error("auto chose " + c->strategy + ", which the backend does not offer");
      for (const PlanEntry& e : c->ranking)
        if (!(e.prediction.latency_us > 0))
          return internal_error(e.prediction.strategy + ": no predicted time");
      chosen[static_cast<std::size_t>(comm.rank())] = c->strategy;
      predicted[static_cast<std::size_t>(comm.rank())] = c->ranking.front().prediction.latency_us;
      for (int64_t pos = 0; pos < n; ++pos)
        if (ses.owns(0, pos))
          TREEATTN_RETURN_IF_ERROR(ses.store(0, 0, pos, token(sh, 0, 1, 0, pos).data(),
                                             token(sh, 0, 2, 0, pos).data()));
      const auto q = query(sh, 0, 0);
      std::vector<float> out(q.size()), lse(static_cast<std::size_t>(sh.heads));
      TREEATTN_RETURN_IF_ERROR(ses.attend(0, q.data(), out.data(), lse.data()));
      std::vector<double> ref_out, ref_lse;
      oracle(sh, cfg.dtype, 0, {n}, q.data(), ref_out, ref_lse);
      const double e = rel_error(out, lse, ref_out, ref_lse);
      if (!(e <= 1e-5))
        return internal_error("auto (" + c->strategy + "): error " + std::to_string(e));
      return Status::ok();
    });
    ASSERT_TRUE(st.is_ok()) << "p=" << p << ": " << st.to_string();
    for (int r = 1; r < p; ++r) {
      EXPECT_EQ(chosen[static_cast<std::size_t>(r)], chosen[0]) << "p=" << p << " rank " << r;
      EXPECT_EQ(predicted[static_cast<std::size_t>(r)], predicted[0]) << "p=" << p;
    }
  }
}

// With a given topology the session's choice is choose_strategy's on it; the choice follows
// the topology (a slow network between nodes against one node's shared memory).
TEST(SessionAuto, AGivenTopologyIsTheOnePlannedOn) {
  const AttnShape sh{1, 32, 8, 128, 1};
  const int64_t n = 4096;
  auto slow = preset_topology("emu-1gbit");  // 2 nodes x 2 ranks, 1 Gbit between them
  ASSERT_TRUE(slow.is_ok());
  CostQuery q;
  q.shape = sh;
  q.kv_dtype = DType::kBF16;
  q.context = n;
  q.ranks = 4;
  auto want = choose_strategy(q, *slow, CommCapabilities{}.user_reductions);
  ASSERT_TRUE(want.is_ok()) << want.status().to_string();
  std::vector<std::string> chosen(4);
  Status st = run_local(4, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = sh;
    cfg.context = {n};
    cfg.strategy = "auto";
    cfg.topology = *slow;
    cfg.options.kernel.threads = 1;
    auto s = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(s.status());
    chosen[static_cast<std::size_t>(comm.rank())] = (*s)->config().strategy;
    if ((*s)->auto_choice()->topology != slow->name)
      return internal_error("planned on " + (*s)->auto_choice()->topology);
    if ((*s)->auto_choice()->ranking.size() != want->ranking.size())
      return internal_error("ranking sizes differ");
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const std::string& c : chosen) EXPECT_EQ(c, want->strategy);
}

// Ranks that were given different topologies still run one strategy: rank 0's choice. Rank 0
// plans on the emulated 2 x 2 cluster (veth between nodes), the others on one node of 4; the
// context is the first of a few where the two plans differ.
TEST(SessionAuto, RankZerosChoiceWinsWhenRanksPlanDifferently) {
  const AttnShape sh{1, 32, 8, 128, 1};
  auto two_nodes = preset_topology("emu-veth");
  auto one_node = preset_topology("local");
  ASSERT_TRUE(two_nodes.is_ok() && one_node.is_ok());
  one_node->ranks_per_node = 4;
  CostQuery q;
  q.shape = sh;
  q.kv_dtype = DType::kBF16;
  q.ranks = 4;
  std::string on_rank0, on_others;
  for (int64_t n : {64, 1024, 4096, 65536}) {
    q.context = n;
    auto a = choose_strategy(q, *two_nodes), b = choose_strategy(q, *one_node);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    on_rank0 = a->strategy;
    on_others = b->strategy;
    if (on_rank0 != on_others) break;
  }
  ASSERT_NE(on_rank0, on_others) << "the planner chose " << on_rank0
                                 << " on both topologies at every context tried";
  const int64_t n = q.context;
  std::vector<std::string> chosen(4);
  Status st = run_local(4, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = sh;
    cfg.context = {n};
    cfg.strategy = "auto";
    cfg.topology = comm.rank() == 0 ? *two_nodes : *one_node;
    cfg.options.kernel.threads = 1;
    auto s = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(s.status());
    chosen[static_cast<std::size_t>(comm.rank())] = (*s)->config().strategy;
    if ((*s)->auto_choice()->ranking.front().prediction.strategy != (*s)->config().strategy)
      return internal_error("the ranking does not start with the strategy run");
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const std::string& c : chosen) EXPECT_EQ(c, on_rank0);
  std::printf("auto at 4 ranks, %lld tokens: %s on 2 x 2 (veth), %s on 1 x 4\n",
              static_cast<long long>(n), on_rank0.c_str(), on_others.c_str());
}

}  // namespace
}  // namespace treeattn
