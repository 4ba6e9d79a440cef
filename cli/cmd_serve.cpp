// `treeattn serve`: an OpenAI-compatible HTTP server (src/serve/) over the serving engine
// (include/treeattn/engine.hpp): every rank of the job holds the model and a share of the
// paged KV cache; rank 0 also speaks HTTP.
//
// What every rank runs (start-up, the threads, stopping on a signal, failure) is the serve
// library's run_serve_job (src/serve/serve_job.hpp). This command checks the flags and the model
// first, then runs it on one rank here, under the job's mpirun, or under an mpirun of its own.
// From a plain shell with --ranks P > 1 it starts mpirun itself and turns a stop signal into
// SIGUSR1 for mpirun, which forwards it to every rank (SIGTERM to mpirun would kill the ranks
// within a second, before they drain): rank 0 drains, the other ranks ignore SIGUSR1 and return
// when rank 0's engine stops, and SIGTERM to rank 0 means mpirun is ending the job because a
// rank died (every open request answered 503, exit 3). Under your own mpirun, send SIGUSR1 to
// mpirun (or SIGTERM to rank 0) to stop. When the engine fails the job ends through MPI_Abort,
// so that no rank waits for a dead one.
#include <fcntl.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "engine/dense_plan.hpp"
#include "engine/exchange.hpp"
#include "engine/layer_merge.hpp"
#include "options.hpp"
#include "tuning.hpp"
#include "serve/serve_job.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/job_status.hpp"
#include "treeattn/launch.hpp"
#include "treeattn/model.hpp"
#include "treeattn/tokenizer.hpp"
#include "treeattn/topology.hpp"

namespace treeattn::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct ServeFlags {
  std::string model;
  int ranks = 1;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string kv_memory;  // empty: the engine's default
  int64_t kv_window_pages = -1;  // EngineConfig::kv_window_pages
  std::string kv_dtype = "f16";
  int64_t page_tokens = engine::EngineConfig{}.page_tokens;
  int max_batch = 16;
  int64_t prefill_chunk = 256;
  std::string method = "auto";
  std::string topology;  // what auto plans on: a file or preset; empty: this job's
  int fanout = 2;
  std::string prefill_exchange = "auto";
  std::string dense = "auto";
  int threads = 0;
  std::string isa = "auto";
  std::string matmul;  // --matmul: exact | int8 | int8-ffn; "" until preflight: the model's
  std::string api_key;
  int max_queue = 256;
  int64_t context = 0;
  int shutdown_timeout = 30;
  int timeout_ms = static_cast<int>(engine::EngineConfig{}.timeout.count());
  int read_timeout = 30;
  int max_conns_per_peer = 256;
  int stall_timeout_ms = 5000;
  double request_timeout = 0;
  bool no_prefix_cache = false;
  bool no_rows8 = false;
  bool no_tune = false;  // --no-tune
  std::vector<std::string> served_model_names;
  std::vector<std::string> cors_origins;
};

// Everything checkable before ranks start. On success: the model path, and f.matmul set (the
// model's default when --matmul was not given).
Result<std::string> preflight(ServeFlags& f) {
  if (f.ranks < 1 || f.ranks > 4096) return invalid_argument("--ranks must be in 1..4096");
  if (f.port < 0 || f.port > 65535) return invalid_argument("--port must be in 0..65535");
  if (f.host.empty()) return invalid_argument("--host: empty");
  if (!f.kv_memory.empty())
    if (auto b = parse_bytes(f.kv_memory); !b.is_ok())
      return invalid_argument("--kv-memory: " + b.status().message());
  TREEATTN_RETURN_IF_ERROR(kv_dtype_for_flag(f.kv_dtype).status());
  if (f.page_tokens != 16 && (f.page_tokens < 32 || f.page_tokens > 256 || f.page_tokens % 32 != 0))
    return invalid_argument("--page-tokens " + std::to_string(f.page_tokens) +
                            ": 16 or a multiple of 32 up to 256");
  if (f.max_batch < 1) return invalid_argument("--max-batch must be >= 1");
  if (f.prefill_chunk < 1) return invalid_argument("--prefill-chunk must be >= 1");
  if (f.max_queue < 1)
    return invalid_argument("--max-queue must be >= 1 (0 would refuse every request)");
  {
    const auto known = engine::merge_methods(CommCapabilities{});
    if (f.method != "auto" && std::find(known.begin(), known.end(), f.method) == known.end()) {
      std::string list;
      for (const auto& m : known) list += m + ", ";
      return invalid_argument("--method '" + f.method +
                              "': not a strategy that merges a batch of states (one of " + list +
                              "auto)");
    }
  }
  if (f.fanout < 1) return invalid_argument("--fanout must be >= 1");
  if (!f.topology.empty())
    if (auto t = load_topology(f.topology); !t.is_ok())
      return Status(t.status().code(), "--topology: " + t.status().message());
  if (auto x = engine::parse_exchange(f.prefill_exchange); !x.is_ok())
    return Status(x.status().code(), "--prefill-exchange: " + x.status().message());
  if (Status d = engine::check_dense_name(f.dense); !d.is_ok())
    return Status(d.code(), "--dense: " + d.message());
  TREEATTN_RETURN_IF_ERROR(check_thread_count(f.threads, "--threads"));
  TREEATTN_RETURN_IF_ERROR(check_matmul_flag(f.matmul));  // before a model is fetched
  TREEATTN_RETURN_IF_ERROR(isa_for_flag(f.isa).status());
  if (f.context < 0) return invalid_argument("--context must be >= 0");
  if (f.shutdown_timeout < 0) return invalid_argument("--shutdown-timeout must be >= 0");
  TREEATTN_RETURN_IF_ERROR(check_timeout_ms("--timeout-ms", f.timeout_ms));
  if (f.read_timeout < 1 || f.read_timeout > 3600)
    return invalid_argument("--read-timeout must be in 1..3600 seconds");
  if (f.max_conns_per_peer < 0) return invalid_argument("--max-conns-per-peer must be >= 0");
  TREEATTN_RETURN_IF_ERROR(check_timeout_ms("--stall-timeout-ms", f.stall_timeout_ms));
  if (!(f.request_timeout >= 0 && f.request_timeout <= 86400))
    return invalid_argument("--request-timeout must be in 0..86400 seconds");
  for (std::size_t i = 0; i < f.served_model_names.size(); ++i) {
    const std::string& n = f.served_model_names[i];
    if (n.empty()) return invalid_argument("--served-model-name: an empty name");
    if (std::find(f.served_model_names.begin(), f.served_model_names.begin() + i, n) !=
        f.served_model_names.begin() + i)
      return invalid_argument("--served-model-name: '" + n + "' is given twice");
  }
  for (const std::string& o : f.cors_origins)
    if (o != "*" && (o.empty() || o.find_first_of(" \t\r\n") != std::string::npos ||
                     o.find("://") == std::string::npos))
      return invalid_argument("--cors-origins: '" + o +
                              "' is neither * nor an origin such as https://app.example.com");
  auto path = resolve_model(f.model);
  if (!path.is_ok()) return path.status();
  auto matmul = matmul_for_model(f.matmul, *path);
  if (!matmul.is_ok()) return matmul.status();
  f.matmul = *matmul;
  auto m = model::LlamaModel::load(*path);
  if (!m.is_ok()) return m.status();
  auto tok = Tokenizer::from_gguf((*m)->file());
  if (!tok.is_ok()) return tok.status();
  // The CPU kernels' tuning for the model's attention on this launch's ranks.
  const auto& cfg = (*m)->config();
  const int threads = f.threads > 0 ? f.threads : default_threads(f.ranks);
  tune_at_start("serve",
                {TuneKey{*parse_dtype(f.kv_dtype), cfg.head_dim,
                         cfg.n_head / std::max<int64_t>(1, cfg.n_head_kv), threads}},
                {threads});
  return path;
}

engine::EngineConfig engine_config(const ServeFlags& f, int threads) {
  engine::EngineConfig c;
  c.kv_dtype = *parse_dtype(f.kv_dtype);
  c.page_tokens = f.page_tokens;
  if (!f.kv_memory.empty()) c.kv_memory = static_cast<std::size_t>(*parse_bytes(f.kv_memory));
  c.kv_window_pages = f.kv_window_pages;
  c.max_batch = f.max_batch;
  c.prefill_chunk = f.prefill_chunk;
  c.max_queue = f.max_queue;
  c.prefix_cache = !f.no_prefix_cache;
  c.rows8 = !f.no_rows8;
  c.merge = f.method;
  c.topology = f.topology;
  c.fanout = f.fanout;
  c.prefill_exchange = f.prefill_exchange;
  c.dense = f.dense;
  c.threads = threads;
  c.isa = *isa_for_flag(f.isa);
  c.matmul = *model::parse_matmul_mode(f.matmul);
  c.timeout = std::chrono::milliseconds(f.timeout_ms);
  return c;
}

// Started by `treeattn serve --ranks P` from a plain shell (run_job below sets it).
bool launched_by_serve() {
  const char* v = std::getenv("TREEATTN_SERVE_LAUNCHED");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// The job (every rank): the serve library's run_serve_job (src/serve/serve_job.hpp).
int serve_job(Communicator& comm, const ServeFlags& f, const std::string& model_path) {
  serve::ServeJob job;
  job.model_path = model_path;
  job.engine =
      engine_config(f, f.threads > 0 ? f.threads : default_threads(local_ranks(comm.size())));
  job.http.host = f.host;
  job.http.port = f.port;
  job.http.api_key = f.api_key;
  job.http.read_timeout = std::chrono::seconds(f.read_timeout);
  job.http.max_connections_per_peer = f.max_conns_per_peer;
  job.http.stall_timeout = std::chrono::milliseconds(f.stall_timeout_ms);
  job.http.request_timeout = std::chrono::milliseconds(static_cast<int64_t>(f.request_timeout * 1000));
  job.http.served_model_names = f.served_model_names;
  job.http.cors_origins = f.cors_origins;
  job.context = f.context;
  job.shutdown_timeout_s = f.shutdown_timeout;
  job.sigterm_ends_job = launched_by_serve();
  job.phase = [](std::string_view what) { launch::rank_status_phase(what); };
  job.abort_job = [](int code, std::string_view message) {
    if (mpi_active()) launch::abort_job(code, message);
  };
  return serve::run_serve_job(comm, job);
}

// ---- launching from a plain shell ------------------------------------------------------------

volatile std::sig_atomic_t g_signals = 0;
void count_signal(int) { g_signals = g_signals + 1; }

// mpirun with this command line; a stop signal becomes SIGUSR1 for mpirun (forwarded to every
// rank: rank 0 drains), a second one or a job that has not ended shutdown_timeout + 30 s later
// SIGTERM, and 10 s after that SIGKILL.
Result<int> run_job(const launch::LaunchOptions& lo, const std::vector<std::string>& args,
                    int shutdown_timeout) {
  TREEATTN_RETURN_IF_ERROR(launch::check_local_rank_count(lo, "--ranks"));
  const std::vector<std::string> cmd = launch::mpirun_command(lo, args);
  std::vector<char*> argv;
  for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  struct sigaction sa {};
  sa.sa_handler = count_signal;
  sigemptyset(&sa.sa_mask);
  const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction old[3];
  for (int i = 0; i < 3; ++i) sigaction(sigs[i], &sa, &old[i]);
  const sigset_t blocked = serve::stop_signals();  // blocked since serve_command began
  pthread_sigmask(SIG_UNBLOCK, &blocked, nullptr);
  // The ranks record their pids here: a mpirun that is SIGKILLed leaves them running and its
  // shared memory behind, which only this process can then clean up.
  const std::string status_dir = launch::make_job_status_dir();
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return internal_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    for (int i = 0; i < 3; ++i) sigaction(sigs[i], &old[i], nullptr);
    std::signal(SIGPIPE, SIG_DFL);
    setpgid(0, 0);  // terminal signals reach the launcher only
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(128 + SIGTERM);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) {
      dup2(devnull, STDIN_FILENO);
      close(devnull);
    }
    setenv("TREEATTN_LAUNCHED", "1", 1);
    setenv("TREEATTN_SERVE_LAUNCHED", "1", 1);
    if (!status_dir.empty()) setenv("TREEATTN_STATUS_DIR", status_dir.c_str(), 1);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "treeattn serve: cannot run %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  int handled = 0;
  Clock::time_point first, term;
  bool termed = false, killed = false;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR)
      return internal_error(std::string("waitpid failed: ") + std::strerror(errno));
    const int seen = g_signals;
    if (seen > handled) {
      if (handled == 0) {
        first = Clock::now();
        kill(pid, SIGUSR1);
      } else if (!termed) {
        kill(pid, SIGTERM);
        termed = true;
        term = Clock::now();
      }
      handled = seen;
    }
    if (handled > 0 && !termed &&
        Clock::now() - first > std::chrono::seconds(shutdown_timeout + 30)) {
      std::fprintf(stderr, "treeattn serve: the job did not stop: terminating it\n");
      kill(pid, SIGTERM);
      termed = true;
      term = Clock::now();
    }
    if (termed && !killed && Clock::now() - term > std::chrono::seconds(10)) {
      kill(pid, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (int i = 0; i < 3; ++i) sigaction(sigs[i], &old[i], nullptr);
  const bool mpirun_killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  if (mpirun_killed && !killed)
    std::fprintf(stderr,
                 "treeattn serve: mpirun was killed (SIGKILL): ending its ranks (rank 0 answers "
                 "its open requests with an error first) and removing their shared memory\n");
  // SIGTERM first: rank 0 then ends every open request with an error (a stream with an error
  // event and [DONE]) before it exits.
  launch::clean_up_job(status_dir, mpirun_killed, std::chrono::seconds(killed ? 0 : 5));
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

int serve_command(ServeFlags& f, const CLI::App& sub, const Invocation& inv) {
  apply_no_tune(f.no_tune);
  // First: a stop signal during start-up is kept for the signal thread, not fatal.
  serve::catch_stop_signals();
  if (f.api_key.empty())
    if (const char* k = std::getenv("TREEATTN_API_KEY"); k != nullptr) f.api_key = k;
  auto job = [&](Communicator& comm, const std::string& path) { return serve_job(comm, f, path); };
  auto launch = [&](const std::string& path) {
    launch::LaunchOptions lo;
    lo.ranks = f.ranks;
    lo.who = "treeattn serve";
    std::vector<std::string> args = inv.args;
    if (f.model.empty()) args.insert(args.end(), {"--model", path});
    auto rc = run_job(lo, args, f.shutdown_timeout);
    return rc.is_ok() ? rc.value() : fail("serve", rc.status());
  };
  return launch::run_model_command(
      "serve", f.ranks, sub.count("--ranks") > 0, [&](bool) { return preflight(f); }, job, launch);
}

}  // namespace

Runner add_serve_command(CLI::App& app, const Invocation& inv) {
  auto* sub = app.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, "
      "/health, /metrics; llama-server's /tokenize, /detokenize, /apply-template) over the "
      "serving engine: every rank holds the model and a share of "
      "the paged KV cache, rank 0 speaks HTTP");
  auto f = std::make_shared<ServeFlags>();
  add_model_option(*sub, f->model);
  sub->add_option("--ranks", f->ranks,
                  "Ranks (from a plain shell, P > 1 starts them with mpirun; under mpirun: the "
                  "job's)")
      ->capture_default_str();
  sub->add_option("--host", f->host, "Address to listen on (0.0.0.0: every interface)")
      ->capture_default_str();
  sub->add_option("--port", f->port, "Port to listen on (0: any free port, printed)")
      ->capture_default_str();
  sub->add_option("--kv-memory", f->kv_memory,
                  "KV page memory per rank, e.g. 2G (default: half of MemAvailable over the "
                  "ranks of the host)");
  sub->add_option("--kv-window-pages", f->kv_window_pages,
                  "Pages per rank of the sliding-window layers (gemma3's local layers), which "
                  "drop what their window has passed (-1: auto, max-batch windows and a prefill "
                  "chunk; 0: those layers keep every position, as global layers)")
      ->capture_default_str();
  add_kv_dtype_option(*sub, f->kv_dtype);
  sub->add_option("--page-tokens", f->page_tokens, "Tokens per KV page (16, or 32..256 by 32)")
      ->capture_default_str();
  sub->add_option("--max-batch", f->max_batch, "Sequences in one engine step")
      ->capture_default_str();
  sub->add_option("--prefill-chunk", f->prefill_chunk,
                  "Prompt tokens per engine step over all prefilling sequences")
      ->capture_default_str();
  sub->add_option("--method", f->method,
                  "Per-layer merge of the ranks' attention states: a strategy that merges a batch "
                  "of states (tree, tree-paper, tree2, hier, ring-state, allgather, gather-root, "
                  "tree-det) or auto (the planner's fastest batch-invariant merge on --topology; "
                  "the banner and /v1/models name it)")
      ->capture_default_str();
  sub->add_option("--topology", f->topology,
                  "Topology file or preset that --method auto plans on (default: this job as MPI "
                  "shows it: ranks grouped by host)");
  sub->add_option("--fanout", f->fanout, "hier: children per leader in the inter-node tree")
      ->capture_default_str();
  sub->add_option("--prefill-exchange", f->prefill_exchange,
                  "How a prompt chunk's attention crosses the ranks: pass-q (its queries travel), "
                  "kv (the cached K/V travels), auto (per chunk, fewer bytes; same bits)")
      ->capture_default_str();
  sub->add_option("--dense", f->dense,
                  "The dense layers over the ranks: split (each rank holds and computes 1/p of "
                  "every projection's outputs, all-gathered per matrix group), replicated (every "
                  "rank holds the whole model and computes its share of a step's rows), auto (the "
                  "cost model's choice for one decoding sequence on --topology; same bits)")
      ->capture_default_str();
  sub->add_option("--threads", f->threads, "Threads per rank (0: cores / ranks on the host)")
      ->capture_default_str();
  add_matmul_option(*sub, f->matmul);
  add_isa_option(*sub, f->isa);
  sub->add_option("--api-key", f->api_key,
                  "Require Authorization: Bearer KEY on every route but /health (default: "
                  "$TREEATTN_API_KEY; none when empty)");
  sub->add_option("--served-model-name", f->served_model_names,
                  "Name(s) clients use for the model (repeat or a comma list): /v1/models lists "
                  "them, the first is the id; a request whose \"model\" is another gets 404 "
                  "model_not_found (default: the file's name, and any \"model\" is accepted)")
      ->delimiter(',');
  sub->add_option("--cors-origins", f->cors_origins,
                  "Origins allowed to call the server from a browser (a comma list, or *): "
                  "preflights are answered and responses carry Access-Control-Allow-Origin "
                  "(default: none, no CORS headers)")
      ->delimiter(',');
  sub->add_option("--max-queue", f->max_queue,
                  "Requests waiting for KV pages (>= 1); beyond it new ones get 429 + Retry-After")
      ->capture_default_str();
  sub->add_option("--read-timeout", f->read_timeout,
                  "Seconds for a request's whole head and body to arrive, from its first byte "
                  "(else 408 and the connection closes; slow clients hold no worker meanwhile)")
      ->capture_default_str();
  sub->add_option("--max-conns-per-peer", f->max_conns_per_peer,
                  "Open connections from one client address; beyond it 503 and closed (0: no cap)")
      ->capture_default_str();
  sub->add_option("--stall-timeout-ms", f->stall_timeout_ms,
                  "/health answers 503 while requests are open and the engine has made no "
                  "progress (no layer of a step completed) for this long: a stalled rank, long "
                  "before --timeout-ms fails the engine (0: never)")
      ->capture_default_str();
  sub->add_option("--request-timeout", f->request_timeout,
                  "Default deadline of a completion in seconds (a body's \"timeout\" field "
                  "overrides it): it then ends with its text so far and finish_reason "
                  "\"timeout\" (0: none)")
      ->capture_default_str();
  sub->add_option("--context", f->context,
                  "Tokens per sequence, prompt + generated (0: the model's training context)")
      ->capture_default_str();
  add_no_tune_flag(*sub, f->no_tune);
  sub->add_flag("--no-prefix-cache", f->no_prefix_cache,
                "Do not reuse the KV pages of earlier prompts");
  add_rows8_flag(*sub, f->no_rows8);
  sub->add_option("--shutdown-timeout", f->shutdown_timeout,
                  "Seconds after a stop signal before running requests are cancelled")
      ->capture_default_str();
  sub->add_option("--timeout-ms", f->timeout_ms,
                  "A rank silent this long (a host down or stopped) fails the engine: /health "
                  "and the requests in flight answer 503, the job exits 3 (0: wait forever). "
                  "Collectives wait only for the imbalance between ranks, never a whole step, "
                  "and an idle server sends a heartbeat step every 250 ms")
      ->capture_default_str();
  return [f, sub, &inv] { return serve_command(*f, *sub, inv); };
}

}  // namespace treeattn::cli
