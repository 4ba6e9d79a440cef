// mem_available_bytes: see host_memory.hpp.
#include "treeattn/host_memory.hpp"

#include <fstream>
#include <string>

namespace treeattn {

uint64_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoull(line.substr(13)) * 1024;
  return 0;
}

}  // namespace treeattn
