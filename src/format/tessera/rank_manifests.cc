#include "format/tessera/rank_manifests.h"

#include <algorithm>
#include <set>

#include "core/tiling.h"
#include "format/tessera/manifest.h"

namespace tessera {
namespace {

// A rank manifest is small (one rank's chunks): read whole.
Result<Metadata> ReadRankManifest(Storage& storage, const std::string& dir, const std::string& name,
                                  int expected_rank, const std::string& save_id) {
  const std::string path = JoinPath(dir, name);
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  if (file->size() > kMaxManifestBytes) {
    return DataLoss(path + ": corrupt manifest: " + std::to_string(file->size()) + " bytes");
  }
  Bytes bytes(file->size());
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, bytes.data(), bytes.size()));
  TESSERA_ASSIGN_OR_RETURN(Metadata m, DecodeManifest(bytes, path));
  if (m.part_rank != expected_rank || m.save_id != save_id) {
    return DataLoss(path + ": corrupt manifest: it is the part of rank " +
                    std::to_string(m.part_rank) + " of save " + m.save_id +
                    ", its name says rank " + std::to_string(expected_rank) + " of save " +
                    save_id);
  }
  return m;
}

}  // namespace

std::string RankManifestSet::MissingRanks() const {
  // Walks the gaps between the parts present, never the ranks one by one: a part may claim
  // 2^31-1 ranks (a corrupt or hostile file), and naming 16 of them must cost 16 steps.
  const int64_t present = std::distance(names.begin(), names.lower_bound(num_ranks));
  const int64_t missing = static_cast<int64_t>(num_ranks) - present;
  std::string out = missing == 1 ? "rank " : "ranks ";
  int64_t shown = 0;
  auto next_present = names.begin();
  for (int64_t r = 0; r < num_ranks && shown < kMissingRanksShown; ++r) {
    if (next_present != names.end() && next_present->first == r) {
      ++next_present;
      continue;
    }
    out += (shown++ ? ", " : "") + std::to_string(r);
  }
  if (missing > shown) out += " and " + std::to_string(missing - shown) + " more";
  return out + " (of " + std::to_string(num_ranks) + ")";
}

Result<std::vector<RankManifestSet>> FindRankManifestSets(Storage& storage, const std::string& dir,
                                                          const std::vector<std::string>& names) {
  std::map<std::string, RankManifestSet> by_id;
  for (const std::string& name : names) {
    std::string id;
    int rank = 0;
    if (!ParseRankManifestName(name, &id, &rank)) continue;
    RankManifestSet& set = by_id[id];
    set.save_id = id;
    set.names[rank] = name;
  }
  std::vector<RankManifestSet> sets;
  for (auto& [id, set] : by_id) {
    for (const auto& [rank, name] : set.names) {
      Result<Metadata> part = ReadRankManifest(storage, dir, name, rank, id);
      if (part.ok()) {
        set.num_ranks = part->num_ranks;
        set.save_time_unix_ms = part->save_time_unix_ms;
        set.format_version = part->format_version;
        set.header_read = true;
        break;
      }
      if (part.status().code() != StatusCode::kDataLoss &&
          part.status().code() != StatusCode::kUnimplemented) {
        return part.status();  // the storage failed, not the part
      }
      if (set.problem.ok()) set.problem = part.status();
    }
    for (const auto& [r, n] : set.names) {
      if (set.header_read && r >= set.num_ranks && set.problem.ok()) {
        set.problem = DataLoss(JoinPath(dir, n) + ": rank " + std::to_string(r) + " of a save by " +
                               std::to_string(set.num_ranks) + " ranks");
      }
    }
    sets.push_back(std::move(set));
  }
  return sets;
}

Result<Metadata> MergeRankManifests(Storage& storage, const std::string& dir,
                                    const RankManifestSet& set) {
  Metadata merged;
  merged.save_id = set.save_id;
  merged.num_ranks = set.num_ranks;
  // The time saves are ordered by (the lowest rank's), not the latest part's: a rank may commit
  // its part of the next save before a slower rank commits its part of this one, and the merged
  // manifest Finalize writes must not then look newer than that next save.
  merged.save_time_unix_ms = set.save_time_unix_ms;
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, int> tensor_rank;  // the rank that first named each key
  std::map<std::string, ObjectInfo> objects;
  std::map<std::string, int> object_rank;           // the rank that first named each object key
  std::map<std::string, std::set<Box>> boxes;       // per key: boxes taken (held by several ranks)
  std::map<std::string, std::vector<int>> writers;  // per key: the rank of each kept chunk
  for (const auto& [rank, name] : set.names) {
    TESSERA_ASSIGN_OR_RETURN(Metadata part,
                             ReadRankManifest(storage, dir, name, rank, set.save_id));
    if (rank == set.names.begin()->first) {
      merged.format = part.format;
      merged.checksum = part.checksum;
      merged.checksum_block_bytes = part.checksum_block_bytes;
      merged.user_metadata = part.user_metadata;
      merged.separate_prefixes = part.separate_prefixes;
    } else if (part.num_ranks != set.num_ranks ||
               part.checksum_block_bytes != merged.checksum_block_bytes) {
      return DataLoss(JoinPath(dir, name) + ": rank " + std::to_string(rank) + " says " +
                      std::to_string(part.num_ranks) +
                      " ranks or another checksum block size than rank " +
                      std::to_string(set.names.begin()->first));
    }
    const uint32_t file_base = static_cast<uint32_t>(merged.files.size());
    merged.files.insert(merged.files.end(), part.files.begin(), part.files.end());
    for (TensorInfo& t : part.tensors) {
      auto [it, inserted] = tensors.try_emplace(t.key);
      TensorInfo& into = it->second;
      if (inserted) {
        into = TensorInfo{t.key, t.dtype, t.global_shape, {}, t.partial};
        tensor_rank[t.key] = rank;
      } else if (into.dtype != t.dtype || into.global_shape != t.global_shape ||
                 into.partial != t.partial) {
        return InvalidArgument(
            "rank-local save " + set.save_id + " in " + dir + ": key '" + t.key + "' is " +
            std::string(DTypeName(into.dtype)) + " " + ShapeToString(into.global_shape) +
            (into.partial ? " (partial)" : "") + " on rank " + std::to_string(tensor_rank[t.key]) +
            " but " + std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.global_shape) +
            (t.partial ? " (partial)" : "") + " on rank " + std::to_string(rank));
      }
      for (ChunkInfo& c : t.chunks) {
        // Replicas that both claimed the main replica wrote the same box: keep one.
        if (!boxes[t.key].insert(c.box).second) continue;
        c.location.file_index += file_base;
        into.chunks.push_back(std::move(c));
        writers[t.key].push_back(rank);
      }
    }
    for (ObjectInfo& o : part.objects) {
      o.location.file_index += file_base;
      object_rank.try_emplace(o.key, rank);
      objects.try_emplace(o.key, std::move(o));  // the lowest rank's copy
    }
  }
  for (const auto& [key, rank] : object_rank) {
    if (auto t = tensor_rank.find(key); t != tensor_rank.end()) {
      return InvalidArgument("rank-local save " + set.save_id + " in " + dir + ": key '" + key +
                             "' is a tensor on rank " + std::to_string(t->second) +
                             " but an object on rank " + std::to_string(rank));
    }
  }
  for (auto& [key, t] : tensors) {
    // Each part was checked alone; only now can a gap (a box no rank wrote as the main replica)
    // or an overlap between ranks show: name the key here rather than as a corrupt manifest.
    if (auto failure = CheckTiling(t.chunks, t.global_shape, !t.partial)) {
      std::string who;
      if (failure->first >= 0 && failure->second >= 0) {
        const std::vector<int>& ranks = writers[key];
        who = " (written by rank " + std::to_string(ranks[failure->first]) + " and rank " +
              std::to_string(ranks[failure->second]) + ")";
      }
      return FailedPrecondition("rank-local save " + set.save_id + " in " + dir +
                                " is not a whole checkpoint: key '" + key +
                                "': " + failure->problem() + who +
                                " (every box must be written by one rank holding it as the main "
                                "replica, replica id 0)");
    }
    merged.tensors.push_back(std::move(t));
  }
  for (auto& [key, o] : objects) merged.objects.push_back(std::move(o));
  return merged;
}

}  // namespace tessera
