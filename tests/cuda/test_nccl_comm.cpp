// The NCCL communicator on GPUs (label gpu). Ranks are threads (the in-process communicator
// bootstraps NCCL, one device per rank, so a multi-rank case needs as many GPUs); every test
// skips with the reason when this build has no NCCL or there are too few devices. One rank:
// every operation, self point-to-point, splits, counters and argument errors; the decode session
// over NCCL + the CUDA executor for every strategy NCCL serves against the float64 oracle.
// Several GPUs: the same at P ranks, rank-order results, grouped two-way exchanges, a rank
// that skips a collective ending in kTimeout on the others instead of a hang, and a
// communicator destroyed while its collective waits for a dead rank returning (bounded wait,
// then abort). One GPU stands in for a dead rank by holding the stream (stream_hold.hpp): the
// watchdog ends a held collective in kTimeout, and synchronize() over a replayed CUDA graph's
// held collective (which the watchdog does not track) gives up after the timeout. Host-side
// (any machine): the timeouts, the teardown poll, the wait's bound and the messages.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl/nccl_policy.hpp"
#include "kernels/cuda/cuda_presence.hpp"
#include "stream_hold.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/comm_nccl.hpp"
#include "treeattn/executor_cuda.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"

namespace treeattn {
namespace {

using Fn = std::function<Status(Communicator& nccl, Executor& exec)>;

// Runs fn on p threads, each with a CUDA executor on device `rank` and an NCCL communicator
// bootstrapped over the in-process world.
Status run_nccl(int p, const Fn& fn, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  return run_local(p, [&](Communicator& boot) -> Status {
    boot.set_timeout(timeout);
    CudaExecutorOptions o;
    o.device = boot.rank();
    auto exec = make_cuda_executor(o);
    TREEATTN_RETURN_IF_ERROR(exec.status());
    auto nccl = make_nccl_communicator(boot, **exec);
    TREEATTN_RETURN_IF_ERROR(nccl.status());
    return fn(**nccl, **exec);
  });
}

// Skips unless NCCL is built and `ranks` devices exist; a machine with no CUDA device or driver
// skips, one whose CUDA is there but broken (cudaGetDeviceCount fails otherwise) fails
// (cuda_presence.hpp).
#define REQUIRE_DEVICES(ranks)                                                               \
  do {                                                                                       \
    if (!nccl_built()) GTEST_SKIP() << "this build has no NCCL backend";                     \
    const gpu::CudaProbe probe_ = gpu::probe_cuda();                                         \
    const std::string absent_ = gpu::cuda_absence(probe_);                                   \
    if (!absent_.empty()) GTEST_SKIP() << "no CUDA device here: " << absent_;                \
    if (probe_.count_error != gpu::kCudaSuccess)                                             \
      FAIL() << "CUDA is present but cudaGetDeviceCount failed: " << probe_.error_name       \
             << " (driver version " << probe_.driver_version << ")";                         \
    if (probe_.device_count < (ranks))                                                       \
      GTEST_SKIP() << "needs " << (ranks) << " CUDA devices, found " << probe_.device_count; \
  } while (0)

Result<Buffer> device_floats(Executor& e, const std::vector<float>& host) {
  auto b = e.allocate(host.size() * sizeof(float));
  TREEATTN_RETURN_IF_ERROR(b.status());
  TREEATTN_RETURN_IF_ERROR(e.from_host(b->data(), host.data(), host.size() * sizeof(float)));
  return std::move(*b);
}
Result<std::vector<float>> host_floats(Executor& e, const Buffer& b, std::size_t n) {
  std::vector<float> v(n);
  TREEATTN_RETURN_IF_ERROR(e.to_host(v.data(), b.data(), n * sizeof(float)));
  return v;
}
Status expect(bool ok, const std::string& what) {
  return ok ? Status::ok() : internal_error("check failed: " + what);
}

// Every collective and point-to-point operation at p ranks; values depend on the rank so that
// rank order and reductions are visible.
Status every_operation(Communicator& c, Executor& e) {
  const int p = c.size(), r = c.rank();
  TREEATTN_RETURN_IF_ERROR(expect(c.backend_name() == "nccl", "backend name"));
  const CommCapabilities caps = c.capabilities();
  TREEATTN_RETURN_IF_ERROR(
      expect(caps.memory == MemorySpace::kDevice && !caps.user_reductions && caps.stream_ordered,
             "capabilities"));
  const std::size_t n = 1000;
  std::vector<float> mine(n);
  for (std::size_t i = 0; i < n; ++i)
    mine[i] = static_cast<float>(r + 1) * 0.5f + static_cast<float>(i);
  // allreduce sum and max
  auto a = device_floats(e, mine);
  TREEATTN_RETURN_IF_ERROR(a.status());
  TREEATTN_RETURN_IF_ERROR(c.allreduce(a->as<float>(), n, ReduceOp::kSum));
  auto sum = host_floats(e, *a, n);
  TREEATTN_RETURN_IF_ERROR(sum.status());
  const float want0 = 0.5f * static_cast<float>(p * (p + 1) / 2);
  TREEATTN_RETURN_IF_ERROR(expect((*sum)[0] == want0, "allreduce sum"));
  auto m = device_floats(e, mine);
  TREEATTN_RETURN_IF_ERROR(m.status());
  TREEATTN_RETURN_IF_ERROR(c.allreduce(m->as<float>(), n, ReduceOp::kMax));
  auto mx = host_floats(e, *m, n);
  TREEATTN_RETURN_IF_ERROR(mx.status());
  TREEATTN_RETURN_IF_ERROR(
      expect((*mx)[7] == 0.5f * static_cast<float>(p) + 7.0f, "allreduce max"));
  // allgather in rank order
  auto g = e.allocate(static_cast<std::size_t>(p) * n * sizeof(float));
  TREEATTN_RETURN_IF_ERROR(g.status());
  auto src = device_floats(e, mine);
  TREEATTN_RETURN_IF_ERROR(src.status());
  TREEATTN_RETURN_IF_ERROR(c.allgather(src->data(), n * sizeof(float), g->data()));
  auto all = host_floats(e, *g, static_cast<std::size_t>(p) * n);
  TREEATTN_RETURN_IF_ERROR(all.status());
  for (int k = 0; k < p; ++k)
    TREEATTN_RETURN_IF_ERROR(expect(
        (*all)[static_cast<std::size_t>(k) * n + 3] == static_cast<float>(k + 1) * 0.5f + 3.0f,
        "allgather order"));
  // gather to the last rank
  const int root = p - 1;
  auto gr = e.allocate(static_cast<std::size_t>(p) * n * sizeof(float));
  TREEATTN_RETURN_IF_ERROR(gr.status());
  TREEATTN_RETURN_IF_ERROR(c.gather(src->data(), n * sizeof(float), gr->data(), root));
  if (r == root) {
    auto got = host_floats(e, *gr, static_cast<std::size_t>(p) * n);
    TREEATTN_RETURN_IF_ERROR(got.status());
    TREEATTN_RETURN_IF_ERROR(expect(*got == *all, "gather equals allgather at the root"));
  }
  // broadcast and reduce
  auto bc = device_floats(e, mine);
  TREEATTN_RETURN_IF_ERROR(bc.status());
  TREEATTN_RETURN_IF_ERROR(c.broadcast(bc->data(), n * sizeof(float), root));
  auto bcv = host_floats(e, *bc, n);
  TREEATTN_RETURN_IF_ERROR(bcv.status());
  TREEATTN_RETURN_IF_ERROR(expect((*bcv)[0] == static_cast<float>(root + 1) * 0.5f, "broadcast"));
  auto rd = device_floats(e, mine);
  TREEATTN_RETURN_IF_ERROR(rd.status());
  TREEATTN_RETURN_IF_ERROR(c.reduce(rd->as<float>(), n, ReduceOp::kSum, 0));
  if (r == 0) {
    auto rv = host_floats(e, *rd, n);
    TREEATTN_RETURN_IF_ERROR(rv.status());
    TREEATTN_RETURN_IF_ERROR(expect((*rv)[0] == want0, "reduce"));
  }
  // A ring exchange in both directions, posted before the wait (one group), plus a zero-byte
  // message, twice: the k-th send meets the k-th receive.
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  auto in1 = e.allocate(n * sizeof(float)), in2 = e.allocate(n * sizeof(float));
  TREEATTN_RETURN_IF_ERROR(in1.status());
  TREEATTN_RETURN_IF_ERROR(in2.status());
  auto second = device_floats(e, std::vector<float>(n, static_cast<float>(100 + r)));
  TREEATTN_RETURN_IF_ERROR(second.status());
  std::vector<CommRequest> reqs;
  for (auto req : {c.irecv(in1->data(), n * sizeof(float), prev, 1),
                   c.irecv(in2->data(), n * sizeof(float), prev, 2),
                   c.isend(src->data(), n * sizeof(float), next, 1),
                   c.isend(second->data(), n * sizeof(float), next, 2),
                   c.irecv(nullptr, 0, next, 3), c.isend(nullptr, 0, prev, 3)}) {
    TREEATTN_RETURN_IF_ERROR(req.status());
    reqs.push_back(*req);
  }
  auto done = c.test_all(reqs);
  TREEATTN_RETURN_IF_ERROR(done.status());
  TREEATTN_RETURN_IF_ERROR(c.wait_all(reqs));
  auto v1 = host_floats(e, *in1, n), v2 = host_floats(e, *in2, n);
  TREEATTN_RETURN_IF_ERROR(v1.status());
  TREEATTN_RETURN_IF_ERROR(v2.status());
  TREEATTN_RETURN_IF_ERROR(expect((*v1)[5] == static_cast<float>(prev + 1) * 0.5f + 5.0f &&
                                      (*v2)[5] == static_cast<float>(100 + prev),
                                  "ring exchange order"));
  // barrier, synchronize, splits
  TREEATTN_RETURN_IF_ERROR(c.barrier());
  TREEATTN_RETURN_IF_ERROR(c.synchronize());
  auto half = c.split(r % 2, -r);  // key -r: reversed order inside each half
  TREEATTN_RETURN_IF_ERROR(half.status());
  TREEATTN_RETURN_IF_ERROR(
      expect(*half != nullptr && (*half)->size() == (p - r % 2 + 1) / 2, "split size"));
  const int expect_rank = ((p - 1 - r % 2) / 2) - r / 2;
  TREEATTN_RETURN_IF_ERROR(expect((*half)->rank() == expect_rank, "split order by key"));
  TREEATTN_RETURN_IF_ERROR((*half)->barrier());
  auto none = c.split(r == 0 ? -1 : 0, 0);
  TREEATTN_RETURN_IF_ERROR(none.status());
  TREEATTN_RETURN_IF_ERROR(expect((r == 0) == (*none == nullptr), "split without color"));
  auto host = c.split_shared(0);
  TREEATTN_RETURN_IF_ERROR(host.status());
  TREEATTN_RETURN_IF_ERROR(expect(*host != nullptr && (*host)->size() == p, "split_shared"));
  // What NCCL cannot do, and argument errors.
  TREEATTN_RETURN_IF_ERROR(
      expect(c.allreduce_states(a->as<float>(), 1, 64).code() == Code::kUnsupported,
             "allreduce_states unsupported"));
  TREEATTN_RETURN_IF_ERROR(
      expect(c.isend(src->data(), 4, p, 0).status().code() == Code::kInvalidArgument,
             "peer out of range"));
  const CommRequest bogus{12345};
  TREEATTN_RETURN_IF_ERROR(
      expect(c.wait_all({&bogus, 1}).code() == Code::kInvalidArgument, "unknown request"));
  TREEATTN_RETURN_IF_ERROR(
      expect(c.counters().p2p_messages == 3 && c.counters().p2p_bytes == 2 * n * sizeof(float),
             "p2p counters"));
  return Status::ok();
}

TEST(NcclComm, OneRankEveryOperation) {
  REQUIRE_DEVICES(1);
  const Status s = run_nccl(1, every_operation);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST(NcclComm, AllDevicesEveryOperation) {
  REQUIRE_DEVICES(2);
  const int p = std::min(cuda_device_count(), 8);
  const Status s = run_nccl(p, every_operation);
  EXPECT_TRUE(s.is_ok()) << p << " ranks: " << s.to_string();
}

TEST(NcclComm, ARankThatSkipsACollectiveIsATimeoutNotAHang) {
  REQUIRE_DEVICES(2);
  const auto start = std::chrono::steady_clock::now();
  std::string rank0;
  const Status s = run_nccl(
      2,
      [&](Communicator& c, Executor& e) -> Status {
        c.set_timeout(std::chrono::milliseconds(2000));
        if (c.rank() == 1) return Status::ok();  // never arrives
        auto b = device_floats(e, std::vector<float>(64, 1.0f));
        TREEATTN_RETURN_IF_ERROR(b.status());
        Status st = c.allreduce(b->as<float>(), 64, ReduceOp::kSum);
        if (st.is_ok()) st = c.synchronize();
        rank0 = st.to_string();
        return st.code() == Code::kTimeout ? Status::ok() : st;
      },
      std::chrono::seconds(30));
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_NE(rank0.find("did not complete within 2000 ms"), std::string::npos) << rank0;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(25));
}

// One rank with a 500 ms timeout: `before` runs, then the stream is held (stream_hold.hpp), as
// by a collective waiting for a dead rank, while `held` runs; its status is in *got. A kTimeout
// there is the expected outcome.
using HeldFn = std::function<Status(Communicator& c, Executor& e, Buffer& b)>;
Status run_held(const HeldFn& before, const HeldFn& held, std::string* got) {
  return run_nccl(1, [&](Communicator& c, Executor& e) -> Status {
    c.set_timeout(std::chrono::milliseconds(500));
    auto b = device_floats(e, std::vector<float>(64, 1.0f));
    TREEATTN_RETURN_IF_ERROR(b.status());
    TREEATTN_RETURN_IF_ERROR(before(c, e, *b));
    auto stream = cuda_stream(e);
    TREEATTN_RETURN_IF_ERROR(stream.status());
    auto hold = test::StreamHold::start(*stream);
    TREEATTN_RETURN_IF_ERROR(hold.status());
    const Status st = held(c, e, *b);
    *got = st.to_string();
    (*hold)->release();
    return st.code() == Code::kTimeout ? Status::ok() : st;
  });
}

TEST(NcclComm, OneRankWatchdogEndsAHeldCollectiveInATimeout) {
  // The watchdog finds the held all-reduce incomplete after the timeout; synchronize() says so.
  REQUIRE_DEVICES(1);
  const auto start = std::chrono::steady_clock::now();
  std::string got;
  const Status s = run_held([](Communicator&, Executor&, Buffer&) { return Status::ok(); },
                            [](Communicator& c, Executor&, Buffer& b) {
                              Status st = c.allreduce(b.as<float>(), 64, ReduceOp::kSum);
                              return st.is_ok() ? c.synchronize() : st;
                            },
                            &got);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_NE(got.find("did not complete within 500 ms"), std::string::npos) << got;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
      << "the abort waited for the held stream";
}

TEST(NcclComm, SynchronizeOverAReplayedGraphsHeldCollectiveIsBounded) {
  // A graph's collectives are not tracked by the watchdog while it replays; the wait itself
  // gives up one timeout after it began and aborts the communicator.
  REQUIRE_DEVICES(1);
  const auto start = std::chrono::steady_clock::now();
  std::string got;
  std::unique_ptr<CudaGraph> graph;
  const Status s = run_held(
      [&](Communicator& c, Executor& e, Buffer& b) -> Status {
        TREEATTN_RETURN_IF_ERROR(c.allreduce(b.as<float>(), 64, ReduceOp::kSum));
        TREEATTN_RETURN_IF_ERROR(c.synchronize());
        TREEATTN_RETURN_IF_ERROR(cuda_capture_begin(e));
        const Status captured = c.allreduce(b.as<float>(), 64, ReduceOp::kSum);
        auto g = cuda_capture_end(e);
        TREEATTN_RETURN_IF_ERROR(captured);
        TREEATTN_RETURN_IF_ERROR(g.status());
        graph = std::move(*g);
        return Status::ok();
      },
      [&](Communicator& c, Executor&, Buffer&) {
        Status st = graph->replay();
        st = st.is_ok() ? c.synchronize() : st;
        graph.reset();  // before its executor
        return st;
      },
      &got);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_NE(got.find("did not complete within 500 ms"), std::string::npos) << got;
  EXPECT_NE(got.find("the watchdog does not track"), std::string::npos) << got;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
      << "the abort waited for the held stream";
}

TEST(NcclComm, DestroyingACommunicatorWhoseCollectiveWaitsForADeadPeerReturns) {
  // Rank 0 enqueues an all-reduce that rank 1 never joins and destroys its communicator at once,
  // before the watchdog's deadline: the destructor stops the watchdog, so only its own bounded
  // wait (the timeout, then ncclCommAbort) stands between it and a hang.
  REQUIRE_DEVICES(2);
  const auto start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration destroy_took{};
  const Status s = run_local(2, [&](Communicator& boot) -> Status {
    boot.set_timeout(std::chrono::seconds(30));
    CudaExecutorOptions o;
    o.device = boot.rank();
    auto exec = make_cuda_executor(o);
    TREEATTN_RETURN_IF_ERROR(exec.status());
    auto made = make_nccl_communicator(boot, **exec);
    TREEATTN_RETURN_IF_ERROR(made.status());
    std::unique_ptr<Communicator> c = std::move(*made);
    c->set_timeout(std::chrono::milliseconds(3000));
    if (c->rank() == 1) return Status::ok();  // gone
    auto b = device_floats(**exec, std::vector<float>(64, 1.0f));
    TREEATTN_RETURN_IF_ERROR(b.status());
    TREEATTN_RETURN_IF_ERROR(c->allreduce(b->as<float>(), 64, ReduceOp::kSum));  // enqueued
    const auto t0 = std::chrono::steady_clock::now();
    c.reset();
    destroy_took = std::chrono::steady_clock::now() - t0;
    return Status::ok();
  });
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_LT(destroy_took, std::chrono::seconds(15));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

// The values the owners store (exact in every dtype's range) and the float64 oracle.
float value(int64_t b, int64_t pos, int64_t i, int kind) {
  uint64_t x = (static_cast<uint64_t>(b) << 40) ^ (static_cast<uint64_t>(pos) << 12) ^
               static_cast<uint64_t>(i) ^ (static_cast<uint64_t>(kind) << 60);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<int64_t>(x >> 41) - (int64_t{1} << 22)) * 0x1p-22f;
}

Status session_matches_oracle(Communicator& c, Executor& e) {
  SessionConfig cfg;
  cfg.shape = AttnShape{2, 16, 4, 128, 2};
  cfg.dtype = DType::kBF16;
  cfg.placement = ShardKind::kEven;
  cfg.timeout = std::chrono::seconds(30);
  const int64_t prefill = 777, total = 1500;  // prefill by owners, then appends
  const std::vector<int64_t> lens{total, total};
  const AttnShape& s = cfg.shape;
  const auto per_tok = static_cast<std::size_t>(s.kv_heads * s.head_dim);
  // The whole cache on the host, for the oracle.
  KVCache whole(s, cfg.dtype, total);
  std::vector<float> k(per_tok), v(per_tok);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < lens[static_cast<std::size_t>(b)]; ++t) {
      for (std::size_t i = 0; i < per_tok; ++i) {
        k[i] = value(b, t, static_cast<int64_t>(i), 1);
        v[i] = value(b, t, static_cast<int64_t>(i), 2);
      }
      for (int64_t h = 0; h < s.kv_heads; ++h)
        whole.set_token(b, h, t, k.data() + h * s.head_dim, v.data() + h * s.head_dim);
    }
  std::vector<float> q(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 2.0f * value(9, 9, static_cast<int64_t>(i), 3);
  const std::vector<int64_t> zeros(2, 0);
  std::vector<double> ref(q.size()), ref_lse(q.size() / static_cast<std::size_t>(s.head_dim));
  TREEATTN_RETURN_IF_ERROR(oracle_attention(s, q.data(), whole.view(0, lens, zeros, lens, 1),
                                            ref.data(), ref_lse.data()));

  const StrategyRegistry& reg = StrategyRegistry::for_backend(c.capabilities());
  for (const StrategyInfo& info : reg.list()) {
    cfg.strategy = std::string(info.name);
    cfg.context = {};
    auto sess = DecodeSession::create(c, cfg, e);
    TREEATTN_RETURN_IF_ERROR(sess.status());
    DecodeSession& d = **sess;
    TREEATTN_RETURN_IF_ERROR(d.extend(prefill));
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t t = 0; t < prefill; ++t)
        if (d.owns(b, t)) {
          for (std::size_t i = 0; i < per_tok; ++i) {
            k[i] = value(b, t, static_cast<int64_t>(i), 1);
            v[i] = value(b, t, static_cast<int64_t>(i), 2);
          }
          TREEATTN_RETURN_IF_ERROR(d.store(0, b, t, k.data(), v.data()));
        }
    std::vector<float> ka(2 * per_tok), va(2 * per_tok);
    for (int64_t t = prefill; t < total; ++t) {
      for (int64_t b = 0; b < 2; ++b)
        for (std::size_t i = 0; i < per_tok; ++i) {
          ka[static_cast<std::size_t>(b) * per_tok + i] = value(b, t, static_cast<int64_t>(i), 1);
          va[static_cast<std::size_t>(b) * per_tok + i] = value(b, t, static_cast<int64_t>(i), 2);
        }
      TREEATTN_RETURN_IF_ERROR(d.append(ka.data(), va.data()));
    }
    auto qd = device_floats(e, q);
    TREEATTN_RETURN_IF_ERROR(qd.status());
    auto od = e.allocate(q.size() * sizeof(float));
    auto ld = e.allocate(ref_lse.size() * sizeof(float));
    TREEATTN_RETURN_IF_ERROR(od.status());
    TREEATTN_RETURN_IF_ERROR(ld.status());
    TREEATTN_RETURN_IF_ERROR(d.attend(0, qd->as<float>(), od->as<float>(), ld->as<float>()));
    if (!d.delivers_result()) continue;
    auto out = host_floats(e, *od, q.size());
    auto lse = host_floats(e, *ld, ref_lse.size());
    TREEATTN_RETURN_IF_ERROR(out.status());
    TREEATTN_RETURN_IF_ERROR(lse.status());
    double worst = 0, big = 1;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      worst = std::max(worst, std::fabs((*out)[i] - ref[i]));
      big = std::max(big, std::fabs(ref[i]));
    }
    worst /= big;
    for (std::size_t i = 0; i < ref_lse.size(); ++i)
      worst =
          std::max(worst, std::fabs((*lse)[i] - ref_lse[i]) / std::max(1.0, std::fabs(ref_lse[i])));
    if (worst > 1e-5)
      return internal_error("strategy " + cfg.strategy + ": error " + std::to_string(worst) +
                            " against the oracle at " + std::to_string(c.size()) + " ranks");
  }
  return Status::ok();
}

TEST(NcclComm, SessionOverNcclMatchesTheOracleForEveryStrategy) {
  REQUIRE_DEVICES(1);
  Status s = run_nccl(1, session_matches_oracle);
  EXPECT_TRUE(s.is_ok()) << "1 rank: " << s.to_string();
  const int p = std::min(cuda_device_count(), 8);
  if (p >= 2) {
    s = run_nccl(p, session_matches_oracle);
    EXPECT_TRUE(s.is_ok()) << p << " ranks: " << s.to_string();
  }
}

// ---- host-side rules (nccl_policy.hpp): run on every machine -----------------------------------

TEST(NcclPolicy, TheCommunicatorNeverStartsWithoutATimeout) {
  using std::chrono::milliseconds;
  EXPECT_GT(kNcclDefaultTimeout.count(), 0);
  EXPECT_EQ(nccl_detail::initial_timeout(milliseconds(0)), kNcclDefaultTimeout);
  EXPECT_EQ(nccl_detail::initial_timeout(milliseconds(1500)), milliseconds(1500));
  // The destructor's wait is bounded even after set_timeout(0) ("wait forever").
  EXPECT_EQ(nccl_detail::teardown_limit(milliseconds(0)), kNcclDefaultTimeout);
  EXPECT_EQ(nccl_detail::teardown_limit(milliseconds(250)), milliseconds(250));
}

TEST(NcclPolicy, TheTeardownPollGivesUpAtItsLimit) {
  // A stream that never drains (a queued collective waiting for a dead peer): the poll returns
  // false at the limit, so the destructor aborts instead of hanging.
  int naps = 0;
  const auto start = std::chrono::steady_clock::now();
  const bool drained =
      nccl_detail::poll_until([] { return false; }, std::chrono::milliseconds(60),
                              [&](auto) {
                                ++naps;
                                std::this_thread::sleep_for(std::chrono::milliseconds(1));
                              });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_FALSE(drained);
  EXPECT_GE(took, std::chrono::milliseconds(60));
  EXPECT_LT(took, std::chrono::seconds(5));
  EXPECT_GT(naps, 0);
  // A stream that drains on the third look: true, without waiting for the limit.
  int looks = 0;
  EXPECT_TRUE(
      nccl_detail::poll_until([&] { return ++looks == 3; }, std::chrono::hours(1), [](auto) {}));
  EXPECT_EQ(looks, 3);
}

TEST(NcclPolicy, AMissingRankHasOneMessage) {
  // The watchdog (an enqueued collective) and a non-blocking call still in progress (newer NCCL
  // connects at the first collective) report the same condition with the same words, the ones
  // ARankThatSkipsACollectiveIsATimeoutNotAHang looks for.
  const std::string collective =
      nccl_detail::missing_rank_message("rank 0: ", "allreduce (operation #1)", 2000, {});
  const std::string in_progress =
      nccl_detail::missing_rank_message("rank 0: ", "allreduce at step 2", 2000, {});
  const std::string p2p =
      nccl_detail::missing_rank_message("rank 2: ", "point-to-point group #4", 500, {1, 3});
  for (const std::string& m : {collective, in_progress})
    EXPECT_NE(m.find("did not complete within 2000 ms"), std::string::npos) << m;
  EXPECT_EQ(collective.rfind("rank 0: NCCL allreduce", 0), 0u) << collective;
  EXPECT_NE(collective.find("does not report which rank is missing"), std::string::npos);
  EXPECT_NE(p2p.find("did not complete within 500 ms; waiting for ranks 1, 3"), std::string::npos)
      << p2p;
  EXPECT_NE(p2p.find("aborted the NCCL communicator"), std::string::npos) << p2p;
  EXPECT_EQ(p2p.find("did not finish"), std::string::npos);
}

TEST(NcclPolicy, AWaitForTheStreamEndsATimeoutAfterTheLastProgress) {
  // synchronize() over a replayed graph whose collective waits for a dead rank: nothing the
  // watchdog tracks completes, so the wait expires one timeout after it began.
  using std::chrono::milliseconds;
  const auto t0 = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  nccl_detail::WaitBound stuck(milliseconds(500), 7, t0);
  EXPECT_FALSE(stuck.expired(7, t0 + milliseconds(500)));
  EXPECT_TRUE(stuck.expired(7, t0 + milliseconds(501)));
  // Operations completing meanwhile (a deep queue draining) move the bound along.
  nccl_detail::WaitBound draining(milliseconds(500), 0, t0);
  EXPECT_FALSE(draining.expired(1, t0 + milliseconds(400)));
  EXPECT_FALSE(draining.expired(2, t0 + milliseconds(800)));
  EXPECT_FALSE(draining.expired(2, t0 + milliseconds(1300)));
  EXPECT_TRUE(draining.expired(2, t0 + milliseconds(1301)));
  // set_timeout(0): wait forever.
  nccl_detail::WaitBound forever(milliseconds(0), 0, t0);
  EXPECT_FALSE(forever.expired(0, t0 + std::chrono::hours(100)));
}

TEST(NcclComm, NoNcclBuildSaysSo) {
  if (nccl_built()) GTEST_SKIP() << "this build has NCCL";
  auto world = make_local_world(1);
  ASSERT_TRUE(world.is_ok());
  auto c = make_nccl_communicator(*(*world)[0], cpu_executor());
  EXPECT_EQ(c.status().code(), Code::kUnsupported);
}

}  // namespace
}  // namespace treeattn
