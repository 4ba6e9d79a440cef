// Kernel tuning: the CPU kernels' choices that change no bit, measured on the CPU they run on.
//
// The decode kernels stream the KV cache from memory; how fast one core reads it depends on how
// that core overlaps software prefetch with arithmetic, which differs between CPUs. So the
// choices below are not constants: calibrate_kernels() times the real kernels with each
// candidate, the candidates alternating inside one run with the streaming-read probe beside
// them, and keeps the fastest. Every one of them changes where or when memory is read, never an
// operation on a value: the states are the same bits whatever the calibration picks (tested for
// every candidate and every ISA target the CPU runs, tests/kernels/test_tuning.cpp).
//
//   tiled_prefetch   software prefetch lead of the tiled decode driver, bytes per stream
//   paged_prefetch   the same for the paged driver (the serving engine's pools)
//   tiled_l2, paged_l2  whether those drivers' prefetch fetches into L2 (prefetcht1) rather than
//                    into L1 (prefetcht0): timed with the leads, as lead and level pairs
//   rows_prefetch    the same for the caller's rows layout (rounded up to whole tokens)
//   chunks_outer     the order the tiled and rows drivers hand items to threads: a head's chunks
//                    one after another (false) or chunk by chunk over the heads (true)
//   matmul tile      the model's matrix products on 8-bit activations of K-quant weights
//                    (src/model/matvec.cpp): the bytes of activation codes one token tile keeps,
//                    which every row block of the tile reads again (an L2 question), per thread
//                    count (MatmulTuneEntry; measured by the model library, model.hpp)
//
// Not tuned, because they change bits: the softmax block (tiles per online-softmax block), the
// tile size and the chunk size (each fixes which tokens one online softmax or one merge covers).
// The KV layout (rows or tiled) is measured by the same run and kept with the entry, for the
// session's `auto` layout (strategy.hpp, host_kv_layout): the two layouts' kernels give results
// within the oracle's tolerance but not the same bits, so a caller that needs the same bits on
// every machine names its layout.
//
// The cache: one file per CPU (model name, family, model, stepping), best ISA target and build
// (a hash of the kernel sources and the compiler), kernel-tuning-<hash>.txt in
// $TREEATTN_CACHE_DIR, else $XDG_CACHE_HOME/treeattn, else $HOME/.cache/treeattn. The library
// reads it at the first kernel call (kernel_tuning()) and never measures by itself; `treeattn
// tune` and the treeattn commands that decode (run, bench, generate, serve) calibrate what the
// file lacks before they start. A file that does not parse, or whose key names another CPU,
// ISA or build, is ignored with one warning on stderr and the compiled-in defaults are used.
// TREEATTN_TUNE=0 (or off) skips the file: the compiled-in defaults, nothing read or measured.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "treeattn/dtype.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// What an entry is calibrated for: the KV dtype, head dim, GQA group (heads per KV head) and
// kernel threads of the calls that use it.
struct TuneKey {
  DType dtype = DType::kBF16;
  int64_t head_dim = 128;
  int64_t group = 4;
  int threads = 1;
  bool operator==(const TuneKey&) const = default;
  std::string to_string() const;  // "bf16 D128 G4 T1"
};

// The choices (see the head of this file). The defaults are the compiled-in ones of the
// kernels, per dtype and head dim: tuning_defaults().
struct TuneChoice {
  int64_t tiled_prefetch = 8192;
  int64_t paged_prefetch = 8192;
  bool tiled_l2 = false;
  bool paged_l2 = false;
  int64_t rows_prefetch = 2048;
  bool chunks_outer = false;
  KVLayout layout = KVLayout::kTiled;
  bool operator==(const TuneChoice&) const = default;
};
// The compiled-in choice for a key on a target (layout: the rule by ISA, host_kv_layout(isa)).
TuneChoice tuning_defaults(const TuneKey& key, Isa isa);

struct TuneEntry {
  TuneKey key;
  TuneChoice choice;
  double probe_gbps = 0;   // the streaming-read probe's fastest round in the calibration
  double kernel_gbps = 0;  // the chosen layout's kernel at its chosen lead (fastest round)
};

// The matrix kernels' entry: the token tile of matmul calls on 8-bit activations whose weights
// are all K-quant types, as bytes of activation codes (src/model/matvec.cpp; the tile in tokens
// is that over the columns, rounded to the target's token groups), for calls of `threads`
// threads. Default 512 KiB.
struct MatmulTuneEntry {
  int threads = 1;
  int64_t tile_bytes = 512 * 1024;
  double gops = 0;  // the calibration's matrix at the chosen tile, integer operations per second
};

// Where the process's choices come from.
struct TuningState {
  enum class Source {
    kCache,    // the cache file, read (entries below)
    kNone,     // no cache file for this CPU, ISA and build: the compiled-in defaults
    kIgnored,  // a file that does not parse or is another CPU's, ISA's or build's: defaults
    kSkipped,  // TREEATTN_TUNE=0: the compiled-in defaults, no file read
  };
  Source source = Source::kNone;
  std::string path;    // the cache file this process reads and writes ("" without a cache dir)
  std::string detail;  // kIgnored: why; otherwise empty
  std::string key;     // this process's cache key (CPU | ISA | build)
  Isa isa = Isa::kGeneric;  // the target the entries are for (best_isa())
  std::vector<TuneEntry> entries;
  std::vector<MatmulTuneEntry> matmul;
};
// The process's tuning, loaded at the first call (the first kernel call asks it). A file
// ignored prints "treeattn: warning: ..." once on stderr (in an MPI job from each host's first
// rank only).
const TuningState& kernel_tuning();
// The cache file's path and key for this CPU, best ISA and build (what kernel_tuning() reads).
std::string tuning_cache_path();
std::string tuning_cache_key();
// TREEATTN_TUNE=0 or off in the environment.
bool tuning_skipped();
// Reads the file again (after another process wrote it, or the environment changed).
void reload_kernel_tuning();

// The entry the kernels use for a call, or nullptr for the compiled-in defaults: an entry of
// the same dtype and head dim on the cached ISA target, the nearest in group, then in threads.
const TuneEntry* find_tuning(const TuneKey& key, Isa isa);
// find_tuning's choice, or tuning_defaults() when there is none.
TuneChoice tuned_choice(const TuneKey& key, Isa isa);

// The matmul tile for calls of `threads` threads on `isa` (the entry nearest in threads), or 0
// for the compiled-in one (no entry, another target, TREEATTN_TUNE=0).
int64_t tuned_matmul_tile_bytes(int threads, Isa isa);

// Writes `entries` and `matmul` into the cache file (replacing entries of the same keys and
// thread counts, keeping the others a valid file has; written to a temporary file and renamed,
// so readers never see half a file) and makes the process use the result. kInternal naming the
// path when it cannot be written.
Status store_kernel_tuning(const std::vector<TuneEntry>& entries,
                           const std::vector<MatmulTuneEntry>& matmul = {});

// One timed candidate of a calibration.
struct TuneCandidate {
  std::string knob;   // "tiled_prefetch", "rows_prefetch", "paged_prefetch", "item_order", ...
  std::string value;  // "8192", "heads", "chunks", ...
  double gbps = 0;    // the fastest round (bytes the kernel reads per second; other work on
                      // the machine only slows a round)
  double spread = 0;  // (fastest - slowest) / fastest over the rounds
  // Median over rounds of (this candidate's rate / its knob's default's in the same round); a
  // candidate is chosen only when this beats 1 + margin (the layout: in calls per second against
  // the rule's layout, since the tiles hold the quantized types' scales in fewer bytes).
  double vs_default = 1;
  bool is_default = false;
  bool chosen = false;
};
struct TuneResult {
  TuneEntry entry;
  std::vector<TuneCandidate> candidates;
  double probe_spread = 0;  // of the probe, as TuneCandidate::spread
  int rounds = 0;
  double seconds = 0;       // the whole calibration of this key, set-up included
  int64_t bytes = 0;        // K and V bytes one call of a layout reads
};
struct TuneOptions {
  std::vector<TuneKey> keys;
  // K and V bytes per layout (0: twice the last-level cache, within 64..256 MiB, at most a
  // quarter of the available memory), so that every call reads from memory.
  int64_t bytes = 0;
  double seconds = 1.2;  // measuring time per key after the set-up (rounds continue until it)
  int min_rounds = 3;
  int max_rounds = 15;
  // A candidate replaces the default only when its median ratio to the default over the rounds
  // beats 1 by more than this, so that noise does not move a choice.
  double margin = 0.03;
};
// The candidates a calibration of `key` on `isa` times, each the defaults with one choice
// changed (the layout is not one: both layouts' kernels run with their own candidates).
std::vector<TuneChoice> tuning_candidates(const TuneKey& key, Isa isa);

// Times every candidate of every key on this CPU's best target (the real kernels on `bytes` of
// K/V, rounds of all candidates in a rotating order with the probe in each round) and returns
// the choices; stores nothing. While it runs no other kernel call may run in the process.
Result<std::vector<TuneResult>> calibrate_kernels(const TuneOptions& options);

}  // namespace treeattn
