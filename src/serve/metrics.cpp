// Prometheus text for /metrics (metrics.hpp).
#include "serve/metrics.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace treeattn::serve {

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::observe(double value) {
  if (!std::isfinite(value)) return;
  const auto i = static_cast<std::size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                          bounds_.begin());
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  sum_ += value;
}

Histogram::Snapshot Histogram::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  s.bounds = bounds_;
  uint64_t c = 0;
  for (std::size_t i = 0; i < bounds_.size(); ++i) {
    c += counts_[i];
    s.cumulative.push_back(c);
  }
  s.count = c + counts_.back();
  s.sum = sum_;
  return s;
}

std::vector<double> ttft_buckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
}
std::vector<double> itl_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5};
}

ServerMetrics::ServerMetrics()
    : ttft(ttft_buckets()),
      itl(itl_buckets()),
      duration(ttft_buckets()),
      queue(ttft_buckets()),
      prefill(ttft_buckets()),
      decode(ttft_buckets()) {}

void ServerMetrics::count_response(int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++responses_[status];
}

void ServerMetrics::count_finish(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  ++finished_[reason];
}

ServerMetrics::Snapshot ServerMetrics::snapshot() const {
  Snapshot s{ttft.snapshot(),  itl.snapshot(),     duration.snapshot(), queue.snapshot(),
             prefill.snapshot(), decode.snapshot(), {},                  {}};
  std::lock_guard<std::mutex> lock(mu_);
  s.responses = responses_;
  s.finished = finished_;
  return s;
}

namespace {

// Label values: backslash, double quote and newline escaped.
std::string label(std::string_view v) {
  std::string s;
  for (const char c : v) {
    if (c == '\\')
      s += "\\\\";
    else if (c == '"')
      s += "\\\"";
    else if (c == '\n')
      s += "\\n";
    else
      s += c;
  }
  return s;
}

std::string num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

class Writer {
 public:
  void head(std::string_view name, std::string_view type, std::string_view help) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  void sample(std::string_view name, double v, std::string_view labels = {}) {
    out_ += labels.empty() ? fmt::format("{} {}\n", name, num(v))
                           : fmt::format("{}{{{}}} {}\n", name, labels, num(v));
  }
  void metric(std::string_view name, std::string_view type, std::string_view help, double v) {
    head(name, type, help);
    sample(name, v);
  }
  template <class T>
  void per_rank(std::string_view name, std::string_view type, std::string_view help,
                const std::vector<T>& values) {
    head(name, type, help);
    for (std::size_t r = 0; r < values.size(); ++r)
      sample(name, static_cast<double>(values[r]), fmt::format("rank=\"{}\"", r));
  }
  void histogram(std::string_view name, std::string_view help, const Histogram::Snapshot& h) {
    head(name, "histogram", help);
    const std::string bucket = std::string(name) + "_bucket";
    for (std::size_t i = 0; i < h.bounds.size(); ++i)
      sample(bucket, static_cast<double>(h.cumulative[i]),
             fmt::format("le=\"{}\"", num(h.bounds[i])));
    sample(bucket, static_cast<double>(h.count), "le=\"+Inf\"");
    sample(std::string(name) + "_sum", h.sum);
    sample(std::string(name) + "_count", static_cast<double>(h.count));
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace

std::string prometheus_text(const engine::EngineMetrics& e, const ServerMetrics::Snapshot& s,
                            const MetricsInfo& info) {
  Writer w;
  w.head("treeattn_info", "gauge", "The served model, the merge method and the rank count.");
  w.sample("treeattn_info", 1,
           fmt::format("model=\"{}\",method=\"{}\",ranks=\"{}\"", label(info.model),
                       label(info.method), info.ranks));
  w.metric("treeattn_requests_running", "gauge", "Requests admitted by the engine, not finished.",
           static_cast<double>(e.running));
  w.metric("treeattn_requests_waiting", "gauge", "Requests queued, not yet admitted.",
           static_cast<double>(e.waiting));
  w.metric("treeattn_requests_total", "counter", "Requests the engine accepted.",
           static_cast<double>(e.requests_total));
  w.metric("treeattn_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
           static_cast<double>(e.prompt_tokens_total));
  w.metric("treeattn_generation_tokens_total", "counter", "Tokens generated.",
           static_cast<double>(e.generated_tokens_total));
  w.metric("treeattn_prefix_cache_query_tokens_total", "counter",
           "Prompt tokens looked up in the prefix cache (every admitted prompt token).",
           static_cast<double>(e.prompt_tokens_total));
  w.metric("treeattn_prefix_cache_hit_tokens_total", "counter",
           "Prompt tokens taken from the prefix cache instead of computed.",
           static_cast<double>(e.cached_tokens_total));
  w.metric("treeattn_requests_preempted", "gauge",
           "Requests preempted for KV pages, waiting to be admitted again.",
           static_cast<double>(e.preempted));
  w.metric("treeattn_preemptions_total", "counter",
           "Times a running request was preempted for KV pages (it resumes by recomputing).",
           static_cast<double>(e.preemptions_total));
  w.metric("treeattn_engine_steps_total", "counter", "Engine steps (batched forward passes).",
           static_cast<double>(e.steps));
  w.metric("treeattn_merges_total", "counter", "Per-layer merges each rank ran.",
           static_cast<double>(e.merges));
  w.metric("treeattn_bytes_sent_total", "counter", "Bytes rank 0 sent (communicator counters).",
           static_cast<double>(e.bytes_sent));
  w.metric("treeattn_kv_pages_total", "gauge", "KV pages per rank.",
           static_cast<double>(e.pages_per_rank));
  w.per_rank("treeattn_kv_pages_used", "gauge", "KV pages referenced by live sequences, per rank.",
             e.pages_used);
  w.per_rank("treeattn_kv_pages_cached", "gauge",
             "KV pages kept for prefix reuse, unreferenced (evictable), per rank.", e.pages_cached);
  w.per_rank("treeattn_kv_pages_free", "gauge", "KV pages on the free list, per rank.",
             e.pages_free);
  if (e.window_pages_per_rank > 0) {
    w.metric("treeattn_kv_window_pages_total", "gauge",
             "KV pages per rank of the sliding-window layers (each sequence keeps those its "
             "window still sees).",
             static_cast<double>(e.window_pages_per_rank));
    w.per_rank("treeattn_kv_window_pages_used", "gauge",
               "Window pages referenced by live sequences, per rank.", e.window_pages_used);
    w.per_rank("treeattn_kv_window_pages_cached", "gauge",
               "Window pages kept for prefix reuse, unreferenced (evictable), per rank.",
               e.window_pages_cached);
    w.per_rank("treeattn_kv_window_pages_free", "gauge",
               "Window pages on the free list, per rank.", e.window_pages_free);
  }
  // Per layer and rank: the pages of the layer's group (full or window) that live sequences
  // reference, and that group's size.
  w.head("treeattn_kv_layer_pages_used", "gauge",
         "KV pages referenced by live sequences in one layer, per layer and rank.");
  for (std::size_t l = 0; l < e.layer_in_window.size(); ++l) {
    const auto& used = e.layer_in_window[l] ? e.window_pages_used : e.pages_used;
    for (std::size_t r = 0; r < used.size(); ++r)
      w.sample("treeattn_kv_layer_pages_used", static_cast<double>(used[r]),
               fmt::format("layer=\"{}\",window=\"{}\",rank=\"{}\"", l,
                           e.layer_in_window[l] ? 1 : 0, r));
  }
  w.head("treeattn_kv_layer_pages_total", "gauge", "KV pages of one layer, per layer.");
  for (std::size_t l = 0; l < e.layer_in_window.size(); ++l)
    w.sample("treeattn_kv_layer_pages_total",
             static_cast<double>(e.layer_in_window[l] ? e.window_pages_per_rank : e.pages_per_rank),
             fmt::format("layer=\"{}\"", l));
  std::vector<double> usage;
  for (const int64_t used : e.pages_used)
    usage.push_back(e.pages_per_rank > 0
                        ? static_cast<double>(used) / static_cast<double>(e.pages_per_rank)
                        : 0.0);
  w.per_rank("treeattn_kv_usage_ratio", "gauge",
             "Fraction of the KV pages referenced by live sequences, per rank.", usage);
  w.per_rank("treeattn_merge_seconds_total", "counter",
             "Time in the per-layer merge of the ranks' attention states, per rank.",
             e.merge_seconds);
  std::vector<double> per_layer;
  for (const double m : e.merge_seconds)
    per_layer.push_back(e.merges > 0 ? m / static_cast<double>(e.merges) : 0.0);
  w.per_rank("treeattn_merge_seconds_per_layer", "gauge",
             "Mean time of one per-layer merge, per rank.", per_layer);
  w.per_rank("treeattn_attention_seconds_total", "counter",
             "Time in the paged attention kernel, per rank.", e.attention_seconds);
  w.metric("treeattn_engine_failed", "gauge", "1 when the engine has failed.",
           e.failed ? 1.0 : 0.0);
  w.histogram("treeattn_time_to_first_token_seconds",
              "From the request's arrival to its first token.", s.ttft);
  w.histogram("treeattn_inter_token_latency_seconds", "Between consecutive tokens of a request.",
              s.itl);
  w.histogram("treeattn_request_duration_seconds", "From the request's arrival to its last token.",
              s.duration);
  w.histogram("treeattn_request_queue_seconds",
              "From submission to the engine to admission, of finished requests.", s.queue);
  w.histogram("treeattn_request_prefill_seconds",
              "From admission to the first token, of finished requests.", s.prefill);
  w.histogram("treeattn_request_decode_seconds",
              "From the first token to the last, of finished requests.", s.decode);
  w.head("treeattn_requests_finished_total", "counter",
         "Requests that ended, by reason (stop, length, cancelled, error, disconnected).");
  for (const auto& [reason, n] : s.finished)
    w.sample("treeattn_requests_finished_total", static_cast<double>(n),
             fmt::format("reason=\"{}\"", label(reason)));
  w.head("treeattn_http_responses_total", "counter", "HTTP responses, by status code.");
  for (const auto& [code, n] : s.responses)
    w.sample("treeattn_http_responses_total", static_cast<double>(n),
             fmt::format("code=\"{}\"", code));
  return w.take();
}

}  // namespace treeattn::serve
