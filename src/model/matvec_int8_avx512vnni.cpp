// The integer row kernel for AVX-512 VNNI + VL (vpdpbusd on ymm, EVEX); called only when the CPU has it.
// Compiled with its own -m flags (src/model/CMakeLists.txt); matvec_int8_x86.hpp has the code.
#define TREEATTN_INT8_DOT 2
#define TREEATTN_INT8_NS int8_avx512vnni
#include "model/matvec_int8_x86.hpp"

namespace treeattn::model::detail {
void rows_int8_avx512vnni(const RowsArgs& a) { int8_avx512vnni::rows_int8_impl(a); }
}  // namespace treeattn::model::detail
