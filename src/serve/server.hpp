// The HTTP side of `treeattn serve`: cpp-httplib routes over a Backend (the engine), on rank 0.
//
// Threads. cpp-httplib accepts connections on one thread and runs each connection on a worker
// of its pool. A worker only parses, tokenizes, submits to the backend and then waits on its
// request's own queue, which the backend's callback feeds (on the engine's step thread: the
// callback only appends the event and wakes the worker). No worker ever calls the
// communicator: the engine's step loop (Engine::run, on the main thread of every rank) is the
// only caller.
//
// Routes (every one but /health needs `Authorization: Bearer KEY` when an API key is set):
//   GET  /health               200 {"status":"ok"}; 503 with an error body while the model
//                              loads, while shutting down, and after the engine failed
//   GET  /v1/models            the served model
//   GET  /metrics              Prometheus text (metrics.hpp)
//   POST /v1/chat/completions  OpenAI chat completions (api.hpp), streamed or not (format.hpp)
//   POST /v1/completions       OpenAI (legacy) completions
// The same routes without the /v1 prefix are accepted too.
//
// Statuses: 400 for a body the parser refuses (a message naming the field) or a prompt that
// does not fit (naming both numbers); 401 for a wrong or missing key; 404 for an unknown path;
// 413 for a body over max_body_bytes; 429 with Retry-After when the engine's queue is full;
// 503 while loading, shutting down, or after the engine failed (a rank died).
//
// Streams: the headers go out at once, then the role chunk (chat); while no token comes (a
// queued request, a long prefill) a comment line every ping_interval keeps clients and
// proxies from timing out. A write that fails (the client went away) cancels the request in
// the engine, which frees its pages at its next step. A request whose client stays connected
// but stops reading is cancelled when a write has blocked for write_timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "serve/api.hpp"
#include "serve/metrics.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/status.hpp"

namespace treeattn::serve {

// What the server needs of the engine (engine_backend.hpp adapts engine::Engine; the tests use
// a scripted one). submit, cancel and metrics are called from the HTTP workers.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual Result<engine::RequestId> submit(engine::Request request,
                                           engine::TokenCallback callback) = 0;
  virtual void cancel(engine::RequestId id) = 0;
  virtual engine::EngineMetrics metrics() const = 0;
  virtual int64_t max_sequence_tokens() const = 0;
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port (port() tells which)
  std::string api_key;
  int threads = 64;                        // HTTP workers: streams in flight + a few
  std::size_t max_body_bytes = 32u << 20;  // larger bodies: 413
  std::chrono::milliseconds ping_interval{2000};
  std::chrono::seconds read_timeout{30};
  std::chrono::seconds write_timeout{30};
};

struct ModelInfo {
  std::string id;       // /v1/models and every response's "model"
  int64_t created = 0;  // unix time the server started
  int64_t context = 0;  // tokens one sequence may hold (prompt + generated); 0: the pool's
  ChatTemplate chat;
  int ranks = 1;
  std::string method;   // the engine's merge
  nlohmann::json meta;  // extra facts for /v1/models ("meta")
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket (kInvalidArgument naming the address when it cannot).
  Status bind();
  int port() const;
  // Serves on a thread of its own from now on; until set_ready, /health and every other route
  // answer 503 "Loading model".
  void start();
  // The backend and codec must outlive the server (or stop()).
  void set_ready(Backend& backend, const Codec& codec, ModelInfo info);
  // New completions are refused with 503; running ones continue.
  void set_draining();
  // The engine failed: new requests 503 with `why`; waiting ones end with it if the engine has
  // not ended them within `grace` (it ends them itself when its step loop fails; a job that
  // is being torn down cannot wait).
  void set_failed(std::string why, std::chrono::milliseconds grace = std::chrono::seconds(5));
  // Completion requests accepted and not yet answered (streams included).
  int64_t active() const;
  // Waits until active() is 0 or the deadline passes; true when idle.
  bool wait_idle(std::chrono::steady_clock::time_point deadline) const;
  // Stops listening, ends the streams still open and joins the server's threads.
  void stop();

  ServerMetrics& metrics();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace treeattn::serve
