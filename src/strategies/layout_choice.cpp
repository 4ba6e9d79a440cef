// host_kv_layout(workload) and choose_kv_layout(..., workload) (strategy.hpp): the KV layout
// measured per workload on this CPU, kept in the process and in a cache file.
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include "treeattn/kv_tiles.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {

namespace {

std::filesystem::path cache_file() {
  const char* dir = std::getenv("TREEATTN_CACHE_DIR");
  if (dir != nullptr && *dir != '\0') return std::filesystem::path(dir) / "kv-layout.tsv";
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && *xdg != '\0')
    return std::filesystem::path(xdg) / "treeattn" / "kv-layout.tsv";
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home != '\0')
    return std::filesystem::path(home) / ".cache" / "treeattn" / "kv-layout.tsv";
  return {};
}

bool measuring_enabled() {
  const char* e = std::getenv("TREEATTN_KV_LAYOUT_MEASURE");
  return e == nullptr || std::string(e) != "0";
}

// One line of the file: KEY \t LAYOUT \t rows ms \t tiled ms \t tokens.
struct Entry {
  KVLayout layout = KVLayout::kRows;
  std::string numbers;  // "rows 12.3 ms, tiled 10.1 ms (N tokens)"
};

std::string numbers_text(double rows_ms, double tiled_ms, long long tokens) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "rows %.2f ms, tiled %.2f ms over %lld tokens", rows_ms, tiled_ms,
                tokens);
  return buf;
}

// The file's last line for `key`, if any.
bool read_cached(const std::filesystem::path& file, const std::string& key, Entry& out) {
  std::ifstream in(file);
  if (!in) return false;
  std::string line;
  bool found = false;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string k, layout;
    double rows_ms = 0, tiled_ms = 0;
    long long tokens = 0;
    if (!std::getline(fields, k, '\t') || k != key) continue;
    if (!std::getline(fields, layout, '\t') || !(fields >> rows_ms >> tiled_ms >> tokens)) continue;
    if (layout != "rows" && layout != "tiled") continue;
    out.layout = layout == "rows" ? KVLayout::kRows : KVLayout::kTiled;
    out.numbers = numbers_text(rows_ms, tiled_ms, tokens);
    found = true;
  }
  return found;
}

// Appends one line with a single write (O_APPEND), so that ranks writing at once do not mix
// their lines. Failures are ignored: the next process measures again.
void append_cached(const std::filesystem::path& file, const std::string& line) {
  std::error_code ec;
  std::filesystem::create_directories(file.parent_path(), ec);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  const ssize_t n = ::write(fd, line.data(), line.size());
  (void)n;
  ::close(fd);
}

// The kernel options a workload's calls run with: kAuto is best_isa(), 0 threads what OpenMP
// offers (what the key names and what the timing runs).
DecodeOptions resolved_kernel(const KVLayoutWorkload& w) {
  DecodeOptions o = w.kernel;
  if (o.isa == Isa::kAuto) o.isa = best_isa();
  if (o.threads <= 0) o.threads = omp_get_max_threads();
  return o;
}

}  // namespace

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      std::string m = colon == std::string::npos ? line : line.substr(colon + 1);
      while (!m.empty() && (m.front() == ' ' || m.front() == '\t')) m.erase(m.begin());
      for (char& c : m)
        if (c == '\t' || c == '|') c = ' ';
      return m;
    }
  return "unknown CPU";
}

std::string kv_layout_cache_key(const KVLayoutWorkload& w) {
  static const std::string model = cpu_model_name();
  const DecodeOptions o = resolved_kernel(w);
  const Isa isa = o.isa;
  const int threads = o.threads;
  // v1: the kernels as of this key's introduction; a kernel change that moves the balance
  // between the layouts bumps it, so that older lines are no longer read.
  return "v1|" + model + "|" + std::string(isa_name(isa)) + "|H" + std::to_string(w.shape.heads) +
         "|Hkv" + std::to_string(w.shape.kv_heads) + "|D" + std::to_string(w.shape.head_dim) +
         "|Q" + std::to_string(w.shape.q_len) + "|" + std::string(dtype_name(w.dtype)) + "|T" +
         std::to_string(threads);
}

HostKVLayout host_kv_layout(const KVLayoutWorkload& w) {
  const DecodeOptions o = resolved_kernel(w);
  const Isa isa = o.isa;
  if (!measuring_enabled())
    return {host_kv_layout(isa), "by the CPU's kernel target (TREEATTN_KV_LAYOUT_MEASURE=0)"};
  const std::string key = kv_layout_cache_key(w);
  static std::mutex mu;
  static std::map<std::string, HostKVLayout> known;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(key); it != known.end()) return it->second;
  const std::filesystem::path file = cache_file();
  Entry e;
  HostKVLayout out;
  if (!file.empty() && read_cached(file, key, e)) {
    out = {e.layout, "measured before (" + file.string() + "): " + e.numbers};
  } else {
    auto t = time_kv_layouts(w.shape, w.dtype, o);
    if (!t.is_ok()) {
      // Kept in the process (not in the file), so that later sessions do not try again.
      out = {host_kv_layout(isa), "by the CPU's kernel target (the measurement failed: " +
                                      t.status().message() + ")"};
      known.emplace(key, out);
      return out;
    }
    const KVLayout l = t->tiled_seconds < t->rows_seconds ? KVLayout::kTiled : KVLayout::kRows;
    const double rows_ms = t->rows_seconds * 1e3, tiled_ms = t->tiled_seconds * 1e3;
    out = {l, "measured: " + numbers_text(rows_ms, tiled_ms, static_cast<long long>(t->tokens))};
    if (!file.empty()) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "\t%.4f\t%.4f\t%lld\n", rows_ms, tiled_ms,
                    static_cast<long long>(t->tokens));
      append_cached(file, key + "\t" + std::string(kv_layout_name(l)) + buf);
    }
  }
  known.emplace(key, out);
  return out;
}

Result<KVLayout> choose_kv_layout(KVLayout requested, MemorySpace memory,
                                  std::span<const std::string> strategies,
                                  const KVLayoutWorkload& workload) {
  auto layout = choose_kv_layout(requested, memory, strategies);
  TREEATTN_RETURN_IF_ERROR(layout.status());
  if (requested != KVLayout::kAuto || memory != MemorySpace::kHost) return layout;
  return host_kv_layout(workload).layout;
}

}  // namespace treeattn
