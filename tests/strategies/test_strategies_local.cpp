// Every strategy against the float64 oracle over the in-process communicator (comm_local.hpp),
// at 1, 2, 3, 5, 8, 13 and 16 ranks (threads), without mpirun.
//
// The cases are those of tests/multirank/strategies_main.cpp: even, uneven, striped and explicit
// shards with empty ranks, odd and ragged lengths, GQA, batch > 1, q_len > 1, the three KV
// dtypes, sharp logits, multi-step decodes with appends, root-only delivery and one case with
// timeout 0 (waits without deadline). Every strategy the backend's registry offers runs every
// case at every rank count; `hier` runs twice more: with an explicit grouping of two ranks per
// node and fan-out 3, and grouped by split_shared over emulated nodes of three ranks
// (LocalWorldOptions), so its intra-node and inter-node steps both have several members. The
// full cross product runs (nothing is sampled): 9 cases x (strategies + 2) x 7 rank counts.
//
// Checks per run and timed step: the merged states of the rank that holds the result (rank 0,
// or the root) are within the documented tolerance of the float64 oracle (max |out - ref| <=
// 1e-5 * max(1, max |ref|), and the LSE likewise; see strategies_main.cpp for why one tolerance
// serves every dtype), and for all-rank delivery every rank's states are byte-identical to that
// rank's: so every rank matches the oracle, with the same bits. Strategies that only send
// point-to-point messages (ring-kv, ring-state) must also count exactly the bytes the analytic
// model says each rank sends (ring-kv runs twice: tiles rotate on the default layout, rows on
// KVLayout::kRows, where the bytes are checked). The oracle is computed once per case and step (it does not depend
// on the rank count or the strategy).
//
// The ranks' kernels run one thread each (options.kernel.threads = 1), so results do not depend
// on OMP_NUM_THREADS.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "strategies/common.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/workload.hpp"

namespace treeattn {
namespace {

constexpr double kRelTol = 1e-5;
constexpr int kRankCounts[] = {1, 2, 3, 5, 8, 13, 16};

struct Case {
  std::string name;
  RunConfig config;
};

std::vector<int64_t> alternating_empty(int p, int64_t n) {
  // Odd ranks hold the tokens (rank 0 holds all when p == 1); even ranks hold none.
  std::vector<int64_t> lens(static_cast<std::size_t>(p), 0);
  if (p == 1) {
    lens[0] = n;
    return lens;
  }
  const int holders = p / 2;
  int64_t left = n;
  for (int r = 1, i = 0; r < p; r += 2, ++i) {
    const int64_t take = i + 1 == holders ? left : n / holders;
    lens[static_cast<std::size_t>(r)] = take;
    left -= take;
  }
  return lens;
}

// The cases of strategies_main.cpp, with the same shapes, lengths, seeds and scales.
std::vector<Case> make_cases(int p) {
  std::vector<Case> cases;
  auto add = [&](std::string name, AttnShape shape, DType dtype, std::vector<int64_t> n,
                 ShardKind kind, float q_scale) {
    Case c;
    c.name = std::move(name);
    c.config.shape = shape;
    c.config.dtype = dtype;
    c.config.total_len = std::move(n);
    c.config.shard = kind;
    c.config.q_scale = q_scale;
    c.config.seed = 7 + cases.size();
    c.config.timeout = std::chrono::milliseconds(20000);
    c.config.options.kernel.threads = 1;
    cases.push_back(std::move(c));
    return &cases.back().config;
  };
  add("f32 gqa even", {1, 4, 2, 64, 1}, DType::kF32, {97}, ShardKind::kEven, 2.0f);
  {
    // timeout 0: every wait without a deadline.
    RunConfig* c = add("f32 no-timeout uneven", {2, 4, 2, 128, 1}, DType::kF32, {61, 30},
                       ShardKind::kUneven, 2.0f);
    c->timeout = std::chrono::milliseconds(0);
  }
  add("f16 ragged-batch uneven", {2, 4, 4, 128, 1}, DType::kF16, {53, 17}, ShardKind::kUneven,
      3.0f);
  add("bf16 q3 striped", {1, 8, 2, 64, 3}, DType::kBF16, {113}, ShardKind::kStriped, 3.0f);
  {
    RunConfig* c = add("f32 b3 q2 explicit-empty", {3, 2, 1, 80, 2}, DType::kF32, {31},
                       ShardKind::kExplicit, 4.0f);
    c->explicit_len = alternating_empty(p, 31);
  }
  add("bf16 sharp logits even", {1, 2, 2, 64, 1}, DType::kBF16, {7}, ShardKind::kEven, 40.0f);
  {
    RunConfig* c = add("f32 appends striped q2", {2, 4, 2, 64, 2}, DType::kF32, {40, 23},
                       ShardKind::kStriped, 2.0f);
    c->steps = 3;
    c->append = true;
    c->check_every_step = true;  // the per-step agreement check must pass when ranks agree
  }
  {
    RunConfig* c =
        add("f16 appends even", {1, 4, 1, 96, 1}, DType::kF16, {29}, ShardKind::kEven, 2.0f);
    c->steps = 3;
    c->append = true;
  }
  {
    RunConfig* c =
        add("f32 root-only", {1, 4, 2, 64, 1}, DType::kF32, {50}, ShardKind::kEven, 2.0f);
    c->options.root = p - 1;
  }
  return cases;
}

// A strategy with its options and the in-process world it runs in.
struct Variant {
  std::string label;
  RunConfig config;
  LocalWorldOptions world;
};

std::vector<Variant> variants_of(const RunConfig& base, const StrategyRegistry& registry, int p) {
  std::vector<Variant> out;
  for (const StrategyInfo& info : registry.list()) {
    Variant v;
    v.config = base;
    v.config.strategy = std::string(info.name);
    v.label = v.config.strategy;
    out.push_back(v);
    if (info.reads_every_shard) {  // ring-kv: tiles rotate (auto layout above); rows too
      Variant r = v;
      r.config.kv_layout = KVLayout::kRows;
      r.label = v.label + " rows";
      out.push_back(r);
    }
    if (info.name == "hier") {
      Variant h = v;  // explicit grouping: two ranks per node, fan-out 3
      for (int r = 0; r < p; ++r) h.config.options.node_of_rank.push_back(r / 2);
      h.config.options.fanout = 3;
      h.label = "hier nodes-of-2 fanout-3";
      out.push_back(h);
      Variant s = v;  // split_shared over emulated nodes of three ranks
      for (int r = 0; r < p; ++r) s.world.node_of_rank.push_back(r / 3);
      s.label = "hier shared-memory nodes-of-3";
      out.push_back(s);
    }
  }
  return out;
}

// The oracle of (case, step), computed once for every rank count and strategy.
const OracleReference& oracle_for(const Case& c, int64_t step) {
  static std::map<std::pair<std::string, int64_t>, OracleReference> cache;
  auto key = std::make_pair(c.name, step);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto ref = oracle_reference(c.config, step);
  EXPECT_TRUE(ref.is_ok()) << c.name << ": " << ref.status().to_string();
  return cache.emplace(key, ref.is_ok() ? std::move(*ref) : OracleReference{}).first->second;
}

class StrategiesLocal : public ::testing::TestWithParam<int> {};

TEST_P(StrategiesLocal, EveryStrategyMatchesTheOracleWithTheSameBitsOnEveryRank) {
  const int p = GetParam();
  auto probe = make_local_world(1);
  ASSERT_TRUE(probe.is_ok()) << probe.status().to_string();
  const StrategyRegistry& registry = StrategyRegistry::for_backend((*probe)[0]->capabilities());
  int runs = 0;
  for (const Case& c : make_cases(p)) {
    for (const Variant& v : variants_of(c.config, registry, p)) {
      const RunConfig& cfg = v.config;
      const std::string label = c.name + " [" + v.label + "] p=" + std::to_string(p);
      ++runs;
      std::vector<std::optional<RunReport>> reports(static_cast<std::size_t>(p));
      Status s = run_local(
          p,
          [&](Communicator& comm) -> Status {
            auto rep = run_decode(comm, cfg);
            if (!rep.is_ok()) return rep.status();
            reports[static_cast<std::size_t>(comm.rank())] = std::move(*rep);
            return Status::ok();
          },
          v.world);
      if (!s.is_ok()) {
        ADD_FAILURE() << label << ": " << s.to_string();
        continue;
      }
      const int holder = cfg.options.root >= 0 ? cfg.options.root : 0;
      const RunReport& ref_rep = *reports[static_cast<std::size_t>(holder)];
      ASSERT_EQ(ref_rep.states.size(), static_cast<std::size_t>(cfg.steps)) << label;
      for (int r = 0; r < p; ++r)
        EXPECT_EQ(reports[static_cast<std::size_t>(r)]->has_result,
                  cfg.options.root < 0 || r == cfg.options.root)
            << label << " rank " << r;
      for (std::size_t i = 0; i < ref_rep.states.size(); ++i) {
        const int64_t step = ref_rep.steps[i].step;
        const StateBuffer& got = ref_rep.states[i];
        auto chk = compare_with_reference(cfg.shape, got, oracle_for(c, step), kRelTol);
        if (!chk.is_ok())
          ADD_FAILURE() << label << " step " << step << ": " << chk.status().to_string();
        else
          EXPECT_TRUE(chk->passed)
              << label << " step " << step << " (rank " << holder << "): " << chk->detail;
        if (cfg.options.root >= 0) continue;
        for (int r = 0; r < p; ++r) {
          const StateBuffer& other = reports[static_cast<std::size_t>(r)]->states[i];
          const bool same = other.bytes() == got.bytes() &&
                            std::memcmp(other.data(), got.data(), got.bytes()) == 0;
          EXPECT_TRUE(same) << label << " step " << step << ": rank " << r
                            << "'s states differ from rank " << holder << "'s";
        }
      }
      // Point-to-point strategies: the counted bytes are the model's, on every rank (ring-kv
      // on rows: on tiles it sends whole tiles, more than the model's rows).
      if (((cfg.strategy == "ring-kv" && cfg.kv_layout == KVLayout::kRows) ||
           cfg.strategy == "ring-state") &&
          p > 1)
        for (int r = 0; r < p; ++r) {
          const RunReport& rep = *reports[static_cast<std::size_t>(r)];
          EXPECT_EQ(static_cast<double>(rep.steps[0].p2p_bytes), rep.model.bytes_sent)
              << label << " rank " << r << ": counted p2p bytes vs the analytic model ("
              << rep.model.formula << ")";
          EXPECT_EQ(rep.steps[0].collective_calls, 0u) << label << " rank " << r;
        }
    }
  }
  EXPECT_EQ(runs, 9 * static_cast<int>(registry.list().size() + 3)) << "cases x variants";
}

// ring-kv's ranks compute the partial of every shard and must agree bit for bit, so it never
// leaves the split plan to the device (the CUDA executor's follows the SM count): the kernel
// options it passes have a fixed chunk length, the CPU's default where none was asked for (so
// CPU results keep their bits).
TEST(RingKV, PassesTheKernelAFixedSplitLength) {
  DecodeOptions o;
  o.scale = 0.5f;
  o.threads = 3;
  EXPECT_EQ(strategies::fixed_split_options(o).chunk_tokens, kDefaultChunkTokens);
  EXPECT_EQ(strategies::fixed_split_options(o).scale, 0.5f);
  EXPECT_EQ(strategies::fixed_split_options(o).threads, 3);
  o.chunk_tokens = 777;
  EXPECT_EQ(strategies::fixed_split_options(o).chunk_tokens, 777);
  o.chunk_tokens = -1;  // still the kernel's to refuse
  EXPECT_EQ(strategies::fixed_split_options(o).chunk_tokens, -1);
}

// ring-kv on the tiled layout with what the cases above do not have: quantized KV (the scales
// travel inside the tile records), shards long enough to be computed in several pieces of whole
// tiles, and ranks without tokens; at 1-8 ranks, every rank the same bits, within the oracle's
// tolerance.
TEST(RingKVTiles, QuantizedLongAndEmptyShardsMatchTheOracle) {
  struct Tiled {
    std::string name;
    DType dtype;
    std::vector<int64_t> lens;
    ShardKind kind;
  };
  const std::vector<Tiled> cases = {{"int8 uneven", DType::kInt8, {301, 77}, ShardKind::kUneven},
                                    {"fp8 explicit-empty", DType::kFP8, {190}, ShardKind::kExplicit},
                                    {"bf16 long even", DType::kBF16, {20000}, ShardKind::kEven},
                                    {"f16 striped", DType::kF16, {257, 3}, ShardKind::kStriped}};
  for (const Tiled& t : cases)
    for (int p = 1; p <= 8; ++p) {
      RunConfig cfg;
      cfg.strategy = "ring-kv";
      cfg.kv_layout = KVLayout::kTiled;
      cfg.shape = AttnShape{static_cast<int64_t>(t.lens.size()), 4, 2, 64, 1};
      cfg.dtype = t.dtype;
      cfg.total_len = t.lens;
      cfg.shard = t.kind;
      cfg.q_scale = 2.0f;
      cfg.options.kernel.threads = 1;
      if (t.kind == ShardKind::kExplicit) cfg.explicit_len = alternating_empty(p, t.lens[0]);
      const std::string label = t.name + " p=" + std::to_string(p);
      std::vector<std::optional<RunReport>> reports(static_cast<std::size_t>(p));
      Status s = run_local(p, [&](Communicator& comm) -> Status {
        auto rep = run_decode(comm, cfg);
        if (!rep.is_ok()) return rep.status();
        reports[static_cast<std::size_t>(comm.rank())] = std::move(*rep);
        return Status::ok();
      });
      ASSERT_TRUE(s.is_ok()) << label << ": " << s.to_string();
      const RunReport& r0 = *reports[0];
      ASSERT_EQ(r0.kv_layout, KVLayout::kTiled) << label;
      auto ref = oracle_reference(cfg, r0.steps[0].step);
      ASSERT_TRUE(ref.is_ok()) << label << ": " << ref.status().to_string();
      auto chk = compare_with_reference(cfg.shape, r0.states[0], *ref, kRelTol);
      ASSERT_TRUE(chk.is_ok()) << label;
      EXPECT_TRUE(chk->passed) << label << ": " << chk->detail;
      for (int r = 1; r < p; ++r) {
        const StateBuffer& other = reports[static_cast<std::size_t>(r)]->states[0];
        EXPECT_TRUE(other.bytes() == r0.states[0].bytes() &&
                    std::memcmp(other.data(), r0.states[0].data(), other.bytes()) == 0)
            << label << ": rank " << r << "'s states differ from rank 0's";
      }
    }
}

std::string rank_counts_name(const ::testing::TestParamInfo<int>& info) {
  return "p" + std::to_string(info.param);
}
INSTANTIATE_TEST_SUITE_P(Ranks, StrategiesLocal, ::testing::ValuesIn(kRankCounts),
                         rank_counts_name);

}  // namespace
}  // namespace treeattn
