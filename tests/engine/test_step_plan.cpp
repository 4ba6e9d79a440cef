// The engine's step description (src/engine/step_plan.hpp): encode and decode round trip every
// field and kind bit for bit, and malformed words (truncated, trailing, unknown kinds, counts
// and lengths out of range, random corruption) are refused with a clear error, never a crash.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "engine/step_plan.hpp"

namespace treeattn::engine {
namespace {

Plan sample_plan() {
  Plan pl;
  pl.kind = StepKind::kRun;
  pl.waiting_after = 3;
  pl.cancels = {7, 9};
  pl.preempts = {5};
  pl.resumes = {3, 2, 6};
  Plan::Admit a;
  a.id = 11;
  a.req.prompt = {1, 2, 3, 4, 5};
  a.req.max_new_tokens = 17;
  a.req.sampling.temperature = 0.7;
  a.req.sampling.top_k = 40;
  a.req.sampling.top_p = 0.95;
  a.req.sampling.seed = 0xfedcba9876543210ull;
  a.req.sampling.min_p = 0.05;
  a.req.sampling.presence_penalty = -1.5;
  a.req.sampling.frequency_penalty = 0.25;
  a.req.sampling.repetition_penalty = 1.3;
  a.req.sampling.logit_bias = {{3, -100.0}, {17, 0.125}, {300, 7.5}};
  a.req.stop_tokens = {2, 42};
  a.req.return_logits = true;
  a.req.logprobs = 20;
  a.req.response_format = R"({"type":"json_schema","json_schema":{"name":"x"}})";
  pl.admits.push_back(a);
  Plan::Admit b;
  b.id = 12;
  b.req.prompt = {8};
  pl.admits.push_back(b);
  pl.work = {{11, 5}, {4, 1}, {12, 1}};
  return pl;
}

void expect_same(const Plan& a, const Plan& b) {
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.waiting_after, b.waiting_after);
  EXPECT_EQ(a.cancels, b.cancels);
  EXPECT_EQ(a.preempts, b.preempts);
  EXPECT_EQ(a.resumes, b.resumes);
  ASSERT_EQ(a.admits.size(), b.admits.size());
  for (std::size_t i = 0; i < a.admits.size(); ++i) {
    const Request &x = a.admits[i].req, &y = b.admits[i].req;
    EXPECT_EQ(a.admits[i].id, b.admits[i].id);
    EXPECT_EQ(x.prompt, y.prompt);
    EXPECT_EQ(x.max_new_tokens, y.max_new_tokens);
    EXPECT_EQ(std::bit_cast<uint64_t>(x.sampling.temperature),
              std::bit_cast<uint64_t>(y.sampling.temperature));
    EXPECT_EQ(x.sampling.top_k, y.sampling.top_k);
    EXPECT_EQ(std::bit_cast<uint64_t>(x.sampling.top_p), std::bit_cast<uint64_t>(y.sampling.top_p));
    EXPECT_EQ(x.sampling.seed, y.sampling.seed);
    for (const auto field :
         {&model::SamplingParams::min_p, &model::SamplingParams::presence_penalty,
          &model::SamplingParams::frequency_penalty, &model::SamplingParams::repetition_penalty})
      EXPECT_EQ(std::bit_cast<uint64_t>(x.sampling.*field),
                std::bit_cast<uint64_t>(y.sampling.*field));
    ASSERT_EQ(x.sampling.logit_bias.size(), y.sampling.logit_bias.size());
    for (std::size_t j = 0; j < x.sampling.logit_bias.size(); ++j) {
      EXPECT_EQ(x.sampling.logit_bias[j].first, y.sampling.logit_bias[j].first);
      EXPECT_EQ(std::bit_cast<uint64_t>(x.sampling.logit_bias[j].second),
                std::bit_cast<uint64_t>(y.sampling.logit_bias[j].second));
    }
    EXPECT_EQ(x.stop_tokens, y.stop_tokens);
    EXPECT_EQ(x.return_logits, y.return_logits);
    EXPECT_EQ(x.logprobs, y.logprobs);
    EXPECT_EQ(x.response_format, y.response_format);
  }
  EXPECT_EQ(a.work, b.work);
}

TEST(StepPlan, RoundTripsEveryField) {
  const Plan pl = sample_plan();
  const std::vector<int64_t> w = encode_plan(pl);
  auto back = decode_plan(w);
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  expect_same(pl, *back);
  EXPECT_EQ(encode_plan(*back), w);
}

TEST(StepPlan, RoundTripsEveryKindAndTheEmptyPlan) {
  for (StepKind k : {StepKind::kRun, StepKind::kStop, StepKind::kFail}) {
    Plan pl;
    pl.kind = k;
    const auto w = encode_plan(pl);
    EXPECT_EQ(w.size(), kPlanHeaderWords);
    auto back = decode_plan(w);
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    expect_same(pl, *back);
  }
}

TEST(StepPlan, RoundTripsOddDoubles) {
  Plan pl = sample_plan();
  pl.admits[0].req.sampling.temperature = -0.0;
  pl.admits[0].req.sampling.top_p = std::numeric_limits<double>::quiet_NaN();
  pl.admits[0].req.sampling.repetition_penalty = -std::numeric_limits<double>::infinity();
  pl.admits[0].req.sampling.logit_bias[1].second = std::numeric_limits<double>::denorm_min();
  auto back = decode_plan(encode_plan(pl));
  ASSERT_TRUE(back.is_ok());
  expect_same(pl, *back);
  EXPECT_TRUE(std::isnan(back->admits[0].req.sampling.top_p));
}

void expect_refused(const std::vector<int64_t>& w, const std::string& why) {
  auto r = decode_plan(w);
  ASSERT_FALSE(r.is_ok()) << "accepted: " << why;
  EXPECT_EQ(r.status().code(), Code::kInternal);
  EXPECT_NE(r.status().message().find("malformed step description from rank 0 (word "),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
}

TEST(StepPlan, RefusesEveryTruncation) {
  const auto w = encode_plan(sample_plan());
  for (std::size_t n = 0; n < w.size(); ++n) {
    auto r = decode_plan(std::span<const int64_t>(w.data(), n));
    EXPECT_FALSE(r.is_ok()) << "a prefix of " << n << " words was accepted";
    if (!r.is_ok()) {
      EXPECT_NE(r.status().message().find("malformed"), std::string::npos);
    }
  }
}

TEST(StepPlan, RefusesTrailingWords) {
  auto w = encode_plan(sample_plan());
  w.push_back(0);
  expect_refused(w, "1 words past the description");
}

TEST(StepPlan, RefusesUnknownKinds) {
  for (int64_t kind : {int64_t{0}, int64_t{4}, int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
    auto w = encode_plan(Plan{});
    w[0] = kind;
    expect_refused(w, "unknown step kind " + std::to_string(kind));
  }
}

TEST(StepPlan, RefusesCountsOutOfRange) {
  const int64_t huge = std::numeric_limits<int64_t>::max();
  for (std::size_t at = 2; at < kPlanHeaderWords; ++at)
    for (int64_t bad : {int64_t{-1}, huge, int64_t{1} << 40, std::numeric_limits<int64_t>::min()}) {
      auto w = encode_plan(sample_plan());
      w[at] = bad;
      expect_refused(w, "count is missing or out of range");
    }
  // A count that the words could hold only if a work item were one word.
  Plan pl;
  pl.work = {{1, 1}};
  auto w = encode_plan(pl);
  w[6] = 2;
  expect_refused(w, "work count");
}

TEST(StepPlan, RefusesAdmissionLengthsOutOfRange) {
  // The first admission's words start after the header, the two cancels, the preemption and
  // the three resumptions; its prompt, stop token and logit_bias counts are its words 1, 13
  // and 14.
  const std::size_t first = kPlanHeaderWords + 2 + 1 + 3;
  const std::size_t np_at = first + 1, ns_at = first + 13, nb_at = first + 14;
  const int64_t huge = std::numeric_limits<int64_t>::max();
  for (std::size_t at : {np_at, ns_at, nb_at})
    for (int64_t bad : {int64_t{-1}, huge, int64_t{1000}, std::numeric_limits<int64_t>::min()}) {
      auto w = encode_plan(sample_plan());
      w[at] = bad;
      expect_refused(w, "exceed the words left");
    }
  for (const auto& [a, b] : {std::pair{np_at, ns_at}, std::pair{ns_at, nb_at}}) {
    auto w = encode_plan(sample_plan());
    w[a] = huge;
    w[b] = huge;  // their sum overflows int64
    expect_refused(w, "exceed the words left");
  }
  // One bias entry more than the words after the admission's prompt and stop tokens hold.
  auto w = encode_plan(sample_plan());
  const auto left = static_cast<int64_t>(w.size() - (first + 15)) - w[np_at] - w[ns_at];
  w[nb_at] = left / 2 + 1;
  expect_refused(w, "exceed the words left");
}

TEST(StepPlan, SurvivesRandomCorruption) {
  const auto good = encode_plan(sample_plan());
  std::mt19937_64 rng(12345);
  int refused = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    auto w = good;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % w.size();
      switch (rng() % 4) {
        case 0:
          w[at] = static_cast<int64_t>(rng());
          break;
        case 1:
          w[at] += static_cast<int64_t>(rng() % 5) - 2;
          break;
        case 2:
          w.resize(at);
          break;
        default:
          w.insert(w.begin() + static_cast<std::ptrdiff_t>(at), static_cast<int64_t>(rng() % 7));
          break;
      }
      if (w.empty()) break;
    }
    auto r = decode_plan(w);
    if (!r.is_ok()) {
      ++refused;
      EXPECT_NE(r.status().message().find("malformed"), std::string::npos);
    } else {
      // Whatever is accepted has the same shape as the words and round trips from then on.
      const auto again = encode_plan(*r);
      EXPECT_EQ(again.size(), w.size());
      auto back = decode_plan(again);
      ASSERT_TRUE(back.is_ok());
      EXPECT_EQ(encode_plan(*back), again);
    }
  }
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace treeattn::engine
