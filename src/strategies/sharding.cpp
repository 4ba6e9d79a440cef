// Shard plans (which rank holds which token) and the rank-local shard with appends.
#include "treeattn/sharding.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>

#include "strategies/descriptor.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/kv_tiles.hpp"

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

Status ShardPlan::extend_row(int64_t b, int64_t n, std::span<const int64_t> row_explicit) {
  if (b < 0 || b >= batch())
    return invalid_argument("row " + std::to_string(b) + " is outside [0, " +
                            std::to_string(batch()) + ")");
  if (n < 0) return invalid_argument("a row grows by n >= 0 tokens, got " + std::to_string(n));
  const std::size_t B = total_len_.size(), bi = static_cast<std::size_t>(b);
  if (total_len_[bi] > 0 || n == 0) {
    if (kind_ == ShardKind::kStriped) {  // position t on rank t mod p
      const int64_t N = total_len_[bi], P = ranks_;
      for (int64_t r = 0; r < P; ++r) {
        // Positions t in [N, N + n) with t mod P == r: ceil-counts below each end.
        const auto below = [&](int64_t end) { return end > r ? (end - r + P - 1) / P : 0; };
        len_[static_cast<std::size_t>(r) * B + bi] += below(N + n) - below(N);
      }
    } else {
      len_[static_cast<std::size_t>(append_owner(b)) * B + bi] += n;
    }
    total_len_[bi] += n;
    return Status::ok();
  }
  auto one = make(kind_, ranks_, {n}, kind_ == ShardKind::kExplicit ? row_explicit
                                                                     : std::span<const int64_t>{},
                  holder_);
  TREEATTN_RETURN_IF_ERROR(one.status());
  for (std::size_t r = 0; r < static_cast<std::size_t>(ranks_); ++r) {
    len_[r * B + bi] = one->len_[r];
    pos_start_[r * B + bi] = one->pos_start_[r];
  }
  total_len_[bi] = n;
  return Status::ok();
}

void ShardPlan::clear_row(int64_t b) {
  if (b < 0 || b >= batch()) return;
  const std::size_t B = total_len_.size(), bi = static_cast<std::size_t>(b);
  for (std::size_t r = 0; r < static_cast<std::size_t>(ranks_); ++r) {
    len_[r * B + bi] = 0;
    // Where a row of no tokens starts under this kind (make() with N = 0).
    pos_start_[r * B + bi] = kind_ == ShardKind::kStriped ? static_cast<int64_t>(r) : 0;
  }
  total_len_[bi] = 0;
}

ShardPlan ShardPlan::only_rows(std::span<const int64_t> rows) const {
  ShardPlan p = *this;
  std::vector<char> keep(total_len_.size(), 0);
  for (int64_t b : rows)
    if (b >= 0 && b < batch()) keep[static_cast<std::size_t>(b)] = 1;
  for (std::size_t b = 0; b < keep.size(); ++b)
    if (!keep[b]) p.clear_row(static_cast<int64_t>(b));
  return p;
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

// ---- LocalShard: device storage (see sharding.hpp) ---------------------------------------------

struct LocalShard::DeviceStore {
  static constexpr std::size_t kFlushBytes = std::size_t{64} << 20;  // staged bytes before a flush

  Executor* exec = nullptr;
  AttnShape shape;
  DType dtype = DType::kF32;
  int64_t capacity = 0;
  Buffer k, v, k_scale, v_scale;  // [batch][kv_heads][capacity][head_dim] / [..][capacity]
  Buffer staging;                 // a flush's packed tokens on the device (flush_locked)
  std::mutex mu;
  // Staged tokens: slot (b, j) of token i and its record at bytes[i * token_bytes]: K then V codes
  // [kv_heads][head_dim], then (quantized dtypes) K then V scales [kv_heads].
  std::vector<std::pair<int64_t, int64_t>> slots;
  std::vector<uint8_t> bytes;
  std::size_t token_bytes = 0;
  Status error;

  std::size_t es() const { return dtype_size(dtype); }
  std::size_t head_bytes() const { return static_cast<std::size_t>(shape.head_dim) * es(); }
  std::size_t codes_bytes() const {
    return static_cast<std::size_t>(shape.kv_heads) * head_bytes();
  }
  // Byte offset of (b, h, slot j) in K or V of a buffer with capacity cap, and of its scale.
  std::size_t at(int64_t b, int64_t h, int64_t j, int64_t cap) const {
    return static_cast<std::size_t>((b * shape.kv_heads + h) * cap + j) * head_bytes();
  }
  std::size_t scale_at(int64_t b, int64_t h, int64_t j, int64_t cap) const {
    return static_cast<std::size_t>((b * shape.kv_heads + h) * cap + j) * sizeof(float);
  }

  void fail(const Status& s) {
    if (error.is_ok()) error = s;
  }

  // Zeros buf: one from_host of up to 1 MiB, then copies that double the zeroed prefix.
  Status zero(Buffer& buf) {
    const std::size_t n = buf.bytes();
    if (n == 0) return Status::ok();
    const std::size_t first = std::min<std::size_t>(n, std::size_t{1} << 20);
    const std::vector<uint8_t> zeros(first, 0);
    TREEATTN_RETURN_IF_ERROR(exec->from_host(buf.data(), zeros.data(), first));
    auto* base = static_cast<uint8_t*>(buf.data());
    for (std::size_t done = first; done < n;) {
      const std::size_t c = std::min(done, n - done);
      TREEATTN_RETURN_IF_ERROR(exec->copy(base + done, base, c));
      done += c;
    }
    return Status::ok();
  }

  Status make(Buffer& buf, std::size_t n, const char* what) {
    auto b = exec->allocate(n);
    if (!b.is_ok())
      return Status(b.status().code(), "KV shard " + std::string(what) + " (" + std::to_string(n) +
                                           " bytes): " + b.status().message());
    buf = std::move(*b);
    return zero(buf);
  }

  Status allocate(int64_t cap, Buffer& nk, Buffer& nv, Buffer& nks, Buffer& nvs) {
    const auto rows = static_cast<std::size_t>(shape.batch * shape.kv_heads * cap);
    TREEATTN_RETURN_IF_ERROR(make(nk, rows * head_bytes(), "K"));
    TREEATTN_RETURN_IF_ERROR(make(nv, rows * head_bytes(), "V"));
    if (dtype_is_quantized(dtype)) {
      TREEATTN_RETURN_IF_ERROR(make(nks, rows * sizeof(float), "K scales"));
      TREEATTN_RETURN_IF_ERROR(make(nvs, rows * sizeof(float), "V scales"));
    }
    return Status::ok();
  }

  // Narrows one token ([kv_heads][head_dim] floats of K and V) into rec, as KVCache::set_token.
  void narrow(const float* kf, const float* vf, uint8_t* rec) const {
    const auto D = static_cast<std::size_t>(shape.head_dim);
    const std::size_t cb = codes_bytes();
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      const std::size_t e0 = static_cast<std::size_t>(h) * D;  // element index in the record
      if (dtype_is_quantized(dtype)) {
        const float ks = quantize_token(rec, dtype, e0, kf + e0, D);
        const float vs = quantize_token(rec + cb, dtype, e0, vf + e0, D);
        std::memcpy(rec + 2 * cb + static_cast<std::size_t>(h) * sizeof(float), &ks, sizeof(float));
        std::memcpy(rec + 2 * cb + static_cast<std::size_t>(shape.kv_heads + h) * sizeof(float),
                    &vs, sizeof(float));
        continue;
      }
      for (std::size_t d = 0; d < D; ++d) {
        store_from_float(rec, dtype, e0 + d, kf[e0 + d]);
        store_from_float(rec + cb, dtype, e0 + d, vf[e0 + d]);
      }
    }
  }

  // Copies the staged tokens: sorted by slot (the last store of a slot wins), packed into one
  // host buffer as the device segments they fill (per run of consecutive slots of a row, per KV
  // head and tensor: the codes, then the scales), sent with one from_host into the device staging
  // buffer, then scattered by device-to-device copies that are only enqueued (no wait each):
  // one synchronizing copy per flush (a decode step's appends) instead of one per segment.
  Status flush_locked() {
    if (slots.empty()) return error;
    std::vector<std::size_t> order(slots.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [this](std::size_t a, std::size_t b) { return slots[a] < slots[b]; });
    std::vector<std::size_t> keep;  // the last store of every slot, in slot order
    keep.reserve(order.size());
    for (std::size_t i = 0; i < order.size(); ++i)
      if (i + 1 == order.size() || slots[order[i + 1]] != slots[order[i]]) keep.push_back(order[i]);
    const bool quant = dtype_is_quantized(dtype);
    const std::size_t hb = head_bytes(), cb = codes_bytes();
    struct Segment {
      uint8_t* dst;
      std::size_t at, bytes;  // offset in the pack, length
    };
    std::vector<Segment> segments;
    std::vector<uint8_t> pack;
    pack.reserve(keep.size() * token_bytes);
    Status st;
    for (std::size_t r0 = 0; r0 < keep.size();) {
      const auto [b, j0] = slots[keep[r0]];
      std::size_t r1 = r0 + 1;
      while (r1 < keep.size() && slots[keep[r1]].first == b &&
             slots[keep[r1]].second == j0 + static_cast<int64_t>(r1 - r0))
        ++r1;
      const auto n = static_cast<int64_t>(r1 - r0);
      if (b < 0 || b >= shape.batch || j0 < 0 || j0 + n > capacity) {
        st = invalid_argument("KV shard: slots [" + std::to_string(j0) + ", " +
                              std::to_string(j0 + n) + ") of batch row " + std::to_string(b) +
                              " are outside the capacity " + std::to_string(capacity));
        break;  // the runs before it are still copied
      }
      for (int64_t h = 0; h < shape.kv_heads; ++h) {
        const auto hh = static_cast<std::size_t>(h);
        for (std::size_t t = 0; t < 2; ++t) {  // K, V
          Buffer& dst = t == 0 ? k : v;
          segments.push_back({static_cast<uint8_t*>(dst.data()) + at(b, h, j0, capacity),
                              pack.size(), static_cast<std::size_t>(n) * hb});
          for (std::size_t i = r0; i < r1; ++i) {
            const uint8_t* src = bytes.data() + keep[i] * token_bytes + t * cb + hh * hb;
            pack.insert(pack.end(), src, src + hb);
          }
          if (!quant) continue;
          Buffer& sdst = t == 0 ? k_scale : v_scale;
          segments.push_back({static_cast<uint8_t*>(sdst.data()) + scale_at(b, h, j0, capacity),
                              pack.size(), static_cast<std::size_t>(n) * sizeof(float)});
          const std::size_t so =
              2 * cb + (t * static_cast<std::size_t>(shape.kv_heads) + hh) * sizeof(float);
          for (std::size_t i = r0; i < r1; ++i) {
            const uint8_t* src = bytes.data() + keep[i] * token_bytes + so;
            pack.insert(pack.end(), src, src + sizeof(float));
          }
        }
      }
      r0 = r1;
    }
    slots.clear();
    bytes.clear();
    Status cs = copy_segments(pack, segments);
    if (!cs.is_ok()) fail(cs);
    if (!st.is_ok()) fail(st);
    return error;
  }

  // One from_host of the pack into the staging buffer (grown as needed), then one enqueued
  // device-to-device copy per segment. The next flush's from_host into the same staging bytes
  // is ordered after these copies on the executor's stream.
  template <class Segment>
  Status copy_segments(const std::vector<uint8_t>& pack, const std::vector<Segment>& segments) {
    if (pack.empty()) return Status::ok();
    if (staging.bytes() < pack.size()) {
      staging.reset();
      auto sb = exec->allocate(pack.size());
      if (!sb.is_ok())
        return Status(sb.status().code(), "KV shard staging buffer (" +
                                              std::to_string(pack.size()) +
                                              " bytes): " + sb.status().message());
      staging = std::move(*sb);
    }
    TREEATTN_RETURN_IF_ERROR(exec->from_host(staging.data(), pack.data(), pack.size()));
    const auto* base = static_cast<const uint8_t*>(staging.data());
    for (const Segment& g : segments)
      TREEATTN_RETURN_IF_ERROR(exec->copy(g.dst, base + g.at, g.bytes));
    return Status::ok();
  }

  // Grows to at least `tokens` slots per row (doubling), keeping the contents.
  Status grow_locked(int64_t tokens) {
    if (tokens <= capacity) return error;
    TREEATTN_RETURN_IF_ERROR(flush_locked());
    const int64_t cap = std::max(tokens, 2 * capacity);
    Buffer nk, nv, nks, nvs;
    Status st = allocate(cap, nk, nv, nks, nvs);
    const bool quant = dtype_is_quantized(dtype);
    for (int64_t b = 0; b < shape.batch && st.is_ok(); ++b)
      for (int64_t h = 0; h < shape.kv_heads && st.is_ok() && capacity > 0; ++h) {
        const std::size_t row = static_cast<std::size_t>(capacity) * head_bytes();
        st = exec->copy(static_cast<uint8_t*>(nk.data()) + at(b, h, 0, cap),
                        static_cast<const uint8_t*>(k.data()) + at(b, h, 0, capacity), row);
        if (st.is_ok())
          st = exec->copy(static_cast<uint8_t*>(nv.data()) + at(b, h, 0, cap),
                          static_cast<const uint8_t*>(v.data()) + at(b, h, 0, capacity), row);
        if (!quant || !st.is_ok()) continue;  // the per-token scales move with the codes
        const std::size_t srow = static_cast<std::size_t>(capacity) * sizeof(float);
        st = exec->copy(static_cast<uint8_t*>(nks.data()) + scale_at(b, h, 0, cap),
                        static_cast<const uint8_t*>(k_scale.data()) + scale_at(b, h, 0, capacity),
                        srow);
        if (st.is_ok())
          st = exec->copy(static_cast<uint8_t*>(nvs.data()) + scale_at(b, h, 0, cap),
                          static_cast<const uint8_t*>(v_scale.data()) + scale_at(b, h, 0, capacity),
                          srow);
      }
    if (!st.is_ok()) {
      fail(st);
      return error;
    }
    k = std::move(nk);
    v = std::move(nv);
    k_scale = std::move(nks);
    v_scale = std::move(nvs);
    capacity = cap;
    return error;
  }
};

// Tiled storage: the cache, and the TiledKVShard the last view() pointed its KVShard at.
struct LocalShard::Tiled {
  TiledKVCache cache;
  mutable TiledKVShard view;
};

LocalShard::LocalShard() = default;
LocalShard::~LocalShard() = default;
LocalShard::LocalShard(LocalShard&&) noexcept = default;
LocalShard& LocalShard::operator=(LocalShard&&) noexcept = default;

DType LocalShard::dtype() const {
  if (tiled_) return tiled_->cache.dtype();
  return device_ ? device_->dtype : cache_.dtype();
}
int64_t LocalShard::capacity() const {
  if (tiled_) return tiled_->cache.capacity();
  return device_ ? device_->capacity : cache_.capacity();
}

std::size_t LocalShard::allocated_bytes() const {
  if (tiled_) return tiled_->cache.bytes();
  if (!device_) return cache_.bytes();
  return device_->k.bytes() + device_->v.bytes() + device_->k_scale.bytes() +
         device_->v_scale.bytes();
}

Status LocalShard::flush() {
  if (!device_) return Status::ok();
  std::lock_guard<std::mutex> lk(device_->mu);
  return device_->flush_locked();
}

Status LocalShard::status() const {
  if (!tiled_error_.is_ok() || !device_) return tiled_error_;  // host growth (tiled or rows)
  std::lock_guard<std::mutex> lk(device_->mu);
  return device_->error;
}

Result<LocalShard> LocalShard::create(const AttnShape& shape, DType dtype, const ShardPlan& plan,
                                      int rank, int64_t spare_tokens, Executor* executor,
                                      KVLayout layout) {
  TREEATTN_RETURN_IF_ERROR(shape.validate());
  if (plan.batch() != shape.batch)
    return invalid_argument("shard plan has " + std::to_string(plan.batch()) +
                            " batch rows, shape has batch " + std::to_string(shape.batch));
  if (rank < 0 || rank >= plan.ranks())
    return invalid_argument("rank " + std::to_string(rank) + " is outside the plan's " +
                            std::to_string(plan.ranks()) + " ranks");
  if (spare_tokens < 0)
    return invalid_argument("spare tokens must be >= 0, got " + std::to_string(spare_tokens));
  const bool host = executor == nullptr || executor->memory() == MemorySpace::kHost;
  if (layout == KVLayout::kTiled && !host)
    return invalid_argument("rank " + std::to_string(rank) + ": the tiled KV layout is for host "
                            "memory; executor '" + std::string(executor->name()) +
                            "' keeps its shards as rows");
  LocalShard s;
  s.shape_ = shape;
  s.rank_ = rank;
  if (layout == KVLayout::kTiled) {
    auto c = TiledKVCache::create(shape, dtype, plan.max_len(rank) + spare_tokens);
    if (!c.is_ok())
      return Status(c.status().code(), "rank " + std::to_string(rank) + ": tiled KV shard: " +
                                           c.status().message());
    s.tiled_ = std::make_unique<Tiled>();
    s.tiled_->cache = std::move(*c);
    return s;
  }
  if (host) {
    s.cache_ = KVCache(shape, dtype, plan.max_len(rank) + spare_tokens);
    return s;
  }
  auto d = std::make_unique<DeviceStore>();
  d->exec = executor;
  d->shape = shape;
  d->dtype = dtype;
  d->capacity = plan.max_len(rank) + spare_tokens;
  d->token_bytes =
      2 * d->codes_bytes() + (dtype_is_quantized(dtype)
                                  ? 2 * static_cast<std::size_t>(shape.kv_heads) * sizeof(float)
                                  : 0);
  const Status st = d->allocate(d->capacity, d->k, d->v, d->k_scale, d->v_scale);
  if (!st.is_ok())
    return Status(st.code(), "rank " + std::to_string(rank) + ": executor '" +
                                 std::string(executor->name()) + "': " + st.message());
  s.device_ = std::move(d);
  return s;
}

void LocalShard::set_slot(int64_t b, int64_t j, const float* k, const float* v) {
  if (tiled_) {
    if (j < tiled_->cache.capacity()) {
      tiled_->cache.set_tokens(b, j, k, v);
    } else if (tiled_error_.is_ok()) {  // a failed reserve() left no room (status() says why)
      tiled_error_ = Status(Code::kOutOfMemory, "rank " + std::to_string(rank_) + ": slot " +
                                   std::to_string(j) + " is beyond the tiled KV shard's " +
                                   std::to_string(tiled_->cache.capacity()) + " slots");
    }
    return;
  }
  if (device_) {
    thread_local std::vector<uint8_t> rec;
    rec.resize(device_->token_bytes);
    device_->narrow(k, v, rec.data());
    std::lock_guard<std::mutex> lk(device_->mu);
    device_->slots.emplace_back(b, j);
    device_->bytes.insert(device_->bytes.end(), rec.begin(), rec.end());
    if (device_->bytes.size() >= DeviceStore::kFlushBytes) (void)device_->flush_locked();
    return;
  }
  const auto D = static_cast<std::size_t>(shape_.head_dim);
  for (int64_t h = 0; h < shape_.kv_heads; ++h)
    cache_.set_token(b, h, j, k + static_cast<std::size_t>(h) * D,
                     v + static_cast<std::size_t>(h) * D);
}

KVShard LocalShard::view(const ShardPlan& plan) const {
  if (tiled_) {
    tiled_->view = tiled_->cache.view(plan.lens(rank_), plan.pos_starts(rank_), plan.total_lens(),
                                      plan.pos_stride());
    KVShard s;
    s.dtype = tiled_->cache.dtype();
    s.memory = MemorySpace::kHost;
    s.len = tiled_->view.len;
    s.pos_start = tiled_->view.pos_start;
    s.total_len = tiled_->view.total_len;
    s.pos_stride = tiled_->view.pos_stride;
    s.tiled = &tiled_->view;
    return s;
  }
  if (device_) {
    const DeviceStore& d = *device_;
    KVShard s;
    s.dtype = d.dtype;
    s.memory = MemorySpace::kDevice;
    s.k = d.k.data();
    s.v = d.v.data();
    s.stride_token = shape_.head_dim;
    s.stride_head = d.capacity * shape_.head_dim;
    s.stride_batch = shape_.kv_heads * s.stride_head;
    s.len = plan.lens(rank_);
    s.pos_start = plan.pos_starts(rank_);
    s.total_len = plan.total_lens();
    s.pos_stride = plan.pos_stride();
    if (dtype_is_quantized(d.dtype)) {
      s.k_scale = d.k_scale.as<float>();
      s.v_scale = d.v_scale.as<float>();
      s.scale_stride_token = 1;
      s.scale_stride_head = d.capacity;
      s.scale_stride_batch = shape_.kv_heads * d.capacity;
    }
    return s;
  }
  return cache_.view(0, plan.lens(rank_), plan.pos_starts(rank_), plan.total_lens(),
                     plan.pos_stride());
}

// K and V of every live token, with their scales for quantized dtypes (the bytes the analytic
// cost model counts for a shard).
std::size_t LocalShard::live_bytes(const ShardPlan& plan) const {
  return static_cast<std::size_t>(plan.total_tokens(rank_)) *
         static_cast<std::size_t>(strategies::kv_bytes_per_token(shape_, dtype()));
}

void LocalShard::reserve(int64_t tokens) {
  const Status st = try_reserve(tokens);
  if (!st.is_ok() && !device_ && tiled_error_.is_ok()) tiled_error_ = st;  // kept for status()
}

Status LocalShard::try_reserve(int64_t tokens) {
  if (tiled_) {
    const int64_t cap = tiled_->cache.capacity();
    if (tokens <= cap) return Status::ok();
    const Status st = tiled_->cache.reserve(std::max(tokens, 2 * cap));
    if (!st.is_ok())
      return Status(st.code(), "rank " + std::to_string(rank_) +
                                   ": growing the tiled KV shard: " + st.message());
    return Status::ok();
  }
  if (device_) {
    std::lock_guard<std::mutex> lk(device_->mu);
    return device_->grow_locked(tokens);
  }
  if (tokens <= cache_.capacity()) return Status::ok();
  const int64_t cap = std::max(tokens, 2 * cache_.capacity());
  KVCache bigger;
  try {
    bigger = KVCache(shape_, cache_.dtype(), cap);
  } catch (const std::bad_alloc&) {
    return Status(Code::kOutOfMemory, "rank " + std::to_string(rank_) +
                                          ": growing the KV shard to " + std::to_string(cap) +
                                          " tokens per row: out of memory");
  }
  const std::size_t es = dtype_size(cache_.dtype());
  const auto row = static_cast<std::size_t>(cache_.capacity() * shape_.head_dim) * es;
  // An empty cache (capacity 0) has no storage to copy: memcpy from its null data, even of 0
  // bytes, is undefined (UBSan reports it).
  for (int64_t b = 0; b < shape_.batch && cache_.capacity() > 0; ++b)
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
  return Status::ok();
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
