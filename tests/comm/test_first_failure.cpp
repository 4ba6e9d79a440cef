// first_failure (comm.hpp) over in-process ranks: no failure gives "" everywhere; otherwise every
// rank gets the lowest failing rank's message with the count of the others, and a message that
// already names its rank keeps its own prefix.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "treeattn/comm_local.hpp"

namespace treeattn {
namespace {

// Every rank's verdict when the ranks in `failing` fail with `message(rank)`.
std::vector<std::string> verdicts(int ranks, const std::vector<int>& failing,
                                  std::string (*message)(int)) {
  std::vector<std::string> out(static_cast<std::size_t>(ranks));
  const Status st = run_local(ranks, [&](Communicator& comm) -> Status {
    Status mine;
    for (int r : failing)
      if (r == comm.rank()) mine = invalid_argument(message(r));
    auto v = first_failure(comm, mine);
    TREEATTN_RETURN_IF_ERROR(v.status());
    out[static_cast<std::size_t>(comm.rank())] = *v;
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

std::string plain(int r) { return "no GPU here (" + std::to_string(r) + ")"; }
std::string named(int r) { return "rank " + std::to_string(r) + " has no GPU"; }

TEST(FirstFailure, EmptyWhenEveryRankSucceeded) {
  for (int p : {1, 2, 5})
    for (const auto& v : verdicts(p, {}, plain)) EXPECT_EQ(v, "");
}

TEST(FirstFailure, TheLowestFailingRankOnEveryRank) {
  const Status probe = invalid_argument(plain(2));
  for (const auto& v : verdicts(5, {4, 2}, plain))
    EXPECT_EQ(v, "rank 2: " + probe.to_string() + " (and 1 more rank)");
  for (const auto& v : verdicts(4, {1, 2, 3}, plain))
    EXPECT_EQ(v, "rank 1: " + invalid_argument(plain(1)).to_string() + " (and 2 more ranks)");
  for (const auto& v : verdicts(3, {0}, plain))
    EXPECT_EQ(v, "rank 0: " + invalid_argument(plain(0)).to_string());
}

TEST(FirstFailure, AMessageThatNamesItsRankKeepsItsPrefix) {
  for (const auto& v : verdicts(3, {1}, named)) EXPECT_EQ(v, invalid_argument(named(1)).to_string());
}

}  // namespace
}  // namespace treeattn
