// The integer row kernel for AVX2 + FMA + F16C: maddubs + madd.
// Compiled with its own -m flags (src/model/CMakeLists.txt); matvec_int8_x86.hpp has the code.
#define TREEATTN_INT8_DOT 0
#define TREEATTN_INT8_NS int8_avx2
#include "model/matvec_int8_x86.hpp"

namespace treeattn::model::detail {
void rows_int8_avx2(const RowsArgs& a) { int8_avx2::rows_int8_impl(a); }
}  // namespace treeattn::model::detail
