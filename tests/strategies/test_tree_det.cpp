// tree-det (the deterministic merge) over the in-process communicator: output and LSE bitwise
// identical whatever the rank count (1..16), the contiguous placement (even, uneven, explicit
// lengths with empty ranks, single) and the kernel's thread count, for every KV dtype, batch
// rows of different lengths and q_len > 1; every result also within the tolerance of the
// float64 oracle; and the same bits on the tiled KV layout as on rows (tree-det copies the tiles'
// tokens into rows, kGroup chunks at a time, for the same leaves). Striped placement is refused
// with a clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"

namespace treeattn {
namespace {

float value(int kind, int64_t b, int64_t pos, int64_t i) {
  uint64_t x = (static_cast<uint64_t>(kind) << 56) ^ (static_cast<uint64_t>(b) << 44) ^
               (static_cast<uint64_t>(pos) << 16) ^ static_cast<uint64_t>(i);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) * 0x1p-23f;
}

std::vector<float> token(const AttnShape& s, int kind, int64_t b, int64_t pos) {
  std::vector<float> t(static_cast<std::size_t>(s.kv_heads * s.head_dim));
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = value(kind, b, pos, static_cast<int64_t>(i));
  return t;
}

struct Case {
  std::string name;
  AttnShape shape;
  DType dtype;
  std::vector<int64_t> lens;  // per batch row
};

enum class Place { kEven, kUneven, kExplicitEmpty, kSingle };

// Output and LSE bytes of rank 0 (and every rank must agree) for one configuration.
struct Bits {
  std::vector<float> out, lse;
  std::string error;
};

Bits run(const Case& c, int p, Place place, int threads, KVLayout layout) {
  Bits got;
  std::mutex mu;
  Status st = run_local(p, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = c.shape;
    cfg.dtype = c.dtype;
    cfg.context = c.lens;
    cfg.strategy = "tree-det";
    cfg.timeout = std::chrono::milliseconds(20000);
    cfg.options.kernel.threads = threads;
    cfg.layout = layout;
    switch (place) {
      case Place::kEven: cfg.placement = ShardKind::kEven; break;
      case Place::kUneven: cfg.placement = ShardKind::kUneven; break;
      case Place::kSingle: cfg.placement = ShardKind::kSingle; break;
      case Place::kExplicitEmpty: {
        // Rank 0 and every third rank hold nothing; the rest split the context unevenly.
        cfg.placement = ShardKind::kExplicit;
        for (int64_t n : c.lens) {
          std::vector<int64_t> per(static_cast<std::size_t>(p), 0);
          std::vector<int> holders;
          for (int r = 0; r < p; ++r)
            if (p == 1 || (r % 3 != 0)) holders.push_back(r);
          int64_t left = n;
          for (std::size_t i = 0; i < holders.size(); ++i) {
            const int64_t take = i + 1 == holders.size() ? left : left * 2 / 5;
            per[static_cast<std::size_t>(holders[i])] = take;
            left -= take;
          }
          cfg.explicit_len.insert(cfg.explicit_len.end(), per.begin(), per.end());
        }
        // explicit_len is [rank][batch]: transpose the per-row lists just built.
        std::vector<int64_t> t(cfg.explicit_len.size());
        const auto B = c.lens.size();
        for (std::size_t b = 0; b < B; ++b)
          for (int r = 0; r < p; ++r)
            t[static_cast<std::size_t>(r) * B + b] = cfg.explicit_len[b * static_cast<std::size_t>(p) + static_cast<std::size_t>(r)];
        cfg.explicit_len = t;
        break;
      }
    }
    auto s = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(s.status());
    for (int64_t b = 0; b < c.shape.batch; ++b)
      for (int64_t pos = 0; pos < c.lens[static_cast<std::size_t>(b)]; ++pos)
        if ((*s)->owns(b, pos))
          TREEATTN_RETURN_IF_ERROR((*s)->store(0, b, pos, token(c.shape, 1, b, pos).data(),
                                               token(c.shape, 2, b, pos).data()));
    const AttnShape& sh = c.shape;
    std::vector<float> q(static_cast<std::size_t>(sh.batch * sh.q_len * sh.heads * sh.head_dim));
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = 3.0f * value(9, 0, 0, static_cast<int64_t>(i));
    std::vector<float> out(q.size()), lse(static_cast<std::size_t>(sh.batch * sh.q_len * sh.heads));
    TREEATTN_RETURN_IF_ERROR((*s)->attend(0, q.data(), out.data(), lse.data()));
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) {
      got.out = out;
      got.lse = lse;
    } else if (!got.out.empty() &&
               (std::memcmp(out.data(), got.out.data(), out.size() * sizeof(float)) != 0 ||
                std::memcmp(lse.data(), got.lse.data(), lse.size() * sizeof(float)) != 0)) {
      got.error = "rank " + std::to_string(comm.rank()) + " differs from rank 0";
    }
    return Status::ok();
  });
  if (!st.is_ok()) got.error = st.to_string();
  return got;
}

double oracle_error(const Case& c, const Bits& bits) {
  const AttnShape& sh = c.shape;
  const int64_t cap = std::max<int64_t>(1, *std::max_element(c.lens.begin(), c.lens.end()));
  KVCache cache(sh, c.dtype, cap);
  for (int64_t b = 0; b < sh.batch; ++b)
    for (int64_t t = 0; t < c.lens[static_cast<std::size_t>(b)]; ++t) {
      const auto k = token(sh, 1, b, t), v = token(sh, 2, b, t);
      for (int64_t h = 0; h < sh.kv_heads; ++h)
        cache.set_token(b, h, t, k.data() + h * sh.head_dim, v.data() + h * sh.head_dim);
    }
  std::vector<int64_t> zeros(c.lens.size(), 0);
  const KVShard view = cache.view(0, c.lens, zeros, c.lens, 1);
  std::vector<float> q(static_cast<std::size_t>(sh.batch * sh.q_len * sh.heads * sh.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 3.0f * value(9, 0, 0, static_cast<int64_t>(i));
  std::vector<double> ref(q.size()), lse(bits.lse.size());
  EXPECT_TRUE(oracle_attention(sh, q.data(), view, ref.data(), lse.data()).is_ok());
  double err = 0, big = 1;
  for (double r : ref) big = std::max(big, std::fabs(r));
  for (std::size_t i = 0; i < ref.size(); ++i) err = std::max(err, std::fabs(bits.out[i] - ref[i]) / big);
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse[i])) {
      if (static_cast<double>(bits.lse[i]) != lse[i]) return INFINITY;
      continue;
    }
    err = std::max(err, std::fabs(bits.lse[i] - lse[i]) / std::max(1.0, std::fabs(lse[i])));
  }
  return err;
}

std::string describe(int p, Place place, int threads, KVLayout layout) {
  static const char* names[] = {"even", "uneven", "explicit-empty", "single"};
  return std::to_string(p) + " ranks, " + names[static_cast<int>(place)] + ", " +
         std::to_string(threads) + " threads, " + std::string(kv_layout_name(layout));
}

class TreeDet : public ::testing::TestWithParam<Case> {};

TEST_P(TreeDet, SameBitsForEveryRankCountPlacementAndThreadCount) {
  const Case& c = GetParam();
  const Bits ref = run(c, 1, Place::kEven, 1, KVLayout::kRows);
  ASSERT_EQ(ref.error, "");
  const double e = oracle_error(c, ref);
  EXPECT_LE(e, 1e-5) << "one rank vs the float64 oracle";
  for (KVLayout layout : {KVLayout::kRows, KVLayout::kTiled})
    for (int p : {1, 2, 3, 4, 5, 7, 8, 11, 13, 16})
      for (Place place : {Place::kEven, Place::kUneven, Place::kExplicitEmpty, Place::kSingle})
        for (int threads : {1, 2}) {
          if (p > 5 && threads == 2) continue;  // 16 ranks x 2 threads on 2 cores adds nothing
          const Bits got = run(c, p, place, threads, layout);
          const std::string at = describe(p, place, threads, layout);
          ASSERT_EQ(got.error, "") << at;
          ASSERT_EQ(std::memcmp(got.out.data(), ref.out.data(), ref.out.size() * sizeof(float)),
                    0)
              << "output bits differ at " << at;
          ASSERT_EQ(std::memcmp(got.lse.data(), ref.lse.data(), ref.lse.size() * sizeof(float)),
                    0)
              << "LSE bits differ at " << at;
        }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TreeDet,
    ::testing::Values(
        Case{"f32_gqa", {1, 8, 2, 64, 1}, DType::kF32, {1000}},
        Case{"bf16_ragged_batch", {3, 4, 2, 64, 1}, DType::kBF16, {700, 0, 259}},
        Case{"f16_qlen3", {1, 4, 1, 128, 3}, DType::kF16, {513}},
        Case{"fp8", {1, 4, 2, 64, 1}, DType::kFP8, {777}},
        Case{"int8_tiny", {2, 2, 1, 80, 1}, DType::kInt8, {5, 256}},
        // More than one group of 16 chunks per rank on the tiled layout (at up to 2 ranks).
        Case{"bf16_groups", {1, 4, 2, 64, 1}, DType::kBF16, {9001}}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(TreeDetPlacement, StripedIsRefusedWithAClearError) {
  std::vector<Status> got(2);
  ASSERT_TRUE(run_local(2, [&](Communicator& comm) -> Status {
                SessionConfig cfg;
                cfg.shape = AttnShape{1, 2, 1, 64, 1};
                cfg.context = {100};
                cfg.placement = ShardKind::kStriped;
                cfg.strategy = "tree-det";
                got[static_cast<std::size_t>(comm.rank())] = DecodeSession::create(comm, cfg).status();
                return Status::ok();
              }).is_ok());
  for (const Status& s : got) {
    EXPECT_EQ(s.code(), Code::kUnsupported) << s.to_string();
    EXPECT_NE(s.message().find("needs a contiguous placement"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace treeattn
