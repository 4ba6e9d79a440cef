// The HTTP server (server.hpp) on cpp-httplib: HttpServer's public methods (binding, starting
// the connection loop and the workers, the state changes, stopping), and the routes with their
// handlers (/health, /v1/models, /metrics, the completions, which submit to the engine). The
// connection loop is in connection_loop.cpp, a completion's events and response in
// completion_job.cpp; server_impl.hpp holds what they share.
#include "serve/server.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <ctime>
#include <random>
#include <tuple>

#include "serve/server_impl.hpp"

namespace treeattn::serve {

HttpServer::Impl::Impl(ServerOptions o) : opt(std::move(o)) {
  std::random_device rd;
  seed_base = (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

bool HttpServer::Impl::authorized(std::string_view got) const {
  if (opt.api_key.empty()) return true;
  const std::string want = "Bearer " + opt.api_key;
  if (got.size() != want.size()) return false;
  unsigned char diff = 0;  // constant time in the key
  for (std::size_t i = 0; i < want.size(); ++i)
    diff |= static_cast<unsigned char>(got[i] ^ want[i]);
  return diff == 0;
}

ApiError HttpServer::Impl::unauthorized() {
  return ApiError{401, "Incorrect or missing API key (Authorization: Bearer KEY).",
                  "invalid_request_error", "", "invalid_api_key"};
}

// 503 unless the server is ready; nullopt when it is.
std::optional<ApiError> HttpServer::Impl::not_ready() const {
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

void HttpServer::Impl::health(httplib::Response& res) {
  if (auto e = health_error()) return send_error(res, *e);
  res.set_content(R"({"status":"ok"})", kJson);
}

void HttpServer::Impl::models(httplib::Response& res) {
  if (state.load() == State::kLoading) return send_error(res, unavailable("Loading model"));
  const std::vector<std::string>& names = opt.served_model_names;
  res.set_content(models_body(names.empty() ? std::vector<std::string>{info.id} : names,
                              info.created, info.meta),
                  kJson);
}

void HttpServer::Impl::prometheus(httplib::Response& res) {
  if (state.load() == State::kLoading) return send_error(res, unavailable("Loading model"));
  const MetricsInfo mi{info.id, info.method, info.ranks};
  res.set_content(prometheus_text(backend->metrics(), metrics.snapshot(), mi),
                  "text/plain; version=0.0.4; charset=utf-8");
}

// ---- completions: parsed, tokenized and submitted here; answered or streamed by
// completion_job.cpp.

void HttpServer::Impl::completion(const httplib::Request& req, httplib::Response& res,
                                  Endpoint endpoint) {
  const Clock::time_point arrival = Clock::now();
  if (auto e = not_ready()) return send_error(res, *e);
  auto parsed = parse_request(endpoint, req.body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  ParsedRequest& r = std::get<ParsedRequest>(parsed);
  if (auto e = check_model(r.model, opt.served_model_names)) return send_error(res, *e);
  // A prompt whose byte count alone rules it out is refused before it is tokenized.
  if (auto e = check_prompt_bytes(r, codec->max_token_bytes(), info.context,
                                  backend->max_sequence_tokens()))
    return send_error(res, *e);
  auto prompt = build_prompt(r, *codec, info.chat);
  if (auto* e = std::get_if<ApiError>(&prompt)) return send_error(res, *e);
  auto& ids = std::get<std::vector<TokenId>>(prompt);
  auto max_new = check_lengths(r, static_cast<int64_t>(ids.size()), info.context,
                               backend->max_sequence_tokens());
  if (auto* e = std::get_if<ApiError>(&max_new)) return send_error(res, *e);

  if (auto e = check_logit_bias(r, codec->n_vocab())) return send_error(res, *e);

  engine::Request er;
  er.prompt = ids;
  er.max_new_tokens = std::get<int64_t>(max_new);
  er.sampling.temperature = r.top_p == 0.0 ? 0.0 : r.temperature;
  er.sampling.top_p = r.top_p == 0.0 ? 1.0 : r.top_p;
  er.sampling.top_k = r.top_k;
  er.sampling.min_p = r.min_p;
  er.sampling.presence_penalty = r.presence_penalty;
  er.sampling.frequency_penalty = r.frequency_penalty;
  er.sampling.repetition_penalty = r.repetition_penalty;
  er.sampling.logit_bias = r.logit_bias;
  er.logprobs = r.logprobs;
  // A fresh seed per choice: the counter moves by n.
  const uint64_t seed =
      r.seed ? *r.seed : seed_base + seed_counter.fetch_add(static_cast<uint64_t>(r.n));
  if (!r.ignore_eos) er.stop_tokens = eog;
  er.response_format = r.response_format;

  // A base model's transcript (chat_stop_strings): its answer ends where it starts the user's
  // next turn, as a chat model's ends at its end-of-turn token.
  std::vector<std::string> stops = r.stop;
  if (endpoint == Endpoint::kChat && !r.ignore_eos)
    for (std::string& s : chat_stop_strings(info.chat.format))
      if (std::find(stops.begin(), stops.end(), s) == stops.end()) stops.push_back(std::move(s));
  auto job = std::make_shared<Job>();
  job->server = this;
  job->arrival = arrival;
  // The name asked for (one of the served names: check_model), else the model's id.
  job->meta = ResponseMeta{endpoint, make_response_id(endpoint),
                           static_cast<int64_t>(std::time(nullptr)),
                           opt.served_model_names.empty() || r.model.empty() ? info.id : r.model};
  job->prompt = std::move(ids);
  job->inbox = std::make_shared<Inbox>();
  if (r.timeout)
    job->deadline = arrival + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(*r.timeout));
  else if (opt.request_timeout.count() > 0)
    job->deadline = arrival + opt.request_timeout;
  const int n = r.n;
  const bool logprobs = r.logprobs >= 0;
  job->req = std::move(r);
  std::tie(job->start_bytes, job->start_rows) = sent_and_rows(backend->metrics());
  // The choices: one engine request each, seeds seed + i (vLLM's rule). Submitted in order,
  // so the first prefills the prompt and the others wait for its full pages and take them from
  // the prefix cache (the scheduler's prefix_in_flight).
  for (int i = 0; i < n; ++i) {
    job->choices.emplace_back(*codec, stops, logprobs);
    if (job->req.uses_tools())  // call ids: the response's, and the choice's index past 0
      job->choices.back().tools = std::make_unique<ToolCallStream>(
          job->req.tools,
          tool_call_id_base(job->meta) + (i > 0 ? "_" + std::to_string(i) : std::string()));
    er.sampling.seed = seed + static_cast<uint64_t>(i);
    auto id = backend->submit(er, [inbox = job->inbox, i](const engine::TokenEvent& e) {
      {
        std::lock_guard<std::mutex> lock(inbox->mu);
        inbox->events.push_back(TimedEvent{e, Clock::now(), static_cast<std::size_t>(i)});
      }
      inbox->cv.notify_one();
    });
    if (id.is_ok()) {
      job->choices.back().id = *id;
      continue;
    }
    for (int j = 0; j < i; ++j) backend->cancel(job->choices[static_cast<std::size_t>(j)].id);
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
  active.fetch_add(1);
  in_engine.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(mu);
    inboxes.insert(job->inbox.get());
  }
  if (job->req.stream) return stream(job, res);
  answer(*job, res);
  finish_active(*job);
}

// ---- llama-server's /tokenize, /detokenize and /apply-template

void HttpServer::Impl::tokenize(const httplib::Request& req, httplib::Response& res) {
  if (auto e = not_ready()) return send_error(res, *e);
  auto parsed = parse_tokenize(req.body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  const TokenizeRequest& r = std::get<TokenizeRequest>(parsed);
  auto ids = codec->tokenize(r.content, r.add_special, r.parse_special);
  if (!ids.is_ok())
    return send_error(res,
                      ApiError{400, "The content cannot be tokenized: " + ids.status().message(),
                               "invalid_request_error", "content", "invalid_value"});
  res.set_content(tokenize_body(*ids, *codec, r.with_pieces), kJson);
}

void HttpServer::Impl::detokenize(const httplib::Request& req, httplib::Response& res) {
  if (auto e = not_ready()) return send_error(res, *e);
  auto parsed = parse_detokenize(req.body, codec->n_vocab());
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  std::string text;
  for (const TokenId id : std::get<std::vector<TokenId>>(parsed)) text += codec->token_text(id);
  res.set_content(dump(nlohmann::json{{"content", std::move(text)}}), kJson);
}

void HttpServer::Impl::apply_template(const httplib::Request& req, httplib::Response& res) {
  if (auto e = not_ready()) return send_error(res, *e);
  auto parsed = parse_request(Endpoint::kChat, req.body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  const ParsedRequest& r = std::get<ParsedRequest>(parsed);
  if (auto e = check_model(r.model, opt.served_model_names)) return send_error(res, *e);
  auto prompt = render_chat_prompt(r, info.chat);
  if (auto* e = std::get_if<ApiError>(&prompt)) return send_error(res, *e);
  res.set_content(dump(nlohmann::json{{"prompt", std::get<std::string>(prompt)}}), kJson);
}

void HttpServer::Impl::routes() {
  // The connection loop refuses a wrong key once the head is read, before any of the body
  // (on_head); the handlers check it again (a request httplib routes is always complete).
  auto guarded = [this](auto handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req.get_header_value("Authorization")))
        return send_error(res, unauthorized());
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
  http.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
              tokenize(req, res);
            }));
  http.Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
              detokenize(req, res);
            }));
  http.Post("/apply-template",
            guarded([this](const httplib::Request& req, httplib::Response& res) {
              apply_template(req, res);
            }));
  // CORS: every response httplib writes (errors and streams too) to an allowed origin.
  http.set_post_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    for (const std::string& h : cors_headers(opt.cors_origins, req.get_header_value("Origin"),
                                             /*preflight=*/false)) {
      const auto colon = h.find(':');
      res.set_header(h.substr(0, colon), h.substr(colon + 2));
    }
  });
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

HttpServer::HttpServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  Impl& s = *impl_;
  s.limits.max_body = s.opt.max_body_bytes;
  s.limits.max_headers = s.opt.max_headers;
  s.limits.max_line = s.opt.max_header_line;
  s.http.set_keep_alive_max_count(kMaxRequestsPerConnection);
  s.http.set_payload_max_length(s.opt.max_body_bytes);
  s.routes();
}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::bind() {
  Impl& s = *impl_;
  if (s.opt.port < 0 || s.opt.port > 65535)
    return invalid_argument("--port " + std::to_string(s.opt.port) + ": not in 0..65535");
  const Status refused =
      invalid_argument("cannot listen on " + s.opt.host + ":" + std::to_string(s.opt.port) +
                       " (address in use, not an address of this machine, or a privileged port)");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(s.opt.host.c_str(), std::to_string(s.opt.port).c_str(), &hints, &found) != 0)
    return refused;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    // The backlog: a burst of connections must not lose SYNs (and wait a second for their
    // retransmission).
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) return refused;
  sockaddr_storage local{};
  socklen_t n = sizeof local;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &n);
  s.bound_port = local.ss_family == AF_INET6
                     ? ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port)
                     : ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  s.listen_fd = fd;
  return Status::ok();
}

int HttpServer::port() const { return impl_->bound_port; }

void HttpServer::start() {
  Impl& s = *impl_;
  if (s.listen_fd < 0 || s.loop_thread.joinable()) return;
  // A client that went away must be a failed write (the request is cancelled), not SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  // Every open connection is a descriptor: as many as the hard limit allows.
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  const auto fds = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                       ? static_cast<std::size_t>(rl.rlim_cur)
                       : std::size_t{1} << 20;
  // Room for the workers' and the engine's own descriptors.
  s.max_connections = std::min<std::size_t>(static_cast<std::size_t>(s.opt.max_connections),
                                            fds > 256 ? fds - 128 : fds / 2);
  s.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  s.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = s.listen_fd;
  ::epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, s.listen_fd, &ev);
  ev.data.fd = s.wake_fd;
  ::epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, s.wake_fd, &ev);
  s.http.set_running(s.listen_fd);
  const auto threads = static_cast<std::size_t>(std::max(4, s.opt.threads));
  for (std::size_t i = 0; i < threads; ++i) s.workers.emplace_back([&s] { s.run_worker(); });
  s.loop_thread = std::thread([&s] { s.run_loop(); });
}

void HttpServer::set_ready(Backend& backend, const Codec& codec, ModelInfo info) {
  Impl& s = *impl_;
  s.backend = &backend;
  s.codec = &codec;
  s.info = std::move(info);
  if (!s.opt.served_model_names.empty()) s.info.id = s.opt.served_model_names.front();
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
  s.http.set_running(-1);  // open streams end
  if (s.loop_thread.joinable()) {
    s.loop_stop.store(true);
    s.wake_loop();
    s.loop_thread.join();
  }
  {
    std::lock_guard<std::mutex> lock(s.work_mu);
    s.work_stop = true;
  }
  s.work_cv.notify_all();
  for (std::thread& t : s.workers) t.join();
  s.workers.clear();
  while (!s.conns.empty()) s.close_conn(s.conns.begin()->first);
  s.returned.clear();
  for (int* fd : {&s.listen_fd, &s.epoll_fd, &s.wake_fd})
    if (*fd >= 0) {
      ::close(*fd);
      *fd = -1;
    }
  if (s.state.load() == State::kFailed) s.state.store(State::kStopped);
}

ServerMetrics& HttpServer::metrics() { return impl_->metrics; }

}  // namespace treeattn::serve
