// treeattn_roofline: prints the kernel roofline table (bandwidth probe, FMA probe, kernel and
// OpenBLAS peer timings) until the CLI exposes it as `treeattn bench --kernel`.
//
//   treeattn_roofline [--dtype f32,bf16,f16,fp8,int8] [--threads 0,1] [--repeats 5] [--isa auto]
//                     [--seq N] [--batch B] [--q-len Q] [--chunk N] [--probe-mib 1024]
//                     [--no-peer] [--json FILE]
// --seq/--batch/--q-len replace the default cases with one llama3-8b-shaped case.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "treeattn/roofline.hpp"

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i <= s.size()) {
    const std::size_t j = s.find(',', i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

int usage(const char* msg) {
  std::fprintf(stderr, "treeattn_roofline: %s\n", msg);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace treeattn;
  RooflineOptions opt;
  std::string json;
  int64_t seq = 0, batch = 1, q_len = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--dtype") {
      opt.dtypes.clear();
      for (const std::string& d : split(next())) {
        const auto t = parse_dtype(d);
        if (!t) return usage(("unknown dtype '" + d + "' (f32, f16, bf16, fp8, int8)").c_str());
        opt.dtypes.push_back(*t);
      }
    } else if (a == "--threads") {
      opt.threads.clear();
      for (const std::string& t : split(next())) opt.threads.push_back(std::atoi(t.c_str()));
    } else if (a == "--repeats") {
      opt.repeats = std::atoi(next().c_str());
    } else if (a == "--isa") {
      const Result<Isa> isa = parse_isa(next());
      if (!isa.is_ok()) return usage(isa.status().message().c_str());
      opt.isa = isa.value();
    } else if (a == "--seq") {
      seq = std::atoll(next().c_str());
    } else if (a == "--batch") {
      batch = std::atoll(next().c_str());
    } else if (a == "--q-len") {
      q_len = std::atoll(next().c_str());
    } else if (a == "--chunk") {
      opt.chunk_tokens = std::atoll(next().c_str());
    } else if (a == "--probe-mib") {
      opt.probe_bytes = std::atoll(next().c_str()) << 20;
    } else if (a == "--no-peer") {
      opt.peer = false;
    } else if (a == "--json") {
      json = next();
    } else {
      return usage(("unknown option '" + std::string(a) + "'").c_str());
    }
  }
  if (seq > 0) opt.cases = {RooflineCase{AttnShape{batch, 32, 8, 128, q_len}, seq}};
  const Result<std::vector<RooflineRecord>> r = run_roofline(opt);
  if (!r.is_ok()) {
    std::fprintf(stderr, "treeattn_roofline: %s\n", r.status().to_string().c_str());
    return 1;
  }
  std::fputs(roofline_table(r.value()).c_str(), stdout);
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) return usage(("cannot write " + json).c_str());
    std::fputs(roofline_json(r.value()).c_str(), f);
    std::fclose(f);
  }
  return 0;
}
