// The strategy registries (one per backend kind), built from the strategies' descriptors, and
// the analytic cost model's common part (each strategy's formula is in its own file).
#include <algorithm>
#include <cmath>
#include <string>

#include "strategies/common.hpp"
#include "strategies/descriptor.hpp"

namespace treeattn {
namespace strategies {
namespace {

// Every strategy, for backends with user-defined reductions (Open MPI), in the CLI's order.
constexpr const StrategyDescriptor* kHostTable[] = {
    &kTreeDescriptor,      &kTreePaperDescriptor,  &kTree2Descriptor,
    &kHierDescriptor,      &kRingKVDescriptor,     &kRingStateDescriptor,
    &kAllgatherDescriptor, &kGatherRootDescriptor, &kSingleDescriptor,
};

// Offered by name (run --deterministic, --methods tree-det) on every backend, but not part of
// `all` or of the planner's candidates: tree-det needs a contiguous placement, and it trades
// speed for bits that do not depend on the rank count.
constexpr const StrategyDescriptor* const kByNameOnly[] = {&kTreeDetDescriptor};

// Backends without user-defined reductions (NCCL): the same table, with each strategy that
// needs them replaced by its stand-in (tree -> the all-gather form) or left out (hier).
std::vector<const StrategyDescriptor*> without_user_reductions() {
  std::vector<const StrategyDescriptor*> v;
  for (const StrategyDescriptor* d : kHostTable) {
    if (!d->needs_user_reductions)
      v.push_back(d);
    else if (d->without_user_reductions)
      v.push_back(d->without_user_reductions);
  }
  return v;
}

std::vector<StrategyInfo> infos(bool user_reductions) {
  std::vector<StrategyInfo> v;
  for (const StrategyDescriptor* d : strategy_descriptors(user_reductions)) v.push_back(d->info);
  return v;
}

}  // namespace

std::span<const StrategyDescriptor* const> strategy_descriptors(bool user_reductions) {
  static const std::vector<const StrategyDescriptor*> kNoUserReductionTable =
      without_user_reductions();
  if (user_reductions) return kHostTable;
  return kNoUserReductionTable;
}

const StrategyDescriptor* find_strategy_descriptor(std::string_view name, bool user_reductions) {
  for (const StrategyDescriptor* d : strategy_descriptors(user_reductions))
    if (d->info.name == name) return d;
  for (const StrategyDescriptor* d : kByNameOnly)
    if (d->info.name == name) return d;
  return nullptr;
}

double AnalyticInput::kv_bytes(int r) const {
  return static_cast<double>(plan.total_tokens(r)) * kv_per_token;
}

double AnalyticInput::bcast_sends(int r, int n, int rt) {
  const int rel = ((r - rt) % n + n) % n;
  return static_cast<double>(binomial_children(rel, n).size());
}

CostEstimate AnalyticInput::no_communication(double extra_ws) const {
  CostEstimate c;
  c.bytes_sent = 0;
  c.working_set_bytes = base_ws() + extra_ws;
  c.formula = "p = 1: no communication; ws = KV + q + S";
  return c;
}

}  // namespace strategies

Status Strategy::step(const float* q, const KVShard& local, const ShardPlan& plan,
                      StateBuffer& out) {
  if (!exec_ || exec_->memory() != MemorySpace::kHost)
    return invalid_argument(std::string(name()) +
                            ": step() with a host StateBuffer needs a strategy set up on a host "
                            "executor; use run() with a buffer in the executor's memory");
  const auto B = static_cast<std::size_t>(shape_.batch), Q = static_cast<std::size_t>(shape_.q_len),
             H = static_cast<std::size_t>(shape_.heads),
             D = static_cast<std::size_t>(shape_.head_dim);
  if (out.records() != B * Q * H || out.head_dim() != D) out = StateBuffer(B, Q, H, D);
  return run(q, local, plan, out.data());
}

const StrategyRegistry& StrategyRegistry::for_backend(const CommCapabilities& caps) {
  static const StrategyRegistry with(true), without(false);
  return caps.user_reductions ? with : without;
}

std::span<const StrategyInfo> StrategyRegistry::list() const {
  static const std::vector<StrategyInfo> with = strategies::infos(true),
                                         without = strategies::infos(false);
  return user_reductions_ ? with : without;
}

bool StrategyRegistry::contains(std::string_view name) const {
  return strategies::find_strategy_descriptor(name, user_reductions_) != nullptr;
}

const StrategyInfo* StrategyRegistry::info(std::string_view name) const {
  const auto* d = strategies::find_strategy_descriptor(name, user_reductions_);
  return d ? &d->info : nullptr;
}

Result<std::unique_ptr<Strategy>> StrategyRegistry::create(std::string_view name,
                                                           const StrategyOptions& options) const {
  if (const auto* d = strategies::find_strategy_descriptor(name, user_reductions_))
    return d->create(options);
  std::string known;
  for (const StrategyInfo& i : list()) {
    if (!known.empty()) known += ", ";
    known += i.name;
  }
  for (const strategies::StrategyDescriptor* d : strategies::kByNameOnly)
    known += ", " + std::string(d->info.name);
  return invalid_argument("unknown strategy '" + std::string(name) + "' (known: " + known + ")");
}

// ---- what the descriptors decide for a run ----------------------------------------------------

std::string_view deterministic_strategy() {
  for (const strategies::StrategyDescriptor* d : strategies::kByNameOnly)
    if (d->info.rank_count_invariant) return d->info.name;
  return {};
}

namespace {

Result<const StrategyInfo*> known_info(std::string_view name, const char* who) {
  const strategies::StrategyDescriptor* d = strategies::find_strategy_descriptor(name);
  if (d == nullptr)
    return invalid_argument(std::string(who) + ": unknown strategy '" + std::string(name) + "'");
  return &d->info;
}

}  // namespace

// The layout each host kernel target reads faster for llama3-8b's shape, by ISA: tiled on
// AVX-512 and the generic target, rows on AVX2. Measured by `treeattn bench --kernel
// --kernel-cases --dtype f32,bf16,f16 --repeats 7 --no-peer` (or bench/treeattn_roofline with
// the same flags: rows and tiled interleaved in each round, fractions of the streaming probe).
// The faster layout also depends on the CPU and the shape (SmolLM2's reads faster tiled on AVX2
// too), so kAuto with a workload takes the layout the kernel tuning measured on this CPU
// (host_kv_layout(workload), layout_choice.cpp, tuning.hpp); this rule is what remains without
// a tuned entry, and with TREEATTN_TUNE=0.
//   generic: not measured; the tiled layout, as before.
KVLayout host_kv_layout(Isa isa) {
  if (isa == Isa::kAuto) isa = best_isa();
  switch (isa) {
    case Isa::kAvx2:
      return KVLayout::kRows;
    case Isa::kAuto:
    case Isa::kReference:
    case Isa::kGeneric:
    case Isa::kAvx512:
      break;
  }
  return KVLayout::kTiled;
}

Result<KVLayout> choose_kv_layout(KVLayout requested, MemorySpace memory,
                                  std::span<const std::string> strategies) {
  for (const std::string& name : strategies)
    TREEATTN_RETURN_IF_ERROR(known_info(name, "KV layout").status());
  const bool host = memory == MemorySpace::kHost;
  switch (requested) {
    case KVLayout::kAuto:
      return host ? host_kv_layout() : KVLayout::kRows;
    case KVLayout::kRows:
      return KVLayout::kRows;
    case KVLayout::kTiled:
      if (!host)
        return invalid_argument("the tiled KV layout is for host memory; device shards are rows");
      return KVLayout::kTiled;
  }
  return invalid_argument("unknown KV layout");
}

Result<ShardPlan> initial_plan(std::string_view strategy, ShardKind requested, int ranks,
                               std::vector<int64_t> lens, std::span<const int64_t> explicit_len,
                               int holder) {
  auto info = known_info(strategy, "initial plan");
  TREEATTN_RETURN_IF_ERROR(info.status());
  switch ((*info)->placement) {
    case PlacementNeed::kAllOnRoot:  // whatever the requested placement
      return ShardPlan::make(ShardKind::kSingle, ranks, std::move(lens));
    case PlacementNeed::kContiguous:  // the strategy's setup refuses striped (kUnsupported)
    case PlacementNeed::kAny:
      break;
  }
  // An explicit placement describes the prefill (extend); before it every rank holds nothing.
  const bool empty = std::all_of(lens.begin(), lens.end(), [](int64_t n) { return n == 0; });
  if (requested == ShardKind::kExplicit && empty) {
    const std::vector<int64_t> zeros(static_cast<std::size_t>(std::max(ranks, 0)), 0);
    return ShardPlan::make(requested, ranks, std::move(lens), zeros, holder);
  }
  return ShardPlan::make(requested, ranks, std::move(lens), explicit_len, holder);
}

// ---- analytic cost ----------------------------------------------------------------------------

Result<CostEstimate> analytic_cost(std::string_view strategy, const AttnShape& shape, DType dtype,
                                   const ShardPlan& plan, int rank,
                                   const StrategyOptions& options) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  if (rank < 0 || rank >= plan.ranks())
    return invalid_argument("analytic_cost: rank " + std::to_string(rank) + " is outside [0, " +
                            std::to_string(plan.ranks()) + ")");
  const strategies::StrategyDescriptor* d = strategies::find_strategy_descriptor(strategy);
  if (!d || !d->analytic)
    return invalid_argument("analytic_cost: unknown strategy '" + std::string(strategy) + "'");
  const strategies::AnalyticInput in{.shape = shape,
                                     .dtype = dtype,
                                     .plan = plan,
                                     .rank = rank,
                                     .options = options,
                                     .p = plan.ranks(),
                                     .S = strategies::state_bytes(shape),
                                     .q_bytes = strategies::query_bytes(shape),
                                     .kv_per_token = strategies::kv_bytes_per_token(shape, dtype),
                                     .root = options.root >= 0 ? options.root : 0,
                                     .all = options.root < 0};
  return d->analytic(in);
}

Result<double> strategy_extra_kv_caches(std::string_view strategy, int ranks) {
  const strategies::StrategyDescriptor* d = strategies::find_strategy_descriptor(strategy);
  if (!d || !d->extra_kv_caches)
    return invalid_argument("strategy_extra_kv_caches: unknown strategy '" + std::string(strategy) +
                            "'");
  if (ranks < 1)
    return invalid_argument("strategy_extra_kv_caches: ranks must be >= 1, got " +
                            std::to_string(ranks));
  return d->extra_kv_caches(ranks);
}

}  // namespace treeattn
