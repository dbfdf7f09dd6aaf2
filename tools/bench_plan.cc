// tessera bench plan: the planning of a very large save and load, with no I/O and no
// communication. R ranks each hold a 1/R row slice of each of T tensors (R x T chunks); the
// load asks for a different layout (a 1/8 column slice of each of R/8 row blocks).
//
// Every rank's part runs in this one thread, one rank after another, and is timed as each rank
// would do it. What runs once on the coordinator (decode every plan, global plan, validation,
// manifest) is timed as a whole; what every rank does in parallel (its local plan; reading the
// manifest and planning its reads) is timed per rank and reported as the slowest rank sampled.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "format/manifest.h"
#include "format/safetensors.h"
#include "plan/load_plan.h"
#include "plan/save_plan.h"
#include "tools/commands.h"

namespace tessera::tools {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct BenchPlanOptions {
  int ranks = 1024;
  int tensors = 1024;
  int64_t rows_per_rank = 4;
  int64_t columns = 1024;
  int sampled_load_ranks = 8;
  int threads = 2;  // the coordinator's threads (SaveOptions::num_io_threads)
};

std::string TensorKey(int t) {
  return "decoder.layers." + std::to_string(t / 8) + ".weight_" + std::to_string(t % 8);
}

int RunBenchPlan(const BenchPlanOptions& o) {
  if (o.ranks < 8 || o.ranks % 8 != 0 || o.tensors < 1) {
    return Fail(InvalidArgument("bench plan needs --ranks a multiple of 8 and --tensors >= 1"));
  }
  const Shape shape = {o.rows_per_rank * o.ranks, o.columns};
  static uint8_t dummy[8];  // tensors are never read: every view points here

  // 1. Every rank: its local plan, encoded (what it sends to the coordinator).
  std::vector<Bytes> encoded(o.ranks);
  double local_plan_max = 0;
  for (int r = 0; r < o.ranks; ++r) {
    StateDict state;
    for (int t = 0; t < o.tensors; ++t) {
      ShardedTensor tensor = ShardedTensor::Shard(
          TensorKey(t), TensorView(dummy, DType::kBF16, {o.rows_per_rank, o.columns}), shape,
          {o.rows_per_rank * r, 0});
      if (Status s = state.Add(std::move(tensor)); !s.ok()) return Fail(s);
    }
    Clock::time_point start = Clock::now();
    Result<LocalPlan> plan = BuildLocalPlan(state);
    if (!plan.ok()) return Fail(plan.status());
    encoded[r] = EncodeLocalPlan(*plan);
    local_plan_max = std::max(local_plan_max, Since(start));
  }
  uint64_t plan_bytes = 0;
  for (const Bytes& b : encoded) plan_bytes += b.size();

  // 2. The coordinator: decode, global plan with validation, manifest.
  Clock::time_point start = Clock::now();
  // As the coordinator does it (Save): with its I/O threads (2 by default).
  std::vector<std::span<const uint8_t>> bodies(encoded.begin(), encoded.end());
  Result<std::vector<LocalPlan>> decoded_plans = DecodeLocalPlans(bodies, o.threads);
  if (!decoded_plans.ok()) return Fail(decoded_plans.status());
  std::vector<LocalPlan> plans = std::move(*decoded_plans);
  const double decode_seconds = Since(start);
  start = Clock::now();
  Result<GlobalSavePlan> global = BuildGlobalSavePlan(plans, {});
  if (!global.ok()) return Fail(global.status());
  const double global_plan_seconds = Since(start);
  const double save_plan_seconds = decode_seconds + global_plan_seconds;

  // Validation alone (it is part of the global plan above): the tiling check of every tensor.
  start = Clock::now();
  for (const TensorInfo& t : global->metadata.tensors) {
    if (auto failure = CheckTiling(t.chunks, t.global_shape, true)) {
      return Fail(Internal(failure->message));
    }
  }
  const double validate_seconds = Since(start);

  // The writers' reports (one file per rank, items back to back) and the manifest.
  std::vector<WriteResult> results(o.ranks);
  for (int r = 0; r < o.ranks; ++r) {
    uint64_t offset = kDataAlignment;
    for (uint32_t item : global->writes[r]) {
      uint64_t length = plans[r].items[item].num_bytes;
      results[r].items.push_back({item, 0, offset, length, offset * 31});
      offset += length;
    }
    results[r].files.push_back({DataFileName("0123456789abcdef", r, 0), offset});
  }
  start = Clock::now();
  Result<Metadata> metadata = FinishMetadata(*global, results);
  if (!metadata.ok()) return Fail(metadata.status());
  metadata->save_id = "0123456789abcdef";
  Bytes manifest = EncodeManifest(*metadata);
  const double manifest_encode_seconds = Since(start);
  plans.clear();

  // 3. Load under another layout: every rank decodes the manifest and plans its reads. Timed on
  // a sample of ranks spread over the job.
  double decode_manifest_max = 0, load_plan_max = 0;
  uint64_t runs_sampled = 0;
  const int column_splits = 8, row_splits = o.ranks / column_splits;
  const int64_t load_rows = shape[0] / row_splits, load_columns = shape[1] / column_splits;
  std::vector<uint8_t> destination(load_rows * load_columns * 2);
  for (int s = 0; s < o.sampled_load_ranks; ++s) {
    const int r = static_cast<int>(static_cast<int64_t>(s) * (o.ranks - 1) /
                                   std::max(1, o.sampled_load_ranks - 1));
    start = Clock::now();
    Result<Metadata> decoded = DecodeManifest(manifest, "bench manifest");
    if (!decoded.ok()) return Fail(decoded.status());
    decode_manifest_max = std::max(decode_manifest_max, Since(start));
    StateDict state;
    const int64_t row0 = (r / column_splits) * load_rows, col0 = (r % column_splits) * load_columns;
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
  out["coordinator_threads"] = o.threads;
  out["chunks"] = metadata->TotalChunks();
  out["local_plan_seconds_max_rank"] = local_plan_max;
  out["local_plan_bytes_total"] = plan_bytes;
  out["local_plan_bytes_per_rank"] = plan_bytes / o.ranks;
  out["decode_local_plans_seconds"] = decode_seconds;
  out["global_plan_seconds"] = global_plan_seconds;
  out["save_plan_seconds"] = save_plan_seconds;
  out["validate_seconds"] = validate_seconds;
  out["save_plan_plus_validate_seconds"] = save_plan_seconds;  // validation is inside
  out["manifest_encode_seconds"] = manifest_encode_seconds;
  out["manifest_bytes"] = manifest.size();
  out["manifest_decode_seconds"] = decode_manifest_max;
  out["load_plan_seconds"] = load_plan_max;
  out["load_plan_ranks_sampled"] = o.sampled_load_ranks;
  out["load_read_runs_per_rank"] = runs_sampled / o.sampled_load_ranks;
  std::printf("%s\n", out.dump(2).c_str());
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
  plan->add_option("--rows-per-rank", options->rows_per_rank, "rows of each tensor per rank")
      ->capture_default_str();
  plan->add_option("--columns", options->columns, "columns of each tensor")->capture_default_str();
  plan->add_option("--sampled-load-ranks", options->sampled_load_ranks,
                   "ranks whose load planning is timed")
      ->capture_default_str();
  plan->add_option("--threads", options->threads, "coordinator threads")->capture_default_str();
  plan->add_flag("--json", *json, "print JSON (the only output format)");
  plan->callback([=] {
    // CLI11 keeps a reference to *json and writes it at parse time: the callback owns it.
    (void)json;
    *exit_code = RunBenchPlan(*options);
  });
}

}  // namespace tessera::tools
