// The HTTP server (server.hpp) on cpp-httplib.
#include "serve/server.hpp"

#include <arpa/inet.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

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
#include "serve/http_request.hpp"
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

// The socket of the request an HTTP worker is answering (set around httplib's processing, which
// runs the handler on the same thread): answer() polls it for the client going away.
thread_local int tl_conn_fd = -1;

// Requests read completely and waiting for a worker; beyond it: 503 (the engine's own queue
// answers 429 long before, with the default worker count).
constexpr std::size_t kMaxDispatched = 4096;
// Requests answered on one connection before it is closed (as cpp-httplib's keep-alive count).
constexpr std::size_t kMaxRequestsPerConnection = 1000;

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

// cpp-httplib's request processing over a stream of our own: the connection loop below reads
// and bounds the request, and hands it, complete, to httplib's router and response writer.
class Router : public httplib::Server {
 public:
  using httplib::Server::process_request;
  // httplib's streams end when the server is not "running" (svr_sock_ invalid): the listening
  // socket (owned by the connection loop) while it serves, -1 once it stops.
  void set_running(int fd) { svr_sock_.store(fd); }
};

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

// The peer of a connection has closed it (or reset it): a request it waits for is cancelled.
bool peer_gone(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

// The HTTP response for a status the connection loop answers itself.
std::string raw_response(int status, const std::string& body, bool close,
                         const std::vector<std::string>& extra = {}) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
  out += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n";
  for (const std::string& h : extra) out += h + "\r\n";
  out += close ? "Connection: close\r\n\r\n" : "Keep-Alive: timeout=5\r\n\r\n";
  return out + body;
}

std::string path_of(const std::string& target) { return target.substr(0, target.find('?')); }

}  // namespace

struct HttpServer::Impl {
  ServerOptions opt;
  Router http;
  int bound_port = -1;

  // ---- the connection loop (one thread): accepts, reads each request whole under the limits
  // and the read deadline, answers /health and the refusals itself, and hands complete requests
  // to the workers; a connection whose response is done comes back to it (keep-alive and
  // pipelined requests). No worker is held by a connection that has not sent a whole request.
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

  void wake_loop() const {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  void watch(Conn& c, uint32_t events, int op = EPOLL_CTL_MOD) const {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = c.fd;
    ::epoll_ctl(epoll_fd, op, c.fd, &ev);
  }

  void close_conn(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    if (--per_peer[it->second->ip] <= 0) per_peer.erase(it->second->ip);
    ::close(fd);  // leaves the epoll set with it
    conns.erase(it);
  }

  void accept_all() {
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
        [[maybe_unused]] const ssize_t w = ::send(fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
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
  bool flush(Conn& c) {
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

  void respond(Conn& c, int status, const std::string& body, bool close,
               const std::vector<std::string>& extra = {}) {
    metrics.count_response(status);
    c.out += raw_response(status, body, close, extra);
    c.close_after = close;
    flush(c);
  }

  void respond_error(Conn& c, const ApiError& e, bool close) {
    respond(c, e.status, error_body(e), close);
  }

  // Ready for the connection's next request.
  void next_request(Conn& c) {
    c.reader = RequestReader(limits);
    c.started = false;
    c.deadline = Clock::now() + opt.idle_timeout;
  }

  // The head is complete, the body not read: what needs no body is decided here. True when the
  // request was answered.
  bool on_head(Conn& c) {
    const HttpRequest& r = c.reader.request();
    const std::string path = path_of(r.target);
    const bool no_body = !r.chunked && r.header("Content-Length").find_first_not_of('0') ==
                                           std::string_view::npos;
    if (path == "/health" && r.method == "GET" && no_body) {
      c.reader.read_body();
      const auto e = health_error();
      if (e)
        respond_error(c, *e, !r.keep_alive);
      else
        respond(c, 200, R"({"status":"ok"})", !r.keep_alive);
      if (!c.dead && !c.close_after) next_request(c);
      return true;
    }
    if (path != "/health" && !authorized(r.header("Authorization"))) {
      // The body is never read: the connection closes after the answer.
      respond_error(c, unauthorized(), true);
      return true;
    }
    if (r.expect_continue && !no_body) {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      const ssize_t n = ::send(c.fd, kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n != static_cast<ssize_t>(kContinue.size())) {
        c.dead = true;
        return true;
      }
    }
    return false;
  }

  void dispatch(Conn& c) {
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
  void advance(Conn& c) {
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
                        true);
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

  void on_readable(Conn& c) {
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
  void expire(Clock::time_point now) {
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
                      true);
        if (!c.dead) continue;
      }
      close_conn(fd);
    }
  }

  void take_returned() {
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

  void run_loop() {
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
  void run_worker() {
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

  // ---- the progress watchdog: /health answers 503 while requests wait and the engine has
  // completed no step for stall_timeout (a stalled rank, a host cut off), long before the
  // collective timeout fails the engine.
  std::mutex watch_mu;
  int64_t seen_steps = -1;
  Clock::time_point progress_at = Clock::now();

  void sample_progress(Clock::time_point now) {
    if (state.load() != State::kReady) return;
    const int64_t steps = backend->metrics().steps;
    std::lock_guard<std::mutex> lock(watch_mu);
    if (in_engine.load() == 0 || steps != seen_steps) {
      seen_steps = steps;
      progress_at = now;
    }
  }

  std::optional<ApiError> health_error() {
    if (auto e = not_ready()) return e;
    if (opt.stall_timeout.count() <= 0) return std::nullopt;
    const Clock::time_point now = Clock::now();
    sample_progress(now);
    std::lock_guard<std::mutex> lock(watch_mu);
    const auto stalled = now - progress_at;
    if (in_engine.load() > 0 && stalled >= opt.stall_timeout)
      return unavailable("The engine has completed no step for " +
                         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(stalled).count()) +
                         " s while " + std::to_string(in_engine.load()) +
                         " requests wait (a rank stalled or cut off?)");
    return std::nullopt;
  }

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
  // Of those, the ones still waiting for the engine's events (a stream still being written to
  // a slow reader is not): what the progress watchdog looks at.
  std::atomic<int64_t> in_engine{0};
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
    Clock::time_point deadline{};  // none when at its epoch
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

  // The request no longer waits for the engine (done, disconnected, past its deadline): it
  // leaves the watchdog's count, once.
  void end_in_engine(Job& job) {
    if (job.ended) return;
    job.ended = true;
    in_engine.fetch_sub(1);
  }

  void finish_active(Job& job) {
    end_in_engine(job);
    {
      std::lock_guard<std::mutex> lock(mu);
      inboxes.erase(job.inbox.get());
    }
    if (active.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(idle_mu);
      idle_cv.notify_all();
    }
  }

  bool authorized(std::string_view got) const {
    if (opt.api_key.empty()) return true;
    const std::string want = "Bearer " + opt.api_key;
    if (got.size() != want.size()) return false;
    unsigned char diff = 0;  // constant time in the key
    for (std::size_t i = 0; i < want.size(); ++i)
      diff |= static_cast<unsigned char>(got[i] ^ want[i]);
    return diff == 0;
  }

  static ApiError unauthorized() {
    return ApiError{401, "Incorrect or missing API key (Authorization: Bearer KEY).",
                    "invalid_request_error", "", "invalid_api_key"};
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
    if (auto e = health_error()) return send_error(res, *e);
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
      end_in_engine(job);
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
    if (r.timeout)
      job->deadline = arrival + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(*r.timeout));
    else if (opt.request_timeout.count() > 0)
      job->deadline = arrival + opt.request_timeout;
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
    in_engine.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu);
      inboxes.insert(job->inbox.get());
    }
    if (job->req.stream) return stream(job, res);
    answer(*job, res);
    finish_active(*job);
  }

  // Not streamed: waits for the whole output. The client going away cancels the request (its
  // pages are freed at the engine's next step); its deadline ends it with finish "timeout".
  void answer(Job& job, httplib::Response& res) {
    std::deque<TimedEvent> events;
    while (!job.gen.done()) {
      events.clear();
      wait_events(job, events, std::chrono::milliseconds(250));
      for (const TimedEvent& te : events)
        if (process(job, te).done) break;
      if (job.gen.done()) break;
      if (past_deadline(job)) break;
      if (tl_conn_fd >= 0 && peer_gone(tl_conn_fd)) {
        backend->cancel(job.id);
        metrics.count_finish("disconnected");
        end_in_engine(job);
        // Nobody reads it: nginx's "client closed request".
        return send_error(res, ApiError{499, "The client closed the connection.",
                                        "invalid_request_error", "", ""});
      }
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

  // Ends the request in the engine and in its output when its deadline has passed; the
  // update (the text held back) for a stream.
  std::optional<Generation::Update> past_deadline(Job& job) {
    if (job.gen.done() || job.deadline == Clock::time_point{} || Clock::now() < job.deadline)
      return std::nullopt;
    backend->cancel(job.id);
    Generation::Update u = job.gen.end(Finish::kTimeout);
    const Clock::time_point now = Clock::now();
    metrics.duration.observe(seconds(now - job.arrival));
    metrics.count_finish(finish_name(u.finish));
    end_in_engine(job);
    return u;
  }

  // How long a stream may wait for events before its deadline (a day when it has none).
  static Clock::duration until_deadline(const Job& job) {
    if (job.deadline == Clock::time_point{}) return std::chrono::hours(24);
    return std::max<Clock::duration>(Clock::duration::zero(), job.deadline - Clock::now());
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
            s->end_in_engine(*job);
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
        end_in_engine(job);
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
    bool got = wait_events(job, events, std::min<Clock::duration>(opt.ping_interval, until_deadline(job)));
    std::string out;
    for (const TimedEvent& te : events) {
      const Generation::Update u = process(job, te);
      if (!u.text.empty()) out += sse_data(chunk_text(job.meta, u.text));
      if (u.done) {
        out += last_events(job, u);
        break;
      }
    }
    if (!job.gen.done())
      if (auto u = past_deadline(job)) {
        if (!u->text.empty()) out += sse_data(chunk_text(job.meta, u->text));
        out += last_events(job, *u);
        got = true;
      }
    if (!got) out = sse_comment("keep-alive");
    if (!out.empty() && !write(out)) return gone();
    if (job.gen.done()) sink.done();
    return true;
  }

  std::string last_events(const Job& job, const Generation::Update& u) {
    std::string out;
    if (u.finish == Finish::kStop || u.finish == Finish::kLength || u.finish == Finish::kTimeout) {
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
