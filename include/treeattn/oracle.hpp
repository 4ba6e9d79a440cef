// The float64 oracle: plain softmax(q K^T * scale) V over a whole KV cache on one process.
//
// Every element is widened exactly to double, logits and softmax are computed in double with
// an explicit max subtraction, and masked or absent keys never enter the sum. It is slow on
// purpose: it is the definition every kernel and strategy is checked against.
#pragma once

#include <cstdint>

#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// kv.len[b] must equal kv.total_len[b] for the whole cache, or kv may be any shard, in which
// case the result is the attention over that shard's visible keys (the partial state,
// normalized). out is [batch][q_len][heads][head_dim] double, lse is [batch][q_len][heads]
// double (natural log). Rows that see no key get out = 0 and lse = -inf.
// scale = 0 means 1 / sqrt(head_dim).
Status oracle_attention(const AttnShape& shape, const float* q, const KVShard& kv, double* out,
                        double* lse, double scale = 0.0);

// Same, as float64 partial-state records [m, l, o...] (o unnormalized), for merge tests.
Status oracle_partial(const AttnShape& shape, const float* q, const KVShard& kv, double* states,
                      double scale = 0.0);

}  // namespace treeattn
