// Shared CLI vocabulary (see options.hpp).
#include "options.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>


namespace treeattn::cli {

const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = {
      {"llama3-8b", 32, 8, 128, "Llama 3 / 3.1 8B: 32 query heads, 8 KV heads, D 128"},
      {"llama3-70b", 64, 8, 128, "Llama 3 70B: 64 query heads, 8 KV heads, D 128"},
      {"paper-block", 16, 16, 128, "the paper's microbenchmark block: 16 heads x 128, no GQA"},
      {"mha-64", 32, 32, 64, "plain multi-head attention with small heads: 32 x 64"},
  };
  return kPresets;
}

std::string preset_names() {
  std::string s;
  for (const auto& p : presets()) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// 128-bit intermediates for exact size arithmetic (GCC/Clang extension).
__extension__ typedef __int128 i128;

Result<int64_t> parse_size(const std::string& text) {
  if (text.empty()) return invalid_argument("empty size");
  const std::string bad = "'" + text +
                          "' is not a size (digits, an optional fraction and an optional suffix k "
                          "= 1024, M = 1024^2, G = 1024^3: 4096, 64k, 1M, 1.5M)";
  // Strictly [0-9]+ ( "." [0-9]+ )? [kKmMgG]?: no sign, exponent, hexadecimal or spaces, and a
  // suffix needs a number in front of it.
  std::size_t i = 0;
  i128 whole = 0, frac = 0, den = 1;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    if (whole > 1'000'000'000'000'000'000) return invalid_argument("size '" + text + "' is too large");
    whole = whole * 10 + (text[i++] - '0');
  }
  if (i == 0) return invalid_argument(bad);
  if (i < text.size() && text[i] == '.') {
    ++i;
    const std::size_t start = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
      if (den > 1'000'000'000'000'000) return invalid_argument(bad);  // 18 decimals is plenty
      frac = frac * 10 + (text[i++] - '0');
      den *= 10;
    }
    if (i == start) return invalid_argument(bad);
  }
  i128 mult = 1;
  if (i < text.size()) {
    const char c = text[i++];
    if (c == 'k' || c == 'K') mult = 1024;
    else if (c == 'm' || c == 'M') mult = 1024 * 1024;
    else if (c == 'g' || c == 'G') mult = 1024 * 1024 * 1024;
    else return invalid_argument(bad);
  }
  if (i != text.size()) return invalid_argument(bad);
  // The whole part alone past the limit: too large, before num * mult could overflow i128 (whole
  // and den each reach ~1e19).
  if (whole > static_cast<i128>(9'000'000'000'000'000) / mult)
    return invalid_argument("size '" + text + "' is too large");
  const i128 num = whole * den + frac;  // the value is num / den, times mult
  const i128 scaled = num * mult;
  if (scaled / den > static_cast<i128>(9'000'000'000'000'000))
    return invalid_argument("size '" + text + "' is too large");
  if (scaled % den != 0) {
    const auto lo = static_cast<long long>(scaled / den);
    return invalid_argument(fmt::format(
        "'{}' is {:.10g} tokens, not a whole number (use {} or {})", text,
        static_cast<double>(scaled) / static_cast<double>(den), lo, lo + 1));
  }
  return static_cast<int64_t>(scaled / den);
}

Result<int64_t> parse_bytes(const std::string& text) {
  std::string t = text;
  if (t.size() > 2 && (t.ends_with("iB") || t.ends_with("ib"))) t.resize(t.size() - 2);
  else if (t.size() > 1 && (t.back() == 'B' || t.back() == 'b')) t.pop_back();
  if (!t.empty() && (t.back() == 't' || t.back() == 'T')) {  // terabytes: G x 1024
    t.back() = 'G';
    auto g = parse_size(t);
    if (!g.is_ok()) return g.status();
    if (*g > std::numeric_limits<int64_t>::max() / 1024)
      return invalid_argument("'" + text + "' is too large");
    return *g * 1024;
  }
  auto b = parse_size(t);
  if (!b.is_ok())
    return invalid_argument("'" + text + "' is not a byte count (4096, 512K, 64M, 2G, 1.5G)");
  if (*b < 1) return invalid_argument("'" + text + "': the byte count must be >= 1");
  return b;
}

Result<std::vector<int64_t>> parse_size_list(const std::string& text) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(text)) {
    auto v = parse_size(item);
    if (!v.is_ok()) return v.status();
    out.push_back(*v);
  }
  if (out.empty()) return invalid_argument("empty list '" + text + "'");
  return out;
}

Result<int64_t> parse_count(const std::string& text, int64_t max) {
  if (text.empty() || text.size() > 18) return invalid_argument("'" + text + "' is not a count");
  int64_t v = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c)))
      return invalid_argument("'" + text + "' is not a count (decimal digits only)");
    v = v * 10 + (c - '0');
  }
  if (v > max) return invalid_argument("'" + text + "' is larger than " + std::to_string(max));
  return v;
}


void require_decimal_integers(CLI::App& app) {
  const CLI::Validator decimal(
      [](std::string& text) -> std::string {
        const std::size_t sign = !text.empty() && text[0] == '-' ? 1 : 0;
        if (text.size() == sign ||
            text.find_first_not_of("0123456789", sign) != std::string::npos)
          return "'" + text + "' is not a decimal integer (digits only: no hexadecimal, octal, " +
                 "binary, exponent or '+')";
        // Leading zeros would make strtoll read octal.
        const std::size_t first = std::min(text.find_first_not_of('0', sign), text.size() - 1);
        text = text.substr(0, sign) + text.substr(first);
        return "";
      },
      "", "decimal");
  for (CLI::Option* o : app.get_options()) {
    const std::string type = o->get_type_name();
    if (type.rfind("INT", 0) == 0 || type.rfind("UINT", 0) == 0) o->transform(decimal);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    require_decimal_integers(*sub);
}

Result<InjectSpec> parse_inject(const std::string& text) {
  const std::string usage = "--inject '" + text +
                            "': expected never-arrive:RANK@STEP, kill:RANK@STEP, nan:RANK, "
                            "slow:RANK:MS or mismatch:RANK";
  const auto colon = text.find(':');
  if (colon == std::string::npos) return invalid_argument(usage);
  const std::string kind = text.substr(0, colon), rest = text.substr(colon + 1);
  InjectSpec spec;
  std::string rank = rest;
  if (kind == "never-arrive" || kind == "kill") {
    spec.kind = kind == "kill" ? InjectSpec::Kind::kKill : InjectSpec::Kind::kNeverArrive;
    const auto at = rest.find('@');
    if (at == std::string::npos) return invalid_argument(usage + " (" + kind + " needs @STEP)");
    rank = rest.substr(0, at);
    auto step = parse_count(rest.substr(at + 1), 1 << 30);
    if (!step.is_ok()) return invalid_argument(usage + ": STEP " + step.status().message());
    spec.step = *step;
  } else if (kind == "slow") {
    spec.kind = InjectSpec::Kind::kSlow;
    const auto c2 = rest.find(':');
    if (c2 == std::string::npos) return invalid_argument(usage + " (slow needs :MS)");
    rank = rest.substr(0, c2);
    auto ms = parse_count(rest.substr(c2 + 1), 3'600'000);
    if (!ms.is_ok()) return invalid_argument(usage + ": MS " + ms.status().message());
    spec.ms = static_cast<int>(*ms);
  } else if (kind == "nan") {
    spec.kind = InjectSpec::Kind::kNan;
  } else if (kind == "mismatch") {
    spec.kind = InjectSpec::Kind::kMismatch;
  } else {
    return invalid_argument(usage);
  }
  auto r = parse_count(rank, 1 << 20);
  if (!r.is_ok()) return invalid_argument(usage + ": RANK " + r.status().message());
  spec.rank = static_cast<int>(*r);
  return spec;
}

std::string InjectSpec::to_string() const {
  switch (kind) {
    case Kind::kNone: return "none";
    case Kind::kNeverArrive: return fmt::format("never-arrive:{}@{}", rank, step);
    case Kind::kKill: return fmt::format("kill:{}@{}", rank, step);
    case Kind::kNan: return fmt::format("nan:{}", rank);
    case Kind::kSlow: return fmt::format("slow:{}:{}", rank, ms);
    case Kind::kMismatch: return fmt::format("mismatch:{}", rank);
  }
  return "?";
}

Status check_output_file(const std::string& flag, const std::string& path) {
  const std::string what = flag + " '" + path + "'";
  if (path.empty()) return invalid_argument(flag + ": empty path");
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return invalid_argument(what + " is a directory; give a file name in it (" +
                              (path.back() == '/' ? path : path + "/") + "out" +
                              (flag == "--plot" ? ".png" : flag == "--csv" ? ".csv" : ".json") +
                              ")");
    if (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode)) return Status::ok();  // /dev/stdout, a pipe
    const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);  // no O_TRUNC: leave it as it is
    if (fd < 0) return invalid_argument(what + " cannot be written: " + std::strerror(errno));
    close(fd);
    return Status::ok();
  }
  if (errno != ENOENT) return invalid_argument(what + " cannot be written: " + std::strerror(errno));
  // Create it now (and remove it again): the only test that sees read-only filesystems, /proc
  // and permissions exactly as the write after the run will.
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return invalid_argument(what + " cannot be created: " + std::strerror(errno));
  close(fd);
  unlink(path.c_str());
  return Status::ok();
}

Status check_plot_output(const std::string& flag, const std::string& path) {
  TREEATTN_RETURN_IF_ERROR(check_output_file(flag, path));
  const char* path_env = std::getenv("PATH");
  std::stringstream dirs(path_env != nullptr ? path_env : "/usr/bin:/bin");
  std::string d;
  while (std::getline(dirs, d, ':'))
    if (!d.empty() && access((d + "/gnuplot").c_str(), X_OK) == 0) return Status::ok();
  return invalid_argument(flag + " needs gnuplot, which is not installed (apt-get install "
                          "gnuplot-nox)");
}

Status prepare_output_dir(const std::string& flag, const std::string& dir) {
  const std::string what = flag + " '" + dir + "'";
  if (dir.empty()) return invalid_argument(flag + ": empty path");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return invalid_argument(what + ": cannot create the directory: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec))
    return invalid_argument(what + " exists and is not a directory");
  const std::string probe = dir + "/.treeattn-write-test-" + std::to_string(getpid());
  const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return invalid_argument(what + ": cannot create files in it: " + std::strerror(errno));
  close(fd);
  unlink(probe.c_str());
  return Status::ok();
}

Status check_range(const std::string& flag, int64_t value, int64_t min, int64_t max,
                   const std::string& why) {
  if (value >= min && value <= max) return Status::ok();
  return invalid_argument(fmt::format("{} {}: must be between {} and {}{}", flag, value, min, max,
                                      why.empty() ? "" : " (" + why + ")"));
}

Status check_timeout_ms(const std::string& flag, int64_t ms) {
  if (ms < 0)
    return invalid_argument(flag + " " + std::to_string(ms) +
                            ": must be >= 0 (milliseconds; 0 waits forever)");
  return Status::ok();
}

Result<Device> parse_device(const std::string& text) {
  if (text == "cpu") return Device::kCpu;
  if (text == "cuda") return Device::kCuda;
  return invalid_argument("--device '" + text + "': unknown device (known: cpu, cuda)");
}

const char* device_name(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

int fail(const char* cmd, const Status& s) {
  std::fprintf(stderr, "treeattn %s: error: %s\n", cmd, s.to_string().c_str());
  return 2;
}

int local_ranks(int world) {
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) return std::max(1, std::atoi(v));
  return world;
}

int default_threads(int ranks_here) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_here));
}

void ShapeFlags::add_to(CLI::App& app, bool lists) {
  app.add_option("--preset", preset, "Model shape preset: " + preset_names())->capture_default_str();
  if (lists && batch_list.empty()) batch_list = std::to_string(batch);
  if (lists)
    app.add_option("--batch", batch_list, "Batch rows (comma-separated list to sweep)")
        ->capture_default_str();
  else
    app.add_option("--batch", batch, "Batch rows (sequences decoded together)")->capture_default_str();
  app.add_option("--heads", heads, "Query heads")->capture_default_str();
  app.add_option("--kv-heads", kv_heads, "KV heads (grouped-query attention: divides --heads)")
      ->capture_default_str();
  app.add_option("--head-dim", head_dim, "Head dimension (" + supported_head_dims_string() + ")")
      ->capture_default_str();
  app.add_option("--seq", seq,
                 lists ? "Total context tokens over all ranks; list to sweep; suffixes k, M"
                       : "Total context tokens over all ranks; suffixes k (x1024), M (x1024^2)")
      ->capture_default_str();
  app.add_option("--q-len", q_len, "New tokens per step (>1: speculative decoding, causal)")
      ->capture_default_str();
  app.add_option("--dtype", dtype,
                 "KV cache element type: f32, f16, bf16, or fp8 / int8 (quantized, a float32 "
                 "scale per token and KV head)")
      ->capture_default_str();
  app.add_option("--shard", shard,
                 "KV placement over ranks: even, uneven (contiguous, unequal), striped (token t on "
                 "rank t mod p), empty (one rank holds nothing)")
      ->capture_default_str();
  app.add_option("--kv-layout", kv_layout,
                 "How each rank stores its KV shard: tiled (64-token tiles, K transposed), rows "
                 "([batch][kv_heads][tokens][head_dim]), or auto = the one this CPU reads faster "
                 "for this dtype, head dim, group and thread count, as the kernel tuning measured "
                 "it (treeattn tune; rank 0's choice; rows on a GPU); one layout for all methods "
                 "of a run")
      ->capture_default_str();
  app.add_option("--seed", seed, "Seed of the generated query and cache")->capture_default_str();
}

Status ShapeFlags::resolve(const CLI::App& app) {
  if (!preset.empty()) {
    const Preset* found = nullptr;
    for (const auto& p : presets())
      if (preset == p.name) found = &p;
    if (found == nullptr)
      return invalid_argument("unknown preset '" + preset + "' (known: " + preset_names() + ")");
    if (app.count("--heads") == 0) heads = found->heads;
    if (app.count("--kv-heads") == 0) kv_heads = found->kv_heads;
    if (app.count("--head-dim") == 0) head_dim = found->head_dim;
  }
  if (!batch_list.empty()) {
    auto v = parse_size_list(batch_list);
    if (!v.is_ok()) return invalid_argument("--batch: " + v.status().message());
    batches = *v;
    batch = batches.front();
  } else {
    batches = {batch};
  }
  auto seqs_r = parse_size_list(seq);
  if (!seqs_r.is_ok()) return invalid_argument("--seq: " + seqs_r.status().message());
  seqs = *seqs_r;
  if (!parse_dtype(dtype).has_value() && split_list(dtype).size() <= 1)
    return invalid_argument("--dtype: unknown type '" + dtype + "' (known: f32, f16, bf16, fp8, int8)");
  if (auto l = parse_kv_layout(kv_layout); !l.is_ok())
    return invalid_argument("--kv-layout: " + l.status().message());
  if (shard != "even" && shard != "uneven" && shard != "striped" && shard != "empty")
    return invalid_argument("--shard: unknown placement '" + shard +
                            "' (known: even, uneven, striped, empty)");
  for (int64_t b : batches) {
    AttnShape s = shape();
    s.batch = b;
    TREEATTN_RETURN_IF_ERROR(s.validate());
  }
  // The q_len new tokens are the last positions of the context (causal), so they fit in it.
  for (int64_t n : seqs)
    if (q_len > n)
      return invalid_argument(
          fmt::format("--q-len {} must be <= the context (--seq {})", q_len, format_size(n)));
  return Status::ok();
}

}  // namespace treeattn::cli
