// Peak-RSS readings of this process (see include/treeattn/measure.hpp): getrusage for the
// lifetime peak, /proc/self/clear_refs and VmHWM for a peak that can be reset; a mapped file's
// resident bytes from /proc/self/smaps.
#include "treeattn/measure.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace treeattn {

double percentile(std::span<const double> values, double q) {
  if (values.empty()) return 0;
  std::vector<double> v(values.begin(), values.end());
  std::sort(v.begin(), v.end());
  const double at = std::clamp(q, 0.0, 1.0) * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(at));
  const std::size_t hi = std::min(v.size() - 1, lo + 1);
  const double f = at - static_cast<double>(lo);
  return v[lo] + f * (v[hi] - v[lo]);
}

int64_t peak_rss_bytes() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return -1;
  return static_cast<int64_t>(u.ru_maxrss) * 1024;  // Linux reports KiB
}

uint64_t mapped_file_rss(const std::string& path) {
  std::error_code ec;
  const std::string want = std::filesystem::canonical(path, ec).string();
  if (ec) return 0;
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool in = false;
  uint64_t kb = 0;
  while (std::getline(f, line)) {
    // A mapping's header: "start-end perms offset dev inode   pathname"; its fields follow.
    const std::size_t dash = line.find('-');
    if (dash != std::string::npos && dash > 0 &&
        std::isxdigit(static_cast<unsigned char>(line[0])) && line.find(':') > dash) {
      const std::size_t slash = line.find('/');
      in = slash != std::string::npos && line.compare(slash, std::string::npos, want) == 0;
    } else if (in && line.rfind("Rss:", 0) == 0) {
      kb += std::stoull(line.substr(4));
    }
  }
  return kb * 1024;
}

bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

uint64_t current_peak_rss() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  const int64_t lifetime = peak_rss_bytes();
  return lifetime > 0 ? static_cast<uint64_t>(lifetime) : 0;
}

}  // namespace treeattn
