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
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

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

int fail(const Status& s) {
  std::fprintf(stderr, "treeattn generate: error: %s\n", s.to_string().c_str());
  return 2;
}


// --prompt-file names something a prompt can be read from (checked before the model is loaded).
Status check_prompt_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return invalid_argument("--prompt-file " + path +
                            " is a directory; give the text file to read the prompt from");
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    return invalid_argument("--prompt-file " + path + " is not a regular file");
  return Status::ok();
}

// The prompt's token ids, the same on every rank.
Result<std::vector<TokenId>> make_prompt(const GenFlags& f, const Tokenizer& tok) {
  if (f.prompt_tokens > 0) {
    // A synthetic prompt for timing: seeded draws among the normal tokens.
    std::vector<TokenId> normal;
    for (TokenId id = 0; id < tok.n_vocab(); ++id)
      if (tok.token_type(id) == TokenType::kNormal) normal.push_back(id);
    if (normal.empty())
      return invalid_argument("--prompt-tokens: the vocabulary has no normal tokens");
    std::vector<TokenId> ids;
    if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    uint64_t s = f.seed * 0x9e3779b97f4a7c15ull + 12345;
    while (static_cast<int64_t>(ids.size()) < f.prompt_tokens) {
      uint64_t z = (s += 0x9e3779b97f4a7c15ull);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      ids.push_back(normal[static_cast<std::size_t>(z % normal.size())]);
    }
    return ids;
  }
  std::string text = f.prompt;
  if (!f.prompt_file.empty()) {
    TREEATTN_RETURN_IF_ERROR(check_prompt_file(f.prompt_file));
    std::ifstream in(f.prompt_file, std::ios::binary);
    if (!in) return invalid_argument("--prompt-file " + f.prompt_file + ": cannot read it");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  if (f.chat) {
    const ChatTurn user{"user", text};
    text = format_chat(tok.chat_format(), std::span<const ChatTurn>(&user, 1),
                       f.system_given ? f.system : tok.default_system());
  }
  auto ids = tok.encode(text, true, f.chat);
  if (!ids.is_ok()) return ids.status();
  if (ids->empty()) return invalid_argument("the prompt is empty after tokenization");
  return ids;
}

int default_threads(int ranks_here) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_here));
}

int local_ranks(int world) {
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) return std::max(1, std::atoi(v));
  return world;
}

std::vector<std::string> methods_of(const GenFlags& f) {
  if (f.deterministic) return {std::string(deterministic_strategy())};
  return split_list(f.method);
}

model::GeneratorConfig generator_config(const GenFlags& f, const std::vector<std::string>& methods,
                                        int threads) {
  model::GeneratorConfig gc;
  gc.methods = methods;
  gc.kv_dtype = *parse_dtype(f.kv_dtype);
  gc.placement = *parse_shard_kind(f.placement);
  gc.kv_layout = *parse_kv_layout(f.kv_layout);
  gc.threads = threads;
  gc.matmul = *model::parse_matmul_mode(f.matmul);
  gc.reserve_tokens = f.new_tokens;
  gc.fanout = f.fanout;
  gc.timeout = std::chrono::milliseconds(f.timeout_ms);
  return gc;
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
  if (!f.prompt_file.empty()) TREEATTN_RETURN_IF_ERROR(check_prompt_file(f.prompt_file));
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
    auto p = make_prompt(f, *tok);
    if (!p.is_ok()) return p.status();
    prompt = std::move(p).value();
  }
  const int64_t n = f.prompt_tokens > 0 ? f.prompt_tokens : static_cast<int64_t>(prompt.size());
  const auto& cfg = (*m)->config();
  const int here = f.ranks;  // local launches put every rank here
  const auto est =
      model::estimate_memory(cfg, generator_config(f, methods, 1), f.ranks, n, f.new_tokens);
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

uint64_t fnv1a(uint64_t h, TokenId t) {
  for (int i = 0; i < 4; ++i) {
    h ^= static_cast<uint64_t>(static_cast<uint32_t>(t) >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t sent(const Communicator& c) {
  return c.counters().p2p_bytes + c.counters().collective_payload_bytes;
}

// Holds back an incomplete UTF-8 sequence at the end of the streamed bytes.
std::size_t complete_utf8_prefix(const std::string& s) {
  std::size_t n = s.size();
  for (std::size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xc0) == 0x80) continue;  // continuation byte
    const std::size_t len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

struct MethodResult {
  std::string method;
  std::vector<TokenId> tokens;
  std::vector<double> step_ms;
  double decode_s = 0;
  uint64_t bytes_sent = 0;  // this rank, over the decode steps
  int first_diff = -1;      // vs method 0
  float diff_gap = 0;
};

// The job: every rank runs this with its communicator.
// --engine: the prompt as one request of the serving engine (include/treeattn/engine.hpp), the
// path `treeattn serve` takes: paged KV over the ranks, prefill by the tree merge in chunks, the
// same tokens bit for bit as a server request with the same prompt and sampling.
int run_engine_job(Communicator& comm, const GenFlags& f, const std::string& model_path) {
  const bool lead = comm.rank() == 0;
  const int P = comm.size();
  auto say_error = [&](const Status& s) {
    std::fprintf(stderr, "treeattn generate: rank %d: error: %s\n", comm.rank(),
                 s.to_string().c_str());
    return 2;
  };
  auto m = model::LlamaModel::load(model_path);
  if (!m.is_ok()) return say_error(m.status());
  auto tok = Tokenizer::from_gguf((*m)->file());
  if (!tok.is_ok()) return say_error(tok.status());
  auto prompt = make_prompt(f, *tok);
  if (!prompt.is_ok()) return say_error(prompt.status());
  const auto n = static_cast<int64_t>(prompt->size());
  const auto& cfg = (*m)->config();
  const int threads = f.threads > 0 ? f.threads : default_threads(local_ranks(P));
  engine::EngineConfig ec;
  auto dt = parse_dtype(f.kv_dtype);
  if (!dt) return say_error(invalid_argument("--kv-dtype " + f.kv_dtype));
  ec.kv_dtype = *dt;
  ec.threads = threads;
  ec.matmul = *model::parse_matmul_mode(f.matmul);
  ec.merge = f.method;
  ec.prefill_exchange = f.prefill_exchange;
  ec.timeout = std::chrono::milliseconds(f.timeout_ms);
  if (!f.kv_memory.empty()) {
    auto bytes = parse_bytes(f.kv_memory);
    if (!bytes.is_ok()) return say_error(bytes.status());
    ec.kv_memory = static_cast<std::size_t>(*bytes);
  } else {  // the pages this prompt needs on each rank, and a few more
    ec.kv_pages = (n + f.new_tokens + ec.page_tokens - 1) / ec.page_tokens / P + 2;
  }
  auto e = engine::Engine::create(comm, **m, ec);
  if (!e.is_ok()) return say_error(e.status());
  engine::Engine& eng = **e;
  if (lead)
    std::fprintf(stderr,
                 "treeattn generate (engine): %s | %d rank(s) x %d thread(s), matmul %s %s | merge %s | KV %s "
                 "pages of %lld tokens, %lld per rank | prompt %lld tokens, up to %lld new\n",
                 cfg.to_string().c_str(), P, threads,
                 std::string(isa_name(model::matmul_isa({threads, Isa::kAuto}))).c_str(),
                 f.matmul.c_str(),
                 ec.merge.c_str(), f.kv_dtype.c_str(),
                 static_cast<long long>(ec.page_tokens),
                 static_cast<long long>(eng.metrics().pages_per_rank), static_cast<long long>(n),
                 static_cast<long long>(f.new_tokens));
  std::vector<TokenId> out;
  std::vector<double> token_ms;  // between consecutive tokens (decode steps)
  Clock::time_point last_token;
  uint64_t sent_at_first = 0;
  engine::RequestTimings timings;
  Status failure;
  std::string streamed;
  std::size_t printed = 0;
  const auto t0 = Clock::now();
  double ttft_ms = 0;
  if (lead) {
    engine::Request r;
    r.prompt = *prompt;
    r.max_new_tokens = f.new_tokens;
    r.sampling = {f.temperature, f.top_k, f.top_p, f.seed};
    if (!f.ignore_eos)
      for (TokenId id = 0; id < tok->n_vocab(); ++id)
        if (tok->is_end_of_generation(id)) r.stop_tokens.push_back(id);
    auto id = eng.submit(std::move(r), [&](const engine::TokenEvent& ev) {
      if (ev.token >= 0) {
        const auto now = Clock::now();
        if (out.empty()) {
          ttft_ms = std::chrono::duration<double, std::milli>(now - t0).count();
          sent_at_first = sent(comm);
        } else {
          token_ms.push_back(std::chrono::duration<double, std::milli>(now - last_token).count());
        }
        last_token = now;
        out.push_back(ev.token);
        if (!f.quiet && ev.finish != engine::FinishReason::kStop) {
          auto piece = tok->token_to_piece(ev.token);
          if (piece.is_ok()) streamed += *piece;
          const std::size_t upto = complete_utf8_prefix(streamed);
          if (upto > printed) {
            std::fwrite(streamed.data() + printed, 1, upto - printed, stdout);
            std::fflush(stdout);
            printed = upto;
          }
        }
      }
      timings = ev.timings;
      if (ev.finish == engine::FinishReason::kError) failure = ev.error;
      if (ev.finish != engine::FinishReason::kNone) eng.stop(true);
    });
    if (!id.is_ok()) {
      say_error(id.status());
      eng.stop(false);
    }
  }
  Status st = eng.run();
  if (!st.is_ok()) {
    say_error(st);
    abort_job(3, "");
  }
  // Every rank's peak RSS and bytes sent, for the report.
  const std::array<double, 2> mine = {static_cast<double>(peak_rss_bytes()),
                                      static_cast<double>(sent(comm))};
  std::vector<std::array<double, 2>> all(static_cast<std::size_t>(P));
  if (Status g = comm.allgather(mine.data(), sizeof mine, all.data()); !g.is_ok()) {
    say_error(g);
    abort_job(3, "");
  }
  if (!lead) return 0;
  if (!failure.is_ok()) return say_error(failure);
  if (out.empty()) return 2;
  if (!f.quiet) {
    std::fwrite(streamed.data() + printed, 1, streamed.size() - printed, stdout);
    std::printf("\n");
    std::fflush(stdout);  // the text before the report on stderr
  }
  const auto mt = eng.metrics();
  const double decode_ms =
      out.size() > 1 ? timings.decode_seconds * 1e3 / static_cast<double>(out.size() - 1) : 0.0;
  // Rank 0's bytes per decode step (the merges' fan-in and fan-out; the other ranks' totals are
  // in bytes_sent_by_rank).
  const double bytes_per_token =
      out.size() > 1 ? static_cast<double>(sent(comm) - sent_at_first) /
                           static_cast<double>(out.size() - 1)
                     : 0.0;
  uint64_t max_rss = 0;
  std::vector<uint64_t> rss, bytes_by_rank;
  for (const auto& a : all) {
    rss.push_back(static_cast<uint64_t>(a[0]));
    bytes_by_rank.push_back(static_cast<uint64_t>(a[1]));
    max_rss = std::max(max_rss, rss.back());
  }
  std::string rss_list;
  for (uint64_t r : rss) rss_list += (rss_list.empty() ? "" : " ") + format_bytes(static_cast<double>(r));
  std::fprintf(stderr,
               "prompt %lld tokens (%lld from the prefix cache): time to first token %.1f ms "
               "(prefill %.0f tokens/s)\n"
               "decode %s (engine) %zu tokens: %.2f ms/token p50, %.2f p99, %.1f tokens/s | "
               "rank 0 sent %s/token in %lld merges in all\n"
               "peak RSS per rank: %s (includes the mapped weights, shared between ranks)\n",
               static_cast<long long>(n), static_cast<long long>(timings.cached_tokens), ttft_ms,
               static_cast<double>(n) / std::max(1e-9, timings.prefill_seconds), ec.merge.c_str(),
               out.size(), percentile(token_ms, 0.5), percentile(token_ms, 0.99),
               decode_ms > 0 ? 1e3 / decode_ms : 0.0, format_bytes(bytes_per_token).c_str(),
               static_cast<long long>(mt.merges), rss_list.c_str());
  if (!f.json.empty()) {
    auto text = tok->decode(out);
    nlohmann::json j = {{"model", model_path},
                        {"model_config", cfg.to_string()},
                        {"engine", true},
                        {"prompt_tokens", *prompt},
                        {"tokens", out},
                        {"text", text.is_ok() ? *text : ""},
                        {"ranks", P},
                        {"threads_per_rank", threads},
                        {"matmul", f.matmul},
                        {"method", ec.merge},
                        {"prefill_exchange", ec.prefill_exchange},
                        {"rows_kv_exchange", mt.rows_kv_exchange},
                        {"rows_pass_q", mt.rows_pass_q},
                        {"kv_dtype", f.kv_dtype},
                        {"ttft_ms", ttft_ms},
                        {"prefill_ms", timings.prefill_seconds * 1e3},
                        {"prefill_tokens_per_s",
                         static_cast<double>(n) / std::max(1e-9, timings.prefill_seconds)},
                        {"cached_tokens", timings.cached_tokens},
                        {"decode_ms_per_token", decode_ms},
                        {"decode_ms", token_ms},
                        {"decode_ms_p50", percentile(token_ms, 0.5)},
                        {"decode_ms_p99", percentile(token_ms, 0.99)},
                        {"tokens_per_s", decode_ms > 0 ? 1e3 / decode_ms : 0.0},
                        {"bytes_sent_per_rank_per_token", bytes_per_token},
                        {"bytes_sent_per_token_of", "rank 0, decode steps"},
                        {"bytes_sent_rank0", mt.bytes_sent},
                        {"bytes_sent_by_rank", bytes_by_rank},
                        {"peak_rss_bytes", max_rss},
                        {"peak_rss_bytes_by_rank", rss}};
    std::ofstream o(f.json);
    o << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!o) return fail(invalid_argument("--json " + f.json + ": write failed"));
  }
  return 0;
}

int run_job(Communicator& comm, const GenFlags& f, const std::string& model_path) {
  if (f.engine) return run_engine_job(comm, f, model_path);
  const bool lead = comm.rank() == 0;
  const int P = comm.size();
  auto say_error = [&](const Status& s) {
    std::fprintf(stderr, "treeattn generate: rank %d: error: %s\n", comm.rank(),
                 s.to_string().c_str());
    return 2;
  };
  auto m = model::LlamaModel::load(model_path);
  if (!m.is_ok()) return say_error(m.status());
  auto tok = Tokenizer::from_gguf((*m)->file());
  if (!tok.is_ok()) return say_error(tok.status());
  auto prompt = make_prompt(f, *tok);
  if (!prompt.is_ok()) return say_error(prompt.status());
  const auto n = static_cast<int64_t>(prompt->size());
  const auto& cfg = (*m)->config();
  const int threads = f.threads > 0 ? f.threads : default_threads(local_ranks(P));
  std::vector<std::string> methods = methods_of(f);
  if (std::find(methods.begin(), methods.end(), "auto") != methods.end()) {
    auto planned = resolve_auto_methods(
        methods, AttnShape{1, cfg.n_head, cfg.n_head_kv, cfg.head_dim, 1}, *parse_dtype(f.kv_dtype),
        n + f.new_tokens, P, "", "", "", f.fanout, lead);
    if (!planned.is_ok()) return say_error(planned.status());
    methods = *planned;
  }
  rank_status_phase("generate: set-up");
  auto g = model::Generator::create(comm, **m, generator_config(f, methods, threads));
  if (!g.is_ok()) {
    const int rc = say_error(g.status());
    if (g.status().code() == Code::kTimeout) abort_job(3, "");
    return rc;
  }
  if (lead)
    std::fprintf(
        stderr,
        "treeattn generate: %s | %d rank(s) x %d thread(s), matmul %s %s | method %s | KV "
        "%s (%s placement, %s layout) | prompt %lld tokens, up to %lld new\n",
        cfg.to_string().c_str(), P, threads,
        std::string(isa_name(model::matmul_isa({threads, Isa::kAuto}))).c_str(),
        f.matmul.c_str(),
        [&] {
          std::string s;
          for (const auto& x : methods) s += (s.empty() ? "" : ",") + x;
          return s;
        }()
            .c_str(),
        f.kv_dtype.c_str(), f.placement.c_str(), f.kv_layout.c_str(), static_cast<long long>(n),
        static_cast<long long>(f.new_tokens));

  // ---- prefill ----
  rank_status_phase("generate: prefill");
  const bool tty = isatty(2) != 0;
  const auto t0 = Clock::now();
  auto last_print = t0;
  std::vector<float> logits;
  Status st = f.synthetic_kv ? (*g)->prefill_synthetic(n - 1, f.seed) : Status::ok();
  if (f.synthetic_kv && st.is_ok())  // the prompt's last token runs as a decode step
    st = (*g)->step(prompt->back(), logits, 0);
  if (!f.synthetic_kv)
    st = (*g)->prefill(*prompt, logits, [&](int l, int layers) {
      if (!lead || n < 2048) return;
      const auto now = Clock::now();
      if (l < layers && now - last_print < std::chrono::seconds(2)) return;
      last_print = now;
      const double s = std::chrono::duration<double>(now - t0).count();
      std::fprintf(stderr, "%sprefill: layer %d/%d, %.1f s, about %.0f s left%s", tty ? "\r" : "",
                   l, layers, s, s / l * (layers - l), tty ? (l == layers ? "\n" : "") : "\n");
      std::fflush(stderr);
    });
  if (!st.is_ok()) {
    say_error(st);
    abort_job(3, "");
  }
  model::Sampler sampler({f.temperature, f.top_k, f.top_p, f.seed});
  const std::vector<float> first_logits = logits;
  const TokenId first = sampler.sample(logits);
  const double ttft_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const double prefill_s = (*g)->prefill_stats().seconds;

  // ---- decode, method 0 streams ----
  std::vector<MethodResult> results;
  std::string streamed;
  std::size_t printed = 0;
  auto stream = [&](TokenId t) {
    if (!lead || f.quiet) return;
    auto piece = tok->token_to_piece(t);
    if (!piece.is_ok()) return;
    streamed += *piece;
    const std::size_t upto = complete_utf8_prefix(streamed);
    if (upto > printed) {
      std::fwrite(streamed.data() + printed, 1, upto - printed, stdout);
      std::fflush(stdout);
      printed = upto;
    }
  };
  uint64_t hash = 0xcbf29ce484222325ull;
  for (int k = 0; k < (*g)->methods(); ++k) {
    MethodResult r;
    r.method = (*g)->method(k);
    model::Sampler smp({f.temperature, f.top_k, f.top_p, f.seed});
    logits = first_logits;
    if (f.synthetic_kv && k > 0) {  // this session's copy of the step that ended the "prefill"
      st = (*g)->step(prompt->back(), logits, k);
      if (!st.is_ok()) {
        say_error(st);
        abort_job(3, "");
      }
    }
    TokenId t = k == 0 ? first : smp.sample(logits);  // the same draws as method 0
    r.tokens.push_back(t);
    if (k == 0) {
      stream(t);
      hash = fnv1a(hash, t);
    }
    const int64_t steps_wanted =
        k == 0 ? f.new_tokens - 1 : static_cast<int64_t>(results[0].tokens.size()) - 1;
    rank_status_phase("generate: decode " + r.method);
    const uint64_t sent0 = sent(comm);
    const auto d0 = Clock::now();
    for (int64_t i = 0; i < steps_wanted; ++i) {
      if (k == 0 && !f.ignore_eos && tok->is_end_of_generation(t)) break;
      rank_status_step(i);
      const auto s0 = Clock::now();
      st = (*g)->step(t, logits, k);
      if (!st.is_ok()) {
        say_error(st);
        abort_job(3, "");
      }
      t = (k == 0 ? sampler : smp).sample(logits);
      r.step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
      r.tokens.push_back(t);
      if (k == 0) {
        stream(t);
        hash = fnv1a(hash, t);
        if (f.check) {  // every rank's stream so far, compared at every step
          std::vector<uint64_t> all(static_cast<std::size_t>(P));
          st = comm.allgather(&hash, sizeof hash, all.data());
          if (!st.is_ok()) {
            say_error(st);
            abort_job(3, "");
          }
          for (int q = 1; q < P; ++q)
            if (all[static_cast<std::size_t>(q)] != all[0]) {
              if (lead)
                std::fprintf(stderr,
                             "\ntreeattn generate: DIVERGENCE: after %zu tokens rank %d's token "
                             "stream (hash %016llx) differs from rank 0's (%016llx)\n",
                             r.tokens.size(), q,
                             static_cast<unsigned long long>(all[static_cast<std::size_t>(q)]),
                             static_cast<unsigned long long>(all[0]));
              return 3;
            }
        }
      }
    }
    r.decode_s = std::chrono::duration<double>(Clock::now() - d0).count();
    r.bytes_sent = sent(comm) - sent0;
    if (k > 0) {
      const auto& a = results[0].tokens;
      for (std::size_t i = 0; i < std::min(a.size(), r.tokens.size()); ++i)
        if (a[i] != r.tokens[i]) {
          r.first_diff = static_cast<int>(i);
          break;
        }
    }
    results.push_back(std::move(r));
  }
  if (lead && !f.quiet) {
    std::fwrite(streamed.data() + printed, 1, streamed.size() - printed, stdout);
    std::printf("\n");
    std::fflush(stdout);
  }

  // ---- agreement and report ----
  struct RankStats {
    uint64_t hash, rss;
    double bytes_per_token[8];
    double prefill_busy_s, prefill_attention_s;
    int64_t prefill_positions;
  } mine{};
  mine.hash = hash;
  {
    const model::PrefillStats& p = (*g)->prefill_stats();
    mine.prefill_busy_s = p.seconds - p.wait_seconds;  // computing, not waiting for the others
    mine.prefill_attention_s = p.attention_seconds;
    mine.prefill_positions = p.positions_computed;
  }
  mine.rss = static_cast<uint64_t>(peak_rss_bytes());
  for (std::size_t k = 0; k < results.size() && k < 8; ++k)
    mine.bytes_per_token[k] = results[k].step_ms.empty()
                                  ? 0.0
                                  : static_cast<double>(results[k].bytes_sent) /
                                        static_cast<double>(results[k].step_ms.size());
  std::vector<RankStats> all(static_cast<std::size_t>(P));
  st = comm.allgather(&mine, sizeof mine, all.data());
  if (!st.is_ok()) {
    say_error(st);
    abort_job(3, "");
  }
  int rc = 0;
  for (int q = 1; q < P; ++q)
    if (all[static_cast<std::size_t>(q)].hash != all[0].hash) {
      if (lead)
        std::fprintf(stderr,
                     "treeattn generate: DIVERGENCE: rank %d's token stream differs from "
                     "rank 0's (hashes %016llx vs %016llx)\n",
                     q, static_cast<unsigned long long>(all[static_cast<std::size_t>(q)].hash),
                     static_cast<unsigned long long>(all[0].hash));
      rc = 3;
    }
  if (!lead) return rc;

  uint64_t max_rss = 0;
  std::string rss_list;
  for (const auto& a : all) {
    max_rss = std::max(max_rss, a.rss);
    rss_list += (rss_list.empty() ? "" : " ") + format_bytes(static_cast<double>(a.rss));
  }
  const model::PrefillStats& ps = (*g)->prefill_stats();
  std::vector<double> busy, att;
  std::vector<int64_t> positions;
  std::string busy_list;
  for (const auto& a : all) {
    busy.push_back(a.prefill_busy_s);
    att.push_back(a.prefill_attention_s);
    positions.push_back(a.prefill_positions);
    busy_list += fmt::format("{}{:.2f}", busy_list.empty() ? "" : " ", a.prefill_busy_s);
  }
  if (f.synthetic_kv)
    std::fprintf(stderr,
                 "\nprompt %lld tokens: synthetic KV cache (not computed, %.2f s to fill)\n",
                 static_cast<long long>(n), prefill_s);
  else
    std::fprintf(stderr,
                 "\nprompt %lld tokens: prefill %.2f s (%.1f tokens/s, attention %.2f s, waiting "
                 "%.2f s on rank 0), time to first token %.1f ms\n",
                 static_cast<long long>(n), prefill_s, static_cast<double>(n) / prefill_s,
                 ps.attention_seconds, ps.wait_seconds, ttft_ms);
  if (!f.synthetic_kv && P > 1)
    std::fprintf(stderr,
                 "prefill busy s per rank (computing, not waiting): %s; sent %s by rank 0\n",
                 busy_list.c_str(), format_bytes(static_cast<double>(ps.bytes_sent)).c_str());
  nlohmann::json jm = nlohmann::json::array();
  for (std::size_t k = 0; k < results.size(); ++k) {
    const MethodResult& r = results[k];
    const double p50 = percentile(r.step_ms, 0.5), p99 = percentile(r.step_ms, 0.99);
    const double tps = r.step_ms.empty() ? 0.0 : static_cast<double>(r.step_ms.size()) / r.decode_s;
    double bpt = 0;
    std::vector<double> bpt_ranks;
    for (const auto& a : all) {
      bpt = std::max(bpt, k < 8 ? a.bytes_per_token[k] : 0.0);
      bpt_ranks.push_back(k < 8 ? a.bytes_per_token[k] : 0.0);
    }
    std::string agree;
    if (k > 0)
      agree = r.first_diff < 0
                  ? ", same tokens as " + results[0].method
                  : fmt::format(", differs from {} at token {}", results[0].method, r.first_diff);
    std::fprintf(stderr,
                 "decode %-11s %zu tokens: %.2f ms/token p50, %.2f p99, %.1f tokens/s | sent "
                 "%s/rank/token (max) | end-to-end %.2f s%s\n",
                 r.method.c_str(), r.step_ms.size(), p50, p99, tps, format_bytes(bpt).c_str(),
                 prefill_s + r.decode_s, agree.c_str());
    jm.push_back({{"method", r.method},
                  {"tokens", r.tokens},
                  {"decode_steps", r.step_ms.size()},
                  {"decode_ms", r.step_ms},
                  {"decode_ms_p50", p50},
                  {"decode_ms_p99", p99},
                  {"tokens_per_s", tps},
                  {"decode_s", r.decode_s},
                  {"end_to_end_s", prefill_s + r.decode_s},
                  {"bytes_sent_per_rank_per_token", bpt},
                  {"bytes_sent_per_token_by_rank", bpt_ranks},
                  {"first_token_differing_from_method0", r.first_diff}});
  }
  std::fprintf(stderr,
               "peak RSS per rank: %s (includes the mapped weights, shared between ranks)\n",
               rss_list.c_str());
  if (rc != 0) std::fprintf(stderr, "FAILED: the ranks' token streams diverged\n");
  if (!f.json.empty()) {
    const MethodResult& r0 = results[0];
    auto text = tok->decode(r0.tokens);
    std::vector<uint64_t> rss;
    for (const auto& a : all) rss.push_back(a.rss);
    nlohmann::json j = {
        {"model", model_path},
        {"model_config", cfg.to_string()},
        {"prompt_tokens", *prompt},
        {"tokens", r0.tokens},
        {"text", text.is_ok() ? *text : ""},
        {"ranks", P},
        {"threads_per_rank", threads},
        {"matmul", f.matmul},
        {"method", r0.method},
        {"kv_dtype", f.kv_dtype},
        {"placement", f.placement},
        {"kv_layout", f.kv_layout},
        {"ttft_ms", ttft_ms},
        {"prefill_ms", prefill_s * 1e3},
        {"synthetic_kv", f.synthetic_kv},
        {"prefill_tokens_per_s", static_cast<double>(n) / prefill_s},
        {"prefill_bytes_sent_rank0", ps.bytes_sent},
        {"prefill_busy_s_by_rank", busy},
        {"prefill_attention_s_by_rank", att},
        {"prefill_positions_by_rank", positions},
        {"decode_ms_p50", jm[0]["decode_ms_p50"]},
        {"decode_ms_p99", jm[0]["decode_ms_p99"]},
        {"tokens_per_s", jm[0]["tokens_per_s"]},
        {"bytes_sent_per_rank_per_token", jm[0]["bytes_sent_per_rank_per_token"]},
        {"peak_rss_bytes", max_rss},
        {"peak_rss_bytes_by_rank", rss},
        {"token_stream_hash", fmt::format("{:016x}", hash)},
        {"ranks_agree", rc == 0},
        {"methods", jm},
    };
    std::ofstream out(f.json);
    // Generated text may end inside a multi-byte character: invalid UTF-8 becomes U+FFFD.
    out << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!out) rc = fail(invalid_argument("--json " + f.json + ": write failed"));
  }
  return rc;
}

int generate_command(GenFlags& f, const CLI::App& sub, const Invocation& inv) {
  choose_path(f, sub);
  if (started_by_mpi_launcher()) {
    auto world = mpi_init_world(nullptr, nullptr);
    if (!world.is_ok()) return fail(world.status());
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
        if (comm->rank() == 0 && !path.is_ok()) fail(path.status());
      } else {
        rc = run_job(*comm, f, *path);
      }
    }
    (void)mpi_finalize();
    return rc;
  }
  auto path = preflight(f, sub, true);
  if (!path.is_ok()) return fail(path.status());
  if (f.ranks == 1) {
    auto world = make_local_world(1);
    if (!world.is_ok()) return fail(world.status());
    return run_job(*world.value()[0], f, *path);
  }
  LaunchOptions lo;
  lo.ranks = f.ranks;
  lo.who = "treeattn generate";
  if (Status s = check_local_rank_count(lo, "--ranks"); !s.is_ok()) return fail(s);
  std::vector<std::string> args = inv.args;
  if (f.model.empty()) args.insert(args.end(), {"--model", *path});
  auto rc = run_under_mpirun(lo, args);
  if (!rc.is_ok()) return fail(rc.status());
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
                  "How ranks store the KV cache: auto (tiled, the layout the CPU kernel reads "
                  "fastest; rows for ring-kv and tree-det), rows or tiled")
      ->capture_default_str();
  sub->add_flag("--chat", f->chat,
                "Wrap the prompt in the model's chat format (ChatML, or Gemma's turns)");
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
