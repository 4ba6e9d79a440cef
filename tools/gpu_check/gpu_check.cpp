// gpu_check OUTDIR [--seed N] [--max-tokens N] [--cases N] [--section NAME]: the GPU check behind
// tools/gpu-check.sh, which runs each section in a process of its own (--section NAME writes
// OUTDIR/gpu-check-NAME.json), so that a kernel fault, which spoils the CUDA context for the
// rest of its process, fails that section only.
//
// On one GPU, in this order (each part writes its findings; a wrong result fails the run):
//   device       name, SMs, memory, driver and runtime versions
//   widening     every f16 / bf16 / fp8 / int8 value through the kernel, bit for bit
//   correctness  random shapes (dtypes, head dims 64/128, GQA groups, q_len 1-4, ragged batches
//                with empty and odd rows, offset / striped shard views, fixed and planned splits)
//                against the CPU float64 oracle, into NaN-poisoned outputs; sharply peaked
//                softmaxes (q x30) with NaN in the slots the kernel must not use (before the
//                view, past len, past the causal limit); partial_chunks and the state kernels
//                against the CPU executor
//   bandwidth    (and virtual ranks) a device-to-device copy probe and a read probe, then the
//                decode kernel on the llama3-8b shape (32 heads, 8 KV heads, head dim 128, bf16,
//                q_len 1) at 64k, 256k and 1M tokens, batch 1 and 16: GB/s of KV read and the
//                fraction of each probe, eager and as a CUDA graph, and the cost of the split
//                merge fused into the kernel (partial less partial_chunks over the same splits,
//                graph times); results checked against a different split plan (all) and the
//                oracle (64k, and the last row of batch 16 at 256k and 1M)
//   vranks       P = 1..8 virtual ranks on the one GPU: P shards, P partials and the merge kernel
//                against one shard (time, merge time, agreement)
//   bandwidth8   the same shapes with fp8 and then int8 K/V (codes and scales counted as read),
//                against the section's own probes, checked the same way
//   nccl         the NCCL communicator with one rank (bootstrapped over the in-process
//                communicator): every operation, and the decode session over NCCL + the CUDA
//                executor for every strategy NCCL serves
// Writes OUTDIR/gpu-check-core.json (gpu-check-NAME.json with --section) after each section
// ("complete": false until the end, so a crash leaves what was found) and a short table on
// stdout. Exit status: 0 all correct; 1 a wrong result; 2 no wrong result but the environment
// failed: no usable GPU (no device or driver, or one that cannot run this build:
// cuda_presence.hpp tells them apart in the message) or a set-up that failed (the NCCL
// communicator).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/cuda_presence.hpp"
#include "kernels/cuda/decode_geometry.hpp"
#include "tools/gpu_check/gpu_check_device.hpp"
#include "tools/gpu_check/gpu_check_report.hpp"
#include "tools/gpu_check/state_tolerance.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/comm_nccl.hpp"
#include "treeattn/executor_cuda.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"
#include "treeattn/state.hpp"

namespace {

using namespace treeattn;  // NOLINT(google-build-using-namespace): a tool's main file

using gpucheck::BandwidthRow;
using gpucheck::Check;
using gpucheck::environment_check;
using gpucheck::json_str;
using gpucheck::Report;
using gpucheck::VrankRow;

// ---- device buffers --------------------------------------------------------------------------

struct Dev {
  Executor& e;
  Result<Buffer> upload(const void* host, std::size_t bytes) {
    auto b = e.allocate(bytes);
    TREEATTN_RETURN_IF_ERROR(b.status());
    TREEATTN_RETURN_IF_ERROR(e.from_host(b->data(), host, bytes));
    return std::move(*b);
  }
  Result<Buffer> poisoned(std::size_t floats) {
    const std::vector<float> nan(floats, std::numeric_limits<float>::quiet_NaN());
    return upload(nan.data(), floats * sizeof(float));
  }
  Result<std::vector<float>> download(const Buffer& b, std::size_t floats) {
    std::vector<float> v(floats);
    TREEATTN_RETURN_IF_ERROR(e.to_host(v.data(), b.data(), floats * sizeof(float)));
    return v;
  }
};

struct DeviceCache {
  Buffer k, v, ks, vs;
};

Result<DeviceCache> upload_cache(Dev& dev, const KVCache& c, int64_t batch) {
  DeviceCache d;
  const auto codes = static_cast<std::size_t>(batch * c.stride_batch()) * dtype_size(c.dtype());
  auto k = dev.upload(c.k_data(), codes);
  auto v = dev.upload(c.v_data(), codes);
  TREEATTN_RETURN_IF_ERROR(k.status());
  TREEATTN_RETURN_IF_ERROR(v.status());
  d.k = std::move(*k);
  d.v = std::move(*v);
  if (dtype_is_quantized(c.dtype())) {
    const auto sn =
        static_cast<std::size_t>(batch * c.stride_batch() / c.stride_token()) * sizeof(float);
    auto ks = dev.upload(c.k_scale_data(), sn);
    auto vs = dev.upload(c.v_scale_data(), sn);
    TREEATTN_RETURN_IF_ERROR(ks.status());
    TREEATTN_RETURN_IF_ERROR(vs.status());
    d.ks = std::move(*ks);
    d.vs = std::move(*vs);
  }
  return d;
}

KVShard on_device(const KVShard& h, const KVCache& c, const DeviceCache& d) {
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

// Worst error of float states against the oracle's output and LSE (the project's rule:
// |out - ref| / max(1, max|ref|) and |lse - ref| / max(1, |ref|)); NaN where the NaN pattern
// differs. With `compared`, only the rows r ([batch][q_len][heads] order) it accepts.
double state_error(const AttnShape& s, const float* states, const double* out, const double* lse,
                   const std::function<bool(std::size_t)>& compared = {}) {
  const auto D = static_cast<std::size_t>(s.head_dim);
  const auto rows = static_cast<std::size_t>(s.batch * s.q_len * s.heads);
  double worst_out = 0, ref_max = 0, worst_lse = 0;
  std::vector<float> o(D);
  for (std::size_t r = 0; r < rows; ++r) {
    if (compared && !compared(r)) continue;
    float l = 0;
    state_normalize(states + r * (D + 2), D, o.data(), &l);
    if (std::isnan(l) != std::isnan(lse[r])) return std::numeric_limits<double>::quiet_NaN();
    if (std::isinf(lse[r]) || std::isinf(l)) {
      if (static_cast<double>(l) != lse[r]) return std::numeric_limits<double>::infinity();
    } else if (!std::isnan(l)) {
      worst_lse = std::max(worst_lse, std::fabs(l - lse[r]) / std::max(1.0, std::fabs(lse[r])));
    }
    for (std::size_t d = 0; d < D; ++d) {
      const double ref = out[r * D + d];
      if (std::isnan(ref) != std::isnan(o[d])) return std::numeric_limits<double>::quiet_NaN();
      if (std::isnan(ref)) continue;
      worst_out = std::max(worst_out, std::fabs(o[d] - ref));
      ref_max = std::max(ref_max, std::fabs(ref));
    }
  }
  return std::max(worst_out / std::max(1.0, ref_max), worst_lse);
}

// Normalized outputs of two state arrays: worst |a - b| / max(1, max|b|) (NaN: infinite).
double states_diff(const std::vector<float>& a, const std::vector<float>& b, std::size_t d) {
  const std::size_t rows = a.size() / (d + 2);
  double worst = 0, big = 1;
  std::vector<float> oa(d), ob(d);
  for (std::size_t r = 0; r < rows; ++r) {
    float la = 0, lb = 0;
    state_normalize(a.data() + r * (d + 2), d, oa.data(), &la);
    state_normalize(b.data() + r * (d + 2), d, ob.data(), &lb);
    if (std::isnan(la) || std::isnan(lb)) return std::numeric_limits<double>::infinity();
    if (!(std::isinf(la) && la == lb))
      worst = std::max(worst, std::fabs(static_cast<double>(la) - lb) /
                                  std::max(1.0, std::fabs(static_cast<double>(lb))));
    for (std::size_t i = 0; i < d; ++i) {
      if (std::isnan(oa[i]) || std::isnan(ob[i])) return std::numeric_limits<double>::infinity();
      worst = std::max(worst, static_cast<double>(std::fabs(oa[i] - ob[i])));
      big = std::max(big, static_cast<double>(std::fabs(ob[i])));
    }
  }
  return worst / big;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

constexpr double kTolerance = 1e-5;
constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8};

// ---- widening ----------------------------------------------------------------------------------

void check_widening(Executor& e, Report& rep) {
  Dev dev{e};
  for (DType t : kTypes) {
    const int64_t D = 128;
    const std::size_t values = t == DType::kF32 ? 8192 : dtype_size(t) == 2 ? 65536 : 256;
    const int64_t B = static_cast<int64_t>(values / static_cast<std::size_t>(D));
    const AttnShape shape{B, 1, 1, D, 1};
    KVCache cache(shape, t, 1);
    std::mt19937_64 rng(5);
    for (std::size_t i = 0; i < values; ++i) {
      if (t == DType::kF32) {
        const auto bits = static_cast<uint32_t>(rng());
        std::memcpy(static_cast<uint8_t*>(cache.v_data()) + i * 4, &bits, 4);
      } else if (dtype_size(t) == 2) {
        static_cast<uint16_t*>(cache.v_data())[i] = static_cast<uint16_t>(i);
      } else {
        static_cast<uint8_t*>(cache.v_data())[i] = static_cast<uint8_t>(i);
      }
    }
    if (dtype_is_quantized(t))
      for (int64_t b = 0; b < B; ++b) {
        cache.k_scale_data()[cache.scale_index(b, 0, 0)] = 1.0f;
        cache.v_scale_data()[cache.scale_index(b, 0, 0)] = 1.0f;
      }
    const std::vector<int64_t> one(static_cast<std::size_t>(B), 1),
        zero(static_cast<std::size_t>(B), 0);
    const KVShard view = cache.view(0, one, zero, one, 1);
    const std::vector<float> q(static_cast<std::size_t>(B * D), 0.0f);
    Check c{"widening", std::string(dtype_name(t)) + ": every value through the kernel"};
    auto dc = upload_cache(dev, cache, B);
    auto qd = dev.upload(q.data(), q.size() * sizeof(float));
    auto st = dev.poisoned(static_cast<std::size_t>(B * (D + 2)));
    Status s = dc.status();
    if (s.is_ok()) s = qd.status();
    if (s.is_ok()) s = st.status();
    if (s.is_ok())
      s = e.partial(shape, qd->as<float>(), on_device(view, cache, *dc), st->as<float>(), {});
    auto got = s.is_ok() ? dev.download(*st, static_cast<std::size_t>(B * (D + 2)))
                         : Result<std::vector<float>>(s);
    if (!got.is_ok()) {
      c.ok = false;
      c.detail = got.status().to_string();
      rep.add(c);
      continue;
    }
    int bad = 0;
    for (std::size_t i = 0; i < values; ++i) {
      const float want = load_as_float(cache.v_data(), t, i);
      const float have =
          (*got)[(i / static_cast<std::size_t>(D)) * static_cast<std::size_t>(D + 2) + 2 +
                 i % static_cast<std::size_t>(D)];
      if (!(std::isnan(want) ? std::isnan(have) : want == have)) {
        if (bad == 0) c.detail = "first mismatch at value " + std::to_string(i);
        ++bad;
      }
    }
    c.ok = bad == 0;
    if (c.ok)
      c.detail = std::to_string(values) + " values exact";
    else
      c.detail += " (" + std::to_string(bad) + " wrong)";
    rep.add(c);
  }
}

// ---- random shapes against the oracle
// ------------------------------------------------------------

struct Case {
  AttnShape shape;
  DType dtype = DType::kBF16;
  int64_t first = 0, stride = 1, chunk = 0;
  std::vector<int64_t> len, pos, total;
};

Case random_case(std::mt19937_64& rng) {
  auto pick = [&rng](std::initializer_list<int64_t> v) {
    return *(v.begin() + static_cast<std::ptrdiff_t>(rng() % v.size()));
  };
  Case c;
  c.dtype = kTypes[rng() % 5];
  c.shape.head_dim = pick({64, 128});
  c.shape.kv_heads = pick({1, 2, 4, 8});
  c.shape.heads = c.shape.kv_heads * pick({1, 2, 3, 4, 6, 8});
  c.shape.q_len = pick({1, 1, 1, 2, 4});
  c.shape.batch = rng() % 12 == 0 ? 70 : pick({1, 2, 3, 5, 8});
  c.stride = rng() % 4 == 0 ? pick({2, 3}) : 1;
  c.first = rng() % 3 == 0 ? static_cast<int64_t>(rng() % 50) : 0;
  c.chunk = rng() % 4 == 0 ? 1 + static_cast<int64_t>(rng() % 3000) : 0;
  // Oracle work ~ rows x tokens x head_dim: keep each case around 1e8.
  const int64_t rows = c.shape.batch * c.shape.q_len * c.shape.heads;
  const int64_t budget = std::max<int64_t>(64, 100000000 / (rows * c.shape.head_dim));
  for (int64_t b = 0; b < c.shape.batch; ++b) {
    const auto r = rng() % 10;
    int64_t n = r == 0  ? 0
                : r < 4 ? 1 + static_cast<int64_t>(rng() % 40)
                : r < 8 ? 41 + static_cast<int64_t>(rng() % 3000)
                        : 3000 + static_cast<int64_t>(rng() % 17000);
    n = std::min(n, budget);
    const auto p0 = static_cast<int64_t>(rng() % 500);
    c.len.push_back(n);
    c.pos.push_back(p0);
    c.total.push_back(p0 + c.stride * std::max<int64_t>(n - 1, 0) + 1 +
                      static_cast<int64_t>(rng() % 6));
  }
  return c;
}

void check_random_shapes(Executor& e, Report& rep, uint64_t seed, int cases) {
  Dev dev{e};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  double worst[5] = {0, 0, 0, 0, 0};
  int count[5] = {0, 0, 0, 0, 0}, failed = 0;
  std::string first_failure;
  for (int i = 0; i < cases; ++i) {
    const Case c = random_case(rng);
    const AttnShape& s = c.shape;
    const int64_t cap =
        c.first + std::max<int64_t>(1, *std::max_element(c.len.begin(), c.len.end()));
    KVCache cache(s, c.dtype, cap);
    std::vector<float> k(static_cast<std::size_t>(s.head_dim)), v(k.size());
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < s.kv_heads; ++h)
        for (int64_t t = 0; t < c.first + c.len[static_cast<std::size_t>(b)]; ++t) {
          for (auto& x : k) x = u(rng) * 2.0f;
          for (auto& x : v) x = u(rng);
          cache.set_token(b, h, t, k.data(), v.data());
        }
    std::vector<float> q(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
    for (auto& x : q) x = u(rng);
    const KVShard view = cache.view(c.first, c.len, c.pos, c.total, c.stride);
    const std::size_t rows = static_cast<std::size_t>(s.batch * s.q_len * s.heads);
    const std::size_t recf = rows * static_cast<std::size_t>(s.head_dim + 2);
    DecodeOptions opt;
    opt.chunk_tokens = c.chunk;
    auto dc = upload_cache(dev, cache, s.batch);
    auto qd = dev.upload(q.data(), q.size() * sizeof(float));
    auto st = dev.poisoned(recf);
    Status status = dc.status();
    if (status.is_ok()) status = qd.status();
    if (status.is_ok()) status = st.status();
    if (status.is_ok())
      status = e.partial(s, qd->as<float>(), on_device(view, cache, *dc), st->as<float>(), opt);
    auto got = status.is_ok() ? dev.download(*st, recf) : Result<std::vector<float>>(status);
    double err = std::numeric_limits<double>::infinity();
    if (got.is_ok()) {
      std::vector<double> out(rows * static_cast<std::size_t>(s.head_dim)), lse(rows);
      if (oracle_attention(s, q.data(), view, out.data(), lse.data()).is_ok())
        err = state_error(s, got->data(), out.data(), lse.data());
    }
    const auto ti = static_cast<std::size_t>(c.dtype);
    ++count[ti];
    if (!(err <= kTolerance)) {
      ++failed;
      if (first_failure.empty())
        first_failure = "case " + std::to_string(i) + " " + s.to_string() + " " +
                        std::string(dtype_name(c.dtype)) + " stride " + std::to_string(c.stride) +
                        " chunk " + std::to_string(c.chunk) + ": " +
                        (got.is_ok() ? "error " + fmt("%.3g", err) : got.status().to_string());
    }
    worst[ti] =
        std::max(worst[ti], std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
  }
  for (DType t : kTypes) {
    const auto ti = static_cast<std::size_t>(t);
    Check ch{"correctness", std::string(dtype_name(t)) + ": random shapes vs float64 oracle"};
    ch.error = worst[ti];
    ch.ok = worst[ti] <= kTolerance;
    ch.detail = std::to_string(count[ti]) + " cases, worst " + fmt("%.2e", worst[ti]);
    rep.add(ch);
  }
  if (failed) rep.notes.push_back("first failing random case: " + first_failure);
}

// Sharply peaked softmaxes (q scaled x30: a few keys carry nearly all the weight, so a wrong
// running maximum or rescale shows) and NaN planted in slots the kernel may load but must not
// use: the slots before the view's first, those past each row's len, and each row's last slot,
// which the causal limit hides from every query but the last. The kernel reads the poisoned
// cache; the rows that must not see a NaN are held to the oracle of the clean cache (the last
// query's rows see the planted last slot and are not compared), with the executor's split plan
// and with fixed splits of 700 tokens. The tolerance of the peaked cases is kTolerance x 30: the
// logits, and with them their float rounding, are 30 times larger.
void check_peaked_and_hidden_nan(Executor& e, Report& rep) {
  Dev dev{e};
  std::mt19937_64 rng(43);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const AttnShape s{3, 8, 2, 128, 4};
  const int64_t first = 16;
  const std::vector<int64_t> len{37, 1000, 5000}, pos{0, 0, 0};
  const std::vector<int64_t>& total = len;  // the last query sits at each row's last slot
  const int64_t cap = first + 5000 + 64;
  const auto D = static_cast<std::size_t>(s.head_dim);
  const std::vector<float> nan(D, std::numeric_limits<float>::quiet_NaN());
  const std::size_t rows = static_cast<std::size_t>(s.batch * s.q_len * s.heads);
  const std::size_t recf = rows * (D + 2);
  const auto not_last_query = [&](std::size_t r) {
    return static_cast<int64_t>(r / static_cast<std::size_t>(s.heads)) % s.q_len != s.q_len - 1;
  };
  for (DType t : kTypes)
    for (float qscale : {1.0f, 30.0f}) {
      KVCache clean(s, t, cap), dirty(s, t, cap);
      std::vector<float> k(D), v(D);
      for (int64_t b = 0; b < s.batch; ++b)
        for (int64_t h = 0; h < s.kv_heads; ++h)
          for (int64_t tok = 0; tok < cap; ++tok) {
            for (auto& x : k) x = u(rng) * 2.0f;
            for (auto& x : v) x = u(rng);
            clean.set_token(b, h, tok, k.data(), v.data());
            const bool hidden = tok < first || tok >= first + len[static_cast<std::size_t>(b)] - 1;
            if (!hidden || dtype_is_quantized(t)) dirty.set_token(b, h, tok, k.data(), v.data());
            if (hidden && dtype_is_quantized(t)) {  // codes times a NaN scale
              dirty.k_scale_data()[dirty.scale_index(b, h, tok)] = nan[0];
              dirty.v_scale_data()[dirty.scale_index(b, h, tok)] = nan[0];
            } else if (hidden) {
              dirty.set_token(b, h, tok, nan.data(), nan.data());
            }
          }
      std::vector<float> q(rows * D);
      for (auto& x : q) x = u(rng) * qscale;
      std::vector<double> out(rows * D), lse(rows);
      const Status os = oracle_attention(s, q.data(), clean.view(first, len, pos, total, 1),
                                         out.data(), lse.data());
      const KVShard view = dirty.view(first, len, pos, total, 1);
      auto dc = upload_cache(dev, dirty, s.batch);
      auto qd = dev.upload(q.data(), q.size() * sizeof(float));
      for (int64_t chunk : {int64_t{0}, int64_t{700}}) {
        Check c{"correctness", std::string(dtype_name(t)) + (qscale > 1 ? ": peaked (q x30)" : "") +
                                   ": NaN in hidden slots, " +
                                   (chunk ? "700-token splits" : "planned splits")};
        auto st = dev.poisoned(recf);
        Status status = os;
        if (status.is_ok()) status = dc.status();
        if (status.is_ok()) status = qd.status();
        if (status.is_ok()) status = st.status();
        DecodeOptions opt;
        opt.chunk_tokens = chunk;
        if (status.is_ok())
          status = e.partial(s, qd->as<float>(), on_device(view, dirty, *dc), st->as<float>(), opt);
        auto got = status.is_ok() ? dev.download(*st, recf) : Result<std::vector<float>>(status);
        if (!got.is_ok()) {
          c.ok = false;
          c.detail = got.status().to_string();
        } else {
          const double err = state_error(s, got->data(), out.data(), lse.data(), not_last_query);
          c.error = std::isnan(err) ? std::numeric_limits<double>::infinity() : err;
          c.ok = c.error <= kTolerance * static_cast<double>(qscale);
          c.detail = "vs oracle of the clean cache " + fmt("%.1e", c.error) +
                     (std::isnan(err) ? " (a NaN reached a row that must not see it)" : "");
        }
        rep.add(c);
      }
    }
}

void check_chunks_and_states(Executor& e, Report& rep) {
  Dev dev{e};
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // partial_chunks against the CPU executor's.
  {
    const AttnShape s{3, 8, 4, 128, 2};
    const std::vector<int64_t> len{1000, 256, 0}, zero(3, 0);
    KVCache cache(s, DType::kBF16, 1000);
    std::vector<float> k(128), v(128);
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t t = 0; t < len[static_cast<std::size_t>(b)]; ++t) {
          for (auto& x : k) x = u(rng);
          for (auto& x : v) x = u(rng);
          cache.set_token(b, h, t, k.data(), v.data());
        }
    std::vector<float> q(static_cast<std::size_t>(3 * 2 * 8 * 128));
    for (auto& x : q) x = u(rng);
    const KVShard view = cache.view(0, len, zero, len, 1);
    const std::size_t per = 3 * 2 * 8 * 130, chunks = 4;
    std::vector<float> cpu(per * chunks);
    Check c{"correctness", "partial_chunks (256-token chunks) vs CPU executor"};
    Status st = cpu_executor().partial_chunks(s, q.data(), view, 256, cpu.data(), {});
    auto dc = upload_cache(dev, cache, 3);
    auto qd = dev.upload(q.data(), q.size() * sizeof(float));
    auto out = dev.poisoned(per * chunks);
    if (st.is_ok()) st = dc.status();
    if (st.is_ok()) st = qd.status();
    if (st.is_ok()) st = out.status();
    if (st.is_ok())
      st = e.partial_chunks(s, qd->as<float>(), on_device(view, cache, *dc), 256, out->as<float>(),
                            {});
    auto got = st.is_ok() ? dev.download(*out, per * chunks) : Result<std::vector<float>>(st);
    if (!got.is_ok()) {
      c.ok = false;
      c.detail = got.status().to_string();
    } else {
      c.error = states_diff(*got, cpu, 128);
      c.ok = c.error <= kTolerance;
      c.detail = "worst " + fmt("%.2e", c.error);
    }
    rep.add(c);
  }
  // State kernels: merge_ordered of 8 parts with empty / -0 / NaN records, normalize, sum form.
  {
    const std::size_t n = 513, d = 128, rf = d + 2, parts = 8;
    std::vector<float> all(n * parts * rf);
    std::uniform_real_distribution<float> m(-40.0f, 40.0f), l(1.0f, 50.0f);
    for (std::size_t i = 0; i < n * parts; ++i) {
      float* r = all.data() + i * rf;
      const auto kind = rng() % 12;
      if (kind == 0) {
        state_set_empty(r, d);
        continue;
      }
      r[0] = kind == 1 ? -0.0f : kind == 2 ? std::nanf("") : m(rng);
      r[1] = l(rng);
      for (std::size_t j = 0; j < d; ++j) r[2 + j] = u(rng) * r[1];
    }
    std::vector<float> want(n * rf), norm(n * d), lse(n);
    (void)cpu_executor().merge_ordered(all.data(), parts, n * rf, n, d, want.data());
    (void)cpu_executor().normalize(want.data(), n, d, norm.data(), lse.data());
    Check c{"correctness", "state kernels (merge of 8 parts, normalize) vs CPU executor"};
    auto ad = dev.upload(all.data(), all.size() * sizeof(float));
    auto md = dev.poisoned(n * rf), nd = dev.poisoned(n * d), ld = dev.poisoned(n);
    Status st = ad.status();
    if (st.is_ok()) st = md.status();
    if (st.is_ok()) st = nd.status();
    if (st.is_ok()) st = ld.status();
    if (st.is_ok()) st = e.merge_ordered(ad->as<float>(), parts, n * rf, n, d, md->as<float>());
    if (st.is_ok()) st = e.normalize(md->as<float>(), n, d, nd->as<float>(), ld->as<float>());
    auto gm = st.is_ok() ? dev.download(*md, n * rf) : Result<std::vector<float>>(st);
    auto gn = st.is_ok() ? dev.download(*nd, n * d) : Result<std::vector<float>>(st);
    if (!gm.is_ok() || !gn.is_ok()) {
      c.ok = false;
      c.detail = (gm.is_ok() ? gn.status() : gm.status()).to_string();
    } else {
      // Within the bound of the inputs' weighted magnitudes, not of the result: the merged
      // terms cancel (tools/gpu_check/state_tolerance.hpp derives the bound).
      std::size_t exact = 0, bad = 0;
      double worst = 0;
      for (std::size_t i = 0; i < want.size(); ++i) {
        const float a = want[i], b = (*gm)[i];
        if (std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b))) ++exact;
      }
      std::vector<const float*> in(parts);
      for (std::size_t r = 0; r < n; ++r) {
        for (std::size_t p = 0; p < parts; ++p) in[p] = all.data() + (p * n + r) * rf;
        const double em = tolerance::merged_record_excess(in.data(), parts, d, gm->data() + r * rf,
                                                          want.data() + r * rf);
        const double en = tolerance::normalized_excess(in.data(), parts, d, gn->data() + r * d,
                                                       norm.data() + r * d);
        const double excess = std::max(em, en);
        worst = std::max(worst, excess);
        if (!(excess <= 1.0)) ++bad;
      }
      c.ok = bad == 0;
      c.error = worst;
      c.detail = std::to_string(exact) + " floats bit-identical; worst " + fmt("%.2f", worst) +
                 " of the bound (device expf); " + std::to_string(bad) + " of " +
                 std::to_string(n) + " records wrong";
    }
    rep.add(c);
  }
}

// ---- bandwidth
// -----------------------------------------------------------------------------------

// Times fn (which enqueues work on the executor's stream) over reps runs after one warm-up.
Result<double> time_ms(void* stream, int reps, const std::function<Status()>& fn) {
  TREEATTN_RETURN_IF_ERROR(fn());
  gpucheck::StreamTimer t(stream);
  TREEATTN_RETURN_IF_ERROR(t.start());
  for (int r = 0; r < reps; ++r) TREEATTN_RETURN_IF_ERROR(fn());
  auto ms = t.stop_ms();
  TREEATTN_RETURN_IF_ERROR(ms.status());
  return *ms / reps;
}

// fn (stream work) captured into a CUDA graph. A capture that began is always ended, also when
// fn failed inside it (the stream must leave capture mode either way); one that did not begin
// is not ended.
Result<std::unique_ptr<CudaGraph>> capture_graph(Executor& e, const std::function<Status()>& fn) {
  TREEATTN_RETURN_IF_ERROR(cuda_capture_begin(e));
  const Status inside = fn();
  auto graph = cuda_capture_end(e);
  TREEATTN_RETURN_IF_ERROR(inside);
  return graph;
}

struct Llama {
  static constexpr int64_t kHeads = 32, kKvHeads = 8, kDim = 128;
};

// The CUDA executor's wave for the head dim 128 instance of K/V dtype t serving `group` rows per
// KV head (q_len 1): SMs x resident blocks, as the executor plans (0 if the device cannot say).
int64_t wave_slots(Executor& e, DType t, int64_t group) {
  auto info = cuda_device_info(e);
  const int rows = gpu::split_rows(t, group, 1).rows_tpl;
  const auto dim = static_cast<int>(Llama::kDim);
  int blocks = 0;
  const auto occupancy = gpu::decode_entry(t).occupancy;
  const cudaError_t err = occupancy ? occupancy(dim, rows, &blocks) : cudaErrorInvalidValue;
  if (!info.is_ok() || err != cudaSuccess) return 0;
  return static_cast<int64_t>(info->sm_count) * blocks;
}

// The device-to-device copy and read probes, into rep (each bandwidth section measures its own,
// in its own process).
void run_probes(void* stream, Report& rep) {
  if (auto c = gpucheck::copy_probe_gbps(stream, std::size_t{2} << 30, 5); c.is_ok()) {
    rep.copy_gbps = *c;
  } else {
    rep.notes.push_back("copy probe: " + c.status().to_string());
  }
  if (auto r = gpucheck::read_probe_gbps(stream, std::size_t{4} << 30, 5); r.is_ok()) {
    rep.read_gbps = *r;
  } else {
    rep.notes.push_back("read probe: " + r.status().to_string());
  }
  std::printf("  probes: device-to-device copy %.0f GB/s (read + write), read %.0f GB/s\n",
              rep.copy_gbps, rep.read_gbps);
}

// One KV cache [16][8][cap][128] of one dtype for every bandwidth shape (views of fewer tokens
// keep the strides), filled on the device with values the host recomputes
// (gpu_check_device.hpp): bf16 values, or fp8 / int8 codes with their scales.
struct BandwidthCache {
  static constexpr int64_t kBatch = 16;
  DType dtype = DType::kBF16;  // what K and V hold: allocate's, or fill's of the same size
  int64_t cap = 0;
  Buffer k, v, ks, vs;

  // The largest capacity up to max_tokens (halving, down to 64k) whose K and V (and, for 8-bit
  // K/V, the scales) of dtype t fit.
  Status allocate(Executor& e, DType t, int64_t max_tokens) {
    dtype = t;
    ks = Buffer();
    vs = Buffer();
    const auto codes = [&](int64_t c) {
      return static_cast<std::size_t>(kBatch * Llama::kKvHeads * c * Llama::kDim) *
             dtype_size(dtype);
    };
    const auto scales = [&](int64_t c) {
      return static_cast<std::size_t>(kBatch * Llama::kKvHeads * c) * sizeof(float);
    };
    for (cap = max_tokens; cap >= 65536; cap /= 2) {
      k = Buffer();
      v = Buffer();
      auto kb = e.allocate(codes(cap));
      if (!kb.is_ok()) continue;
      auto vb = e.allocate(codes(cap));
      if (!vb.is_ok()) continue;
      k = std::move(*kb);
      v = std::move(*vb);
      if (!dtype_is_quantized(dtype)) return Status::ok();
      auto kq = e.allocate(scales(cap));
      auto vq = e.allocate(scales(cap));
      if (!kq.is_ok() || !vq.is_ok()) continue;
      ks = std::move(*kq);
      vs = std::move(*vq);
      return Status::ok();
    }
    return Status(Code::kOutOfMemory, "not even 64k tokens x 16 rows fit");
  }
  // Fills K and V (and the scales) as dtype `t`: one of the allocation's element size, with
  // scales where t has them (fp8 and int8 share one allocation).
  Status fill(void* stream, DType t) {
    if ((t != DType::kBF16 && !dtype_is_quantized(t)) || dtype_size(t) != dtype_size(dtype) ||
        (dtype_is_quantized(t) && (ks.data() == nullptr || vs.data() == nullptr)))
      return invalid_argument(
          "bandwidth cache: cannot fill an allocation of " + std::string(dtype_name(dtype)) +
          " with " + std::string(dtype_name(t)) +
          " (bf16, fp8 or int8 of the allocation's element size, with scales for 8-bit)");
    dtype = t;
    const auto elems = static_cast<std::size_t>(kBatch * Llama::kKvHeads * cap * Llama::kDim);
    if (t == DType::kBF16) {
      TREEATTN_RETURN_IF_ERROR(gpucheck::fill_bf16(stream, k.data(), elems, 1));
      return gpucheck::fill_bf16(stream, v.data(), elems, 2);
    }
    const auto tokens = static_cast<std::size_t>(kBatch * Llama::kKvHeads * cap);
    const bool fp8 = t == DType::kFP8;
    TREEATTN_RETURN_IF_ERROR(gpucheck::fill_codes(stream, k.data(), elems, 1, fp8));
    TREEATTN_RETURN_IF_ERROR(gpucheck::fill_codes(stream, v.data(), elems, 2, fp8));
    TREEATTN_RETURN_IF_ERROR(gpucheck::fill_scales(stream, ks.as<float>(), tokens, 3));
    return gpucheck::fill_scales(stream, vs.as<float>(), tokens, 4);
  }
  // The view of the first n tokens of `batch` rows (the spans must outlive it).
  KVShard view(int64_t batch, int64_t n, std::vector<int64_t>& len, std::vector<int64_t>& pos,
               std::vector<int64_t>& total) const {
    len.assign(static_cast<std::size_t>(batch), n);
    pos.assign(static_cast<std::size_t>(batch), 0);
    total = len;
    KVShard s;
    s.dtype = dtype;
    s.memory = MemorySpace::kDevice;
    s.k = k.data();
    s.v = v.data();
    s.stride_token = Llama::kDim;
    s.stride_head = cap * Llama::kDim;
    s.stride_batch = Llama::kKvHeads * cap * Llama::kDim;
    if (dtype_is_quantized(dtype)) {
      s.k_scale = ks.as<float>();
      s.v_scale = vs.as<float>();
      s.scale_stride_token = 1;
      s.scale_stride_head = cap;
      s.scale_stride_batch = Llama::kKvHeads * cap;
    }
    s.len = len;
    s.pos_start = pos;
    s.total_len = total;
    return s;
  }
  // The host copy of row b's first n tokens (the same synthetic values), for the oracle.
  KVCache host_row(int64_t b, int64_t n) const {
    const int64_t Hkv = Llama::kKvHeads, D = Llama::kDim;
    const AttnShape s1{1, Llama::kHeads, Hkv, D, 1};
    KVCache c(s1, dtype, n);
    std::vector<float> kf(static_cast<std::size_t>(D)), vf(kf.size());
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t = 0; t < n; ++t) {
        const auto token = static_cast<uint64_t>((b * Hkv + h) * cap + t);
        const uint64_t base = token * static_cast<uint64_t>(D);
        if (dtype == DType::kBF16) {
          for (int64_t d = 0; d < D; ++d) {
            kf[static_cast<std::size_t>(d)] = gpucheck::synthetic_value(1, base + d);
            vf[static_cast<std::size_t>(d)] = gpucheck::synthetic_value(2, base + d);
          }
          c.set_token(0, h, t, kf.data(), vf.data());
          continue;
        }
        const bool fp8 = dtype == DType::kFP8;
        auto* kc = static_cast<uint8_t*>(c.k_data()) + c.index(0, h, t);
        auto* vc = static_cast<uint8_t*>(c.v_data()) + c.index(0, h, t);
        for (int64_t d = 0; d < D; ++d) {
          kc[d] = gpucheck::synthetic_code(1, base + d, fp8);
          vc[d] = gpucheck::synthetic_code(2, base + d, fp8);
        }
        c.k_scale_data()[c.scale_index(0, h, t)] = gpucheck::synthetic_scale(3, token);
        c.v_scale_data()[c.scale_index(0, h, t)] = gpucheck::synthetic_scale(4, token);
      }
    return c;
  }
};

// The query and state buffers of the bandwidth shapes (16 rows of llama3-8b).
struct BandwidthIo {
  std::vector<float> q;
  Buffer qd, states, states2;
  Status make(Dev& dev) {
    const int64_t B = BandwidthCache::kBatch, H = Llama::kHeads, D = Llama::kDim;
    std::mt19937_64 rng(3);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    q.resize(static_cast<std::size_t>(B * H * D));
    for (auto& x : q) x = u(rng);
    auto a = dev.upload(q.data(), q.size() * sizeof(float));
    auto s1 = dev.poisoned(static_cast<std::size_t>(B * H * (D + 2)));
    auto s2 = dev.poisoned(static_cast<std::size_t>(B * H * (D + 2)));
    TREEATTN_RETURN_IF_ERROR(a.status());
    TREEATTN_RETURN_IF_ERROR(s1.status());
    TREEATTN_RETURN_IF_ERROR(s2.status());
    qd = std::move(*a);
    states = std::move(*s1);
    states2 = std::move(*s2);
    return Status::ok();
  }
};

// Times partial() on `batch` rows of n tokens (eager and as a CUDA graph; with fused_merge also
// the split merge fused into the kernel) as a fraction of the section's probes, and checks the
// result against another split plan and, at 64k (a row other than 0) and at 256k and 1M for
// batch 16 (the last row, whose element offsets pass 2^32), against the float64 oracle.
void time_shape(Executor& e, Report& rep, void* stream, const BandwidthCache& cache,
                BandwidthIo& io, int64_t batch, int64_t n, bool fused_merge) {
  Dev dev{e};
  const int64_t H = Llama::kHeads, Hkv = Llama::kKvHeads, D = Llama::kDim;
  std::vector<int64_t> len, pos, total;
  const KVShard view = cache.view(batch, n, len, pos, total);
  const AttnShape shape{batch, H, Hkv, D, 1};
  const std::string dtype(dtype_name(cache.dtype));
  BandwidthRow row;
  row.dtype = dtype;
  row.batch = batch;
  row.tokens = n;
  const double per_token = static_cast<double>(D) * static_cast<double>(dtype_size(cache.dtype)) +
                           (dtype_is_quantized(cache.dtype) ? sizeof(float) : 0);
  row.kv_bytes = static_cast<double>(batch * Hkv * n) * per_token * 2;
  // The executor's plan: splits sized to the device's wave (SMs x resident blocks).
  const gpu::SplitPlan plan = gpu::plan_decode(
      cache.dtype, batch, Hkv, H / Hkv, 1, n, 0, wave_slots(e, cache.dtype, H / Hkv),
      gpu::max_split_slots(cache.dtype, view.stride_token, view.scale_stride_token));
  row.splits = plan.splits;
  row.chunk = plan.chunk;
  auto partial = [&] {
    return e.partial(shape, io.qd.as<float>(), view, io.states.as<float>(), {});
  };
  const int reps = std::min(50, std::max<int>(3, static_cast<int>(2e9 / row.kv_bytes)));
  auto eager = time_ms(stream, reps, partial);
  Check c{"bandwidth", dtype + " B=" + std::to_string(batch) + " N=" + std::to_string(n)};
  if (!eager.is_ok()) {
    c.ok = false;
    c.detail = eager.status().to_string();
    rep.add(c);
    return;
  }
  row.eager_ms = *eager;
  // As a CUDA graph (no host work between launches).
  auto graph = capture_graph(e, partial);
  if (graph.is_ok()) {
    auto g = time_ms(stream, reps, [&] { return (*graph)->replay(); });
    if (g.is_ok()) row.graph_ms = *g;
  } else {
    rep.notes.push_back("graph capture at " + c.name + ": " + graph.status().to_string());
  }
  // The fused split merge's cost: partial_chunks over the same splits launches the same blocks
  // without the tickets and the merge (its records go to a buffer of splits x records), so the
  // difference of the two graph times is the merge (not measured without a graph).
  if (fused_merge && plan.splits > 1 && row.graph_ms > 0) {
    const auto recs = static_cast<std::size_t>(plan.splits * batch * H * (D + 2));
    if (auto chunks = e.allocate(recs * sizeof(float)); chunks.is_ok()) {
      auto unmerged = [&] {
        return e.partial_chunks(shape, io.qd.as<float>(), view, plan.chunk, chunks->as<float>(),
                                {});
      };
      if (auto cg = capture_graph(e, unmerged); cg.is_ok()) {
        auto t = time_ms(stream, reps, [&] { return (*cg)->replay(); });
        if (t.is_ok()) row.fused_merge_us = (row.graph_ms - *t) * 1000;
      }
    }
  }
  const double best_ms = row.graph_ms > 0 ? std::min(row.graph_ms, row.eager_ms) : row.eager_ms;
  row.gbps = row.kv_bytes / (best_ms * 1e6);
  row.frac_copy = rep.copy_gbps > 0 ? row.gbps / rep.copy_gbps : 0;
  row.frac_read = rep.read_gbps > 0 ? row.gbps / rep.read_gbps : 0;
  // Correctness: another split plan must agree; some rows also against the oracle.
  DecodeOptions other;
  other.chunk_tokens = 12345;
  Status cs = e.partial(shape, io.qd.as<float>(), view, io.states2.as<float>(), other);
  const auto recf = static_cast<std::size_t>(batch * H * (D + 2));
  auto a = cs.is_ok() ? dev.download(io.states, recf) : Result<std::vector<float>>(cs);
  auto b = cs.is_ok() ? dev.download(io.states2, recf) : Result<std::vector<float>>(cs);
  if (!a.is_ok() || !b.is_ok()) {
    c.ok = false;
    c.detail = (a.is_ok() ? b.status() : a.status()).to_string();
    rep.add(c);
    return;
  }
  c.error = states_diff(*a, *b, static_cast<std::size_t>(D));
  std::string how = "vs other split plan";
  if (n == 65536 || batch > 1) {
    const int64_t rb = batch == 1 ? 0 : n == 65536 ? 5 : batch - 1;
    const KVCache hc = cache.host_row(rb, n);
    const std::vector<int64_t> l1{n}, p1{0};
    const AttnShape s1{1, H, Hkv, D, 1};
    std::vector<double> out(static_cast<std::size_t>(H * D)), lse(static_cast<std::size_t>(H));
    const float* qr = io.q.data() + static_cast<std::size_t>(rb * H * D);
    if (oracle_attention(s1, qr, hc.view(0, l1, p1, l1, 1), out.data(), lse.data()).is_ok()) {
      const double oe = state_error(s1, a->data() + static_cast<std::size_t>(rb * H * (D + 2)),
                                    out.data(), lse.data());
      c.error = std::max(c.error, std::isnan(oe) ? std::numeric_limits<double>::infinity() : oe);
      how = "vs oracle (row " + std::to_string(rb) + ") and other split plan";
    }
  }
  c.ok = c.error <= kTolerance;
  c.detail = fmt("%.0f GB/s", row.gbps) + " (" + fmt("%.0f%%", 100 * row.frac_copy) + " of copy, " +
             std::to_string(row.splits) + " splits" +
             (fused_merge ? ", fused merge " + fmt("%.1f us", row.fused_merge_us) : "") + "); " +
             how + " " + fmt("%.1e", c.error);
  rep.add(c);
  rep.bandwidth.push_back(row);
}

// The bandwidth shapes: batch 1 and 16 at 64k, 256k and 1M tokens (those that fit).
void time_shapes(Executor& e, Report& rep, void* stream, const BandwidthCache& cache,
                 BandwidthIo& io, bool fused_merge) {
  for (int64_t batch : {int64_t{1}, BandwidthCache::kBatch})
    for (int64_t n : {int64_t{65536}, int64_t{262144}, int64_t{1048576}})
      if (n <= cache.cap) time_shape(e, rep, stream, cache, io, batch, n, fused_merge);
}

// A bandwidth section's set-up: the probes, the cache of `dtype` (filled), the query and state
// buffers. False (with a failed check) where a part could not be made.
bool bandwidth_setup(Executor& e, Report& rep, void* stream, int64_t max_tokens, DType dtype,
                     BandwidthCache& cache, BandwidthIo& io) {
  Dev dev{e};
  run_probes(stream, rep);
  Status s = cache.allocate(e, dtype, max_tokens);
  if (s.is_ok() && cache.cap < max_tokens)
    rep.notes.push_back("bandwidth (" + std::string(dtype_name(dtype)) + "): tokens limited to " +
                        std::to_string(cache.cap) + " by memory");
  if (s.is_ok()) s = cache.fill(stream, dtype);
  if (s.is_ok()) s = e.synchronize();
  if (s.is_ok()) s = io.make(dev);
  if (!s.is_ok()) rep.add({"bandwidth", "KV cache and buffers", false, 0, s.to_string()});
  return s.is_ok();
}

// The 8-bit K/V kernels on the bandwidth shapes, fp8 and int8 in one cache of codes (a section
// of its own, so that a fault there leaves the bf16 figures).
void check_bandwidth_8bit(Executor& e, Report& rep, int64_t max_tokens) {
  auto stream = cuda_stream(e);
  if (!stream.is_ok()) return;
  BandwidthCache cache;
  BandwidthIo io;
  if (!bandwidth_setup(e, rep, *stream, max_tokens, DType::kFP8, cache, io)) return;
  time_shapes(e, rep, *stream, cache, io, /*fused_merge=*/false);
  if (const Status s = cache.fill(*stream, DType::kInt8); !s.is_ok()) {
    rep.add({"bandwidth", "fill the int8 cache", false, 0, s.to_string()});
    return;
  }
  time_shapes(e, rep, *stream, cache, io, /*fused_merge=*/false);
}

void check_bandwidth_and_vranks(Executor& e, Report& rep, int64_t max_tokens) {
  Dev dev{e};
  auto stream_r = cuda_stream(e);
  if (!stream_r.is_ok()) return;
  void* stream = *stream_r;
  BandwidthCache cache;
  BandwidthIo io;
  if (!bandwidth_setup(e, rep, stream, max_tokens, DType::kBF16, cache, io)) return;
  time_shapes(e, rep, stream, cache, io, /*fused_merge=*/true);
  const int64_t H = Llama::kHeads, D = Llama::kDim, cap = cache.cap;
  const Buffer &kb = cache.k, &vb = cache.v;

  // Virtual ranks: P shards of the batch-1 256k-token row (or the longest that fits).
  const int64_t n = std::min<int64_t>(262144, cap);
  const AttnShape shape{1, H, Llama::kKvHeads, D, 1};
  const std::size_t recf = static_cast<std::size_t>(H * (D + 2));
  std::vector<int64_t> len, pos, total;
  const KVShard whole = cache.view(1, n, len, pos, total);
  auto single = [&] {
    return e.partial(shape, io.qd.as<float>(), whole, io.states.as<float>(), {});
  };
  auto single_ms = time_ms(stream, 20, single);
  auto reference = single_ms.is_ok() ? dev.download(io.states, recf)
                                     : Result<std::vector<float>>(single_ms.status());
  auto parts = e.allocate(8 * recf * sizeof(float));
  if (!single_ms.is_ok() || !reference.is_ok() || !parts.is_ok()) {
    rep.add({"vranks", "set-up", false, 0, "single-shard run or allocation failed"});
    return;
  }
  Check vc{"vranks", "P = 1..8 shards + merge kernel vs one shard"};
  for (int p = 1; p <= 8; ++p) {
    VrankRow row;
    row.p = p;
    row.single_ms = *single_ms;
    std::vector<std::vector<int64_t>> plen(static_cast<std::size_t>(p)),
        ppos(static_cast<std::size_t>(p));
    std::vector<KVShard> shards;
    int64_t start = 0;
    for (int r = 0; r < p; ++r) {
      const int64_t m = n / p + (r < n % p ? 1 : 0);
      plen[static_cast<std::size_t>(r)] = {m};
      ppos[static_cast<std::size_t>(r)] = {start};
      KVShard s = whole;
      s.k = static_cast<const uint8_t*>(kb.data()) + static_cast<std::size_t>(start * D) * 2;
      s.v = static_cast<const uint8_t*>(vb.data()) + static_cast<std::size_t>(start * D) * 2;
      s.len = plen[static_cast<std::size_t>(r)];
      s.pos_start = ppos[static_cast<std::size_t>(r)];
      shards.push_back(s);
      start += m;
    }
    auto sharded = [&]() -> Status {
      for (int r = 0; r < p; ++r)
        TREEATTN_RETURN_IF_ERROR(
            e.partial(shape, io.qd.as<float>(), shards[static_cast<std::size_t>(r)],
                      parts->as<float>() + static_cast<std::size_t>(r) * recf, {}));
      return e.merge_ordered(parts->as<float>(), static_cast<std::size_t>(p), recf,
                             static_cast<std::size_t>(H), static_cast<std::size_t>(D),
                             io.states2.as<float>());
    };
    auto merge = [&] {
      return e.merge_ordered(parts->as<float>(), static_cast<std::size_t>(p), recf,
                             static_cast<std::size_t>(H), static_cast<std::size_t>(D),
                             io.states2.as<float>());
    };
    auto sms = time_ms(stream, 10, sharded);
    auto mms = time_ms(stream, 200, merge);
    if (!sms.is_ok() || !mms.is_ok()) {
      vc.ok = false;
      vc.detail = (sms.is_ok() ? mms.status() : sms.status()).to_string();
      break;
    }
    row.sharded_ms = *sms;
    row.merge_us = *mms * 1000;
    if (auto g = capture_graph(e, merge); g.is_ok()) {
      auto gm = time_ms(stream, 200, [&] { return (*g)->replay(); });
      if (gm.is_ok()) row.merge_graph_us = *gm * 1000;
    }
    auto merged = dev.download(io.states2, recf);
    if (!merged.is_ok()) {
      vc.ok = false;
      vc.detail = merged.status().to_string();
      break;
    }
    row.error = states_diff(*merged, *reference, static_cast<std::size_t>(D));
    vc.error = std::max(vc.error, row.error);
    rep.vranks.push_back(row);
  }
  if (vc.detail.empty()) {
    vc.ok = vc.error <= kTolerance;
    vc.detail = "N=" + std::to_string(n) + ", worst " + fmt("%.1e", vc.error);
  }
  rep.add(vc);
}

// ---- NCCL
// ----------------------------------------------------------------------------------------

Status nccl_one_rank(Communicator& c, Executor& e, Report& rep) {
  Dev dev{e};
  const std::vector<float> x{1.5f, -2.0f, 3.25f, 0.0f};
  auto a = dev.upload(x.data(), 16);
  auto b = e.allocate(16);
  TREEATTN_RETURN_IF_ERROR(a.status());
  TREEATTN_RETURN_IF_ERROR(b.status());
  TREEATTN_RETURN_IF_ERROR(c.allreduce(a->as<float>(), 4, ReduceOp::kSum));
  TREEATTN_RETURN_IF_ERROR(c.allreduce(a->as<float>(), 4, ReduceOp::kMax));
  TREEATTN_RETURN_IF_ERROR(c.allgather(a->data(), 16, b->data()));
  TREEATTN_RETURN_IF_ERROR(c.broadcast(b->data(), 16, 0));
  TREEATTN_RETURN_IF_ERROR(c.gather(a->data(), 16, b->data(), 0));
  auto r1 = c.irecv(b->data(), 16, 0, 1);
  auto s1 = c.isend(a->data(), 16, 0, 1);
  TREEATTN_RETURN_IF_ERROR(r1.status());
  TREEATTN_RETURN_IF_ERROR(s1.status());
  const CommRequest reqs[] = {*r1, *s1};
  TREEATTN_RETURN_IF_ERROR(c.wait_all(reqs));
  TREEATTN_RETURN_IF_ERROR(c.barrier());
  auto sub = c.split(0, 0);
  TREEATTN_RETURN_IF_ERROR(sub.status());
  auto got = dev.download(*b, 4);
  TREEATTN_RETURN_IF_ERROR(got.status());
  if (*got != x) return internal_error("one-rank NCCL operations changed the data");
  rep.add({"nccl", "one rank: allreduce, allgather, broadcast, gather, send/recv, barrier, split",
           true, 0, "ok"});
  // The decode session over NCCL + the CUDA executor, every strategy NCCL serves.
  SessionConfig cfg;
  cfg.shape = AttnShape{2, 32, 8, 128, 2};
  cfg.dtype = DType::kBF16;
  const int64_t n = 3000;
  const AttnShape& s = cfg.shape;
  KVCache whole(s, cfg.dtype, n);
  std::mt19937_64 rng(17);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const auto per = static_cast<std::size_t>(s.kv_heads * s.head_dim);
  std::vector<std::vector<float>> ks, vs;
  for (int64_t t = 0; t < 2 * n; ++t) {
    ks.emplace_back(per);
    vs.emplace_back(per);
    for (auto& v : ks.back()) v = u(rng);
    for (auto& v : vs.back()) v = u(rng);
    const int64_t bb = t / n, tt = t % n;
    for (int64_t h = 0; h < s.kv_heads; ++h)
      whole.set_token(bb, h, tt, ks.back().data() + h * s.head_dim,
                      vs.back().data() + h * s.head_dim);
  }
  std::vector<float> q(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
  for (auto& v : q) v = u(rng);
  const std::vector<int64_t> lens{n, n}, zeros{0, 0};
  std::vector<double> ref(q.size()), ref_lse(q.size() / 128);
  TREEATTN_RETURN_IF_ERROR(oracle_attention(s, q.data(), whole.view(0, lens, zeros, lens, 1),
                                            ref.data(), ref_lse.data()));
  auto qd = dev.upload(q.data(), q.size() * sizeof(float));
  TREEATTN_RETURN_IF_ERROR(qd.status());
  const StrategyRegistry& reg = StrategyRegistry::for_backend(c.capabilities());
  for (const StrategyInfo& info : reg.list()) {
    cfg.strategy = std::string(info.name);
    Check ch{"nccl", "one rank: session, strategy " + cfg.strategy};
    auto sess = DecodeSession::create(c, cfg, e);
    Status st = sess.status();
    if (st.is_ok()) st = (*sess)->extend(n);
    for (int64_t t = 0; t < 2 * n && st.is_ok(); ++t)
      st = (*sess)->store(0, t / n, t % n, ks[static_cast<std::size_t>(t)].data(),
                          vs[static_cast<std::size_t>(t)].data());
    auto od = e.allocate(q.size() * sizeof(float));
    auto ld = e.allocate(ref_lse.size() * sizeof(float));
    if (st.is_ok()) st = od.status();
    if (st.is_ok()) st = ld.status();
    if (st.is_ok()) st = (*sess)->attend(0, qd->as<float>(), od->as<float>(), ld->as<float>());
    auto out = st.is_ok() ? dev.download(*od, q.size()) : Result<std::vector<float>>(st);
    auto lse = st.is_ok() ? dev.download(*ld, ref_lse.size()) : Result<std::vector<float>>(st);
    if (!out.is_ok() || !lse.is_ok()) {
      ch.ok = false;
      ch.detail = (out.is_ok() ? lse.status() : out.status()).to_string();
    } else {
      double worst = 0, big = 1;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        worst = std::max(worst, std::fabs((*out)[i] - ref[i]));
        big = std::max(big, std::fabs(ref[i]));
      }
      worst /= big;
      for (std::size_t i = 0; i < ref_lse.size(); ++i)
        worst = std::max(worst,
                         std::fabs((*lse)[i] - ref_lse[i]) / std::max(1.0, std::fabs(ref_lse[i])));
      ch.error = worst;
      ch.ok = worst <= kTolerance;
      ch.detail = "vs oracle " + fmt("%.1e", worst);
    }
    rep.add(ch);
  }
  return Status::ok();
}

void check_nccl(Report& rep) {
  if (!nccl_built()) {
    rep.notes.push_back("nccl: this build has no NCCL (not found at configure time)");
    return;
  }
  // The set-up (an executor, the communicator) failing is the environment (exit 2); a check
  // after it failing is a wrong result (exit 1).
  Status setup;
  const Status s = run_local(1, [&](Communicator& boot) -> Status {
    boot.set_timeout(std::chrono::seconds(60));
    auto exec = make_cuda_executor();
    setup = exec.status();
    TREEATTN_RETURN_IF_ERROR(setup);
    auto nccl = make_nccl_communicator(boot, **exec);
    setup = nccl.status();
    TREEATTN_RETURN_IF_ERROR(setup);
    return nccl_one_rank(**nccl, **exec, rep);
  });
  if (!setup.is_ok())
    rep.add(environment_check("nccl", "one rank: NCCL communicator set-up", setup));
  else if (!s.is_ok())
    rep.add({"nccl", "one rank end to end", false, 0, s.to_string()});
}

void print_tables(const Report& rep) {
  std::printf("\n%-5s %-6s %-8s %10s %10s %10s %9s %9s %7s %12s\n", "dtype", "batch", "tokens",
              "KV GiB", "ms", "GB/s", "of copy", "of read", "splits", "merge us");
  for (const BandwidthRow& b : rep.bandwidth)
    std::printf(
        "%-5s %-6lld %-8lld %10.2f %10.3f %10.0f %8.0f%% %8.0f%% %7lld %12.1f\n", b.dtype.c_str(),
        static_cast<long long>(b.batch), static_cast<long long>(b.tokens), b.kv_bytes / (1 << 30),
        std::min(b.eager_ms, b.graph_ms > 0 ? b.graph_ms : b.eager_ms), b.gbps, 100 * b.frac_copy,
        100 * b.frac_read, static_cast<long long>(b.splits), b.fused_merge_us);
  std::printf("\n%-3s %11s %11s %10s %12s %10s\n", "P", "1 shard ms", "P shards ms", "merge us",
              "merge graph", "max err");
  for (const VrankRow& v : rep.vranks)
    std::printf("%-3d %11.3f %11.3f %10.2f %12.2f %10.1e\n", v.p, v.single_ms, v.sharded_ms,
                v.merge_us, v.merge_graph_us, v.error);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s OUTDIR [--seed N] [--max-tokens N] [--cases N] [--section NAME]\n",
                 argv[0]);
    return 2;
  }
  const std::string outdir = argv[1];
  uint64_t seed = 20240806;
  int64_t max_tokens = 1 << 20;
  int cases = 60;
  std::string only;  // --section: that section alone
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seed")
      seed = std::stoull(argv[i + 1]);
    else if (a == "--max-tokens")
      max_tokens = std::stoll(argv[i + 1]);
    else if (a == "--cases")
      cases = std::stoi(argv[i + 1]);
    else if (a == "--section")
      only = argv[i + 1];
  }
  constexpr const char* kSections[] = {"widening", "correctness", "bandwidth", "bandwidth8",
                                       "nccl"};
  if (!only.empty() &&
      std::find(std::begin(kSections), std::end(kSections), only) == std::end(kSections)) {
    std::fprintf(
        stderr, "gpu_check: no section '%s' (widening, correctness, bandwidth, bandwidth8, nccl)\n",
        only.c_str());
    return 2;
  }
  Report rep;
  const std::string json_path =
      outdir + (only.empty() ? "/gpu-check-core.json" : "/gpu-check-" + only + ".json");
  auto write_json = [&](bool complete) {
    std::ofstream f(json_path);
    f << rep.json(complete);
    return static_cast<bool>(f);
  };
  auto exec = make_cuda_executor();
  if (!exec.is_ok()) {
    // Either no GPU here at all, or one that is there but cannot be used (an old driver, no
    // image for its architecture): both are the environment, named apart (cuda_presence.hpp).
    const std::string absent = gpu::cuda_absence(gpu::probe_cuda());
    const std::string why =
        absent.empty() ? "a CUDA device is present but unusable: " + exec.status().to_string()
                       : "no CUDA device or driver on this machine: " + absent;
    std::fprintf(stderr, "gpu_check: %s\n", why.c_str());
    rep.notes.push_back(why);
    rep.add(environment_check("device", "CUDA executor", exec.status()));
    (void)write_json(true);
    return 2;
  }
  Executor& e = **exec;
  if (auto info = cuda_device_info(e); info.is_ok()) {
    rep.device = info->name;
    rep.device_fields = {{"name", json_str(info->name)},
                         {"sm_count", std::to_string(info->sm_count)},
                         {"compute_capability", json_str(std::to_string(info->cc_major) + "." +
                                                         std::to_string(info->cc_minor))},
                         {"memory_bytes", std::to_string(info->memory_bytes)},
                         {"driver_version", std::to_string(info->driver_version)},
                         {"runtime_version", std::to_string(info->runtime_version)}};
    std::printf("gpu_check on %s (%d SMs, cc %d.%d, %.0f GiB), seed %llu\n", info->name.c_str(),
                info->sm_count, info->cc_major, info->cc_minor,
                static_cast<double>(info->memory_bytes) / (1 << 30),
                static_cast<unsigned long long>(seed));
  }
  const auto t0 = std::chrono::steady_clock::now();
  // Each section rewrites the JSON when it ends (complete: false until the last), so a crash or
  // a hang in a later one leaves what the earlier ones found.
  bool json_ok = write_json(false);
  auto section = [&](const char* name, const std::function<void()>& fn) {
    if (!only.empty() && only != name) return;
    std::printf("== %s\n", name);
    std::fflush(stdout);
    const auto s = std::chrono::steady_clock::now();
    fn();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count();
    rep.notes.push_back(std::string(name) + ": " + fmt("%.1f s", secs));
    json_ok = write_json(false) && json_ok;
  };
  section("widening", [&] { check_widening(e, rep); });
  section("correctness", [&] {
    check_random_shapes(e, rep, seed, cases);
    check_peaked_and_hidden_nan(e, rep);
    check_chunks_and_states(e, rep);
  });
  section("bandwidth", [&] { check_bandwidth_and_vranks(e, rep, max_tokens); });
  section("bandwidth8", [&] { check_bandwidth_8bit(e, rep, max_tokens); });
  exec->reset();  // frees the KV cache before NCCL's own executor starts
  section("nccl", [&] { check_nccl(rep); });
  print_tables(rep);
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rep.notes.push_back("total: " + fmt("%.1f s", total));
  if (!write_json(true) || !json_ok) {
    std::fprintf(stderr, "gpu_check: cannot write %s\n", json_path.c_str());
    return 2;
  }
  const int rc = rep.exit_code();
  std::printf("\ngpu_check: %s (%zu checks, %zu wrong, %zu set-up failures, %.0f s)\n",
              rc == 0   ? "all results correct"
              : rc == 1 ? "WRONG RESULTS"
                        : "a set-up failed (environment); no wrong result",
              rep.checks.size(), rep.wrong_results(), rep.environment_failures(), total);
  return rc;
}
