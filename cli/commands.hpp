// The subcommands of `treeattn`. Each registers its flags on a CLI11 subcommand and returns a
// callable that runs it (after parsing) and yields the process exit code.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace treeattn::cli {

// The original command line (without argv[0]), for re-execution under mpirun.
struct Invocation {
  std::vector<std::string> args;
};

using Runner = std::function<int()>;

Runner add_run_command(CLI::App& app, const Invocation& inv);
Runner add_bench_command(CLI::App& app, const Invocation& inv);
Runner add_verify_command(CLI::App& app, const Invocation& inv);
// Topology and planning (cmd_topo.cpp, cmd_plan.cpp).
Runner add_topo_command(CLI::App& app, const Invocation& inv);
Runner add_plan_command(CLI::App& app, const Invocation& inv);
// Text generation with a GGUF model over sharded KV caches (cmd_generate.cpp).
Runner add_generate_command(CLI::App& app, const Invocation& inv);
// The OpenAI-compatible HTTP server over the serving engine (cmd_serve.cpp).
Runner add_serve_command(CLI::App& app, const Invocation& inv);
// The kernel tuning of this CPU (cmd_tune.cpp).
Runner add_tune_command(CLI::App& app, const Invocation& inv);

}  // namespace treeattn::cli
