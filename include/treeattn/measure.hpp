// Memory readings of this process for the benchmark harness: the peak resident set size, and
// resetting it so that one measured method does not inherit another's peak.
//
// Part of the measurement library treeattn_measure (src/measure), not of libtreeattn: nothing
// in the core library reads process memory.
//
//   peak_rss_bytes()    getrusage's ru_maxrss: the peak since the process started; never reset.
//   reset_peak_rss()    Linux: writes 5 to /proc/self/clear_refs, which sets the kernel's
//                       high-water mark (VmHWM) back to the current RSS.
//   current_peak_rss()  VmHWM from /proc/self/status: the peak since the last reset_peak_rss()
//                       (or the start); peak_rss_bytes() where /proc is not readable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "treeattn/state_buffer.hpp"

namespace treeattn {

// Peak resident set size since the process started (getrusage), in bytes; -1 if unavailable.
int64_t peak_rss_bytes();

// Resets the kernel's peak-RSS counter of this process. Returns false where /proc/self/clear_refs
// cannot be written (not Linux, or restricted); current_peak_rss() then keeps counting from start.
bool reset_peak_rss();

// Peak resident set size since the last reset_peak_rss() (or the start), in bytes.
uint64_t current_peak_rss();

// MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping); 0 where it
// cannot be read. The memory pre-checks (run/bench, generate, bench --kernel, the launcher's
// rank cap) all use this one reading.
uint64_t mem_available_bytes();

// SHA-256 of bytes as 64 lowercase hex digits (OpenSSL); "" if libcrypto fails.
std::string sha256_hex(std::span<const std::byte> bytes);
// The hash every JSON record of run, verify and bench carries: SHA-256 of the normalized output
// [batch][q_len][heads][head_dim] followed by the LSE [batch][q_len][heads], float32 bytes, of
// these merged states (rank 0's). Equal hashes: bitwise equal results.
std::string output_sha256(const StateBuffer& states);

}  // namespace treeattn
