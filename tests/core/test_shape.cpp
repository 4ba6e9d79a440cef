// Shape and KV-view validation: every bad input gets a clear error naming the value.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "treeattn/kernel.hpp"
#include "treeattn/shape.hpp"

namespace treeattn {
namespace {

bool contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(Shape, SupportedHeadDimsAccepted) {
  for (int d : {64, 80, 96, 128, 192, 256}) EXPECT_TRUE(AttnShape({1, 4, 2, d, 1}).validate().is_ok()) << d;
}

TEST(Shape, UnsupportedHeadDimNamesValueAndSupportedOnes) {
  for (int64_t d : {59, 1, 100, 512}) {
    const Status s = AttnShape{1, 4, 2, d, 1}.validate();
    EXPECT_EQ(s.code(), Code::kUnsupported);
    EXPECT_TRUE(contains(s, std::to_string(d))) << s.to_string();
    EXPECT_TRUE(contains(s, "64, 80, 96, 128, 192, 256")) << s.to_string();
  }
}

TEST(Shape, BadGroupingAndZeroSizes) {
  Status s = AttnShape{1, 6, 4, 64, 1}.validate();
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s, "multiple of kv_heads")) << s.to_string();
  EXPECT_TRUE(contains(AttnShape{1, 0, 1, 64, 1}.validate(), "heads must be positive"));
  EXPECT_TRUE(contains(AttnShape{1, 4, 0, 64, 1}.validate(), "kv_heads must be positive"));
  EXPECT_TRUE(contains(AttnShape{0, 4, 4, 64, 1}.validate(), "batch must be positive"));
  EXPECT_TRUE(contains(AttnShape{1, 4, 4, 64, 0}.validate(), "q_len must be positive"));
  const int64_t big = std::numeric_limits<int64_t>::max() / 4;
  EXPECT_TRUE(contains(AttnShape{big, 4, 4, 64, 1}.validate(), "overflows"));
}

struct ViewFixture : ::testing::Test {
  AttnShape shape{1, 4, 2, 64, 1};
  std::vector<int64_t> len{8}, start{0}, total{8};
  KVCache cache{shape, DType::kF32, 8};
  KVShard view() { return cache.view(0, len, start, total, 1); }
};

TEST_F(ViewFixture, ValidViewPasses) { EXPECT_TRUE(view().validate(shape).is_ok()); }

TEST_F(ViewFixture, NullDataWithTokensRejected) {
  KVShard v = view();
  v.k = nullptr;
  const Status s = v.validate(shape);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s, "null")) << s.to_string();
  // Null is fine when the shard holds no tokens.
  len[0] = 0;
  KVShard e = view();
  e.k = e.v = nullptr;
  EXPECT_TRUE(e.validate(shape).is_ok());
}

TEST_F(ViewFixture, PositionsOutsideTheContextRejected) {
  total[0] = 7;
  EXPECT_TRUE(contains(view().validate(shape), "do not fit in a context of 7"));
  total[0] = 8;
  start[0] = -1;
  EXPECT_FALSE(view().validate(shape).is_ok());
}

TEST_F(ViewFixture, OverflowingLengthsRejected) {
  len[0] = std::numeric_limits<int64_t>::max() / 2;
  total[0] = len[0];
  const Status s = view().validate(shape);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s, "overflow")) << s.to_string();
}

TEST_F(ViewFixture, SpanSizesMustMatchBatch) {
  AttnShape two = shape;
  two.batch = 2;
  EXPECT_TRUE(contains(view().validate(two), "batch is 2"));
}

TEST_F(ViewFixture, DecodeRejectsBadShapesBeforeTouchingData) {
  std::vector<float> q(4 * 64), st(4 * 66);
  AttnShape bad = shape;
  bad.head_dim = 59;
  const Status s = decode_partial(bad, q.data(), view(), st.data());
  EXPECT_EQ(s.code(), Code::kUnsupported);
  EXPECT_TRUE(contains(s, "59"));
  EXPECT_EQ(decode_partial(shape, nullptr, view(), st.data()).code(), Code::kInvalidArgument);
  DecodeOptions o;
  o.threads = -1;
  EXPECT_TRUE(contains(decode_partial(shape, q.data(), view(), st.data(), o), "threads"));
}

}  // namespace
}  // namespace treeattn
