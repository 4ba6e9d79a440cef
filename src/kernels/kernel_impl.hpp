// Internal contract between the dispatcher (dispatch.cpp) and the kernel implementations.
//
// The dispatcher validates the shape and the view, resolves defaults (scale, threads, chunk
// size, ISA) and only then calls an implementation, so implementations may assume valid input.
#pragma once

#include <cstdint>

#include "treeattn/kernel.hpp"

namespace treeattn::kernels {

struct ResolvedOptions {
  float scale;
  int threads;           // >= 1
  int64_t chunk_tokens;  // >= 1
  Isa isa;               // kReference, or a CPU target this CPU supports
};

// What every CPU decode entry point (decode_partial, decode_partial_tiled) checks before calling
// a kernel, after validating the shape and the view: the pointers and options, resolved to
// their defaults (scale 1/sqrt(head_dim), OpenMP's thread count, 1024-token chunks, the best ISA
// of this CPU). Whether a kernel for the ISA is built is the caller's question (its own table).
Result<ResolvedOptions> resolve_options(const AttnShape& shape, const float* q,
                                        const float* states, const DecodeOptions& options);

using KernelFn = Status (*)(const AttnShape&, const float* q, const KVShard&, float* states,
                            const ResolvedOptions&);

// The simple scalar kernel from the foundation issue; always available.
Status decode_reference(const AttnShape&, const float* q, const KVShard&, float* states,
                        const ResolvedOptions&);

// The kernel registered for an ISA target, or nullptr if this build has none for it.
KernelFn cpu_kernel_for(Isa isa);

}  // namespace treeattn::kernels
