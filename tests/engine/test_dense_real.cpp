// --dense split on the shipped model files (label real; Qwen2.5-Coder-1.5B also large), with
// threads as ranks. Each file is found by tools/model-path.sh NAME (which only looks in models/;
// an absent file skips with a message).
//   * A prompt within one page (page 0 lives on rank 0, so the merge adds nothing): one rank's
//     tokens and logits bits at 2, 3 and 4 ranks, split and replicated, exact and int8.
//   * A prompt over several pages at 2 ranks (the merge and the K/V exchange at work): split gives
//     replicated's bits, exact and int8.
// Split ranks copy their own rows into the rows8 layout (an unpacked model); replicated ones view
// the copy of a packed model, so memory holds one copy each way.
#include <gtest/gtest.h>
#include <stdio.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/model.hpp"

namespace treeattn::engine {
namespace {

std::string model_path(const std::string& name, std::string* why) {
  const std::string cmd =
      std::string(TREEATTN_SOURCE_DIR) + "/tools/model-path.sh '" + name + "' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *why = "cannot run " + cmd;
    return "";
  }
  std::string out;
  char buf[4096];
  while (fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  if (rc == 0 && std::filesystem::is_regular_file(out)) return out;
  *why = out;
  return "";
}

struct Out {
  std::vector<TokenId> tokens;
  std::vector<std::vector<float>> logits;
  DenseChoice dense;
  Status status;
};

// One greedy request alone through an engine over p in-process ranks.
Out run(const model::LlamaModel& m, int p, EngineConfig cfg, const std::vector<TokenId>& prompt,
        int64_t new_tokens) {
  Out out;
  std::mutex mu;
  out.status = run_local(p, [&](Communicator& comm) -> Status {
    auto e = Engine::create(comm, m, cfg);
    TREEATTN_RETURN_IF_ERROR(e.status());
    Engine& eng = **e;
    if (comm.rank() != 0) return eng.run();
    out.dense = eng.dense_choice();
    Request r;
    r.prompt = prompt;
    r.max_new_tokens = new_tokens;
    r.return_logits = true;
    Status failed;
    auto id = eng.submit(r, [&](const TokenEvent& ev) {
      std::lock_guard lk(mu);
      if (ev.token >= 0) out.tokens.push_back(ev.token);
      if (!ev.logits.empty()) out.logits.push_back(ev.logits);
      if (ev.finish == FinishReason::kError) failed = ev.error;
    });
    TREEATTN_RETURN_IF_ERROR(id.status());
    for (bool more = true; more;) {
      auto s = eng.step();
      TREEATTN_RETURN_IF_ERROR(s.status());
      more = *s;
    }
    eng.stop(false);
    TREEATTN_RETURN_IF_ERROR(eng.step().status());
    return failed;
  });
  return out;
}

std::string same_bits(const Out& a, const Out& b) {
  if (a.tokens != b.tokens) return "tokens differ";
  if (a.logits.size() != b.logits.size() || a.logits.empty()) return "logit counts differ";
  for (std::size_t s = 0; s < a.logits.size(); ++s)
    if (a.logits[s].size() != b.logits[s].size() ||
        std::memcmp(a.logits[s].data(), b.logits[s].data(), a.logits[s].size() * 4) != 0)
      return "logits of generated token " + std::to_string(s) + " differ";
  return "";
}

std::vector<TokenId> prompt_of(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<TokenId> t(static_cast<std::size_t>(n));
  uint64_t s = seed;
  for (auto& x : t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<TokenId>((s >> 33) % static_cast<uint64_t>(std::min<int64_t>(vocab, 30000)));
  }
  return t;
}

void check_model(const std::string& name) {
  std::string why;
  const std::string path = model_path(name, &why);
  if (path.empty()) GTEST_SKIP() << name << " is not in models/ (tools/fetch-model.sh " << name
                                 << "): " << why;
  auto raw = model::LlamaModel::load(path);  // split ranks pack their own rows
  auto packed = model::LlamaModel::load(path);  // replicated ranks view its copy
  ASSERT_TRUE(raw.is_ok() && packed.is_ok()) << raw.status().to_string();
  const int64_t vocab = (*raw)->config().n_vocab;
  EngineConfig base;
  base.kv_dtype = DType::kF16;
  base.page_tokens = 256;
  base.kv_pages = 4;
  base.threads = 1;
  base.max_batch = 4;
  base.prefill_chunk = 64;  // several prefill steps
  base.timeout = std::chrono::milliseconds(600000);
  base.idle_tick = std::chrono::milliseconds(1);
  for (const model::MatmulMode mode : {model::MatmulMode::kExact, model::MatmulMode::kInt8}) {
    SCOPED_TRACE(name + " " + std::string(model::matmul_mode_name(mode)));
    (*packed)->pack_rows8(mode, 2);
    EngineConfig cfg = base;
    cfg.matmul = mode;
    // Within one page: one rank's bits everywhere.
    const auto prompt = prompt_of(90, vocab, 7);
    cfg.dense = "replicated";
    const Out one = run(**packed, 1, cfg, prompt, 6);
    ASSERT_TRUE(one.status.is_ok()) << one.status.to_string();
    ASSERT_EQ(one.tokens.size(), 6u);
    for (int p : {2, 3, 4})
      for (const std::string dense : {"split", "replicated"}) {
        cfg.dense = dense;
        const Out got = run(dense == "split" ? **raw : **packed, p, cfg, prompt, 6);
        ASSERT_TRUE(got.status.is_ok()) << got.status.to_string();
        EXPECT_EQ(got.dense.split, dense == "split");
        EXPECT_EQ(same_bits(one, got), "") << p << " ranks, " << dense;
      }
    // Several pages over 2 ranks: split gives replicated's bits.
    cfg.page_tokens = 32;
    cfg.kv_pages = 16;
    const auto longer = prompt_of(300, vocab, 11);
    cfg.dense = "replicated";
    const Out rep = run(**packed, 2, cfg, longer, 5);
    ASSERT_TRUE(rep.status.is_ok()) << rep.status.to_string();
    cfg.dense = "split";
    const Out split = run(**raw, 2, cfg, longer, 5);
    ASSERT_TRUE(split.status.is_ok()) << split.status.to_string();
    EXPECT_EQ(same_bits(rep, split), "") << "300 tokens over pages of 32 at 2 ranks";
    std::printf("[ dense     ] %s %s: 1-4 ranks within a page and 2 ranks over %d pages: the "
                "same bits split and replicated; %zu tokens\n",
                name.c_str(), std::string(model::matmul_mode_name(mode)).c_str(), 300 / 32 + 1,
                one.tokens.size());
  }
}

TEST(DenseReal, SmolLM2) { check_model("smollm2-135m"); }
TEST(DenseReal, Gemma3_270M) { check_model("gemma-3-270m"); }
TEST(DenseReal, Qwen25Coder05B) { check_model("qwen2.5-coder-0.5b"); }
TEST(DenseReal, Qwen25Coder15B) { check_model("qwen2.5-coder-1.5b"); }

}  // namespace
}  // namespace treeattn::engine
