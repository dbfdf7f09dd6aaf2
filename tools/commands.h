// The tessera command-line tool's subcommands. Each returns the process exit code and prints
// errors as one line: "tessera: error: <what went wrong>".
#ifndef TESSERA_TOOLS_COMMANDS_H_
#define TESSERA_TOOLS_COMMANDS_H_

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tessera/status.h"
#include "tools/progress.h"

namespace tessera::tools {

int Fail(const Status& status);

// OK when every prefix in `prefixes` begins some key of the checkpoint at `path`; else NotFound
// naming the first that does not, with the closest keys and prefixes ("did you mean ...") and
// `consequence` ("nothing was removed"). Prefixes that are not UTF-8, and a checkpoint that
// cannot be read, are left to the command (which refuses them with its own error): OK.
Status CheckEveryPrefixMatches(const std::string& path, const std::vector<std::string>& prefixes,
                               const std::string& consequence);

// Each Add*Command adds a subcommand to `parent`; when it is chosen, its callback stores the
// process exit code in *exit_code.
void AddInspectCommands(CLI::App& app, int* exit_code);  // inspect, verify
void AddDemoCommand(CLI::App& app, int* exit_code);
void AddConvertCommand(CLI::App& app, int* exit_code);
void AddBenchConvertCommand(CLI::App& bench, int* exit_code);    // tessera bench convert
void AddBenchPlanCommand(CLI::App& bench, int* exit_code);       // tessera bench plan
void AddBenchReadPlanCommand(CLI::App& bench, int* exit_code);   // tessera bench read-plan
void AddBenchIoCommand(CLI::App& bench, int* exit_code);         // tessera bench io
void AddBenchAsyncCommand(CLI::App& bench, int* exit_code);      // tessera bench async
void AddBenchRankLocalCommand(CLI::App& bench, int* exit_code);  // tessera bench rank-local

struct InspectOptions {
  std::string path;
  bool json = false;
  std::vector<std::string> keys;  // globs; empty: every key
  bool tree = false;
  int depth = 0;  // --tree levels; 0: all
  bool files = false;
};
int RunInspect(const InspectOptions& options);
int RunVerify(const std::string& path, int threads, ProgressMode progress);
void AddLsCommand(CLI::App& app, int* exit_code);        // tessera ls
void AddDiffCommand(CLI::App& app, int* exit_code);      // tessera diff
void AddRmKeysCommand(CLI::App& app, int* exit_code);    // tessera rm-keys
void AddFinalizeCommand(CLI::App& app, int* exit_code);  // tessera finalize
void AddManagerCommands(CLI::App& app, int* exit_code);  // tessera latest, tessera prune

struct DemoOptions {
  std::string out;
  uint64_t size_bytes = 256ull << 20;
  std::string save_layout = "tp2,dp2";
  std::string load_layout = "tp4,dp1";
  int ranks = 0;  // 0: the save layout's product
  int io_threads = 2;
  bool sync = true;
  std::string share_reads = "auto";  // auto | readonce | none | broadcast | allgather
  std::string comm = "local";            // local | mpi
  ProgressMode progress = ProgressMode::kAuto;
  bool rank_local = false;  // SaveOptions::collective false
};
int RunDemo(const DemoOptions& options);

struct ConvertCliOptions {
  std::string src, dst;
  std::string to;  // tessera | torch_dist | safetensors
  std::string max_shard_size = "5GB";
  std::vector<std::string> keys;
  std::string strip_prefix;
  std::string dtype;                      // empty: keep
  std::string torch_dist_flavor = "2.x";  // with --to torch_dist: 2.x | 1.13
  int threads = 4;
  std::string buffer = "256MiB";
  std::string comm = "local";
  int ranks = 1;          // with --comm local
  bool progress = false;  // draw even when stderr is not a terminal
  bool quiet = false;
  bool json = false;
  bool sync = true;
  bool verify = true;
};
int RunConvert(const ConvertCliOptions& options);

// A directory for a benchmark's files: `requested` if not empty (created), else a fresh
// temporary directory. RemoveBenchDir removes it only if it was temporary.
Result<std::string> MakeBenchDir(const std::string& requested);
void RemoveBenchDir(const std::string& dir, const std::string& requested);

// "256MiB", "1GiB", "1000000", "1.5GB" -> bytes. InvalidArgument for text that is not a size
// or a size of 2^64 bytes or more.
Result<uint64_t> ParseSize(const std::string& text);
// InvalidArgument naming `what` when `bytes` exceed the machine's physical memory: a request
// that cannot be met fails with a clear error instead of std::bad_alloc.
Status CheckFitsInMemory(uint64_t bytes, const std::string& what);
// "268.4 MB" style, decimal units.
std::string FormatBytes(uint64_t bytes);

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_COMMANDS_H_
