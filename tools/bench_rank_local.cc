// tessera bench rank-local: a rank-local save (SaveOptions::collective false: no message between
// ranks) against the collective save of the same state, in the same run, alternating, on the
// ranks of the chosen communicator; and what reading the index of each costs afterwards (the
// merge of every rank's manifest against one manifest).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "tessera/checkpoint.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/ranks.h"
#include "workload/model_state.h"

namespace tessera::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchRankLocalOptions {
  uint64_t size_bytes = 256ull << 20;
  std::string layout = "tp2,dp4";
  int repeat = 5;
  bool sync = false;
  std::string comm = "local";
  std::string dir;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The slowest rank's seconds for fn, started together after a barrier. COLLECTIVE.
Result<double> TimeOnEveryRank(Comm& comm, const std::function<Status()>& fn) {
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  const Clock::time_point start = Clock::now();
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, fn()));
  std::vector<int64_t> ns = {
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()};
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(ns, ReduceOp::kMax));
  return ns[0] / 1e9;
}

struct Timings {
  std::vector<double> collective, collective_uncached, rank_local;
  std::vector<double> read_collective, read_rank_local;
};

// One round: a collective save (plan cache as configured), a rank-local save, and the index
// read of each from rank 0. Each into a directory of its own, removed after.
Status Round(Comm& comm, const workload::RankState& state, const std::string& dir, int round,
             const SaveOptions& base, Timings& t) {
  SaveOptions cached = base;
  SaveOptions uncached = base;
  uncached.plan_cache = false;
  SaveOptions local = base;
  local.collective = false;
  local.save_tag = "bench-" + std::to_string(round);
  const std::string c_dir = dir + "/c" + std::to_string(round);
  const std::string u_dir = dir + "/u" + std::to_string(round);
  const std::string r_dir = dir + "/r" + std::to_string(round);
  TESSERA_ASSIGN_OR_RETURN(double c, TimeOnEveryRank(comm, [&] {
                             return Save(state.dict, c_dir, comm, cached).status();
                           }));
  TESSERA_ASSIGN_OR_RETURN(double u, TimeOnEveryRank(comm, [&] {
                             return Save(state.dict, u_dir, comm, uncached).status();
                           }));
  TESSERA_ASSIGN_OR_RETURN(double r, TimeOnEveryRank(comm, [&] {
                             return Save(state.dict, r_dir, comm, local).status();
                           }));
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  if (comm.rank() == 0) {
    Clock::time_point start = Clock::now();
    TESSERA_RETURN_IF_ERROR(ReadMetadata(c_dir).status());
    t.read_collective.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    start = Clock::now();
    TESSERA_RETURN_IF_ERROR(ReadMetadata(r_dir).status());
    t.read_rank_local.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    t.collective.push_back(c);
    t.collective_uncached.push_back(u);
    t.rank_local.push_back(r);
    std::error_code ignored;
    for (const std::string& d : {c_dir, u_dir, r_dir}) std::filesystem::remove_all(d, ignored);
  }
  return comm.Barrier();
}

// Rank 0 makes the directory (MakeBenchDir) and every rank learns its name. COLLECTIVE.
Status ShareBenchDir(Comm& comm, const std::string& requested, std::string& dir) {
  Bytes name;
  Status made = Status::Ok();
  if (comm.rank() == 0) {
    Result<std::string> created = MakeBenchDir(requested);
    if (created.ok()) {
      name.assign(created->begin(), created->end());
    } else {
      made = created.status();
    }
  }
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, made));
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&name, 0));
  dir.assign(name.begin(), name.end());
  return Status::Ok();
}

int RunBenchRankLocal(const BenchRankLocalOptions& o) {
  Result<workload::Layout> layout = workload::ParseLayout(o.layout);
  if (!layout.ok()) return Fail(layout.status());
  Result<std::unique_ptr<RankRunner>> runner = RankRunner::Create(o.comm);
  if (!runner.ok()) return Fail(runner.status());
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(o.size_bytes);
  SaveOptions base;
  base.sync = o.sync ? SyncPolicy::kFull : SyncPolicy::kNone;
  Timings t;
  std::string dir;  // rank 0's, removed at the end
  Status status = (*runner)->Run(layout->ranks(), [&](Comm& comm, bool active) -> Status {
    std::string my_dir;  // each rank's own copy: with threads, `dir` is shared
    TESSERA_RETURN_IF_ERROR(ShareBenchDir(comm, o.dir, my_dir));
    if (comm.rank() == 0) dir = my_dir;
    workload::RankState state;
    if (active) state = workload::BuildRankState(config, *layout, comm.rank(), /*fill=*/true);
    // One untimed round first: page faults of fresh files, the plan cache's first plan.
    TESSERA_RETURN_IF_ERROR(Round(comm, state, my_dir, 0, base, t));
    if (comm.rank() == 0) t = Timings();
    for (int i = 1; i <= o.repeat; ++i) {
      TESSERA_RETURN_IF_ERROR(Round(comm, state, my_dir, i, base, t));
    }
    return Status::Ok();
  });
  if (!dir.empty() && (*runner)->printer()) RemoveBenchDir(dir, o.dir);
  if (!status.ok()) return Fail(status);
  if (!(*runner)->printer()) return 0;
  nlohmann::json j;
  j["ranks"] = layout->ranks();
  j["layout"] = layout->ToString();
  j["comm"] = o.comm;
  j["state_bytes"] = config.StateBytes();
  j["synced"] = o.sync;
  j["repeat"] = o.repeat;
  j["collective_save_seconds"] = Median(t.collective);
  j["collective_save_uncached_plan_seconds"] = Median(t.collective_uncached);
  j["rank_local_save_seconds"] = Median(t.rank_local);
  j["rank_local_over_collective"] = Median(t.rank_local) / Median(t.collective);
  j["rank_local_over_collective_uncached"] = Median(t.rank_local) / Median(t.collective_uncached);
  j["read_metadata_collective_seconds"] = Median(t.read_collective);
  j["read_metadata_rank_local_seconds"] = Median(t.read_rank_local);
  PrintJson(std::move(j));
  return 0;
}

}  // namespace

void AddBenchRankLocalCommand(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<BenchRankLocalOptions>();
  auto size = std::make_shared<std::string>("256MiB");
  CLI::App* cmd = bench.add_subcommand(
      "rank-local",
      "Time a rank-local save (no collective) against collective saves of the same state, "
      "alternating in one run; JSON");
  cmd->add_option("--size", *size, "state size")->capture_default_str();
  cmd->add_option("--layout", o->layout, "save layout, e.g. tp2,dp4 (8 ranks)")
      ->capture_default_str();
  cmd->add_option("--repeat", o->repeat, "timed rounds (medians reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--sync", o->sync, "fsync (default: page cache)");
  cmd->add_option("--comm", o->comm, "local (threads) or mpi (mpirun)")
      ->check(CLI::IsMember({"local", "mpi"}))
      ->capture_default_str();
  cmd->add_option("--dir", o->dir, "where to write (default: a temp dir, removed after)");
  cmd->callback([=] {
    Result<uint64_t> bytes = ParseSize(*size);
    if (!bytes.ok()) return void(*exit_code = Fail(bytes.status()));
    o->size_bytes = *bytes;
    *exit_code = RunBenchRankLocal(*o);
  });
}

}  // namespace tessera::tools
