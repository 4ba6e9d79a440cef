// What `treeattn generate` reports of a run_generation output (generation.hpp), as data: the
// per-method decode figures (p50/p99 by percentile(), measure.hpp: the one definition), the
// engine path's figures, the report's lines, and the --json document of either path (its keys
// are what bench/model/ and the tests read). The CLI prints the lines and writes the document.
//
// Part of treeattn_engine (a private header: it speaks nlohmann::json, which the installed
// headers do not).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "treeattn/generation.hpp"
#include "treeattn/status.hpp"

namespace treeattn::generation {

// The run as the command line named it (the document repeats the flags' spelling).
struct ReportLabels {
  std::string model_path;
  int ranks = 1;
  int threads = 1;  // per rank
  std::string matmul, kv_dtype;
  std::string placement, kv_layout;  // session path
  bool synthetic_kv = false;         // session path
  std::string prefill_exchange;      // engine path
  // The kernel target (isa_name: avx512, avx2, generic) and the integer kernel it runs for
  // --matmul int8 (matmul_int8_target: avx512vnni, avxvnni, avx2, generic).
  std::string isa, int8_kernel;
  std::string method_requested;  // engine path: --method as given (a name or auto)
  std::string dense_requested;   // engine path: --dense as given (split, replicated or auto)
};

// One method of the session path.
struct MethodFigures {
  double p50_ms = 0, p99_ms = 0;  // per decode step
  double tokens_per_s = 0;        // decode steps / decode seconds
  double bytes_per_token = 0;     // sent per rank per token, the largest over ranks
  double end_to_end_s = 0;        // prefill + this method's decode
};
MethodFigures method_figures(const Output& output, const MethodResult& method);

// The engine path.
struct EngineFigures {
  double decode_ms_per_token = 0;  // decode seconds over the tokens after the first
  double tokens_per_s = 0;
  double p50_ms = 0, p99_ms = 0;  // between consecutive tokens
  double prefill_tokens_per_s = 0;
};
EngineFigures engine_figures(const Output& output);

// The largest peak RSS over ranks.
uint64_t max_peak_rss(const Output& output);

// Whether a request of prompt_tokens + request.new_tokens on `ranks` ranks fits in `available`
// bytes (0: unknown, not checked) with ranks_here of them on this machine and the weights
// counted once (the page cache shares them): model::estimate_memory's KV cache and prefill
// buffers per rank; kOutOfMemory naming the parts when the need passes 90% of what is available.
Status check_memory(const model::LlamaConfig& config, const Request& request, int ranks,
                    int ranks_here, int64_t prompt_tokens, double weight_bytes, uint64_t available);

// The report on stderr: the engine path's three lines, and the session path's (the prefill, one
// line per method, the peak RSS and, when the ranks' token streams diverged, FAILED).
std::string engine_report_text(const Output& output, const std::string& merge);
std::string session_report_text(const Output& output, bool synthetic_kv, int ranks, bool diverged);

// The --json documents. merge: the engine's merge; ranks_agree: the session path's verdict on
// the ranks' token streams.
nlohmann::json engine_report_json(const Output& output, const std::string& merge,
                                  const ReportLabels& labels);
nlohmann::json session_report_json(const Output& output, const ReportLabels& labels,
                                   bool ranks_agree);
// Writes a document indented; generated text may end inside a multi-byte character, so invalid
// UTF-8 becomes U+FFFD. flag names the option in the error ("--json").
Status write_report_json(const std::string& path, const nlohmann::json& document,
                         const std::string& flag);

}  // namespace treeattn::generation
