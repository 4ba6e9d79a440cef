// The HTTP side of `treeattn serve`: cpp-httplib routes over a Backend (the engine), on rank 0.
//
// Threads. One connection loop (epoll) accepts every connection and reads each request whole:
// its head and body must arrive within read_timeout of its first byte and within the limits of
// http_request.hpp (a chunked body counts against max_body_bytes as it arrives; a compressed one
// is refused with 415; a wrong API key is refused once the head is read, before the body). The
// loop answers /health and those refusals itself, so that slow or idle connections hold no
// worker and /health never waits for one; a complete request goes to a worker, which runs
// cpp-httplib's router and response writer over it, then hands the connection back (keep-alive;
// pipelined requests are answered in order). Connections per peer address are capped.
// A worker only parses, tokenizes, submits to the backend and then waits on its request's own
// queue, which the backend's callback feeds (on the engine's step thread: the callback only
// appends the event and wakes the worker). No worker ever calls the communicator: the engine's
// step loop (Engine::run, on the main thread of every rank) is the only caller.
//
// Routes (every one but /health and a preflight needs `Authorization: Bearer KEY` when an API
// key is set):
//   GET  /health               200 {"status":"ok"}; 503 with an error body while the model
//                              loads, while shutting down, after the engine failed, and while
//                              requests are open and the engine has made no progress (no layer of a step completed) for
//                              stall_timeout (a stalled rank: the progress watchdog)
//   GET  /v1/models            the served model: one entry per served name (the first is the
//                              id), or the file's name when none is given
//   GET  /metrics              Prometheus text (metrics.hpp)
//   POST /v1/chat/completions  OpenAI chat completions (api.hpp), streamed or not (format.hpp)
//   POST /v1/completions       OpenAI (legacy) completions
//   POST /tokenize             llama-server's: {"content", "add_special", "parse_special",
//                              "with_pieces"} -> {"tokens": [...]} (api.hpp, format.hpp)
//   POST /detokenize           {"tokens": [ids]} -> {"content": "..."} (control tokens as their
//                              text, invalid UTF-8 as U+FFFD)
//   POST /apply-template       a chat completion's body -> {"prompt": "..."}: the text its
//                              prompt is tokenized from (render_chat_prompt)
//   OPTIONS (any path, no body) a CORS preflight, answered 204 by the connection loop without
//                              the key: with cors_origins' headers for an allowed Origin, none
//                              otherwise
// The same routes without the /v1 prefix are accepted too.
//
// Models: with served_model_names, a completion, chat or /apply-template whose "model" is not
// one of them is a 404 (OpenAI's model_not_found), and responses name the model asked for (the
// first name when none is); without, any "model" is accepted and responses name ModelInfo::id.
// CORS: with cors_origins, every response to an allowed Origin carries
// Access-Control-Allow-Origin (errors and streams included; the connection loop's refusals of a
// request under the limits when its Origin line came before what was refused), except the 503
// for too many connections (sent before a byte is read).
//
// Statuses: 400 for a body the parser refuses (a message naming the field) or a prompt that
// does not fit (naming both numbers), or a malformed request (http_request.hpp); 401 for a
// wrong or missing key; 404 for an unknown path; 408 for a request not read within
// read_timeout; 411, 413, 414, 415, 431, 501, 505 as http_request.hpp says; 429 with
// Retry-After when the engine's queue is full; 503 while loading, shutting down, after the
// engine failed (a rank died), or for a connection over the per-peer cap.
//
// Non-streamed requests: the worker polls the socket while it waits; a client that closed the
// connection has its request cancelled (pages freed at the engine's next step) within 250 ms.
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
  // A count that moves while the engine works (Engine::progress: steps and layers); the progress
  // watchdog's signal. Default: the completed steps.
  virtual int64_t progress() const { return metrics().steps; }
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port (port() tells which)
  std::string api_key;
  int threads = 64;  // HTTP workers: requests being answered (streams included) + a few
  std::size_t max_body_bytes = 32u << 20;  // larger bodies (de-chunked): 413
  std::size_t max_headers = 100;           // more header fields: 431
  std::size_t max_header_line = 8192;      // a longer request or header line: 414 / 431
  std::chrono::milliseconds ping_interval{2000};
  // A request's head and body must arrive within read_timeout of its first byte (else 408);
  // a connection with no request in progress closes after idle_timeout.
  std::chrono::seconds read_timeout{30};
  std::chrono::seconds idle_timeout{5};
  std::chrono::seconds write_timeout{30};
  int max_connections = 10000;          // open at once (and at most the descriptor limit allows)
  int max_connections_per_peer = 256;   // from one address; beyond: 503 and closed (0: no cap)
  // /health answers 503 while requests are open and the engine has made no progress (no layer of a step completed) for this
  // long (0: never).
  std::chrono::milliseconds stall_timeout{5000};
  // A completion's deadline when its body gives no "timeout" (0: none); past it the request
  // ends with finish_reason "timeout" and the text so far.
  std::chrono::milliseconds request_timeout{0};
  // The names clients may ask for (the first is the model's id); none: ModelInfo::id, and any
  // "model" is accepted.
  std::vector<std::string> served_model_names;
  // Origins allowed by CORS ("*": any); none: no CORS headers at all.
  std::vector<std::string> cors_origins;
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
