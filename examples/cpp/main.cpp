// One distributed decode step through treeattn's public API, checked against the float64
// oracle: each rank stores its share of a small deterministic KV cache in a DecodeSession, all
// ranks attend, and rank 0 compares the merged output with oracle_attention over the whole
// cache. Run: mpirun -np 2 ./example (exit status 1 when the result is wrong).
#include <cmath>
#include <cstdio>
#include <vector>

#include "treeattn/comm_mpi.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"

using namespace treeattn;

static void check(const Status& s) {  // errors reach every rank alike: print and end the job
  if (!s.is_ok()) mpi_abort(1, s.to_string());
}

int main(int argc, char** argv) {
  auto world = mpi_init_world(&argc, &argv);
  check(world.status());
  const int64_t B = 2, H = 8, Hkv = 2, D = 64, N = 37;  // N tokens of context per batch row
  SessionConfig cfg;  // strategy "tree", placement: contiguous even split over the ranks
  cfg.shape = {.batch = B, .heads = H, .kv_heads = Hkv, .head_dim = D};
  cfg.dtype = DType::kF32;
  cfg.context = {N};
  auto created = DecodeSession::create(**world, cfg);
  check(created.status());
  DecodeSession& session = **created;

  // The whole cache K, V [b][pos][kv_head][d] and q [b][head][d], the same on every rank.
  std::vector<float> k(B * N * Hkv * D), v(k.size()), q(B * H * D), out(q.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.37f * i), v[i] = std::cos(0.11f * i);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(1.3f * i + 0.5f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t pos = 0, at = b * N * Hkv * D; pos < N; ++pos, at += Hkv * D)
      if (session.owns(b, pos)) check(session.store(/*layer=*/0, b, pos, &k[at], &v[at]));
  check(session.attend(/*layer=*/0, q.data(), out.data()));

  int rc = 0;
  if ((*world)->rank() == 0) {  // the float64 oracle over the whole cache, on one process
    const std::vector<int64_t> len(B, N), start(B, 0);
    KVShard all;  // K and V above as one view; strides in elements
    all.k = k.data(), all.v = v.data(), all.len = all.total_len = len, all.pos_start = start;
    all.stride_batch = N * Hkv * D, all.stride_head = D, all.stride_token = Hkv * D;
    std::vector<double> ref(out.size()), lse(B * H);
    check(oracle_attention(cfg.shape, q.data(), all, ref.data(), lse.data()));
    double err = 0;
    for (std::size_t i = 0; i < out.size(); ++i) err = std::fmax(err, std::fabs(out[i] - ref[i]));
    rc = err <= 1e-5 ? 0 : 1;
    std::printf("%d ranks: max |out - oracle| = %.3g %s\n", (*world)->size(), err,
                rc == 0 ? "(ok)" : "(WRONG)");
  }
  created.value().reset();  // the session before its communicator, both before MPI_Finalize
  world.value().reset();
  check(mpi_finalize());
  return rc;
}
