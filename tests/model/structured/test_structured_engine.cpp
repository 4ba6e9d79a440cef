// Structured output through the serving engine, on the real SmolLM2-135M-Instruct with threads
// as ranks: constrained outputs (greedy and seeded temperature 1) are JSON of the schema's
// shape ending with kStop, and each request's tokens are the same alone and in a batch whose
// pages run out (preempted requests resume with their matcher state), at 1 and 2 ranks.
// Skipped without the model file.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "model/model_path.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/engine.hpp"

namespace treeattn::engine {
namespace {

using json = nlohmann::ordered_json;

struct Case {
  const char* question;
  const char* schema;
  double temperature;
};

const Case kCases[] = {
    {"Describe a cat named Tom who is 3 years old.",
     R"({"type":"object","properties":{"name":{"type":"string","maxLength":20},
        "age":{"type":"integer"},"indoor":{"type":"boolean"}},
        "required":["name","age","indoor"],"additionalProperties":false})",
     0.0},
    {"List three colours.",
     R"({"type":"object","properties":{"colours":{"type":"array","minItems":1,"maxItems":3,
        "items":{"enum":["red","green","blue","yellow"]}}},"required":["colours"]})",
     0.0},
    {"Give me a point on the plane.",
     R"({"type":"object","properties":{"x":{"type":"number"},"y":{"type":"number"},
        "label":{"anyOf":[{"type":"string","maxLength":10},{"type":"null"}]}},
        "required":["x","y","label"]})",
     1.0},
};

std::string response_format(const char* schema) {
  return json{{"type", "json_schema"},
              {"json_schema", {{"name", "t"}, {"schema", json::parse(schema)}, {"strict", false}}}}
      .dump();
}

struct Outcome {
  std::vector<TokenId> tokens;
  FinishReason finish = FinishReason::kNone;
};

struct RunResult {
  std::vector<Outcome> out;
  int64_t preemptions = 0;
  Status status;
};

// The requests through one engine over p in-process ranks, every rank in Engine::run(), rank
// 0's requests submitted from another thread as a server's HTTP threads do: one at a time
// (alone: each when the previous one has finished) or all at once.
RunResult run(const model::LlamaModel& m, int p, const EngineConfig& cfg,
              const std::vector<Request>& reqs, bool alone) {
  RunResult res;
  res.out.resize(reqs.size());
  std::mutex mu;
  std::condition_variable changed;
  std::size_t finished = 0;
  res.status = run_local(p, [&](Communicator& comm) -> Status {
    auto e = Engine::create(comm, m, cfg);
    TREEATTN_RETURN_IF_ERROR(e.status());
    if (comm.rank() != 0) return (*e)->run();
    Status submitted;
    std::thread client([&] {
      for (std::size_t i = 0; i < reqs.size() && submitted.is_ok(); ++i) {
        auto id = (*e)->submit(reqs[i], [&, i](const TokenEvent& ev) {
          std::lock_guard lk(mu);
          if (ev.token >= 0) res.out[i].tokens.push_back(ev.token);
          if (ev.finish == FinishReason::kNone) return;
          res.out[i].finish = ev.finish;
          ++finished;
          changed.notify_all();
        });
        submitted = id.status();
        std::unique_lock lk(mu);
        if (alone) changed.wait(lk, [&] { return finished == i + 1 || !submitted.is_ok(); });
      }
      (*e)->stop(true);  // drains what was submitted
    });
    const Status ran = (*e)->run();
    client.join();
    res.preemptions = (*e)->metrics().preemptions_total;
    TREEATTN_RETURN_IF_ERROR(submitted);
    return ran;
  });
  return res;
}

TEST(StructuredEngine, OutputsParseAndAreTheSameAloneAndInAPreemptedBatch) {
  TREEATTN_REQUIRE_REAL_MODEL(path);
  auto m = model::LlamaModel::load(path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto tok = Tokenizer::from_gguf((*m)->file());
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  std::vector<Request> reqs;
  for (const Case& c : kCases) {
    const ChatTurn turn{"user", c.question};
    auto prompt = tok->encode_chat(std::span(&turn, 1));
    ASSERT_TRUE(prompt.is_ok()) << prompt.status().to_string();
    Request r;
    r.prompt = *prompt;
    r.max_new_tokens = 64;
    r.sampling.temperature = c.temperature;
    r.sampling.seed = 7;
    r.response_format = response_format(c.schema);
    reqs.push_back(std::move(r));
  }
  for (const int p : {1, 2}) {
    EngineConfig cfg;
    cfg.page_tokens = 16;
    cfg.threads = 1;
    cfg.matmul = model::MatmulMode::kExact;
    cfg.timeout = std::chrono::milliseconds(120000);
    cfg.idle_tick = std::chrono::milliseconds(1);
    cfg.kv_pages = 24 / p;
    const RunResult alone = run(**m, p, cfg, reqs, true);
    ASSERT_TRUE(alone.status.is_ok()) << alone.status.to_string();
    EngineConfig tight = cfg;
    tight.kv_pages = 8 / p;  // three prompts of ~40 tokens and their answers (~25) do not fit
    const RunResult batch = run(**m, p, tight, reqs, false);
    ASSERT_TRUE(batch.status.is_ok()) << batch.status.to_string();
    EXPECT_GE(batch.preemptions, 1) << "p " << p;
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      const Outcome& o = alone.out[i];
      EXPECT_EQ(o.finish, FinishReason::kStop) << "p " << p << " request " << i;
      ASSERT_FALSE(o.tokens.empty());
      auto text = tok->decode(std::span(o.tokens).first(o.tokens.size() - 1));
      ASSERT_TRUE(text.is_ok());
      SCOPED_TRACE("p " + std::to_string(p) + " request " + std::to_string(i) + ": " + *text);
      ASSERT_TRUE(json::accept(*text));
      std::printf("p %d request %zu (%zu prompt tokens, %zu generated): %s\n", p, i,
                  reqs[i].prompt.size(), o.tokens.size(), text->c_str());
      const json v = json::parse(*text);
      const json schema = json::parse(kCases[i].schema);
      for (const auto& name : schema["required"]) EXPECT_TRUE(v.contains(name.get<std::string>()));
      EXPECT_EQ(batch.out[i].tokens, o.tokens);
      EXPECT_EQ(batch.out[i].finish, o.finish);
    }
  }
}

}  // namespace
}  // namespace treeattn::engine
