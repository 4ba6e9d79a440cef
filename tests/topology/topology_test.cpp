// Tests of the topology file format: presets, JSON round trips, loading from files, malformed
// files (each error must name the file, the JSON path and what was expected), and building a
// topology from measured numbers.
#include "treeattn/topology.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace treeattn {
namespace {

// A valid two-level file; the malformed cases below edit one thing in it.
constexpr const char* kValid = R"({
  "format": "treeattn-topology/1",
  "name": "two-by-four",
  "description": "test cluster",
  "nodes": 2,
  "ranks_per_node": 4,
  "collectives": "mpi",
  "collective_overhead_us": 1.5,
  "memory": {"bandwidth_GBps": 30, "capacity_GB": 16},
  "compute": {"peak_TFLOPs": 2, "kernel_overhead_us": 3, "max_concurrent_ranks": 2},
  "levels": [
    {"name": "node", "latency_us": 0.5, "bandwidth_GBps": 9},
    {"name": "network", "latency_us": 12, "bandwidth_GBps": 0.125, "links_per_node": 1}
  ],
  "sources": ["made up for a test"]
})";

std::string replace(std::string s, const std::string& from, const std::string& to) {
  const auto pos = s.find(from);
  EXPECT_NE(pos, std::string::npos) << "test bug: '" << from << "' not in the valid file";
  if (pos != std::string::npos) s.replace(pos, from.size(), to);
  return s;
}

TEST(TopologyFile, ParsesEveryField) {
  Result<Topology> t = parse_topology_json(kValid, "t.json");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->name, "two-by-four");
  EXPECT_EQ(t->nodes, 2);
  EXPECT_EQ(t->ranks_per_node, 4);
  EXPECT_EQ(t->total_ranks(), 8);
  EXPECT_EQ(t->collectives, CollectiveLibrary::kMpi);
  EXPECT_DOUBLE_EQ(t->collective_overhead_us, 1.5);
  EXPECT_DOUBLE_EQ(t->memory_bandwidth_GBps, 30);
  ASSERT_TRUE(t->memory_capacity_GB.has_value());
  EXPECT_DOUBLE_EQ(*t->memory_capacity_GB, 16);
  ASSERT_TRUE(t->peak_tflops.has_value());
  EXPECT_DOUBLE_EQ(*t->peak_tflops, 2);
  EXPECT_DOUBLE_EQ(t->kernel_overhead_us, 3);
  EXPECT_EQ(t->max_concurrent_ranks, 2);
  EXPECT_DOUBLE_EQ(t->node.latency_us, 0.5);
  EXPECT_DOUBLE_EQ(t->node.bandwidth_GBps, 9);
  ASSERT_TRUE(t->network.has_value());
  EXPECT_DOUBLE_EQ(t->network->latency_us, 12);
  EXPECT_DOUBLE_EQ(t->network->bandwidth_GBps, 0.125);
  EXPECT_EQ(t->network->links_per_node, 1);
  ASSERT_EQ(t->sources.size(), 1u);
}

TEST(TopologyFile, OptionalFieldsDefault) {
  constexpr const char* kMinimal = R"({"format": "treeattn-topology/1", "name": "m",
    "nodes": 1, "ranks_per_node": 2, "memory": {"bandwidth_GBps": 10},
    "levels": [{"name": "node", "latency_us": 1, "bandwidth_GBps": 5}]})";
  Result<Topology> t = parse_topology_json(kMinimal, "m.json");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->collectives, CollectiveLibrary::kMpi);
  EXPECT_FALSE(t->network.has_value());
  EXPECT_FALSE(t->memory_capacity_GB.has_value());
  EXPECT_FALSE(t->peak_tflops.has_value());
  EXPECT_EQ(t->max_concurrent_ranks, 0);
  EXPECT_DOUBLE_EQ(t->collective_overhead_us, 0);
}

TEST(TopologyFile, DumpThenParseIsIdentity) {
  Result<Topology> t = parse_topology_json(kValid, "t.json");
  ASSERT_TRUE(t.is_ok());
  const std::string text = topology_to_json(*t);
  Result<Topology> back = parse_topology_json(text, "dumped");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string() << "\n" << text;
  EXPECT_EQ(*back, *t);
}

struct BadCase {
  const char* what;
  std::string text;
  std::string expect;  // substring of the error message
};

TEST(TopologyFile, MalformedFilesGiveClearErrors) {
  const std::string v = kValid;
  const std::vector<BadCase> cases = {
      {"not JSON", "{\"format\": ", "t.json: not valid JSON: parse error at line 1"},
      {"top level is an array", "[1, 2]", "t.json: $: expected an object, got [1,2]"},
      {"format missing", replace(v, R"("format": "treeattn-topology/1",)", ""),
       "t.json: $.format: missing (expected a string)"},
      {"format wrong", replace(v, "treeattn-topology/1", "treeattn-topology/9"),
       "t.json: $.format: expected \"treeattn-topology/1\", got \"treeattn-topology/9\""},
      {"nodes zero", replace(v, R"("nodes": 2)", R"("nodes": 0)"),
       "t.json: $.nodes: expected an integer in [1, 1048576], got 0"},
      {"nodes a string", replace(v, R"("nodes": 2)", R"("nodes": "2")"),
       "t.json: $.nodes: expected an integer in [1, 1048576], got \"2\""},
      {"nodes fractional", replace(v, R"("nodes": 2)", R"("nodes": 2.5)"),
       "t.json: $.nodes: expected an integer"},
      {"negative bandwidth", replace(v, R"("bandwidth_GBps": 0.125)", R"("bandwidth_GBps": -3)"),
       "t.json: $.levels[1].bandwidth_GBps: expected a number > 0, got -3"},
      {"latency not a number", replace(v, R"("latency_us": 12)", R"("latency_us": "fast")"),
       "t.json: $.levels[1].latency_us: expected a number > 0, got \"fast\""},
      {"negative call overhead",
       replace(v, R"("links_per_node": 1})", R"("links_per_node": 1, "call_overhead_us": -1})"),
       "t.json: $.levels[1].call_overhead_us: expected a number >= 0, got -1"},
      {"call overhead on the node level",
       replace(v, R"("bandwidth_GBps": 9})", R"("bandwidth_GBps": 9, "call_overhead_us": 5})"),
       "t.json: $.levels[0].call_overhead_us: only the network level has a call overhead"},
      {"links on the node level",
       replace(v, R"("bandwidth_GBps": 9})", R"("bandwidth_GBps": 9, "links_per_node": 8})"),
       "t.json: $.levels[0].links_per_node: only the network level has links a node's ranks "
       "share"},
      {"latency missing", replace(v, R"("latency_us": 0.5, )", ""),
       "t.json: $.levels[0].latency_us: missing (expected a number)"},
      {"levels swapped", replace(v, R"("name": "node")", R"("name": "rack")"),
       "t.json: $.levels[0].name: expected \"node\" at this position, got \"rack\""},
      {"network level missing for 2 nodes",
       replace(v, R"(,
    {"name": "network", "latency_us": 12, "bandwidth_GBps": 0.125, "links_per_node": 1})",
               ""),
       "t.json: $.levels: nodes is 2, so a second level {\"name\": \"network\", ...} is "
       "required"},
      {"three levels",
       replace(v, R"("links_per_node": 1}
  ])",
               R"("links_per_node": 1}, {"name": "pod"}])"),
       "t.json: $.levels: expected an array of 1 or 2 levels"},
      {"typo in a key", replace(v, R"("bandwidth_GBps": 9)", R"("bandwith_GBps": 9)"),
       "t.json: $.levels[0].bandwith_GBps: unknown key (known keys: name, latency_us, "
       "bandwidth_GBps, links_per_node, call_overhead_us, user_op_overhead_us)"},
      {"unknown top-level key", replace(v, R"("nodes": 2,)", R"("nodes": 2, "gpus": 8,)"),
       "t.json: $.gpus: unknown key"},
      {"memory missing", replace(v, R"("memory": {"bandwidth_GBps": 30, "capacity_GB": 16},)", ""),
       "t.json: $.memory: missing"},
      {"memory bandwidth zero",
       replace(v, R"("memory": {"bandwidth_GBps": 30)", R"("memory": {"bandwidth_GBps": 0)"),
       "t.json: $.memory.bandwidth_GBps: expected a number > 0, got 0"},
      {"memory not an object",
       replace(v, R"("memory": {"bandwidth_GBps": 30, "capacity_GB": 16})", R"("memory": 30)"),
       "t.json: $.memory: expected an object, got 30"},
      {"unknown collectives", replace(v, R"("collectives": "mpi")", R"("collectives": "gloo")"),
       "t.json: $.collectives: expected \"mpi\" or \"nccl\", got \"gloo\""},
      {"negative overhead",
       replace(v, R"("collective_overhead_us": 1.5)", R"("collective_overhead_us": -1)"),
       "t.json: $.collective_overhead_us: expected a number >= 0, got -1"},
      {"links_per_node zero", replace(v, R"("links_per_node": 1)", R"("links_per_node": 0)"),
       "t.json: $.levels[1].links_per_node: expected an integer in [1, 1048576], got 0"},
      {"source not a string", replace(v, R"(["made up for a test"])", R"(["ok", 3])"),
       "t.json: $.sources[1]: expected a string, got 3"},
      {"ranks overflow", replace(v, R"("ranks_per_node": 4)", R"("ranks_per_node": 1048576)"),
       "t.json: topology 'two-by-four': nodes * ranks_per_node = 2097152 exceeds 1048576"},
  };
  for (const BadCase& c : cases) {
    Result<Topology> t = parse_topology_json(c.text, "t.json");
    ASSERT_FALSE(t.is_ok()) << c.what << ": parsed although malformed";
    EXPECT_EQ(t.status().code(), Code::kInvalidArgument) << c.what;
    EXPECT_NE(t.status().message().find(c.expect), std::string::npos)
        << c.what << "\n  got:      " << t.status().message() << "\n  expected: " << c.expect;
  }
}

TEST(TopologyFile, LoadsFromFileAndNamesMissingFiles) {
  char path[] = "/tmp/treeattn_topo_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream out(path);
    out << kValid;
  }
  Result<Topology> t = load_topology(path);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->name, "two-by-four");
  {
    std::ofstream out(path);
    out << replace(kValid, R"("nodes": 2)", R"("nodes": -1)");
  }
  Result<Topology> bad = load_topology(path);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find(std::string(path) + ": $.nodes"), std::string::npos)
      << bad.status().message();
  std::remove(path);
  Result<Topology> missing = load_topology("/nonexistent/topo.json");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("cannot open topology file '/nonexistent/topo.json'"),
            std::string::npos)
      << missing.status().message();
}

TEST(TopologyFile, NetworkCallOverheadParsesAndRoundTrips) {
  auto t = parse_topology_json(replace(kValid, R"("links_per_node": 1})",
                                       R"("links_per_node": 1, "call_overhead_us": 5400})"),
                               "t.json");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE(t->network.has_value());
  EXPECT_DOUBLE_EQ(t->network->call_overhead_us, 5400.0);
  auto back = parse_topology_json(topology_to_json(*t), "dump");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, *t);
  // Absent means 0, and 0 is not written out.
  auto plain = parse_topology_json(kValid, "t.json");
  ASSERT_TRUE(plain.is_ok());
  EXPECT_DOUBLE_EQ(plain->network->call_overhead_us, 0.0);
  EXPECT_EQ(topology_to_json(*plain).find("call_overhead_us"), std::string::npos);
}

// The user-defined-reduction allreduce's extra (topo --detect's user_op_overhead_us) on either
// level: parsed, written back, absent in older files (0: the merge priced like a built-in
// allreduce), and refused when negative.
TEST(TopologyFile, UserOpOverheadParsesAndRoundTripsOnBothLevels) {
  std::string text = replace(kValid, R"("links_per_node": 1})",
                             R"("links_per_node": 1, "user_op_overhead_us": 640.5})");
  text = replace(text, R"("bandwidth_GBps": 9})", R"("bandwidth_GBps": 9, "user_op_overhead_us": 12})");
  auto t = parse_topology_json(text, "t.json");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_DOUBLE_EQ(t->node.user_op_overhead_us, 12.0);
  EXPECT_DOUBLE_EQ(t->network->user_op_overhead_us, 640.5);
  const std::string dumped = topology_to_json(*t);
  EXPECT_NE(dumped.find("\"user_op_overhead_us\": 640.5"), std::string::npos) << dumped;
  auto back = parse_topology_json(dumped, "dump");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, *t);
  // A file written before the field existed: both 0, and 0 is not written out.
  auto old = parse_topology_json(kValid, "old.json");
  ASSERT_TRUE(old.is_ok()) << old.status().to_string();
  EXPECT_DOUBLE_EQ(old->node.user_op_overhead_us, 0.0);
  EXPECT_DOUBLE_EQ(old->network->user_op_overhead_us, 0.0);
  EXPECT_EQ(topology_to_json(*old).find("user_op_overhead_us"), std::string::npos);
  auto old_back = parse_topology_json(topology_to_json(*old), "dump");
  ASSERT_TRUE(old_back.is_ok());
  EXPECT_EQ(*old_back, *old);
  // Negative: the error names the file, the path and what is expected.
  auto bad = parse_topology_json(replace(kValid, R"("links_per_node": 1})",
                                         R"("links_per_node": 1, "user_op_overhead_us": -3})"),
                                 "t.json");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("t.json: $.levels[1].user_op_overhead_us: expected a "
                                        "number >= 0, got -3"),
            std::string::npos)
      << bad.status().message();
  // From measured numbers (topo --detect): each level gets its own.
  MeasuredTopology m;
  m.nodes = 2;
  m.ranks_per_node = 2;
  m.memory_bandwidth_GBps = 10;
  m.intra_latency_us = 1;
  m.intra_bandwidth_GBps = 5;
  m.inter_latency_us = 30;
  m.inter_bandwidth_GBps = 0.1;
  m.intra_user_op_overhead_us = 7;
  m.inter_user_op_overhead_us = 900;
  auto mt = topology_from_measurements(m);
  ASSERT_TRUE(mt.is_ok()) << mt.status().to_string();
  EXPECT_DOUBLE_EQ(mt->node.user_op_overhead_us, 7.0);
  EXPECT_DOUBLE_EQ(mt->network->user_op_overhead_us, 900.0);
}

TEST(TopologyPresets, AllLoadValidateAndRoundTrip) {
  for (const std::string& name : preset_names()) {
    Result<Topology> t = load_topology("preset:" + name);
    ASSERT_TRUE(t.is_ok()) << name << ": " << t.status().to_string();
    EXPECT_EQ(t->name, name);
    EXPECT_TRUE(t->validate().is_ok()) << name;
    EXPECT_FALSE(t->sources.empty()) << name << " has no sources";
    Result<Topology> back = parse_topology_json(topology_to_json(*t), name);
    ASSERT_TRUE(back.is_ok()) << name << ": " << back.status().to_string();
    EXPECT_EQ(*back, *t) << name;
  }
}

TEST(TopologyPresets, PaperClustersHaveThePapersNumbers) {
  Result<Topology> dgx = preset_topology("dgx-h100x16");
  ASSERT_TRUE(dgx.is_ok());
  EXPECT_EQ(dgx->total_ranks(), 128);
  EXPECT_EQ(dgx->ranks_per_node, 8);
  EXPECT_DOUBLE_EQ(dgx->node.bandwidth_GBps * 2, 900.0);      // NVLink 900 GB/s bidirectional
  EXPECT_DOUBLE_EQ(dgx->network->bandwidth_GBps * 8, 400.0);  // 400 Gb/s per GPU
  EXPECT_EQ(dgx->network->links_per_node, 8);
  EXPECT_DOUBLE_EQ(dgx->memory_bandwidth_GBps, 3350.0);
  EXPECT_EQ(dgx->collectives, CollectiveLibrary::kNccl);
  Result<Topology> mi = preset_topology("mi300x4");
  ASSERT_TRUE(mi.is_ok());
  EXPECT_EQ(mi->total_ranks(), 4);
  EXPECT_DOUBLE_EQ(mi->memory_bandwidth_GBps, 5300.0);
  Result<Topology> rtx = preset_topology("rtx4090x2");
  ASSERT_TRUE(rtx.is_ok());
  EXPECT_EQ(rtx->total_ranks(), 2);
  EXPECT_DOUBLE_EQ(rtx->memory_bandwidth_GBps, 1008.0);
}

TEST(TopologyPresets, UnknownPresetListsTheKnownOnes) {
  Result<Topology> t = load_topology("preset:dgx-b200");
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("unknown topology preset 'dgx-b200'"), std::string::npos);
  EXPECT_NE(t.status().message().find("dgx-h100x16, mi300x4, rtx4090x2"), std::string::npos)
      << t.status().message();
}

TEST(TopologyValidate, RejectsInconsistentValues) {
  Topology t;
  t.name = "x";
  t.memory_bandwidth_GBps = 10;
  EXPECT_TRUE(t.validate().is_ok());
  t.nodes = 2;  // no network level
  EXPECT_NE(t.validate().message().find("needs a \"network\" level"), std::string::npos);
  t.network = LinkLevel{"network", 10, 1, 1};
  EXPECT_TRUE(t.validate().is_ok());
  t.network->bandwidth_GBps = 0;
  EXPECT_NE(t.validate().message().find("level network.bandwidth_GBps must be a number > 0, got 0"),
            std::string::npos)
      << t.validate().message();
  t.network->bandwidth_GBps = 1;
  t.memory_bandwidth_GBps = -1;
  EXPECT_NE(t.validate().message().find("memory.bandwidth_GBps must be > 0, got -1"),
            std::string::npos);
}

TEST(TopologyMeasured, BuildsFromMeasuredNumbers) {
  MeasuredTopology m;
  m.nodes = 2;
  m.ranks_per_node = 2;
  m.memory_bandwidth_GBps = 31.5;
  m.intra_latency_us = 0.5;
  m.intra_bandwidth_GBps = 8.8;
  m.inter_latency_us = 12.4;
  m.inter_bandwidth_GBps = 0.121;
  m.max_concurrent_ranks = 2;
  Result<Topology> t = topology_from_measurements(m);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->total_ranks(), 4);
  EXPECT_DOUBLE_EQ(t->network->bandwidth_GBps, 0.121);
  EXPECT_DOUBLE_EQ(t->node.latency_us, 0.5);
  Result<Topology> back = parse_topology_json(topology_to_json(*t), "detected");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, *t);

  m.inter_bandwidth_GBps.reset();
  Result<Topology> bad = topology_from_measurements(m);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("nodes = 2 needs the inter-node latency and bandwidth"),
            std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace treeattn
