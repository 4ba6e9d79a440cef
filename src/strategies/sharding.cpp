// Shard plans (which rank holds which token) and the rank-local shard with appends.
#include "treeattn/sharding.hpp"

#include <algorithm>
#include <cstring>

#include "strategies/descriptor.hpp"

namespace treeattn {
namespace {
__extension__ typedef __int128 Int128;  // exact N * r (r + 1) / 2 for any plan size
}  // namespace

std::string_view shard_kind_name(ShardKind kind) {
  switch (kind) {
    case ShardKind::kEven:
      return "even";
    case ShardKind::kUneven:
      return "uneven";
    case ShardKind::kStriped:
      return "striped";
    case ShardKind::kExplicit:
      return "explicit";
    case ShardKind::kSingle:
      return "single";
  }
  return "?";
}

Result<ShardKind> parse_shard_kind(std::string_view name) {
  for (ShardKind k : {ShardKind::kEven, ShardKind::kUneven, ShardKind::kStriped,
                      ShardKind::kExplicit, ShardKind::kSingle})
    if (shard_kind_name(k) == name) return k;
  return invalid_argument("unknown shard kind '" + std::string(name) +
                          "' (known: even, uneven, striped, explicit, single)");
}

Result<ShardPlan> ShardPlan::make(ShardKind kind, int ranks, std::vector<int64_t> total_len,
                                  std::span<const int64_t> explicit_len, int holder) {
  if (ranks < 1)
    return invalid_argument("shard plan needs >= 1 rank, got " + std::to_string(ranks));
  if (total_len.empty()) return invalid_argument("shard plan needs >= 1 batch row");
  for (std::size_t b = 0; b < total_len.size(); ++b)
    if (total_len[b] < 0)
      return invalid_argument("batch row " + std::to_string(b) + " has negative length " +
                              std::to_string(total_len[b]));
  if (kind != ShardKind::kExplicit && !explicit_len.empty())
    return invalid_argument("per-rank lengths are only accepted with shard kind 'explicit', not '" +
                            std::string(shard_kind_name(kind)) + "'");
  if (kind == ShardKind::kSingle && (holder < 0 || holder >= ranks))
    return invalid_argument("single-holder rank " + std::to_string(holder) + " is outside [0, " +
                            std::to_string(ranks) + ")");

  ShardPlan p;
  p.kind_ = kind;
  p.ranks_ = ranks;
  p.holder_ = kind == ShardKind::kSingle ? holder : 0;
  const std::size_t B = total_len.size();
  const auto R = static_cast<std::size_t>(ranks);
  p.total_len_ = std::move(total_len);
  p.len_.assign(R * B, 0);
  p.pos_start_.assign(R * B, 0);

  if (kind == ShardKind::kExplicit) {
    if (explicit_len.size() != R && explicit_len.size() != R * B)
      return invalid_argument("explicit shard lengths: got " + std::to_string(explicit_len.size()) +
                              " values, expected " + std::to_string(R) + " (one per rank) or " +
                              std::to_string(R * B) + " (ranks x batch)");
  }
  for (std::size_t b = 0; b < B; ++b) {
    const int64_t N = p.total_len_[b];
    int64_t start = 0;
    for (std::size_t r = 0; r < R; ++r) {
      const int64_t ri = static_cast<int64_t>(r), P = ranks;
      int64_t n = 0;
      switch (kind) {
        case ShardKind::kEven:
          n = N / P + (ri < N % P ? 1 : 0);
          break;
        case ShardKind::kUneven: {
          // Cumulative boundaries floor(N * S_r / S_p), S_r = r (r + 1) / 2.
          const auto sp = static_cast<Int128>(P) * (P + 1) / 2;
          const auto lo = static_cast<Int128>(N) * (ri * (ri + 1) / 2) / sp;
          const auto hi = static_cast<Int128>(N) * ((ri + 1) * (ri + 2) / 2) / sp;
          n = static_cast<int64_t>(hi - lo);
          break;
        }
        case ShardKind::kStriped:
          n = N > ri ? (N - ri + P - 1) / P : 0;
          break;
        case ShardKind::kExplicit:
          n = explicit_len.size() == R ? explicit_len[r] : explicit_len[r * B + b];
          if (n < 0)
            return invalid_argument("explicit shard length of rank " + std::to_string(r) +
                                    " is negative (" + std::to_string(n) + ")");
          break;
        case ShardKind::kSingle:
          n = ri == holder ? N : 0;
          break;
      }
      p.len_[r * B + b] = n;
      if (kind == ShardKind::kStriped) {
        p.pos_start_[r * B + b] = ri;
      } else if (kind == ShardKind::kSingle) {
        p.pos_start_[r * B + b] = 0;
      } else {
        p.pos_start_[r * B + b] = start;
        start += n;
      }
    }
    if (kind == ShardKind::kExplicit && start != N)
      return invalid_argument("explicit shard lengths of batch row " + std::to_string(b) +
                              " sum to " + std::to_string(start) + ", but the row has " +
                              std::to_string(N) + " tokens");
  }
  return p;
}

int64_t ShardPlan::max_len(int rank) const {
  int64_t m = 0;
  for (int64_t v : lens(rank)) m = std::max(m, v);
  return m;
}

int64_t ShardPlan::total_tokens(int rank) const {
  int64_t s = 0;
  for (int64_t v : lens(rank)) s += v;
  return s;
}

int64_t ShardPlan::max_total_len() const {
  int64_t m = 0;
  for (int64_t v : total_len_) m = std::max(m, v);
  return m;
}

int ShardPlan::owner(int64_t b, int64_t pos) const {
  if (kind_ == ShardKind::kStriped) return static_cast<int>(pos % ranks_);
  if (kind_ == ShardKind::kSingle) return holder_;
  for (int r = 0; r < ranks_; ++r) {
    const int64_t s = pos_start(r, b), n = len(r, b);
    if (pos >= s && pos < s + n) return r;
  }
  return ranks_ - 1;
}

int ShardPlan::append_owner(int64_t b) const {
  switch (kind_) {
    case ShardKind::kStriped:
      return static_cast<int>(total_len(b) % ranks_);
    case ShardKind::kSingle:
      return holder_;
    default:
      return ranks_ - 1;
  }
}

void ShardPlan::append_one() {
  const std::size_t B = total_len_.size();
  for (std::size_t b = 0; b < B; ++b) {
    const auto r = static_cast<std::size_t>(append_owner(static_cast<int64_t>(b)));
    len_[r * B + b] += 1;
    total_len_[b] += 1;
  }
}

uint64_t ShardPlan::fingerprint() const {
  // FNV-1a over the plan's integers.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<int64_t>(kind_));
  mix(ranks_);
  mix(holder_);
  for (int64_t v : total_len_) mix(v);
  for (int64_t v : len_) mix(v);
  for (int64_t v : pos_start_) mix(v);
  return h;
}

std::string ShardPlan::to_string() const {
  std::string s = std::string(shard_kind_name(kind_)) + " p=" + std::to_string(ranks_) + " N=[";
  for (std::size_t b = 0; b < total_len_.size(); ++b) {
    if (b) s += ",";
    s += std::to_string(total_len_[b]);
  }
  return s + "]";
}

// ---- LocalShard -----------------------------------------------------------------------------

Result<LocalShard> LocalShard::create(const AttnShape& shape, DType dtype, const ShardPlan& plan,
                                      int rank, int64_t spare_tokens) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  if (plan.batch() != shape.batch)
    return invalid_argument("shard plan has " + std::to_string(plan.batch()) +
                            " batch rows, shape has batch " + std::to_string(shape.batch));
  if (rank < 0 || rank >= plan.ranks())
    return invalid_argument("rank " + std::to_string(rank) + " is outside the plan's " +
                            std::to_string(plan.ranks()) + " ranks");
  if (spare_tokens < 0)
    return invalid_argument("spare tokens must be >= 0, got " + std::to_string(spare_tokens));
  LocalShard s;
  s.shape_ = shape;
  s.rank_ = rank;
  s.cache_ = KVCache(shape, dtype, plan.max_len(rank) + spare_tokens);
  return s;
}

void LocalShard::set_slot(int64_t b, int64_t j, const float* k, const float* v) {
  const auto D = static_cast<std::size_t>(shape_.head_dim);
  for (int64_t h = 0; h < shape_.kv_heads; ++h)
    cache_.set_token(b, h, j, k + static_cast<std::size_t>(h) * D,
                     v + static_cast<std::size_t>(h) * D);
}

KVShard LocalShard::view(const ShardPlan& plan) const {
  return cache_.view(0, plan.lens(rank_), plan.pos_starts(rank_), plan.total_lens(),
                     plan.pos_stride());
}

// K and V of every live token, with their scales for quantized dtypes (the bytes the analytic
// cost model counts for a shard).
std::size_t LocalShard::live_bytes(const ShardPlan& plan) const {
  return static_cast<std::size_t>(plan.total_tokens(rank_)) *
         static_cast<std::size_t>(strategies::kv_bytes_per_token(shape_, cache_.dtype()));
}

void LocalShard::reserve(int64_t tokens) {
  if (tokens <= cache_.capacity()) return;
  const int64_t cap = std::max(tokens, 2 * cache_.capacity());
  KVCache bigger(shape_, cache_.dtype(), cap);
  const std::size_t es = dtype_size(cache_.dtype());
  const auto row = static_cast<std::size_t>(cache_.capacity() * shape_.head_dim) * es;
  for (int64_t b = 0; b < shape_.batch; ++b)
    for (int64_t h = 0; h < shape_.kv_heads; ++h) {
      const std::size_t from = cache_.index(b, h, 0) * es, to = bigger.index(b, h, 0) * es;
      std::memcpy(static_cast<uint8_t*>(bigger.k_data()) + to,
                  static_cast<const uint8_t*>(cache_.k_data()) + from, row);
      std::memcpy(static_cast<uint8_t*>(bigger.v_data()) + to,
                  static_cast<const uint8_t*>(cache_.v_data()) + from, row);
      if (dtype_is_quantized(cache_.dtype())) {  // the per-token scales move with the codes
        const auto n = static_cast<std::size_t>(cache_.capacity()) * sizeof(float);
        std::memcpy(bigger.k_scale_data() + bigger.scale_index(b, h, 0),
                    cache_.k_scale_data() + cache_.scale_index(b, h, 0), n);
        std::memcpy(bigger.v_scale_data() + bigger.scale_index(b, h, 0),
                    cache_.v_scale_data() + cache_.scale_index(b, h, 0), n);
      }
    }
  cache_ = std::move(bigger);
}

Status append_token(ShardPlan& plan, LocalShard& shard, const float* k_new, const float* v_new) {
  const AttnShape& shape = shard.shape();
  if (plan.batch() != shape.batch)
    return invalid_argument("append: plan has " + std::to_string(plan.batch()) +
                            " batch rows, shard has batch " + std::to_string(shape.batch));
  if (k_new == nullptr || v_new == nullptr) return invalid_argument("append: null K or V");
  const int me = shard.rank();
  const auto per_row = static_cast<std::size_t>(shape.kv_heads * shape.head_dim);
  for (int64_t b = 0; b < shape.batch; ++b) {
    if (plan.append_owner(b) != me) continue;
    const int64_t slot = plan.len(me, b);
    if (slot >= shard.capacity()) shard.reserve(slot + 1);
    shard.set_slot(b, slot, k_new + static_cast<std::size_t>(b) * per_row,
                   v_new + static_cast<std::size_t>(b) * per_row);
  }
  plan.append_one();
  return Status::ok();
}

}  // namespace treeattn
