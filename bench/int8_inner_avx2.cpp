// int8_inner_avx2.hpp's functions: the AVX2 integer target's kernel header, included as
// src/model/matvec_int8_avx2.cpp includes it, and compiled with the same flags.
#define TREEATTN_INT8_DOT 0
#define TREEATTN_INT8_NS int8_avx2_bench
// The header's entry point (rows_int8_impl) is not called here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "model/matvec_int8_x86.hpp"
#pragma GCC diagnostic pop

#include "int8_inner_avx2.hpp"

#include <cstdlib>

namespace treeattn::bench {

using namespace treeattn::model::detail;
using namespace treeattn::model::detail::int8_avx2_bench;

namespace {

bool k_type(uint32_t type) {
  return type == kTypeQ4_K || type == kTypeQ5_K || type == kTypeQ6_K;
}

template <uint32_t T>
void decode_rows_k(const uint8_t* rows, int64_t blocks, uint8_t* dec) {
  for (int64_t rb = 0; rb < 4 * blocks; ++rb)
    decode_k<T>(rows + rb * CodeK<T>::kBytes, dec + rb * kDecKBytes);
}

template <uint32_t T>
void decode_rows_32(const uint8_t* rows, int64_t blocks, uint8_t* dec) {
  for (int64_t rb = 0; rb < 4 * blocks; ++rb) {
    Dec d;
    Code<T>::decode(rows + rb * Code<T>::kBytes, d);
    store_dec(dec + rb * kGroupBytes, d);
  }
}

// A K type's call on NV groups; false for the other types.
template <int NV>
bool run_k(uint32_t type, const uint8_t* dec, int64_t blocks, const ActBlockK8* xk, float* y) {
  switch (type) {
    case kTypeQ4_K:
      groupk<kTypeQ4_K, 4, NV, NarrowLanes>(dec, blocks, xk, 8, y, 4, nullptr, 0);
      return true;
    case kTypeQ5_K:
      groupk<kTypeQ5_K, 4, NV, NarrowLanes>(dec, blocks, xk, 8, y, 4, nullptr, 0);
      return true;
    case kTypeQ6_K:
      groupk<kTypeQ6_K, 4, NV, NarrowLanes>(dec, blocks, xk, 8, y, 4, nullptr, 0);
      return true;
    default: return false;
  }
}

}  // namespace

int64_t int8_inner_dec_bytes(uint32_t type, int64_t blocks) {
  return 4 * blocks * (k_type(type) ? kDecKBytes : kGroupBytes);
}

bool int8_inner_decode(uint32_t type, const uint8_t* rows, int64_t blocks, uint8_t* dec) {
  switch (type) {
    case kTypeQ4_K: decode_rows_k<kTypeQ4_K>(rows, blocks, dec); return true;
    case kTypeQ5_K: decode_rows_k<kTypeQ5_K>(rows, blocks, dec); return true;
    case kTypeQ6_K: decode_rows_k<kTypeQ6_K>(rows, blocks, dec); return true;
    case kTypeQ4_0: decode_rows_32<kTypeQ4_0>(rows, blocks, dec); return true;
    case kTypeQ4_1: decode_rows_32<kTypeQ4_1>(rows, blocks, dec); return true;
    case kTypeQ5_0: decode_rows_32<kTypeQ5_0>(rows, blocks, dec); return true;
    case kTypeQ5_1: decode_rows_32<kTypeQ5_1>(rows, blocks, dec); return true;
    case kTypeQ8_0: decode_rows_32<kTypeQ8_0>(rows, blocks, dec); return true;
    default: return false;
  }
}

void int8_inner_run(uint32_t type, const uint8_t* dec, int64_t blocks, const void* xt, float* y,
                    int groups) {
  const auto* xk = static_cast<const ActBlockK8*>(xt);
  const auto* x8 = static_cast<const ActBlock8*>(xt);
  if (groups == 2 ? run_k<2>(type, dec, blocks, xk, y) : run_k<1>(type, dec, blocks, xk, y))
    return;
  if (groups != 1) std::abort();  // the 32-value types run one group a pass
  switch (type) {
    case kTypeQ4_0: group8<kTypeQ4_0, 4, 1>(dec, blocks, x8, 8, y, 4); break;
    case kTypeQ4_1: group8<kTypeQ4_1, 4, 1>(dec, blocks, x8, 8, y, 4); break;
    case kTypeQ5_0: group8<kTypeQ5_0, 4, 1>(dec, blocks, x8, 8, y, 4); break;
    case kTypeQ5_1: group8<kTypeQ5_1, 4, 1>(dec, blocks, x8, 8, y, 4); break;
    case kTypeQ8_0: group8<kTypeQ8_0, 4, 1>(dec, blocks, x8, 8, y, 4); break;
    default: break;
  }
}

}  // namespace treeattn::bench
