// tessera: inspect, verify, list, compare, prune, convert, demo and benchmark checkpoints from the
// command line.
#include <CLI/CLI.hpp>
#include <new>

#include "core/utf8.h"
#include "tools/commands.h"

// The exit status of a command line that does not parse (README, "Command line").
constexpr int kUsageError = 2;

int main(int argc, char** argv) {
  using namespace tessera::tools;
  CLI::App app{"tessera: distributed checkpoints of sharded tensors"};
  app.require_subcommand(1);
  // A command line that does not parse is one line too, like every other error.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "tessera: error: " + tessera::EscapeControlCharacters(e.what()) +
           " (--help for usage)\n";
  });
  // The project's version (CMake's project(VERSION)), e.g. "tessera 0.1.0".
  app.set_version_flag("--version", std::string("tessera ") + TESSERA_VERSION);
  int exit_code = 0;
  AddInspectCommands(app, &exit_code);
  AddDemoCommand(app, &exit_code);
  AddConvertCommand(app, &exit_code);
  AddLsCommand(app, &exit_code);
  AddDiffCommand(app, &exit_code);
  AddRmKeysCommand(app, &exit_code);
  AddFinalizeCommand(app, &exit_code);
  AddManagerCommands(app, &exit_code);
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that print JSON");
  bench->require_subcommand(1);
  AddBenchPlanCommand(*bench, &exit_code);
  AddBenchReadPlanCommand(*bench, &exit_code);
  AddBenchIoCommand(*bench, &exit_code);
  AddBenchAsyncCommand(*bench, &exit_code);
  AddBenchRankLocalCommand(*bench, &exit_code);
  AddBenchConvertCommand(*bench, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every command line that does not parse exits 2 (the README's
    // usage-error status), not CLI11's own codes (105, 106, ...).
    return app.exit(e) == 0 ? 0 : kUsageError;
  } catch (const std::bad_alloc&) {
    // The library reports errors as statuses; memory exhaustion in a command's own buffers is
    // the one failure that arrives as an exception. A clear error, not an abort.
    return Fail(tessera::Status(tessera::StatusCode::kInternal,
                                "out of memory (a size too large for this machine?)"));
  }
  return exit_code;
}
