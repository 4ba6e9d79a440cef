// The decode session (include/treeattn/session.hpp): agreement at creation, the per-layer KV
// shards under one placement, appends, and attention through the strategies.
#include "treeattn/session.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>
#include <string>
#include <vector>

namespace treeattn {
namespace {

std::string rank_prefix(const Communicator& c) {
  return "rank " + std::to_string(c.world_rank()) + ": ";
}

// The failure-state check before a device step's results are handed back (issue 21, 2). A
// stream-ordered communicator (NCCL) only enqueues its collectives; when its watchdog aborts one
// that waits for a missing rank, NCCL's kernels return normally, the stream completes and a copy
// to the host succeeds, with garbage in it. The communicator knows: its synchronize() returns
// the failure (comm_nccl.hpp). Called after the copy to the host that ends attend_states (the
// stream is drained then, so it costs an event query) or the normalize that ends a device
// attend (it then waits for the step, so that success means a result known to be good); a host
// communicator has completed its calls and reported their errors already, so it is not asked.
Status check_stream_ordered_comm(Communicator& c) {
  if (!c.capabilities().stream_ordered) return Status::ok();
  return c.synchronize();
}

// What every rank must agree on, serialized as "name=value" fields in a fixed-size record for
// an all-gather, with this rank's own verdict on its configuration.
constexpr std::size_t kFieldsBytes = 3072;
constexpr std::size_t kErrorBytes = 400;

struct Fingerprint {
  int32_t error = 0;  // 1: this rank's own configuration is invalid (text below)
  int32_t overflow = 0;
  char fields[kFieldsBytes];  // name \x1f value \x1e name \x1f value ...
  char error_text[kErrorBytes];
};

using Fields = std::vector<std::pair<std::string, std::string>>;

Fingerprint make_fingerprint(const Fields& fields, const std::string& local_error) {
  Fingerprint f{};
  std::string flat;
  for (const auto& [k, v] : fields) flat += k + '\x1f' + v + '\x1e';
  if (flat.size() >= kFieldsBytes) {
    f.overflow = 1;
    flat.resize(kFieldsBytes - 1);
  }
  std::memcpy(f.fields, flat.data(), flat.size());
  f.error = local_error.empty() ? 0 : 1;
  std::snprintf(f.error_text, sizeof(f.error_text), "%s", local_error.c_str());
  return f;
}

Fields parse_fields(const Fingerprint& f) {
  Fields out;
  const std::string flat(f.fields, strnlen(f.fields, kFieldsBytes));
  std::size_t at = 0;
  while (at < flat.size()) {
    const std::size_t sep = flat.find('\x1f', at), end = flat.find('\x1e', at);
    if (sep == std::string::npos || end == std::string::npos || sep > end) break;
    out.emplace_back(flat.substr(at, sep - at), flat.substr(sep + 1, end - sep - 1));
    at = end + 1;
  }
  return out;
}

// (field, rank 0's value, other's value) for every field that differs, in field order.
std::vector<std::tuple<std::string, std::string, std::string>> differences(const Fields& a,
                                                                            const Fields& b) {
  std::vector<std::tuple<std::string, std::string, std::string>> d;
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const std::string name = i < a.size() ? a[i].first : b[i].first;
    const std::string va = i < a.size() ? a[i].second : "(absent)";
    std::string vb = "(absent)";
    if (i < b.size()) vb = b[i].first == name ? b[i].second : b[i].first + "=" + b[i].second;
    if (va != vb) d.emplace_back(name, va, vb);
  }
  return d;
}

std::string describe(const Fields& f) {
  std::string s;
  for (const auto& [k, v] : f) {
    if (k == "shard plan (lengths per rank)") {
      s += " plan=" + v;
      continue;
    }
    if (!s.empty()) s += " ";
    s += k + "=" + v;
  }
  return s;
}

// All-gathers the fingerprints; every rank returns the same verdict. A communicator whose
// buffers live in device memory (NCCL) gets them staged through the executor.
Status agree(Communicator& comm, Executor& exec, const Fields& fields,
             const std::string& local_error, const std::string& when) {
  const Fingerprint mine = make_fingerprint(fields, local_error);
  const auto p = static_cast<std::size_t>(comm.size());
  std::vector<Fingerprint> all(p);
  if (comm.capabilities().memory == MemorySpace::kHost) {
    TREEATTN_RETURN_IF_ERROR(comm.allgather(&mine, sizeof(Fingerprint), all.data()));
  } else {
    auto send = exec.allocate(sizeof(Fingerprint));
    TREEATTN_RETURN_IF_ERROR(send.status());
    auto recv = exec.allocate(p * sizeof(Fingerprint));
    TREEATTN_RETURN_IF_ERROR(recv.status());
    TREEATTN_RETURN_IF_ERROR(exec.from_host(send->data(), &mine, sizeof(Fingerprint)));
    TREEATTN_RETURN_IF_ERROR(comm.allgather(send->data(), sizeof(Fingerprint), recv->data()));
    TREEATTN_RETURN_IF_ERROR(exec.to_host(all.data(), recv->data(), p * sizeof(Fingerprint)));
  }
  for (std::size_t r = 0; r < p; ++r)
    if (all[r].error)
      return invalid_argument(
          rank_prefix(comm) + "rank " + std::to_string(r) + " rejected the run configuration " +
          when + ": " +
          std::string(all[r].error_text, strnlen(all[r].error_text, sizeof(all[r].error_text))));
  std::vector<Fields> parsed(p);
  for (std::size_t r = 0; r < p; ++r) parsed[r] = parse_fields(all[r]);
  // Group the ranks by their record; the largest group is the reference (on a tie, the group of
  // the lowest rank), so the message names the odd ranks out, not the healthy majority.
  // Ranks agree when their records are the same bytes (the fields are parsed from them).
  const auto same = [&](std::size_t a, std::size_t b) {
    return std::memcmp(all[a].fields, all[b].fields, kFieldsBytes) == 0;
  };
  std::size_t ref = 0, ref_size = 0;
  for (std::size_t r = 0; r < p; ++r) {
    std::size_t n = 0;
    for (std::size_t o = 0; o < p; ++o) n += same(r, o) ? 1 : 0;
    if (n > ref_size) {
      ref = r;
      ref_size = n;
    }
  }
  std::vector<int> bad;
  for (std::size_t r = 0; r < p; ++r)
    if (!same(ref, r)) bad.push_back(static_cast<int>(r));
  if (bad.empty()) return Status::ok();
  const auto first = static_cast<std::size_t>(bad.front());
  const auto diffs = differences(parsed[ref], parsed[first]);
  const std::string rn = "rank " + std::to_string(ref);
  std::string msg = rank_prefix(comm) + "ranks disagree on the run " + when + ": ";
  for (std::size_t i = 0; i < diffs.size(); ++i) {
    const auto& [name, a, b] = diffs[i];
    if (i) msg += ", ";
    msg += rn + " has " + name + "=" + a + ", rank " + std::to_string(first) + " has " + name +
           "=" + b;
  }
  if (diffs.empty()) msg += "configuration records differ beyond their first " +
                            std::to_string(kFieldsBytes) + " bytes";
  msg += ref_size * 2 > p ? " (ranks differing from the majority:"
                          : " (ranks differing from " + rn + "'s configuration:";
  for (int r : bad) msg += " " + std::to_string(r);
  msg += "; " + rn + ": " + describe(parsed[ref]) + "; rank " + std::to_string(first) + ": " +
         describe(parsed[first]) + ")";
  return {Code::kMismatch, msg};
}

std::vector<int64_t> expand_context(const SessionConfig& c) {
  std::vector<int64_t> lens = c.context;
  if (lens.empty()) lens.assign(static_cast<std::size_t>(std::max<int64_t>(c.shape.batch, 0)), 0);
  if (lens.size() == 1 && c.shape.batch > 1)
    lens.assign(static_cast<std::size_t>(c.shape.batch), lens[0]);
  return lens;
}

Result<ShardPlan> make_plan(const SessionConfig& c, int ranks, std::vector<int64_t> lens) {
  if (static_cast<int64_t>(lens.size()) != c.shape.batch)
    return invalid_argument("got " + std::to_string(c.context.size()) +
                            " context lengths for batch " + std::to_string(c.shape.batch) +
                            " (give one, or one per batch row)");
  return initial_plan(c.strategy, c.placement, ranks, std::move(lens), c.explicit_len, c.holder);
}

Fields config_fields(const SessionConfig& c, const std::string& strategy,
                     const StrategyOptions& o, uint64_t plan_fp) {
  Fields f = {{"strategy", strategy},
              {"batch", std::to_string(c.shape.batch)},
              {"heads", std::to_string(c.shape.heads)},
              {"kv_heads", std::to_string(c.shape.kv_heads)},
              {"head_dim", std::to_string(c.shape.head_dim)},
              {"q_len", std::to_string(c.shape.q_len)},
              {"dtype", std::string(dtype_name(c.dtype))},
              {"shard", std::string(shard_kind_name(c.placement))},
              {"layers", std::to_string(c.layers)},
              {"kv_layout", std::string(kv_layout_name(c.layout))},
              {"root", std::to_string(o.root)},
              {"fanout", std::to_string(o.fanout)},
              {"rows_start_free", c.rows_start_free ? "1" : "0"}};
  for (const auto& kv : c.agree_also) f.push_back(kv);
  f.emplace_back("shard plan (lengths per rank)", std::to_string(plan_fp));
  return f;
}

// Broadcasts `bytes` host bytes from rank 0 (staged through the executor for a communicator
// that works in device memory, as agree() does).
Status broadcast_host(Communicator& comm, Executor& exec, void* data, std::size_t bytes) {
  if (comm.capabilities().memory == MemorySpace::kHost) return comm.broadcast(data, bytes, 0);
  auto buf = exec.allocate(bytes);
  TREEATTN_RETURN_IF_ERROR(buf.status());
  TREEATTN_RETURN_IF_ERROR(exec.from_host(buf->data(), data, bytes));
  TREEATTN_RETURN_IF_ERROR(comm.broadcast(buf->data(), bytes, 0));
  return exec.to_host(data, buf->data(), bytes);
}

// The topology `auto` plans on when none is given (SessionConfig::topology). Collective
// (split_shared); on a backend that cannot split, every rank is taken to share one node.
Result<Topology> job_topology(Communicator& comm, Executor& exec) {
  const int p = comm.size();
  int per_node = p;
  if (p > 1) {
    auto node = comm.split_shared(comm.rank());
    int32_t n = node.is_ok() ? (*node)->size() : p;
    TREEATTN_RETURN_IF_ERROR(broadcast_host(comm, exec, &n, sizeof(n)));  // rank 0's node
    per_node = std::clamp(static_cast<int>(n), 1, p);
  }
  auto t = preset_topology("local");
  TREEATTN_RETURN_IF_ERROR(t.status());
  Topology topo = std::move(*t);
  topo.name = "job";
  topo.ranks_per_node = per_node;
  topo.nodes = (p + per_node - 1) / per_node;
  topo.description = "this job: " + std::to_string(topo.nodes) + " node(s) x " +
                     std::to_string(per_node) + " rank(s) by shared memory, links and memory of " +
                     "preset local";
  if (topo.nodes > 1) {
    auto emu = preset_topology("emu-veth");
    TREEATTN_RETURN_IF_ERROR(emu.status());
    topo.network = emu->network;
    topo.sources.push_back("network: preset emu-veth's (not measured; detect_topology measures it)");
  }
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0) topo.max_concurrent_ranks = static_cast<int>(cores);
  return topo;
}

// SessionConfig::strategy = "auto": the choice every rank makes (rank 0's, broadcast). Errors
// are local (the caller passes them to the agreement step); the broadcast always runs.
Status resolve_auto(Communicator& comm, Executor& exec, const SessionConfig& config,
                    const std::vector<int64_t>& lens, std::optional<StrategyChoice>& out,
                    std::string& name, std::string& local_error) {
  Result<Topology> topo = config.topology ? Result<Topology>(*config.topology)
                                          : job_topology(comm, exec);
  Result<StrategyChoice> choice = topo.status();
  if (topo.is_ok()) {
    CostQuery q;
    q.shape = config.shape;
    q.kv_dtype = config.dtype;
    int64_t context = config.plan_context;
    if (context <= 0) context = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
    if (context <= 0) context = config.reserve_tokens;
    q.context = std::max<int64_t>(context, 1);
    q.ranks = comm.size();
    // Block placement: the first ranks fill a node (the topology's ranks_per_node).
    q.ranks_per_node = std::min(comm.size(), topo->ranks_per_node);
    q.hier_fanout = config.options.fanout;
    choice = choose_strategy(q, *topo, comm.capabilities().user_reductions);
  }
  char chosen[64] = {};
  if (choice.is_ok()) {
    const std::string& s = choice->strategy;
    std::memcpy(chosen, s.data(), std::min(s.size(), sizeof(chosen) - 1));
  }
  if (comm.size() > 1) TREEATTN_RETURN_IF_ERROR(broadcast_host(comm, exec, chosen, sizeof(chosen)));
  name.assign(chosen, strnlen(chosen, sizeof(chosen)));
  if (!choice.is_ok()) {
    local_error = "strategy auto: " + choice.status().message();
  } else if (name.empty()) {
    local_error = "strategy auto: rank 0 could not choose (its error is in its message)";
  } else {
    out = std::move(*choice);
    // Rank 0's choice first: a rank whose own ranking differs (another topology) runs it too.
    auto at = std::find_if(out->ranking.begin(), out->ranking.end(),
                           [&](const PlanEntry& e) { return e.prediction.strategy == name; });
    if (at != out->ranking.end()) std::rotate(out->ranking.begin(), at, at + 1);
    out->strategy = name;
  }
  return Status::ok();
}

}  // namespace

Result<Topology> job_topology_of(Communicator& comm, Executor& executor) {
  return job_topology(comm, executor);
}

DecodeSession::~DecodeSession() = default;

Result<std::unique_ptr<DecodeSession>> DecodeSession::create(Communicator& comm,
                                                             const SessionConfig& config,
                                                             Executor& executor) {
  comm.set_timeout(config.timeout);
  const int p = comm.size(), me = comm.rank();

  // Local validation; its verdict travels with the fingerprint so that no rank waits alone.
  std::string local_error;
  const StrategyRegistry& registry = StrategyRegistry::for_backend(comm.capabilities());
  // "auto" becomes the planner's choice first (collective), then everything is checked as if
  // the choice had been asked for.
  std::optional<StrategyChoice> auto_choice;
  std::string auto_error;
  SessionConfig resolved = config;
  if (config.strategy == "auto")
    TREEATTN_RETURN_IF_ERROR(resolve_auto(comm, executor, config, expand_context(config),
                                          auto_choice, resolved.strategy, auto_error));
  Result<ShardPlan> plan = make_plan(resolved, p, expand_context(config));
  if (Status s = config.shape.validate(); !s.is_ok())
    local_error = s.to_string();
  else if (config.layers < 1)
    local_error = "layers must be >= 1, got " + std::to_string(config.layers);
  else if (!registry.contains(resolved.strategy))
    local_error = registry.create(resolved.strategy, config.options).status().to_string();
  else if (!plan.is_ok())
    local_error = plan.status().to_string();
  else if (config.rows_start_free &&
           std::any_of(config.context.begin(), config.context.end(), [](int64_t n) { return n != 0; }))
    local_error = "rows_start_free: the rows are free sequence slots, so the context must be empty";
  else if (config.reserve_tokens < 0)
    local_error = "reserve_tokens must be >= 0, got " + std::to_string(config.reserve_tokens);
  if (!auto_error.empty()) local_error = auto_error;  // before the others: they follow from it
  // The KV layout (choose_kv_layout, strategy.hpp). `auto` on the host is measured per workload
  // (host_kv_layout), so ranks may time it differently: every rank takes rank 0's choice (the
  // broadcast always runs, whatever this rank's errors).
  if (local_error.empty()) {
    const std::string names[] = {resolved.strategy};
    // Only rank 0 measures (the others would time the same kernels at once, skewing rank 0's
    // figure, for an answer they then drop); the others check the request and take rank 0's.
    const KVLayoutWorkload workload{config.shape, config.dtype, config.options.kernel};
    Result<KVLayout> layout =
        me == 0 ? choose_kv_layout(config.layout, executor.memory(), names, workload)
                : choose_kv_layout(config.layout, executor.memory(), names);
    if (layout.is_ok())
      resolved.layout = *layout;
    else
      local_error = layout.status().message() + " (executor '" + std::string(executor.name()) + "')";
  } else if (resolved.layout == KVLayout::kAuto) {
    resolved.layout = KVLayout::kRows;
  }
  if (p > 1) {
    uint8_t root_layout = static_cast<uint8_t>(resolved.layout);
    TREEATTN_RETURN_IF_ERROR(broadcast_host(comm, executor, &root_layout, 1));
    if (config.layout == KVLayout::kAuto && executor.memory() == MemorySpace::kHost &&
        local_error.empty() && (root_layout == static_cast<uint8_t>(KVLayout::kRows) ||
                                root_layout == static_cast<uint8_t>(KVLayout::kTiled)))
      resolved.layout = static_cast<KVLayout>(root_layout);
  }
  const uint64_t plan_fp = plan.is_ok() ? plan->fingerprint() : 0;
  if (config.check_agreement && p > 1)
    TREEATTN_RETURN_IF_ERROR(agree(comm, executor,
                                   config_fields(resolved, resolved.strategy, config.options, plan_fp),
                                   local_error, "at setup"));
  if (!local_error.empty()) return invalid_argument(rank_prefix(comm) + local_error);

  std::unique_ptr<DecodeSession> s(new DecodeSession());
  s->config_ = resolved;
  s->auto_ = std::move(auto_choice);
  s->comm_ = &comm;
  s->exec_ = &executor;
  s->plan_ = std::move(*plan);
  s->live_.assign(static_cast<std::size_t>(config.shape.batch), config.rows_start_free ? 0 : 1);
  s->shards_.reserve(static_cast<std::size_t>(config.layers));
  for (int l = 0; l < config.layers; ++l) {
    // A device executor holds the shards in its memory (LocalShard's device storage).
    auto shard = LocalShard::create(config.shape, config.dtype, s->plan_, me, config.reserve_tokens,
                                    &executor, resolved.layout);
    TREEATTN_RETURN_IF_ERROR(shard.status());
    s->shards_.push_back(std::move(*shard));
  }
  auto strategy = registry.create(resolved.strategy, config.options);
  TREEATTN_RETURN_IF_ERROR(strategy.status());
  TREEATTN_RETURN_IF_ERROR(
      (*strategy)->setup(comm, executor, config.shape, config.dtype, s->plan_));
  s->strategies_.push_back(std::move(*strategy));
  return s;
}

Status DecodeSession::check_layer(int layer, const char* op) const {
  if (layer < 0 || layer >= config_.layers)
    return invalid_argument(rank_prefix(*comm_) + op + ": layer " + std::to_string(layer) +
                            " is outside [0, " + std::to_string(config_.layers) + ")");
  return Status::ok();
}

bool DecodeSession::owns(int64_t b, int64_t pos) const {
  if (b < 0 || b >= plan_.batch() || pos < 0 || pos >= plan_.total_len(b)) return false;
  return plan_.owner(b, pos) == comm_->rank();
}

Status DecodeSession::store(int layer, int64_t b, int64_t pos, const float* k, const float* v) {
  TREEATTN_RETURN_IF_ERROR(check_layer(layer, "store"));
  if (b < 0 || b >= plan_.batch())
    return invalid_argument(rank_prefix(*comm_) + "store: batch row " + std::to_string(b) +
                            " is outside [0, " + std::to_string(plan_.batch()) + ")");
  if (pos < 0 || pos >= plan_.total_len(b))
    return invalid_argument(rank_prefix(*comm_) + "store: position " + std::to_string(pos) +
                            " of row " + std::to_string(b) + " is outside [0, " +
                            std::to_string(plan_.total_len(b)) + ")");
  const int me = comm_->rank();
  if (plan_.owner(b, pos) != me)
    return invalid_argument(rank_prefix(*comm_) + "store: position " + std::to_string(pos) +
                            " of row " + std::to_string(b) + " belongs to rank " +
                            std::to_string(plan_.owner(b, pos)) + " (" + plan_.to_string() + ")");
  if (k == nullptr || v == nullptr) return invalid_argument(rank_prefix(*comm_) + "store: null K or V");
  const int64_t slot = (pos - plan_.pos_start(me, b)) / plan_.pos_stride();
  LocalShard& shard = shards_[static_cast<std::size_t>(layer)];
  if (slot >= shard.capacity()) {
    TREEATTN_RETURN_IF_ERROR(shard.try_reserve(slot + 1));
  }
  shard.set_slot(b, slot, k, v);
  return shard.status();  // device storage: a failed growth or copy
}

Status DecodeSession::append(const float* k, const float* v) {
  TREEATTN_RETURN_IF_ERROR(check_all_live("append"));
  if (k == nullptr || v == nullptr)
    return invalid_argument(rank_prefix(*comm_) + "append: null K or V");
  const int me = comm_->rank();
  const AttnShape& s = config_.shape;
  const auto per_row = static_cast<std::size_t>(s.kv_heads * s.head_dim);
  const auto per_layer = static_cast<std::size_t>(s.batch) * per_row;
  for (int64_t b = 0; b < s.batch; ++b) {
    if (plan_.append_owner(b) != me) continue;
    const int64_t slot = plan_.len(me, b);
    for (std::size_t l = 0; l < shards_.size(); ++l) {
      LocalShard& shard = shards_[l];
      if (slot >= shard.capacity()) {
        // Nothing counted yet: the plan has not moved.
        TREEATTN_RETURN_IF_ERROR(shard.try_reserve(slot + 1));
      }
      const std::size_t off = l * per_layer + static_cast<std::size_t>(b) * per_row;
      shard.set_slot(b, slot, k + off, v + off);
    }
  }
  plan_.append_one();  // once for every layer
  for (const LocalShard& shard : shards_) TREEATTN_RETURN_IF_ERROR(shard.status());
  return Status::ok();
}

Status DecodeSession::extend(int64_t n) {
  TREEATTN_RETURN_IF_ERROR(check_all_live("extend(n)"));
  if (n < 0)
    return invalid_argument(rank_prefix(*comm_) + "extend: n must be >= 0, got " +
                            std::to_string(n));
  ShardPlan before = plan_;
  bool empty = true;
  for (int64_t len : plan_.total_lens()) empty = empty && len == 0;
  if (empty && n > 0) {
    std::vector<int64_t> lens(static_cast<std::size_t>(config_.shape.batch), n);
    auto plan = make_plan(config_, comm_->size(), std::move(lens));
    if (!plan.is_ok())
      return Status(plan.status().code(),
                    rank_prefix(*comm_) + "extend: " + plan.status().message());
    plan_ = std::move(*plan);
  } else {
    for (int64_t b = 0; b < plan_.batch(); ++b)  // n appends per row, counted at once
      TREEATTN_RETURN_IF_ERROR(plan_.extend_row(b, n));
  }
  return grow_shards(std::move(before), "extend");
}

Status DecodeSession::grow_shards(ShardPlan before, const char* op) {
  const int64_t need = plan_.max_len(comm_->rank());
  // Refused before any allocation when it could never fit: K and V of the largest rank's slots
  // per row, every row and layer, against this machine's physical memory. The largest rank's,
  // so that every rank (same plan, same machines) gives the same answer with no message.
  int64_t largest = 0;
  for (int r = 0; r < plan_.ranks(); ++r) largest = std::max(largest, plan_.max_len(r));
  const AttnShape& sh = config_.shape;
  const double bytes = static_cast<double>(largest) * static_cast<double>(sh.batch) *
                       static_cast<double>(sh.kv_heads * sh.head_dim) * 2.0 *
                       static_cast<double>(dtype_size(config_.dtype)) *
                       static_cast<double>(config_.layers);
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                          static_cast<double>(sysconf(_SC_PAGESIZE));
  if (physical > 0 && bytes > physical) {
    plan_ = std::move(before);
    return Status(Code::kOutOfMemory,
                  rank_prefix(*comm_) + op + ": " + std::to_string(largest) +
                      " token slots per row would take " + std::to_string(bytes / 1e9) +
                      " GB of K and V on one rank, more than the machine's " +
                      std::to_string(physical / 1e9) + " GB");
  }
  for (LocalShard& shard : shards_) {
    Status st = need > shard.capacity() ? shard.try_reserve(need + config_.reserve_tokens)
                                         : shard.status();
    if (!st.is_ok()) {
      plan_ = std::move(before);  // the placement never counts tokens it has no room for
      return st;
    }
  }
  return Status::ok();
}

KVShard DecodeSession::view(int layer) const {
  return shards_[static_cast<std::size_t>(layer)].view(plan_);
}

std::size_t DecodeSession::live_kv_bytes() const {
  std::size_t total = 0;
  for (const LocalShard& shard : shards_) total += shard.live_bytes(plan_);
  return total;
}

bool DecodeSession::delivers_result(int strategy) const {
  return strategies_[static_cast<std::size_t>(strategy)]->delivers_result(comm_->rank());
}

Status DecodeSession::attend_states(int layer, const float* q, StateBuffer& states, int strategy) {
  TREEATTN_RETURN_IF_ERROR(check_layer(layer, "attend"));
  if (strategy < 0 || strategy >= strategy_count())
    return invalid_argument(rank_prefix(*comm_) + "attend: strategy index " +
                            std::to_string(strategy) + " is outside [0, " +
                            std::to_string(strategy_count()) + ")");
  if (q == nullptr) return invalid_argument(rank_prefix(*comm_) + "attend: null query");
  TREEATTN_RETURN_IF_ERROR(shards_[static_cast<std::size_t>(layer)].flush());
  Strategy& st = *strategies_[static_cast<std::size_t>(strategy)];
  if (exec_->memory() == MemorySpace::kHost) return st.step(q, view(layer), plan_, states);
  // Device executor: the strategy merges into a buffer in its memory, copied to the host here.
  const AttnShape& sh = config_.shape;
  const auto B = static_cast<std::size_t>(sh.batch), Q = static_cast<std::size_t>(sh.q_len),
             H = static_cast<std::size_t>(sh.heads), D = static_cast<std::size_t>(sh.head_dim);
  if (states.records() != B * Q * H || states.head_dim() != D) states = StateBuffer(B, Q, H, D);
  TREEATTN_RETURN_IF_ERROR(run_on_device(layer, q, strategy));
  if (!delivers_result(strategy)) return Status::ok();
  TREEATTN_RETURN_IF_ERROR(exec_->to_host(states.data(), device_scratch_.data(), states.bytes()));
  return check_stream_ordered_comm(*comm_);  // not a success with garbage (see there)
}

Status DecodeSession::run_on_device(int layer, const float* q, int strategy) {
  return run_on_device(layer, q, strategy, plan_);
}

Status DecodeSession::run_on_device(int layer, const float* q, int strategy,
                                    const ShardPlan& plan) {
  const AttnShape& sh = config_.shape;
  const std::size_t bytes = static_cast<std::size_t>(sh.batch * sh.q_len * sh.heads) *
                            state_record_floats(static_cast<std::size_t>(sh.head_dim)) *
                            sizeof(float);
  if (device_scratch_.bytes() < bytes) {
    device_scratch_.reset();
    auto b = exec_->allocate(bytes);
    if (!b.is_ok())
      return Status(b.status().code(), rank_prefix(*comm_) + "attend: " + b.status().message());
    device_scratch_ = std::move(*b);
  }
  return strategies_[static_cast<std::size_t>(strategy)]->run(
      q, shards_[static_cast<std::size_t>(layer)].view(plan), plan, device_scratch_.as<float>());
}

Status DecodeSession::attend(int layer, const float* q, float* out, float* lse) {
  if (exec_->memory() != MemorySpace::kHost) {
    TREEATTN_RETURN_IF_ERROR(check_layer(layer, "attend"));
    if (q == nullptr) return invalid_argument(rank_prefix(*comm_) + "attend: null query");
    TREEATTN_RETURN_IF_ERROR(shards_[static_cast<std::size_t>(layer)].flush());
    TREEATTN_RETURN_IF_ERROR(run_on_device(layer, q, 0));
    if (!delivers_result(0)) return Status::ok();
    if (out == nullptr) return invalid_argument(rank_prefix(*comm_) + "attend: null output");
    TREEATTN_RETURN_IF_ERROR(exec_->normalize(
        device_scratch_.as<float>(),
        static_cast<std::size_t>(config_.shape.batch * config_.shape.q_len * config_.shape.heads),
        static_cast<std::size_t>(config_.shape.head_dim), out, lse));
    return check_stream_ordered_comm(*comm_);  // not a success with garbage (see there)
  }
  TREEATTN_RETURN_IF_ERROR(attend_states(layer, q, scratch_, 0));
  if (!delivers_result(0)) return Status::ok();
  if (out == nullptr) return invalid_argument(rank_prefix(*comm_) + "attend: null output");
  return exec_->normalize(scratch_.data(), scratch_.records(),
                          static_cast<std::size_t>(config_.shape.head_dim), out, lse);
}

// ---- sequences ----------------------------------------------------------------------------------

Status DecodeSession::check_live(int64_t seq, const char* op) const {
  if (seq < 0 || seq >= plan_.batch())
    return invalid_argument(rank_prefix(*comm_) + op + ": sequence " + std::to_string(seq) +
                            " is outside [0, " + std::to_string(plan_.batch()) + ")");
  if (!live_[static_cast<std::size_t>(seq)])
    return invalid_argument(rank_prefix(*comm_) + op + ": sequence " + std::to_string(seq) +
                            " is not live (add_sequence() first)");
  return Status::ok();
}

Status DecodeSession::check_all_live(const char* op) const {
  for (std::size_t b = 0; b < live_.size(); ++b)
    if (!live_[b])
      return invalid_argument(rank_prefix(*comm_) + op + " grows every row, but row " +
                              std::to_string(b) +
                              " is a free sequence slot: grow sequences with extend(seq, n) and "
                              "store_range");
  return Status::ok();
}

Result<int64_t> DecodeSession::add_sequence() {
  for (std::size_t b = 0; b < live_.size(); ++b)
    if (!live_[b]) {  // free rows are empty (remove_sequence cleared it, or it never grew)
      live_[b] = 1;
      return static_cast<int64_t>(b);
    }
  return Status(Code::kOutOfMemory,
                rank_prefix(*comm_) + "add_sequence: all " + std::to_string(live_.size()) +
                    " sequence slots are live (remove one, or create the session with a larger "
                    "batch)");
}

Status DecodeSession::remove_sequence(int64_t seq) {
  TREEATTN_RETURN_IF_ERROR(check_live(seq, "remove_sequence"));
  live_[static_cast<std::size_t>(seq)] = 0;
  plan_.clear_row(seq);
  return Status::ok();
}

bool DecodeSession::live(int64_t seq) const {
  return seq >= 0 && seq < plan_.batch() && live_[static_cast<std::size_t>(seq)] != 0;
}

int64_t DecodeSession::live_sequences() const {
  return std::count(live_.begin(), live_.end(), char{1});
}

Status DecodeSession::extend(int64_t seq, int64_t n) {
  TREEATTN_RETURN_IF_ERROR(check_live(seq, "extend"));
  if (n < 0)
    return invalid_argument(rank_prefix(*comm_) + "extend: n must be >= 0, got " +
                            std::to_string(n));
  std::span<const int64_t> row_explicit;
  if (plan_.kind() == ShardKind::kExplicit && length(seq) == 0 && n > 0) {
    if (static_cast<int>(config_.explicit_len.size()) != comm_->size())
      return invalid_argument(rank_prefix(*comm_) +
                              "extend: an explicit placement of one sequence needs explicit_len "
                              "with one length per rank (" + std::to_string(comm_->size()) +
                              "), got " + std::to_string(config_.explicit_len.size()));
    row_explicit = config_.explicit_len;
  }
  ShardPlan before = plan_;
  if (Status st = plan_.extend_row(seq, n, row_explicit); !st.is_ok())
    return Status(st.code(), rank_prefix(*comm_) + "extend: " + st.message());
  return grow_shards(std::move(before), "extend");
}

Status DecodeSession::store_range(int layer, int64_t seq, int64_t pos0, int64_t n, const float* k,
                                  const float* v) {
  TREEATTN_RETURN_IF_ERROR(check_layer(layer, "store_range"));
  TREEATTN_RETURN_IF_ERROR(check_live(seq, "store_range"));
  const int64_t len = length(seq);
  if (n < 0 || pos0 < 0 || pos0 > len || n > len - pos0)
    return invalid_argument(rank_prefix(*comm_) + "store_range: positions " +
                            std::to_string(pos0) + " + " + std::to_string(n) +
                            " of sequence " + std::to_string(seq) + " are outside [0, " +
                            std::to_string(len) + ") (extend the sequence first)");
  if (n == 0) return Status::ok();
  if (k == nullptr || v == nullptr)
    return invalid_argument(rank_prefix(*comm_) + "store_range: null K or V");
  const int me = comm_->rank();
  std::vector<int64_t> mine;  // offsets in the range this rank owns
  for (int64_t i = 0; i < n; ++i)
    if (plan_.owner(seq, pos0 + i) == me) mine.push_back(i);
  if (mine.empty()) return Status::ok();
  const auto per = static_cast<std::size_t>(config_.shape.kv_heads * config_.shape.head_dim);
  const float* kh = k;
  const float* vh = v;
  if (exec_->memory() != MemorySpace::kHost) {  // one copy of the range, then staged slots
    const std::size_t count = static_cast<std::size_t>(n) * per;
    staging_.resize(2 * count);
    TREEATTN_RETURN_IF_ERROR(exec_->to_host(staging_.data(), k, count * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(exec_->to_host(staging_.data() + count, v, count * sizeof(float)));
    kh = staging_.data();
    vh = staging_.data() + count;
  }
  LocalShard& shard = shards_[static_cast<std::size_t>(layer)];
  for (int64_t i : mine) {
    const int64_t slot = (pos0 + i - plan_.pos_start(me, seq)) / plan_.pos_stride();
    if (slot >= shard.capacity()) {
      TREEATTN_RETURN_IF_ERROR(shard.try_reserve(slot + 1));
    }
    shard.set_slot(seq, slot, kh + static_cast<std::size_t>(i) * per,
                   vh + static_cast<std::size_t>(i) * per);
  }
  return shard.status();
}

Status DecodeSession::attend(int layer, std::span<const int64_t> seqs, const float* q, float* out,
                             float* lse) {
  TREEATTN_RETURN_IF_ERROR(check_layer(layer, "attend"));
  std::vector<char> seen(live_.size(), 0);
  for (int64_t seq : seqs) {
    TREEATTN_RETURN_IF_ERROR(check_live(seq, "attend"));
    if (seen[static_cast<std::size_t>(seq)]++)
      return invalid_argument(rank_prefix(*comm_) + "attend: sequence " + std::to_string(seq) +
                              " is listed twice");
  }
  if (seqs.empty()) return Status::ok();  // every rank has the same list: nobody waits
  if (q == nullptr) return invalid_argument(rank_prefix(*comm_) + "attend: null query");
  const AttnShape& sh = config_.shape;
  const auto QH = static_cast<std::size_t>(sh.q_len * sh.heads);
  const std::size_t D = static_cast<std::size_t>(sh.head_dim), qrow = QH * D;
  const std::size_t rec = state_record_floats(D);
  const std::size_t full = static_cast<std::size_t>(sh.batch) * qrow;
  const ShardPlan sub = plan_.only_rows(seqs);
  LocalShard& shard = shards_[static_cast<std::size_t>(layer)];
  TREEATTN_RETURN_IF_ERROR(shard.flush());
  // The batch's queries: the listed rows in place, zeros elsewhere (those rows hold no token in
  // `sub`, so their queries are never read).
  q_full_.assign(full, 0.0f);
  const float* states = nullptr;
  if (exec_->memory() == MemorySpace::kHost) {
    for (std::size_t i = 0; i < seqs.size(); ++i)
      std::memcpy(q_full_.data() + static_cast<std::size_t>(seqs[i]) * qrow, q + i * qrow,
                  qrow * sizeof(float));
    TREEATTN_RETURN_IF_ERROR(strategies_[0]->step(q_full_.data(), shard.view(sub), sub, scratch_));
    states = scratch_.data();
  } else {
    if (device_q_.bytes() < full * sizeof(float)) {
      device_q_.reset();
      auto b = exec_->allocate(full * sizeof(float));
      if (!b.is_ok())
        return Status(b.status().code(), rank_prefix(*comm_) + "attend: " + b.status().message());
      device_q_ = std::move(*b);
    }
    float* dq = device_q_.as<float>();
    TREEATTN_RETURN_IF_ERROR(exec_->from_host(dq, q_full_.data(), full * sizeof(float)));
    for (std::size_t i = 0; i < seqs.size(); ++i)
      TREEATTN_RETURN_IF_ERROR(exec_->copy(dq + static_cast<std::size_t>(seqs[i]) * qrow,
                                           q + i * qrow, qrow * sizeof(float)));
    TREEATTN_RETURN_IF_ERROR(run_on_device(layer, dq, 0, sub));
    states = device_scratch_.as<float>();
  }
  if (!delivers_result(0)) return Status::ok();
  if (out == nullptr) return invalid_argument(rank_prefix(*comm_) + "attend: null output");
  for (std::size_t i = 0; i < seqs.size(); ++i)
    TREEATTN_RETURN_IF_ERROR(exec_->normalize(
        states + static_cast<std::size_t>(seqs[i]) * QH * rec, QH, D, out + i * qrow,
        lse == nullptr ? nullptr : lse + i * QH));
  return Status::ok();
}

Status DecodeSession::check_agreement(
    const std::string& when, const std::vector<std::pair<std::string, std::string>>& extra) {
  if (comm_->size() == 1) return Status::ok();
  SessionConfig c = config_;
  c.agree_also.insert(c.agree_also.end(), extra.begin(), extra.end());
  std::string live;
  for (char l : live_) live += l ? '1' : '0';
  c.agree_also.emplace_back("live sequences", live);
  return agree(*comm_, *exec_, config_fields(c, c.strategy, c.options, plan_.fingerprint()), "",
               when);
}

Result<int> DecodeSession::add_strategy(const std::string& name, const StrategyOptions& options) {
  const StrategyRegistry& registry = StrategyRegistry::for_backend(comm_->capabilities());
  std::string local_error;
  const std::string names[] = {name};
  if (!registry.contains(name))
    local_error = registry.create(name, options).status().to_string();
  else if (Result<KVLayout> l = choose_kv_layout(config_.layout, exec_->memory(), names);
           !l.is_ok())
    local_error = "strategy " + name + " cannot join a session on the tiled layout: " +
                  l.status().message();
  if (config_.check_agreement && comm_->size() > 1)
    TREEATTN_RETURN_IF_ERROR(agree(*comm_, *exec_,
                                   config_fields(config_, name, options, plan_.fingerprint()),
                                   local_error, "adding strategy " + name));
  if (!local_error.empty()) return invalid_argument(rank_prefix(*comm_) + local_error);
  auto strategy = registry.create(name, options);
  TREEATTN_RETURN_IF_ERROR(strategy.status());
  TREEATTN_RETURN_IF_ERROR((*strategy)->setup(*comm_, *exec_, config_.shape, config_.dtype, plan_));
  strategies_.push_back(std::move(*strategy));
  return strategy_count() - 1;
}

}  // namespace treeattn
