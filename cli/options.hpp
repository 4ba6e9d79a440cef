// Command-line vocabulary shared by all subcommands: model presets, sizes with suffixes
// ("256k", "1M"), comma-separated lists, and the shape flags every subcommand takes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "treeattn/dtype.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace CLI {
class App;
}

namespace treeattn::cli {

struct Preset {
  const char* name;
  int64_t heads, kv_heads, head_dim;
  const char* what;
};
// llama3-8b, llama3-70b, paper-block, mha-64.
const std::vector<Preset>& presets();
std::string preset_names();

// "4096", "64k" (x1024), "1M" (x1024^2), "1.5M", "5.12M"; suffixes are binary.
Result<int64_t> parse_size(const std::string& text);
Result<std::vector<int64_t>> parse_size_list(const std::string& text);
std::vector<std::string> split_list(const std::string& text);
std::string format_size(int64_t tokens);  // 65536 -> "64k"
std::string format_bytes(double bytes);    // "1.50 GiB"

// Flags that describe the decode problem; every subcommand has them.
struct ShapeFlags {
  std::string preset;
  int64_t batch = 1;
  int64_t heads = 32;
  int64_t kv_heads = 8;
  int64_t head_dim = 128;
  std::string seq = "64k";
  int64_t q_len = 1;
  std::string dtype = "bf16";
  std::string shard = "even";
  uint64_t seed = 1;
  std::string batch_list;  // --batch as a list (bench)
  // Filled by resolve(): every --seq and --batch value.
  std::vector<int64_t> seqs, batches;

  void add_to(CLI::App& app, bool lists);
  // Applies the preset (explicit --heads/--kv-heads/--head-dim win) and validates.
  Status resolve(const CLI::App& app);
  AttnShape shape() const { return AttnShape{batch, heads, kv_heads, head_dim, q_len}; }
};

}  // namespace treeattn::cli
