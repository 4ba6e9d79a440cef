// GET /metrics: Prometheus text exposition (format 0.0.4) of the engine's counters and the
// server's own measurements. Pure formatting over snapshots; unit-tested.
//
// From the engine (EngineMetrics, rank 0's view of every rank):
//   treeattn_requests_running, treeattn_requests_waiting                      gauges
//   treeattn_requests_total, treeattn_prompt_tokens_total,
//   treeattn_generation_tokens_total, treeattn_prefix_cache_hit_tokens_total,
//   treeattn_engine_steps_total, treeattn_merges_total, treeattn_bytes_sent_total counters
//   treeattn_kv_pages_total (pages per rank)                                   gauge
//   treeattn_kv_pages_used{rank}, _cached{rank}, _free{rank}                   gauges
//   treeattn_kv_window_pages_total, _used{rank}, _cached{rank}, _free{rank}    gauges (window
//     pages of sliding-window layers, when the engine has them)
//   treeattn_kv_layer_pages_used{layer,window,rank}, _total{layer}            gauges
//   treeattn_merge_seconds_total{rank}, treeattn_attention_seconds_total{rank} counters
//   treeattn_merge_seconds_per_layer{rank}   mean time of one per-layer merge   gauge
//   treeattn_engine_failed                   1 after the engine failed          gauge
// Measured by the server (ServerMetrics):
//   treeattn_time_to_first_token_seconds     request received -> first token    histogram
//   treeattn_inter_token_latency_seconds     between a request's tokens         histogram
//   treeattn_request_duration_seconds        request received -> last token     histogram
//   treeattn_requests_finished_total{reason} stop, length, cancelled, error, disconnected, timeout
//   treeattn_http_responses_total{code}      every response by status code
//   treeattn_info{model,method,ranks}        1
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "treeattn/engine.hpp"

namespace treeattn::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound: observations <= it
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative), + the +Inf bucket
  double sum_ = 0;
};

// Buckets: time to first token up to 10 minutes (a long prompt on CPU ranks), inter-token
// latency from 1 ms.
std::vector<double> ttft_buckets();
std::vector<double> itl_buckets();

class ServerMetrics {
 public:
  ServerMetrics();
  Histogram ttft, itl, duration;
  Histogram queue, prefill, decode;  // of finished requests, from the engine's timings
  void count_response(int status);
  void count_finish(const std::string& reason);

  struct Snapshot {
    Histogram::Snapshot ttft, itl, duration, queue, prefill, decode;
    std::map<int, uint64_t> responses;
    std::map<std::string, uint64_t> finished;
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  std::map<int, uint64_t> responses_;
  std::map<std::string, uint64_t> finished_;
};

struct MetricsInfo {
  std::string model;
  std::string method;
  int ranks = 1;
};

std::string prometheus_text(const engine::EngineMetrics& engine,
                            const ServerMetrics::Snapshot& server, const MetricsInfo& info);

}  // namespace treeattn::serve
