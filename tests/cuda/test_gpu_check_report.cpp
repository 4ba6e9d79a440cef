// The GPU check's verdicts (tools/gpu_check/gpu_check_report.hpp), on any machine: a set-up that
// fails (no executor, no NCCL communicator) is the environment, exit 2, never a wrong result;
// a wrong result is exit 1 whatever else happened; the JSON written between sections says that
// it is not complete; bandwidth rows name their K/V dtype.
#include <gtest/gtest.h>

#include <string>

#include "tools/gpu_check/gpu_check_report.hpp"

namespace treeattn {
namespace {

using gpucheck::Check;
using gpucheck::environment_check;
using gpucheck::Report;

TEST(GpuCheckReport, ASetUpFailureIsTheEnvironmentNotAWrongResult) {
  Report rep;
  EXPECT_EQ(rep.exit_code(), 0);
  rep.add(environment_check("nccl", "one rank: NCCL communicator set-up", Status::ok()));
  EXPECT_EQ(rep.exit_code(), 0);
  rep.add(
      environment_check("nccl", "one rank: NCCL communicator set-up",
                        internal_error("ncclCommInitRankConfig failed: unhandled system error")));
  EXPECT_EQ(rep.wrong_results(), 0u);
  EXPECT_EQ(rep.environment_failures(), 1u);
  EXPECT_EQ(rep.exit_code(), 2);
  EXPECT_FALSE(rep.all_ok());
  // A wrong result wins: exit 1.
  rep.add(Check{"correctness", "bf16: random shapes vs float64 oracle", false, 3e-3, "worst"});
  EXPECT_EQ(rep.exit_code(), 1);
}

TEST(GpuCheckReport, TheJsonSaysWhetherEverySectionRan) {
  Report rep;
  rep.add(Check{"widening", "f16: every value through the kernel", true, 0, "ok"});
  const std::string partial = rep.json(/*complete=*/false);
  EXPECT_NE(partial.find("\"complete\": false"), std::string::npos) << partial;
  EXPECT_NE(partial.find("\"exit_code\": 0"), std::string::npos) << partial;
  rep.add(environment_check("nccl", "set-up", internal_error("no NCCL")));
  const std::string done = rep.json();
  EXPECT_NE(done.find("\"complete\": true"), std::string::npos) << done;
  EXPECT_NE(done.find("\"environment_failures\": 1"), std::string::npos) << done;
  EXPECT_NE(done.find("\"environment\": true"), std::string::npos) << done;
  EXPECT_NE(done.find("\"exit_code\": 2"), std::string::npos) << done;
}

// The bandwidth rows of both bandwidth sections say which K/V dtype they timed (report.py sets
// the fractions of copy bandwidth of bf16, fp8 and int8 side by side from them).
TEST(GpuCheckReport, BandwidthRowsNameTheirDtype) {
  Report rep;
  gpucheck::BandwidthRow bf16, fp8;
  bf16.batch = fp8.batch = 1;
  bf16.frac_copy = 0.9;
  fp8.dtype = "fp8";
  fp8.frac_copy = 0.7;
  rep.bandwidth = {bf16, fp8};
  const std::string j = rep.json();
  EXPECT_NE(j.find("\"dtype\": \"bf16\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"dtype\": \"fp8\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"fraction_of_copy\": 0.7"), std::string::npos) << j;
}

}  // namespace
}  // namespace treeattn
