// Every kernel target this CPU can run (reference, generic, avx2, avx512) against the float64
// oracle, over the foundation sweep: KV lengths 0..16384, heads 1/4/32 with GQA groups 1/4/8,
// D 64/128/256, batch 1/3/17 (ragged), Q 1/4, dtypes f32/f16/bf16. Plus the exact fixture,
// SIMD tails and misaligned views, extreme logits, NaN propagation and determinism.
//
// Tolerance: see tests/support/test_data.hpp (1e-5 relative to max(1, max|ref|)).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "support/test_data.hpp"

namespace treeattn {
namespace {

using testing::Errors;
using testing::Problem;

struct HeadsConfig {
  int64_t heads, kv_heads;
};
constexpr HeadsConfig kHeads[] = {{1, 1}, {4, 4}, {4, 1}, {32, 32}, {32, 8}, {32, 4}};
constexpr int64_t kLengths[] = {0, 1, 2, 3, 7, 16, 17, 54, 97, 113, 256, 339, 799, 1024, 2048, 16384};
constexpr int64_t kDims[] = {64, 128, 256};
constexpr int64_t kBatches[] = {1, 3, 17};
constexpr DType kTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

struct SweepCase {
  AttnShape shape;
  DType dtype;
  std::vector<int64_t> len;
  std::string name;
};

// Cycles the other parameters against each length so every value meets many lengths, and
// caps the oracle's work so the sweep stays fast.
std::vector<SweepCase> sweep_cases() {
  std::vector<SweepCase> cases;
  int k = 0;
  for (int64_t L : kLengths)
    for (DType t : kTypes)
      for (int64_t Q : {1, 4}) {
        HeadsConfig hc = kHeads[k % 6];
        int64_t D = kDims[(k / 2) % 3];
        int64_t B = kBatches[(k / 3) % 3];
        ++k;
        while (B * hc.heads * std::max<int64_t>(L, 1) * D * Q > 100'000'000 && B > 1) B = B > 3 ? 3 : 1;
        while (hc.heads * std::max<int64_t>(L, 1) * D * Q > 100'000'000 && hc.heads > 4) hc = {4, 1};
        SweepCase c;
        c.shape = AttnShape{B, hc.heads, hc.kv_heads, D, Q};
        c.dtype = t;
        for (int64_t b = 0; b < B; ++b) c.len.push_back(std::max<int64_t>(0, L - 13 * b));  // ragged
        c.name = "L" + std::to_string(L) + "_" + std::string(dtype_name(t)) + "_B" +
                 std::to_string(B) + "_H" + std::to_string(hc.heads) + "_Hkv" +
                 std::to_string(hc.kv_heads) + "_D" + std::to_string(D) + "_Q" + std::to_string(Q);
        cases.push_back(std::move(c));
      }
  return cases;
}

void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.name; }

class KernelSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(KernelSweep, EveryTargetMatchesOracle) {
  const SweepCase& c = GetParam();
  Problem p(c.shape, c.dtype, c.len, 1234 + static_cast<uint64_t>(c.len[0]));
  std::vector<double> out(p.rows() * static_cast<std::size_t>(c.shape.head_dim)), lse(p.rows());
  ASSERT_TRUE(oracle_attention(p.shape, p.q.data(), p.whole(), out.data(), lse.data()).is_ok());
  std::vector<float> st(p.rows() * static_cast<std::size_t>(c.shape.head_dim + 2));
  for (Isa isa : testing::runnable_isas()) {
    for (int64_t chunk : {int64_t{0}, int64_t{37}}) {
      DecodeOptions opt;
      opt.isa = isa;
      opt.chunk_tokens = chunk;
      const Status s = decode_partial(p.shape, p.q.data(), p.whole(), st.data(), opt);
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      const Errors e = testing::compare_states(p.shape, st.data(), out.data(), lse.data());
      EXPECT_FALSE(e.nan_mismatch) << isa_name(isa);
      EXPECT_LE(e.out_rel(), 1e-5) << isa_name(isa) << " chunk " << chunk;
      EXPECT_LE(e.lse_abs, 1e-5) << isa_name(isa) << " chunk " << chunk;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Foundation, KernelSweep, ::testing::ValuesIn(sweep_cases()),
                         [](const auto& param_info) { return param_info.param.name; });

// q = 0 makes every logit 0, so every weight is exp(0) = 1 exactly, l counts tokens and o sums
// small integers exactly. With a power-of-two length the output is mean(V) bit for bit, for
// every chunking, thread count and target.
TEST(KernelExact, ZeroQueryGivesMeanOfValuesBitForBit) {
  for (DType t : kTypes) {
    for (int64_t D : kDims) {
      AttnShape shape{2, 8, 2, D, 1};
      const int64_t N = 1024;
      KVCache cache(shape, t, N);
      std::vector<float> k(static_cast<std::size_t>(D)), v(k.size());
      std::vector<double> sum(static_cast<std::size_t>(2 * 2 * D), 0.0);
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t tok = 0; tok < N; ++tok) {
            for (int64_t d = 0; d < D; ++d) {
              k[static_cast<std::size_t>(d)] = static_cast<float>((tok * 7 + d) % 11) - 5.0f;
              v[static_cast<std::size_t>(d)] = static_cast<float>((tok * 3 + d * 5 + b + h) % 17) - 8.0f;
              sum[static_cast<std::size_t>((b * 2 + h) * D + d)] += v[static_cast<std::size_t>(d)];
            }
            cache.set_token(b, h, tok, k.data(), v.data());
          }
      std::vector<int64_t> len{N, N}, start{0, 0}, total{N, N};
      std::vector<float> q(static_cast<std::size_t>(2 * 8 * D), 0.0f);
      std::vector<float> st(static_cast<std::size_t>(2 * 8 * (D + 2))), out(static_cast<std::size_t>(D));
      for (Isa isa : testing::runnable_isas())
        for (int64_t chunk : {1, 3, 64, 100, 1024, 4096})
          for (int threads : {1, 2}) {
            DecodeOptions opt;
            opt.isa = isa;
            opt.chunk_tokens = chunk;
            opt.threads = threads;
            ASSERT_TRUE(decode_partial(shape, q.data(), cache.view(0, len, start, total, 1), st.data(), opt).is_ok());
            for (int64_t b = 0; b < 2; ++b)
              for (int64_t h = 0; h < 8; ++h) {
                float lse = 0;
                state_normalize(st.data() + static_cast<std::size_t>(b * 8 + h) * static_cast<std::size_t>(D + 2),
                                static_cast<std::size_t>(D), out.data(), &lse);
                for (int64_t d = 0; d < D; ++d) {
                  const float mean = static_cast<float>(sum[static_cast<std::size_t>((b * 2 + h / 4) * D + d)] / N);
                  ASSERT_EQ(out[static_cast<std::size_t>(d)], mean)
                      << isa_name(isa) << " chunk " << chunk << " threads " << threads << " " << dtype_name(t);
                }
                ASSERT_EQ(lse, std::log(1024.0f));
              }
          }
    }
  }
}

// Views that start mid-cache with odd token strides, lengths around vector widths, and
// NaN-poisoned memory right after the view: a kernel that reads past the end turns NaN.
TEST(KernelViews, TailsMisalignedStartsAndPoisonedPadding) {
  for (DType t : kTypes) {
    const int64_t D = 64, stride = D + 5, offset = 3;
    for (int64_t n : {1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129}) {
      AttnShape shape{1, 4, 1, D, 1};
      const std::size_t elems = static_cast<std::size_t>(offset + n * stride + 64);
      std::vector<uint8_t> kb(elems * dtype_size(t)), vb(kb.size());
      std::mt19937_64 rng(static_cast<uint64_t>(n));
      std::uniform_real_distribution<float> u(-1, 1);
      for (std::size_t i = 0; i < elems; ++i) {  // poison everything, then fill the view
        store_from_float(kb.data(), t, i, std::numeric_limits<float>::quiet_NaN());
        store_from_float(vb.data(), t, i, std::numeric_limits<float>::quiet_NaN());
      }
      for (int64_t tok = 0; tok < n; ++tok)
        for (int64_t d = 0; d < D; ++d) {
          const auto i = static_cast<std::size_t>(offset + tok * stride + d);
          store_from_float(kb.data(), t, i, u(rng));
          store_from_float(vb.data(), t, i, u(rng));
        }
      std::vector<int64_t> len{n}, start{0}, total{n};
      KVShard kv;
      kv.dtype = t;
      kv.k = kb.data() + static_cast<std::size_t>(offset) * dtype_size(t);
      kv.v = vb.data() + static_cast<std::size_t>(offset) * dtype_size(t);
      kv.stride_token = stride;
      kv.stride_head = n * stride;
      kv.stride_batch = n * stride;
      kv.len = len; kv.pos_start = start; kv.total_len = total;
      std::vector<float> q(static_cast<std::size_t>(4 * D));
      for (auto& x : q) x = u(rng);
      std::vector<double> out(static_cast<std::size_t>(4 * D)), lse(4);
      ASSERT_TRUE(oracle_attention(shape, q.data(), kv, out.data(), lse.data()).is_ok());
      std::vector<float> st(static_cast<std::size_t>(4 * (D + 2)));
      for (Isa isa : testing::runnable_isas())
        for (int64_t chunk : {int64_t{0}, int64_t{5}}) {
          DecodeOptions opt;
          opt.isa = isa;
          opt.chunk_tokens = chunk;
          ASSERT_TRUE(decode_partial(shape, q.data(), kv, st.data(), opt).is_ok());
          const Errors e = testing::compare_states(shape, st.data(), out.data(), lse.data());
          EXPECT_FALSE(e.nan_mismatch) << isa_name(isa) << " n=" << n << " " << dtype_name(t);
          EXPECT_LE(e.out_rel(), 1e-5) << isa_name(isa) << " n=" << n;
        }
    }
  }
}

// Striped placement (token j at global position r + j*p) with Q = 4: the causal limit uses
// global positions, so the shard must match the oracle on the same view.
TEST(KernelViews, StripedPositionsWithMultiTokenQuery) {
  AttnShape shape{3, 8, 2, 128, 4};
  for (int64_t p : {2, 3, 5}) {
    for (int64_t r = 0; r < p; ++r) {
      const int64_t N = 301;
      std::vector<int64_t> total{N, N - 50, 3};
      std::vector<int64_t> len, start;
      for (int64_t b = 0; b < 3; ++b) {
        len.push_back(total[static_cast<std::size_t>(b)] > r ? (total[static_cast<std::size_t>(b)] - r + p - 1) / p : 0);
        start.push_back(r);
      }
      Problem prob(shape, DType::kBF16, {N, N, N}, static_cast<uint64_t>(p * 10 + r));
      const KVShard kv = prob.cache.view(0, len, start, total, p);
      std::vector<double> out(prob.rows() * 128), lse(prob.rows());
      ASSERT_TRUE(oracle_attention(shape, prob.q.data(), kv, out.data(), lse.data()).is_ok());
      std::vector<float> st(prob.rows() * 130);
      for (Isa isa : testing::runnable_isas()) {
        DecodeOptions opt;
        opt.isa = isa;
        ASSERT_TRUE(decode_partial(shape, prob.q.data(), kv, st.data(), opt).is_ok());
        const Errors e = testing::compare_states(shape, st.data(), out.data(), lse.data());
        EXPECT_FALSE(e.nan_mismatch);
        EXPECT_LE(e.out_rel(), 1e-5) << isa_name(isa) << " p=" << p << " r=" << r;
        EXPECT_LE(e.lse_abs, 1e-5);
      }
    }
  }
}

// Raw logits of -524288 (and large positive ones) are ordinary numbers, not sentinels.
TEST(KernelNumerics, ExtremeLogits) {
  for (float target : {-524288.0f, 60000.0f}) {
    AttnShape shape{1, 1, 1, 64, 1};
    KVCache cache(shape, DType::kF32, 4);
    std::vector<float> k(64, 0.0f), v(64, 0.0f);
    for (int t = 0; t < 4; ++t) {
      k[0] = target;
      v[0] = static_cast<float>(t);
      cache.set_token(0, 0, t, k.data(), v.data());
    }
    std::vector<float> q(64, 0.0f);
    q[0] = 1.0f;
    std::vector<int64_t> len{4}, start{0}, total{4};
    std::vector<float> st(66), out(64);
    for (Isa isa : testing::runnable_isas()) {
      DecodeOptions opt;
      opt.isa = isa;
      opt.scale = 1.0f;
      ASSERT_TRUE(decode_partial(shape, q.data(), cache.view(0, len, start, total, 1), st.data(), opt).is_ok());
      float lse = 0;
      state_normalize(st.data(), 64, out.data(), &lse);
      EXPECT_EQ(out[0], 1.5f) << isa_name(isa) << " logit " << target;
      EXPECT_FLOAT_EQ(lse, target + std::log(4.0f)) << isa_name(isa);
    }
  }
}

TEST(KernelNumerics, NaNInKeysOrValuesPropagates) {
  for (int which = 0; which < 2; ++which) {
    Problem p(AttnShape{1, 4, 2, 64, 1}, DType::kF32, {300}, 77);
    std::vector<float> k(64, 0.1f), v(64, 0.2f);
    (which == 0 ? k : v)[9] = std::numeric_limits<float>::quiet_NaN();
    p.cache.set_token(0, 1, 123, k.data(), v.data());  // KV head 1 serves heads 2 and 3
    std::vector<float> st(4 * 66), out(64);
    for (Isa isa : testing::runnable_isas()) {
      DecodeOptions opt;
      opt.isa = isa;
      ASSERT_TRUE(decode_partial(p.shape, p.q.data(), p.whole(), st.data(), opt).is_ok());
      for (int h = 0; h < 4; ++h) {
        float lse = 0;
        state_normalize(st.data() + h * 66, 64, out.data(), &lse);
        const bool nan = std::isnan(out[9]) || std::isnan(lse);
        EXPECT_EQ(nan, h >= 2) << isa_name(isa) << " head " << h << (which ? " V" : " K");
      }
    }
  }
}

TEST(KernelDeterminism, SameBitsForAnyThreadCount) {
  Problem p(AttnShape{2, 32, 8, 128, 1}, DType::kBF16, {5000, 4097}, 9);
  std::vector<float> a(p.rows() * 130), b(a.size());
  for (Isa isa : testing::runnable_isas()) {
    DecodeOptions o1;
    o1.isa = isa;
    o1.threads = 1;
    DecodeOptions o2 = o1;
    o2.threads = 2;
    ASSERT_TRUE(decode_partial(p.shape, p.q.data(), p.whole(), a.data(), o1).is_ok());
    ASSERT_TRUE(decode_partial(p.shape, p.q.data(), p.whole(), b.data(), o2).is_ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << isa_name(isa);
  }
}

TEST(KernelErrors, UnknownIsaNameAndUnsupportedTarget) {
  EXPECT_FALSE(parse_isa("sse9").is_ok());
  EXPECT_TRUE(parse_isa("avx512").is_ok());
  EXPECT_NE(best_isa(), Isa::kAuto);
}

}  // namespace
}  // namespace treeattn
