// Registry of the SIMD CPU kernels by ISA target (filled in by the CPU kernel work).
#include "kernels/kernel_impl.hpp"

namespace treeattn::kernels {

KernelFn cpu_kernel_for(Isa) { return nullptr; }

}  // namespace treeattn::kernels
