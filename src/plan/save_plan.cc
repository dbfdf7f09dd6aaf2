#include "plan/save_plan.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <numeric>
#include <queue>
#include <set>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "core/byte_io.h"
#include "plan/flat_range.h"
#include "plan/local_pieces.h"

namespace tessera {
namespace {

std::string RanksToString(const std::vector<int32_t>& ranks) {
  std::string out;
  size_t shown = std::min<size_t>(ranks.size(), 8);
  for (size_t i = 0; i < shown; ++i) {
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
  }
  if (ranks.size() > shown) out += ", ... (" + std::to_string(ranks.size()) + " ranks)";
  return out;
}

}  // namespace

// ---- local plan ----------------------------------------------------------------------------

Result<LocalPlan> BuildLocalPlan(const StateDict& state) {
  LocalPlan plan;
  const auto& entries = state.entries();
  plan.items.reserve(entries.size());
  for (uint32_t i = 0; i < entries.size(); ++i) {
    if (const auto* object = std::get_if<ShardedObject>(&entries[i])) {
      LocalItem item;
      item.key = object->key;
      item.kind = ItemKind::kObject;
      item.replica_id = object->replica_id;
      item.num_bytes = object->data.size();
      item.object_encoding = object->encoding;
      item.entry_index = i;
      plan.items.push_back(std::move(item));
      continue;
    }
    const auto& tensor = std::get<ShardedTensor>(entries[i]);
    TESSERA_RETURN_IF_ERROR(tensor.Validate());
    const size_t element_size = DTypeSize(tensor.data.dtype);
    Box local = tensor.LocalBox();
    // `holds_elements` false: an item that holds nothing (num_bytes 0) but tells the
    // coordinator the tensor's dtype and shape.
    auto add = [&](Box box, uint64_t byte_offset, bool holds_elements = true) {
      LocalItem item;
      item.key = tensor.key;
      item.kind = ItemKind::kTensor;
      item.dtype = tensor.data.dtype;
      item.partial = tensor.partial;
      item.global_shape = tensor.global_shape;
      item.num_bytes = holds_elements ? static_cast<uint64_t>(box.NumElements()) * element_size : 0;
      item.box = std::move(box);
      item.replica_id = tensor.replica_id;
      item.entry_index = i;
      item.byte_offset = byte_offset;
      plan.items.push_back(std::move(item));
    };
    if (!tensor.flat_range) {
      add(std::move(local), 0);
      continue;
    }
    const FlatRange range = *tensor.flat_range;
    std::vector<FlatPiece> pieces = FlatRangeToBoxes(local, range.begin, range.end);
    if (pieces.empty()) {
      // Holds no element, but still tells the coordinator the tensor's dtype and shape.
      // (For a 0-d tensor that box, with no dimensions, still has an element: num_bytes 0
      // says it holds none.)
      add(Box(local.offsets, Shape(local.rank(), 0)), 0, /*holds_elements=*/false);
    }
    for (FlatPiece& piece : pieces) {
      add(std::move(piece.box),
          static_cast<uint64_t>(piece.flat_begin - range.begin) * element_size);
    }
  }
  // Several pieces of a key are items like any others from here on (each written from its own
  // entry's memory); they only must not overlap.
  TESSERA_RETURN_IF_ERROR(CheckLocalPiecesDisjoint(state));
  return plan;
}

Bytes EncodeLocalPlan(const LocalPlan& plan, bool with_replica_ids) {
  Bytes out;
  out.reserve(plan.items.size() * 64);
  ByteWriter w(&out);
  w.Put<uint32_t>(static_cast<uint32_t>(plan.items.size()));
  for (const LocalItem& item : plan.items) {
    w.PutString(item.key);
    w.Put<uint8_t>(static_cast<uint8_t>(item.kind));
    w.Put<uint8_t>(static_cast<uint8_t>(item.dtype));
    w.Put<uint8_t>(static_cast<uint8_t>(item.object_encoding));
    w.Put<uint8_t>(item.partial ? 1 : 0);
    w.Put<uint8_t>(static_cast<uint8_t>(item.global_shape.size()));
    w.PutBytes(item.global_shape.data(), item.global_shape.size() * sizeof(int64_t));
    w.PutBytes(item.box.offsets.data(), item.box.rank() * sizeof(int64_t));
    w.PutBytes(item.box.sizes.data(), item.box.rank() * sizeof(int64_t));
    if (with_replica_ids) w.PutVector(item.replica_id);
    w.Put<uint64_t>(item.num_bytes);
  }
  return out;
}

Result<LocalPlan> DecodeLocalPlan(std::span<const uint8_t> bytes, bool with_replica_ids) {
  ByteReader r(bytes);
  uint32_t count = 0;
  TESSERA_RETURN_IF_ERROR(r.Get(&count));
  if (count > bytes.size())
    return DataLoss("local plan: item count " + std::to_string(count) +
                    " exceeds the message size");
  LocalPlan plan;
  plan.items.resize(count);
  for (LocalItem& item : plan.items) {
    uint8_t kind = 0, dtype = 0, encoding = 0, partial = 0, rank = 0;
    TESSERA_RETURN_IF_ERROR(r.GetString(&item.key));
    TESSERA_RETURN_IF_ERROR(r.Get(&kind));
    TESSERA_RETURN_IF_ERROR(r.Get(&dtype));
    TESSERA_RETURN_IF_ERROR(r.Get(&encoding));
    TESSERA_RETURN_IF_ERROR(r.Get(&partial));
    TESSERA_RETURN_IF_ERROR(r.Get(&rank));
    if (kind > 1 || (kind == 0 && !IsValidDType(dtype))) {
      return DataLoss("local plan: bad item kind or dtype for key '" + item.key + "'");
    }
    if (encoding > static_cast<uint8_t>(ObjectEncoding::kJson)) {
      return DataLoss("local plan: bad object encoding for key '" + item.key + "'");
    }
    item.kind = static_cast<ItemKind>(kind);
    item.object_encoding = static_cast<ObjectEncoding>(encoding);
    item.dtype = static_cast<DType>(dtype);
    item.partial = partial != 0;
    item.global_shape.resize(rank);
    item.box.offsets.resize(rank);
    item.box.sizes.resize(rank);
    for (std::span<int64_t> v :
         {std::span<int64_t>(item.global_shape), std::span<int64_t>(item.box.offsets),
          std::span<int64_t>(item.box.sizes)}) {
      for (int64_t& x : v) TESSERA_RETURN_IF_ERROR(r.Get(&x));
    }
    if (with_replica_ids) TESSERA_RETURN_IF_ERROR(r.GetVector(&item.replica_id));
    TESSERA_RETURN_IF_ERROR(r.Get(&item.num_bytes));
  }
  if (!r.AtEnd()) return DataLoss("local plan: trailing bytes");
  return plan;
}

Result<std::vector<LocalPlan>> DecodeLocalPlans(std::span<const std::span<const uint8_t>> encoded,
                                                int threads) {
  std::vector<LocalPlan> plans(encoded.size());
  std::vector<Status> statuses(encoded.size());
  auto decode_range = [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      Result<LocalPlan> plan = DecodeLocalPlan(encoded[r]);
      if (plan.ok()) {
        plans[r] = std::move(*plan);
      } else {
        statuses[r] = plan.status().WithContext("plan of rank " + std::to_string(r));
      }
    }
  };
  const size_t parts = std::clamp<size_t>(threads, 1, std::max<size_t>(1, encoded.size() / 16));
  std::vector<std::thread> workers;
  for (size_t p = 1; p < parts; ++p) {
    workers.emplace_back(decode_range, encoded.size() * p / parts,
                         encoded.size() * (p + 1) / parts);
  }
  decode_range(0, encoded.size() / parts);
  for (std::thread& t : workers) t.join();
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  return plans;
}

// ---- global plan -----------------------------------------------------------------------------

namespace {

// A unique piece to be written once: a tensor chunk or an object.
struct Shard {
  uint64_t num_bytes = 0;
  // The ranks that hold it, ascending: holder_count entries of `holders` from holder_begin
  // (one shared array: most shards have one holder, and a vector each would cost an
  // allocation per chunk).
  uint32_t holder_begin = 0;
  uint32_t holder_count = 0;
  ItemRef writer;
  int32_t tensor = -1;  // index into metadata.tensors, or -1 for an object
  uint32_t index = 0;   // chunk index within the tensor, or object index
};

// "rank 3" or "ranks 3, 131, 259": the ranks the plans of `refs` stand for.
std::string DescribeHolders(std::span<const ItemRef> refs, const SavePlanOptions& options) {
  std::vector<int32_t> ranks;
  for (const ItemRef& h : refs) {
    if (options.ranks_of) {
      std::vector<int32_t> members = options.ranks_of(h.rank);
      ranks.insert(ranks.end(), members.begin(), members.end());
    } else {
      ranks.push_back(h.rank);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return (ranks.size() == 1 ? "rank " : "ranks ") + RanksToString(ranks);
}

// BuildGlobalSavePlan's phases over one set of local plans: group the items by key (sorted),
// turn each group into an object or a tensor's chunks (checking that the ranks agree and that
// the chunks tile the tensor), then choose each shard's writer.
class GlobalPlanBuilder {
 public:
  GlobalPlanBuilder(std::span<const LocalPlan> plans, const SavePlanOptions& options)
      : plans_(plans), options_(options), num_ranks_(static_cast<int32_t>(plans.size())) {}

  Result<GlobalSavePlan> Build() {
    plan_.writes.resize(num_ranks_);
    const std::vector<std::vector<ItemRef>> groups = GroupsByKey();
    // Each key's checks and chunks depend on its items alone: built on several threads for a
    // big plan (a million chunks), then appended in key order, so the plan and the first error
    // reported are the same whatever the thread count.
    std::vector<KeyPart> parts(groups.size());
    ForEachKey(groups, [&](size_t g) { parts[g] = BuildKey(groups[g]); });
    for (size_t g = 0; g < groups.size(); ++g) {
      TESSERA_RETURN_IF_ERROR(parts[g].status);
      Append(std::move(parts[g]));
    }
    TESSERA_RETURN_IF_ERROR(ChooseMainReplicas());
    if (options_.balance_writes) BalanceWrites();
    return Finish();
  }

 private:
  const LocalItem& Item(const ItemRef& ref) const { return plans_[ref.rank].items[ref.item]; }
  std::string Who(const ItemRef& ref) const {
    return DescribeHolders(std::span<const ItemRef>(&ref, 1), options_);
  }
  std::span<const ItemRef> HoldersOf(const Shard& shard) const {
    return std::span<const ItemRef>(holders_).subspan(shard.holder_begin, shard.holder_count);
  }

  // Every item, grouped by key, the groups sorted by key; each group in rank order.
  std::vector<std::vector<ItemRef>> GroupsByKey() {
    std::unordered_map<std::string_view, uint32_t> group_of_key;
    std::vector<std::vector<ItemRef>> groups;
    size_t total_items = 0;
    for (const LocalPlan& p : plans_) total_items += p.items.size();
    group_of_key.reserve(total_items / std::max<int32_t>(num_ranks_, 1) * 2 + 16);
    for (int32_t r = 0; r < num_ranks_; ++r) {
      const auto& items = plans_[r].items;
      for (uint32_t i = 0; i < items.size(); ++i) {
        auto [it, inserted] = group_of_key.try_emplace(items[i].key, groups.size());
        if (inserted) groups.emplace_back();
        groups[it->second].push_back({r, i});
      }
    }
    std::sort(groups.begin(), groups.end(),
              [&](const std::vector<ItemRef>& a, const std::vector<ItemRef>& b) {
                return Item(a[0]).key < Item(b[0]).key;
              });
    shards_.reserve(total_items);
    holders_.reserve(total_items);
    return groups;
  }

  Status CheckSameKind(const std::vector<ItemRef>& refs) const {
    const LocalItem& first = Item(refs[0]);
    for (const ItemRef& ref : refs) {
      const LocalItem& item = Item(ref);
      if (item.kind != first.kind) {
        return InvalidArgument(
            "key '" + first.key + "' is a " +
            (first.kind == ItemKind::kTensor ? "tensor" : "object") + " on " + Who(refs[0]) +
            " but a " + (item.kind == ItemKind::kTensor ? "tensor" : "object") + " on " + Who(ref));
      }
    }
    return Status::Ok();
  }

  // One key's part of the plan, built on its own: a tensor's chunks or an object, and their
  // shards, whose holder_begin, tensor and index are relative to the part until Append.
  struct KeyPart {
    Status status;
    bool object = false;
    TensorInfo tensor;
    ObjectInfo object_info;
    std::vector<Shard> shards;
    std::vector<ItemRef> holders;
  };

  // Calls fn(g) for every group, on SavePlanOptions::threads threads (by default up to 8 when
  // the plan is big enough to gain).
  void ForEachKey(const std::vector<std::vector<ItemRef>>& groups,
                  const std::function<void(size_t)>& fn) const {
    size_t items = 0;
    for (const auto& g : groups) items += g.size();
    constexpr size_t kItemsPerThread = 1 << 16;  // below this, starting a thread costs more
    const size_t wanted = options_.threads > 0
                              ? static_cast<size_t>(options_.threads)
                              : std::min<size_t>({std::max(1u, std::thread::hardware_concurrency()),
                                                  8, items / kItemsPerThread + 1});
    const size_t threads = std::max<size_t>(1, std::min(wanted, groups.size()));
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t g; (g = next.fetch_add(1)) < groups.size();) fn(g);
    };
    std::vector<std::thread> workers;
    for (size_t t = 1; t < threads; ++t) workers.emplace_back(work);
    work();
    for (std::thread& t : workers) t.join();
  }

  KeyPart BuildKey(const std::vector<ItemRef>& refs) const {
    KeyPart part;
    part.status = CheckSameKind(refs);
    if (!part.status.ok()) return part;
    if (Item(refs[0]).kind == ItemKind::kObject) {
      BuildObject(refs, part);
    } else {
      part.status = BuildTensor(refs, part);
    }
    return part;
  }

  // Adds `part` to the plan: its tensor or object, its shards and their holders.
  void Append(KeyPart part) {
    const uint32_t holder_base = static_cast<uint32_t>(holders_.size());
    const uint32_t index_base = static_cast<uint32_t>(part.object ? plan_.metadata.objects.size()
                                                                  : plan_.metadata.tensors.size());
    for (Shard& shard : part.shards) {
      shard.holder_begin += holder_base;
      if (part.object) {
        shard.index = index_base;
      } else {
        shard.tensor = static_cast<int32_t>(index_base);
      }
      shards_.push_back(shard);
    }
    holders_.insert(holders_.end(), part.holders.begin(), part.holders.end());
    if (part.object) {
      plan_.metadata.objects.push_back(std::move(part.object_info));
    } else {
      plan_.metadata.tensors.push_back(std::move(part.tensor));
    }
  }

  // An object: one shard, held by every rank that has it.
  void BuildObject(const std::vector<ItemRef>& refs, KeyPart& part) const {
    const LocalItem& first = Item(refs[0]);
    Shard shard;
    shard.holder_begin = 0;
    shard.holder_count = static_cast<uint32_t>(refs.size());
    part.holders.assign(refs.begin(), refs.end());
    shard.num_bytes = first.num_bytes;
    shard.tensor = -1;
    part.object = true;
    part.object_info = ObjectInfo{first.key, {}, first.object_encoding};
    part.shards.push_back(shard);
  }

  // A tensor's items must agree on dtype and global shape, and each box must lie inside it.
  // Sets *partial when some rank saves it partial.
  Status CheckTensorAgrees(const std::vector<ItemRef>& refs, bool* partial) const {
    const LocalItem& first = Item(refs[0]);
    const std::string& key = first.key;
    for (const ItemRef& ref : refs) {
      const LocalItem& item = Item(ref);
      if (item.dtype != first.dtype) {
        return InvalidArgument("key '" + key + "': dtype " + std::string(DTypeName(first.dtype)) +
                               " on " + Who(refs[0]) + " but " +
                               std::string(DTypeName(item.dtype)) + " on " + Who(ref));
      }
      if (item.global_shape != first.global_shape) {
        return InvalidArgument("key '" + key + "': global shape " +
                               ShapeToString(first.global_shape) + " on " + Who(refs[0]) + " but " +
                               ShapeToString(item.global_shape) + " on " + Who(ref));
      }
      if (!item.box.InBounds(item.global_shape)) {
        return Status(StatusCode::kOutOfRange,
                      "key '" + key + "': box " + item.box.ToString() + " on " + Who(ref) +
                          " is outside the global shape " + ShapeToString(item.global_shape));
      }
      *partial = *partial || item.partial;
    }
    return Status::Ok();
  }

  // The items that hold bytes to write, sorted by box, then rank: runs of equal boxes are the
  // holders of one chunk.
  std::vector<ItemRef> ItemsByBox(const std::vector<ItemRef>& refs) const {
    const Dims& shape = Item(refs[0]).global_shape;
    std::vector<ItemRef> sorted;
    sorted.reserve(refs.size());
    const bool empty_tensor = Box::Whole(shape).empty();
    for (const ItemRef& ref : refs) {
      // An item without bytes holds nothing to write: an empty box, or the empty flat range of
      // a 0-d tensor (whose box, with no dimensions, is never empty).
      if (Item(ref).num_bytes > 0 || empty_tensor) sorted.push_back(ref);
    }
    // One three-way comparison of the boxes (a != then a < would compare them twice). Ranks
    // usually hold ascending boxes (rank r the r-th row block), so the items arrive sorted,
    // and checking that is one pass where a sort of a million items follows their pointers
    // n log n times.
    auto by_box_then_rank = [&](const ItemRef& a, const ItemRef& b) {
      const auto order = Item(a).box <=> Item(b).box;
      return order != 0 ? order < 0 : a.rank < b.rank;
    };
    if (!std::is_sorted(sorted.begin(), sorted.end(), by_box_then_rank)) {
      std::sort(sorted.begin(), sorted.end(), by_box_then_rank);
    }
    if (empty_tensor && !sorted.empty()) {
      // Nothing to write but the tensor itself: one empty chunk, the whole (empty) box.
      std::vector<ItemRef> whole;
      for (const ItemRef& ref : sorted) {
        if (Item(ref).box == Box::Whole(shape)) whole.push_back(ref);
      }
      if (whole.empty()) whole.push_back(sorted[0]);
      sorted = std::move(whole);
    }
    return sorted;
  }

  // A tensor: one chunk (and shard) per unique box, whose holders are the items of that box.
  Status BuildTensor(const std::vector<ItemRef>& refs, KeyPart& part) const {
    const LocalItem& first = Item(refs[0]);
    bool partial = false;
    TESSERA_RETURN_IF_ERROR(CheckTensorAgrees(refs, &partial));
    TensorInfo& info = part.tensor;
    info.key = first.key;
    info.dtype = first.dtype;
    info.global_shape = first.global_shape.ToVector();
    info.partial = partial;
    const std::vector<ItemRef> sorted = ItemsByBox(refs);
    info.chunks.reserve(sorted.size());
    part.holders.reserve(sorted.size());
    for (const ItemRef& ref : sorted) {
      const Box& box = Item(ref).box;
      if (info.chunks.empty() || info.chunks.back().box != box) {
        info.chunks.push_back(ChunkInfo{.box = box});
        Shard shard;
        shard.holder_begin = static_cast<uint32_t>(part.holders.size());
        shard.num_bytes = Item(ref).num_bytes;
        shard.index = static_cast<uint32_t>(info.chunks.size() - 1);
        part.shards.push_back(shard);
      }
      part.holders.push_back(ref);
      part.shards.back().holder_count += 1;
    }
    return CheckChunksTile(part);
  }

  // The chunks of `part`'s tensor are disjoint, and cover it unless it is partial or coverage
  // is not required; the error names who holds the culprits.
  Status CheckChunksTile(const KeyPart& part) const {
    const TensorInfo& info = part.tensor;
    auto failure =
        CheckTiling(info.chunks, info.global_shape, !info.partial && options_.require_coverage);
    if (!failure) return Status::Ok();
    std::string message = "key '" + info.key + "': " + failure->message;
    auto holders_of = [&](int64_t chunk) {
      const Shard& shard = part.shards[chunk];
      return DescribeHolders(
          std::span<const ItemRef>(part.holders).subspan(shard.holder_begin, shard.holder_count),
          options_);
    };
    if (failure->first >= 0) {
      message += " (held by " + holders_of(failure->first);
      if (failure->second >= 0) message += " and " + holders_of(failure->second);
      message += ")";
    }
    Status status = InvalidArgument(std::move(message));
    if (failure->advice.empty()) return status;
    return status.WithDetail({.kind = StatusDetail::Kind::kNotCovered,
                              .keys = {info.key},
                              .options = {"partial"},
                              .advice = failure->advice});
  }

  std::string DescribeShard(const Shard& shard) const {
    if (shard.tensor < 0) return "object '" + plan_.metadata.objects[shard.index].key + "'";
    const TensorInfo& t = plan_.metadata.tensors[shard.tensor];
    return "key '" + t.key + "' box " + t.chunks[shard.index].box.ToString();
  }

  // The default writer of each shard: the lowest-ranked holder of its main replica.
  Status ChooseMainReplicas() {
    for (Shard& shard : shards_) {
      std::span<const ItemRef> held_by = HoldersOf(shard);
      auto main = std::find_if(held_by.begin(), held_by.end(),
                               [&](const ItemRef& h) { return IsMainReplica(Item(h).replica_id); });
      if (main == held_by.end()) return NoMainReplica(shard);
      shard.writer = *main;
    }
    return Status::Ok();
  }

  Status NoMainReplica(const Shard& shard) const {
    std::span<const ItemRef> held_by = HoldersOf(shard);
    if (num_ranks_ == 1) {  // no "rank 0" in a one-rank run: name the replica id instead
      std::string id;
      for (int32_t v : Item(held_by[0]).replica_id) {
        id += (id.empty() ? "" : ", ") + std::to_string(v);
      }
      return InvalidArgument(DescribeShard(shard) + " has replica id [" + id +
                             "] and nothing holds its main replica (replica id all zeros), "
                             "the copy that is written");
    }
    return InvalidArgument(DescribeShard(shard) + " is held by " +
                           DescribeHolders(held_by, options_) +
                           " but none holds the main replica (replica id all zeros)");
  }

  // balance_writes: greedy over all holders, the shards with fewest holders and most bytes
  // first, each to its least loaded holder (ties to the lowest rank).
  void BalanceWrites() {
    std::vector<uint32_t> order(shards_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      if (shards_[a].holder_count != shards_[b].holder_count) {
        return shards_[a].holder_count < shards_[b].holder_count;
      }
      return shards_[a].num_bytes > shards_[b].num_bytes;
    });
    std::vector<uint64_t> load(num_ranks_, 0);
    for (uint32_t s : order) {
      Shard& shard = shards_[s];
      std::span<const ItemRef> held_by = HoldersOf(shard);
      const ItemRef* best = &held_by[0];
      for (const ItemRef& h : held_by) {
        if (load[h.rank] < load[best->rank]) best = &h;  // holders ascend by rank: ties by rank
      }
      shard.writer = *best;
      load[best->rank] += shard.num_bytes;
    }
  }

  // The writer tables and each rank's writes, from the shards' writers.
  GlobalSavePlan Finish() {
    plan_.chunk_writers.resize(plan_.metadata.tensors.size());
    for (size_t t = 0; t < plan_.metadata.tensors.size(); ++t) {
      plan_.chunk_writers[t].resize(plan_.metadata.tensors[t].chunks.size());
    }
    plan_.object_writers.resize(plan_.metadata.objects.size());
    for (const Shard& shard : shards_) {
      (shard.tensor >= 0 ? plan_.chunk_writers[shard.tensor][shard.index]
                         : plan_.object_writers[shard.index]) = shard.writer;
      plan_.writes[shard.writer.rank].push_back(shard.writer.item);
      plan_.total_bytes += shard.num_bytes;
    }
    for (auto& w : plan_.writes) std::sort(w.begin(), w.end());
    plan_.metadata.num_ranks = options_.num_ranks >= 0 ? options_.num_ranks : num_ranks_;
    return std::move(plan_);
  }

  const std::span<const LocalPlan> plans_;
  const SavePlanOptions& options_;
  const int32_t num_ranks_;
  GlobalSavePlan plan_;
  std::vector<Shard> shards_;
  // The holders of every shard, in one array (Shard::holder_begin, holder_count).
  std::vector<ItemRef> holders_;
};

}  // namespace

Result<GlobalSavePlan> BuildGlobalSavePlan(std::span<const LocalPlan> plans,
                                           const SavePlanOptions& options) {
  return GlobalPlanBuilder(plans, options).Build();
}

// ---- write results ---------------------------------------------------------------------------

Bytes EncodeWriteResult(const WriteResult& result) {
  Bytes out;
  ByteWriter w(&out);
  w.Put<uint32_t>(static_cast<uint32_t>(result.files.size()));
  for (const FileInfo& f : result.files) {
    w.PutString(f.name);
    w.Put<uint64_t>(f.size);
  }
  w.Put<uint32_t>(static_cast<uint32_t>(result.items.size()));
  w.PutBytes(result.items.data(), result.items.size() * sizeof(WrittenItem));
  w.PutVector(result.block_checksums);
  return out;
}

Result<WriteResult> DecodeWriteResult(std::span<const uint8_t> bytes) {
  static_assert(std::is_trivially_copyable_v<WrittenItem>);
  ByteReader r(bytes);
  WriteResult result;
  uint32_t num_files = 0;
  TESSERA_RETURN_IF_ERROR(r.Get(&num_files));
  if (num_files > bytes.size()) return DataLoss("write result: bad file count");
  result.files.resize(num_files);
  for (FileInfo& f : result.files) {
    TESSERA_RETURN_IF_ERROR(r.GetString(&f.name));
    TESSERA_RETURN_IF_ERROR(r.Get(&f.size));
  }
  TESSERA_RETURN_IF_ERROR(r.GetVector(&result.items));
  TESSERA_RETURN_IF_ERROR(r.GetVector(&result.block_checksums));
  if (!r.AtEnd()) return DataLoss("write result: trailing bytes");
  for (const WrittenItem& item : result.items) {
    if (item.first_block > result.block_checksums.size() ||
        item.num_blocks > result.block_checksums.size() - item.first_block) {
      return DataLoss("write result: block checksums out of range");
    }
  }
  return result;
}

Result<Metadata> FinishMetadata(const GlobalSavePlan& plan, std::span<const WriteResult> results) {
  Metadata metadata = plan.metadata;
  const size_t num_ranks = results.size();
  std::vector<uint32_t> file_base(num_ranks, 0);
  // Per rank: item index -> position in results[r].items (kNone when not reported).
  constexpr uint32_t kNone = ~uint32_t{0};
  std::vector<std::vector<uint32_t>> where(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) {
    file_base[r] = static_cast<uint32_t>(metadata.files.size());
    metadata.files.insert(metadata.files.end(), results[r].files.begin(), results[r].files.end());
    for (uint32_t k = 0; k < results[r].items.size(); ++k) {
      const WrittenItem& w = results[r].items[k];
      if (w.file >= results[r].files.size()) {
        return Internal("rank " + std::to_string(r) + " reported file index " +
                        std::to_string(w.file) + " of " + std::to_string(results[r].files.size()));
      }
      if (w.item >= where[r].size()) where[r].resize(w.item + 1, kNone);
      where[r][w.item] = k;
    }
  }
  // The location of `ref`'s bytes; `describe` names them, called only for an error.
  // The location of `ref`'s bytes, and the checksums of its later blocks when `blocks` is not
  // null; `describe` names them, called only for an error.
  auto locate = [&](const ItemRef& ref, ByteLocation& out, std::vector<uint64_t>* blocks,
                    auto&& describe) -> Status {
    const size_t r = static_cast<size_t>(ref.rank);
    if (r >= num_ranks || ref.item >= where[r].size() || where[r][ref.item] == kNone) {
      return Internal(describe() + " was not reported written by rank " + std::to_string(ref.rank));
    }
    const WrittenItem& w = results[r].items[where[r][ref.item]];
    out = ByteLocation{file_base[r] + w.file, w.offset, w.length, w.checksum};
    if (blocks && w.num_blocks) {
      const auto first = results[r].block_checksums.begin() + w.first_block;
      blocks->assign(first, first + w.num_blocks);
    }
    return Status::Ok();
  };
  for (size_t t = 0; t < metadata.tensors.size(); ++t) {
    TensorInfo& tensor = metadata.tensors[t];
    for (size_t c = 0; c < tensor.chunks.size(); ++c) {
      ChunkInfo& chunk = tensor.chunks[c];
      TESSERA_RETURN_IF_ERROR(
          locate(plan.chunk_writers[t][c], chunk.location, &chunk.block_checksums,
                 [&] { return "key '" + tensor.key + "' box " + chunk.box.ToString(); }));
    }
  }
  for (size_t o = 0; o < metadata.objects.size(); ++o) {
    ObjectInfo& object = metadata.objects[o];
    TESSERA_RETURN_IF_ERROR(locate(plan.object_writers[o], object.location, nullptr,
                                   [&] { return "object '" + object.key + "'"; }));
  }
  return metadata;
}

}  // namespace tessera
