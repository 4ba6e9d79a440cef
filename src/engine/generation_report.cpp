// The figures and --json documents of `treeattn generate` (generation_report.hpp).
#include "engine/generation_report.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "core/units.hpp"
#include "treeattn/measure.hpp"

namespace treeattn::generation {

MethodFigures method_figures(const Output& o, const MethodResult& r) {
  MethodFigures m;
  m.p50_ms = percentile(r.step_ms, 0.5);
  m.p99_ms = percentile(r.step_ms, 0.99);
  m.tokens_per_s = r.step_ms.empty() ? 0.0 : static_cast<double>(r.step_ms.size()) / r.decode_s;
  m.bytes_per_token = r.bytes_sent_per_token_by_rank.empty()
                          ? 0.0
                          : *std::max_element(r.bytes_sent_per_token_by_rank.begin(),
                                              r.bytes_sent_per_token_by_rank.end());
  m.end_to_end_s = o.prefill_s + r.decode_s;
  return m;
}

EngineFigures engine_figures(const Output& o) {
  EngineFigures e;
  const std::size_t count = o.tokens.size();
  e.decode_ms_per_token = count > 1 ? o.decode_seconds * 1e3 / static_cast<double>(count - 1) : 0.0;
  e.tokens_per_s = e.decode_ms_per_token > 0 ? 1e3 / e.decode_ms_per_token : 0.0;
  e.p50_ms = percentile(o.token_ms, 0.5);
  e.p99_ms = percentile(o.token_ms, 0.99);
  e.prefill_tokens_per_s = static_cast<double>(o.prompt.size()) / std::max(1e-9, o.prefill_seconds);
  return e;
}

Status check_memory(const model::LlamaConfig& cfg, const Request& r, int ranks, int ranks_here,
                    int64_t n, double weights, uint64_t avail) {
  const auto est = model::estimate_memory(cfg, generator_config(r), ranks, n, r.new_tokens);
  const double need = static_cast<double>(est.total()) * ranks_here + weights;
  if (avail == 0 || need <= 0.9 * static_cast<double>(avail)) return Status::ok();
  std::string msg;
  appendf(msg,
          "a prompt of %lld tokens + %lld new on %d rank(s) needs about %s (%s of KV cache and %s "
          "of prefill buffers per rank, %s of weights); this machine has %s available. Use "
          "fewer tokens, --kv-dtype bf16/f16, or more machines",
          static_cast<long long>(n), static_cast<long long>(r.new_tokens), ranks,
          format_bytes(need).c_str(), format_bytes(static_cast<double>(est.kv_bytes)).c_str(),
          format_bytes(static_cast<double>(est.prefill_bytes)).c_str(),
          format_bytes(weights).c_str(), format_bytes(static_cast<double>(avail)).c_str());
  return Status(Code::kOutOfMemory, msg);
}

uint64_t max_peak_rss(const Output& o) {
  uint64_t m = 0;
  for (uint64_t r : o.peak_rss_by_rank) m = std::max(m, r);
  return m;
}

namespace {

std::string bytes_list(const std::vector<uint64_t>& by_rank) {
  std::string list;
  for (uint64_t r : by_rank)
    list += (list.empty() ? "" : " ") + format_bytes(static_cast<double>(r));
  return list;
}

}  // namespace

std::string engine_report_text(const Output& o, const std::string& merge) {
  const EngineFigures e = engine_figures(o);
  std::string out;
  appendf(out,
          "prompt %lld tokens (%lld from the prefix cache): time to first token %.1f ms "
          "(prefill %.0f tokens/s)\n"
          "decode %s (engine, dense %s) %zu tokens: %.2f ms/token p50, %.2f p99, %.1f "
          "tokens/s | rank 0 sent %s/token in %lld merges in all\n"
          "peak RSS per rank: %s (includes the mapped weights, shared between ranks)\n",
          static_cast<long long>(o.prompt.size()), static_cast<long long>(o.cached_tokens),
          o.ttft_ms, e.prefill_tokens_per_s, merge.c_str(), o.dense_choice.mode(), o.tokens.size(),
          e.p50_ms, e.p99_ms, e.tokens_per_s, format_bytes(o.bytes_per_token).c_str(),
          static_cast<long long>(o.merges), bytes_list(o.peak_rss_by_rank).c_str());
  if (o.window_pages_per_rank > 0)
    appendf(out,
            "KV pages in use at most (all ranks): %lld full pages (%s, global layers), %lld "
            "window pages (%s, sliding-window layers); per rank %lld full, %lld window pages of "
            "%lld tokens\n",
            static_cast<long long>(o.pages_used_peak),
            format_bytes(static_cast<double>(o.kv_bytes_used_peak)).c_str(),
            static_cast<long long>(o.window_pages_used_peak),
            format_bytes(static_cast<double>(o.window_kv_bytes_used_peak)).c_str(),
            static_cast<long long>(o.pages_per_rank),
            static_cast<long long>(o.window_pages_per_rank),
            static_cast<long long>(o.page_tokens));
  else
    appendf(out, "KV pages in use at most (all ranks): %lld (%s); %lld pages of %lld tokens per rank\n",
            static_cast<long long>(o.pages_used_peak),
            format_bytes(static_cast<double>(o.kv_bytes_used_peak)).c_str(),
            static_cast<long long>(o.pages_per_rank), static_cast<long long>(o.page_tokens));
  if (!o.weights_resident_by_rank.empty()) {
    appendf(out, "weights resident per rank (the file's pages touched + own rows8 copy): %s\n",
            bytes_list(o.weights_resident_by_rank).c_str());
  }
  if (!o.logits_hash.empty()) appendf(out, "logits hash: %s\n", o.logits_hash.c_str());
  return out;
}

std::string session_report_text(const Output& o, bool synthetic_kv, int ranks, bool diverged) {
  const auto n = static_cast<int64_t>(o.prompt.size());
  const model::PrefillStats& ps = o.prefill;
  std::string out, busy_list;
  for (double b : o.prefill_busy_s_by_rank)
    appendf(busy_list, "%s%.2f", busy_list.empty() ? "" : " ", b);
  if (synthetic_kv)
    appendf(out, "\nprompt %lld tokens: synthetic KV cache (not computed, %.2f s to fill)\n",
            static_cast<long long>(n), o.prefill_s);
  else
    appendf(out,
            "\nprompt %lld tokens: prefill %.2f s (%.1f tokens/s, attention %.2f s, waiting "
            "%.2f s on rank 0), time to first token %.1f ms\n",
            static_cast<long long>(n), o.prefill_s, static_cast<double>(n) / o.prefill_s,
            ps.attention_seconds, ps.wait_seconds, o.ttft_ms);
  if (!synthetic_kv && ranks > 1)
    appendf(out, "prefill busy s per rank (computing, not waiting): %s; sent %s by rank 0\n",
            busy_list.c_str(), format_bytes(static_cast<double>(ps.bytes_sent)).c_str());
  for (std::size_t k = 0; k < o.methods.size(); ++k) {
    const MethodResult& r = o.methods[k];
    const MethodFigures m = method_figures(o, r);
    std::string agree;
    if (k > 0 && r.first_diff < 0) agree = ", same tokens as " + o.methods[0].method;
    if (k > 0 && r.first_diff >= 0)
      agree = ", differs from " + o.methods[0].method + " at token " + std::to_string(r.first_diff);
    appendf(out,
            "decode %-11s %zu tokens: %.2f ms/token p50, %.2f p99, %.1f tokens/s | sent "
            "%s/rank/token (max) | end-to-end %.2f s%s\n",
            r.method.c_str(), r.step_ms.size(), m.p50_ms, m.p99_ms, m.tokens_per_s,
            format_bytes(m.bytes_per_token).c_str(), m.end_to_end_s, agree.c_str());
  }
  appendf(out, "peak RSS per rank: %s (includes the mapped weights, shared between ranks)\n",
          bytes_list(o.peak_rss_by_rank).c_str());
  if (diverged) out += "FAILED: the ranks' token streams diverged\n";
  return out;
}

// auto's ranking: every candidate with its predicted per-layer time (rank 0's).
nlohmann::json merge_candidates(const engine::MergeChoice& c) {
  nlohmann::json a = nlohmann::json::array();
  for (const PlanEntry& e : c.ranking)
    a.push_back({{"method", e.prediction.strategy},
                 {"predicted_layer_us", e.prediction.latency_us},
                 {"predicted_comm_us", e.prediction.comm_us},
                 {"feasible", e.feasible}});
  return a;
}

nlohmann::json engine_report_json(const Output& o, const std::string& merge,
                                  const ReportLabels& l) {
  const EngineFigures e = engine_figures(o);
  return {{"model", l.model_path},
          {"model_config", o.config_text},
          {"engine", true},
          {"prompt_tokens", o.prompt},
          {"tokens", o.tokens},
          {"text", o.text},
          {"ranks", l.ranks},
          {"threads_per_rank", l.threads},
          {"matmul", l.matmul},
          {"isa", l.isa},
          {"int8_kernel", l.int8_kernel},
          {"method", merge},
          {"method_requested", l.method_requested},
          {"merge_how", o.merge_choice.how},
          {"merge_batch_invariant", o.merge_choice.batch_invariant},
          {"merge_candidates", merge_candidates(o.merge_choice)},
          {"prefill_exchange", l.prefill_exchange},
          {"rows_kv_exchange", o.rows_kv_exchange},
          {"rows_pass_q", o.rows_pass_q},
          {"kv_dtype", l.kv_dtype},
          {"ttft_ms", o.ttft_ms},
          {"prefill_ms", o.prefill_seconds * 1e3},
          {"prefill_tokens_per_s", e.prefill_tokens_per_s},
          {"cached_tokens", o.cached_tokens},
          {"decode_ms_per_token", e.decode_ms_per_token},
          {"decode_ms", o.token_ms},
          {"decode_ms_p50", e.p50_ms},
          {"decode_ms_p99", e.p99_ms},
          {"tokens_per_s", e.tokens_per_s},
          {"bytes_sent_per_rank_per_token", o.bytes_per_token},
          {"bytes_sent_per_token_of", "rank 0, decode steps"},
          {"bytes_sent_rank0", o.bytes_sent_rank0},
          {"bytes_sent_by_rank", o.bytes_sent_by_rank},
          {"peak_rss_bytes", max_peak_rss(o)},
          {"peak_rss_bytes_by_rank", o.peak_rss_by_rank},
          {"page_tokens", o.page_tokens},
          {"kv_pages_per_rank", o.pages_per_rank},
          {"kv_window_pages_per_rank", o.window_pages_per_rank},
          {"kv_pages_used_peak", o.pages_used_peak},
          {"kv_window_pages_used_peak", o.window_pages_used_peak},
          {"kv_bytes_used_peak", o.kv_bytes_used_peak},
          {"kv_window_bytes_used_peak", o.window_kv_bytes_used_peak},
          {"dense", o.dense_choice.mode()},
          {"dense_requested", l.dense_requested},
          {"dense_how", o.dense_choice.how},
          {"dense_predicted_split_us", o.dense_choice.predicted_split_us},
          {"dense_predicted_replicated_us", o.dense_choice.predicted_replicated_us},
          {"dense_collectives_per_token", o.dense_choice.collectives_per_token},
          {"dense_weight_gbps", o.dense_choice.weight_gbps},
          {"weight_bytes_rank0", o.dense_choice.weight_bytes},
          {"rows8_bytes_rank0", o.dense_choice.rows8_bytes},
          {"weights_resident_bytes_by_rank", o.weights_resident_by_rank},
          {"decode_dense_ms_by_rank", o.decode_dense_ms_by_rank},
          {"decode_attention_ms_by_rank", o.decode_attention_ms_by_rank},
          {"decode_comm_ms_by_rank", o.decode_comm_ms_by_rank},
          {"logits_hash", o.logits_hash}};
}

nlohmann::json session_report_json(const Output& o, const ReportLabels& l, bool ranks_agree) {
  const auto n = static_cast<double>(o.prompt.size());
  nlohmann::json jm = nlohmann::json::array();
  for (const MethodResult& r : o.methods) {
    const MethodFigures m = method_figures(o, r);
    jm.push_back({{"method", r.method},
                  {"tokens", r.tokens},
                  {"decode_steps", r.step_ms.size()},
                  {"decode_ms", r.step_ms},
                  {"decode_ms_p50", m.p50_ms},
                  {"decode_ms_p99", m.p99_ms},
                  {"tokens_per_s", m.tokens_per_s},
                  {"decode_s", r.decode_s},
                  {"end_to_end_s", m.end_to_end_s},
                  {"bytes_sent_per_rank_per_token", m.bytes_per_token},
                  {"bytes_sent_per_token_by_rank", r.bytes_sent_per_token_by_rank},
                  {"first_token_differing_from_method0", r.first_diff}});
  }
  const MethodResult empty;
  const MethodResult& r0 = o.methods.empty() ? empty : o.methods[0];
  const MethodFigures m0 = method_figures(o, r0);
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(o.token_hash));
  return {
      {"model", l.model_path},
      {"model_config", o.config_text},
      {"prompt_tokens", o.prompt},
      {"tokens", r0.tokens},
      {"text", o.text},
      {"ranks", l.ranks},
      {"threads_per_rank", l.threads},
      {"matmul", l.matmul},
      {"isa", l.isa},
      {"int8_kernel", l.int8_kernel},
      {"method", r0.method},
      {"kv_dtype", l.kv_dtype},
      {"placement", l.placement},
      {"kv_layout", l.kv_layout},
      {"ttft_ms", o.ttft_ms},
      {"prefill_ms", o.prefill_s * 1e3},
      {"synthetic_kv", l.synthetic_kv},
      {"prefill_tokens_per_s", n / o.prefill_s},
      {"prefill_bytes_sent_rank0", o.prefill.bytes_sent},
      {"prefill_busy_s_by_rank", o.prefill_busy_s_by_rank},
      {"prefill_attention_s_by_rank", o.prefill_attention_s_by_rank},
      {"prefill_positions_by_rank", o.prefill_positions_by_rank},
      {"decode_ms_p50", m0.p50_ms},
      {"decode_ms_p99", m0.p99_ms},
      {"tokens_per_s", m0.tokens_per_s},
      {"bytes_sent_per_rank_per_token", m0.bytes_per_token},
      {"peak_rss_bytes", max_peak_rss(o)},
      {"peak_rss_bytes_by_rank", o.peak_rss_by_rank},
      {"token_stream_hash", hash},
      {"ranks_agree", ranks_agree},
      {"methods", jm},
  };
}

Status write_report_json(const std::string& path, const nlohmann::json& document,
                         const std::string& flag) {
  std::ofstream out(path);
  out << document.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  if (!out) return invalid_argument(flag + " " + path + ": write failed");
  return Status::ok();
}

}  // namespace treeattn::generation
