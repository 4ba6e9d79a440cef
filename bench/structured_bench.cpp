// The cost of structured output's token mask against a decode step of the same model, in one
// run: treeattn_structured_bench [MODEL.gguf] [SCHEMAS.json]
//
// 1. The engine (one rank, the file's matmul mode as `serve` runs it) answers each schema's
//    prompt (tests/model/structured/data/schemas.json) greedily with the constraint, and again
//    without it for as many tokens: the decode step time is the unconstrained requests' decode
//    seconds over their tokens after the first, batch 1.
// 2. Each constrained answer is replayed through a fresh TokenConstraint: mask() (the trie walk
//    and the logits write) timed before each of its tokens, then accept(). Checked outside the
//    timed region: every token of the answer is one the mask kept.
// Prints the CPU, both times, the mask's mean, p99 and max per token and the ratio of the mean
// mask to the decode step (the target: at most 10%).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model/structured/constraint.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/kernel.hpp"

namespace {

using namespace treeattn;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

struct Answer {
  std::vector<TokenId> tokens;
  engine::RequestTimings timings;
};

// The requests one at a time through an engine on one in-process rank.
Result<std::vector<Answer>> answer(const model::LlamaModel& m,
                                   const std::vector<engine::Request>& reqs) {
  std::vector<Answer> out(reqs.size());
  std::mutex mu;
  Status st = run_local(1, [&](Communicator& comm) -> Status {
    engine::EngineConfig cfg;
    cfg.matmul = model::MatmulMode::kExact;  // SmolLM2's mode in tools/models.txt, as serve runs it
    cfg.kv_memory = std::size_t{512} << 20;
    auto e = engine::Engine::create(comm, m, cfg);
    TREEATTN_RETURN_IF_ERROR(e.status());
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      bool done = false;
      auto id = (*e)->submit(reqs[i], [&, i](const engine::TokenEvent& ev) {
        std::lock_guard lk(mu);
        if (ev.token >= 0) out[i].tokens.push_back(ev.token);
        out[i].timings = ev.timings;
        done = done || ev.finish != engine::FinishReason::kNone;
      });
      TREEATTN_RETURN_IF_ERROR(id.status());
      while (!done) TREEATTN_RETURN_IF_ERROR((*e)->step().status());
    }
    (*e)->stop(false);
    return (*e)->step().status();
  });
  TREEATTN_RETURN_IF_ERROR(st);
  return out;
}

int fail(const std::string& why) {
  std::fprintf(stderr, "treeattn_structured_bench: %s\n", why.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  const std::string schemas = argc > 2 ? argv[2] : "tests/model/structured/data/schemas.json";
  auto m = model::LlamaModel::load(path);
  if (!m.is_ok()) return fail(m.status().to_string());
  auto tok = Tokenizer::from_gguf((*m)->file());
  if (!tok.is_ok()) return fail(tok.status().to_string());
  std::ifstream in(schemas);
  if (!in) return fail("cannot read " + schemas);
  const json cases = json::parse(in);

  const auto t0 = Clock::now();
  const auto vocab = structured::vocabulary_of(*tok, static_cast<int32_t>((*m)->config().n_vocab));
  const double vocab_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();

  std::vector<engine::Request> constrained, free_text;
  for (const json& c : cases) {
    const std::string question = c["prompt"].get<std::string>();
    const ChatTurn turn{"user", question};
    auto prompt = tok->encode_chat(std::span(&turn, 1));
    if (!prompt.is_ok()) return fail(prompt.status().to_string());
    engine::Request r;
    r.prompt = *prompt;
    r.max_new_tokens = 512;
    r.response_format =
        json{{"type", "json_schema"}, {"json_schema", {{"name", "b"}, {"schema", c["schema"]}}}}
            .dump();
    constrained.push_back(r);
  }
  auto with = answer(**m, constrained);
  if (!with.is_ok()) return fail(with.status().to_string());
  for (std::size_t i = 0; i < constrained.size(); ++i) {
    engine::Request r = constrained[i];
    r.response_format.clear();
    r.stop_tokens.clear();  // as many tokens as the constrained answer
    r.max_new_tokens = std::max<int64_t>(2, static_cast<int64_t>((*with)[i].tokens.size()));
    free_text.push_back(r);
  }
  auto without = answer(**m, free_text);
  if (!without.is_ok()) return fail(without.status().to_string());
  double decode_s = 0;
  int64_t decode_tokens = 0;
  for (const Answer& a : *without) {
    decode_s += a.timings.decode_seconds;
    decode_tokens += a.timings.generated_tokens - 1;
  }
  const double step_ms = 1e3 * decode_s / static_cast<double>(std::max<int64_t>(decode_tokens, 1));

  std::vector<double> mask_ms;
  std::vector<float> logits(static_cast<std::size_t>(vocab->size()));
  for (std::size_t i = 0; i < constrained.size(); ++i) {
    auto grammar = structured::compile_response_format(constrained[i].response_format);
    if (!grammar.is_ok()) return fail(grammar.status().to_string());
    structured::TokenConstraint tc(*grammar, vocab);
    for (const TokenId t : (*with)[i].tokens) {
      std::fill(logits.begin(), logits.end(), 0.0f);
      const auto a = Clock::now();
      tc.mask(logits);
      mask_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
      if (logits[static_cast<std::size_t>(t)] != 0.0f)
        return fail("schema " + std::to_string(i) + ": the answer's token " + std::to_string(t) +
                    " is one the mask refuses");
      if (tc.accept(t) == structured::TokenConstraint::Step::kRefused)
        return fail("schema " + std::to_string(i) + ": token " + std::to_string(t) + " refused");
    }
  }
  std::vector<double> sorted = mask_ms;
  std::sort(sorted.begin(), sorted.end());
  double sum = 0;
  for (const double x : sorted) sum += x;
  const double mean = sum / static_cast<double>(std::max<std::size_t>(sorted.size(), 1));
  const double p99 = sorted.empty() ? 0 : sorted[(sorted.size() - 1) * 99 / 100];
  const double max = sorted.empty() ? 0 : sorted.back();
  std::printf("cpu: %s (%s kernels)\n", cpu_model_name().c_str(),
              std::string(isa_name(best_isa())).c_str());
  std::printf("model: %s, vocabulary %d tokens (trie built in %.1f ms, once per model)\n",
              path.c_str(), vocab->size(), vocab_ms);
  std::printf("decode step (1 rank, batch 1, exact matmul, %lld tokens of %zu answers): %.3f ms\n",
              static_cast<long long>(decode_tokens), free_text.size(), step_ms);
  std::printf(
      "mask per token (%zu tokens of %zu schemas): mean %.3f ms, p99 %.3f ms, max %.3f ms\n",
      sorted.size(), constrained.size(), mean, p99, max);
  std::printf("ratio mask / decode step: mean %.1f%%, p99 %.1f%% (target: at most 10%%)\n",
              100.0 * mean / step_ms, 100.0 * p99 / step_ms);
  return 0;
}
