// calibrate_matmul (model.hpp): the token tile of matmul on 8-bit activations of K-quant weights,
// timed on this CPU with every candidate (tuning.hpp, MatmulTuneEntry).
//
// One random Q4_K matrix (options.rows x options.cols; valid blocks: small positive scales,
// random 6-bit sub-block scales and 4-bit codes) and options.tokens random activations; a round
// is one matmul call per candidate tile in an order that rotates from round to round. A
// candidate replaces the compiled-in tile only when the median over rounds of its rate over the
// default's in the same round beats 1 by more than the margin; its reported figure is its
// fastest round in integer operations per second (2 per weight and token).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "model/matmul_tuning.hpp"
#include "model/matvec_targets.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/model.hpp"

namespace treeattn::model {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kQ4KBlock = 144;  // bytes per 256 values: d, dmin (f16), 12 scale bytes, 128 codes

// Rows x cols of Q4_K: every block a valid one, its values O(1).
std::vector<uint8_t> random_q4k(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<uint8_t> w(static_cast<std::size_t>(rows * (cols / 256) * kQ4KBlock));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  const uint16_t d = float_to_f16(1.0f / 64), dmin = float_to_f16(1.0f / 128);
  for (std::size_t b = 0; b < w.size(); b += kQ4KBlock) {
    w[b] = static_cast<uint8_t>(d & 0xff);
    w[b + 1] = static_cast<uint8_t>(d >> 8);
    w[b + 2] = static_cast<uint8_t>(dmin & 0xff);
    w[b + 3] = static_cast<uint8_t>(dmin >> 8);
    for (int64_t j = 4; j < kQ4KBlock; ++j) w[b + static_cast<std::size_t>(j)] = static_cast<uint8_t>(byte(rng));
  }
  return w;
}

}  // namespace

std::vector<int64_t> matmul_tile_candidates() {
  return {int64_t{128} << 10, int64_t{256} << 10, detail::kTileBytes, int64_t{1} << 20,
          int64_t{2} << 20};
}

Result<MatmulTuneResult> calibrate_matmul(const MatmulTuneOptions& o) {
  TREEATTN_RETURN_IF_ERROR(check_thread_count(o.threads));
  if (o.threads < 1) return invalid_argument("calibrate_matmul: threads must be >= 1");
  if (o.min_rounds < 1 || o.max_rounds < o.min_rounds)
    return invalid_argument("calibrate_matmul: rounds must be 1 <= min_rounds <= max_rounds");
  if (o.rows < 1 || o.cols < 256 || o.cols % 256 != 0 || o.tokens < 1)
    return invalid_argument("calibrate_matmul: rows >= 1, cols a multiple of 256, tokens >= 1");
  const auto t_start = Clock::now();
  try {
    const std::vector<uint8_t> w = random_q4k(o.rows, o.cols, 11);
    WeightMatrix m;
    m.name = "calibration";
    m.type = detail::kTypeQ4_K;
    m.data = w.data();
    m.rows = o.rows;
    m.cols = o.cols;
    m.row_bytes = o.cols / 256 * kQ4KBlock;
    std::vector<float> x(static_cast<std::size_t>(o.tokens * o.cols));
    std::mt19937_64 rng(12);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& v : x) v = u(rng);
    std::vector<float> y(static_cast<std::size_t>(o.tokens * o.rows));
    MatvecOptions mo;
    mo.threads = o.threads;
    mo.mode = MatmulMode::kInt8;
    const WeightMatrix* mats[] = {&m};
    float* ys[] = {y.data()};
    const double ops = 2.0 * static_cast<double>(o.rows) * static_cast<double>(o.cols) *
                       static_cast<double>(o.tokens);

    const std::vector<int64_t> tiles = matmul_tile_candidates();
    const std::size_t n = tiles.size();
    std::vector<std::vector<double>> gops(n);
    auto timed = [&](int64_t tile) -> Result<double> {
      detail::force_matmul_tile_bytes(tile);
      const auto t0 = Clock::now();
      const Status s = matmul(mats, x.data(), o.tokens, o.cols, ys, mo);
      const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
      detail::force_matmul_tile_bytes(0);
      TREEATTN_RETURN_IF_ERROR(s);
      return ops / sec / 1e9;
    };
    TREEATTN_RETURN_IF_ERROR(timed(detail::kTileBytes).status());  // warm-up
    const auto t_measure = Clock::now();
    int rounds = 0;
    while (rounds < o.max_rounds &&
           (rounds < o.min_rounds ||
            std::chrono::duration<double>(Clock::now() - t_measure).count() < o.seconds)) {
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t step = rounds % 2 == 0 ? i : n - 1 - i;
        const std::size_t c = (step + 2 * static_cast<std::size_t>(rounds)) % n;
        auto g = timed(tiles[c]);
        TREEATTN_RETURN_IF_ERROR(g.status());
        gops[c].push_back(*g);
      }
      ++rounds;
    }
    auto best = [&](std::size_t i) { return *std::max_element(gops[i].begin(), gops[i].end()); };
    std::size_t dflt = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (tiles[i] == detail::kTileBytes) dflt = i;
    // Each tile against the default in the same round: the median of their ratios.
    auto vs = [&](std::size_t i) {
      std::vector<double> r;
      for (std::size_t k = 0; k < gops[i].size(); ++k) r.push_back(gops[i][k] / gops[dflt][k]);
      std::sort(r.begin(), r.end());
      const std::size_t h = r.size() / 2;
      return r.size() % 2 ? r[h] : 0.5 * (r[h - 1] + r[h]);
    };
    std::size_t chosen = dflt;
    for (std::size_t i = 0; i < n; ++i)
      if (vs(i) > 1 + o.margin && vs(i) > vs(chosen)) chosen = i;
    MatmulTuneResult r;
    r.entry.threads = o.threads;
    r.entry.tile_bytes = tiles[chosen];
    r.entry.gops = best(chosen);
    for (std::size_t i = 0; i < n; ++i) {
      TuneCandidate c;
      c.knob = "matmul_tile";
      c.value = std::to_string(tiles[i]);
      const auto [lo, hi] = std::minmax_element(gops[i].begin(), gops[i].end());
      c.gbps = *hi;
      c.spread = *hi > 0 ? (*hi - *lo) / *hi : 0;
      c.vs_default = vs(i);
      c.is_default = i == dflt;
      c.chosen = i == chosen;
      r.candidates.push_back(c);
    }
    r.rounds = rounds;
    r.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    return r;
  } catch (const std::bad_alloc&) {
    detail::force_matmul_tile_bytes(0);
    return Status(Code::kOutOfMemory, "calibrate_matmul: cannot allocate the matrix");
  }
}

}  // namespace treeattn::model
