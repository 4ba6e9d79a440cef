// What generate reports of a run (src/engine/generation_report.hpp), on hand-made outputs: the
// per-method and engine figures (p50/p99 by the one percentile definition: linear, not nearest
// rank), the largest peak RSS, the keys of both --json documents (what bench/model/ and the tests
// read), the token-stream hash's spelling, and a document with invalid UTF-8 written readable.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "engine/generation_report.hpp"

namespace treeattn {
namespace {

using generation::MethodResult;
using generation::Output;

std::set<std::string> keys(const nlohmann::json& j) {
  std::set<std::string> k;
  for (const auto& [key, v] : j.items()) k.insert(key);
  return k;
}

Output session_output() {
  Output o;
  o.prompt = {1, 2, 3, 4};
  o.config_text = "tiny";
  o.text = "Paris";
  o.peak_rss_by_rank = {300, 700, 500};
  o.ttft_ms = 12.5;
  o.prefill_s = 2.0;
  o.token_hash = 0xabcULL;
  MethodResult a;
  a.method = "tree";
  a.tokens = {7, 8, 9, 10};
  a.step_ms = {4, 1, 3, 2};
  a.decode_s = 0.5;
  a.bytes_sent_per_token_by_rank = {10, 30, 20};
  MethodResult b = a;
  b.method = "ring-kv";
  b.first_diff = 2;
  b.step_ms = {10, 20};
  b.decode_s = 1.0;
  b.bytes_sent_per_token_by_rank.clear();
  o.methods = {a, b};
  return o;
}

TEST(GenerationReport, MethodFigures) {
  const Output o = session_output();
  const auto m = generation::method_figures(o, o.methods[0]);
  EXPECT_DOUBLE_EQ(m.p50_ms, 2.5);   // the mean of the middle two (nearest rank would say 2)
  EXPECT_DOUBLE_EQ(m.p99_ms, 3.97);  // 2.97: 3 + 0.97 * (4 - 3)
  EXPECT_DOUBLE_EQ(m.tokens_per_s, 8.0);
  EXPECT_DOUBLE_EQ(m.bytes_per_token, 30.0);
  EXPECT_DOUBLE_EQ(m.end_to_end_s, 2.5);
  const auto n = generation::method_figures(o, o.methods[1]);
  EXPECT_DOUBLE_EQ(n.bytes_per_token, 0.0);
  EXPECT_DOUBLE_EQ(n.p50_ms, 15.0);
  EXPECT_EQ(generation::max_peak_rss(o), 700u);
}

TEST(GenerationReport, EngineFigures) {
  Output o;
  o.prompt.assign(100, 1);
  o.tokens = {1, 2, 3, 4, 5};
  o.token_ms = {100, 50, 150, 100};
  o.decode_seconds = 0.4;
  o.prefill_seconds = 0.5;
  const auto e = generation::engine_figures(o);
  EXPECT_DOUBLE_EQ(e.decode_ms_per_token, 100.0);  // 0.4 s over the 4 tokens after the first
  EXPECT_DOUBLE_EQ(e.tokens_per_s, 10.0);
  EXPECT_DOUBLE_EQ(e.p50_ms, 100.0);
  EXPECT_DOUBLE_EQ(e.prefill_tokens_per_s, 200.0);
  Output one;
  one.tokens = {1};
  EXPECT_EQ(generation::engine_figures(one).tokens_per_s, 0.0);
}

TEST(GenerationReport, SessionDocument) {
  const Output o = session_output();
  generation::ReportLabels l{"/m.gguf", 3,      2,      "int8",    "f16", "even", "auto",
                             false,     "auto", "avx2", "avxvnni", "",    ""};
  const nlohmann::json j = generation::session_report_json(o, l, true);
  EXPECT_EQ(keys(j), (std::set<std::string>{"model",
                                            "model_config",
                                            "prompt_tokens",
                                            "tokens",
                                            "text",
                                            "ranks",
                                            "threads_per_rank",
                                            "matmul",
                                            "isa",
                                            "int8_kernel",
                                            "method",
                                            "kv_dtype",
                                            "placement",
                                            "kv_layout",
                                            "ttft_ms",
                                            "prefill_ms",
                                            "synthetic_kv",
                                            "prefill_tokens_per_s",
                                            "prefill_bytes_sent_rank0",
                                            "prefill_busy_s_by_rank",
                                            "prefill_attention_s_by_rank",
                                            "prefill_positions_by_rank",
                                            "decode_ms_p50",
                                            "decode_ms_p99",
                                            "tokens_per_s",
                                            "bytes_sent_per_rank_per_token",
                                            "peak_rss_bytes",
                                            "peak_rss_bytes_by_rank",
                                            "token_stream_hash",
                                            "ranks_agree",
                                            "methods"}));
  EXPECT_EQ(j["method"], "tree");
  EXPECT_EQ(j["isa"], "avx2");
  EXPECT_EQ(j["int8_kernel"], "avxvnni");
  EXPECT_EQ(j["tokens"], nlohmann::json({7, 8, 9, 10}));
  EXPECT_EQ(j["token_stream_hash"], "0000000000000abc");
  EXPECT_EQ(j["decode_ms_p50"], 2.5);
  EXPECT_EQ(j["peak_rss_bytes"], 700);
  EXPECT_EQ(j["prefill_tokens_per_s"], 2.0);
  EXPECT_EQ(j["ranks"], 3);
  ASSERT_EQ(j["methods"].size(), 2u);
  EXPECT_EQ(keys(j["methods"][1]),
            (std::set<std::string>{"method", "tokens", "decode_steps", "decode_ms", "decode_ms_p50",
                                   "decode_ms_p99", "tokens_per_s", "decode_s", "end_to_end_s",
                                   "bytes_sent_per_rank_per_token", "bytes_sent_per_token_by_rank",
                                   "first_token_differing_from_method0"}));
  EXPECT_EQ(j["methods"][1]["first_token_differing_from_method0"], 2);
  EXPECT_EQ(j["methods"][1]["end_to_end_s"], 3.0);
  EXPECT_FALSE(generation::session_report_json(o, l, false)["ranks_agree"].get<bool>());
}

TEST(GenerationReport, EngineDocumentAndInvalidUtf8) {
  Output o;
  o.prompt = {1, 2};
  o.tokens = {5, 6, 7};
  o.token_ms = {10, 30};
  o.decode_seconds = 0.04;
  o.prefill_seconds = 0.01;
  o.text = std::string("caf\xc3", 4);  // ends inside a two-byte character
  o.peak_rss_by_rank = {9, 4};
  o.bytes_per_token = 128;
  generation::ReportLabels l{"/m.gguf", 2,    1,        "exact",      "bf16", "",    "",
                             false,     "kv", "avx512", "avx512vnni", "auto", "auto"};
  o.dense_choice.split = true;
  o.dense_choice.how = "auto: planned on topology job";
  o.dense_choice.predicted_split_us = 900;
  o.dense_choice.predicted_replicated_us = 1500;
  o.dense_choice.collectives_per_token = 121;
  o.dense_choice.weight_bytes = 5000;
  o.weights_resident_by_rank = {6000, 5900};
  o.logits_hash = "00000000deadbeef";
  o.merge_choice.strategy = "allgather";
  o.merge_choice.how = "auto: planned on topology job";
  o.merge_choice.batch_invariant = true;
  PlanEntry cand;
  cand.prediction.strategy = "allgather";
  cand.prediction.latency_us = 12.5;
  o.merge_choice.ranking = {cand};
  const nlohmann::json j = generation::engine_report_json(o, "allgather", l);
  EXPECT_TRUE(j["engine"].get<bool>());
  EXPECT_EQ(j["method"], "allgather");
  EXPECT_EQ(j["method_requested"], "auto");
  EXPECT_EQ(j["merge_how"], "auto: planned on topology job");
  EXPECT_TRUE(j["merge_batch_invariant"].get<bool>());
  ASSERT_EQ(j["merge_candidates"].size(), 1u);
  EXPECT_EQ(j["merge_candidates"][0]["method"], "allgather");
  EXPECT_EQ(j["merge_candidates"][0]["predicted_layer_us"], 12.5);
  EXPECT_EQ(j["prefill_exchange"], "kv");
  EXPECT_EQ(j["isa"], "avx512");
  EXPECT_EQ(j["int8_kernel"], "avx512vnni");
  EXPECT_EQ(j["decode_ms_per_token"], 20.0);
  EXPECT_EQ(j["decode_ms_p50"], 20.0);
  EXPECT_EQ(j["tokens_per_s"], 50.0);
  EXPECT_EQ(j["peak_rss_bytes"], 9);
  EXPECT_EQ(j["bytes_sent_per_token_of"], "rank 0, decode steps");
  EXPECT_EQ(j["dense"], "split");
  EXPECT_EQ(j["dense_requested"], "auto");
  EXPECT_EQ(j["dense_how"], "auto: planned on topology job");
  EXPECT_EQ(j["dense_predicted_split_us"], 900.0);
  EXPECT_EQ(j["dense_predicted_replicated_us"], 1500.0);
  EXPECT_EQ(j["dense_collectives_per_token"], 121);
  EXPECT_EQ(j["weight_bytes_rank0"], 5000);
  EXPECT_EQ(j["weights_resident_bytes_by_rank"], (std::vector<uint64_t>{6000, 5900}));
  EXPECT_EQ(j["logits_hash"], "00000000deadbeef");
  const std::string path = "/tmp/treeattn-test-genreport-" + std::to_string(getpid()) + ".json";
  ASSERT_TRUE(generation::write_report_json(path, j, "--json").is_ok());
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::remove(path.c_str());
  const auto back = nlohmann::json::parse(ss.str());
  EXPECT_EQ(back["text"], "caf\xef\xbf\xbd");  // U+FFFD
  EXPECT_EQ(back["tokens"], j["tokens"]);
  const Status bad = generation::write_report_json("/nonexistent-dir/x.json", j, "--json");
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("--json /nonexistent-dir/x.json"), std::string::npos);
}

TEST(GenerationReport, MemoryCheck) {
  model::LlamaConfig cfg;
  cfg.n_layers = 2;
  cfg.n_embd = 64;
  cfg.n_ff = 128;
  cfg.n_head = 4;
  cfg.n_head_kv = 2;
  cfg.head_dim = 16;
  cfg.n_vocab = 100;
  generation::Request r;
  r.new_tokens = 6;
  EXPECT_TRUE(generation::check_memory(cfg, r, 2, 2, 10, 1e6, 0).is_ok());  // unknown
  EXPECT_TRUE(generation::check_memory(cfg, r, 2, 2, 10, 1e6, uint64_t{1} << 40).is_ok());
  const Status tight = generation::check_memory(cfg, r, 2, 2, 10, 1e6, 1000000);
  EXPECT_EQ(tight.code(), Code::kOutOfMemory);  // the weights alone pass 90%
  EXPECT_NE(tight.message().find("a prompt of 10 tokens + 6 new on 2 rank(s) needs about "),
            std::string::npos);
  EXPECT_NE(tight.message().find("976.56 KiB of weights); this machine has 976.56 KiB available"),
            std::string::npos)
      << tight.message();
  // The need grows with the ranks on this machine: find where it crosses 90%.
  const auto est = model::estimate_memory(cfg, generation::generator_config(r), 2, 10, 6);
  const double one = static_cast<double>(est.total()) + 1e6;
  const auto avail = static_cast<uint64_t>(one / 0.9) + 1;
  EXPECT_TRUE(generation::check_memory(cfg, r, 2, 1, 10, 1e6, avail).is_ok());
  EXPECT_FALSE(generation::check_memory(cfg, r, 2, 2, 10, 1e6, avail).is_ok());
}

TEST(GenerationReport, Lines) {
  Output e;
  e.prompt.assign(100, 1);
  e.cached_tokens = 64;
  e.ttft_ms = 12.34;
  e.tokens = {1, 2, 3, 4, 5};
  e.token_ms = {100, 50, 150, 100};
  e.decode_seconds = 0.4;
  e.prefill_seconds = 0.5;
  e.bytes_per_token = 3 * 1024;
  e.merges = 90;
  e.peak_rss_by_rank = {1u << 20, 3u << 19};
  e.page_tokens = 128;
  e.pages_per_rank = 40;
  e.pages_used_peak = 70;
  e.kv_bytes_used_peak = 35u << 20;
  const std::string head =
      "prompt 100 tokens (64 from the prefix cache): time to first token 12.3 ms (prefill "
      "200 tokens/s)\n"
      "decode tree (engine, dense replicated) 5 tokens: 100.00 ms/token p50, 148.50 p99, "
      "10.0 tokens/s | rank 0 sent 3.00 KiB/token in 90 merges in all\n"
      "peak RSS per rank: 1.00 MiB 1.50 MiB (includes the mapped weights, shared between "
      "ranks)\n";
  EXPECT_EQ(generation::engine_report_text(e, "tree"),
            head + "KV pages in use at most (all ranks): 70 (35.00 MiB); 40 pages of 128 tokens "
                   "per rank\n");
  e.window_pages_per_rank = 5;
  e.window_pages_used_peak = 6;
  e.window_kv_bytes_used_peak = 15u << 20;
  EXPECT_EQ(generation::engine_report_text(e, "tree"),
            head + "KV pages in use at most (all ranks): 70 full pages (35.00 MiB, global "
                   "layers), 6 window pages (15.00 MiB, sliding-window layers); per rank 40 "
                   "full, 5 window pages of 128 tokens\n");
  e.weights_resident_by_rank = {2u << 20, 1u << 20};
  e.logits_hash = "0123456789abcdef";
  const std::string with = generation::engine_report_text(e, "tree");
  EXPECT_NE(with.find("weights resident per rank (the file's pages touched + own rows8 copy): "
                      "2.00 MiB 1.00 MiB\n"),
            std::string::npos)
      << with;
  EXPECT_NE(with.find("logits hash: 0123456789abcdef\n"), std::string::npos);

  Output o = session_output();
  o.prefill_busy_s_by_rank = {1.5, 0.25};
  o.prefill.bytes_sent = 2048;
  const std::string two = generation::session_report_text(o, false, 2, false);
  EXPECT_NE(two.find("\nprompt 4 tokens: prefill 2.00 s (2.0 tokens/s"), std::string::npos);
  EXPECT_NE(two.find("prefill busy s per rank (computing, not waiting): 1.50 0.25; sent 2.00 "
                     "KiB by rank 0\n"),
            std::string::npos);
  EXPECT_NE(two.find("decode tree        4 tokens: 2.50 ms/token p50, 3.97 p99, 8.0 tokens/s | "
                     "sent 30 B/rank/token (max) | end-to-end 2.50 s\n"),
            std::string::npos);
  EXPECT_NE(two.find("| end-to-end 3.00 s, differs from tree at token 2\n"), std::string::npos);
  EXPECT_EQ(two.find("FAILED"), std::string::npos);
  o.methods[1].first_diff = -1;
  const std::string one = generation::session_report_text(o, true, 1, true);
  EXPECT_NE(one.find("synthetic KV cache (not computed, 2.00 s to fill)"), std::string::npos);
  EXPECT_EQ(one.find("prefill busy"), std::string::npos);
  EXPECT_NE(one.find(", same tokens as tree\n"), std::string::npos);
  EXPECT_NE(one.find("peak RSS per rank: 300 B 700 B 500 B"), std::string::npos);
  EXPECT_NE(one.find("FAILED: the ranks' token streams diverged\n"), std::string::npos);
}

}  // namespace
}  // namespace treeattn
