// The partial attention state: what one shard of the KV cache knows about one query row.
//
// For one (batch row b, query position i, query head h) and a set S of keys the query may see,
// with scaled logits s_j = scale * <q, k_j> (natural-log units):
//
//   m = max_{j in S} s_j                  (-inf when S is empty)
//   l = sum_{j in S} exp(s_j - m)         (0 when S is empty; 1 <= l <= |S| otherwise)
//   o = sum_{j in S} exp(s_j - m) * v_j   (UNNORMALIZED; the zero vector when S is empty)
//
// The attention output over S is o / l and its log-sum-exp is m + log(l). Keeping o
// unnormalized makes the merge two scalings and an add, and it makes the exact fixture exact:
// with all logits equal, l counts tokens and o sums values with no rounding at all.
//
// Merging two states for disjoint key sets gives the state of their union:
//
//   m = max(ma, mb);  a = exp(ma - m);  b = exp(mb - m)
//   l = a * la + b * lb;  o = a * oa + b * ob
//
// The empty state E = (-inf, 0, 0) is the identity: merge(E, x) == x and merge(x, E) == x
// bit for bit, and merge(E, E) == E with no NaN (the -inf - -inf case never evaluates).
// Merge is commutative exactly and associative up to float rounding. A NaN in m, l or o of
// either side propagates to the result; nothing produces NaN from non-NaN finite inputs.
//
// m is never -0: where the merge picks m = 0 it stores +0, because max(+0, -0) would otherwise
// keep the sign of whichever operand came second and merge(a, b) and merge(b, a) would differ in
// one bit. With that fold the merge is commutative bit for bit in every backend (MPI's
// user-defined op, the in-process communicator, a device merge kernel), since all of them call
// state_merge.
//
// On the wire and in buffers a state is one packed float32 record of D + 2 floats:
// [m, l, o_0, ..., o_{D-1}] (the offsets kStateM, kStateL, kStateO; read and write them through
// state_m / state_l / state_o). Records for a step are ordered [batch][query][head].
//
// Everything here is plain arithmetic on caller memory, callable from host code and, compiled by
// nvcc, from device code (TREEATTN_HD). The owning host buffer is StateBuffer (state_buffer.hpp).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

// Host and device: empty in host-only builds, __host__ __device__ under nvcc.
#if defined(__CUDACC__)
#define TREEATTN_HD __host__ __device__
#else
#define TREEATTN_HD
#endif

namespace treeattn {

inline constexpr double kLog2e = 1.4426950408889634;
inline constexpr double kLn2 = 0.6931471805599453;

// Offsets of the fields in a packed record.
inline constexpr std::size_t kStateM = 0;  // running max of the logits
inline constexpr std::size_t kStateL = 1;  // sum of exp(s - m)
inline constexpr std::size_t kStateO = 2;  // first of the head_dim unnormalized output values

// Number of floats in one packed state record for head dim d.
TREEATTN_HD constexpr std::size_t state_record_floats(std::size_t head_dim) {
  return head_dim + 2;
}

template <class T>
TREEATTN_HD inline T state_neg_inf() {
  return static_cast<T>(-INFINITY);
}

// Named access to the fields of one record.
template <class T>
TREEATTN_HD inline T& state_m(T* rec) {
  return rec[kStateM];
}
template <class T>
TREEATTN_HD inline const T& state_m(const T* rec) {
  return rec[kStateM];
}
template <class T>
TREEATTN_HD inline T& state_l(T* rec) {
  return rec[kStateL];
}
template <class T>
TREEATTN_HD inline const T& state_l(const T* rec) {
  return rec[kStateL];
}
template <class T>
TREEATTN_HD inline T* state_o(T* rec) {
  return rec + kStateO;
}
template <class T>
TREEATTN_HD inline const T* state_o(const T* rec) {
  return rec + kStateO;
}

template <class T>
TREEATTN_HD inline void state_set_empty(T* rec, std::size_t d) {
  state_m(rec) = state_neg_inf<T>();
  state_l(rec) = T(0);
  T* o = state_o(rec);
  for (std::size_t i = 0; i < d; ++i) o[i] = T(0);
}

template <class T>
TREEATTN_HD inline bool state_is_empty(const T* rec) {
  return state_m(rec) == state_neg_inf<T>();
}

// acc <- acc (+) x, for one record. See the file comment for the algebra and the -0 fold.
template <class T>
TREEATTN_HD inline void state_merge(T* acc, const T* x, std::size_t d) {
  const T ma = state_m(acc);
  const T mb = state_m(x);
  if (mb == state_neg_inf<T>()) return;  // x is empty: identity (also covers empty with empty)
  if (ma == state_neg_inf<T>()) {        // acc is empty: the result is x, bit for bit
    for (std::size_t i = 0; i < d + 2; ++i) acc[i] = x[i];
    return;
  }
  // Both non-empty (or NaN). NaN in either m must win, so no std::max / fmax here.
  T m = (std::isnan(ma) || std::isnan(mb)) ? static_cast<T>(NAN) : (ma > mb ? ma : mb);
  if (m == T(0)) m = T(0);  // -0 -> +0: commutative bit for bit
  const T sa = std::exp(ma - m);
  const T sb = std::exp(mb - m);
  state_m(acc) = m;
  state_l(acc) = sa * state_l(acc) + sb * state_l(x);
  T* __restrict oa = state_o(acc);
  const T* __restrict ob = state_o(x);
  for (std::size_t i = 0; i < d; ++i) oa[i] = sa * oa[i] + sb * ob[i];
}

// Merge n consecutive records of x into n consecutive records of acc.
template <class T>
TREEATTN_HD inline void state_merge_n(T* acc, const T* x, std::size_t n, std::size_t d) {
  const std::size_t r = d + 2;
  for (std::size_t i = 0; i < n; ++i) state_merge(acc + i * r, x + i * r, d);
}

// Natural-log log-sum-exp of the record: m + log(l); -inf for the empty state.
template <class T>
TREEATTN_HD inline T state_lse(const T* rec) {
  if (state_l(rec) == T(0) && !std::isnan(state_m(rec))) return state_neg_inf<T>();
  return state_m(rec) + std::log(state_l(rec));
}

// out[0..d) = o / l and *lse = m + log(l). The empty state gives out = 0 and lse = -inf.
template <class T, class U>
TREEATTN_HD inline void state_normalize(const T* rec, std::size_t d, U* out, U* lse) {
  const T l = state_l(rec);
  if (l == T(0) && !std::isnan(state_m(rec))) {
    for (std::size_t i = 0; i < d; ++i) out[i] = U(0);
    if (lse) *lse = state_neg_inf<U>();
    return;
  }
  const T* o = state_o(rec);
  for (std::size_t i = 0; i < d; ++i) out[i] = static_cast<U>(o[i] / l);
  if (lse) *lse = static_cast<U>(state_m(rec) + std::log(l));
}

// A state from a normalized output and its natural-log LSE (what FlashAttention-style kernels
// return): m = lse, l = 1, o = out. lse = -inf gives the empty state.
template <class T>
TREEATTN_HD inline void state_from_output_lse(const T* out, T lse, std::size_t d, T* rec) {
  if (lse == state_neg_inf<T>()) {
    state_set_empty(rec, d);
    return;
  }
  state_m(rec) = lse;
  state_l(rec) = T(1);
  T* o = state_o(rec);
  for (std::size_t i = 0; i < d; ++i) o[i] = out[i];
}

// ---- the paper's sum form (tree-paper, tree2: MAX and SUM collectives only) ------------------
//
// With M = the maximum over ranks of each record's LSE, a rank's record becomes the weight
// w = exp(lse - M) (0 for an empty record or M = -inf) and the weighted normalized output
// w * o / l. Summing both over ranks gives the merged state (M, sum w, sum w o/l).

// num[0..d) = w * o / l and *den = w for one record, given the global max lse M.
template <class T>
TREEATTN_HD inline void state_to_sum_form(const T* rec, T max_lse, std::size_t d, T* num, T* den) {
  const T mine = state_lse(rec);
  const T w = (mine == state_neg_inf<T>() || max_lse == state_neg_inf<T>())
                  ? T(0)
                  : std::exp(mine - max_lse);
  const T l = state_l(rec);
  const T* o = state_o(rec);
  for (std::size_t i = 0; i < d; ++i) num[i] = w == T(0) ? T(0) : o[i] / l * w;
  *den = w;
}

// The merged record from the summed form: (M, den, num), or empty when M = -inf or den = 0.
template <class T>
TREEATTN_HD inline void state_from_sum_form(T max_lse, const T* num, T den, std::size_t d,
                                            T* rec) {
  if (max_lse == state_neg_inf<T>() || den == T(0)) {
    state_set_empty(rec, d);
    return;
  }
  state_m(rec) = max_lse;
  state_l(rec) = den;
  T* o = state_o(rec);
  for (std::size_t i = 0; i < d; ++i) o[i] = num[i];
}

// Converters at the boundary: some kernels in the field report LSE in base 2 (log2-sum-exp2
// of logits pre-multiplied by log2(e)). Infinities and NaN pass through unchanged.
TREEATTN_HD inline float lse_to_base2(float lse_e) { return static_cast<float>(lse_e * kLog2e); }
TREEATTN_HD inline float lse_from_base2(float lse_2) { return static_cast<float>(lse_2 * kLn2); }
TREEATTN_HD inline double lse_to_base2(double lse_e) { return lse_e * kLog2e; }
TREEATTN_HD inline double lse_from_base2(double lse_2) { return lse_2 * kLn2; }

}  // namespace treeattn
