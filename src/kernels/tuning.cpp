// The kernel tuning cache (tuning.hpp): its key and path, the file format, the process's state
// (read at the first kernel call), the lookup the drivers make, and the store.
//
// The file, one line each:
//   treeattn kernel tuning 2
//   key <CPU model> (family F model M stepping S)|<ISA>|<build>
//   entry <dtype> <head_dim> <group> <threads> tiled_prefetch=N tiled_level=l1|l2
//         paged_prefetch=N paged_level=l1|l2 rows_prefetch=N order=heads|chunks
//         layout=rows|tiled probe_gbps=X kernel_gbps=X                         (one line)
//   matmul <threads> tile_bytes=N gops=X                                            (any number)
//   end <number of entries and matmul lines>
// Anything else (a missing or extra line, an unknown field, a value out of range, two entries
// of one key) makes the whole file corrupt: it is ignored with a warning, never half used.
#include "treeattn/tuning.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <utility>

#include "kernels/build_id.hpp"
#include "kernels/cpu/cpu_targets.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {

namespace {

constexpr const char* kHeader = "treeattn kernel tuning 2";
// The most bytes a lead may be (also what the environment's overrides accept).
constexpr int64_t kMaxLead = int64_t{1} << 20;

// "name : value" lines of /proc/cpuinfo's first processor.
std::string cpuinfo_field(const std::string& name) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) break;  // the first processor's block only
    if (line.rfind(name, 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    if (key != name) continue;
    std::string v = line.substr(colon + 1);
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.erase(v.begin());
    for (char& c : v)
      if (c == '\t' || c == '|' || c == '\n' || c == '\r') c = ' ';
    return v;
  }
  return "";
}

std::filesystem::path cache_dir() {
  const char* dir = std::getenv("TREEATTN_CACHE_DIR");
  if (dir != nullptr && *dir != '\0') return dir;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && *xdg != '\0') return std::filesystem::path(xdg) / "treeattn";
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home != '\0') return std::filesystem::path(home) / ".cache" / "treeattn";
  return {};
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The first rank of this host in an MPI job, or a process outside one: who prints warnings.
bool first_on_host() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return std::string(v) == "0";
  return true;
}

// ---- the file format --------------------------------------------------------------------

std::string entry_line(const TuneEntry& e) {
  char buf[384];
  std::snprintf(buf, sizeof buf,
                "entry %s %lld %lld %d tiled_prefetch=%lld tiled_level=%s paged_prefetch=%lld "
                "paged_level=%s rows_prefetch=%lld order=%s layout=%s probe_gbps=%.3f "
                "kernel_gbps=%.3f",
                std::string(dtype_name(e.key.dtype)).c_str(),
                static_cast<long long>(e.key.head_dim), static_cast<long long>(e.key.group),
                e.key.threads, static_cast<long long>(e.choice.tiled_prefetch),
                e.choice.tiled_l2 ? "l2" : "l1", static_cast<long long>(e.choice.paged_prefetch),
                e.choice.paged_l2 ? "l2" : "l1",
                static_cast<long long>(e.choice.rows_prefetch),
                e.choice.chunks_outer ? "chunks" : "heads",
                std::string(kv_layout_name(e.choice.layout)).c_str(), e.probe_gbps,
                e.kernel_gbps);
  return buf;
}

// A whole decimal integer in [lo, hi].
bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t& out) {
  if (s.empty() || s.size() > 18) return false;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v < lo || v > hi) return false;
  out = v;
  return true;
}

// One of two words: `no` (out = false) or `yes` (out = true).
bool parse_pick(const std::string& s, const char* no, const char* yes, bool& out) {
  if (s != no && s != yes) return false;
  out = s == yes;
  return true;
}

bool parse_gbps(const std::string& s, double& out) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v < 0) return false;
  out = v;
  return true;
}

// One entry line, or why not.
std::string parse_entry(const std::string& line, TuneEntry& e) {
  std::istringstream in(line);
  std::string word, dtype, d, g, t;
  if (!(in >> word >> dtype >> d >> g >> t) || word != "entry") return "not an entry line";
  const auto dt = parse_dtype(dtype);
  if (!dt) return "unknown dtype '" + dtype + "'";
  e.key.dtype = *dt;
  int64_t v = 0;
  if (!parse_int(d, 1, 4096, e.key.head_dim)) return "bad head_dim '" + d + "'";
  if (!parse_int(g, 1, 4096, e.key.group)) return "bad group '" + g + "'";
  if (!parse_int(t, 1, kMaxThreads, v)) return "bad threads '" + t + "'";
  e.key.threads = static_cast<int>(v);
  // Every field of the line: its name and how its value is read (false: a bad value).
  bool rows_layout = false;
  const std::pair<const char*, std::function<bool(const std::string&)>> fields[] = {
      {"tiled_prefetch",
       [&](const std::string& x) { return parse_int(x, 0, kMaxLead, e.choice.tiled_prefetch); }},
      {"tiled_level",
       [&](const std::string& x) { return parse_pick(x, "l1", "l2", e.choice.tiled_l2); }},
      {"paged_prefetch",
       [&](const std::string& x) { return parse_int(x, 0, kMaxLead, e.choice.paged_prefetch); }},
      {"paged_level",
       [&](const std::string& x) { return parse_pick(x, "l1", "l2", e.choice.paged_l2); }},
      {"rows_prefetch",
       [&](const std::string& x) { return parse_int(x, 0, kMaxLead, e.choice.rows_prefetch); }},
      {"order",
       [&](const std::string& x) { return parse_pick(x, "heads", "chunks", e.choice.chunks_outer); }},
      {"layout", [&](const std::string& x) { return parse_pick(x, "tiled", "rows", rows_layout); }},
      {"probe_gbps", [&](const std::string& x) { return parse_gbps(x, e.probe_gbps); }},
      {"kernel_gbps", [&](const std::string& x) { return parse_gbps(x, e.kernel_gbps); }},
  };
  bool seen[std::size(fields)] = {};
  std::string field;
  while (in >> field) {
    const auto eq = field.find('=');
    if (eq == std::string::npos) return "field '" + field + "' has no value";
    const std::string name = field.substr(0, eq), value = field.substr(eq + 1);
    std::size_t which = 0;
    while (which < std::size(fields) && name != fields[which].first) ++which;
    if (which == std::size(fields)) return "unknown field '" + name + "'";
    if (!fields[which].second(value)) return "bad value '" + value + "' for " + name;
    if (seen[which]) return name + " given twice";
    seen[which] = true;
  }
  for (bool s : seen)
    if (!s) return "an entry lacks a field";
  e.choice.layout = rows_layout ? KVLayout::kRows : KVLayout::kTiled;
  return "";
}

std::string matmul_line(const MatmulTuneEntry& m) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "matmul %d tile_bytes=%lld gops=%.3f", m.threads,
                static_cast<long long>(m.tile_bytes), m.gops);
  return buf;
}

// One matmul line, or why not.
std::string parse_matmul(const std::string& line, MatmulTuneEntry& m) {
  std::istringstream in(line);
  std::string word, t, tile, gops, extra;
  if (!(in >> word >> t >> tile >> gops) || word != "matmul") return "not a matmul line";
  if (in >> extra) return "a matmul line has more than three fields";
  int64_t v = 0;
  if (!parse_int(t, 1, kMaxThreads, v)) return "bad threads '" + t + "'";
  m.threads = static_cast<int>(v);
  if (tile.rfind("tile_bytes=", 0) != 0 ||
      !parse_int(tile.substr(11), 4096, int64_t{64} << 20, m.tile_bytes))
    return "bad field '" + tile + "'";
  if (gops.rfind("gops=", 0) != 0 || !parse_gbps(gops.substr(5), m.gops))
    return "bad field '" + gops + "'";
  return "";
}

// Reads `path` into `entries` for `key`. kNone when there is no file; kIgnored with `why` when
// it does not parse or is for another key; kCache otherwise.
TuningState::Source read_file(const std::string& path, const std::string& key,
                              std::vector<TuneEntry>& entries,
                              std::vector<MatmulTuneEntry>& matmul, std::string& why) {
  std::ifstream in(path);
  if (!in) return TuningState::Source::kNone;
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  auto corrupt = [&](const std::string& what) {
    why = "it is corrupt (" + what + ")";
    return TuningState::Source::kIgnored;
  };
  if (lines.empty() || lines[0] != kHeader) return corrupt("no '" + std::string(kHeader) + "' line");
  if (lines.size() < 3 || lines[1].rfind("key ", 0) != 0) return corrupt("no key line");
  const std::string file_key = lines[1].substr(4);
  std::vector<TuneEntry> got;
  std::vector<MatmulTuneEntry> got_matmul;
  std::size_t i = 2;
  for (; i < lines.size() && lines[i].rfind("entry ", 0) == 0; ++i) {
    TuneEntry e;
    if (const std::string bad = parse_entry(lines[i], e); !bad.empty())
      return corrupt("line " + std::to_string(i + 1) + ": " + bad);
    for (const TuneEntry& o : got)
      if (o.key == e.key) return corrupt("two entries for " + e.key.to_string());
    got.push_back(e);
  }
  for (; i < lines.size() && lines[i].rfind("matmul ", 0) == 0; ++i) {
    MatmulTuneEntry m;
    if (const std::string bad = parse_matmul(lines[i], m); !bad.empty())
      return corrupt("line " + std::to_string(i + 1) + ": " + bad);
    for (const MatmulTuneEntry& o : got_matmul)
      if (o.threads == m.threads)
        return corrupt("two matmul lines for " + std::to_string(m.threads) + " threads");
    got_matmul.push_back(m);
  }
  const std::size_t n = got.size() + got_matmul.size();
  if (i + 1 != lines.size() || lines[i] != "end " + std::to_string(n))
    return corrupt("it does not end with 'end " + std::to_string(n) + "'");
  if (file_key != key) {
    why = "it was tuned for " + file_key + ", not this " + key;
    return TuningState::Source::kIgnored;
  }
  entries = std::move(got);
  matmul = std::move(got_matmul);
  return TuningState::Source::kCache;
}

// ---- the process's state ----------------------------------------------------------------

std::mutex g_mu;
// Replaced by reload and store, never freed (a few per process), so that references handed
// out stay valid.
std::atomic<const TuningState*> g_state{nullptr};

const TuningState* load_state() {
  auto* s = new TuningState();
  s->key = tuning_cache_key();
  s->path = tuning_cache_path();
  s->isa = best_isa();
  if (tuning_skipped()) {
    s->source = TuningState::Source::kSkipped;
  } else if (s->path.empty()) {
    s->source = TuningState::Source::kNone;
  } else {
    s->source = read_file(s->path, s->key, s->entries, s->matmul, s->detail);
    if (s->source == TuningState::Source::kIgnored && first_on_host())
      std::fprintf(stderr,
                   "treeattn: warning: kernel tuning cache %s ignored: %s; the compiled-in "
                   "defaults are used (`treeattn tune` measures this CPU and rewrites it)\n",
                   s->path.c_str(), s->detail.c_str());
  }
  return s;
}

// Distance of an entry's group and threads from a call's: group first (it sets the arithmetic
// per byte), then threads (the share of the memory path each thread has).
std::pair<double, int> distance(const TuneKey& e, const TuneKey& want) {
  const double g = std::abs(std::log2(static_cast<double>(e.group) /
                                      static_cast<double>(std::max<int64_t>(1, want.group))));
  return {g, std::abs(e.threads - want.threads)};
}

}  // namespace

std::string TuneKey::to_string() const {
  return std::string(dtype_name(dtype)) + " D" + std::to_string(head_dim) + " G" +
         std::to_string(group) + " T" + std::to_string(threads);
}

TuneChoice tuning_defaults(const TuneKey& key, Isa isa) {
  TuneChoice c;
  c.tiled_prefetch = kernels::cpu::default_tiled_prefetch_bytes(key.dtype, key.head_dim);
  c.paged_prefetch = kernels::cpu::kTiledPrefetchBytes;
  c.rows_prefetch = kernels::cpu::kDefaultPrefetchBytes;
  c.chunks_outer = false;
  c.layout = host_kv_layout(isa);
  return c;
}

std::string cpu_model_name() {
  const std::string m = cpuinfo_field("model name");
  return m.empty() ? "unknown CPU" : m;
}

std::string tuning_cache_key() {
  static const std::string cpu = [] {
    std::string s = cpu_model_name();
    const std::string family = cpuinfo_field("cpu family"), model = cpuinfo_field("model"),
                      stepping = cpuinfo_field("stepping");
    if (!family.empty())
      s += " (family " + family + " model " + model + " stepping " + stepping + ")";
    return s;
  }();
  return cpu + "|" + std::string(isa_name(best_isa())) + "|" + TREEATTN_KERNEL_BUILD;
}

std::string tuning_cache_path() {
  const std::filesystem::path dir = cache_dir();
  if (dir.empty()) return "";
  char name[64];
  std::snprintf(name, sizeof name, "kernel-tuning-%016llx.txt",
                static_cast<unsigned long long>(fnv1a(tuning_cache_key())));
  return (dir / name).string();
}

bool tuning_skipped() {
  const char* e = std::getenv("TREEATTN_TUNE");
  if (e == nullptr) return false;
  const std::string v = e;
  return v == "0" || v == "off";
}

const TuningState& kernel_tuning() {
  if (const TuningState* s = g_state.load(std::memory_order_acquire)) return *s;
  std::lock_guard<std::mutex> lock(g_mu);
  if (const TuningState* s = g_state.load(std::memory_order_acquire)) return *s;
  const TuningState* s = load_state();
  g_state.store(s, std::memory_order_release);
  return *s;
}

void reload_kernel_tuning() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_state.store(load_state(), std::memory_order_release);
}

const TuneEntry* find_tuning(const TuneKey& key, Isa isa) {
  const TuningState& s = kernel_tuning();
  if (s.entries.empty() || isa != s.isa) return nullptr;
  const TuneEntry* best = nullptr;
  std::pair<double, int> best_d;
  for (const TuneEntry& e : s.entries) {
    if (e.key.dtype != key.dtype || e.key.head_dim != key.head_dim) continue;
    const auto d = distance(e.key, key);
    if (best == nullptr || d < best_d) {
      best = &e;
      best_d = d;
    }
  }
  return best;
}

TuneChoice tuned_choice(const TuneKey& key, Isa isa) {
  if (const TuneEntry* e = find_tuning(key, isa)) return e->choice;
  return tuning_defaults(key, isa);
}

int64_t tuned_matmul_tile_bytes(int threads, Isa isa) {
  const TuningState& s = kernel_tuning();
  if (s.matmul.empty() || isa != s.isa) return 0;
  const MatmulTuneEntry* best = &s.matmul[0];
  for (const MatmulTuneEntry& m : s.matmul)
    if (std::abs(m.threads - threads) < std::abs(best->threads - threads)) best = &m;
  return best->tile_bytes;
}

Status store_kernel_tuning(const std::vector<TuneEntry>& entries,
                           const std::vector<MatmulTuneEntry>& matmul) {
  const std::string path = tuning_cache_path();
  if (path.empty())
    return internal_error("no cache directory to store the kernel tuning in (set "
                          "TREEATTN_CACHE_DIR, XDG_CACHE_HOME or HOME)");
  const std::string key = tuning_cache_key();
  std::vector<TuneEntry> all;
  std::vector<MatmulTuneEntry> all_matmul;
  std::string why;
  (void)read_file(path, key, all, all_matmul, why);  // a file not ours (or corrupt) is replaced
  for (const TuneEntry& e : entries) {
    auto it = std::find_if(all.begin(), all.end(), [&](const TuneEntry& o) { return o.key == e.key; });
    if (it != all.end()) *it = e;
    else all.push_back(e);
  }
  for (const MatmulTuneEntry& m : matmul) {
    auto it = std::find_if(all_matmul.begin(), all_matmul.end(),
                           [&](const MatmulTuneEntry& o) { return o.threads == m.threads; });
    if (it != all_matmul.end()) *it = m;
    else all_matmul.push_back(m);
  }
  std::string text = std::string(kHeader) + "\nkey " + key + "\n";
  for (const TuneEntry& e : all) text += entry_line(e) + "\n";
  for (const MatmulTuneEntry& m : all_matmul) text += matmul_line(m) + "\n";
  text += "end " + std::to_string(all.size() + all_matmul.size()) + "\n";

  const std::filesystem::path p(path);
  std::error_code ec;
  std::filesystem::create_directories(p.parent_path(), ec);
  std::string tmpl = (p.parent_path() / ".kernel-tuning-XXXXXX").string();
  const int fd = ::mkstemp(tmpl.data());
  if (fd < 0)
    return internal_error("cannot write the kernel tuning cache in " +
                          p.parent_path().string() + ": cannot create a file there");
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  const bool written = done == text.size() && ::fchmod(fd, 0644) == 0;
  ::close(fd);
  if (!written || std::rename(tmpl.c_str(), path.c_str()) != 0) {
    std::remove(tmpl.c_str());
    return internal_error("cannot write the kernel tuning cache " + path);
  }
  reload_kernel_tuning();
  return Status::ok();
}

}  // namespace treeattn
