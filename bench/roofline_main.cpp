// treeattn_roofline: prints the kernel roofline table (bandwidth probe, FMA probe, kernel and
// OpenBLAS peer timings), the table of `treeattn bench --kernel`, with the knobs used to compare
// the tiled KV layout's alternatives in one run.
//
//   treeattn_roofline [--dtype f32,bf16,f16,fp8,int8] [--threads 0,1] [--repeats 5] [--isa auto]
//                     [--seq N,...] [--batch B] [--q-len Q] [--heads H] [--kv-heads K]
//                     [--head-dim D] [--chunk N] [--probe-once]
//                     [--layouts rows,tiled] [--tile-tokens 16,32] [--tile-layout split,interleaved]
//                     [--block-tiles 1,2,4] [--prefetch 0,4096,16384:l2] [--no-peer] [--no-check]
//                     [--json FILE]
// --seq (a list) replaces the default cases with one case per length of the shape given by
// --batch/--q-len/--heads/--kv-heads/--head-dim (default llama3-8b: 32, 8, 128). The tiled
// layout is timed once per (tile tokens x tile layout x softmax block tiles x prefetch bytes);
// 0 block tiles and -1 prefetch bytes mean the kernel's defaults (src/kernels/cpu/
// cpu_targets.hpp), rows in the table read t<tokens><s|i>-b<block tiles>-p<prefetch bytes>. A
// lead may name where its lines go, ":l1" (prefetcht0) or ":l2" (prefetcht1; the row's label
// ends in "l2"); without it, where the tuning puts them.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "treeattn/roofline.hpp"

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i <= s.size()) {
    const std::size_t j = s.find(',', i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

int usage(const char* msg) {
  std::fprintf(stderr, "treeattn_roofline: %s\n", msg);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace treeattn;
  RooflineOptions opt;
  std::string json;
  int64_t batch = 1, q_len = 1, heads = 32, kv_heads = 8, head_dim = 128;
  std::vector<int64_t> seqs;
  std::vector<int64_t> tile_tokens{kKVTileTokens};
  std::vector<KVTileLayout> tile_layouts{kKVTileLayout};
  std::vector<int> block_tiles{0};
  std::vector<std::pair<int64_t, int>> prefetch{{-1, -1}};  // lead, level (-1: the tuned ones)
  bool tiled = true;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--dtype") {
      opt.dtypes.clear();
      for (const std::string& d : split(next())) {
        const auto t = parse_dtype(d);
        if (!t) return usage(("unknown dtype '" + d + "' (f32, f16, bf16, fp8, int8)").c_str());
        opt.dtypes.push_back(*t);
      }
    } else if (a == "--threads") {
      opt.threads.clear();
      for (const std::string& t : split(next())) opt.threads.push_back(std::atoi(t.c_str()));
    } else if (a == "--repeats") {
      opt.repeats = std::atoi(next().c_str());
    } else if (a == "--isa") {
      const Result<Isa> isa = parse_isa(next());
      if (!isa.is_ok()) return usage(isa.status().message().c_str());
      opt.isa = isa.value();
    } else if (a == "--seq") {
      for (const std::string& t : split(next())) seqs.push_back(std::atoll(t.c_str()));
    } else if (a == "--heads") {
      heads = std::atoll(next().c_str());
    } else if (a == "--kv-heads") {
      kv_heads = std::atoll(next().c_str());
    } else if (a == "--head-dim") {
      head_dim = std::atoll(next().c_str());
    } else if (a == "--probe-once") {
      opt.probe_each_repeat = false;
    } else if (a == "--no-check") {
      opt.check = false;
    } else if (a == "--layouts") {
      opt.rows = tiled = false;
      for (const std::string& l : split(next())) {
        if (l == "rows") {
          opt.rows = true;
        } else if (l == "tiled") {
          tiled = true;
        } else {
          return usage(("unknown layout '" + l + "' (rows, tiled)").c_str());
        }
      }
    } else if (a == "--tile-tokens") {
      tile_tokens.clear();
      for (const std::string& t : split(next())) tile_tokens.push_back(std::atoll(t.c_str()));
    } else if (a == "--block-tiles") {
      block_tiles.clear();
      for (const std::string& t : split(next())) block_tiles.push_back(std::atoi(t.c_str()));
    } else if (a == "--prefetch") {
      prefetch.clear();
      for (const std::string& t : split(next())) {
        const auto colon = t.find(':');
        const std::string lvl = colon == std::string::npos ? "" : t.substr(colon + 1);
        if (!lvl.empty() && lvl != "l1" && lvl != "l2")
          return usage(("unknown prefetch level '" + lvl + "' in '" + t + "' (l1, l2)").c_str());
        prefetch.emplace_back(std::atoll(t.substr(0, colon).c_str()),
                              lvl.empty() ? -1 : (lvl == "l2" ? 2 : 1));
      }
    } else if (a == "--tile-layout") {
      tile_layouts.clear();
      for (const std::string& l : split(next())) {
        const Result<KVTileLayout> tl = parse_kv_tile_layout(l);
        if (!tl.is_ok()) return usage(tl.status().message().c_str());
        tile_layouts.push_back(tl.value());
      }
    } else if (a == "--batch") {
      batch = std::atoll(next().c_str());
    } else if (a == "--q-len") {
      q_len = std::atoll(next().c_str());
    } else if (a == "--chunk") {
      opt.chunk_tokens = std::atoll(next().c_str());
    } else if (a == "--no-peer") {
      opt.peer = false;
    } else if (a == "--json") {
      json = next();
    } else {
      return usage(("unknown option '" + std::string(a) + "'").c_str());
    }
  }
  for (int64_t seq : seqs)
    opt.cases.push_back(RooflineCase{AttnShape{batch, heads, kv_heads, head_dim, q_len}, seq});
  opt.tiles.clear();
  if (tiled)
    for (int64_t tt : tile_tokens)
      for (KVTileLayout tl : tile_layouts)
        for (int bt : block_tiles)
          for (const auto& [pf, level] : prefetch)
            opt.tiles.push_back(RooflineTiles{tt, tl, bt, pf, level});
  const Result<std::vector<RooflineRecord>> r = run_roofline(opt);
  if (!r.is_ok()) {
    std::fprintf(stderr, "treeattn_roofline: %s\n", r.status().to_string().c_str());
    return 1;
  }
  std::fputs(roofline_table(r.value()).c_str(), stdout);
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) return usage(("cannot write " + json).c_str());
    std::fputs(roofline_json(r.value()).c_str(), f);
    std::fclose(f);
  }
  return 0;
}
