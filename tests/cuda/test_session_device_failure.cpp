// The decode session on a device after its stream-ordered communicator failed (issue 21, 2),
// without a GPU: a stand-in device (MemorySpace::kDevice, host bytes, the CPU executor's
// arithmetic) and a stand-in NCCL-like communicator over the in-process world that behaves as
// the NCCL communicator does once its watchdog aborted a stuck collective: the collective was
// only enqueued (it returns success and leaves its output buffer as it was, garbage), and the
// failure shows in the blocking calls (synchronize, wait_all, barrier) and every later call.
// attend_states and attend must then return the communicator's error, never success.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/session.hpp"
#include "treeattn/state_buffer.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {
namespace {

// Device memory space, host bytes, the CPU executor's arithmetic.
class StandInDevice final : public Executor {
 public:
  std::string_view name() const override { return "stand-in-device"; }
  MemorySpace memory() const override { return MemorySpace::kDevice; }
  Result<Buffer> allocate(std::size_t bytes) override {
    if (bytes == 0) return Buffer();
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) return Status(Code::kOutOfMemory, "stand-in device: no memory");
    std::memset(p, 0xA5, bytes);
    return Buffer(this, p, bytes);
  }
  void release(void* data, std::size_t) noexcept override { std::free(data); }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    std::memmove(dst, src, bytes);
    return Status::ok();
  }
  Status to_host(void* dst, const void* src, std::size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  Status from_host(void* dst, const void* src, std::size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  Status partial(const AttnShape& s, const float* q, const KVShard& kv, float* st,
                 const DecodeOptions& o) override {
    return cpu().partial(s, q, kv, st, o);
  }
  Status partial_chunks(const AttnShape& s, const float* q, const KVShard& kv, int64_t c, float* st,
                        const DecodeOptions& o) override {
    return cpu().partial_chunks(s, q, kv, c, st, o);
  }
  Status set_empty(float* st, std::size_t n, std::size_t d) override {
    return cpu().set_empty(st, n, d);
  }
  Status merge(float* a, const float* x, std::size_t n, std::size_t d) override {
    return cpu().merge(a, x, n, d);
  }
  Status merge_ordered(const float* p, std::size_t c, std::size_t ps, std::size_t n, std::size_t d,
                       float* out) override {
    return cpu().merge_ordered(p, c, ps, n, d, out);
  }
  Status lse(const float* st, std::size_t n, std::size_t d, float* out) override {
    return cpu().lse(st, n, d, out);
  }
  Status to_sum_form(const float* st, const float* m, std::size_t n, std::size_t d, float* num,
                     std::size_t ns, float* den) override {
    return cpu().to_sum_form(st, m, n, d, num, ns, den);
  }
  Status from_sum_form(const float* m, const float* num, std::size_t ns, const float* den,
                       std::size_t n, std::size_t d, float* st) override {
    return cpu().from_sum_form(m, num, ns, den, n, d, st);
  }
  Status normalize(const float* st, std::size_t n, std::size_t d, float* out, float* lse) override {
    return cpu().normalize(st, n, d, out, lse);
  }

 private:
  static Executor& cpu() { return cpu_executor(); }
};

// NCCL's capabilities (device memory, no user-defined reductions, stream-ordered) over an
// in-process communicator. Once `abort_next` is set, the next collective is "aborted by the
// watchdog": it returns success without moving data, and from then on the blocking calls and
// every later call return the kTimeout an NCCL watchdog raises.
class StandInNccl final : public Communicator {
 public:
  explicit StandInNccl(std::unique_ptr<Communicator> inner) : in_(std::move(inner)) {}
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  int world_rank() const override { return in_->world_rank(); }
  std::string_view backend_name() const override { return "stand-in-nccl"; }
  CommCapabilities capabilities() const override {
    return {MemorySpace::kDevice, /*user_reductions=*/false, /*stream_ordered=*/true};
  }
  Status allreduce(float* d, std::size_t n, ReduceOp op) override {
    return collective([&] { return in_->allreduce(d, n, op); });
  }
  Status reduce(float* d, std::size_t n, ReduceOp op, int root) override {
    return collective([&] { return in_->reduce(d, n, op, root); });
  }
  Status allreduce_states(float*, std::size_t, std::size_t) override {
    return unsupported("no user-defined reductions");
  }
  Status reduce_states(float*, std::size_t, std::size_t, int) override {
    return unsupported("no user-defined reductions");
  }
  Status allgather(const void* s, std::size_t b, void* r) override {
    return collective([&] { return in_->allgather(s, b, r); });
  }
  Status gather(const void* s, std::size_t b, void* r, int root) override {
    return collective([&] { return in_->gather(s, b, r, root); });
  }
  Status broadcast(void* d, std::size_t b, int root) override {
    return collective([&] { return in_->broadcast(d, b, root); });
  }
  Status barrier() override {
    TREEATTN_RETURN_IF_ERROR(failure());
    return in_->barrier();
  }
  Result<CommRequest> isend(const void* d, std::size_t b, int dest, int tag) override {
    TREEATTN_RETURN_IF_ERROR(failure());
    return in_->isend(d, b, dest, tag);
  }
  Result<CommRequest> irecv(void* d, std::size_t b, int src, int tag) override {
    TREEATTN_RETURN_IF_ERROR(failure());
    return in_->irecv(d, b, src, tag);
  }
  Status wait_all(std::span<const CommRequest> r) override {
    TREEATTN_RETURN_IF_ERROR(failure());
    return in_->wait_all(r);
  }
  Result<bool> test_all(std::span<const CommRequest> r) override {
    TREEATTN_RETURN_IF_ERROR(failure());
    return in_->test_all(r);
  }
  int max_tag() const override { return in_->max_tag(); }
  Result<std::unique_ptr<Communicator>> split(int, int) override {
    return unsupported("stand-in NCCL: split");
  }
  Result<std::unique_ptr<Communicator>> split_shared(int) override {
    return unsupported("stand-in NCCL: split_shared");
  }
  Status synchronize() override { return failure(); }
  [[noreturn]] void abort(int code, std::string_view message) override {
    in_->abort(code, message);
    std::abort();
  }

  bool abort_next = false;
  bool aborted = false;

 private:
  Status failure() const {
    if (!aborted) return Status::ok();
    return Status(Code::kTimeout, "rank " + std::to_string(world_rank()) +
                                      ": NCCL allgather (operation #7) did not complete within "
                                      "2000 ms; aborted the NCCL communicator");
  }
  template <class F>
  Status collective(F call) {
    TREEATTN_RETURN_IF_ERROR(failure());
    if (abort_next) {  // enqueued; the watchdog aborts it later; the kernels return normally
      abort_next = false;
      aborted = true;
      return Status::ok();
    }
    in_->set_timeout(timeout());
    return call();
  }
  std::unique_ptr<Communicator> in_;
};

// Two ranks, each a session on its stand-in device over its stand-in NCCL communicator, for
// every strategy the NCCL backend serves; the communicator aborts the first collective of the
// step. Returns, per strategy, what attend_states (states = true) or attend returned on rank 0
// and whether a collective was aborted at all.
struct Outcome {
  std::string strategy;
  bool aborted = false;
  Status status;
};

std::vector<Outcome> run_failing_step(bool states) {
  constexpr int P = 2;
  std::vector<Outcome> outcomes;
  std::vector<std::string> names;
  const CommCapabilities caps{MemorySpace::kDevice, false, true};
  for (const StrategyInfo& i : StrategyRegistry::for_backend(caps).list())
    names.emplace_back(i.name);
  for (const std::string& name : names) {
    auto world = make_local_world(P);
    EXPECT_TRUE(world.is_ok()) << world.status().to_string();
    if (!world.is_ok()) return outcomes;
    std::vector<std::unique_ptr<StandInNccl>> comms;
    for (auto& c : *world) comms.push_back(std::make_unique<StandInNccl>(std::move(c)));
    std::vector<Outcome> mine(P);
    const Status ran = run_local(P, [&](Communicator& host) -> Status {
      const int r = host.rank();
      StandInNccl& comm = *comms[static_cast<std::size_t>(r)];
      StandInDevice device;
      SessionConfig cfg;
      cfg.shape = AttnShape{2, 4, 2, 64, 1};
      cfg.dtype = DType::kF32;
      cfg.strategy = name;
      cfg.timeout = std::chrono::milliseconds(20000);
      cfg.check_agreement = false;  // the set-up is not what this test is about
      if (name == "single") cfg.placement = ShardKind::kSingle;
      auto sess = DecodeSession::create(comm, cfg, device);
      TREEATTN_RETURN_IF_ERROR(sess.status());
      DecodeSession& s = **sess;
      const int64_t n = 40;
      TREEATTN_RETURN_IF_ERROR(s.extend(n));
      std::vector<float> k(2 * 64), v(2 * 64);
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t t = 0; t < n; ++t)
          if (s.owns(b, t)) {
            for (std::size_t i = 0; i < k.size(); ++i) {
              k[i] = static_cast<float>((b * 7 + t * 3 + static_cast<int64_t>(i)) % 11) / 11.0f;
              v[i] = static_cast<float>((b * 5 + t + static_cast<int64_t>(i)) % 13) / 13.0f;
            }
            TREEATTN_RETURN_IF_ERROR(s.store(0, b, t, k.data(), v.data()));
          }
      auto q = device.allocate(2 * 4 * 64 * sizeof(float));
      auto out = device.allocate(2 * 4 * 64 * sizeof(float));
      auto lse = device.allocate(2 * 4 * sizeof(float));
      TREEATTN_RETURN_IF_ERROR(q.status());
      TREEATTN_RETURN_IF_ERROR(out.status());
      TREEATTN_RETURN_IF_ERROR(lse.status());
      for (std::size_t i = 0; i < 2 * 4 * 64; ++i)
        q->as<float>()[i] = static_cast<float>(i % 17) / 17.0f - 0.5f;
      comm.abort_next = true;
      Outcome& o = mine[static_cast<std::size_t>(r)];
      o.strategy = name;
      if (states) {
        StateBuffer st;
        o.status = measure::attend_states(s, 0, q->as<float>(), st, 0);
      } else {
        o.status = s.attend(0, q->as<float>(), out->as<float>(), lse->as<float>());
      }
      o.aborted = comm.aborted;
      return Status::ok();
    });
    EXPECT_TRUE(ran.is_ok()) << name << ": " << ran.to_string();
    outcomes.push_back(mine[0]);
  }
  return outcomes;
}

void expect_no_success_after_an_abort(bool states) {
  int aborted = 0;
  for (const Outcome& o : run_failing_step(states)) {
    if (!o.aborted) continue;  // a strategy whose rank 0 enqueues no collective in the step
    ++aborted;
    EXPECT_EQ(o.status.code(), Code::kTimeout)
        << o.strategy << ": after the watchdog aborted a collective, "
        << (states ? "attend_states" : "attend") << " returned " << o.status.to_string();
    EXPECT_NE(o.status.message().find("did not complete"), std::string::npos)
        << o.strategy << ": " << o.status.to_string();
  }
  // tree (as an all-gather) and allgather at least run a collective on rank 0.
  EXPECT_GE(aborted, 2);
}

TEST(SessionDeviceFailure, AttendStatesReturnsTheCommunicatorsFailure) {
  expect_no_success_after_an_abort(/*states=*/true);
}

TEST(SessionDeviceFailure, AttendReturnsTheCommunicatorsFailure) {
  expect_no_success_after_an_abort(/*states=*/false);
}

}  // namespace
}  // namespace treeattn
