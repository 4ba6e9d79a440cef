// How the engine computes a prefill chunk's attention across ranks: pass-Q or the K/V exchange,
// chosen per chunk by the bytes each moves (docs/serving.md, "Pass-Q vs moving K/V").
//
//   pass-Q  the chunk's q, k, v travel (one all-gather of every row's q, k and v), every rank
//           computes the partial states of every row over its own pages, and one merge per
//           layer combines them. The cached K/V never moves.
//   K/V     the chunk's k and v travel (the same all-gather without q), and so does the cached
//           prefix's K/V (one all-gather of every rank's pages of the chunk's sequence); every
//           rank then computes the attention of its own rows alone: per owner rank, the partial
//           state over that rank's pages (the kernel the owner would have run, on the same
//           pages), merged locally in the association of the merge collective
//           (its local twin, Strategy::merge_local). No merge collective for those rows, and the bits are those
//           of pass-Q: which way a chunk went never changes a token.
//
// Bytes each rank receives per layer for n new rows of a sequence with C cached tokens over p
// ranks (H heads, Hkv KV heads, head dim D, floats of 4 bytes, b bytes of K and V per cached
// token and layer):
//   pass-Q  n (H + 2 Hkv) D 4 (p-1)/p  +  n H (D + 2) 4 m(p)
//           m: the merge's received records per rank and record: p - 1 for a merge that
//           gathers every rank's states; 1 at two ranks, about 2 (p-1)/p above for a
//           reduction followed by a broadcast
//   K/V     n 2 Hkv D 4 (p-1)/p  +  C b (p-1)/p
// The K/V exchange wins while C < n (H D 4 + H (D + 2) 4 m(p) p / (p-1)) / b: for SmolLM2 (H 9, Hkv 3, D 64, f16: b = 768) at two ranks, C < 9.2 n, so a fresh prompt
// (C = 0) and the first chunks of a long one move K/V, and a question against a long cached
// document (n = 30, C = 16k) passes its queries (0.13 MB against 6.3 MB per layer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "treeattn/status.hpp"

namespace treeattn::engine {

enum class ExchangePolicy : uint8_t { kAuto, kPassQ, kKV };
Result<ExchangePolicy> parse_exchange(std::string_view name);  // auto | pass-q | kv
const char* exchange_name(ExchangePolicy policy);

struct ExchangeShape {
  int ranks = 1;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  std::size_t kv_token_bytes = 0;  // K and V of one token in one layer, as cached
  bool merge_gathers = false;  // the merge gathers every rank's states (m = p - 1)
  bool local_twin = true;      // the merge has a local twin (Strategy::merge_local)
};

// Bytes each rank receives per layer, as in the header comment.
struct ExchangeBytes {
  double pass_q = 0;
  double kv = 0;
};
ExchangeBytes exchange_bytes(const ExchangeShape& s, int64_t new_rows, int64_t cached);

// Whether the K/V exchange computes this chunk. Never at one rank (nothing moves either way)
// nor for a merge without a local twin (the collective library's association: the bits would
// differ). kAuto: when it moves fewer bytes (ties go to pass-Q).
bool use_kv_exchange(ExchangePolicy policy, const ExchangeShape& s, int64_t new_rows,
                     int64_t cached);
// Whether the policy can be honoured with this merge and rank count (kKV needs a merge with a
// local twin).
Status check_exchange(ExchangePolicy policy, const ExchangeShape& s, std::string_view merge);

}  // namespace treeattn::engine
