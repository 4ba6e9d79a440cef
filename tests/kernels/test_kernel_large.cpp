// Large cases (ctest label `large`, not in the default suite): long shards and big batches
// against the float64 oracle, and element offsets beyond 2^31 so that 32-bit indexing anywhere
// in the kernels would show.
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <vector>

#include "support/test_data.hpp"

namespace treeattn {
namespace {

TEST(KernelLarge, LongShardsMatchOracle) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    testing::Problem p(AttnShape{1, 32, 8, 128, 1}, t, {131072}, 11);
    for (Isa isa : testing::runnable_isas()) {
      if (isa == Isa::kReference) continue;  // minutes at this size; covered by the sweep
      DecodeOptions opt;
      opt.isa = isa;
      testing::Errors e;
      ASSERT_TRUE(testing::kernel_vs_oracle(p, opt, &e).is_ok());
      EXPECT_FALSE(e.nan_mismatch);
      EXPECT_LE(e.out_rel(), 1e-5) << isa_name(isa) << " " << dtype_name(t);
    }
  }
}

TEST(KernelLarge, BigBatchMatchesOracle) {
  std::vector<int64_t> lens;
  for (int b = 0; b < 128; ++b) lens.push_back(97 + 31 * b);
  testing::Problem p(AttnShape{128, 8, 2, 64, 1}, DType::kF16, lens, 12);
  for (Isa isa : testing::runnable_isas()) {
    DecodeOptions opt;
    opt.isa = isa;
    testing::Errors e;
    ASSERT_TRUE(testing::kernel_vs_oracle(p, opt, &e).is_ok());
    EXPECT_LE(e.out_rel(), 1e-5) << isa_name(isa);
  }
}

// Batch row 1 starts 2^31 elements after row 0 (stride_batch = 2^31), so any 32-bit index
// arithmetic in a kernel or the oracle reads the wrong memory. The buffers are left
// uninitialized except for the viewed tokens, so the untouched pages cost no memory.
TEST(KernelLarge, OffsetsBeyondTwoToThe31) {
  const int64_t D = 128, tail = 4096;
  const int64_t stride_b = int64_t{1} << 31;
  AttnShape shape{2, 4, 1, D, 1};
  const auto elems = static_cast<std::size_t>(stride_b + tail * D);
  std::unique_ptr<uint16_t[]> k(new uint16_t[elems]), v(new uint16_t[elems]);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < tail * D; ++i) {
      const auto at = static_cast<std::size_t>(b * stride_b + i);
      k[at] = float_to_bf16(u(rng));
      v[at] = float_to_bf16(u(rng));
    }
  std::vector<int64_t> len{tail, tail}, start{0, 0}, total{tail, tail};
  KVShard kv;
  kv.dtype = DType::kBF16;
  kv.k = k.get();
  kv.v = v.get();
  kv.stride_batch = stride_b;
  kv.stride_head = tail * D;
  kv.stride_token = D;
  kv.len = len;
  kv.pos_start = start;
  kv.total_len = total;
  std::vector<float> q(static_cast<std::size_t>(2 * 4 * D));
  for (auto& x : q) x = u(rng);
  std::vector<double> out(q.size()), lse(8);
  ASSERT_TRUE(oracle_attention(shape, q.data(), kv, out.data(), lse.data()).is_ok());
  std::vector<float> st(static_cast<std::size_t>(8 * (D + 2)));
  for (Isa isa : testing::runnable_isas()) {
    DecodeOptions opt;
    opt.isa = isa;
    ASSERT_TRUE(decode_partial(shape, q.data(), kv, st.data(), opt).is_ok());
    const testing::Errors e = testing::compare_states(shape, st.data(), out.data(), lse.data());
    EXPECT_FALSE(e.nan_mismatch) << isa_name(isa);
    EXPECT_LE(e.out_rel(), 1e-5) << isa_name(isa);
  }
}

}  // namespace
}  // namespace treeattn
