#include "plan/load_plan.h"

#include <algorithm>
#include <numeric>
#include <string_view>
#include <unordered_set>

#include "core/dtype_convert.h"
#include "plan/flat_range.h"
#include "plan/local_pieces.h"

namespace tessera {

ChunkIndex::ChunkIndex(const TensorInfo& tensor) : tensor_(&tensor) {
  const auto& chunks = tensor.chunks;
  const size_t rank = tensor.global_shape.size();
  by_offset_.resize(chunks.size());
  std::iota(by_offset_.begin(), by_offset_.end(), 0);
  if (rank == 0 || chunks.size() < 2) return;
  size_t best_count = 0;
  std::vector<int64_t> values(chunks.size());
  for (size_t d = 0; d < rank; ++d) {
    for (size_t c = 0; c < chunks.size(); ++c) values[c] = chunks[c].box.offsets[d];
    std::sort(values.begin(), values.end());
    size_t count = std::unique(values.begin(), values.end()) - values.begin();
    if (count > best_count) best_count = count, dim_ = d;
  }
  for (const ChunkInfo& c : chunks) max_extent_ = std::max(max_extent_, c.box.sizes[dim_]);
  std::stable_sort(by_offset_.begin(), by_offset_.end(), [&](uint32_t a, uint32_t b) {
    return chunks[a].box.offsets[dim_] < chunks[b].box.offsets[dim_];
  });
}

void ChunkIndex::ForEachIntersecting(const Box& box,
                                     const std::function<void(uint32_t)>& fn) const {
  const auto& chunks = tensor_->chunks;
  if (box.rank() == 0 || chunks.size() < 2) {
    for (uint32_t c = 0; c < chunks.size(); ++c) {
      if (Intersect(chunks[c].box, box)) fn(c);
    }
    return;
  }
  // Chunks that can reach the box along dim_: offset in (box.offset - max_extent, box.end).
  const int64_t low = box.offsets[dim_] - max_extent_;
  auto it = std::upper_bound(by_offset_.begin(), by_offset_.end(), low, [&](int64_t v, uint32_t c) {
    return v < chunks[c].box.offsets[dim_];
  });
  std::vector<uint32_t> hits;
  for (; it != by_offset_.end() && chunks[*it].box.offsets[dim_] < box.end(dim_); ++it) {
    if (Intersect(chunks[*it].box, box)) hits.push_back(*it);
  }
  std::sort(hits.begin(), hits.end());
  for (uint32_t c : hits) fn(c);
}

int64_t PlanTensorReads(const Metadata& metadata, uint32_t tensor_index, const ChunkIndex& index,
                        const Box& box, const Box& layout, std::byte* destination,
                        std::vector<ReadRun>& runs, std::vector<PermutedCopy>& permuted,
                        std::optional<DTypeCast> cast) {
  const TensorInfo& tensor = metadata.tensors[tensor_index];
  const size_t rank = box.rank();
  const int64_t element_size = static_cast<int64_t>(DTypeSize(tensor.dtype));
  const int64_t dst_element_size = cast ? static_cast<int64_t>(DTypeSize(cast->to)) : element_size;
  int64_t covered = 0;
  index.ForEachIntersecting(box, [&](uint32_t c) {
    const ChunkInfo& chunk = tensor.chunks[c];
    std::optional<Box> common = Intersect(chunk.box, box);
    if (!common) return;
    const Box& part = *common;
    covered += part.NumElements();
    if (!chunk.storage_order.empty()) {
      permuted.push_back(PermutedCopy{tensor_index, c, part, layout, destination, cast});
      return;
    }
    // The run: the innermost dimensions along which `part` spans both the chunk and the
    // destination layout completely, plus the first one (from the inside) where it does not.
    int64_t run_elements = 1;
    size_t outer = rank;  // dimensions [0, outer) are iterated, [outer, rank) form the run
    while (outer > 0) {
      --outer;
      run_elements *= part.sizes[outer];
      if (part.sizes[outer] != chunk.box.sizes[outer] || part.sizes[outer] != layout.sizes[outer]) {
        break;
      }
    }
    const std::vector<int64_t> src_strides = RowMajorStrides(chunk.box.sizes);
    const std::vector<int64_t> dst_strides = RowMajorStrides(layout.sizes);
    std::vector<int64_t> index_in_part(outer, 0);
    while (true) {
      int64_t src = 0, dst = 0;
      for (size_t d = 0; d < rank; ++d) {
        int64_t at = part.offsets[d] + (d < outer ? index_in_part[d] : 0);
        src += (at - chunk.box.offsets[d]) * src_strides[d];
        dst += (at - layout.offsets[d]) * dst_strides[d];
      }
      ReadRun run{chunk.location.file_index,
                  chunk.location.offset + static_cast<uint64_t>(src * element_size),
                  static_cast<uint64_t>(run_elements * element_size),
                  destination + dst * dst_element_size,
                  tensor_index,
                  c};
      run.cast = cast;
      runs.push_back(run);
      // Next index of the outer dimensions, last fastest; done after the last one.
      bool done = true;
      for (size_t d = outer; d-- > 0;) {
        if (++index_in_part[d] < part.sizes[d]) {
          done = false;
          break;
        }
        index_in_part[d] = 0;
      }
      if (done) break;
    }
  });
  return covered;
}

void CoalesceRuns(std::vector<ReadRun>& runs) {
  std::sort(runs.begin(), runs.end(), [](const ReadRun& a, const ReadRun& b) {
    if (a.file_index != b.file_index) return a.file_index < b.file_index;
    return a.file_offset < b.file_offset;
  });
  size_t out = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (out > 0) {
      ReadRun& last = runs[out - 1];
      const ReadRun& next = runs[i];
      // Runs of different chunks stay apart, so every run belongs to one chunk.
      if (last.file_index == next.file_index && last.tensor == next.tensor &&
          last.chunk == next.chunk && last.file_offset + last.length == next.file_offset &&
          last.destination + last.DestinationLength() == next.destination &&
          last.flat == next.flat && last.cast == next.cast) {
        last.length += next.length;
        continue;
      }
    }
    runs[out++] = runs[i];
  }
  runs.resize(out);
}

namespace {

// The conversion a load of `tensor` needs, none when the dtypes agree; InvalidArgument naming
// the key and both dtypes when they differ and cannot (or may not) be converted.
Result<std::optional<DTypeCast>> CastFor(const TensorInfo& info, const ShardedTensor& tensor,
                                         bool cast_dtypes) {
  const DType saved = info.dtype, wanted = tensor.data.dtype;
  if (saved == wanted) return std::optional<DTypeCast>();
  const bool floats = IsFloatDType(saved) && IsFloatDType(wanted);
  if (cast_dtypes && floats) return std::optional<DTypeCast>(DTypeCast{saved, wanted});
  std::string message = "key '" + tensor.key + "': saved dtype " + std::string(DTypeName(saved)) +
                        ", requested " + std::string(DTypeName(wanted));
  StatusDetail detail{.kind = StatusDetail::Kind::kDTypeMismatch,
                      .keys = {tensor.key},
                      .options = {"LoadOptions::cast_dtypes"}};
  if (!floats) {
    if (cast_dtypes) {
      message +=
          " (LoadOptions::cast_dtypes converts only between F64, F32, F16, BF16, F8_E4M3 and "
          "F8_E5M2)";
    }
  } else {
    detail.advice = "set LoadOptions::cast_dtypes to convert between float dtypes";
    message += " (" + detail.advice + ")";
  }
  return InvalidArgument(message).WithDetail(std::move(detail));
}

Status PlanTensor(const Metadata& metadata, std::vector<std::unique_ptr<ChunkIndex>>& indexes,
                  ShardedTensor& tensor, const std::string& path, bool cast_dtypes,
                  RankReadPlan& plan) {
  const TensorInfo* info = metadata.FindTensor(tensor.key);
  const uint32_t t = static_cast<uint32_t>(info - metadata.tensors.data());
  plan.asked[t] = 1;
  TESSERA_RETURN_IF_ERROR(tensor.Validate());
  TESSERA_ASSIGN_OR_RETURN(const std::optional<DTypeCast> cast,
                           CastFor(*info, tensor, cast_dtypes));
  Box local = tensor.LocalBox();
  const bool shape_differs = tensor.global_shape != info->global_shape;
  if (shape_differs) {
    if (!tensor.allow_shape_mismatch || tensor.global_shape.size() != info->global_shape.size()) {
      StatusDetail detail{.kind = StatusDetail::Kind::kShapeMismatch,
                          .keys = {tensor.key},
                          .options = {"allow_shape_mismatch"}};
      if (!tensor.allow_shape_mismatch) {
        detail.advice = "set allow_shape_mismatch to load the common part";
      }
      return InvalidArgument(
                 "key '" + tensor.key + "': saved global shape " +
                 ShapeToString(info->global_shape) + ", requested " +
                 ShapeToString(tensor.global_shape) +
                 (tensor.allow_shape_mismatch ? " (ranks differ)" : " (" + detail.advice + ")"))
          .WithDetail(std::move(detail));
    }
    plan.shape_mismatched_keys.push_back(tensor.key);
  }
  if (!indexes[t]) indexes[t] = std::make_unique<ChunkIndex>(*info);
  const size_t element_size = DTypeSize(tensor.data.dtype);  // of the destination
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
    const size_t first_run = plan.runs.size();
    const int64_t covered = PlanTensorReads(metadata, t, *indexes[t], wanted, piece.box,
                                            destination, plan.runs, plan.permuted, cast);
    if (tensor.flat_range) {
      for (size_t i = first_run; i < plan.runs.size(); ++i) plan.runs[i].flat = true;
    }
    plan.bytes_needed += needed * element_size;
    if (covered != needed) {
      return DataLoss("key '" + tensor.key + "': box " + wanted.ToString() + " is covered by " +
                      std::to_string(covered) + " of its " + std::to_string(needed) +
                      " elements in the checkpoint at " + path + " (saved as a partial tensor?)");
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {

// Removes repeated keys (a key held in several pieces is listed once), keeping the first of
// each.
void RemoveRepeatedKeys(std::vector<std::string>& keys) {
  std::unordered_set<std::string_view> seen;
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) {
    if (seen.insert(key).second) out.push_back(key);  // copied: `seen` views `keys`
  }
  keys = std::move(out);
}

}  // namespace

Result<RankReadPlan> PlanRankReads(const Metadata& metadata, StateDict& state,
                                   const std::string& path, bool skip_missing, bool cast_dtypes) {
  // Each piece of a key lands in its own memory; pieces that overlap would need one read in two
  // places.
  TESSERA_RETURN_IF_ERROR(CheckLocalPiecesDisjoint(state));
  RankReadPlan plan;
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
      TESSERA_RETURN_IF_ERROR(PlanTensor(metadata, indexes, *tensor, path, cast_dtypes, plan));
    } else {
      auto& object = std::get<ShardedObject>(entry);
      const ObjectInfo* info = metadata.FindObject(object.key);
      if (!info) {
        missing.push_back(object.key);
        continue;
      }
      plan.asked[metadata.tensors.size() + (info - metadata.objects.data())] = 1;
      plan.objects.push_back({info, &object});
      plan.bytes_needed += info->location.length;
    }
  }
  RemoveRepeatedKeys(missing);
  RemoveRepeatedKeys(plan.shape_mismatched_keys);
  if (!missing.empty() && !skip_missing) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 10; ++i)
      list += (i ? ", '" : "'") + missing[i] + "'";
    if (missing.size() > 10) list += ", ... (" + std::to_string(missing.size()) + " keys)";
    StatusDetail detail{.kind = StatusDetail::Kind::kMissingKeys,
                        .keys = missing,
                        .options = {"LoadOptions::missing_keys"},
                        .advice = "set LoadOptions::missing_keys = kSkip to load the rest"};
    return NotFound("the checkpoint at " + path + " has no key " + list + " (" + detail.advice +
                    ")")
        .WithDetail(std::move(detail));
  }
  plan.missing_keys = std::move(missing);
  CoalesceRuns(plan.runs);
  return plan;
}

}  // namespace tessera
