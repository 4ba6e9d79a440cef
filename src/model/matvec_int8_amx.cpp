// The integer row kernel for AMX-INT8: the AVX-512 VNNI target, with the K types' batched path on
// the tile unit (matvec_int8_amx.hpp). Compiled with its own -m flags (src/model/CMakeLists.txt);
// called only where the CPU has AMX-INT8 and the kernel lets this process use the tiles
// (matvec.cpp, amx_usable).
#define TREEATTN_INT8_DOT 2
#define TREEATTN_INT8_AMX 1
#define TREEATTN_INT8_NS int8_amx
#include "model/matvec_int8_x86.hpp"

namespace treeattn::model::detail {
void rows_int8_amx(const RowsArgs& a) { int8_amx::rows_int8_impl(a); }
}  // namespace treeattn::model::detail
