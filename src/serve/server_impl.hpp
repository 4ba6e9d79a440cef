// The inside of HttpServer (server.hpp), shared by the three files that implement it:
//   connection_loop.cpp  the connection loop (epoll: accept, read each request whole under the
//                        limits and the read deadline, answer /health and the refusals itself,
//                        write, keep-alive and pipelining) and the HTTP workers that run
//                        cpp-httplib's request processing over a request the loop has read
//   completion_job.cpp   a completion request (Job) from submit to its last byte: its queue of
//                        engine events (Inbox), deadlines, disconnects, the answer or the SSE
//                        stream, and the progress watchdog behind /health
//   server.cpp           HttpServer's public methods, the routes and their handlers
// Internal: included by those files only (not in include/).
#pragma once

#include <httplib.h>
#include <sys/epoll.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "serve/format.hpp"
#include "serve/tool_calls.hpp"
#include "serve/http_request.hpp"
#include "serve/server.hpp"
#include "serve/text.hpp"

namespace treeattn::serve {

using Clock = std::chrono::steady_clock;

enum class State : int { kLoading, kReady, kDraining, kFailed, kStopped };

inline constexpr const char* kJson = "application/json";

inline void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e), kJson);
}

inline ApiError unavailable(std::string message) {
  return ApiError{503, std::move(message), "unavailable_error", "", ""};
}

// The socket of the request an HTTP worker is answering (set around httplib's processing, which
// runs the handler on the same thread): answer() polls it for the client going away.
inline thread_local int tl_conn_fd = -1;

// Requests answered on one connection before it is closed (as cpp-httplib's keep-alive count).
inline constexpr std::size_t kMaxRequestsPerConnection = 1000;

// An engine event, the choice it is for and when it reached the server.
struct TimedEvent {
  engine::TokenEvent event;
  Clock::time_point at;
  std::size_t choice = 0;
};

// One request's queue: the engine's callback appends, the HTTP worker takes.
struct Inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TimedEvent> events;
  bool wake = false;  // the server failed or stops: look at its state now
};

// cpp-httplib's request processing over a stream of our own: the connection loop reads
// and bounds the request, and hands it, complete, to httplib's router and response writer.
class Router : public httplib::Server {
 public:
  using httplib::Server::process_request;
  // httplib's streams end when the server is not "running" (svr_sock_ invalid): the listening
  // socket (owned by the connection loop) while it serves, -1 once it stops.
  void set_running(int fd) { svr_sock_.store(fd); }
};

struct HttpServer::Impl {
  ServerOptions opt;
  Router http;
  int bound_port = -1;

  // ---- the connection loop (connection_loop.cpp; one thread): accepts, reads each request
  // whole under the limits and the read deadline, answers /health and the refusals itself, and
  // hands complete requests to the workers; a connection whose response is done comes back to
  // it (keep-alive and pipelined requests). No worker is held by a connection that has not sent
  // a whole request.
  struct Conn {
    int fd = -1;
    std::string ip;
    int port = 0;
    std::string in;  // received, not yet read by `reader`
    RequestReader reader;
    bool started = false;     // a byte of the current request has arrived
    bool dispatched = false;  // a worker has it
    bool lingering = false;   // answered and shut down: reads are dropped until EOF or deadline
    bool close_after = false; // once `out` is written
    bool dead = false;
    std::string out;          // a response of the loop's own, being written
    std::size_t requests = 0;
    std::size_t dropped = 0;  // bytes dropped while lingering
    Clock::time_point deadline;
    explicit Conn(RequestLimits l) : reader(l) {}
  };
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  std::thread loop_thread;
  std::atomic<bool> loop_stop{false};
  std::map<int, std::unique_ptr<Conn>> conns;  // the loop thread's (a dispatched one's fd stays)
  std::map<std::string, int> per_peer;
  RequestLimits limits;
  std::size_t max_connections = 0;
  Clock::time_point accept_paused_until{};
  bool accept_paused = false;

  std::vector<std::thread> workers;
  std::mutex work_mu;
  std::condition_variable work_cv;
  std::deque<Conn*> work;                       // complete requests for the workers
  std::deque<std::pair<Conn*, bool>> returned;  // answered: keep the connection?
  bool work_stop = false;

  void wake_loop() const;
  void watch(Conn& c, uint32_t events, int op = EPOLL_CTL_MOD) const;
  void close_conn(int fd);
  void accept_all();
  bool flush(Conn& c);
  void respond(Conn& c, int status, const std::string& body, bool close,
               const std::vector<std::string>& extra = {});
  void respond_error(Conn& c, const ApiError& e, bool close,
                     const std::vector<std::string>& extra = {});
  void answer_inline(Conn& c, int status, const std::string& body,
                     const std::vector<std::string>& extra);
  std::vector<std::string> cors_of(const Conn& c) const;
  void next_request(Conn& c);
  bool on_head(Conn& c);
  void dispatch(Conn& c);
  void advance(Conn& c);
  void on_readable(Conn& c);
  void expire(Clock::time_point now);
  void take_returned();
  void run_loop();
  void run_worker();

  // ---- the progress watchdog (completion_job.cpp): /health answers 503 while requests wait
  // and the engine has made no progress (no layer of a step completed) for stall_timeout (a stalled rank, a host cut off),
  // long before the collective timeout fails the engine.
  std::mutex watch_mu;
  int64_t seen_steps = -1;
  Clock::time_point progress_at = Clock::now();

  void sample_progress(Clock::time_point now);
  std::optional<ApiError> health_error();

  // ---- the server's state, the engine and the requests waiting for it
  std::atomic<State> state{State::kLoading};
  mutable std::mutex mu;  // failure, failed_at, grace, inboxes
  std::string failure;
  Clock::time_point failed_at;
  Clock::duration grace{};
  std::set<Inbox*> inboxes;  // of the requests waiting for the engine

  // Set once by set_ready before state becomes kReady.
  Backend* backend = nullptr;
  const Codec* codec = nullptr;
  ModelInfo info;
  std::vector<TokenId> eog;

  ServerMetrics metrics;
  std::atomic<int64_t> active{0};
  // Of those, the ones still waiting for the engine's events (a stream still being written to
  // a slow reader is not): what the progress watchdog looks at.
  std::atomic<int64_t> in_engine{0};
  mutable std::mutex idle_mu;
  mutable std::condition_variable idle_cv;
  uint64_t seed_base = 0;
  std::atomic<uint64_t> seed_counter{0};

  // One choice of a completion: its request in the engine and its output.
  struct Choice {
    engine::RequestId id = 0;
    Generation gen;
    std::unique_ptr<ToolCallStream> tools;  // the request's tools are shown to the model
    Clock::time_point last_token;
    bool first_token = false;
    Choice(const Codec& c, std::vector<std::string> stop, bool logprobs)
        : gen(c, std::move(stop), logprobs) {}
  };

  // A completion request from submit to its last byte: n choices (ParsedRequest::n), each its
  // own request in the engine, whose events share the inbox.
  struct Job {
    Impl* server = nullptr;
    ParsedRequest req;
    ResponseMeta meta;
    std::vector<TokenId> prompt;
    std::shared_ptr<Inbox> inbox;
    std::vector<Choice> choices;
    Clock::time_point arrival;
    Clock::time_point deadline{};  // none when at its epoch
    bool first_token = false;      // of any choice
    bool role_sent = false;
    bool ended = false;        // counted as finished (done or disconnected)
    uint64_t start_bytes = 0;  // sent_and_rows before submit
    int64_t start_rows = 0;
    bool done() const {
      return std::all_of(choices.begin(), choices.end(),
                         [](const Choice& c) { return c.gen.done(); });
    }
    // The choice that ended the job abnormally (cancelled or failed), if any.
    const Choice* failed() const {
      for (const Choice& c : choices)
        if (c.gen.finish() == Finish::kCancelled || c.gen.finish() == Finish::kError) return &c;
      return nullptr;
    }
  };

  explicit Impl(ServerOptions o);

  // ---- a completion's events and its response (completion_job.cpp)
  void wake_all();
  void end_in_engine(Job& job);
  void finish_active(Job& job);
  static std::pair<uint64_t, int64_t> sent_and_rows(const engine::EngineMetrics& m);
  double bytes_per_token(const Job& job) const;
  nlohmann::json timings_of(const Job& job, const Choice& c) const;
  Usage usage_of(const Job& job) const;
  bool wait_events(Job& job, std::deque<TimedEvent>& out, Clock::duration timeout);
  Generation::Update process(Job& job, const TimedEvent& te);
  void cancel_all(Job& job);
  void abandon(Job& job, const char* why);
  void answer(Job& job, httplib::Response& res);
  std::vector<std::pair<std::size_t, Generation::Update>> past_deadline(Job& job);
  static Clock::duration until_deadline(const Job& job);
  std::string failure_of(const Job& job) const;
  void stream(const std::shared_ptr<Job>& job, httplib::Response& res);
  bool pump(Job& job, httplib::DataSink& sink);
  std::string choice_events(Job& job, std::size_t i, const Generation::Update& u);
  std::string last_events(const Job& job);

  // ---- the API key, readiness and the routes (server.cpp)
  bool authorized(std::string_view got) const;
  static ApiError unauthorized();
  std::optional<ApiError> not_ready() const;
  void health(httplib::Response& res);
  void models(httplib::Response& res);
  void prometheus(httplib::Response& res);
  void completion(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  void tokenize(const httplib::Request& req, httplib::Response& res);
  void detokenize(const httplib::Request& req, httplib::Response& res);
  void apply_template(const httplib::Request& req, httplib::Response& res);
  void routes();
};

}  // namespace treeattn::serve
