// The roofline's FMA probe (roofline.hpp, measure_peak_gflops) runs a target's instructions: on
// a CPU that lacks the target it must refuse by name, never execute them (SIGILL). Each x86
// target is checked on the branch this CPU takes: refused where the CPU lacks it, a positive
// peak where it has it (AVX-512 machines run the second branch for both, AVX2-only ones the first
// for avx512).
#include <gtest/gtest.h>

#include <string>

#include "treeattn/kernel.hpp"
#include "treeattn/roofline.hpp"

namespace treeattn {
namespace {

TEST(RooflineProbes, FmaPeakRefusesATargetThisCpuCannotRunAndMeasuresTheOthers) {
  for (const Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kGeneric}) {
    auto g = measure_peak_gflops(1, isa, 1);
    if (isa_supported(isa)) {
      ASSERT_TRUE(g.is_ok()) << isa_name(isa) << ": " << g.status().to_string();
      EXPECT_GT(*g, 0.0) << isa_name(isa);
    } else {
      ASSERT_FALSE(g.is_ok()) << isa_name(isa);
      EXPECT_EQ(g.status().code(), Code::kUnsupported);
      EXPECT_NE(g.status().message().find("cannot run the " + std::string(isa_name(isa))),
                std::string::npos)
          << g.status().to_string();
    }
  }
}

// The bandwidth each kernel run is compared with streams that layout's own bytes: the rows
// layout's K, V (and scales) and the tiled copy, each pass reading all of them but the 512-byte
// remainders of its pieces.
TEST(RooflineProbes, EachLayoutIsComparedWithAStreamOverItsOwnBytes) {
  RooflineOptions o;
  o.cases = {RooflineCase{AttnShape{1, 4, 2, 64, 1}, 4096}};
  o.dtypes = {DType::kBF16, DType::kInt8};
  o.threads = {1, 2};
  o.repeats = 2;
  o.peer = false;
  auto recs = run_roofline(o);
  ASSERT_TRUE(recs.is_ok()) << recs.status().to_string();
  ASSERT_EQ(recs->size(), 8u);  // 2 thread counts x 2 dtypes x (rows, tiled)
  for (const RooflineRecord& r : *recs) {
    SCOPED_TRACE(r.dtype + " " + r.layout + " threads " + std::to_string(r.threads));
    // At most 4 spans (K, V and two scale arrays), each thread losing under 512 bytes per span
    // it reads and the split under 512 per thread.
    const int64_t slack = 512 * (4 + 1) * r.threads;
    EXPECT_LE(r.probe_bytes, r.kv_bytes + (r.layout == "tiled" ? 64 * 1024 : 0));
    EXPECT_GE(r.probe_bytes, r.kv_bytes - slack);
    EXPECT_GT(r.bandwidth_gbps, 0.0);
  }
}

// The ceiling beside each record ran, with the arithmetic of the case's rows per KV head: group *
// q_len accumulators (2 * 1, and 4 * 3 = 12 here, at most 8).
TEST(RooflineProbes, TheCeilingRunsWithTheCasesRowsPerKVHead) {
  RooflineOptions o;
  o.cases = {RooflineCase{AttnShape{1, 4, 2, 64, 1}, 4096},
             RooflineCase{AttnShape{1, 8, 2, 64, 3}, 2048}};
  o.dtypes = {DType::kF16};
  o.threads = {1};
  o.repeats = 1;
  o.peer = false;
  auto recs = run_roofline(o);
  ASSERT_TRUE(recs.is_ok()) << recs.status().to_string();
  ASSERT_EQ(recs->size(), 4u);  // 2 cases x (rows, tiled)
  for (const RooflineRecord& r : *recs) {
    SCOPED_TRACE(r.shape + " " + r.layout);
    EXPECT_EQ(r.ceiling_rows, r.q_len == 1 ? 2 : 8);
    EXPECT_GT(r.ceiling_gbps, 0.0);
  }
}

}  // namespace
}  // namespace treeattn
