// The calibration the decoding commands make before they start, and their --no-tune flag
// (tuning.hpp).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tuning.hpp"
#include "treeattn/launch.hpp"
#ifndef TREEATTN_CLI_NO_MODEL_COMMANDS
#include "treeattn/model.hpp"
#endif

namespace treeattn::cli {

std::string tuning_choice_text(const TuneChoice& c) {
  char buf[192];
  std::snprintf(buf, sizeof buf,
                "tiled lead %lld%s, paged lead %lld%s, rows lead %lld, %s outer, layout %s",
                static_cast<long long>(c.tiled_prefetch), c.tiled_l2 ? ":l2" : "",
                static_cast<long long>(c.paged_prefetch), c.paged_l2 ? ":l2" : "",
                static_cast<long long>(c.rows_prefetch), c.chunks_outer ? "chunks" : "heads",
                std::string(kv_layout_name(c.layout)).c_str());
  return buf;
}

void add_no_tune_flag(CLI::App& sub, bool& no_tune) {
  sub.add_flag("--no-tune", no_tune,
               "The CPU kernels' compiled-in choices: no tuning cache read and no calibration at "
               "start (as TREEATTN_TUNE=0)");
}

void apply_no_tune(bool no_tune) {
  if (no_tune) ::setenv("TREEATTN_TUNE", "0", 1);
  if (no_tune && kernel_tuning().source != TuningState::Source::kSkipped) reload_kernel_tuning();
}

void tune_at_start(const char* cmd, const std::vector<TuneKey>& keys,
                   const std::vector<int>& matmul_threads) {
  if (tuning_skipped() || launch::started_by_mpi_launcher()) return;
  const TuningState& s = kernel_tuning();  // warns about a file it ignores
  std::vector<TuneKey> missing;
  for (const TuneKey& k : keys) {
    bool have = false;
    for (const TuneEntry& e : s.entries) have = have || e.key == k;
    if (!have && std::find(missing.begin(), missing.end(), k) == missing.end())
      missing.push_back(k);
  }
  for (const TuneKey& k : missing) {
    std::fprintf(stderr, "treeattn %s: tuning the CPU kernels for %s (first use on this CPU and build) ...",
                 cmd, k.to_string().c_str());
    std::fflush(stderr);
    TuneOptions o;
    o.keys = {k};
    auto r = calibrate_kernels(o);
    if (!r.is_ok()) {
      std::fprintf(stderr, " failed: %s; the compiled-in choices are used\n",
                   r.status().to_string().c_str());
      continue;
    }
    const TuneResult& res = r->front();
    const Status stored = store_kernel_tuning({res.entry});
    std::fprintf(stderr, " %.1f s: %s (probe %.1f GB/s)%s\n", res.seconds,
                 tuning_choice_text(res.entry.choice).c_str(), res.entry.probe_gbps,
                 stored.is_ok() ? ("; cached in " + tuning_cache_path()).c_str()
                                : ("; not cached: " + stored.message()).c_str());
  }
#ifndef TREEATTN_CLI_NO_MODEL_COMMANDS
  for (int t : matmul_threads) {
    bool have = false;
    for (const MatmulTuneEntry& m : kernel_tuning().matmul) have = have || m.threads == t;
    if (have) continue;
    std::fprintf(stderr, "treeattn %s: tuning the matrix kernels for %d thread(s) ...", cmd, t);
    std::fflush(stderr);
    model::MatmulTuneOptions o;
    o.threads = t;
    auto r = model::calibrate_matmul(o);
    if (!r.is_ok()) {
      std::fprintf(stderr, " failed: %s; the compiled-in tile is used\n",
                   r.status().to_string().c_str());
      continue;
    }
    const Status stored = store_kernel_tuning({}, {r->entry});
    std::fprintf(stderr, " %.1f s: int8 K-quant token tile %lld KiB (%.0f GOPS)%s\n", r->seconds,
                 static_cast<long long>(r->entry.tile_bytes >> 10), r->entry.gops,
                 stored.is_ok() ? "" : ("; not cached: " + stored.message()).c_str());
  }
#else
  (void)matmul_threads;
#endif
}

}  // namespace treeattn::cli
