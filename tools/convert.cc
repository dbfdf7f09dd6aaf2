// tessera convert SRC DST --to tessera|torch_dist|safetensors: rewrite a checkpoint of any
// format tessera reads in another one (include/tessera/convert.h), with a progress bar on a
// terminal.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/dtype_convert.h"
#include "tessera/convert.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/progress.h"
#include "tools/ranks.h"

namespace tessera::tools {
namespace {

// "bf16", "BF16", "f32", ... -> the dtype; only the float dtypes a conversion can target.
Result<DType> ParseTargetDtype(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  Result<DType> dtype = DTypeFromName(text);
  if (!dtype.ok() || !IsConvertibleFloat(*dtype)) {
    return InvalidArgument("--dtype must be bf16, f16, f32 or f64, not '" + text + "'");
  }
  return *dtype;
}

std::string List(const std::vector<std::string>& names, size_t most) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > most) out += ", ... (" + std::to_string(names.size()) + ")";
  return out;
}

void PrintReport(const ConvertCliOptions& cli, const ConvertReport& report, bool json) {
  if (json) {
    nlohmann::json doc = {{"source", cli.src},
                          {"destination", cli.dst},
                          {"source_format", CheckpointFormatName(report.source_format)},
                          {"format", cli.to},
                          {"tensors", report.tensors},
                          {"objects", report.objects},
                          {"total_bytes", report.total_bytes},
                          {"files", report.files},
                          {"skipped_objects", report.skipped_objects}};
    PrintJson(std::move(doc));
    return;
  }
  std::printf("converted %s (%s) to %s (%s): %llu tensors%s, %s in %zu files\n", cli.src.c_str(),
              CheckpointFormatName(report.source_format), cli.dst.c_str(), cli.to.c_str(),
              static_cast<unsigned long long>(report.tensors),
              report.objects ? (", " + std::to_string(report.objects) + " objects").c_str() : "",
              FormatBytes(report.total_bytes).c_str(), report.files.size());
  if (!report.skipped_objects.empty()) {
    std::printf("not exported: %zu objects (%s files hold only tensors): %s\n",
                report.skipped_objects.size(), cli.to.c_str(),
                List(report.skipped_objects, 10).c_str());
  }
}

}  // namespace

int RunConvert(const ConvertCliOptions& cli) {
  ConvertOptions options;
  Result<CheckpointFormat> to = CheckpointFormatFromName(cli.to);
  if (!to.ok()) return Fail(to.status());
  options.to = *to;
  Result<uint64_t> max_size = ParseSize(cli.max_shard_size);
  if (!max_size.ok()) return Fail(max_size.status());
  options.max_file_bytes = *max_size;
  Result<uint64_t> buffer = ParseSize(cli.buffer);
  if (!buffer.ok()) return Fail(buffer.status());
  options.buffer_bytes = *buffer;
  if (!cli.dtype.empty()) {
    Result<DType> dtype = ParseTargetDtype(cli.dtype);
    if (!dtype.ok()) return Fail(dtype.status());
    options.dtype = *dtype;
  }
  if (options.to == CheckpointFormat::kTorchDist) {
    options.format_options =
        TorchDistOptions{.flavor = cli.torch_dist_flavor == "1.13" ? TorchDistFlavor::kTorch113
                                                                   : TorchDistFlavor::kTorch2};
  }
  // Each --keys prefix must select something: one that selects nothing is a typo.
  if (Status s = CheckEveryPrefixMatches(cli.src, cli.keys, "nothing was converted"); !s.ok()) {
    return Fail(s);
  }
  options.keys = cli.keys;
  options.strip_prefix = cli.strip_prefix;
  options.num_threads = cli.threads;
  options.sync = cli.sync ? SyncPolicy::kFull : SyncPolicy::kNone;
  options.verify_checksums = cli.verify;
  Result<std::unique_ptr<RankRunner>> runner = RankRunner::Create(cli.comm);
  if (!runner.ok()) return Fail(runner.status());
  const bool printer = (*runner)->printer();
  const ProgressMode mode = !printer || cli.json ? ProgressMode::kQuiet
                            : cli.quiet          ? ProgressMode::kQuiet
                            : cli.progress       ? ProgressMode::kForce
                                                 : ProgressMode::kAuto;
  ProgressBar bar("convert", mode);
  const bool draw = bar.active();
  ConvertReport report;
  const int ranks = (*runner)->fixed_size() > 0 ? (*runner)->fixed_size() : cli.ranks;
  const Status status = (*runner)->Run(ranks, [&](Comm& comm, bool) -> Status {
    ConvertOptions mine = options;
    // Rank 0's own bytes: every rank writes about as much (files are spread by size).
    if (comm.rank() == 0 && draw) {
      mine.progress = bar.Callback();
    }
    Result<ConvertReport> converted = Convert(cli.src, cli.dst, mine, comm);
    if (converted.ok() && comm.rank() == 0) report = *converted;
    return converted.status();
  });
  bar.Finish();
  if (!status.ok()) return Fail(status);
  if (printer) PrintReport(cli, report, cli.json);
  return 0;
}

void AddConvertCommand(CLI::App& app, int* exit_code) {
  auto cli = std::make_shared<ConvertCliOptions>();
  auto no_sync = std::make_shared<bool>(false);
  auto no_verify = std::make_shared<bool>(false);
  CLI::App* convert = app.add_subcommand(
      "convert",
      "Rewrite a checkpoint (tessera, PyTorch DCP, Hugging Face safetensors) in another format, "
      "streaming");
  convert->add_option("SRC", cli->src, "checkpoint directory or .safetensors file")->required();
  convert->add_option("DST", cli->dst, "directory to create (absent or empty)")->required();
  convert->add_option("--to", cli->to, "output format: tessera, torch_dist or safetensors")
      ->required()
      ->check(CLI::IsMember({"tessera", "torch_dist", "safetensors"}));
  convert
      ->add_option("--max-shard-size", cli->max_shard_size,
                   "largest output file, e.g. 5GB, 2GiB (one tensor larger gets its own)")
      ->capture_default_str();
  convert->add_option("--keys", cli->keys, "keep only keys starting with these prefixes");
  convert->add_option("--strip-prefix", cli->strip_prefix, "remove this prefix from every key");
  convert->add_option("--dtype", cli->dtype,
                      "write float tensors (f64, f32, f16, bf16) in this dtype: bf16, f16, f32, "
                      "f64 (round to nearest even)");
  convert
      ->add_option("--torch-dist-flavor", cli->torch_dist_flavor,
                   "with --to torch_dist: the torch whose class paths .metadata names (2.x reads "
                   "only 2.x, 1.13 only 1.13)")
      ->check(CLI::IsMember({"2.x", "1.13"}))
      ->capture_default_str();
  convert->add_option("--threads", cli->threads, "threads per rank")->capture_default_str();
  convert->add_option("--buffer", cli->buffer, "memory for the units in flight, per rank")
      ->capture_default_str();
  convert->add_option("--comm", cli->comm, "local (threads of this process) or mpi (mpirun)")
      ->check(CLI::IsMember({"local", "mpi"}))
      ->capture_default_str();
  convert->add_option("--ranks", cli->ranks, "ranks with --comm local (threads)")
      ->capture_default_str();
  convert->add_flag("--progress", cli->progress, "draw a progress bar even when not a terminal");
  convert->add_flag("--quiet", cli->quiet, "no progress bar");
  convert->add_flag("--json", cli->json, "print the report as one JSON document");
  convert->add_flag("--no-sync", *no_sync, "skip fsync (page-cache speed, no durability)");
  convert->add_flag("--no-verify", *no_verify,
                    "do not check the source's checksums (where it has them)");
  convert->callback([=] {
    cli->sync = !*no_sync;
    cli->verify = !*no_verify;
    *exit_code = RunConvert(*cli);
  });
}

}  // namespace tessera::tools
