// The SIMD CPU decode kernels: the work-item driver shared by every ISA target, and the
// registry that dispatch.cpp asks for the kernel of a target.
//
// Work items are (batch row b, chunk c, KV head) in that order, chunk c of row b covering
// tokens [c * chunk_tokens, (c + 1) * chunk_tokens) of the tokens some query of the row can
// see (tokens past every query's causal limit are never read). Items run on OpenMP threads
// (dynamic schedule); each writes the states of its R = group * q_len rows into its own slot,
// and the slots are merged in chunk order with state_merge. The chunk size is an input, never
// derived from the thread count, so results are bitwise identical for any thread count.
//
// This file is compiled for the baseline ISA; only the item kernels (cpu_targets.hpp) are
// compiled per target. Scratch memory is thread-local and grows only, so steady-state calls
// do not allocate.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/kernel_impl.hpp"
#include "treeattn/state.hpp"

static_assert(treeattn::kernels::cpu::kM == treeattn::kStateM &&
                  treeattn::kernels::cpu::kL == treeattn::kStateL &&
                  treeattn::kernels::cpu::kO == treeattn::kStateO,
              "cpu_targets.hpp's record offsets must match state.hpp");

namespace treeattn::kernels {
namespace {

using cpu::ItemArgs;
using cpu::ItemFn;

// Per-thread scratch: query rows, visible counts and the item kernel's score block.
struct ThreadScratch {
  std::vector<float> q;
  std::vector<int64_t> visible;
  std::vector<float> scores;
};

ThreadScratch& thread_scratch() {
  thread_local ThreadScratch s;
  return s;
}

// Per-call scratch owned by the calling thread: chunk prefix sums and chunk states.
struct CallScratch {
  std::vector<int64_t> first_chunk;
  std::vector<int64_t> needed;
  std::vector<float> chunk_states;
};

CallScratch& call_scratch() {
  thread_local CallScratch s;
  return s;
}

template <class T>
void grow(std::vector<T>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
}

// Tokens of a shard row that query i sees: positions pos_start + t * stride <= limit.
int64_t visible_tokens(int64_t len, int64_t pos_start, int64_t pos_stride, int64_t limit) {
  if (limit < pos_start) return 0;
  const int64_t last = (limit - pos_start) / pos_stride;  // last visible token index
  return std::min(len, last + 1);
}

Status run_driver(ItemFn item_fn, const AttnShape& shape, const float* q, const KVShard& kv,
                  float* states, const ResolvedOptions& opt) {
  const int64_t B = shape.batch, H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim;
  const int64_t Q = shape.q_len, G = shape.group();
  const int64_t R = G * Q;
  const std::size_t rec = static_cast<std::size_t>(D + 2);
  const std::size_t item_floats = static_cast<std::size_t>(R) * rec;
  const int64_t chunk = opt.chunk_tokens;
  const std::size_t esize = dtype_size(kv.dtype);

  CallScratch& cs = call_scratch();
  grow(cs.first_chunk, static_cast<std::size_t>(B) + 1);
  grow(cs.needed, static_cast<std::size_t>(B));
  cs.first_chunk[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const auto ub = static_cast<std::size_t>(b);
    // The last query sees the most; tokens past its limit are never read.
    const int64_t need = visible_tokens(kv.len[ub], kv.pos_start[ub], kv.pos_stride,
                                        kv.total_len[ub] - 1);
    cs.needed[ub] = need;
    cs.first_chunk[ub + 1] = cs.first_chunk[ub] + (need + chunk - 1) / chunk;
  }
  const int64_t chunks_total = cs.first_chunk[static_cast<std::size_t>(B)];
  const int64_t items = chunks_total * Hkv;
  grow(cs.chunk_states, static_cast<std::size_t>(items) * item_floats);
  float* chunk_states = cs.chunk_states.data();
  const int64_t* first_chunk = cs.first_chunk.data();
  const int64_t* needed = cs.needed.data();

  const int prefetch = cpu::default_prefetch_tokens(D * static_cast<int64_t>(esize));

#pragma omp parallel for schedule(dynamic, 1) num_threads(opt.threads)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t kvh = item % Hkv;
    const int64_t gchunk = item / Hkv;
    const int64_t b = std::upper_bound(first_chunk, first_chunk + B + 1, gchunk) - first_chunk - 1;
    const auto ub = static_cast<std::size_t>(b);
    const int64_t c = gchunk - first_chunk[ub];
    const int64_t t0 = c * chunk;
    const int64_t t1 = std::min(needed[ub], t0 + chunk);

    ThreadScratch& ts = thread_scratch();
    grow(ts.q, static_cast<std::size_t>(R * D));
    grow(ts.visible, static_cast<std::size_t>(R));
    grow(ts.scores, static_cast<std::size_t>(R + 2) * cpu::kBlockTokens);
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t vis = visible_tokens(kv.len[ub], kv.pos_start[ub], kv.pos_stride,
                                         kv.total_len[ub] - Q + i);
      const int64_t in_chunk = std::clamp<int64_t>(vis - t0, 0, t1 - t0);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        ts.visible[static_cast<std::size_t>(r)] = in_chunk;
        std::memcpy(ts.q.data() + r * D, q + ((b * Q + i) * H + kvh * G + g) * D,
                    static_cast<std::size_t>(D) * sizeof(float));
      }
    }
    const std::size_t elem0 =
        static_cast<std::size_t>(b * kv.stride_batch + kvh * kv.stride_head + t0 * kv.stride_token);
    ItemArgs a;
    a.head_dim = static_cast<int>(D);
    a.dtype = kv.dtype;
    a.k = static_cast<const char*>(kv.k) + elem0 * esize;
    a.v = static_cast<const char*>(kv.v) + elem0 * esize;
    a.stride_token = kv.stride_token;
    if (kv.k_scale != nullptr) {
      const int64_t s0 = b * kv.scale_stride_batch + kvh * kv.scale_stride_head +
                         t0 * kv.scale_stride_token;
      a.k_scale = kv.k_scale + s0;
      a.v_scale = kv.v_scale + s0;
      a.scale_stride_token = kv.scale_stride_token;
    }
    a.tokens = t1 - t0;
    a.rows = static_cast<int>(R);
    a.q = ts.q.data();
    a.visible = ts.visible.data();
    a.scale = opt.scale;
    a.out = chunk_states + static_cast<std::size_t>(item) * item_floats;
    a.scores = ts.scores.data();
    a.prefetch_tokens = prefetch;
    item_fn(a);
  }

  // Merge the chunk states of each (b, kv head) in chunk order.
#pragma omp parallel for schedule(static) num_threads(opt.threads)
  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t b = bh / Hkv, kvh = bh % Hkv;
    const auto ub = static_cast<std::size_t>(b);
    for (int64_t i = 0; i < Q; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        float* dst = states + static_cast<std::size_t>((b * Q + i) * H + kvh * G + g) * rec;
        state_set_empty(dst, static_cast<std::size_t>(D));
        for (int64_t c = first_chunk[ub]; c < first_chunk[ub + 1]; ++c) {
          const float* src = chunk_states + static_cast<std::size_t>(c * Hkv + kvh) * item_floats +
                             static_cast<std::size_t>(i * G + g) * rec;
          state_merge(dst, src, static_cast<std::size_t>(D));
        }
      }
    }
  }
  return Status::ok();
}

Status decode_generic(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                      const ResolvedOptions& opt) {
  return run_driver(&cpu::generic::decode_item, shape, q, kv, states, opt);
}

#if defined(TREEATTN_HAVE_X86_KERNELS)
Status decode_avx2(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                   const ResolvedOptions& opt) {
  return run_driver(&cpu::avx2::decode_item, shape, q, kv, states, opt);
}

Status decode_avx512(const AttnShape& shape, const float* q, const KVShard& kv, float* states,
                     const ResolvedOptions& opt) {
  return run_driver(&cpu::avx512::decode_item, shape, q, kv, states, opt);
}
#endif

}  // namespace

KernelFn cpu_kernel_for(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return &decode_generic;
#if defined(TREEATTN_HAVE_X86_KERNELS)
    case Isa::kAvx2: return &decode_avx2;
    case Isa::kAvx512: return &decode_avx512;
#endif
    default: return nullptr;
  }
}

namespace cpu {
int default_prefetch_tokens(int64_t row_bytes) {
  static const int from_env = [] {
    const char* e = std::getenv("TREEATTN_PREFETCH_TOKENS");
    if (e == nullptr || *e == '\0') return -1;
    const long v = std::strtol(e, nullptr, 10);
    return v < 0 ? 0 : (v > 4096 ? 4096 : static_cast<int>(v));
  }();
  if (from_env >= 0) return from_env;
  const int64_t rb = row_bytes > 0 ? row_bytes : 1;
  return static_cast<int>((kDefaultPrefetchBytes + rb - 1) / rb);
}

ExpFn exp_for(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return &generic::exp_array;
#if defined(TREEATTN_HAVE_X86_KERNELS)
    case Isa::kAvx2: return &avx2::exp_array;
    case Isa::kAvx512: return &avx512::exp_array;
#endif
    default: return nullptr;
  }
}

ReadStreamFn read_stream_for(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return &generic::read_stream;
#if defined(TREEATTN_HAVE_X86_KERNELS)
    case Isa::kAvx2: return &avx2::read_stream;
    case Isa::kAvx512: return &avx512::read_stream;
#endif
    default: return nullptr;
  }
}

FmaBurnFn fma_burn_for(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return &generic::fma_burn;
#if defined(TREEATTN_HAVE_X86_KERNELS)
    case Isa::kAvx2: return &avx2::fma_burn;
    case Isa::kAvx512: return &avx512::fma_burn;
#endif
    default: return nullptr;
  }
}
}  // namespace cpu

}  // namespace treeattn::kernels
