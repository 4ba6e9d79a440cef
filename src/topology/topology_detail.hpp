// What topology.cpp (validation) and topology_json.cpp (the file format) share.
#pragma once

#include <cmath>
#include <sstream>
#include <string>

namespace treeattn::topology_detail {

// The largest node or rank count a topology may name.
constexpr int kMaxCount = 1 << 20;

inline std::string fmt_double(double v) {
  std::ostringstream os;
  os.precision(10);
  os << v;
  return os.str();
}

inline bool positive_finite(double v) { return std::isfinite(v) && v > 0; }

}  // namespace treeattn::topology_detail
