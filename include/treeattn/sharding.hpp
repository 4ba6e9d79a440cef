// Where the tokens of the KV cache live across ranks, and the rank-local shard that owns them.
//
// A ShardPlan says, for every rank and batch row, how many tokens the rank holds and at which
// global positions (pos_start + j * pos_stride for local slot j). It is a pure function of its
// inputs and of the appends applied to it, so every rank builds the same plan without
// communication. Kinds:
//   even      contiguous, ranks get floor(N/p) or ceil(N/p) tokens (the first N mod p get one more)
//   uneven    contiguous, rank r gets about N * (r + 1) / (p (p + 1) / 2) tokens (the last rank
//             holds most; the first may hold none)
//   striped   token t on rank t mod p (stays balanced as decoding appends tokens)
//   explicit  contiguous with caller-given per-rank lengths (zeros allowed)
//   single    every token on one holder rank (the `single` strategy's placement)
// Batch rows may have different lengths (ragged batches); each row is split by the same rule.
//
// Appending: decoding adds one token per batch row per step at position N (the row's current
// length). Contiguous kinds append on the last rank (p - 1), which keeps every shard a
// contiguous range; striped appends on rank N mod p; single on its holder. append_token()
// updates the plan on every rank and stores the token on the rank that owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/dtype.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

enum class ShardKind : uint8_t { kEven, kUneven, kStriped, kExplicit, kSingle };

// How a LocalShard stores its tokens:
//   rows    [batch][kv_heads][capacity][head_dim] (KVCache, the caller layout of shape.hpp);
//           every strategy and executor reads it, and device shards are always rows.
//   tiled   the tiled layout of kv_tiles.hpp (TiledKVCache, host memory), which the CPU kernel
//           reads near the memory limit (docs/kernels.md; `treeattn bench
//           --kernel` compares it with rows). Every strategy reads it (ring-kv
//           rotates tiles, tree-det copies its chunks' tokens out of them).
//   auto    on a host executor the layout this CPU reads faster for the workload (shape, dtype,
//           kernel threads), measured once and kept (host_kv_layout(workload), strategy.hpp;
//           rank 0's choice in a job), rows on a device.
enum class KVLayout : uint8_t { kAuto, kRows, kTiled };
inline std::string_view kv_layout_name(KVLayout layout) {
  switch (layout) {
    case KVLayout::kAuto:
      return "auto";
    case KVLayout::kRows:
      return "rows";
    case KVLayout::kTiled:
      return "tiled";
  }
  return "?";
}
// Inline (no library needed), so the CLI's option parsing links without the strategies.
inline Result<KVLayout> parse_kv_layout(std::string_view name) {
  for (KVLayout l : {KVLayout::kAuto, KVLayout::kRows, KVLayout::kTiled})
    if (kv_layout_name(l) == name) return l;
  return invalid_argument("unknown KV layout '" + std::string(name) +
                          "' (known: auto, rows, tiled)");
}

std::string_view shard_kind_name(ShardKind kind);
Result<ShardKind> parse_shard_kind(std::string_view name);  // even|uneven|striped|explicit|single

class ShardPlan {
 public:
  ShardPlan() = default;

  // total_len: context length per batch row (>= 0). explicit_len (kExplicit only): per-rank
  // lengths, either `ranks` values used for every row or ranks * batch values ([rank][batch]);
  // their sum must equal each row's length. holder (kSingle only): the rank holding all tokens.
  static Result<ShardPlan> make(ShardKind kind, int ranks, std::vector<int64_t> total_len,
                                std::span<const int64_t> explicit_len = {}, int holder = 0);

  ShardKind kind() const { return kind_; }
  int ranks() const { return ranks_; }
  int64_t batch() const { return static_cast<int64_t>(total_len_.size()); }
  int holder() const { return holder_; }
  int64_t pos_stride() const { return kind_ == ShardKind::kStriped ? ranks_ : 1; }

  std::span<const int64_t> total_lens() const { return total_len_; }
  int64_t total_len(int64_t b) const { return total_len_[static_cast<std::size_t>(b)]; }
  // Per batch row, for one rank.
  std::span<const int64_t> lens(int rank) const { return row(len_, rank); }
  std::span<const int64_t> pos_starts(int rank) const { return row(pos_start_, rank); }
  int64_t len(int rank, int64_t b) const { return lens(rank)[static_cast<std::size_t>(b)]; }
  int64_t pos_start(int rank, int64_t b) const {
    return pos_starts(rank)[static_cast<std::size_t>(b)];
  }
  int64_t max_len(int rank) const;       // over batch rows
  int64_t total_tokens(int rank) const;  // over batch rows
  int64_t max_total_len() const;

  // The rank holding position pos of row b (pos < total_len(b)).
  int owner(int64_t b, int64_t pos) const;
  // The rank that will hold the next appended token of row b.
  int append_owner(int64_t b) const;
  // Records one appended token per batch row.
  void append_one();
  // One row on its own (a sequence of a serving session, DecodeSession::extend(seq, n)): grows
  // row b by n tokens. An empty row is laid out by the plan's kind as make() lays out a row of n
  // tokens (kExplicit: by row_explicit, one length per rank summing to n); a non-empty row
  // takes n appends (append_owner). kInvalidArgument for a bad row, n < 0 or bad lengths.
  Status extend_row(int64_t b, int64_t n, std::span<const int64_t> row_explicit = {});
  // Row b holds no tokens again (a sequence left); the other rows keep theirs.
  void clear_row(int64_t b);
  // A copy in which only the given rows keep their tokens (the others are empty): attention
  // over a subset of the rows reads nothing of the others. Rows outside [0, batch) are ignored.
  ShardPlan only_rows(std::span<const int64_t> rows) const;

  // A 64-bit hash of everything above, equal on ranks that built equal plans.
  uint64_t fingerprint() const;
  std::string to_string() const;  // "striped p=4 N=[100,37]"

 private:
  std::span<const int64_t> row(const std::vector<int64_t>& v, int rank) const {
    return std::span<const int64_t>(v).subspan(static_cast<std::size_t>(rank) * total_len_.size(),
                                               total_len_.size());
  }
  ShardKind kind_ = ShardKind::kEven;
  int ranks_ = 1;
  int holder_ = 0;
  std::vector<int64_t> total_len_;        // [batch]
  std::vector<int64_t> len_, pos_start_;  // [rank][batch]
};

class Executor;  // executor.hpp

// This rank's part of the KV cache: an owning buffer [batch][kv_heads][capacity][head_dim] whose
// slot j of row b holds the token at global position plan.pos_start(rank, b) + j * stride.
//
// Tiled storage (KVLayout::kTiled, host only): the same slots in a TiledKVCache; view() returns
// a KVShard whose `tiled` points at a TiledKVShard kept inside this LocalShard (valid until the
// next view(), reserve() or move of this shard), and cache() stays empty.
//
// Device storage: created with an executor whose memory() is MemorySpace::kDevice, K and V (and
// the scales) are buffers of that executor, in the same layout, zero-filled like KVCache.
// set_slot narrows on the host into a staging list (thread-safe); flush() copies the staged
// tokens with from_host, one copy per run of consecutive slots per KV head (and tensor), so a
// prefill of n tokens costs batch x kv_heads x 2 copies, not n x kv_heads x 2. view() shows what
// has been flushed (KVShard::memory = kDevice); DecodeSession flushes before every attention.
// Errors of the device path (out of memory while growing, a failed copy) are kept and returned by
// flush() and status(). cache() is the host cache and stays empty then.
class LocalShard {
 public:
  LocalShard();
  ~LocalShard();
  LocalShard(LocalShard&&) noexcept;
  LocalShard& operator=(LocalShard&&) noexcept;
  // Capacity = the rank's longest row plus spare_tokens (room for appends before growing).
  // executor: null or a host executor keeps the shard in a host KVCache; a device executor
  // (which must outlive the shard) holds it in its memory.
  // layout: kRows or kTiled (kTiled needs host memory; kAuto is rows here).
  static Result<LocalShard> create(const AttnShape& shape, DType dtype, const ShardPlan& plan,
                                   int rank, int64_t spare_tokens, Executor* executor = nullptr,
                                   KVLayout layout = KVLayout::kRows);

  const AttnShape& shape() const { return shape_; }
  DType dtype() const;
  int rank() const { return rank_; }
  int64_t capacity() const;
  KVCache& cache() { return cache_; }
  const KVCache& cache() const { return cache_; }
  MemorySpace memory() const { return device_ ? MemorySpace::kDevice : MemorySpace::kHost; }
  KVLayout layout() const { return tiled_ ? KVLayout::kTiled : KVLayout::kRows; }
  // Device storage: copies the staged tokens to the device. Host storage: nothing to do (OK).
  Status flush();
  // The first error of the device path so far (OK on the host path).
  Status status() const;

  // Writes local slot j of row b from k, v [kv_heads][head_dim] floats (narrowed to dtype).
  void set_slot(int64_t b, int64_t j, const float* k, const float* v);
  // A view of the rank's live tokens; the plan must outlive the view.
  KVShard view(const ShardPlan& plan) const;
  // Bytes of K and V the rank holds for the plan (live tokens only).
  std::size_t live_bytes(const ShardPlan& plan) const;
  std::size_t allocated_bytes() const;

  // Makes room for at least `tokens` slots per row, keeping the contents (doubling growth).
  // A failure is kept and returned by status() from then on.
  void reserve(int64_t tokens);
  // The same, returning a failure instead of keeping it (host storage: the shard is unchanged
  // and usable; device storage keeps its errors as before).
  Status try_reserve(int64_t tokens);

 private:
  struct DeviceStore;  // sharding.cpp
  AttnShape shape_;
  int rank_ = 0;
  KVCache cache_;
  std::unique_ptr<DeviceStore> device_;
  struct Tiled;  // sharding.cpp: the TiledKVCache and the view handed out last
  std::unique_ptr<Tiled> tiled_;
  Status tiled_error_;  // a failed growth of the tiled cache (status())
};

// Appends one decoded token to every batch row: k_new and v_new are [batch][kv_heads][head_dim]
// floats, the same on every rank. Updates plan (on every rank) and stores the token in shard if
// this rank owns its position, growing the shard when it is full.
Status append_token(ShardPlan& plan, LocalShard& shard, const float* k_new, const float* v_new);

}  // namespace treeattn
