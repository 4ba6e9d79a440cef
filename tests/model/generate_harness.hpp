// Runs a Generator over the in-process communicator (threads as ranks) for the model tests:
// prefill a prompt, then decode steps that either follow given tokens (teacher forcing, to
// compare logits position by position with a reference) or pick greedily. Every rank's tokens
// and logits are kept, so a test can check that the ranks agree bit for bit.
#pragma once

#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "treeattn/comm_local.hpp"
#include "treeattn/generate.hpp"
#include "treeattn/strategy.hpp"

namespace treeattn::testing {

struct GenRun {
  // Per rank: the logits after the prefill and after each step, and the tokens chosen.
  std::vector<std::vector<std::vector<float>>> logits;
  std::vector<std::vector<int32_t>> tokens;
  Status status;
};

struct GenCase {
  std::vector<std::string> methods = {"tree"};
  DType kv = DType::kF32;
  int steps = 4;
  const std::vector<int32_t>* forced = nullptr;  // tokens fed at each step (else greedy)
  int threads = 1;
  ShardKind placement = ShardKind::kEven;
  // The tests compare with float64 references and between paths: exact unless a test says so.
  model::MatmulMode matmul = model::MatmulMode::kExact;
};

inline GenRun run_generation(const model::LlamaModel& m, int ranks, const GenCase& c,
                             const std::vector<int32_t>& prompt, int method_index = 0) {
  GenRun out;
  out.logits.resize(static_cast<std::size_t>(ranks));
  out.tokens.resize(static_cast<std::size_t>(ranks));
  out.status = run_local(ranks, [&](Communicator& comm) -> Status {
    model::GeneratorConfig gc;
    gc.methods = c.methods;
    gc.kv_dtype = c.kv;
    gc.threads = c.threads;
    gc.placement = c.placement;
    gc.matmul = c.matmul;
    gc.reserve_tokens = c.steps;
    gc.timeout = std::chrono::milliseconds(120000);
    auto g = model::Generator::create(comm, m, gc);
    TREEATTN_RETURN_IF_ERROR(g.status());
    auto& logits = out.logits[static_cast<std::size_t>(comm.rank())];
    auto& toks = out.tokens[static_cast<std::size_t>(comm.rank())];
    std::vector<float> l;
    TREEATTN_RETURN_IF_ERROR((*g)->prefill(prompt, l));
    logits.push_back(l);
    for (int s = 0; s < c.steps; ++s) {
      const int32_t t =
          c.forced != nullptr ? (*c.forced)[static_cast<std::size_t>(s)] : model::top_two(l).first;
      toks.push_back(t);
      TREEATTN_RETURN_IF_ERROR((*g)->step(t, l, method_index));
      logits.push_back(l);
    }
    return Status::ok();
  });
  return out;
}

struct MethodRun {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // before each chosen token
};

// Every method's greedy continuation after one prefill, from rank 0 (the others checked equal).
inline Result<std::vector<MethodRun>> run_all(const model::LlamaModel& m, int ranks,
                                       const std::vector<std::string>& methods,
                                       const std::vector<int32_t>& prompt, int steps,
                                       model::MatmulMode matmul = model::MatmulMode::kExact) {
  std::vector<std::vector<MethodRun>> per_rank(static_cast<std::size_t>(ranks));
  Status st = run_local(ranks, [&](Communicator& comm) -> Status {
    model::GeneratorConfig gc;
    gc.methods = methods;
    gc.kv_dtype = DType::kF16;
    gc.matmul = matmul;
    gc.threads = ranks == 1 ? 2 : 1;
    gc.reserve_tokens = steps;
    gc.timeout = std::chrono::milliseconds(600000);
    auto g = model::Generator::create(comm, m, gc);
    TREEATTN_RETURN_IF_ERROR(g.status());
    std::vector<float> first;
    TREEATTN_RETURN_IF_ERROR((*g)->prefill(prompt, first));
    auto& mine = per_rank[static_cast<std::size_t>(comm.rank())];
    for (int k = 0; k < (*g)->methods(); ++k) {
      MethodRun r;
      std::vector<float> l = first;
      for (int s = 0; s < steps; ++s) {
        r.logits.push_back(l);
        r.tokens.push_back(model::top_two(l).first);
        TREEATTN_RETURN_IF_ERROR((*g)->step(r.tokens.back(), l, k));
      }
      mine.push_back(std::move(r));
    }
    return Status::ok();
  });
  if (!st.is_ok()) return st;
  for (int r = 1; r < ranks; ++r)
    for (std::size_t k = 0; k < methods.size(); ++k) {
      const auto& a = per_rank[static_cast<std::size_t>(r)][k];
      const auto& b = per_rank[0][k];
      if (a.tokens != b.tokens)
        return internal_error(methods[k] + ": rank " + std::to_string(r) +
                              "'s tokens differ from rank 0's");
      for (std::size_t s = 0; s < a.logits.size(); ++s)
        if (std::memcmp(a.logits[s].data(), b.logits[s].data(), a.logits[s].size() * 4) != 0)
          return internal_error(methods[k] + ": rank " + std::to_string(r) +
                                "'s logits differ from rank 0's at step " + std::to_string(s));
    }
  return per_rank[0];
}

// The methods the rank sweeps compare: every strategy `all` runs, and tree-det.
inline std::vector<std::string> sweep_methods() {
  std::vector<std::string> v;
  for (const auto& i : StrategyRegistry::for_backend(CommCapabilities{}).list())
    v.emplace_back(i.name);
  v.emplace_back("tree-det");
  return v;
}

// One rank count's runs (run_all) against the same methods at 1 rank: tree-det must give the
// same tokens and logits bits; every other method the same tokens up to a first divergence where
// the 1-rank logits' top two are within near_tie (printed with `label`, counted in *near).
// "" when so, else what differs.
inline std::string compare_to_one_rank(const std::vector<std::string>& methods,
                                       const std::vector<MethodRun>& run,
                                       const std::vector<MethodRun>& one, double near_tie,
                                       const std::string& label, int* near) {
  for (std::size_t k = 0; k < methods.size(); ++k) {
    const MethodRun& a = run[k];
    const MethodRun& b = one[k];
    const std::string what = label + " " + methods[k];
    if (methods[k] == "tree-det") {  // no exemption: the same tokens and logits bits
      if (a.tokens != b.tokens) return what + ": tokens differ from 1 rank's";
      for (std::size_t s = 0; s < a.logits.size(); ++s)
        if (std::memcmp(a.logits[s].data(), b.logits[s].data(), a.logits[s].size() * 4) != 0)
          return what + ": logits differ from 1 rank's at step " + std::to_string(s);
      continue;
    }
    for (std::size_t s = 0; s < a.tokens.size(); ++s) {
      if (a.tokens[s] == b.tokens[s]) continue;
      const auto top = model::top_two(b.logits[s]);
      std::printf("[ near tie  ] %s step %zu: %d vs %d, top-2 gap %.3g\n", what.c_str(), s,
                  a.tokens[s], b.tokens[s], static_cast<double>(top.gap()));
      if (top.gap() >= near_tie)
        return what + ": diverged from 1 rank at step " + std::to_string(s) + " with a top-2 gap of " +
               std::to_string(top.gap());
      ++*near;
      break;
    }
  }
  return "";
}

// "" when every rank has the same tokens and logits bits as rank 0, else which differs.
inline std::string ranks_agree(const GenRun& r) {
  for (std::size_t k = 1; k < r.logits.size(); ++k) {
    if (r.tokens[k] != r.tokens[0]) return "rank " + std::to_string(k) + "'s tokens differ";
    for (std::size_t s = 0; s < r.logits[0].size(); ++s)
      if (r.logits[k][s].size() != r.logits[0][s].size() ||
          std::memcmp(r.logits[k][s].data(), r.logits[0][s].data(),
                      r.logits[0][s].size() * sizeof(float)) != 0)
        return "rank " + std::to_string(k) + "'s logits at step " + std::to_string(s) +
               " differ from rank 0's";
  }
  return "";
}

}  // namespace treeattn::testing
