// comm_nccl.hpp in a build without NCCL (no CUDA, or NCCL not found at configure time): the same
// functions, saying that this build has no NCCL backend.
#include "treeattn/comm_nccl.hpp"

namespace treeattn {

bool nccl_built() { return false; }

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap, Executor&) {
  return unsupported("rank " + std::to_string(bootstrap.world_rank()) +
                     ": this treeattn was built without NCCL (configure with CUDA and NCCL "
                     "present; see TREEATTN_WITH_CUDA and TREEATTN_NCCL_ROOT)");
}

}  // namespace treeattn
