// merge_states: see merge.hpp.
#include "engine/merge.hpp"

#include <algorithm>
#include <string>

#include "treeattn/state.hpp"

namespace treeattn::engine {

// The engine's merge methods are not strategies (strategy.hpp): they merge the states of a
// paged batch each layer and share two of the strategies' words (tree, allgather) for the
// same merges. They are named here, once, and parsed from this table.
Result<MergeKind> parse_merge(std::string_view name) {
  for (MergeKind k : {MergeKind::kTree, MergeKind::kAllreduce, MergeKind::kAllgather})
    if (std::string_view(merge_name(k)) == name) return k;
  return invalid_argument("unknown engine merge '" + std::string(name) +
                          "' (known: tree, allreduce, allgather)");
}

const char* merge_name(MergeKind kind) {
  switch (kind) {
    case MergeKind::kTree: return "tree";
    case MergeKind::kAllreduce: return "allreduce";
    case MergeKind::kAllgather: return "allgather";
  }
  return "?";
}

Status merge_states(Communicator& comm, MergeKind kind, float* records, std::size_t n,
                    std::size_t head_dim, std::vector<float>& scratch) {
  const int p = comm.size(), r = comm.rank();
  if (p == 1 || n == 0) return Status::ok();
  const std::size_t rec = head_dim + 2;
  const std::size_t floats = n * rec;
  const std::size_t bytes = floats * sizeof(float);
  switch (kind) {
    case MergeKind::kAllreduce:
      return comm.allreduce_states(records, n, head_dim);
    case MergeKind::kAllgather: {
      if (scratch.size() < floats * static_cast<std::size_t>(p))
        scratch.resize(floats * static_cast<std::size_t>(p));
      TREEATTN_RETURN_IF_ERROR(comm.allgather(records, bytes, scratch.data()));
      // Rank 0's records, then (+) rank 1's, ... in rank order.
      for (std::size_t i = 0; i < floats; ++i) records[i] = scratch[i];
      for (int q = 1; q < p; ++q)
        state_merge_n(records, scratch.data() + static_cast<std::size_t>(q) * floats, n, head_dim);
      return Status::ok();
    }
    case MergeKind::kTree: {
      // Two ranks: the tree is one merge of rank 0's and rank 1's records, which the allreduce
      // computes in one exchange with the same bits (the merge is exactly commutative, and each
      // record is merged once whatever the algorithm or segmentation).
      if (p == 2) return comm.allreduce_states(records, n, head_dim);
      if (scratch.size() < floats) scratch.resize(floats);
      for (int dist = 1; dist < p; dist *= 2) {
        if (r % (2 * dist) == dist) {  // send up and leave the reduction
          auto req = comm.isend(records, bytes, r - dist, 0);
          TREEATTN_RETURN_IF_ERROR(req.status());
          const CommRequest reqs[1] = {*req};
          TREEATTN_RETURN_IF_ERROR(comm.wait_all(reqs));
          break;
        }
        if (r % (2 * dist) == 0 && r + dist < p) {
          auto req = comm.irecv(scratch.data(), bytes, r + dist, 0);
          TREEATTN_RETURN_IF_ERROR(req.status());
          const CommRequest reqs[1] = {*req};
          TREEATTN_RETURN_IF_ERROR(comm.wait_all(reqs));
          state_merge_n(records, scratch.data(), n, head_dim);  // lower ranks on the left
        }
      }
      return comm.broadcast(records, bytes, 0);
    }
  }
  return internal_error("merge_states: unknown kind");
}

Status merge_states_local(MergeKind kind, int p, const float* const* parts, std::size_t n,
                          std::size_t head_dim, float* out, std::vector<float>& scratch) {
  const std::size_t floats = n * (head_dim + 2);
  if (p < 1) return invalid_argument("merge_states_local: no parts");
  std::copy(parts[0], parts[0] + floats, out);
  if (p == 1 || n == 0) return Status::ok();
  if (p == 2 || kind == MergeKind::kAllgather) {
    for (int q = 1; q < p; ++q) state_merge_n(out, parts[q], n, head_dim);
    return Status::ok();
  }
  if (kind != MergeKind::kTree)
    return unsupported("merge_states_local: the allreduce merge at " + std::to_string(p) +
                       " ranks has no local twin (MPI chooses its association)");
  // The tree's rounds: after round dist, the records of rank r (r mod 2 dist == 0) hold the
  // merge of ranks [r, r + 2 dist); a receiver merges its own records (+) the sender's.
  if (scratch.size() < floats * static_cast<std::size_t>(p))
    scratch.resize(floats * static_cast<std::size_t>(p));
  auto at = [&](int r) { return scratch.data() + static_cast<std::size_t>(r) * floats; };
  for (int r = 0; r < p; ++r) std::copy(parts[r], parts[r] + floats, at(r));
  for (int dist = 1; dist < p; dist *= 2)
    for (int r = 0; r + dist < p; r += 2 * dist) state_merge_n(at(r), at(r + dist), n, head_dim);
  std::copy(at(0), at(0) + floats, out);
  return Status::ok();
}

}  // namespace treeattn::engine
