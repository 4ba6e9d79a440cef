// first_failure (comm.hpp): one verdict, the same on every rank, about a step that may have
// failed on some ranks only.
#include <cstdio>
#include <string>

#include "treeattn/comm.hpp"

namespace treeattn {

Result<std::string> first_failure(Communicator& world, const Status& mine) {
  const int P = world.size(), me = world.rank();
  float lowest = mine.is_ok() ? 0.0f : static_cast<float>(P - me);  // max = lowest failing rank
  TREEATTN_RETURN_IF_ERROR(world.allreduce(&lowest, 1, ReduceOp::kMax));
  if (lowest == 0.0f) return std::string();
  float failed = mine.is_ok() ? 0.0f : 1.0f;
  TREEATTN_RETURN_IF_ERROR(world.allreduce(&failed, 1, ReduceOp::kSum));
  const int who = P - static_cast<int>(lowest);
  char text[1024] = {};
  if (me == who) {
    // Library messages that already name the rank keep their own prefix.
    const std::string m = mine.message().rfind("rank ", 0) == 0
                              ? mine.to_string()
                              : "rank " + std::to_string(me) + ": " + mine.to_string();
    std::snprintf(text, sizeof(text), "%s", m.c_str());
  }
  TREEATTN_RETURN_IF_ERROR(world.broadcast(text, sizeof(text), who));
  std::string out = text;
  const int others = static_cast<int>(failed) - 1;
  if (others > 0)
    out += " (and " + std::to_string(others) + " more rank" + (others == 1 ? "" : "s") + ")";
  return out;
}

}  // namespace treeattn
