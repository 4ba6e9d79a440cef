// Measuring several strategies on the same data in one job (bench.hpp): the memory pass, the
// interleaved latency pass, the oracle checks and the aggregation over ranks. Part of the
// measurement library treeattn_measure (moved from the CLI, which now parses, calls, prints).
#include "treeattn/bench.hpp"

#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/workload.hpp"

namespace treeattn {
namespace {

// What each rank contributes to a point; all-gathered to rank 0.
struct RankStats {
  double counted_bytes = 0;  // per step: p2p payload + collective payload handed to the comm
  double wire_bytes = -1;    // per step, -1 when the transport could not be observed
  double working_set = 0;
  double peak_rss = 0;
  double kv_bytes = 0;
  double model_bytes = 0;
  double model_working_set = 0;
};

std::vector<int64_t> explicit_empty_lens(int64_t seq, int ranks) {
  // Rank 0 holds nothing; the others split the context evenly (first ones get the remainder).
  std::vector<int64_t> lens(static_cast<std::size_t>(ranks), 0);
  const int holders = ranks - 1;
  for (int r = 1; r < ranks; ++r)
    lens[static_cast<std::size_t>(r)] = seq / holders + ((r - 1) < seq % holders ? 1 : 0);
  return lens;
}

RunConfig base_run_config(const BenchConfig& c, int ranks) {
  RunConfig r;
  r.shape = c.shape;
  r.dtype = c.dtype;
  r.total_len = {c.seq};
  r.seed = c.seed;
  r.warmup = c.warmup;
  r.steps = c.iters;
  r.append = c.append;
  r.spare_tokens = c.append ? c.warmup + c.iters : 0;
  r.timeout = std::chrono::milliseconds(c.timeout_ms);
  r.options.root = c.root;
  r.options.fanout = c.fanout;
  r.options.kernel.threads = c.threads;
  const BenchFaults& inj = c.faults;
  if (inj.nan_rank >= 0) {
    r.inject_nan_rank = inj.nan_rank;
    r.check_inputs = true;  // every rank then names the one that brought it
  }
  r.inject_never_arrive_rank = inj.never_arrive_rank;
  r.inject_kill_rank = inj.kill_rank;
  r.inject_step = inj.step;
  r.inject_slow_rank = inj.slow_rank;
  r.inject_slow_ms = inj.slow_ms;
  r.on_step = c.on_step;
  if (c.nodes > 1) {
    r.options.node_of_rank.resize(static_cast<std::size_t>(ranks));
    for (int i = 0; i < ranks; ++i)
      r.options.node_of_rank[static_cast<std::size_t>(i)] = static_cast<int>(
          static_cast<int64_t>(i) * c.nodes / ranks);
  }
  r.kv_layout = c.kv_layout;
  r.executor = c.executor;
  r.device_comm = c.device_comm;
  if (c.shard == "empty" && ranks > 1) {
    r.shard = ShardKind::kExplicit;
    r.explicit_len = explicit_empty_lens(c.seq, ranks);
  } else if (c.shard == "empty") {
    r.shard = ShardKind::kEven;
  } else {
    r.shard = parse_shard_kind(c.shard).value();
  }
  return r;
}

// The oracle is local arithmetic on one rank, minutes on a long context and a busy machine, not
// communication: the other ranks wait for it here with a deadline of its own (a day, or none
// with --timeout-ms 0), not with --timeout-ms, which names ranks that never arrived and would
// blame a rank that is only computing. The wait polls and sleeps (the communicator's timed
// path), leaving the cores to the oracle. They learn whether it failed (so that none waits in
// a later collective for a rank that gave up); a rank that dies meanwhile ends the job through
// mpirun. --timeout-ms applies again from the next operation on.
constexpr std::chrono::hours kOracleDeadline{24};

Status wait_for_oracle(Communicator& comm, int check_rank, const Status& oracle) {
  const auto timeout = comm.timeout();
  const std::string context = comm.context();
  if (timeout.count() > 0)
    comm.set_timeout(std::max<std::chrono::milliseconds>(timeout, kOracleDeadline));
  comm.set_context(fmt::format("waiting for rank {}'s float64 oracle", check_rank));
  float failed = oracle.is_ok() ? 0.0f : 1.0f;
  const Status agreed = comm.allreduce(&failed, 1, ReduceOp::kMax);
  comm.set_timeout(timeout);
  comm.set_context(context);
  TREEATTN_RETURN_IF_ERROR(agreed);
  if (!oracle.is_ok()) return oracle;
  if (failed != 0.0f)
    return Status(Code::kInvalidArgument,
                  fmt::format("rank {}: the float64 oracle failed on rank {} (its message is "
                              "above)", comm.rank(), check_rank));
  return Status::ok();
}

}  // namespace

MemoryNeed bench_memory_need(const BenchConfig& c, int ranks) {
  const double P = ranks;
  const double B = static_cast<double>(c.shape.batch), Q = static_cast<double>(c.shape.q_len);
  const double H = static_cast<double>(c.shape.heads), Hkv = static_cast<double>(c.shape.kv_heads);
  const double D = static_cast<double>(c.shape.head_dim);
  const double tokens = static_cast<double>(c.seq) + (c.append ? c.warmup + c.iters : 0);
  double per_token = 2.0 * B * Hkv * D * static_cast<double>(dtype_size(c.dtype));
  if (dtype_is_quantized(c.dtype)) per_token += 2.0 * B * Hkv * 4.0;  // a float scale each
  const double total_kv = tokens * per_token;
  // Shards of the shared session, each strategy's extra KV storage (strategy_extra_kv_caches:
  // single's whole cache on rank 0, ring-kv's shard-sized receive buffers), and the oracle's
  // regenerated cache. A method the library does not know (auto, resolved later) counts p
  // state buffers and no extra KV.
  double session_caches = 1.0;
  double buffers = 0;  // state buffers of the strategies, per rank
  const StrategyRegistry& reg = StrategyRegistry::for_backend(CommCapabilities{});
  for (const auto& m : c.methods) {
    const StrategyInfo* info = reg.info(m);
    if (auto extra = strategy_extra_kv_caches(m, ranks); extra.is_ok()) session_caches += *extra;
    buffers += info == nullptr || info->holds_every_state ? P : 2.0;
  }
  const bool device_memory =
      c.device_memory || (c.executor != nullptr && c.executor->memory() != MemorySpace::kHost);
  MemoryNeed need;
  need.kv_bytes =
      total_kv * ((device_memory ? 0.0 : session_caches) + (c.check ? 1.0 : 0.0));
  const double records = B * Q * H;
  const double state = records * (D + 2) * 4.0;
  const double methods = static_cast<double>(std::max<std::size_t>(1, c.methods.size()));
  const double per_rank = records * D * 4.0                        // the query
                          + state * (1.0 + methods * c.iters)      // output + kept states
                          + state * buffers                        // strategy buffers
                          + 32.0 * 1024 * 1024;                    // process baseline
  need.state_bytes = P * per_rank + (c.check ? 2.0 * records * (D + 1) * 8.0 : 0.0);
  need.per_job_bytes = need.kv_bytes + need.state_bytes;
  need.available_bytes = static_cast<double>(mem_available_bytes());
  return need;
}

Result<std::vector<BenchPoint>> bench_strategies(Communicator& comm, const BenchConfig& c) {
  auto phase = [&c](const std::string& what) {
    if (c.on_phase) c.on_phase(what);
  };
  const int P = comm.size();
  const int me = comm.rank();
  const int check_rank = c.root >= 0 ? c.root : 0;
  // The strategies the sessions' communicator offers (NCCL: no hier, tree as an all-gather).
  const Communicator& session_comm = c.device_comm != nullptr ? *c.device_comm : comm;
  const StrategyRegistry& registry = StrategyRegistry::for_backend(session_comm.capabilities());
  for (const auto& m : c.methods)
    if (!registry.contains(m)) {
      std::string known;
      for (const auto& i : registry.list()) known += (known.empty() ? "" : ", ") + std::string(i.name);
      const std::string over =
          c.device_comm != nullptr ? " over " + std::string(session_comm.backend_name()) : "";
      return invalid_argument("unknown method '" + m + "'" + over + " (known: " + known + ")");
    }

  // Large buffers (KV shards, ring buffers) always come from mmap and go back on free; glibc's
  // default would raise the threshold after the first free and keep later ones in the heap.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // The float64 oracle over the regenerated whole cache, once for every method: the last
  // timed step (appends included).
  OracleReference ref;
  if (c.check) {
    Status oracle;
    if (me == check_rank) {
      if (c.progress) std::fprintf(stderr, "  float64 oracle over %s tokens...\n", std::to_string(c.seq).c_str());
      phase(fmt::format("p={} seq={} batch={}: the float64 oracle", P, c.seq, c.shape.batch));
      auto r = oracle_reference(base_run_config(c, P), c.warmup + c.iters - 1);
      if (r.is_ok())
        ref = std::move(r).value();
      else
        oracle = r.status();
    } else {
      phase(fmt::format("p={} seq={} batch={}: waiting for rank {}'s float64 oracle",
                                    P, c.seq, c.shape.batch, check_rank));
    }
    TREEATTN_RETURN_IF_ERROR(wait_for_oracle(comm, check_rank, oracle));
  }

  // Pass 1, memory: each method alone in a fresh session for one step, so that its peak RSS is
  // its own (the KV shard, its buffers) and not another method's.
  std::vector<double> peak_rss(c.methods.size(), 0.0);
  for (std::size_t m = 0; m < c.methods.size(); ++m) {
    if (c.progress && me == 0)
      std::fprintf(stderr, "  %-11s p=%d seq=%lld memory...\n", c.methods[m].c_str(), P,
                   static_cast<long long>(c.seq));
    phase(fmt::format("p={} seq={} batch={}: memory pass of {}", P, c.seq,
                                  c.shape.batch, c.methods[m]));
    RunConfig rc = base_run_config(c, P);
    rc.strategy = c.methods[m];
    rc.warmup = 0;
    rc.steps = 1;
    rc.append = false;
    rc.keep_states = false;
    TREEATTN_RETURN_IF_ERROR(comm.barrier());
    // Give the previous method's memory back to the kernel before the high-water mark is reset,
    // so that one method's peak RSS does not carry another's retained heap.
    malloc_trim(0);
    reset_peak_rss();
    auto rep = run_decode(comm, rc);
    if (!rep.is_ok()) return rep.status();
    peak_rss[m] = static_cast<double>(current_peak_rss());
  }
  malloc_trim(0);

  // Pass 2, latency and bytes: every method on the same shards, one step of each in turn.
  if (c.progress && me == 0)
    std::fprintf(stderr, "  %zu methods round robin, p=%d seq=%lld, %d + %d steps...\n",
                 c.methods.size(), P, static_cast<long long>(c.seq), c.warmup, c.iters);
  std::string names;
  for (const auto& m : c.methods) names += (names.empty() ? "" : ",") + m;
  phase(fmt::format("p={} seq={} batch={}: timed steps of {}", P, c.seq,
                                c.shape.batch, names));
  RunConfig rc = base_run_config(c, P);
  auto reports = run_interleaved(comm, rc, c.methods);
  if (!reports.is_ok()) return reports.status();

  std::vector<BenchPoint> points;
  for (std::size_t m = 0; m < c.methods.size(); ++m) {
    const std::string& method = c.methods[m];
    RunReport& rep = (*reports)[m];

    RankStats mine;
    const double n = static_cast<double>(std::max<std::size_t>(1, rep.steps.size()));
    double wire = 0;
    bool have_wire = true;
    for (const auto& st : rep.steps) {
      mine.counted_bytes += static_cast<double>(st.p2p_bytes + st.collective_payload_bytes) / n;
      mine.working_set = std::max(mine.working_set, static_cast<double>(st.working_set_bytes));
      if (st.wire_bytes) wire += static_cast<double>(*st.wire_bytes) / n;
      else have_wire = false;
    }
    mine.wire_bytes = have_wire && P > 1 ? wire : -1;
    mine.peak_rss = peak_rss[m];
    mine.kv_bytes = static_cast<double>(rep.kv_bytes);
    mine.model_bytes = rep.model.bytes_sent;
    mine.model_working_set = rep.model.working_set_bytes;

    // Exactness outside the timed loop, and bit-identical results across ranks.
    double err = 0;
    bool ok = true;
    if (c.check) {
      if (me == check_rank) {
        if (!rep.has_result || rep.states.empty()) return internal_error("no result on rank " + std::to_string(me));
        auto cr = compare_with_reference(c.shape, rep.states.back(), ref, c.tolerance);
        if (!cr.is_ok()) return cr.status();
        err = cr.value().rel_error();
        ok = cr.value().passed;
      }
      if (c.root < 0 && !rep.states.empty()) {
        Status same = check_identical_across_ranks(comm, rep.states.back());
        if (!same.is_ok()) {
          if (me == 0) std::fprintf(stderr, "%s: %s\n", method.c_str(), same.to_string().c_str());
          ok = false;
        }
      }
    }

    std::vector<RankStats> all(static_cast<std::size_t>(P));
    TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof(RankStats), all.data()));
    double errs[2] = {err, ok ? 0.0 : 1.0};
    TREEATTN_RETURN_IF_ERROR(comm.broadcast(errs, sizeof(errs), check_rank));
    float bad = errs[1] > 0 ? 1.0f : 0.0f;
    TREEATTN_RETURN_IF_ERROR(comm.allreduce(&bad, 1, ReduceOp::kMax));

    // The hash of the result this rank got (rank 0's, or the root's), for comparing runs.
    char hash[65] = {0};
    if (me == check_rank && rep.has_result && !rep.states.empty())
      std::snprintf(hash, sizeof(hash), "%s", output_sha256(rep.states.back()).c_str());
    TREEATTN_RETURN_IF_ERROR(comm.broadcast(hash, sizeof(hash), check_rank));

    BenchPoint p;
    p.output_sha256 = hash;
    p.method = method;
    p.ranks = P;
    p.nodes = c.nodes;
    p.seq = c.seq;
    p.batch = c.shape.batch;
    p.heads = c.shape.heads;
    p.kv_heads = c.shape.kv_heads;
    p.head_dim = c.shape.head_dim;
    p.q_len = c.shape.q_len;
    p.dtype = std::string(dtype_name(c.dtype));
    p.shard = c.shard;
    p.kv_layout = std::string(kv_layout_name(rep.kv_layout));
    for (const auto& s : rep.steps) p.step_us.push_back(s.max_seconds * 1e6);
    bool wire_all = true;
    double kv_total = 0;
    for (const auto& r : all) {
      p.bytes_sent_per_rank = std::max(p.bytes_sent_per_rank, static_cast<uint64_t>(std::llround(r.counted_bytes)));
      if (r.wire_bytes < 0) wire_all = false;
      else p.bytes_wire_per_rank = std::max<uint64_t>(p.bytes_wire_per_rank.value_or(0), static_cast<uint64_t>(std::llround(r.wire_bytes)));
      p.bytes_formula = std::max(p.bytes_formula, static_cast<uint64_t>(std::llround(r.model_bytes)));
      p.peak_bytes_per_rank = std::max(p.peak_bytes_per_rank, static_cast<uint64_t>(r.working_set));
      p.peak_bytes_formula = std::max(p.peak_bytes_formula, static_cast<uint64_t>(std::llround(r.model_working_set)));
      p.peak_rss_bytes = std::max(p.peak_rss_bytes, static_cast<uint64_t>(r.peak_rss));
      kv_total += r.kv_bytes;
    }
    if (!wire_all) p.bytes_wire_per_rank.reset();
    // KV bytes all ranks' kernels read in one step: the cache once, except where every rank
    // runs the kernel over every shard (ring-kv: the whole cache p times).
    const StrategyInfo* info = StrategyRegistry::for_backend(CommCapabilities{}).info(method);
    const bool every_shard = info != nullptr && info->reads_every_shard;
    p.kv_bytes_read = static_cast<uint64_t>(every_shard ? kv_total * P : kv_total);
    p.max_rel_err = errs[0];
    p.tolerance = c.tolerance;
    p.ok = bad == 0.0f;
    points.push_back(p);
  }
  return points;
}

}  // namespace treeattn
