// Measures every strategy in one run and prints, per strategy and context length, the median
// decode latency (slowest rank), the bytes each rank sent (counted at the communicator, and as
// the kernel's TCP counters saw them when the job runs with `--mca btl self,tcp`), the attention
// working set and the process RSS, beside the analytic model. With --check-wire it also
// verifies the accounting: for strategies that only send point-to-point messages (ring-kv,
// ring-state) the counted payload must match the model exactly and the TCP bytes must be the
// payload plus at most 3% + 4 KiB of transport headers.
//
//   multirank_measure [--lengths 32768,262144] [--heads 32] [--kv-heads 8] [--dim 128]
//                     [--dtype bf16] [--batch 1] [--warmup 2] [--steps 7] [--threads 0]
//                     [--strategies tree,ring-kv,...] [--check-wire]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "treeattn/comm_mpi.hpp"
#include "treeattn/workload.hpp"

using namespace treeattn;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(item);
  return v;
}

// Per-rank results, all-gathered to rank 0 for the table.
struct RankRow {
  double median_s, p2p, coll_payload, wire, ws, model_bytes, model_ws, rss;
  int has_wire;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string mib(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024.0)
    std::snprintf(buf, sizeof(buf), "%.1fM", b / 1048576.0);
  else
    std::snprintf(buf, sizeof(buf), "%.0f", b);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  auto world = mpi_init_world(&argc, &argv);
  if (!world.is_ok()) {
    std::fprintf(stderr, "%s\n", world.status().to_string().c_str());
    return 2;
  }
  Communicator& comm = **world;
  const int p = comm.size(), me = comm.rank();

  std::vector<std::string> lengths = {"32768", "262144"}, names;
  AttnShape shape{1, 32, 8, 128, 1};
  DType dtype = DType::kBF16;
  int warmup = 2, steps = 7, threads = 0;
  bool check_wire = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--lengths")
      lengths = split(next());
    else if (a == "--heads")
      shape.heads = std::atoll(next().c_str());
    else if (a == "--kv-heads")
      shape.kv_heads = std::atoll(next().c_str());
    else if (a == "--dim")
      shape.head_dim = std::atoll(next().c_str());
    else if (a == "--batch")
      shape.batch = std::atoll(next().c_str());
    else if (a == "--dtype")
      dtype = parse_dtype(next()).value_or(DType::kBF16);
    else if (a == "--warmup")
      warmup = std::atoi(next().c_str());
    else if (a == "--steps")
      steps = std::atoi(next().c_str());
    else if (a == "--threads")
      threads = std::atoi(next().c_str());
    else if (a == "--strategies")
      names = split(next());
    else if (a == "--check-wire")
      check_wire = true;
    else {
      if (me == 0) std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (names.empty())
    for (const StrategyInfo& i : StrategyRegistry::for_backend(comm.capabilities()).list())
      names.emplace_back(i.name);
  if (threads == 0) threads = std::max(1, 2 / p);  // two cores on the reference machine

  if (me == 0) {
    std::printf("p=%d shape %s dtype %s, kernel threads/rank %d, warmup %d, steps %d\n", p,
                shape.to_string().c_str(), std::string(dtype_name(dtype)).c_str(), threads, warmup,
                steps);
    std::printf("%-11s %8s %9s %10s %10s %10s %10s %10s %10s %10s\n", "strategy", "N", "median_ms",
                "sent_p2p", "coll_pay", "sent_tcp", "model_sent", "ws", "model_ws", "rss");
  }
  int failures = 0;
  for (const std::string& n_text : lengths) {
    for (const std::string& name : names) {
      RunConfig c;
      c.strategy = name;
      c.shape = shape;
      c.dtype = dtype;
      c.total_len = {std::atoll(n_text.c_str())};
      c.shard = ShardKind::kEven;
      c.warmup = warmup;
      c.steps = steps;
      c.keep_states = false;
      c.options.kernel.threads = threads;
      // The accounting check compares with the analytic model, which counts rows (on the tiled
      // layout ring-kv sends whole tiles).
      if (check_wire) c.kv_layout = KVLayout::kRows;
      auto rep = run_decode(comm, c);
      if (!rep.is_ok()) {
        std::printf("rank %d: %s N=%s: %s\n", me, name.c_str(), n_text.c_str(),
                    rep.status().to_string().c_str());
        ++failures;
        continue;
      }
      std::vector<double> secs;
      RankRow mine{};
      for (const StepReport& s : rep->steps) {
        secs.push_back(s.max_seconds);
        mine.p2p = std::max(mine.p2p, static_cast<double>(s.p2p_bytes));
        mine.coll_payload =
            std::max(mine.coll_payload, static_cast<double>(s.collective_payload_bytes));
        mine.ws = std::max(mine.ws, static_cast<double>(s.working_set_bytes));
        if (s.wire_bytes) {
          mine.has_wire = 1;
          mine.wire = std::max(mine.wire, static_cast<double>(*s.wire_bytes));
        }
        // Accounting check: explicit messages only, counted == model, TCP == payload + headers.
        if (check_wire && (name == "ring-kv" || name == "ring-state") && p > 1) {
          const auto counted = static_cast<double>(s.p2p_bytes);
          const double wire = s.wire_bytes ? static_cast<double>(*s.wire_bytes) : -1.0;
          if (counted != rep->model.bytes_sent || !(wire >= counted) ||
              !(wire <= counted * 1.03 + 4096)) {
            std::printf(
                "rank %d: ACCOUNTING FAIL %s step %lld: counted %.0f, model %.0f, tcp %.0f\n", me,
                name.c_str(), static_cast<long long>(s.step), counted, rep->model.bytes_sent, wire);
            ++failures;
          }
        }
      }
      mine.median_s = median(secs);
      mine.model_bytes = rep->model.bytes_sent;
      mine.model_ws = rep->model.working_set_bytes;
      mine.rss = static_cast<double>(rep->peak_rss_bytes);
      std::vector<RankRow> all(static_cast<std::size_t>(p));
      if (!comm.allgather(&mine, sizeof(RankRow), all.data()).is_ok()) return 1;
      if (me == 0)
        for (int r = 0; r < p; ++r) {
          const RankRow& x = all[static_cast<std::size_t>(r)];
          std::printf("%-11s %8s %9.3f %10s %10s %10s %10s %10s %10s %10s  (rank %d)\n",
                      name.c_str(), n_text.c_str(), x.median_s * 1e3, mib(x.p2p).c_str(),
                      mib(x.coll_payload).c_str(), x.has_wire ? mib(x.wire).c_str() : "-",
                      mib(x.model_bytes).c_str(), mib(x.ws).c_str(), mib(x.model_ws).c_str(),
                      mib(x.rss).c_str(), r);
        }
      std::fflush(stdout);
    }
  }
  float any = failures ? 1.0f : 0.0f;
  (void)comm.allreduce(&any, 1, ReduceOp::kMax);
  if (me == 0) std::printf("%s\n", any > 0 ? "FAILED" : "PASSED");
  world->reset();
  (void)mpi_finalize();
  return any > 0 ? 1 : 0;
}
