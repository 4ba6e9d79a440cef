// Measuring the topology of a running job (detect.hpp: detect_topology): the shared-memory
// split, ping-pongs on the node and network levels, the memory-bandwidth probe and a small
// merge allreduce, all through the Communicator interface (no MPI headers here). Part of the
// measurement library treeattn_measure.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/cost_model.hpp"
#include "treeattn/detect.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/roofline.hpp"
#include "treeattn/topology.hpp"

namespace treeattn {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string fmt_double(double v, int digits = 3) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
  return buf;
}

// Half round trip in microseconds between ranks a and b (median over iters after a warm-up),
// known on every rank afterwards. Other ranks wait in the closing barrier.
Result<double> ping_pong(Communicator& comm, int a, int b, int64_t bytes, int iters) {
  const int me = comm.rank();
  std::vector<char> buf(static_cast<std::size_t>(std::max<int64_t>(bytes, 1)), 1);
  const auto n = static_cast<std::size_t>(bytes);
  double result = 0;
  TREEATTN_RETURN_IF_ERROR(comm.barrier());
  if (me == a || me == b) {
    const int peer = me == a ? b : a;
    const int warmup = std::max(2, iters / 10);
    std::vector<double> samples;
    for (int i = 0; i < warmup + iters; ++i) {
      const auto t0 = Clock::now();
      if (me == a) {
        auto s = comm.isend(buf.data(), n, peer, 7);
        if (!s.is_ok()) return s.status();
        TREEATTN_RETURN_IF_ERROR(comm.wait_all(std::span<const CommRequest>(&s.value(), 1)));
        auto r = comm.irecv(buf.data(), n, peer, 7);
        if (!r.is_ok()) return r.status();
        TREEATTN_RETURN_IF_ERROR(comm.wait_all(std::span<const CommRequest>(&r.value(), 1)));
      } else {
        auto r = comm.irecv(buf.data(), n, peer, 7);
        if (!r.is_ok()) return r.status();
        TREEATTN_RETURN_IF_ERROR(comm.wait_all(std::span<const CommRequest>(&r.value(), 1)));
        auto s = comm.isend(buf.data(), n, peer, 7);
        if (!s.is_ok()) return s.status();
        TREEATTN_RETURN_IF_ERROR(comm.wait_all(std::span<const CommRequest>(&s.value(), 1)));
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (i >= warmup) samples.push_back(us / 2.0);
    }
    result = median(samples);
  }
  TREEATTN_RETURN_IF_ERROR(comm.broadcast(&result, sizeof(result), a));
  return result;
}

// Every rank with a partner (partner >= 0) exchanges `bytes` with it in both directions at
// once; returns the median over iterations of the slowest rank's time in us (on every rank).
Result<double> exchange(Communicator& comm, int partner, int64_t bytes, int iters) {
  std::vector<char> out(static_cast<std::size_t>(bytes), 1), in(static_cast<std::size_t>(bytes));
  std::vector<double> samples;
  for (int i = 0; i < iters + 2; ++i) {
    TREEATTN_RETURN_IF_ERROR(comm.barrier());
    const auto t0 = Clock::now();
    if (partner >= 0) {
      CommRequest reqs[2];
      auto r = comm.irecv(in.data(), in.size(), partner, 8);
      if (!r.is_ok()) return r.status();
      reqs[0] = *r;
      auto sd = comm.isend(out.data(), out.size(), partner, 8);
      if (!sd.is_ok()) return sd.status();
      reqs[1] = *sd;
      TREEATTN_RETURN_IF_ERROR(comm.wait_all(reqs));
    }
    float us =
        partner >= 0 ? std::chrono::duration<float, std::micro>(Clock::now() - t0).count() : 0.0f;
    TREEATTN_RETURN_IF_ERROR(comm.allreduce(&us, 1, ReduceOp::kMax));
    if (i >= 2) samples.push_back(static_cast<double>(us));
  }
  return median(samples);
}

// The three collectives a one-call merge can run, at the size of one step's state records
// (allreduce_records records of head_dim + 2 floats): medians over calls of the slowest rank's
// time in us.
struct CollectiveTimes {
  double user_op = 0;    // allreduce_states: the merge as a user-defined reduction (`tree`)
  double built_in = 0;   // a built-in float sum allreduce of the same bytes (tree-paper's kind)
  double allgather = 0;  // the all-gather of every rank's records (`allgather`, NCCL's `tree`)
};

// Interleaved: every iteration times one call of each, in an order that rotates, so that load
// that comes and goes hits the three alike.
Result<CollectiveTimes> time_collectives(Communicator& comm, const DetectOptions& o) {
  const auto D = static_cast<std::size_t>(o.head_dim);
  const auto n = static_cast<std::size_t>(o.allreduce_records);
  std::vector<float> rec(n * (D + 2), 0.0f), sum(n * (D + 2), 0.0f);
  std::vector<float> all(rec.size() * static_cast<std::size_t>(comm.size()));
  std::array<std::vector<double>, 3> samples;
  constexpr int kWarmup = 5;
  for (int i = 0; i < o.allreduce_iters + kWarmup; ++i) {
    for (int j = 0; j < 3; ++j) {
      const int which = (i + j) % 3;
      for (std::size_t k = 0; k < n; ++k) {
        rec[k * (D + 2)] = 0.0f;      // m
        rec[k * (D + 2) + 1] = 1.0f;  // l
      }
      TREEATTN_RETURN_IF_ERROR(comm.barrier());
      const auto t0 = Clock::now();
      if (which == 0)
        TREEATTN_RETURN_IF_ERROR(comm.allreduce_states(rec.data(), n, D));
      else if (which == 1)
        TREEATTN_RETURN_IF_ERROR(comm.allreduce(sum.data(), sum.size(), ReduceOp::kSum));
      else
        TREEATTN_RETURN_IF_ERROR(comm.allgather(rec.data(), rec.size() * sizeof(float), all.data()));
      float us = std::chrono::duration<float, std::micro>(Clock::now() - t0).count();
      TREEATTN_RETURN_IF_ERROR(comm.allreduce(&us, 1, ReduceOp::kMax));
      if (i >= kWarmup) samples[static_cast<std::size_t>(which)].push_back(static_cast<double>(us));
    }
  }
  return CollectiveTimes{median(samples[0]), median(samples[1]), median(samples[2])};
}

struct Level {
  double latency_us = 0;
  double bandwidth_GBps = 0;
};

Result<Level> measure_level(Communicator& comm, int a, int b, const DetectOptions& o) {
  auto lat = ping_pong(comm, a, b, o.latency_bytes, o.latency_iters);
  if (!lat.is_ok()) return lat.status();
  auto big = ping_pong(comm, a, b, o.bandwidth_bytes, o.bandwidth_iters);
  if (!big.is_ok()) return big.status();
  Level l;
  l.latency_us = std::max(0.01, *lat);
  // Bandwidth from the time beyond the small-message latency (at least 10% of the total, so
  // that noise cannot produce an absurd rate).
  const double wire_us = std::max(*big - *lat, 0.1 * *big);
  l.bandwidth_GBps = static_cast<double>(o.bandwidth_bytes) / (wire_us * 1e3);
  return l;
}

// Median over calls of the slowest rank's time in us of decode_partial over `tokens` tokens of
// one batch row, timed on every rank at once (barrier before each call).
Result<double> time_kernel(Communicator& comm, const DetectOptions& o, DType dt, int64_t tokens,
                           int threads) {
  const AttnShape shape{1, o.kernel_heads, o.kernel_kv_heads, o.head_dim, 1};
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  KVCache cache(shape, dt, tokens);
  std::vector<float> row(static_cast<std::size_t>(o.head_dim), 0.01f);
  for (int64_t h = 0; h < shape.kv_heads; ++h)
    for (int64_t t = 0; t < tokens; ++t) cache.set_token(0, h, t, row.data(), row.data());
  std::vector<float> q(static_cast<std::size_t>(shape.heads * shape.head_dim), 0.02f);
  std::vector<float> states(static_cast<std::size_t>(shape.heads * (shape.head_dim + 2)));
  const int64_t len[1] = {tokens}, start[1] = {0}, total[1] = {tokens};
  const KVShard kv = cache.view(0, len, start, total, 1);
  DecodeOptions opt;
  opt.threads = threads;
  std::vector<double> samples;
  for (int i = 0; i < o.kernel_iters + 2; ++i) {
    TREEATTN_RETURN_IF_ERROR(comm.barrier());
    const auto t0 = Clock::now();
    TREEATTN_RETURN_IF_ERROR(decode_partial(shape, q.data(), kv, states.data(), opt));
    float us = std::chrono::duration<float, std::micro>(Clock::now() - t0).count();
    // The slowest rank of each call, as bench reports a step.
    TREEATTN_RETURN_IF_ERROR(comm.allreduce(&us, 1, ReduceOp::kMax));
    if (i >= 2) samples.push_back(static_cast<double>(us));
  }
  return median(samples);
}

std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace

Result<Topology> detect_topology(Communicator& world, const DetectOptions& o,
                                 std::vector<std::string>* notes) {
  TREEATTN_RETURN_IF_ERROR(check_thread_count(o.probe_threads, "probe_threads"));
  TREEATTN_RETURN_IF_ERROR(check_thread_count(o.kernel_threads, "kernel_threads"));
  if (o.latency_iters < 1 || o.bandwidth_iters < 1 || o.allreduce_iters < 1 ||
      o.latency_bytes < 1 || o.bandwidth_bytes < 1024 || o.allreduce_records < 1)
    return invalid_argument(
        "detect_topology: iteration counts must be >= 1, latency_bytes >= 1 "
        "and bandwidth_bytes >= 1024");
  auto note = [&](const std::string& s) {
    if (notes != nullptr) notes->push_back(s);
  };
  const int P = world.size();
  const int me = world.rank();

  // Nodes: the shared-memory split; a node's id is its first rank in the world.
  if (o.nodes < 0 || o.nodes > P)
    return invalid_argument("detect_topology: nodes must be in [0, " + std::to_string(P) +
                            "] (0 = the shared-memory split), got " + std::to_string(o.nodes));
  auto node_r = o.nodes > 0 ? world.split(static_cast<int>(int64_t{me} * o.nodes / P), me)
                            : world.split_shared(me);
  if (!node_r.is_ok()) return node_r.status();
  std::unique_ptr<Communicator> node = std::move(node_r).value();
  int leader = me;
  TREEATTN_RETURN_IF_ERROR(node->broadcast(&leader, sizeof(leader), 0));
  std::vector<int> node_of(static_cast<std::size_t>(P), 0);
  TREEATTN_RETURN_IF_ERROR(world.allgather(&leader, sizeof(int), node_of.data()));
  std::vector<int> ids(node_of);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const int nodes = static_cast<int>(ids.size());
  int rpn = 0;
  for (int id : ids)
    rpn = std::max(rpn, static_cast<int>(std::count(node_of.begin(), node_of.end(), id)));
  bool block = true;
  for (int r = 0; r < P; ++r)
    block = block && node_of[static_cast<std::size_t>(r)] == (r / rpn) * rpn;
  note(std::to_string(P) + " ranks on " + std::to_string(nodes) + " node(s) (" +
       (o.nodes > 0 ? "--nodes: equal blocks" : "shared-memory split") + "), " +
       std::to_string(rpn) + " per node" +
       (block ? ""
              : "; WARNING: ranks are not placed in blocks (rank r on node r / " +
                    std::to_string(rpn) + "), the cost model assumes block placement"));

  // One machine? (the emulated cluster's hosts share the kernel and its cores)
  std::array<char, 40> mine{};
  const std::string bid = boot_id();
  std::memcpy(mine.data(), bid.data(), std::min(bid.size(), mine.size() - 1));
  std::vector<std::array<char, 40>> all(static_cast<std::size_t>(P));
  TREEATTN_RETURN_IF_ERROR(world.allgather(mine.data(), mine.size(), all.data()));
  bool same_machine = true;
  for (const auto& b : all) same_machine = same_machine && b == all[0];
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  TREEATTN_RETURN_IF_ERROR(world.broadcast(&cores, sizeof(cores), 0));

  MeasuredTopology m;
  m.name = o.name;
  m.nodes = nodes;
  m.ranks_per_node = rpn;
  m.kernel_overhead_us = o.kernel_overhead_us;
  if (same_machine && nodes > 1)
    m.max_concurrent_ranks = P > cores ? cores : 0;
  else if (rpn > cores)
    m.max_concurrent_ranks = nodes * cores;
  if (m.max_concurrent_ranks > 0)
    note(std::to_string(P) + " ranks share " + std::to_string(m.max_concurrent_ranks) +
         " cores: max_concurrent_ranks = " + std::to_string(m.max_concurrent_ranks));
  m.sources.push_back("treeattn topo --detect: " + std::to_string(P) + " ranks, " +
                      std::to_string(nodes) + " node(s), " + std::to_string(cores) +
                      " cores per machine" + (same_machine ? ", all on one machine" : ""));

  // Members of each node in world-rank order, and this rank's node index and local index.
  std::vector<std::vector<int>> members(ids.size());
  for (int r = 0; r < P; ++r) {
    const auto k = static_cast<std::size_t>(
        std::lower_bound(ids.begin(), ids.end(), node_of[static_cast<std::size_t>(r)]) -
        ids.begin());
    members[k].push_back(r);
  }
  std::size_t my_node = 0, my_local = 0;
  for (std::size_t k = 0; k < members.size(); ++k)
    for (std::size_t i = 0; i < members[k].size(); ++i)
      if (members[k][i] == me) {
        my_node = k;
        my_local = i;
      }

  // Node level: rank 0 and the next rank on its node.
  int intra = -1, inter = -1;
  for (int r = 1; r < P; ++r) {
    if (intra < 0 && node_of[static_cast<std::size_t>(r)] == node_of[0]) intra = r;
    if (inter < 0 && node_of[static_cast<std::size_t>(r)] != node_of[0]) inter = r;
  }
  if (intra > 0) {
    auto l = measure_level(world, 0, intra, o);
    if (!l.is_ok()) return l.status();
    // All ranks at once: node-local index i exchanges with i ^ 1 on every node, first small
    // messages (the latency of a round in which every rank communicates, as in a collective;
    // a lone ping-pong is slowed where the waiting ranks poll on the same cores), then large.
    const int np = node->rank() ^ 1;
    const int node_partner = np < node->size() ? np : -1;
    auto small = exchange(*node, node_partner, o.latency_bytes, o.latency_iters);
    if (!small.is_ok()) return small.status();
    auto ex = exchange(*node, node_partner, o.bandwidth_bytes, o.bandwidth_iters);
    if (!ex.is_ok()) return ex.status();
    float t[2] = {static_cast<float>(*small), static_cast<float>(*ex)};
    TREEATTN_RETURN_IF_ERROR(world.allreduce(t, 2, ReduceOp::kMax));
    // The smaller of the two: a lone ping-pong is slowed where the waiting ranks poll on the
    // same cores, all pairs at once where ranks outnumber cores and a waiting rank sleeps;
    // what the collectives cost beyond the links becomes the call overhead (below).
    const double lat = std::max(0.01, std::min(l->latency_us, static_cast<double>(t[0])));
    const double conc = static_cast<double>(o.bandwidth_bytes) /
                        (std::max(static_cast<double>(t[1]) - lat, 0.1 * t[1]) * 1e3);
    m.intra_latency_us = lat;
    m.intra_bandwidth_GBps = conc;
    const std::string s = "node level (rank 0 <-> " + std::to_string(intra) +
                          "): ping-pong " + fmt_double(l->latency_us) + " us at " +
                          std::to_string(o.latency_bytes) + " B (half round trip), " +
                          fmt_double(l->bandwidth_GBps) + " GB/s one pair; all pairs at once: " +
                          fmt_double(t[0]) + " us at " + std::to_string(o.latency_bytes) +
                          " B, " + fmt_double(conc) + " GB/s per rank exchanging " +
                          std::to_string(o.bandwidth_bytes) + " B (used) -> latency " +
                          fmt_double(lat) + " us (the smaller)";
    note(s);
    m.sources.push_back(s);
  }
  if (inter > 0) {
    auto l = measure_level(world, 0, inter, o);
    if (!l.is_ok()) return l.status();
    // All ranks at once: local index i of node k exchanges with local index i of node k ^ 1.
    int partner = -1;
    const std::size_t pk = my_node ^ 1;
    if (pk < members.size() && my_local < members[pk].size()) partner = members[pk][my_local];
    // Small messages first: the latency of a round in which every rank crosses the network.
    auto small = exchange(world, partner, o.latency_bytes, o.latency_iters);
    if (!small.is_ok()) return small.status();
    auto ex = exchange(world, partner, o.bandwidth_bytes, o.bandwidth_iters);
    if (!ex.is_ok()) return ex.status();
    const double lat = std::max(0.01, std::min(l->latency_us, *small));  // as on the node
    const double t = *ex;
    const double conc = static_cast<double>(o.bandwidth_bytes) / (std::max(t - lat, 0.1 * t) * 1e3);
    // The cost model shares a node's links among its ranks itself (RoundSim's node term), so
    // the network level takes the one-pair rate; the all-pairs rate is recorded for reference.
    m.inter_latency_us = lat;
    m.inter_bandwidth_GBps = l->bandwidth_GBps;
    const std::string s = "network level (rank 0 <-> " + std::to_string(inter) +
                          "): ping-pong " + fmt_double(l->latency_us) + " us at " +
                          std::to_string(o.latency_bytes) + " B (half round trip), " +
                          fmt_double(l->bandwidth_GBps) +
                          " GB/s one pair (used: the model shares a node's links itself); all "
                          "pairs at once: " + fmt_double(*small) + " us at " +
                          std::to_string(o.latency_bytes) + " B, " + fmt_double(conc) +
                          " GB/s per rank exchanging " + std::to_string(o.bandwidth_bytes) +
                          " B -> latency " + fmt_double(lat) + " us (the smaller)";
    note(s);
    m.sources.push_back(s);
  }

  // Memory bandwidth: the streaming-read probe on rank 0 while the others wait.
  double bw = 0;
  const int node_ranks = node->size();
  const int threads = o.probe_threads > 0 ? o.probe_threads : std::max(1, cores / node_ranks);
  Status probe_status;
  if (me == 0) {
    auto b = measure_read_bandwidth(threads, o.probe_bytes, o.probe_repeats);
    if (b.is_ok())
      bw = *b;
    else
      probe_status = b.status();
  }
  TREEATTN_RETURN_IF_ERROR(world.broadcast(&bw, sizeof(bw), 0));
  if (!(bw > 0))
    return internal_error("detect_topology: rank 0: memory bandwidth probe failed: " +
                          probe_status.to_string());
  m.memory_bandwidth_GBps = bw;
  {
    const std::string s = "memory probe: " + fmt_double(bw) + " GB/s streaming read with " +
                          std::to_string(threads) + " thread(s) of " +
                          std::to_string(o.probe_bytes >> 20) + " MiB (rank 0 alone, median of " +
                          std::to_string(o.probe_repeats) + ")";
    note(s);
    m.sources.push_back(s);
  }
  if (o.kernel_tokens > 0) {
    const auto dt = parse_dtype(o.kernel_dtype);
    if (!dt)
      return invalid_argument("detect_topology: kernel_dtype must be f32, f16 or bf16, got '" +
                              o.kernel_dtype + "'");
    const int kthreads = o.kernel_threads > 0 ? o.kernel_threads : std::max(1, cores / node_ranks);
    auto small = time_kernel(world, o, *dt, 16, kthreads);
    if (!small.is_ok()) return small.status();
    auto big = time_kernel(world, o, *dt, o.kernel_tokens, kthreads);
    if (!big.is_ok()) return big.status();
    const double bytes = 2.0 * static_cast<double>(o.kernel_tokens) * o.kernel_kv_heads *
                         o.head_dim * static_cast<double>(dtype_size(*dt));
    // The model runs ceil(P / max_concurrent_ranks) kernels back to back per core; undo that
    // here so that the model's local time reproduces the measured one.
    const double share = m.max_concurrent_ranks > 0 && P > m.max_concurrent_ranks
                             ? std::ceil(static_cast<double>(P) / m.max_concurrent_ranks)
                             : 1.0;
    m.kernel_overhead_us = std::max(0.1, *small);
    m.memory_bandwidth_GBps =
        bytes * share / (std::max(*big - m.kernel_overhead_us, 0.1 * *big) * 1e3);
    const std::string s =
        "decode kernel: " + std::to_string(o.kernel_tokens) + " tokens x " +
        std::to_string(o.kernel_kv_heads) + " KV heads x " + std::to_string(o.head_dim) + " " +
        o.kernel_dtype + " (" + fmt_double(bytes / 1048576.0) + " MiB) on all " +
        std::to_string(P) + " ranks at once with " + std::to_string(kthreads) +
        " thread(s) each: " + fmt_double(*big) +
        " us (median of the slowest rank per call), 16 tokens: " + fmt_double(*small) +
        " us -> kernel_overhead_us " + fmt_double(m.kernel_overhead_us) +
        ", memory.bandwidth_GBps " + fmt_double(m.memory_bandwidth_GBps) + " per rank" +
        (share > 1 ? " (x" + fmt_double(share) + ": ranks take turns on the cores)" : "");
    note(s);
    m.sources.push_back(s);
  }

  // Call overheads: the merge allreduce with its user-defined reduction (what `tree` runs), a
  // built-in allreduce of the same bytes and the all-gather of the records, timed interleaved on
  // each node and then over the whole job. What the model does not explain with the measured
  // links in the built-in allreduce becomes the call overhead of every library call
  // (collective_overhead_us inside a node, network.call_overhead_us for a call that crosses
  // nodes); what the user-defined reduction costs beyond it becomes user_op_overhead_us of the
  // level, which the model adds to `tree`'s allreduce only.
  const std::string size_text = std::to_string(o.allreduce_records) + " x " +
                                std::to_string(o.head_dim) + " states";
  CostQuery q;
  q.shape = AttnShape{1, o.allreduce_records, 1, o.head_dim, 1};
  // The comm_us the model gives `strategy` for these records on topology t (p ranks, r a node).
  auto model_comm = [&](const char* strategy, const MeasuredTopology& t, int p,
                        int r) -> Result<double> {
    auto base = topology_from_measurements(t);
    if (!base.is_ok()) return base.status();
    q.context = p;
    q.ranks = p;
    q.ranks_per_node = r;
    auto pred = predict(strategy, q, *base);
    if (!pred.is_ok()) return pred.status();
    return pred->comm_us;
  };
  if (node->size() > 1) {
    auto t = time_collectives(*node, o);
    if (!t.is_ok()) return t.status();
    // The slowest node's.
    float w[3] = {static_cast<float>(t->user_op), static_cast<float>(t->built_in),
                  static_cast<float>(t->allgather)};
    TREEATTN_RETURN_IF_ERROR(world.allreduce(w, 3, ReduceOp::kMax));
    MeasuredTopology one = m;
    one.nodes = 1;
    one.inter_latency_us.reset();
    one.inter_bandwidth_GBps.reset();
    one.collective_overhead_us = 0;
    one.intra_user_op_overhead_us = 0;
    auto links = model_comm("tree", one, node->size(), node->size());
    if (!links.is_ok()) return links.status();
    m.collective_overhead_us = std::max(0.0, static_cast<double>(w[1]) - *links);
    m.intra_user_op_overhead_us = std::max(0.0, static_cast<double>(w[0] - w[1]));
    one.collective_overhead_us = m.collective_overhead_us;
    auto ag = model_comm("allgather", one, node->size(), node->size());
    if (!ag.is_ok()) return ag.status();
    const std::string s =
        "collectives inside a node (" + size_text + ", interleaved, median of " +
        std::to_string(o.allreduce_iters) + ", slowest node): built-in allreduce " +
        fmt_double(w[1]) + " us, the links explain " + fmt_double(*links) +
        " us -> collective_overhead_us " + fmt_double(m.collective_overhead_us) +
        "; user-defined-op allreduce (tree) " + fmt_double(w[0]) +
        " us -> node.user_op_overhead_us " + fmt_double(m.intra_user_op_overhead_us) +
        "; all-gather " + fmt_double(w[2]) + " us (model " + fmt_double(*ag) + " us)";
    note(s);
    m.sources.push_back(s);
  }
  if (nodes > 1) {
    auto t = time_collectives(world, o);
    if (!t.is_ok()) return t.status();
    MeasuredTopology base = m;
    base.inter_call_overhead_us = 0;
    base.inter_user_op_overhead_us = 0;
    base.intra_user_op_overhead_us = 0;  // the built-in allreduce's model, without it
    auto links = model_comm("tree", base, P, rpn);
    if (!links.is_ok()) return links.status();
    m.inter_call_overhead_us = std::max(0.0, t->built_in - *links);
    m.inter_user_op_overhead_us =
        std::max(0.0, t->user_op - t->built_in - m.intra_user_op_overhead_us);
    base.inter_call_overhead_us = m.inter_call_overhead_us;
    auto ag = model_comm("allgather", base, P, rpn);
    if (!ag.is_ok()) return ag.status();
    const std::string s =
        "collectives over all " + std::to_string(P) + " ranks (" + size_text +
        ", interleaved, median of " + std::to_string(o.allreduce_iters) +
        "): built-in allreduce " + fmt_double(t->built_in) +
        " us, the links and the node overhead explain " + fmt_double(*links) +
        " us -> network.call_overhead_us " + fmt_double(m.inter_call_overhead_us) +
        "; user-defined-op allreduce (tree) " + fmt_double(t->user_op) +
        " us -> network.user_op_overhead_us " + fmt_double(m.inter_user_op_overhead_us) +
        " (beyond the node's); all-gather " + fmt_double(t->allgather) + " us (model " +
        fmt_double(*ag) + " us)";
    note(s);
    m.sources.push_back(s);
  }
  return topology_from_measurements(m);
}

}  // namespace treeattn
