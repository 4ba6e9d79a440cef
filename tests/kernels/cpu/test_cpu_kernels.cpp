// Tests of the SIMD CPU kernels, each ISA target forced (skipped when the CPU lacks it):
// SIMD tails, misaligned and strided views with NaN-poisoned memory around them, every dtype
// and head dim, causal Q > 1 over striped positions, empty shards, NaN propagation, the exact
// fixture bit for bit for every chunk size, bitwise determinism across thread counts, and the
// contract of each target's exp; quantized (fp8, int8) caches against the oracle on the
// dequantized values, and the quantize/dequantize round trip.
//
// Tolerance (tests/support/test_data.hpp): K/V of every dtype are widened to float32 exactly,
// so the only error is float32 accumulation: max|out - ref| <= 1e-5 * max(1, max|ref|) on the
// normalized output, the same relative bound on the LSE, against the float64 oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/cpu/driver_tuning.hpp"
#include "kernels/cpu/item_order.hpp"
#include "kernels/kernel_impl.hpp"
#include "support/test_data.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/state.hpp"
#include "treeattn/tuning.hpp"

namespace treeattn {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kTol = 1e-5;

// A KV buffer laid out as a view inside a larger, NaN-poisoned allocation: every batch row and
// head holds `capacity` token slots of `stride_token` elements, the view starts `first` tokens
// in and `elem_offset` elements past a 64-byte boundary, and everything outside the visible
// token range (padding between tokens, slots before and after) is NaN.
struct StridedKV {
  AttnShape shape;
  DType dtype;
  int64_t capacity, stride_token, first, elem_offset;
  std::vector<int64_t> len, pos_start, total_len;
  int64_t pos_stride = 1;
  std::vector<uint8_t> kbuf, vbuf;

  StridedKV(const AttnShape& s, DType t, std::vector<int64_t> lengths, int64_t first_token,
            int64_t token_pad, int64_t misalign)
      : shape(s), dtype(t), first(first_token), elem_offset(misalign), len(std::move(lengths)) {
    int64_t maxlen = 0;
    for (int64_t l : len) maxlen = std::max(maxlen, l);
    capacity = first + maxlen + 3;
    stride_token = s.head_dim + token_pad;
    const std::size_t elems =
        static_cast<std::size_t>(elem_offset + s.batch * s.kv_heads * capacity * stride_token);
    kbuf.assign(elems * dtype_size(t) + 64, 0);
    vbuf.assign(kbuf.size(), 0);
    for (std::size_t i = 0; i < elems; ++i) {
      store_from_float(kdata(), t, i, kNaN);
      store_from_float(vdata(), t, i, kNaN);
    }
    pos_start.assign(len.size(), 0);
    total_len = len;
  }
  void* kdata() { return kbuf.data() + (64 - reinterpret_cast<uintptr_t>(kbuf.data()) % 64) % 64; }
  void* vdata() { return vbuf.data() + (64 - reinterpret_cast<uintptr_t>(vbuf.data()) % 64) % 64; }
  const void* kdata() const { return const_cast<StridedKV*>(this)->kdata(); }
  const void* vdata() const { return const_cast<StridedKV*>(this)->vdata(); }
  int64_t stride_head() const { return capacity * stride_token; }
  int64_t stride_batch() const { return shape.kv_heads * stride_head(); }
  std::size_t index(int64_t b, int64_t h, int64_t t) const {
    return static_cast<std::size_t>(elem_offset + b * stride_batch() + h * stride_head() +
                                    (first + t) * stride_token);
  }
  void set(int64_t b, int64_t h, int64_t t, const float* k, const float* v) {
    const std::size_t base = index(b, h, t);
    for (int64_t d = 0; d < shape.head_dim; ++d) {
      store_from_float(kdata(), dtype, base + static_cast<std::size_t>(d), k[d]);
      store_from_float(vdata(), dtype, base + static_cast<std::size_t>(d), v[d]);
    }
  }
  void fill_random(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> k(static_cast<std::size_t>(shape.head_dim)), v(k.size());
    for (int64_t b = 0; b < shape.batch; ++b)
      for (int64_t h = 0; h < shape.kv_heads; ++h)
        for (int64_t t = 0; t < len[static_cast<std::size_t>(b)]; ++t) {
          for (auto& x : k) x = u(rng);
          for (auto& x : v) x = u(rng);
          set(b, h, t, k.data(), v.data());
        }
  }
  KVShard view() const {
    KVShard s;
    s.dtype = dtype;
    const std::size_t off = static_cast<std::size_t>(elem_offset + first * stride_token) * dtype_size(dtype);
    s.k = static_cast<const uint8_t*>(kdata()) + off;
    s.v = static_cast<const uint8_t*>(vdata()) + off;
    s.stride_batch = stride_batch();
    s.stride_head = stride_head();
    s.stride_token = stride_token;
    s.len = len;
    s.pos_start = pos_start;
    s.total_len = total_len;
    s.pos_stride = pos_stride;
    return s;
  }
};

std::vector<float> random_q(const AttnShape& s, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
  for (auto& x : q) x = u(rng) * scale;
  return q;
}

std::size_t record_count(const AttnShape& s) {
  return static_cast<std::size_t>(s.batch * s.q_len * s.heads);
}

// Runs the kernel on a view and compares with the oracle; returns the errors.
testing::Errors run_vs_oracle(const AttnShape& s, const std::vector<float>& q, const KVShard& kv,
                              const DecodeOptions& opt) {
  const std::size_t rows = record_count(s), D = static_cast<std::size_t>(s.head_dim);
  std::vector<float> states(rows * (D + 2));
  const Status st = decode_partial(s, q.data(), kv, states.data(), opt);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  std::vector<double> out(rows * D), lse(rows);
  const Status so = oracle_attention(s, q.data(), kv, out.data(), lse.data(), opt.scale);
  EXPECT_TRUE(so.is_ok()) << so.to_string();
  return testing::compare_states(s, states.data(), out.data(), lse.data());
}

std::string describe(const testing::Errors& e) {
  return "out_rel " + std::to_string(e.out_rel()) + " lse_rel " + std::to_string(e.lse_abs) +
         (e.nan_mismatch ? " NaN MISMATCH" : "");
}

class CpuTarget : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam()))
      GTEST_SKIP() << "CPU lacks " << isa_name(GetParam());
    if (kernels::cpu::exp_for(GetParam()) == nullptr)
      GTEST_SKIP() << isa_name(GetParam()) << " is not built into this library";
  }
  DecodeOptions opts(int64_t chunk = 0, int threads = 0) const {
    DecodeOptions o;
    o.isa = GetParam();
    o.chunk_tokens = chunk;
    o.threads = threads;
    return o;
  }
};

// The registry hands out a kernel for the target, and auto picks the best one.
TEST_P(CpuTarget, IsRegistered) {
  EXPECT_NE(kernels::cpu_kernel_for(GetParam()), nullptr);
  if (GetParam() == Isa::kAvx512) {
    EXPECT_EQ(best_isa(), Isa::kAvx512);
  }
}

// Lengths around the vector widths (8, 16) and the 32-token block, every dtype and head dim,
// with misaligned, strided views and NaN everywhere outside them.
TEST_P(CpuTarget, TailsMisalignmentAndPoisonedPadding) {
  const int64_t lengths[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 97};
  const int64_t dims[] = {64, 80, 96, 128, 192, 256};
  int k = 0;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t L : lengths) {
      const int64_t D = dims[k % 6];
      const int64_t misalign = (k % 3 == 0) ? 0 : (k % 3 == 1 ? 1 : 5);  // elements off 64 B
      const int64_t token_pad = (k % 4 == 0) ? 0 : 3;                     // odd token strides
      const int64_t first = k % 5;                                        // view mid-cache
      const int64_t heads = (k % 2 == 0) ? 8 : 3, kv_heads = (k % 2 == 0) ? 2 : 3;
      ++k;
      AttnShape s{2, heads, kv_heads, D, 1};
      StridedKV kv(s, t, {L, std::max<int64_t>(1, L / 2)}, first, token_pad, misalign);
      kv.fill_random(static_cast<uint64_t>(k));
      const auto q = random_q(s, static_cast<uint64_t>(100 + k), 2.0f);
      for (int64_t chunk : {int64_t{0}, int64_t{7}, int64_t{32}}) {
        const auto e = run_vs_oracle(s, q, kv.view(), opts(chunk));
        EXPECT_FALSE(e.nan_mismatch) << dtype_name(t) << " L=" << L << " D=" << D;
        EXPECT_LE(e.out_rel(), kTol) << dtype_name(t) << " L=" << L << " D=" << D << " "
                                     << describe(e);
        EXPECT_LE(e.lse_abs, kTol) << dtype_name(t) << " L=" << L << " D=" << D;
      }
    }
  }
}

// Multi-token queries against a striped shard: rank 1 of 3 holds positions 1, 4, 7, ...; the
// causal limit falls inside blocks and inside 4-row tiles (group 2 puts two queries in a tile).
TEST_P(CpuTarget, CausalStripedPositions) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (int64_t total : {int64_t{5}, int64_t{40}, int64_t{100}, int64_t{301}}) {
      for (int64_t group : {int64_t{1}, int64_t{2}, int64_t{4}}) {
        for (int64_t Q : {int64_t{2}, int64_t{4}, int64_t{7}}) {
          AttnShape s{2, 2 * group, 2, 128, Q};
          const int64_t stride = 3, rank = 1;
          const int64_t n = total > rank ? (total - rank + stride - 1) / stride : 0;
          StridedKV kv(s, t, {n, n}, 2, 1, 1);
          kv.pos_stride = stride;
          kv.pos_start = {rank, rank};
          kv.total_len = {total, total};
          kv.fill_random(static_cast<uint64_t>(total * 10 + Q));
          const auto q = random_q(s, static_cast<uint64_t>(total + group), 3.0f);
          for (int64_t chunk : {int64_t{0}, int64_t{5}, int64_t{33}}) {
            const auto e = run_vs_oracle(s, q, kv.view(), opts(chunk));
            EXPECT_FALSE(e.nan_mismatch) << "total " << total << " G " << group << " Q " << Q;
            EXPECT_LE(e.out_rel(), kTol) << "total " << total << " G " << group << " Q " << Q
                                         << " " << describe(e);
            EXPECT_LE(e.lse_abs, kTol) << "total " << total << " G " << group << " Q " << Q;
          }
        }
      }
    }
  }
}

// Tokens past a query's causal limit hold NaN: they must never be read for that query.
TEST_P(CpuTarget, CausallyHiddenNaNIsNotRead) {
  AttnShape s{1, 4, 1, 64, 4};
  const int64_t n = 70;
  StridedKV kv(s, DType::kF32, {n}, 0, 0, 0);
  kv.fill_random(3);
  // The last 3 tokens are seen only by later queries; poison the last one (seen only by q 3).
  std::vector<float> nan_row(64, kNaN);
  kv.set(0, 0, n - 1, nan_row.data(), nan_row.data());
  const auto q = random_q(s, 4);
  std::vector<float> states(record_count(s) * 66);
  for (int64_t chunk : {int64_t{0}, int64_t{16}}) {
    ASSERT_TRUE(decode_partial(s, q.data(), kv.view(), states.data(), opts(chunk)).is_ok());
    for (std::size_t r = 0; r < record_count(s); ++r) {
      const bool last_query = r / 4 == 3;
      EXPECT_EQ(std::isnan(states[r * 66 + 1]), last_query) << "record " << r;
      EXPECT_EQ(std::isnan(states[r * 66 + 2]), last_query) << "record " << r;
    }
  }
}

// Empty shards (all rows, or some rows of a ragged batch) give the empty state exactly.
TEST_P(CpuTarget, EmptyShards) {
  AttnShape s{3, 8, 2, 128, 2};
  StridedKV kv(s, DType::kF16, {0, 37, 0}, 1, 0, 0);
  kv.fill_random(5);
  const auto q = random_q(s, 6);
  std::vector<float> states(record_count(s) * 130, 123.0f);
  ASSERT_TRUE(decode_partial(s, q.data(), kv.view(), states.data(), opts()).is_ok());
  for (std::size_t r = 0; r < record_count(s); ++r) {
    const std::size_t b = r / 16;
    if (b == 1) {
      EXPECT_GT(states[r * 130 + 1], 0.0f);
      continue;
    }
    EXPECT_EQ(states[r * 130], -kInf) << r;
    for (std::size_t i = 1; i < 130; ++i) EXPECT_EQ(states[r * 130 + i], 0.0f) << r;
  }
  StridedKV none(s, DType::kF32, {0, 0, 0}, 0, 0, 0);
  ASSERT_TRUE(decode_partial(s, q.data(), none.view(), states.data(), opts()).is_ok());
  for (std::size_t r = 0; r < record_count(s); ++r) EXPECT_TRUE(state_is_empty(states.data() + r * 130));
}

// A NaN in K poisons the rows of its KV head only; a NaN in V poisons o; an infinite query
// entry (logit -inf or NaN) is handled as the oracle does.
TEST_P(CpuTarget, NaNPropagation) {
  AttnShape s{1, 8, 2, 96, 1};
  for (bool in_k : {true, false}) {
    for (int64_t at : {int64_t{0}, int64_t{40}, int64_t{199}}) {
      StridedKV kv(s, DType::kBF16, {200}, 0, 0, 0);
      kv.fill_random(7);
      std::vector<float> k(96), v(96);
      for (int i = 0; i < 96; ++i) k[static_cast<std::size_t>(i)] = v[static_cast<std::size_t>(i)] = 0.25f;
      (in_k ? k : v)[17] = kNaN;
      kv.set(0, 1, at, k.data(), v.data());
      const auto q = random_q(s, 8);
      std::vector<float> states(8 * 98);
      ASSERT_TRUE(decode_partial(s, q.data(), kv.view(), states.data(), opts(64)).is_ok());
      for (std::size_t h = 0; h < 8; ++h) {
        float out[96], lse;
        state_normalize(states.data() + h * 98, 96, out, &lse);
        const bool poisoned = h >= 4;
        EXPECT_EQ(std::isnan(lse), poisoned && in_k) << "head " << h << " at " << at;
        EXPECT_EQ(std::isnan(out[17]), poisoned) << "head " << h << " at " << at;
        if (poisoned && in_k) {
          EXPECT_TRUE(std::isnan(states[h * 98])) << "m must be NaN";
        }
      }
    }
  }
}

// Raw logits of -524288 and large positive ones need no sentinel.
TEST_P(CpuTarget, ExtremeLogits) {
  for (float qs : {1e4f, -1e4f, 5e5f}) {
    AttnShape s{1, 4, 1, 128, 1};
    StridedKV kv(s, DType::kF32, {77}, 0, 0, 0);
    kv.fill_random(9);
    auto q = random_q(s, 10, qs);
    DecodeOptions o = opts(16);
    o.scale = 1.0f;
    const auto e = run_vs_oracle(s, q, kv.view(), o);
    EXPECT_FALSE(e.nan_mismatch);
    // Logits of 1e5 carry float32 rounding of ~1e-2 absolute, which moves the weights.
    EXPECT_LE(e.out_rel(), 2e-2) << qs << " " << describe(e);
  }
  // Every logit exactly -524288 (q and k constant): the output is the mean of V.
  AttnShape s{1, 1, 1, 64, 1};
  StridedKV kv(s, DType::kF32, {40}, 0, 0, 0);
  std::vector<float> k(64, 1.0f), v(64);
  for (int64_t t = 0; t < 40; ++t) {
    for (int d = 0; d < 64; ++d) v[static_cast<std::size_t>(d)] = static_cast<float>(t % 4);
    kv.set(0, 0, t, k.data(), v.data());
  }
  std::vector<float> q(64, -8192.0f), rec(66);
  DecodeOptions o = opts();
  o.scale = 1.0f;
  ASSERT_TRUE(decode_partial(s, q.data(), kv.view(), rec.data(), o).is_ok());
  EXPECT_EQ(rec[0], -524288.0f);
  EXPECT_EQ(rec[1], 40.0f);
  EXPECT_EQ(rec[2], 60.0f);  // 10 * (0 + 1 + 2 + 3)
}

// q = 0 makes every logit 0 and every weight exp(0) = 1; with small-integer V and a
// power-of-two length the output equals mean(V) bit for bit, whatever the chunking.
TEST_P(CpuTarget, ExactFixtureBitForBit) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t n : {int64_t{64}, int64_t{256}, int64_t{1024}, int64_t{4096}}) {
      AttnShape s{2, 8, 2, 128, 1};
      StridedKV kv(s, t, {n, n / 2}, 3, 1, 1);
      std::mt19937_64 rng(static_cast<uint64_t>(n));
      std::uniform_int_distribution<int> u(-8, 8);
      std::vector<double> sum(static_cast<std::size_t>(2 * 2 * 128), 0.0);
      std::vector<float> k(128), v(128);
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t tok = 0; tok < kv.len[static_cast<std::size_t>(b)]; ++tok) {
            for (int d = 0; d < 128; ++d) {
              k[static_cast<std::size_t>(d)] = static_cast<float>(u(rng)) * 0.5f;
              v[static_cast<std::size_t>(d)] = static_cast<float>(u(rng));
              sum[static_cast<std::size_t>((b * 2 + h) * 128 + d)] += v[static_cast<std::size_t>(d)];
            }
            kv.set(b, h, tok, k.data(), v.data());
          }
      std::vector<float> q(static_cast<std::size_t>(2 * 8 * 128), 0.0f);
      for (int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{7}, int64_t{32},
                            int64_t{100}, int64_t{1024}}) {
        std::vector<float> states(16 * 130);
        ASSERT_TRUE(decode_partial(s, q.data(), kv.view(), states.data(), opts(chunk)).is_ok());
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t h = 0; h < 8; ++h) {
            const float* rec = states.data() + static_cast<std::size_t>(b * 8 + h) * 130;
            const int64_t len = kv.len[static_cast<std::size_t>(b)];
            ASSERT_EQ(rec[0], 0.0f);
            ASSERT_EQ(rec[1], static_cast<float>(len)) << "chunk " << chunk;
            float out[128], lse;
            state_normalize(rec, 128, out, &lse);
            for (int d = 0; d < 128; ++d) {
              const float mean = static_cast<float>(
                  sum[static_cast<std::size_t>((b * 2 + h / 4) * 128 + d)] / static_cast<double>(len));
              ASSERT_EQ(out[d], mean) << dtype_name(t) << " n " << n << " chunk " << chunk;
            }
          }
      }
    }
  }
}

// Same inputs, any thread count: the same bits.
TEST_P(CpuTarget, DeterministicAcrossThreadCounts) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    AttnShape s{3, 8, 2, 128, 2};
    StridedKV kv(s, t, {3000, 17, 1500}, 0, 0, 0);
    kv.fill_random(11);
    const auto q = random_q(s, 12, 4.0f);
    std::vector<float> base(record_count(s) * 130), other(base.size());
    ASSERT_TRUE(decode_partial(s, q.data(), kv.view(), base.data(), opts(256, 1)).is_ok());
    for (int threads : {2, 3, 5, 8}) {
      for (int rep = 0; rep < 3; ++rep) {
        ASSERT_TRUE(decode_partial(s, q.data(), kv.view(), other.data(), opts(256, threads)).is_ok());
        ASSERT_EQ(std::memcmp(base.data(), other.data(), base.size() * sizeof(float)), 0)
            << threads << " threads";
      }
    }
  }
}

// The roofline's ceiling loop (FmaStreamFn) reads every element of every line once, widened as
// the kernel widens its dtype, into each of `rows` accumulators, row r with its own multiplier
// c * (r + 1): with small integers (exact in every dtype and in any summation order) it returns
// c * (1 + ... + rows) * their sum, for an odd number of lines (the one-line tail), every row
// count it takes (clamped to 1 .. 8) and a byte count that is not whole lines (rounded down).
TEST_P(CpuTarget, CeilingLoopReadsEveryElementIntoEveryRow) {
  const kernels::cpu::FmaStreamFn fn = kernels::cpu::fma_stream_for(GetParam());
  ASSERT_NE(fn, nullptr);
  constexpr int64_t kLines = 37;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8}) {
    const auto eb = static_cast<int64_t>(dtype_size(dt));
    const int64_t n = kLines * 64 / eb;
    std::vector<uint8_t> buf(static_cast<std::size_t>(kLines * 64));
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = static_cast<float>((i * 7) % 5) - 1.0f;  // -1 .. 3
      sum += x;
      uint8_t* e = buf.data() + i * eb;
      switch (dt) {
        case DType::kF32: std::memcpy(e, &x, 4); break;
        case DType::kF16: { const uint16_t b = float_to_f16(x); std::memcpy(e, &b, 2); break; }
        case DType::kBF16: { const uint16_t b = float_to_bf16(x); std::memcpy(e, &b, 2); break; }
        case DType::kFP8: *e = float_to_fp8_e4m3(x); break;
        case DType::kInt8: *e = static_cast<uint8_t>(static_cast<int8_t>(x)); break;
      }
    }
    // The last line alone, for the byte count short of a whole line.
    double last = 0;
    for (int64_t i = (kLines - 1) * 64 / eb; i < n; ++i)
      last += static_cast<double>((i * 7) % 5) - 1.0;
    for (int rows : {1, 2, 3, 4, 5, 7, 8, 0, 9}) {
      const int eff = rows < 1 ? 1 : (rows > 8 ? 8 : rows);
      const double weight = 0.5 * eff * (eff + 1) / 2;  // c * (1 + ... + eff)
      EXPECT_EQ(static_cast<double>(fn(buf.data(), kLines * 64, dt, rows, 256, 0.5f)),
                weight * sum)
          << dtype_name(dt) << " rows " << rows;
      EXPECT_EQ(static_cast<double>(fn(buf.data(), kLines * 64 - 1, dt, rows, 0, 0.5f)),
                weight * (sum - last))
          << dtype_name(dt) << " rows " << rows << ", one byte short of the last line";
    }
  }
}

// The bandwidth probe (the roofline's and the calibration's): the exact sum of its n floats (n a
// multiple of 128), from a pointer off any vector boundary, and nothing past them (NaN there).
TEST_P(CpuTarget, ReadProbeSumsExactlyItsFloats) {
  const kernels::cpu::ReadStreamFn fn = kernels::cpu::read_stream_for(GetParam());
  ASSERT_NE(fn, nullptr);
  for (int64_t n : {int64_t{128}, int64_t{256}, int64_t{1152}}) {
    for (int64_t off : {0, 1, 5}) {
      std::vector<float> buf(static_cast<std::size_t>(off + n + 64), kNaN);
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float x = static_cast<float>((i * 11) % 7 + 1);  // 1 .. 7: any lost one shows; sums exact
        buf[static_cast<std::size_t>(off + i)] = x;
        sum += x;
      }
      EXPECT_EQ(static_cast<double>(fn(buf.data() + off, n)), sum) << "n " << n << " off " << off;
    }
  }
}

// The kernel's exp: exactly 1 at 0, 0 at -inf, NaN for NaN, +inf above the float range, and
// within 2 ulp of the correctly rounded value on [-87, 0] (the range softmax uses).
TEST_P(CpuTarget, ExpContract) {
  const kernels::cpu::ExpFn fn = kernels::cpu::exp_for(GetParam());
  ASSERT_NE(fn, nullptr);
  std::vector<float> in = {0.0f, -0.0f, -kInf, kNaN, 100.0f, kInf, -100.0f, -87.0f, 88.0f};
  std::vector<float> out(in.size());
  fn(in.data(), out.data(), static_cast<int64_t>(in.size()));
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 1.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_EQ(out[4], kInf);
  EXPECT_EQ(out[5], kInf);
  EXPECT_GE(out[6], 0.0f);  // 0, or libm's subnormal for the generic target
  EXPECT_LT(out[6], 1.2e-38f);
  EXPECT_GT(out[7], 0.0f);
  EXPECT_LT(std::abs(out[8] / static_cast<float>(std::exp(88.0)) - 1.0f), 1e-6f);
  std::vector<float> xs;
  for (float x = -87.0f; x <= 0.0f; x += 0.0137f) xs.push_back(x);
  for (float x = -1e-3f; x <= 0.0f; x += 1.3e-6f) xs.push_back(x);
  std::vector<float> ys(xs.size());
  fn(xs.data(), ys.data(), static_cast<int64_t>(xs.size()));  // odd count: exercises the tail
  double worst = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double ref = std::exp(static_cast<double>(xs[i]));
    const double ulp = std::nextafter(static_cast<float>(ref), kInf) - static_cast<float>(ref);
    worst = std::max(worst, std::abs(ys[i] - ref) / ulp);
  }
  EXPECT_LE(worst, 2.0) << "worst error in ulp";
}

// The softmax's exp (exp_nonpos, for s - m): the same bits as exp for every input it gets
// (x <= 0, -0, -inf, NaN), across the underflow edge and the subnormal results.
TEST_P(CpuTarget, ExpNonposGivesExpsBits) {
  const kernels::cpu::ExpFn full = kernels::cpu::exp_for(GetParam());
  const kernels::cpu::ExpFn nonpos = kernels::cpu::exp_nonpos_for(GetParam());
  ASSERT_NE(full, nullptr);
  ASSERT_NE(nonpos, nullptr);
  std::vector<float> xs = {0.0f, -0.0f, -kInf, kNaN, -kNaN, -87.33654f, -87.3365f, -87.34f,
                           -88.0f, -103.9f, -1e30f, -std::numeric_limits<float>::denorm_min(),
                           -std::numeric_limits<float>::min()};
  for (float x = -90.0f; x <= 0.0f; x += 0.00731f) xs.push_back(x);
  for (float x = -1e-3f; x <= 0.0f; x += 7.3e-7f) xs.push_back(x);
  std::vector<float> a(xs.size()), b(xs.size());
  full(xs.data(), a.data(), static_cast<int64_t>(xs.size()));
  nonpos(xs.data(), b.data(), static_cast<int64_t>(xs.size()));
  int bad = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const bool same = std::isnan(a[i]) ? std::isnan(b[i]) : std::memcmp(&a[i], &b[i], 4) == 0;
    if (!same && ++bad <= 5) ADD_FAILURE() << "x " << xs[i] << ": exp " << a[i] << ", exp_nonpos " << b[i];
  }
  EXPECT_EQ(bad, 0);
}

// Bigger shapes through the sweep helper: GQA groups, Q 1/4, long enough for many chunks.
TEST_P(CpuTarget, GroupedQueryLongShard) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t Q : {int64_t{1}, int64_t{4}}) {
      testing::Problem p(AttnShape{2, 32, 8, 128, Q}, t, {5000, 2049}, 21, 2.0f);
      testing::Errors e;
      ASSERT_TRUE(testing::kernel_vs_oracle(p, opts(), &e).is_ok());
      EXPECT_FALSE(e.nan_mismatch);
      EXPECT_LE(e.out_rel(), kTol) << dtype_name(t) << " Q " << Q << " " << describe(e);
      EXPECT_LE(e.lse_abs, kTol) << dtype_name(t) << " Q " << Q;
    }
  }
}

// Quantized caches (fp8, int8) written by KVCache::set_token, viewed from an offset (so the
// scale pointers move with the view), chunked, GQA and causal Q > 1, against the oracle on the
// dequantized cache. Every byte code appears in the raw-code variant (fp8 subnormals included).
void fill_quantized_cache(KVCache& cache, const AttnShape& s, int64_t capacity, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> k(static_cast<std::size_t>(s.head_dim)), v(k.size());
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t t = 0; t < capacity; ++t) {
        // Token 3 is all zero (scale 0), token 5 large, the rest in [-2, 2).
        const float mul = t == 3 ? 0.0f : (t == 5 ? 300.0f : 1.0f);
        for (std::size_t d = 0; d < k.size(); ++d) {
          k[d] = u(rng) * mul;
          v[d] = u(rng) * mul;
        }
        cache.set_token(b, h, t, k.data(), v.data());
      }
}

TEST_P(CpuTarget, QuantizedCachesMatchOracle) {
  for (DType t : {DType::kFP8, DType::kInt8}) {
    for (int64_t D : {64, 80, 128, 256}) {
      for (int64_t Q : {int64_t{1}, int64_t{3}}) {
        const AttnShape s{2, 8, 2, D, Q};
        const std::vector<int64_t> len{1537, 33};
        const int64_t first = 2, capacity = 1537 + first + 3;
        KVCache cache(s, t, capacity);
        fill_quantized_cache(cache, s, capacity, static_cast<uint64_t>(D * 10 + Q));
        const std::vector<int64_t> start{0, 0};
        const KVShard kv = cache.view(first, len, start, len, 1);
        const std::vector<float> q = random_q(s, 7);
        for (int64_t chunk : {int64_t{0}, int64_t{100}}) {
          const testing::Errors e = run_vs_oracle(s, q, kv, opts(chunk));
          EXPECT_FALSE(e.nan_mismatch) << dtype_name(t) << " D " << D;
          EXPECT_LE(e.out_rel(), kTol) << dtype_name(t) << " D " << D << " Q " << Q << " chunk "
                                      << chunk << " " << describe(e);
          EXPECT_LE(e.lse_abs, kTol) << dtype_name(t) << " D " << D << " Q " << Q;
        }
      }
    }
  }
}

// Raw codes: every fp8 byte (the NaN codes in one token only) and every int8 byte, with scales
// stored at a token stride of 3, against the oracle; the token holding fp8 NaN codes makes the
// output NaN in both.
TEST_P(CpuTarget, QuantizedRawCodesAndStridedScales) {
  for (DType t : {DType::kFP8, DType::kInt8}) {
    for (bool with_nan : {false, true}) {
      const AttnShape s{1, 4, 1, 128, 1};
      const int64_t n = 70, D = s.head_dim;
      std::vector<uint8_t> k(static_cast<std::size_t>(n * D)), v(k.size());
      std::vector<float> ks(static_cast<std::size_t>(3 * n)), vs(ks.size());
      std::mt19937_64 rng(5);
      std::uniform_real_distribution<float> u(0.0f, 0.01f);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = 0; d < D; ++d) {
          auto code = static_cast<uint8_t>((j * D + d) % 256);
          auto vcode = static_cast<uint8_t>((j * D + d * 7 + 3) % 256);
          const bool nan_token = t == DType::kFP8 && with_nan && j == 40;
          if (t == DType::kFP8 && !nan_token) {  // keep S.1111.111 out
            if ((code & 0x7f) == 0x7f) code = 0;
            if ((vcode & 0x7f) == 0x7f) vcode = 0;
          }
          k[static_cast<std::size_t>(j * D + d)] = code;
          v[static_cast<std::size_t>(j * D + d)] = vcode;
        }
        ks[static_cast<std::size_t>(3 * j)] = u(rng);
        vs[static_cast<std::size_t>(3 * j)] = u(rng);
      }
      const std::vector<int64_t> len{n}, start{0};
      KVShard kv;
      kv.dtype = t;
      kv.k = k.data();
      kv.v = v.data();
      kv.stride_token = D;
      kv.stride_head = n * D;
      kv.stride_batch = n * D;
      kv.len = len;
      kv.pos_start = start;
      kv.total_len = len;
      kv.k_scale = ks.data();
      kv.v_scale = vs.data();
      kv.scale_stride_token = 3;
      kv.scale_stride_head = 3 * n;
      kv.scale_stride_batch = 3 * n;
      const std::vector<float> q = random_q(s, 9, 3.0f);
      const testing::Errors e = run_vs_oracle(s, q, kv, opts(32));
      EXPECT_FALSE(e.nan_mismatch) << dtype_name(t) << " nan " << with_nan;
      EXPECT_LE(e.out_rel(), kTol) << dtype_name(t) << " " << describe(e);
      if (t == DType::kFP8 && with_nan) {
        std::vector<float> st(4 * (static_cast<std::size_t>(D) + 2));
        ASSERT_TRUE(decode_partial(s, q.data(), kv, st.data(), opts(32)).is_ok());
        EXPECT_TRUE(std::isnan(st[1])) << "a NaN key code must make l NaN";
      }
    }
  }
}

// The scalar reference kernel dequantizes the same way.
TEST(QuantizedReference, MatchesOracle) {
  for (DType t : {DType::kFP8, DType::kInt8}) {
    const AttnShape s{2, 8, 2, 96, 2};
    const std::vector<int64_t> len{300, 41}, start{0, 0};
    KVCache cache(s, t, 305);
    fill_quantized_cache(cache, s, 305, 3);
    const KVShard kv = cache.view(1, len, start, len, 1);
    DecodeOptions o;
    o.isa = Isa::kReference;
    o.chunk_tokens = 64;
    const testing::Errors e = run_vs_oracle(s, random_q(s, 4), kv, o);
    EXPECT_FALSE(e.nan_mismatch);
    EXPECT_LE(e.out_rel(), kTol) << dtype_name(t) << " " << describe(e);
  }
}

// The view checks scales: required for quantized dtypes, rejected for the others.
TEST(QuantizedView, ScalePointersAreValidated) {
  const AttnShape s{1, 4, 1, 64, 1};
  KVCache cache(s, DType::kInt8, 8);
  const std::vector<int64_t> len{8}, start{0};
  KVShard kv = cache.view(0, len, start, len, 1);
  EXPECT_TRUE(kv.validate(s).is_ok());
  kv.v_scale = nullptr;
  EXPECT_FALSE(kv.validate(s).is_ok());
  KVCache f(s, DType::kF32, 8);
  KVShard fv = f.view(0, len, start, len, 1);
  fv.k_scale = cache.k_scale_data();
  EXPECT_FALSE(fv.validate(s).is_ok());
}

// Quantize-dequantize round trips: every fp8 and int8 code survives decode + encode, rounding
// is to nearest even with saturation, and quantize_token's error is within half a code step of
// its scale: max|x| / quant_max rounded up to a bfloat16 value (quant_scale), so no code
// saturates.
TEST(Quantize, CodesRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float f = fp8_e4m3_to_float(code);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << c;
      EXPECT_EQ(float_to_fp8_e4m3(f) & 0x7f, 0x7f);
      continue;
    }
    EXPECT_EQ(float_to_fp8_e4m3(f), code) << "fp8 code " << c << " value " << f;
  }
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_float(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(float_to_fp8_e4m3(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(float_to_fp8_e4m3(-1000.0f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(1.0625f), 0x38);  // tie 1 | 1.125 -> even (1)
  EXPECT_EQ(float_to_fp8_e4m3(1.1875f), 0x3a);  // tie 1.125 | 1.25 -> even (1.25)
  EXPECT_EQ(float_to_fp8_e4m3(0x1p-10f), 0x00);  // tie 0 | 2^-9 -> even (0)
  for (int c = -127; c <= 127; ++c)
    EXPECT_EQ(float_to_int8(static_cast<float>(c)), c);
  EXPECT_EQ(float_to_int8(2.5f), 2);
  EXPECT_EQ(float_to_int8(3.5f), 4);
  EXPECT_EQ(float_to_int8(-2.5f), -2);
  EXPECT_EQ(float_to_int8(200.0f), 127);
  EXPECT_EQ(float_to_int8(-200.0f), -127);
}

TEST(Quantize, TokenRoundTripThroughKVCache) {
  const AttnShape s{1, 4, 2, 128, 1};
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (DType t : {DType::kFP8, DType::kInt8}) {
    KVCache cache(s, t, 4);
    std::vector<float> k(128), v(128);
    for (int64_t tok = 0; tok < 4; ++tok) {
      for (std::size_t d = 0; d < 128; ++d) {
        k[d] = u(rng);
        v[d] = tok == 2 ? 0.0f : u(rng);
      }
      cache.set_token(0, 1, tok, k.data(), v.data());
      const float ks = cache.k_scale_data()[cache.scale_index(0, 1, tok)];
      const float vs = cache.v_scale_data()[cache.scale_index(0, 1, tok)];
      float amax = 0;
      for (float x : k) amax = std::max(amax, std::abs(x));
      EXPECT_EQ(ks, quant_scale(amax, t));
      EXPECT_TRUE(is_bf16_value(ks));
      EXPECT_GE(ks, amax / quant_max(t));                           // rounded up ...
      EXPECT_LT(ks, amax / quant_max(t) * (1 + 0x1p-7f));           // ... by less than a bf16 step
      for (float x : k) EXPECT_LE(std::abs(x / ks), quant_max(t));  // no code saturates
      if (tok == 2) {
        EXPECT_EQ(vs, 0.0f);
      }
      for (std::size_t d = 0; d < 128; ++d) {
        const std::size_t i = cache.index(0, 1, tok) + d;
        const float kd = dequantize(cache.k_data(), t, i, ks);
        const float vd = dequantize(cache.v_data(), t, i, vs);
        // int8: half a step; fp8: half an ulp of 3 mantissa bits (2^-4 relative) or half the
        // subnormal step; plus float rounding of the product.
        const float step = t == DType::kInt8 ? 0.5f * ks
                                             : std::max(std::abs(k[d]) * 0x1p-4f, 0x1p-10f * ks);
        EXPECT_LE(std::abs(kd - k[d]), step * 1.0001f + 1e-7f) << dtype_name(t) << " d " << d;
        if (tok == 2) {
          EXPECT_EQ(vd, 0.0f);
        }
      }
    }
  }
}

// The bound over magnitudes far apart (tiny to huge, a subnormal max included) and rows whose
// largest element is exactly a code step from a bf16 boundary: int8 within scale / 2, fp8
// within half an ulp of 3 mantissa bits (or half its subnormal step), the scale a bf16 value.
TEST(Quantize, BoundHoldsForEveryMagnitude) {
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(64), back(64);
  std::vector<uint8_t> codes(64);
  for (DType t : {DType::kFP8, DType::kInt8})
    for (int e = -140; e <= 110; e += 10)
      for (int rep = 0; rep < 4; ++rep) {
        for (float& v : x) v = std::ldexp(u(rng), e);
        if (rep == 1) x[5] = std::ldexp(quant_max(t) * (1.0f + 0x1p-7f), e);  // on a boundary
        if (rep == 2) x[9] = -std::ldexp(std::nextafter(1.0f, 2.0f), e);
        const float s = quantize_token(codes.data(), t, 0, x.data(), x.size());
        ASSERT_TRUE(is_bf16_value(s));
        for (std::size_t d = 0; d < x.size(); ++d) {
          back[d] = dequantize(codes.data(), t, d, s);
          const double err = std::abs(static_cast<double>(back[d]) - x[d]);
          const double bound = t == DType::kInt8
                                   ? 0.5 * s * (1 + 0x1p-20)
                                   : std::max(std::abs(x[d]) * 0x1p-4, 0x1p-10 * s) * (1 + 0x1p-20);
          ASSERT_LE(err, bound + 0x1p-149) << dtype_name(t) << " e " << e << " d " << d;
          if (s > 0) {
            ASSERT_LE(std::abs(x[d] / s), quant_max(t));  // no code saturates
          }
        }
      }
}

INSTANTIATE_TEST_SUITE_P(Targets, CpuTarget,
                         ::testing::Values(Isa::kGeneric, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& param_info) {
                           return std::string(isa_name(param_info.param));
                         });

// The driver's item orders: each visits every (row, chunk, KV head) once, rows in order; heads
// outer walks one head's chunks in a row, chunks outer the heads of one chunk. Rows with no
// chunk (an empty shard row) are skipped in both.
TEST(ItemOrder, EveryItemOnceInTheLayoutsOrder) {
  namespace kc = kernels::cpu;
  const int64_t Hkv = 3;
  const std::vector<int64_t> first_chunk{0, 4, 4, 5, 7};  // rows of 4, 0, 1 and 2 chunks
  const int64_t B = 4, items = first_chunk[4] * Hkv;
  for (auto order : {kc::ItemOrder::kChunksOuter, kc::ItemOrder::kHeadsOuter}) {
    std::vector<int> seen(static_cast<std::size_t>(items), 0);
    kc::ItemCoords prev{};
    for (int64_t i = 0; i < items; ++i) {
      const kc::ItemCoords at = kc::item_coords(i, first_chunk.data(), B, Hkv, order);
      ASSERT_GE(at.gchunk, first_chunk[static_cast<std::size_t>(at.b)]) << i;
      ASSERT_LT(at.gchunk, first_chunk[static_cast<std::size_t>(at.b) + 1]) << i;
      ASSERT_LT(at.kv_head, Hkv) << i;
      ++seen[static_cast<std::size_t>(at.gchunk * Hkv + at.kv_head)];
      if (i > 0 && at.b == prev.b) {
        const bool heads = order == kc::ItemOrder::kHeadsOuter;
        // The inner index steps by one; where it wraps, the outer one does.
        const int64_t inner = heads ? at.gchunk : at.kv_head;
        const int64_t prev_inner = heads ? prev.gchunk : prev.kv_head;
        const int64_t outer = heads ? at.kv_head : at.gchunk;
        const int64_t prev_outer = heads ? prev.kv_head : prev.gchunk;
        if (outer == prev_outer) {
          EXPECT_EQ(inner, prev_inner + 1) << i;
        } else {
          EXPECT_EQ(outer, prev_outer + 1) << i;
        }
      } else if (i > 0) {
        EXPECT_GT(at.b, prev.b) << i;
      }
      prev = at;
    }
    for (int64_t i = 0; i < items; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], 1) << i;
  }
  // Row 0, head 1: heads outer reaches it after head 0's four chunks.
  const kc::ItemCoords h = kc::item_coords(4, first_chunk.data(), B, Hkv, kc::ItemOrder::kHeadsOuter);
  EXPECT_EQ(h.b, 0);
  EXPECT_EQ(h.kv_head, 1);
  EXPECT_EQ(h.gchunk, 0);
}

// The prefetch leads with the compiled-in choices (TREEATTN_TUNE=0): the tiled driver's per
// dtype and head_dim and the paged driver's one default unless a lead is set, and a set lead (0
// included: no prefetch) for every dtype and both drivers; set_tiled_tuning(-1) goes back to
// the defaults. (tests/kernels/test_tuning.cpp: the cache's choices.)
TEST(TiledTuning, PrefetchLeadPerDtypeAndHeadDimUnlessSet) {
  namespace kc = kernels::cpu;
  ::setenv("TREEATTN_TUNE", "0", 1);
  reload_kernel_tuning();
  auto lead = [](DType d, int64_t hd) {
    return kc::driver_choice(d, hd, 4, 1, best_isa()).tiled_prefetch;
  };
  auto paged = [](DType d) { return kc::driver_choice(d, 128, 4, 1, best_isa()).paged_prefetch; };
  ASSERT_EQ(kc::tiled_tuning().prefetch_bytes, -1);
  for (DType d : {DType::kF16, DType::kBF16}) {
    EXPECT_EQ(lead(d, 64), kc::kTiledPrefetchBytes16);
    EXPECT_EQ(lead(d, 128), kc::kTiledPrefetchBytes16);
    EXPECT_EQ(lead(d, 256), kc::kTiledPrefetchBytes);
  }
  for (DType d : {DType::kF32, DType::kFP8, DType::kInt8}) {
    for (int64_t hd : {64, 128, 256}) EXPECT_EQ(lead(d, hd), kc::kTiledPrefetchBytes);
    EXPECT_EQ(paged(d), kc::kTiledPrefetchBytes);  // every dtype, paged
  }
  EXPECT_NE(kc::kTiledPrefetchBytes16, kc::kTiledPrefetchBytes);

  const kc::TiledTuning saved = kc::tiled_tuning();
  for (int64_t set_lead : {int64_t{0}, int64_t{4096}}) {
    kc::TiledTuning set = saved;
    set.prefetch_bytes = set_lead;
    kc::set_tiled_tuning(set);
    for (DType d : {DType::kF32, DType::kBF16, DType::kInt8}) {
      EXPECT_EQ(lead(d, 128), set_lead);
      EXPECT_EQ(paged(d), set_lead);
    }
  }
  kc::TiledTuning set = saved;
  set.prefetch_bytes = -1;
  kc::set_tiled_tuning(set);
  EXPECT_EQ(lead(DType::kBF16, 128), kc::kTiledPrefetchBytes16);
  kc::set_tiled_tuning(saved);
}

}  // namespace
}  // namespace treeattn
