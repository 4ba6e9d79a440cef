// The integer row kernel for AVX-VNNI (vpdpbusd on ymm, VEX); called only when the CPU has it.
// Compiled with its own -m flags (src/model/CMakeLists.txt); matvec_int8_x86.hpp has the code.
#define TREEATTN_INT8_DOT 1
#define TREEATTN_INT8_NS int8_avxvnni
#include "model/matvec_int8_x86.hpp"

namespace treeattn::model::detail {
void rows_int8_avxvnni(const RowsArgs& a) { int8_avxvnni::rows_int8_impl(a); }
}  // namespace treeattn::model::detail
