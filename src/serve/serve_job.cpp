// One rank of `treeattn serve` (serve_job.hpp).
#include "serve/serve_job.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "serve/codec.hpp"
#include "serve/engine_backend.hpp"
#include "serve/model_info.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/model.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::serve {
namespace {

using Clock = std::chrono::steady_clock;

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

// Rank 0: the first signal drains, the deadline or a second signal cancels, and a stuck engine
// ends the process. Other ranks: SIGTERM / SIGHUP end the process (how mpirun stops a job that
// lost a rank); SIGINT and SIGUSR1 are rank 0's business.
class SignalThread {
 public:
  SignalThread(bool lead, engine::Engine& engine, HttpServer* http, const ServeJob& job)
      : thread_([=, this, &engine, &job] { loop(lead, engine, http, job); }) {}
  ~SignalThread() {
    quit_ = true;
    thread_.join();
  }

 private:
  void loop(bool lead, engine::Engine& engine, HttpServer* http, const ServeJob& job) {
    const int shutdown_timeout = job.shutdown_timeout_s;
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
      if (sig == SIGTERM && job.sigterm_ends_job) {
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
        if (job.abort_job) job.abort_job(3, "");
        _exit(3);
      }
    }
  }

  std::atomic<bool> quit_{false};
  std::thread thread_;
};

}  // namespace

std::chrono::milliseconds collective_timeout(std::chrono::milliseconds serve_timeout) {
  if (serve_timeout.count() <= 0) return serve_timeout;
  // The communicator names the silent ranks after a timeout, waiting up to half its timeout
  // (at most 2 s) for the others' reports (src/comm/mpi): that time comes off.
  return serve_timeout - std::min<std::chrono::milliseconds>(serve_timeout / 3,
                                                             std::chrono::seconds(2));
}

sigset_t stop_signals() {
  sigset_t s;
  sigemptyset(&s);
  for (const int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1}) sigaddset(&s, sig);
  return s;
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

// ---- the job (every rank) --------------------------------------------------------------------

int run_serve_job(Communicator& comm, const ServeJob& job) {
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
  auto phase = [&](std::string_view what) {
    if (job.phase) job.phase(what);
  };
  auto end_job = [&](std::string_view message) {
    if (job.abort_job) job.abort_job(3, message);
  };
  const engine::EngineConfig& ec = job.engine;
  phase("serve: start-up");
  std::unique_ptr<HttpServer> http;
  Status st;
  if (lead) {
    ServerOptions so = job.http;
    // A worker per request waiting in the engine or streaming, and a few for /health, /metrics.
    so.threads = static_cast<int>(
        std::min<int64_t>(1024, int64_t{ec.max_batch} + int64_t{ec.max_queue} + 8));
    http = std::make_unique<HttpServer>(so);
    st = http->bind();
    if (!st.is_ok()) say(st);
  }
  if (!agree(st)) return 2;
  if (lead) http->start();

  auto m = model::LlamaModel::load(job.model_path);
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
  // The agreement: the ranks then enter Engine::create, whose collectives are timed
  // (ec.timeout), together, whatever a slow disk or a busy host made of their loading (the
  // agreement itself waits without a limit, as the start-up always did). The engine copies the
  // rows it computes with into the decode layout (rows8) itself, once it knows its slice.
  if (!agree(st)) return 2;
  const model::LlamaConfig& cfg = (*m)->config();

  phase("serve: engine set-up");
  engine::EngineConfig timed = ec;
  timed.timeout = collective_timeout(ec.timeout);
  auto eng = engine::Engine::create(comm, **m, timed);
  if (!eng.is_ok()) {
    say(eng.status());
    return 2;
  }
  engine::Engine& engine = **eng;

  std::unique_ptr<TokenizerCodec> codec;
  std::unique_ptr<EngineBackend> backend;
  if (lead) {
    codec = std::make_unique<TokenizerCodec>(*tok);
    backend = std::make_unique<EngineBackend>(engine);
    const ModelInfo info = engine_model_info(job.model_path, **m, *tok, engine, ec, P, job.context);
    const engine::EngineMetrics em = engine.metrics();
    if (job.context > cfg.n_ctx_train && cfg.n_ctx_train > 0)
      std::fprintf(stderr,
                   "treeattn serve: note: --context %lld is beyond the model's training context "
                   "(%lld); RoPE positions past it degrade the text\n",
                   static_cast<long long>(job.context), static_cast<long long>(cfg.n_ctx_train));
    http->set_ready(*backend, *codec, info);
    std::fprintf(stderr,
                 "treeattn serve: %s | %d rank(s) x %d thread(s), matmul %s | dense %s | merge "
                 "%s | KV %s, "
                 "%lld pages of %lld tokens per rank, at most %lld tokens per sequence, context "
                 "%lld | max batch %d, prefill chunk %lld, queue %d | timeout %lld ms\n",
                 info.id.c_str(), P, ec.threads,
                 model::matmul_description({ec.threads, ec.isa, ec.matmul}).c_str(),
                 engine::describe_dense(engine.dense_choice()).c_str(),
                 engine::describe_merge(engine.merge_choice()).c_str(),
                 std::string(dtype_name(ec.kv_dtype)).c_str(),
                 static_cast<long long>(em.pages_per_rank), static_cast<long long>(ec.page_tokens),
                 static_cast<long long>(engine.max_sequence_tokens()),
                 static_cast<long long>(info.context), ec.max_batch,
                 static_cast<long long>(ec.prefill_chunk), ec.max_queue,
                 static_cast<long long>(ec.timeout.count()));
    if (em.window_pages_per_rank > 0) {
      int64_t local = 0;
      for (const uint8_t w : em.layer_in_window) local += w;
      std::fprintf(stderr,
                   "treeattn serve: sliding-window layers (%lld of %zu): %lld window pages per "
                   "rank, each sequence keeps the pages of its window (%lld positions)\n",
                   static_cast<long long>(local), em.layer_in_window.size(),
                   static_cast<long long>(em.window_pages_per_rank),
                   static_cast<long long>(engine.model().config().sliding_window));
    }
    std::fprintf(stderr, "treeattn serve: chat: %s\n", info.chat.describe().c_str());
    std::fprintf(stderr, "treeattn serve: listening on http://%s:%d\n", job.http.host.c_str(),
                 http->port());
    std::fflush(stderr);
    if (job.listening) job.listening(http->port());
  }

  phase("serve: serving");
  {
    SignalThread signals(lead, engine, http.get(), job);
    st = engine.run();
  }
  if (!lead) {
    if (st.is_ok()) return 0;
    say(st);
    // Rank 0 answers its clients first; then nobody may wait for a dead rank.
    std::this_thread::sleep_for(std::chrono::seconds(3));
    end_job("");
    return 3;
  }
  if (!st.is_ok()) {
    say(st);
    const auto failed_at = Clock::now();
    http->set_failed(st.to_string());
    http->wait_idle(failed_at + std::chrono::seconds(3));  // the 503s go out
    // A handler is done before httplib has written its response; and /health answers 503 for
    // a second at least, so that a health checker sees the failure, not only a closed port.
    std::this_thread::sleep_until(std::max(Clock::now() + std::chrono::milliseconds(200),
                                           failed_at + std::chrono::seconds(1)));
    http->stop();
    end_job("treeattn serve: the engine failed; ending the job");
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

}  // namespace treeattn::serve
