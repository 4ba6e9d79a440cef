// The session's sequences (session.hpp): rows as sequence slots that join, leave and grow on
// their own; K/V stored a range at a time; attention for any set of live sequences in one call.
// Checked against the float64 oracle of each sequence's own tokens at 1..8 ranks, for several
// placements and strategies, with empty ranks (a 3-token sequence on 8 ranks), a slot reused
// after a sequence left (its old tokens are never read) and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"

namespace treeattn {
namespace {

// Seeded values in [-1, 1) for (sequence id, layer, kind, position, element): a sequence's
// tokens depend on its id, not on the row it occupies, so a reused row holds new data.
float value(int64_t id, int layer, int kind, int64_t pos, int64_t i) {
  uint64_t x = (static_cast<uint64_t>(id) << 52) ^ (static_cast<uint64_t>(layer) << 44) ^
               (static_cast<uint64_t>(kind) << 40) ^ (static_cast<uint64_t>(pos) << 16) ^
               static_cast<uint64_t>(i);
  x = (x ^ (x >> 31)) * 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 29)) * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) * 0x1p-23f;
}

// K (kind 1) or V (kind 2) of positions pos0 .. pos0 + n - 1: [n][kv_heads][head_dim].
std::vector<float> kv_range(const AttnShape& s, int64_t id, int layer, int kind, int64_t pos0,
                            int64_t n) {
  const int64_t per = s.kv_heads * s.head_dim;
  std::vector<float> t(static_cast<std::size_t>(n * per));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < per; ++i)
      t[static_cast<std::size_t>(j * per + i)] = value(id, layer, kind, pos0 + j, i);
  return t;
}

std::vector<float> queries(const AttnShape& s, int64_t id, int layer, int64_t step) {
  std::vector<float> q(static_cast<std::size_t>(s.q_len * s.heads * s.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = 2.0f * value(id, layer, 3 + static_cast<int>(step % 8), 0, static_cast<int64_t>(i));
  return q;
}

// Relative error of one sequence's attention against the float64 oracle over its tokens.
double error_vs_oracle(const AttnShape& sh, DType dtype, int64_t id, int layer, int64_t len,
                       const std::vector<float>& q, const float* out, const float* lse) {
  AttnShape one = sh;
  one.batch = 1;
  KVCache cache(one, dtype, std::max<int64_t>(1, len));
  const auto k = kv_range(sh, id, layer, 1, 0, len), v = kv_range(sh, id, layer, 2, 0, len);
  const int64_t per = sh.kv_heads * sh.head_dim;
  for (int64_t t = 0; t < len; ++t)
    for (int64_t h = 0; h < sh.kv_heads; ++h)
      cache.set_token(0, h, t, k.data() + t * per + h * sh.head_dim,
                      v.data() + t * per + h * sh.head_dim);
  const std::vector<int64_t> lens = {len}, zeros = {0};
  const KVShard view = cache.view(0, lens, zeros, lens, 1);
  std::vector<double> ref(q.size()), ref_lse(static_cast<std::size_t>(sh.q_len * sh.heads));
  if (!oracle_attention(one, q.data(), view, ref.data(), ref_lse.data()).is_ok()) return INFINITY;
  double worst = 0, mag = 1;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    worst = std::max(worst, std::fabs(out[i] - ref[i]));
    mag = std::max(mag, std::fabs(ref[i]));
  }
  double err = worst / mag;
  for (std::size_t i = 0; i < ref_lse.size(); ++i)
    err = std::max(err, std::fabs(lse[i] - ref_lse[i]) / std::max(1.0, std::fabs(ref_lse[i])));
  return err;
}

struct SeqCase {
  std::string strategy = "tree";
  ShardKind placement = ShardKind::kEven;
  DType dtype = DType::kF32;
  int64_t q_len = 1;
};

// The serving-shaped loop on p ranks; returns the first failure ("" when all passed).
std::string run_sequences(const SeqCase& c, int p) {
  std::mutex mu;
  std::string failure;
  auto fail = [&](const std::string& m) {
    std::lock_guard<std::mutex> lock(mu);
    if (failure.empty()) failure = m;
  };
  const Status st = run_local(p, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{4, 6, 2, 80, c.q_len};  // 4 sequence slots, GQA 3:1, head_dim 80
    cfg.dtype = c.dtype;
    cfg.layers = 2;
    cfg.placement = c.placement;
    cfg.strategy = c.strategy;
    cfg.rows_start_free = true;
    cfg.timeout = std::chrono::milliseconds(20000);
    cfg.options.kernel.threads = 1;
    auto created = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(created.status());
    DecodeSession& s = **created;
    const AttnShape& sh = cfg.shape;
    const std::string who = "rank " + std::to_string(comm.rank()) + ": ";
    std::map<int64_t, int64_t> id_of;  // row -> sequence id
    int64_t next_id = 1;

    auto add = [&](int64_t expect_row) -> Status {
      auto row = s.add_sequence();
      TREEATTN_RETURN_IF_ERROR(row.status());
      if (*row != expect_row)
        fail(who + "add_sequence gave row " + std::to_string(*row) + ", expected " +
             std::to_string(expect_row));
      id_of[*row] = next_id++;
      return Status::ok();
    };
    // Grows a sequence by n tokens and stores them, every layer, a range at a time.
    auto grow = [&](int64_t row, int64_t n) -> Status {
      const int64_t pos0 = s.length(row);
      TREEATTN_RETURN_IF_ERROR(s.extend(row, n));
      for (int l = 0; l < cfg.layers; ++l) {
        const auto k = kv_range(sh, id_of[row], l, 1, pos0, n);
        const auto v = kv_range(sh, id_of[row], l, 2, pos0, n);
        TREEATTN_RETURN_IF_ERROR(s.store_range(l, row, pos0, n, k.data(), v.data()));
      }
      return Status::ok();
    };
    auto check = [&](const std::vector<int64_t>& rows, int64_t step) -> Status {
      const auto qrow = static_cast<std::size_t>(sh.q_len * sh.heads * sh.head_dim);
      const auto lrow = static_cast<std::size_t>(sh.q_len * sh.heads);
      for (int l = 0; l < cfg.layers; ++l) {
        std::vector<float> q;
        for (int64_t r : rows) {
          const auto qr = queries(sh, id_of[r], l, step);
          q.insert(q.end(), qr.begin(), qr.end());
        }
        std::vector<float> out(q.size(), NAN), lse(rows.size() * lrow, NAN);
        TREEATTN_RETURN_IF_ERROR(s.attend(l, rows, q.data(), out.data(), lse.data()));
        for (std::size_t i = 0; i < rows.size(); ++i) {
          const double e = error_vs_oracle(
              sh, c.dtype, id_of[rows[i]], l, s.length(rows[i]),
              std::vector<float>(q.begin() + static_cast<std::ptrdiff_t>(i * qrow),
                                 q.begin() + static_cast<std::ptrdiff_t>((i + 1) * qrow)),
              out.data() + i * qrow, lse.data() + i * lrow);
          if (!(e <= 1e-5))
            fail(who + "layer " + std::to_string(l) + " step " + std::to_string(step) +
                 " sequence in row " + std::to_string(rows[i]) + " (length " +
                 std::to_string(s.length(rows[i])) + "): relative error " + std::to_string(e));
        }
      }
      return Status::ok();
    };

    TREEATTN_RETURN_IF_ERROR(add(0));
    TREEATTN_RETURN_IF_ERROR(grow(0, 37));  // a prompt laid out by the placement
    TREEATTN_RETURN_IF_ERROR(add(1));
    TREEATTN_RETURN_IF_ERROR(grow(1, 3));  // fewer tokens than ranks at p = 5, 8
    TREEATTN_RETURN_IF_ERROR(check({0, 1}, 0));
    for (int64_t step = 1; step <= 3; ++step) {  // decode steps: each grows by q_len tokens
      TREEATTN_RETURN_IF_ERROR(grow(0, c.q_len));
      TREEATTN_RETURN_IF_ERROR(grow(1, c.q_len));
      TREEATTN_RETURN_IF_ERROR(check({1, 0}, step));  // any order
    }
    TREEATTN_RETURN_IF_ERROR(s.remove_sequence(0));
    if (s.live(0) || s.live_sequences() != 1) fail(who + "row 0 still live after remove");
    TREEATTN_RETURN_IF_ERROR(add(0));  // the lowest free row again, with new tokens
    TREEATTN_RETURN_IF_ERROR(grow(0, 20));  // shorter than the 40 it held: stale slots remain
    TREEATTN_RETURN_IF_ERROR(check({0}, 4));
    TREEATTN_RETURN_IF_ERROR(grow(0, 50));
    TREEATTN_RETURN_IF_ERROR(check({0, 1}, 5));
    TREEATTN_RETURN_IF_ERROR(add(2));
    TREEATTN_RETURN_IF_ERROR(add(3));
    TREEATTN_RETURN_IF_ERROR(grow(3, 11));
    TREEATTN_RETURN_IF_ERROR(grow(2, 1 + c.q_len));
    TREEATTN_RETURN_IF_ERROR(check({3, 1, 2, 0}, 6));
    auto full = s.add_sequence();
    if (full.status().code() != Code::kOutOfMemory)
      fail(who + "a fifth sequence in 4 slots: " + full.status().to_string());
    return Status::ok();
  });
  if (!st.is_ok()) return st.to_string();
  return failure;
}

TEST(SessionSequences, JoinLeaveAndGrowAloneMatchTheOracle) {
  const std::vector<SeqCase> cases = {
      {"tree", ShardKind::kEven},          {"tree", ShardKind::kStriped},
      {"allgather", ShardKind::kUneven},   {"ring-state", ShardKind::kEven},
      {"ring-kv", ShardKind::kEven},       {"tree-det", ShardKind::kEven},
      {"single", ShardKind::kSingle},      {"tree", ShardKind::kEven, DType::kF16},
      {"tree", ShardKind::kStriped, DType::kF32, 3},
  };
  for (const SeqCase& c : cases)
    for (int p : {1, 2, 3, 5, 8}) {
      if ((c.strategy == "ring-kv" || c.strategy == "tree-det") && p > 5) continue;  // time
      EXPECT_EQ(run_sequences(c, p), "")
          << c.strategy << " " << shard_kind_name(c.placement) << " " << dtype_name(c.dtype)
          << " q_len " << c.q_len << " p " << p;
    }
}

TEST(SessionSequences, ErrorsNameTheSequenceAndNeverHang) {
  const Status st = run_local(3, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{2, 4, 2, 64, 1};
    cfg.rows_start_free = true;
    cfg.timeout = std::chrono::milliseconds(20000);
    auto created = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(created.status());
    DecodeSession& s = **created;
    std::vector<float> kv(64 * 2 * 8, 0.5f), q(4 * 64, 0.1f), out(q.size());
    const auto expect = [](const Status& got, const std::string& want) {
      EXPECT_FALSE(got.is_ok()) << want;
      EXPECT_NE(got.message().find(want), std::string::npos) << got.to_string();
    };
    expect(s.extend(0, 4), "sequence 0 is not live");
    expect(s.extend(5), "row 0 is a free sequence slot");
    expect(s.append(kv.data(), kv.data()), "free sequence slot");
    auto a = s.add_sequence();
    EXPECT_TRUE(a.is_ok());
    expect(s.extend(*a, -1), "n must be >= 0");
    EXPECT_TRUE(s.extend(*a, 4).is_ok());
    expect(s.store_range(0, *a, 2, 3, kv.data(), kv.data()), "positions 2 + 3 of sequence 0");
    expect(s.store_range(0, 7, 0, 1, kv.data(), kv.data()), "sequence 7 is outside [0, 2)");
    expect(s.store_range(3, *a, 0, 1, kv.data(), kv.data()), "layer 3");
    EXPECT_TRUE(s.store_range(0, *a, 0, 4, kv.data(), kv.data()).is_ok());
    const std::vector<int64_t> twice = {0, 0}, dead = {1};
    expect(s.attend(0, twice, q.data(), out.data()), "listed twice");
    expect(s.attend(0, dead, q.data(), out.data()), "sequence 1 is not live");
    EXPECT_TRUE(s.attend(0, std::vector<int64_t>{0}, q.data(), out.data()).is_ok());
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  // A session of free slots cannot start with context.
  const Status bad = run_local(2, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{2, 4, 2, 64, 1};
    cfg.rows_start_free = true;
    cfg.context = {8};
    return DecodeSession::create(comm, cfg).status();
  });
  EXPECT_NE(bad.message().find("context must be empty"), std::string::npos) << bad.to_string();
}

// Growth that could never fit is refused at once (not token by token), and the session keeps
// its length and stays usable: the placement never counts tokens it has no room for.
TEST(SessionSequences, GrowthBeyondMemoryIsRefusedAtOnceAndLeavesTheSessionUsable) {
  const Status st = run_local(2, [&](Communicator& comm) -> Status {
    SessionConfig cfg;
    cfg.shape = AttnShape{2, 4, 2, 64, 1};
    cfg.context = {16};
    cfg.timeout = std::chrono::milliseconds(20000);
    auto created = DecodeSession::create(comm, cfg);
    TREEATTN_RETURN_IF_ERROR(created.status());
    DecodeSession& s = **created;
    const Status all = s.extend(int64_t{1} << 62);
    EXPECT_EQ(all.code(), Code::kOutOfMemory) << all.to_string();
    EXPECT_EQ(s.length(0), 16);
    EXPECT_TRUE(s.remove_sequence(1).is_ok());
    const Status one = s.extend(0, int64_t{1} << 61);
    EXPECT_EQ(one.code(), Code::kOutOfMemory) << one.to_string();
    EXPECT_EQ(s.length(0), 16);
    std::vector<float> q(4 * 64, 0.25f), out(q.size(), NAN);
    TREEATTN_RETURN_IF_ERROR(s.attend(0, std::vector<int64_t>{0}, q.data(), out.data()));
    for (float x : out) EXPECT_TRUE(std::isfinite(x));
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

}  // namespace
}  // namespace treeattn
