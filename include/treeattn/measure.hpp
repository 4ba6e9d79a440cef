// Memory readings of this process for the benchmark harness: the peak resident set size, and
// resetting it so that one measured method does not inherit another's peak. Result hashes. And
// the decode session's benchmark and check surface (namespace treeattn::measure, below): several
// strategies on one cache, and the merged state records.
//
// Part of the measurement library treeattn_measure (src/measure), not of libtreeattn: nothing
// in the core library reads process memory, and a model never needs a second strategy.
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

#include "treeattn/host_memory.hpp"  // mem_available_bytes, for the callers of the pre-checks
#include "treeattn/session.hpp"
#include "treeattn/state_buffer.hpp"
#include "treeattn/status.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn {

// Peak resident set size since the process started (getrusage), in bytes; -1 if unavailable.
int64_t peak_rss_bytes();

// Resets the kernel's peak-RSS counter of this process. Returns false where /proc/self/clear_refs
// cannot be written (not Linux, or restricted); current_peak_rss() then keeps counting from start.
bool reset_peak_rss();

// Peak resident set size since the last reset_peak_rss() (or the start), in bytes.
uint64_t current_peak_rss();

// The bytes of this process's mappings of the file `path` that are resident now (the Rss of
// each of its mappings in /proc/self/smaps, summed): of a model's weights, the pages this
// process has touched. 0 where /proc is not readable or the file is not mapped.
uint64_t mapped_file_rss(const std::string& path);

// The q-quantile (q in [0, 1], clamped) of `values`, in any order; 0 for none. Linear
// interpolation between the two closest ranks: with the values sorted, v[i] + f (v[i + 1] - v[i])
// where i + f = q (n - 1) (numpy's default "linear", Hyndman and Fan's type 7): p50 of an even
// count is the mean of the middle two, p0 the minimum, p100 the maximum. The one definition
// bench, run and generate report (their p10/p50/p90/p99).
double percentile(std::span<const double> values, double q);

// SHA-256 of bytes as 64 lowercase hex digits (OpenSSL); "" if libcrypto fails.
std::string sha256_hex(std::span<const std::byte> bytes);
// The hash every JSON record of run, verify and bench carries: SHA-256 of the normalized output
// [batch][q_len][heads][head_dim] followed by the LSE [batch][q_len][heads], float32 bytes, of
// these merged states (rank 0's). Equal hashes: bitwise equal results.
std::string output_sha256(const StateBuffer& states);

// ---- the session's benchmark and check surface ------------------------------------------------
// Several strategies on one cache and the state records: what the benchmark driver (run, verify,
// bench), the tests and the Python module's Session.add_strategy / attend_states use to compare
// strategies on the very same shards. A strategy index is 0 for the session's configured
// strategy and what add_strategy returned for the others.
namespace measure {

// Collective. Sets up one more strategy on the session's placement and shards and returns its
// index. Every rank must agree on name and options (checked, with the configuration, when the
// session checks agreement). `single` cannot join a session whose placement is not
// ShardKind::kSingle.
Result<int> add_strategy(DecodeSession& session, const std::string& name,
                         const StrategyOptions& options);

// Collective. The merged state records (state.hpp) of strategy `strategy` for the queries q
// (the layout of DecodeSession::attend, in the executor's memory) instead of normalised
// outputs: host records [batch][q_len][heads][head_dim + 2] in states on any executor (resized
// to fit), written where delivers_result(session, strategy). kInvalidArgument for an index
// outside [0, strategy_count).
Status attend_states(DecodeSession& session, int layer, const float* q, StateBuffer& states,
                     int strategy = 0);

// The strategies the session holds (1 + the ones added).
int strategy_count(const DecodeSession& session);

// Strategy `index` itself (its buffer sizes, its name); 0 <= index < strategy_count(session).
Strategy& strategy_of(const DecodeSession& session, int index);

// Whether strategy `index` delivers its result on this rank (all ranks unless options.root >= 0);
// 0 <= index < strategy_count(session).
bool delivers_result(const DecodeSession& session, int index);

}  // namespace measure
}  // namespace treeattn
