// The HTTP server (server.hpp) on cpp-httplib.
#include "serve/server.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "serve/format.hpp"
#include "serve/text.hpp"

namespace treeattn::serve {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

enum class State : int { kLoading, kReady, kDraining, kFailed, kStopped };

constexpr const char* kJson = "application/json";

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e), kJson);
}

ApiError unavailable(std::string message) {
  return ApiError{503, std::move(message), "unavailable_error", "", ""};
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// An engine event and when it reached the server.
struct TimedEvent {
  engine::TokenEvent event;
  Clock::time_point at;
};

// One request's queue: the engine's callback appends, the HTTP worker takes.
struct Inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TimedEvent> events;
  bool wake = false;  // the server failed or stops: look at its state now
};

// httplib::Server with a listen backlog of our choosing: the library's (compiled in, 5) drops
// the SYNs of a burst of connections, which then wait a second for the retransmission.
class BacklogServer : public httplib::Server {
 public:
  void set_backlog(int n) {
    const int fd = static_cast<int>(svr_sock_.load());
    if (fd >= 0) ::listen(fd, n);  // listen() again only changes the backlog
  }
};

// Shuts down the reading side of the connections accepted on `port` (at shutdown, once every
// request is answered: the idle keep-alive ones), which cpp-httplib would otherwise wait out
// for its keep-alive timeout (5 s) before its threads can be joined.
void shutdown_connections(int port) {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return;
  while (const dirent* e = readdir(d)) {
    const int fd = std::atoi(e->d_name);
    if (fd <= 2 || fd == dirfd(d)) continue;
    sockaddr_storage local{}, peer{};
    socklen_t n = sizeof local, m = sizeof peer;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &n) != 0) continue;
    int p = -1;
    if (local.ss_family == AF_INET) p = ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
    if (local.ss_family == AF_INET6) p = ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
    if (p != port || getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &m) != 0) continue;
    ::shutdown(fd, SHUT_RD);  // reads end; a response being written still goes out
  }
  closedir(d);
}

}  // namespace

struct HttpServer::Impl {
  ServerOptions opt;
  BacklogServer http;
  std::thread listener;
  std::atomic<bool> listener_done{false};  // listen_after_bind returned
  int bound_port = -1;

  std::atomic<State> state{State::kLoading};
  mutable std::mutex mu;  // failure, failed_at, grace, inboxes
  std::string failure;
  Clock::time_point failed_at;
  Clock::duration grace{};
  std::set<Inbox*> inboxes;  // of the requests waiting for the engine

  void wake_all() {
    std::lock_guard<std::mutex> lock(mu);
    for (Inbox* in : inboxes) {
      {
        std::lock_guard<std::mutex> l(in->mu);
        in->wake = true;
      }
      in->cv.notify_all();
    }
  }

  // Set once by set_ready before state becomes kReady.
  Backend* backend = nullptr;
  const Codec* codec = nullptr;
  ModelInfo info;
  std::vector<TokenId> eog;

  ServerMetrics metrics;
  std::atomic<int64_t> active{0};
  mutable std::mutex idle_mu;
  mutable std::condition_variable idle_cv;
  uint64_t seed_base = 0;
  std::atomic<uint64_t> seed_counter{0};

  // A completion request from submit to its last byte.
  struct Job {
    Impl* server = nullptr;
    ParsedRequest req;
    ResponseMeta meta;
    std::vector<TokenId> prompt;
    std::shared_ptr<Inbox> inbox;
    engine::RequestId id = 0;
    Generation gen;
    Clock::time_point arrival, last_token;
    bool first_token = false;
    bool role_sent = false;
    bool ended = false;        // counted as finished (done or disconnected)
    uint64_t start_bytes = 0;  // sent_and_rows before submit
    int64_t start_rows = 0;
    Job(const Codec& c, std::vector<std::string> stop) : gen(c, std::move(stop)) {}
  };

  explicit Impl(ServerOptions o) : opt(std::move(o)) {
    std::random_device rd;
    seed_base = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }

  void finish_active(const Job& job) {
    {
      std::lock_guard<std::mutex> lock(mu);
      inboxes.erase(job.inbox.get());
    }
    if (active.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(idle_mu);
      idle_cv.notify_all();
    }
  }

  bool authorized(const httplib::Request& req) const {
    if (opt.api_key.empty()) return true;
    const std::string want = "Bearer " + opt.api_key;
    const std::string got = req.get_header_value("Authorization");
    if (got.size() != want.size()) return false;
    unsigned char diff = 0;  // constant time in the key
    for (std::size_t i = 0; i < want.size(); ++i)
      diff |= static_cast<unsigned char>(got[i] ^ want[i]);
    return diff == 0;
  }

  // 503 unless the server is ready; nullopt when it is.
  std::optional<ApiError> not_ready() const {
    switch (state.load()) {
      case State::kLoading:
        return unavailable("Loading model");
      case State::kReady:
        return std::nullopt;
      case State::kDraining:
      case State::kStopped:
        return unavailable("The server is shutting down");
      case State::kFailed: {
        std::lock_guard<std::mutex> lock(mu);
        return unavailable("The engine failed: " + failure);
      }
    }
    return unavailable("?");
  }

  void health(httplib::Response& res) {
    if (auto e = not_ready()) return send_error(res, *e);
    res.set_content(R"({"status":"ok"})", kJson);
  }

  void models(httplib::Response& res) {
    if (state.load() == State::kLoading) return send_error(res, unavailable("Loading model"));
    res.set_content(models_body(info.id, info.created, info.meta), kJson);
  }

  void prometheus(httplib::Response& res) {
    if (state.load() == State::kLoading) return send_error(res, unavailable("Loading model"));
    const MetricsInfo mi{info.id, info.method, info.ranks};
    res.set_content(prometheus_text(backend->metrics(), metrics.snapshot(), mi),
                    "text/plain; version=0.0.4; charset=utf-8");
  }

  // Rank 0's bytes sent and the tokens the engine computed (prompt tokens not cached, and
  // generated ones), so far.
  static std::pair<uint64_t, int64_t> sent_and_rows(const engine::EngineMetrics& m) {
    return {m.bytes_sent, m.prompt_tokens_total - m.cached_tokens_total + m.generated_tokens_total};
  }

  // Over the request's life: bytes rank 0 sent per token the engine computed meanwhile (its
  // own and those of the requests batched with it; the merges of a step carry every row).
  double bytes_per_token(const Job& job) const {
    const auto [bytes, rows] = sent_and_rows(backend->metrics());
    const int64_t d_rows = rows - job.start_rows;
    return d_rows > 0 ? static_cast<double>(bytes - job.start_bytes) / static_cast<double>(d_rows)
                      : 0.0;
  }

  json timings_of(const Job& job) const {
    TimingsInfo t;
    t.timings = job.gen.timings();
    t.generated_tokens = job.gen.completion_tokens();
    t.ranks = info.ranks;
    t.method = info.method;
    t.bytes_sent_per_token = bytes_per_token(job);
    return timings_json(t);
  }

  Usage usage_of(const Job& job) const {
    return Usage{static_cast<int64_t>(job.prompt.size()), job.gen.completion_tokens(),
                 job.gen.timings().cached_tokens};
  }

  // Waits up to `timeout` for events; moves them into `out`. Returns false on timeout. When the
  // engine failed (or the server stops) and the engine has not ended the request a few seconds
  // later, an error event is made up so that no worker waits forever.
  bool wait_events(Job& job, std::deque<TimedEvent>& out, Clock::duration timeout) {
    {
      std::unique_lock<std::mutex> lock(job.inbox->mu);
      job.inbox->cv.wait_for(lock, timeout,
                             [&] { return !job.inbox->events.empty() || job.inbox->wake; });
      job.inbox->wake = false;
      if (!job.inbox->events.empty()) {
        out.swap(job.inbox->events);
        return true;
      }
    }
    const State s = state.load();
    if (s == State::kFailed || s == State::kStopped) {
      Clock::time_point since;
      Clock::duration wait{};
      std::string why;
      {
        std::lock_guard<std::mutex> lock(mu);
        since = s == State::kFailed ? failed_at : Clock::time_point{};
        wait = grace;
        why = s == State::kFailed ? failure : "the server stopped";
      }
      if (s == State::kStopped || Clock::now() - since >= wait) {
        TimedEvent te{engine::TokenEvent{}, Clock::now()};
        te.event.id = job.id;
        te.event.finish = engine::FinishReason::kError;
        te.event.error = internal_error(why);
        te.event.timings = job.gen.timings();
        out.push_back(std::move(te));
        return true;
      }
    }
    return false;
  }

  // Feeds one event to the request's output; measures latencies; ends the request in the
  // engine when a stop string ended it.
  Generation::Update process(Job& job, const TimedEvent& te) {
    const bool was_done = job.gen.done();
    Generation::Update u = job.gen.on_event(te.event);
    if (was_done) return u;
    if (te.event.token >= 0) {
      if (!job.first_token)
        metrics.ttft.observe(seconds(te.at - job.arrival));
      else
        metrics.itl.observe(seconds(te.at - job.last_token));
      job.first_token = true;
      job.last_token = te.at;
    }
    if (u.done) {
      metrics.duration.observe(seconds(te.at - job.arrival));
      metrics.queue.observe(te.event.timings.queue_seconds);
      if (te.event.timings.generated_tokens > 0) {
        metrics.prefill.observe(te.event.timings.prefill_seconds);
        metrics.decode.observe(te.event.timings.decode_seconds);
      }
      metrics.count_finish(finish_name(u.finish));
      job.ended = true;
      if (u.stopped_by_string) backend->cancel(job.id);
    }
    return u;
  }

  // ---- completions ----

  void completion(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
    const Clock::time_point arrival = Clock::now();
    if (auto e = not_ready()) return send_error(res, *e);
    auto parsed = parse_request(endpoint, req.body);
    if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
    ParsedRequest& r = std::get<ParsedRequest>(parsed);
    auto prompt = build_prompt(r, *codec, info.chat);
    if (auto* e = std::get_if<ApiError>(&prompt)) return send_error(res, *e);
    auto& ids = std::get<std::vector<TokenId>>(prompt);
    auto max_new = check_lengths(r, static_cast<int64_t>(ids.size()), info.context,
                                 backend->max_sequence_tokens());
    if (auto* e = std::get_if<ApiError>(&max_new)) return send_error(res, *e);

    engine::Request er;
    er.prompt = ids;
    er.max_new_tokens = std::get<int64_t>(max_new);
    er.sampling.temperature = r.top_p == 0.0 ? 0.0 : r.temperature;
    er.sampling.top_p = r.top_p == 0.0 ? 1.0 : r.top_p;
    er.sampling.top_k = r.top_k;
    er.sampling.seed = r.seed ? *r.seed : seed_base + seed_counter.fetch_add(1);
    if (!r.ignore_eos) er.stop_tokens = eog;

    // A base model's transcript (chat_stop_strings): its answer ends where it starts the user's
    // next turn, as a chat model's ends at its end-of-turn token.
    std::vector<std::string> stops = r.stop;
    if (endpoint == Endpoint::kChat && !r.ignore_eos)
      for (std::string& s : chat_stop_strings(info.chat.format))
        if (std::find(stops.begin(), stops.end(), s) == stops.end()) stops.push_back(std::move(s));
    auto job = std::make_shared<Job>(*codec, std::move(stops));
    job->server = this;
    job->arrival = arrival;
    job->meta = ResponseMeta{endpoint, make_response_id(endpoint),
                             static_cast<int64_t>(std::time(nullptr)), info.id};
    job->prompt = std::move(ids);
    job->inbox = std::make_shared<Inbox>();
    job->req = std::move(r);
    std::tie(job->start_bytes, job->start_rows) = sent_and_rows(backend->metrics());
    auto id = backend->submit(std::move(er), [inbox = job->inbox](const engine::TokenEvent& e) {
      {
        std::lock_guard<std::mutex> lock(inbox->mu);
        inbox->events.push_back(TimedEvent{e, Clock::now()});
      }
      inbox->cv.notify_one();
    });
    if (!id.is_ok()) {
      const Status& s = id.status();
      if (s.code() == Code::kOutOfMemory) {
        res.set_header("Retry-After", "1");
        return send_error(res,
                          ApiError{429, "The server is busy (" + s.message() + "); retry later.",
                                   "rate_limit_error", "", "queue_full"});
      }
      if (s.code() == Code::kInvalidArgument)
        return send_error(res, ApiError{400, s.message(), "invalid_request_error",
                                        endpoint == Endpoint::kChat ? "messages" : "prompt", ""});
      return send_error(res, unavailable(s.message()));
    }
    job->id = *id;
    active.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu);
      inboxes.insert(job->inbox.get());
    }
    if (job->req.stream) return stream(job, res);
    answer(*job, res);
    finish_active(*job);
  }

  // Not streamed: waits for the whole output.
  void answer(Job& job, httplib::Response& res) {
    std::deque<TimedEvent> events;
    while (!job.gen.done()) {
      events.clear();
      wait_events(job, events, std::chrono::seconds(1));
      for (const TimedEvent& te : events)
        if (process(job, te).done) break;
    }
    const Finish f = job.gen.finish();
    if (f == Finish::kCancelled)
      return send_error(res, unavailable("The request was cancelled: the server is shutting "
                                         "down"));
    if (f == Finish::kError)
      return send_error(res, unavailable("The engine failed: " + failure_of(job)));
    Completion c;
    c.text = job.gen.text();
    c.finish = f;
    c.usage = usage_of(job);
    c.timings = timings_of(job);
    if (job.req.return_token_ids) {
      c.token_ids = &job.gen.tokens();
      c.prompt_ids = &job.prompt;
    }
    res.set_content(completion_body(job.meta, c), kJson);
  }

  std::string failure_of(const Job& job) const {
    if (!job.gen.error().empty()) return job.gen.error();
    std::lock_guard<std::mutex> lock(mu);
    return failure.empty() ? std::string("see the server's log") : failure;
  }

  // Streamed: server-sent events from a chunked content provider.
  void stream(const std::shared_ptr<Job>& job, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [job](std::size_t, httplib::DataSink& sink) { return job->server->pump(*job, sink); },
        [job](bool) {
          Impl* s = job->server;
          if (!job->gen.done() && !job->ended) {  // the connection ended first
            s->backend->cancel(job->id);
            s->metrics.count_finish("disconnected");
            job->ended = true;
          }
          s->finish_active(*job);
        });
  }

  bool pump(Job& job, httplib::DataSink& sink) {
    auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
    auto gone = [&] {  // the client went away: free the request's pages
      if (!job.gen.done() && !job.ended) {
        backend->cancel(job.id);
        metrics.count_finish("disconnected");
        job.ended = true;
      }
      return false;
    };
    if (!job.role_sent) {
      job.role_sent = true;
      if (job.meta.endpoint == Endpoint::kChat && !write(sse_data(chunk_role(job.meta))))
        return gone();
      return true;
    }
    std::deque<TimedEvent> events;
    const bool got = wait_events(job, events, opt.ping_interval);
    std::string out;
    for (const TimedEvent& te : events) {
      const Generation::Update u = process(job, te);
      if (!u.text.empty()) out += sse_data(chunk_text(job.meta, u.text));
      if (u.done) {
        out += last_events(job, u);
        break;
      }
    }
    if (!got) out = sse_comment("keep-alive");
    if (!out.empty() && !write(out)) return gone();
    if (job.gen.done()) sink.done();
    return true;
  }

  std::string last_events(const Job& job, const Generation::Update& u) {
    std::string out;
    if (u.finish == Finish::kStop || u.finish == Finish::kLength) {
      out += sse_data(chunk_finish(job.meta, u.finish, timings_of(job),
                                   job.req.return_token_ids ? &job.gen.tokens() : nullptr));
      if (job.req.include_usage) out += sse_data(chunk_usage(job.meta, usage_of(job)));
    } else {
      const ApiError e = u.finish == Finish::kCancelled
                             ? unavailable(
                                   "The request was cancelled: the server is shutting "
                                   "down")
                             : unavailable("The engine failed: " + failure_of(job));
      out += "data: " + error_body(e) + "\n\n";
    }
    return out + sse_done();
  }

  void routes() {
    // The key is checked in the handlers, once the body has been read: refusing in a
    // pre-routing handler would leave a POST's body in the connection, to be parsed as the next
    // request of a keep-alive connection.
    auto guarded = [this](auto handler) {
      return [this, handler](const httplib::Request& req, httplib::Response& res) {
        if (!authorized(req))
          return send_error(res, ApiError{401,
                                          "Incorrect or missing API key (Authorization: "
                                          "Bearer KEY).",
                                          "invalid_request_error", "", "invalid_api_key"});
        handler(req, res);
      };
    };
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) { health(res); });
    for (const std::string prefix : {"/v1", ""}) {
      http.Get(prefix + "/models",
               guarded([this](const httplib::Request&, httplib::Response& res) { models(res); }));
      http.Post(prefix + "/chat/completions",
                guarded([this](const httplib::Request& req, httplib::Response& res) {
                  completion(req, res, Endpoint::kChat);
                }));
      http.Post(prefix + "/completions",
                guarded([this](const httplib::Request& req, httplib::Response& res) {
                  completion(req, res, Endpoint::kCompletion);
                }));
    }
    http.Get("/metrics",
             guarded([this](const httplib::Request&, httplib::Response& res) { prometheus(res); }));
    // Statuses httplib sets itself (404, 413, 400 for a malformed request) get an OpenAI body.
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string message;
      if (res.status == 404)
        message = "Unknown route: " + req.method + " " + req.path;
      else if (res.status == 413)
        message =
            "The request body is larger than " + std::to_string(opt.max_body_bytes) + " bytes.";
      else if (res.status == 400)
        message = "Malformed HTTP request.";
      else
        message = "HTTP status " + std::to_string(res.status);
      send_error(res,
                 ApiError{res.status, message,
                          res.status >= 500 ? "server_error" : "invalid_request_error", "", ""});
    });
    http.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
          std::string what = "unknown exception";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          send_error(res, ApiError{500, "Internal error: " + what, "server_error", "", ""});
        });
    http.set_logger([this](const httplib::Request&, const httplib::Response& res) {
      metrics.count_response(res.status);
    });
  }
};

HttpServer::HttpServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  Impl& s = *impl_;
  const auto threads = static_cast<std::size_t>(std::max(4, s.opt.threads));
  s.http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s.http.set_tcp_nodelay(true);
  s.http.set_keep_alive_max_count(1000);
  s.http.set_payload_max_length(s.opt.max_body_bytes);
  s.http.set_read_timeout(s.opt.read_timeout.count(), 0);
  s.http.set_write_timeout(s.opt.write_timeout.count(), 0);
  s.routes();
}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::bind() {
  Impl& s = *impl_;
  if (s.opt.port < 0 || s.opt.port > 65535)
    return invalid_argument("--port " + std::to_string(s.opt.port) + ": not in 0..65535");
  if (s.opt.port == 0) {
    s.bound_port = s.http.bind_to_any_port(s.opt.host);
  } else {
    s.bound_port = s.http.bind_to_port(s.opt.host, s.opt.port) ? s.opt.port : -1;
  }
  if (s.bound_port >= 0) s.http.set_backlog(1024);
  if (s.bound_port < 0)
    return invalid_argument("cannot listen on " + s.opt.host + ":" + std::to_string(s.opt.port) +
                            " (address in use, not an address of this machine, or a privileged "
                            "port)");
  return Status::ok();
}

int HttpServer::port() const { return impl_->bound_port; }

void HttpServer::start() {
  // A client that went away must be a failed write (the request is cancelled), not SIGPIPE
  // (libcpp-httplib sends without MSG_NOSIGNAL).
  std::signal(SIGPIPE, SIG_IGN);
  impl_->listener = std::thread([this] {
    impl_->http.listen_after_bind();
    impl_->listener_done.store(true);
  });
}

void HttpServer::set_ready(Backend& backend, const Codec& codec, ModelInfo info) {
  Impl& s = *impl_;
  s.backend = &backend;
  s.codec = &codec;
  s.info = std::move(info);
  s.eog = codec.end_of_generation();
  State expected = State::kLoading;
  s.state.compare_exchange_strong(expected, State::kReady);
}

void HttpServer::set_draining() {
  State expected = State::kReady;
  impl_->state.compare_exchange_strong(expected, State::kDraining);
}

void HttpServer::set_failed(std::string why, std::chrono::milliseconds grace) {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.failure = std::move(why);
    s.failed_at = Clock::now();
    s.grace = grace;
  }
  if (s.state.load() != State::kStopped) s.state.store(State::kFailed);
  s.wake_all();
}

int64_t HttpServer::active() const { return impl_->active.load(); }

bool HttpServer::wait_idle(std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(impl_->idle_mu);
  return impl_->idle_cv.wait_until(lock, deadline, [&] { return impl_->active.load() == 0; });
}

void HttpServer::stop() {
  Impl& s = *impl_;
  if (s.state.load() != State::kFailed) s.state.store(State::kStopped);
  s.wake_all();
  if (s.listener.joinable()) {
    // cpp-httplib's stop() acts only on a server already in its listen loop: a stop that comes
    // right after start() (a start-up failing once the listener thread exists) can reach it
    // before the thread does, and the loop would then run forever. Wait for the loop to be
    // running, or for the thread to have returned (a listen that failed).
    while (!s.http.is_running() && !s.listener_done.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  s.http.stop();
  if (s.listener.joinable()) {
    if (s.bound_port > 0) shutdown_connections(s.bound_port);
    s.listener.join();
  }
  if (s.state.load() == State::kFailed) s.state.store(State::kStopped);
}

ServerMetrics& HttpServer::metrics() { return impl_->metrics; }

}  // namespace treeattn::serve
