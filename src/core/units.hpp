// How the library's reports and the CLI write sizes and times for people: tokens with binary
// suffixes ("64k", "1M"), bytes in binary units ("1.50 GiB"), a duration in microseconds
// ("1.25 ms"), and printf into a string (the report texts the CLI prints). Header-only (no link
// dependency): the CLI's value parsers, which the fuzzers build on their own, share it
// (cli/options.hpp: parse_size reads what format_size writes).
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <string>

namespace treeattn {

// 65536 -> "64k", 3 << 20 -> "3M", 1000 -> "1000".
inline std::string format_size(int64_t tokens) {
  if (tokens >= (1 << 20) && tokens % (1 << 20) == 0) return std::to_string(tokens >> 20) + "M";
  if (tokens >= 1024 && tokens % 1024 == 0) return std::to_string(tokens >> 10) + "k";
  return std::to_string(tokens);
}

// "512 B", "1.50 KiB" ... "2.00 TiB" (1024 per step).
inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", bytes, units[u]);
  return buf;
}

// "12.5 us", "1.25 ms", "2.00 s".
inline std::string format_us(double us) {
  char buf[64];
  if (us >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2f s", us / 1e6);
  else if (us >= 1e3)
    std::snprintf(buf, sizeof buf, "%.2f ms", us / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.1f us", us);
  return buf;
}

// printf's format appended to out.
__attribute__((format(printf, 2, 3))) inline void appendf(std::string& out, const char* format,
                                                          ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  if (n > 0) {
    const std::size_t at = out.size();
    out.resize(at + static_cast<std::size_t>(n) + 1);
    std::vsnprintf(out.data() + at, static_cast<std::size_t>(n) + 1, format, again);
    out.resize(at + static_cast<std::size_t>(n));
  }
  va_end(again);
}

}  // namespace treeattn
