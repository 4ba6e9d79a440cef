// Decode kernels: the partial attention state of a query against one KV shard.
//
// A kernel reads every visible key and value of the shard once, computes scaled logits
// scale * <q, k> for all query heads of the KV head's group and all q_len queries, and writes
// one state record per (batch, query, head) (see state.hpp). Long shards are cut into chunks
// of chunk_tokens; each chunk yields a state and the chunks are merged in a fixed order with
// state_merge, so the result does not depend on the thread count.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/shape.hpp"
#include "treeattn/status.hpp"

namespace treeattn {

// Instruction-set targets of the CPU kernel. kAuto picks the best one this CPU supports.
// kReference is the simple scalar kernel kept for comparison.
enum class Isa : uint8_t { kAuto, kReference, kGeneric, kAvx2, kAvx512 };

std::string_view isa_name(Isa isa);
Result<Isa> parse_isa(std::string_view name);
// The best target this CPU supports (never kAuto).
Isa best_isa();
// The CPU's model name as /proc/cpuinfo gives it ("unknown CPU" without one).
std::string cpu_model_name();
// Whether this CPU can run the target (kAuto, kReference and kGeneric always can).
bool isa_supported(Isa isa);
// OK where isa_supported(isa); else kUnsupported, "<who>: this CPU cannot run the <isa> target
// (it needs ...); the best it runs is <best_isa()>". The one check of every entry point that
// takes a target (kernels, matmul, engine, probes, the CLI's --isa).
Status check_isa_supported(Isa isa, std::string_view who);

// The most threads a kernel call may ask for; the one cap of every thread count that reaches
// OpenMP here (DecodeOptions::threads, the roofline and topology probes, the CLI's --threads,
// the Python module's threads=). More only oversubscribe the cores further, and tens of
// thousands make the OpenMP runtime fail to create its team, which crashes the process instead
// of returning an error.
inline constexpr int kMaxThreads = 1024;

// OK when 0 <= threads <= kMaxThreads (0: the caller's default); else kInvalidArgument
// "WHAT N: must be between 0 (the default) and 1024", with WHAT naming the flag or argument.
Status check_thread_count(int64_t threads, std::string_view what = "threads");

// The CPU kernels' chunk length where DecodeOptions::chunk_tokens is 0.
inline constexpr int64_t kDefaultChunkTokens = 1024;

struct DecodeOptions {
  float scale = 0.0f;          // 0 means 1 / sqrt(head_dim)
  int threads = 0;             // 0 means all the threads OpenMP offers; at most kMaxThreads
  // 0 means the kernel's default: kDefaultChunkTokens on the CPU (not per-thread); on a GPU a
  // split plan sized to the device's SM count (executor_cuda.hpp)
  int64_t chunk_tokens = 0;
  Isa isa = Isa::kAuto;
};

// states must hold batch * q_len * heads * (head_dim + 2) floats; it is overwritten.
// A shard with no visible tokens yields empty states (m = -inf, l = 0, o = 0).
Status decode_partial(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                      const DecodeOptions& options = {});

}  // namespace treeattn
