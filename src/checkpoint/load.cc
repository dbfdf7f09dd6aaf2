// Load: the protocol of ../shared/DESIGN.md, "Load protocol".
//
//   1. rank 0 reads the manifest           -> Broadcast; every rank decodes it
//   2. every rank plans its reads (no I/O) -> AllReduce of which keys anyone asked for
//   3. agree that every rank's plan is good, then read, then agree on the outcome
//
// Nothing in the caller's memory is touched unless every rank's request is valid.
#include <algorithm>
#include <map>
#include <thread>

#include "checkpoint/envelope.h"
#include "checkpoint/reader.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "plan/flat_range.h"
#include "plan/load_plan.h"
#include "tessera/checkpoint.h"

namespace tessera {
namespace {

constexpr int kCoordinator = 0;

struct ObjectRead {
  const ObjectInfo* info;
  ShardedObject* destination;
};

struct LoadPlan {
  std::vector<ReadRun> runs;
  std::vector<ObjectRead> objects;
  // asked[k] is 1 when this rank asks for key k: the manifest's tensors, then its objects.
  std::vector<int64_t> asked;
  LoadReport report;
};

Status PlanTensor(const Metadata& metadata, std::vector<std::unique_ptr<ChunkIndex>>& indexes,
                  ShardedTensor& tensor, const std::string& path, LoadPlan& plan) {
  const TensorInfo* info = metadata.FindTensor(tensor.key);
  const uint32_t t = static_cast<uint32_t>(info - metadata.tensors.data());
  plan.asked[t] = 1;
  TESSERA_RETURN_IF_ERROR(tensor.Validate());
  if (tensor.data.dtype != info->dtype) {
    return InvalidArgument("key '" + tensor.key + "': saved dtype " +
                           std::string(DTypeName(info->dtype)) + ", requested " +
                           std::string(DTypeName(tensor.data.dtype)));
  }
  Box local = tensor.LocalBox();
  const bool shape_differs = tensor.global_shape != info->global_shape;
  if (shape_differs) {
    if (!tensor.allow_shape_mismatch || tensor.global_shape.size() != info->global_shape.size()) {
      return InvalidArgument("key '" + tensor.key + "': saved global shape " +
                             ShapeToString(info->global_shape) + ", requested " +
                             ShapeToString(tensor.global_shape) +
                             (tensor.allow_shape_mismatch ? " (ranks differ)"
                                                          : " (set allow_shape_mismatch to load "
                                                            "the common part)"));
    }
    plan.report.shape_mismatched_keys.push_back(tensor.key);
  }
  if (!indexes[t]) indexes[t] = std::make_unique<ChunkIndex>(*info);
  const size_t element_size = DTypeSize(info->dtype);
  // Destinations: the local box, or the boxes of its flat range; each contiguous in `data`.
  std::vector<FlatPiece> pieces;
  if (tensor.flat_range) {
    pieces = FlatRangeToBoxes(local, tensor.flat_range->begin, tensor.flat_range->end);
    for (FlatPiece& p : pieces) p.flat_begin -= tensor.flat_range->begin;
  } else {
    pieces.push_back({local, 0});
  }
  const Box saved_whole = Box::Whole(info->global_shape);
  for (const FlatPiece& piece : pieces) {
    if (piece.box.empty()) continue;
    std::byte* destination = tensor.data.bytes() + piece.flat_begin * element_size;
    Box wanted = piece.box;
    if (shape_differs) {
      // Only the part inside the saved tensor is loaded; the rest keeps its values.
      std::optional<Box> common = Intersect(piece.box, saved_whole);
      if (!common) continue;
      wanted = std::move(*common);
    } else if (!piece.box.InBounds(info->global_shape)) {
      return OutOfRange("key '" + tensor.key + "': requested box " + piece.box.ToString() +
                        " is outside the saved global shape " + ShapeToString(info->global_shape));
    }
    const int64_t needed = wanted.NumElements();
    const int64_t covered =
        PlanTensorReads(metadata, t, *indexes[t], wanted, piece.box, destination, plan.runs);
    plan.report.bytes_needed += needed * element_size;
    if (covered != needed) {
      return DataLoss("key '" + tensor.key + "': box " + wanted.ToString() + " is covered by " +
                      std::to_string(covered) + " of its " + std::to_string(needed) +
                      " elements in the checkpoint at " + path + " (saved as a partial tensor?)");
    }
  }
  return Status::Ok();
}

Result<LoadPlan> PlanLoad(const Metadata& metadata, StateDict& state, const std::string& path,
                          const LoadOptions& options) {
  LoadPlan plan;
  const size_t num_keys = metadata.tensors.size() + metadata.objects.size();
  plan.asked.assign(num_keys, 0);
  std::vector<std::unique_ptr<ChunkIndex>> indexes(metadata.tensors.size());
  std::vector<std::string> missing;
  for (StateEntry& entry : state.entries()) {
    if (auto* tensor = std::get_if<ShardedTensor>(&entry)) {
      if (!metadata.FindTensor(tensor->key)) {
        missing.push_back(tensor->key);
        continue;
      }
      TESSERA_RETURN_IF_ERROR(PlanTensor(metadata, indexes, *tensor, path, plan));
    } else {
      auto& object = std::get<ShardedObject>(entry);
      const ObjectInfo* info = metadata.FindObject(object.key);
      if (!info) {
        missing.push_back(object.key);
        continue;
      }
      plan.asked[metadata.tensors.size() + (info - metadata.objects.data())] = 1;
      plan.objects.push_back({info, &object});
      plan.report.bytes_needed += info->location.length;
    }
  }
  if (!missing.empty() && options.missing_keys == KeyPolicy::kError) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 10; ++i)
      list += (i ? ", '" : "'") + missing[i] + "'";
    if (missing.size() > 10) list += ", ... (" + std::to_string(missing.size()) + " keys)";
    return NotFound("the checkpoint at " + path + " has no key " + list +
                    " (set LoadOptions::missing_keys = kSkip to load the rest)");
  }
  plan.report.missing_keys = std::move(missing);
  CoalesceRuns(plan.runs);
  return plan;
}

}  // namespace

Result<LoadReport> Load(StateDict& state, const std::string& path, Comm& comm,
                        const LoadOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : NewPosixStorage();
  if (options.num_io_threads < 1) {
    return InvalidArgument("LoadOptions::num_io_threads must be at least 1, got " +
                           std::to_string(options.num_io_threads));
  }
  // 1. The manifest, read once and shared.
  Bytes manifest;
  if (comm.rank() == kCoordinator) {
    Result<Bytes> bytes = ReadManifestBytes(*storage, path);
    manifest = bytes.ok() ? Seal(Status::Ok(), std::move(*bytes)) : Seal(bytes.status());
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&manifest, kCoordinator));
  TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> manifest_bytes, Open(manifest, "rank 0"));
  TESSERA_ASSIGN_OR_RETURN(Metadata metadata,
                           DecodeManifest(manifest_bytes, JoinPath(path, kManifestFileName)));
  manifest = Bytes();

  // 2. Plan this rank's reads; learn which keys any rank asked for.
  Result<LoadPlan> planned = PlanLoad(metadata, state, path, options);
  const size_t num_keys = metadata.tensors.size() + metadata.objects.size();
  std::vector<int64_t> asked = planned.ok() ? planned->asked : std::vector<int64_t>(num_keys, 0);
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(asked, ReduceOp::kMax));
  Status plan_status = planned.status();
  if (plan_status.ok()) {
    for (size_t k = 0; k < num_keys; ++k) {
      if (asked[k]) continue;
      planned->report.unexpected_keys.push_back(
          k < metadata.tensors.size() ? metadata.tensors[k].key
                                      : metadata.objects[k - metadata.tensors.size()].key);
    }
    const auto& unexpected = planned->report.unexpected_keys;
    if (!unexpected.empty() && options.unexpected_keys == KeyPolicy::kError) {
      std::string list;
      for (size_t i = 0; i < unexpected.size() && i < 10; ++i) {
        list += (i ? ", '" : "'") + unexpected[i] + "'";
      }
      if (unexpected.size() > 10) list += ", ... (" + std::to_string(unexpected.size()) + " keys)";
      plan_status =
          InvalidArgument("the checkpoint at " + path + " has keys no rank asked for: " + list +
                          " (set LoadOptions::unexpected_keys = kSkip to ignore)");
    }
  }
  // 3. Read only if every rank's plan is good; then agree on the outcome.
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, plan_status));
  LoadPlan& plan = *planned;
  Status read_status = ExecuteReads(*storage, path, metadata, plan.runs, options, plan.report);
  if (read_status.ok()) {
    for (const ObjectRead& read : plan.objects) {
      read_status = ReadObject(*storage, path, metadata, *read.info, options,
                               read.destination->data, plan.report);
      if (!read_status.ok()) break;
    }
  }
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, read_status));
  return std::move(plan.report);
}

Result<LoadReport> Load(StateDict& state, const std::string& path, const LoadOptions& options) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  return Load(state, path, *comm, options);
}

}  // namespace tessera
