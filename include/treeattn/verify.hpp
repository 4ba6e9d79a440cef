// The exactness experiment behind `treeattn verify`: random cases (shapes, GQA, head dims,
// ragged batches, multi-token queries, dtypes, shard placements incl. empty shards), each a
// short decode loop with appends, checked against the float64 oracle and for bit-identical
// results on every rank. Everything about a case follows from its seed, so one seed reruns it.
//
//   make_case(seed, ranks, types, contiguous)   the case (local, the same on every rank)
//   check_case(world, case, method, options)    collective: run, check, one verdict everywhere
//   save_case / write_index                     the case's q, k, v, output and LSE as .npy
//                                               files and their index.json (numpy rechecks)
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/state_buffer.hpp"
#include "treeattn/status.hpp"
#include "treeattn/workload.hpp"

namespace treeattn::verify {

struct Case {
  uint64_t seed = 0;
  RunConfig config;  // strategy, KV layout and devices are the check's (check_case)
  // "B2 H8/2 D128 Q1 N=700/3 bf16 even"
  std::string describe() const;
};

// Case `seed` for `ranks` ranks, its KV type drawn from `types`; contiguous: no striped
// placement (tree-det's need).
Case make_case(uint64_t seed, int ranks, const std::vector<DType>& types, bool contiguous);

// The KV layout of one check: `layout`, or with kAuto the tiled layout on odd seeds and rows on
// even ones (so that both are checked); rows on a device (its shards are rows).
KVLayout case_layout(KVLayout layout, uint64_t seed, bool device);

struct CheckOptions {
  double tolerance = 1e-5;  // relative to max(1, max|ref|)
  KVLayout layout = KVLayout::kAuto;
  Executor* executor = nullptr;       // null: the CPU executor
  Communicator* device_comm = nullptr;  // with a device executor: the communicator there
  std::chrono::milliseconds timeout{60000};
  std::filesystem::path save_dir;  // not empty: rank 0 saves the case there (save_case)
};

struct Check {
  bool ok = false;            // the same on every rank (rank 0's verdict)
  double rel_error = 0;       // rank 0's, sent to every rank
  KVLayout layout = KVLayout::kRows;
  std::string why;            // why not ok: rank 0's oracle or save message, or this rank's error
  std::string output_sha256;  // rank 0: of the last step's output and LSE
  std::string saved;          // rank 0 with save_dir: the case's index entry (JSON text)
  // The run failed with a timeout or an internal error: the ranks may be out of step, the
  // caller ends the job (why says what failed).
  bool must_abort = false;
};

// Collective over world: runs the case with `method`; rank 0 checks the last step against the
// float64 oracle (and saves it); every rank checks that its result is bit-identical to the
// others'; rank 0's verdict is broadcast.
Check check_case(Communicator& world, const Case& c, const std::string& method,
                 const CheckOptions& options);

// Writes the case's query, keys, values (widened to float32 exactly) and merged output/LSE
// (from `states`, the last step's) under dir as case-SEED-{q,k,v,out,lse}.npy; returns the
// index entry (JSON text). Throws std::filesystem_error / std::ios_base::failure on a full disk.
std::string save_case(const std::filesystem::path& dir, const Case& c, const StateBuffer& states,
                      const std::string& method);
// dir/index.json: {"ranks": ranks, "cases": [entries...]}.
Status write_index(const std::filesystem::path& dir, int ranks,
                   const std::vector<std::string>& entries);

}  // namespace treeattn::verify
