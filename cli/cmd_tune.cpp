// `treeattn tune`: calibrates the CPU kernels' bit-neutral choices on this CPU (tuning.hpp),
// prints every candidate's rate beside the probe's, and writes the cache that every later run
// reads.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <fstream>
#include <memory>
#include <string>

#include "commands.hpp"
#include "options.hpp"
#include "tuning.hpp"
#ifndef TREEATTN_CLI_NO_MODEL_COMMANDS
#include "treeattn/model.hpp"
#endif

namespace treeattn::cli {
namespace {

struct TuneFlags {
  std::string dtypes = "f32,bf16,f16,fp8,int8";
  std::string head_dims = "128";
  std::string groups = "4";
  std::string threads = "1,0";
  double seconds = 1.2;
  int64_t mib = 0;
  std::string json;
  bool no_store = false;
  bool no_matmul = false;
};

std::string table(const TuneResult& r) {
  const TuneEntry& e = r.entry;
  std::string s = fmt::format(
      "{}: {:.0f} MiB of K/V per layout, {} rounds, {:.1f} s; probe {:.1f} GB/s (spread {:.0f}%)\n",
      e.key.to_string(), static_cast<double>(r.bytes) / (1 << 20), r.rounds, r.seconds,
      e.probe_gbps, 100 * r.probe_spread);
  s += fmt::format("  {:<15} {:>7} {:>7} {:>9} {:>7} {:>8}\n", "knob", "value", "GB/s", "of probe",
                   "spread", "vs dflt");
  for (const TuneCandidate& c : r.candidates) {
    std::string mark;
    if (c.is_default) mark += " default";
    if (c.chosen) mark += " <- chosen";
    s += fmt::format("  {:<15} {:>7} {:>7.2f} {:>9.3f} {:>6.0f}% {:>8.3f}{}\n", c.knob, c.value,
                     c.gbps, e.probe_gbps > 0 ? c.gbps / e.probe_gbps : 0.0, 100 * c.spread,
                     c.vs_default, mark);
  }
  return s;
}

nlohmann::json result_json(const TuneResult& r) {
  const TuneEntry& e = r.entry;
  nlohmann::json cands = nlohmann::json::array();
  for (const TuneCandidate& c : r.candidates)
    cands.push_back({{"knob", c.knob},
                     {"value", c.value},
                     {"gbps", c.gbps},
                     {"fraction_of_probe", e.probe_gbps > 0 ? c.gbps / e.probe_gbps : 0.0},
                     {"spread", c.spread},
                     {"vs_default", c.vs_default},
                     {"default", c.is_default},
                     {"chosen", c.chosen}});
  return {{"dtype", std::string(dtype_name(e.key.dtype))},
          {"head_dim", e.key.head_dim},
          {"group", e.key.group},
          {"threads", e.key.threads},
          {"bytes", r.bytes},
          {"rounds", r.rounds},
          {"seconds", r.seconds},
          {"probe_gbps", e.probe_gbps},
          {"probe_spread", r.probe_spread},
          {"kernel_gbps", e.kernel_gbps},
          {"choice",
           {{"tiled_prefetch", e.choice.tiled_prefetch},
            {"paged_prefetch", e.choice.paged_prefetch},
            {"rows_prefetch", e.choice.rows_prefetch},
            {"item_order", e.choice.chunks_outer ? "chunks" : "heads"},
            {"layout", std::string(kv_layout_name(e.choice.layout))}}},
          {"candidates", cands}};
}

#ifndef TREEATTN_CLI_NO_MODEL_COMMANDS
std::string matmul_table(const model::MatmulTuneResult& r) {
  std::string s = fmt::format(
      "matmul T{}: int8 K-quant token tile, {} rounds, {:.1f} s (a {} x {} Q4_K matrix, {} tokens)\n",
      r.entry.threads, r.rounds, r.seconds, model::MatmulTuneOptions{}.rows,
      model::MatmulTuneOptions{}.cols, model::MatmulTuneOptions{}.tokens);
  s += fmt::format("  {:<15} {:>7} {:>7} {:>7} {:>8}\n", "knob", "KiB", "GOPS", "spread",
                   "vs dflt");
  for (const TuneCandidate& c : r.candidates) {
    std::string mark;
    if (c.is_default) mark += " default";
    if (c.chosen) mark += " <- chosen";
    s += fmt::format("  {:<15} {:>7} {:>7.1f} {:>6.0f}% {:>8.3f}{}\n", c.knob,
                     std::stoll(c.value) >> 10, c.gbps, 100 * c.spread, c.vs_default, mark);
  }
  return s;
}

nlohmann::json matmul_json(const model::MatmulTuneResult& r) {
  nlohmann::json cands = nlohmann::json::array();
  for (const TuneCandidate& c : r.candidates)
    cands.push_back({{"tile_bytes", std::stoll(c.value)},
                     {"gops", c.gbps},
                     {"spread", c.spread},
                     {"vs_default", c.vs_default},
                     {"default", c.is_default},
                     {"chosen", c.chosen}});
  return {{"matmul_threads", r.entry.threads}, {"rounds", r.rounds}, {"seconds", r.seconds},
          {"tile_bytes", r.entry.tile_bytes},  {"gops", r.entry.gops},  {"candidates", cands}};
}
#endif

Result<std::vector<TuneKey>> keys_of(const TuneFlags& f) {
  std::vector<TuneKey> keys;
  std::vector<DType> dtypes;
  for (const std::string& d : split_list(f.dtypes)) {
    const auto t = parse_dtype(d);
    if (!t) return invalid_argument("--dtype: unknown type '" + d + "' (f32, f16, bf16, fp8, int8)");
    dtypes.push_back(*t);
  }
  std::vector<int64_t> dims, groups;
  std::vector<int> threads;
  for (const std::string& d : split_list(f.head_dims)) {
    auto v = parse_count(d, 4096);
    if (!v.is_ok()) return invalid_argument("--head-dim: " + v.status().message());
    dims.push_back(*v);
  }
  for (const std::string& g : split_list(f.groups)) {
    auto v = parse_count(g, 4096);
    if (!v.is_ok() || *v < 1)
      return invalid_argument("--group '" + g + "': heads per KV head, a count >= 1");
    groups.push_back(*v);
  }
  for (const std::string& t : split_list(f.threads)) {
    auto v = parse_count(t, kMaxThreads);
    if (!v.is_ok()) return invalid_argument("--threads: " + v.status().message());
    const int n = *v == 0 ? default_threads(1) : static_cast<int>(*v);
    if (std::find(threads.begin(), threads.end(), n) == threads.end()) threads.push_back(n);
  }
  if (dtypes.empty() || dims.empty() || groups.empty() || threads.empty())
    return invalid_argument("--dtype, --head-dim, --group and --threads each need a value");
  for (DType d : dtypes)
    for (int64_t hd : dims)
      for (int64_t g : groups)
        for (int t : threads) {
          const AttnShape one{1, g, 1, hd, 1};
          TREEATTN_RETURN_IF_ERROR(one.validate());
          keys.push_back(TuneKey{d, hd, g, t});
        }
  return keys;
}

int tune_command(const TuneFlags& f) {
  auto keys = keys_of(f);
  if (!keys.is_ok()) return fail("tune", keys.status());
  if (!(f.seconds > 0 && f.seconds <= 60))
    return fail("tune", invalid_argument("--seconds must be in (0, 60]"));
  if (f.mib < 0 || f.mib > 65536)
    return fail("tune", invalid_argument("--mib must be in 0..65536 (0: automatic)"));
  if (!f.json.empty() && f.json != "-")
    if (Status s = check_output_file("--json", f.json); !s.is_ok()) return fail("tune", s);
  const TuningState& before = kernel_tuning();  // warns about a file it ignores
  std::printf("treeattn tune: %s\ncache: %s%s\n\n", tuning_cache_key().c_str(),
              before.path.empty() ? "(none: no cache directory)" : before.path.c_str(),
              tuning_skipped() ? " (TREEATTN_TUNE=0: the commands will not read it)" : "");
  std::fflush(stdout);
  TuneOptions o;
  o.seconds = f.seconds;
  o.bytes = f.mib << 20;
  nlohmann::json all = nlohmann::json::array();
  std::vector<TuneEntry> entries;
  for (const TuneKey& key : *keys) {
    o.keys = {key};
    auto r = calibrate_kernels(o);
    if (!r.is_ok()) return fail("tune", r.status());
    const TuneResult& res = r->front();
    std::printf("%s  chosen: %s\n\n", table(res).c_str(), tuning_choice_text(res.entry.choice).c_str());
    std::fflush(stdout);
    all.push_back(result_json(res));
    entries.push_back(res.entry);
  }
  std::vector<MatmulTuneEntry> matmul;
#ifndef TREEATTN_CLI_NO_MODEL_COMMANDS
  if (!f.no_matmul) {
    std::vector<int> threads;
    for (const TuneKey& k : *keys)
      if (std::find(threads.begin(), threads.end(), k.threads) == threads.end())
        threads.push_back(k.threads);
    for (int t : threads) {
      model::MatmulTuneOptions mo;
      mo.threads = t;
      mo.seconds = std::min(f.seconds, mo.seconds);
      auto r = model::calibrate_matmul(mo);
      if (!r.is_ok()) return fail("tune", r.status());
      std::printf("%s  chosen: %lld KiB\n\n", matmul_table(*r).c_str(),
                  static_cast<long long>(r->entry.tile_bytes >> 10));
      std::fflush(stdout);
      all.push_back(matmul_json(*r));
      matmul.push_back(r->entry);
    }
  }
#endif
  if (!f.json.empty()) {
    const std::string text = all.dump(1) + "\n";
    if (f.json == "-") {
      std::fputs(text.c_str(), stdout);
    } else {
      std::ofstream out(f.json);
      out << text;
      if (!out) return fail("tune", invalid_argument("cannot write '" + f.json + "'"));
    }
  }
  if (f.no_store) {
    std::printf("not stored (--no-store)\n");
    return 0;
  }
  if (Status s = store_kernel_tuning(entries, matmul); !s.is_ok()) return fail("tune", s);
  const std::size_t n = entries.size() + matmul.size();
  std::printf("stored %zu entr%s in %s\n", n, n == 1 ? "y" : "ies", tuning_cache_path().c_str());
  return 0;
}

}  // namespace

Runner add_tune_command(CLI::App& app, const Invocation&) {
  auto* sub = app.add_subcommand(
      "tune",
      "Calibrate the CPU kernels' prefetch leads, item order and KV layout on this CPU (the "
      "choices that change no bit), print every candidate against the read-bandwidth probe, "
      "and write the cache every later run reads");
  auto f = std::make_shared<TuneFlags>();
  sub->add_option("--dtype", f->dtypes, "KV dtypes to calibrate (comma-separated)")
      ->capture_default_str();
  sub->add_option("--head-dim", f->head_dims, "Head dims (comma-separated)")->capture_default_str();
  sub->add_option("--group", f->groups, "Query heads per KV head (comma-separated)")
      ->capture_default_str();
  sub->add_option("--threads", f->threads,
                  "Kernel thread counts (comma-separated; 0: the cores of this machine)")
      ->capture_default_str();
  sub->add_option("--seconds", f->seconds, "Measuring time per entry after its set-up")
      ->capture_default_str();
  sub->add_option("--mib", f->mib,
                  "MiB of K/V per layout (0: twice the last-level cache, 64..256 MiB)")
      ->capture_default_str();
  sub->add_option("--json", f->json, "Write every entry and candidate as JSON (- : stdout)");
  sub->add_flag("--no-store", f->no_store, "Measure and print; leave the cache as it is");
#ifndef TREEATTN_CLI_NO_MODEL_COMMANDS
  sub->add_flag("--no-matmul", f->no_matmul,
                "Leave out the matrix kernels' token tile (timed once per thread count)");
#endif
  return [f] { return tune_command(*f); };
}

}  // namespace treeattn::cli
