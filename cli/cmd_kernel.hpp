// `treeattn bench --kernel` (see cmd_kernel.cpp).
#pragma once

#include <string>

#include "options.hpp"

namespace treeattn::cli {

struct KernelBenchFlags {
  ShapeFlags shape;        // resolved: seqs, batches, heads...
  std::string dtypes;      // comma-separated
  int threads = 0;         // 0: all cores and one core
  int repeats = 5;
  std::string isa = "auto";
  bool no_peer = false;
  bool default_cases = false;  // the cases instead of the shape flags
  std::string json;
  Device device = Device::kCpu;  // cuda: the CUDA executor's kernel (run_roofline_on)
};

int kernel_bench(const KernelBenchFlags& flags);

}  // namespace treeattn::cli
