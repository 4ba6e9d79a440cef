// The CUDA executor: executor.hpp's calls on one GPU, without CUDA headers in this interface.
//
// make_cuda_executor() gives an Executor whose memory space is MemorySpace::kDevice: buffers from
// allocate() are cudaMalloc'ed on the executor's device (never managed memory), and every call
// (partial attention, merges, copies) is enqueued on the executor's one stream, in call order.
// to_host() and from_host() wait for the stream (the host buffer is complete, or free to reuse,
// when they return); synchronize() waits for everything enqueued. A stream-ordered communicator
// built on this executor (comm_nccl.hpp) enqueues on the same stream.
//
// The kernels (src/kernels/cuda): a split-KV decode kernel (flash-decoding: many thread blocks
// per sequence, each a chunk of tokens, then a merge kernel that folds the chunks with state.hpp's
// state_merge) for K/V in f32, f16, bf16, fp8 (E4M3) and int8 with per-token scales, head dims
// 64 and 128 (others: kUnsupported naming these), GQA reading each KV head once for up to 8 query
// rows, q_len >= 1 with the causal rule of shape.hpp, ragged batches. K and V must be 16-byte
// aligned (8 for fp8 / int8) with token, head and batch strides that keep every token's row
// aligned; KVShard::memory must be kDevice. DecodeOptions: scale as on the CPU; chunk_tokens > 0
// fixes the split length, so that every device computes the same bits (0: a plan sized to this
// device's SM count, the same bits only on devices of the same kind; ring-kv, whose ranks must
// agree on each shard's partial, fixes it); threads and isa are ignored.
//
// CUDA graphs: every call except allocate, to_host, from_host and synchronize is a stream
// operation, so a decode step (partial, merges, normalize; NCCL collectives too) can be captured
// with cuda_capture_begin / cuda_capture_end and replayed. The graph replays the step with the
// lengths it was captured with (they travel in kernel parameters), so capture again after the
// cache grows. Run the step once before capturing: partial() grows its split workspace and its
// ticket counters with cudaMalloc, which it refuses (kUnsupported, leaving both as they were)
// while the stream is capturing. When they grow later, the old ones are kept while a graph of
// the executor lives (a graph keeps the addresses it was captured with), and freed when the last
// one is destroyed; destroy the graphs before their executor. A graph with NCCL collectives is
// not watched by the communicator's watchdog while it replays: wait for it with the
// communicator's synchronize(), which gives up after the communicator's timeout and aborts it
// (comm_nccl.hpp), rather than the executor's, which waits as long as the stream runs.
//
// Builds without CUDA (TREEATTN_WITH_CUDA=OFF, or AUTO without nvcc) keep these functions; they
// return kUnsupported saying that the build has no CUDA.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "treeattn/executor.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

struct CudaExecutorOptions {
  // The CUDA device; -1 picks local_rank % device_count, where local_rank comes from the launcher's
  // environment (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID, LOCAL_RANK; 0 when
  // none is set), so one rank per GPU works under mpirun and srun without configuration.
  int device = -1;
  // A cudaStream_t to enqueue on instead of a stream the executor creates (and destroys); it must
  // belong to `device` and outlive the executor. For integration with a framework's stream.
  void* stream = nullptr;
};

// Whether this build has the CUDA executor (not whether a GPU is present).
bool cuda_built();
// Number of CUDA devices visible to this process: 0 when there is none or no usable driver
// (the message of the error that says why is in *why when why is not null).
int cuda_device_count(std::string* why = nullptr);

Result<std::unique_ptr<Executor>> make_cuda_executor(const CudaExecutorOptions& options = {});

struct CudaDeviceInfo {
  int device = 0;
  std::string name;  // "NVIDIA H200"
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  std::size_t memory_bytes = 0;
  int driver_version = 0, runtime_version = 0;  // 13000 = 13.0
};
// The device of an executor made by make_cuda_executor (kInvalidArgument for any other executor).
Result<CudaDeviceInfo> cuda_device_info(const Executor& executor);
// Its stream, as a cudaStream_t (kInvalidArgument for any other executor).
Result<void*> cuda_stream(const Executor& executor);

// A captured sequence of stream operations of one CUDA executor, replayable on its stream.
class CudaGraph {
 public:
  virtual ~CudaGraph() = default;
  // Enqueues one replay on the executor's stream (complete it with synchronize()).
  virtual Status replay() = 0;
};
// Starts capturing the executor's stream (thread-local capture mode: other threads may keep
// using CUDA). Every call on the executor until cuda_capture_end is recorded, not run.
Status cuda_capture_begin(Executor& executor);
// Ends the capture and instantiates the graph. On a failed capture the stream is back to normal.
Result<std::unique_ptr<CudaGraph>> cuda_capture_end(Executor& executor);

}  // namespace treeattn
