// The decode session's benchmark and check surface (measure.hpp): the calls DecodeSession keeps
// private, reached through its friend SessionAccess so that they stay out of the class's public
// surface (what a model sees) while the benchmark driver, the tests and the Python module
// still compare several strategies on the very same shards.
#include <cstddef>
#include <string>

#include "treeattn/measure.hpp"
#include "treeattn/session.hpp"

namespace treeattn::measure {

struct SessionAccess {
  static Result<int> add_strategy(DecodeSession& s, const std::string& name,
                                  const StrategyOptions& options) {
    return s.add_strategy(name, options);
  }
  static Status attend_states(DecodeSession& s, int layer, const float* q, StateBuffer& states,
                              int strategy) {
    return s.attend_states(layer, q, states, strategy);
  }
  static int strategy_count(const DecodeSession& s) { return s.strategy_count(); }
  static Strategy& strategy(const DecodeSession& s, int index) {
    return *s.strategies_[static_cast<std::size_t>(index)];
  }
  static bool delivers_result(const DecodeSession& s, int index) {
    return s.delivers_result(index);
  }
};

Result<int> add_strategy(DecodeSession& session, const std::string& name,
                         const StrategyOptions& options) {
  return SessionAccess::add_strategy(session, name, options);
}

Status attend_states(DecodeSession& session, int layer, const float* q, StateBuffer& states,
                     int strategy) {
  return SessionAccess::attend_states(session, layer, q, states, strategy);
}

int strategy_count(const DecodeSession& session) { return SessionAccess::strategy_count(session); }

Strategy& strategy_of(const DecodeSession& session, int index) {
  return SessionAccess::strategy(session, index);
}

bool delivers_result(const DecodeSession& session, int index) {
  return SessionAccess::delivers_result(session, index);
}

}  // namespace treeattn::measure
