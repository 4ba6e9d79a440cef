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

json HttpServer::Impl::timings_of(const Job& job, const Choice& c) const {
  TimingsInfo t;
  t.timings = c.gen.timings();
  t.generated_tokens = c.gen.completion_tokens();
  t.ranks = info.ranks;
  t.method = info.method;
  t.bytes_sent_per_token = bytes_per_token(job);
  return timings_json(t);
}

// The prompt once, the choices' tokens summed; the cached tokens of the first choice's prompt
// (the others take its pages from the prefix cache).
Usage HttpServer::Impl::usage_of(const Job& job) const {
  int64_t generated = 0;
  for (const Choice& c : job.choices) generated += c.gen.completion_tokens();
  return Usage{static_cast<int64_t>(job.prompt.size()), generated,
               job.choices.front().gen.timings().cached_tokens};
}

// Waits up to `timeout` for events; moves them into `out`. Returns false on timeout. When the
// engine failed (or the server stops) and the engine has not ended the request a few seconds
// later, an error event is made up for each choice still open, so that no worker waits forever.
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
      for (std::size_t i = 0; i < job.choices.size(); ++i) {
        const Choice& c = job.choices[i];
        if (c.gen.done()) continue;
        TimedEvent te{engine::TokenEvent{}, Clock::now(), i};
        te.event.id = c.id;
        te.event.finish = engine::FinishReason::kError;
        te.event.error = internal_error(why);
        te.event.timings = c.gen.timings();
        out.push_back(std::move(te));
      }
      return true;
    }
  }
  return false;
}

// Feeds one event to its choice's output; measures latencies; ends the choice in the engine
// when a stop string ended it.
Generation::Update HttpServer::Impl::process(Job& job, const TimedEvent& te) {
  Choice& c = job.choices[te.choice];
  const bool was_done = c.gen.done();
  Generation::Update u = c.gen.on_event(te.event);
  if (was_done) return u;
  if (te.event.token >= 0) {
    if (!job.first_token) metrics.ttft.observe(seconds(te.at - job.arrival));
    if (c.first_token) metrics.itl.observe(seconds(te.at - c.last_token));
    job.first_token = c.first_token = true;
    c.last_token = te.at;
  }
  if (u.done) {
    metrics.queue.observe(te.event.timings.queue_seconds);
    if (te.event.timings.generated_tokens > 0) {
      metrics.prefill.observe(te.event.timings.prefill_seconds);
      metrics.decode.observe(te.event.timings.decode_seconds);
    }
    metrics.count_finish(finish_name(u.finish));
    if (u.stopped_by_string) backend->cancel(c.id);
    if (job.done()) {
      metrics.duration.observe(seconds(te.at - job.arrival));
      end_in_engine(job);
    }
  }
  return u;
}

// Every choice still open ends in the engine (its pages are freed at the engine's next step).
void HttpServer::Impl::cancel_all(Job& job) {
  for (const Choice& c : job.choices)
    if (!c.gen.done()) backend->cancel(c.id);
}

// The request ends before its choices do (the client went away, a choice failed): the open
// ones are cancelled in the engine and counted as `why`.
void HttpServer::Impl::abandon(Job& job, const char* why) {
  if (job.ended || job.done()) return;
  cancel_all(job);
  metrics.count_finish(why);
  end_in_engine(job);
}

// Not streamed: waits for the whole output. The client going away cancels the request (its
// pages are freed at the engine's next step); its deadline ends it with finish "timeout".
void HttpServer::Impl::answer(Job& job, httplib::Response& res) {
  std::deque<TimedEvent> events;
  while (!job.done() && job.failed() == nullptr) {
    events.clear();
    wait_events(job, events, std::chrono::milliseconds(250));
    for (const TimedEvent& te : events) process(job, te);
    if (job.done() || job.failed() != nullptr) break;
    if (!past_deadline(job).empty()) break;
    if (tl_conn_fd >= 0 && peer_gone(tl_conn_fd)) {
      abandon(job, "disconnected");
      // Nobody reads it: nginx's "client closed request".
      return send_error(res, ApiError{499, "The client closed the connection.",
                                      "invalid_request_error", "", ""});
    }
  }
  if (const Choice* f = job.failed()) {
    const bool cancelled = f->gen.finish() == Finish::kCancelled;
    abandon(job, cancelled ? "cancelled" : "error");
    if (cancelled)
      return send_error(res, unavailable("The request was cancelled: the server is shutting "
                                         "down"));
    return send_error(res, unavailable("The engine failed: " + failure_of(job)));
  }
  Completion c;
  for (const Choice& ch : job.choices) {
    ChoiceOut o;
    o.text = ch.gen.text();
    o.finish = ch.gen.finish();
    if (ch.tools) {
      ToolCallReading t = ch.tools->read(o.text);
      if (!t.calls.empty()) {
        o.text = std::move(t.content);
        o.tool_calls = std::move(t.calls);
        o.finish = Finish::kToolCalls;
      }
    }
    if (job.req.return_token_ids) o.token_ids = &ch.gen.tokens();
    if (job.req.logprobs >= 0)
      o.logprobs = logprobs_json(job.meta.endpoint, ch.gen.logprobs(), *codec);
    c.choices.push_back(std::move(o));
  }
  c.usage = usage_of(job);
  c.timings = timings_of(job, job.choices.front());
  if (job.req.return_token_ids) c.prompt_ids = &job.prompt;
  res.set_content(completion_body(job.meta, c), kJson);
}

// Ends the request's open choices in the engine and in their outputs when its deadline has
// passed; their updates (the text held back) for a stream, none before the deadline.
std::vector<std::pair<std::size_t, Generation::Update>> HttpServer::Impl::past_deadline(Job& job) {
  std::vector<std::pair<std::size_t, Generation::Update>> out;
  if (job.done() || job.deadline == Clock::time_point{} || Clock::now() < job.deadline) return out;
  cancel_all(job);
  for (std::size_t i = 0; i < job.choices.size(); ++i) {
    Generation& g = job.choices[i].gen;
    if (g.done()) continue;
    out.emplace_back(i, g.end(Finish::kTimeout));
    metrics.count_finish(finish_name(out.back().second.finish));
  }
  metrics.duration.observe(seconds(Clock::now() - job.arrival));
  end_in_engine(job);
  return out;
}

// How long a stream may wait for events before its deadline (a day when it has none).
Clock::duration HttpServer::Impl::until_deadline(const Job& job) {
  if (job.deadline == Clock::time_point{}) return std::chrono::hours(24);
  return std::max<Clock::duration>(Clock::duration::zero(), job.deadline - Clock::now());
}

std::string HttpServer::Impl::failure_of(const Job& job) const {
  for (const Choice& c : job.choices)
    if (!c.gen.error().empty()) return c.gen.error();
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
        s->abandon(*job, "disconnected");  // when the connection ended first
        s->finish_active(*job);
      });
}

bool HttpServer::Impl::pump(Job& job, httplib::DataSink& sink) {
  auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
  auto gone = [&] {  // the client went away: free the request's pages
    abandon(job, "disconnected");
    return false;
  };
  if (!job.role_sent) {
    job.role_sent = true;
    std::string roles;
    if (job.meta.endpoint == Endpoint::kChat)
      for (std::size_t i = 0; i < job.choices.size(); ++i)
        roles += sse_data(chunk_role(job.meta, static_cast<int>(i)));
    if (!roles.empty() && !write(roles)) return gone();
    return true;
  }
  std::deque<TimedEvent> events;
  bool got = wait_events(job, events,
                         std::min<Clock::duration>(opt.ping_interval, until_deadline(job)));
  std::string out;
  for (const TimedEvent& te : events) {
    out += choice_events(job, te.choice, process(job, te));
    if (job.done()) break;
  }
  if (!job.done())
    for (const auto& [i, u] : past_deadline(job)) {
      out += choice_events(job, i, u);
      got = true;
    }
  if (job.done()) out += last_events(job);
  if (!got) out = sse_comment("keep-alive");
  if (!out.empty() && !write(out)) return gone();
  if (job.done()) sink.done();
  return true;
}

// A choice's update as events: its text and logprobs, and its finish chunk when it ended
// normally. A choice that failed or was cancelled ends the whole request (last_events says
// why): the other choices are cancelled.
std::string HttpServer::Impl::choice_events(Job& job, std::size_t i, const Generation::Update& u) {
  std::string out;
  const int index = static_cast<int>(i);
  const nlohmann::json lp = job.req.logprobs >= 0 && !u.logprobs.empty()
                                ? logprobs_json(job.meta.endpoint, u.logprobs, *codec)
                                : nlohmann::json(nullptr);
  Choice& c = job.choices[i];
  const std::string text = c.tools ? c.tools->push(u.text) : u.text;
  if (!text.empty() || !lp.is_null()) out += sse_data(chunk_text(job.meta, text, index, lp));
  if (!u.done) return out;
  if (u.finish == Finish::kStop || u.finish == Finish::kLength || u.finish == Finish::kTimeout) {
    Finish finish = u.finish;
    if (c.tools) {  // the content held back, then the calls whole
      const ToolCallReading t = c.tools->finish();
      if (!t.content.empty()) out += sse_data(chunk_text(job.meta, t.content, index));
      if (!t.calls.empty()) {
        out += sse_data(chunk_tool_calls(job.meta, t.calls, index));
        finish = Finish::kToolCalls;
      }
    }
    out += sse_data(chunk_finish(job.meta, finish, timings_of(job, c),
                                 job.req.return_token_ids ? &c.gen.tokens() : nullptr, index));
    return out;
  }
  abandon(job, u.finish == Finish::kCancelled ? "cancelled" : "error");
  for (Choice& other : job.choices)
    if (!other.gen.done()) other.gen.end(u.finish);
  return out;
}

// After every choice ended: the usage chunk, or the error event of a choice that failed; [DONE].
std::string HttpServer::Impl::last_events(const Job& job) {
  std::string out;
  if (const Choice* f = job.failed()) {
    const ApiError e = f->gen.finish() == Finish::kCancelled
                           ? unavailable(
                                 "The request was cancelled: the server is shutting "
                                 "down")
                           : unavailable("The engine failed: " + failure_of(job));
    out += "data: " + error_body(e) + "\n\n";
  } else if (job.req.include_usage) {
    out += sse_data(chunk_usage(job.meta, usage_of(job)));
  }
  return out + sse_done();
}

}  // namespace treeattn::serve
