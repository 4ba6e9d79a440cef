// The per-layer merge of the ranks' partial states in the serving engine (engine.hpp).
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/status.hpp"

namespace treeattn::engine {

enum class MergeKind : uint8_t { kTree, kAllreduce, kAllgather };
Result<MergeKind> parse_merge(std::string_view name);  // tree | allreduce | allgather
const char* merge_name(MergeKind kind);

// Merges n records of head_dim + 2 floats over every rank of comm, in place; afterwards every
// rank holds the merged records, bit-identical on all ranks.
//   kTree       binomial tree to rank 0 over point-to-point messages (round k: rank r with
//               r mod 2^(k+1) == 2^k sends to r - 2^k, which merges its records (+) the
//               received ones), then a broadcast. The association of every record depends on
//               the rank count only, never on n: batch invariant. log2(p) rounds, each rank
//               sends S at most once plus the broadcast. At two ranks it is the allreduce
//               (one exchange; the same bits: one exactly commutative merge per record).
//   kAllreduce  Communicator::allreduce_states (MPI_Allreduce with a user-defined operation).
//   kAllgather  all-gather every rank's records, merge them in rank order 0..p-1 locally.
// scratch grows as needed and is kept between calls.
Status merge_states(Communicator& comm, MergeKind kind, float* records, std::size_t n,
                    std::size_t head_dim, std::vector<float>& scratch);

// merge_states without communication: parts[r] holds the n records rank r would contribute,
// out receives the records every rank would hold afterwards, the same bits (the same
// association of every record: kAllgather folds in rank order, kTree runs the binomial tree's
// rounds, and at two ranks every kind is the one exactly commutative merge). kAllreduce at more
// than two ranks has no local twin (MPI chooses its association): kUnsupported. scratch grows
// as needed. A rank that already holds every rank's states (the engine's K/V exchange) gets the
// merged records the collective would have given it.
Status merge_states_local(MergeKind kind, int p, const float* const* parts, std::size_t n,
                          std::size_t head_dim, float* out, std::vector<float>& scratch);

}  // namespace treeattn::engine
