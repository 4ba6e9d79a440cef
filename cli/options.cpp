// Shared CLI vocabulary (see options.hpp).
#include "options.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <sstream>

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

Result<int64_t> parse_size(const std::string& text) {
  if (text.empty()) return invalid_argument("empty size");
  double mult = 1;
  std::string num = text;
  const char last = text.back();
  if (last == 'k' || last == 'K') mult = 1024.0;
  if (last == 'm' || last == 'M') mult = 1024.0 * 1024.0;
  if (last == 'g' || last == 'G') mult = 1024.0 * 1024.0 * 1024.0;
  if (mult != 1) num.pop_back();
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(num, &used);
  } catch (...) {
    used = 0;
  }
  if (used != num.size() || !(v >= 0) || !std::isfinite(v))
    return invalid_argument("'" + text + "' is not a size (examples: 4096, 64k, 1M, 5.12M)");
  const double tokens = std::round(v * mult);
  if (tokens > 9.0e15) return invalid_argument("size '" + text + "' is too large");
  return static_cast<int64_t>(tokens);
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

std::string format_size(int64_t tokens) {
  if (tokens >= (1 << 20) && tokens % (1 << 20) == 0) return fmt::format("{}M", tokens >> 20);
  if (tokens >= 1024 && tokens % 1024 == 0) return fmt::format("{}k", tokens >> 10);
  return std::to_string(tokens);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
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
  if (shard != "even" && shard != "uneven" && shard != "striped" && shard != "empty")
    return invalid_argument("--shard: unknown placement '" + shard +
                            "' (known: even, uneven, striped, empty)");
  for (int64_t b : batches) {
    AttnShape s = shape();
    s.batch = b;
    TREEATTN_RETURN_IF_ERROR(s.validate());
  }
  return Status::ok();
}

}  // namespace treeattn::cli
