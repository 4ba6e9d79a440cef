// A multi-host exactness check for the emulated cluster (tools/cluster): run it with mpirun
// across network namespaces and it verifies that
//   1. MPI_COMM_TYPE_SHARED splits the job into the expected number of hosts, each with a
//      distinct hostname (so Open MPI really treats the namespaces as separate nodes);
//   2. partial attention states computed on uneven sequence shards and merged with ONE
//      MPI_Allreduce (user-defined merge op on packed (m, l, o[D]) records, the "tree"
//      strategy) equal the float64 oracle over the whole cache on every rank;
//   3. a small-message ping-pong between rank 0 and a rank on another host completes (its
//      half round trip is printed, informative only).
// Exit status 0 only if every rank passes. Usage: cluster_check [--expect-nodes K]
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "treeattn/oracle.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/state.hpp"

namespace {

using treeattn::AttnShape;

int g_head_dim = 0;

void merge_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto d = static_cast<std::size_t>(g_head_dim);
  treeattn::state_merge_n(static_cast<float*>(inout), static_cast<const float*>(in),
                          static_cast<std::size_t>(*len), d);
}

int fail(int rank, const std::string& what) {
  std::fprintf(stderr, "cluster_check rank %d: FAIL: %s\n", rank, what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int expect_nodes = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--expect-nodes") == 0 && i + 1 < argc) {
      expect_nodes = std::atoi(argv[++i]);
    } else {
      if (rank == 0) std::fprintf(stderr, "usage: cluster_check [--expect-nodes K]\n");
      MPI_Finalize();
      return 2;
    }
  }
  int failures = 0;

  // 1. hosts.
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int node_rank = 0;
  MPI_Comm_rank(node, &node_rank);
  int is_leader = node_rank == 0 ? 1 : 0, nodes = 0;
  MPI_Allreduce(&is_leader, &nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  std::vector<char> hosts(static_cast<std::size_t>(size) * 256);
  MPI_Allgather(host, 256, MPI_CHAR, hosts.data(), 256, MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> names;
  for (int r = 0; r < size; ++r) names.emplace_back(&hosts[static_cast<std::size_t>(r) * 256]);
  std::vector<std::string> distinct = names;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  if (static_cast<int>(distinct.size()) != nodes)
    failures +=
        fail(rank, "shared-memory split found " + std::to_string(nodes) + " nodes but there are " +
                       std::to_string(distinct.size()) + " distinct hostnames");
  if (expect_nodes > 0 && nodes != expect_nodes)
    failures += fail(rank, "expected " + std::to_string(expect_nodes) + " hosts, found " +
                               std::to_string(nodes));

  // 2. exactness of the one-collective merge across hosts.
  const AttnShape shape{2, 4, 2, 64, 1};
  g_head_dim = static_cast<int>(shape.head_dim);
  const int64_t n_tokens = 997;  // prime: shards are uneven
  treeattn::KVCache cache(shape, treeattn::DType::kF32, n_tokens);
  std::mt19937 gen(1234);  // the same cache on every rank
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> kbuf(static_cast<std::size_t>(shape.head_dim)), vbuf(kbuf.size());
  for (int64_t b = 0; b < shape.batch; ++b)
    for (int64_t h = 0; h < shape.kv_heads; ++h)
      for (int64_t t = 0; t < n_tokens; ++t) {
        for (auto& x : kbuf) x = dist(gen);
        for (auto& x : vbuf) x = dist(gen);
        cache.set_token(b, h, t, kbuf.data(), vbuf.data());
      }
  std::vector<float> q(
      static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads * shape.head_dim));
  for (auto& x : q) x = dist(gen);

  const int64_t first = n_tokens * rank / size;
  const int64_t last = n_tokens * (rank + 1) / size;
  const std::vector<int64_t> len(static_cast<std::size_t>(shape.batch), last - first);
  const std::vector<int64_t> start(len.size(), first), total(len.size(), n_tokens);
  const treeattn::KVShard shard = cache.view(first, len, start, total, 1);
  const std::size_t rows = static_cast<std::size_t>(shape.batch * shape.q_len * shape.heads);
  const std::size_t rec = treeattn::state_record_floats(static_cast<std::size_t>(shape.head_dim));
  std::vector<double> partial(rows * rec);
  treeattn::Status st = treeattn::oracle_partial(shape, q.data(), shard, partial.data());
  if (!st.is_ok()) failures += fail(rank, "oracle_partial: " + st.to_string());
  std::vector<float> states(partial.begin(), partial.end());

  MPI_Datatype record;
  MPI_Type_contiguous(static_cast<int>(rec), MPI_FLOAT, &record);
  MPI_Type_commit(&record);
  MPI_Op op;
  MPI_Op_create(&merge_op, 1, &op);
  std::vector<float> merged(states.size());
  MPI_Allreduce(states.data(), merged.data(), static_cast<int>(rows), record, op, MPI_COMM_WORLD);

  const std::vector<int64_t> full_len(len.size(), n_tokens), zero(len.size(), 0);
  const treeattn::KVShard whole = cache.view(0, full_len, zero, total, 1);
  std::vector<double> want(rows * static_cast<std::size_t>(shape.head_dim)), want_lse(rows);
  st = treeattn::oracle_attention(shape, q.data(), whole, want.data(), want_lse.data());
  if (!st.is_ok()) failures += fail(rank, "oracle_attention: " + st.to_string());
  double max_err = 0;
  const auto d = static_cast<std::size_t>(shape.head_dim);
  std::vector<float> out(d);
  for (std::size_t r = 0; r < rows; ++r) {
    float lse = 0;
    treeattn::state_normalize(merged.data() + r * rec, d, out.data(), &lse);
    for (std::size_t i = 0; i < d; ++i)
      max_err = std::max(max_err, std::abs(static_cast<double>(out[i]) - want[r * d + i]));
    max_err = std::max(max_err, std::abs(static_cast<double>(lse) - want_lse[r]));
  }
  if (!(max_err < 1e-5))
    failures += fail(rank, "merged output differs from the oracle by " + std::to_string(max_err) +
                               " (limit 1e-5)");

  // 3. ping-pong with the first rank on another host (bounded: 200 round trips).
  int peer = -1;
  for (int r = 0; r < size; ++r)
    if (names[static_cast<std::size_t>(r)] != names[0]) {
      peer = r;
      break;
    }
  double half_rtt_us = 0;
  if (peer > 0 && (rank == 0 || rank == peer)) {
    const int other = rank == 0 ? peer : 0;
    char buf[8] = {};
    constexpr int kIters = 200;
    const double t0 = MPI_Wtime();
    for (int i = 0; i < kIters; ++i) {
      if (rank == 0) {
        MPI_Send(buf, 8, MPI_CHAR, other, 7, MPI_COMM_WORLD);
        MPI_Recv(buf, 8, MPI_CHAR, other, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(buf, 8, MPI_CHAR, other, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buf, 8, MPI_CHAR, other, 7, MPI_COMM_WORLD);
      }
    }
    half_rtt_us = (MPI_Wtime() - t0) / (2.0 * kIters) * 1e6;
  }

  int total_failures = 0;
  MPI_Allreduce(&failures, &total_failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  double worst_err = 0;
  MPI_Reduce(&max_err, &worst_err, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("cluster_check: %d ranks on %d hosts (", size, nodes);
    for (std::size_t i = 0; i < distinct.size(); ++i)
      std::printf("%s%s", i ? ", " : "", distinct[i].c_str());
    std::printf("); merge max |err| vs oracle %.3g; 8 B ping-pong rank 0 <-> %d: %.1f us; %s\n",
                worst_err, peer, half_rtt_us, total_failures == 0 ? "PASS" : "FAIL");
  }
  MPI_Op_free(&op);
  MPI_Type_free(&record);
  MPI_Comm_free(&node);
  MPI_Finalize();
  return total_failures == 0 ? 0 : 1;
}
