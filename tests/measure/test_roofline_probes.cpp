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

}  // namespace
}  // namespace treeattn
