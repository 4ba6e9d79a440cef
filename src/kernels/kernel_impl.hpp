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
};

using KernelFn = Status (*)(const AttnShape&, const float* q, const KVShard&, float* states,
                            const ResolvedOptions&);

// The simple scalar kernel from the foundation issue; always available.
Status decode_reference(const AttnShape&, const float* q, const KVShard&, float* states,
                        const ResolvedOptions&);

// The kernel registered for an ISA target, or nullptr if this build has none for it.
KernelFn cpu_kernel_for(Isa isa);

}  // namespace treeattn::kernels
