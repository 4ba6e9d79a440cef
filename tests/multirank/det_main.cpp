// tree-det under real mpirun: prints, on rank 0, one line per case with the SHA-256 of the
// merged output and LSE ("case NAME sha256 HEX"); det_check.sh runs it at 1, 2, 3, 4, 5, 7 and 8
// ranks and requires every rank count to print the very same hashes (bitwise identical results
// whatever the rank count and placement). Each case is also checked against the float64 oracle
// and for identical bits on all ranks of the job; exit 1 on any failure.
#include <cstdio>
#include <string>
#include <vector>

#include "treeattn/comm_mpi.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/workload.hpp"

using namespace treeattn;

int main(int argc, char** argv) {
  auto world_r = mpi_init_world(&argc, &argv);
  if (!world_r.is_ok()) {
    std::fprintf(stderr, "%s\n", world_r.status().to_string().c_str());
    return 2;
  }
  std::unique_ptr<Communicator> world = std::move(world_r).value();
  const int p = world->size(), me = world->rank();
  struct Case {
    std::string name;
    AttnShape shape;
    DType dtype;
    std::vector<int64_t> lens;
    ShardKind kind;
  };
  const std::vector<Case> cases = {
      {"f32-even", {1, 8, 2, 64, 1}, DType::kF32, {3001}, ShardKind::kEven},
      {"bf16-uneven-ragged", {2, 4, 2, 128, 1}, DType::kBF16, {1500, 77}, ShardKind::kUneven},
      {"f16-q2-explicit-empty", {1, 4, 1, 64, 2}, DType::kF16, {999}, ShardKind::kExplicit},
      {"fp8-even", {1, 4, 2, 64, 1}, DType::kFP8, {2048}, ShardKind::kEven},
      {"int8-single", {1, 4, 2, 64, 1}, DType::kInt8, {700}, ShardKind::kSingle},
  };
  int failures = 0;
  for (const Case& c : cases) {
    RunConfig rc;
    rc.strategy = "tree-det";
    rc.shape = c.shape;
    rc.dtype = c.dtype;
    rc.total_len = c.lens;
    rc.shard = c.kind;
    rc.seed = 11;
    rc.q_scale = 3.0f;
    rc.warmup = 0;
    rc.steps = 2;
    rc.append = true;
    rc.timeout = std::chrono::milliseconds(30000);
    rc.options.kernel.threads = 1;
    if (c.kind == ShardKind::kExplicit) {  // even ranks hold nothing (rank 0 holds all at p = 1)
      int holders = 0;
      for (int r = 0; r < p; ++r) holders += (p == 1 || r % 2 == 1) ? 1 : 0;
      for (int64_t n : c.lens) {
        int64_t left = n;
        std::vector<int64_t> per(static_cast<std::size_t>(p), 0);
        for (int r = 0, i = 0; r < p; ++r)
          if (p == 1 || r % 2 == 1) {
            const int64_t take = ++i == holders ? left : n / holders;
            per[static_cast<std::size_t>(r)] = take;
            left -= take;
          }
        rc.explicit_len = per;
      }
    }
    auto rep = run_decode(*world, rc);
    if (!rep.is_ok()) {
      std::printf("rank %d: case %s FAILED: %s\n", me, c.name.c_str(), rep.status().to_string().c_str());
      ++failures;
      continue;
    }
    const StateBuffer& st = rep->states.back();
    if (Status same = check_identical_across_ranks(*world, st); !same.is_ok()) {
      std::printf("rank %d: case %s FAILED: %s\n", me, c.name.c_str(), same.to_string().c_str());
      ++failures;
    }
    if (me == 0) {
      auto chk = check_against_oracle(rc, rc.warmup + rc.steps - 1, st);
      if (!chk.is_ok() || !chk->passed) {
        std::printf("rank 0: case %s FAILED the oracle check: %s\n", c.name.c_str(),
                    chk.is_ok() ? chk->detail.c_str() : chk.status().to_string().c_str());
        ++failures;
      }
      std::printf("case %s sha256 %s\n", c.name.c_str(), output_sha256(st).c_str());
    }
  }
  world.reset();
  (void)mpi_finalize();
  return failures ? 1 : 0;
}
