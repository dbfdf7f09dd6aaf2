// Convert: the protocol around each rank's writing (convert_writer.h).
//
//   1. rank 0 reads the source's index         -> Broadcast (ReadAndShareIndex)
//   2. every rank plans the output (no I/O)    -> the same plan everywhere
//   3. rank 0 prepares DST (created, or empty, or holding only what dead conversions left) and
//      publishes its in-progress marker there -> Broadcast the save id
//   4. every rank writes its files into DST    -> Gather each rank's status and checksums
//   5. rank 0 commits (PublishCommit), or removes what the conversion wrote
//                                              -> Broadcast the outcome
//
// No directory is ever renamed, on any store: the output is committed the way its format
// commits a save. tessera and torch_dist data files carry the save id in their names and mean
// nothing until the manifest or `.metadata` that names them is published (CommitIndex).
// Hugging Face files have fixed names and no commit file of their own when there is one file:
// each is written under a hidden name (".<name>.tessera-convert-<save id>", which no reader
// claims), then renamed to its name once every file is complete, the index last; a reader of a
// directory without the index reads a set of shards only when it is complete (hf_index.h).
#include "tessera/convert.h"
#include "tessera/storage_uri.h"

#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>

#include "checkpoint/commit.h"
#include "checkpoint/convert_writer.h"
#include "checkpoint/envelope.h"
#include "checkpoint/load_internal.h"
#include "checkpoint/marker.h"
#include "checkpoint/sequence.h"
#include "core/byte_io.h"
#include "format/huggingface/hf_export.h"
#include "format/huggingface/hf_index.h"
#include "format/registry.h"
#include "format/safetensors.h"
#include "format/tessera/manifest.h"
#include "format/tessera/names.h"
#include "format/torch_dist/dcp_format_writer.h"
#include "format/torch_dist/dcp_writer.h"
#include "format/torch_dist/torch_dtype.h"
#include "format/torch_dist/torch_zip.h"
#include "plan/convert_plan.h"

namespace tessera {
namespace {

constexpr int kCoordinator = 0;
// The largest unit a thread loads and writes at once, whatever the buffer: smaller units keep
// every thread busy sooner (reading one while writing another) and let a conversion of a few
// hundred MB spread over all its threads (64 MiB of a 1 GiB checkpoint: 0.04 s where 16 MiB
// units take 0.03 s and `cp` 0.025 s, 2 cores, page cache); larger ones re-read fewer
// checksum blocks where a unit's edge cuts a source chunk (at most one 256 KiB block per
// chunk and edge: 8 column-split chunks over 32 MiB units, 6%).
constexpr uint64_t kMaxUnitBytes = 32u << 20;
// The Python package's record of a state dict's containers (python/tessera/_state.py,
// STRUCTURE_KEY). It names keys, so it is dropped when a conversion filters or renames them.
constexpr char kPythonStructureKey[] = "tessera.python.structure";

std::string SenderName(const Comm& comm, int r) {
  return comm.size() > 1 ? "rank " + std::to_string(r) : std::string();
}

Status CheckOptions(const ConvertOptions& options) {
  if (options.num_threads < 1) {
    return InvalidArgument("ConvertOptions::num_threads must be at least 1, got " +
                           std::to_string(options.num_threads));
  }
  if (options.max_file_bytes == 0) {
    return InvalidArgument("ConvertOptions::max_file_bytes must be greater than 0");
  }
  if (const Format* format = FindFormat(options.to)) {
    return format->CheckOptions(options.format_options, "ConvertOptions::format_options");
  }
  return Status::Ok();
}

// DST without trailing slashes, its parent directory and its name.
struct Destination {
  std::string path, parent, name;
};

Result<Destination> SplitDestination(const std::string& dst) {
  std::string path = dst;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const size_t slash = path.find_last_of('/');
  Destination d{path,
                slash == std::string::npos ? "."
                : slash == 0               ? "/"
                                           : path.substr(0, slash),
                slash == std::string::npos ? path : path.substr(slash + 1)};
  if (d.name.empty() || d.name == "." || d.name == ".." || d.name == "/") {
    return InvalidArgument("the destination '" + dst + "' does not name a directory to create");
  }
  return d;
}

// Names and headers of the output files. Hugging Face: "model.safetensors" alone, else the
// shard names; tessera: each writing rank's data file names.
// torch_dist: DCP data file names, no headers, each tensor one torch.save item back to back,
// then the file's objects.
Result<OutputLayout> LayOutDcp(const ConvertPlan& plan, const std::string& save_id) {
  OutputLayout layout;
  layout.dcp_tensors.resize(plan.tensors.size());
  std::map<int, int> per_rank;  // the next file number of each rank
  for (const OutputFile& file : plan.files) {
    layout.names.push_back(torch_dist::DcpDataFileName(save_id, file.rank, per_rank[file.rank]++));
    layout.headers.emplace_back();
    uint64_t at = 0;
    for (uint32_t t : file.tensors) {
      const OutputTensor& tensor = plan.tensors[t];
      Result<torch_dist::TorchItemLayout> item =
          torch_dist::LayOutTorchTensorItem(torch_dist::TorchTensorSpec{
              std::string(torch_dist::TorchDTypeOf(tensor.dtype).name), tensor.shape});
      if (!item.ok()) return item.status().WithContext("tensor '" + tensor.name + "'");
      layout.dcp_tensors[t] = DcpTensorPlace{at, at + item->data_offset, item->total_size};
      at += item->total_size;
    }
    layout.dcp_objects_begin.push_back(at);
  }
  return layout;
}

Result<OutputLayout> LayOut(const ConvertPlan& plan, CheckpointFormat to,
                            const std::string& save_id) {
  if (to == CheckpointFormat::kTorchDist) return LayOutDcp(plan, save_id);
  OutputLayout layout;
  const int count = static_cast<int>(plan.files.size());
  std::map<int, int> per_rank;  // tessera: the next file number of each rank
  std::map<std::string, std::string> header_metadata = {{"format", "pt"}};
  if (to == CheckpointFormat::kTessera) header_metadata["tessera_save_id"] = save_id;
  for (int f = 0; f < count; ++f) {
    const OutputFile& file = plan.files[f];
    if (to == CheckpointFormat::kTessera) {
      layout.names.push_back(DataFileName(save_id, file.rank, per_rank[file.rank]++));
    } else {
      layout.names.push_back(count == 1 ? kHuggingFaceSingleFileName
                                        : HuggingFaceShardName(f, count));
    }
    std::vector<SafetensorsEntry> entries;
    for (uint32_t t : file.tensors) {
      const OutputTensor& tensor = plan.tensors[t];
      entries.push_back(SafetensorsEntry{tensor.name, tensor.dtype, tensor.shape});
    }
    for (uint32_t o : file.objects) {
      const OutputObject& object = plan.objects[o];
      entries.push_back(
          SafetensorsEntry{object.name, DType::kU8, {static_cast<int64_t>(object.bytes)}});
    }
    if (LayOutEntries(entries) != file.data_bytes) {
      return Internal("output file " + layout.names.back() + ": the plan and the layout differ");
    }
    TESSERA_ASSIGN_OR_RETURN(Bytes header, EncodeSafetensorsHeader(entries, header_metadata));
    layout.headers.push_back(std::move(header));
  }
  return layout;
}

// The name a Hugging Face output file is written under until the commit renames it to `name`:
// hidden, not ending in ".safetensors" (no reader claims it), carrying the save id (so that a
// later conversion knows it for the leftover of this one).
std::string HiddenName(const std::string& name, const std::string& save_id) {
  return "." + name + ".tessera-convert-" + save_id;
}

// The entries of a DST that is not empty (`names`, sorted) when a conversion begins: the
// leftovers of conversions that died are removed (a marker whose owner is dead, and the files
// that carry its save id in their names or are temporaries of a Publish: every file a
// conversion writes until it commits); anything else is kAlreadyExists naming the entry, and
// nothing is removed. The markers go last, so that an interrupted removal leaves them to
// justify the next one.
Status RemoveLeftovers(Storage& storage, const std::string& dir,
                       const std::vector<std::string>& names) {
  const SaveMarkers markers = FindSaveMarkers(storage, dir, names, /*own_id=*/"");
  const std::string not_empty = "the destination " + dir + " exists and is not empty (it holds ";
  if (markers.others_running > 0) {
    for (const std::string& id : markers.running) {
      if (!id.empty()) {
        return AlreadyExists(not_empty + MarkerName(id) +
                             ": a conversion or save that is still running writes into it)");
      }
    }
  }
  std::vector<std::string> dead_ids;
  for (const std::string& marker : markers.dead_markers) dead_ids.push_back(MarkerSaveId(marker));
  std::vector<std::string> files;
  for (const std::string& name : names) {
    if (std::find(markers.dead_markers.begin(), markers.dead_markers.end(), name) !=
        markers.dead_markers.end()) {
      continue;
    }
    std::string target;
    const bool leftover =
        !dead_ids.empty() &&
        (ParsePublishTemporaryName(name, &target) ||
         std::any_of(dead_ids.begin(), dead_ids.end(),
                     [&](const std::string& id) { return name.find(id) != std::string::npos; }));
    if (!leftover) {
      return AlreadyExists(not_empty + name + (names.size() > 1 ? ", ..." : "") + ")");
    }
    files.push_back(name);
  }
  for (const std::string& name : files) {
    TESSERA_RETURN_IF_ERROR_CTX(storage.Remove(JoinPath(dir, name)),
                                "removing what a conversion that died left in " + dir);
  }
  for (const std::string& marker : markers.dead_markers) {
    TESSERA_RETURN_IF_ERROR_CTX(storage.Remove(JoinPath(dir, marker)),
                                "removing the marker of a conversion that died in " + dir);
  }
  return Status::Ok();
}

// Coordinator, before any rank writes (step 3): DST is created when absent (with the missing
// directories above it, durable with kFull); an existing DST must be empty or hold only what
// conversions that died left (RemoveLeftovers). Then this conversion's in-progress marker, and
// a second look: a conversion or save that began meanwhile makes this one stop (kAlreadyExists)
// rather than mix its files with the other's. Returns whether DST was created here (a failure
// then removes it).
Result<bool> PrepareDestination(Storage& storage, const Destination& dst,
                                const std::string& save_id, SyncPolicy sync) {
  TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(dst.path));
  if (type == FileType::kFile) {
    return AlreadyExists("the destination " + dst.path + " exists and is a file");
  }
  bool created = false;
  if (type == FileType::kDirectory) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(dst.path));
    if (!names.empty()) TESSERA_RETURN_IF_ERROR(RemoveLeftovers(storage, dst.path, names));
  } else {
    if (Status made = CreateDurableDirs(storage, dst.path, sync); !made.ok()) {
      // DST may exist by now (a failed sync of its parent): it was absent, so it is ours.
      storage.RemoveDir(dst.path).IgnoreError();
      return made;
    }
    created = true;
  }
  Status marked = CreateSaveMarker(storage, dst.path, save_id, sync);
  if (marked.ok()) {
    Result<std::vector<std::string>> names = storage.ListDir(dst.path);
    marked = names.status();
    if (names.ok()) {
      for (const std::string& name : *names) {
        if (name == MarkerName(save_id)) continue;
        marked = AlreadyExists("the destination " + dst.path + " was written by another " +
                               "process while this conversion began (it now holds " + name + ")");
        break;
      }
    }
  }
  if (!marked.ok()) {
    // Also when its creation failed: a failed sync leaves the marker in place.
    RemoveSaveMarker(storage, dst.path, save_id);
    if (created) storage.RemoveDir(dst.path).IgnoreError();
    return marked;
  }
  return created;
}

// After a failure before the commit made anything visible: removes every file this conversion
// may have written into DST (under `written` and `committed` names), its marker, and DST itself
// when it was `created` here. Best effort: a conversion that failed reports its own error.
void RemoveOutput(Storage& storage, const Destination& dst, const std::vector<std::string>& written,
                  const std::vector<std::string>& committed, const std::string& save_id,
                  bool created) {
  for (const std::vector<std::string>* names : {&written, &committed}) {
    for (const std::string& name : *names) storage.Remove(JoinPath(dst.path, name)).IgnoreError();
  }
  RemoveSaveMarker(storage, dst.path, save_id);
  if (created) storage.RemoveDir(dst.path).IgnoreError();
}

// The manifest of a tessera output, from every rank's checksums (RankWriteResult::checksums,
// indexed by rank).
Result<Metadata> TesseraMetadata(const Metadata& source, const ConvertPlan& plan,
                                 const OutputLayout& layout,
                                 const std::vector<std::vector<uint64_t>>& checksums,
                                 const std::string& save_id, int num_ranks, bool keys_changed) {
  Metadata m;
  m.format = CheckpointFormat::kTessera;
  m.checksum = ChecksumKind::kXxh3_64;
  m.checksum_block_bytes = kChecksumBlockBytes;
  m.save_id = save_id;
  m.num_ranks = num_ranks;
  m.save_time_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
  m.user_metadata = source.user_metadata;
  if (keys_changed) m.user_metadata.erase(kPythonStructureKey);
  m.tensors.resize(plan.tensors.size());
  m.objects.resize(plan.objects.size());
  std::vector<size_t> cursor(checksums.size(), 0);
  auto take = [&](int rank, uint64_t n, const std::string& key) -> Result<std::vector<uint64_t>> {
    const std::vector<uint64_t>& from = checksums[rank];
    if (cursor[rank] + n > from.size()) {
      return Internal("rank " + std::to_string(rank) + " sent too few checksums (at '" + key +
                      "')");
    }
    std::vector<uint64_t> out(from.begin() + cursor[rank], from.begin() + cursor[rank] + n);
    cursor[rank] += n;
    return out;
  };
  for (uint32_t f = 0; f < plan.files.size(); ++f) {
    const OutputFile& file = plan.files[f];
    const uint64_t data_start = layout.headers[f].size();
    m.files.push_back(FileInfo{layout.names[f], data_start + file.data_bytes});
    for (uint32_t t : file.tensors) {
      const OutputTensor& out = plan.tensors[t];
      TESSERA_ASSIGN_OR_RETURN(
          std::vector<uint64_t> sums,
          take(file.rank, NumChecksumBlocks(out.bytes, kChecksumBlockBytes), out.name));
      TensorInfo& info = m.tensors[t];
      info.key = out.name;
      info.dtype = out.dtype;
      info.global_shape = out.shape;
      ChunkInfo chunk;
      chunk.box = Box::Whole(out.shape);
      chunk.location = ByteLocation{f, data_start + out.offset, out.bytes, sums.front()};
      chunk.block_checksums.assign(sums.begin() + 1, sums.end());
      info.chunks.push_back(std::move(chunk));
    }
    for (uint32_t o : file.objects) {
      const OutputObject& out = plan.objects[o];
      TESSERA_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, take(file.rank, 1, out.name));
      m.objects[o] =
          ObjectInfo{out.name, ByteLocation{f, data_start + out.offset, out.bytes, sums.front()},
                     source.objects[out.source].encoding};
    }
  }
  return m;
}

// The Metadata of a torch_dist output as MarkDcpItems leaves it, from every rank's object item
// lengths (RankWriteResult::object_lengths, indexed by rank).
Result<Metadata> DcpOutputMetadata(const Metadata& source, const ConvertPlan& plan,
                                   const OutputLayout& layout,
                                   const std::vector<std::vector<uint64_t>>& object_lengths,
                                   const std::string& save_id) {
  Metadata m;
  m.save_id = save_id;
  m.tensors.resize(plan.tensors.size());
  m.objects.resize(plan.objects.size());
  std::vector<size_t> cursor(object_lengths.size(), 0);
  for (uint32_t f = 0; f < plan.files.size(); ++f) {
    const OutputFile& file = plan.files[f];
    for (uint32_t t : file.tensors) {
      const OutputTensor& out = plan.tensors[t];
      const DcpTensorPlace& place = layout.dcp_tensors[t];
      TensorInfo& info = m.tensors[t];
      info.key = out.name;
      info.dtype = out.dtype;
      info.global_shape = out.shape;
      ChunkInfo chunk;
      chunk.box = Box::Whole(out.shape);
      chunk.location = ByteLocation{f, place.item_offset, place.item_length, 0};
      info.chunks.push_back(std::move(chunk));
    }
    uint64_t at = layout.dcp_objects_begin[f];
    for (uint32_t o : file.objects) {
      const OutputObject& out = plan.objects[o];
      const std::vector<uint64_t>& lengths = object_lengths[file.rank];
      if (cursor[file.rank] >= lengths.size()) {
        return Internal("rank " + std::to_string(file.rank) + " sent too few object lengths (at '" +
                        out.name + "')");
      }
      const uint64_t length = lengths[cursor[file.rank]++];
      m.objects[o] =
          ObjectInfo{out.name, ByteLocation{f, at, length, 0}, source.objects[out.source].encoding};
      at += length;
    }
    m.files.push_back(FileInfo{layout.names[f], at});
  }
  torch_dist::MarkDcpItems(m);
  return m;
}

// The writer of ConvertOptions::to (a format tessera writes), for the commit of its index.
Result<std::unique_ptr<FormatWriter>> WriterFor(const ConvertOptions& options) {
  SaveOptions as_save;
  as_save.format = options.to;
  as_save.format_options = options.format_options;
  if (options.to == CheckpointFormat::kTorchDist) {  // with the deprecated field folded in
    TESSERA_ASSIGN_OR_RETURN(
        as_save.format_options,
        torch_dist::ResolveTorchDistOptions(options.format_options, options.torch_dist_flavor,
                                            /*key_paths=*/nullptr, "ConvertOptions"));
  }
  return FormatOf(options.to).NewWriter(as_save, /*coordinator=*/true);
}

// Every output tensor one the format stores (FormatWriter::CheckTensor; e.g. torch 1.13 lacks
// float8), refused before anything is written. Nothing to check for a format tessera converts
// into but does not save (Hugging Face: any dtype).
Status CheckOutputTensors(const ConvertPlan& plan, const ConvertOptions& options) {
  if (!FormatOf(options.to).CanWrite()) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(const std::unique_ptr<FormatWriter> writer, WriterFor(options));
  for (const OutputTensor& t : plan.tensors) {
    TESSERA_RETURN_IF_ERROR(writer->CheckTensor(t.name, t.dtype));
  }
  return Status::Ok();
}

// The coordinator's last step once every rank has written (step 5): the commit of the output
// in DST. tessera and torch_dist: the manifest or `.metadata`, committed as a save commits it
// (CommitIndex). Hugging Face: each file renamed from its hidden name to its name (`names`),
// then, with several files, the index published create-only. `visible` becomes true once a
// reader may see the output (its files must then stay whatever happens).
// `gathered[r]` is rank r's RankWriteResult::checksums (tessera) or object_lengths (DCP).
Status Commit(Storage& storage, const Destination& dst, const ConvertOptions& options,
              const ConvertPlan& plan, const OutputLayout& layout,
              const std::vector<std::string>& names, const Metadata& source,
              const std::vector<std::vector<uint64_t>>& gathered, const std::string& save_id,
              int num_ranks, bool& visible) {
  const bool durable = options.sync == SyncPolicy::kFull;
  if (options.to == CheckpointFormat::kTorchDist || options.to == CheckpointFormat::kTessera) {
    TESSERA_ASSIGN_OR_RETURN(const std::unique_ptr<FormatWriter> writer, WriterFor(options));
    Metadata m;
    if (options.to == CheckpointFormat::kTorchDist) {
      TESSERA_ASSIGN_OR_RETURN(m, DcpOutputMetadata(source, plan, layout, gathered, save_id));
    } else {
      const bool keys_changed = !options.keys.empty() || !options.strip_prefix.empty();
      TESSERA_ASSIGN_OR_RETURN(
          m, TesseraMetadata(source, plan, layout, gathered, save_id, num_ranks, keys_changed));
    }
    return CommitIndex(storage, dst.path, *writer, m, options.sync, visible);
  }
  // Every file complete (synced by its writer) before the first takes its name.
  for (size_t f = 0; f < names.size(); ++f) {
    TESSERA_RETURN_IF_ERROR_CTX(
        storage.RenameNoReplace(JoinPath(dst.path, layout.names[f]), JoinPath(dst.path, names[f])),
        "giving the finished file " + names[f] + " its name");
    visible = names.size() == 1;
  }
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dst.path));
  if (names.size() > 1) {
    std::vector<std::pair<std::string, std::string>> weight_map;
    for (const OutputTensor& t : plan.tensors) weight_map.emplace_back(t.name, names[t.file]);
    TESSERA_ASSIGN_OR_RETURN(std::string text,
                             EncodeHuggingFaceIndex(plan.total_tensor_bytes, weight_map));
    const std::string index = JoinPath(dst.path, kHuggingFaceIndexName);
    const Status published =
        storage.Publish(index, std::as_bytes(std::span(text.data(), text.size())),
                        PublishMode::kCreateOnly, durable);
    // A failure after the index took its place (its directory's sync) leaves a complete output
    // that a reader may already have opened: it stays.
    visible = published.ok() || PublishMayHavePlaced(storage, index);
    TESSERA_RETURN_IF_ERROR(published);
  }
  return Status::Ok();
}

}  // namespace

Result<CheckpointFormat> CheckpointFormatFromName(const std::string& name) {
  if (const Format* format = FindFormat(name)) return format->id();
  return InvalidArgument("unknown checkpoint format '" + name + "' (expected one of " +
                         FormatNames() + ")");
}

namespace {

// Convert from `src` in `source` to `dst` in `output`, a store with positional writes (and
// with rename, for a Hugging Face output): the files are written into `dst` and committed there
// (the protocol at the top of this file).
Result<ConvertReport> ConvertInto(Storage& source, const std::string& src, Storage& output,
                                  const std::string& dst, const ConvertOptions& options,
                                  Comm& comm) {
  Storage* const storage = &output;  // where the output goes
  const bool coordinator = comm.rank() == kCoordinator;
  TESSERA_ASSIGN_OR_RETURN(const Destination destination, SplitDestination(dst));

  // 1-2. The source's index, once; the same plan on every rank.
  TESSERA_ASSIGN_OR_RETURN(const CheckpointIndex index, ReadAndShareIndex(comm, source, src));
  ConvertPlanOptions plan_options;
  plan_options.format = options.to;
  plan_options.keep_objects =
      options.to == CheckpointFormat::kTessera || options.to == CheckpointFormat::kTorchDist;
  plan_options.max_file_bytes = options.max_file_bytes;
  plan_options.key_prefixes = options.keys;
  plan_options.strip_prefix = options.strip_prefix;
  plan_options.dtype = options.dtype;
  plan_options.num_ranks = comm.size();
  TESSERA_ASSIGN_OR_RETURN(const ConvertPlan plan, PlanConversion(index.metadata, plan_options));
  TESSERA_RETURN_IF_ERROR(CheckOutputTensors(plan, options));

  // 3. DST, its marker and the save id, from the coordinator.
  Bytes prepared;
  bool created = false;  // the coordinator's: DST was created by this conversion
  if (coordinator) {
    const std::string save_id = NewSaveId({});
    Result<bool> made = PrepareDestination(*storage, destination, save_id, options.sync);
    Bytes payload;
    if (made.ok()) {
      created = *made;
      ByteWriter(&payload).PutString(save_id);
    }
    prepared = Seal(made.status(), std::move(payload));
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&prepared, kCoordinator));
  TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> body, Open(prepared, SenderName(comm, 0)));
  std::string save_id;
  ByteReader reader(body);
  TESSERA_RETURN_IF_ERROR(reader.GetString(&save_id));

  // 4. This rank's files, straight into DST; Hugging Face files under hidden names until the
  // commit (`names` are the names they end up with).
  Result<OutputLayout> layout = LayOut(plan, options.to, save_id);
  std::vector<std::string> names;
  if (layout.ok()) {
    names = layout->names;
    if (options.to == CheckpointFormat::kSafetensors) {
      for (std::string& name : layout->names) name = HiddenName(name, save_id);
    }
  }
  bool any_converted = false;
  for (const OutputTensor& t : plan.tensors) any_converted |= t.dtype != t.source_dtype;
  RankWriteOptions write_options;
  write_options.num_threads = options.num_threads;
  write_options.unit_bytes = std::min(
      options.buffer_bytes / static_cast<uint64_t>(options.num_threads) / (any_converted ? 2 : 1),
      kMaxUnitBytes);
  write_options.checksum_block_bytes =
      options.to == CheckpointFormat::kTessera ? kChecksumBlockBytes : 0;
  write_options.sync = options.sync;
  write_options.verify_checksums = options.verify_checksums;
  write_options.progress = options.progress;
  Result<RankWriteResult> written =
      layout.ok() ? WriteRankFiles(source, output, destination.path, index, src, plan, *layout,
                                   comm.rank(), write_options)
                  : Result<RankWriteResult>(layout.status());
  Bytes mine;
  if (written.ok()) {
    ByteWriter(&mine).PutVector(options.to == CheckpointFormat::kTorchDist ? written->object_lengths
                                                                           : written->checksums);
  }
  std::vector<Bytes> gathered;
  TESSERA_RETURN_IF_ERROR(
      comm.Gather(Seal(written.status(), std::move(mine)), &gathered, kCoordinator));

  // 5. The coordinator commits, or removes what was written; everyone learns the outcome.
  Bytes outcome;
  if (coordinator) {
    bool visible = false;
    Status status = [&]() -> Status {
      std::vector<std::vector<uint64_t>> checksums(gathered.size());
      for (size_t r = 0; r < gathered.size(); ++r) {
        TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> sums,
                                 Open(gathered[r], SenderName(comm, static_cast<int>(r))));
        ByteReader sums_reader(sums);
        TESSERA_RETURN_IF_ERROR(sums_reader.GetVector(&checksums[r]));
      }
      return Commit(*storage, destination, options, plan, *layout, names, index.metadata, checksums,
                    save_id, comm.size(), visible);
    }();
    if (status.ok() || visible) {
      RemoveSaveMarker(*storage, destination.path, save_id);
    } else {
      RemoveOutput(*storage, destination, layout.ok() ? layout->names : std::vector<std::string>(),
                   names, save_id, created);
    }
    outcome = Seal(status);
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&outcome, kCoordinator));
  TESSERA_RETURN_IF_ERROR(Open(outcome, "").status());

  ConvertReport report;
  report.source_format = index.metadata.format;
  report.tensors = plan.tensors.size();
  report.objects = plan.objects.size();
  report.total_bytes = plan.total_tensor_bytes;
  for (const OutputObject& o : plan.objects) report.total_bytes += o.bytes;
  report.files = names;
  if (options.to == CheckpointFormat::kTessera) {
    report.files.push_back(NumberedManifestName(1));  // the first commit of a new directory
  } else if (options.to == CheckpointFormat::kTorchDist) {
    report.files.push_back(torch_dist::kDcpMetadataFileName);
  } else if (plan.files.size() > 1) {
    report.files.push_back(kHuggingFaceIndexName);
  }
  report.bytes_written = written->bytes_written;
  report.bytes_read = written->bytes_read;
  report.files_written = written->files_written;
  report.skipped_objects = plan.skipped_objects;
  return report;
}

// Copies the local file `from` to `to` in `output` front to back (what a store without
// positional writes takes), created exclusively: on an object store nothing is visible before
// Sync publishes the whole object.
Status UploadFile(Storage& local, const std::string& from, Storage& output, const std::string& to) {
  constexpr uint64_t kPieceBytes = 8u << 20;
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> in, local.NewReadableFile(from));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out,
                           output.NewWritableFile(to, CreateMode::kExclusive));
  std::vector<std::byte> buffer(static_cast<size_t>(std::min(kPieceBytes, in->size())));
  for (uint64_t at = 0; at < in->size();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), in->size() - at));
    TESSERA_RETURN_IF_ERROR(in->ReadAt(at, buffer.data(), n));
    TESSERA_RETURN_IF_ERROR(out->WriteAt(at, buffer.data(), n));
    at += n;
  }
  TESSERA_RETURN_IF_ERROR(out->Sync());
  return out->Close();
}

// Uploads the finished conversion in `staged` to `dst` of `output`: every file, the one that
// commits it (`commit`: the manifest, `.metadata` or index, else the only file) last, so that a
// reader never sees an index naming a file not yet there. On failure removes what it uploaded.
Status UploadConversion(Storage& local, const std::string& staged, Storage& output,
                        const std::string& dst, const std::string& commit) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, local.ListDir(staged));
  if (std::find(names.begin(), names.end(), commit) == names.end()) {
    return Internal("the conversion staged in " + staged + " lacks its index " + commit);
  }
  std::erase(names, commit);
  names.push_back(commit);
  TESSERA_RETURN_IF_ERROR(output.CreateDirs(dst));
  std::vector<std::string> uploaded;
  for (const std::string& name : names) {
    const std::string to = JoinPath(dst, name);
    Status status = UploadFile(local, JoinPath(staged, name), output, to);
    if (!status.ok()) {
      for (const std::string& done : uploaded) output.Remove(done).IgnoreError();
      return status.WithContext("uploading the conversion to " + to);
    }
    uploaded.push_back(to);
  }
  return Status::Ok();
}

// Convert into a store without rename or positional writes (an object store): the output is
// made in a local directory (ConvertOptions::staging_dir), then uploaded, its index last. One
// process only: with several, each would hold only its own files.
Result<ConvertReport> ConvertThroughLocal(Storage& source, const std::string& src, Storage& output,
                                          const std::string& dst, const std::string& uri,
                                          const ConvertOptions& options, Comm& comm) {
  if (comm.size() > 1) {
    return Unimplemented("converting into " + uri +
                         ", a store without rename or positional writes, runs on one process "
                         "(it converts in a local directory, then uploads the result): convert "
                         "with one process, or into a file system");
  }
  TESSERA_ASSIGN_OR_RETURN(const Destination destination, SplitDestination(dst));
  TESSERA_ASSIGN_OR_RETURN(const FileType type, output.Stat(destination.path));
  if (type == FileType::kFile) return AlreadyExists("the destination " + uri + " is a file");
  if (type == FileType::kDirectory) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, output.ListDir(destination.path));
    if (!names.empty()) {
      return AlreadyExists("the destination " + uri + " is not empty (it holds " + names.front() +
                           (names.size() > 1 ? ", ..." : "") + ")");
    }
  }
  std::error_code ec;
  const std::string base = !options.staging_dir.empty()
                               ? options.staging_dir
                               : std::filesystem::temp_directory_path(ec).string();
  std::string pattern = JoinPath(base.empty() ? "/tmp" : base, "tessera-convert-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return IOErrorFromErrno(
        "creating a local directory for the conversion into " + uri + " (" + pattern + ")", errno);
  }
  const std::string staged = JoinPath(pattern, destination.name);
  std::shared_ptr<Storage> local = NewPosixStorage();
  ConvertOptions local_options = options;
  local_options.sync = SyncPolicy::kNone;  // a scratch copy: the upload is what must last
  Result<ConvertReport> report = ConvertInto(source, src, *local, staged, local_options, comm);
  Status status = report.status();
  if (status.ok()) {
    status = UploadConversion(*local, staged, output, destination.path, report->files.back());
  }
  std::filesystem::remove_all(pattern, ec);
  if (!status.ok()) return status;
  return report;
}

}  // namespace

Result<ConvertReport> Convert(const std::string& src, const std::string& dst,
                              const ConvertOptions& options, Comm& comm) {
  // The same on every rank (the options are), so every rank returns here alike.
  TESSERA_RETURN_IF_ERROR(CheckOptions(options));
  // Paths or URIs (s3://, msc://, file://) where the options name no storage.
  TESSERA_ASSIGN_OR_RETURN(auto source, ResolveStorage(src, options.storage));
  TESSERA_ASSIGN_OR_RETURN(
      auto output,
      ResolveStorage(dst, options.output_storage ? options.output_storage : options.storage));
  // The files are written at offsets in any order, and Hugging Face files are renamed to their
  // names once complete: into a store without those capabilities (an object store), the
  // conversion is made in a local directory first and then uploaded, its index last.
  const StorageCapabilities caps = output.first->capabilities();
  if (!caps.positional_writes || (options.to == CheckpointFormat::kSafetensors && !caps.rename)) {
    return ConvertThroughLocal(*source.first, source.second, *output.first, output.second, dst,
                               options, comm);
  }
  return ConvertInto(*source.first, source.second, *output.first, output.second, options, comm);
}

Result<ConvertReport> Convert(const std::string& src, const std::string& dst,
                              const ConvertOptions& options) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  return Convert(src, dst, options, *comm);
}

}  // namespace tessera
