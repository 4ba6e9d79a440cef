// The topology file format in builds without nlohmann_json (TREEATTN_CORE_ONLY on a machine
// without it, such as tools/gpu-check.sh's bare GPU image): presets and built topologies work,
// parsing a file says why it cannot. topology_to_json is not defined in such builds.
#include <string>

#include "treeattn/topology.hpp"

namespace treeattn {

Result<Topology> parse_topology_json(std::string_view, std::string_view source) {
  return unsupported(std::string(source) +
                     ": this build reads no topology files (built without nlohmann_json, "
                     "TREEATTN_CORE_ONLY); use a preset (preset:NAME)");
}

}  // namespace treeattn
