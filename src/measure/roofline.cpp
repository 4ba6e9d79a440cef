// The bandwidth and FMA probes and the kernel roofline run (see include/treeattn/roofline.hpp).
#include "treeattn/roofline.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <thread>

#include "kernels/cpu/cpu_targets.hpp"
#include "kernels/cpu/driver_tuning.hpp"
#include "treeattn/executor.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/kv_tiles.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/peer.hpp"
#include "treeattn/state.hpp"

namespace treeattn {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int resolve_threads(int threads) { return threads > 0 ? threads : omp_get_max_threads(); }

// The target whose probes run: the kernel's ISA, or generic for the reference kernel.
Isa probe_isa(Isa isa) {
  const Isa resolved = isa == Isa::kAuto ? best_isa() : isa;
  return resolved == Isa::kReference ? Isa::kGeneric : resolved;
}

// 64-byte aligned, uninitialized byte buffer (first touched by the threads that use it).
struct AlignedBuffer {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> mem;
  std::size_t bytes = 0;
  explicit AlignedBuffer(std::size_t n) : bytes((n + 63) / 64 * 64) {
    mem.reset(std::aligned_alloc(64, bytes));
  }
  uint8_t* data() const { return static_cast<uint8_t*>(mem.get()); }
};

// Fills a buffer with dtype-encoded values in [-1, 1): a 64 Ki-element random table tiled by
// memcpy, in parallel (the first touch places pages with the threads that read them).
void fill_random(uint8_t* dst, std::size_t bytes, DType t, uint64_t seed, int threads) {
  const std::size_t es = dtype_size(t);
  constexpr std::size_t kTable = 65536;
  std::vector<uint8_t> table(kTable * es);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < kTable; ++i) store_from_float(table.data(), t, i, u(rng));
  const std::size_t tb = table.size();
  const auto tiles = static_cast<int64_t>((bytes + tb - 1) / tb);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < tiles; ++i) {
    const std::size_t off = static_cast<std::size_t>(i) * tb;
    std::memcpy(dst + off, table.data(), std::min(tb, bytes - off));
  }
}

// Quantized K or V (fp8, int8) over `tokens` (token, KV head) rows of head_dim codes: a table
// of kPeriod random tokens in [-1, 1) is quantized per token (quantize_token) and tiled, codes
// and scales with the same period, so that the unquantized value of buffer token i is table
// token i % kPeriod (returned in `table` for the error against the unquantized values).
constexpr int64_t kPeriod = 512;
void fill_quantized(uint8_t* codes, float* scales, int64_t tokens, int64_t D, DType t,
                    uint64_t seed, int threads, std::vector<float>& table) {
  const auto per = static_cast<std::size_t>(kPeriod * D);
  table.resize(per);
  std::vector<uint8_t> ctab(per);
  std::vector<float> stab(static_cast<std::size_t>(kPeriod));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : table) x = u(rng);
  for (int64_t j = 0; j < kPeriod; ++j) {
    const auto off = static_cast<std::size_t>(j * D);
    stab[static_cast<std::size_t>(j)] =
        quantize_token(ctab.data(), t, off, table.data() + off, static_cast<std::size_t>(D));
  }
  const int64_t tiles = (tokens + kPeriod - 1) / kPeriod;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t n = std::min(kPeriod, tokens - i * kPeriod);
    std::memcpy(codes + static_cast<std::size_t>(i * kPeriod * D), ctab.data(),
                static_cast<std::size_t>(n * D));
    std::memcpy(scales + i * kPeriod, stab.data(), static_cast<std::size_t>(n) * sizeof(float));
  }
}

// Max |a - b| over max(1, max |b|) of normalized outputs of `rows` records against an oracle.
double rel_error(const std::vector<float>& states, const std::vector<double>& ref,
                 std::size_t rows, std::size_t D) {
  double err = 0, mag = 1;
  std::vector<float> o(D);
  for (std::size_t r = 0; r < rows; ++r) {
    float l;
    state_normalize(states.data() + r * (D + 2), D, o.data(), &l);
    for (std::size_t d = 0; d < D; ++d) {
      err = std::max(err, std::abs(o[d] - ref[r * D + d]));
      mag = std::max(mag, std::abs(ref[r * D + d]));
    }
  }
  return err / mag;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}


// The streaming-read probe over byte ranges: their concatenation split into one contiguous part
// per thread, each part read once by read_stream. The roofline gives it the very bytes a kernel
// reads (a case's K and V and scales, or its tiled copy), so that where the system placed those
// pages counts on both sides of a fraction; measure_read_bandwidth a buffer of its own.
// run() times one pass and returns GB/s of the bytes read (each piece rounded down to 512 bytes).
// run_ceiling() times one pass of the kernel's least arithmetic over the same pieces (FmaStreamFn
// on each span's dtype, `rows` accumulators, a prefetch lead) and returns its GB/s.
class SpanProbe {
 public:
  struct Span {
    std::span<const uint8_t> bytes;
    DType dtype = DType::kF32;  // what run_ceiling() reads the span as
  };
  SpanProbe(std::vector<Span> spans, int threads, Isa isa = Isa::kAuto)
      : spans_(std::move(spans)),
        threads_(resolve_threads(threads)),
        read_(kernels::cpu::read_stream_for(probe_isa(Isa::kAuto))),
        fma_(kernels::cpu::fma_stream_for(probe_isa(isa))) {
    std::size_t total = 0;
    for (const auto& sp : spans_) total += sp.bytes.size();
    per_thread_ = total / static_cast<std::size_t>(threads_) / 512 * 512;
    for (int t = 0; t < threads_; ++t)
      bytes_ += pieces(t, [](const uint8_t*, std::size_t, DType) {});
  }
  bool usable() const { return read_ != nullptr && bytes_ > 0; }
  bool ceiling_usable() const { return fma_ != nullptr && bytes_ > 0; }
  std::size_t bytes() const { return bytes_; }

  double run() {
    return timed([this](const uint8_t* p, std::size_t n, DType) {
      return read_(reinterpret_cast<const float*>(p), static_cast<int64_t>(n / 4));
    });
  }
  double run_ceiling(int rows, int64_t prefetch_bytes) {
    return timed([&](const uint8_t* p, std::size_t n, DType dt) {
      return fma_(p, static_cast<int64_t>(n), dt, rows, prefetch_bytes, 1.0f);
    });
  }

 private:
  template <typename Read>
  double timed(Read read) {
    float sum = 0;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads_) reduction(+ : sum)
    {
      float part = 0;
      pieces(omp_get_thread_num(),
             [&](const uint8_t* p, std::size_t n, DType dt) { part += read(p, n, dt); });
      sum += part;
    }
    const double s = seconds_since(t0);
    sink_ = sink_ + sum;
    return static_cast<double>(bytes_) / s / 1e9;
  }

  // Bytes of thread t's part, each piece (a multiple of 512 bytes) passed to visit.
  template <typename Visit>
  std::size_t pieces(int t, Visit visit) const {
    const std::size_t lo = static_cast<std::size_t>(t) * per_thread_, hi = lo + per_thread_;
    std::size_t base = 0, n = 0;
    for (const auto& sp : spans_) {
      const std::size_t size = sp.bytes.size();
      const std::size_t b = std::max(lo, base), e = std::min(hi, base + size);
      if (b < e) {
        const std::size_t bytes = (e - b) / 512 * 512;
        if (bytes > 0) visit(sp.bytes.data() + (b - base), bytes, sp.dtype);
        n += bytes;
      }
      base += size;
    }
    return n;
  }

  std::vector<Span> spans_;
  int threads_;
  kernels::cpu::ReadStreamFn read_;
  kernels::cpu::FmaStreamFn fma_;
  std::size_t per_thread_ = 0, bytes_ = 0;
  volatile float sink_ = 0;
};

// The software prefetch leads run_ceiling() is timed with (bytes; 0: the hardware's alone).
constexpr int64_t kCeilingLeads[] = {0, 2048, 8192, 32768};

// One case's cache and query on the host: K and V [batch][kv_heads][seq][head_dim] of random
// values in the dtype (fp8/int8: codes, a scale per token, and the unquantized table), the query,
// and every row's length (seq) and start (0).
struct HostCase {
  AttnShape shape;
  int64_t seq = 0;
  DType dtype = DType::kF32;
  AlignedBuffer k{0}, v{0};
  std::vector<float> k_scale, v_scale, k_table, v_table, q;
  std::vector<int64_t> len, start;

  bool quantized() const { return dtype_is_quantized(dtype); }
  std::size_t kv_elems() const {
    return static_cast<std::size_t>(shape.batch * shape.kv_heads * seq * shape.head_dim);
  }
  std::size_t kv_tokens() const {
    return static_cast<std::size_t>(shape.batch * shape.kv_heads * seq);
  }
  std::size_t code_bytes() const { return kv_elems() * dtype_size(dtype); }  // of K (or V)
  std::size_t scale_bytes() const { return quantized() ? kv_tokens() * sizeof(float) : 0; }
  // What one decode step reads: K and V and, quantized, their scales (float32 in rows,
  // bfloat16 in tiles).
  int64_t kv_bytes(bool tiled = false) const {
    const std::size_t scales =
        tiled ? scale_bytes() / sizeof(float) * kTiledScaleBytes : scale_bytes();
    return static_cast<int64_t>(2 * (code_bytes() + scales));
  }
  // A rows view of the whole cache over these K/V (and scale) pointers in `memory`.
  KVShard view(const void* kp, const void* vp, const float* ks, const float* vs,
               MemorySpace memory) const {
    KVShard kv;
    kv.dtype = dtype;
    kv.memory = memory;
    kv.k = kp;
    kv.v = vp;
    kv.stride_token = shape.head_dim;
    kv.stride_head = seq * shape.head_dim;
    kv.stride_batch = shape.kv_heads * kv.stride_head;
    kv.len = len;
    kv.pos_start = start;
    kv.total_len = len;
    if (quantized()) {
      kv.k_scale = ks;
      kv.v_scale = vs;
      kv.scale_stride_token = 1;
      kv.scale_stride_head = seq;
      kv.scale_stride_batch = shape.kv_heads * seq;
    }
    return kv;
  }
  KVShard host_view() const {
    return view(k.data(), v.data(), k_scale.data(), v_scale.data(), MemorySpace::kHost);
  }
};

Result<HostCase> make_host_case(const RooflineCase& c, DType t, int threads) {
  HostCase h;
  h.shape = c.shape;
  h.seq = c.seq;
  h.dtype = t;
  h.k = AlignedBuffer(h.code_bytes());
  h.v = AlignedBuffer(h.code_bytes());
  if (h.k.data() == nullptr || h.v.data() == nullptr)
    return Status(Code::kOutOfMemory, "cannot allocate " + std::to_string(2 * h.code_bytes()) +
                                          " bytes of KV for " + c.shape.to_string());
  if (h.quantized()) {
    h.k_scale.resize(h.kv_tokens());
    h.v_scale.resize(h.kv_tokens());
    fill_quantized(h.k.data(), h.k_scale.data(), static_cast<int64_t>(h.kv_tokens()),
                   c.shape.head_dim, t, 1, threads, h.k_table);
    fill_quantized(h.v.data(), h.v_scale.data(), static_cast<int64_t>(h.kv_tokens()),
                   c.shape.head_dim, t, 2, threads, h.v_table);
  } else {
    fill_random(h.k.data(), h.code_bytes(), t, 1, threads);
    fill_random(h.v.data(), h.code_bytes(), t, 2, threads);
  }
  h.q.resize(static_cast<std::size_t>(c.shape.batch * c.shape.q_len * c.shape.heads *
                                      c.shape.head_dim));
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : h.q) x = u(rng);
  h.len.assign(static_cast<std::size_t>(c.shape.batch), c.seq);
  h.start.assign(h.len.size(), 0);
  return h;
}

// The fields every record has: the case, the timings (median and best round) against the probe.
RooflineRecord timed_record(const HostCase& h, int64_t kv_bytes, const std::vector<double>& seconds,
                            const std::vector<double>& fractions,
                            const std::vector<double>& probes) {
  const AttnShape& s = h.shape;
  RooflineRecord rec;
  rec.shape = s.to_string();
  rec.dtype = std::string(dtype_name(h.dtype));
  rec.batch = s.batch;
  rec.heads = s.heads;
  rec.kv_heads = s.kv_heads;
  rec.head_dim = s.head_dim;
  rec.q_len = s.q_len;
  rec.seq = h.seq;
  rec.kv_bytes = kv_bytes;
  rec.seconds = median(seconds);
  rec.gbps = static_cast<double>(rec.kv_bytes) / rec.seconds / 1e9;
  rec.bandwidth_gbps = median(probes);
  rec.fraction_of_bandwidth = median(fractions);
  rec.gbps_best =
      static_cast<double>(rec.kv_bytes) / *std::min_element(seconds.begin(), seconds.end()) / 1e9;
  const auto [lo, hi] = std::minmax_element(probes.begin(), probes.end());
  rec.bandwidth_gbps_best = *hi;
  rec.fraction_best = rec.gbps_best / rec.bandwidth_gbps_best;
  rec.probe_spread = (*hi - *lo) / *hi;
  rec.flops = 4.0 * static_cast<double>(s.batch * s.heads * s.q_len) *
              static_cast<double>(h.seq) * static_cast<double>(s.head_dim);
  rec.memory_seconds = static_cast<double>(rec.kv_bytes) / (rec.bandwidth_gbps * 1e9);
  return rec;
}

// The check of one timed layout: `run` decodes batch row 0's first min(seq, 2048) tokens (shape
// with batch 1, lengths, host states out) and the states are compared with the float64 oracle on
// the host cache and, for fp8/int8, on the values before quantization.
Status check_record(
    const HostCase& h,
    const std::function<Status(const AttnShape&, std::span<const int64_t>, float*)>& run,
    RooflineRecord& rec) {
  const AttnShape& s = h.shape;
  AttnShape cs = s;
  cs.batch = 1;
  std::vector<int64_t> cl{std::min<int64_t>(h.seq, 2048)}, c0{0};
  const std::size_t crow = static_cast<std::size_t>(cs.q_len * cs.heads);
  const std::size_t D = static_cast<std::size_t>(s.head_dim);
  std::vector<float> cst(crow * (D + 2));
  TREEATTN_RETURN_IF_ERROR(run(cs, cl, cst.data()));
  KVShard ck = h.host_view();
  ck.len = cl;
  ck.pos_start = c0;
  ck.total_len = cl;
  std::vector<double> ref(crow * D), lse(crow);
  TREEATTN_RETURN_IF_ERROR(oracle_attention(cs, h.q.data(), ck, ref.data(), lse.data()));
  rec.max_rel_error = rel_error(cst, ref, crow, D);
  if (!h.quantized()) return Status::ok();
  // The same rows against the oracle on the unquantized values (table token
  // (h * seq + j) % kPeriod for head h, token j of batch row 0).
  const int64_t n = cl[0];
  std::vector<float> kf(static_cast<std::size_t>(s.kv_heads * n) * D), vf(kf.size());
  for (int64_t hd = 0; hd < s.kv_heads; ++hd)
    for (int64_t j = 0; j < n; ++j) {
      const auto src = static_cast<std::size_t>((hd * h.seq + j) % kPeriod) * D;
      const auto dst = static_cast<std::size_t>(hd * n + j) * D;
      std::memcpy(kf.data() + dst, h.k_table.data() + src, D * sizeof(float));
      std::memcpy(vf.data() + dst, h.v_table.data() + src, D * sizeof(float));
    }
  KVShard uk = ck;
  uk.dtype = DType::kF32;
  uk.k = kf.data();
  uk.v = vf.data();
  uk.stride_token = s.head_dim;
  uk.stride_head = n * s.head_dim;
  uk.stride_batch = s.kv_heads * uk.stride_head;
  uk.k_scale = uk.v_scale = nullptr;
  TREEATTN_RETURN_IF_ERROR(oracle_attention(cs, h.q.data(), uk, ref.data(), lse.data()));
  rec.max_rel_error_unquantized = rel_error(cst, ref, crow, D);
  return Status::ok();
}

}  // namespace

std::vector<RooflineCase> default_roofline_cases() {
  return {
      {AttnShape{1, 32, 8, 128, 1}, 262144},
      {AttnShape{16, 32, 8, 128, 1}, 16384},
      {AttnShape{1, 32, 8, 128, 4}, 65536},
  };
}

Result<double> measure_read_bandwidth(int threads, int64_t bytes, int repeats) {
  if (repeats < 1) return invalid_argument("repeats must be >= 1, got " + std::to_string(repeats));
  TREEATTN_RETURN_IF_ERROR(check_thread_count(threads));
  if (bytes < (int64_t{1} << 20))
    return invalid_argument("bandwidth probe needs at least 1 MiB, got " + std::to_string(bytes));
  // A buffer much larger than the caches, each thread's part first touched by that thread.
  const int T = resolve_threads(threads);
  const auto per = static_cast<std::size_t>(bytes / T / 512 * 512);
  AlignedBuffer buf(per * static_cast<std::size_t>(T));
  if (buf.data() == nullptr) return Status(Code::kOutOfMemory, "cannot allocate the probe buffer");
#pragma omp parallel num_threads(T)
  std::memset(buf.data() + static_cast<std::size_t>(omp_get_thread_num()) * per, 0, per);
  SpanProbe probe({{{buf.data(), buf.bytes}, DType::kF32}}, T);
  if (!probe.usable()) return internal_error("no read-stream probe built for this CPU");
  std::vector<double> rates;
  for (int r = 0; r < repeats + 1; ++r) {
    const double gbps = probe.run();
    if (r > 0) rates.push_back(gbps);  // r = 0: warm-up
  }
  return median(rates);
}

Result<double> measure_peak_gflops(int threads, Isa isa, int repeats) {
  if (repeats < 1) return invalid_argument("repeats must be >= 1, got " + std::to_string(repeats));
  TREEATTN_RETURN_IF_ERROR(check_thread_count(threads));
  const int T = resolve_threads(threads);
  const Isa target = probe_isa(isa);
  TREEATTN_RETURN_IF_ERROR(check_isa_supported(target, "FMA probe"));
  const kernels::cpu::FmaBurnFn burn = kernels::cpu::fma_burn_for(target);
  if (burn == nullptr) return internal_error("no FMA probe built for ISA " + std::string(isa_name(isa)));
  constexpr int64_t kIters = 4'000'000;
  std::vector<double> rates;
  volatile float sink = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    double flops = 0;
    float sum = 0;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(T) reduction(+ : flops, sum)
    {
      double f = 0;
      sum += burn(kIters, static_cast<float>(omp_get_thread_num()), &f);
      flops += f;
    }
    const double s = seconds_since(t0);
    sink = sink + sum;
    if (r > 0) rates.push_back(flops / s / 1e9);
  }
  return median(rates);
}

Result<std::vector<RooflineRecord>> run_roofline(const RooflineOptions& options) {
  if (options.repeats < 1)
    return invalid_argument("repeats must be >= 1, got " + std::to_string(options.repeats));
  for (int t : options.threads) TREEATTN_RETURN_IF_ERROR(check_thread_count(t));
  const std::vector<RooflineCase> cases =
      options.cases.empty() ? default_roofline_cases() : options.cases;
  for (const RooflineCase& c : cases) {
    TREEATTN_RETURN_IF_ERROR(c.shape.validate());
    if (c.seq < 1) return invalid_argument("roofline case " + c.shape.to_string() +
                                           " needs seq >= 1, got " + std::to_string(c.seq));
  }
  const Isa isa = options.isa == Isa::kAuto ? best_isa() : options.isa;
  TREEATTN_RETURN_IF_ERROR(check_isa_supported(isa, "roofline"));

  if (!options.rows && options.tiles.empty())
    return invalid_argument("roofline: no KV layout to time (rows off and no tile configuration)");
  for (const RooflineTiles& tc : options.tiles)
    if (tc.tile_tokens != 16 && (tc.tile_tokens < 32 || tc.tile_tokens > 256 || tc.tile_tokens % 32))
      return invalid_argument("roofline: tile_tokens must be 16 or a multiple of 32 up to 256, got " +
                              std::to_string(tc.tile_tokens));

  // Memory before anything is allocated (a case's KV, a tiled copy per tile configuration,
  // the query and the states): a shape that cannot fit is an error naming it, not an abort.
  const auto available = static_cast<double>(mem_available_bytes());
  for (const RooflineCase& c : cases)
    for (DType t : options.dtypes) {
      const AttnShape& s = c.shape;
      const double tokens = static_cast<double>(s.batch) * static_cast<double>(s.kv_heads) *
                            static_cast<double>(c.seq);
      double per_token = 2.0 * static_cast<double>(s.head_dim) * static_cast<double>(dtype_size(t));
      if (dtype_is_quantized(t)) per_token += 2.0 * sizeof(float);
      const double kv = tokens * per_token * (1.0 + static_cast<double>(options.tiles.size()));
      const double rows = static_cast<double>(s.batch) * static_cast<double>(s.q_len) *
                          static_cast<double>(s.heads);
      const double q = rows * static_cast<double>(s.head_dim) * sizeof(float);
      const double states = 2.0 * rows * static_cast<double>(s.head_dim + 2) * sizeof(float);
      const double need = kv + q + states;
      if (available > 0 && need > available)
        return Status(Code::kOutOfMemory,
                      "roofline: " + s.to_string() + " " + std::string(dtype_name(t)) + " at " +
                          std::to_string(c.seq) + " tokens needs " +
                          std::to_string(static_cast<long long>(need / (1 << 20))) +
                          " MiB (KV, its tiled copies, query and states); " +
                          std::to_string(static_cast<long long>(available / (1 << 20))) +
                          " MiB are available (MemAvailable)");
    }

  std::vector<RooflineRecord> out;
  for (int threads_opt : options.threads) {
    const int T = resolve_threads(threads_opt);
    Result<double> peak = measure_peak_gflops(T, isa, options.repeats);
    if (!peak.is_ok()) return peak.status();

    for (const RooflineCase& c : cases) {
      const AttnShape& s = c.shape;
      for (DType t : options.dtypes) {
        Result<HostCase> hc = make_host_case(c, t, T);
        if (!hc.is_ok()) return hc.status();
        const HostCase& h = *hc;
        const KVShard kv = h.host_view();
        const std::size_t rows = static_cast<std::size_t>(s.batch * s.q_len * s.heads);
        std::vector<float> states(rows * static_cast<std::size_t>(s.head_dim + 2));
        DecodeOptions opt;
        opt.threads = T;
        opt.isa = isa;
        opt.chunk_tokens = options.chunk_tokens;

        // The layouts timed for this case: rows, then each tiled configuration (same values).
        // Each with the probe over its own bytes (SpanProbe) and that probe's figures.
        struct Variant {
          std::string layout;
          RooflineTiles tiles;
          TiledKVCache cache;
          std::vector<double> seconds, fractions, probes;
          double bw_once = 0;  // without probe_each_repeat: the probe's median, once
        };
        std::vector<Variant> variants;
        if (options.rows) variants.push_back(Variant{"rows", {0, kKVTileLayout}, {}, {}, {}, {}});
        for (const RooflineTiles& tc : options.tiles) {
          Result<TiledKVCache> tiled =
              TiledKVCache::copy_from(s, kv, 0, tc.layout, tc.tile_tokens);
          if (!tiled.is_ok()) return tiled.status();
          variants.push_back(Variant{"tiled", tc, std::move(tiled).value(), {}, {}, {}});
        }
        std::vector<SpanProbe> own;
        for (const Variant& v : variants) {
          std::vector<SpanProbe::Span> spans;
          if (v.layout == "rows") {
            spans = {{{h.k.data(), h.code_bytes()}, t}, {{h.v.data(), h.code_bytes()}, t}};
            if (h.quantized())
              for (const std::vector<float>* sc : {&h.k_scale, &h.v_scale})
                spans.push_back({{reinterpret_cast<const uint8_t*>(sc->data()),
                                  sc->size() * sizeof(float)},
                                 DType::kF32});
          } else {
            spans = {{{v.cache.data(), v.cache.bytes()}, t}};  // its scales read as codes too
          }
          own.emplace_back(std::move(spans), T, isa);
          if (!own.back().usable())
            return internal_error("roofline: no read-stream probe for " + s.to_string() + " " +
                                  std::string(dtype_name(t)) + " (" + v.layout + ")");
        }
        if (!options.probe_each_repeat)
          for (std::size_t i = 0; i < variants.size(); ++i) {
            std::vector<double> rates;
            for (int r = 0; r < options.repeats + 1; ++r) {
              const double g = own[i].run();
              if (r > 0) rates.push_back(g);
            }
            variants[i].bw_once = median(rates);
          }
        // Runs one layout on the first shape.batch rows, each with l[b] tokens from position 0.
        auto run_variant = [&](const Variant& v, const AttnShape& shape, std::span<const int64_t> l,
                               float* st) -> Status {
          const std::span<const int64_t> l0 = std::span<const int64_t>(h.start).first(l.size());
          if (v.layout == "rows") {
            KVShard view = kv;
            view.len = l;
            view.pos_start = l0;
            view.total_len = l;
            return decode_partial(shape, h.q.data(), view, st, opt);
          }
          // The tiled kernel's block and prefetch for this configuration (the defaults unless
          // the configuration names others), restored afterwards.
          const kernels::cpu::TiledTuning saved = kernels::cpu::tiled_tuning();
          kernels::cpu::TiledTuning tuning = saved;
          if (v.tiles.block_tiles > 0) tuning.block_tiles = v.tiles.block_tiles;
          if (v.tiles.prefetch_bytes >= 0) tuning.prefetch_bytes = v.tiles.prefetch_bytes;
          if (v.tiles.prefetch_level > 0) tuning.prefetch_level = v.tiles.prefetch_level;
          kernels::cpu::set_tiled_tuning(tuning);
          const Status st_run =
              decode_partial_tiled(shape, h.q.data(), v.cache.view(l, l0, l), st, opt);
          kernels::cpu::set_tiled_tuning(saved);
          return st_run;
        };
        for (int r = 0; r < options.repeats + 1; ++r) {
          for (std::size_t i = 0; i < variants.size(); ++i) {
            Variant& v = variants[i];
            // Its probe right before it, the faster of two passes: one pass disturbed by other
            // work is not the machine's.
            const double bw_r =
                options.probe_each_repeat ? std::max(own[i].run(), own[i].run()) : v.bw_once;
            const auto t0 = Clock::now();
            TREEATTN_RETURN_IF_ERROR(run_variant(v, s, h.len, states.data()));
            const double sec = seconds_since(t0);
            if (r == 0) continue;  // warm-up round
            v.probes.push_back(bw_r);
            v.seconds.push_back(sec);
            v.fractions.push_back(static_cast<double>(h.kv_bytes(v.layout == "tiled")) / sec / 1e9 /
                                  bw_r);
          }
        }

        // The OpenBLAS peer (f32), timed once per case; every layout's record is compared to it.
        double peer_seconds = -1;
        if (options.peer && t == DType::kF32 && openblas_available()) {
          std::vector<double> pt;
          for (int r = 0; r < options.repeats + 1; ++r) {
            const auto t0 = Clock::now();
            TREEATTN_RETURN_IF_ERROR(
                openblas_decode_partial(s, h.q.data(), kv, states.data(), 0.0f, T));
            if (r > 0) pt.push_back(seconds_since(t0));
          }
          peer_seconds = median(pt);
          // OpenBLAS's worker threads busy-wait for a while after a call (THREAD_TIMEOUT,
          // ~2^28 cycles) and would steal the cores the next kernel timing runs on.
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
        }

        for (std::size_t i = 0; i < variants.size(); ++i) {
          Variant& v = variants[i];
          RooflineRecord rec =
              timed_record(h, h.kv_bytes(v.layout == "tiled"), v.seconds, v.fractions, v.probes);
          rec.isa = std::string(isa_name(isa));
          rec.layout = v.layout;
          rec.probe_bytes = static_cast<int64_t>(own[i].bytes());
          // The ceiling: the fastest of two passes per prefetch lead, after the kernel's rounds.
          rec.ceiling_rows = static_cast<int>(std::min<int64_t>(8, s.group() * s.q_len));
          if (own[i].ceiling_usable()) {
            for (const int64_t lead : kCeilingLeads)
              for (int pass = 0; pass < 2; ++pass)
                rec.ceiling_gbps =
                    std::max(rec.ceiling_gbps, own[i].run_ceiling(rec.ceiling_rows, lead));
            rec.fraction_of_ceiling = rec.gbps_best / rec.ceiling_gbps;
          }
          if (v.layout == "tiled") {
            rec.tile_tokens = v.tiles.tile_tokens;
            rec.tile_layout = std::string(kv_tile_layout_name(v.tiles.layout));
            const kernels::cpu::TiledTuning tuning = kernels::cpu::tiled_tuning();
            rec.block_tiles = v.tiles.block_tiles > 0 ? v.tiles.block_tiles : tuning.block_tiles;
            const kernels::cpu::DriverChoice dc =
                kernels::cpu::driver_choice(t, s.head_dim, s.group(), T, isa);
            rec.prefetch_bytes = v.tiles.prefetch_bytes >= 0 ? v.tiles.prefetch_bytes : dc.tiled_prefetch;
            rec.prefetch_l2 = v.tiles.prefetch_level > 0 ? v.tiles.prefetch_level == 2 : dc.tiled_l2;
          }
          rec.threads = T;
          rec.peak_gflops = peak.value();
          rec.compute_seconds = rec.flops / (rec.peak_gflops * 1e9);
          rec.bound = rec.compute_seconds > rec.memory_seconds ? "compute" : "memory";
          rec.fraction_of_bound = std::max(rec.compute_seconds, rec.memory_seconds) / rec.seconds;
          if (options.check)
            TREEATTN_RETURN_IF_ERROR(check_record(
                h,
                [&](const AttnShape& cs, std::span<const int64_t> cl, float* st) {
                  return run_variant(v, cs, cl, st);
                },
                rec));
          if (peer_seconds >= 0) {
            rec.peer_seconds = peer_seconds;
            rec.ours_over_peer = rec.seconds / peer_seconds;
          }
          out.push_back(rec);
        }
      }
    }
  }
  return out;
}

Result<std::vector<RooflineRecord>> run_roofline_on(Executor& exec,
                                                    const RooflineOptions& options) {
  const std::vector<RooflineCase> cases =
      options.cases.empty() ? default_roofline_cases() : options.cases;
  if (options.repeats < 1) return invalid_argument("roofline: repeats must be >= 1");
  if (options.probe_bytes < 1) return invalid_argument("roofline: probe_bytes must be >= 1");
  const std::string who = "roofline on " + std::string(exec.name()) + ": ";
  const int host_threads = resolve_threads(0);
  const auto available = static_cast<double>(mem_available_bytes());

  // The copy probe inside the executor's memory: `repeats` timed copies after a warm-up.
  std::vector<double> probes;
  {
    const auto n = static_cast<std::size_t>(options.probe_bytes);
    auto a = exec.allocate(n);
    TREEATTN_RETURN_IF_ERROR(a.status());
    auto b = exec.allocate(n);
    TREEATTN_RETURN_IF_ERROR(b.status());
    for (int r = 0; r < options.repeats + 1; ++r) {
      const auto t0 = Clock::now();
      TREEATTN_RETURN_IF_ERROR(exec.copy(b->data(), a->data(), n));
      TREEATTN_RETURN_IF_ERROR(exec.synchronize());
      const double sec = seconds_since(t0);
      if (r > 0) probes.push_back(2.0 * static_cast<double>(n) / sec / 1e9);
    }
  }
  const double bw = median(probes);

  // Copies host bytes into a new buffer of the executor.
  auto upload = [&](const void* src, std::size_t bytes) -> Result<Buffer> {
    auto buf = exec.allocate(bytes);
    TREEATTN_RETURN_IF_ERROR(buf.status());
    if (bytes > 0) TREEATTN_RETURN_IF_ERROR(exec.from_host(buf->data(), src, bytes));
    return buf;
  };

  std::vector<RooflineRecord> out;
  for (const RooflineCase& c : cases) {
    const AttnShape& s = c.shape;
    TREEATTN_RETURN_IF_ERROR(s.validate());
    if (c.seq < 1) return invalid_argument(who + "seq must be >= 1, got " + std::to_string(c.seq));
    for (DType t : options.dtypes) {
      // The values stay on the host for the oracle; a copy goes into the executor's memory.
      const double host_need = 2.0 * static_cast<double>(
                                         static_cast<std::size_t>(s.batch * s.kv_heads * c.seq *
                                                                  s.head_dim) * dtype_size(t));
      if (available > 0 && host_need > available)
        return Status(Code::kOutOfMemory,
                      who + s.to_string() + " at " + std::to_string(c.seq) + " tokens needs " +
                          std::to_string(static_cast<long long>(host_need / (1 << 20))) +
                          " MiB of host memory for the cache it copies; " +
                          std::to_string(static_cast<long long>(available / (1 << 20))) +
                          " MiB are available");
      Result<HostCase> hc = make_host_case(c, t, host_threads);
      if (!hc.is_ok()) return hc.status();
      const HostCase& h = *hc;
      auto dk = upload(h.k.data(), h.code_bytes());
      TREEATTN_RETURN_IF_ERROR(dk.status());
      auto dv = upload(h.v.data(), h.code_bytes());
      TREEATTN_RETURN_IF_ERROR(dv.status());
      auto dks = upload(h.k_scale.data(), h.scale_bytes());
      TREEATTN_RETURN_IF_ERROR(dks.status());
      auto dvs = upload(h.v_scale.data(), h.scale_bytes());
      TREEATTN_RETURN_IF_ERROR(dvs.status());
      auto dq = upload(h.q.data(), h.q.size() * sizeof(float));
      TREEATTN_RETURN_IF_ERROR(dq.status());
      const std::size_t st_bytes = static_cast<std::size_t>(s.batch * s.q_len * s.heads) *
                                   static_cast<std::size_t>(s.head_dim + 2) * sizeof(float);
      auto dst = exec.allocate(st_bytes);
      TREEATTN_RETURN_IF_ERROR(dst.status());
      const KVShard kv =
          h.view(dk->data(), dv->data(), dks->as<float>(), dvs->as<float>(), exec.memory());
      DecodeOptions opt;
      opt.chunk_tokens = options.chunk_tokens;
      std::vector<double> seconds, fractions;
      for (int r = 0; r < options.repeats + 1; ++r) {
        const auto t0 = Clock::now();
        TREEATTN_RETURN_IF_ERROR(exec.partial(s, dq->as<float>(), kv, dst->as<float>(), opt));
        TREEATTN_RETURN_IF_ERROR(exec.synchronize());
        const double sec = seconds_since(t0);
        if (r == 0) continue;  // warm-up
        seconds.push_back(sec);
        fractions.push_back(static_cast<double>(h.kv_bytes()) / sec / 1e9 / bw);
      }

      RooflineRecord rec = timed_record(h, h.kv_bytes(), seconds, fractions, probes);
      rec.isa = std::string(exec.name());
      rec.layout = "rows";
      rec.probe_bytes = 2 * options.probe_bytes;  // the copy's read and write
      rec.threads = 0;
      rec.peak_gflops = 0;  // not measured on the executor: the bandwidth bound
      rec.compute_seconds = 0;
      rec.bound = "memory";
      rec.fraction_of_bound = rec.memory_seconds / rec.seconds;
      if (options.check)
        TREEATTN_RETURN_IF_ERROR(check_record(
            h,
            [&](const AttnShape& cs, std::span<const int64_t> cl, float* host_states) {
              KVShard ck = kv;
              ck.len = cl;
              ck.pos_start = std::span<const int64_t>(h.start).first(cl.size());
              ck.total_len = cl;
              if (Status st = exec.partial(cs, dq->as<float>(), ck, dst->as<float>(), opt);
                  !st.is_ok())
                return st;
              const std::size_t n = static_cast<std::size_t>(cs.q_len * cs.heads) *
                                    static_cast<std::size_t>(cs.head_dim + 2);
              return exec.to_host(host_states, dst->data(), n * sizeof(float));
            },
            rec));
      out.push_back(rec);
    }
  }
  return out;
}

std::string roofline_table(const std::vector<RooflineRecord>& records) {
  std::string s;
  char line[512];
  std::snprintf(line, sizeof line,
                "%-26s %-5s %-7s %-16s %3s %7s %8s %8s %7s %7s %6s %7s %7s %6s %6s %7s %6s %8s %-7s "
                "%6s %9s %9s %8s %8s\n",
                "shape", "dtype", "isa", "layout", "thr", "seq", "kv_MB", "ms", "GB/s", "bw_GB/s",
                "frac", "best", "bw_best", "bw_spr", "f_best", "ceil", "f_ceil", "peak_GF", "bound",
                "f_bnd", "blas_ms", "ours/blas", "rel_err", "err_unq");
  s += line;
  for (const RooflineRecord& r : records) {
    const std::string peer_ms = r.peer_seconds >= 0 ? fmt("%.2f", r.peer_seconds * 1e3) : "-";
    const std::string ratio = r.ours_over_peer >= 0 ? fmt("%.3f", r.ours_over_peer) : "-";
    const std::string err = r.max_rel_error >= 0 ? fmt("%.1e", r.max_rel_error) : "-";
    const std::string errq =
        r.max_rel_error_unquantized >= 0 ? fmt("%.1e", r.max_rel_error_unquantized) : "-";
    std::string layout = r.layout;
    if (r.layout == "tiled") {
      layout = "t" + std::to_string(r.tile_tokens) + (r.tile_layout == "split" ? "s" : "i") +
               "-b" + std::to_string(r.block_tiles) + "-p" + std::to_string(r.prefetch_bytes) +
               (r.prefetch_l2 && r.prefetch_bytes > 0 ? "l2" : "");
    }
    std::snprintf(line, sizeof line,
                  "%-26s %-5s %-7s %-16s %3d %7lld %8.1f %8.2f %7.2f %7.2f %6.3f %7.2f %7.2f %5.0f%% "
                  "%6.3f %7.2f %6.3f %8.1f %-7s %6.3f %9s %9s %8s %8s\n",
                  r.shape.c_str(), r.dtype.c_str(), r.isa.c_str(), layout.c_str(), r.threads,
                  static_cast<long long>(r.seq), static_cast<double>(r.kv_bytes) / 1048576.0,
                  r.seconds * 1e3, r.gbps, r.bandwidth_gbps, r.fraction_of_bandwidth, r.gbps_best,
                  r.bandwidth_gbps_best, 100 * r.probe_spread, r.fraction_best,
                  r.ceiling_gbps, r.fraction_of_ceiling, r.peak_gflops, r.bound.c_str(),
                  r.fraction_of_bound, peer_ms.c_str(), ratio.c_str(), err.c_str(), errq.c_str());
    s += line;
  }
  return s;
}

std::string roofline_json(const std::vector<RooflineRecord>& records) {
  std::string s = "[";
  for (std::size_t i = 0; i < records.size(); ++i) {
    const RooflineRecord& r = records[i];
    auto num = [](double v) { return fmt("%.9g", v); };
    s += i ? ",\n " : "\n ";
    s += "{\"shape\": \"" + r.shape + "\", \"dtype\": \"" + r.dtype + "\", \"isa\": \"" + r.isa +
         "\", \"layout\": \"" + r.layout + "\", \"tile_tokens\": " + std::to_string(r.tile_tokens) +
         ", \"tile_layout\": \"" + r.tile_layout + "\", \"block_tiles\": " +
         std::to_string(r.block_tiles) + ", \"prefetch_bytes\": " + std::to_string(r.prefetch_bytes) +
         ", \"prefetch_level\": \"" + (r.prefetch_l2 ? "l2" : "l1") + "\"" +
         ", \"batch\": " + std::to_string(r.batch) + ", \"heads\": " + std::to_string(r.heads) +
         ", \"kv_heads\": " + std::to_string(r.kv_heads) +
         ", \"head_dim\": " + std::to_string(r.head_dim) + ", \"q_len\": " + std::to_string(r.q_len) +
         ", \"seq\": " + std::to_string(r.seq) + ", \"threads\": " + std::to_string(r.threads) +
         ", \"kv_bytes\": " + std::to_string(r.kv_bytes) + ", \"seconds\": " + num(r.seconds) +
         ", \"gbps\": " + num(r.gbps) + ", \"bandwidth_gbps\": " + num(r.bandwidth_gbps) +
         ", \"fraction_of_bandwidth\": " + num(r.fraction_of_bandwidth) +
         ", \"gbps_best\": " + num(r.gbps_best) +
         ", \"bandwidth_gbps_best\": " + num(r.bandwidth_gbps_best) +
         ", \"fraction_best\": " + num(r.fraction_best) +
         ", \"probe_spread\": " + num(r.probe_spread) +
         ", \"probe_bytes\": " + std::to_string(r.probe_bytes) +
         ", \"ceiling_gbps\": " + num(r.ceiling_gbps) +
         ", \"fraction_of_ceiling\": " + num(r.fraction_of_ceiling) +
         ", \"ceiling_rows\": " + std::to_string(r.ceiling_rows) +
         ", \"flops\": " + num(r.flops) + ", \"peak_gflops\": " + num(r.peak_gflops) +
         ", \"compute_seconds\": " + num(r.compute_seconds) +
         ", \"memory_seconds\": " + num(r.memory_seconds) + ", \"bound\": \"" + r.bound +
         "\", \"fraction_of_bound\": " + num(r.fraction_of_bound) +
         ", \"peer_seconds\": " + (r.peer_seconds >= 0 ? num(r.peer_seconds) : "null") +
         ", \"ours_over_peer\": " + (r.ours_over_peer >= 0 ? num(r.ours_over_peer) : "null") +
         ", \"max_rel_error\": " + (r.max_rel_error >= 0 ? num(r.max_rel_error) : "null") +
         ", \"max_rel_error_unquantized\": " +
         (r.max_rel_error_unquantized >= 0 ? num(r.max_rel_error_unquantized) : "null") + "}";
  }
  s += "\n]\n";
  return s;
}

}  // namespace treeattn
