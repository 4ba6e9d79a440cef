// The exactness experiment of `treeattn verify` (verify.hpp).
#include "treeattn/verify.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"

namespace treeattn::verify {
namespace {

template <class T>
void write_npy(const std::filesystem::path& path, const char* descr, const std::vector<int64_t>& shape,
               const T* data, std::size_t n) {
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ",";
  if (shape.size() > 1) dims.pop_back();
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, dims);
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  f.write(reinterpret_cast<const char*>(&len), 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n * sizeof(T)));
}

}  // namespace

std::string Case::describe() const {
  std::string lens;
  for (int64_t n : config.total_len) lens += (lens.empty() ? "" : "/") + std::to_string(n);
  return fmt::format("{} N={} {} {}", config.shape.to_string(), lens, dtype_name(config.dtype),
                     shard_kind_name(config.shard));
}

KVLayout case_layout(KVLayout layout, uint64_t seed, bool device) {
  if (device) return KVLayout::kRows;  // device shards are rows
  if (layout != KVLayout::kAuto) return layout;
  return seed % 2 == 1 ? KVLayout::kTiled : KVLayout::kRows;
}

// Everything about case `seed` follows from the seed, so `--seed S --cases 1` reruns it.
Case make_case(uint64_t seed, int ranks, const std::vector<DType>& types, bool contiguous) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 17);
  auto pick = [&](auto const& options) { return options[rng() % options.size()]; };
  const std::vector<std::pair<int64_t, int64_t>> heads = {{1, 1}, {4, 1}, {4, 4}, {8, 2}, {32, 8}, {32, 4}};
  const std::vector<int64_t> dims = {64, 80, 96, 128, 192, 256};
  const std::vector<int64_t> qlens = {1, 1, 2, 4};
  const std::vector<std::string> shards =
      contiguous ? std::vector<std::string>{"even", "uneven", "empty", "explicit"}
                 : std::vector<std::string>{"even", "uneven", "striped", "empty", "explicit"};
  Case c;
  c.seed = seed;
  RunConfig& r = c.config;
  const auto hc = pick(heads);
  r.shape = AttnShape{1 + static_cast<int64_t>(rng() % 3), hc.first, hc.second, pick(dims), pick(qlens)};
  r.dtype = pick(types);
  for (int64_t b = 0; b < r.shape.batch; ++b) {
    const int64_t kind = static_cast<int64_t>(rng() % 4);
    r.total_len.push_back(kind == 0 ? static_cast<int64_t>(rng() % 4) : static_cast<int64_t>(rng() % 3000));
  }
  const std::string shard = pick(shards);
  if ((shard == "empty" || shard == "explicit") && ranks > 1) {
    // Per-rank lengths: random cuts, with rank 0 (empty) or random ranks holding nothing.
    r.shard = ShardKind::kExplicit;
    for (int64_t b = 0; b < r.shape.batch; ++b) {
      std::vector<int64_t> cut(static_cast<std::size_t>(ranks), 0);
      int64_t left = r.total_len[static_cast<std::size_t>(b)];
      for (int q = 0; q < ranks; ++q) {
        const bool empty = (shard == "empty" && q == 0) || (shard == "explicit" && rng() % 3 == 0);
        const int64_t take = q == ranks - 1 ? left
                             : empty       ? 0
                                           : static_cast<int64_t>(rng() % static_cast<uint64_t>(left + 1));
        cut[static_cast<std::size_t>(q)] = take;
        left -= take;
      }
      r.explicit_len.insert(r.explicit_len.end(), cut.begin(), cut.end());
    }
    // explicit_len is [rank][batch]; we built [batch][rank]: transpose.
    std::vector<int64_t> t(r.explicit_len.size());
    for (int64_t b = 0; b < r.shape.batch; ++b)
      for (int q = 0; q < ranks; ++q)
        t[static_cast<std::size_t>(q) * static_cast<std::size_t>(r.shape.batch) + static_cast<std::size_t>(b)] =
            r.explicit_len[static_cast<std::size_t>(b) * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(q)];
    r.explicit_len = t;
  } else {
    r.shard = (shard == "empty" || shard == "explicit") ? ShardKind::kEven : parse_shard_kind(shard).value();
  }
  r.seed = seed;
  r.warmup = 1;
  r.steps = 2;
  r.append = true;
  r.spare_tokens = 4;
  r.options.kernel.threads = 1;
  return c;
}

std::string save_case(const std::filesystem::path& dir, const Case& c, const StateBuffer& st,
                      const std::string& method) {
  const RunConfig& r = c.config;
  const int64_t step = r.warmup + r.steps - 1;
  WorkloadSpec w{r.shape, r.dtype, r.seed, r.q_scale};
  std::vector<int64_t> lens = r.total_len;
  for (auto& n : lens) n += step;  // one append per earlier step
  const int64_t nmax = *std::max_element(lens.begin(), lens.end());
  const KVCache cache = make_full_cache(w, lens);
  const auto B = r.shape.batch, H = r.shape.heads, Hkv = r.shape.kv_heads, D = r.shape.head_dim, Q = r.shape.q_len;
  std::vector<float> q(static_cast<std::size_t>(B * Q * H * D));
  make_query(w, step, q.data());
  std::vector<float> k(static_cast<std::size_t>(B * Hkv * std::max<int64_t>(nmax, 0) * D), 0.0f), v(k.size(), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t = 0; t < lens[static_cast<std::size_t>(b)]; ++t)
        for (int64_t d = 0; d < D; ++d) {
          const std::size_t src = cache.index(b, h, t) + static_cast<std::size_t>(d);
          const std::size_t dst = static_cast<std::size_t>(((b * Hkv + h) * nmax + t) * D + d);
          if (dtype_is_quantized(r.dtype)) {  // codes times the token's scale, as the kernels read them
            const std::size_t si = cache.scale_index(b, h, t);
            k[dst] = dequantize(cache.k_data(), r.dtype, src, cache.k_scale_data()[si]);
            v[dst] = dequantize(cache.v_data(), r.dtype, src, cache.v_scale_data()[si]);
          } else {
            k[dst] = load_as_float(cache.k_data(), r.dtype, src);
            v[dst] = load_as_float(cache.v_data(), r.dtype, src);
          }
        }
  std::vector<float> out(static_cast<std::size_t>(B * Q * H * D)), lse(static_cast<std::size_t>(B * Q * H));
  for (std::size_t i = 0; i < st.records(); ++i)
    state_normalize(st.record(i), static_cast<std::size_t>(D), out.data() + i * static_cast<std::size_t>(D), lse.data() + i);
  const std::string stem = fmt::format("case-{}", c.seed);
  std::filesystem::create_directories(dir);
  write_npy(dir / (stem + "-q.npy"), "<f4", {B, Q, H, D}, q.data(), q.size());
  write_npy(dir / (stem + "-k.npy"), "<f4", {B, Hkv, nmax, D}, k.data(), k.size());
  write_npy(dir / (stem + "-v.npy"), "<f4", {B, Hkv, nmax, D}, v.data(), v.size());
  write_npy(dir / (stem + "-out.npy"), "<f4", {B, Q, H, D}, out.data(), out.size());
  write_npy(dir / (stem + "-lse.npy"), "<f4", {B, Q, H}, lse.data(), lse.size());
  const nlohmann::json entry = {{"seed", c.seed}, {"method", method}, {"batch", B}, {"heads", H}, {"kv_heads", Hkv},
          {"head_dim", D}, {"q_len", Q}, {"kv_lengths", lens}, {"dtype", dtype_name(r.dtype)},
          {"scale", 1.0 / std::sqrt(static_cast<double>(D))},
          {"causal", "query i of q_len sees keys at positions <= kv_length - q_len + i"},
          {"files", {{"q", stem + "-q.npy"}, {"k", stem + "-k.npy"}, {"v", stem + "-v.npy"},
                     {"out", stem + "-out.npy"}, {"lse", stem + "-lse.npy"}}},
          {"note", "k and v are the cache values widened exactly to float32 (quantized: code times "
                   "the token's scale; padding rows are 0); "
                   "lse is natural-log"}};
  return entry.dump();
}

Status write_index(const std::filesystem::path& dir, int ranks,
                   const std::vector<std::string>& entries) {
  nlohmann::json cases = nlohmann::json::array();
  for (const auto& e : entries) cases.push_back(nlohmann::json::parse(e));
  std::ofstream idx(dir / "index.json");
  idx << nlohmann::json{{"ranks", ranks}, {"cases", cases}}.dump(2) << "\n";
  if (!idx) return invalid_argument("cannot write " + (dir / "index.json").string());
  return Status::ok();
}

Check check_case(Communicator& world, const Case& c, const std::string& method,
                 const CheckOptions& o) {
  const bool lead = world.rank() == 0;
  Check out;
  RunConfig rc = c.config;
  rc.timeout = o.timeout;
  rc.strategy = method;
  rc.kv_layout = out.layout = case_layout(o.layout, c.seed, o.executor != nullptr);
  rc.executor = o.executor;  // null on the CPU: the CPU executor
  rc.device_comm = o.device_comm;
  auto rep = run_decode(world, rc);
  if (!rep.is_ok()) {
    out.why = rep.status().to_string();
    out.must_abort =
        rep.status().code() == Code::kTimeout || rep.status().code() == Code::kInternal;
    return out;
  }
  const StateBuffer& st = rep.value().states.back();
  bool ok = true;
  if (lead) {
    auto chk = check_against_oracle(rc, rc.warmup + rc.steps - 1, st, o.tolerance);
    if (!chk.is_ok()) {
      ok = false;
      out.why = chk.status().to_string();
    } else {
      out.rel_error = chk.value().rel_error();
      ok = chk.value().passed;
      if (!ok) out.why = chk.value().detail;
    }
    out.output_sha256 = output_sha256(st);
    if (!o.save_dir.empty()) {
      try {
        out.saved = save_case(o.save_dir, c, st, method);
      } catch (const std::exception& e) {  // the disk filled up, the directory went away
        ok = false;
        out.why = "cannot save the case to " + o.save_dir.string() + ": " + e.what();
      }
    }
  }
  Status same = check_identical_across_ranks(world, st);
  if (!same.is_ok()) {
    ok = false;
    out.why = same.to_string();
  }
  double flag[2] = {ok ? 0.0 : 1.0, out.rel_error};
  (void)world.broadcast(flag, sizeof(flag), 0);
  out.ok = flag[0] == 0.0;
  out.rel_error = flag[1];
  return out;
}

}  // namespace treeattn::verify
