// What this host can still allocate: one reading for every memory pre-check and pool size.
#pragma once

#include <cstdint>

namespace treeattn {

// MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping); 0 where it
// cannot be read. The memory pre-checks (run/bench, generate, bench --kernel, the launcher's
// rank cap) and the serving engine's default KV pool all use this one reading.
uint64_t mem_available_bytes();

}  // namespace treeattn
