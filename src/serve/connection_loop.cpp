// The connection loop of HttpServer (server_impl.hpp): one epoll thread that accepts
// connections (capped in all and per peer address), reads each request whole through
// RequestReader (http_request.hpp) under the limits and the read deadline, answers /health and
// the refusals itself, writes its own responses, and hands complete requests to the HTTP
// workers; and the workers, which run cpp-httplib's request processing over the request read
// (ConnStream) and hand the connection back (keep-alive, pipelined requests).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "serve/server_impl.hpp"

namespace treeattn::serve {
namespace {

// Requests read completely and waiting for a worker; beyond it: 503 (the engine's own queue
// answers 429 long before, with the default worker count).
constexpr std::size_t kMaxDispatched = 4096;

// One request read by the connection loop, as httplib reads it (normalized(): its body
// de-chunked), and the connection's socket for the response.
class ConnStream final : public httplib::Stream {
 public:
  ConnStream(int fd, std::string in, std::string ip, int port, std::chrono::seconds write_timeout)
      : fd_(fd), in_(std::move(in)), ip_(std::move(ip)), port_(port), timeout_(write_timeout) {}
  bool is_readable() const override { return pos_ < in_.size(); }
  bool is_writable() const override { return wait_writable(); }
  ssize_t read(char* ptr, size_t size) override {
    const std::size_t n = std::min(size, in_.size() - pos_);
    std::memcpy(ptr, in_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    std::size_t sent = 0;
    while (sent < size) {
      const ssize_t n = ::send(fd_, ptr + sent, size - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!wait_writable()) return -1;  // the client stopped reading for write_timeout
      } else {
        return -1;
      }
    }
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = ip_;
    port = port_;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip.clear();
    port = -1;
  }
  // httplib only compares it with FD_SETSIZE (for its select(), which this stream never uses).
  socket_t socket() const override { return -1; }

 private:
  bool wait_writable() const {
    pollfd p{fd_, POLLOUT, 0};
    const auto deadline = Clock::now() + timeout_;
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      const int r = ::poll(&p, 1, static_cast<int>(left));
      if (r > 0) return (p.revents & (POLLERR | POLLHUP | POLLNVAL)) == 0;
      if (r == 0) return false;
      if (errno != EINTR) return false;
    }
  }
  int fd_;
  std::string in_;
  std::size_t pos_ = 0;
  std::string ip_;
  int port_;
  std::chrono::seconds timeout_;
};

// The HTTP response for a status the connection loop answers itself.
std::string raw_response(int status, const std::string& body, bool close,
                         const std::vector<std::string>& extra = {}) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
  if (status != 204)  // no content, and no Content-Length (RFC 9110)
    out += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\n";
  for (const std::string& h : extra) out += h + "\r\n";
  out += close ? "Connection: close\r\n\r\n" : "Keep-Alive: timeout=5\r\n\r\n";
  return out + body;
}

std::string path_of(const std::string& target) { return target.substr(0, target.find('?')); }

}  // namespace

void HttpServer::Impl::wake_loop() const {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
}

void HttpServer::Impl::watch(Conn& c, uint32_t events, int op) const {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = c.fd;
  ::epoll_ctl(epoll_fd, op, c.fd, &ev);
}

void HttpServer::Impl::close_conn(int fd) {
  auto it = conns.find(fd);
  if (it == conns.end()) return;
  if (--per_peer[it->second->ip] <= 0) per_peer.erase(it->second->ip);
  ::close(fd);  // leaves the epoll set with it
  conns.erase(it);
}

void HttpServer::Impl::accept_all() {
  while (true) {
    sockaddr_storage a{};
    socklen_t n = sizeof a;
    const int fd =
        ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&a), &n, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        // Out of descriptors (or memory): stop accepting for a moment rather than spin.
        ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, listen_fd, nullptr);
        accept_paused = true;
        accept_paused_until = Clock::now() + std::chrono::milliseconds(100);
      }
      return;
    }
    char ip[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (a.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
      ::inet_ntop(AF_INET, &v4->sin_addr, ip, sizeof ip);
      port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
      ::inet_ntop(AF_INET6, &v6->sin6_addr, ip, sizeof ip);
      port = ntohs(v6->sin6_port);
    }
    int& from_peer = per_peer[ip];
    if (conns.size() >= max_connections ||
        (opt.max_connections_per_peer > 0 && from_peer >= opt.max_connections_per_peer)) {
      if (from_peer == 0) per_peer.erase(ip);
      const std::string r = raw_response(
          503,
          error_body(unavailable(conns.size() >= max_connections
                                     ? "Too many connections to this server."
                                     : "Too many connections from " + std::string(ip) + ".")),
          true, {"Retry-After: 1"});
      [[maybe_unused]] const ssize_t w =
          ::send(fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      metrics.count_response(503);
      continue;
    }
    ++from_peer;
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto c = std::make_unique<Conn>(limits);
    c->fd = fd;
    c->ip = ip;
    c->port = port;
    c->deadline = Clock::now() + opt.idle_timeout;
    watch(*c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    conns.emplace(fd, std::move(c));
  }
}

// Writes what the loop has to say; false when the connection is gone (marked dead).
bool HttpServer::Impl::flush(Conn& c) {
  while (!c.out.empty()) {
    const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out.erase(0, static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      watch(c, EPOLLOUT);  // reads wait until the response is out
      return true;
    } else {
      c.dead = true;
      return false;
    }
  }
  if (c.close_after) {
    // Half-close, then read and drop what the client still sends for a while: closing with
    // unread bytes would reset the connection and could destroy the response in flight.
    ::shutdown(c.fd, SHUT_WR);
    c.lingering = true;
    c.deadline = Clock::now() + std::chrono::seconds(2);
  }
  watch(c, EPOLLIN | EPOLLRDHUP);
  return true;
}

void HttpServer::Impl::respond(Conn& c, int status, const std::string& body, bool close,
             const std::vector<std::string>& extra) {
  metrics.count_response(status);
  c.out += raw_response(status, body, close, extra);
  c.close_after = close;
  flush(c);
}

void HttpServer::Impl::respond_error(Conn& c, const ApiError& e, bool close,
                                     const std::vector<std::string>& extra) {
  respond(c, e.status, error_body(e), close, extra);
}

// A request without a body answered by the loop at its head; the connection goes on.
void HttpServer::Impl::answer_inline(Conn& c, int status, const std::string& body,
                                     const std::vector<std::string>& extra) {
  const bool keep_alive = c.reader.request().keep_alive;
  c.reader.read_body();
  respond(c, status, body, !keep_alive, extra);
  if (!c.dead && !c.close_after) next_request(c);
}

// The CORS headers of a response to the request being read, as far as its head has been read
// (a refusal: its Origin, when that line came before the one refused).
std::vector<std::string> HttpServer::Impl::cors_of(const Conn& c) const {
  return cors_headers(opt.cors_origins, c.reader.request().header("Origin"), /*preflight=*/false);
}

// Ready for the connection's next request.
void HttpServer::Impl::next_request(Conn& c) {
  c.reader = RequestReader(limits);
  c.started = false;
  c.deadline = Clock::now() + opt.idle_timeout;
}

// The head is complete, the body not read: what needs no body is decided here. True when the
// request was answered.
bool HttpServer::Impl::on_head(Conn& c) {
  const HttpRequest& r = c.reader.request();
  const std::string path = path_of(r.target);
  const bool no_body = !r.chunked && r.header("Content-Length").find_first_not_of('0') ==
                                         std::string_view::npos;
  const std::string_view origin = r.header("Origin");
  // A CORS preflight needs no key (browsers send none): the allow headers for an allowed
  // origin, none otherwise.
  if (r.method == "OPTIONS" && no_body) {
    auto headers = cors_headers(opt.cors_origins, origin, /*preflight=*/true,
                                r.header("Access-Control-Request-Headers"));
    headers.push_back("Allow: GET, POST, OPTIONS");
    answer_inline(c, 204, "", headers);
    return true;
  }
  const auto cors = cors_of(c);
  if (path == "/health" && r.method == "GET" && no_body) {
    const auto e = health_error();
    answer_inline(c, e ? e->status : 200, e ? error_body(*e) : R"({"status":"ok"})", cors);
    return true;
  }
  if (path != "/health" && !authorized(r.header("Authorization"))) {
    // The body is never read: the connection closes after the answer.
    respond_error(c, unauthorized(), true, cors);
    return true;
  }
  if (r.expect_continue && !no_body) {
    static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    const ssize_t n =
        ::send(c.fd, kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n != static_cast<ssize_t>(kContinue.size())) {
      c.dead = true;
      return true;
    }
  }
  return false;
}

void HttpServer::Impl::dispatch(Conn& c) {
  {
    std::lock_guard<std::mutex> lock(work_mu);
    if (work.size() < kMaxDispatched) {
      ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
      c.dispatched = true;
      work.push_back(&c);
      work_cv.notify_one();
      return;
    }
  }
  respond(c, 503, error_body(unavailable("The server is busy; retry later.")), true,
          {"Retry-After: 1"});
}

// Reads the requests in `c.in` as far as they go.
void HttpServer::Impl::advance(Conn& c) {
  while (!c.dead && !c.dispatched && !c.lingering && c.out.empty()) {
    RequestReader& rd = c.reader;
    if (rd.state() == RequestReader::State::kHead || rd.state() == RequestReader::State::kBody) {
      if (c.in.empty()) return;
      const std::size_t n = rd.feed(c.in);
      c.in.erase(0, n);
      if (!c.started && rd.consumed() > 0) {
        c.started = true;
        c.deadline = Clock::now() + opt.read_timeout;
      }
    }
    switch (rd.state()) {
      case RequestReader::State::kHead:
      case RequestReader::State::kBody:
        if (c.in.empty()) return;
        break;
      case RequestReader::State::kError:
        respond_error(c,
                      ApiError{rd.status(), rd.message(),
                               rd.status() >= 500 ? "server_error" : "invalid_request_error",
                               "", ""},
                      true, cors_of(c));
        return;
      case RequestReader::State::kHeadDone:
        if (!on_head(c)) rd.read_body();
        break;
      case RequestReader::State::kDone:
        dispatch(c);
        return;
    }
  }
}

void HttpServer::Impl::on_readable(Conn& c) {
  char buf[1 << 16];
  while (!c.dead) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n > 0) {
      if (c.lingering) {
        c.dropped += static_cast<std::size_t>(n);
        if (c.dropped > limits.max_body) c.dead = true;
        continue;
      }
      c.in.append(buf, static_cast<std::size_t>(n));
      advance(c);
      // Stop reading once a request is complete or an answer is being written; the rest
      // stays in the socket (pipelined requests are read after the response).
      if (c.dispatched || !c.out.empty() || c.lingering) return;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    c.dead = true;  // EOF (a half-closed client gets no answer to a partial request) or error
  }
}

// Connections past their deadline: an idle one closes; one in the middle of a request gets
// 408 (the whole head and body must arrive within read_timeout of its first byte).
void HttpServer::Impl::expire(Clock::time_point now) {
  std::vector<int> late;
  for (auto& [fd, c] : conns)
    if (!c->dispatched && now >= c->deadline) late.push_back(fd);
  for (int fd : late) {
    Conn& c = *conns.at(fd);
    if (c.started && !c.lingering && c.out.empty()) {
      respond_error(c,
                    ApiError{408,
                             "The request did not arrive within " +
                                 std::to_string(opt.read_timeout.count()) + " s.",
                             "invalid_request_error", "", ""},
                    true, cors_of(c));
      if (!c.dead) continue;
    }
    close_conn(fd);
  }
}

void HttpServer::Impl::take_returned() {
  std::deque<std::pair<Conn*, bool>> back;
  {
    std::lock_guard<std::mutex> lock(work_mu);
    back.swap(returned);
  }
  for (auto [c, keep] : back) {
    c->dispatched = false;
    if (!keep || loop_stop.load()) {
      close_conn(c->fd);
      continue;
    }
    next_request(*c);
    watch(*c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    advance(*c);  // pipelined requests already read
    if (c->dead) close_conn(c->fd);
  }
}

void HttpServer::Impl::run_loop() {
  std::vector<epoll_event> events(256);
  Clock::time_point last_tick = Clock::now();
  while (!loop_stop.load()) {
    const int n = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), 100);
    for (int i = 0; i < n; ++i) {
      const int fd = events[static_cast<std::size_t>(i)].data.fd;
      const uint32_t ev = events[static_cast<std::size_t>(i)].events;
      if (fd == listen_fd) {
        accept_all();
        continue;
      }
      if (fd == wake_fd) {
        uint64_t v = 0;
        [[maybe_unused]] const ssize_t r = ::read(wake_fd, &v, sizeof v);
        take_returned();
        continue;
      }
      auto it = conns.find(fd);
      if (it == conns.end() || it->second->dispatched) continue;
      Conn& c = *it->second;
      if ((ev & (EPOLLOUT | EPOLLERR | EPOLLHUP)) != 0 && !c.out.empty() && flush(c) &&
          c.out.empty() && !c.lingering)
        advance(c);  // the rest of a pipeline
      if (!c.dead && (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0 && c.out.empty())
        on_readable(c);
      if (c.dead || (c.lingering && (ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0))
        close_conn(fd);
    }
    const Clock::time_point now = Clock::now();
    if (now - last_tick >= std::chrono::milliseconds(100)) {
      last_tick = now;
      expire(now);
      sample_progress(now);
      if (accept_paused && now >= accept_paused_until) {
        accept_paused = false;
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = listen_fd;
        ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &ev);
      }
    }
  }
}

// An HTTP worker: answers the complete requests the loop hands it, through httplib.
void HttpServer::Impl::run_worker() {
  while (true) {
    Conn* c = nullptr;
    {
      std::unique_lock<std::mutex> lock(work_mu);
      work_cv.wait(lock, [&] { return work_stop || !work.empty(); });
      if (work.empty()) return;
      c = work.front();
      work.pop_front();
    }
    HttpRequest& r = c->reader.request();
    ConnStream strm(c->fd, r.normalized(), c->ip, c->port, opt.write_timeout);
    std::string().swap(r.body);
    bool closed = false;
    const bool last = !r.keep_alive || ++c->requests >= kMaxRequestsPerConnection;
    tl_conn_fd = c->fd;
    const bool ok = http.process_request(strm, last, closed, nullptr);
    tl_conn_fd = -1;
    const bool keep = ok && !closed && !last && state.load() != State::kStopped;
    {
      std::lock_guard<std::mutex> lock(work_mu);
      returned.emplace_back(c, keep);
    }
    wake_loop();
  }
}

}  // namespace treeattn::serve
