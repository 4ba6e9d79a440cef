// The CUDA executor (executor_cuda.hpp): executor.hpp's calls as kernels and copies on one
// stream of one device. Host code only; the kernels are launched through cuda_kernels.hpp.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/cuda_presence.hpp"
#include "kernels/cuda/decode_geometry.hpp"
#include "kernels/cuda/device_pointers.hpp"
#include "kernels/cuda/graph_buffers.hpp"
#include "treeattn/executor_cuda.hpp"
#include "treeattn/state.hpp"

#ifndef TREEATTN_CUDA_ARCHS
#define TREEATTN_CUDA_ARCHS "?"
#endif

namespace treeattn {
namespace {

std::string cuda_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// Makes `device` current on the calling thread (and leaves it current: restoring the previous
// device would create a context on device 0 in every process of a one-GPU-per-rank job).
cudaError_t use_device(int device) {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur == device) return cudaSuccess;
  return cudaSetDevice(device);
}

// The node-local rank the launcher gave this process, or 0.
int env_local_rank() {
  for (const char* name :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && r >= 0 && r < (1L << 20)) return static_cast<int>(r);
    }
  }
  return 0;
}

constexpr DType kCudaDtypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kFP8, DType::kInt8};
constexpr int kRowTemplates[] = {1, 2, 4, 8};
constexpr std::size_t kNumHeadDims = std::size(gpu::kCudaHeadDims);

std::string supported_cuda_head_dims() {
  std::string s;
  for (int d : gpu::kCudaHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

class CudaExecutor final : public Executor {
 public:
  static Result<std::unique_ptr<Executor>> create(const CudaExecutorOptions& o);
  ~CudaExecutor() override {
    workspace_.reset();
    tickets_.reset();
    owned_ = gpu::GraphBuffers<Buffer>();
    (void)use_device(device_);
    if (owns_stream_ && stream_) (void)cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }
  MemorySpace memory() const override { return MemorySpace::kDevice; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  const cudaDeviceProp& props() const { return props_; }

  // ---- memory ----------------------------------------------------------------------------------
  Result<Buffer> allocate(std::size_t bytes) override {
    if (bytes == 0) return Buffer();
    if (capturing())
      return unsupported(who_ + ": allocate(" + std::to_string(bytes) +
                         " bytes) while its stream is being captured into a CUDA graph; run the "
                         "step once before capturing so that every buffer exists");
    TREEATTN_RETURN_IF_ERROR(check(use_device(device_), "cudaSetDevice"));
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      std::size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      return Status(Code::kOutOfMemory, who_ + ": cannot allocate " + std::to_string(bytes) +
                                            " bytes (" + std::to_string(free_b) + " of " +
                                            std::to_string(total_b) + " bytes free)");
    }
    TREEATTN_RETURN_IF_ERROR(check(e, "cudaMalloc(" + std::to_string(bytes) + ")"));
    pointers_.allocated(p, bytes);
    return Buffer(this, p, bytes);
  }
  void release(void* data, std::size_t) noexcept override {
    pointers_.freed(data);  // before the memory can be another allocation's
    (void)use_device(device_);
    (void)cudaFree(data);
  }
  Status copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_ptr(dst, "copy destination"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(src, "copy source"));
    return check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpyAsync device to device");
  }
  Status to_host(void* host_dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(no_capture("to_host"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(src, "to_host source"));
    TREEATTN_RETURN_IF_ERROR(check(
        cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "to_host copy"));
    return synchronize();
  }
  Status from_host(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(no_capture("from_host"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(dst, "from_host destination"));
    TREEATTN_RETURN_IF_ERROR(check(
        cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "from_host copy"));
    return synchronize();
  }

  // ---- attention ------------------------------------------------------------------------------
  Status partial(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                 const DecodeOptions& options) override {
    TREEATTN_RETURN_IF_ERROR(check_decode(shape, q, kv, states, options, "partial"));
    int64_t max_visible = 0;
    for (std::size_t b = 0; b < kv.len.size(); ++b)
      max_visible =
          std::max(max_visible, gpu::visible_count(kv.len[b], kv.pos_start[b], kv.total_len[b],
                                                   kv.pos_stride, shape.q_len, shape.q_len - 1));
    const gpu::RowSplit rows = gpu::split_rows(kv.dtype, shape.group(), shape.q_len);
    const gpu::SplitPlan plan =
        gpu::plan_decode(kv.dtype, shape.batch, shape.kv_heads, shape.group(), shape.q_len,
                         max_visible, options.chunk_tokens,
                         wave_slots(kv.dtype, shape.head_dim, rows.rows_tpl), max_split_slots(kv));
    // With no visible slot the kernel addresses none (and nothing checked the strides).
    if (max_visible > 0) TREEATTN_RETURN_IF_ERROR(check_split_slots(kv, plan.chunk, "partial"));
    const int64_t rec_floats = shape.head_dim + 2;
    const int64_t records = shape.batch * shape.q_len * shape.heads;
    if (plan.splits == 1)  // the block's record is the final state
      return launch(shape, q, kv, plan, states, records * rec_floats, nullptr, options);
    // The splits' records in the workspace, merged into states by the last block of each item
    // (decode_kernel.cuh); its ticket counters are 0 between launches.
    const auto bytes = static_cast<std::size_t>(plan.splits * records * rec_floats) * sizeof(float);
    if (workspace_.bytes() < bytes) {
      // Before anything is freed: a capture cannot allocate, and the graphs captured before
      // keep the old workspace (graph_buffers.hpp).
      TREEATTN_RETURN_IF_ERROR(no_capture_growth("the split workspace of partial", bytes));
      const Status st = owned_.replace(workspace_, [&] { return allocate(bytes); });
      if (!st.is_ok())
        return Status(st.code(), st.message() + " (split workspace of partial: " +
                                     std::to_string(plan.splits) + " splits of " +
                                     std::to_string(plan.chunk) + " tokens)");
    }
    const int64_t nb = std::min<int64_t>(shape.batch, gpu::kMaxBatchPerLaunch);
    TREEATTN_RETURN_IF_ERROR(
        reserve_tickets(gpu::tickets_per_launch(nb, shape.kv_heads, plan.rows.row_groups)));
    return launch(shape, q, kv, plan, workspace_.as<float>(), records * rec_floats, states,
                  options);
  }

  Status partial_chunks(const AttnShape& shape, const float* q, const KVShard& kv,
                        int64_t chunk_tokens, float* states,
                        const DecodeOptions& options) override {
    if (chunk_tokens < 1)
      return invalid_argument(who_ + ": partial_chunks: chunk_tokens must be >= 1, got " +
                              std::to_string(chunk_tokens));
    TREEATTN_RETURN_IF_ERROR(check_decode(shape, q, kv, states, options, "partial_chunks"));
    int64_t longest = 0;
    for (int64_t n : kv.len) longest = std::max(longest, n);
    if (longest == 0) return Status::ok();  // no chunks, nothing written (as on the CPU)
    const gpu::SplitPlan plan = gpu::plan_chunks(kv.dtype, shape.batch, shape.kv_heads,
                                                 shape.group(), shape.q_len, longest, chunk_tokens);
    TREEATTN_RETURN_IF_ERROR(check_split_slots(kv, plan.chunk, "partial_chunks"));
    const int64_t per_chunk = shape.batch * shape.q_len * shape.heads * (shape.head_dim + 2);
    return launch(shape, q, kv, plan, states, per_chunk, nullptr, options);
  }

  // ---- state algebra ---------------------------------------------------------------------------
  Status set_empty(float* states, std::size_t n, std::size_t d) override {
    if (n == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_ptr(states, "set_empty states"));
    return check(gpu::launch_set_empty(states, i64(n), i64(d), stream_), "set_empty kernel");
  }
  Status merge(float* acc, const float* x, std::size_t n, std::size_t d) override {
    if (n == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_dim(d, "merge"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(acc, "merge accumulator"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(x, "merge input"));
    return check(gpu::launch_merge(acc, x, 1, 0, i64(n), i64(d), acc, stream_), "merge kernel");
  }
  Status merge_ordered(const float* parts, std::size_t count, std::size_t part_stride,
                       std::size_t n, std::size_t d, float* out) override {
    if (n == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_dim(d, "merge_ordered"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(out, "merge_ordered output"));
    if (count > 0) TREEATTN_RETURN_IF_ERROR(check_ptr(parts, "merge_ordered parts"));
    return check(gpu::launch_merge(nullptr, parts, i64(count), i64(part_stride), i64(n), i64(d),
                                   out, stream_),
                 "merge kernel (merge_ordered)");
  }
  Status lse(const float* states, std::size_t n, std::size_t d, float* out) override {
    if (n == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_ptr(states, "lse states"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(out, "lse output"));
    return check(gpu::launch_lse(states, i64(n), i64(d), out, stream_), "lse kernel");
  }
  Status to_sum_form(const float* states, const float* max_lse, std::size_t n, std::size_t d,
                     float* num, std::size_t num_stride, float* den) override {
    if (n == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_dim(d, "to_sum_form"));
    if (num_stride < d + (den ? 0 : 1))
      return invalid_argument(who_ + ": to_sum_form: num_stride " + std::to_string(num_stride) +
                              " is too small for head_dim " + std::to_string(d) +
                              (den ? "" : " plus the fused weight"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(states, "to_sum_form states"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(max_lse, "to_sum_form max_lse"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(num, "to_sum_form num"));
    if (den) TREEATTN_RETURN_IF_ERROR(check_ptr(den, "to_sum_form den"));
    return check(gpu::launch_to_sum_form(states, max_lse, i64(n), i64(d), num, i64(num_stride), den,
                                         stream_),
                 "to_sum_form kernel");
  }
  Status from_sum_form(const float* max_lse, const float* num, std::size_t num_stride,
                       const float* den, std::size_t n, std::size_t d, float* states) override {
    if (n == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_dim(d, "from_sum_form"));
    if (num_stride < d + (den ? 0 : 1))
      return invalid_argument(who_ + ": from_sum_form: num_stride " + std::to_string(num_stride) +
                              " is too small for head_dim " + std::to_string(d) +
                              (den ? "" : " plus the fused weight"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(max_lse, "from_sum_form max_lse"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(num, "from_sum_form num"));
    if (den) TREEATTN_RETURN_IF_ERROR(check_ptr(den, "from_sum_form den"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(states, "from_sum_form states"));
    return check(gpu::launch_from_sum_form(max_lse, num, i64(num_stride), den, i64(n), i64(d),
                                           states, stream_),
                 "from_sum_form kernel");
  }
  Status normalize(const float* states, std::size_t n, std::size_t d, float* out,
                   float* lse) override {
    if (n == 0) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(check_dim(d, "normalize"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(states, "normalize states"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(out, "normalize output"));
    if (lse) TREEATTN_RETURN_IF_ERROR(check_ptr(lse, "normalize lse"));
    return check(gpu::launch_normalize(states, i64(n), i64(d), out, lse, stream_),
                 "normalize kernel");
  }

  Status synchronize() override {
    TREEATTN_RETURN_IF_ERROR(no_capture("synchronize"));
    TREEATTN_RETURN_IF_ERROR(current());
    return check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  bool capturing() const {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &st) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return st != cudaStreamCaptureStatusNone;
  }
  // The graphs of this executor (CudaGraphImpl): while one lives, a buffer that grows is kept.
  void graph_created() { owned_.graph_created(); }
  void graph_destroyed() { owned_.graph_destroyed(); }

 private:
  CudaExecutor() = default;
  static int64_t i64(std::size_t v) { return static_cast<int64_t>(v); }

  // Every operation makes the executor's device current first (kernels launch on the current
  // device; the stream belongs to ours).
  Status current() const { return check(use_device(device_), "cudaSetDevice"); }
  Status check(cudaError_t e, const std::string& what) const {
    if (e == cudaSuccess) return Status::ok();
    return internal_error(who_ + ": " + what + " failed: " + cuda_error_text(e));
  }
  Status no_capture(const char* op) const {
    if (!capturing()) return Status::ok();
    return unsupported(who_ + ": " + op +
                       " waits for the stream, which is being captured into a CUDA graph; only "
                       "stream operations can be captured");
  }
  Status check_dim(std::size_t d, const char* op) const {
    if (d >= 1 && gpu::state_lane_elems(i64(d)) != 0) return Status::ok();
    return unsupported(who_ + ": " + op + ": head_dim " + std::to_string(d) +
                       " is outside the state kernels' range 1..256");
  }
  // p must be device memory of this executor's device (or managed memory): inside one of its own
  // live allocations (no driver call), or what the driver says of it (device_pointers.hpp).
  Status check_ptr(const void* p, const char* what) const {
    if (p == nullptr) return invalid_argument(who_ + ": " + what + " is null");
    if (pointers_.own(p)) return Status::ok();
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return invalid_argument(who_ + ": " + what + " is not a pointer CUDA knows (" +
                              cuda_error_text(e) + ")");
    }
    if (a.type == cudaMemoryTypeManaged) return Status::ok();
    if (a.type == cudaMemoryTypeDevice && a.device == device_) return Status::ok();
    std::string is = a.type == cudaMemoryTypeDevice ? "memory of device " + std::to_string(a.device)
                     : a.type == cudaMemoryTypeHost ? std::string("pinned host memory")
                                                    : std::string("host memory");
    return invalid_argument(who_ + ": " + what + " is " + is + "; this executor reads and writes " +
                            "device memory of device " + std::to_string(device_) +
                            " (allocate it with the executor, copy host data with from_host)");
  }

  Status check_decode(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                      const DecodeOptions& options, const char* op) const {
    const std::string where = who_ + ": " + op + ": ";
    TREEATTN_RETURN_IF_ERROR(current());
    TREEATTN_RETURN_IF_ERROR(shape.validate());
    if (kv.tiled != nullptr)
      return invalid_argument(where + "the KV shard is in the host tiled layout (kv_tiles.hpp); "
                                      "device shards are rows");
    TREEATTN_RETURN_IF_ERROR(kv.validate(shape));
    if (!(options.scale >= 0.0f) || std::isinf(options.scale))
      return invalid_argument(where + "scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got " +
                              std::to_string(options.scale));
    if (options.chunk_tokens < 0)
      return invalid_argument(where + "chunk_tokens must be >= 0, got " +
                              std::to_string(options.chunk_tokens));
    if (std::find(std::begin(gpu::kCudaHeadDims), std::end(gpu::kCudaHeadDims), shape.head_dim) ==
        std::end(gpu::kCudaHeadDims))
      return unsupported(where + "head_dim " + std::to_string(shape.head_dim) +
                         " has no CUDA kernel (supported: " + supported_cuda_head_dims() + ")");
    if (gpu::decode_entry(kv.dtype).launch == nullptr)
      return unsupported(where + "KV dtype " + std::string(dtype_name(kv.dtype)) +
                         " has no CUDA kernel");
    if (kv.memory != MemorySpace::kDevice)
      return invalid_argument(where +
                              "the KV shard is marked as host memory (KVShard::memory); "
                              "the CUDA executor reads K and V from device memory");
    TREEATTN_RETURN_IF_ERROR(check_ptr(q, "query"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(states, "state output"));
    bool any = false;
    for (int64_t n : kv.len) any = any || n > 0;
    if (!any) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(check_ptr(kv.k, "K"));
    TREEATTN_RETURN_IF_ERROR(check_ptr(kv.v, "V"));
    if (dtype_is_quantized(kv.dtype)) {
      TREEATTN_RETURN_IF_ERROR(check_ptr(kv.k_scale, "K scales"));
      TREEATTN_RETURN_IF_ERROR(check_ptr(kv.v_scale, "V scales"));
    }
    const int vb = gpu::vec_bytes(kv.dtype), ve = gpu::vec_elems(kv.dtype);  // 16 bytes
    const auto misaligned = [vb](const void* p) {
      return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(vb) != 0;
    };
    if (misaligned(kv.k) || misaligned(kv.v) || kv.stride_token % ve != 0 ||
        kv.stride_head % ve != 0 || kv.stride_batch % ve != 0)
      return unsupported(where + "the CUDA kernel loads " + std::to_string(vb) +
                         "-byte vectors: K and V must be " + std::to_string(vb) +
                         "-byte aligned and the token, head and batch strides multiples of " +
                         std::to_string(ve) + " elements (got strides " +
                         std::to_string(kv.stride_token) + ", " + std::to_string(kv.stride_head) +
                         ", " + std::to_string(kv.stride_batch) + ")");
    return Status::ok();
  }

  // The kernel reaches a split's slots by 32-bit offsets from its first (decode_geometry.hpp):
  // the most slots a split may span at the shard's K/V and scale token strides.
  static int64_t max_split_slots(const KVShard& kv) {
    return gpu::max_split_slots(kv.dtype, kv.stride_token, kv.scale_stride_token);
  }
  // A split of `chunk` slots must fit, for K/V and for the scales.
  Status check_split_slots(const KVShard& kv, int64_t chunk, const char* op) const {
    const int64_t most = max_split_slots(kv);  // no division: 0 for a negative stride
    if (chunk >= 1 && chunk <= most) return Status::ok();
    const int64_t stride =
        std::max(kv.stride_token, dtype_is_quantized(kv.dtype) ? kv.scale_stride_token : 0);
    return unsupported(who_ + ": " + op + ": a split of " + std::to_string(chunk) +
                       " token slots at a token stride of " + std::to_string(stride) +
                       " elements is past the kernel's 32-bit slot offsets (at most " +
                       std::to_string(most) + " slots a split at this stride); pass a " +
                       "DecodeOptions::chunk_tokens (partial_chunks: a chunk_tokens) of at most " +
                       std::to_string(most));
  }

  // Launches the decode kernel over every batch row, kMaxBatchPerLaunch rows at a time, writing
  // split s's records to out + s * split_stride and, with final_out, the merged states there
  // (the launches run one after another on the stream, so they share the ticket counters).
  Status launch(const AttnShape& shape, const float* q, const KVShard& kv,
                const gpu::SplitPlan& plan, float* out, int64_t split_stride, float* final_out,
                const DecodeOptions& options) {
    const float scale =
        options.scale != 0.0f
            ? options.scale
            : static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
    gpu::DecodeParams p;
    p.q = q;
    p.k = kv.k;
    p.v = kv.v;
    p.k_scale = kv.k_scale;
    p.v_scale = kv.v_scale;
    p.out = out;
    p.final_out = final_out;
    p.tickets = final_out ? static_cast<unsigned int*>(tickets_.data()) : nullptr;
    p.stride_batch = kv.stride_batch;
    p.stride_head = kv.stride_head;
    p.stride_token = kv.stride_token;
    p.scale_stride_batch = kv.scale_stride_batch;
    p.scale_stride_head = kv.scale_stride_head;
    p.scale_stride_token = kv.scale_stride_token;
    p.pos_stride = kv.pos_stride;
    p.chunk = plan.chunk;
    p.split_stride = split_stride;
    p.splits = plan.splits;
    p.row_groups = plan.rows.row_groups;
    p.rows_total = plan.rows.rows_total;
    p.heads = shape.heads;
    p.kv_heads = shape.kv_heads;
    p.group = shape.group();
    p.q_len = shape.q_len;
    p.qscale = static_cast<float>(static_cast<double>(scale) * kLog2e);
    const auto fn = gpu::decode_entry(kv.dtype).launch;
    for (int64_t b0 = 0; b0 < shape.batch; b0 += gpu::kMaxBatchPerLaunch) {
      const int64_t nb = std::min<int64_t>(gpu::kMaxBatchPerLaunch, shape.batch - b0);
      p.b0 = b0;
      for (int64_t i = 0; i < nb; ++i) {
        const auto b = static_cast<std::size_t>(b0 + i);
        p.len[i] = kv.len[b];
        p.pos_start[i] = kv.pos_start[b];
        p.total_len[i] = kv.total_len[b];
      }
      const int64_t blocks = nb * plan.blocks_per_batch_row;
      if (blocks > 0x7fffffffLL)
        return unsupported(who_ + ": " + std::to_string(blocks) +
                           " thread blocks in one launch (more than 2^31 - 1); use a larger "
                           "chunk_tokens");
      TREEATTN_RETURN_IF_ERROR(
          check(fn(static_cast<int>(shape.head_dim), plan.rows.rows_tpl, p, blocks, stream_),
                "decode kernel launch (" + std::string(dtype_name(kv.dtype)) + ", head_dim " +
                    std::to_string(shape.head_dim) + ", " + std::to_string(blocks) + " blocks)"));
    }
    return Status::ok();
  }

  // The planner's wave for an instance: SMs x its resident blocks (0: unknown, the
  // device-independent plan).
  int64_t wave_slots(DType t, int64_t head_dim, int rows_tpl) const {
    for (std::size_t d = 0; d < kNumHeadDims; ++d)
      for (std::size_t r = 0; r < std::size(kRowTemplates); ++r)
        if (gpu::kCudaHeadDims[d] == head_dim && kRowTemplates[r] == rows_tpl)
          return static_cast<int64_t>(props_.multiProcessorCount) *
                 occupancy_[static_cast<std::size_t>(t)][d][r];
    return 0;
  }
  // Resident blocks per SM of every decode instance, asked once (not a stream operation, but
  // kept out of partial() so that nothing but launches happens there during a graph capture).
  void query_occupancy() {
    for (DType t : kCudaDtypes)
      for (std::size_t d = 0; d < kNumHeadDims; ++d)
        for (std::size_t r = 0; r < std::size(kRowTemplates); ++r) {
          int n = 0;
          if (gpu::decode_entry(t).occupancy(gpu::kCudaHeadDims[d], kRowTemplates[r], &n) !=
              cudaSuccess) {
            (void)cudaGetLastError();
            n = 0;
          }
          occupancy_[static_cast<std::size_t>(t)][d][r] = n;
        }
  }
  // At least n ticket counters, all 0: a new buffer is zeroed on the stream before any launch
  // that uses it; afterwards every launch leaves its counters 0 (the merging block resets them).
  // The first buffer holds 64k counters (256 KiB: 64 batch rows x 8 KV heads x 128 row groups),
  // so that it is seldom replaced; a graph captured before a replacement keeps the old buffer
  // (graph_buffers.hpp).
  Status reserve_tickets(int64_t n) {
    const auto bytes = static_cast<std::size_t>(std::max<int64_t>(n, 65536)) * sizeof(unsigned int);
    if (tickets_.bytes() >= bytes) return Status::ok();
    TREEATTN_RETURN_IF_ERROR(no_capture_growth("the split merge's ticket counters", bytes));
    TREEATTN_RETURN_IF_ERROR(owned_.replace(tickets_, [&] { return allocate(bytes); }));
    return check(cudaMemsetAsync(tickets_.data(), 0, tickets_.bytes(), stream_),
                 "cudaMemsetAsync (split merge tickets)");
  }
  Status no_capture_growth(const char* what, std::size_t bytes) const {
    if (!capturing()) return Status::ok();
    return unsupported(who_ + ": " + what + " must grow to " + std::to_string(bytes) +
                       " bytes while its stream is being captured into a CUDA graph; run the "
                       "step once before capturing so that every buffer exists");
  }

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaDeviceProp props_{};
  std::string who_;
  // This executor's live allocations, which check_ptr knows without the driver (declared before
  // the buffers, so that it outlives every release()).
  gpu::DevicePointers pointers_;
  Buffer workspace_;  // the split records of partial()
  Buffer tickets_;    // the fused split merge's counters (decode_kernel.cuh), 0 between launches
  // The two buffers above as graphs see them: replaced ones kept while a graph lives.
  gpu::GraphBuffers<Buffer> owned_;
  int occupancy_[std::size(kCudaDtypes)][kNumHeadDims][std::size(kRowTemplates)] = {};
};

Result<std::unique_ptr<Executor>> CudaExecutor::create(const CudaExecutorOptions& o) {
  std::string why;
  const int count = cuda_device_count(&why);
  if (count == 0) return unsupported("cuda executor: no CUDA device: " + why);
  int device = o.device;
  if (device < 0) device = env_local_rank() % count;
  if (device >= count)
    return invalid_argument("cuda executor: device " + std::to_string(device) +
                            " does not exist (this process sees " + std::to_string(count) +
                            " CUDA devices)");
  std::unique_ptr<CudaExecutor> e(new CudaExecutor());
  e->device_ = device;
  e->who_ = "cuda executor (device " + std::to_string(device) + ")";
  TREEATTN_RETURN_IF_ERROR(e->check(use_device(device), "cudaSetDevice"));
  TREEATTN_RETURN_IF_ERROR(
      e->check(cudaGetDeviceProperties(&e->props_, device), "cudaGetDeviceProperties"));
  if (const cudaError_t img = gpu::probe_kernel_image(); img != cudaSuccess) {
    (void)cudaGetLastError();
    return unsupported(e->who_ + ": " + e->props_.name + " (compute capability " +
                       std::to_string(e->props_.major) + "." + std::to_string(e->props_.minor) +
                       ") cannot run this build's kernels (built for CUDA architectures " +
                       TREEATTN_CUDA_ARCHS +
                       "; set CMAKE_CUDA_ARCHITECTURES): " + cuda_error_text(img));
  }
  e->query_occupancy();
  if (o.stream) {
    e->stream_ = static_cast<cudaStream_t>(o.stream);
  } else {
    TREEATTN_RETURN_IF_ERROR(e->check(cudaStreamCreateWithFlags(&e->stream_, cudaStreamNonBlocking),
                                      "cudaStreamCreateWithFlags"));
    e->owns_stream_ = true;
  }
  return std::unique_ptr<Executor>(std::move(e));
}

class CudaGraphImpl final : public CudaGraph {
 public:
  CudaGraphImpl(CudaExecutor& e, cudaGraph_t g, cudaGraphExec_t x)
      : exec_(&e), graph_(g), instance_(x) {
    exec_->graph_created();
  }
  ~CudaGraphImpl() override {
    (void)use_device(exec_->device());
    (void)cudaGraphExecDestroy(instance_);
    (void)cudaGraphDestroy(graph_);
    exec_->graph_destroyed();
  }
  CudaGraphImpl(const CudaGraphImpl&) = delete;
  CudaGraphImpl& operator=(const CudaGraphImpl&) = delete;
  Status replay() override {
    (void)use_device(exec_->device());
    const cudaError_t e = cudaGraphLaunch(instance_, exec_->stream());
    if (e == cudaSuccess) return Status::ok();
    return internal_error("cuda executor (device " + std::to_string(exec_->device()) +
                          "): cudaGraphLaunch failed: " + cuda_error_text(e));
  }

 private:
  CudaExecutor* exec_;
  cudaGraph_t graph_;
  cudaGraphExec_t instance_;
};

Status not_cuda(const Executor& e, const char* op) {
  return invalid_argument(std::string(op) + ": executor '" + std::string(e.name()) +
                          "' is not a CUDA executor (make_cuda_executor)");
}
Result<const CudaExecutor*> as_cuda(const Executor& e, const char* op) {
  if (const auto* c = dynamic_cast<const CudaExecutor*>(&e)) return c;
  return not_cuda(e, op);
}
Result<CudaExecutor*> as_cuda(Executor& e, const char* op) {
  if (auto* c = dynamic_cast<CudaExecutor*>(&e)) return c;
  return not_cuda(e, op);
}

}  // namespace

bool cuda_built() { return true; }

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) {
      *why = "cudaGetDeviceCount: " + cuda_error_text(e);
      if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice)
        *why += " (no NVIDIA GPU or driver on this machine, or a driver older than CUDA " +
                std::to_string(CUDART_VERSION / 1000) + "." +
                std::to_string(CUDART_VERSION % 1000 / 10) + " needs)";
    }
    return 0;
  }
  if (n == 0 && why) *why = "cudaGetDeviceCount found 0 devices";
  return n;
}

// cuda_presence.hpp names these error codes as plain ints.
static_assert(cudaSuccess == gpu::kCudaSuccess);
static_assert(cudaErrorStubLibrary == gpu::kCudaErrorStubLibrary);
static_assert(cudaErrorInsufficientDriver == gpu::kCudaErrorInsufficientDriver);
static_assert(cudaErrorNoDevice == gpu::kCudaErrorNoDevice);

gpu::CudaProbe gpu::probe_cuda() {
  CudaProbe p;
  p.built = true;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  p.count_error = static_cast<int>(e);
  p.device_count = e == cudaSuccess ? n : 0;
  p.error_name = cudaGetErrorName(e);
  int v = 0;
  if (cudaDriverGetVersion(&v) == cudaSuccess) p.driver_version = v;
  return p;
}

Result<std::unique_ptr<Executor>> make_cuda_executor(const CudaExecutorOptions& options) {
  return CudaExecutor::create(options);
}

Result<CudaDeviceInfo> cuda_device_info(const Executor& executor) {
  auto c = as_cuda(executor, "cuda_device_info");
  TREEATTN_RETURN_IF_ERROR(c.status());
  const cudaDeviceProp& p = (*c)->props();
  CudaDeviceInfo info;
  info.device = (*c)->device();
  info.name = p.name;
  info.sm_count = p.multiProcessorCount;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.memory_bytes = p.totalGlobalMem;
  (void)cudaDriverGetVersion(&info.driver_version);
  (void)cudaRuntimeGetVersion(&info.runtime_version);
  return info;
}

Result<void*> cuda_stream(const Executor& executor) {
  auto c = as_cuda(executor, "cuda_stream");
  TREEATTN_RETURN_IF_ERROR(c.status());
  return static_cast<void*>((*c)->stream());
}

Status cuda_capture_begin(Executor& executor) {
  auto c = as_cuda(executor, "cuda_capture_begin");
  TREEATTN_RETURN_IF_ERROR(c.status());
  (void)use_device((*c)->device());
  const cudaError_t e = cudaStreamBeginCapture((*c)->stream(), cudaStreamCaptureModeThreadLocal);
  if (e == cudaSuccess) return Status::ok();
  return internal_error("cuda executor (device " + std::to_string((*c)->device()) +
                        "): cudaStreamBeginCapture failed: " + cuda_error_text(e));
}

Result<std::unique_ptr<CudaGraph>> cuda_capture_end(Executor& executor) {
  auto c = as_cuda(executor, "cuda_capture_end");
  TREEATTN_RETURN_IF_ERROR(c.status());
  const std::string who = "cuda executor (device " + std::to_string((*c)->device()) + ")";
  (void)use_device((*c)->device());
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture((*c)->stream(), &graph);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return internal_error(who +
                          ": cudaStreamEndCapture failed (an operation that is not a "
                          "stream operation ran during the capture?): " +
                          cuda_error_text(e));
  }
  cudaGraphExec_t instance = nullptr;
  e = cudaGraphInstantiate(&instance, graph, 0);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaGraphDestroy(graph);
    return internal_error(who + ": cudaGraphInstantiate failed: " + cuda_error_text(e));
  }
  return std::unique_ptr<CudaGraph>(new CudaGraphImpl(**c, graph, instance));
}

}  // namespace treeattn
