// The engine's choice between pass-Q and the K/V exchange: see exchange.hpp.
#include "engine/exchange.hpp"

#include <string>

namespace treeattn::engine {

Result<ExchangePolicy> parse_exchange(std::string_view name) {
  if (name == "auto") return ExchangePolicy::kAuto;
  if (name == "pass-q") return ExchangePolicy::kPassQ;
  if (name == "kv") return ExchangePolicy::kKV;
  return invalid_argument("unknown prefill exchange '" + std::string(name) +
                          "' (known: auto, pass-q, kv)");
}

const char* exchange_name(ExchangePolicy policy) {
  switch (policy) {
    case ExchangePolicy::kAuto: return "auto";
    case ExchangePolicy::kPassQ: return "pass-q";
    case ExchangePolicy::kKV: return "kv";
  }
  return "?";
}

ExchangeBytes exchange_bytes(const ExchangeShape& s, int64_t new_rows, int64_t cached) {
  ExchangeBytes b;
  if (s.ranks <= 1) return b;
  const double p = s.ranks, share = (p - 1) / p, n = static_cast<double>(new_rows);
  const double row_q = static_cast<double>(s.heads * s.head_dim) * 4;
  const double row_kv = static_cast<double>(2 * s.kv_heads * s.head_dim) * 4;
  const double records = static_cast<double>(s.heads * (s.head_dim + 2)) * 4;
  const double m = s.merge_gathers ? p - 1 : (s.ranks == 2 ? 1.0 : 2 * share);
  b.pass_q = n * (row_q + row_kv) * share + n * records * m;
  b.kv = n * row_kv * share + static_cast<double>(cached) * static_cast<double>(s.kv_token_bytes) * share;
  return b;
}

bool use_kv_exchange(ExchangePolicy policy, const ExchangeShape& s, int64_t new_rows,
                     int64_t cached) {
  if (s.ranks <= 1 || !s.local_twin || policy == ExchangePolicy::kPassQ)
    return false;
  if (policy == ExchangePolicy::kKV) return true;
  const ExchangeBytes b = exchange_bytes(s, new_rows, cached);
  return b.kv < b.pass_q;
}

Status check_exchange(ExchangePolicy policy, const ExchangeShape& s, std::string_view merge) {
  if (policy == ExchangePolicy::kKV && s.ranks > 1 && !s.local_twin)
    return invalid_argument("prefill exchange 'kv' needs a merge with a local twin at " +
                            std::to_string(s.ranks) + " ranks: the association of '" +
                            std::string(merge) +
                            "' is the collective library's, so the K/V exchange could not "
                            "reproduce its bits");
  return Status::ok();
}

}  // namespace treeattn::engine
