// treeattn: run, verify and benchmark exact distributed attention decoding.
//
//   treeattn run      a few decode steps on P ranks, checked against the float64 oracle, with
//                     every strategy side by side
//   treeattn verify   exactness over random shapes, shards and dtypes, for every strategy
//   treeattn bench    latency / bytes / memory sweeps over context, ranks, batch and methods
//   treeattn topo     detect or show a topology (docs/topology.md)
//   treeattn plan     predicted cost of every strategy on a topology, the paper-scale sweep,
//                     and predicted vs measured (--validate)
#include <CLI/CLI.hpp>

#include <cstdio>

#include "commands.hpp"

int main(int argc, char** argv) {
  using namespace treeattn::cli;
  Invocation inv;
  for (int i = 1; i < argc; ++i) inv.args.emplace_back(argv[i]);

  CLI::App app{"treeattn: exact attention decoding over a KV cache sharded across ranks "
               "(Tree Attention), with its baselines, an exactness oracle and a cost model"};
  app.require_subcommand(1);
  app.get_formatter()->column_width(34);
  Runner run = add_run_command(app, inv);
  Runner verify = add_verify_command(app, inv);
  Runner bench = add_bench_command(app, inv);
  Runner topo = add_topo_command(app, inv);
  Runner plan = add_plan_command(app, inv);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const std::string name = app.get_subcommands().front()->get_name();
  if (name == "run") return run();
  if (name == "verify") return verify();
  if (name == "bench") return bench();
  if (name == "topo") return topo();
  if (name == "plan") return plan();
  std::fprintf(stderr, "treeattn: unknown subcommand %s\n", name.c_str());
  return 2;
}
