// `treeattn generate`: text generation with a Llama GGUF model whose KV cache is sharded over P
// ranks (include/treeattn/generate.hpp): prefill across the ranks, then decode with the chosen
// strategy merging the ranks' partial attention states at every layer.
//
// From a plain shell, --ranks P > 1 re-executes this program under mpirun (launcher.hpp), one
// rank is run in this process; under an existing mpirun/srun the job's world is used. Everything
// that can be checked before a rank starts is checked here first: the model file (architecture,
// tensor types), the prompt, --ranks against the prompt, the memory the KV cache and the prefill
// need against what the machine has.
//
// Rank 0 streams the text on stdout as it is produced; progress and the report go to stderr:
// time to first token, prefill tokens/s, decode ms per token (p50, p99), tokens/s, bytes sent
// per rank per token, peak RSS per rank. With several methods (--method tree,ring-kv,single) the
// first streams, then each other decodes the same number of tokens from the same prefill and
// the report compares them (the benchmark mode of bench/model/).
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cluster.hpp"
#include "engine/exchange.hpp"
#include "engine/merge.hpp"
#include "commands.hpp"
#include "job_status.hpp"
#include "launcher.hpp"
#include "options.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/generate.hpp"
#include "treeattn/generation.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/model.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct GenFlags {
  std::string model;
  std::string prompt, prompt_file;
  int64_t prompt_tokens = 0;
  int64_t new_tokens = 64;
  int ranks = 1;
  std::string method = "tree";
  std::string kv_dtype = "f16";
  std::string placement = "even";
  std::string kv_layout = "auto";
  bool chat = false;
  std::string system;  // with --chat; not given: the model's template's default (Tokenizer)
  bool system_given = false;
  std::string json;
  bool deterministic = false;
  double temperature = 0.0;
  int top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 1;
  int threads = 0;
  std::string matmul = "int8";  // --matmul: exact | int8 (model::MatmulMode)
  bool check = false;
  bool ignore_eos = false;
  bool quiet = false;
  bool synthetic_kv = false;
  bool engine = false;   // --engine, or chosen by choose_path()
  bool session = false;  // --session
  std::string device = "cpu";  // --device: the model runs on CPU ranks only
  std::string kv_memory;
  std::string prefill_exchange = "auto";  // --engine: pass-q | kv | auto
  int timeout_ms = 600000;
  int fanout = 2;
};

std::vector<std::string> methods_of(const GenFlags& f) {
  if (f.deterministic) return {std::string(deterministic_strategy())};
  return split_list(f.method);
}

generation::PromptSpec prompt_of(const GenFlags& f) {
  generation::PromptSpec p;
  p.text = f.prompt;
  p.file = f.prompt_file;
  p.synthetic_tokens = f.prompt_tokens;
  p.chat = f.chat;
  if (f.system_given) p.system = f.system;
  p.seed = f.seed;
  return p;
}

// The library's request from the flags (checked by preflight).
generation::Request request_of(const GenFlags& f, const std::string& model_path, int threads) {
  generation::Request r;
  r.model_path = model_path;
  r.prompt = prompt_of(f);
  r.new_tokens = f.new_tokens;
  r.ignore_eos = f.ignore_eos;
  r.sampling = {f.temperature, f.top_k, f.top_p, f.seed};
  r.matmul = *model::parse_matmul_mode(f.matmul);
  r.kv_dtype = *parse_dtype(f.kv_dtype);
  r.threads = threads;
  r.timeout = std::chrono::milliseconds(f.timeout_ms);
  r.engine = f.engine;
  r.methods = f.engine ? std::vector<std::string>{f.method} : methods_of(f);
  if (!f.kv_memory.empty()) r.kv_memory = static_cast<std::size_t>(*parse_bytes(f.kv_memory));
  r.prefill_exchange = f.prefill_exchange;
  r.placement = *parse_shard_kind(f.placement);
  r.kv_layout = *parse_kv_layout(f.kv_layout);
  r.fanout = f.fanout;
  r.synthetic_kv = f.synthetic_kv;
  r.check = f.check;
  return r;
}

// Which path decodes: the serving engine (paged KV, chunked prefill by the tree merge; what
// `treeattn serve` runs) unless the flags ask for what only the DecodeSession path has: a
// strategy other than the engine's merges (tree, allreduce, allgather) or a comma list to
// compare, tree-det (--deterministic), a synthetic KV cache, a placement, a KV layout, hier's
// fan-out or the per-step token hash (--check). --session forces the DecodeSession path,
// --engine the engine (and then refuses those flags). Every rank decides from the same flags.
void choose_path(GenFlags& f, const CLI::App& sub) {
  if (f.engine || f.session) return;
  const auto methods = methods_of(f);
  const bool engine_merge = methods.size() == 1 && engine::parse_merge(methods[0]).is_ok();
  f.engine = engine_merge && !f.deterministic && !f.synthetic_kv && !f.check &&
             sub.count("--placement") == 0 && sub.count("--kv-layout") == 0 &&
             sub.count("--fanout") == 0;
}

// Everything checkable before ranks start (output files: by one process only). On success: the
// model path.
Result<std::string> preflight(const GenFlags& f, const CLI::App& sub, bool check_outputs) {
  const int sources = (sub.count("--prompt") > 0) + (sub.count("--prompt-file") > 0) +
                      (sub.count("--prompt-tokens") > 0);
  if (sources != 1)
    return invalid_argument(
        "give exactly one of --prompt TEXT, --prompt-file FILE or "
        "--prompt-tokens N");
  if (sub.count("--prompt-tokens") > 0 && f.prompt_tokens < 1)
    return invalid_argument("--prompt-tokens must be >= 1");
  if (f.new_tokens < 1) return invalid_argument("--new-tokens must be >= 1");
  if (f.synthetic_kv && sub.count("--prompt-tokens") == 0)
    return invalid_argument("--synthetic-kv needs --prompt-tokens N (a context to time decode at)");
  if (f.ranks < 1 || f.ranks > 4096) return invalid_argument("--ranks must be in 1..4096");
  const auto dt = parse_dtype(f.kv_dtype);
  if (!dt || dtype_is_quantized(*dt))
    return invalid_argument("--kv-dtype '" + f.kv_dtype + "': one of f16, bf16, f32");
  if (auto l = parse_kv_layout(f.kv_layout); !l.is_ok())
    return invalid_argument("--kv-layout: " + l.status().message());
  const auto pk = parse_shard_kind(f.placement);
  if (!pk.is_ok() ||
      (*pk != ShardKind::kEven && *pk != ShardKind::kUneven && *pk != ShardKind::kStriped))
    return invalid_argument("--placement '" + f.placement + "': one of even, uneven, striped");
  const auto& reg = StrategyRegistry::for_backend(CommCapabilities{});
  const auto methods = methods_of(f);
  if (methods.empty()) return invalid_argument("--method: empty");
  if (f.engine && f.session) return invalid_argument("give --engine or --session, not both");
  if (auto d = parse_device(f.device); !d.is_ok())
    return d.status();
  else if (*d != Device::kCpu)
    return unsupported("--device " + f.device +
                       ": generate runs the model's forward pass and its KV cache on CPU ranks; "
                       "GPU ranks decode attention in run, bench and verify (--device cuda)");
  if (f.engine) {
    for (const char* flag : {"--placement", "--kv-layout", "--fanout"})
      if (sub.count(flag) > 0)
        return invalid_argument(std::string("--engine does not take ") + flag +
                                " (the engine places pages itself; --session decodes with a placement)");
    if (f.deterministic)
      return invalid_argument("--engine does not take --deterministic (tree-det runs with --session)");
    if (f.check) return invalid_argument("--engine does not take --check (use --session)");
    if (methods.size() != 1 || !engine::parse_merge(methods[0]).is_ok())
      return invalid_argument("--engine: --method is the engine's merge, one of tree, allreduce, "
                              "allgather (not '" + f.method + "')");
    if (f.synthetic_kv) return invalid_argument("--engine does not take --synthetic-kv");
    if (!f.kv_memory.empty()) {
      auto b = parse_bytes(f.kv_memory);
      if (!b.is_ok()) return Status(b.status().code(), "--kv-memory: " + b.status().message());
    }
    if (auto x = engine::parse_exchange(f.prefill_exchange); !x.is_ok())
      return Status(x.status().code(), "--prefill-exchange: " + x.status().message());
  } else if (!f.kv_memory.empty()) {
    return invalid_argument("--kv-memory is the engine's (not with --session or flags that imply it)");
  } else if (f.prefill_exchange != "auto") {
    return invalid_argument("--prefill-exchange is the engine's (not with --session or flags that "
                            "imply it; the session's prefill always moves K/V)");
  }
  for (const auto& m : methods)
    if (!f.engine && m != "auto" && !reg.contains(m)) {
      std::string known;
      for (const auto& i : reg.list()) known += std::string(i.name) + ", ";
      return invalid_argument("--method: unknown method '" + m + "' (known: " + known +
                              "tree-det, auto)");
    }
  if (f.deterministic && f.placement == "striped" &&
      reg.info(deterministic_strategy())->placement == PlacementNeed::kContiguous)
    return invalid_argument(
        "--deterministic (tree-det) needs a contiguous placement, not "
        "--placement striped");
  model::SamplingParams sp{f.temperature, f.top_k, f.top_p, f.seed};
  TREEATTN_RETURN_IF_ERROR(sp.validate());
  TREEATTN_RETURN_IF_ERROR(check_timeout_ms("--timeout-ms", f.timeout_ms));
  TREEATTN_RETURN_IF_ERROR(check_thread_count(f.threads, "--threads"));
  if (auto mm = model::parse_matmul_mode(f.matmul); !mm.is_ok())
    return invalid_argument("--matmul " + f.matmul + ": expected exact or int8");
  if (!f.prompt_file.empty()) TREEATTN_RETURN_IF_ERROR(generation::check_prompt_file(f.prompt_file));
  if (check_outputs && !f.json.empty())
    TREEATTN_RETURN_IF_ERROR(check_output_file("--json", f.json));
  auto path = resolve_model(f.model);
  if (!path.is_ok()) return path.status();
  auto m = model::LlamaModel::load(*path);
  if (!m.is_ok()) return m.status();
  auto tok = Tokenizer::from_gguf((*m)->file());
  if (!tok.is_ok()) return tok.status();
  // Memory first (a synthetic prompt's length is known before it is built): estimated before
  // anything is allocated, for the ranks on this machine.
  std::vector<TokenId> prompt;
  if (f.prompt_tokens == 0) {
    auto p = generation::make_prompt(prompt_of(f), *tok);
    if (!p.is_ok()) return p.status();
    prompt = std::move(p).value();
  }
  const int64_t n = f.prompt_tokens > 0 ? f.prompt_tokens : static_cast<int64_t>(prompt.size());
  const auto& cfg = (*m)->config();
  const int here = f.ranks;  // local launches put every rank here
  const auto est =
      model::estimate_memory(cfg, generation::generator_config(request_of(f, *path, 1)), f.ranks, n,
                             f.new_tokens);
  const double weights = static_cast<double>((*m)->file().file_size());  // shared page cache
  const double need = static_cast<double>(est.total()) * here + weights;
  const uint64_t avail = mem_available_bytes();
  if (avail > 0 && need > 0.9 * static_cast<double>(avail))
    return Status(Code::kOutOfMemory,
                  fmt::format("a prompt of {} tokens + {} new on {} rank(s) needs about {} "
                              "({} of KV cache and {} of prefill buffers per rank, {} of "
                              "weights); this machine has {} available. Use fewer tokens, "
                              "--kv-dtype bf16/f16, or more machines",
                              n, f.new_tokens, f.ranks, format_bytes(need),
                              format_bytes(static_cast<double>(est.kv_bytes)),
                              format_bytes(static_cast<double>(est.prefill_bytes)),
                              format_bytes(weights), format_bytes(static_cast<double>(avail))));
  if (f.ranks > n && !f.engine)  // the engine's ranks may hold no page
    return invalid_argument(fmt::format(
        "--ranks {} is larger than the prompt ({} tokens): every rank holds part of the "
        "prompt's KV cache; use at most {} ranks or a longer prompt",
        f.ranks, n, n));
  if (cfg.n_ctx_train > 0 && n + f.new_tokens > cfg.n_ctx_train && !started_by_mpi_launcher())
    std::fprintf(stderr,
                 "treeattn generate: note: %lld tokens is beyond the model's training context "
                 "(%lld); RoPE positions past it degrade the text (timing is unaffected)\n",
                 static_cast<long long>(n + f.new_tokens), static_cast<long long>(cfg.n_ctx_train));
  return path;
}

int say_error(const Communicator& comm, const Status& s) {
  std::fprintf(stderr, "treeattn generate: rank %d: error: %s\n", comm.rank(),
               s.to_string().c_str());
  return 2;
}

std::string isa_label(int threads) {
  return std::string(isa_name(model::matmul_isa({threads, Isa::kAuto})));
}

// The report of the engine path (rank 0).
int report_engine(const GenFlags& f, const std::string& model_path,
                  const generation::Output& o, const std::string& merge, int threads, int P) {
  const auto n = static_cast<int64_t>(o.prompt.size());
  const std::size_t count = o.tokens.size();
  const double decode_ms =
      count > 1 ? o.decode_seconds * 1e3 / static_cast<double>(count - 1) : 0.0;
  uint64_t max_rss = 0;
  std::string rss_list;
  for (uint64_t r : o.peak_rss_by_rank) {
    max_rss = std::max(max_rss, r);
    rss_list += (rss_list.empty() ? "" : " ") + format_bytes(static_cast<double>(r));
  }
  std::fprintf(stderr,
               "prompt %lld tokens (%lld from the prefix cache): time to first token %.1f ms "
               "(prefill %.0f tokens/s)\n"
               "decode %s (engine) %zu tokens: %.2f ms/token p50, %.2f p99, %.1f tokens/s | "
               "rank 0 sent %s/token in %lld merges in all\n"
               "peak RSS per rank: %s (includes the mapped weights, shared between ranks)\n",
               static_cast<long long>(n), static_cast<long long>(o.cached_tokens), o.ttft_ms,
               static_cast<double>(n) / std::max(1e-9, o.prefill_seconds), merge.c_str(), count,
               percentile(o.token_ms, 0.5), percentile(o.token_ms, 0.99),
               decode_ms > 0 ? 1e3 / decode_ms : 0.0, format_bytes(o.bytes_per_token).c_str(),
               static_cast<long long>(o.merges), rss_list.c_str());
  if (f.json.empty()) return 0;
  nlohmann::json j = {{"model", model_path},
                      {"model_config", o.config_text},
                      {"engine", true},
                      {"prompt_tokens", o.prompt},
                      {"tokens", o.tokens},
                      {"text", o.text},
                      {"ranks", P},
                      {"threads_per_rank", threads},
                      {"matmul", f.matmul},
                      {"method", merge},
                      {"prefill_exchange", f.prefill_exchange},
                      {"rows_kv_exchange", o.rows_kv_exchange},
                      {"rows_pass_q", o.rows_pass_q},
                      {"kv_dtype", f.kv_dtype},
                      {"ttft_ms", o.ttft_ms},
                      {"prefill_ms", o.prefill_seconds * 1e3},
                      {"prefill_tokens_per_s",
                       static_cast<double>(n) / std::max(1e-9, o.prefill_seconds)},
                      {"cached_tokens", o.cached_tokens},
                      {"decode_ms_per_token", decode_ms},
                      {"decode_ms", o.token_ms},
                      {"decode_ms_p50", percentile(o.token_ms, 0.5)},
                      {"decode_ms_p99", percentile(o.token_ms, 0.99)},
                      {"tokens_per_s", decode_ms > 0 ? 1e3 / decode_ms : 0.0},
                      {"bytes_sent_per_rank_per_token", o.bytes_per_token},
                      {"bytes_sent_per_token_of", "rank 0, decode steps"},
                      {"bytes_sent_rank0", o.bytes_sent_rank0},
                      {"bytes_sent_by_rank", o.bytes_sent_by_rank},
                      {"peak_rss_bytes", max_rss},
                      {"peak_rss_bytes_by_rank", o.peak_rss_by_rank}};
  std::ofstream out(f.json);
  out << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  if (!out) return fail("generate", invalid_argument("--json " + f.json + ": write failed"));
  return 0;
}

// The report of the session path (rank 0); rc: 3 when the ranks' streams diverged.
int report_session(const GenFlags& f, const std::string& model_path,
                   const generation::Output& o, int threads, int P, int rc) {
  const auto n = static_cast<int64_t>(o.prompt.size());
  const model::PrefillStats& ps = o.prefill;
  std::string busy_list, rss_list;
  uint64_t max_rss = 0;
  for (double b : o.prefill_busy_s_by_rank)
    busy_list += fmt::format("{}{:.2f}", busy_list.empty() ? "" : " ", b);
  for (uint64_t r : o.peak_rss_by_rank) {
    max_rss = std::max(max_rss, r);
    rss_list += (rss_list.empty() ? "" : " ") + format_bytes(static_cast<double>(r));
  }
  if (f.synthetic_kv)
    std::fprintf(stderr,
                 "\nprompt %lld tokens: synthetic KV cache (not computed, %.2f s to fill)\n",
                 static_cast<long long>(n), o.prefill_s);
  else
    std::fprintf(stderr,
                 "\nprompt %lld tokens: prefill %.2f s (%.1f tokens/s, attention %.2f s, waiting "
                 "%.2f s on rank 0), time to first token %.1f ms\n",
                 static_cast<long long>(n), o.prefill_s, static_cast<double>(n) / o.prefill_s,
                 ps.attention_seconds, ps.wait_seconds, o.ttft_ms);
  if (!f.synthetic_kv && P > 1)
    std::fprintf(stderr,
                 "prefill busy s per rank (computing, not waiting): %s; sent %s by rank 0\n",
                 busy_list.c_str(), format_bytes(static_cast<double>(ps.bytes_sent)).c_str());
  nlohmann::json jm = nlohmann::json::array();
  for (std::size_t k = 0; k < o.methods.size(); ++k) {
    const generation::MethodResult& r = o.methods[k];
    const double p50 = percentile(r.step_ms, 0.5), p99 = percentile(r.step_ms, 0.99);
    const double tps = r.step_ms.empty() ? 0.0 : static_cast<double>(r.step_ms.size()) / r.decode_s;
    const double bpt = r.bytes_sent_per_token_by_rank.empty()
                           ? 0.0
                           : *std::max_element(r.bytes_sent_per_token_by_rank.begin(),
                                               r.bytes_sent_per_token_by_rank.end());
    std::string agree;
    if (k > 0)
      agree = r.first_diff < 0
                  ? ", same tokens as " + o.methods[0].method
                  : fmt::format(", differs from {} at token {}", o.methods[0].method, r.first_diff);
    std::fprintf(stderr,
                 "decode %-11s %zu tokens: %.2f ms/token p50, %.2f p99, %.1f tokens/s | sent "
                 "%s/rank/token (max) | end-to-end %.2f s%s\n",
                 r.method.c_str(), r.step_ms.size(), p50, p99, tps, format_bytes(bpt).c_str(),
                 o.prefill_s + r.decode_s, agree.c_str());
    jm.push_back({{"method", r.method},
                  {"tokens", r.tokens},
                  {"decode_steps", r.step_ms.size()},
                  {"decode_ms", r.step_ms},
                  {"decode_ms_p50", p50},
                  {"decode_ms_p99", p99},
                  {"tokens_per_s", tps},
                  {"decode_s", r.decode_s},
                  {"end_to_end_s", o.prefill_s + r.decode_s},
                  {"bytes_sent_per_rank_per_token", bpt},
                  {"bytes_sent_per_token_by_rank", r.bytes_sent_per_token_by_rank},
                  {"first_token_differing_from_method0", r.first_diff}});
  }
  std::fprintf(stderr,
               "peak RSS per rank: %s (includes the mapped weights, shared between ranks)\n",
               rss_list.c_str());
  if (rc != 0) std::fprintf(stderr, "FAILED: the ranks' token streams diverged\n");
  if (f.json.empty()) return rc;
  const generation::MethodResult& r0 = o.methods[0];
  nlohmann::json j = {
      {"model", model_path},
      {"model_config", o.config_text},
      {"prompt_tokens", o.prompt},
      {"tokens", r0.tokens},
      {"text", o.text},
      {"ranks", P},
      {"threads_per_rank", threads},
      {"matmul", f.matmul},
      {"method", r0.method},
      {"kv_dtype", f.kv_dtype},
      {"placement", f.placement},
      {"kv_layout", f.kv_layout},
      {"ttft_ms", o.ttft_ms},
      {"prefill_ms", o.prefill_s * 1e3},
      {"synthetic_kv", f.synthetic_kv},
      {"prefill_tokens_per_s", static_cast<double>(n) / o.prefill_s},
      {"prefill_bytes_sent_rank0", ps.bytes_sent},
      {"prefill_busy_s_by_rank", o.prefill_busy_s_by_rank},
      {"prefill_attention_s_by_rank", o.prefill_attention_s_by_rank},
      {"prefill_positions_by_rank", o.prefill_positions_by_rank},
      {"decode_ms_p50", jm[0]["decode_ms_p50"]},
      {"decode_ms_p99", jm[0]["decode_ms_p99"]},
      {"tokens_per_s", jm[0]["tokens_per_s"]},
      {"bytes_sent_per_rank_per_token", jm[0]["bytes_sent_per_rank_per_token"]},
      {"peak_rss_bytes", max_rss},
      {"peak_rss_bytes_by_rank", o.peak_rss_by_rank},
      {"token_stream_hash", fmt::format("{:016x}", o.token_hash)},
      {"ranks_agree", rc == 0},
      {"methods", jm},
  };
  std::ofstream out(f.json);
  // Generated text may end inside a multi-byte character: invalid UTF-8 becomes U+FFFD.
  out << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  if (!out) rc = fail("generate", invalid_argument("--json " + f.json + ": write failed"));
  return rc;
}

// The job: every rank runs this with its communicator (generation.hpp does the work).
int run_job(Communicator& comm, const GenFlags& f, const std::string& model_path) {
  const bool lead = comm.rank() == 0;
  const int P = comm.size();
  const int threads = f.threads > 0 ? f.threads : default_threads(local_ranks(P));
  generation::Request req = request_of(f, model_path, threads);
  if (!f.engine) {
    auto jt = job_topology("", "", "", P);
    if (!jt.is_ok()) return say_error(comm, jt.status());
    req.topology = jt->topology;
    req.ranks_per_node = jt->ranks_per_node;
  }
  generation::Hooks hooks;
  hooks.phase = [](const std::string& what) { rank_status_phase(what); };
  hooks.step = [](int64_t i) { rank_status_step(i); };
  hooks.planned = [](const StrategyChoice& c) { announce_auto(c); };
  int64_t n = 0;
  hooks.started = [&](const generation::Start& s) {
    n = s.prompt_tokens;
    std::string methods;
    for (const auto& x : s.methods) methods += (methods.empty() ? "" : ",") + x;
    if (f.engine)
      std::fprintf(stderr,
                   "treeattn generate (engine): %s | %d rank(s) x %d thread(s), matmul %s %s | "
                   "merge %s | KV %s pages of %lld tokens, %lld per rank | prompt %lld tokens, "
                   "up to %lld new\n",
                   s.config->to_string().c_str(), P, threads, isa_label(threads).c_str(),
                   f.matmul.c_str(), methods.c_str(), f.kv_dtype.c_str(),
                   static_cast<long long>(s.page_tokens), static_cast<long long>(s.pages_per_rank),
                   static_cast<long long>(n), static_cast<long long>(f.new_tokens));
    else
      std::fprintf(stderr,
                   "treeattn generate: %s | %d rank(s) x %d thread(s), matmul %s %s | method %s "
                   "| KV %s (%s placement, %s layout) | prompt %lld tokens, up to %lld new\n",
                   s.config->to_string().c_str(), P, threads, isa_label(threads).c_str(),
                   f.matmul.c_str(), methods.c_str(), f.kv_dtype.c_str(), f.placement.c_str(),
                   f.kv_layout.c_str(), static_cast<long long>(n),
                   static_cast<long long>(f.new_tokens));
  };
  const bool tty = isatty(2) != 0;
  double last_print = -1e9;
  hooks.prefill_layer = [&](int l, int layers, double s) {
    if (n < 2048) return;
    if (l < layers && s - last_print < 2.0) return;
    last_print = s;
    std::fprintf(stderr, "%sprefill: layer %d/%d, %.1f s, about %.0f s left%s", tty ? "\r" : "",
                 l, layers, s, s / l * (layers - l), tty ? (l == layers ? "\n" : "") : "\n");
    std::fflush(stderr);
  };
  if (!f.quiet)
    hooks.text = [](std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    };
  const generation::Output o = generation::run_generation(comm, req, hooks);
  if (!o.status.is_ok()) {
    say_error(comm, o.status);
    if (o.must_abort) abort_job(3, "");
    return 2;
  }
  if (o.check_divergence) {
    const generation::Divergence& d = *o.check_divergence;
    if (lead)
      std::fprintf(stderr,
                   "\ntreeattn generate: DIVERGENCE: after %zu tokens rank %d's token stream "
                   "(hash %016llx) differs from rank 0's (%016llx)\n",
                   d.tokens, d.rank, static_cast<unsigned long long>(d.hash),
                   static_cast<unsigned long long>(d.hash_rank0));
    return 3;
  }
  if (f.engine && (!lead || o.tokens.empty())) return lead ? 2 : 0;
  if (lead && !f.quiet) {
    std::printf("\n");
    std::fflush(stdout);  // the text before the report on stderr
  }
  if (f.engine) return report_engine(f, model_path, o, req.methods.front(), threads, P);
  int rc = 0;
  for (int q = 1; q < P; ++q)
    if (o.token_hash_by_rank[static_cast<std::size_t>(q)] != o.token_hash_by_rank[0]) {
      if (lead)
        std::fprintf(stderr,
                     "treeattn generate: DIVERGENCE: rank %d's token stream differs from "
                     "rank 0's (hashes %016llx vs %016llx)\n",
                     q, static_cast<unsigned long long>(o.token_hash_by_rank[static_cast<std::size_t>(q)]),
                     static_cast<unsigned long long>(o.token_hash_by_rank[0]));
      rc = 3;
    }
  if (!lead) return rc;
  return report_session(f, model_path, o, threads, P, rc);
}


int generate_command(GenFlags& f, const CLI::App& sub, const Invocation& inv) {
  choose_path(f, sub);
  if (started_by_mpi_launcher()) {
    auto world = mpi_init_world(nullptr, nullptr);
    if (!world.is_ok()) return fail("generate", world.status());
    int rc = 2;
    {
      std::unique_ptr<Communicator> comm = std::move(world).value();
      // Checked on every rank (the job may come from an outside mpirun): all or none go on.
      auto path = preflight(f, sub, comm->rank() == 0);
      float bad = path.is_ok() ? 0.0f : 1.0f;
      if (path.is_ok() && sub.count("--ranks") > 0 && f.ranks != comm->size()) {
        if (comm->rank() == 0)
          std::fprintf(stderr,
                       "treeattn generate: error: --ranks %d but the MPI job has %d ranks\n",
                       f.ranks, comm->size());
        bad = 1.0f;
      }
      if (!comm->allreduce(&bad, 1, ReduceOp::kMax).is_ok() || bad != 0.0f) {
        if (comm->rank() == 0 && !path.is_ok()) fail("generate", path.status());
      } else {
        rc = run_job(*comm, f, *path);
      }
    }
    (void)mpi_finalize();
    return rc;
  }
  auto path = preflight(f, sub, true);
  if (!path.is_ok()) return fail("generate", path.status());
  if (f.ranks == 1) {
    auto world = make_local_world(1);
    if (!world.is_ok()) return fail("generate", world.status());
    return run_job(*world.value()[0], f, *path);
  }
  LaunchOptions lo;
  lo.ranks = f.ranks;
  lo.who = "treeattn generate";
  if (Status s = check_local_rank_count(lo, "--ranks"); !s.is_ok()) return fail("generate", s);
  std::vector<std::string> args = inv.args;
  if (f.model.empty()) args.insert(args.end(), {"--model", *path});
  auto rc = run_under_mpirun(lo, args);
  if (!rc.is_ok()) return fail("generate", rc.status());
  if (const int sig = interrupted_by(); sig != 0) {
    std::fprintf(stderr, "treeattn generate: interrupted by signal %d (%s); the %d-rank job was "
                 "stopped\n", sig, strsignal(sig), f.ranks);
    return 128 + sig;
  }
  return rc.value();
}

}  // namespace

Runner add_generate_command(CLI::App& app, const Invocation& inv) {
  auto* sub = app.add_subcommand(
      "generate",
      "Generate text with a Llama GGUF model (default: the shipped SmolLM2-135M-"
      "Instruct) whose KV cache is sharded over P ranks: one request of the serving engine, "
      "or with --session a decode through any strategy");
  auto f = std::make_shared<GenFlags>();
  add_model_option(*sub, f->model);
  sub->add_option("--prompt", f->prompt, "Prompt text");
  sub->add_option("--prompt-file", f->prompt_file, "Read the prompt from a file");
  sub->add_option("--prompt-tokens", f->prompt_tokens,
                  "A synthetic prompt of N tokens (seeded draws of normal tokens), for timing");
  sub->add_option("--new-tokens", f->new_tokens, "Tokens to generate (fewer if the model ends)")
      ->capture_default_str();
  sub->add_option("--ranks", f->ranks, "Ranks (from a plain shell, P > 1 starts them with mpirun)")
      ->capture_default_str();
  sub->add_option("--method,--methods", f->method,
                  "Decode strategy: tree, tree-paper, tree2, hier, ring-kv, ring-state, "
                  "allgather, gather-root, single, tree-det, auto; a comma list decodes each from "
                  "the same prefill (the first streams) and compares them")
      ->capture_default_str();
  sub->add_option("--kv-dtype", f->kv_dtype, "KV cache element type: f16, bf16, f32")
      ->capture_default_str();
  sub->add_option("--placement", f->placement,
                  "KV placement over ranks: even, uneven, striped (single: always rank 0)")
      ->capture_default_str();
  sub->add_option("--kv-layout", f->kv_layout,
                  "How ranks store the KV cache: auto (the layout this CPU's kernel reads "
                  "fastest: tiled on AVX-512, rows on AVX2), rows or tiled")
      ->capture_default_str();
  sub->add_flag("--chat", f->chat,
                "Wrap the prompt in the model's chat format (ChatML, Gemma's turns, or for a "
                "base model without a chat template a 'User: ... Assistant:' transcript)");
  sub->add_option("--system", f->system,
                  "System message with --chat (default: the one the model's chat template "
                  "inserts, e.g. SmolLM2's or Qwen2.5's; --system '' for none)")
      ->each([f](const std::string&) { f->system_given = true; });
  sub->add_option("--json", f->json, "Write the tokens, text and timings as JSON");
  sub->add_flag("--deterministic", f->deterministic,
                "Decode with tree-det: the same bits (and tokens) for any rank count");
  sub->add_option("--temperature", f->temperature, "0: greedy; else sample")->capture_default_str();
  sub->add_option("--top-k", f->top_k, "Sample among the k most likely (0: all)")
      ->capture_default_str();
  sub->add_option("--top-p", f->top_p, "Nucleus sampling mass")->capture_default_str();
  sub->add_option("--seed", f->seed, "Sampling and synthetic-prompt seed")->capture_default_str();
  sub->add_option("--threads", f->threads, "Threads per rank (0: cores / ranks on the host)")
      ->capture_default_str();
  sub->add_option("--matmul", f->matmul,
                  "Quantized weights: int8 (activations quantized to 8 bits per 32, integer dot "
                  "products) or exact (float activations; the tested reference)")
      ->capture_default_str();
  sub->add_flag("--check", f->check,
                "Hash the token stream on every rank at every step and stop on a divergence");
  sub->add_flag("--engine", f->engine,
                "Run the prompt as one request of the serving engine (paged KV, chunked prefill "
                "by the tree merge; what `treeattn serve` runs); --method is then the engine's "
                "merge: tree, allreduce or allgather. The default, unless a flag below needs "
                "the DecodeSession path");
  sub->add_option("--device", f->device,
                  "Where the ranks run the model: cpu (the only one for models so far)")
      ->capture_default_str();
  sub->add_flag("--session", f->session,
                "Decode on the DecodeSession with a strategy instead of the engine; implied by a "
                "strategy other than tree/allreduce/allgather, a comma list, --deterministic, "
                "--synthetic-kv, --placement, --kv-layout, --fanout and --check");
  sub->add_option("--prefill-exchange", f->prefill_exchange,
                  "--engine: how a prompt chunk's attention crosses the ranks: pass-q (its queries "
                  "travel, one merge per layer), kv (the cached K/V travels), auto (per chunk, "
                  "fewer bytes; same bits either way)")
      ->capture_default_str();
  sub->add_option("--kv-memory", f->kv_memory,
                  "--engine: KV page memory per rank, e.g. 2G (default: what the prompt needs)");
  sub->add_flag("--ignore-eos", f->ignore_eos, "Generate --new-tokens even past end of text");
  sub->add_flag("--quiet", f->quiet, "Do not print the text (report only)");
  sub->add_flag("--synthetic-kv", f->synthetic_kv,
                "Benchmarks: fill the prompt's KV cache with seeded values instead of computing "
                "the prefill (with --prompt-tokens; decode speed is real, the text is not)");
  sub->add_option("--timeout-ms", f->timeout_ms,
                  "Per communicator operation (a long prefill layer waits in one)")
      ->capture_default_str();
  sub->add_option("--fanout", f->fanout, "hier: children per leader")->capture_default_str();
  return [f, sub, &inv] { return generate_command(*f, *sub, inv); };
}

}  // namespace treeattn::cli
