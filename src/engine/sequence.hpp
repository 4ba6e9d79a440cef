// One admitted request as every rank holds it (replicated: the same on every rank, applied from
// the same step descriptions), plus rank 0's callback and timings.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/page_table.hpp"
#include "treeattn/engine.hpp"

namespace treeattn::structured {
class TokenConstraint;  // src/model/structured/constraint.hpp
}

namespace treeattn::engine {

using Clock = std::chrono::steady_clock;

struct Sequence {
  RequestId id = 0;
  Request req;
  std::vector<TokenId> tokens;  // prompt, then generated
  int64_t prompt_len = 0;
  int64_t computed = 0;               // positions whose K/V are stored
  std::vector<PageRef> pages;         // logical page j
  std::vector<uint64_t> hashes;       // chain hash of full pages 0 .. hashes.size() - 1
  // With a window group (kv_manager.hpp): logical page j's window page; pages
  // [0, window_dropped) were dropped (invalid refs).
  std::vector<PageRef> window_pages;
  int64_t window_dropped = 0;
  std::vector<int64_t> reserve_left;  // per group and rank: pages reserved, not yet allocated
  int64_t generated = 0;
  int64_t cached_tokens = 0;  // prompt tokens taken from the prefix cache
  model::Sampler sampler{model::SamplingParams{}};
  // Request::response_format's token mask and matcher state (made by the engine at the first
  // draw; kept through preemption with the tokens it has seen).
  std::shared_ptr<structured::TokenConstraint> constraint;
  // rank 0 only
  TokenCallback cb;
  Clock::time_point submitted, admitted, first_token;
};

}  // namespace treeattn::engine
