// The engine's scheduler (src/engine/scheduler.hpp) with neither a model nor a communicator:
// hand-made KV pools (kv_manager.hpp) and a stand-in for the forward pass that stores positions
// and appends a token. First come first served admission that waits for pages rather than being
// overtaken, pages on demand with preemption of the most recently admitted sequence and its
// resumption ahead of every waiting request, max_batch, prefill chunking in admission order,
// waiting for a shared prefix still in flight, cancels (of preempted sequences too), stops, the
// queue limit, failure, and a second rank's replica applying the broadcast plans into the same
// state.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "engine/scheduler.hpp"

namespace treeattn::engine {
namespace {

std::vector<TokenId> tokens(int64_t n, TokenId first = 0) {
  std::vector<TokenId> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

Request request(std::vector<TokenId> prompt, int64_t max_new = 4) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  return r;
}

SchedulerConfig config(int max_batch = 4, int64_t chunk = 32, int max_queue = 8) {
  return SchedulerConfig{max_batch, chunk, max_queue, std::chrono::milliseconds(1), "rank 0: "};
}

// The events each request got.
struct Events {
  std::map<RequestId, std::vector<FinishReason>> by_id;
  TokenCallback callback() {
    return [this](const TokenEvent& ev) { by_id[ev.id].push_back(ev.finish); };
  }
};

// What a step's forward pass does to the replicated state, without a model: stores the work's
// positions (pages allocated, full pages indexed), appends token 7 to sequences that computed
// all their tokens, and retires those that reached max_new_tokens.
void run_work(Scheduler& s, KVManager& kv, const std::vector<WorkItem>& work) {
  std::vector<RequestId> done;
  for (const auto& [id, n] : work) {
    Sequence* q = s.find(id);
    ASSERT_NE(q, nullptr);
    ASSERT_TRUE(kv.allocate(*q, n, 0, nullptr).is_ok());
    q->computed += n;
    kv.index_full_pages(*q);
    if (q->computed == static_cast<int64_t>(q->tokens.size())) {
      q->tokens.push_back(7);
      if (++q->generated >= q->req.max_new_tokens) done.push_back(id);
    }
  }
  for (RequestId id : done) s.retire(id);
}

// One step: plan on rank 0, apply on the replica, check both can run it, run it on both.
struct Ranks {
  KVManager kv0, kv1;
  Scheduler s0, s1;
  explicit Ranks(SchedulerConfig c, int ranks = 2, int64_t pages = 8, int64_t T = 16)
      : kv0(ranks, pages, T, true), kv1(ranks, pages, T, true), s0(c, kv0), s1(c, kv1) {}
  Plan step() {
    auto pl = s0.make_plan();
    EXPECT_TRUE(pl.is_ok()) << pl.status().message();
    auto sent = decode_plan(encode_plan(*pl));
    EXPECT_TRUE(sent.is_ok());
    EXPECT_TRUE(s1.apply_plan(*sent).is_ok());
    EXPECT_TRUE(s0.check_work(pl->work).is_ok());
    EXPECT_TRUE(s1.check_work(sent->work).is_ok());
    run_work(s0, kv0, pl->work);
    run_work(s1, kv1, sent->work);
    return *pl;
  }
  void expect_same() {
    ASSERT_EQ(s0.preempted().size(), s1.preempted().size());
    for (std::size_t i = 0; i < s0.preempted().size(); ++i) {
      EXPECT_EQ(s0.preempted()[i]->id, s1.preempted()[i]->id);
      EXPECT_EQ(s0.preempted()[i]->tokens, s1.preempted()[i]->tokens);
    }
    ASSERT_EQ(s0.running().size(), s1.running().size());
    for (std::size_t i = 0; i < s0.running().size(); ++i) {
      EXPECT_EQ(s0.running()[i]->id, s1.running()[i]->id);
      EXPECT_EQ(s0.running()[i]->pages, s1.running()[i]->pages);
      EXPECT_EQ(s0.running()[i]->computed, s1.running()[i]->computed);
    }
    for (int r = 0; r < kv0.ranks(); ++r) {
      EXPECT_EQ(kv0.table().free_pages(r), kv1.table().free_pages(r));
      EXPECT_EQ(kv0.table().reserved(r), kv1.table().reserved(r));
      EXPECT_EQ(kv0.table().cached_pages(r), kv1.table().cached_pages(r));
    }
    EXPECT_TRUE(kv0.table().check().is_ok());
    EXPECT_TRUE(kv1.table().check().is_ok());
  }
};

std::vector<RequestId> admitted_ids(const Plan& pl) {
  std::vector<RequestId> ids;
  for (const auto& a : pl.admits) ids.push_back(a.id);
  return ids;
}

TEST(Scheduler, ChunksPrefillInAdmissionOrderAndDecodesOneTokenEach) {
  Ranks r(config(4, 32));
  Events ev;
  ASSERT_TRUE(r.s0.submit(request(tokens(40)), ev.callback()).is_ok());
  ASSERT_TRUE(r.s0.submit(request(tokens(10, 100)), ev.callback()).is_ok());
  Plan a = r.step();
  EXPECT_EQ(admitted_ids(a), (std::vector<RequestId>{1, 2}));
  EXPECT_EQ(a.work, (std::vector<WorkItem>{{1, 32}}));  // the chunk's budget goes to the first
  Plan b = r.step();
  EXPECT_EQ(b.work, (std::vector<WorkItem>{{1, 8}, {2, 10}}));
  Plan c = r.step();
  EXPECT_EQ(c.work, (std::vector<WorkItem>{{1, 1}, {2, 1}}));
  EXPECT_EQ(c.kind, StepKind::kRun);
  r.expect_same();
}

TEST(Scheduler, FirstComeFirstServedWaitsForPagesWithoutOvertaking) {
  // 1 rank of 4 pages of 16 tokens.
  Ranks r(config(4, 256), 1, 4);
  Events ev;
  ASSERT_TRUE(r.s0.submit(request(tokens(40), 9), ev.callback()).is_ok());      // 3 pages
  ASSERT_TRUE(r.s0.submit(request(tokens(20, 50), 1), ev.callback()).is_ok());  // 2 pages
  ASSERT_TRUE(r.s0.submit(request(tokens(5, 90), 1), ev.callback()).is_ok());   // 1 page
  Plan a = r.step();
  EXPECT_EQ(admitted_ids(a), (std::vector<RequestId>{1}));  // 3 waits behind 2
  EXPECT_EQ(a.waiting_after, 2);
  EXPECT_EQ(r.s0.waiting(), 2);
  std::vector<RequestId> order = admitted_ids(a);
  for (int i = 0; i < 12; ++i) {
    const bool one_runs = r.s0.find(1) != nullptr;
    const Plan b = r.step();
    for (RequestId id : admitted_ids(b)) order.push_back(id);
    if (one_runs) {
      EXPECT_TRUE(admitted_ids(b).empty());  // 3 would fit but must not overtake 2
    }
  }
  EXPECT_EQ(order, (std::vector<RequestId>{1, 2, 3}));
  r.expect_same();
}

// 1 rank of 4 pages of 16 tokens. A (30-token prompt) and B (20) take 2 pages each; when A's
// position 32 needs a third page, B (admitted last) is preempted: its full page stays cached,
// its tokens kept. C, arriving meanwhile, does not overtake B, which resumes when A finishes,
// recomputing its tokens, and ends with every token it was due.
TEST(Scheduler, PagesOnDemandPreemptTheLastAdmittedWhichResumesFirst) {
  Ranks r(config(4, 256), 1, 4);
  Events ev;
  ASSERT_TRUE(r.s0.submit(request(tokens(30), 30), ev.callback()).is_ok());      // A = 1
  ASSERT_TRUE(r.s0.submit(request(tokens(20, 100), 40), ev.callback()).is_ok());  // B = 2
  Plan a = r.step();
  EXPECT_EQ(admitted_ids(a), (std::vector<RequestId>{1, 2}));
  EXPECT_EQ(r.kv0.table().available(0), 0);  // admission took the prompts' pages only
  Plan b = r.step();  // A at position 30, B at 20: both on pages they hold
  EXPECT_TRUE(b.preempts.empty());
  Plan c = r.step();  // A at 31
  EXPECT_TRUE(c.preempts.empty());
  const std::vector<TokenId> b_tokens = r.s0.find(2)->tokens;
  const int64_t b_generated = r.s0.find(2)->generated;
  Plan d = r.step();  // A at 32: a third page, only by preempting B
  EXPECT_EQ(d.preempts, (std::vector<RequestId>{2}));
  EXPECT_TRUE(d.resumes.empty());
  EXPECT_EQ(d.work, (std::vector<WorkItem>{{1, 1}}));
  ASSERT_EQ(r.s0.preempted().size(), 1u);
  EXPECT_EQ(r.s0.preempted()[0]->tokens, b_tokens);
  EXPECT_EQ(r.s0.preempted()[0]->computed, 0);
  EXPECT_TRUE(r.s0.preempted()[0]->pages.empty());
  EXPECT_EQ(r.s0.preemptions_total(), 1);
  EXPECT_EQ(d.waiting_after, 1);
  r.expect_same();
  ASSERT_TRUE(r.s0.submit(request(tokens(3, 900), 1), ev.callback()).is_ok());  // C = 3
  std::vector<RequestId> order;
  for (int i = 0; i < 200 && (r.s0.find(2) != nullptr || !r.s0.preempted().empty() ||
                              r.s0.find(1) != nullptr || r.s0.waiting() > 0);
       ++i) {
    const Plan pl = r.step();
    if (!pl.resumes.empty()) {  // B recomputed every token it held and sampled the next one
      const Sequence* b2 = r.s0.find(2);
      ASSERT_NE(b2, nullptr);
      const WorkItem b_all{2, static_cast<int64_t>(b_tokens.size())};  // its page was evicted
      EXPECT_NE(std::find(pl.work.begin(), pl.work.end(), b_all), pl.work.end());
      EXPECT_EQ(b2->generated, b_generated + 1);
      ASSERT_EQ(b2->tokens.size(), b_tokens.size() + 1);
      EXPECT_TRUE(std::equal(b_tokens.begin(), b_tokens.end(), b2->tokens.begin()));
      EXPECT_EQ(b2->cached_tokens, 0);  // of its prompt, as first admitted
    }
    for (RequestId id : pl.resumes) order.push_back(id);
    for (RequestId id : admitted_ids(pl)) order.push_back(id);
    if (!r.s0.preempted().empty()) {
      EXPECT_TRUE(pl.admits.empty());  // C waits behind B
    }
    r.expect_same();
  }
  EXPECT_EQ(order, (std::vector<RequestId>{2, 3}));
  EXPECT_TRUE(ev.by_id.empty());  // every request ran to max_new_tokens: none was cancelled
  EXPECT_EQ(r.kv0.table().used_pages(0), 0);
  EXPECT_EQ(r.kv0.table().reserved(0), 0);
}

TEST(Scheduler, APreemptedRequestCanBeCancelledAndStopNowCancelsIt) {
  for (const bool stop_now : {false, true}) {
    Ranks r(config(4, 256), 1, 4);
    Events ev;
    ASSERT_TRUE(r.s0.submit(request(tokens(30), 30), ev.callback()).is_ok());
    ASSERT_TRUE(r.s0.submit(request(tokens(20, 100), 40), ev.callback()).is_ok());
    for (int i = 0; i < 4; ++i) r.step();
    ASSERT_EQ(r.s0.preempted().size(), 1u);
    if (stop_now)
      r.s0.stop(false);
    else
      r.s0.cancel(2);
    const Plan pl = r.step();
    EXPECT_NE(std::find(pl.cancels.begin(), pl.cancels.end(), 2), pl.cancels.end());
    EXPECT_TRUE(r.s0.preempted().empty());
    EXPECT_EQ(ev.by_id[2].back(), FinishReason::kCancelled);
    r.expect_same();
  }
}

TEST(Scheduler, AReplicaRefusesAPreemptionOrResumptionItCannotApply) {
  KVManager kv(1, 8, 16, true);
  Scheduler s(config(), kv);
  Plan bad_preempt;
  bad_preempt.preempts.push_back(9);
  auto st = s.apply_plan(bad_preempt);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("preempts request 9, which is not running here"), std::string::npos);
  Plan bad_resume;
  bad_resume.resumes.push_back(4);
  st = s.apply_plan(bad_resume);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("resumes request 4, which is not the next preempted one"),
            std::string::npos);
}

TEST(Scheduler, MaxBatchBoundsTheRunningSequences) {
  Ranks r(config(2, 256));
  Events ev;
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(r.s0.submit(request(tokens(4, 10 * i)), ev.callback()).is_ok());
  Plan a = r.step();
  EXPECT_EQ(admitted_ids(a), (std::vector<RequestId>{1, 2}));
  EXPECT_EQ(a.waiting_after, 1);
}

TEST(Scheduler, ASharedPrefixInFlightWaitsAndThenHitsTheCache) {
  Ranks r(config(4, 16));
  Events ev;
  const auto doc = tokens(50);
  ASSERT_TRUE(r.s0.submit(request(doc), ev.callback()).is_ok());
  Plan a = r.step();
  EXPECT_EQ(admitted_ids(a), (std::vector<RequestId>{1}));
  ASSERT_TRUE(r.s0.submit(request(doc), ev.callback()).is_ok());             // shares 3 pages
  ASSERT_TRUE(r.s0.submit(request(tokens(8, 500)), ev.callback()).is_ok());  // goes first
  Plan b = r.step();
  EXPECT_EQ(admitted_ids(b), (std::vector<RequestId>{3}));
  EXPECT_TRUE(prefix_in_flight(r.s0.running(), doc, r.kv0));
  r.step();  // 1 has computed 48 of its 50 prompt tokens
  Plan d = r.step();
  EXPECT_EQ(admitted_ids(d), (std::vector<RequestId>{2}));
  const Sequence* two = r.s0.find(2);
  ASSERT_NE(two, nullptr);
  EXPECT_EQ(two->cached_tokens, 48);
  EXPECT_EQ(r.s1.find(2)->cached_tokens, 48);
  r.expect_same();
}

TEST(Scheduler, CancelsWaitingAndRunningRequests) {
  Ranks r(config(1, 256));
  Events ev;
  ASSERT_TRUE(r.s0.submit(request(tokens(20)), ev.callback()).is_ok());
  ASSERT_TRUE(r.s0.submit(request(tokens(20, 30)), ev.callback()).is_ok());
  r.step();
  r.s0.cancel(2);   // waiting
  r.s0.cancel(1);   // running
  r.s0.cancel(77);  // unknown: ignored
  Plan b = r.step();
  EXPECT_EQ(b.cancels, (std::vector<RequestId>{1}));
  EXPECT_TRUE(r.s0.running().empty());
  EXPECT_EQ(ev.by_id[1], (std::vector<FinishReason>{FinishReason::kCancelled}));
  EXPECT_EQ(ev.by_id[2], (std::vector<FinishReason>{FinishReason::kCancelled}));
  EXPECT_EQ(r.kv0.table().used_pages(0) + r.kv0.table().used_pages(1), 0);
  r.expect_same();
}

TEST(Scheduler, StopNowCancelsEverythingAndStopDrainFinishesFirst) {
  {
    Ranks r(config(1, 256));
    Events ev;
    ASSERT_TRUE(r.s0.submit(request(tokens(5)), ev.callback()).is_ok());
    ASSERT_TRUE(r.s0.submit(request(tokens(5, 9)), ev.callback()).is_ok());
    r.step();
    r.s0.stop(false);
    Plan b = r.step();
    EXPECT_EQ(b.kind, StepKind::kStop);
    EXPECT_EQ(b.cancels, (std::vector<RequestId>{1}));
    EXPECT_EQ(ev.by_id[2], (std::vector<FinishReason>{FinishReason::kCancelled}));
    EXPECT_FALSE(r.s0.submit(request(tokens(3)), {}).is_ok());
  }
  {
    Ranks r(config(4, 256));
    ASSERT_TRUE(r.s0.submit(request(tokens(5), 2), {}).is_ok());
    r.s0.stop(true);
    auto refused = r.s0.submit(request(tokens(3)), {});
    ASSERT_FALSE(refused.is_ok());
    EXPECT_NE(refused.status().message().find("stopping"), std::string::npos);
    EXPECT_EQ(r.step().kind, StepKind::kRun);   // prefill, first token
    EXPECT_EQ(r.step().kind, StepKind::kRun);   // second token: it retires
    EXPECT_EQ(r.step().kind, StepKind::kStop);  // drained
  }
}

TEST(Scheduler, RefusesAFullQueue) {
  Ranks r(config(4, 256, 2));
  ASSERT_TRUE(r.s0.submit(request(tokens(3)), {}).is_ok());
  ASSERT_TRUE(r.s0.submit(request(tokens(3)), {}).is_ok());
  auto third = r.s0.submit(request(tokens(3)), {});
  ASSERT_FALSE(third.is_ok());
  EXPECT_EQ(third.status().code(), Code::kOutOfMemory);
}

TEST(Scheduler, FailAllEndsEverythingWithTheError) {
  Ranks r(config(1, 256));
  Events ev;
  ASSERT_TRUE(r.s0.submit(request(tokens(5)), ev.callback()).is_ok());
  ASSERT_TRUE(r.s0.submit(request(tokens(5)), ev.callback()).is_ok());
  r.step();
  r.s0.fail_all(internal_error("boom"));
  EXPECT_EQ(ev.by_id[1].back(), FinishReason::kError);
  EXPECT_EQ(ev.by_id[2].back(), FinishReason::kError);
  EXPECT_TRUE(r.s0.failed());
  EXPECT_EQ(r.s0.failure().message(), "boom");
  EXPECT_TRUE(r.s0.running().empty());
  auto late = r.s0.submit(request(tokens(3)), {});
  ASSERT_FALSE(late.is_ok());
  EXPECT_NE(late.status().message().find("the engine failed: boom"), std::string::npos);
}

TEST(Scheduler, AReplicaRefusesAnAdmissionThatDoesNotFit) {
  KVManager kv(2, 1, 16, true);  // 32 positions at most
  Scheduler s(config(), kv);
  Plan pl;
  pl.admits.push_back({5, request(tokens(40))});
  auto st = s.apply_plan(pl);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("request 5 admitted by rank 0 does not fit rank 0's pages here"),
            std::string::npos)
      << st.message();
}

TEST(Scheduler, CheckWorkRefusesWhatThisRankCannotRun) {
  KVManager kv(1, 8, 16, true);
  Scheduler s(config(), kv);
  Plan pl;
  pl.admits.push_back({3, request(tokens(10))});
  ASSERT_TRUE(s.apply_plan(pl).is_ok());
  EXPECT_TRUE(s.check_work(std::vector<WorkItem>{{3, 10}}).is_ok());
  for (const WorkItem& bad : {WorkItem{3, 11}, WorkItem{3, 0}, WorkItem{4, 1}}) {
    auto st = s.check_work(std::vector<WorkItem>{bad});
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("which this rank cannot run"), std::string::npos);
  }
}

// choose_work and prefix_in_flight on hand-made sequences.
TEST(Scheduler, ChooseWorkOnHandMadeSequences) {
  Running running;
  auto add = [&](RequestId id, int64_t prompt, int64_t computed, int64_t generated) {
    auto s = std::make_unique<Sequence>();
    s->id = id;
    s->prompt_len = prompt;
    s->tokens = tokens(prompt + generated);
    s->computed = computed;
    running.push_back(std::move(s));
  };
  add(1, 100, 90, 0);  // prefilling: 10 left
  add(2, 5, 5, 1);     // decoding
  add(3, 50, 0, 0);    // prefilling
  add(4, 70, 0, 0);    // prefilling, past the budget
  EXPECT_EQ(choose_work(running, 30), (std::vector<WorkItem>{{1, 10}, {2, 1}, {3, 20}}));
  EXPECT_EQ(choose_work(running, 1), (std::vector<WorkItem>{{1, 1}, {2, 1}}));

  KVManager kv(1, 16, 16, true);
  // Sequence 3 shares 2 full pages with this prompt but has computed none: in flight.
  const auto prompt = tokens(40);
  EXPECT_TRUE(prefix_in_flight(running, prompt, kv));
  running[2]->computed = 32;  // both shared pages computed (and indexed)
  running[3]->computed = 32;
  EXPECT_FALSE(prefix_in_flight(running, prompt, kv));
  KVManager off(1, 16, 16, false);
  running[2]->computed = 0;
  EXPECT_FALSE(prefix_in_flight(running, prompt, off));
}

}  // namespace
}  // namespace treeattn::engine
