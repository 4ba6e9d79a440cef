// StateBuffer: an owning host buffer of one step's packed state records (state.hpp),
// [batch][query][head] x (head_dim + 2) floats, initialised to the empty state.
#pragma once

#include <cstddef>
#include <vector>

#include "treeattn/state.hpp"

namespace treeattn {

class StateBuffer {
 public:
  StateBuffer() = default;
  StateBuffer(std::size_t batch, std::size_t q_len, std::size_t heads, std::size_t head_dim)
      : batch_(batch), q_len_(q_len), heads_(heads), head_dim_(head_dim),
        data_(batch * q_len * heads * state_record_floats(head_dim)) {
    set_empty();
  }
  void set_empty() {
    for (std::size_t i = 0; i < records(); ++i) state_set_empty(record(i), head_dim_);
  }
  std::size_t batch() const { return batch_; }
  std::size_t q_len() const { return q_len_; }
  std::size_t heads() const { return heads_; }
  std::size_t records() const { return batch_ * q_len_ * heads_; }
  std::size_t record_floats() const { return state_record_floats(head_dim_); }
  std::size_t floats() const { return data_.size(); }
  std::size_t bytes() const { return data_.size() * sizeof(float); }
  std::size_t head_dim() const { return head_dim_; }
  float* record(std::size_t i) { return data_.data() + i * record_floats(); }
  const float* record(std::size_t i) const { return data_.data() + i * record_floats(); }
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
