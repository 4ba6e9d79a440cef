// A completion request of HttpServer (server_impl.hpp) from submit to its last byte: the
// engine's events reach the request's Inbox (the callback only appends and wakes), the worker
// feeds them to the output (Generation), measures latencies, ends the request at its deadline
// or when the client goes away, and writes the answer or the SSE stream; a made-up error event
// when the engine failed. And the progress watchdog behind /health.
#include <poll.h>

#include <algorithm>

#include "serve/server_impl.hpp"

namespace treeattn::serve {
namespace {

using nlohmann::json;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The peer of a connection has closed it (or reset it): a request it waits for is cancelled.
bool peer_gone(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace

void HttpServer::Impl::sample_progress(Clock::time_point now) {
  if (state.load() != State::kReady) return;
  const int64_t steps = backend->progress();  // steps and layers: a long step still moves it
  std::lock_guard<std::mutex> lock(watch_mu);
  if (in_engine.load() == 0 || steps != seen_steps) {
    seen_steps = steps;
    progress_at = now;
  }
}

std::optional<ApiError> HttpServer::Impl::health_error() {
  if (auto e = not_ready()) return e;
  if (opt.stall_timeout.count() <= 0) return std::nullopt;
  const Clock::time_point now = Clock::now();
  sample_progress(now);
  std::lock_guard<std::mutex> lock(watch_mu);
  const auto stalled = now - progress_at;
  if (in_engine.load() > 0 && stalled >= opt.stall_timeout)
    return unavailable(
        "The engine has made no progress (no layer of a step completed) for " +
        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(stalled).count()) +
        " s while " + std::to_string(in_engine.load()) +
        " requests wait (a rank stalled or cut off?)");
  return std::nullopt;
}

void HttpServer::Impl::wake_all() {
  std::lock_guard<std::mutex> lock(mu);
  for (Inbox* in : inboxes) {
    {
      std::lock_guard<std::mutex> l(in->mu);
      in->wake = true;
    }
    in->cv.notify_all();
  }
}

// The request no longer waits for the engine (done, disconnected, past its deadline): it
// leaves the watchdog's count, once.
void HttpServer::Impl::end_in_engine(Job& job) {
  if (job.ended) return;
  job.ended = true;
  in_engine.fetch_sub(1);
}

void HttpServer::Impl::finish_active(Job& job) {
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

// Rank 0's bytes sent and the tokens the engine computed (prompt tokens not cached, and
// generated ones), so far.
std::pair<uint64_t, int64_t> HttpServer::Impl::sent_and_rows(const engine::EngineMetrics& m) {
  return {m.bytes_sent, m.prompt_tokens_total - m.cached_tokens_total + m.generated_tokens_total};
}

// Over the request's life: bytes rank 0 sent per token the engine computed meanwhile (its
// own and those of the requests batched with it; the merges of a step carry every row).
double HttpServer::Impl::bytes_per_token(const Job& job) const {
  const auto [bytes, rows] = sent_and_rows(backend->metrics());
  const int64_t d_rows = rows - job.start_rows;
  return d_rows > 0 ? static_cast<double>(bytes - job.start_bytes) / static_cast<double>(d_rows)
                    : 0.0;
}

json HttpServer::Impl::timings_of(const Job& job) const {
  TimingsInfo t;
  t.timings = job.gen.timings();
  t.generated_tokens = job.gen.completion_tokens();
  t.ranks = info.ranks;
  t.method = info.method;
  t.bytes_sent_per_token = bytes_per_token(job);
  return timings_json(t);
}

Usage HttpServer::Impl::usage_of(const Job& job) const {
  return Usage{static_cast<int64_t>(job.prompt.size()), job.gen.completion_tokens(),
               job.gen.timings().cached_tokens};
}

// Waits up to `timeout` for events; moves them into `out`. Returns false on timeout. When the
// engine failed (or the server stops) and the engine has not ended the request a few seconds
// later, an error event is made up so that no worker waits forever.
bool HttpServer::Impl::wait_events(Job& job, std::deque<TimedEvent>& out, Clock::duration timeout) {
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
Generation::Update HttpServer::Impl::process(Job& job, const TimedEvent& te) {
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

// Not streamed: waits for the whole output. The client going away cancels the request (its
// pages are freed at the engine's next step); its deadline ends it with finish "timeout".
void HttpServer::Impl::answer(Job& job, httplib::Response& res) {
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
  if (job.tools) {
    ToolCallReading t = read_tool_calls(c.text, job.req.tools, tool_call_id_base(job.meta));
    if (!t.calls.empty()) {
      c.text = std::move(t.content);
      c.tool_calls = std::move(t.calls);
      c.finish = Finish::kToolCalls;
    }
  }
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
std::optional<Generation::Update> HttpServer::Impl::past_deadline(Job& job) {
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
Clock::duration HttpServer::Impl::until_deadline(const Job& job) {
  if (job.deadline == Clock::time_point{}) return std::chrono::hours(24);
  return std::max<Clock::duration>(Clock::duration::zero(), job.deadline - Clock::now());
}

std::string HttpServer::Impl::failure_of(const Job& job) const {
  if (!job.gen.error().empty()) return job.gen.error();
  std::lock_guard<std::mutex> lock(mu);
  return failure.empty() ? std::string("see the server's log") : failure;
}

// Streamed: server-sent events from a chunked content provider.
void HttpServer::Impl::stream(const std::shared_ptr<Job>& job, httplib::Response& res) {
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

bool HttpServer::Impl::pump(Job& job, httplib::DataSink& sink) {
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
  bool got = wait_events(job, events,
                         std::min<Clock::duration>(opt.ping_interval, until_deadline(job)));
  std::string out;
  for (const TimedEvent& te : events) {
    const Generation::Update u = process(job, te);
    if (const std::string t = job.tools ? job.tools->push(u.text) : u.text; !t.empty())
      out += sse_data(chunk_text(job.meta, t));
    if (u.done) {
      out += last_events(job, u);
      break;
    }
  }
  if (!job.gen.done())
    if (auto u = past_deadline(job)) {
      if (const std::string t = job.tools ? job.tools->push(u->text) : u->text; !t.empty())
        out += sse_data(chunk_text(job.meta, t));
      out += last_events(job, *u);
      got = true;
    }
  if (!got) out = sse_comment("keep-alive");
  if (!out.empty() && !write(out)) return gone();
  if (job.gen.done()) sink.done();
  return true;
}

std::string HttpServer::Impl::last_events(const Job& job, const Generation::Update& u) {
  std::string out;
  if (u.finish == Finish::kStop || u.finish == Finish::kLength || u.finish == Finish::kTimeout) {
    Finish finish = u.finish;
    if (job.tools) {  // the content held back, then the calls whole
      const ToolCallReading t = job.tools->finish();
      if (!t.content.empty()) out += sse_data(chunk_text(job.meta, t.content));
      if (!t.calls.empty()) {
        out += sse_data(chunk_tool_calls(job.meta, t.calls));
        finish = Finish::kToolCalls;
      }
    }
    out += sse_data(chunk_finish(job.meta, finish, timings_of(job),
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

}  // namespace treeattn::serve
