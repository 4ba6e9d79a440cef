// time_kv_layouts (kv_tiles.hpp): the caller's rows against the default tiles, on this CPU, for
// one workload, both read from memory.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "treeattn/kv_tiles.hpp"
#include "treeattn/shape.hpp"

namespace treeattn {

namespace {

// The last-level cache in bytes, or 32 MiB when the system does not say.
std::size_t last_level_cache_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return static_cast<std::size_t>(l3);
#endif
#if defined(_SC_LEVEL2_CACHE_SIZE)
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 > 0) return static_cast<std::size_t>(l2);
#endif
  return std::size_t{32} << 20;
}

}  // namespace

namespace {

Result<KVLayoutTiming> time_both(const AttnShape& shape, DType dtype, const DecodeOptions& options,
                                 std::size_t bytes, int rounds) {
  AttnShape one = shape;
  one.batch = 1;
  TREEATTN_RETURN_IF_ERROR(one.validate());
  if (rounds < 1) return invalid_argument("time_kv_layouts: rounds must be >= 1");
  if (bytes == 0)
    bytes = std::clamp(2 * last_level_cache_bytes(), std::size_t{64} << 20, std::size_t{512} << 20);
  // K and V per token and KV head, and the scales of the quantized types (the rows layout's
  // float32 ones: the larger of the two layouts).
  const std::size_t per_token = static_cast<std::size_t>(one.kv_heads) *
                                (2 * static_cast<std::size_t>(one.head_dim) * dtype_size(dtype) +
                                 (dtype_is_quantized(dtype) ? 2 * sizeof(float) : 0));
  // Whole tiles, and at least 16 of them.
  int64_t tokens = static_cast<int64_t>(bytes / per_token);
  tokens = std::max<int64_t>(16 * kKVTileTokens, tokens / kKVTileTokens * kKVTileTokens);

  KVCache rows(one, dtype, tokens);
  // Any valid value: 0x3C in every byte is ~0.0115 in f32 and bf16, ~1.06 in f16, 1.5 in fp8
  // (e4m3), 60 in int8. The kernels' work does not depend on the values.
  const std::size_t elems = static_cast<std::size_t>(one.kv_heads * tokens * one.head_dim) *
                            dtype_size(dtype);
  std::memset(rows.k_data(), 0x3C, elems);
  std::memset(rows.v_data(), 0x3C, elems);
  if (dtype_is_quantized(dtype)) {
    const std::size_t n = static_cast<std::size_t>(one.kv_heads * tokens);
    // A bfloat16 value, as the tiles' scales must be (copy_from refuses others).
    std::fill(rows.k_scale_data(), rows.k_scale_data() + n, 0x1p-7f);
    std::fill(rows.v_scale_data(), rows.v_scale_data() + n, 0x1p-7f);
  }
  const std::vector<int64_t> len{tokens}, pos{0}, total{tokens};
  const KVShard rv = rows.view(0, len, pos, total, 1);
  auto tiled = TiledKVCache::copy_from(one, rv);
  TREEATTN_RETURN_IF_ERROR(tiled.status());
  const TiledKVShard tv = tiled->view(len, pos, total, 1);

  std::vector<float> q(static_cast<std::size_t>(one.q_len * one.heads * one.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 17) - 0.08f;
  std::vector<float> states(static_cast<std::size_t>(one.q_len * one.heads * (one.head_dim + 2)));

  using Clock = std::chrono::steady_clock;
  auto timed = [&](bool tiled_layout, double& best) -> Status {
    const auto t0 = Clock::now();
    Status s = tiled_layout ? decode_partial_tiled(one, q.data(), tv, states.data(), options)
                            : decode_partial(one, q.data(), rv, states.data(), options);
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s.is_ok()) best = std::min(best, sec);
    return s;
  };
  double warm_rows = 1e300, warm_tiled = 1e300;
  TREEATTN_RETURN_IF_ERROR(timed(false, warm_rows));
  TREEATTN_RETURN_IF_ERROR(timed(true, warm_tiled));
  KVLayoutTiming t;
  t.rows_seconds = t.tiled_seconds = 1e300;
  for (int r = 0; r < rounds; ++r) {
    // Alternate which goes first, so that neither always follows the other's cache state.
    const bool tiled_first = r % 2 == 1;
    TREEATTN_RETURN_IF_ERROR(timed(tiled_first, tiled_first ? t.tiled_seconds : t.rows_seconds));
    TREEATTN_RETURN_IF_ERROR(timed(!tiled_first, tiled_first ? t.rows_seconds : t.tiled_seconds));
  }
  t.tokens = tokens;
  t.bytes = static_cast<std::size_t>(tokens) * per_token;
  return t;
}

}  // namespace

Result<KVLayoutTiming> time_kv_layouts(const AttnShape& shape, DType dtype,
                                       const DecodeOptions& options, std::size_t bytes,
                                       int rounds) {
  try {
    return time_both(shape, dtype, options, bytes, rounds);
  } catch (const std::bad_alloc&) {
    return Status(Code::kOutOfMemory, "time_kv_layouts: cannot allocate the two layouts' " +
                                          std::to_string(2 * bytes >> 20) + " MiB");
  }
}

}  // namespace treeattn
