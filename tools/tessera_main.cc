// tessera: inspect, verify, demo and benchmark checkpoints from the command line.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "tools/commands.h"

int main(int argc, char** argv) {
  using namespace tessera::tools;
  CLI::App app{"tessera: distributed checkpoints of sharded tensors"};
  app.require_subcommand(1);

  std::string path;
  bool json = false;
  CLI::App* inspect =
      app.add_subcommand("inspect", "List the tensors, objects and files of a checkpoint");
  inspect->add_option("PATH", path, "checkpoint directory")->required();
  inspect->add_flag("--json", json, "print one JSON document");

  CLI::App* verify = app.add_subcommand(
      "verify", "Re-read every chunk, check checksums and that chunks cover each tensor exactly");
  verify->add_option("PATH", path, "checkpoint directory")->required();

  DemoOptions demo_options;
  std::string size_text = "256MiB";
  bool no_sync = false;
  CLI::App* demo = app.add_subcommand(
      "demo", "Save a synthetic sharded model state, load it under another layout, check it");
  demo->add_option("--out", demo_options.out, "directory for the checkpoint")->required();
  demo->add_option("--size", size_text, "state size, e.g. 256MiB, 1GiB")->capture_default_str();
  demo->add_option("--save-layout", demo_options.save_layout, "layout at save, e.g. tp2,pp1,dp4")
      ->capture_default_str();
  demo->add_option("--load-layout", demo_options.load_layout, "layout at load, e.g. tp4,dp2")
      ->capture_default_str();
  demo->add_option("--ranks", demo_options.ranks,
                   "ranks that save (must equal the save layout's product; default: that product)");
  demo->add_option("--io-threads", demo_options.io_threads, "I/O threads per rank")
      ->capture_default_str();
  demo->add_flag("--no-sync", no_sync, "skip fsync (page-cache speed, no durability)");

  CLI11_PARSE(app, argc, argv);

  if (*inspect) return RunInspect(path, json);
  if (*verify) return RunVerify(path);
  if (*demo) {
    tessera::Result<uint64_t> size = ParseSize(size_text);
    if (!size.ok()) return Fail(size.status());
    demo_options.size_bytes = *size;
    demo_options.sync = !no_sync;
    return RunDemo(demo_options);
  }
  return 2;
}
