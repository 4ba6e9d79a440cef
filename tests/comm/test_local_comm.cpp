// The in-process communicator (comm_local.hpp) against the Communicator contract (comm.hpp).
//
// Every operation runs at 1, 2, 3, 5, 8, 13 and 16 ranks (threads): results are compared bit
// for bit with a reference computed in rank order 0..p-1 (the order the backend promises), so a
// reduction that differs between ranks or from the rank order fails. Then the ordering contract
// (messages between a pair match by posting order whatever the tags), splits, counters counted
// as the MPI backend counts them, timeouts that name the rank that never arrived within bounded
// time, mismatched collectives and message sizes, and ranks that return early.
//
// Each rank's body returns a Status; a failed check becomes an error naming the rank, and the
// test asserts on what run_local returns.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <latch>
#include <mutex>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kRankCounts[] = {1, 2, 3, 5, 8, 13, 16};

// An error naming the rank when a check fails.
Status expect(bool ok, const Communicator& c, const std::string& what) {
  if (ok) return Status::ok();
  return internal_error("rank " + std::to_string(c.world_rank()) + ": " + what);
}

Status expect_status(const Status& s, Code code, const std::string& needle, const Communicator& c,
                     const std::string& what) {
  if (s.code() == code && s.message().find(needle) != std::string::npos) return Status::ok();
  return internal_error("rank " + std::to_string(c.world_rank()) + ": " + what + ": expected " +
                        code_name(code) + " containing '" + needle + "', got " + s.to_string());
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Rank r's contribution to float reductions: values of mixed magnitude and sign, so that the
// summation order changes the rounded result.
std::vector<float> contribution(int r, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = std::ldexp(static_cast<float>((r * 131 + static_cast<int>(i) * 7) % 97) - 48.0f,
                      static_cast<int>((i + static_cast<std::size_t>(r)) % 7) - 3) +
           0.1f * static_cast<float>(r);
  return v;
}

// Rank r's partial states: random records, one empty record per rank, and a record whose m is
// -0 on odd ranks and +0 on even ones (the merge must give +0 everywhere).
constexpr std::size_t kRecs = 6, kDim = 8;
std::vector<float> partial_states(int r) {
  const std::size_t rec = state_record_floats(kDim);
  std::vector<float> s(kRecs * rec);
  std::mt19937_64 rng(1000 + static_cast<uint64_t>(r));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < kRecs; ++i) {
    float* x = s.data() + i * rec;
    state_m(x) = 6.0f * u(rng);
    state_l(x) = 1.0f + 3.0f * (u(rng) + 1.0f);
    for (std::size_t d = 0; d < kDim; ++d) state_o(x)[d] = 5.0f * u(rng);
  }
  state_set_empty(s.data() + static_cast<std::size_t>(r) % (kRecs - 1) * rec, kDim);
  state_m(s.data() + (kRecs - 1) * rec) = r % 2 ? -0.0f : 0.0f;
  return s;
}

std::vector<uint8_t> pattern(int r, std::size_t bytes, int salt) {
  std::vector<uint8_t> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i)
    v[i] = static_cast<uint8_t>(r * 37 + static_cast<int>(i) * 11 + salt * 101);
  return v;
}

class LocalComm : public ::testing::TestWithParam<int> {};

TEST_P(LocalComm, AllreduceSumAndMaxAreTheRankOrderResultOnEveryRank) {
  const int p = GetParam();
  constexpr std::size_t n = 37;
  std::vector<float> sum = contribution(0, n), max = sum;
  for (int r = 1; r < p; ++r) {
    const std::vector<float> x = contribution(r, n);
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] = sum[i] + x[i];
      max[i] = std::max(max[i], x[i]);
    }
  }
  Status s = run_local(p, [&](Communicator& c) -> Status {
    TREEATTN_RETURN_IF_ERROR(expect(c.size() == p && c.world_rank() == c.rank(), c, "identity"));
    TREEATTN_RETURN_IF_ERROR(expect(c.backend_name() == "local", c, "backend name"));
    const CommCapabilities caps = c.capabilities();
    TREEATTN_RETURN_IF_ERROR(
        expect(caps.memory == MemorySpace::kHost && caps.user_reductions && !caps.stream_ordered, c,
               "capabilities"));
    std::vector<float> a = contribution(c.rank(), n), b = a;
    TREEATTN_RETURN_IF_ERROR(c.allreduce(a.data(), n, ReduceOp::kSum));
    TREEATTN_RETURN_IF_ERROR(expect(same_bits(a, sum), c, "allreduce SUM differs from rank order"));
    TREEATTN_RETURN_IF_ERROR(c.allreduce(b.data(), n, ReduceOp::kMax));
    TREEATTN_RETURN_IF_ERROR(expect(same_bits(b, max), c, "allreduce MAX"));
    TREEATTN_RETURN_IF_ERROR(c.allreduce(nullptr, 0, ReduceOp::kSum));  // empty is fine
    // NaN on one rank propagates through MAX to every rank.
    float v = c.rank() == p - 1 ? NAN : static_cast<float>(c.rank());
    TREEATTN_RETURN_IF_ERROR(c.allreduce(&v, 1, ReduceOp::kMax));
    return expect(std::isnan(v), c, "MAX dropped a NaN");
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST_P(LocalComm, ReduceDeliversToTheRootOnlyForEveryRoot) {
  const int p = GetParam();
  constexpr std::size_t n = 19;
  std::vector<float> sum = contribution(0, n);
  for (int r = 1; r < p; ++r) {
    const std::vector<float> x = contribution(r, n);
    for (std::size_t i = 0; i < n; ++i) sum[i] = sum[i] + x[i];
  }
  Status s = run_local(p, [&](Communicator& c) -> Status {
    for (int root : {0, p / 2, p - 1}) {
      std::vector<float> a = contribution(c.rank(), n);
      TREEATTN_RETURN_IF_ERROR(c.reduce(a.data(), n, ReduceOp::kSum, root));
      const bool ok =
          c.rank() == root ? same_bits(a, sum) : same_bits(a, contribution(c.rank(), n));
      TREEATTN_RETURN_IF_ERROR(expect(ok, c, "reduce to root " + std::to_string(root)));
    }
    return Status::ok();
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST_P(LocalComm, StateReductionsMergeInRankOrderBitForBit) {
  const int p = GetParam();
  std::vector<float> merged = partial_states(0);
  for (int r = 1; r < p; ++r) {
    const std::vector<float> x = partial_states(r);
    state_merge_n(merged.data(), x.data(), kRecs, kDim);
  }
  ASSERT_EQ(std::signbit(state_m(merged.data() + (kRecs - 1) * state_record_floats(kDim))), false);
  Status s = run_local(p, [&](Communicator& c) -> Status {
    std::vector<float> a = partial_states(c.rank());
    TREEATTN_RETURN_IF_ERROR(c.allreduce_states(a.data(), kRecs, kDim));
    TREEATTN_RETURN_IF_ERROR(expect(same_bits(a, merged), c, "allreduce_states"));
    // And every rank's bits equal every other rank's (the same check the strategies test runs).
    std::vector<float> all(a.size() * static_cast<std::size_t>(p));
    TREEATTN_RETURN_IF_ERROR(c.allgather(a.data(), a.size() * sizeof(float), all.data()));
    for (int r = 0; r < p; ++r)
      TREEATTN_RETURN_IF_ERROR(
          expect(std::memcmp(all.data() + a.size() * static_cast<std::size_t>(r), a.data(),
                             a.size() * sizeof(float)) == 0,
                 c, "rank " + std::to_string(r) + " got other bits"));
    const int root = p - 1;
    std::vector<float> b = partial_states(c.rank());
    TREEATTN_RETURN_IF_ERROR(c.reduce_states(b.data(), kRecs, kDim, root));
    const bool ok =
        c.rank() == root ? same_bits(b, merged) : same_bits(b, partial_states(c.rank()));
    return expect(ok, c, "reduce_states");
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST_P(LocalComm, AllgatherGatherBroadcastBarrier) {
  const int p = GetParam();
  std::atomic<int> arrived{0};
  Status s = run_local(p, [&](Communicator& c) -> Status {
    const int me = c.rank();
    constexpr std::size_t kBytes = 13;
    const std::vector<uint8_t> mine = pattern(me, kBytes, 1);
    std::vector<uint8_t> all(kBytes * static_cast<std::size_t>(p), 0);
    TREEATTN_RETURN_IF_ERROR(c.allgather(mine.data(), kBytes, all.data()));
    for (int r = 0; r < p; ++r)
      TREEATTN_RETURN_IF_ERROR(expect(std::memcmp(all.data() + kBytes * static_cast<std::size_t>(r),
                                                  pattern(r, kBytes, 1).data(), kBytes) == 0,
                                      c, "allgather slot " + std::to_string(r)));

    const int groot = p / 2;
    std::vector<uint8_t> gathered(me == groot ? kBytes * static_cast<std::size_t>(p) : 0);
    TREEATTN_RETURN_IF_ERROR(
        c.gather(mine.data(), kBytes, me == groot ? gathered.data() : nullptr, groot));
    if (me == groot)
      for (int r = 0; r < p; ++r)
        TREEATTN_RETURN_IF_ERROR(
            expect(std::memcmp(gathered.data() + kBytes * static_cast<std::size_t>(r),
                               pattern(r, kBytes, 1).data(), kBytes) == 0,
                   c, "gather slot " + std::to_string(r)));

    const int broot = p - 1;
    std::vector<uint8_t> b = me == broot ? pattern(broot, 21, 2) : std::vector<uint8_t>(21, 0);
    TREEATTN_RETURN_IF_ERROR(c.broadcast(b.data(), b.size(), broot));
    TREEATTN_RETURN_IF_ERROR(expect(b == pattern(broot, 21, 2), c, "broadcast"));

    // Nobody leaves barrier k before everyone has entered it.
    for (int k = 1; k <= 3; ++k) {
      arrived.fetch_add(1);
      TREEATTN_RETURN_IF_ERROR(c.barrier());
      TREEATTN_RETURN_IF_ERROR(
          expect(arrived.load() >= k * p, c, "left barrier " + std::to_string(k) + " early"));
      TREEATTN_RETURN_IF_ERROR(c.barrier());
    }
    return Status::ok();
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// Every rank sends three messages to every rank (itself included) with tags in an order
// unrelated to the receiver's tags and sizes 24, 0, 40; receives match by posting order. Even
// ranks post their receives first, odd ranks their sends, so both sides of the match run.
TEST_P(LocalComm, PointToPointMatchesByPostingOrderWhateverTheTags) {
  const int p = GetParam();
  const std::size_t sizes[3] = {24, 0, 40};
  const int send_tags[3] = {9, 3, 9}, recv_tags[3] = {1, 2, 3};
  Status s = run_local(p, [&](Communicator& c) -> Status {
    const int me = c.rank();
    std::vector<std::vector<uint8_t>> out, in;
    for (int peer = 0; peer < p; ++peer)
      for (int k = 0; k < 3; ++k) {
        out.push_back(pattern(me * 1000 + peer, sizes[k], k));
        in.emplace_back(sizes[k], 0);
      }
    std::vector<CommRequest> reqs;
    auto post_sends = [&]() -> Status {
      for (int peer = 0; peer < p; ++peer)
        for (int k = 0; k < 3; ++k) {
          const auto& m = out[static_cast<std::size_t>(peer * 3 + k)];
          auto r = c.isend(m.data(), m.size(), (me + peer) % p, send_tags[k]);
          TREEATTN_RETURN_IF_ERROR(r.status());
          reqs.push_back(*r);
        }
      return Status::ok();
    };
    auto post_recvs = [&]() -> Status {
      for (int peer = 0; peer < p; ++peer)
        for (int k = 0; k < 3; ++k) {
          auto& m = in[static_cast<std::size_t>(peer * 3 + k)];
          auto r = c.irecv(m.data(), m.size(), peer, recv_tags[k]);
          TREEATTN_RETURN_IF_ERROR(r.status());
          reqs.push_back(*r);
        }
      return Status::ok();
    };
    if (me % 2 == 0) {
      TREEATTN_RETURN_IF_ERROR(post_recvs());
      TREEATTN_RETURN_IF_ERROR(post_sends());
    } else {
      TREEATTN_RETURN_IF_ERROR(post_sends());
      TREEATTN_RETURN_IF_ERROR(post_recvs());
    }
    for (;;) {  // test_all drives nothing here, but must report completion and keep handles
      auto done = c.test_all(reqs);
      TREEATTN_RETURN_IF_ERROR(done.status());
      if (*done) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    TREEATTN_RETURN_IF_ERROR(c.wait_all(reqs));
    for (int peer = 0; peer < p; ++peer)
      for (int k = 0; k < 3; ++k)
        TREEATTN_RETURN_IF_ERROR(
            expect(in[static_cast<std::size_t>(peer * 3 + k)] ==
                       pattern(peer * 1000 + (me - peer + p) % p, sizes[k], k),
                   c, "message " + std::to_string(k) + " from rank " + std::to_string(peer)));
    // The handles are gone after wait_all.
    auto again = c.wait_all(std::span<const CommRequest>(reqs.data(), reqs.empty() ? 0 : 1));
    return expect_status(again, Code::kInvalidArgument, "invalid request handle", c, "reuse");
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// Ranks with equal color, ordered by (key, rank): keys reverse the order here. Nested splits,
// color < 0 (no communicator), split_shared by the emulated nodes, and traffic on the pieces.
TEST_P(LocalComm, SplitsOrderByKeyThenRankAndGroupByNode) {
  const int p = GetParam();
  LocalWorldOptions nodes;
  for (int r = 0; r < p; ++r) nodes.node_of_rank.push_back(r / 4);
  Status s = run_local(
      p,
      [&](Communicator& c) -> Status {
        const int me = c.rank();
        const int color = (p > 1 && me == p - 1) ? -1 : me % 3;
        auto sub = c.split(color, -me);
        TREEATTN_RETURN_IF_ERROR(sub.status());
        if (color < 0) {
          TREEATTN_RETURN_IF_ERROR(expect(*sub == nullptr, c, "color -1 got a communicator"));
        } else {
          std::vector<int> members;  // in the expected order: descending world rank
          for (int r = p - 1; r >= 0; --r)
            if (!(p > 1 && r == p - 1) && r % 3 == color) members.push_back(r);
          Communicator& g = **sub;
          const auto pos = std::find(members.begin(), members.end(), me) - members.begin();
          TREEATTN_RETURN_IF_ERROR(expect(g.size() == static_cast<int>(members.size()) &&
                                              g.rank() == static_cast<int>(pos) &&
                                              g.world_rank() == me,
                                          c, "split rank/size"));
          std::vector<float> who = {static_cast<float>(me)};
          std::vector<float> all(members.size());
          TREEATTN_RETURN_IF_ERROR(g.allgather(who.data(), sizeof(float), all.data()));
          for (std::size_t i = 0; i < members.size(); ++i)
            TREEATTN_RETURN_IF_ERROR(
                expect(all[i] == static_cast<float>(members[i]), c, "split member order"));
          // A ring on the sub-communicator.
          const int n = g.size(), next = (g.rank() + 1) % n, prev = (g.rank() + n - 1) % n;
          int got = -1, mine = me;
          auto rq = g.irecv(&got, sizeof(int), prev, 5);
          TREEATTN_RETURN_IF_ERROR(rq.status());
          auto sq = g.isend(&mine, sizeof(int), next, 5);
          TREEATTN_RETURN_IF_ERROR(sq.status());
          const CommRequest both[2] = {*rq, *sq};
          TREEATTN_RETURN_IF_ERROR(g.wait_all(both));
          TREEATTN_RETURN_IF_ERROR(
              expect(got == members[static_cast<std::size_t>(prev)], c, "ring on a split"));
          // Split of a split: everyone of the piece in one group, ordered by rank (equal keys).
          auto again = g.split(0, 0);
          TREEATTN_RETURN_IF_ERROR(again.status());
          TREEATTN_RETURN_IF_ERROR(
              expect((*again)->size() == n && (*again)->rank() == g.rank(), c, "nested split"));
        }
        // Emulated nodes of 4 ranks; the key puts rank order backwards inside a node.
        auto node = c.split_shared(p - me);
        TREEATTN_RETURN_IF_ERROR(node.status());
        const int first = me / 4 * 4, last = std::min(p, first + 4) - 1;
        TREEATTN_RETURN_IF_ERROR(
            expect((*node)->size() == last - first + 1 && (*node)->rank() == last - me, c,
                   "split_shared by node"));
        float sum = static_cast<float>(me);
        TREEATTN_RETURN_IF_ERROR((*node)->allreduce(&sum, 1, ReduceOp::kSum));
        return expect(sum == static_cast<float>((first + last) * (last - first + 1) / 2), c,
                      "allreduce inside a node");
      },
      nodes);
  EXPECT_TRUE(s.is_ok()) << s.to_string();

  // Without node ids every rank is on one node.
  s = run_local(p, [&](Communicator& c) -> Status {
    auto node = c.split_shared(0);
    TREEATTN_RETURN_IF_ERROR(node.status());
    return expect((*node)->size() == p && (*node)->rank() == c.rank(), c, "one node by default");
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// Counted as the MPI backend counts: one call and this rank's buffer bytes per collective
// (whatever the root), the payload of every isend, nothing for irecv and splits; shared with
// communicators split from it.
TEST_P(LocalComm, CountersCountWhatTheMpiBackendCounts) {
  const int p = GetParam();
  Status s = run_local(p, [&](Communicator& c) -> Status {
    const int me = c.rank();
    std::vector<float> f(5, 1.0f), st(3 * state_record_floats(4));
    for (std::size_t i = 0; i < 3; ++i) state_set_empty(st.data() + i * state_record_floats(4), 4);
    std::vector<uint8_t> send(11), recv(11 * static_cast<std::size_t>(p));
    TREEATTN_RETURN_IF_ERROR(c.allreduce(f.data(), 5, ReduceOp::kSum));                      // 20
    TREEATTN_RETURN_IF_ERROR(c.reduce(f.data(), 3, ReduceOp::kMax, 0));                      // 12
    TREEATTN_RETURN_IF_ERROR(c.allreduce_states(st.data(), 3, 4));                           // 72
    TREEATTN_RETURN_IF_ERROR(c.reduce_states(st.data(), 2, 4, p - 1));                       // 48
    TREEATTN_RETURN_IF_ERROR(c.allgather(send.data(), 9, recv.data()));                      // 9
    TREEATTN_RETURN_IF_ERROR(c.gather(send.data(), 7, me == 0 ? recv.data() : nullptr, 0));  // 7
    TREEATTN_RETURN_IF_ERROR(c.broadcast(send.data(), 11, 0));                               // 11
    TREEATTN_RETURN_IF_ERROR(c.barrier());                                                   // 0
    auto sub = c.split(0, 0);
    TREEATTN_RETURN_IF_ERROR(sub.status());
    TREEATTN_RETURN_IF_ERROR((*sub)->allreduce(f.data(), 2, ReduceOp::kSum));  // 8
    // Two messages to the next rank on c (100 and 0 bytes) and one of 10 bytes on *sub.
    std::vector<uint8_t> out(100), in(100), out2(10), in2(10);
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    std::vector<CommRequest> reqs;
    for (std::size_t n : {std::size_t{100}, std::size_t{0}}) {
      auto r = c.irecv(in.data(), n, prev, 1);
      TREEATTN_RETURN_IF_ERROR(r.status());
      reqs.push_back(*r);
      auto q = c.isend(out.data(), n, next, 1);
      TREEATTN_RETURN_IF_ERROR(q.status());
      reqs.push_back(*q);
    }
    TREEATTN_RETURN_IF_ERROR(c.wait_all(reqs));
    auto r2 = (*sub)->irecv(in2.data(), in2.size(), prev, 2);
    TREEATTN_RETURN_IF_ERROR(r2.status());
    auto s2 = (*sub)->isend(out2.data(), out2.size(), next, 2);
    TREEATTN_RETURN_IF_ERROR(s2.status());
    const CommRequest on_sub[2] = {*r2, *s2};
    TREEATTN_RETURN_IF_ERROR((*sub)->wait_all(on_sub));
    const CommCounters& k = c.counters();
    TREEATTN_RETURN_IF_ERROR(expect(k.collective_calls == 9, c,
                                    "collective_calls " + std::to_string(k.collective_calls)));
    TREEATTN_RETURN_IF_ERROR(
        expect(k.collective_payload_bytes == 20 + 12 + 72 + 48 + 9 + 7 + 11 + 8, c,
               "collective_payload_bytes " + std::to_string(k.collective_payload_bytes)));
    TREEATTN_RETURN_IF_ERROR(expect(k.p2p_bytes == 110 && k.p2p_messages == 3, c,
                                    "p2p " + std::to_string(k.p2p_bytes) + " bytes in " +
                                        std::to_string(k.p2p_messages) + " messages"));
    return expect(&(*sub)->counters() == &c.counters(), c, "split shares the counters");
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

std::string rank_counts_name(const ::testing::TestParamInfo<int>& info) {
  return "p" + std::to_string(info.param);
}
INSTANTIATE_TEST_SUITE_P(Ranks, LocalComm, ::testing::ValuesIn(kRankCounts), rank_counts_name);

// ---- failures ----------------------------------------------------------------------------------

// The last rank never enters the collective: every other rank times out within bounds, names
// it, and cannot use the communicator afterwards; the late rank fails at once when it arrives.
class LocalCommTimeout : public ::testing::TestWithParam<int> {};

TEST_P(LocalCommTimeout, CollectiveNamesTheRankThatNeverArrived) {
  const int p = GetParam();
  const int missing = p - 1;
  std::latch others_done(p - 1);
  std::vector<Status> got(static_cast<std::size_t>(p));
  std::vector<double> ms(static_cast<std::size_t>(p), 0);
  Status s = run_local(p, [&](Communicator& c) -> Status {
    const int me = c.rank();
    c.set_timeout(milliseconds(200));
    c.set_context("step 3");
    TREEATTN_RETURN_IF_ERROR(c.barrier());
    std::vector<float> st(2 * state_record_floats(4), 0.0f);
    if (me == missing) {
      others_done.wait();
      got[static_cast<std::size_t>(me)] = c.allreduce_states(st.data(), 2, 4);
      return Status::ok();
    }
    const auto t0 = Clock::now();
    got[static_cast<std::size_t>(me)] = c.allreduce_states(st.data(), 2, 4);
    ms[static_cast<std::size_t>(me)] =
        std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    Status later = c.barrier();
    others_done.count_down();
    return expect_status(later, Code::kInternal, "called on a communicator that already failed", c,
                         "call after a timeout");
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < missing; ++r) {
    const Status& g = got[static_cast<std::size_t>(r)];
    EXPECT_EQ(g.code(), Code::kTimeout) << g.to_string();
    const std::regex want("rank " + std::to_string(r) +
                          ": timed out after 2[0-9][0-9] ms in allreduce_states at step 3 "
                          "\\(collective #2\\); rank " +
                          std::to_string(missing) + " never arrived");
    EXPECT_TRUE(std::regex_search(g.message(), want)) << g.message();
    EXPECT_GE(ms[static_cast<std::size_t>(r)], 199.0);
    EXPECT_LT(ms[static_cast<std::size_t>(r)], 2000.0);
  }
  const Status& late = got[static_cast<std::size_t>(missing)];
  EXPECT_EQ(late.code(), Code::kTimeout) << late.to_string();
  EXPECT_NE(late.message().find("rank " + std::to_string(missing) +
                                ": gave up after 0 ms in allreduce_states at step 3 (collective "
                                "#2): it cannot complete; rank 0 failed earlier (timed out in "
                                "allreduce_states at step 3 (collective #2))"),
            std::string::npos)
      << late.message();
}

TEST_P(LocalCommTimeout, WaitAllNamesThePeerItWaitsFor) {
  const int p = GetParam();
  std::latch done(1);
  Status result;
  Status s = run_local(p, [&](Communicator& c) -> Status {
    c.set_timeout(milliseconds(150));
    c.set_context("step 3");
    if (c.rank() == 0) {
      int x = 0;
      auto r = c.irecv(&x, sizeof(x), p - 1, 7);
      TREEATTN_RETURN_IF_ERROR(r.status());
      const CommRequest reqs[1] = {*r};
      result = c.wait_all(reqs);
      done.count_down();
    } else if (c.rank() == p - 1) {
      done.wait();
    }
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(result.code(), Code::kTimeout);
  const std::regex want(
      "rank 0: timed out after 1[5-9][0-9] ms in wait_all \\(point-to-point\\) "
      "at step 3; still waiting to receive from rank " +
      std::to_string(p - 1) + " \\(tag 7\\)");
  EXPECT_TRUE(std::regex_search(result.message(), want)) << result.message();
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalCommTimeout, ::testing::Values(2, 4, 16), rank_counts_name);

// A rank blocked elsewhere is named with where it waits: ranks 0, 1, 3 in a world allreduce,
// rank 2 in a barrier of its half that waits for rank 3. Rank 2 waits longer (timeouts are per
// rank), and the others stay until it is done, so what each sees does not depend on timing.
TEST(LocalCommFailures, TimeoutSaysWhereTheMissingRankWaits) {
  std::vector<Status> got(4);
  std::latch rank2_done(1);
  Status s = run_local(4, [&](Communicator& c) -> Status {
    c.set_timeout(milliseconds(c.rank() == 2 ? 500 : 150));
    auto half = c.split(c.rank() / 2, 0);
    TREEATTN_RETURN_IF_ERROR(half.status());
    c.set_context("step 1");
    float x = 1.0f;
    got[static_cast<std::size_t>(c.rank())] =
        c.rank() == 2 ? (*half)->barrier() : c.allreduce(&x, 1, ReduceOp::kSum);
    if (c.rank() == 2)
      rank2_done.count_down();
    else
      rank2_done.wait();
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_NE(got[0].message().find("rank 0: timed out after"), std::string::npos);
  EXPECT_NE(got[0].message().find("in allreduce at step 1 (collective #2); rank 2 never arrived; "
                                  "rank 2 is waiting in barrier (collective #1) at step 1"),
            std::string::npos)
      << got[0].message();
  EXPECT_NE(got[2].message().find("in barrier at step 1 (collective #1); rank 3 never arrived"),
            std::string::npos)
      << got[2].message();
}

// Ranks calling different collectives, or the same with different counts, get kMismatch naming
// both calls, instead of a hang or a buffer overrun; the communicator is unusable afterwards.
TEST(LocalCommFailures, MismatchedCollectivesAreReportedOnEveryRank) {
  for (int p : {2, 5, 16}) {
    std::vector<Status> first(static_cast<std::size_t>(p)), second(static_cast<std::size_t>(p));
    Status s = run_local(p, [&](Communicator& c) -> Status {
      const auto me = static_cast<std::size_t>(c.rank());
      c.set_context("step 0");
      std::vector<float> buf(64 * static_cast<std::size_t>(p), 0.0f);
      if (c.rank() == 0)
        first[me] = c.allreduce(buf.data(), 4, ReduceOp::kSum);
      else
        first[me] = c.gather(buf.data(), 16, buf.data(), 0);
      second[me] = c.barrier();
      return Status::ok();
    });
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    for (int r = 0; r < p; ++r) {
      const Status& g = first[static_cast<std::size_t>(r)];
      EXPECT_EQ(g.code(), Code::kMismatch) << g.to_string();
      EXPECT_NE(g.message().find("rank " + std::to_string(r) + ": "), std::string::npos);
      EXPECT_NE(g.message().find("collective #1 does not match across ranks: rank 0 called "
                                 "allreduce(count=4, op=sum), rank 1 called gather(bytes=16, "
                                 "root=0)"),
                std::string::npos)
          << g.message();
      EXPECT_EQ(second[static_cast<std::size_t>(r)].code(), Code::kInternal);
    }
  }
  // Same operation, different counts.
  std::vector<Status> got(3);
  Status s = run_local(3, [&](Communicator& c) -> Status {
    std::vector<float> buf(8, 1.0f);
    got[static_cast<std::size_t>(c.rank())] =
        c.allreduce_states(buf.data(), c.rank() == 2 ? 2 : 1, 2);
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (const Status& g : got) {
    EXPECT_EQ(g.code(), Code::kMismatch);
    EXPECT_NE(g.message().find("rank 0 called allreduce_states(records=1, head_dim=2), rank 2 "
                               "called allreduce_states(records=2, head_dim=2) (ranks differing "
                               "from rank 0: 2)"),
              std::string::npos)
        << g.message();
  }
}

TEST(LocalCommFailures, InvalidArgumentOnOneRankFailsTheCollectiveOnAll) {
  std::vector<Status> got(3);
  Status s = run_local(3, [&](Communicator& c) -> Status {
    float x = 0;
    got[static_cast<std::size_t>(c.rank())] = c.broadcast(&x, sizeof(x), c.rank() == 1 ? 7 : 0);
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(got[1].code(), Code::kInvalidArgument);
  EXPECT_NE(got[1].message().find("rank 1: broadcast root 7 is outside [0, 3)"), std::string::npos)
      << got[1].message();
  EXPECT_NE(got[0].message().find("rank 0: broadcast (collective #1) failed on rank 1: rank 1: "
                                  "broadcast root 7"),
            std::string::npos)
      << got[0].message();
}

TEST(LocalCommFailures, MessageSizesMustMatchPairwise) {
  std::vector<Status> got(2);
  Status s = run_local(2, [&](Communicator& c) -> Status {
    std::vector<uint8_t> buf(16);
    auto r = c.rank() == 0 ? c.isend(buf.data(), 8, 1, 4) : c.irecv(buf.data(), 16, 0, 5);
    TREEATTN_RETURN_IF_ERROR(r.status());
    const CommRequest reqs[1] = {*r};
    got[static_cast<std::size_t>(c.rank())] = c.wait_all(reqs);
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(got[0].code(), Code::kMismatch);
  EXPECT_NE(got[0].message().find("rank 0: message #1 to rank 1 (tag 4) has 8 bytes, but the "
                                  "matching receive on rank 1 (tag 5) has room for 16"),
            std::string::npos)
      << got[0].message();
  EXPECT_EQ(got[1].code(), Code::kMismatch);
  EXPECT_NE(got[1].message().find("rank 1: receive #1 from rank 0 (tag 5) has room for 16 bytes"),
            std::string::npos)
      << got[1].message();
}

// test_all is false until the peer posts, and leaves the handle valid for wait_all.
TEST(LocalCommFailures, TestAllReportsProgressWithoutBlocking) {
  std::latch tested(1);
  Status s = run_local(2, [&](Communicator& c) -> Status {
    int v = c.rank() == 1 ? 42 : 0;
    if (c.rank() == 0) {
      auto r = c.irecv(&v, sizeof(v), 1, 0);
      TREEATTN_RETURN_IF_ERROR(r.status());
      const CommRequest reqs[1] = {*r};
      auto done = c.test_all(reqs);
      TREEATTN_RETURN_IF_ERROR(done.status());
      TREEATTN_RETURN_IF_ERROR(expect(!*done, c, "test_all true before the send"));
      tested.count_down();
      TREEATTN_RETURN_IF_ERROR(c.wait_all(reqs));
      return expect(v == 42, c, "value");
    }
    tested.wait();
    auto r = c.isend(&v, sizeof(v), 0, 0);
    TREEATTN_RETURN_IF_ERROR(r.status());
    const CommRequest reqs[1] = {*r};
    return c.wait_all(reqs);
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// With timeout 0 (wait forever) a rank that returns early must not hang the others: they fail
// when its communicator is destroyed, and run_local reports the early rank's own error.
TEST(LocalCommFailures, ARankThatLeavesEarlyDoesNotHangTheOthers) {
  std::vector<Status> got(4);
  const auto t0 = Clock::now();
  Status s = run_local(4, [&](Communicator& c) -> Status {
    if (c.rank() == 2) return invalid_argument("rank 2: bad configuration");
    got[static_cast<std::size_t>(c.rank())] = c.barrier();
    return got[static_cast<std::size_t>(c.rank())];
  });
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
  EXPECT_EQ(s.message(), "rank 2: bad configuration");
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(got[static_cast<std::size_t>(r)].code(), Code::kInternal);
    EXPECT_NE(
        got[static_cast<std::size_t>(r)].message().find("rank 2 left (destroyed its communicator)"),
        std::string::npos)
        << got[static_cast<std::size_t>(r)].message();
  }
}

TEST(LocalCommFailures, WorldOptionsAreChecked) {
  EXPECT_EQ(make_local_world(0).status().code(), Code::kInvalidArgument);
  LocalWorldOptions o;
  o.node_of_rank = {0, 1};
  EXPECT_EQ(make_local_world(3, o).status().code(), Code::kInvalidArgument);
  o.node_of_rank = {0, -1, 0};
  EXPECT_EQ(make_local_world(3, o).status().code(), Code::kInvalidArgument);
  auto w = make_local_world(3);
  ASSERT_TRUE(w.is_ok());
  EXPECT_EQ(w->size(), 3u);
}

}  // namespace
}  // namespace treeattn
