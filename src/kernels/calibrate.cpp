// calibrate_kernels (tuning.hpp): the candidates of every bit-neutral choice timed on the real
// decode kernels, from memory, alternating inside one run with the streaming-read probe.
//
// For one key (dtype, head_dim, group, threads): a cache of batch 1, 8 KV heads and `bytes` of
// K and V in the caller's rows layout, its copy in tiles (which is also the paged kernel's pool:
// one sequence whose pages are the tiles in order), one query. A round times one decode call
// per candidate, each reading the whole cache, and one probe pass, in an order that rotates
// from round to round, so that no candidate always follows the same one and a drift of the
// machine's load falls on all of them. Rounds go on until the time asked for has passed (at
// least min_rounds). A candidate is compared with its knob's compiled-in default round by round
// (the two ran a few calls apart, under the same load): the median over rounds of the ratio of
// their rates, so that load that comes and goes beside the calibration (another process, a
// build) falls on both sides of each ratio; a candidate replaces the default only when that
// median beats it by more than the margin. Each candidate's reported rate is its fastest round
// (other work only ever slows a round).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/cpu/driver_tuning.hpp"
#include "treeattn/host_memory.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/paged_kv.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/tuning.hpp"

namespace treeattn {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double best(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The last-level cache in bytes, or 32 MiB when the system does not say.
int64_t last_level_cache_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  if (const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE); l3 > 0) return l3;
#endif
#if defined(_SC_LEVEL2_CACHE_SIZE)
  if (const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE); l2 > 0) return l2;
#endif
  return int64_t{32} << 20;
}

int64_t default_bytes() {
  int64_t b = std::clamp<int64_t>(2 * last_level_cache_bytes(), int64_t{64} << 20,
                                  int64_t{256} << 20);
  if (const uint64_t avail = mem_available_bytes(); avail > 0)
    b = std::min<int64_t>(b, static_cast<int64_t>(avail / 4));
  return b;
}

constexpr int64_t kKVHeads = 8;
const int64_t kTiledLeads[] = {0, 4096, 8192, 12288, 16384, 24576, 32768, 65536};
const int64_t kRowsLeads[] = {0, 1024, 2048, 4096};
const int64_t kPagedLeads[] = {4096, 8192, 12288, 16384};
// The leads also timed with the prefetch into L2 (prefetcht1): a core whose L1 keeps fewer
// misses in flight than its L2 reads faster with those (the Zen 4 of docs/kernels.md).
const int64_t kTiledLeadsL2[] = {8192, 16384, 24576, 32768, 65536};
const int64_t kPagedLeadsL2[] = {8192, 16384, 32768};

enum class Run { kRows, kTiled, kPaged, kProbe };

struct Candidate {
  std::string knob, value;
  Run run = Run::kProbe;
  TuneChoice choice;
  bool is_default = false;
  std::vector<double> gbps;  // per round
};

// One key's cache, query and the calls that time it.
class KeyBench {
 public:
  Status init(const TuneKey& key, int64_t bytes, Isa isa) {
    shape_ = AttnShape{1, kKVHeads * key.group, kKVHeads, key.head_dim, 1};
    TREEATTN_RETURN_IF_ERROR(shape_.validate());
    dtype_ = key.dtype;
    options_.threads = key.threads;
    options_.isa = isa;
    const bool quant = dtype_is_quantized(dtype_);
    const int64_t per_token =
        kKVHeads * (2 * key.head_dim * static_cast<int64_t>(dtype_size(dtype_)) +
                    (quant ? 2 * static_cast<int64_t>(sizeof(float)) : 0));
    tokens_ = std::max<int64_t>(16, bytes / per_token / kKVTileTokens) * kKVTileTokens;
    bytes_ = tokens_ * per_token;
    // The tiles hold the quantized types' scales as bfloat16, the rows as float32.
    tiled_bytes_ = tokens_ * kKVHeads *
                   static_cast<int64_t>(kv_head_token_bytes(static_cast<std::size_t>(key.head_dim), dtype_));
    rows_ = KVCache(shape_, dtype_, tokens_);
    const std::size_t elems =
        static_cast<std::size_t>(kKVHeads * tokens_ * key.head_dim) * dtype_size(dtype_);
    // Any valid value, written so that every page is the process's own: 0x3C in every byte
    // is ~0.0115 in f32 and bf16, ~1.06 in f16, 1.5 in fp8 (e4m3), 60 in int8; the scales a
    // bfloat16 value. The kernels' work does not depend on the values.
    std::memset(rows_.k_data(), 0x3C, elems);
    std::memset(rows_.v_data(), 0x3C, elems);
    if (quant) {
      const std::size_t n = static_cast<std::size_t>(kKVHeads * tokens_);
      std::fill(rows_.k_scale_data(), rows_.k_scale_data() + n, 0x1p-7f);
      std::fill(rows_.v_scale_data(), rows_.v_scale_data() + n, 0x1p-7f);
    }
    len_ = {tokens_};
    pos_ = {0};
    rows_view_ = rows_.view(0, len_, pos_, len_, 1);
    auto tiled = TiledKVCache::copy_from(shape_, rows_view_);
    TREEATTN_RETURN_IF_ERROR(tiled.status());
    tiled_ = std::move(tiled).value();
    tiled_view_ = tiled_.view(len_, pos_, len_, 1);
    const int64_t pages = tokens_ / kKVTileTokens;
    pages_.resize(static_cast<std::size_t>(pages));
    page_pos_.resize(pages_.size());
    page_len_.assign(pages_.size(), static_cast<int32_t>(kKVTileTokens));
    for (int64_t p = 0; p < pages; ++p) {
      pages_[static_cast<std::size_t>(p)] = static_cast<int32_t>(p);
      page_pos_[static_cast<std::size_t>(p)] = p * kKVTileTokens;
    }
    q_.resize(static_cast<std::size_t>(shape_.heads * shape_.head_dim));
    for (std::size_t i = 0; i < q_.size(); ++i) q_[i] = 0.01f * static_cast<float>(i % 17) - 0.08f;
    states_.resize(static_cast<std::size_t>(shape_.heads * (shape_.head_dim + 2)));
    read_ = kernels::cpu::read_stream_for(isa == Isa::kReference ? Isa::kGeneric : isa);
    if (read_ == nullptr) return internal_error("no read-stream probe built for this CPU");
    return Status::ok();
  }

  int64_t bytes() const { return bytes_; }  // K and V in rows (what a rows call reads)
  int64_t bytes_of(Run run) const { return run == Run::kRows ? bytes_ : tiled_bytes_; }

  // GB/s of one call of `run` under `choice` (the probe ignores it).
  Result<double> time(Run run, const TuneChoice& choice) {
    if (run == Run::kProbe) return probe();
    kernels::cpu::force_driver_choice(&choice);
    const auto t0 = Clock::now();
    Status s;
    switch (run) {
      case Run::kRows:
        s = decode_partial(shape_, q_.data(), rows_view_, states_.data(), options_);
        break;
      case Run::kTiled:
        s = decode_partial_tiled(shape_, q_.data(), tiled_view_, states_.data(), options_);
        break;
      case Run::kPaged: {
        PagedEntry e;
        e.q = q_.data();
        e.n_q = 1;
        e.first_pos = tokens_ - 1;
        e.pages = pages_;
        e.page_pos = page_pos_;
        e.page_len = page_len_;
        e.states = states_.data();
        s = decode_partial_paged(shape_, tiled_view_, tokens_ / kKVTileTokens,
                                 std::span<const PagedEntry>(&e, 1), options_);
        break;
      }
      case Run::kProbe:
        break;
    }
    const double sec = seconds_since(t0);
    kernels::cpu::force_driver_choice(nullptr);
    TREEATTN_RETURN_IF_ERROR(s);
    return static_cast<double>(run == Run::kRows ? bytes_ : tiled_bytes_) / sec / 1e9;
  }

 private:
  // The streaming-read probe over the tiled copy (the tiled and paged candidates' bytes, on
  // their huge pages; the rows buffers' 4 KiB pages may stream slower), each thread reading its
  // own contiguous part.
  double probe() {
    const int T = options_.threads;
    const std::size_t floats = tiled_.bytes() / 4;
    const std::size_t per = floats / static_cast<std::size_t>(T) / 128 * 128;
    const float* f = reinterpret_cast<const float*>(tiled_.data());
    const kernels::cpu::ReadStreamFn read = read_;
    float sum = 0;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(T) reduction(+ : sum)
    {
      const std::size_t tid = static_cast<std::size_t>(omp_get_thread_num());
      sum += read(f + tid * per, static_cast<int64_t>(per));
    }
    const double sec = seconds_since(t0);
    sink_ = sink_ + sum;
    return static_cast<double>(per * static_cast<std::size_t>(T) * 4) / sec / 1e9;
  }

  AttnShape shape_;
  DType dtype_ = DType::kF32;
  DecodeOptions options_;
  int64_t tokens_ = 0, bytes_ = 0, tiled_bytes_ = 0;
  KVCache rows_;
  TiledKVCache tiled_;
  std::vector<int64_t> len_, pos_;
  KVShard rows_view_;
  TiledKVShard tiled_view_;
  std::vector<int32_t> pages_, page_len_;
  std::vector<int64_t> page_pos_;
  std::vector<float> q_, states_;
  kernels::cpu::ReadStreamFn read_ = nullptr;
  volatile float sink_ = 0;
};

std::string num(int64_t v) { return std::to_string(v); }

std::vector<Candidate> candidates_for(const TuneKey& key, Isa isa) {
  const TuneChoice def = tuning_defaults(key, isa);
  std::vector<Candidate> c;
  // A lead knob's candidates: its leads at the default level, into L1 (tuning_defaults()
  // never sends lines to L2), the default's lead among them; and, where given, leads into L2
  // ("16384:l2").
  auto add_leads = [&](const char* knob, Run run, const int64_t* leads, std::size_t n,
                       int64_t TuneChoice::*field, const int64_t* l2_leads, std::size_t n_l2,
                       bool TuneChoice::*l2_field) {
    std::vector<int64_t> v(leads, leads + n);
    if (std::find(v.begin(), v.end(), def.*field) == v.end()) v.push_back(def.*field);
    std::sort(v.begin(), v.end());
    for (int64_t lead : v) {
      Candidate x{knob, num(lead), run, def, lead == def.*field, {}};
      x.choice.*field = lead;
      c.push_back(x);
    }
    for (std::size_t i = 0; i < n_l2; ++i) {
      Candidate x{knob, num(l2_leads[i]) + ":l2", run, def, false, {}};
      x.choice.*field = l2_leads[i];
      x.choice.*l2_field = true;
      c.push_back(x);
    }
  };
  add_leads("tiled_prefetch", Run::kTiled, kTiledLeads, std::size(kTiledLeads),
            &TuneChoice::tiled_prefetch, kTiledLeadsL2, std::size(kTiledLeadsL2),
            &TuneChoice::tiled_l2);
  Candidate chunks{"item_order", "chunks", Run::kTiled, def, false, {}};
  chunks.choice.chunks_outer = true;
  c.push_back(chunks);
  add_leads("rows_prefetch", Run::kRows, kRowsLeads, std::size(kRowsLeads),
            &TuneChoice::rows_prefetch, nullptr, 0, nullptr);
  add_leads("paged_prefetch", Run::kPaged, kPagedLeads, std::size(kPagedLeads),
            &TuneChoice::paged_prefetch, kPagedLeadsL2, std::size(kPagedLeadsL2),
            &TuneChoice::paged_l2);
  c.push_back(Candidate{"probe", "read", Run::kProbe, def, false, {}});
  return c;
}

TuneCandidate summary(const Candidate& c, bool chosen, double vs_default) {
  TuneCandidate t;
  t.vs_default = vs_default;
  t.knob = c.knob;
  t.value = c.value;
  const auto [lo, hi] = std::minmax_element(c.gbps.begin(), c.gbps.end());
  t.gbps = *hi;
  t.spread = *hi > 0 ? (*hi - *lo) / *hi : 0;
  t.is_default = c.is_default;
  t.chosen = chosen;
  return t;
}

Result<TuneResult> calibrate_one(const TuneKey& key, const TuneOptions& o, Isa isa) {
  const auto t_start = Clock::now();
  KeyBench bench;
  TREEATTN_RETURN_IF_ERROR(bench.init(key, o.bytes > 0 ? o.bytes : default_bytes(), isa));
  std::vector<Candidate> cands = candidates_for(key, isa);
  const TuneChoice def = tuning_defaults(key, isa);
  // Warm-up: one call of each kind (first touches of the scratch, OpenMP's threads).
  for (Run r : {Run::kRows, Run::kTiled, Run::kPaged, Run::kProbe})
    TREEATTN_RETURN_IF_ERROR(bench.time(r, def).status());

  const auto t_measure = Clock::now();
  int rounds = 0;
  const std::size_t n = cands.size();
  while (rounds < o.max_rounds && (rounds < o.min_rounds || seconds_since(t_measure) < o.seconds)) {
    // Rotate the start and alternate the direction: no candidate always follows another.
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t step = rounds % 2 == 0 ? i : n - 1 - i;
      Candidate& c = cands[(step + static_cast<std::size_t>(rounds) * 5) % n];
      auto g = bench.time(c.run, c.choice);
      TREEATTN_RETURN_IF_ERROR(g.status());
      c.gbps.push_back(*g);
    }
    ++rounds;
  }

  // Per knob, each candidate against the knob's default in the same round (the two ran a few
  // calls apart, under the same load): the median over rounds of their ratio. A candidate
  // replaces the default only when that median beats it by more than the margin, the best such.
  auto fastest = [&](std::size_t i) { return best(cands[i].gbps); };
  auto vs = [&](std::size_t i, std::size_t base) {
    std::vector<double> r;
    for (std::size_t k = 0; k < cands[i].gbps.size(); ++k)
      r.push_back(cands[i].gbps[k] / cands[base].gbps[k]);
    return median(r);
  };
  auto find = [&](const std::string& knob, bool want_default) {
    for (std::size_t i = 0; i < n; ++i)
      if (cands[i].knob == knob && cands[i].is_default == want_default) return i;
    return n;
  };
  auto pick = [&](const std::string& knob) {
    const std::size_t dflt = find(knob, true);
    std::size_t top = dflt;
    for (std::size_t i = 0; i < n; ++i)
      if (cands[i].knob == knob && vs(i, dflt) > 1 + o.margin && vs(i, dflt) > vs(top, dflt)) top = i;
    return top;
  };
  const std::size_t tiled = pick("tiled_prefetch"), rows = pick("rows_prefetch"),
                    paged = pick("paged_prefetch");
  const std::size_t heads = find("tiled_prefetch", true), chunks = find("item_order", false);
  const bool chunks_outer = vs(chunks, heads) > 1 + o.margin;
  // The layout: each at its chosen lead; the other one than the rule's only when it beats the
  // rule's by the margin, round by round.
  const bool tiled_rule = def.layout == KVLayout::kTiled;
  const std::size_t rule_i = tiled_rule ? tiled : rows, other_i = tiled_rule ? rows : tiled;
  // In calls per second: the layouts read the same tokens, but the tiles hold the quantized
  // types' scales in fewer bytes.
  const double per_call = static_cast<double>(bench.bytes_of(cands[rule_i].run)) /
                          static_cast<double>(bench.bytes_of(cands[other_i].run));
  const double layout_vs = vs(other_i, rule_i) * per_call;
  const bool switch_layout = layout_vs > 1 + o.margin;
  const KVLayout layout = switch_layout ? (tiled_rule ? KVLayout::kRows : KVLayout::kTiled)
                                        : def.layout;

  TuneResult out;
  out.entry.key = key;
  out.entry.choice = def;
  out.entry.choice.tiled_prefetch = cands[tiled].choice.tiled_prefetch;
  out.entry.choice.tiled_l2 = cands[tiled].choice.tiled_l2;
  out.entry.choice.rows_prefetch = cands[rows].choice.rows_prefetch;
  out.entry.choice.paged_prefetch = cands[paged].choice.paged_prefetch;
  out.entry.choice.paged_l2 = cands[paged].choice.paged_l2;
  out.entry.choice.chunks_outer = chunks_outer;
  out.entry.choice.layout = layout;
  out.entry.kernel_gbps = layout == KVLayout::kTiled ? fastest(tiled) : fastest(rows);
  for (std::size_t i = 0; i < n; ++i) {
    const Candidate& c = cands[i];
    if (c.run == Run::kProbe) {
      out.entry.probe_gbps = fastest(i);
      out.probe_spread = summary(c, false, 1).spread;
      continue;
    }
    if (c.knob == "item_order") {
      Candidate h = cands[heads];
      h.knob = "item_order";
      h.value = "heads";
      h.is_default = true;
      out.candidates.push_back(summary(h, !chunks_outer, 1));
      out.candidates.push_back(summary(c, chunks_outer, vs(chunks, heads)));
      continue;
    }
    out.candidates.push_back(
        summary(c, i == tiled || i == rows || i == paged, vs(i, find(c.knob, true))));
  }
  for (KVLayout l : {KVLayout::kRows, KVLayout::kTiled}) {
    const std::size_t li = l == KVLayout::kRows ? rows : tiled;
    Candidate lc = cands[li];
    lc.knob = "layout";
    lc.value = std::string(kv_layout_name(l));
    lc.is_default = l == def.layout;
    out.candidates.push_back(summary(lc, l == layout, li == rule_i ? 1.0 : layout_vs));
  }
  out.rounds = rounds;
  out.bytes = bench.bytes();
  out.seconds = seconds_since(t_start);
  return out;
}

}  // namespace

std::vector<TuneChoice> tuning_candidates(const TuneKey& key, Isa isa) {
  std::vector<TuneChoice> out;
  for (const Candidate& c : candidates_for(key, isa))
    if (c.run != Run::kProbe) out.push_back(c.choice);
  return out;
}

Result<std::vector<TuneResult>> calibrate_kernels(const TuneOptions& options) {
  if (options.keys.empty()) return invalid_argument("calibrate_kernels: no key to calibrate");
  if (options.min_rounds < 1 || options.max_rounds < options.min_rounds)
    return invalid_argument("calibrate_kernels: rounds must be 1 <= min_rounds <= max_rounds, got " +
                            std::to_string(options.min_rounds) + " and " +
                            std::to_string(options.max_rounds));
  if (options.bytes < 0) return invalid_argument("calibrate_kernels: bytes must be >= 0");
  const Isa isa = best_isa();
  std::vector<TuneResult> out;
  for (const TuneKey& key : options.keys) {
    TREEATTN_RETURN_IF_ERROR(check_thread_count(key.threads));
    if (key.threads < 1)
      return invalid_argument("calibrate_kernels: " + key.to_string() + ": threads must be >= 1");
    if (key.group < 1)
      return invalid_argument("calibrate_kernels: " + key.to_string() + ": group must be >= 1");
    try {
      auto r = calibrate_one(key, options, isa);
      kernels::cpu::force_driver_choice(nullptr);
      TREEATTN_RETURN_IF_ERROR(r.status());
      out.push_back(std::move(r).value());
    } catch (const std::bad_alloc&) {
      kernels::cpu::force_driver_choice(nullptr);
      return Status(Code::kOutOfMemory,
                    "calibrate_kernels: cannot allocate the caches for " + key.to_string());
    }
  }
  return out;
}

}  // namespace treeattn
