// treeattn: run, verify and benchmark exact distributed attention decoding.
//
//   treeattn run      a few decode steps on P ranks, checked against the float64 oracle, with
//                     every strategy side by side
//   treeattn verify   exactness over random shapes, shards and dtypes, for every strategy
//   treeattn bench    latency / bytes / memory sweeps over context, ranks, batch and methods
//   treeattn topo     detect or show a topology (docs/topology.md)
//   treeattn plan     predicted cost of every strategy on a topology, the paper-scale sweep,
//                     and predicted vs measured (--validate)
//   treeattn generate text generation with a GGUF model over a sharded KV cache
//   treeattn serve    an OpenAI-compatible HTTP server over the serving engine
//   treeattn tune     calibrate the CPU kernels' bit-neutral choices on this CPU and cache them
//
// Every subcommand reports its errors as one line and exit code 2; an exception that escapes
// one (std::bad_alloc for a shape that passed the memory pre-check, a filesystem error) is
// turned into such a line here, and inside an MPI job it ends the job so that no rank waits
// for the one that failed.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>

#include "commands.hpp"
#include "options.hpp"
#include "treeattn/comm_mpi.hpp"
#include "treeattn/job_status.hpp"

namespace {

std::string rank_label() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0')
      return std::string("rank ") + v + ": ";
  return "";
}

int report_exception(const std::string& cmd, const std::string& what) {
  const std::string line = "treeattn " + cmd + ": " + rank_label() + "error: " + what;
  if (treeattn::mpi_active()) treeattn::launch::abort_job(2, line);  // the others must not wait
  std::fprintf(stderr, "%s\n", line.c_str());
  return 2;
}

#ifdef TREEATTN_CLI_NO_MODEL_COMMANDS
// A subcommand this build left out (TREEATTN_CLI_MODEL_COMMANDS=OFF, tools/build.sh --main-job):
// any arguments, and one line saying how to build it.
treeattn::cli::Runner add_unbuilt_command(CLI::App& app, const char* name) {
  CLI::App* sub = app.add_subcommand(name, std::string("(not in this build: tools/build.sh builds it)"));
  sub->prefix_command();  // every argument after the name is taken, none checked
  const std::string cmd = name;
  return [cmd] {
    std::fprintf(stderr,
                 "treeattn %s: this treeattn was built without the model commands (tools/quickstart.sh "
                 "builds only what `treeattn run` needs: tools/build.sh --main-job); run "
                 "tools/build.sh (or tools/test.sh) to build `%s`\n",
                 cmd.c_str(), cmd.c_str());
    return 2;
  };
}
#endif

}  // namespace

int main(int argc, char** argv) {
  using namespace treeattn::cli;
  treeattn::launch::rank_status_open();
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
  Runner tune = add_tune_command(app, inv);
#ifndef TREEATTN_CLI_NO_MODEL_COMMANDS
  Runner generate = add_generate_command(app, inv);
  Runner serve = add_serve_command(app, inv);
#else
  Runner generate = add_unbuilt_command(app, "generate");
  Runner serve = add_unbuilt_command(app, "serve");
#endif
  require_decimal_integers(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    treeattn::launch::rank_status_returned(rc);
    return rc;
  }
  const std::string name = app.get_subcommands().front()->get_name();
  int rc = 2;
  try {
    if (name == "run") rc = run();
    else if (name == "verify") rc = verify();
    else if (name == "bench") rc = bench();
    else if (name == "topo") rc = topo();
    else if (name == "plan") rc = plan();
    else if (name == "generate") rc = generate();
    else if (name == "serve") rc = serve();
    else if (name == "tune") rc = tune();
    else std::fprintf(stderr, "treeattn: unknown subcommand %s\n", name.c_str());
  } catch (const std::bad_alloc&) {
    rc = report_exception(name, "out of memory (an allocation failed: a smaller --seq, --batch, "
                                "--heads or --q-len, or more ranks, would fit)");
  } catch (const std::exception& e) {
    rc = report_exception(name, e.what());
  }
  treeattn::launch::rank_status_returned(rc);
  return rc;
}
