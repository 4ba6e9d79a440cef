// LocalShard's device storage (sharding.hpp) on any machine: an executor that reports
// MemorySpace::kDevice but keeps its buffers in host memory (and counts its copies) stands in for
// the GPU, so the staging, the last-store-wins order, the run coalescing, the scale placement,
// zero fill, growth and the view's strides are checked byte for byte against the host shard fed
// the same stores, and the CPU kernel over both views gives the same bits. The GPU executor's
// own copies are checked on a device (test_cuda_executor).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "treeattn/executor.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/sharding.hpp"

namespace treeattn {
namespace {

// Device memory space, host bytes: every call is the CPU executor's, plus counters.
class HostBackedDevice final : public Executor {
 public:
  std::string_view name() const override { return "host-backed-device"; }
  MemorySpace memory() const override { return MemorySpace::kDevice; }
  Result<Buffer> allocate(std::size_t bytes) override {
    if (bytes == 0) return Buffer();
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) return Status(Code::kOutOfMemory, "test executor: no memory");
    std::memset(p, 0xA5, bytes);  // not zero: the shard must zero-fill by itself
    ++allocations;
    return Buffer(this, p, bytes);
  }
  void release(void* data, std::size_t) noexcept override { std::free(data); }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    ++copies;
    std::memmove(dst, src, bytes);
    return Status::ok();
  }
  Status to_host(void* dst, const void* src, std::size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }
  Status from_host(void* dst, const void* src, std::size_t bytes) override {
    ++from_host_calls;
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

  int allocations = 0, copies = 0, from_host_calls = 0;

 private:
  static Executor& cpu() { return cpu_executor(); }
};

struct Pair {
  AttnShape shape;
  DType dtype;
  ShardPlan plan;
  HostBackedDevice dev;
  LocalShard host, device;
};

std::unique_ptr<Pair> make_pair(DType dtype, std::vector<int64_t> lens, int64_t spare) {
  auto p = std::make_unique<Pair>();
  p->shape = AttnShape{static_cast<int64_t>(lens.size()), 4, 2, 64, 1};
  p->dtype = dtype;
  auto plan = ShardPlan::make(ShardKind::kEven, 2, std::move(lens));
  EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
  p->plan = *plan;
  auto h = LocalShard::create(p->shape, dtype, p->plan, 1, spare);
  auto d = LocalShard::create(p->shape, dtype, p->plan, 1, spare, &p->dev);
  EXPECT_TRUE(h.is_ok() && d.is_ok());
  p->host = std::move(*h);
  p->device = std::move(*d);
  return p;
}

// Every byte of K, V and the scales over the whole capacity, via the views' strides.
void expect_same_bytes(const Pair& p) {
  ASSERT_EQ(p.host.capacity(), p.device.capacity());
  const KVShard h = p.host.view(p.plan), d = p.device.view(p.plan);
  EXPECT_EQ(d.memory, MemorySpace::kDevice);
  EXPECT_EQ(h.stride_batch, d.stride_batch);
  EXPECT_EQ(h.stride_head, d.stride_head);
  EXPECT_EQ(h.stride_token, d.stride_token);
  const std::size_t es = dtype_size(p.dtype);
  const auto n = static_cast<std::size_t>(p.shape.batch * h.stride_batch) * es;
  EXPECT_EQ(std::memcmp(h.k, d.k, n), 0) << "K differs";
  EXPECT_EQ(std::memcmp(h.v, d.v, n), 0) << "V differs";
  if (dtype_is_quantized(p.dtype)) {
    EXPECT_EQ(h.scale_stride_batch, d.scale_stride_batch);
    EXPECT_EQ(h.scale_stride_head, d.scale_stride_head);
    const auto ns = static_cast<std::size_t>(p.shape.batch * h.scale_stride_batch) * sizeof(float);
    EXPECT_EQ(std::memcmp(h.k_scale, d.k_scale, ns), 0) << "K scales differ";
    EXPECT_EQ(std::memcmp(h.v_scale, d.v_scale, ns), 0) << "V scales differ";
  }
}

std::vector<float> random_token(std::mt19937_64& rng, const AttnShape& s) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> t(static_cast<std::size_t>(s.kv_heads * s.head_dim));
  for (float& x : t) x = u(rng);
  return t;
}

constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8};

TEST(DeviceShard, StoresInAnyOrderLastWinsAndMatchesTheHostShard) {
  for (DType t : kTypes) {
    auto p = make_pair(t, {40, 17, 0}, 3);
    std::mt19937_64 rng(11);
    // Random slots (with repeats, some slots never written) in random order.
    for (int i = 0; i < 120; ++i) {
      const auto b = static_cast<int64_t>(rng() % 3);
      const int64_t cap = p->host.capacity();
      const auto j = static_cast<int64_t>(rng() % static_cast<uint64_t>(cap));
      const auto k = random_token(rng, p->shape), v = random_token(rng, p->shape);
      p->host.set_slot(b, j, k.data(), v.data());
      p->device.set_slot(b, j, k.data(), v.data());
    }
    ASSERT_TRUE(p->device.flush().is_ok()) << dtype_name(t);
    expect_same_bytes(*p);
    EXPECT_EQ(p->device.dtype(), t);
    EXPECT_EQ(p->device.live_bytes(p->plan), p->host.live_bytes(p->plan));
    EXPECT_EQ(p->device.allocated_bytes(), p->host.allocated_bytes());
  }
}

TEST(DeviceShard, PrefillIsOneHostCopyAndOneDeviceCopyPerRunHeadAndTensor) {
  for (DType t : {DType::kBF16, DType::kFP8}) {
    auto p = make_pair(t, {1000, 999, 1}, 0);
    const int before = p->dev.from_host_calls, copies_before = p->dev.copies;
    std::mt19937_64 rng(3);
    for (int64_t b = 0; b < p->shape.batch; ++b)
      for (int64_t j = 0; j < p->plan.len(1, b); ++j) {
        const auto k = random_token(rng, p->shape), v = random_token(rng, p->shape);
        p->host.set_slot(b, j, k.data(), v.data());
        p->device.set_slot(b, j, k.data(), v.data());
      }
    ASSERT_TRUE(p->device.flush().is_ok());
    const int per_run = static_cast<int>(p->shape.kv_heads) * (dtype_is_quantized(t) ? 4 : 2);
    int runs = 0;  // rows this rank holds tokens of (rank 1: 500, 499 and 0 tokens)
    for (int64_t b = 0; b < p->shape.batch; ++b) runs += p->plan.len(1, b) > 0 ? 1 : 0;
    EXPECT_EQ(runs, 2);
    // One packed host-to-device copy (the staging buffer), then the segments device to device.
    EXPECT_EQ(p->dev.from_host_calls - before, 1) << dtype_name(t);
    EXPECT_EQ(p->dev.copies - copies_before, runs * per_run) << dtype_name(t);
    expect_same_bytes(*p);
    // Nothing staged: a second flush copies nothing.
    const int after = p->dev.from_host_calls, copies_after = p->dev.copies;
    ASSERT_TRUE(p->device.flush().is_ok());
    EXPECT_EQ(p->dev.from_host_calls, after);
    EXPECT_EQ(p->dev.copies, copies_after);
  }
}

TEST(DeviceShard, DecodeStepAppendsAreOneHostCopy) {
  // A decode step appends one token to every row: one host-to-device copy for all of them
  // (before: one per row, KV head and tensor), and the same bytes as the host shard.
  for (DType t : kTypes) {
    auto p = make_pair(t, {40, 30, 20}, 0);
    std::mt19937_64 rng(11);
    for (int step = 0; step < 3; ++step) {
      const int before = p->dev.from_host_calls;
      for (int64_t b = 0; b < p->shape.batch; ++b) {
        const int64_t j = p->plan.len(1, b) - 1 - step;
        if (j < 0) continue;
        const auto k = random_token(rng, p->shape), v = random_token(rng, p->shape);
        p->host.set_slot(b, j, k.data(), v.data());
        p->device.set_slot(b, j, k.data(), v.data());
      }
      ASSERT_TRUE(p->device.flush().is_ok()) << dtype_name(t);
      EXPECT_EQ(p->dev.from_host_calls - before, 1) << dtype_name(t) << " step " << step;
      expect_same_bytes(*p);
    }
  }
}

TEST(DeviceShard, GrowthKeepsFlushedAndStagedTokens) {
  for (DType t : kTypes) {
    auto p = make_pair(t, {10, 6}, 0);
    std::mt19937_64 rng(5);
    auto store = [&](int64_t b, int64_t j) {
      const auto k = random_token(rng, p->shape), v = random_token(rng, p->shape);
      p->host.set_slot(b, j, k.data(), v.data());
      p->device.set_slot(b, j, k.data(), v.data());
    };
    for (int64_t j = 0; j < 5; ++j) store(0, j);
    ASSERT_TRUE(p->device.flush().is_ok());
    for (int64_t j = 0; j < 3; ++j) store(1, j);  // staged, not flushed, when it grows
    p->host.reserve(p->host.capacity() + 1);
    p->device.reserve(p->device.capacity() + 1);
    ASSERT_TRUE(p->device.status().is_ok());
    for (int64_t j = 5; j < p->host.capacity(); ++j) store(0, j);
    ASSERT_TRUE(p->device.flush().is_ok());
    expect_same_bytes(*p);
  }
}

TEST(DeviceShard, ParallelStoresGiveTheSameShard) {
  auto p = make_pair(DType::kBF16, {600, 600}, 0);
  const int64_t n = p->plan.len(1, 0);
  std::vector<std::vector<float>> ks, vs;
  std::mt19937_64 rng(9);
  for (int64_t j = 0; j < 2 * n; ++j) {
    ks.push_back(random_token(rng, p->shape));
    vs.push_back(random_token(rng, p->shape));
  }
  for (int64_t j = 0; j < 2 * n; ++j)
    p->host.set_slot(j / n, j % n, ks[static_cast<std::size_t>(j)].data(),
                     vs[static_cast<std::size_t>(j)].data());
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int64_t j = w; j < 2 * n; j += 4)
        p->device.set_slot(j / n, j % n, ks[static_cast<std::size_t>(j)].data(),
                           vs[static_cast<std::size_t>(j)].data());
    });
  for (auto& th : threads) th.join();
  ASSERT_TRUE(p->device.flush().is_ok());
  expect_same_bytes(*p);
}

TEST(DeviceShard, KernelOverBothViewsGivesTheSameBits) {
  for (DType t : kTypes) {
    auto p = make_pair(t, {300, 123, 0}, 4);
    std::mt19937_64 rng(21);
    for (int64_t b = 0; b < p->shape.batch; ++b)
      for (int64_t j = 0; j < p->plan.len(1, b); ++j) {
        const auto k = random_token(rng, p->shape), v = random_token(rng, p->shape);
        p->host.set_slot(b, j, k.data(), v.data());
        p->device.set_slot(b, j, k.data(), v.data());
      }
    ASSERT_TRUE(p->device.flush().is_ok());
    std::vector<float> q(static_cast<std::size_t>(p->shape.batch * p->shape.heads * 64));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : q) x = u(rng);
    const std::size_t rec = static_cast<std::size_t>(p->shape.batch * p->shape.heads) * 66;
    std::vector<float> a(rec), b(rec);
    KVShard dv = p->device.view(p->plan);
    dv.memory = MemorySpace::kHost;  // host bytes behind the test executor
    ASSERT_TRUE(decode_partial(p->shape, q.data(), p->host.view(p->plan), a.data()).is_ok());
    ASSERT_TRUE(decode_partial(p->shape, q.data(), dv, b.data()).is_ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), rec * sizeof(float)), 0) << dtype_name(t);
  }
}

TEST(DeviceShard, AStoreBeyondTheCapacityIsAnErrorAtFlush) {
  auto p = make_pair(DType::kBF16, {8}, 0);
  std::mt19937_64 rng(1);
  const auto k = random_token(rng, p->shape), v = random_token(rng, p->shape);
  p->device.set_slot(0, p->device.capacity(), k.data(), v.data());  // no reserve
  const Status s = p->device.flush();
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("outside the capacity"), std::string::npos) << s.message();
  EXPECT_EQ(p->device.status().code(), Code::kInvalidArgument);
}

TEST(DeviceShard, HostExecutorKeepsTheHostPath) {
  AttnShape shape{1, 2, 2, 64, 1};
  auto plan = ShardPlan::make(ShardKind::kEven, 1, {5});
  ASSERT_TRUE(plan.is_ok());
  auto s = LocalShard::create(shape, DType::kBF16, *plan, 0, 0, &cpu_executor());
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->memory(), MemorySpace::kHost);
  EXPECT_EQ(s->cache().capacity(), 5);
  EXPECT_EQ(s->view(*plan).memory, MemorySpace::kHost);
  EXPECT_TRUE(s->flush().is_ok());
}

}  // namespace
}  // namespace treeattn
