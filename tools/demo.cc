// tessera demo: the main job in one command. Builds a synthetic model state sharded under one
// layout, saves it with R ranks (threads of this process, talking through LocalComm), loads it
// under another layout, and checks every element.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>

#include "tessera/checkpoint.h"
#include "tessera/local_comm.h"
#include "tools/commands.h"
#include "tools/progress.h"
#include "tools/ranks.h"
#include "workload/model_state.h"

namespace tessera::tools {

using namespace ::tessera::workload;
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

int RunDemo(const DemoOptions& options) {
  Result<Layout> save_layout = ParseLayout(options.save_layout);
  if (!save_layout.ok()) return Fail(save_layout.status());
  Result<Layout> load_layout = ParseLayout(options.load_layout);
  if (!load_layout.ok()) return Fail(load_layout.status());
  if (options.ranks != 0 && options.ranks != save_layout->ranks()) {
    return Fail(InvalidArgument("--ranks " + std::to_string(options.ranks) +
                                " does not match --save-layout " + options.save_layout + " (" +
                                std::to_string(save_layout->ranks()) + " ranks)"));
  }
  const ModelConfig config = ModelConfig::ForBytes(options.size_bytes);
  // The ranks of this process hold the whole state at least once, in memory.
  if (Status fits = CheckFitsInMemory(std::max(options.size_bytes, config.StateBytes()),
                                      "demo --size: the state, held in memory,");
      !fits.ok()) {
    return Fail(fits);
  }
  Result<std::unique_ptr<RankRunner>> runner = RankRunner::Create(options.comm);
  if (!runner.ok()) return Fail(runner.status());
  const bool print = (*runner)->printer();
  if (print) {
    std::printf(
        "model: hidden %lld, ffn %lld, vocab %lld, %lld layers; state %s (BF16 params "
        "+ F32 Adam moments)\n",
        static_cast<long long>(config.hidden), static_cast<long long>(config.ffn),
        static_cast<long long>(config.vocab), static_cast<long long>(config.layers),
        FormatBytes(config.StateBytes()).c_str());
  }

  SaveOptions save_options;
  save_options.num_io_threads = options.io_threads;
  save_options.sync = options.sync ? SyncPolicy::kFull : SyncPolicy::kNone;
  save_options.user_metadata = {{"producer", "tessera demo"}, {"layout", save_layout->ToString()}};
  // With --rank-local each save is tagged; every rank takes the ranks' latest clock reading before
  // the save (a message of the demo's, not of the save), so MPI processes agree on the tag.
  save_options.collective = !options.rank_local;

  // Sums over ranks, computed with an all-reduce so that MPI runs print totals too.
  auto sum = [](Comm& comm, std::vector<int64_t> values) -> Result<std::vector<int64_t>> {
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(values, ReduceOp::kSum));
    return values;
  };

  // Save with the save layout.
  uint64_t held_bytes = 0, total_bytes = 0;
  double save_seconds = 0;
  // Progress: the sum over the ranks of this process (all of them with threads; with MPI,
  // the printing process shows its own rank).
  const int local_ranks = options.comm == "mpi" ? 1 : save_layout->ranks();
  ProgressBar save_bar(options.comm == "mpi" ? "save (rank 0)" : "save",
                       print ? options.progress : ProgressMode::kQuiet);
  Status saved = (*runner)->Run(save_layout->ranks(), [&](Comm& comm, bool active) -> Status {
    RankState state;
    if (active) state = BuildRankState(config, *save_layout, comm.rank(), /*fill=*/true);
    SaveOptions rank_options = save_options;
    if (options.rank_local) {
      std::vector<int64_t> now_ms = {std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::system_clock::now().time_since_epoch())
                                         .count()};
      TESSERA_RETURN_IF_ERROR(comm.AllReduce(now_ms, ReduceOp::kMax));
      rank_options.save_tag = "demo-" + std::to_string(now_ms[0]);
    }
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    Clock::time_point start = Clock::now();
    if (save_bar.active()) {
      rank_options.progress =
          save_bar.RankCallback(local_ranks == 1 ? 0 : comm.rank(), local_ranks);
    }
    TESSERA_ASSIGN_OR_RETURN(SaveReport report, Save(state.dict, options.out, comm, rank_options));
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    const double seconds = Seconds(start, Clock::now());
    // A rank-local save reports each rank's own bytes: the total is their sum.
    TESSERA_ASSIGN_OR_RETURN(
        std::vector<int64_t> totals,
        sum(comm, {static_cast<int64_t>(state.bytes), static_cast<int64_t>(report.total_bytes)}));
    if (comm.rank() == 0) {
      save_seconds = seconds;
      total_bytes = options.rank_local ? totals[1] : report.total_bytes;
      held_bytes = totals[0];
    }
    return Status::Ok();
  });
  save_bar.Finish();
  if (!saved.ok()) return Fail(saved.WithContext("save"));
  Result<Metadata> metadata = ReadMetadata(options.out);
  if (!metadata.ok()) return Fail(metadata.status());
  if (print) {
    std::printf(
        "save: %d ranks (%s) held %s, wrote %s once (replicas deduplicated) in %zu "
        "files, %llu chunks, %.3f s, %.2f GB/s%s%s\n",
        save_layout->ranks(), save_layout->ToString().c_str(), FormatBytes(held_bytes).c_str(),
        FormatBytes(total_bytes).c_str(), metadata->files.size(),
        static_cast<unsigned long long>(metadata->TotalChunks()), save_seconds,
        total_bytes / save_seconds / 1e9, options.sync ? " (fsync'ed)" : " (page cache, no fsync)",
        options.rank_local ? ", rank-local (no collective; one manifest per rank)" : "");
  }

  // Load with the load layout, into zeroed buffers, and check every element.
  LoadOptions load_options;
  load_options.num_io_threads = options.io_threads;
  if (options.share_reads == "none") load_options.read_sharing = ReadSharing::kNone;
  if (options.share_reads == "broadcast") load_options.read_sharing = ReadSharing::kBroadcast;
  if (options.share_reads == "allgather") load_options.read_sharing = ReadSharing::kAllGather;
  if (options.share_reads == "readonce") load_options.read_sharing = ReadSharing::kReadOnce;
  if (options.share_reads == "auto") load_options.read_sharing = ReadSharing::kAuto;
  uint64_t read_bytes = 0, needed_bytes = 0, received_bytes = 0, union_bytes = 0,
           checkpoint_bytes = 0;
  ReadSharing sharing_used = ReadSharing::kNone;
  double load_seconds = 0;
  const int local_load_ranks = options.comm == "mpi" ? 1 : load_layout->ranks();
  ProgressBar load_bar(options.comm == "mpi" ? "load (rank 0)" : "load",
                       print ? options.progress : ProgressMode::kQuiet);
  Status loaded = (*runner)->Run(load_layout->ranks(), [&](Comm& comm, bool active) -> Status {
    RankState state;
    if (active) state = BuildRankState(config, *load_layout, comm.rank(), /*fill=*/false);
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    Clock::time_point start = Clock::now();
    LoadOptions rank_options = load_options;
    if (load_bar.active()) {
      rank_options.progress =
          load_bar.RankCallback(local_load_ranks == 1 ? 0 : comm.rank(), local_load_ranks);
    }
    TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(state.dict, options.out, comm, rank_options));
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    const double seconds = Seconds(start, Clock::now());
    TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> totals,
                             sum(comm, {static_cast<int64_t>(report.bytes_read),
                                        static_cast<int64_t>(report.bytes_needed),
                                        static_cast<int64_t>(report.bytes_received)}));
    if (comm.rank() == 0) {
      load_seconds = seconds;
      read_bytes = totals[0], needed_bytes = totals[1], received_bytes = totals[2];
      union_bytes = report.job_bytes_needed;
      checkpoint_bytes = report.checkpoint_bytes;
      sharing_used = report.read_sharing;
    }
    return AgreeOnStatus(comm,
                         CheckRankState(state).WithContext("rank " + std::to_string(comm.rank())));
  });
  load_bar.Finish();
  if (!loaded.ok()) return Fail(loaded.WithContext("load"));
  if (print) {
    std::printf("load: %d ranks (%s) needed %s, read %s from storage%s, %.3f s, %.2f GB/s\n",
                load_layout->ranks(), load_layout->ToString().c_str(),
                FormatBytes(needed_bytes).c_str(), FormatBytes(read_bytes).c_str(),
                received_bytes == 0 ? ""
                                    : (" and " + FormatBytes(received_bytes) +
                                       " from other ranks (" + options.share_reads + ")")
                                          .c_str(),
                load_seconds, needed_bytes / load_seconds / 1e9);
    if (union_bytes > 0) {
      std::printf(
          "storage bytes %.3fx the union of what the ranks needed (%s), %.3fx the "
          "checkpoint (%s)%s\n",
          static_cast<double>(read_bytes) / union_bytes, FormatBytes(union_bytes).c_str(),
          static_cast<double>(read_bytes) / checkpoint_bytes, FormatBytes(checkpoint_bytes).c_str(),
          sharing_used == ReadSharing::kReadOnce ? ": each block read once in the job"
          : options.share_reads == "auto"
              ? ": each rank read its own (--share-reads auto on a local "
                "filesystem, where re-reading beats sending; readonce forces it)"
              : "");
    }
    std::printf(
        "verified: every element of the %s layout matches the state saved under %s "
        "(bit-exact), checkpoint in %s\n",
        load_layout->ToString().c_str(), save_layout->ToString().c_str(), options.out.c_str());
  }
  return 0;
}

void AddDemoCommand(CLI::App& app, int* exit_code) {
  auto options = std::make_shared<DemoOptions>();
  auto size_text = std::make_shared<std::string>("256MiB");
  auto no_sync = std::make_shared<bool>(false);
  CLI::App* demo = app.add_subcommand(
      "demo", "Save a synthetic sharded model state, load it under another layout, check it");
  demo->add_option("--out", options->out, "directory for the checkpoint")->required();
  demo->add_option("--size", *size_text, "state size, e.g. 256MiB, 1GiB")->capture_default_str();
  demo->add_option("--save-layout", options->save_layout, "layout at save, e.g. tp2,pp1,dp4")
      ->capture_default_str();
  demo->add_option("--load-layout", options->load_layout, "layout at load, e.g. tp4,dp2")
      ->capture_default_str();
  demo->add_option("--ranks", options->ranks,
                   "ranks that save (must equal the save layout's product; default: that product)");
  demo->add_option("--io-threads", options->io_threads, "I/O threads per rank")
      ->capture_default_str();
  demo->add_flag("--no-sync", *no_sync, "skip fsync (page-cache speed, no durability)");
  demo->add_flag("--rank-local", options->rank_local,
                 "save with no collective: every rank commits a manifest of its own part "
                 "(SaveOptions::collective false); the load merges them");
  demo->add_option("--comm", options->comm, "local (threads of this process) or mpi (mpirun)")
      ->check(CLI::IsMember({"local", "mpi"}))
      ->capture_default_str();
  demo->add_option("--share-reads", options->share_reads,
                   "how ranks share reads: auto (readonce, but none on a local filesystem), "
                   "readonce (the job reads each block once and ranks exchange what others "
                   "need), none (each rank reads its own), broadcast or allgather (within "
                   "groups of replicas only)")
      ->check(CLI::IsMember({"auto", "readonce", "none", "broadcast", "allgather"}))
      ->capture_default_str();
  auto progress = std::make_shared<ProgressFlags>();
  AddProgressFlags(*demo, *progress);
  demo->callback([=] {
    options->progress = progress->Mode();
    Result<uint64_t> size = ParseSize(*size_text);
    if (!size.ok()) {
      *exit_code = Fail(size.status());
      return;
    }
    options->size_bytes = *size;
    options->sync = !*no_sync;
    *exit_code = RunDemo(*options);
  });
}

}  // namespace tessera::tools
