// `auto` KV layout across ranks (host_kv_layout, strategy.hpp): each rank's kernel tuning cache
// (tuning.hpp) says something else, and every rank must still store rank 0's choice, in a DecodeSession and in the
// driver's run_interleaved (which resolves the layout once for its strategies). A rank that
// followed its own file would make the run's agreement fail, or read another layout than it
// reports.
// Usage (under mpirun, >= 2 ranks): multirank_layout DIR
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "treeattn/comm_mpi.hpp"
#include "treeattn/session.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/tuning.hpp"
#include "treeattn/workload.hpp"

using namespace treeattn;

namespace {

// This rank's tuning cache holds `layout` for the workload.
void write_cache(const KVLayoutWorkload& w, KVLayout layout) {
  TuneEntry e;
  e.key = TuneKey{w.dtype, w.shape.head_dim, w.shape.group(), w.kernel.threads};
  e.choice = tuning_defaults(e.key, best_isa());
  e.choice.layout = layout;
  const Status s = store_kernel_tuning({e});
  if (!s.is_ok()) std::fprintf(stderr, "%s\n", s.to_string().c_str());
}

KVLayout other(KVLayout l) { return l == KVLayout::kRows ? KVLayout::kTiled : KVLayout::kRows; }

}  // namespace

int main(int argc, char** argv) {
  auto world = mpi_init_world(&argc, &argv);
  if (!world.is_ok()) {
    std::fprintf(stderr, "%s\n", world.status().to_string().c_str());
    return 2;
  }
  Communicator& comm = **world;
  const int me = comm.rank();
  if (argc != 2 || comm.size() < 2) {
    if (me == 0) std::fprintf(stderr, "usage: mpirun -np P>=2 multirank_layout DIR\n");
    return 2;
  }
  const std::string dir = std::string(argv[1]) + "/rank" + std::to_string(me);
  ::mkdir(argv[1], 0755);
  std::filesystem::remove_all(dir);
  ::mkdir(dir.c_str(), 0755);
  ::setenv("TREEATTN_CACHE_DIR", dir.c_str(), 1);
  ::setenv("TREEATTN_TUNE", "1", 1);
  reload_kernel_tuning();

  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::printf("rank %d: FAIL: %s\n", me, what.c_str());
      ++failures;
    }
  };
  // Two workloads: rank 0 says tiled for the first and rows for the second, the others the
  // opposite, so that neither layout passes by being some rule's default.
  const KVLayout rank0_says[2] = {KVLayout::kTiled, KVLayout::kRows};
  for (int c = 0; c < 2; ++c) {
    const AttnShape shape{1, 6, 2, 64 + 64 * c, 1};
    DecodeOptions kernel;
    kernel.threads = 1;
    const KVLayoutWorkload w{shape, DType::kBF16, kernel};
    const KVLayout want = rank0_says[c];
    write_cache(w, me == 0 ? want : other(want));
    expect(host_kv_layout(w).layout == (me == 0 ? want : other(want)),
           "host_kv_layout does not read this rank's cache file");

    SessionConfig sc;
    sc.shape = shape;
    sc.dtype = DType::kBF16;
    sc.context = {300};
    sc.options.kernel = kernel;
    auto session = DecodeSession::create(comm, sc);
    if (!session.is_ok()) {
      expect(false, "session: " + session.status().to_string());
    } else {
      expect((*session)->config().layout == want,
             "the session stores " + std::string(kv_layout_name((*session)->config().layout)) +
                 ", rank 0 chose " + std::string(kv_layout_name(want)));
    }

    RunConfig rc;
    rc.shape = shape;
    rc.dtype = DType::kBF16;
    rc.total_len = {300};
    rc.steps = 1;
    rc.options.kernel = kernel;
    const std::string names[] = {"tree", "allgather"};
    auto reports = run_interleaved(comm, rc, names);
    if (!reports.is_ok()) {
      expect(false, "run_interleaved: " + reports.status().to_string());
    } else {
      for (const RunReport& r : *reports)
        expect(r.kv_layout == want, "run_interleaved read " +
                                        std::string(kv_layout_name(r.kv_layout)) +
                                        ", rank 0 chose " + std::string(kv_layout_name(want)));
    }
  }
  float all = static_cast<float>(failures);
  if (!comm.allreduce(&all, 1, ReduceOp::kSum).is_ok()) all = static_cast<float>(failures + 1);
  if (me == 0) std::printf(all == 0 ? "PASS\n" : "FAILED (%.0f)\n", static_cast<double>(all));
  world->reset();
  (void)mpi_finalize();
  return all == 0 ? 0 : 1;
}
