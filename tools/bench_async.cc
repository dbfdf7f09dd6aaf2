// tessera bench async: how long an AsyncSave blocks the caller, against a plain memcpy of the
// same bytes into already-touched memory measured in the same run, with staging during the call
// (kBlocking) and deferred behind a compute loop of the caller's (kDeferred); and whether memory
// grows over many saves. The peak of resident memory during the blocking saves, above what the
// process held before them, is the staging's (AsyncSaveOptions::staging_budget_bytes bounds it).
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "tessera/async_save.h"
#include "tessera/local_comm.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/memory.h"
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
  int staging_threads = AsyncSaveOptions().staging_threads;
  uint64_t staging_budget_bytes = 0;  // AsyncSaveOptions::staging_budget_bytes
  std::string dir;
};

// The slowest rank's value: every rank passes its own, all get the max.
Result<double> MaxOverRanks(Comm& comm, double seconds) {
  std::vector<int64_t> ns = {static_cast<int64_t>(seconds * 1e9)};
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(ns, ReduceOp::kMax));
  return ns[0] / 1e9;
}

// The caller's own work while a deferred save stages: arithmetic over a buffer of its own (the
// same cores as the copy threads), in slices, polling the handle between slices.
class ComputeLoop {
 public:
  ComputeLoop() : buffer_(kElements, 1.0f) {}
  // One slice; returns the elements processed.
  uint64_t Slice() {
    for (size_t i = begin_; i < begin_ + kSlice; ++i) buffer_[i] = buffer_[i] * 0.999f + 0.5f;
    begin_ = (begin_ + kSlice) % kElements;
    return kSlice;
  }
  // Runs until `handle` is staged (one slice at least); returns the elements processed.
  uint64_t RunUntilStaged(const AsyncSaveHandle& handle) {
    uint64_t elements = 0;
    do {
      elements += Slice();
    } while (!handle.Staged());
    return elements;
  }
  // Elements per second with nothing else running on this rank.
  double RateAlone(double seconds) {
    uint64_t elements = 0;
    const Clock::time_point start = Clock::now();
    while (Since(start) < seconds) elements += Slice();
    return elements / Since(start);
  }

 private:
  static constexpr size_t kElements = 4 << 20;  // 16 MiB of floats: beyond the caches
  static constexpr size_t kSlice = 16 << 10;    // ~10 us
  std::vector<float> buffer_;
  size_t begin_ = 0;
};

double Median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// Deferred saves of `state`: how long the call blocks, and how long until staged while the
// caller computes. Fills the samples (slowest rank, rank 0 only) after a first save that also
// touches fresh staging buffers.
Status TimeDeferredSaves(Comm& comm, const StateDict& state, const std::string& path, int saves,
                         const AsyncSaveOptions& base, std::vector<double>& blocking_samples,
                         std::vector<double>& staged_samples, double& compute_slowdown) {
  AsyncSaveOptions options = base;
  options.staging = StagingMode::kDeferred;
  ComputeLoop compute;
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  const double rate_alone = compute.RateAlone(0.05);  // every rank at once, as below
  std::vector<double> rates;
  for (int i = 0; i < saves + 1; ++i) {
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    const Clock::time_point start = Clock::now();
    TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle, AsyncSave(state, path, comm, options));
    const double blocking_local = Since(start);
    const uint64_t elements = compute.RunUntilStaged(handle);
    TESSERA_RETURN_IF_ERROR(handle.WaitStaged());
    const double staged_local = Since(start);
    TESSERA_RETURN_IF_ERROR(handle.Wait());
    TESSERA_ASSIGN_OR_RETURN(double blocking, MaxOverRanks(comm, blocking_local));
    TESSERA_ASSIGN_OR_RETURN(double staged, MaxOverRanks(comm, staged_local));
    if (comm.rank() == 0 && i > 0) {
      blocking_samples.push_back(blocking);
      staged_samples.push_back(staged);
      rates.push_back(elements / std::max(staged_local - blocking_local, 1e-9));
    }
  }
  if (comm.rank() == 0) compute_slowdown = rate_alone / Median(rates);
  return Status::Ok();
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
  std::vector<double> deferred_blocking_samples, deferred_staged_samples;
  double memcpy_seconds = 0, sync_save_seconds = 0, first_blocking = 0, compute_slowdown = 0;
  uint64_t held = 0, rss_after_2 = 0, rss_after_all = 0;
  uint64_t rss_before_saves = 0, peak_during_saves = 0;
  bool peak_tracked = false;

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
    options.staging_threads = o.staging_threads;
    options.staging_budget_bytes = o.staging_budget_bytes;
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    if (comm.rank() == 0) {  // the baseline's copies are freed: the peak from here is the saves'
      peak_tracked = ResetPeakRss();
      rss_before_saves = ProcStatusBytes("VmRSS");
    }
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
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
    if (comm.rank() == 0) peak_during_saves = ProcStatusBytes("VmHWM");
    TESSERA_RETURN_IF_ERROR(TimeDeferredSaves(comm, state.dict, *dir + "/async", o.saves, options,
                                              deferred_blocking_samples, deferred_staged_samples,
                                              compute_slowdown));
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
    options.staging = StagingMode::kDeferred;
    options.staging_threads = o.staging_threads;
    for (int i = 0; i < o.rss_saves; ++i) {
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle,
                               AsyncSave(state.dict, *dir + "/rss", comm, options));
      TESSERA_RETURN_IF_ERROR(handle.WaitStaged());
      TESSERA_RETURN_IF_ERROR(handle.Wait());
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      if (comm.rank() == 0 && i == 1) rss_after_2 = CurrentRssBytes();
    }
    if (comm.rank() == 0) rss_after_all = CurrentRssBytes();
    return Status::Ok();
  }));
  RemoveBenchDir(*dir, o.dir);
  if (!status.ok()) return Fail(status);

  const double blocking = Median(blocking_samples);
  const double deferred_blocking = Median(deferred_blocking_samples);
  const double deferred_staged = Median(deferred_staged_samples);
  out["bytes"] = held;
  out["ranks"] = o.ranks;
  out["sync"] = o.sync;
  out["staging_threads"] = o.staging_threads;
  out["staging_budget_bytes"] = o.staging_budget_bytes;
  // Every rank's staging together (the ranks are threads of this process); null where the
  // kernel cannot reset the peak (/proc/self/clear_refs).
  if (peak_tracked) {
    const uint64_t above =
        peak_during_saves > rss_before_saves ? peak_during_saves - rss_before_saves : 0;
    out["staging_peak_rss_bytes"] = above;
    out["staging_peak_rss_over_state"] = static_cast<double>(above) / held;
  } else {
    out["staging_peak_rss_bytes"] = nullptr;
  }
  out["memcpy_seconds"] = memcpy_seconds;
  out["blocking_seconds"] = blocking;
  out["blocking_seconds_samples"] = blocking_samples;
  out["first_blocking_seconds"] = first_blocking;
  out["blocking_over_memcpy"] = blocking / memcpy_seconds;
  out["deferred_blocking_seconds"] = deferred_blocking;
  out["deferred_blocking_seconds_samples"] = deferred_blocking_samples;
  out["deferred_blocking_over_memcpy"] = deferred_blocking / memcpy_seconds;
  out["deferred_staged_seconds"] = deferred_staged;
  out["deferred_staged_seconds_samples"] = deferred_staged_samples;
  out["deferred_staged_over_memcpy"] = deferred_staged / memcpy_seconds;
  out["deferred_compute_slowdown"] = compute_slowdown;
  out["total_seconds"] = Median(total_samples);
  out["sync_save_seconds"] = sync_save_seconds;
  out["rss_saves"] = o.rss_saves;
  out["rss_state_bytes"] = small.StateBytes();
  out["rss_after_2_saves_bytes"] = rss_after_2;
  out["rss_after_all_saves_bytes"] = rss_after_all;
  out["rss_growth_after_100_saves_bytes"] =
      static_cast<int64_t>(rss_after_all) - static_cast<int64_t>(rss_after_2);
  PrintJson(std::move(out));
  return 0;
}

}  // namespace

void AddBenchAsyncCommand(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<BenchAsyncOptions>();
  auto size = std::make_shared<std::string>("512MiB");
  auto rss_size = std::make_shared<std::string>("64MiB");
  auto json = std::make_shared<bool>(true);
  CLI::App* cmd = bench.add_subcommand(
      "async",
      "Time how long AsyncSave blocks (staging during the call, and deferred behind compute), "
      "against memcpy; memory over 100 saves");
  cmd->add_option("--size", *size, "state size")->capture_default_str();
  cmd->add_option("--ranks", o->ranks, "ranks (threads)")->capture_default_str();
  cmd->add_option("--saves", o->saves, "timed async saves")->capture_default_str();
  cmd->add_option("--rss-size", *rss_size, "state size for the memory-growth loop")
      ->capture_default_str();
  cmd->add_option("--rss-saves", o->rss_saves, "saves in the memory-growth loop")
      ->capture_default_str();
  cmd->add_flag("--sync", o->sync, "fsync the timed saves");
  cmd->add_option("--staging-threads", o->staging_threads, "AsyncSaveOptions::staging_threads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  auto budget = std::make_shared<std::string>("0");
  cmd->add_option("--staging-budget", *budget,
                  "AsyncSaveOptions::staging_budget_bytes per rank (e.g. 64MiB; 0: none)")
      ->capture_default_str();
  cmd->add_option("--dir", o->dir, "where to write (default: a temp dir, removed after)");
  cmd->add_flag("--json", *json, "print JSON (the only output format)");
  cmd->callback([=] {
    // CLI11 keeps a reference to *json and writes it at parse time: the callback owns it.
    (void)json;
    Result<uint64_t> bytes = ParseSize(*size);
    Result<uint64_t> rss_bytes = ParseSize(*rss_size);
    if (!bytes.ok()) return void(*exit_code = Fail(bytes.status()));
    if (!rss_bytes.ok()) return void(*exit_code = Fail(rss_bytes.status()));
    Result<uint64_t> budget_bytes = ParseSize(*budget);
    if (!budget_bytes.ok()) return void(*exit_code = Fail(budget_bytes.status()));
    o->staging_budget_bytes = *budget_bytes;
    o->size_bytes = *bytes;
    o->rss_size_bytes = *rss_bytes;
    *exit_code = RunBenchAsync(*o);
  });
}

}  // namespace tessera::tools
