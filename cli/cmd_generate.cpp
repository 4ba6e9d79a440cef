// `treeattn generate`: text generation with a Llama GGUF model whose KV cache is sharded over P
// ranks (include/treeattn/generate.hpp): prefill across the ranks, then decode with the chosen
// strategy merging the ranks' partial attention states at every layer.
//
// From a plain shell, --ranks P > 1 re-executes this program under mpirun (launch.hpp), one
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
#include <memory>

#include "cluster.hpp"
#include "commands.hpp"
#include "engine/dense_plan.hpp"
#include "engine/exchange.hpp"
#include "engine/generation_report.hpp"
#include "engine/layer_merge.hpp"
#include "options.hpp"
#include "tuning.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/generate.hpp"
#include "treeattn/generation.hpp"
#include "treeattn/job_status.hpp"
#include "treeattn/launch.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/model.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::cli {
namespace {

struct GenFlags {
  std::string model;
  std::string prompt, prompt_file;
  int64_t prompt_tokens = 0;
  int64_t new_tokens = 64;
  int ranks = 1;
  std::string method = "auto";
  std::string topology;  // --topology: what auto plans on (file or preset; default the job's)
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
  std::string isa = "auto";
  std::string matmul;  // --matmul: exact | int8 | int8-ffn; "" until preflight: the model's
  bool check = false;
  bool no_rows8 = false;
  bool ignore_eos = false;
  bool quiet = false;
  bool no_tune = false;  // --no-tune
  bool synthetic_kv = false;
  bool engine = false;         // --engine, or chosen by choose_path()
  bool session = false;        // --session
  std::string device = "cpu";  // --device: the model runs on CPU ranks only
  std::string kv_memory;
  int64_t kv_window_pages = -1;           // --engine: EngineConfig::kv_window_pages
  std::string prefill_exchange = "auto";  // --engine: pass-q | kv | auto
  std::string dense = "auto";             // --engine: split | replicated | auto
  bool hash_logits = false;               // --engine: --hash-logits
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

model::SamplingParams sampling_of(const GenFlags& f) {
  model::SamplingParams sp;
  sp.temperature = f.temperature;
  sp.top_k = f.top_k;
  sp.top_p = f.top_p;
  sp.seed = f.seed;
  return sp;
}

// The library's request from the flags (checked by preflight).
generation::Request request_of(const GenFlags& f, const std::string& model_path, int threads) {
  generation::Request r;
  r.model_path = model_path;
  r.prompt = prompt_of(f);
  r.new_tokens = f.new_tokens;
  r.ignore_eos = f.ignore_eos;
  r.sampling = sampling_of(f);
  r.matmul = *model::parse_matmul_mode(f.matmul);
  r.isa = *isa_for_flag(f.isa);
  r.rows8 = !f.no_rows8;
  r.kv_dtype = *parse_dtype(f.kv_dtype);
  r.threads = threads;
  r.timeout = std::chrono::milliseconds(f.timeout_ms);
  r.engine = f.engine;
  r.methods = f.engine ? std::vector<std::string>{f.method} : methods_of(f);
  if (!f.kv_memory.empty()) r.kv_memory = static_cast<std::size_t>(*parse_bytes(f.kv_memory));
  r.kv_window_pages = f.kv_window_pages;
  r.prefill_exchange = f.prefill_exchange;
  r.dense = f.dense;
  r.hash_logits = f.hash_logits;
  r.topology_file = f.topology;
  r.placement = *parse_shard_kind(f.placement);
  r.kv_layout = *parse_kv_layout(f.kv_layout);
  r.fanout = f.fanout;
  r.synthetic_kv = f.synthetic_kv;
  r.check = f.check;
  return r;
}

// One strategy the serving engine can merge with (engine::merge_methods), or auto.
bool is_engine_merge(const std::string& m) {
  const auto known = engine::merge_methods(CommCapabilities{});
  return m == "auto" || std::find(known.begin(), known.end(), m) != known.end();
}

std::string engine_merges() {
  std::string s;
  for (const auto& m : engine::merge_methods(CommCapabilities{})) s += m + ", ";
  return s + "auto";
}

// Which path decodes: the serving engine (paged KV, chunked prefill; what `treeattn serve`
// runs) unless the flags ask for what only the DecodeSession path has: a strategy that does not
// merge a batch of states (ring-kv, single) or a comma list to compare, tree-det's
// rank-count-invariant decode (--deterministic), a synthetic KV cache, a placement, a KV layout
// or the per-step token hash (--check). --session forces the DecodeSession path, --engine the
// engine (and then refuses those flags). Every rank decides from the same flags.
void choose_path(GenFlags& f, const CLI::App& sub) {
  if (f.engine || f.session) return;
  const auto methods = methods_of(f);
  const bool engine_merge = methods.size() == 1 && is_engine_merge(methods[0]);
  f.engine = engine_merge && !f.deterministic && !f.synthetic_kv && !f.check &&
             sub.count("--placement") == 0 && sub.count("--kv-layout") == 0;
}

// Everything checkable before ranks start (output files: by one process only). On success: the
// model path, and f.matmul set (the model's default when --matmul was not given).
Result<std::string> preflight(GenFlags& f, const CLI::App& sub, bool check_outputs) {
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
  TREEATTN_RETURN_IF_ERROR(kv_dtype_for_flag(f.kv_dtype).status());
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
    for (const char* flag : {"--placement", "--kv-layout"})
      if (sub.count(flag) > 0)
        return invalid_argument(
            std::string("--engine does not take ") + flag +
            " (the engine places pages itself; --session decodes with a placement)");
    if (f.deterministic)
      return invalid_argument(
          "--engine does not take --deterministic (tree-det runs with --session)");
    if (f.check) return invalid_argument("--engine does not take --check (use --session)");
    if (methods.size() != 1 || !is_engine_merge(methods[0]))
      return invalid_argument("--engine: --method is one strategy that merges a batch of states: " +
                              engine_merges() + " (not '" + f.method + "')");
    if (f.synthetic_kv) return invalid_argument("--engine does not take --synthetic-kv");
    if (!f.kv_memory.empty()) {
      auto b = parse_bytes(f.kv_memory);
      if (!b.is_ok()) return Status(b.status().code(), "--kv-memory: " + b.status().message());
    }
    if (auto x = engine::parse_exchange(f.prefill_exchange); !x.is_ok())
      return Status(x.status().code(), "--prefill-exchange: " + x.status().message());
    if (Status d = engine::check_dense_name(f.dense); !d.is_ok())
      return Status(d.code(), "--dense: " + d.message());
  } else if (!f.kv_memory.empty()) {
    return invalid_argument(
        "--kv-memory is the engine's (not with --session or flags that imply it)");
  } else if (f.kv_window_pages != -1) {
    return invalid_argument(
        "--kv-window-pages is the engine's (not with --session or flags that imply it)");
  } else if (!f.topology.empty()) {
    return invalid_argument(
        "--topology is the engine's (not with --session or flags that imply it)");
  } else if (f.prefill_exchange != "auto") {
    return invalid_argument(
        "--prefill-exchange is the engine's (not with --session or flags that "
        "imply it; the session's prefill always moves K/V)");
  } else if (f.hash_logits) {
    return invalid_argument(
        "--hash-logits is the engine's (not with --session or flags that imply it)");
  } else if (f.dense != "auto") {
    return invalid_argument(
        "--dense is the engine's (not with --session or flags that imply it; the session "
        "path computes the dense layers on every rank)");
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
  TREEATTN_RETURN_IF_ERROR(sampling_of(f).validate());
  TREEATTN_RETURN_IF_ERROR(check_timeout_ms("--timeout-ms", f.timeout_ms));
  TREEATTN_RETURN_IF_ERROR(check_thread_count(f.threads, "--threads"));
  TREEATTN_RETURN_IF_ERROR(check_matmul_flag(f.matmul));  // before a model is fetched
  TREEATTN_RETURN_IF_ERROR(isa_for_flag(f.isa).status());
  if (!f.prompt_file.empty())
    TREEATTN_RETURN_IF_ERROR(generation::check_prompt_file(f.prompt_file));
  if (check_outputs && !f.json.empty())
    TREEATTN_RETURN_IF_ERROR(check_output_file("--json", f.json));
  auto path = resolve_model(f.model);
  if (!path.is_ok()) return path.status();
  auto matmul = matmul_for_model(f.matmul, *path);
  if (!matmul.is_ok()) return matmul.status();
  f.matmul = *matmul;
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
  // Every rank of a local launch is here; the weights are shared (the page cache).
  TREEATTN_RETURN_IF_ERROR(generation::check_memory(
      cfg, request_of(f, *path, 1), f.ranks, f.ranks, n,
      static_cast<double>((*m)->file().file_size()), mem_available_bytes()));
  if (f.ranks > n && !f.engine)  // the engine's ranks may hold no page
    return invalid_argument(fmt::format(
        "--ranks {} is larger than the prompt ({} tokens): every rank holds part of the "
        "prompt's KV cache; use at most {} ranks or a longer prompt",
        f.ranks, n, n));
  if (cfg.n_ctx_train > 0 && n + f.new_tokens > cfg.n_ctx_train &&
      !launch::started_by_mpi_launcher())
    std::fprintf(stderr,
                 "treeattn generate: note: %lld tokens is beyond the model's training context "
                 "(%lld); RoPE positions past it degrade the text (timing is unaffected)\n",
                 static_cast<long long>(n + f.new_tokens), static_cast<long long>(cfg.n_ctx_train));
  // The CPU kernels' tuning for the model's attention on this launch's ranks.
  if (check_outputs)
    tune_at_start("generate",
                  {TuneKey{*parse_dtype(f.kv_dtype), cfg.head_dim,
                           cfg.n_head / std::max<int64_t>(1, cfg.n_head_kv),
                           f.threads > 0 ? f.threads : default_threads(f.ranks)}},
                  {f.threads > 0 ? f.threads : default_threads(f.ranks)});
  return path;
}

int say_error(const Communicator& comm, const Status& s) {
  std::fprintf(stderr, "treeattn generate: rank %d: error: %s\n", comm.rank(),
               s.to_string().c_str());
  return 2;
}

// The matrix kernels' options the flags give (checked by preflight): for the start line and the
// report's isa / int8_kernel.
model::MatvecOptions matvec_options_of(const GenFlags& f, int threads) {
  model::MatvecOptions o;
  o.threads = threads;
  o.isa = *isa_for_flag(f.isa);
  o.mode = *model::parse_matmul_mode(f.matmul);
  return o;
}

generation::ReportLabels labels_of(const GenFlags& f, const std::string& model_path, int threads,
                                   int P) {
  const model::MatvecOptions o = matvec_options_of(f, threads);
  return {model_path,
          P,
          threads,
          f.matmul,
          f.kv_dtype,
          f.placement,
          f.kv_layout,
          f.synthetic_kv,
          f.prefill_exchange,
          std::string(isa_name(model::matmul_isa(o))),
          std::string(model::matmul_int8_target(o)),
          f.method,
          f.dense};
}

// The report (rank 0): its lines on stderr, and --json.
int report(const GenFlags& f, const std::string& model_path, const generation::Output& o,
           const std::string& merge, int threads, int P, int rc) {
  const std::string text = f.engine
                               ? generation::engine_report_text(o, merge)
                               : generation::session_report_text(o, f.synthetic_kv, P, rc != 0);
  std::fputs(text.c_str(), stderr);
  if (f.json.empty()) return rc;
  const generation::ReportLabels labels = labels_of(f, model_path, threads, P);
  const auto j = f.engine ? generation::engine_report_json(o, merge, labels)
                          : generation::session_report_json(o, labels, rc == 0);
  if (Status s = generation::write_report_json(f.json, j, "--json"); !s.is_ok())
    rc = fail("generate", s);
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
  hooks.phase = [](const std::string& what) { launch::rank_status_phase(what); };
  hooks.step = [](int64_t i) { launch::rank_status_step(i); };
  hooks.planned = [](const StrategyChoice& c) { announce_auto(c); };
  int64_t n = 0;
  hooks.started = [&](const generation::Start& s) {
    const std::string label = model::matmul_description(matvec_options_of(f, threads));
    n = s.prompt_tokens;
    std::string methods;
    for (const auto& x : s.methods) methods += (methods.empty() ? "" : ",") + x;
    if (f.engine)
      std::fprintf(stderr,
                   "treeattn generate (engine): %s | %d rank(s) x %d thread(s), matmul %s | "
                   "dense %s | merge %s | KV %s pages of %lld tokens, %lld per rank | prompt "
                   "%lld tokens, up to %lld new\n",
                   s.config->to_string().c_str(), P, threads, label.c_str(),
                   s.dense_description.c_str(), s.merge_description.c_str(), f.kv_dtype.c_str(),
                   static_cast<long long>(s.page_tokens), static_cast<long long>(s.pages_per_rank),
                   static_cast<long long>(n), static_cast<long long>(f.new_tokens));
    else
      std::fprintf(stderr,
                   "treeattn generate: %s | %d rank(s) x %d thread(s), matmul %s | method %s "
                   "| KV %s (%s placement, %s layout) | prompt %lld tokens, up to %lld new\n",
                   s.config->to_string().c_str(), P, threads, label.c_str(), methods.c_str(),
                   f.kv_dtype.c_str(), f.placement.c_str(), f.kv_layout.c_str(),
                   static_cast<long long>(n), static_cast<long long>(f.new_tokens));
  };
  const bool tty = isatty(2) != 0;
  double last_print = -1e9;
  hooks.prefill_layer = [&](int l, int layers, double s) {
    if (n < 2048) return;
    if (l < layers && s - last_print < 2.0) return;
    last_print = s;
    std::fprintf(stderr, "%sprefill: layer %d/%d, %.1f s, about %.0f s left%s", tty ? "\r" : "", l,
                 layers, s, s / l * (layers - l), tty ? (l == layers ? "\n" : "") : "\n");
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
    if (o.must_abort) launch::abort_job(3, "");
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
  if (f.engine) return report(f, model_path, o, o.merge_choice.strategy, threads, P, 0);
  int rc = 0;
  for (int q = 1; q < P; ++q)
    if (o.token_hash_by_rank[static_cast<std::size_t>(q)] != o.token_hash_by_rank[0]) {
      if (lead)
        std::fprintf(
            stderr,
            "treeattn generate: DIVERGENCE: rank %d's token stream differs from "
            "rank 0's (hashes %016llx vs %016llx)\n",
            q, static_cast<unsigned long long>(o.token_hash_by_rank[static_cast<std::size_t>(q)]),
            static_cast<unsigned long long>(o.token_hash_by_rank[0]));
      rc = 3;
    }
  if (!lead) return rc;
  return report(f, model_path, o, "", threads, P, rc);
}

int generate_command(GenFlags& f, const CLI::App& sub, const Invocation& inv) {
  apply_no_tune(f.no_tune);
  choose_path(f, sub);
  auto job = [&](Communicator& comm, const std::string& path) { return run_job(comm, f, path); };
  auto launch = [&](const std::string& path) {
    launch::LaunchOptions lo;
    lo.ranks = f.ranks;
    lo.who = "treeattn generate";
    if (Status s = launch::check_local_rank_count(lo, "--ranks"); !s.is_ok())
      return fail("generate", s);
    std::vector<std::string> args = inv.args;
    if (f.model.empty()) args.insert(args.end(), {"--model", path});
    auto rc = launch::run_under_mpirun(lo, args);
    if (!rc.is_ok()) return fail("generate", rc.status());
    if (const int code = launch::report_interrupt("treeattn generate", f.ranks); code != 0)
      return code;
    return rc.value();
  };
  return launch::run_model_command(
      "generate", f.ranks, sub.count("--ranks") > 0,
      [&](bool lead) { return preflight(f, sub, lead); }, job, launch);
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
                  "allgather, gather-root, single, tree-det, auto (the planner's choice on "
                  "--topology). One that merges a batch of states (all but ring-kv and single) "
                  "runs on the serving engine; a comma list decodes each from the same prefill "
                  "on the DecodeSession (the first streams) and compares them")
      ->capture_default_str();
  add_kv_dtype_option(*sub, f->kv_dtype);
  sub->add_option("--placement", f->placement,
                  "KV placement over ranks: even, uneven, striped (single: always rank 0)")
      ->capture_default_str();
  sub->add_option("--kv-layout", f->kv_layout,
                  "How ranks store the KV cache: auto (the layout this CPU reads faster for the "
                  "model's attention shape, as the kernel tuning measured it: treeattn tune), rows "
                  "or tiled")
      ->capture_default_str();
  sub->add_flag("--chat", f->chat,
                "Render the prompt as a user message through the model's own chat template "
                "(for a file without one, a 'User: ... Assistant:' transcript)");
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
  add_matmul_option(*sub, f->matmul);
  add_isa_option(*sub, f->isa);
  add_rows8_flag(*sub, f->no_rows8);
  sub->add_flag("--check", f->check,
                "Hash the token stream on every rank at every step and stop on a divergence");
  sub->add_flag("--engine", f->engine,
                "Run the prompt as one request of the serving engine (paged KV, chunked prefill; "
                "what `treeattn serve` runs); --method is then the strategy whose merge stage "
                "merges each layer's states (auto: the planner's batch-invariant choice). The "
                "default, unless a flag below needs the DecodeSession path");
  sub->add_option("--device", f->device,
                  "Where the ranks run the model: cpu (the only one for models so far)")
      ->capture_default_str();
  sub->add_flag("--session", f->session,
                "Decode on the DecodeSession with a strategy instead of the engine; implied by "
                "ring-kv or single, a comma list, --deterministic, --synthetic-kv, --placement, "
                "--kv-layout and --check");
  sub->add_option("--topology", f->topology,
                  "--engine: the topology file or preset --method auto plans on (default: this "
                  "job as MPI shows it: ranks grouped by host)");
  sub->add_option("--prefill-exchange", f->prefill_exchange,
                  "--engine: how a prompt chunk's attention crosses the ranks: pass-q (its queries "
                  "travel, one merge per layer), kv (the cached K/V travels), auto (per chunk, "
                  "fewer bytes; same bits either way)")
      ->capture_default_str();
  sub->add_option("--dense", f->dense,
                  "--engine: the dense layers over the ranks: split (each rank holds and computes "
                  "1/p of every projection's outputs, all-gathered per matrix group), replicated "
                  "(every rank holds the whole model and computes its share of the rows), auto "
                  "(the cost model's choice for one decoding sequence on the job's topology; "
                  "same bits either way)")
      ->capture_default_str();
  sub->add_flag("--hash-logits", f->hash_logits,
                "--engine: hash every generated token's logits bits (the report's and --json's "
                "logits_hash), to compare runs bit for bit");
  sub->add_option("--kv-memory", f->kv_memory,
                  "--engine: KV page memory per rank, e.g. 2G (default: what the prompt needs)");
  sub->add_option("--kv-window-pages", f->kv_window_pages,
                  "--engine: pages per rank of the sliding-window layers, which drop what their "
                  "window has passed (-1: auto, 0: those layers keep every position)")
      ->capture_default_str();
  sub->add_flag("--ignore-eos", f->ignore_eos, "Generate --new-tokens even past end of text");
  sub->add_flag("--quiet", f->quiet, "Do not print the text (report only)");
  add_no_tune_flag(*sub, f->no_tune);
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
