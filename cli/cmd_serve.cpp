// `treeattn serve`: an OpenAI-compatible HTTP server (src/serve/) over the serving engine
// (include/treeattn/engine.hpp): every rank of the job holds the model and a share of the
// paged KV cache; rank 0 also speaks HTTP.
//
// Threads of a rank: the main thread runs Engine::run, the only caller of the communicator;
// a signal thread takes the stop signals (they are blocked in every other thread); on rank 0,
// cpp-httplib's threads take connections and only submit, cancel and wait.
//
// Start-up, on every rank: rank 0 binds the port first (a port in use fails the job at once),
// and answers /health with 503 "Loading model" from then on; the model loads, the engine is
// created (collective), and rank 0 prints "listening on http://HOST:PORT" on stderr.
//
// Stopping. SIGTERM, SIGINT, SIGHUP or SIGUSR1 to rank 0: new requests get 503, the requests
// admitted or queued finish (Engine::stop(drain)); after --shutdown-timeout seconds the ones
// still running are cancelled; then every rank returns from the engine and the process exits
// 0. A second signal cancels at once. From a plain shell with --ranks P > 1 this command
// starts mpirun itself and turns a stop signal into SIGUSR1 for mpirun, which forwards it to
// every rank (SIGTERM to mpirun would kill the ranks within a second, before they drain); the
// other ranks ignore SIGUSR1 and return when rank 0's engine stops. Under your own mpirun,
// send SIGUSR1 to mpirun (or SIGTERM to rank 0) for the same.
//
// Failure. When the engine fails (a rank died, a communicator timeout) every request in flight
// ends with 503 (a streamed one with an error event), /health answers 503, and the job ends
// with a non-zero status (MPI_Abort, so no rank waits for a dead one). When a rank dies, mpirun
// ends the job with SIGTERM to the others at once; under this command's own mpirun (where stop
// signals arrive as SIGUSR1) rank 0 takes that SIGTERM as the job's end: every open request is
// answered 503 (an error event in a stream) and it exits 3. If the engine does not return
// within --shutdown-timeout + 15 s of a stop signal, the process exits 3 anyway.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>
#include <sstream>
#include <thread>

#include "commands.hpp"
#include "engine/exchange.hpp"
#include "engine/merge.hpp"
#include "job_status.hpp"
#include "launcher.hpp"
#include "options.hpp"
#include "serve/codec.hpp"
#include "serve/engine_backend.hpp"
#include "serve/model_info.hpp"
#include "serve/server.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/model.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct ServeFlags {
  std::string model;
  int ranks = 1;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string kv_memory;  // empty: the engine's default
  std::string kv_dtype = "f16";
  int64_t page_tokens = 64;
  int max_batch = 16;
  int64_t prefill_chunk = 256;
  std::string method = "tree";
  std::string prefill_exchange = "auto";
  int threads = 0;
  std::string matmul = "int8";  // --matmul: exact | int8 (model::MatmulMode)
  std::string api_key;
  int max_queue = 256;
  int64_t context = 0;
  int shutdown_timeout = 30;
  int timeout_ms = 600000;
  bool no_prefix_cache = false;
};

// The merge the engine runs for --method (auto: tree, the batch-invariant one).
std::string merge_of(const ServeFlags& f) { return f.method == "auto" ? "tree" : f.method; }

// Everything checkable before ranks start. On success: the model path.
Result<std::string> preflight(const ServeFlags& f) {
  if (f.ranks < 1 || f.ranks > 4096) return invalid_argument("--ranks must be in 1..4096");
  if (f.port < 0 || f.port > 65535) return invalid_argument("--port must be in 0..65535");
  if (f.host.empty()) return invalid_argument("--host: empty");
  if (!f.kv_memory.empty())
    if (auto b = parse_bytes(f.kv_memory); !b.is_ok())
      return invalid_argument("--kv-memory: " + b.status().message());
  const auto dt = parse_dtype(f.kv_dtype);
  if (!dt || (*dt != DType::kF16 && *dt != DType::kBF16 && *dt != DType::kF32))
    return invalid_argument("--kv-dtype '" + f.kv_dtype + "': one of f16, bf16, f32");
  if (f.page_tokens != 16 && (f.page_tokens < 32 || f.page_tokens > 256 || f.page_tokens % 32 != 0))
    return invalid_argument("--page-tokens " + std::to_string(f.page_tokens) +
                            ": 16 or a multiple of 32 up to 256");
  if (f.max_batch < 1) return invalid_argument("--max-batch must be >= 1");
  if (f.prefill_chunk < 1) return invalid_argument("--prefill-chunk must be >= 1");
  if (f.max_queue < 0) return invalid_argument("--max-queue must be >= 0");
  if (f.method != "auto" && !engine::parse_merge(f.method).is_ok())
    return invalid_argument("--method '" + f.method + "': one of tree, allreduce, allgather, auto");
  if (auto x = engine::parse_exchange(f.prefill_exchange); !x.is_ok())
    return Status(x.status().code(), "--prefill-exchange: " + x.status().message());
  TREEATTN_RETURN_IF_ERROR(check_thread_count(f.threads, "--threads"));
  if (auto mm = model::parse_matmul_mode(f.matmul); !mm.is_ok())
    return invalid_argument("--matmul " + f.matmul + ": expected exact or int8");
  if (f.context < 0) return invalid_argument("--context must be >= 0");
  if (f.shutdown_timeout < 0) return invalid_argument("--shutdown-timeout must be >= 0");
  TREEATTN_RETURN_IF_ERROR(check_timeout_ms("--timeout-ms", f.timeout_ms));
  auto path = resolve_model(f.model);
  if (!path.is_ok()) return path.status();
  auto m = model::LlamaModel::load(*path);
  if (!m.is_ok()) return m.status();
  auto tok = Tokenizer::from_gguf((*m)->file());
  if (!tok.is_ok()) return tok.status();
  return path;
}

engine::EngineConfig engine_config(const ServeFlags& f, int threads) {
  engine::EngineConfig c;
  c.kv_dtype = *parse_dtype(f.kv_dtype);
  c.page_tokens = f.page_tokens;
  if (!f.kv_memory.empty()) c.kv_memory = static_cast<std::size_t>(*parse_bytes(f.kv_memory));
  c.max_batch = f.max_batch;
  c.prefill_chunk = f.prefill_chunk;
  c.max_queue = f.max_queue;
  c.prefix_cache = !f.no_prefix_cache;
  c.merge = merge_of(f);
  c.prefill_exchange = f.prefill_exchange;
  c.threads = threads;
  c.matmul = *model::parse_matmul_mode(f.matmul);
  c.timeout = std::chrono::milliseconds(f.timeout_ms);
  return c;
}

// ---- signals ---------------------------------------------------------------------------------

// Started by `treeattn serve --ranks P` from a plain shell (run_job below sets it).
bool launched_by_serve() {
  const char* v = std::getenv("TREEATTN_SERVE_LAUNCHED");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

sigset_t stop_signals() {
  sigset_t s;
  sigemptyset(&s);
  for (const int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1}) sigaddset(&s, sig);
  return s;
}

// The stop signals reach the signal thread through a pipe: their handler writes the signal's
// number into it (async-signal-safe), whichever thread the kernel picked to run it. The signals
// are also blocked in this thread and the threads started after it (MPI's, OpenMP's, httplib's),
// so that system calls there are not interrupted; threads that existed before (OpenBLAS starts
// its pool when the program loads) and the signal thread take them.
int g_signal_pipe[2] = {-1, -1};

void on_stop_signal(int sig) {
  const auto b = static_cast<unsigned char>(sig);
  const ssize_t n = write(g_signal_pipe[1], &b, 1);
  (void)n;
}

void catch_stop_signals() {
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (const int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1}) sigaction(sig, &sa, nullptr);
  const sigset_t s = stop_signals();
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
}

// Rank 0: the first signal drains, the deadline or a second signal cancels, and a stuck engine
// ends the process. Other ranks: SIGTERM / SIGHUP end the process (how mpirun stops a job that
// lost a rank); SIGINT and SIGUSR1 are rank 0's business.
class SignalThread {
 public:
  SignalThread(bool lead, engine::Engine& engine, serve::HttpServer* http, int shutdown_timeout)
      : thread_([=, this, &engine] { loop(lead, engine, http, shutdown_timeout); }) {}
  ~SignalThread() {
    quit_ = true;
    thread_.join();
  }

 private:
  void loop(bool lead, engine::Engine& engine, serve::HttpServer* http, int shutdown_timeout) {
    const sigset_t set = stop_signals();
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);  // at least one thread takes them
    int count = 0;
    bool cancelled = false;
    Clock::time_point first;
    while (!quit_) {
      pollfd pfd{g_signal_pipe[0], POLLIN, 0};
      int sig = 0;
      if (poll(&pfd, 1, 200) > 0) {
        unsigned char b = 0;
        if (read(g_signal_pipe[0], &b, 1) == 1) sig = b;
      }
      if (sig > 0 && !lead) {
        if (sig == SIGTERM || sig == SIGHUP) _exit(128 + sig);
        continue;
      }
      if (sig == SIGTERM && launched_by_serve()) {
        // Our launcher turns stop signals into SIGUSR1; SIGTERM here is mpirun ending the job
        // because a rank died. The engine may wait forever for that rank: answer every request
        // with 503 now, then end this process.
        std::fprintf(stderr,
                     "treeattn serve: mpirun is ending the job (a rank died): answering 503 and "
                     "exiting\n");
        if (http != nullptr) {
          http->set_failed("a rank of the job died; the server is exiting",
                           std::chrono::milliseconds(0));
          http->wait_idle(Clock::now() + std::chrono::milliseconds(500));
          // A handler is done before httplib has written its response.
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
        }
        _exit(3);
      }
      if (sig > 0) {
        if (++count == 1) {
          first = Clock::now();
          std::fprintf(stderr,
                       "treeattn serve: %s: stopping: new requests get 503, running ones finish "
                       "(at most %d s)\n",
                       strsignal(sig), shutdown_timeout);
          if (http != nullptr) http->set_draining();
          engine.stop(true);
        } else if (!cancelled) {
          std::fprintf(stderr, "treeattn serve: %s again: cancelling the running requests\n",
                       strsignal(sig));
          engine.stop(false);
          cancelled = true;
        }
      }
      if (count == 0) continue;
      const auto waited = Clock::now() - first;
      if (!cancelled && waited > std::chrono::seconds(shutdown_timeout)) {
        std::fprintf(stderr,
                     "treeattn serve: --shutdown-timeout %d s passed: cancelling the requests "
                     "still running\n",
                     shutdown_timeout);
        engine.stop(false);
        cancelled = true;
      }
      if (waited > std::chrono::seconds(shutdown_timeout + 15)) {
        std::fprintf(stderr, "treeattn serve: the engine did not stop within %d s: exiting\n",
                     shutdown_timeout + 15);
        if (mpi_active()) abort_job(3, "");
        _exit(3);
      }
    }
  }

  std::atomic<bool> quit_{false};
  std::thread thread_;
};

// ---- the job (every rank) --------------------------------------------------------------------

int serve_job(Communicator& comm, const ServeFlags& f, const std::string& model_path) {
  const bool lead = comm.rank() == 0;
  const int P = comm.size();
  auto say = [&](const Status& s) {  // the engine's messages name their rank already
    if (s.message().rfind("rank ", 0) == 0)
      std::fprintf(stderr, "treeattn serve: error: %s\n", s.to_string().c_str());
    else
      std::fprintf(stderr, "treeattn serve: rank %d: error: %s\n", comm.rank(),
                   s.to_string().c_str());
  };
  // Every rank learns whether all could go on (a port in use, a model that does not load).
  auto agree = [&](const Status& local) {
    float bad = local.is_ok() ? 0.0f : 1.0f;
    if (!comm.allreduce(&bad, 1, ReduceOp::kMax).is_ok()) return false;
    return bad == 0.0f;
  };
  rank_status_phase("serve: start-up");
  const int threads = f.threads > 0 ? f.threads : default_threads(local_ranks(P));
  std::unique_ptr<serve::HttpServer> http;
  Status st;
  if (lead) {
    serve::ServerOptions so;
    so.host = f.host;
    so.port = f.port;
    so.api_key = f.api_key;
    // A worker per request waiting in the engine or streaming, and a few for /health, /metrics.
    so.threads =
        static_cast<int>(std::min<int64_t>(1024, int64_t{f.max_batch} + int64_t{f.max_queue} + 8));
    http = std::make_unique<serve::HttpServer>(so);
    st = http->bind();
    if (!st.is_ok()) say(st);
  }
  if (!agree(st)) return 2;
  if (lead) http->start();

  auto m = model::LlamaModel::load(model_path);
  st = m.is_ok() ? Status::ok() : m.status();
  std::unique_ptr<Tokenizer> tok;
  if (st.is_ok() && lead) {
    auto t = Tokenizer::from_gguf((*m)->file());
    if (t.is_ok())
      tok = std::make_unique<Tokenizer>(std::move(t).value());
    else
      st = t.status();
  }
  if (!st.is_ok()) say(st);
  if (!agree(st)) return 2;
  const model::LlamaConfig& cfg = (*m)->config();

  rank_status_phase("serve: engine set-up");
  const engine::EngineConfig ec = engine_config(f, threads);
  auto eng = engine::Engine::create(comm, **m, ec);
  if (!eng.is_ok()) {
    say(eng.status());
    return 2;
  }
  engine::Engine& engine = **eng;

  std::unique_ptr<serve::TokenizerCodec> codec;
  std::unique_ptr<serve::EngineBackend> backend;
  if (lead) {
    codec = std::make_unique<serve::TokenizerCodec>(*tok);
    backend = std::make_unique<serve::EngineBackend>(engine);
    const serve::ModelInfo info =
        serve::engine_model_info(model_path, **m, *tok, engine, ec, P, f.context);
    const engine::EngineMetrics em = engine.metrics();
    if (f.context > cfg.n_ctx_train && cfg.n_ctx_train > 0)
      std::fprintf(stderr,
                   "treeattn serve: note: --context %lld is beyond the model's training context "
                   "(%lld); RoPE positions past it degrade the text\n",
                   static_cast<long long>(f.context), static_cast<long long>(cfg.n_ctx_train));
    http->set_ready(*backend, *codec, info);
    std::fprintf(stderr,
                 "treeattn serve: %s | %d rank(s) x %d thread(s), matmul %s | merge %s | KV %s, "
                 "%lld pages of %lld tokens per rank, at most %lld tokens per sequence, context "
                 "%lld | max batch %d, prefill chunk %lld, queue %d\n",
                 info.id.c_str(), P, threads, f.matmul.c_str(), ec.merge.c_str(),
                 f.kv_dtype.c_str(),
                 static_cast<long long>(em.pages_per_rank), static_cast<long long>(f.page_tokens),
                 static_cast<long long>(engine.max_sequence_tokens()),
                 static_cast<long long>(info.context), f.max_batch,
                 static_cast<long long>(f.prefill_chunk), f.max_queue);
    std::fprintf(stderr, "treeattn serve: listening on http://%s:%d\n", f.host.c_str(),
                 http->port());
    std::fflush(stderr);
  }

  rank_status_phase("serve: serving");
  {
    SignalThread signals(lead, engine, http.get(), f.shutdown_timeout);
    st = engine.run();
  }
  if (!lead) {
    if (st.is_ok()) return 0;
    say(st);
    // Rank 0 answers its clients first; then nobody may wait for a dead rank.
    std::this_thread::sleep_for(std::chrono::seconds(3));
    if (mpi_active()) abort_job(3, "");
    return 3;
  }
  if (!st.is_ok()) {
    say(st);
    http->set_failed(st.to_string());
    http->wait_idle(Clock::now() + std::chrono::seconds(3));  // the 503s go out
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    http->stop();
    if (mpi_active()) abort_job(3, "treeattn serve: the engine failed; ending the job");
    return 3;
  }
  http->wait_idle(Clock::now() + std::chrono::seconds(5));  // the last events go out
  http->stop();
  const engine::EngineMetrics em = engine.metrics();
  std::fprintf(stderr,
               "treeattn serve: stopped after %lld requests (%lld prompt tokens, %lld of them "
               "from the prefix cache, %lld generated)\n",
               static_cast<long long>(em.requests_total),
               static_cast<long long>(em.prompt_tokens_total),
               static_cast<long long>(em.cached_tokens_total),
               static_cast<long long>(em.generated_tokens_total));
  return 0;
}

// ---- launching from a plain shell ------------------------------------------------------------

volatile std::sig_atomic_t g_signals = 0;
void count_signal(int) { g_signals = g_signals + 1; }

// mpirun with this command line; a stop signal becomes SIGUSR1 for mpirun (forwarded to every
// rank: rank 0 drains), a second one or a job that has not ended shutdown_timeout + 30 s later
// SIGTERM, and 10 s after that SIGKILL.
Result<int> run_job(const LaunchOptions& lo, const std::vector<std::string>& args,
                    int shutdown_timeout) {
  TREEATTN_RETURN_IF_ERROR(check_local_rank_count(lo, "--ranks"));
  const std::vector<std::string> cmd = mpirun_command(lo, args);
  std::vector<char*> argv;
  for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  struct sigaction sa {};
  sa.sa_handler = count_signal;
  sigemptyset(&sa.sa_mask);
  const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction old[3];
  for (int i = 0; i < 3; ++i) sigaction(sigs[i], &sa, &old[i]);
  const sigset_t blocked = stop_signals();  // blocked since serve_command began
  pthread_sigmask(SIG_UNBLOCK, &blocked, nullptr);
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
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

int serve_command(ServeFlags& f, const CLI::App& sub, const Invocation& inv) {
  // First: a stop signal during start-up is kept for the signal thread, not fatal.
  catch_stop_signals();
  if (f.api_key.empty())
    if (const char* k = std::getenv("TREEATTN_API_KEY"); k != nullptr) f.api_key = k;
  if (started_by_mpi_launcher()) {
    auto world = mpi_init_world(nullptr, nullptr);
    if (!world.is_ok()) return fail("serve", world.status());
    int rc = 2;
    {
      std::unique_ptr<Communicator> comm = std::move(world).value();
      auto path = preflight(f);
      float bad = path.is_ok() ? 0.0f : 1.0f;
      if (path.is_ok() && sub.count("--ranks") > 0 && f.ranks != comm->size()) {
        if (comm->rank() == 0)
          std::fprintf(stderr, "treeattn serve: error: --ranks %d but the MPI job has %d ranks\n",
                       f.ranks, comm->size());
        bad = 1.0f;
      }
      if (!comm->allreduce(&bad, 1, ReduceOp::kMax).is_ok() || bad != 0.0f) {
        if (comm->rank() == 0 && !path.is_ok()) fail("serve", path.status());
      } else {
        rc = serve_job(*comm, f, *path);
      }
    }
    (void)mpi_finalize();
    return rc;
  }
  auto path = preflight(f);
  if (!path.is_ok()) return fail("serve", path.status());
  if (f.ranks == 1) {
    auto world = make_local_world(1);
    if (!world.is_ok()) return fail("serve", world.status());
    return serve_job(*world.value()[0], f, *path);
  }
  LaunchOptions lo;
  lo.ranks = f.ranks;
  lo.who = "treeattn serve";
  std::vector<std::string> args = inv.args;
  if (f.model.empty()) args.insert(args.end(), {"--model", *path});
  auto rc = run_job(lo, args, f.shutdown_timeout);
  if (!rc.is_ok()) return fail("serve", rc.status());
  return rc.value();
}

}  // namespace

Runner add_serve_command(CLI::App& app, const Invocation& inv) {
  auto* sub = app.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, "
      "/health, /metrics) over the serving engine: every rank holds the model and a share of "
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
  sub->add_option("--kv-dtype", f->kv_dtype, "KV cache element type: f16, bf16, f32")
      ->capture_default_str();
  sub->add_option("--page-tokens", f->page_tokens, "Tokens per KV page (16, or 32..256 by 32)")
      ->capture_default_str();
  sub->add_option("--max-batch", f->max_batch, "Sequences in one engine step")
      ->capture_default_str();
  sub->add_option("--prefill-chunk", f->prefill_chunk,
                  "Prompt tokens per engine step over all prefilling sequences")
      ->capture_default_str();
  sub->add_option("--method", f->method,
                  "Per-layer merge of the ranks' attention states: tree (batch invariant), "
                  "allreduce, allgather, auto (tree)")
      ->capture_default_str();
  sub->add_option("--prefill-exchange", f->prefill_exchange,
                  "How a prompt chunk's attention crosses the ranks: pass-q (its queries travel), "
                  "kv (the cached K/V travels), auto (per chunk, fewer bytes; same bits)")
      ->capture_default_str();
  sub->add_option("--threads", f->threads, "Threads per rank (0: cores / ranks on the host)")
      ->capture_default_str();
  sub->add_option("--matmul", f->matmul,
                  "Quantized weights: int8 (activations quantized to 8 bits per 32, integer dot "
                  "products) or exact (float activations; the tested reference)")
      ->capture_default_str();
  sub->add_option("--api-key", f->api_key,
                  "Require Authorization: Bearer KEY on every route but /health (default: "
                  "$TREEATTN_API_KEY; none when empty)");
  sub->add_option("--max-queue", f->max_queue,
                  "Requests waiting for KV pages; beyond it new ones get 429 + Retry-After")
      ->capture_default_str();
  sub->add_option("--context", f->context,
                  "Tokens per sequence, prompt + generated (0: the model's training context)")
      ->capture_default_str();
  sub->add_flag("--no-prefix-cache", f->no_prefix_cache,
                "Do not reuse the KV pages of earlier prompts");
  sub->add_option("--shutdown-timeout", f->shutdown_timeout,
                  "Seconds after a stop signal before running requests are cancelled")
      ->capture_default_str();
  sub->add_option("--timeout-ms", f->timeout_ms,
                  "Per communicator operation: a rank silent this long fails the engine (503)")
      ->capture_default_str();
  return [f, sub, &inv] { return serve_command(*f, *sub, inv); };
}

}  // namespace treeattn::cli
