// Regression tests for topology files that used to crash the loader (issue 12): numbers that
// overflow a double (an uncaught out_of_range), nesting deep enough to overflow the stack,
// duplicate keys that were silently accepted, and files far too large to be a topology. Each
// must fail with an error naming the file and, where there is one, the JSON path of the value.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "treeattn/topology.hpp"

namespace treeattn {
namespace {

constexpr const char* kFile = R"({
  "format": "treeattn-topology/1",
  "name": "strict",
  "nodes": 1,
  "ranks_per_node": 2,
  "memory": {"bandwidth_GBps": 30},
  "levels": [{"name": "node", "latency_us": 0.5, "bandwidth_GBps": 9}]
})";

std::string with(const std::string& from, const std::string& to) {
  std::string s = kFile;
  const auto pos = s.find(from);
  EXPECT_NE(pos, std::string::npos) << "test bug: '" << from << "' not in the file";
  if (pos != std::string::npos) s.replace(pos, from.size(), to);
  return s;
}

void expect_error(const std::string& text, const std::string& expect) {
  Result<Topology> t = parse_topology_json(text, "t.json");
  ASSERT_FALSE(t.is_ok()) << "parsed: " << text.substr(0, 200);
  EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
  EXPECT_NE(t.status().message().find(expect), std::string::npos)
      << "\n  got:      " << t.status().message() << "\n  expected: " << expect;
}

TEST(TopologyStrict, TheBaseFileParses) {
  Result<Topology> t = parse_topology_json(kFile, "t.json");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->ranks_per_node, 2);
}

TEST(TopologyStrict, NumberOverflowingADoubleNamesTheKey) {
  expect_error(with("\"bandwidth_GBps\": 9", "\"bandwidth_GBps\": 1e400"),
               "t.json: $.levels[0].bandwidth_GBps: the number 1e400 (5 characters) does not fit "
               "in a double");
  expect_error(with("\"bandwidth_GBps\": 30", "\"bandwidth_GBps\": -1e400"),
               "t.json: $.memory.bandwidth_GBps: the number -1e400");
  // A 5000-digit integer: too large for 64 bits, and then for a double.
  expect_error(with("\"nodes\": 1", "\"nodes\": " + std::string(5000, '7')),
               "t.json: $.nodes: the number 777");
  expect_error(with("\"nodes\": 1", "\"nodes\": " + std::string(5000, '7')),
               "(5000 characters) does not fit in a double");
}

TEST(TopologyStrict, TinyNumbersUnderflowToZeroAndAreRejectedByRange) {
  // 1e-400 is a valid JSON number that rounds to 0: the range check names it.
  expect_error(with("\"latency_us\": 0.5", "\"latency_us\": 1e-400"),
               "t.json: $.levels[0].latency_us: expected a number > 0");
}

TEST(TopologyStrict, DeepNestingIsRejectedWithoutRecursion) {
  // 60,000 levels: the plain parser accepted it and printing it overflowed the stack.
  const std::string arrays = std::string(60000, '[') + std::string(60000, ']');
  expect_error(arrays, "t.json: $[0][0]");
  expect_error(arrays, "nested deeper than 64 levels");
  std::string objects;
  for (int i = 0; i < 60000; ++i) objects += "{\"a\":";
  objects += "1" + std::string(60000, '}');
  expect_error(objects, "t.json: $.a.a.a");
  // Inside a real file, under a known key.
  expect_error(with("\"name\": \"strict\"", "\"name\": \"strict\", \"sources\": " +
                                              std::string(100, '[') + std::string(100, ']')),
               "t.json: $.sources[0][0]");
  // Moderate nesting (not a topology, but not absurd) reaches the schema check instead.
  expect_error(std::string(10, '[') + std::string(10, ']'), "t.json: $: expected an object");
}

TEST(TopologyStrict, DuplicateKeysAreRejected) {
  expect_error(with("\"nodes\": 1,", "\"nodes\": 1, \"nodes\": 2,"),
               "t.json: $.nodes: duplicate key (each key may appear once per object)");
  expect_error(with("\"latency_us\": 0.5", "\"latency_us\": 0.5, \"latency_us\": 0.7"),
               "t.json: $.levels[0].latency_us: duplicate key");
  // The same key in two different objects is fine.
  Result<Topology> t = parse_topology_json(kFile, "t.json");
  EXPECT_TRUE(t.is_ok());
}

TEST(TopologyStrict, SyntaxErrorsStillSayWhere) {
  expect_error("{\"format\": ", "t.json: not valid JSON: parse error at line 1");
  expect_error("", "t.json: not valid JSON");
  expect_error(std::string(kFile) + " trailing", "t.json: not valid JSON");
}

TEST(TopologyStrict, LoadingNamesTheFileAndRefusesHugeFiles) {
  char path[] = "/tmp/treeattn_strict_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream out(path);
    out << with("\"bandwidth_GBps\": 9", "\"bandwidth_GBps\": 1e400");
  }
  Result<Topology> t = load_topology(path);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find(std::string(path) + ": $.levels[0].bandwidth_GBps"),
            std::string::npos)
      << t.status().message();
  {
    std::ofstream out(path);
    out << std::string((16u << 20) + 10, ' ');
  }
  t = load_topology(path);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("is larger than 16 MiB"), std::string::npos)
      << t.status().message();
  std::remove(path);
  // A device that never ends.
  t = load_topology("/dev/zero");
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("'/dev/zero' is larger than 16 MiB"), std::string::npos)
      << t.status().message();
}

}  // namespace
}  // namespace treeattn
