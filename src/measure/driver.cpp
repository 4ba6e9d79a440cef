// The decode driver: agreement checks, set-up, timed steps with accounting, and result checks.
// Part of the measurement library treeattn_measure.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/workload.hpp"

namespace treeattn {
namespace {

using Clock = std::chrono::steady_clock;

// "1.34287512 (0x3fabe2d1)": enough digits and the bits, for values that differ in the last place.
std::string float_bits(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g (0x%08x)", static_cast<double>(x), u);
  return buf;
}

std::string rank_prefix(const Communicator& c) {
  return "rank " + std::to_string(c.world_rank()) + ": ";
}

// What every rank must agree on, as a fixed-size record for an all-gather.
struct Fingerprint {
  char strategy[24];
  int64_t batch, heads, kv_heads, head_dim, q_len, dtype, shard, root, fanout, warmup, steps,
      append, step, seed;
  uint64_t plan;
  uint32_t q_scale_bits;
  int32_t error;  // 1: this rank's own configuration is invalid (text below)
  char error_text[200];
};

Fingerprint make_fingerprint(const RunConfig& c, uint64_t plan_fp, int64_t step,
                             const std::string& local_error) {
  Fingerprint f{};
  std::snprintf(f.strategy, sizeof(f.strategy), "%s", c.strategy.c_str());
  f.batch = c.shape.batch;
  f.heads = c.shape.heads;
  f.kv_heads = c.shape.kv_heads;
  f.head_dim = c.shape.head_dim;
  f.q_len = c.shape.q_len;
  f.dtype = static_cast<int64_t>(c.dtype);
  f.shard = static_cast<int64_t>(c.shard);
  f.root = c.options.root;
  f.fanout = c.options.fanout;
  f.warmup = c.warmup;
  f.steps = c.steps;
  f.append = c.append ? 1 : 0;
  f.step = step;
  f.seed = static_cast<int64_t>(c.seed);
  f.plan = plan_fp;
  std::memcpy(&f.q_scale_bits, &c.q_scale, sizeof(float));
  f.error = local_error.empty() ? 0 : 1;
  std::snprintf(f.error_text, sizeof(f.error_text), "%s", local_error.c_str());
  return f;
}

std::string describe(const Fingerprint& f) {
  return std::string("strategy=") +
         std::string(f.strategy, strnlen(f.strategy, sizeof(f.strategy))) +
         " B=" + std::to_string(f.batch) + " H=" + std::to_string(f.heads) +
         " Hkv=" + std::to_string(f.kv_heads) + " D=" + std::to_string(f.head_dim) +
         " Q=" + std::to_string(f.q_len) +
         " dtype=" + std::string(dtype_name(static_cast<DType>(f.dtype))) +
         " shard=" + std::string(shard_kind_name(static_cast<ShardKind>(f.shard))) +
         " plan=" + std::to_string(f.plan);
}

// Field-by-field differences "head_dim=64 vs 128".
std::vector<std::pair<std::string, std::pair<std::string, std::string>>> differences(
    const Fingerprint& a, const Fingerprint& b) {
  std::vector<std::pair<std::string, std::pair<std::string, std::string>>> d;
  auto num = [&](const char* name, int64_t x, int64_t y) {
    if (x != y) d.push_back({name, {std::to_string(x), std::to_string(y)}});
  };
  const std::string sa(a.strategy, strnlen(a.strategy, sizeof(a.strategy)));
  const std::string sb(b.strategy, strnlen(b.strategy, sizeof(b.strategy)));
  if (sa != sb) d.push_back({"strategy", {sa, sb}});
  num("batch", a.batch, b.batch);
  num("heads", a.heads, b.heads);
  num("kv_heads", a.kv_heads, b.kv_heads);
  num("head_dim", a.head_dim, b.head_dim);
  num("q_len", a.q_len, b.q_len);
  if (a.dtype != b.dtype)
    d.push_back({"dtype",
                 {std::string(dtype_name(static_cast<DType>(a.dtype))),
                  std::string(dtype_name(static_cast<DType>(b.dtype)))}});
  if (a.shard != b.shard)
    d.push_back({"shard",
                 {std::string(shard_kind_name(static_cast<ShardKind>(a.shard))),
                  std::string(shard_kind_name(static_cast<ShardKind>(b.shard)))}});
  num("root", a.root, b.root);
  num("fanout", a.fanout, b.fanout);
  num("warmup", a.warmup, b.warmup);
  num("steps", a.steps, b.steps);
  num("append", a.append, b.append);
  num("step", a.step, b.step);
  num("seed", a.seed, b.seed);
  if (a.q_scale_bits != b.q_scale_bits) {
    float x, y;
    std::memcpy(&x, &a.q_scale_bits, 4);
    std::memcpy(&y, &b.q_scale_bits, 4);
    d.push_back({"q_scale", {std::to_string(x), std::to_string(y)}});
  }
  if (a.plan != b.plan)
    d.push_back(
        {"shard plan (lengths per rank)", {std::to_string(a.plan), std::to_string(b.plan)}});
  return d;
}

// All-gathers the fingerprints; every rank returns the same verdict.
Status agree(Communicator& comm, const Fingerprint& mine, const char* when) {
  const auto p = static_cast<std::size_t>(comm.size());
  std::vector<Fingerprint> all(p);
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof(Fingerprint), all.data()));
  for (std::size_t r = 0; r < p; ++r)
    if (all[r].error)
      return invalid_argument(
          rank_prefix(comm) + "rank " + std::to_string(r) + " rejected the run configuration " +
          when + ": " +
          std::string(all[r].error_text, strnlen(all[r].error_text, sizeof(all[r].error_text))));
  std::vector<int> bad;
  for (std::size_t r = 1; r < p; ++r)
    if (!differences(all[0], all[r]).empty()) bad.push_back(static_cast<int>(r));
  if (bad.empty()) return Status::ok();
  const auto first = static_cast<std::size_t>(bad.front());
  const auto diffs = differences(all[0], all[first]);
  std::string msg = rank_prefix(comm) + "ranks disagree on the run " + when + ": ";
  for (std::size_t i = 0; i < diffs.size(); ++i) {
    if (i) msg += ", ";
    msg += "rank 0 has " + diffs[i].first + "=" + diffs[i].second.first + ", rank " +
           std::to_string(first) + " has " + diffs[i].first + "=" + diffs[i].second.second;
  }
  msg += " (ranks differing from rank 0:";
  for (int r : bad) msg += " " + std::to_string(r);
  msg += "; rank 0: " + describe(all[0]) + "; rank " + std::to_string(first) + ": " +
         describe(all[first]) + ")";
  return {Code::kMismatch, msg};
}

// First non-finite value in a typed buffer region, as (index, value) or -1.
struct Bad {
  int64_t tensor = 0;  // 0 none, 1 q, 2 K, 3 V
  int64_t b = 0, h = 0, pos = 0, d = 0;
  double value = 0;
};

Bad scan_inputs(const RunConfig& c, const float* q, const KVShard& kv) {
  Bad bad;
  const AttnShape& s = c.shape;
  const std::size_t nq = static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim);
  for (std::size_t i = 0; i < nq; ++i)
    if (!std::isfinite(q[i])) {
      bad.tensor = 1;
      bad.d = static_cast<int64_t>(i);
      bad.value = q[i];
      return bad;
    }
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t j = 0; j < kv.len[static_cast<std::size_t>(b)]; ++j)
        for (int64_t d = 0; d < s.head_dim; ++d) {
          const auto idx = static_cast<std::size_t>(b * kv.stride_batch + h * kv.stride_head +
                                                    j * kv.stride_token + d);
          for (int t = 0; t < 2; ++t) {
            const float x = load_as_float(t == 0 ? kv.k : kv.v, kv.dtype, idx);
            if (!std::isfinite(x)) {
              bad.tensor = 2 + t;
              bad.b = b;
              bad.h = h;
              bad.pos = kv.pos_start[static_cast<std::size_t>(b)] + j * kv.pos_stride;
              bad.d = d;
              bad.value = x;
              return bad;
            }
          }
        }
  return bad;
}

Status check_inputs_everywhere(Communicator& comm, const RunConfig& c, const float* q,
                               const KVShard& kv, int64_t step) {
  const Bad mine = scan_inputs(c, q, kv);
  std::vector<Bad> all(static_cast<std::size_t>(comm.size()));
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof(Bad), all.data()));
  std::string msg;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const Bad& x = all[r];
    if (x.tensor == 0) continue;
    if (!msg.empty()) msg += "; ";
    msg += "rank " + std::to_string(r) + " brought a non-finite input (" + std::to_string(x.value) +
           ") at step " + std::to_string(step) + " in ";
    if (x.tensor == 1)
      msg += "the query, element " + std::to_string(x.d);
    else
      msg += std::string(x.tensor == 2 ? "K" : "V") + "[b=" + std::to_string(x.b) +
             "][kv_head=" + std::to_string(x.h) + "][pos=" + std::to_string(x.pos) +
             "][d=" + std::to_string(x.d) + "]";
  }
  if (msg.empty()) return Status::ok();
  return {Code::kNumerics, rank_prefix(comm) + msg};
}

std::vector<int64_t> expand_lengths(const RunConfig& c) {
  std::vector<int64_t> lens = c.total_len;
  if (lens.size() == 1 && c.shape.batch > 1)
    lens.assign(static_cast<std::size_t>(c.shape.batch), lens[0]);
  return lens;
}

}  // namespace

Result<ShardPlan> initial_plan(const RunConfig& config, int ranks) {
  std::vector<int64_t> lens = expand_lengths(config);
  if (static_cast<int64_t>(lens.size()) != config.shape.batch)
    return invalid_argument("got " + std::to_string(config.total_len.size()) +
                            " context lengths for batch " + std::to_string(config.shape.batch) +
                            " (give one, or one per batch row)");
  // `single` places every token on rank 0 whatever the requested placement.
  if (config.strategy == "single")
    return ShardPlan::make(ShardKind::kSingle, ranks, std::move(lens));
  return ShardPlan::make(config.shard, ranks, std::move(lens), config.explicit_len, 0);
}

Result<RunReport> run_decode(Communicator& comm, const RunConfig& config) {
  comm.set_timeout(config.timeout);
  comm.set_context("setup");
  const int me = comm.rank(), p = comm.size();

  // Local validation; its verdict travels in the fingerprint so that no rank waits alone.
  std::string local_error;
  const StrategyRegistry& registry = StrategyRegistry::for_backend(comm.capabilities());
  Result<ShardPlan> plan0 = initial_plan(config, p);
  if (Status s = config.shape.validate(); !s.is_ok())
    local_error = s.to_string();
  else if (!registry.contains(config.strategy))
    local_error = registry.create(config.strategy, config.options).status().to_string();
  else if (!plan0.is_ok())
    local_error = plan0.status().to_string();
  else if (dtype_is_quantized(config.dtype))
    local_error = "KV dtype " + std::string(dtype_name(config.dtype)) +
                  " is quantized: the kernels and `treeattn bench --kernel` support it, but the "
                  "distributed strategies do not yet carry per-token scales (use f32, f16 or bf16)";
  else if (config.steps < 1 || config.warmup < 0)
    local_error = "steps must be >= 1 and warmup >= 0, got steps=" + std::to_string(config.steps) +
                  " warmup=" + std::to_string(config.warmup);
  const uint64_t plan_fp = plan0.is_ok() ? plan0->fingerprint() : 0;
  if (config.check_fingerprint && p > 1)
    TREEATTN_RETURN_IF_ERROR(
        agree(comm, make_fingerprint(config, plan_fp, -1, local_error), "at setup"));
  if (!local_error.empty()) return invalid_argument(rank_prefix(comm) + local_error);

  RunReport report;
  report.plan = std::move(*plan0);
  ShardPlan& plan = report.plan;
  auto strategy = registry.create(config.strategy, config.options);
  TREEATTN_RETURN_IF_ERROR(strategy.status());
  Strategy& strat = **strategy;
  report.has_result = strat.delivers_result(me);

  WorkloadSpec spec{config.shape, config.dtype, config.seed, config.q_scale};
  const int total_steps = config.warmup + config.steps;
  auto shard = LocalShard::create(config.shape, config.dtype, plan, me,
                                  config.spare_tokens + (config.append ? total_steps : 0));
  TREEATTN_RETURN_IF_ERROR(shard.status());
  TREEATTN_RETURN_IF_ERROR(fill_local_shard(spec, plan, *shard));
  if (config.inject_nan_rank == me && plan.total_tokens(me) > 0) {
    int64_t b = 0;
    while (plan.len(me, b) == 0) ++b;
    float k[1] = {std::numeric_limits<float>::quiet_NaN()};
    store_from_float(shard->cache().k_data(), config.dtype, shard->cache().index(b, 0, 0), k[0]);
  }
  TREEATTN_RETURN_IF_ERROR(strat.setup(comm, config.shape, config.dtype, plan));

  const AttnShape& s = config.shape;
  std::vector<float> q(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
  const auto per_row = static_cast<std::size_t>(s.kv_heads * s.head_dim);
  std::vector<float> k_new(static_cast<std::size_t>(s.batch) * per_row),
      v_new(static_cast<std::size_t>(s.batch) * per_row);
  StateBuffer out;

  // Per-barrier TCP bytes, subtracted from each step's measurement (one barrier ends a step).
  uint64_t barrier_wire = 0;
  bool wire = comm.transport_bytes_sent().has_value();
  if (wire) {
    TREEATTN_RETURN_IF_ERROR(comm.barrier());
    uint64_t best = std::numeric_limits<uint64_t>::max();
    for (int i = 0; i < 3; ++i) {
      const uint64_t a = comm.transport_bytes_sent().value_or(0);
      TREEATTN_RETURN_IF_ERROR(comm.barrier());
      const uint64_t b = comm.transport_bytes_sent().value_or(0);
      best = std::min(best, b - a);
    }
    barrier_wire = best;
  }

  for (int step = 0; step < total_steps; ++step) {
    comm.set_context("step " + std::to_string(step));
    if (config.check_every_step && p > 1)
      TREEATTN_RETURN_IF_ERROR(agree(comm, make_fingerprint(config, plan.fingerprint(), step, ""),
                                     ("at step " + std::to_string(step)).c_str()));
    make_query(spec, step, q.data());
    const KVShard local = shard->view(plan);
    if (config.check_inputs)
      TREEATTN_RETURN_IF_ERROR(check_inputs_everywhere(comm, config, q.data(), local, step));
    const bool timed = step >= config.warmup;
    if (timed && step == config.warmup) {
      auto m = analytic_cost(config.strategy, s, config.dtype, plan, me, config.options);
      TREEATTN_RETURN_IF_ERROR(m.status());
      report.model = *m;
      report.kv_bytes = shard->live_bytes(plan);
    }

    TREEATTN_RETURN_IF_ERROR(comm.barrier());
    const CommCounters before = comm.counters();
    const uint64_t wire_before = wire ? comm.transport_bytes_sent().value_or(0) : 0;
    const auto t0 = Clock::now();
    TREEATTN_RETURN_IF_ERROR(strat.step(q.data(), local, plan, out));
    const auto t1 = Clock::now();
    CommCounters after = comm.counters();
    TREEATTN_RETURN_IF_ERROR(comm.barrier());
    const uint64_t wire_after = wire ? comm.transport_bytes_sent().value_or(0) : 0;

    if (timed) {
      StepReport r;
      r.step = step;
      r.seconds = std::chrono::duration<double>(t1 - t0).count();
      float worst = static_cast<float>(r.seconds);
      TREEATTN_RETURN_IF_ERROR(comm.allreduce(&worst, 1, ReduceOp::kMax));
      r.max_seconds = worst;
      r.p2p_bytes = after.p2p_bytes - before.p2p_bytes;
      r.p2p_messages = after.p2p_messages - before.p2p_messages;
      r.collective_calls = after.collective_calls - before.collective_calls;
      r.collective_payload_bytes = after.collective_payload_bytes - before.collective_payload_bytes;
      if (wire) {
        const uint64_t d = wire_after - wire_before;
        r.wire_bytes = d > barrier_wire ? d - barrier_wire : 0;
      }
      r.working_set_bytes =
          shard->live_bytes(plan) + q.size() * sizeof(float) + out.bytes() + strat.buffer_bytes();
      report.steps.push_back(r);
      if (config.keep_states) report.states.push_back(out);
    }
    if (config.append) {
      for (int64_t b = 0; b < s.batch; ++b)
        make_token(spec, b, plan.total_len(b), k_new.data() + static_cast<std::size_t>(b) * per_row,
                   v_new.data() + static_cast<std::size_t>(b) * per_row);
      TREEATTN_RETURN_IF_ERROR(append_token(plan, *shard, k_new.data(), v_new.data()));
    }
  }
  comm.set_context("");
  report.peak_rss_bytes = peak_rss_bytes();
  return report;
}

double CheckResult::rel_error() const {
  return std::max(max_abs_error / std::max(1.0, max_abs_ref), max_lse_error);
}

Result<OracleReference> oracle_reference(const RunConfig& config, int64_t step) {
  const AttnShape& s = config.shape;
  TREEATTN_RETURN_IF_ERROR(s.validate());
  std::vector<int64_t> lens = expand_lengths(config);
  if (static_cast<int64_t>(lens.size()) != s.batch)
    return invalid_argument("check: context lengths do not match batch " + std::to_string(s.batch));
  if (config.append)
    for (int64_t& n : lens) n += step;
  const auto n_rec = static_cast<std::size_t>(s.batch * s.q_len * s.heads);
  const auto D = static_cast<std::size_t>(s.head_dim);
  WorkloadSpec spec{s, config.dtype, config.seed, config.q_scale};
  const KVCache cache = make_full_cache(spec, lens);
  std::vector<int64_t> zeros(lens.size(), 0);
  const KVShard view = cache.view(0, lens, zeros, lens, 1);
  std::vector<float> q(n_rec * D);
  make_query(spec, step, q.data());
  OracleReference ref;
  ref.out.resize(n_rec * D);
  ref.lse.resize(n_rec);
  TREEATTN_RETURN_IF_ERROR(oracle_attention(s, q.data(), view, ref.out.data(), ref.lse.data(),
                                            config.options.kernel.scale));
  return ref;
}

Result<CheckResult> compare_with_reference(const AttnShape& s, const StateBuffer& states,
                                           const OracleReference& ref, double rel_tol) {
  const auto n_rec = static_cast<std::size_t>(s.batch * s.q_len * s.heads);
  const auto D = static_cast<std::size_t>(s.head_dim);
  if (states.records() != n_rec || states.head_dim() != D || ref.out.size() != n_rec * D ||
      ref.lse.size() != n_rec)
    return invalid_argument("check: states hold " + std::to_string(states.records()) +
                            " records of head_dim " + std::to_string(states.head_dim()) +
                            ", expected " + std::to_string(n_rec) + " of " + std::to_string(D));
  constexpr double kInf = std::numeric_limits<double>::infinity();
  CheckResult c;
  std::vector<float> out(D);
  std::size_t worst = 0;
  for (std::size_t i = 0; i < n_rec; ++i) {
    float l = 0;
    state_normalize(states.record(i), D, out.data(), &l);
    const double rl = ref.lse[i], ml = static_cast<double>(l);
    double le = 0;
    if (std::isnan(rl) || std::isnan(ml) || std::isinf(rl) || std::isinf(ml))
      le = (std::isnan(rl) && std::isnan(ml)) || rl == ml ? 0.0 : kInf;
    else
      le = std::fabs(ml - rl) / std::max(1.0, std::fabs(rl));
    c.max_lse_error = std::max(c.max_lse_error, le);
    for (std::size_t d = 0; d < D; ++d) {
      const double r = ref.out[i * D + d];
      double e = std::fabs(static_cast<double>(out[d]) - r);
      if (std::isnan(r) && std::isnan(out[d])) e = 0;  // NaN propagated as in the reference
      else if (std::isnan(e)) e = kInf;                // NaN on one side only
      if (!std::isnan(r)) c.max_abs_ref = std::max(c.max_abs_ref, std::fabs(r));
      if (e > c.max_abs_error) {
        c.max_abs_error = e;
        worst = i * D + d;
      }
    }
  }
  c.tolerance = rel_tol * std::max(1.0, c.max_abs_ref);
  c.passed = c.max_abs_error <= c.tolerance && c.max_lse_error <= rel_tol;
  const std::size_t rec = worst / D;
  const auto H = static_cast<std::size_t>(s.heads), Q = static_cast<std::size_t>(s.q_len);
  c.detail = "max |out - ref| = " + std::to_string(c.max_abs_error) +
             " at b=" + std::to_string(rec / (Q * H)) + " q=" + std::to_string((rec / H) % Q) +
             " h=" + std::to_string(rec % H) + " d=" + std::to_string(worst % D) + " (tolerance " +
             std::to_string(c.tolerance) + "); max LSE error " + std::to_string(c.max_lse_error);
  return c;
}

Result<CheckResult> check_against_oracle(const RunConfig& config, int64_t step,
                                         const StateBuffer& states, double rel_tol) {
  auto ref = oracle_reference(config, step);
  if (!ref.is_ok()) return ref.status();
  return compare_with_reference(config.shape, states, ref.value(), rel_tol);
}

Status check_identical_across_ranks(Communicator& comm, const StateBuffer& states) {
  const std::size_t bytes = states.bytes();
  const auto p = static_cast<std::size_t>(comm.size());
  uint64_t sizes_mine = bytes;
  std::vector<uint64_t> sizes(p);
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&sizes_mine, sizeof(uint64_t), sizes.data()));
  for (std::size_t r = 0; r < p; ++r)
    if (sizes[r] != bytes)
      return {Code::kMismatch, rank_prefix(comm) + "rank " + std::to_string(r) + " holds " +
                                   std::to_string(sizes[r]) + " bytes of states, rank " +
                                   std::to_string(comm.rank()) + " " + std::to_string(bytes)};
  std::vector<float> all(p * states.floats());
  TREEATTN_RETURN_IF_ERROR(comm.allgather(states.data(), bytes, all.data()));
  for (std::size_t r = 1; r < p; ++r) {
    const float* x = all.data() + r * states.floats();
    if (std::memcmp(x, all.data(), bytes) == 0) continue;
    std::size_t i = 0;
    while (std::memcmp(x + i, all.data() + i, sizeof(float)) == 0) ++i;
    return {Code::kMismatch, rank_prefix(comm) + "rank " + std::to_string(r) +
                                 "'s merged states differ from rank 0's " + "at float " +
                                 std::to_string(i) + " (record " +
                                 std::to_string(i / states.record_floats()) +
                                 "): " + float_bits(x[i]) + " vs " + float_bits(all[i])};
  }
  return Status::ok();
}

}  // namespace treeattn
