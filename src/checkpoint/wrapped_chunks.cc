#include "checkpoint/wrapped_chunks.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "format/torch_dist/dcp_codec.h"

namespace tessera {

using torch_dist::ChunkRef;

namespace {

// `m` with the chunks of only the tensors `touched` names (sorted): the others keep key,
// dtype and shape but no chunks. Planning and reading look at the chunks of the tensors a
// request asks for only, and those are the touched ones (a tensor asked for with an empty box
// touches none and needs none), so a load of a few tensors of a checkpoint of millions of
// chunks (Convert loads one unit at a time) copies only theirs.
Metadata CopyWithChunksOf(const Metadata& m, const std::vector<ChunkRef>& touched) {
  Metadata out;
  out.format_version = m.format_version;
  out.format = m.format;
  out.checksum = m.checksum;
  out.checksum_block_bytes = m.checksum_block_bytes;
  out.save_id = m.save_id;
  out.num_ranks = m.num_ranks;
  out.save_time_unix_ms = m.save_time_unix_ms;
  out.objects = m.objects;
  out.files = m.files;
  out.user_metadata = m.user_metadata;
  out.separate_prefixes = m.separate_prefixes;
  out.tensors.resize(m.tensors.size());
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorInfo& from = m.tensors[t];
    TensorInfo& to = out.tensors[t];
    to.key = from.key;
    to.dtype = from.dtype;
    to.global_shape = from.global_shape;
    to.partial = from.partial;
  }
  for (size_t i = 0; i < touched.size(); ++i) {
    if (i == 0 || touched[i].first != touched[i - 1].first) {
      out.tensors[touched[i].first].chunks = m.tensors[touched[i].first].chunks;
    }
  }
  return out;
}

}  // namespace

Result<RankReadPlan> PlanRankReadsResolving(Storage& storage, const std::string& root,
                                            const Metadata& metadata, StateDict& state,
                                            const std::string& path, bool skip_missing,
                                            bool cast_dtypes, int num_threads,
                                            ResolvedIndex& resolved) {
  TESSERA_ASSIGN_OR_RETURN(RankReadPlan plan,
                           PlanRankReads(metadata, state, path, skip_missing, cast_dtypes));
  if (!torch_dist::HasTorchSaveChunks(metadata)) return plan;
  // The chunks the plan touches: its runs' and permuted copies' (a wrapped chunk plans as if
  // its elements started at the item's first byte, row-major; only which chunks matter here).
  std::vector<ChunkRef> touched;
  touched.reserve(plan.runs.size() + plan.permuted.size());
  for (const ReadRun& run : plan.runs) touched.emplace_back(run.tensor, run.chunk);
  for (const PermutedCopy& copy : plan.permuted) touched.emplace_back(copy.tensor, copy.chunk);
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  resolved.metadata = CopyWithChunksOf(metadata, touched);
  // The resolved chunks carry their zip records' CRC-32s (dcp_codec.h), checked as they are read.
  resolved.metadata->checksum = ChecksumKind::kCrc32;
  resolved.metadata->checksum_block_bytes = 0;
  torch_dist::ItemReadStats stats;
  Status status = torch_dist::ResolveTorchSaveChunks(storage, root, *resolved.metadata, touched,
                                                     num_threads, &stats);
  resolved.bytes_read += stats.bytes;
  resolved.read_calls += static_cast<uint64_t>(stats.reads);
  TESSERA_RETURN_IF_ERROR(status);
  return PlanRankReads(*resolved.metadata, state, path, skip_missing, cast_dtypes);
}

Status CheckWrappedItems(Storage& storage, const std::string& root, const Metadata& metadata,
                         int num_threads, uint64_t* bytes_read) {
  torch_dist::ItemReadStats stats;
  if (torch_dist::HasTorchSaveChunks(metadata)) {
    std::vector<ChunkRef> all;
    for (uint32_t t = 0; t < metadata.tensors.size(); ++t) {
      for (uint32_t c = 0; c < metadata.tensors[t].chunks.size(); ++c) all.emplace_back(t, c);
    }
    Metadata copy = metadata;
    TESSERA_RETURN_IF_ERROR(
        torch_dist::ResolveTorchSaveChunks(storage, root, copy, all, num_threads, &stats));
  }
  if (metadata.format == CheckpointFormat::kTorchDist) {
    for (const ObjectInfo& object : metadata.objects) {
      if (object.encoding != ObjectEncoding::kTorchSave) continue;
      const std::string path = JoinPath(root, metadata.files[object.location.file_index].name);
      TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
      Result<torch_dist::TorchObjectItem> item = torch_dist::ReadTorchObjectItem(
          *file, object.location.offset, object.location.length, &stats);
      if (!item.ok()) {
        return Status(item.status().code(),
                      "object '" + object.key + "': " + item.status().message());
      }
    }
  }
  if (bytes_read) *bytes_read += stats.bytes;
  return Status::Ok();
}

Status CheckWrappedItemRecords(Storage& storage, const std::string& root, const Metadata& metadata,
                               int num_threads, uint64_t* bytes_checked) {
  // Each item once (the boxes of an N-D reformulated chunk share theirs), by file, in order.
  std::map<uint32_t, std::set<std::pair<uint64_t, uint64_t>>> items;  // file -> (offset, length)
  for (const TensorInfo& t : metadata.tensors) {
    for (const ChunkInfo& c : t.chunks) {
      if (c.encoding != ChunkEncoding::kTorchSaveItem) continue;
      items[c.location.file_index].emplace(c.location.offset, c.location.length);
    }
  }
  for (const ObjectInfo& o : metadata.objects) {
    if (o.encoding != ObjectEncoding::kTorchSave) continue;
    items[o.location.file_index].emplace(o.location.offset, o.location.length);
  }
  std::vector<std::pair<uint32_t, const std::set<std::pair<uint64_t, uint64_t>>*>> work;
  for (const auto& [file, list] : items) work.emplace_back(file, &list);
  std::vector<Status> statuses(work.size());
  std::vector<uint64_t> checked(work.size(), 0);
  std::atomic<size_t> next{0};
  auto run = [&] {
    for (size_t w; (w = next.fetch_add(1)) < work.size();) {
      const std::string path = JoinPath(root, metadata.files[work[w].first].name);
      Result<std::unique_ptr<ReadableFile>> file = storage.NewReadableFile(path);
      if (!file.ok()) {
        statuses[w] = file.status();
        continue;
      }
      for (const auto& [offset, length] : *work[w].second) {
        statuses[w] =
            torch_dist::CheckTorchItemRecords(**file, offset, length, nullptr, &checked[w]);
        if (!statuses[w].ok()) break;
      }
    }
  };
  const size_t threads = std::clamp<size_t>(static_cast<size_t>(std::max(num_threads, 1)), 1,
                                            std::max<size_t>(work.size(), 1));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  for (size_t w = 0; w < work.size(); ++w) {
    TESSERA_RETURN_IF_ERROR(statuses[w]);
    if (bytes_checked) *bytes_checked += checked[w];
  }
  return Status::Ok();
}

}  // namespace tessera
