// One rank of `treeattn serve` as a library call: the job that every rank runs over its
// communicator, and the stop-signal handling around it. The CLI parses the flags, starts the
// ranks (its own mpirun, or the job's) and calls run_serve_job on each.
//
// Threads of a rank: the calling thread runs Engine::run, the only caller of the communicator;
// a signal thread takes the stop signals (they are blocked in every other thread); on rank 0,
// cpp-httplib's threads take connections and only submit, cancel and wait.
//
// Start-up, on every rank: rank 0 binds the port first (a port in use fails the job at once),
// and answers /health with 503 "Loading model" from then on; the model loads, the engine is
// created (collective), and rank 0 prints "listening on http://HOST:PORT" on stderr.
//
// Stopping. SIGTERM, SIGINT, SIGHUP or SIGUSR1 to rank 0: new requests get 503, the requests
// admitted or queued finish (Engine::stop(drain)); after shutdown_timeout_s the ones still
// running are cancelled; then every rank returns from the engine and run_serve_job returns 0.
// A second signal cancels at once. Other ranks: SIGTERM and SIGHUP end the process (how mpirun
// stops a job that lost a rank); SIGINT and SIGUSR1 are rank 0's business. With
// sigterm_ends_job (the ranks of serve's own mpirun, which turns stop signals into SIGUSR1),
// SIGTERM to rank 0 is mpirun ending the job because a rank died: every open request is answered
// 503 and the process exits 3. If the engine does not return within shutdown_timeout_s + 15 s of
// a stop signal, the process exits 3 anyway (through abort_job first where one is given).
//
// Failure. When the engine fails (a rank died, a communicator timeout) every request in flight
// ends with 503 (a streamed one with an error event), /health answers 503 (for a second at
// least), and run_serve_job returns 3 after abort_job (the CLI's MPI_Abort, so that no rank
// waits for a dead one).
//
// The serve timeout (engine.timeout, `serve --timeout-ms`, default EngineConfig's 10 s): a rank
// silent this long fails the engine, so /health answers 503 and the requests in flight end
// within it of a host going away (a link down, its ranks stopped). The communicator's
// per-operation limit is collective_timeout() of it: the rest is the time the communicator
// takes to name the silent ranks. It cannot fire during a long prefill or an idle spell: every
// rank runs every step in lockstep (the same rows of each layer, split evenly), so a collective
// waits only for the imbalance between the ranks, not for a step's length; an idle rank 0
// broadcasts an empty step every EngineConfig::idle_tick (250 ms: the heartbeat), so the other
// ranks' wait for the next step stays short too; and /health reads the server's state only,
// never waiting on the engine. Start-up (the model's load, which may differ by seconds between
// hosts) ends in an untimed agreement, so that Engine::create's timed collectives start
// together.
#pragma once

#include <signal.h>

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

#include "serve/server.hpp"
#include "treeattn/comm.hpp"
#include "treeattn/engine.hpp"

namespace treeattn::serve {

struct ServeJob {
  std::string model_path;
  engine::EngineConfig engine;  // threads: per rank, already resolved
  ServerOptions http;           // host, port, api_key (threads: from max_batch and max_queue)
  int64_t context = 0;          // tokens per sequence (0: the model's training context)
  int shutdown_timeout_s = 30;
  bool sigterm_ends_job = false;  // see the head comment
  // Optional: what the rank is doing (every rank), rank 0's bound port once it listens, and how
  // to end the whole job (called where ranks may wait for a dead one; not given: nothing more
  // than the exit).
  std::function<void(std::string_view phase)> phase;
  std::function<void(int port)> listening;
  std::function<void(int code, std::string_view message)> abort_job;
};

// The communicator's per-operation timeout for a serve timeout (0: 0, wait forever): the serve
// timeout less the grace the MPI communicator spends naming the silent ranks after a timeout
// (half its timeout, at most 2 s), so that the engine fails within the serve timeout.
std::chrono::milliseconds collective_timeout(std::chrono::milliseconds serve_timeout);

// The stop signals: SIGTERM, SIGINT, SIGHUP, SIGUSR1.
sigset_t stop_signals();
// Routes the stop signals to run_serve_job's signal thread (a pipe their handler writes to)
// and blocks them in the calling thread and the threads it starts afterwards. Call first, before
// any other thread starts, so that a signal during start-up is kept, not fatal.
void catch_stop_signals();

// Collective over comm; every rank calls it with the same job. Returns the process's exit code:
// 0 after a stop, 2 when start-up failed (every rank; rank 0 says why), 3 when the engine failed.
int run_serve_job(Communicator& comm, const ServeJob& job);

}  // namespace treeattn::serve
