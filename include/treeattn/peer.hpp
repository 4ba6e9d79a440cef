// A peer implementation of the decode kernel built on OpenBLAS, for comparison only.
//
// Per (batch row, KV head): scores S = scale * Q_g K^T with one SGEMM (the R = group * q_len
// query rows of the KV head against all its tokens; a GEMV when R = 1), a plain softmax per
// row (max, exp, sum; causally hidden tokens get weight 0), and O = P V with a second SGEMM.
// It writes the same state records as decode_partial (m, l, unnormalized o), so it can be
// checked against the oracle. Only f32 KV is supported; it allocates its score workspace per
// call. Threads are OpenBLAS threads inside each GEMM.
//
// Part of the measurement library treeattn_measure (src/measure), which alone links OpenBLAS;
// libtreeattn does not.
#pragma once

#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// Whether this build links OpenBLAS (otherwise openblas_decode_partial returns kUnsupported).
bool openblas_available();

// scale = 0 means 1 / sqrt(head_dim); threads = 0 leaves OpenBLAS's own setting.
Status openblas_decode_partial(const AttnShape& shape, const float* q, const KVShard& kv,
                               float* states, float scale = 0.0f, int threads = 0);

}  // namespace treeattn
