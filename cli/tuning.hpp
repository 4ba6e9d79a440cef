// The kernel tuning in the treeattn command (include/treeattn/tuning.hpp): `treeattn tune`
// (cmd_tune.cpp) and the calibration the commands that decode make before they start.
#pragma once

#include <string>
#include <vector>

#include "treeattn/tuning.hpp"

namespace CLI {
class App;
}

namespace treeattn::cli {

// --no-tune on a subcommand: when given, TREEATTN_TUNE=0 is set in this process (and so in
// the ranks it starts) before anything reads the tuning: the compiled-in defaults.
void add_no_tune_flag(CLI::App& sub, bool& no_tune);
void apply_no_tune(bool no_tune);

// Before `cmd` starts its ranks (or decodes in this process): calibrates each key whose entry
// the cache lacks, and the matmul tile for each of matmul_threads the cache lacks (the model
// commands), prints one line per key on stderr ("treeattn CMD: tuning the CPU kernels for bf16
// D128 G4 T1 ... 1.6 s: ..."), and stores them. Nothing when TREEATTN_TUNE=0, and nothing
// under an outside MPI launcher (its ranks would be running beside the measurement: they read
// the cache as it is; `treeattn tune` on each host fills it). A failure is one note on stderr:
// the command goes on with what the cache has.
void tune_at_start(const char* cmd, const std::vector<TuneKey>& keys,
                   const std::vector<int>& matmul_threads = {});

// "tiled lead 12288, paged lead 8192, rows lead 2048, heads outer, layout tiled" (a lead into
// L2 reads "16384:l2").
std::string tuning_choice_text(const TuneChoice& c);

}  // namespace treeattn::cli
