// The dense layers' plan (dense_plan.hpp).
#include "engine/dense_plan.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "treeattn/executor.hpp"
#include "treeattn/session.hpp"
#include "treeattn/topology.hpp"

namespace treeattn::engine {
namespace {

// Rank 0's verdict, broadcast: the choice and its figures, or the error.
struct Wire {
  int32_t ok = 0;
  int32_t split = 0;
  int32_t collectives = 0;
  int32_t pad = 0;
  double split_us = 0, replicated_us = 0, gbps = 0;
  char text[2048] = {};  // the topology's name, or the error
};

// The rate (GB/s) at which this rank's matrix kernels read a decode step's weights with the
// engine's options: layer 0's projections for one token, the best of 3 timings. Quantized
// kernels on a CPU thread decode weights slower than memory streams them; the cost model prices
// the reads at the lower of the two. It times the weights as the caller hands them over: where
// the engine makes its own rows8 copy after planning (generate, serve), an int8 decode step is
// timed without that copy, so the rate is the slower kernel's (the choice leans to split).
double measured_weight_gbps(const model::LlamaModel& model, const EngineConfig& config) {
  using model::Projection;
  const model::DenseWeights& w = model.weights();
  model::MatvecOptions o;
  o.threads = config.threads;
  o.isa = config.isa;
  o.mode = config.matmul;
  const auto& mc = model.config();
  const int64_t qd = mc.n_head * mc.head_dim;
  const int64_t widest = std::max({mc.n_embd, mc.n_ff, qd});
  std::vector<float> x(static_cast<std::size_t>(widest), 0.5f);
  std::vector<std::vector<float>> y(3, std::vector<float>(static_cast<std::size_t>(widest)));
  float* ys[] = {y[0].data(), y[1].data(), y[2].data()};
  const Projection qkv[] = {Projection::kQ, Projection::kK, Projection::kV};
  const Projection out[] = {Projection::kO};
  const Projection gate_up[] = {Projection::kGate, Projection::kUp};
  const Projection down[] = {Projection::kDown};
  double bytes = 0;
  for (int pr = 0; pr + 1 < model::kProjections; ++pr)
    bytes += static_cast<double>(w.matrix(0, static_cast<Projection>(pr)).bytes());
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    Status s = model.project(w, 0, qkv, x.data(), 1, mc.n_embd, ys, o);
    if (s.is_ok()) s = model.project(w, 0, out, x.data(), 1, qd, std::span(ys, 1), o);
    if (s.is_ok()) s = model.project(w, 0, gate_up, x.data(), 1, mc.n_embd, std::span(ys, 2), o);
    if (s.is_ok()) s = model.project(w, 0, down, x.data(), 1, mc.n_ff, std::span(ys, 1), o);
    if (!s.is_ok()) return 0;
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (rep == 0 || us < best) best = us;
  }
  return best > 0 ? bytes / best / 1e3 : 0;
}

// Rank 0: auto's choice on the topology (which it has, or the error that it has none).
Wire decide_on_rank0(const model::LlamaModel& model, const EngineConfig& config, int p,
                     const Result<Topology>& topo) {
  Wire w;
  auto put = [&w](const std::string& s) {
    std::memcpy(w.text, s.data(), std::min(s.size(), sizeof(w.text) - 1));
  };
  if (!topo.is_ok()) {
    put("--dense auto: " + topo.status().message());
    return w;
  }
  DenseQuery q = dense_query(model, p);
  q.ranks_per_node = std::min(p, topo->ranks_per_node);
  q.weight_gbps = measured_weight_gbps(model, config);
  auto d = predict_dense(q, *topo);
  if (!d.is_ok()) {
    put("--dense auto on topology '" + topo->name + "': " + d.status().message());
    return w;
  }
  w.ok = 1;
  w.split = d->split_wins() ? 1 : 0;
  w.collectives = d->collectives;
  w.split_us = d->split_us;
  w.replicated_us = d->replicated_us;
  w.gbps = q.weight_gbps;
  put(topo->name);
  return w;
}

Result<DenseChoice> choose(Communicator& comm, const EngineConfig& config,
                           const model::LlamaModel& model) {
  DenseChoice c;
  const int p = comm.size();
  if (config.dense != "auto") {
    c.split = config.dense == "split" && p > 1;
    c.how = p > 1 || config.dense != "split" ? "by name" : "by name; one rank: nothing to split";
    return c;
  }
  if (p == 1) {
    c.how = "auto: one rank, nothing to split";
    return c;
  }
  // The topology: a file or preset is read by rank 0 alone; the job's own is collective.
  Result<Topology> topo = invalid_argument("no topology");
  if (!config.topology.empty()) {
    if (comm.rank() == 0) topo = load_topology(config.topology);
  } else {
    topo = job_topology_of(comm, cpu_executor());
  }
  Wire w;
  if (comm.rank() == 0) w = decide_on_rank0(model, config, p, topo);
  TREEATTN_RETURN_IF_ERROR(comm.broadcast(&w, sizeof(w), 0));
  const std::string text(w.text, strnlen(w.text, sizeof(w.text)));
  if (w.ok == 0)
    return invalid_argument("rank " + std::to_string(comm.rank()) + ": " + text +
                            (comm.rank() == 0 ? "" : " (rank 0's planning)"));
  c.split = w.split != 0;
  c.topology = text;
  c.how = "auto: planned on topology " + text;
  c.predicted_split_us = w.split_us;
  c.predicted_replicated_us = w.replicated_us;
  c.collectives_per_token = w.collectives;
  c.weight_gbps = w.gbps;
  return c;
}

}  // namespace

Status check_dense_name(std::string_view name) {
  if (name == "split" || name == "replicated" || name == "auto") return Status::ok();
  return invalid_argument("dense '" + std::string(name) + "': expected split, replicated or auto");
}

DenseQuery dense_query(const model::LlamaModel& model, int ranks) {
  const auto& mc = model.config();
  const model::DenseWeights& w = model.weights();
  DenseQuery q;
  q.weight_bytes = static_cast<double>(w.bytes());
  // The largest rank's share, as LlamaModel::slice would cut it (slice_rows of every matrix and
  // the head), counted without mapping it; a model that cannot be sliced has none.
  for (int i = 0; i < ranks; ++i) {
    bool sliceable = true;
    double share = 0;
    auto add = [&](const model::WeightMatrix& m) {
      const model::RowRange r = model::slice_rows(m.rows, i, ranks);
      sliceable = sliceable && model::check_row_slice(m, r).is_ok();
      share += static_cast<double>(r.size()) * static_cast<double>(m.row_bytes);
    };
    add(w.matrix(0, model::Projection::kHead));
    for (int l = 0; l < w.layers(); ++l)
      for (int pr = 0; pr + 1 < model::kProjections; ++pr)
        add(w.matrix(l, static_cast<model::Projection>(pr)));
    if (sliceable) q.slice_bytes = std::max(q.slice_bytes, share);
  }
  double weights = 0;
  for (int l = 0; l < w.layers(); ++l)
    for (int pr = 0; pr + 1 < model::kProjections; ++pr) {
      const model::WeightMatrix& m = w.matrix(l, static_cast<model::Projection>(pr));
      weights += static_cast<double>(m.rows) * static_cast<double>(m.cols);
    }
  const model::WeightMatrix& head = w.matrix(0, model::Projection::kHead);
  weights += static_cast<double>(head.rows) * static_cast<double>(head.cols);
  q.flops_per_row = 2.0 * weights;
  q.layers = mc.n_layers;
  q.qkv_width = (mc.n_head + 2 * mc.n_head_kv) * mc.head_dim;
  q.o_width = mc.n_embd;
  q.ffn_width = mc.n_ff;
  q.down_width = mc.n_embd;
  q.head_width = mc.n_vocab;
  q.embd_width = mc.n_embd;
  q.ranks = ranks;
  return q;
}

Result<DensePlan> plan_dense(Communicator& comm, const EngineConfig& config,
                             const model::LlamaModel& model) {
  const int p = comm.size(), me = comm.rank();
  auto choice = choose(comm, config, model);
  TREEATTN_RETURN_IF_ERROR(choice.status());
  DensePlan plan;
  plan.choice = std::move(choice).value();
  // Every rank checks every slice (LlamaModel::slice), so a refusal is the same everywhere; the
  // all-gather of verdicts still names a rank that could not, rather than leave the others
  // waiting in the first step.
  auto w = plan.choice.split ? model.slice(me, p) : model.slice(0, 1);
  // Each rank copies its own rows (about the same amount on every rank) before the all-gather.
  if (w.is_ok() && config.rows8) w->pack_rows8(config.matmul, config.threads);
  int32_t ok = w.is_ok() ? 1 : 0;
  std::vector<int32_t> oks(static_cast<std::size_t>(p), 1);
  if (p > 1) TREEATTN_RETURN_IF_ERROR(comm.allgather(&ok, sizeof(ok), oks.data()));
  const std::string who =
      "rank " + std::to_string(me) + ": engine: --dense " + plan.choice.mode() + ": ";
  if (!w.is_ok()) return Status(w.status().code(), who + w.status().message());
  for (int r = 0; r < p; ++r)
    if (oks[static_cast<std::size_t>(r)] == 0)
      return unsupported(who + "rank " + std::to_string(r) +
                         " could not slice the model's matrices (its message names the tensor)");
  plan.weights = std::move(w).value();
  // A split rank reads the weights through its slice's own mappings: the model's mapping keeps
  // only what it reads again (the tokenizer's metadata on rank 0), not what loading touched.
  if (plan.choice.split) model.file().release_resident_pages();
  plan.choice.weight_bytes = plan.weights.bytes();
  plan.choice.rows8_bytes = plan.weights.rows8_bytes();
  return plan;
}

std::string describe_dense(const DenseChoice& c) {
  const bool planned = c.how.rfind("auto", 0) == 0 && !c.topology.empty();
  std::string s =
      std::string(c.mode()) + " (" + (planned ? "auto on topology " + c.topology : c.how);
  char buf[256];
  if (planned) {
    std::snprintf(buf, sizeof(buf),
                  "; predicted per token: split %.3f ms, replicated %.3f ms, %d all-gathers, "
                  "weights read at %.1f GB/s",
                  c.predicted_split_us / 1e3, c.predicted_replicated_us / 1e3,
                  c.collectives_per_token, c.weight_gbps);
    s += buf;
  }
  std::snprintf(buf, sizeof(buf), "; %.1f MB of weights on this rank",
                static_cast<double>(c.weight_bytes) / 1e6);
  s += buf;
  if (c.rows8_bytes > 0) {
    std::snprintf(buf, sizeof(buf), " + %.1f MB rows8", static_cast<double>(c.rows8_bytes) / 1e6);
    s += buf;
  }
  return s + ")";
}

}  // namespace treeattn::engine
