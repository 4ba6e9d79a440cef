// The decode driver (workload.hpp) on an executor and a session communicator of the caller's
// choosing (RunConfig::executor, RunConfig::device_comm), without a GPU.
//
// 1. The CPU executor given explicitly and a second in-process world as the session
//    communicator give the very bits of the default path (one communicator for everything), the
//    same byte counts per step, and those bytes are the session communicator's: its counters
//    grow by exactly what the steps report, and the host communicator carries no message.
// 2. The device path (treeattn bench --device cuda's code) on a stand-in device: an executor
//    that reports MemorySpace::kDevice but keeps its buffers in host memory, and fails any call
//    given a pointer it did not allocate (so a host query, a host shard or a host state buffer
//    handed to the "device" is an error here as it would be a fault on a GPU), paired with a
//    communicator that reports device memory and no user-defined reductions (what NCCL
//    reports) over an in-process world. Every strategy that backend offers, at 1, 2 and 3
//    ranks, is checked against the float64 oracle at each timed step and bit for bit against
//    the host path with the same strategy forms, with appends, the input scan and the per-step
//    agreement on (both over the host communicator there).
// 3. On such a device the automatic layout is rows and an explicit tiled layout is refused on
//    every rank with a message that says why; ranks that disagree on the run are named through
//    the host communicator (the session cannot all-gather host records over a device-memory
//    communicator), without waiting for a timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/roofline.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/session.hpp"
#include "treeattn/workload.hpp"

namespace treeattn {
namespace {

// Device memory space, host bytes; every pointer a call takes must lie in one of its buffers.
class StandInDevice final : public Executor {
 public:
  std::string_view name() const override { return "stand-in-device"; }
  MemorySpace memory() const override { return MemorySpace::kDevice; }
  Result<Buffer> allocate(std::size_t bytes) override {
    if (bytes == 0) return Buffer();
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) return Status(Code::kOutOfMemory, "stand-in device: no memory");
    std::memset(p, 0xA5, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    live_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return Buffer(this, p, bytes);
  }
  void release(void* data, std::size_t) noexcept override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_.erase(reinterpret_cast<uintptr_t>(data));
    }
    std::free(data);
  }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    TREEATTN_RETURN_IF_ERROR(mine(dst, bytes, "copy dst"));
    TREEATTN_RETURN_IF_ERROR(mine(src, bytes, "copy src"));
    std::memmove(dst, src, bytes);
    return Status::ok();
  }
  Status to_host(void* dst, const void* src, std::size_t bytes) override {
    TREEATTN_RETURN_IF_ERROR(mine(src, bytes, "to_host src"));
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  Status from_host(void* dst, const void* src, std::size_t bytes) override {
    TREEATTN_RETURN_IF_ERROR(mine(dst, bytes, "from_host dst"));
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  Status partial(const AttnShape& s, const float* q, const KVShard& kv, float* st,
                 const DecodeOptions& o) override {
    TREEATTN_RETURN_IF_ERROR(mine(q, 1, "partial query"));
    TREEATTN_RETURN_IF_ERROR(mine(st, 1, "partial states"));
    if (kv.k != nullptr) TREEATTN_RETURN_IF_ERROR(mine(kv.k, 1, "partial K"));
    if (kv.v != nullptr) TREEATTN_RETURN_IF_ERROR(mine(kv.v, 1, "partial V"));
    ++partial_calls;
    return cpu().partial(s, q, kv, st, o);
  }
  Status partial_chunks(const AttnShape& s, const float* q, const KVShard& kv, int64_t c, float* st,
                        const DecodeOptions& o) override {
    TREEATTN_RETURN_IF_ERROR(mine(q, 1, "partial_chunks query"));
    TREEATTN_RETURN_IF_ERROR(mine(st, 1, "partial_chunks states"));
    ++partial_calls;
    return cpu().partial_chunks(s, q, kv, c, st, o);
  }
  Status set_empty(float* st, std::size_t n, std::size_t d) override {
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(st, 1, "set_empty"));
    return cpu().set_empty(st, n, d);
  }
  Status merge(float* a, const float* x, std::size_t n, std::size_t d) override {
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(a, 1, "merge acc"));
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(x, 1, "merge x"));
    return cpu().merge(a, x, n, d);
  }
  Status merge_ordered(const float* p, std::size_t c, std::size_t ps, std::size_t n, std::size_t d,
                       float* out) override {
    if (n > 0 && c > 0) TREEATTN_RETURN_IF_ERROR(mine(p, 1, "merge_ordered parts"));
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(out, 1, "merge_ordered out"));
    return cpu().merge_ordered(p, c, ps, n, d, out);
  }
  Status lse(const float* st, std::size_t n, std::size_t d, float* out) override {
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(st, 1, "lse states"));
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(out, 1, "lse out"));
    return cpu().lse(st, n, d, out);
  }
  Status to_sum_form(const float* st, const float* m, std::size_t n, std::size_t d, float* num,
                     std::size_t ns, float* den) override {
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(st, 1, "to_sum_form states"));
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(num, 1, "to_sum_form num"));
    return cpu().to_sum_form(st, m, n, d, num, ns, den);
  }
  Status from_sum_form(const float* m, const float* num, std::size_t ns, const float* den,
                       std::size_t n, std::size_t d, float* st) override {
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(num, 1, "from_sum_form num"));
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(st, 1, "from_sum_form states"));
    return cpu().from_sum_form(m, num, ns, den, n, d, st);
  }
  Status normalize(const float* st, std::size_t n, std::size_t d, float* out, float* lse) override {
    if (n > 0) TREEATTN_RETURN_IF_ERROR(mine(st, 1, "normalize states"));
    return cpu().normalize(st, n, d, out, lse);
  }

  int partial_calls = 0;

  // kInvalidArgument unless [p, p + bytes) lies in a live buffer of this executor.
  Status mine(const void* p, std::size_t bytes, const char* what) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(a);
    if (it != live_.begin()) {
      --it;
      if (a >= it->first && a + bytes <= it->first + it->second) return Status::ok();
    }
    return invalid_argument(std::string("stand-in device: ") + what +
                            " is not in this executor's memory (a host pointer on a device)");
  }

 private:
  static Executor& cpu() { return cpu_executor(); }
  std::mutex mu_;
  std::map<uintptr_t, std::size_t> live_;
};

// A communicator without user-defined reductions (NCCL's capabilities) in the given memory
// space, over an in-process one: kDevice stands in for NCCL; kHost gives the host path the same
// strategy forms (tree as an all-gather) for a bit-for-bit comparison. Settings go in before
// each call and the counters come back after it.
class NoReductionComm final : public Communicator {
 public:
  NoReductionComm(std::unique_ptr<Communicator> inner, MemorySpace memory)
      : in_(std::move(inner)), memory_(memory) {}
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  int world_rank() const override { return in_->world_rank(); }
  std::string_view backend_name() const override {
    return memory_ == MemorySpace::kDevice ? "device-space" : "no-reductions";
  }
  CommCapabilities capabilities() const override {
    return {memory_, /*user_reductions=*/false, /*stream_ordered=*/memory_ == MemorySpace::kDevice};
  }
  Status allreduce(float* d, std::size_t n, ReduceOp op) override {
    return fwd([&] { return in_->allreduce(d, n, op); });
  }
  Status reduce(float* d, std::size_t n, ReduceOp op, int root) override {
    return fwd([&] { return in_->reduce(d, n, op, root); });
  }
  Status allreduce_states(float*, std::size_t, std::size_t) override {
    return unsupported("no user-defined reductions");
  }
  Status reduce_states(float*, std::size_t, std::size_t, int) override {
    return unsupported("no user-defined reductions");
  }
  Status allgather(const void* s, std::size_t b, void* r) override {
    if (device) {  // as NCCL would: both buffers must be device memory
      TREEATTN_RETURN_IF_ERROR(device->mine(s, b, "allgather send"));
      TREEATTN_RETURN_IF_ERROR(device->mine(r, b * static_cast<std::size_t>(size()), "allgather recv"));
    }
    return fwd([&] { return in_->allgather(s, b, r); });
  }
  StandInDevice* device = nullptr;  // when set, allgather checks its pointers against it
  Status gather(const void* s, std::size_t b, void* r, int root) override {
    return fwd([&] { return in_->gather(s, b, r, root); });
  }
  Status broadcast(void* d, std::size_t b, int root) override {
    return fwd([&] { return in_->broadcast(d, b, root); });
  }
  Status barrier() override {
    return fwd([&] { return in_->barrier(); });
  }
  Result<CommRequest> isend(const void* d, std::size_t b, int dest, int tag) override {
    return fwd([&] { return in_->isend(d, b, dest, tag); });
  }
  Result<CommRequest> irecv(void* d, std::size_t b, int src, int tag) override {
    return fwd([&] { return in_->irecv(d, b, src, tag); });
  }
  Status wait_all(std::span<const CommRequest> r) override {
    return fwd([&] { return in_->wait_all(r); });
  }
  Result<bool> test_all(std::span<const CommRequest> r) override {
    return fwd([&] { return in_->test_all(r); });
  }
  int max_tag() const override { return in_->max_tag(); }
  Result<std::unique_ptr<Communicator>> split(int, int) override {
    return unsupported("no-reductions test communicator: split");
  }
  Result<std::unique_ptr<Communicator>> split_shared(int) override {
    return unsupported("no-reductions test communicator: split_shared");
  }
  [[noreturn]] void abort(int code, std::string_view message) override {
    in_->abort(code, message);
    std::abort();  // not reached: the inner abort ends the process
  }

 private:
  template <class F>
  auto fwd(F call) -> decltype(call()) {
    in_->set_timeout(timeout());
    in_->set_context(context());
    auto r = call();
    mutable_counters() = in_->counters();
    return r;
  }
  std::unique_ptr<Communicator> in_;
  MemorySpace memory_;
};

// One wrapped in-process world of p ranks.
std::vector<std::unique_ptr<NoReductionComm>> wrapped_world(int p, MemorySpace memory) {
  std::vector<std::unique_ptr<NoReductionComm>> out;
  auto w = make_local_world(p);
  EXPECT_TRUE(w.is_ok()) << w.status().to_string();
  if (!w.is_ok()) return out;
  for (auto& c : *w) out.push_back(std::make_unique<NoReductionComm>(std::move(c), memory));
  return out;
}

RunConfig base_config() {
  RunConfig c;
  c.shape = AttnShape{2, 8, 2, 64, 2};  // GQA, batch 2, q_len 2
  c.dtype = DType::kBF16;
  c.total_len = {301, 190};
  c.seed = 7;
  c.warmup = 1;
  c.steps = 2;
  c.append = true;
  c.timeout = std::chrono::milliseconds(20000);
  c.options.kernel.threads = 1;
  return c;
}

std::vector<std::string> host_strategies() { return {"tree", "ring-kv", "allgather", "single"}; }

// Every strategy the device-memory backend offers (no user-defined reductions).
std::vector<std::string> device_strategies() {
  std::vector<std::string> v;
  const CommCapabilities caps{MemorySpace::kDevice, false, true};
  for (const StrategyInfo& i : StrategyRegistry::for_backend(caps).list()) v.emplace_back(i.name);
  return v;
}

bool same_bits(const StateBuffer& a, const StateBuffer& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

TEST(DriverDevice, ExplicitCpuExecutorAndSessionCommMatchTheDefaultPath) {
  constexpr int P = 3;
  auto second = make_local_world(P);
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  const std::vector<std::string> names = host_strategies();
  Status st = run_local(P, [&](Communicator& comm) -> Status {
    // No warm-up, so that the session communicator's traffic is the timed steps' only.
    RunConfig c = base_config();
    c.warmup = 0;
    c.steps = 3;
    auto plain = run_interleaved(comm, c, names);
    TREEATTN_RETURN_IF_ERROR(plain.status());

    Communicator& session_comm = *(*second)[static_cast<std::size_t>(comm.rank())];
    c.executor = &cpu_executor();
    c.device_comm = &session_comm;
    const CommCounters host_before = comm.counters(), ses_before = session_comm.counters();
    auto split = run_interleaved(comm, c, names);
    TREEATTN_RETURN_IF_ERROR(split.status());
    const CommCounters host_after = comm.counters(), ses_after = session_comm.counters();

    uint64_t reported_p2p = 0, reported_messages = 0;
    for (std::size_t m = 0; m < names.size(); ++m) {
      const RunReport& a = (*plain)[m];
      const RunReport& b = (*split)[m];
      if (a.states.size() != b.states.size() || a.steps.size() != b.steps.size())
        return internal_error(names[m] + ": different numbers of steps");
      for (std::size_t i = 0; i < a.states.size(); ++i)
        if (!same_bits(a.states[i], b.states[i]))
          return internal_error(names[m] + ": step " + std::to_string(i) +
                                " differs from the default path");
      for (std::size_t i = 0; i < a.steps.size(); ++i) {
        if (a.steps[i].p2p_bytes != b.steps[i].p2p_bytes ||
            a.steps[i].collective_payload_bytes != b.steps[i].collective_payload_bytes ||
            a.steps[i].collective_calls != b.steps[i].collective_calls)
          return internal_error(names[m] + ": step " + std::to_string(i) +
                                " counts different bytes than the default path");
        reported_p2p += b.steps[i].p2p_bytes;
        reported_messages += b.steps[i].p2p_messages;
      }
      if (a.kv_layout != b.kv_layout) return internal_error(names[m] + ": another layout");
    }
    // ring-kv sends its shards point to point: over the session communicator, all of it.
    if (reported_p2p == 0) return internal_error("no point-to-point bytes reported");
    if (ses_after.p2p_bytes - ses_before.p2p_bytes != reported_p2p ||
        ses_after.p2p_messages - ses_before.p2p_messages != reported_messages)
      return internal_error("the session communicator sent " +
                            std::to_string(ses_after.p2p_bytes - ses_before.p2p_bytes) +
                            " bytes, the steps report " + std::to_string(reported_p2p));
    if (host_after.p2p_bytes != host_before.p2p_bytes)
      return internal_error("the host communicator carried point-to-point messages");
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(DriverDevice, DevicePathMatchesTheOracleAndTheHostPath) {
  const std::vector<std::string> names = device_strategies();
  ASSERT_FALSE(names.empty());
  for (const int P : {1, 2, 3}) {
    auto dcomms = wrapped_world(P, MemorySpace::kDevice);
    auto hcomms = wrapped_world(P, MemorySpace::kHost);
    ASSERT_EQ(dcomms.size(), static_cast<std::size_t>(P));
    ASSERT_EQ(hcomms.size(), static_cast<std::size_t>(P));
    std::vector<std::unique_ptr<StandInDevice>> devices;
    for (int r = 0; r < P; ++r) devices.push_back(std::make_unique<StandInDevice>());
    Status st = run_local(P, [&](Communicator& comm) -> Status {
      const auto r = static_cast<std::size_t>(comm.rank());
      RunConfig host = base_config();
      host.kv_layout = KVLayout::kRows;
      host.device_comm = hcomms[r].get();  // the same strategy forms as over NCCL
      auto want = run_interleaved(comm, host, names);
      TREEATTN_RETURN_IF_ERROR(want.status());

      RunConfig dev = base_config();
      dev.executor = devices[r].get();
      dev.device_comm = dcomms[r].get();
      dev.check_inputs = true;
      dev.check_every_step = true;
      auto got = run_interleaved(comm, dev, names);
      TREEATTN_RETURN_IF_ERROR(got.status());
      if (devices[r]->partial_calls == 0) return internal_error("the device ran no kernel");

      for (std::size_t m = 0; m < names.size(); ++m) {
        const RunReport& g = (*got)[m];
        if (g.kv_layout != KVLayout::kRows)
          return internal_error(names[m] + ": the device shards are not rows");
        if (!g.has_result) continue;
        if (g.states.size() != static_cast<std::size_t>(dev.steps))
          return internal_error(names[m] + ": " + std::to_string(g.states.size()) + " states");
        for (std::size_t i = 0; i < g.states.size(); ++i) {
          const int64_t step = dev.warmup + static_cast<int64_t>(i);
          auto check = check_against_oracle(dev, step, g.states[i]);
          TREEATTN_RETURN_IF_ERROR(check.status());
          if (!check->passed)
            return internal_error(names[m] + " at " + std::to_string(P) + " ranks, step " +
                                  std::to_string(step) + ": " + check->detail);
          // The same strategy on the host's executor and communicator: the same kernel and
          // merges in the same order, so the same bits.
          if (!same_bits(g.states[i], (*want)[m].states[i]))
            return internal_error(names[m] + " at " + std::to_string(P) + " ranks, step " +
                                  std::to_string(step) + ": differs from the host path");
        }
      }
      return Status::ok();
    });
    EXPECT_TRUE(st.is_ok()) << P << " ranks: " << st.to_string();
  }
}

// The session's own agreement over the device communicator names the rank that differs.
TEST(DriverDevice, DeviceRefusesTiledAndNamesAMismatchedRank) {
  constexpr int P = 3;
  auto dcomms = wrapped_world(P, MemorySpace::kDevice);
  ASSERT_EQ(dcomms.size(), static_cast<std::size_t>(P));
  std::vector<std::unique_ptr<StandInDevice>> devices;
  for (int r = 0; r < P; ++r) devices.push_back(std::make_unique<StandInDevice>());
  const std::vector<std::string> names = {"tree", "allgather"};
  std::vector<Status> tiled(P), mismatch(P);
  const auto t0 = std::chrono::steady_clock::now();
  Status st = run_local(P, [&](Communicator& comm) -> Status {
    const auto r = static_cast<std::size_t>(comm.rank());
    RunConfig c = base_config();
    c.executor = devices[r].get();
    c.device_comm = dcomms[r].get();
    c.kv_layout = KVLayout::kTiled;
    tiled[r] = run_interleaved(comm, c, names).status();
    c.kv_layout = KVLayout::kAuto;
    if (r == 2) c.seed = 8;  // one rank generates other data
    mismatch[r] = run_interleaved(comm, c, names).status();
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10))
      << "waited for a timeout";
  for (int r = 0; r < P; ++r) {
    EXPECT_FALSE(tiled[r].is_ok()) << "rank " << r;
    EXPECT_NE(tiled[r].message().find("tiled KV layout is for host memory"), std::string::npos)
        << tiled[r].to_string();
    EXPECT_EQ(mismatch[r].code(), Code::kMismatch) << mismatch[r].to_string();
    EXPECT_NE(mismatch[r].message().find("rank 0 has seed=7, rank 2 has seed=8"), std::string::npos)
        << mismatch[r].to_string();
  }
}

// The session's own agreement (create, add_strategy, check_agreement) over a communicator in
// device memory stages its records through the executor: every buffer the all-gather sees is
// the device's, and a mismatch is still named on every rank.
TEST(DriverDevice, SessionAgreementStagesThroughTheDevice) {
  constexpr int P = 2;
  auto dcomms = wrapped_world(P, MemorySpace::kDevice);
  ASSERT_EQ(dcomms.size(), static_cast<std::size_t>(P));
  std::vector<std::unique_ptr<StandInDevice>> devices;
  for (int r = 0; r < P; ++r) {
    devices.push_back(std::make_unique<StandInDevice>());
    dcomms[static_cast<std::size_t>(r)]->device = devices.back().get();
  }
  std::vector<Status> same(P), added(P), differ(P);
  std::vector<std::thread> threads;  // one thread per rank of the wrapped in-process world
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      SessionConfig cfg;
      cfg.shape = AttnShape{1, 4, 2, 64, 1};
      cfg.context = {100};
      cfg.strategy = "allgather";
      cfg.timeout = std::chrono::milliseconds(10000);
      auto s = DecodeSession::create(*dcomms[i], cfg, *devices[i]);
      same[i] = s.status();
      if (s.is_ok()) added[i] = measure::add_strategy(**s, "ring-state", cfg.options).status();
      if (r == 1) cfg.shape.head_dim = 128;
      differ[i] = DecodeSession::create(*dcomms[i], cfg, *devices[i]).status();
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < P; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_TRUE(same[i].is_ok()) << "rank " << r << ": " << same[i].to_string();
    EXPECT_TRUE(added[i].is_ok()) << "rank " << r << ": " << added[i].to_string();
    EXPECT_EQ(differ[i].code(), Code::kMismatch) << differ[i].to_string();
    EXPECT_NE(differ[i].message().find("head_dim"), std::string::npos) << differ[i].to_string();
  }
}

// bench --kernel --device cuda's roofline (run_roofline_on) through the executor seam: on a
// stand-in device that rejects host pointers and on the CPU executor, every record is filled and
// matches the float64 oracle (f32, bf16, int8 with scales; GQA, Q 2, batch 2).
TEST(RooflineOn, StandInDeviceAndCpuExecutorMatchTheOracle) {
  RooflineOptions o;
  o.cases = {RooflineCase{AttnShape{2, 8, 2, 128, 1}, 3000},
             RooflineCase{AttnShape{1, 4, 4, 64, 2}, 1000}};
  o.dtypes = {DType::kF32, DType::kBF16, DType::kInt8};
  o.repeats = 2;
  o.probe_bytes = int64_t{1} << 20;
  StandInDevice device;
  for (Executor* exec : {static_cast<Executor*>(&device), &cpu_executor()}) {
    auto r = run_roofline_on(*exec, o);
    ASSERT_TRUE(r.is_ok()) << exec->name() << ": " << r.status().to_string();
    ASSERT_EQ(r->size(), 6u);
    for (const RooflineRecord& x : *r) {
      EXPECT_EQ(x.isa, std::string(exec->name()));
      EXPECT_EQ(x.layout, "rows");
      EXPECT_GT(x.gbps, 0);
      EXPECT_GT(x.bandwidth_gbps, 0);
      EXPECT_GT(x.fraction_of_bandwidth, 0);
      EXPECT_EQ(x.bound, "memory");
      EXPECT_GE(x.max_rel_error, 0);
      EXPECT_LT(x.max_rel_error, 1e-5) << x.shape << " " << x.dtype;
    }
  }
  EXPECT_GT(device.partial_calls, 0);
}

}  // namespace
}  // namespace treeattn
