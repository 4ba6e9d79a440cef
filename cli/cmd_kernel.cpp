// `treeattn bench --kernel`: the roofline of the local decode kernel. Measures this machine's
// streaming-read bandwidth and FMA peak with the kernel's threads, then times the kernel per
// shape and dtype and prints achieved GB/s of KV read against the tighter limit, with the
// OpenBLAS peer (f32) in the same run.
#include "cmd_kernel.hpp"

#include <cstdio>
#include <fstream>

#include "treeattn/executor_cuda.hpp"
#include "treeattn/roofline.hpp"
#include "tuning.hpp"

namespace treeattn::cli {

int kernel_bench(const KernelBenchFlags& f) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "treeattn bench --kernel: error: %s\n", s.to_string().c_str());
    return 2;
  };
  RooflineOptions o;
  o.dtypes.clear();
  for (const auto& name : split_list(f.dtypes)) {
    auto t = parse_dtype(name);
    if (!t) return fail(invalid_argument("--dtype: unknown type '" + name + "' (known: f32, f16, bf16)"));
    o.dtypes.push_back(*t);
  }
  if (o.dtypes.empty()) return fail(invalid_argument("--dtype: empty list"));
  auto isa = parse_isa(f.isa);
  if (!isa.is_ok()) return fail(isa.status());
  o.isa = isa.value();
  o.threads = f.threads > 0 ? std::vector<int>{f.threads} : std::vector<int>{0, 1};
  if (f.repeats < 1) return fail(invalid_argument("--repeats must be >= 1"));
  o.repeats = f.repeats;
  o.peer = !f.no_peer;
  if (f.default_cases) {
    o.cases = default_roofline_cases();
  } else {
    for (int64_t b : f.shape.batches)
      for (int64_t seq : f.shape.seqs) {
        RooflineCase c;
        c.shape = f.shape.shape();
        c.shape.batch = b;
        c.seq = seq;
        o.cases.push_back(c);
      }
  }
  if (f.device == Device::kCpu) {
    // The kernels' tuning for every case, dtype and thread count timed, measured first.
    std::vector<TuneKey> keys;
    const int cores = default_threads(1);
    for (const RooflineCase& c : o.cases)
      for (DType t : o.dtypes)
        for (int threads : o.threads)
          keys.push_back(TuneKey{t, c.shape.head_dim, c.shape.group(), threads > 0 ? threads : cores});
    tune_at_start("bench --kernel", keys);
  }
  Result<std::vector<RooflineRecord>> r = std::vector<RooflineRecord>{};
  if (f.device == Device::kCuda) {
    // The GPU kernel in device memory against a device-to-device copy probe; the same report.
    auto exec = make_cuda_executor();
    if (!exec.is_ok()) return fail(exec.status());
    if (auto info = cuda_device_info(**exec); info.is_ok())
      std::printf("device cuda: %s (sm_%d%d, %.0f GiB); bw_GB/s is a device-to-device copy "
                  "(read + write)\n",
                  info->name.c_str(), info->cc_major, info->cc_minor,
                  static_cast<double>(info->memory_bytes) / (1 << 30));
    r = run_roofline_on(**exec, o);
  } else {
    r = run_roofline(o);
  }
  if (!r.is_ok()) return fail(r.status());
  std::printf("%s", roofline_table(r.value()).c_str());
  if (!f.json.empty()) {
    std::ofstream out(f.json);
    out << roofline_json(r.value()) << "\n";
    if (!out) return fail(invalid_argument("cannot write '" + f.json + "'"));
  }
  return 0;
}

}  // namespace treeattn::cli
