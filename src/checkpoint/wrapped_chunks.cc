#include "checkpoint/wrapped_chunks.h"

#include <algorithm>
#include "format/registry.h"

namespace tessera {

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
  const Format& format = FormatOf(metadata.format);
  if (!format.HasWrappedChunks(metadata)) return plan;
  // The chunks the plan touches: its runs' and permuted copies' (a wrapped chunk plans as if
  // its elements started at the item's first byte, row-major; only which chunks matter here).
  std::vector<ChunkRef> touched;
  touched.reserve(plan.runs.size() + plan.permuted.size());
  for (const ReadRun& run : plan.runs) touched.emplace_back(run.tensor, run.chunk);
  for (const PermutedCopy& copy : plan.permuted) touched.emplace_back(copy.tensor, copy.chunk);
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  resolved.metadata = CopyWithChunksOf(metadata, touched);
  // The resolved chunks carry the format's checksums (DCP's: their zip records' CRC-32s),
  // checked as they are read.
  resolved.metadata->checksum = format.resolved_checksum();
  resolved.metadata->checksum_block_bytes = 0;
  FormatReadStats stats;
  Status status =
      format.ResolveWrappedChunks(storage, root, *resolved.metadata, touched, num_threads, &stats);
  resolved.bytes_read += stats.bytes;
  resolved.read_calls += static_cast<uint64_t>(stats.reads);
  TESSERA_RETURN_IF_ERROR(status);
  return PlanRankReads(*resolved.metadata, state, path, skip_missing, cast_dtypes);
}

}  // namespace tessera
