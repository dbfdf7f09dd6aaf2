// tessera bench plan: the planning of a very large save and load, with no I/O and no
// communication. R ranks in groups of D data-parallel replicas (--dp): the R/D tensor-parallel
// shards each hold a row slice of each of T tensors, every replica of a shard the same boxes
// (replica id = position in the group). The load asks for another layout of the R/D shards (a
// 1/8 column slice of row blocks), each wanted by the D replicas of a load group.
//
// Every rank's part runs in this one thread, one rank after another, and is timed as each rank
// would do it (reported as the slowest rank). What the coordinator does once (decode what it
// receives, the global plan with validation, the manifest) is timed as a whole, and its memory
// measured as the resident memory it adds. The messages are those Save exchanges
// (plan/plan_exchange.h): a 16-byte signature from every rank, the plan once per group, the
// main-replica item ranges of every rank.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "format/safetensors.h"
#include "format/tessera/manifest.h"
#include "plan/load_plan.h"
#include "plan/plan_exchange.h"
#include "plan/save_plan.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/memory.h"

namespace tessera::tools {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct BenchPlanOptions {
  int ranks = 1024;
  int tensors = 1024;
  int dp = 1;  // data-parallel replicas holding the same boxes
  int64_t rows_per_shard = 4;
  int64_t columns = 1024;
  int sampled_load_ranks = 8;
};

std::string TensorKey(int t) {
  return "decoder.layers." + std::to_string(t / 8) + ".weight_" + std::to_string(t % 8);
}

// Rank r's state: shard r / dp of every tensor, replica r % dp.
Result<LocalPlan> RankPlan(const BenchPlanOptions& o, const Shape& shape, int r) {
  static uint8_t dummy[8];  // tensors are never read: every view points here
  StateDict state;
  for (int t = 0; t < o.tensors; ++t) {
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        TensorKey(t), TensorView(dummy, DType::kBF16, {o.rows_per_shard, o.columns}), shape,
        {o.rows_per_shard * (r / o.dp), 0}, {r % o.dp})));
  }
  return BuildLocalPlan(state);
}

struct SaveSide {
  double local_plan_max = 0;  // the slowest rank: local plan, holdings, signature, message
  uint64_t received = 0;      // by the coordinator: signatures (all-gather) and messages
  uint64_t unique_plan_bytes = 0;
  uint64_t plain_gather_bytes = 0;  // what gathering every rank's plan would have brought
  double plan_seconds = 0;          // coordinator: decode messages, grouped global plan
  double validate_seconds = 0;
  double manifest_encode_seconds = 0;
  uint64_t coordinator_peak_rss = 0;
  bool rss_tracked = false;
  Bytes manifest;
  uint64_t chunks = 0;
};

Status RunSave(const BenchPlanOptions& o, const Shape& shape, SaveSide& out) {
  // 1. Every rank: local plan, holdings, signature; the groups follow from the signatures.
  std::vector<PlanSignature> signatures(o.ranks);
  std::vector<Bytes> messages(o.ranks);
  std::vector<ItemRanges> main_items(o.ranks);
  std::vector<Bytes> leader_holdings;
  for (int r = 0; r < o.ranks; ++r) {
    const Clock::time_point start = Clock::now();
    TESSERA_ASSIGN_OR_RETURN(LocalPlan plan, RankPlan(o, shape, r));
    Bytes holdings = EncodeHoldings(plan);
    signatures[r] = SignHoldings(holdings);
    main_items[r] = MainItemRanges(plan);
    out.local_plan_max = std::max(out.local_plan_max, Since(start));
    out.plain_gather_bytes += EncodeLocalPlan(plan).size();
    if (r % o.dp == 0) leader_holdings.push_back(std::move(holdings));
  }
  const PlanGroups groups = GroupBySignature(signatures);
  if (groups.members.size() != static_cast<size_t>(o.ranks / o.dp)) {
    return Internal("expected " + std::to_string(o.ranks / o.dp) + " groups, got " +
                    std::to_string(groups.members.size()));
  }
  for (int r = 0; r < o.ranks; ++r) {
    const bool leads = groups.members[groups.group_of[r]][0] == r;
    messages[r] = EncodePlanMessage(leads ? &leader_holdings[r / o.dp] : nullptr, main_items[r]);
    out.received += messages[r].size() + 16;
    if (leads) out.unique_plan_bytes += leader_holdings[r / o.dp].size();
  }
  leader_holdings.clear();
  main_items.clear();

  // 2. The coordinator, holding the messages it received: decode, plan, manifest.
  const uint64_t rss_before = ProcStatusBytes("VmRSS");
  out.rss_tracked = ResetPeakRss();
  Clock::time_point start = Clock::now();
  std::vector<PlanMessage> decoded(o.ranks);
  for (int r = 0; r < o.ranks; ++r) {
    TESSERA_ASSIGN_OR_RETURN(decoded[r], DecodePlanMessage(messages[r]));
  }
  TESSERA_ASSIGN_OR_RETURN(GlobalSavePlan global, BuildGroupedSavePlan(groups, decoded, {}));
  out.plan_seconds = Since(start);
  decoded.clear();
  // Validation alone (it is part of the plan above): the tiling check of every tensor.
  start = Clock::now();
  for (const TensorInfo& t : global.metadata.tensors) {
    if (auto failure = CheckTiling(t.chunks, t.global_shape, true)) {
      return Internal(failure->message);
    }
  }
  out.validate_seconds = Since(start);
  // The writers' reports (one file per rank, items back to back) and the manifest.
  std::vector<WriteResult> results(o.ranks);
  const uint64_t chunk_bytes = static_cast<uint64_t>(o.rows_per_shard * o.columns * 2);
  for (int r = 0; r < o.ranks; ++r) {
    uint64_t offset = kDataAlignment;
    for (uint32_t item : global.writes[r]) {
      results[r].items.push_back({item, 0, offset, chunk_bytes, offset * 31});
      offset += chunk_bytes;
    }
    // As Save does: a rank that writes nothing creates no file.
    if (!global.writes[r].empty()) {
      results[r].files.push_back({DataFileName("0123456789abcdef", r, 0), offset});
    }
  }
  start = Clock::now();
  TESSERA_ASSIGN_OR_RETURN(Metadata metadata, FinishMetadata(global, results));
  metadata.save_id = "0123456789abcdef";
  metadata.checksum_block_bytes = kChecksumBlockBytes;
  out.manifest = EncodeManifest(metadata);
  out.manifest_encode_seconds = Since(start);
  out.chunks = metadata.TotalChunks();
  const uint64_t peak = ProcStatusBytes("VmHWM");
  out.coordinator_peak_rss = (peak > rss_before ? peak - rss_before : 0) + out.received;
  return Status::Ok();
}

int RunBenchPlan(const BenchPlanOptions& o) {
  if (o.dp < 1 || o.ranks % o.dp != 0 || (o.ranks / o.dp) % 8 != 0 || o.tensors < 1) {
    return Fail(
        InvalidArgument("bench plan needs --dp >= 1 dividing --ranks, --ranks / --dp a "
                        "multiple of 8, and --tensors >= 1"));
  }
  const int shards = o.ranks / o.dp;
  const Shape shape = {o.rows_per_shard * shards, o.columns};
  SaveSide save;
  if (Status s = RunSave(o, shape, save); !s.ok()) return Fail(s);

  // 3. Load under another layout: rank 0 reads the manifest and broadcasts it; every rank
  // decodes it and plans its reads. Timed on a sample of ranks spread over the job.
  double decode_manifest_max = 0, load_plan_max = 0;
  uint64_t runs_sampled = 0;
  const int column_splits = 8, row_splits = shards / column_splits;
  const int64_t load_rows = shape[0] / row_splits, load_columns = shape[1] / column_splits;
  std::vector<uint8_t> destination(load_rows * load_columns * 2);
  for (int s = 0; s < o.sampled_load_ranks; ++s) {
    const int r = static_cast<int>(static_cast<int64_t>(s) * (o.ranks - 1) /
                                   std::max(1, o.sampled_load_ranks - 1));
    const int piece = r / o.dp;  // the replicas of a load group want the same piece
    Clock::time_point start = Clock::now();
    Result<Metadata> decoded = DecodeManifest(save.manifest, "bench manifest");
    if (!decoded.ok()) return Fail(decoded.status());
    decode_manifest_max = std::max(decode_manifest_max, Since(start));
    StateDict state;
    const int64_t row0 = (piece / column_splits) * load_rows;
    const int64_t col0 = (piece % column_splits) * load_columns;
    for (int t = 0; t < o.tensors; ++t) {
      if (Status st = state.Add(ShardedTensor::Shard(
              TensorKey(t), TensorView(destination.data(), DType::kBF16, {load_rows, load_columns}),
              shape, {row0, col0}));
          !st.ok()) {
        return Fail(st);
      }
    }
    start = Clock::now();
    Result<RankReadPlan> reads = PlanRankReads(*decoded, state, "bench", false);
    if (!reads.ok()) return Fail(reads.status());
    load_plan_max = std::max(load_plan_max, Since(start));
    runs_sampled += reads->runs.size();
  }

  nlohmann::json out;
  out["ranks"] = o.ranks;
  out["tensors"] = o.tensors;
  out["dp"] = o.dp;
  out["chunks"] = save.chunks;
  out["local_plan_seconds_max_rank"] = save.local_plan_max;
  out["unique_local_plan_bytes"] = save.unique_plan_bytes;
  out["coordinator_bytes_received"] = save.received;
  out["coordinator_bytes_received_over_unique"] =
      static_cast<double>(save.received) / std::max<uint64_t>(1, save.unique_plan_bytes);
  out["plain_gather_bytes"] = save.plain_gather_bytes;
  out["coordinator_peak_rss_bytes"] = save.coordinator_peak_rss;
  out["coordinator_peak_rss_tracked"] = save.rss_tracked;
  out["save_plan_seconds"] = save.plan_seconds;
  out["validate_seconds"] = save.validate_seconds;
  out["save_plan_plus_validate_seconds"] = save.plan_seconds;  // validation is inside
  out["manifest_encode_seconds"] = save.manifest_encode_seconds;
  out["manifest_bytes"] = save.manifest.size();
  out["manifest_bytes_per_chunk"] = static_cast<double>(save.manifest.size()) / save.chunks;
  out["manifest_decode_seconds"] = decode_manifest_max;
  // Load: rank 0 reads the manifest from storage and broadcasts it (load.cc).
  out["load_manifest_bytes_read_rank0"] = save.manifest.size();
  out["load_manifest_bytes_read_other_ranks"] = 0;
  out["load_plan_seconds"] = load_plan_max;
  out["load_plan_ranks_sampled"] = o.sampled_load_ranks;
  out["load_read_runs_per_rank"] = runs_sampled / o.sampled_load_ranks;
  PrintJson(std::move(out));
  return 0;
}

}  // namespace

void AddBenchPlanCommand(CLI::App& bench, int* exit_code) {
  auto options = std::make_shared<BenchPlanOptions>();
  auto json = std::make_shared<bool>(true);
  CLI::App* plan = bench.add_subcommand(
      "plan", "Plan a save of R ranks x T tensors (R*T chunks) and a resharded load; no I/O");
  plan->add_option("--ranks", options->ranks, "ranks (a multiple of 8)")->capture_default_str();
  plan->add_option("--tensors", options->tensors, "tensors")->capture_default_str();
  plan->add_option("--dp", options->dp,
                   "data-parallel replicas: ranks in groups of this many hold the same boxes")
      ->capture_default_str();
  plan->add_option("--rows-per-shard", options->rows_per_shard,
                   "rows of each tensor per tensor-parallel shard")
      ->capture_default_str();
  plan->add_option("--columns", options->columns, "columns of each tensor")->capture_default_str();
  plan->add_option("--sampled-load-ranks", options->sampled_load_ranks,
                   "ranks whose load planning is timed")
      ->capture_default_str();
  plan->add_flag("--json", *json, "print JSON (the only output format)");
  plan->callback([=] {
    // CLI11 keeps a reference to *json and writes it at parse time: the callback owns it.
    (void)json;
    *exit_code = RunBenchPlan(*options);
  });
}

}  // namespace tessera::tools
