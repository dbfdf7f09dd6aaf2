// tessera bench read-plan: the job-wide read-once plan of a very large resharded load
// (LoadOptions::read_sharing kReadOnce, plan/read_once.h), with no I/O and no communication.
//
// The job: R ranks = pp x tp x dp, T tensors spread over the pp stages. The checkpoint was saved
// with tensor parallelism --tp: each tensor (rows x columns, BF16) in tp row blocks, each with
// two Adam moments (F32) in the same blocks. The load uses --load-tp (a divisor of tp): each
// load rank needs tp/load-tp whole blocks of every tensor of its stage (the same for all its
// data-parallel replicas) and, of each moment, its 1/dp' slice of its shard as a flat range (a
// distributed optimizer; different on every rank, its ends sharing checksum blocks with its
// neighbours). Each rank's need list is built, encoded and hashed as Load does; then what every
// rank does after the two all-gathers is timed once (every rank does the same): decode the
// groups' lists, plan. Memory: the gathered bytes plus what decoding and planning add to the
// resident set.
#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "core/checksum.h"
#include "plan/plan_exchange.h"
#include "plan/read_once.h"
#include "tessera/checkpoint.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/memory.h"

namespace tessera::tools {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct BenchReadPlanOptions {
  int ranks = 16384;
  int tensors = 256;
  int dp = 128;  // of the save
  int tp = 8;    // of the save
  int load_tp = 4;
  int64_t rows = 4096;
  int64_t columns = 4096;
  uint64_t exchange_bytes = LoadOptions{}.exchange_bytes;
};

constexpr uint64_t kCellBytes = 256u << 10;

// The needs of load rank (stage, t, d): whole blocks of each param, a flat slice of each
// moment.
std::vector<CellNeed> RankNeeds(const BenchReadPlanOptions& o, int pp, int load_dp, int stage,
                                int t, int d) {
  const int blocks_per_rank = o.tp / o.load_tp;
  const uint64_t param_chunk = static_cast<uint64_t>(o.rows / o.tp * o.columns * 2);
  const uint64_t moment_chunk = param_chunk * 2;
  auto cells = [](uint64_t bytes) { return (bytes + kCellBytes - 1) / kCellBytes; };
  std::vector<CellNeed> needs;
  for (int k = stage; k < o.tensors; k += pp) {
    for (int b = 0; b < blocks_per_rank; ++b) {
      const uint32_t chunk = static_cast<uint32_t>(t * blocks_per_rank + b);
      needs.push_back({static_cast<uint32_t>(3 * k), chunk, param_chunk, 0, cells(param_chunk),
                       param_chunk, CellCheck::kEachCell});
    }
    // This rank's slice of its shard's moments, [begin, end) of the shard's bytes.
    const uint64_t shard = moment_chunk * blocks_per_rank;
    const uint64_t begin = shard * d / load_dp, end = shard * (d + 1) / load_dp;
    for (uint32_t m = 1; m <= 2; ++m) {
      for (int b = 0; b < blocks_per_rank; ++b) {
        const uint64_t lo = std::max<uint64_t>(begin, b * moment_chunk);
        const uint64_t hi = std::min<uint64_t>(end, (b + 1) * moment_chunk);
        if (lo >= hi) continue;
        NeedsOfRun(static_cast<uint32_t>(3 * k + m), static_cast<uint32_t>(t * blocks_per_rank + b),
                   moment_chunk, lo - b * moment_chunk, hi - lo, CellCheck::kEachCell, kCellBytes,
                   needs);
      }
    }
  }
  CoalesceNeeds(needs, kCellBytes);
  return needs;
}

int RunBenchReadPlan(const BenchReadPlanOptions& o) {
  const int per_stage = o.tp * o.dp;
  if (o.tp < 1 || o.dp < 1 || o.load_tp < 1 || o.tp % o.load_tp != 0 || o.ranks % per_stage != 0 ||
      o.rows % o.tp != 0 || o.tensors < 1) {
    return Fail(InvalidArgument(
        "bench read-plan needs --tp x --dp dividing --ranks, --load-tp dividing --tp, --tp "
        "dividing --rows"));
  }
  const int pp = o.ranks / per_stage;
  const int load_dp = o.ranks / (pp * o.load_tp);
  // 1. Every rank: its needs, encoded and signed (timed on the slowest).
  std::vector<PlanSignature> signatures(o.ranks);
  std::vector<Bytes> encoded(o.ranks);
  double local_max = 0;
  for (int r = 0; r < o.ranks; ++r) {
    const Clock::time_point start = Clock::now();
    const int stage = r / (o.load_tp * load_dp);
    const int t = (r / load_dp) % o.load_tp, d = r % load_dp;
    encoded[r] = EncodeNeeds(RankNeeds(o, pp, load_dp, stage, t, d));
    // Load signs the cells and the exact runs: here, the cells and the rank's moment slice.
    Bytes exact = encoded[r];
    exact.push_back(static_cast<uint8_t>(d));
    exact.push_back(static_cast<uint8_t>(d >> 8));
    exact.push_back(static_cast<uint8_t>(d >> 16));
    const Checksum128Value hash = Checksum128(exact.data(), exact.size());
    signatures[r] = {hash.low, hash.high};
    local_max = std::max(local_max, Since(start));
  }
  // 2. The all-gathers: signatures, then one list per group.
  const PlanGroups groups = GroupBySignature(signatures);
  uint64_t gathered = 24ull * o.ranks;
  std::vector<Bytes> leader_lists;
  for (const std::vector<int32_t>& members : groups.members) {
    gathered += encoded[members[0]].size();
    leader_lists.push_back(std::move(encoded[members[0]]));
  }
  encoded.clear();
  encoded.shrink_to_fit();
  // 3. What every rank then does: plan.
  const uint64_t rss_before = ProcStatusBytes("VmRSS");
  const bool rss_tracked = ResetPeakRss();
  // Load plans straight from the encoded lists, decoding each entry as the sweep reaches its
  // chunk (PlanJobReadsEncoded): the decode is inside the plan's time.
  const std::vector<std::span<const uint8_t>> lists(leader_lists.begin(), leader_lists.end());
  const Clock::time_point start = Clock::now();
  Result<JobReadPlan> plan =
      PlanJobReadsEncoded(lists, groups.group_of, kCellBytes, o.exchange_bytes);
  if (!plan.ok()) return Fail(plan.status());
  const double plan_seconds = Since(start);
  const uint64_t peak = ProcStatusBytes("VmHWM");
  uint64_t shared_bytes = 0;
  for (const SharedPiece& p : plan->pieces) shared_bytes += p.end - p.begin;
  const uint64_t param_chunk = static_cast<uint64_t>(o.rows / o.tp * o.columns * 2);
  const uint64_t checkpoint = static_cast<uint64_t>(o.tensors) * o.tp * param_chunk * 5;

  nlohmann::json out;
  out["ranks"] = o.ranks;
  out["tensors"] = o.tensors;
  out["save_layout"] =
      "pp" + std::to_string(pp) + ",tp" + std::to_string(o.tp) + ",dp" + std::to_string(o.dp);
  out["load_layout"] = "pp" + std::to_string(pp) + ",tp" + std::to_string(o.load_tp) + ",dp" +
                       std::to_string(load_dp) + " (moments as flat ranges over dp)";
  out["checkpoint_bytes"] = checkpoint;
  out["groups"] = groups.members.size();
  out["local_needs_seconds_max_rank"] = local_max;
  out["gathered_bytes_per_rank"] = gathered;
  out["plan_seconds"] = plan_seconds;  // decoding included
  out["pieces"] = plan->pieces.size();
  out["rounds"] = plan->num_rounds;
  out["shared_bytes"] = shared_bytes;
  out["union_needed_bytes"] = plan->union_needed_bytes;
  out["peak_rss_added_bytes"] = peak > rss_before ? peak - rss_before : 0;
  out["per_rank_memory_bytes"] = gathered + (peak > rss_before ? peak - rss_before : 0);
  out["rss_tracked"] = rss_tracked;
  PrintJson(std::move(out));
  return 0;
}

}  // namespace

void AddBenchReadPlanCommand(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<BenchReadPlanOptions>();
  auto json = std::make_shared<bool>(true);
  CLI::App* cmd = bench.add_subcommand(
      "read-plan", "Plan the read-once exchange of a resharded load of R ranks; no I/O");
  cmd->add_option("--ranks", o->ranks, "ranks (pp x tp x dp)")->capture_default_str();
  cmd->add_option("--tensors", o->tensors, "tensors (spread over the pipeline stages)")
      ->capture_default_str();
  cmd->add_option("--dp", o->dp, "data-parallel degree of the save")->capture_default_str();
  cmd->add_option("--tp", o->tp, "tensor-parallel degree of the save")->capture_default_str();
  cmd->add_option("--load-tp", o->load_tp, "tensor-parallel degree of the load (divides --tp)")
      ->capture_default_str();
  cmd->add_option("--rows", o->rows, "rows of each tensor")->capture_default_str();
  cmd->add_option("--columns", o->columns, "columns of each tensor")->capture_default_str();
  cmd->add_option("--exchange-bytes", o->exchange_bytes, "LoadOptions::exchange_bytes")
      ->capture_default_str();
  cmd->add_flag("--json", *json, "print JSON (the only output format)");
  cmd->callback([=] {
    (void)json;
    *exit_code = RunBenchReadPlan(*o);
  });
}

}  // namespace tessera::tools
