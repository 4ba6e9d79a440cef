// What run and bench report (src/measure/bench_results.hpp): the latency summary by the one
// percentile definition, a point's summary, the JSON record (its keys are the schema tests/,
// bench/ and the Python tools read) and back, the files the launching shell merges, the CSV, and
// the sweep a job measures on 2 in-process ranks (every point exact against the oracle).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "measure/bench_results.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/measure.hpp"

namespace treeattn {
namespace {

std::string temp_path(const char* what) {
  return std::string("/tmp/treeattn-test-") + what + "-" + std::to_string(getpid());
}

BenchPoint sample_point() {
  BenchPoint p;
  p.method = "tree";
  p.ranks = 4;
  p.nodes = 2;
  p.seq = 65536;
  p.batch = 2;
  p.heads = 32;
  p.kv_heads = 8;
  p.head_dim = 128;
  p.q_len = 1;
  p.dtype = "bf16";
  p.shard = "even";
  p.kv_layout = "tiled";
  p.step_us = {40, 10, 30, 20};  // any order
  p.bytes_sent_per_rank = 1234;
  p.bytes_wire_per_rank = 2345;
  p.bytes_formula = 1200;
  p.peak_bytes_per_rank = 1 << 20;
  p.peak_bytes_formula = 1 << 19;
  p.peak_rss_bytes = 3u << 20;
  p.kv_bytes_read = 50'000'000;
  p.max_rel_err = 1.5e-7;
  p.output_sha256 = std::string(64, 'a');
  p.tolerance = 1e-5;
  p.ok = true;
  return p;
}

TEST(BenchResults, LatencyStatsUseTheLinearPercentile) {
  const LatencyStats s = LatencyStats::of({40, 10, 30, 20});
  EXPECT_DOUBLE_EQ(s.min, 10);
  EXPECT_DOUBLE_EQ(s.max, 40);
  EXPECT_DOUBLE_EQ(s.mean, 25);
  EXPECT_DOUBLE_EQ(s.p50, 25);  // the mean of the middle two, not the nearest rank (20)
  EXPECT_DOUBLE_EQ(s.p10, 13);  // 0.3: 10 + 0.3 * 10
  EXPECT_DOUBLE_EQ(s.p90, 37);  // 2.7: 30 + 0.7 * 10
  EXPECT_DOUBLE_EQ(s.p99, 39.7);
  EXPECT_DOUBLE_EQ(s.spread(), (37.0 - 13.0) / 25.0);
  const LatencyStats none = LatencyStats::of({});
  EXPECT_EQ(none.p50, 0);
  EXPECT_EQ(none.spread(), 0);
}

TEST(BenchResults, SummaryOfAPoint) {
  const BenchResult r = summarize(sample_point(), "cuda");
  EXPECT_EQ(r.device, "cuda");
  EXPECT_EQ(r.iterations, 4);
  EXPECT_DOUBLE_EQ(r.latency_us.p50, 25);
  EXPECT_DOUBLE_EQ(r.kv_gbps, 50'000'000 / (25 * 1e3));  // bytes per ns = GB/s
  EXPECT_EQ(r.method, "tree");
  EXPECT_EQ(r.step_us.size(), 4u);
  BenchPoint empty = sample_point();
  empty.step_us.clear();
  EXPECT_EQ(summarize(empty, "cpu").kv_gbps, 0);
}

TEST(BenchResults, JsonRecordKeysAndRoundTrip) {
  const BenchResult r = summarize(sample_point(), "cpu");
  const nlohmann::json j = to_json(r);
  std::set<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.insert(k);
  const std::set<std::string> expected = {"method",
                                          "ranks",
                                          "nodes",
                                          "seq",
                                          "batch",
                                          "heads",
                                          "kv_heads",
                                          "head_dim",
                                          "q_len",
                                          "dtype",
                                          "shard",
                                          "kv_layout",
                                          "device",
                                          "iterations",
                                          "latency_us",
                                          "bytes_sent_per_rank",
                                          "bytes_wire_per_rank",
                                          "bytes_formula",
                                          "peak_bytes_per_rank",
                                          "peak_bytes_formula",
                                          "peak_rss_bytes",
                                          "kv_bytes_read",
                                          "kv_gbps",
                                          "max_rel_err",
                                          "output_sha256",
                                          "tolerance",
                                          "ok"};
  EXPECT_EQ(keys, expected);
  std::set<std::string> lat;
  for (const auto& [k, v] : j["latency_us"].items()) lat.insert(k);
  EXPECT_EQ(lat,
            (std::set<std::string>{"min", "p10", "p50", "p90", "p99", "max", "mean", "spread"}));
  const BenchResult back = bench_result_from_json(j);
  EXPECT_EQ(to_json(back), j);
  EXPECT_TRUE(back.step_us.empty());  // the file keeps the summary only
  EXPECT_EQ(back.bytes_wire_per_rank, std::optional<uint64_t>(2345));

  // Without a wire count, and as a file written before the tiled layout and --device.
  BenchResult nowire = r;
  nowire.bytes_wire_per_rank.reset();
  nlohmann::json old = to_json(nowire);
  EXPECT_TRUE(old["bytes_wire_per_rank"].is_null());
  old.erase("kv_layout");
  old.erase("device");
  const BenchResult o = bench_result_from_json(old);
  EXPECT_FALSE(o.bytes_wire_per_rank.has_value());
  EXPECT_EQ(o.kv_layout, "rows");
  EXPECT_EQ(o.device, "cpu");
  nlohmann::json broken = j;
  broken.erase("ok");
  EXPECT_THROW(bench_result_from_json(broken), nlohmann::json::exception);
}

TEST(BenchResults, FilesTheShellMerges) {
  const std::string path = temp_path("bench.json");
  BenchResult a = summarize(sample_point(), "cpu");
  BenchResult b = a;
  b.method = "ring-kv";
  ASSERT_TRUE(write_bench_json(path, {a, b}, {{"device_description", "cpu: test"}}).is_ok());
  BenchFile f = read_bench_file(path);
  ASSERT_EQ(f.results.size(), 2u);
  EXPECT_EQ(f.results[1].method, "ring-kv");
  EXPECT_FALSE(f.inexact);
  EXPECT_EQ(f.device_description, "cpu: test");
  b.ok = false;
  ASSERT_TRUE(write_bench_json(path, {a, b}, nlohmann::json::object()).is_ok());
  f = read_bench_file(path);
  EXPECT_TRUE(f.inexact);
  EXPECT_EQ(f.device_description, "");
  std::remove(path.c_str());
  const BenchFile missing = read_bench_file(path);
  EXPECT_TRUE(missing.results.empty());
  EXPECT_FALSE(missing.inexact);
  EXPECT_FALSE(write_bench_json("/nonexistent-dir/x.json", {a}, {}).is_ok());
}

TEST(BenchResults, CsvHasOneRowPerResult) {
  const std::string path = temp_path("bench.csv");
  BenchResult a = summarize(sample_point(), "cpu");
  a.bytes_wire_per_rank.reset();
  ASSERT_TRUE(write_bench_csv(path, {a}).is_ok());
  std::ifstream in(path);
  std::string header, row, extra;
  std::getline(in, header);
  std::getline(in, row);
  EXPECT_FALSE(std::getline(in, extra));
  std::remove(path.c_str());
  EXPECT_EQ(header.rfind("method,ranks,nodes,seq,batch,", 0), 0u);
  EXPECT_EQ(row,
            "tree,4,2,65536,2,32,8,128,1,bf16,even,4,10.000,25.000,37.000,39.700,1234,,1200,"
            "1048576,524288,3145728,50000000,2000.000,1.500e-07,1,cpu");
}

TEST(BenchResults, MemoryCheckBeforeAnythingIsAllocated) {
  BenchConfig c;
  c.methods = {"tree"};
  c.shape = AttnShape{2, 32, 8, 128, 1};
  c.dtype = DType::kBF16;
  c.seq = 4096;
  EXPECT_TRUE(check_bench_memory(c, 4).is_ok());
  if (mem_available_bytes() == 0) GTEST_SKIP() << "MemAvailable is not readable here";
  c.seq = int64_t{1} << 40;  // a tebitoken context: no machine has that memory
  const Status s = check_bench_memory(c, 4);
  EXPECT_EQ(s.code(), Code::kOutOfMemory);
  EXPECT_EQ(s.message().rfind("a context of 1099511627776 tokens (" + c.shape.to_string() +
                                  ", batch 2) on 4 ranks needs about ",
                              0),
            0u)
      << s.message();
  EXPECT_NE(s.message().find(" of queries, outputs and states)"), std::string::npos);
}

TEST(BenchResults, SweepMeasuresEveryPointOnEveryRank) {
  BenchSweep sweep;
  sweep.base.methods = {"tree", "allgather"};
  sweep.base.shape = AttnShape{1, 4, 2, 64, 1};
  sweep.base.dtype = DType::kF32;
  sweep.base.warmup = 1;
  sweep.base.iters = 3;
  sweep.base.threads = 1;
  sweep.seqs = {256, 512};
  sweep.batches = {1, 2};
  sweep.device = "cpu";
  std::mutex mu;
  std::vector<std::vector<BenchResult>> out(2);
  std::vector<std::string> progress;
  const Status st = run_local(2, [&](Communicator& comm) -> Status {
    BenchSweep s = sweep;
    s.methods_for = [](const BenchConfig& c) -> Result<std::vector<std::string>> {
      if (c.seq == 512) return std::vector<std::string>{"allgather", "ring-kv"};
      return c.methods;
    };
    s.progress = [&](std::size_t done, std::size_t total, const BenchConfig& c) {
      if (comm.rank() != 0) return;
      std::lock_guard<std::mutex> lock(mu);
      progress.push_back(std::to_string(done) + "/" + std::to_string(total) + " " +
                         std::to_string(c.shape.batch) + "x" + std::to_string(c.seq));
    };
    auto r = bench_sweep(comm, s);
    TREEATTN_RETURN_IF_ERROR(r.status());
    out[static_cast<std::size_t>(comm.rank())] = std::move(r).value();
    return Status::ok();
  });
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(progress,
            (std::vector<std::string>{"1/4 1x256", "2/4 1x512", "3/4 2x256", "4/4 2x512"}));
  ASSERT_EQ(out[0].size(), 8u);  // batch outer, seq inner, the methods of each point
  const std::vector<std::string> methods = {"tree", "allgather", "allgather", "ring-kv",
                                            "tree", "allgather", "allgather", "ring-kv"};
  for (std::size_t i = 0; i < out[0].size(); ++i) {
    const BenchResult& r = out[0][i];
    EXPECT_EQ(r.method, methods[i]);
    EXPECT_EQ(r.batch, i < 4 ? 1 : 2);
    EXPECT_EQ(r.seq, (i / 2) % 2 == 0 ? 256 : 512);
    EXPECT_EQ(r.ranks, 2);
    EXPECT_EQ(r.iterations, 3);
    EXPECT_TRUE(r.ok) << r.method << ": rel err " << r.max_rel_err;
    EXPECT_LE(r.max_rel_err, r.tolerance);
    EXPECT_GT(r.latency_us.p50, 0);
    EXPECT_EQ(r.device, "cpu");
    // Every rank reports the same point (the aggregation over ranks).
    EXPECT_EQ(to_json(r), to_json(out[1][i]));
  }
  // A method the planner callback refuses stops the sweep with its error.
  const Status bad = run_local(2, [&](Communicator& comm) -> Status {
    BenchSweep s = sweep;
    s.methods_for = [](const BenchConfig&) -> Result<std::vector<std::string>> {
      return invalid_argument("no plan");
    };
    return bench_sweep(comm, s).status();
  });
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace treeattn
