// The decode driver: a client of the decode session (session.hpp) that adds what measuring needs
// around it: the deterministic workload stored into the session, fault injection, timed steps
// with byte counters, several strategies interleaved step by step, and the oracle checks.
//
// Two communicators: `comm` (host memory) carries the driver's own operations (barriers, the
// slowest rank's time, the input scan, the wire-byte probe) and the session communicator
// (RunConfig::device_comm, NCCL beside a CUDA executor; `comm` by default) carries the sessions'
// merges, whose bytes the steps report. The sessions agree on the run over theirs (staging the
// records through the executor where it works in device memory).
// Part of the measurement library treeattn_measure.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "treeattn/kv_tiles.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"
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

// First non-finite value in a typed buffer region, as (index, value) or -1.
struct Bad {
  int64_t tensor = 0;  // 0 none, 1 q, 2 K, 3 V
  int64_t b = 0, h = 0, pos = 0, d = 0;
  double value = 0;
};

// kv may be null: only the query is scanned (a device executor's shard is not host-readable).
Bad scan_inputs(const RunConfig& c, const float* q, const KVShard* kv_or_null) {
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
  if (kv_or_null == nullptr) return bad;
  const KVShard& kv = *kv_or_null;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t j = 0; j < kv.len[static_cast<std::size_t>(b)]; ++j)
        for (int64_t d = 0; d < s.head_dim; ++d) {
          const auto idx = static_cast<std::size_t>(b * kv.stride_batch + h * kv.stride_head +
                                                    j * kv.stride_token + d);
          for (int t = 0; t < 2; ++t) {
            const float x = kv.tiled != nullptr
                                ? tiled_element(*kv.tiled, s.head_dim, t == 1, b, h, j, d)
                                : load_as_float(t == 0 ? kv.k : kv.v, kv.dtype, idx);
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
                               const KVShard* kv, int64_t step) {
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

std::string float_text(float x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(x));
  return buf;
}

// The session a run decodes through: the run's placement, one layer, room for the appends, and
// the run's own settings among the fields every rank must agree on.
SessionConfig session_config(const RunConfig& c, const std::string& strategy) {
  SessionConfig s;
  s.shape = c.shape;
  s.dtype = c.dtype;
  s.layers = 1;
  s.placement = c.shard;
  s.context = expand_lengths(c);
  s.explicit_len = c.explicit_len;
  s.reserve_tokens = c.spare_tokens + (c.append ? c.warmup + c.steps : 0);
  s.layout = c.kv_layout;
  s.strategy = strategy;
  s.options = c.options;
  s.timeout = c.timeout;
  s.check_agreement = c.check_fingerprint;
  s.agree_also = {{"warmup", std::to_string(c.warmup)},
                  {"steps", std::to_string(c.steps)},
                  {"append", c.append ? "1" : "0"},
                  {"seed", std::to_string(c.seed)},
                  {"q_scale", float_text(c.q_scale)}};
  return s;
}

// Collective over the host communicator: every rank learns the errors the others found in their
// own part of the run's set-up (local_error, empty: none) and returns the same verdict, the lowest
// rank's reason. `when`: "at setup".
Status agree_local_errors(Communicator& comm, const std::string& local_error,
                          const std::string& when) {
  struct Record {
    char error[512];
  };
  Record mine{};
  std::snprintf(mine.error, sizeof(mine.error), "%s", local_error.c_str());
  std::vector<Record> all(static_cast<std::size_t>(comm.size()));
  TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof(mine), all.data()));
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r].error[0] != '\0')
      return invalid_argument(rank_prefix(comm) + "rank " + std::to_string(r) +
                              " rejected the run configuration " + when + ": " +
                              std::string(all[r].error, strnlen(all[r].error, sizeof(all[r].error))));
  return Status::ok();
}

// Stores this rank's tokens of the workload into layer 0 of the session.
Status fill_from_workload(const WorkloadSpec& w, DecodeSession& s) {
  const ShardPlan& plan = s.plan();
  const int r = s.comm().rank();
  const auto per_token = static_cast<std::size_t>(w.shape.kv_heads * w.shape.head_dim);
  Status first_error;
  for (int64_t b = 0; b < w.shape.batch; ++b) {
    const int64_t n = plan.len(r, b), start = plan.pos_start(r, b), stride = plan.pos_stride();
    // Threads only pay off for large shards (and spin-waiting threads hurt oversubscribed ranks).
#pragma omp parallel if (n * static_cast <int64_t>(per_token) >= (int64_t{1} << 20))
    {
      std::vector<float> k(per_token), v(per_token);
#pragma omp for schedule(static)
      for (int64_t j = 0; j < n; ++j) {
        make_token(w, b, start + j * stride, k.data(), v.data());
        Status st = s.store(0, b, start + j * stride, k.data(), v.data());
        if (!st.is_ok()) {
#pragma omp critical
          if (first_error.is_ok()) first_error = st;
        }
      }
    }
  }
  return first_error;
}

// Fault injection for the failure tests: a NaN in the first K value this rank holds.
Status inject_nan(const WorkloadSpec& w, DecodeSession& s) {
  const ShardPlan& plan = s.plan();
  const int me = s.comm().rank();
  if (plan.total_tokens(me) == 0) return Status::ok();
  int64_t b = 0;
  while (plan.len(me, b) == 0) ++b;
  const auto per_token = static_cast<std::size_t>(w.shape.kv_heads * w.shape.head_dim);
  std::vector<float> k(per_token), v(per_token);
  const int64_t pos = plan.pos_start(me, b);
  make_token(w, b, pos, k.data(), v.data());
  k[0] = std::numeric_limits<float>::quiet_NaN();
  return s.store(0, b, pos, k.data(), v.data());
}

// Debug fault injection (RunConfig::inject_*), as step `step` begins on this rank.
Status inject_faults(const Communicator& comm, const RunConfig& c, int64_t step) {
  const int me = comm.rank();
  if (c.inject_slow_rank == me && c.inject_slow_ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(c.inject_slow_ms));
  if (step != c.inject_step) return Status::ok();
  if (c.inject_kill_rank == me) std::raise(SIGKILL);
  if (c.inject_never_arrive_rank == me) {
    // Sleep past the others' timeout (they name this rank and end the job); bounded, so that
    // a job without a timeout still ends.
    std::this_thread::sleep_for(std::max<std::chrono::milliseconds>(
        std::chrono::milliseconds(30000), 4 * c.timeout));
    return internal_error(rank_prefix(comm) + "injected fault: never arrived at step " +
                          std::to_string(step) + " (and no other rank ended the job)");
  }
  return Status::ok();
}

// The K/V of the token every row appends after step `step` (its next position), all rows.
void next_tokens(const WorkloadSpec& w, const DecodeSession& s, std::vector<float>& k,
                 std::vector<float>& v) {
  const AttnShape& sh = w.shape;
  const auto per_row = static_cast<std::size_t>(sh.kv_heads * sh.head_dim);
  k.resize(static_cast<std::size_t>(sh.batch) * per_row);
  v.resize(k.size());
  for (int64_t b = 0; b < sh.batch; ++b)
    make_token(w, b, s.length(b), k.data() + static_cast<std::size_t>(b) * per_row,
               v.data() + static_cast<std::size_t>(b) * per_row);
}

// TCP bytes one barrier costs (subtracted from each step's wire bytes); 0 when unobservable.
Result<uint64_t> barrier_wire_bytes(Communicator& comm) {
  if (!comm.transport_bytes_sent().has_value()) return uint64_t{0};
  TREEATTN_RETURN_IF_ERROR(comm.barrier());
  uint64_t best = std::numeric_limits<uint64_t>::max();
  for (int i = 0; i < 3; ++i) {
    const uint64_t a = comm.transport_bytes_sent().value_or(0);
    TREEATTN_RETURN_IF_ERROR(comm.barrier());
    const uint64_t b = comm.transport_bytes_sent().value_or(0);
    best = std::min(best, b - a);
  }
  return best;
}

// One measured step of strategy `index` of the session: barrier, timed attend, counters, the
// slowest rank's time. q is in the session executor's memory. Barriers and the slowest time go
// over the host communicator comm; bytes are the session communicator's. Leaves the merged
// states (host records) in out.
Result<StepReport> timed_step(Communicator& comm, DecodeSession& s, int index, const float* q,
                              StateBuffer& out, uint64_t barrier_wire, std::size_t q_bytes) {
  Communicator& scomm = s.comm();
  const bool wire = scomm.transport_bytes_sent().has_value();
  TREEATTN_RETURN_IF_ERROR(comm.barrier());
  const CommCounters before = scomm.counters();
  const uint64_t wire_before = wire ? scomm.transport_bytes_sent().value_or(0) : 0;
  const auto t0 = Clock::now();
  TREEATTN_RETURN_IF_ERROR(measure::attend_states(s, 0, q, out, index));
  // On a device a rank without results copies nothing back, so its queued kernels and
  // collectives may still run: the step ends when they are done (no-ops on the host).
  TREEATTN_RETURN_IF_ERROR(scomm.synchronize());
  TREEATTN_RETURN_IF_ERROR(s.executor().synchronize());
  const auto t1 = Clock::now();
  const CommCounters after = scomm.counters();
  TREEATTN_RETURN_IF_ERROR(comm.barrier());
  const uint64_t wire_after = wire ? scomm.transport_bytes_sent().value_or(0) : 0;
  StepReport r;
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
      s.live_kv_bytes() + q_bytes + out.bytes() + measure::strategy_of(s, index).buffer_bytes();
  return r;
}

// Filling the shards is local work whose length differs from rank to rank (their shares of the
// context, a busy core), not communication: the ranks meet after it over `host` with a
// deadline of its own (a day; none when the timeout is 0) instead of the per-operation timeout,
// which would name a rank that is still filling as one that never arrived. A rank whose fill
// failed is named to every rank, so that none waits for it later.
constexpr std::chrono::hours kLocalWorkDeadline{24};

Status meet_after_local_work(Communicator& host, const Status& mine, const std::string& what) {
  const auto timeout = host.timeout();
  const std::string context = host.context();
  if (timeout.count() > 0)
    host.set_timeout(std::max<std::chrono::milliseconds>(timeout, kLocalWorkDeadline));
  host.set_context(what);
  Status agreed = agree_local_errors(host, mine.is_ok() ? "" : mine.to_string(), what);
  host.set_timeout(timeout);
  host.set_context(context);
  if (!mine.is_ok()) return mine;
  return agreed;
}

// Creates the session of a run for `strategy` on the session communicator and executor and
// fills it with the workload (the ranks meet over `host` afterwards).
Result<std::unique_ptr<DecodeSession>> open_session(Communicator& comm, Communicator& host,
                                                    Executor& exec, const RunConfig& config,
                                                    const std::string& strategy) {
  if (config.steps < 1 || config.warmup < 0)
    return invalid_argument(rank_prefix(comm) + "steps must be >= 1 and warmup >= 0, got steps=" +
                            std::to_string(config.steps) +
                            " warmup=" + std::to_string(config.warmup));
  auto session =
      DecodeSession::create(comm, session_config(config, strategy), exec);
  TREEATTN_RETURN_IF_ERROR(session.status());
  const WorkloadSpec spec{config.shape, config.dtype, config.seed, config.q_scale};
  Status filled = fill_from_workload(spec, **session);
  if (filled.is_ok() && config.inject_nan_rank == comm.rank())
    filled = inject_nan(spec, **session);
  TREEATTN_RETURN_IF_ERROR(meet_after_local_work(host, filled, "while filling the KV shards"));
  return session;
}

}  // namespace

Result<ShardPlan> initial_plan(const RunConfig& config, int ranks) {
  std::vector<int64_t> lens = expand_lengths(config);
  if (static_cast<int64_t>(lens.size()) != config.shape.batch)
    return invalid_argument("got " + std::to_string(config.total_len.size()) +
                            " context lengths for batch " + std::to_string(config.shape.batch) +
                            " (give one, or one per batch row)");
  return initial_plan(config.strategy, config.shard, ranks, std::move(lens), config.explicit_len, 0);
}

Result<std::vector<RunReport>> run_interleaved(Communicator& comm, const RunConfig& config,
                                               std::span<const std::string> strategies) {
  Communicator& scomm = config.device_comm != nullptr ? *config.device_comm : comm;
  Executor& exec = config.executor != nullptr ? *config.executor : cpu_executor();
  const bool device = exec.memory() != MemorySpace::kHost;
  auto set_context = [&](const std::string& text) {
    comm.set_context(text);
    if (&scomm != &comm) scomm.set_context(text);
  };
  comm.set_timeout(config.timeout);
  scomm.set_timeout(config.timeout);
  set_context("setup");
  if (strategies.empty()) return invalid_argument(rank_prefix(comm) + "no strategies to run");
  const int me = comm.rank();
  // One KV layout for every strategy of the run, so that they read the same bytes the same way
  // (choose_kv_layout, strategy.hpp); an explicit layout the run cannot use is the session's
  // clear error, with every rank taking part.
  // `auto` on the host is measured per workload (host_kv_layout), so every rank takes rank 0's
  // (the broadcast always runs).
  RunConfig cfg = config;
  if (cfg.kv_layout == KVLayout::kAuto) {
    const std::vector<std::string> names(strategies.begin(), strategies.end());
    const KVLayoutWorkload workload{cfg.shape, cfg.dtype, cfg.options.kernel};
    auto layout = me == 0 ? choose_kv_layout(KVLayout::kAuto, exec.memory(), names, workload)
                          : choose_kv_layout(KVLayout::kAuto, exec.memory(), names);
    cfg.kv_layout = layout.is_ok() ? *layout : KVLayout::kRows;
  }
  if (comm.size() > 1) {
    uint8_t root_layout = static_cast<uint8_t>(cfg.kv_layout);
    TREEATTN_RETURN_IF_ERROR(comm.broadcast(&root_layout, 1, 0));
    if (config.kv_layout == KVLayout::kAuto &&
        (root_layout == static_cast<uint8_t>(KVLayout::kRows) ||
         root_layout == static_cast<uint8_t>(KVLayout::kTiled)))
      cfg.kv_layout = static_cast<KVLayout>(root_layout);
  }
  if (&scomm != &comm) {
    // The driver pairs comm's rank r with the session communicator's rank r.
    std::string local_error;
    if (scomm.size() != comm.size() || scomm.rank() != comm.rank())
      local_error = "the session communicator's rank " + std::to_string(scomm.rank()) + " of " +
                    std::to_string(scomm.size()) + " is not the host communicator's rank " +
                    std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
    else if (scomm.capabilities().memory != exec.memory())
      local_error = "the session communicator '" + std::string(scomm.backend_name()) +
                    "' and the executor '" + std::string(exec.name()) +
                    "' work in different memory spaces";
    // Every rank takes part, so that a rank's error reaches the others instead of a hang; the
    // sessions then agree on the run's fields themselves.
    TREEATTN_RETURN_IF_ERROR(agree_local_errors(comm, local_error, "at setup"));
  }
  // Two sessions at most: one for every strategy on the run's placement (they share its shards)
  // and one for `single`, whose placement puts the whole cache on rank 0.
  struct Slot {
    DecodeSession* session = nullptr;
    int index = 0;
  };
  std::unique_ptr<DecodeSession> shared, single;
  std::vector<Slot> slots;
  for (const std::string& name : strategies) {
    const StrategyInfo* info = StrategyRegistry::for_backend(scomm.capabilities()).info(name);
    const bool own_placement = info != nullptr && info->placement == PlacementNeed::kAllOnRoot;
    std::unique_ptr<DecodeSession>& owner = own_placement ? single : shared;
    Slot slot;
    if (!owner) {
      auto s = open_session(scomm, comm, exec, cfg, name);
      TREEATTN_RETURN_IF_ERROR(s.status());
      owner = std::move(*s);
    } else {
      auto idx = measure::add_strategy(*owner, name, config.options);
      TREEATTN_RETURN_IF_ERROR(idx.status());
      slot.index = *idx;
    }
    slot.session = owner.get();
    slots.push_back(slot);
  }

  const AttnShape& s = config.shape;
  const WorkloadSpec spec{config.shape, config.dtype, config.seed, config.q_scale};
  std::vector<RunReport> reports(strategies.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    reports[i].has_result = measure::delivers_result(*slots[i].session, slots[i].index);
    reports[i].kv_layout = slots[i].session->config().layout;
  }
  std::vector<float> q(static_cast<std::size_t>(s.batch * s.q_len * s.heads * s.head_dim));
  const std::size_t q_bytes = q.size() * sizeof(float);
  // The sessions read the query in the executor's memory: on a device, one buffer there that
  // every step's query is copied into.
  Buffer q_device;
  if (device) {
    auto b = exec.allocate(q_bytes);
    if (!b.is_ok())
      return Status(b.status().code(), rank_prefix(comm) + "the query buffer on executor '" +
                                           std::string(exec.name()) + "': " + b.status().message());
    q_device = std::move(*b);
  }
  const float* q_attend = device ? q_device.as<float>() : q.data();
  std::vector<float> k_new, v_new;
  StateBuffer out;
  auto barrier_wire = barrier_wire_bytes(comm);
  TREEATTN_RETURN_IF_ERROR(barrier_wire.status());

  const int total_steps = config.warmup + config.steps;
  const std::size_t n = slots.size();
  for (int step = 0; step < total_steps; ++step) {
    set_context("step " + std::to_string(step));
    if (config.on_step) config.on_step(step);
    TREEATTN_RETURN_IF_ERROR(inject_faults(comm, config, step));
    make_query(spec, step, q.data());
    if (device) TREEATTN_RETURN_IF_ERROR(exec.from_host(q_device.data(), q.data(), q_bytes));
    const bool timed = step >= config.warmup;
    // Round robin, starting one strategy later every step, so neither slow drift of a shared
    // machine nor the position in the round favours one strategy.
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t i = (j + static_cast<std::size_t>(step)) % n;
      DecodeSession& ses = *slots[i].session;
      if (config.check_every_step && comm.size() > 1)
        TREEATTN_RETURN_IF_ERROR(ses.check_agreement("at step " + std::to_string(step),
                                                     {{"step", std::to_string(step)}}));
      // The scan reads host memory only: the host query, and the shard where it is the host's
      // (a device executor's shard is not readable here, so on a device only the query is
      // scanned; a non-finite K/V value there shows in the results and the oracle check).
      if (config.check_inputs) {
        const KVShard view = device ? KVShard{} : ses.view(0);
        TREEATTN_RETURN_IF_ERROR(
            check_inputs_everywhere(comm, config, q.data(), device ? nullptr : &view, step));
      }
      RunReport& rep = reports[i];
      if (timed && step == config.warmup) {
        auto m = analytic_cost(strategies[i], s, config.dtype, ses.plan(), me, config.options);
        TREEATTN_RETURN_IF_ERROR(m.status());
        rep.model = *m;
        rep.kv_bytes = ses.live_kv_bytes();
      }
      auto r = timed_step(comm, ses, slots[i].index, q_attend, out, *barrier_wire, q_bytes);
      TREEATTN_RETURN_IF_ERROR(r.status());
      if (timed) {
        r->step = step;
        rep.steps.push_back(*r);
        if (config.keep_states) rep.states.push_back(out);
      }
    }
    if (config.append)
      for (DecodeSession* ses : {shared.get(), single.get()}) {
        if (!ses) continue;
        next_tokens(spec, *ses, k_new, v_new);
        TREEATTN_RETURN_IF_ERROR(ses->append(k_new.data(), v_new.data()));
      }
  }
  set_context("");
  for (std::size_t i = 0; i < n; ++i) reports[i].plan = slots[i].session->plan();
  return reports;
}

Result<RunReport> run_decode(Communicator& comm, const RunConfig& config) {
  const std::string names[1] = {config.strategy};
  auto reports = run_interleaved(comm, config, names);
  TREEATTN_RETURN_IF_ERROR(reports.status());
  RunReport r = std::move(reports->front());
  r.peak_rss_bytes = peak_rss_bytes();
  return r;
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
