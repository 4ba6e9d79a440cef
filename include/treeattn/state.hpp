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
// On the wire and in buffers a state is one packed float32 record of D + 2 floats:
// [m, l, o_0, ..., o_{D-1}]. Records for a step are ordered [batch][query][head].
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace treeattn {

inline constexpr double kLog2e = 1.4426950408889634;
inline constexpr double kLn2 = 0.6931471805599453;

// Number of floats in one packed state record for head dim d.
constexpr std::size_t state_record_floats(std::size_t head_dim) { return head_dim + 2; }

template <class T>
inline void state_set_empty(T* rec, std::size_t d) {
  rec[0] = -std::numeric_limits<T>::infinity();
  for (std::size_t i = 1; i < d + 2; ++i) rec[i] = T(0);
}

template <class T>
inline bool state_is_empty(const T* rec) {
  return rec[0] == -std::numeric_limits<T>::infinity();
}

// acc <- acc (+) x, for one record. See the file comment for the algebra.
template <class T>
inline void state_merge(T* acc, const T* x, std::size_t d) {
  const T ma = acc[0];
  const T mb = x[0];
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  if (mb == kNegInf) return;  // x is empty: identity (also covers empty with empty)
  if (ma == kNegInf) {        // acc is empty: the result is x, bit for bit
    for (std::size_t i = 0; i < d + 2; ++i) acc[i] = x[i];
    return;
  }
  // Both non-empty (or NaN). NaN in either m must win, so no std::max / fmax here.
  const T m = (std::isnan(ma) || std::isnan(mb)) ? std::numeric_limits<T>::quiet_NaN()
                                                  : (ma > mb ? ma : mb);
  const T sa = std::exp(ma - m);
  const T sb = std::exp(mb - m);
  acc[0] = m;
  acc[1] = sa * acc[1] + sb * x[1];
  T* __restrict oa = acc + 2;
  const T* __restrict ob = x + 2;
  for (std::size_t i = 0; i < d; ++i) oa[i] = sa * oa[i] + sb * ob[i];
}

// Merge n consecutive records of x into n consecutive records of acc.
template <class T>
inline void state_merge_n(T* acc, const T* x, std::size_t n, std::size_t d) {
  const std::size_t r = d + 2;
  for (std::size_t i = 0; i < n; ++i) state_merge(acc + i * r, x + i * r, d);
}

// Natural-log log-sum-exp of the record: m + log(l); -inf for the empty state.
template <class T>
inline T state_lse(const T* rec) {
  if (rec[1] == T(0) && !std::isnan(rec[0])) return -std::numeric_limits<T>::infinity();
  return rec[0] + std::log(rec[1]);
}

// out[0..d) = o / l and *lse = m + log(l). The empty state gives out = 0 and lse = -inf.
template <class T, class U>
inline void state_normalize(const T* rec, std::size_t d, U* out, U* lse) {
  const T l = rec[1];
  if (l == T(0) && !std::isnan(rec[0])) {
    for (std::size_t i = 0; i < d; ++i) out[i] = U(0);
    if (lse) *lse = -std::numeric_limits<U>::infinity();
    return;
  }
  for (std::size_t i = 0; i < d; ++i) out[i] = static_cast<U>(rec[2 + i] / l);
  if (lse) *lse = static_cast<U>(rec[0] + std::log(l));
}

// A state from a normalized output and its natural-log LSE (what FlashAttention-style kernels
// return): m = lse, l = 1, o = out. lse = -inf gives the empty state.
template <class T>
inline void state_from_output_lse(const T* out, T lse, std::size_t d, T* rec) {
  if (lse == -std::numeric_limits<T>::infinity()) {
    state_set_empty(rec, d);
    return;
  }
  rec[0] = lse;
  rec[1] = T(1);
  for (std::size_t i = 0; i < d; ++i) rec[2 + i] = out[i];
}

// Converters at the boundary: some kernels in the field report LSE in base 2 (log2-sum-exp2
// of logits pre-multiplied by log2(e)). Infinities and NaN pass through unchanged.
inline float lse_to_base2(float lse_e) { return static_cast<float>(lse_e * kLog2e); }
inline float lse_from_base2(float lse_2) { return static_cast<float>(lse_2 * kLn2); }
inline double lse_to_base2(double lse_e) { return lse_e * kLog2e; }
inline double lse_from_base2(double lse_2) { return lse_2 * kLn2; }

// A buffer of packed records for a whole step: [batch][query][head] x (head_dim + 2) floats.
class StateBuffer {
 public:
  StateBuffer() = default;
  StateBuffer(std::size_t batch, std::size_t q_len, std::size_t heads, std::size_t head_dim)
      : batch_(batch), q_len_(q_len), heads_(heads), head_dim_(head_dim),
        data_(batch * q_len * heads * (head_dim + 2)) {
    set_empty();
  }
  void set_empty() {
    for (std::size_t i = 0; i < records(); ++i) state_set_empty(record(i), head_dim_);
  }
  std::size_t records() const { return batch_ * q_len_ * heads_; }
  std::size_t record_floats() const { return head_dim_ + 2; }
  std::size_t floats() const { return data_.size(); }
  std::size_t bytes() const { return data_.size() * sizeof(float); }
  std::size_t head_dim() const { return head_dim_; }
  float* record(std::size_t i) { return data_.data() + i * (head_dim_ + 2); }
  const float* record(std::size_t i) const { return data_.data() + i * (head_dim_ + 2); }
  float* record(std::size_t b, std::size_t q, std::size_t h) {
    return record((b * q_len_ + q) * heads_ + h);
  }
  const float* record(std::size_t b, std::size_t q, std::size_t h) const {
    return record((b * q_len_ + q) * heads_ + h);
  }
  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }

 private:
  std::size_t batch_ = 0, q_len_ = 0, heads_ = 0, head_dim_ = 0;
  std::vector<float> data_;
};

}  // namespace treeattn
