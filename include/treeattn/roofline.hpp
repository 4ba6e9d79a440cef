// The kernel roofline: how fast the decode kernel runs against what the machine allows.
//
// Decoding one token reads the whole KV shard once and does little arithmetic per byte, so
// its limit is usually memory bandwidth: time >= kv_bytes / bandwidth. With many query rows
// per KV head (large GQA groups times q_len) the arithmetic can become the tighter limit:
// time >= flops / peak. run_roofline() measures both limits on this machine with the same
// OpenMP threads as the kernel, then times the kernel per case (median of repeats) and
// reports the achieved KV read rate and its fraction of each limit. Optionally it times the
// OpenBLAS peer (f32 only) in the same run.
//
// Two KV layouts are timed side by side on the same values (record field `layout`): "rows",
// the caller's [batch][kv_heads][tokens][head_dim] read by decode_partial(), and "tiled", the
// library-owned tile layout of kv_tiles.hpp read by decode_partial_tiled() (one record per
// tile configuration asked for). Within a case the timed runs of every layout alternate, and
// with probe_each_repeat each run follows its bandwidth probe (the faster of two passes), so the
// machine's load drifts equally over all of them; fraction_of_bandwidth is then the median over
// rounds of (kernel GB/s / probe GB/s of that round), bandwidth_gbps the median probe;
// fraction_best the fastest kernel round over the fastest probe pass, with the probe's spread
// beside it.
//
//   bandwidth:  streaming read of the very bytes the layout's kernel reads (the case's K and V
//               and scales, or its tiled copy), their concatenation split into one contiguous
//               part per thread: the same pages, so where the system placed them counts on
//               both sides of a fraction (the rows layout's buffers and the tiled copy of one
//               case can stream at different rates: compare their bandwidth_gbps).
//   peak:       independent FMA chains in registers with the kernel's ISA, median of repeats.
//   kv_bytes:   bytes of K and V the kernel must read (tokens * kv_heads * head_dim * 2 *
//               dtype size, summed over the batch; for fp8/int8 plus the per-token scales
//               of K and V: 4 bytes each in rows, 2 in tiles).
//   flops:      2 * D per (row, token) for q.k and 2 * D for p*v, rows = batch*heads*q_len.
//
// Part of the measurement library treeattn_measure (src/measure), not of libtreeattn.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

struct RooflineCase {
  AttnShape shape;  // batch, heads, kv_heads, head_dim, q_len
  int64_t seq = 0;  // KV tokens per batch row
};

// A tiled-layout configuration to time: tile size and placement (kv_tiles.hpp).
struct RooflineTiles {
  int64_t tile_tokens = kKVTileTokens;
  KVTileLayout layout = kKVTileLayout;
  int block_tiles = 0;         // tiles per softmax block; 0: the kernel's default
  int64_t prefetch_bytes = -1; // software prefetch distance; -1: the kernel's default, 0: none
  int prefetch_level = -1;     // where it fetches: 1 into L1, 2 into L2; -1: the kernel's default
};

struct RooflineOptions {
  std::vector<RooflineCase> cases;          // empty: default_roofline_cases()
  std::vector<DType> dtypes{DType::kF32, DType::kBF16, DType::kF16};
  std::vector<int> threads{0};              // 0 = all the threads OpenMP offers
  int repeats = 5;                          // timed runs per measurement (median)
  Isa isa = Isa::kAuto;
  int64_t chunk_tokens = 0;                 // 0 = the kernel's default
  int64_t probe_bytes = int64_t{1} << 30;   // run_roofline_on's copy probe (the host probe
                                            // reads each case's own bytes)
  bool peer = true;                         // also time the OpenBLAS peer (f32 only)
  bool check = true;                        // compare one output row set with the reference
  bool rows = true;                         // time the caller's row layout (decode_partial)
  std::vector<RooflineTiles> tiles{RooflineTiles{}};  // tiled configurations (empty: none)
  bool probe_each_repeat = true;            // re-run the bandwidth probe before every round
};

struct RooflineRecord {
  std::string shape;            // AttnShape::to_string()
  std::string dtype;            // "f32", "bf16", "f16"
  std::string isa;              // kernel target that ran
  std::string layout;           // "rows" or "tiled"
  int64_t tile_tokens = 0;      // tiled: tokens per tile (0 for rows)
  std::string tile_layout;      // tiled: "split" or "interleaved" (empty for rows)
  int block_tiles = 0;          // tiled: tiles per softmax block the kernel ran with
  int64_t prefetch_bytes = 0;   // tiled: software prefetch distance the kernel ran with
  bool prefetch_l2 = false;     // tiled: ... into L2 (prefetcht1), else into L1 (prefetcht0)
  int64_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0, q_len = 0;
  int64_t seq = 0;              // KV tokens per batch row
  int threads = 0;
  int64_t kv_bytes = 0;
  double seconds = 0;           // median kernel time
  double gbps = 0;              // kv_bytes / seconds / 1e9
  double bandwidth_gbps = 0;    // measured by the probe with the same threads (median)
  double fraction_of_bandwidth = 0;  // median over rounds of gbps / probe (see above)
  // Best of the rounds: the fastest kernel run over the fastest pass of its own probe (the same
  // bytes, so the same figure whichever other cases share the run). On a machine shared with
  // other work the medians carry the interference; the best rounds show what the kernel does
  // when it has the cores and the memory to itself. probe_spread: (fastest - slowest) / fastest
  // over those probe passes, how steady the probe was; probe_bytes: what one pass read.
  double gbps_best = 0;
  double bandwidth_gbps_best = 0;
  double fraction_best = 0;
  double probe_spread = 0;
  int64_t probe_bytes = 0;
  // The ceiling: the kernel's least arithmetic over the probe's bytes, the fastest of two passes
  // at each software prefetch lead of 0, 2, 8 and 32 KiB. Each vector of the bytes is widened as
  // the case's dtype and multiplied into ceiling_rows = min(group * q_len, 8) accumulators, as
  // exact attention multiplies each K and V element into the query rows of its group, and nothing
  // else: a reference for what that arithmetic leaves of the stream on this CPU, not a proof (a
  // kernel reading its streams in another order can pass it). On a core that overlaps arithmetic
  // with its reads fully it equals the probe. fraction_of_ceiling = gbps_best / ceiling_gbps; 0
  // where the target has no such loop.
  double ceiling_gbps = 0;
  double fraction_of_ceiling = 0;
  int ceiling_rows = 0;
  double flops = 0;
  double peak_gflops = 0;       // measured FMA peak with the same threads and ISA
  double compute_seconds = 0;   // flops / peak
  double memory_seconds = 0;    // kv_bytes / bandwidth
  std::string bound;            // "memory" or "compute": the tighter of the two limits
  double fraction_of_bound = 0; // max(memory_seconds, compute_seconds) / seconds
  double peer_seconds = -1;     // OpenBLAS peer median time; -1 when not run
  double ours_over_peer = -1;   // seconds / peer_seconds (< 1: we are faster)
  double max_rel_error = -1;    // vs the float64 oracle on a check row set (for fp8/int8: on
                                // the dequantized cache); -1 if unchecked
  double max_rel_error_unquantized = -1;  // fp8/int8 only: the same rows vs the oracle on the
                                          // values before quantization; -1 otherwise
};

// The cases: llama3-8b (H 32, Hkv 8, D 128) batch 1 Q 1 at 256k tokens, batch 16 at
// 16k tokens, and batch 1 Q 4 at 64k tokens.
std::vector<RooflineCase> default_roofline_cases();

// Streaming-read bandwidth in GB/s (1e9 bytes/s) with `threads` OpenMP threads (0 = all).
Result<double> measure_read_bandwidth(int threads, int64_t bytes, int repeats);

// FMA peak in GFLOP/s of an ISA target with `threads` threads (0 = all).
Result<double> measure_peak_gflops(int threads, Isa isa, int repeats);

// Runs every case x dtype x thread count. Probes are measured once per thread count.
Result<std::vector<RooflineRecord>> run_roofline(const RooflineOptions& options);

class Executor;  // executor.hpp

// The same roofline on another executor (`bench --kernel --device cuda`): for each case and
// dtype the KV cache in the executor's memory in the rows layout, the decode kernel through
// Executor::partial (timed with a synchronize after each call), and instead of the host probes a
// copy probe inside the executor's memory (Executor::copy of probe_bytes, counted as bytes read +
// written per second, the convention of tools/gpu-check.sh). Records have the same fields:
// isa = the executor's name, threads 0, peak_gflops 0 (not measured: bound "memory"), no peer;
// the check compares batch row 0's first 2048 tokens with the float64 oracle on the host copy.
// options.threads, isa, rows, tiles and peer are ignored.
Result<std::vector<RooflineRecord>> run_roofline_on(Executor& executor,
                                                    const RooflineOptions& options);

// A fixed-width text table of the records (one line per record, with a header).
std::string roofline_table(const std::vector<RooflineRecord>& records);

// One JSON object per record, as a JSON array (no external JSON dependency).
std::string roofline_json(const std::vector<RooflineRecord>& records);

}  // namespace treeattn
