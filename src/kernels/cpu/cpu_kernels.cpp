// The SIMD CPU decode kernels for the caller's row layout: each ISA target's item kernel run by
// the shared work-item driver (item_driver.hpp: items, chunks, merge order, scratch), and the
// registry that dispatch.cpp asks for the kernel of a target.
//
// This file is compiled for the baseline ISA; only the item kernels (cpu_targets.hpp) are
// compiled per target.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/cpu/driver_tuning.hpp"
#include "kernels/cpu/item_driver.hpp"
#include "kernels/kernel_impl.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/state.hpp"

static_assert(treeattn::kernels::cpu::kM == treeattn::kStateM &&
                  treeattn::kernels::cpu::kL == treeattn::kStateL &&
                  treeattn::kernels::cpu::kO == treeattn::kStateO,
              "cpu_targets.hpp's record offsets must match state.hpp");
static_assert(treeattn::kernels::cpu::kVPanel == treeattn::kKVTileVPanel,
              "cpu_targets.hpp's V panel width must match kv_tiles.hpp");

namespace treeattn::kernels {
namespace {

using cpu::ItemArgs;
using cpu::ItemFn;

Status run_driver(ItemFn item_fn, const AttnShape& shape, const float* q, const KVShard& kv,
                  float* states, const ResolvedOptions& opt) {
  const std::size_t esize = dtype_size(kv.dtype);
  const int64_t R = shape.group() * shape.q_len;
  const cpu::DriverChoice choice =
      cpu::driver_choice(kv.dtype, shape.head_dim, shape.group(), opt.threads, opt.isa);
  const int prefetch =
      choice.rows_prefetch_tokens(shape.head_dim * static_cast<int64_t>(esize));
  // A layout with the heads inside a token ([T][Hkv][D]) is read chunk by chunk; one with a
  // head's tokens together in the order the tuning chose.
  cpu::drive_items(
      shape, q, kv.len, kv.pos_start, kv.total_len, kv.pos_stride, opt.chunk_tokens,
      static_cast<std::size_t>(R + 2) * cpu::kBlockTokens, opt.threads,
      kv.stride_head > kv.stride_token ? choice.order : cpu::ItemOrder::kChunksOuter, states,
      [&](const cpu::DriverItem& it) {
        const std::size_t elem0 = static_cast<std::size_t>(
            it.b * kv.stride_batch + it.kv_head * kv.stride_head + it.t0 * kv.stride_token);
        ItemArgs a;
        a.head_dim = static_cast<int>(shape.head_dim);
        a.dtype = kv.dtype;
        a.k = static_cast<const char*>(kv.k) + elem0 * esize;
        a.v = static_cast<const char*>(kv.v) + elem0 * esize;
        a.stride_token = kv.stride_token;
        if (kv.k_scale != nullptr) {
          const int64_t s0 = it.b * kv.scale_stride_batch + it.kv_head * kv.scale_stride_head +
                             it.t0 * kv.scale_stride_token;
          a.k_scale = kv.k_scale + s0;
          a.v_scale = kv.v_scale + s0;
          a.scale_stride_token = kv.scale_stride_token;
        }
        a.tokens = it.t1 - it.t0;
        a.rows = static_cast<int>(R);
        a.q = it.q;
        a.visible = it.visible;
        a.scale = opt.scale;
        a.out = it.out;
        a.scores = it.scores;
        a.prefetch_tokens = prefetch;
        item_fn(a);
      });
  return Status::ok();
}

#if defined(TREEATTN_CPU_KERNEL_GENERIC)
Status decode_generic(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                      const ResolvedOptions& opt) {
  return run_driver(&cpu::generic::decode_item, shape, q, kv, states, opt);
}
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
Status decode_avx2(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                   const ResolvedOptions& opt) {
  return run_driver(&cpu::avx2::decode_item, shape, q, kv, states, opt);
}
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
Status decode_avx512(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                     const ResolvedOptions& opt) {
  return run_driver(&cpu::avx512::decode_item, shape, q, kv, states, opt);
}
#endif

}  // namespace

KernelFn cpu_kernel_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &decode_generic;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &decode_avx2;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &decode_avx512;
#endif
    default: return nullptr;
  }
}

namespace cpu {
ExpFn exp_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &generic::exp_array;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &avx2::exp_array;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &avx512::exp_array;
#endif
    default: return nullptr;
  }
}

ExpFn exp_nonpos_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &generic::exp_nonpos_array;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &avx2::exp_nonpos_array;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &avx512::exp_nonpos_array;
#endif
    default: return nullptr;
  }
}

ReadStreamFn read_stream_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &generic::read_stream;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &avx2::read_stream;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &avx512::read_stream;
#endif
    default: return nullptr;
  }
}

FmaBurnFn fma_burn_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &generic::fma_burn;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &avx2::fma_burn;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &avx512::fma_burn;
#endif
    default: return nullptr;
  }
}

FmaStreamFn fma_stream_for(Isa isa) {
  switch (isa) {
#if defined(TREEATTN_CPU_KERNEL_GENERIC)
    case Isa::kGeneric: return &generic::fma_stream;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX2)
    case Isa::kAvx2: return &avx2::fma_stream;
#endif
#if defined(TREEATTN_CPU_KERNEL_AVX512)
    case Isa::kAvx512: return &avx512::fma_stream;
#endif
    default: return nullptr;
  }
}
}  // namespace cpu

}  // namespace treeattn::kernels
