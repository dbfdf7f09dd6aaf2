#include "suite/multirank_suite.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <random>

#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/storage_wrapper.h"
#include "testing/random_pieces.h"
#include "workload/model_state.h"

namespace tessera::suite {
namespace {

using workload::CheckPattern;
using workload::FillPattern;

// Fails unless `condition`; the message says what was expected.
Status Expect(bool condition, const std::string& what) {
  return condition ? Status::Ok() : Internal("expectation failed: " + what);
}

// Fails unless `status` is an error whose message contains every one of `parts`.
Status ExpectError(const Status& status, std::initializer_list<std::string> parts) {
  if (status.ok()) return Internal("expected an error, got OK");
  for (const std::string& part : parts) {
    if (status.message().find(part) == std::string::npos) {
      return Internal("expected an error containing \"" + part + "\", got: " + status.ToString());
    }
  }
  return Status::Ok();
}

// ---- transformer-like state, resharded -------------------------------------------------------

// The save and load layouts for `ranks` ranks: TP over as many ranks as divide evenly, then DP.
workload::Layout SaveLayout(int ranks) {
  workload::Layout l;
  l.tp = ranks % 2 == 0 ? 2 : 1;
  l.dp = ranks / l.tp;
  return l;
}

Status ExpectReadOnce(Comm& comm, const LoadReport& report);

Status ReshardModelState(Comm& comm, const std::string& dir, workload::Layout load) {
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(6 << 20, 3);
  const workload::Layout save = SaveLayout(comm.size());
  workload::RankState saved = workload::BuildRankState(config, save, comm.rank(), true);
  TESSERA_ASSIGN_OR_RETURN(SaveReport report, Save(saved.dict, dir + "/ck", comm));
  TESSERA_RETURN_IF_ERROR(
      Expect(report.total_bytes == config.StateBytes(), "each unique byte written once"));
  // Unverified, a load reads exactly the bytes it needs; verified (the default), it reads the
  // checksum blocks around them.
  workload::RankState loaded = workload::BuildRankState(config, load, comm.rank(), false);
  LoadOptions unverified;
  unverified.verify_checksums = false;
  unverified.read_sharing = ReadSharing::kNone;
  TESSERA_ASSIGN_OR_RETURN(LoadReport load_report,
                           Load(loaded.dict, dir + "/ck", comm, unverified));
  TESSERA_RETURN_IF_ERROR(Expect(load_report.bytes_read == load_report.bytes_needed,
                                 "an unverified load reads exactly the bytes it needs"));
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, workload::CheckRankState(loaded)));
  loaded = workload::BuildRankState(config, load, comm.rank(), false);
  LoadOptions once;
  once.read_sharing = ReadSharing::kReadOnce;
  TESSERA_ASSIGN_OR_RETURN(load_report, Load(loaded.dict, dir + "/ck", comm, once));
  TESSERA_RETURN_IF_ERROR(ExpectReadOnce(comm, load_report));
  return AgreeOnStatus(comm, workload::CheckRankState(loaded));
}

// A read-once load's job figures: the same on every rank, every byte read at most once (the
// job reads no more than the checkpoint, plus each rank's own reads of the small objects),
// and at least the union of what the ranks needed.
Status ExpectReadOnce(Comm& comm, const LoadReport& report) {
  std::vector<int64_t> mine = {static_cast<int64_t>(report.job_bytes_read),
                               static_cast<int64_t>(report.job_bytes_needed),
                               static_cast<int64_t>(report.job_bytes_exchanged)};
  std::vector<int64_t> low = mine, high = mine;
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(low, ReduceOp::kMin));
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(high, ReduceOp::kMax));
  TESSERA_RETURN_IF_ERROR(Expect(low == high, "every rank reports the same job figures"));
  const std::string figures = "job read " + std::to_string(report.job_bytes_read) + ", needed " +
                              std::to_string(report.job_bytes_needed) + ", checkpoint " +
                              std::to_string(report.checkpoint_bytes);
  TESSERA_RETURN_IF_ERROR(
      Expect(report.job_bytes_needed > 0 && report.job_bytes_read >= report.job_bytes_needed,
             "the job reads what it needs: " + figures));
  constexpr uint64_t kObjectBytes = 64;  // per rank, generous: "optimizer.step" and the like
  return Expect(report.job_bytes_read <= report.checkpoint_bytes + kObjectBytes * comm.size(),
                "the job reads each byte at most once: " + figures);
}

// ---- random layouts ----------------------------------------------------------------------------

void RandomTiling(const Box& box, std::mt19937_64& rng, size_t max_pieces, std::vector<Box>& out) {
  std::vector<Box> pieces = {box};
  while (pieces.size() < max_pieces && rng() % 5 != 0) {
    size_t i = rng() % pieces.size();
    Box b = pieces[i];
    if (b.rank() == 0) break;
    size_t d = rng() % b.rank();
    if (b.sizes[d] < 2) continue;
    int64_t cut = 1 + static_cast<int64_t>(rng() % (b.sizes[d] - 1));
    Box second = b;
    b.sizes[d] = cut;
    second.offsets[d] += cut;
    second.sizes[d] -= cut;
    pieces[i] = b;
    pieces.push_back(second);
  }
  out = std::move(pieces);
}

// One rank's entry for one tensor in a random layout.
struct Holding {
  Box box;
  std::optional<FlatRange> flat;
  ReplicaId replica;
};

// A random assignment of `shape` to `ranks` ranks: each rank holds at most one piece, maybe a
// flat range of it, maybe a replica. Deterministic in `rng`.
std::vector<std::optional<Holding>> RandomLayout(const Shape& shape, int ranks,
                                                 std::mt19937_64& rng, bool for_save) {
  std::vector<Box> pieces;
  RandomTiling(Box::Whole(shape), rng, static_cast<size_t>(ranks), pieces);
  std::vector<int> order(ranks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::optional<Holding>> out(ranks);
  std::vector<std::vector<int>> holders(pieces.size());
  for (size_t p = 0; p < pieces.size(); ++p) holders[p].push_back(order[p]);
  for (size_t k = pieces.size(); k < order.size(); ++k) {  // spare ranks join a random piece
    if (rng() % 3 == 0) continue;
    holders[rng() % pieces.size()].push_back(order[k]);
  }
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Box& box = pieces[p];
    const int64_t n = box.NumElements();
    const bool flat = holders[p].size() > 1 && rng() % 2 == 0;
    for (size_t h = 0; h < holders[p].size(); ++h) {
      Holding holding{box, std::nullopt, {}};
      if (flat) {  // a distributed optimizer: contiguous flat ranges of the piece
        int64_t parts = static_cast<int64_t>(holders[p].size());
        int64_t begin = n * static_cast<int64_t>(h) / parts;
        int64_t end = n * static_cast<int64_t>(h + 1) / parts;
        holding.flat = FlatRange{begin, end};
      } else if (for_save) {
        holding.replica = {static_cast<int32_t>(h)};  // h == 0 is the main replica
      }
      out[holders[p][h]] = std::move(holding);
    }
  }
  return out;
}

struct RandomTensor {
  std::string key;
  DType dtype;
  Shape shape;
};

constexpr DType kPropertyDTypes[] = {DType::kF32, DType::kBF16, DType::kI64, DType::kU8,
                                     DType::kF64};

// Builds this rank's state dict for `layout`, with buffers in `buffers`.
Status BuildRandomState(const std::vector<RandomTensor>& tensors,
                        const std::vector<std::vector<std::optional<Holding>>>& layouts, int rank,
                        bool fill, StateDict& state, std::vector<std::vector<uint8_t>>& buffers) {
  for (size_t t = 0; t < tensors.size(); ++t) {
    const std::optional<Holding>& h = layouts[t][rank];
    if (!h) continue;
    const int64_t elements = h->flat ? h->flat->end - h->flat->begin : h->box.NumElements();
    buffers.emplace_back(elements * DTypeSize(tensors[t].dtype), uint8_t{0xEE});
    ShardedTensor tensor;
    if (h->flat) {
      tensor = ShardedTensor::FlatShard(
          tensors[t].key, TensorView(buffers.back().data(), tensors[t].dtype, {elements}),
          tensors[t].shape, h->box.offsets, h->box.sizes, h->flat->begin, h->replica);
    } else {
      tensor = ShardedTensor::Shard(
          tensors[t].key, TensorView(buffers.back().data(), tensors[t].dtype, h->box.sizes),
          tensors[t].shape, h->box.offsets, h->replica);
    }
    if (fill) FillPattern(tensor);
    TESSERA_RETURN_IF_ERROR(state.Add(std::move(tensor)));
  }
  return Status::Ok();
}

Status RandomResharding(Comm& comm, const std::string& dir) {
  const uint64_t seed = 20261121;
  std::mt19937_64 rng(seed);  // the same sequence on every rank: they agree on the layouts
  const int trials = 60;
  for (int trial = 0; trial < trials; ++trial) {
    const std::string where = "seed " + std::to_string(seed) + " trial " + std::to_string(trial);
    std::vector<RandomTensor> tensors(1 + rng() % 4);
    for (size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].key = "t" + std::to_string(t);
      tensors[t].dtype = kPropertyDTypes[rng() % std::size(kPropertyDTypes)];
      size_t rank = 1 + rng() % 4;
      for (size_t d = 0; d < rank; ++d) {
        tensors[t].shape.push_back(1 + 2 * static_cast<int64_t>(rng() % (rank <= 2 ? 30 : 6)));
      }
    }
    std::vector<std::vector<std::optional<Holding>>> save_layout, load_layout;
    for (const RandomTensor& t : tensors) {
      save_layout.push_back(RandomLayout(t.shape, comm.size(), rng, true));
    }
    for (const RandomTensor& t : tensors) {
      load_layout.push_back(RandomLayout(t.shape, comm.size(), rng, false));
    }
    const std::string path = dir + "/trial" + std::to_string(trial);
    Status status = [&]() -> Status {
      StateDict saved;
      std::vector<std::vector<uint8_t>> save_buffers;
      TESSERA_RETURN_IF_ERROR(
          BuildRandomState(tensors, save_layout, comm.rank(), true, saved, save_buffers));
      SaveOptions save_options;
      save_options.balance_writes = trial % 2 == 1;
      save_options.sync = SyncPolicy::kNone;
      TESSERA_RETURN_IF_ERROR(Save(saved, path, comm, save_options).status());
      StateDict loaded;
      std::vector<std::vector<uint8_t>> load_buffers;
      TESSERA_RETURN_IF_ERROR(
          BuildRandomState(tensors, load_layout, comm.rank(), false, loaded, load_buffers));
      LoadOptions load_options;
      // Verified loads read whole checksum blocks around what they need: more bytes. Each
      // rank reads for itself, or the job reads each block once (the default).
      load_options.verify_checksums = trial % 3 != 2;
      // kAuto on a local filesystem: each rank reads for itself.
      constexpr ReadSharing kModes[] = {ReadSharing::kReadOnce, ReadSharing::kNone,
                                        ReadSharing::kAuto};
      load_options.read_sharing = kModes[trial % 3 == 2 ? (trial / 3) % 3 : trial % 2];
      load_options.exchange_bytes = 1 + rng() % (1 << 20);
      TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(loaded, path, comm, load_options));
      const ReadSharing expected_sharing = load_options.read_sharing == ReadSharing::kAuto
                                               ? ReadSharing::kNone
                                               : load_options.read_sharing;
      TESSERA_RETURN_IF_ERROR(
          Expect(report.read_sharing == expected_sharing,
                 "the report says how reads were shared (kAuto: kNone on a local filesystem)"));
      if (report.read_sharing == ReadSharing::kReadOnce) {
        TESSERA_RETURN_IF_ERROR(ExpectReadOnce(comm, report));
      } else {
        const bool exact = !load_options.verify_checksums;
        TESSERA_RETURN_IF_ERROR(Expect(exact ? report.bytes_read == report.bytes_needed
                                             : report.bytes_read >= report.bytes_needed,
                                       "bytes read (" + std::to_string(report.bytes_read) +
                                           (exact ? ") equal" : ") cover") + " the bytes needed (" +
                                           std::to_string(report.bytes_needed) + ")"));
      }
      Status check;
      for (const StateEntry& entry : loaded.entries()) {
        check = CheckPattern(std::get<ShardedTensor>(entry));
        if (!check.ok()) break;
      }
      return AgreeOnStatus(comm, check);
    }();
    TESSERA_RETURN_IF_ERROR_CTX(status, where);
  }
  return Status::Ok();
}

// ---- errors --------------------------------------------------------------------------------

Status OverlapIsRejectedEverywhere(Comm& comm, const std::string& dir) {
  std::vector<float> data(6);
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
      "w", TensorView(data.data(), DType::kF32, {6}), {4 + 4 * comm.size()}, {4 * comm.rank()})));
  Status s = Save(state, dir + "/ck", comm).status();
  TESSERA_RETURN_IF_ERROR(
      ExpectError(s, {"key 'w'", "[0:6] and [4:10] overlap", "rank 0 and rank 1"}));
  return Expect(!ReadMetadata(dir + "/ck").ok(), "no checkpoint after a failed save");
}

Status DtypeDisagreementIsRejectedEverywhere(Comm& comm, const std::string& dir) {
  std::vector<double> data(2);
  StateDict state;
  const DType dtype = comm.rank() == comm.size() - 1 ? DType::kI64 : DType::kF64;
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard("w", TensorView(data.data(), dtype, {2}),
                                                         {2 * comm.size()}, {2 * comm.rank()})));
  Status s = Save(state, dir + "/ck", comm).status();
  return ExpectError(
      s, {"key 'w': dtype F64 on rank 0 but I64 on rank " + std::to_string(comm.size() - 1)});
}

Status FailingRankStorageFailsTheSave(Comm& comm, const std::string& dir) {
  std::vector<float> data(100, 1.0f);
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
      "w", TensorView(data.data(), DType::kF32, {100}), {100 * comm.size()}, {100 * comm.rank()})));
  SaveOptions options;
  const int victim = comm.size() - 1;
  if (comm.rank() == victim) {
    options.storage = std::make_shared<FaultInjectingStorage>(
        NewPosixStorage(), FaultPlan{.fail_at = 1, .crash = false, .path_filter = ""});
  }
  Status s = Save(state, dir + "/ck", comm, options).status();
  TESSERA_RETURN_IF_ERROR(ExpectError(s, {"rank " + std::to_string(victim), "injected fault"}));
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  return Expect(!ReadMetadata(dir + "/ck").ok(), "no checkpoint after a failed save");
}

Status MissingKeyOnOneRankFailsTheLoadEverywhere(Comm& comm, const std::string& dir) {
  std::vector<int32_t> data(3, comm.rank());
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
      "w", TensorView(data.data(), DType::kI32, {3}), {3 * comm.size()}, {3 * comm.rank()})));
  TESSERA_RETURN_IF_ERROR(Save(state, dir + "/ck", comm).status());
  std::vector<int32_t> extra(1);
  if (comm.rank() == 1) {
    TESSERA_RETURN_IF_ERROR(
        state.Add(ShardedTensor::Whole("not.saved", TensorView(extra.data(), DType::kI32, {1}))));
  }
  Status s = Load(state, dir + "/ck", comm).status();
  return ExpectError(s, {"rank 1", "has no key 'not.saved'"});
}

Status BalancedWritesSpreadReplicatedBytes(Comm& comm, const std::string& dir) {
  // Every rank holds the same 8 tensors (pure data parallelism).
  std::vector<std::vector<float>> data(8, std::vector<float>(1024));
  StateDict state;
  for (int t = 0; t < 8; ++t) {
    ShardedTensor tensor = ShardedTensor::Whole("p" + std::to_string(t),
                                                TensorView(data[t].data(), DType::kF32, {1024}));
    tensor.replica_id = {comm.rank()};
    FillPattern(tensor);
    TESSERA_RETURN_IF_ERROR(state.Add(std::move(tensor)));
  }
  SaveOptions options;
  options.balance_writes = true;
  TESSERA_ASSIGN_OR_RETURN(SaveReport report, Save(state, dir + "/ck", comm, options));
  const uint64_t fair = report.total_bytes / comm.size();
  TESSERA_RETURN_IF_ERROR(Expect(
      report.bytes_written + 4096 >= fair && report.bytes_written <= fair + 4096,
      "rank " + std::to_string(comm.rank()) + " wrote " + std::to_string(report.bytes_written) +
          " bytes, fair share " + std::to_string(fair)));
  for (StateEntry& entry : state.entries()) {
    auto& tensor = std::get<ShardedTensor>(entry);
    std::fill(data[&entry - &state.entries()[0]].begin(), data[&entry - &state.entries()[0]].end(),
              0.0f);
    (void)tensor;
  }
  TESSERA_RETURN_IF_ERROR(Load(state, dir + "/ck", comm).status());
  Status check;
  for (const StateEntry& entry : state.entries()) {
    check = CheckPattern(std::get<ShardedTensor>(entry));
    if (!check.ok()) break;
  }
  return AgreeOnStatus(comm, check);
}

Status ObjectsPerRankAndShared(Comm& comm, const std::string& dir) {
  StateDict state;
  const std::string mine = "rank" + std::to_string(comm.rank());
  TESSERA_RETURN_IF_ERROR(
      state.Add(ShardedObject{"rng." + mine, std::vector<uint8_t>(mine.begin(), mine.end()), {}}));
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedObject{"step", {4, 2}, {comm.rank()}}));
  TESSERA_RETURN_IF_ERROR(Save(state, dir + "/ck", comm).status());
  // Load on the "next" rank's layout: each rank reads another rank's object.
  const std::string other = "rank" + std::to_string((comm.rank() + 1) % comm.size());
  StateDict target;
  TESSERA_RETURN_IF_ERROR(target.Add(ShardedObject{"rng." + other, {}, {}}));
  TESSERA_RETURN_IF_ERROR(target.Add(ShardedObject{"step", {}, {}}));
  TESSERA_RETURN_IF_ERROR(Load(target, dir + "/ck", comm).status());
  const auto& got = std::get<ShardedObject>(*target.Find("rng." + other)).data;
  TESSERA_RETURN_IF_ERROR(
      Expect(std::string(got.begin(), got.end()) == other, "object rng." + other + " round-trips"));
  return Expect(std::get<ShardedObject>(*target.Find("step")).data == std::vector<uint8_t>{4, 2},
                "object step round-trips");
}

Status PlanCacheReusesPlansAndNoticesChanges(Comm& comm, const std::string& dir) {
  // Rank r holds rows [2r, 2r + 2) of a [2 * size, 8] tensor; later the last two ranks trade a
  // row, which must invalidate every rank's cached plan.
  const int64_t rows = 2 * comm.size();
  auto save = [&](int64_t begin, int64_t count, int value) -> Result<SaveReport> {
    std::vector<int32_t> data(count * 8, value);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
        "w", TensorView(data.data(), DType::kI32, {count, 8}), {rows, 8}, {begin, 0})));
    return Save(state, dir + "/ck", comm);
  };
  auto check = [&](int value) -> Status {
    std::vector<int32_t> all(rows * 8, -1);
    StateDict state;
    TESSERA_RETURN_IF_ERROR(
        state.Add(ShardedTensor::Whole("w", TensorView(all.data(), DType::kI32, {rows, 8}))));
    TESSERA_RETURN_IF_ERROR(Load(state, dir + "/ck", comm).status());
    return Expect(std::all_of(all.begin(), all.end(), [&](int32_t v) { return v == value; }),
                  "every element holds " + std::to_string(value));
  };
  TESSERA_ASSIGN_OR_RETURN(SaveReport first, save(2 * comm.rank(), 2, 1));
  TESSERA_RETURN_IF_ERROR(Expect(!first.plan_cache_hit, "the first save plans"));
  TESSERA_ASSIGN_OR_RETURN(SaveReport second, save(2 * comm.rank(), 2, 2));
  TESSERA_RETURN_IF_ERROR(Expect(second.plan_cache_hit, "an unchanged layout reuses the plan"));
  TESSERA_RETURN_IF_ERROR(Expect(second.save_id != first.save_id, "a new save id"));
  TESSERA_RETURN_IF_ERROR(check(2));
  int64_t begin = 2 * comm.rank(), count = 2;
  if (comm.size() >= 2 && comm.rank() == comm.size() - 2) count = 3;
  if (comm.size() >= 2 && comm.rank() == comm.size() - 1) begin += 1, count = 1;
  TESSERA_ASSIGN_OR_RETURN(SaveReport third, save(begin, count, 3));
  if (comm.size() >= 2) {
    TESSERA_RETURN_IF_ERROR(Expect(!third.plan_cache_hit, "a changed layout plans again"));
  }
  return check(3);
}

// Data-parallel replicas load the same shards: with read sharing, storage reads add up to the
// unique bytes needed, whatever the number of replicas, and every element still arrives.
Status ReadSharingReadsEachByteOnce(Comm& comm, const std::string& dir, ReadSharing sharing) {
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(4 << 20, 2);
  const workload::Layout layout = SaveLayout(comm.size());
  workload::RankState saved = workload::BuildRankState(config, layout, comm.rank(), true);
  TESSERA_RETURN_IF_ERROR(Save(saved.dict, dir + "/ck", comm).status());
  workload::RankState loaded = workload::BuildRankState(config, layout, comm.rank(), false);
  LoadOptions options;
  options.read_sharing = sharing;
  options.exchange_bytes = 64 << 10;  // many rounds
  TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(loaded.dict, dir + "/ck", comm, options));
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, workload::CheckRankState(loaded)));
  // The bytes of this rank's boxes (shared with its data-parallel replicas, which hold the
  // same boxes) and of its flat ranges (a distributed optimizer's shards: its own).
  int64_t box_bytes = 0, flat_bytes = 0;
  for (const StateEntry& entry : loaded.dict.entries()) {
    if (const auto* t = std::get_if<ShardedTensor>(&entry)) {
      (t->flat_range ? flat_bytes : box_bytes) += static_cast<int64_t>(t->data.NumBytes());
    }
  }
  std::vector<int64_t> totals = {static_cast<int64_t>(report.bytes_read),
                                 static_cast<int64_t>(report.bytes_received), box_bytes, flat_bytes,
                                 static_cast<int64_t>(report.bytes_received_in_place)};
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(totals, ReduceOp::kSum));
  // The replicas read their boxes once between them; flat ranges and the small
  // "optimizer.step" object are read by the rank that needs them.
  const int64_t object_bytes = 9 * comm.size();
  const int64_t expected = totals[2] / layout.dp + totals[3] + object_bytes;
  if (sharing == ReadSharing::kReadOnce) {  // the blocks at flat ranges' edges are shared too
    TESSERA_RETURN_IF_ERROR(ExpectReadOnce(comm, report));
    // Replicas receive whole cells of their boxes: those land in place; only the cells at the
    // flat ranges' edges hold bytes a receiver does not need.
    TESSERA_RETURN_IF_ERROR(
        Expect(totals[4] <= totals[1] && (layout.dp == 1 || 2 * totals[4] >= totals[1]),
               "bytes received in place (" + std::to_string(totals[4]) + ") are most of the " +
                   std::to_string(totals[1]) + " received"));
    TESSERA_RETURN_IF_ERROR(
        Expect(totals[0] <= expected && totals[0] == static_cast<int64_t>(report.job_bytes_read),
               "storage reads (" + std::to_string(totals[0]) +
                   ") at most the boxes once per "
                   "group of replicas plus the flat ranges and objects (" +
                   std::to_string(expected) + ")"));
    return Expect(layout.dp == 1 || totals[1] > 0, "replicas received their share by exchange");
  }
  TESSERA_RETURN_IF_ERROR(
      Expect(totals[0] == expected, "storage reads (" + std::to_string(totals[0]) +
                                        ") equal the boxes once per group of replicas plus the "
                                        "flat ranges and objects (" +
                                        std::to_string(expected) + ")"));
  return Expect(layout.dp == 1 || totals[1] > 0, "replicas received their share by exchange");
}

// The demo's resharding (tensor-parallel 2 to 4, or to all ranks): the job reads each byte of
// the checkpoint once, with rounds of any size, and every element arrives; each rank reading
// for itself reads more.
Status ReadOnceReshardsReadingEachByteOnce(Comm& comm, const std::string& dir) {
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(6 << 20, 3);
  workload::RankState saved =
      workload::BuildRankState(config, SaveLayout(comm.size()), comm.rank(), true);
  TESSERA_RETURN_IF_ERROR(Save(saved.dict, dir + "/ck", comm).status());
  workload::Layout load;
  load.tp = comm.size() % 4 == 0 ? 4 : comm.size();
  load.dp = comm.size() / load.tp;
  uint64_t job_read = 0;
  for (const uint64_t exchange : {256ull << 20, 300ull << 10, 1ull}) {
    workload::RankState loaded = workload::BuildRankState(config, load, comm.rank(), false);
    LoadOptions options;
    options.read_sharing = ReadSharing::kReadOnce;
    options.exchange_bytes = exchange;
    TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(loaded.dict, dir + "/ck", comm, options));
    TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, workload::CheckRankState(loaded)));
    TESSERA_RETURN_IF_ERROR(ExpectReadOnce(comm, report));
    TESSERA_RETURN_IF_ERROR(Expect(report.job_bytes_read * 100 <= report.job_bytes_needed * 105,
                                   "the job reads at most 1.05x the bytes it needs (read " +
                                       std::to_string(report.job_bytes_read) + ", needed " +
                                       std::to_string(report.job_bytes_needed) + ")"));
    TESSERA_RETURN_IF_ERROR(
        Expect(comm.size() == 1 || report.job_bytes_exchanged > 0, "ranks exchanged bytes"));
    job_read = report.job_bytes_read;
  }
  workload::RankState loaded = workload::BuildRankState(config, load, comm.rank(), false);
  LoadOptions alone;
  alone.read_sharing = ReadSharing::kNone;
  TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(loaded.dict, dir + "/ck", comm, alone));
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, workload::CheckRankState(loaded)));
  std::vector<int64_t> total = {static_cast<int64_t>(report.bytes_read)};
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(total, ReduceOp::kSum));
  return Expect(total[0] >= static_cast<int64_t>(job_read),
                "ranks reading alone read at least as much (" + std::to_string(total[0]) + " vs " +
                    std::to_string(job_read) + ")");
}

// Rank 0 needs nothing; the others load the state as data-parallel replicas.
Status ReadOnceWithARankThatNeedsNothing(Comm& comm, const std::string& dir) {
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(2 << 20, 2);
  workload::RankState saved =
      workload::BuildRankState(config, SaveLayout(comm.size()), comm.rank(), true);
  TESSERA_RETURN_IF_ERROR(Save(saved.dict, dir + "/ck", comm).status());
  const workload::Layout load{.tp = 1, .pp = 1, .dp = comm.size() - 1};
  StateDict nothing;
  workload::RankState loaded =
      workload::BuildRankState(config, load, std::max(comm.rank() - 1, 0), false);
  LoadOptions once;
  once.read_sharing = ReadSharing::kReadOnce;
  TESSERA_ASSIGN_OR_RETURN(LoadReport report,
                           Load(comm.rank() == 0 ? nothing : loaded.dict, dir + "/ck", comm, once));
  TESSERA_RETURN_IF_ERROR(Expect(comm.rank() != 0 || report.bytes_read == 0,
                                 "a rank that needs nothing reads nothing"));
  TESSERA_RETURN_IF_ERROR(
      AgreeOnStatus(comm, comm.rank() == 0 ? Status::Ok() : workload::CheckRankState(loaded)));
  return ExpectReadOnce(comm, report);
}

// A storage whose data file reads fail on their `fail_at`-th call, after, with `comm`, aborting
// it (the rank "dies" mid-exchange).
class FailingReads : public StorageWrapper {
 public:
  FailingReads(std::shared_ptr<Storage> base, int fail_at, Comm* abort)
      : StorageWrapper(std::move(base)), fail_at_(fail_at), abort_(abort) {}
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, target().NewReadableFile(path));
    if (path.find(".safetensors") == std::string::npos) return file;
    return std::unique_ptr<ReadableFile>(new File(std::move(file), this));
  }

 private:
  class File : public ReadableFile {
   public:
    File(std::unique_ptr<ReadableFile> base, FailingReads* owner)
        : base_(std::move(base)), owner_(owner) {}
    Status ReadAt(uint64_t offset, void* dst, size_t n) const override {
      if (owner_->calls_.fetch_add(1) + 1 == owner_->fail_at_) {
        const Status failure = IOError("injected read failure at offset " + std::to_string(offset) +
                                       " of " + base_->path());
        if (owner_->abort_) owner_->abort_->Abort(failure);
        return failure;
      }
      return base_->ReadAt(offset, dst, n);
    }
    uint64_t size() const override { return base_->size(); }
    const std::string& path() const override { return base_->path(); }

   private:
    std::unique_ptr<ReadableFile> base_;
    FailingReads* owner_;
  };
  const int fail_at_;
  Comm* abort_;
  std::atomic<int> calls_{0};
};

// Every rank loads a tensor whole (so every block is shared); the last rank's reads fail, or
// it aborts the communicator as it fails. Every rank's load fails naming it; nothing hangs.
Status ReadOnceReaderFailureFailsEveryRank(Comm& comm, const std::string& dir) {
  std::vector<float> data(1 << 20);  // 4 MiB: 16 blocks
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i);
  const int64_t rows = 1024, cols = 1024;
  StateDict state;
  const int64_t mine = rows / comm.size() + (comm.rank() < rows % comm.size() ? 1 : 0);
  const int64_t first =
      comm.rank() * (rows / comm.size()) + std::min<int64_t>(comm.rank(), rows % comm.size());
  TESSERA_RETURN_IF_ERROR(state.Add(
      ShardedTensor::Shard("w", TensorView(data.data() + first * cols, DType::kF32, {mine, cols}),
                           {rows, cols}, {first, 0})));
  TESSERA_RETURN_IF_ERROR(Save(state, dir + "/ck", comm).status());
  const int victim = comm.size() - 1;
  for (const bool dies : {false, true}) {
    // A fresh communicator each time: an aborted one stays aborted.
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> sub, comm.Split(0, comm.rank()));
    std::vector<float> whole(data.size(), -1.0f);
    StateDict loaded;
    TESSERA_RETURN_IF_ERROR(
        loaded.Add(ShardedTensor::Whole("w", TensorView(whole.data(), DType::kF32, {rows, cols}))));
    LoadOptions options;
    options.read_sharing = ReadSharing::kReadOnce;
    options.exchange_bytes = 1 << 20;  // several rounds
    if (comm.rank() == victim) {
      options.storage =
          std::make_shared<FailingReads>(NewPosixStorage(), 3, dies ? sub.get() : nullptr);
    }
    Status s = Load(loaded, dir + "/ck", *sub, options).status();
    TESSERA_RETURN_IF_ERROR(
        ExpectError(s, {"rank " + std::to_string(victim), "injected read failure"}));
  }
  return Status::Ok();
}

// A training loop: all-reduces on the caller's comm while saves run in the background; each
// checkpoint holds the values of the step that staged it. With kDeferred, the optimizer step
// (the fill) waits for the last save's staging, which checks that the weights did not change.
Status AsyncSaveDuringTraining(Comm& comm, const std::string& dir, StagingMode staging) {
  std::vector<float> weights(4096);
  auto dict = [&] {
    StateDict state;
    (void)state.Add(ShardedTensor::Shard("w", TensorView(weights.data(), DType::kF32, {4096}),
                                         {4096 * comm.size()}, {4096 * comm.rank()}));
    return state;
  };
  std::vector<std::pair<AsyncSaveHandle, int>> saves;
  for (int step = 0; step < 12; ++step) {
    std::vector<int64_t> gradient = {step, 1};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(gradient, ReduceOp::kSum));
    TESSERA_RETURN_IF_ERROR(Expect(gradient[0] == step * comm.size() && gradient[1] == comm.size(),
                                   "the training all-reduce is not disturbed by the save"));
    if (!saves.empty()) TESSERA_RETURN_IF_ERROR(saves.back().first.WaitStaged());
    std::fill(weights.begin(), weights.end(), static_cast<float>(step));
    if (step % 4 == 1) {
      AsyncSaveOptions options;
      options.when_busy = step % 8 == 1 ? WhenBusy::kQueue : WhenBusy::kWait;
      options.staging = staging;
      options.check_unchanged_until_staged = true;  // ignored with kBlocking
      options.staging_piece_bytes = 4096;           // 4 pieces per rank
      StateDict state = dict();
      TESSERA_ASSIGN_OR_RETURN(
          AsyncSaveHandle handle,
          AsyncSave(state, dir + "/step" + std::to_string(step), comm, options));
      saves.emplace_back(handle, step);
    }
  }
  for (auto& [handle, step] : saves) {
    TESSERA_RETURN_IF_ERROR(handle.Wait());
    std::fill(weights.begin(), weights.end(), -1.0f);
    StateDict state = dict();
    TESSERA_RETURN_IF_ERROR(Load(state, dir + "/step" + std::to_string(step), comm).status());
    TESSERA_RETURN_IF_ERROR(
        Expect(std::all_of(weights.begin(), weights.end(),
                           [&](float v) { return v == static_cast<float>(step); }),
               "checkpoint of step " + std::to_string(step) + " holds that step's values"));
  }
  return Status::Ok();
}

// ---- rank-local saves (SaveOptions::collective false) ------------------------------------------

SaveOptions RankLocal(const std::string& tag) {
  SaveOptions options;
  options.collective = false;
  options.save_tag = tag;
  return options;
}

// A transformer-like state saved with no collective, loaded under another layout (before and
// after Finalize), and saved again asynchronously.
Status RankLocalSaveReshards(Comm& comm, const std::string& dir) {
  const workload::ModelConfig config = workload::ModelConfig::ForBytes(4 << 20, 2);
  const workload::Layout save = SaveLayout(comm.size());
  workload::RankState saved = workload::BuildRankState(config, save, comm.rank(), true);
  TESSERA_ASSIGN_OR_RETURN(SaveReport report,
                           Save(saved.dict, dir + "/ck", comm, RankLocal("step-1")));
  TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> written, [&]() -> Result<std::vector<int64_t>> {
    std::vector<int64_t> v = {static_cast<int64_t>(report.bytes_written)};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(v, ReduceOp::kSum));
    return v;
  }());
  TESSERA_RETURN_IF_ERROR(
      Expect(written[0] == static_cast<int64_t>(config.StateBytes()),
             "the ranks together wrote each unique byte once (replicas not main write nothing)"));
  const workload::Layout load{.tp = comm.size(), .pp = 1, .dp = 1};
  auto load_and_check = [&]() -> Status {
    workload::RankState loaded = workload::BuildRankState(config, load, comm.rank(), false);
    TESSERA_RETURN_IF_ERROR(Load(loaded.dict, dir + "/ck", comm).status());
    return AgreeOnStatus(comm, workload::CheckRankState(loaded));
  };
  TESSERA_RETURN_IF_ERROR(load_and_check());
  TESSERA_ASSIGN_OR_RETURN(Metadata parts, ReadMetadata(dir + "/ck"));
  TESSERA_RETURN_IF_ERROR(Expect(parts.num_ranks == comm.size(), "num_ranks of the parts"));
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, Verify(dir + "/ck").status()));
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  if (comm.rank() == 0) TESSERA_RETURN_IF_ERROR(Finalize(dir + "/ck").status());
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, NewPosixStorage()->ListDir(dir + "/ck"));
  for (const std::string& name : names) {
    TESSERA_RETURN_IF_ERROR(Expect(name.find(".rank-") == std::string::npos,
                                   "Finalize removed the rank manifests, found " + name));
  }
  TESSERA_RETURN_IF_ERROR(load_and_check());
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  // Asynchronous, still without a collective; the newer save wins over the finalized one.
  AsyncSaveOptions async_options;
  async_options.save = RankLocal("step-2");
  async_options.staging = StagingMode::kDeferred;
  TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle,
                           AsyncSave(saved.dict, dir + "/ck", comm, async_options));
  TESSERA_RETURN_IF_ERROR(handle.Wait());
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  TESSERA_ASSIGN_OR_RETURN(Metadata newest, ReadMetadata(dir + "/ck"));
  TESSERA_RETURN_IF_ERROR(Expect(newest.save_id != parts.save_id, "the newer save is read"));
  TESSERA_RETURN_IF_ERROR(load_and_check());
  // A tag is a save: saving it again is refused, naming it.
  Status again = Save(saved.dict, dir + "/ck", comm, RankLocal("step-2")).status();
  return ExpectError(again, {"already saved tag 'step-2'"});
}

// One rank that dies mid-save (its storage fails part-way): the save is reported incomplete,
// naming the rank, and the previous checkpoint in the directory stays what loads.
Status RankLocalSaveMissingARankKeepsThePrevious(Comm& comm, const std::string& dir) {
  std::vector<float> data(1000);
  StateDict state;
  TESSERA_RETURN_IF_ERROR(
      state.Add(ShardedTensor::Shard("w", TensorView(data.data(), DType::kF32, {1000}),
                                     {1000 * comm.size()}, {1000 * comm.rank()})));
  std::fill(data.begin(), data.end(), 1.0f);
  TESSERA_RETURN_IF_ERROR(Save(state, dir + "/ck", comm).status());  // collective, step 1
  std::fill(data.begin(), data.end(), 2.0f);
  const int victim = comm.size() - 1;
  SaveOptions options = RankLocal("step-2");
  if (comm.rank() == victim) {
    options.storage = std::make_shared<FaultInjectingStorage>(
        NewPosixStorage(), FaultPlan{.fail_at = 1, .crash = true, .path_filter = "tsr-"});
  }
  Status saved = Save(state, dir + "/ck", comm, options).status();
  TESSERA_RETURN_IF_ERROR(
      Expect(saved.ok() == (comm.rank() != victim), "only the victim's save fails"));
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  std::fill(data.begin(), data.end(), 0.0f);
  TESSERA_RETURN_IF_ERROR(Load(state, dir + "/ck", comm).status());
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(
      comm, Expect(std::all_of(data.begin(), data.end(), [](float v) { return v == 1.0f; }),
                   "the previous checkpoint loads")));
  // Without a previous checkpoint: an error naming the missing rank.
  if (comm.rank() != victim) {
    TESSERA_RETURN_IF_ERROR(Save(state, dir + "/alone", comm, RankLocal("step-2")).status());
  }
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  Status incomplete = Load(state, dir + "/alone", comm).status();
  TESSERA_RETURN_IF_ERROR(
      ExpectError(incomplete, {"lacks the manifests of rank " + std::to_string(victim) + " (of " +
                               std::to_string(comm.size()) + ")"}));
  if (comm.rank() == 0) {
    TESSERA_RETURN_IF_ERROR(
        ExpectError(Finalize(dir + "/alone").status(), {"rank " + std::to_string(victim)}));
  }
  return Status::Ok();
}

// A box no rank holds as the main replica is a gap the readers name.
Status RankLocalSaveGapIsNamed(Comm& comm, const std::string& dir) {
  std::vector<float> data(8, 1.0f);
  ShardedTensor tensor =
      ShardedTensor::Shard("layers.0.w", TensorView(data.data(), DType::kF32, {8}),
                           {8 * comm.size()}, {8 * comm.rank()});
  if (comm.rank() == comm.size() - 1) tensor.replica_id = {1};  // claims a replica of nobody
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(std::move(tensor)));
  TESSERA_RETURN_IF_ERROR(Save(state, dir + "/ck", comm, RankLocal("gap")).status());
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  return ExpectError(Load(state, dir + "/ck", comm).status(), {"key 'layers.0.w'"});
}

// Rank-local and collective saves alternating in one directory with no pause between them: each
// is the newer checkpoint as soon as it is complete, the collective one's cleanup removes the
// rank-local one before it, and Finalize beside them keeps what loads.
Status RankLocalAndCollectiveSavesAlternate(Comm& comm, const std::string& dir) {
  std::vector<float> data(64);
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
      "w", TensorView(data.data(), DType::kF32, {64}), {64 * comm.size()}, {64 * comm.rank()})));
  auto save_and_check = [&](float value, const SaveOptions& options) -> Status {
    std::fill(data.begin(), data.end(), value);
    TESSERA_RETURN_IF_ERROR(Save(state, dir + "/ck", comm, options).status());
    TESSERA_RETURN_IF_ERROR(comm.Barrier());
    std::fill(data.begin(), data.end(), 0.0f);
    TESSERA_RETURN_IF_ERROR(Load(state, dir + "/ck", comm).status());
    return AgreeOnStatus(
        comm, Expect(std::all_of(data.begin(), data.end(), [&](float v) { return v == value; }),
                     "the save of " + std::to_string(value) + " is what loads"));
  };
  TESSERA_RETURN_IF_ERROR(save_and_check(1.0f, RankLocal("a")));
  TESSERA_RETURN_IF_ERROR(save_and_check(2.0f, SaveOptions{}));
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, NewPosixStorage()->ListDir(dir + "/ck"));
  for (const std::string& name : names) {
    TESSERA_RETURN_IF_ERROR(Expect(name.find(".rank-") == std::string::npos,
                                   "the collective save removed the rank-local one: " + name));
  }
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  TESSERA_RETURN_IF_ERROR(save_and_check(3.0f, RankLocal("b")));
  if (comm.rank() == 0) TESSERA_RETURN_IF_ERROR(Finalize(dir + "/ck").status());
  TESSERA_RETURN_IF_ERROR(comm.Barrier());
  TESSERA_RETURN_IF_ERROR(save_and_check(4.0f, RankLocal("c")));
  return save_and_check(5.0f, SaveOptions{});
}

// ---- several pieces of one key on one rank (issue 21)
// --------------------------------------------

// One rank's state for random layouts in which it holds several boxes and flat ranges of a key
// (testing/random_pieces.h), each piece with its own buffer.
Status BuildPiecesState(const std::vector<RandomTensor>& tensors,
                        const std::vector<std::vector<std::vector<testing::PieceSpec>>>& layouts,
                        int layout_rank, bool fill, StateDict& state,
                        std::vector<std::vector<uint8_t>>& buffers) {
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (const testing::PieceSpec& piece : layouts[t][layout_rank]) {
      buffers.emplace_back(piece.NumElements() * DTypeSize(tensors[t].dtype), uint8_t{0xEE});
      ShardedTensor tensor = testing::PieceTensor(tensors[t].key, piece, buffers.back().data(),
                                                  tensors[t].dtype, tensors[t].shape);
      if (fill) FillPattern(tensor);
      TESSERA_RETURN_IF_ERROR(state.Add(std::move(tensor)));
    }
  }
  return Status::Ok();
}

// Saves `state` the way trial `trial` picks: collective (the tessera or the torch_dist format,
// balanced writes or not), asynchronous (blocking or deferred staging) or rank-local.
Status SavePiecesAs(Comm& comm, const StateDict& state, const std::string& path, int trial) {
  SaveOptions options;
  options.sync = SyncPolicy::kNone;
  options.balance_writes = trial % 2 == 1;
  switch (trial % 5) {
    case 0:
    case 1: {
      TESSERA_ASSIGN_OR_RETURN(SaveReport first, Save(state, path, comm, options));
      // The same layout again: the plan cache serves it.
      TESSERA_ASSIGN_OR_RETURN(SaveReport second, Save(state, path, comm, options));
      return Expect(!first.plan_cache_hit && second.plan_cache_hit,
                    "the second save of an unchanged layout reuses the plan");
    }
    case 2:
      options.format = CheckpointFormat::kTorchDist;
      return Save(state, path, comm, options).status();
    case 3: {
      AsyncSaveOptions async_options;
      async_options.save = options;
      async_options.staging = trial % 2 ? StagingMode::kDeferred : StagingMode::kBlocking;
      async_options.staging_piece_bytes = 4096;  // the least: a piece spans several entries
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle, AsyncSave(state, path, comm, async_options));
      return handle.Wait();
    }
    default:
      options = RankLocal("trial" + std::to_string(trial));
      options.sync = SyncPolicy::kNone;
      TESSERA_RETURN_IF_ERROR(Save(state, path, comm, options).status());
      TESSERA_RETURN_IF_ERROR(comm.Barrier());  // every rank's part is there before any loads
      if (trial % 10 == 9) {                    // half of them merged into one manifest
        Status finalized = comm.rank() == 0 ? Finalize(path).status() : Status::Ok();
        TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, finalized));
      }
      return Status::Ok();
  }
}

// Random layouts in which ranks hold several boxes and flat ranges of one key (stacked layers
// with a flat range of each, several local shards, replicas), saved in every way a save can
// run and loaded into other such layouts, some ranks data-parallel replicas of others (read
// sharing). Bit-exact, and Verify passes.
Status SeveralPiecesPerKeyPerRank(Comm& comm, const std::string& dir) {
  const uint64_t seed = 20260521;
  std::mt19937_64 rng(seed);  // the same sequence on every rank: they agree on the layouts
  const int trials = 30;
  for (int trial = 0; trial < trials; ++trial) {
    const std::string where = "seed " + std::to_string(seed) + " trial " + std::to_string(trial);
    std::vector<RandomTensor> tensors(1 + rng() % 3);
    for (size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].key = "layers.t" + std::to_string(t);
      tensors[t].dtype = kPropertyDTypes[rng() % std::size(kPropertyDTypes)];
      const size_t rank = rng() % 4;
      for (size_t d = 0; d < rank; ++d) {
        tensors[t].shape.push_back(1 + static_cast<int64_t>(rng() % (rank <= 2 ? 12 : 5)));
      }
    }
    // Load: `groups` distinct layouts; rank r takes layout r % groups, so the ranks of one group
    // are data-parallel replicas that need the same bytes.
    const int groups = 1 + static_cast<int>(rng() % comm.size());
    std::vector<std::vector<std::vector<testing::PieceSpec>>> save_layout, load_layout;
    for (const RandomTensor& t : tensors) {
      save_layout.push_back(testing::RandomPiecesLayout(t.shape, comm.size(), rng, true));
      load_layout.push_back(testing::RandomPiecesLayout(t.shape, groups, rng, false));
    }
    const std::string path = dir + "/pieces" + std::to_string(trial);
    // Loads the checkpoint at `from` into the load layout and checks every element.
    auto load_and_check = [&](const std::string& from) -> Status {
      StateDict loaded;
      std::vector<std::vector<uint8_t>> load_buffers;
      TESSERA_RETURN_IF_ERROR(BuildPiecesState(tensors, load_layout, comm.rank() % groups, false,
                                               loaded, load_buffers));
      LoadOptions load_options;
      load_options.verify_checksums = trial % 3 != 2;
      constexpr ReadSharing kSharing[] = {ReadSharing::kNone, ReadSharing::kAllGather,
                                          ReadSharing::kBroadcast, ReadSharing::kReadOnce};
      load_options.read_sharing = kSharing[trial % 4];
      load_options.exchange_bytes = 512;  // several rounds
      TESSERA_RETURN_IF_ERROR(Load(loaded, from, comm, load_options).status());
      Status check;
      for (const StateEntry& entry : loaded.entries()) {
        check = CheckPattern(std::get<ShardedTensor>(entry));
        if (!check.ok()) break;
      }
      return AgreeOnStatus(comm, check);
    };
    Status status = [&]() -> Status {
      StateDict saved;
      std::vector<std::vector<uint8_t>> save_buffers;
      TESSERA_RETURN_IF_ERROR(
          BuildPiecesState(tensors, save_layout, comm.rank(), true, saved, save_buffers));
      TESSERA_RETURN_IF_ERROR(SavePiecesAs(comm, saved, path, trial));
      TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, Verify(path).status()));
      TESSERA_RETURN_IF_ERROR(load_and_check(path));
      if (trial % 5 != 0) return Status::Ok();
      // Convert reads a checkpoint saved in pieces like any other.
      ConvertOptions convert;
      convert.max_file_bytes = 1024;  // several files
      TESSERA_RETURN_IF_ERROR(Convert(path, path + "_hf", convert, comm).status());
      return load_and_check(path + "_hf");
    }();
    TESSERA_RETURN_IF_ERROR_CTX(status, where);
  }
  return Status::Ok();
}

// Pieces of one key that overlap on one rank fail the save and the load on every rank, naming
// the rank, the key and both pieces; the checkpoint saved before stays.
Status OverlappingPiecesOfOneRankAreRejectedEverywhere(Comm& comm, const std::string& dir) {
  const int victim = comm.size() - 1;
  std::vector<float> rows(8, 1.0f), extra(3, 2.0f);
  const Shape shape = {2 * comm.size(), 4};
  StateDict state;
  TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::Shard(
      "w", TensorView(rows.data(), DType::kF32, {2, 4}), shape, {2 * comm.rank(), 0})));
  TESSERA_RETURN_IF_ERROR(Save(state, dir + "/ck", comm).status());
  TESSERA_ASSIGN_OR_RETURN(Metadata before, ReadMetadata(dir + "/ck"));
  if (comm.rank() == victim) {  // the flat range [1, 4) of its second row, which it holds already
    TESSERA_RETURN_IF_ERROR(state.Add(ShardedTensor::FlatShard(
        "w", TensorView(extra.data(), DType::kF32, {3}), shape, {2 * victim + 1, 0}, {1, 4}, 1)));
  }
  const std::string v = std::to_string(2 * victim);
  const std::string v1 = std::to_string(2 * victim + 1);
  const std::string v2 = std::to_string(2 * victim + 2);
  const std::string pieces = "tensor 'w': this rank holds pieces of it that overlap: local box [" +
                             v + ":" + v2 + ", 0:4] and local box [" + v1 + ":" + v2 +
                             ", 0:4] flat range [1, 4) share the elements [" + v1 + ":" + v2 +
                             ", 1:4]";
  const std::string who = comm.size() > 1 ? "rank " + std::to_string(victim) : "tensor 'w'";
  TESSERA_RETURN_IF_ERROR(ExpectError(Save(state, dir + "/ck", comm).status(), {who, pieces}));
  TESSERA_ASSIGN_OR_RETURN(Metadata after, ReadMetadata(dir + "/ck"));
  TESSERA_RETURN_IF_ERROR(
      Expect(after.save_id == before.save_id, "the checkpoint saved before the refused one stays"));
  std::fill(rows.begin(), rows.end(), 0.0f);
  TESSERA_RETURN_IF_ERROR(ExpectError(Load(state, dir + "/ck", comm).status(), {who, pieces}));
  return Expect(std::all_of(rows.begin(), rows.end(), [](float x) { return x == 0.0f; }),
                "a refused load touches no memory");
}

}  // namespace

const std::vector<MultiRankCase>& MultiRankCases() {
  static const std::vector<MultiRankCase> cases = {
      {"ReshardModelStateToFullTensorParallel", 1,
       [](Comm& c, const std::string& d) {
         return ReshardModelState(c, d, workload::Layout{.tp = c.size(), .pp = 1, .dp = 1});
       }},
      {"ReshardModelStateToFullDataParallel", 1,
       [](Comm& c, const std::string& d) {
         return ReshardModelState(c, d, workload::Layout{.tp = 1, .pp = 1, .dp = c.size()});
       }},
      {"RandomLayoutsReshardBitExact", 1, RandomResharding},
      {"OverlapIsRejectedEverywhere", 2, OverlapIsRejectedEverywhere},
      {"DtypeDisagreementIsRejectedEverywhere", 2, DtypeDisagreementIsRejectedEverywhere},
      {"FailingRankStorageFailsTheSave", 2, FailingRankStorageFailsTheSave},
      {"MissingKeyOnOneRankFailsTheLoadEverywhere", 2, MissingKeyOnOneRankFailsTheLoadEverywhere},
      {"BalancedWritesSpreadReplicatedBytes", 1, BalancedWritesSpreadReplicatedBytes},
      {"ObjectsPerRankAndShared", 1, ObjectsPerRankAndShared},
      {"PlanCacheReusesPlansAndNoticesChanges", 1, PlanCacheReusesPlansAndNoticesChanges},
      {"AsyncSaveDuringTraining", 1,
       [](Comm& comm, const std::string& dir) {
         return AsyncSaveDuringTraining(comm, dir, StagingMode::kBlocking);
       }},
      {"AsyncSaveWithDeferredStagingDuringTraining", 1,
       [](Comm& comm, const std::string& dir) {
         return AsyncSaveDuringTraining(comm, dir, StagingMode::kDeferred);
       }},
      {"ReadSharingByAllGatherReadsEachByteOnce", 1,
       [](Comm& c, const std::string& d) {
         return ReadSharingReadsEachByteOnce(c, d, ReadSharing::kAllGather);
       }},
      {"ReadSharingByBroadcastReadsEachByteOnce", 1,
       [](Comm& c, const std::string& d) {
         return ReadSharingReadsEachByteOnce(c, d, ReadSharing::kBroadcast);
       }},
      {"ReadSharingReadOnceReadsEachByteOnce", 1,
       [](Comm& c, const std::string& d) {
         return ReadSharingReadsEachByteOnce(c, d, ReadSharing::kReadOnce);
       }},
      {"ReadOnceReshardsReadingEachByteOnce", 1, ReadOnceReshardsReadingEachByteOnce},
      {"ReadOnceWithARankThatNeedsNothing", 2, ReadOnceWithARankThatNeedsNothing},
      {"ReadOnceReaderFailureFailsEveryRank", 2, ReadOnceReaderFailureFailsEveryRank},
      {"RankLocalSaveReshards", 1, RankLocalSaveReshards},
      {"RankLocalSaveMissingARankKeepsThePrevious", 2, RankLocalSaveMissingARankKeepsThePrevious},
      {"RankLocalSaveGapIsNamed", 2, RankLocalSaveGapIsNamed},
      {"RankLocalAndCollectiveSavesAlternate", 1, RankLocalAndCollectiveSavesAlternate},
      {"SeveralPiecesPerKeyPerRank", 1, SeveralPiecesPerKeyPerRank},
      {"OverlappingPiecesOfOneRankAreRejectedEverywhere", 1,
       OverlappingPiecesOfOneRankAreRejectedEverywhere},
  };
  return cases;
}

}  // namespace tessera::suite
