// Failure behaviour under real mpirun: each case must end with the expected error, on the
// expected ranks, inside a bounded time. Run as `multirank_faults CASE`; tests/multirank/expect.sh
// checks the printed messages and the elapsed time.
//
//   mismatch-dim    rank 0 uses head_dim 64, the others 128: every rank reports kMismatch naming
//                   rank 0's and rank 1's values.
//   mismatch-dtype  rank 1 uses bf16, the others f32.
//   timeout         after one successful collective (so the test measures the operation
//                   timeout, not connection set-up), the last rank skips an allreduce_states
//                   with a 200 ms timeout; the others must report kTimeout naming it. They then
//                   abort the job (a timed-out communicator is unusable).
//   timeout-p2p     the same for the ring: the last rank never posts its ring-state messages.
//   kill            rank 1 kills itself (SIGKILL) in the middle of a decode loop; mpirun must
//                   end the job with its own message, the others must not hang.
//   nan-check       rank 1's K holds a NaN and check_inputs is on: every rank reports kNumerics
//                   naming rank 1.
//   nan-propagate   the same without the check: the NaN reaches every rank's output.
//
// Each rank prints "rank R: RESULT <code>: <message>" and "rank R: elapsed_ms=<t>".
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "treeattn/comm_mpi.hpp"
#include "treeattn/workload.hpp"

using namespace treeattn;
using Clock = std::chrono::steady_clock;

namespace {

RunConfig base_config() {
  RunConfig c;
  c.strategy = "tree";
  c.shape = {1, 4, 2, 128, 1};
  c.dtype = DType::kF32;
  c.total_len = {64};
  c.timeout = std::chrono::milliseconds(10000);
  c.options.kernel.threads = 1;
  return c;
}

void print_result(int rank, const Status& s, Clock::time_point t0) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  std::printf("rank %d: RESULT %s: %s\nrank %d: elapsed_ms=%lld\n", rank, code_name(s.code()),
              s.message().c_str(), rank, static_cast<long long>(ms));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  auto world = mpi_init_world(&argc, &argv);
  if (!world.is_ok()) {
    std::fprintf(stderr, "%s\n", world.status().to_string().c_str());
    return 2;
  }
  Communicator& comm = **world;
  const int me = comm.rank(), p = comm.size();
  const std::string which = argc > 1 ? argv[1] : "";
  int rc = 0;

  if (which == "mismatch-dim" || which == "mismatch-dtype") {
    RunConfig c = base_config();
    if (which == "mismatch-dim" && me == 0) c.shape.head_dim = 64;
    if (which == "mismatch-dtype" && me == 1) c.dtype = DType::kBF16;
    const auto t0 = Clock::now();
    auto r = run_decode(comm, c);
    print_result(me, r.status(), t0);
    rc = r.status().code() == Code::kMismatch ? 0 : 1;
  } else if (which == "timeout" || which == "timeout-p2p") {
    const int missing = p - 1;
    comm.set_timeout(std::chrono::milliseconds(200));
    std::vector<float> rec(4 * 66);
    for (std::size_t i = 0; i < 4; ++i) state_set_empty(rec.data() + i * 66, 64);
    Status warm = comm.allreduce_states(rec.data(), 4, 64);  // everyone: connections are up
    if (!warm.is_ok()) {
      print_result(me, warm, Clock::now());
      return 1;
    }
    comm.set_context("step 3");
    if (me == missing) {
      std::this_thread::sleep_for(std::chrono::seconds(20));  // ended by the others' abort
      return 0;
    }
    const auto t0 = Clock::now();
    Status s;
    if (which == "timeout") {
      s = comm.allreduce_states(rec.data(), 4, 64);
    } else {
      // One ring hop: receive from the left neighbour, send to the right.
      const int next = (me + 1) % p, prev = (me + p - 1) % p;
      std::vector<float> in(rec.size());
      auto rq = comm.irecv(in.data(), in.size() * sizeof(float), prev, 7);
      auto sq = comm.isend(rec.data(), rec.size() * sizeof(float), next, 7);
      if (rq.is_ok() && sq.is_ok()) {
        const CommRequest reqs[2] = {*rq, *sq};
        s = comm.wait_all(reqs);
      } else {
        s = rq.is_ok() ? sq.status() : rq.status();
      }
    }
    print_result(me, s, t0);
    // Let the other ranks print, then end the job (the communicator is unusable now).
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    comm.abort(s.code() == Code::kTimeout ? 3 : 4, "");
  } else if (which == "kill") {
    RunConfig c = base_config();
    c.steps = 2;
    const auto t0 = Clock::now();
    for (int i = 0; i < 50; ++i) {
      if (i == 3 && me == 1) std::raise(SIGKILL);
      auto r = run_decode(comm, c);
      if (!r.is_ok()) {
        print_result(me, r.status(), t0);
        return 1;
      }
    }
    print_result(me, Status::ok(), t0);
    rc = 1;  // reaching here means the kill did not happen
  } else if (which == "nan-check" || which == "nan-propagate") {
    RunConfig c = base_config();
    c.inject_nan_rank = p > 1 ? 1 : 0;
    c.check_inputs = which == "nan-check";
    const auto t0 = Clock::now();
    auto r = run_decode(comm, c);
    if (which == "nan-check") {
      print_result(me, r.status(), t0);
      rc = r.status().code() == Code::kNumerics ? 0 : 1;
    } else if (!r.is_ok()) {
      print_result(me, r.status(), t0);
      rc = 1;
    } else {
      bool nan = false;
      for (float x :
           std::vector<float>(r->states[0].data(), r->states[0].data() + r->states[0].floats()))
        nan = nan || std::isnan(x);
      std::printf("rank %d: output %s NaN\n", me, nan ? "contains" : "does not contain");
      rc = nan ? 0 : 1;
    }
  } else {
    std::fprintf(stderr,
                 "usage: multirank_faults mismatch-dim|mismatch-dtype|timeout|timeout-p2p|"
                 "kill|nan-check|nan-propagate\n");
    rc = 2;
  }
  world->reset();
  (void)mpi_finalize();
  return rc;
}
