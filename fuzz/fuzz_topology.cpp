// libFuzzer target: the topology file loader (parse_topology_json, docs/topology.md) on
// arbitrary bytes. Any input must give a Topology or a Status, never a crash, an exception, a
// stack overflow or a sanitizer report; an accepted topology must survive a round trip through
// topology_to_json unchanged (the loader's own contract).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string_view>

#include "treeattn/topology.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  treeattn::Result<treeattn::Topology> t = treeattn::parse_topology_json(text, "fuzz.json");
  if (!t.is_ok()) {
    if (t.status().message().rfind("fuzz.json", 0) != 0) {
      std::fprintf(stderr, "error without the file name: %s\n", t.status().message().c_str());
      __builtin_trap();
    }
    return 0;
  }
  const std::string dumped = treeattn::topology_to_json(*t);
  treeattn::Result<treeattn::Topology> again = treeattn::parse_topology_json(dumped, "dumped");
  if (!again.is_ok() || !(*again == *t)) {
    std::fprintf(stderr, "round trip failed: %s\n%s\n",
                 again.is_ok() ? "different topology" : again.status().message().c_str(),
                 dumped.c_str());
    __builtin_trap();
  }
  return 0;
}
