// The CUDA executor on a GPU (label gpu; every test skips with the reason where the machine has
// no CUDA device or driver, or the build has no CUDA, and fails where a device is there but no
// executor can be made on it: cuda_presence.hpp). Partial states against the
// float64 oracle over dtypes, head dims, GQA groups, q_len > 1, ragged and large batches, shard
// views (offset and striped positions), fixed split lengths and poisoned outputs;
// partial_chunks and the state kernels against the CPU executor; exact widening of every f16,
// bf16, fp8 and int8 value; error messages; CUDA graph capture and replay, and the buffers a
// graph keeps when the executor's own grow.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_presence.hpp"
#include "kernels/cuda/decode_geometry.hpp"
#include "support/test_data.hpp"
#include "tools/gpu_check/state_tolerance.hpp"
#include "treeattn/executor_cuda.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/state.hpp"

namespace treeattn {
namespace {

using testing::compare_states;
using testing::Errors;
using testing::Problem;

class CudaExecutorTest : public ::testing::Test {
 protected:
  // Skips only where the machine has no CUDA device or driver (cuda_presence.hpp); a device
  // that is there but cannot be used (an old driver, no image for its architecture, no memory)
  // fails the test.
  void SetUp() override {
    auto e = make_cuda_executor();
    if (!e.is_ok()) {
      const std::string absent = gpu::cuda_absence(gpu::probe_cuda());
      if (!absent.empty()) GTEST_SKIP() << "no CUDA device here: " << absent;
      FAIL() << "a CUDA device is present but the executor failed: " << e.status().to_string();
    }
    exec = std::move(*e);
  }

  // A device buffer holding `bytes` of host data (or poison when host is null).
  Buffer upload(const void* host, std::size_t bytes) {
    auto b = exec->allocate(bytes);
    EXPECT_TRUE(b.is_ok()) << b.status().to_string();
    if (!b.is_ok()) return Buffer();
    if (host) {
      EXPECT_TRUE(exec->from_host(b->data(), host, bytes).is_ok());
    } else {
      const std::vector<float> nan(bytes / sizeof(float), std::numeric_limits<float>::quiet_NaN());
      EXPECT_TRUE(exec->from_host(b->data(), nan.data(), nan.size() * sizeof(float)).is_ok());
    }
    return std::move(*b);
  }
  template <class T>
  std::vector<T> download(const Buffer& b, std::size_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(exec->to_host(v.data(), b.data(), n * sizeof(T)).is_ok());
    return v;
  }

  // The cache of p on the device and a view of it that mirrors `host_view` (same offsets).
  struct DeviceCache {
    Buffer k, v, ks, vs;
  };
  DeviceCache upload_cache(const KVCache& c, int64_t batch) {
    DeviceCache d;
    const std::size_t codes =
        static_cast<std::size_t>(batch * c.stride_batch()) * dtype_size(c.dtype());
    d.k = upload(c.k_data(), codes);
    d.v = upload(c.v_data(), codes);
    if (dtype_is_quantized(c.dtype())) {
      const std::size_t sn =
          static_cast<std::size_t>(batch * c.stride_batch() / c.stride_token()) * sizeof(float);
      d.ks = upload(c.k_scale_data(), sn);
      d.vs = upload(c.v_scale_data(), sn);
    }
    return d;
  }
  static KVShard on_device(const KVShard& h, const KVCache& c, const DeviceCache& d) {
    KVShard s = h;
    s.memory = MemorySpace::kDevice;
    const auto off = static_cast<const uint8_t*>(h.k) - static_cast<const uint8_t*>(c.k_data());
    s.k = static_cast<const uint8_t*>(d.k.data()) + off;
    s.v = static_cast<const uint8_t*>(d.v.data()) + off;
    if (h.k_scale) {
      s.k_scale = d.ks.as<float>() + (h.k_scale - c.k_scale_data());
      s.v_scale = d.vs.as<float>() + (h.v_scale - c.v_scale_data());
    }
    return s;
  }

  // The graph tests' step: 2 bf16 rows of 20000 and 3000 tokens (32 heads, 8 KV heads) on the
  // device, the query uploaded and a poisoned state buffer.
  struct GraphStep {
    const AttnShape shape{2, 32, 8, 128, 1};
    Problem p{shape, DType::kBF16, {20000, 3000}, 4};
    DeviceCache d;
    KVShard dv;
    const std::size_t rows = 2 * 32, recf = rows * 130;
    Buffer qd, st;
  };
  std::unique_ptr<GraphStep> graph_step() {
    auto g = std::make_unique<GraphStep>();
    g->d = upload_cache(g->p.cache, g->shape.batch);
    g->dv = on_device(g->p.whole(), g->p.cache, g->d);
    g->qd = upload(g->p.q.data(), g->p.q.size() * sizeof(float));
    g->st = upload(nullptr, g->recf * sizeof(float));
    return g;
  }

  // partial() of q against a host view on the device, checked against the float64 oracle on the
  // same view (the normalized output and LSE of the view's visible keys).
  void expect_matches_oracle(const AttnShape& shape, const std::vector<float>& q,
                             const KVCache& cache, const KVShard& view, const DecodeOptions& opt,
                             const std::string& what) {
    const DeviceCache d = upload_cache(cache, shape.batch);
    const KVShard dv = on_device(view, cache, d);
    const std::size_t rows = static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads);
    const std::size_t recf = rows * static_cast<std::size_t>(shape.head_dim + 2);
    Buffer qd = upload(q.data(), q.size() * sizeof(float));
    Buffer st = upload(nullptr, recf * sizeof(float));  // poisoned
    const Status s = exec->partial(shape, qd.as<float>(), dv, st.as<float>(), opt);
    ASSERT_TRUE(s.is_ok()) << what << ": " << s.to_string();
    const std::vector<float> states = download<float>(st, recf);
    std::vector<double> out(rows * static_cast<std::size_t>(shape.head_dim)), lse(rows);
    ASSERT_TRUE(oracle_attention(shape, q.data(), view, out.data(), lse.data(),
                                 static_cast<double>(opt.scale))
                    .is_ok());
    const Errors e = compare_states(shape, states.data(), out.data(), lse.data());
    EXPECT_FALSE(e.nan_mismatch) << what;
    EXPECT_LE(e.out_rel(), 1e-5) << what;
    EXPECT_LE(e.lse_abs, 1e-5) << what;
  }

  std::unique_ptr<Executor> exec;
};

constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8};

TEST_F(CudaExecutorTest, PartialMatchesTheOracle) {
  struct Case {
    AttnShape shape;
    std::vector<int64_t> len;
  };
  const std::vector<Case> cases = {
      {{1, 8, 8, 0, 1}, {1}},                   // MHA, one token
      {{3, 32, 8, 0, 1}, {5000, 0, 777}},       // GQA 4, ragged, an empty row, splits
      {{2, 8, 1, 0, 3}, {1031, 2}},             // GQA 8 x Q 3 = 24 rows: 3 row groups
      {{5, 6, 2, 0, 2}, {1, 2, 3, 300, 4099}},  // GQA 3 x Q 2 = 6 rows (8-row blocks)
      {{2, 4, 2, 0, 5}, {3, 17}},               // Q > context of a row
  };
  uint64_t seed = 1;
  for (const Case& c : cases)
    for (int d : {64, 128})
      for (DType t : kTypes) {
        AttnShape shape = c.shape;
        shape.head_dim = d;
        Problem p(shape, t, c.len, seed++);
        expect_matches_oracle(shape, p.q, p.cache, p.whole(), {},
                              shape.to_string() + " " + std::string(dtype_name(t)));
      }
}

TEST_F(CudaExecutorTest, ShardViewsOffsetStripedAndFixedSplits) {
  // A middle shard of a longer context (pos_start > 0, total_len > len), and a striped shard
  // (pos_stride 3), with q_len 4 so the causal limit cuts inside the shard.
  for (DType t : {DType::kBF16, DType::kFP8}) {
    const AttnShape shape{2, 16, 4, 128, 4};
    Problem p(shape, t, {900, 650}, 77);
    const std::vector<int64_t> len{700, 650}, pos{100, 1};
    for (int64_t stride : {1, 3}) {
      // Row 0's last query sees 2 positions past the shard, row 1's exactly its last one.
      const std::vector<int64_t> total{pos[0] + stride * (len[0] - 1) + 3,
                                       pos[1] + stride * (len[1] - 1) + 1};
      const KVShard v = p.cache.view(100, len, pos, total, stride);  // slots 100.. of the cache
      for (int64_t chunk : {0, 100, 999}) {
        DecodeOptions o;
        o.chunk_tokens = chunk;
        expect_matches_oracle(shape, p.q, p.cache, v, o,
                              std::string(dtype_name(t)) + " stride " + std::to_string(stride) +
                                  " chunk " + std::to_string(chunk));
      }
    }
  }
}

TEST_F(CudaExecutorTest, BatchesLargerThanOneLaunch) {
  std::vector<int64_t> len(gpu::kMaxBatchPerLaunch * 2 + 3);
  for (std::size_t b = 0; b < len.size(); ++b) len[b] = static_cast<int64_t>((b * 37) % 300);
  const AttnShape shape{static_cast<int64_t>(len.size()), 8, 2, 64, 1};
  Problem p(shape, DType::kF16, len, 5);
  expect_matches_oracle(shape, p.q, p.cache, p.whole(), {}, "batch 131");
}

TEST_F(CudaExecutorTest, EmptyShardGivesEmptyStates) {
  const AttnShape shape{2, 4, 2, 64, 1};
  Problem p(shape, DType::kBF16, {0, 0}, 3);
  const std::size_t recf = 2 * 4 * 66;
  Buffer qd = upload(p.q.data(), p.q.size() * sizeof(float));
  Buffer st = upload(nullptr, recf * sizeof(float));
  const DeviceCache d = upload_cache(p.cache, shape.batch);
  // No slot is addressed, so no strides are checked: a negative token stride (and any chunk)
  // gives the same empty states.
  KVShard neg = on_device(p.whole(), p.cache, d);
  neg.stride_token = -64;
  DecodeOptions one;
  one.chunk_tokens = 3;
  for (const KVShard& kv : {on_device(p.whole(), p.cache, d), neg})
    for (const DecodeOptions& o : {DecodeOptions{}, one}) {
      const std::vector<float> seven(recf, 7.0f);
      ASSERT_TRUE(exec->from_host(st.data(), seven.data(), recf * sizeof(float)).is_ok());
      ASSERT_TRUE(exec->partial(shape, qd.as<float>(), kv, st.as<float>(), o).is_ok());
      const auto s = download<float>(st, recf);
      for (std::size_t r = 0; r < 8; ++r) {
        EXPECT_EQ(s[r * 66], -std::numeric_limits<float>::infinity());
        for (std::size_t i = 1; i < 66; ++i) EXPECT_EQ(s[r * 66 + i], 0.0f);
      }
    }
}

TEST_F(CudaExecutorTest, PartialChunksMatchTheCpuExecutor) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kInt8}) {
    const AttnShape shape{3, 8, 4, 64, 2};
    Problem p(shape, t, {700, 256, 0}, 9);
    const int64_t chunk = 256;
    const std::size_t per = static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads) * 66;
    const std::size_t chunks = 3;  // ceil(700 / 256)
    std::vector<float> cpu(per * chunks);
    ASSERT_TRUE(
        cpu_executor().partial_chunks(shape, p.q.data(), p.whole(), chunk, cpu.data(), {}).is_ok());
    const DeviceCache d = upload_cache(p.cache, shape.batch);
    Buffer qd = upload(p.q.data(), p.q.size() * sizeof(float));
    Buffer st = upload(nullptr, per * chunks * sizeof(float));
    ASSERT_TRUE(exec->partial_chunks(shape, qd.as<float>(), on_device(p.whole(), p.cache, d), chunk,
                                     st.as<float>(), {})
                    .is_ok());
    const auto gpu = download<float>(st, per * chunks);
    for (std::size_t r = 0; r < per * chunks / 66; ++r) {
      const float* a = cpu.data() + r * 66;
      const float* b = gpu.data() + r * 66;
      ASSERT_EQ(state_is_empty(a), state_is_empty(b)) << dtype_name(t) << " record " << r;
      if (state_is_empty(a)) continue;
      std::vector<float> oa(64), ob(64);
      float la = 0, lb = 0;
      state_normalize(a, 64, oa.data(), &la);
      state_normalize(b, 64, ob.data(), &lb);
      EXPECT_NEAR(la, lb, 1e-5f * std::max(1.0f, std::abs(la)));
      for (int i = 0; i < 64; ++i)
        EXPECT_NEAR(oa[static_cast<std::size_t>(i)], ob[static_cast<std::size_t>(i)], 1e-5f);
    }
  }
}

// Records with every special case: empty, -0 and +0 maxima, NaN, large spreads.
std::vector<float> special_records(std::size_t n, std::size_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), m(-30.0f, 30.0f), l(1.0f, 100.0f);
  std::vector<float> r(n * (d + 2));
  for (std::size_t i = 0; i < n; ++i) {
    float* rec = r.data() + i * (d + 2);
    const auto kind = rng() % 10;
    if (kind == 0) {
      state_set_empty(rec, d);
      continue;
    }
    rec[0] = kind == 1 ? -0.0f : kind == 2 ? 0.0f : kind == 3 ? std::nanf("") : m(rng);
    rec[1] = l(rng);
    for (std::size_t k = 0; k < d; ++k) rec[2 + k] = u(rng) * rec[1];
  }
  return r;
}

// Per-float agreement for the kernels without a sum of terms that may cancel (lse, normalize,
// the sum form, which scale each value): within 4e-6 relative (the device's expf / logf).
bool same_or_close(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::abs(a - b) <= 4e-6f * std::max(1.0f, std::max(std::abs(a), std::abs(b)));
}

TEST_F(CudaExecutorTest, StateKernelsMatchTheCpuExecutor) {
  for (std::size_t d : {64, 80, 128, 256}) {
    const std::size_t n = 301, rf = d + 2, parts = 5;
    const auto all = special_records(n * parts, d, d);
    Buffer ad = upload(all.data(), all.size() * sizeof(float));
    Executor& cpu = cpu_executor();
    auto check = [&](const std::vector<float>& want, const Buffer& got, const char* op) {
      const auto g = download<float>(got, want.size());
      int bad = 0;
      for (std::size_t i = 0; i < want.size(); ++i)
        if (!same_or_close(want[i], g[i]) && bad++ < 5)
          ADD_FAILURE() << op << " d=" << d << " element " << i << ": cpu " << want[i] << " gpu "
                        << g[i];
    };
    // Merged records: within the bound of the inputs' weighted magnitudes (the terms cancel,
    // so a bound relative to the result fails a correct merge; state_tolerance.hpp).
    auto check_merged = [&](const std::vector<float>& want, const Buffer& got, std::size_t k,
                            const char* op) {
      const auto g = download<float>(got, want.size());
      int bad = 0;
      for (std::size_t r = 0; r < n; ++r) {
        std::vector<const float*> in;
        for (std::size_t p = 0; p < k; ++p) in.push_back(all.data() + (p * n + r) * rf);
        const double e = tolerance::merged_record_excess(in.data(), k, d, g.data() + r * rf,
                                                         want.data() + r * rf);
        if (!(e <= 1.0) && bad++ < 5)
          ADD_FAILURE() << op << " d=" << d << " record " << r << ": " << e
                        << " times the bound (m cpu " << want[r * rf] << " gpu " << g[r * rf]
                        << ")";
      }
    };
    // merge_ordered
    std::vector<float> out(n * rf);
    ASSERT_TRUE(cpu.merge_ordered(all.data(), parts, n * rf, n, d, out.data()).is_ok());
    Buffer od = upload(nullptr, n * rf * sizeof(float));
    ASSERT_TRUE(exec->merge_ordered(ad.as<float>(), parts, n * rf, n, d, od.as<float>()).is_ok());
    check_merged(out, od, parts, "merge_ordered");
    // merge in place
    std::vector<float> acc(all.begin(), all.begin() + static_cast<long>(n * rf));
    ASSERT_TRUE(cpu.merge(acc.data(), all.data() + n * rf, n, d).is_ok());
    Buffer accd = upload(all.data(), n * rf * sizeof(float));
    ASSERT_TRUE(exec->merge(accd.as<float>(), ad.as<float>() + n * rf, n, d).is_ok());
    check_merged(acc, accd, 2, "merge");
    // lse, normalize
    std::vector<float> lse(n), nout(n * d), nlse(n);
    ASSERT_TRUE(cpu.lse(all.data(), n, d, lse.data()).is_ok());
    ASSERT_TRUE(cpu.normalize(all.data(), n, d, nout.data(), nlse.data()).is_ok());
    Buffer lsed = upload(nullptr, n * sizeof(float)),
           noutd = upload(nullptr, n * d * sizeof(float)),
           nlsed = upload(nullptr, n * sizeof(float));
    ASSERT_TRUE(exec->lse(ad.as<float>(), n, d, lsed.as<float>()).is_ok());
    ASSERT_TRUE(
        exec->normalize(ad.as<float>(), n, d, noutd.as<float>(), nlsed.as<float>()).is_ok());
    check(lse, lsed, "lse");
    check(nout, noutd, "normalize");
    check(nlse, nlsed, "normalize lse");
    // sum form, separate and fused weights, and back
    std::vector<float> mx(n);
    for (std::size_t i = 0; i < n; ++i) mx[i] = std::isnan(lse[i]) ? lse[i] : lse[i] + 0.5f;
    Buffer mxd = upload(mx.data(), n * sizeof(float));
    for (bool fused : {false, true}) {
      const std::size_t ns = fused ? d + 1 : d;
      std::vector<float> num(n * ns), den(n), back(n * rf);
      ASSERT_TRUE(
          cpu.to_sum_form(all.data(), mx.data(), n, d, num.data(), ns, fused ? nullptr : den.data())
              .is_ok());
      ASSERT_TRUE(cpu.from_sum_form(mx.data(), num.data(), ns, fused ? nullptr : den.data(), n, d,
                                    back.data())
                      .is_ok());
      Buffer numd = upload(nullptr, n * ns * sizeof(float)),
             dend = upload(nullptr, n * sizeof(float)),
             backd = upload(nullptr, n * rf * sizeof(float));
      ASSERT_TRUE(exec->to_sum_form(ad.as<float>(), mxd.as<float>(), n, d, numd.as<float>(), ns,
                                    fused ? nullptr : dend.as<float>())
                      .is_ok());
      ASSERT_TRUE(exec->from_sum_form(mxd.as<float>(), numd.as<float>(), ns,
                                      fused ? nullptr : dend.as<float>(), n, d, backd.as<float>())
                      .is_ok());
      check(num, numd, fused ? "to_sum_form fused" : "to_sum_form");
      if (!fused) check(den, dend, "to_sum_form den");
      check(back, backd, fused ? "from_sum_form fused" : "from_sum_form");
    }
    // set_empty
    std::vector<float> empty(n * rf);
    ASSERT_TRUE(cpu.set_empty(empty.data(), n, d).is_ok());
    Buffer ed = upload(nullptr, n * rf * sizeof(float));
    ASSERT_TRUE(exec->set_empty(ed.as<float>(), n, d).is_ok());
    const auto eg = download<float>(ed, n * rf);
    EXPECT_EQ(std::memcmp(eg.data(), empty.data(), n * rf * sizeof(float)), 0);
  }
}

// One token per row with q = 0: every weight is exactly 1, so o is V's widened value bit for bit.
TEST_F(CudaExecutorTest, WidensEveryValueExactly) {
  for (DType t : kTypes) {
    const int64_t D = 128;
    const std::size_t values = t == DType::kF32 ? 4096 : dtype_size(t) == 2 ? 65536 : 256;
    const int64_t B = static_cast<int64_t>((values + D - 1) / static_cast<std::size_t>(D));
    const AttnShape shape{B, 1, 1, D, 1};
    KVCache cache(shape, t, 1);
    std::mt19937_64 rng(1);
    for (std::size_t i = 0; i < static_cast<std::size_t>(B * D); ++i) {
      const std::size_t code = i % values;
      switch (t) {
        case DType::kF32: {
          const uint32_t bits = static_cast<uint32_t>(rng());
          std::memcpy(static_cast<uint8_t*>(cache.v_data()) + i * 4, &bits, 4);
          break;
        }
        case DType::kF16:
        case DType::kBF16:
          static_cast<uint16_t*>(cache.v_data())[i] = static_cast<uint16_t>(code);
          break;
        default:
          static_cast<uint8_t*>(cache.v_data())[i] = static_cast<uint8_t>(code);
      }
    }
    if (dtype_is_quantized(t))
      for (int64_t b = 0; b < B; ++b) {
        cache.k_scale_data()[cache.scale_index(b, 0, 0)] = 1.0f;
        cache.v_scale_data()[cache.scale_index(b, 0, 0)] = 1.0f;
      }
    std::vector<int64_t> one(static_cast<std::size_t>(B), 1), zero(static_cast<std::size_t>(B), 0);
    const KVShard view = cache.view(0, one, zero, one, 1);
    const std::vector<float> q(static_cast<std::size_t>(B * D), 0.0f);
    const DeviceCache d = upload_cache(cache, shape.batch);
    Buffer qd = upload(q.data(), q.size() * sizeof(float));
    const std::size_t recf = static_cast<std::size_t>(B * (D + 2));
    Buffer st = upload(nullptr, recf * sizeof(float));
    ASSERT_TRUE(exec->partial(shape, qd.as<float>(), on_device(view, cache, d), st.as<float>(), {})
                    .is_ok());
    const auto s = download<float>(st, recf);
    int bad = 0;
    for (int64_t b = 0; b < B; ++b) {
      ASSERT_EQ(s[static_cast<std::size_t>(b * (D + 2) + 1)], 1.0f);  // l = 1
      for (int64_t e = 0; e < D; ++e) {
        const std::size_t i = static_cast<std::size_t>(b * D + e);
        const float want = load_as_float(cache.v_data(), t, i);
        const float got = s[static_cast<std::size_t>(b * (D + 2) + 2 + e)];
        // Exact; -0 comes back as +0 (the sum starts at +0, as on the CPU).
        const bool ok = std::isnan(want) ? std::isnan(got) : want == got;
        if (!ok && bad++ < 5)
          ADD_FAILURE() << dtype_name(t) << " element " << i << ": want " << want << " got " << got;
      }
    }
  }
}

TEST_F(CudaExecutorTest, ErrorsNameTheProblem) {
  const AttnShape shape{1, 4, 2, 64, 1};
  Problem p(shape, DType::kBF16, {10}, 1);
  const DeviceCache d = upload_cache(p.cache, shape.batch);
  KVShard dv = on_device(p.whole(), p.cache, d);
  Buffer qd = upload(p.q.data(), p.q.size() * sizeof(float));
  Buffer st = upload(nullptr, 4 * 66 * sizeof(float));
  // Head dim without a CUDA kernel.
  {
    AttnShape s80 = shape;
    s80.head_dim = 80;
    Problem p80(s80, DType::kBF16, {10}, 1);
    const DeviceCache d80 = upload_cache(p80.cache, s80.batch);
    Buffer q80 = upload(p80.q.data(), p80.q.size() * sizeof(float));
    Buffer st80 = upload(nullptr, 4 * 82 * sizeof(float));
    const Status s = exec->partial(s80, q80.as<float>(), on_device(p80.whole(), p80.cache, d80),
                                   st80.as<float>(), {});
    EXPECT_EQ(s.code(), Code::kUnsupported);
    EXPECT_NE(s.message().find("64, 128"), std::string::npos) << s.message();
  }
  // KV marked as host memory, and a host query.
  KVShard hv = dv;
  hv.memory = MemorySpace::kHost;
  EXPECT_EQ(exec->partial(shape, qd.as<float>(), hv, st.as<float>(), {}).code(),
            Code::kInvalidArgument);
  const Status hq = exec->partial(shape, p.q.data(), dv, st.as<float>(), {});
  EXPECT_EQ(hq.code(), Code::kInvalidArgument);
  EXPECT_NE(hq.message().find("host memory"), std::string::npos) << hq.message();
  // Misaligned K.
  KVShard mis = dv;
  mis.k = static_cast<const uint8_t*>(dv.k) + 2;
  EXPECT_EQ(exec->partial(shape, qd.as<float>(), mis, st.as<float>(), {}).code(),
            Code::kUnsupported);
  // A chunk past the shard's 10 slots plans one split of those 10, however large the chunk (at
  // token stride 64 the 32-bit slot offsets reach 2^26 slots).
  for (int64_t c : {(int64_t{1} << 26) + 1, int64_t{1} << 40}) {
    DecodeOptions big;
    big.chunk_tokens = c;
    EXPECT_TRUE(exec->partial(shape, qd.as<float>(), dv, st.as<float>(), big).is_ok()) << c;
    EXPECT_TRUE(exec->partial_chunks(shape, qd.as<float>(), dv, c, st.as<float>(), {}).is_ok())
        << c;
  }
  // A split that really spans more slots than the 32-bit slot offsets reach: at a token stride of
  // 2^31 elements a split has 2 slots at the most, and a chunk of 3 of the 10 is refused before
  // anything is read.
  KVShard wide = dv;
  wide.stride_token = int64_t{1} << 31;
  DecodeOptions three;
  three.chunk_tokens = 3;
  const Status hs = exec->partial(shape, qd.as<float>(), wide, st.as<float>(), three);
  EXPECT_EQ(hs.code(), Code::kUnsupported);
  EXPECT_NE(hs.message().find("32-bit slot offsets"), std::string::npos) << hs.message();
  EXPECT_NE(hs.message().find("at most 2 slots"), std::string::npos) << hs.message();
  EXPECT_EQ(exec->partial_chunks(shape, qd.as<float>(), wide, 3, st.as<float>(), {}).code(),
            Code::kUnsupported);
  // The executor is still usable.
  EXPECT_TRUE(exec->partial(shape, qd.as<float>(), dv, st.as<float>(), {}).is_ok());
  EXPECT_TRUE(exec->synchronize().is_ok());
  // Not a CUDA executor.
  EXPECT_EQ(cuda_stream(cpu_executor()).status().code(), Code::kInvalidArgument);
}

TEST_F(CudaExecutorTest, GraphReplayGivesTheEagerBits) {
  const auto g = graph_step();
  const AttnShape& shape = g->shape;
  const KVShard& dv = g->dv;
  const std::size_t rows = g->rows;
  Buffer &qd = g->qd, &st = g->st;
  Buffer out = upload(nullptr, rows * 128 * sizeof(float));
  auto step = [&] {
    EXPECT_TRUE(exec->partial(shape, qd.as<float>(), dv, st.as<float>(), {}).is_ok());
    EXPECT_TRUE(exec->normalize(st.as<float>(), rows, 128, out.as<float>(), nullptr).is_ok());
  };
  step();  // eager (and grows the split workspace)
  const auto eager = download<float>(out, rows * 128);
  Buffer poison = upload(nullptr, rows * 128 * sizeof(float));
  ASSERT_TRUE(exec->copy(out.data(), poison.data(), rows * 128 * sizeof(float)).is_ok());
  ASSERT_TRUE(cuda_capture_begin(*exec).is_ok());
  step();
  // Not stream operations: refused while capturing, and the capture stays valid.
  EXPECT_EQ(exec->allocate(1024).status().code(), Code::kUnsupported);
  std::vector<float> tmp(4);
  EXPECT_EQ(exec->to_host(tmp.data(), st.data(), 16).code(), Code::kUnsupported);
  auto graph = cuda_capture_end(*exec);
  ASSERT_TRUE(graph.is_ok()) << graph.status().to_string();
  // Captured, not run: out still holds the poison.
  const auto before = download<float>(out, rows * 128);
  EXPECT_TRUE(std::isnan(before[0]));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*graph)->replay().is_ok());
  ASSERT_TRUE(exec->synchronize().is_ok());
  const auto replayed = download<float>(out, rows * 128);
  EXPECT_EQ(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(float)), 0);
}

// A graph keeps the split workspace it was captured with (graph_buffers.hpp): when a longer step
// makes it grow, the old one stays allocated while the graph lives, so a replay gives the
// captured step's bits and writes nothing into memory allocated since (a buffer of the old
// workspace's size, allocated right after the growth, where a freed workspace would most likely
// be handed out again, stays NaN). A capture that would need the workspace to grow is refused
// and leaves it as it was.
TEST_F(CudaExecutorTest, AGraphKeepsTheBuffersItWasCapturedWith) {
  const auto g = graph_step();
  const AttnShape& shape = g->shape;
  const KVShard& dv = g->dv;
  const std::size_t recf = g->recf;
  Buffer &qd = g->qd, &st = g->st;
  DecodeOptions coarse, fine, finer;
  coarse.chunk_tokens = 2000;  // 10 splits: a workspace of 10 x 64 records
  fine.chunk_tokens = 64;      // 313 splits
  finer.chunk_tokens = 16;     // 1250 splits
  ASSERT_TRUE(exec->partial(shape, qd.as<float>(), dv, st.as<float>(), coarse).is_ok());
  const auto eager = download<float>(st, recf);
  ASSERT_TRUE(cuda_capture_begin(*exec).is_ok());
  EXPECT_TRUE(exec->partial(shape, qd.as<float>(), dv, st.as<float>(), coarse).is_ok());
  auto graph = cuda_capture_end(*exec);
  ASSERT_TRUE(graph.is_ok()) << graph.status().to_string();
  // The workspace grows (the old one is kept), then memory of the old size is handed out.
  Buffer st2 = upload(nullptr, recf * sizeof(float));
  ASSERT_TRUE(exec->partial(shape, qd.as<float>(), dv, st2.as<float>(), fine).is_ok());
  const auto fine_bits = download<float>(st2, recf);
  Buffer filler = upload(nullptr, 10 * recf * sizeof(float));
  Buffer poison = upload(nullptr, recf * sizeof(float));
  ASSERT_TRUE(exec->copy(st.data(), poison.data(), recf * sizeof(float)).is_ok());
  ASSERT_TRUE((*graph)->replay().is_ok());
  ASSERT_TRUE(exec->synchronize().is_ok());
  const auto replayed = download<float>(st, recf);
  EXPECT_EQ(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(float)), 0);
  const auto untouched = download<float>(filler, 10 * recf);
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float x) {
    return std::isnan(x);
  })) << "the replay wrote into memory allocated after the workspace grew";
  // A capture that needs a larger workspace is refused, and the workspace is as it was.
  ASSERT_TRUE(cuda_capture_begin(*exec).is_ok());
  EXPECT_EQ(exec->partial(shape, qd.as<float>(), dv, st2.as<float>(), finer).code(),
            Code::kUnsupported);
  (void)cuda_capture_end(*exec);
  ASSERT_TRUE(exec->partial(shape, qd.as<float>(), dv, st2.as<float>(), fine).is_ok());
  const auto again = download<float>(st2, recf);
  EXPECT_EQ(std::memcmp(fine_bits.data(), again.data(), again.size() * sizeof(float)), 0);
}

// The split merge fused into the decode kernel (decode_kernel.cuh): the last block of each
// (row, KV head, row group) merges, by an atomic ticket that it resets. Many splits (chunk 64),
// batches over one launch (the launches share the counters), GQA row groups and empty rows:
// every eager call and every graph replay gives the same bits (a counter left non-zero would
// make a later launch merge early, or never), matching the oracle and the unfused path
// (partial_chunks over the same splits, then merge_ordered).
TEST_F(CudaExecutorTest, FusedSplitMergeIsTheSameOnEveryLaunchAndReplay) {
  const AttnShape shape{70, 16, 2, 64, 1};  // 2 launches, 8 rows per KV head
  std::vector<int64_t> lens(70);
  for (std::size_t b = 0; b < lens.size(); ++b)
    lens[b] = b % 7 == 3 ? 0 : 100 + 61 * static_cast<int64_t>(b);
  Problem p(shape, DType::kBF16, lens, 21);
  const DeviceCache d = upload_cache(p.cache, shape.batch);
  const KVShard dv = on_device(p.whole(), p.cache, d);
  const std::size_t rows = static_cast<std::size_t>(shape.batch * shape.heads), recf = rows * 66;
  Buffer qd = upload(p.q.data(), p.q.size() * sizeof(float));
  Buffer st = upload(nullptr, recf * sizeof(float));
  DecodeOptions opt;
  opt.chunk_tokens = 64;  // up to 67 splits
  ASSERT_TRUE(exec->partial(shape, qd.as<float>(), dv, st.as<float>(), opt).is_ok());
  const auto first = download<float>(st, recf);
  std::vector<double> out(rows * 64), lse(rows);
  ASSERT_TRUE(oracle_attention(shape, p.q.data(), p.whole(), out.data(), lse.data()).is_ok());
  const Errors e = compare_states(shape, first.data(), out.data(), lse.data());
  EXPECT_FALSE(e.nan_mismatch);
  EXPECT_LE(e.out_rel(), 1e-5);
  EXPECT_LE(e.lse_abs, 1e-5);
  for (int i = 0; i < 3; ++i) {
    Buffer poison = upload(nullptr, recf * sizeof(float));
    ASSERT_TRUE(exec->copy(st.data(), poison.data(), recf * sizeof(float)).is_ok());
    ASSERT_TRUE(exec->partial(shape, qd.as<float>(), dv, st.as<float>(), opt).is_ok());
    const auto again = download<float>(st, recf);
    ASSERT_EQ(std::memcmp(first.data(), again.data(), recf * sizeof(float)), 0) << "call " << i;
  }
  ASSERT_TRUE(cuda_capture_begin(*exec).is_ok());
  const Status captured = exec->partial(shape, qd.as<float>(), dv, st.as<float>(), opt);
  auto graph = cuda_capture_end(*exec);
  ASSERT_TRUE(captured.is_ok()) << captured.to_string();
  ASSERT_TRUE(graph.is_ok()) << graph.status().to_string();
  for (int i = 0; i < 4; ++i) {
    Buffer poison = upload(nullptr, recf * sizeof(float));
    ASSERT_TRUE(exec->copy(st.data(), poison.data(), recf * sizeof(float)).is_ok());
    ASSERT_TRUE((*graph)->replay().is_ok());
    const auto replayed = download<float>(st, recf);
    ASSERT_EQ(std::memcmp(first.data(), replayed.data(), recf * sizeof(float)), 0)
        << "replay " << i;
  }
  // The unfused path: every split's record, then the merge kernel in split order.
  const int64_t splits = (*std::max_element(lens.begin(), lens.end()) + 63) / 64;
  Buffer parts = upload(nullptr, static_cast<std::size_t>(splits) * recf * sizeof(float));
  ASSERT_TRUE(exec->partial_chunks(shape, qd.as<float>(), dv, 64, parts.as<float>(), {}).is_ok());
  Buffer merged = upload(nullptr, recf * sizeof(float));
  ASSERT_TRUE(exec->merge_ordered(parts.as<float>(), static_cast<std::size_t>(splits), recf, rows,
                                  64, merged.as<float>())
                  .is_ok());
  const auto unfused = download<float>(merged, recf);
  const Errors u = compare_states(shape, unfused.data(), out.data(), lse.data());
  EXPECT_FALSE(u.nan_mismatch);
  EXPECT_LE(u.out_rel(), 1e-5);
  for (std::size_t r = 0; r < rows; ++r)
    ASSERT_EQ(state_is_empty(first.data() + r * 66), state_is_empty(unfused.data() + r * 66)) << r;
}

TEST(CudaBuild, FactoryReportsWhyThereIsNoExecutor) {
  std::string why;
  const int n = cuda_device_count(&why);
  auto e = make_cuda_executor();
  if (n > 0) {
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    return;
  }
  ASSERT_FALSE(e.is_ok());
  EXPECT_EQ(e.status().code(), Code::kUnsupported);
  EXPECT_FALSE(why.empty());
  if (!cuda_built()) {
    EXPECT_NE(e.status().message().find("without CUDA"), std::string::npos);
  }
}

}  // namespace
}  // namespace treeattn
