// tessera bench async: how long an AsyncSave blocks the caller, against a plain memcpy of the
// same bytes into already-touched memory measured in the same run, and whether memory grows
// over many saves.
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "tessera/async_save.h"
#include "tessera/local_comm.h"
#include "tools/commands.h"
#include "workload/model_state.h"

namespace tessera::tools {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

uint64_t CurrentRssBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

struct BenchAsyncOptions {
  uint64_t size_bytes = 512ull << 20;
  int ranks = 2;
  int saves = 5;  // timed async saves of the main state
  uint64_t rss_size_bytes = 64ull << 20;
  int rss_saves = 100;  // consecutive saves for the memory-growth figure
  bool sync = false;
  std::string dir;
};

// The slowest rank's value: every rank passes its own, all get the max.
Result<double> MaxOverRanks(Comm& comm, double seconds) {
  std::vector<int64_t> ns = {static_cast<int64_t>(seconds * 1e9)};
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(ns, ReduceOp::kMax));
  return ns[0] / 1e9;
}

int RunBenchAsync(const BenchAsyncOptions& o) {
  Result<std::string> dir = MakeBenchDir(o.dir);
  if (!dir.ok()) return Fail(dir.status());
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(o.size_bytes);
  const workload::ModelConfig small = workload::ModelConfig::ForBytes(o.rss_size_bytes);
  const workload::Layout layout{.tp = o.ranks, .pp = 1, .dp = 1};
  std::mutex mu;
  nlohmann::json out;
  std::vector<double> blocking_samples, total_samples;
  double memcpy_seconds = 0, sync_save_seconds = 0, first_blocking = 0;
  uint64_t held = 0, rss_after_2 = 0, rss_after_all = 0;

  Status status = FirstError(RunLocalRanks(o.ranks, [&](Comm& comm) -> Status {
    workload::RankState state = workload::BuildRankState(config, layout, comm.rank(), true);
    {
      std::lock_guard<std::mutex> lock(mu);
      held += state.bytes;
    }
    // Baseline: memcpy of this rank's bytes into memory touched beforehand, all ranks at once.
    std::vector<std::vector<std::byte>> targets;
    for (const auto& buffer : state.buffers) targets.emplace_back(buffer->size(), std::byte{1});
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    Clock::time_point start = Clock::now();
    for (size_t i = 0; i < targets.size(); ++i) {
      std::memcpy(targets[i].data(), state.buffers[i]->data(), targets[i].size());
    }
    TESSERA_ASSIGN_OR_RETURN(double copy, MaxOverRanks(comm, Since(start)));
    targets.clear();

    AsyncSaveOptions options;
    options.save.sync = o.sync ? SyncPolicy::kFull : SyncPolicy::kNone;
    for (int i = 0; i < o.saves + 1; ++i) {  // save 0 also touches the staging buffers
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      start = Clock::now();
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle,
                               AsyncSave(state.dict, *dir + "/async", comm, options));
      TESSERA_ASSIGN_OR_RETURN(double blocking, MaxOverRanks(comm, Since(start)));
      TESSERA_RETURN_IF_ERROR(handle.Wait());
      TESSERA_ASSIGN_OR_RETURN(double total, MaxOverRanks(comm, Since(start)));
      if (comm.rank() == 0) {
        if (i == 0)
          first_blocking = blocking;
        else
          blocking_samples.push_back(blocking), total_samples.push_back(total);
      }
    }
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    start = Clock::now();
    TESSERA_RETURN_IF_ERROR(Save(state.dict, *dir + "/sync", comm, options.save).status());
    TESSERA_ASSIGN_OR_RETURN(double sync_save, MaxOverRanks(comm, Since(start)));
    if (comm.rank() == 0) memcpy_seconds = copy, sync_save_seconds = sync_save;
    return Status::Ok();
  }));
  if (!status.ok()) return Fail(status);

  // Memory over many consecutive saves of one state (a fresh comm: its own staging pool).
  status = FirstError(RunLocalRanks(o.ranks, [&](Comm& comm) -> Status {
    workload::RankState state = workload::BuildRankState(small, layout, comm.rank(), true);
    AsyncSaveOptions options;
    options.save.sync = SyncPolicy::kNone;
    for (int i = 0; i < o.rss_saves; ++i) {
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle,
                               AsyncSave(state.dict, *dir + "/rss", comm, options));
      TESSERA_RETURN_IF_ERROR(handle.Wait());
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      if (comm.rank() == 0 && i == 1) rss_after_2 = CurrentRssBytes();
    }
    if (comm.rank() == 0) rss_after_all = CurrentRssBytes();
    return Status::Ok();
  }));
  RemoveBenchDir(*dir, o.dir);
  if (!status.ok()) return Fail(status);

  std::sort(blocking_samples.begin(), blocking_samples.end());
  std::sort(total_samples.begin(), total_samples.end());
  const double blocking = blocking_samples[blocking_samples.size() / 2];  // median
  out["bytes"] = held;
  out["ranks"] = o.ranks;
  out["sync"] = o.sync;
  out["memcpy_seconds"] = memcpy_seconds;
  out["blocking_seconds"] = blocking;
  out["blocking_seconds_samples"] = blocking_samples;
  out["first_blocking_seconds"] = first_blocking;
  out["blocking_over_memcpy"] = blocking / memcpy_seconds;
  out["total_seconds"] = total_samples[total_samples.size() / 2];
  out["sync_save_seconds"] = sync_save_seconds;
  out["rss_saves"] = o.rss_saves;
  out["rss_state_bytes"] = small.StateBytes();
  out["rss_after_2_saves_bytes"] = rss_after_2;
  out["rss_after_all_saves_bytes"] = rss_after_all;
  out["rss_growth_after_100_saves_bytes"] =
      static_cast<int64_t>(rss_after_all) - static_cast<int64_t>(rss_after_2);
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace

void AddBenchAsyncCommand(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<BenchAsyncOptions>();
  auto size = std::make_shared<std::string>("512MiB");
  auto rss_size = std::make_shared<std::string>("64MiB");
  auto json = std::make_shared<bool>(true);
  CLI::App* cmd = bench.add_subcommand(
      "async", "Time how long AsyncSave blocks, against memcpy; memory over 100 saves");
  cmd->add_option("--size", *size, "state size")->capture_default_str();
  cmd->add_option("--ranks", o->ranks, "ranks (threads)")->capture_default_str();
  cmd->add_option("--saves", o->saves, "timed async saves")->capture_default_str();
  cmd->add_option("--rss-size", *rss_size, "state size for the memory-growth loop")
      ->capture_default_str();
  cmd->add_option("--rss-saves", o->rss_saves, "saves in the memory-growth loop")
      ->capture_default_str();
  cmd->add_flag("--sync", o->sync, "fsync the timed saves");
  cmd->add_option("--dir", o->dir, "where to write (default: a temp dir, removed after)");
  cmd->add_flag("--json", *json, "print JSON (the only output format)");
  cmd->callback([=] {
    // CLI11 keeps a reference to *json and writes it at parse time: the callback owns it.
    (void)json;
    Result<uint64_t> bytes = ParseSize(*size);
    Result<uint64_t> rss_bytes = ParseSize(*rss_size);
    if (!bytes.ok()) return void(*exit_code = Fail(bytes.status()));
    if (!rss_bytes.ok()) return void(*exit_code = Fail(rss_bytes.status()));
    o->size_bytes = *bytes;
    o->rss_size_bytes = *rss_bytes;
    *exit_code = RunBenchAsync(*o);
  });
}

}  // namespace tessera::tools
