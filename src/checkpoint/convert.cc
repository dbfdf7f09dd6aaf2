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
#include "format/registry.h"
#include "format/tessera/manifest.h"
#include "format/tessera/names.h"
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

// The name a file of a format whose files are the checkpoint (FilesAreTheCheckpoint: Hugging
// Face) is written under until the commit renames it to `name`: hidden, not ending in the
// format's suffix (no reader claims it), carrying the save id (so that a later conversion
// knows it for the leftover of this one).
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

// What each rank sent the coordinator once it wrote its files (RankWriteResult), by rank.
struct Gathered {
  std::vector<std::vector<uint64_t>> checksums;
  std::vector<std::vector<uint64_t>> object_lengths;
};

// Takes the next `n` values of rank `rank` from `from` (with its cursor), naming `key` when
// the rank sent too few.
class RankValues {
 public:
  explicit RankValues(const std::vector<std::vector<uint64_t>>& from)
      : from_(from), cursor_(from.size(), 0) {}
  Result<std::vector<uint64_t>> Take(int rank, uint64_t n, const std::string& key,
                                     const char* what) {
    const std::vector<uint64_t>& values = from_[rank];
    if (cursor_[rank] + n > values.size()) {
      return Internal("rank " + std::to_string(rank) + " sent too few " + what + " (at '" + key +
                      "')");
    }
    std::vector<uint64_t> out(values.begin() + cursor_[rank], values.begin() + cursor_[rank] + n);
    cursor_[rank] += n;
    return out;
  }

 private:
  const std::vector<std::vector<uint64_t>>& from_;
  std::vector<size_t> cursor_;
};

// The index of the output, every item at the place its format laid it out (`layout`), the
// objects at the lengths their writers reported, the files under their final `names`, with
// the checksums the ranks computed when the format keeps tessera's.
Result<Metadata> OutputMetadata(const Metadata& source, const ConvertPlan& plan,
                                const OutputLayout& layout, const std::vector<std::string>& names,
                                const Gathered& gathered, const FormatWriter& writer,
                                const ConvertOptions& options, const std::string& save_id,
                                int num_ranks) {
  Metadata m;
  m.format = options.to;
  m.save_id = save_id;
  m.num_ranks = num_ranks;
  m.save_time_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
  if (layout.engine_checksums) {
    m.checksum = ChecksumKind::kXxh3_64;
    m.checksum_block_bytes = kChecksumBlockBytes;
  }
  if (writer.StoresUserMetadata()) {
    m.user_metadata = source.user_metadata;
    if (!options.keys.empty() || !options.strip_prefix.empty()) {
      m.user_metadata.erase(kPythonStructureKey);
    }
  }
  m.tensors.resize(plan.tensors.size());
  m.objects.resize(plan.objects.size());
  RankValues checksums(gathered.checksums), lengths(gathered.object_lengths);
  for (uint32_t f = 0; f < plan.files.size(); ++f) {
    const OutputFile& file = plan.files[f];
    uint64_t end = layout.files[f]->header().size();
    for (uint32_t t : file.tensors) {
      const OutputTensor& out = plan.tensors[t];
      ChunkInfo chunk;
      chunk.box = Box::Whole(out.shape);
      chunk.location =
          ByteLocation{f, layout.tensor_offsets[t], layout.tensor_places[t].stored_length, 0};
      if (layout.engine_checksums) {
        TESSERA_ASSIGN_OR_RETURN(
            std::vector<uint64_t> sums,
            checksums.Take(file.rank, NumChecksumBlocks(out.bytes, kChecksumBlockBytes), out.name,
                           "checksums"));
        chunk.location.checksum = sums.front();
        chunk.block_checksums.assign(sums.begin() + 1, sums.end());
      }
      end = std::max(end, chunk.location.offset + chunk.location.length);
      TensorInfo& info = m.tensors[t];
      info.key = out.name;
      info.dtype = out.dtype;
      info.global_shape = out.shape;
      info.chunks.push_back(std::move(chunk));
    }
    uint64_t at = layout.objects_begin[f];
    for (size_t i = 0; i < file.objects.size(); ++i) {
      const OutputObject& out = plan.objects[file.objects[i]];
      TESSERA_ASSIGN_OR_RETURN(const std::vector<uint64_t> length,
                               lengths.Take(file.rank, 1, out.name, "object lengths"));
      ByteLocation where{f, layout.files[f]->ItemOffset(file.tensors.size() + i, at),
                         length.front(), 0};
      if (layout.engine_checksums) {
        TESSERA_ASSIGN_OR_RETURN(const std::vector<uint64_t> sum,
                                 checksums.Take(file.rank, 1, out.name, "checksums"));
        where.checksum = sum.front();
      }
      at = where.offset + where.length;
      end = std::max(end, at);
      m.objects[file.objects[i]] = ObjectInfo{out.name, where, source.objects[out.source].encoding};
    }
    m.files.push_back(FileInfo{names[f], end});
  }
  return m;
}

// The writer of ConvertOptions::to (Format::NewConversionWriter): InvalidArgument when no
// registered format is `to`, or it is one tessera does not convert into.
Result<std::unique_ptr<FormatWriter>> WriterFor(const ConvertOptions& options) {
  const Format* format = FindFormat(options.to);
  if (format == nullptr) {
    return InvalidArgument("ConvertOptions::to (" + std::to_string(static_cast<int>(options.to)) +
                           ") is not a format: expected one of " + FormatNames());
  }
  return format->NewConversionWriter(options);
}

// Every output tensor one the format stores (FormatWriter::CheckTensor; e.g. torch 1.13 lacks
// float8), refused before anything is written.
Status CheckOutputTensors(const ConvertPlan& plan, const FormatWriter& writer) {
  for (const OutputTensor& t : plan.tensors) {
    TESSERA_RETURN_IF_ERROR(writer.CheckTensor(t.name, t.dtype));
  }
  return Status::Ok();
}

// The commit of a format whose files are the checkpoint (FilesAreTheCheckpoint): each file
// renamed from its hidden name (`layout.names`) to its name (`names`), then, when the format
// has one for this many files, the index published create-only.
Status CommitByRenaming(Storage& storage, const Destination& dst, const FormatWriter& writer,
                        const OutputLayout& layout, const std::vector<std::string>& names,
                        Metadata& m, SyncPolicy sync, bool& visible) {
  const bool indexed = writer.NeedsIndex(names.size());
  // Every file complete (synced by its writer) before the first takes its name.
  for (size_t f = 0; f < names.size(); ++f) {
    TESSERA_RETURN_IF_ERROR_CTX(
        storage.RenameNoReplace(JoinPath(dst.path, layout.names[f]), JoinPath(dst.path, names[f])),
        "giving the finished file " + names[f] + " its name");
    visible = !indexed;
  }
  const bool durable = sync == SyncPolicy::kFull;
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dst.path));
  if (!indexed) return Status::Ok();
  writer.FinishIndex(m);
  TESSERA_ASSIGN_OR_RETURN(const Bytes bytes, writer.EncodeIndex(m, dst.path));
  const std::string index = JoinPath(dst.path, writer.IndexFileName());
  const Status published =
      storage.Publish(index, std::as_bytes(std::span(bytes)), PublishMode::kCreateOnly, durable);
  // A failure after the index took its place (its directory's sync) leaves a complete output
  // that a reader may already have opened: it stays.
  visible = published.ok() || PublishMayHavePlaced(storage, index);
  return published;
}

// The coordinator's last step once every rank has written (step 5): the commit of the output
// in DST, as its format commits: the index that names the files, committed as a save commits
// it (CommitIndex), or the files renamed to their names (CommitByRenaming). `visible` becomes
// true once a reader may see the output (its files must then stay whatever happens).
Status Commit(Storage& storage, const Destination& dst, const FormatWriter& writer,
              const ConvertOptions& options, const ConvertPlan& plan, const OutputLayout& layout,
              const std::vector<std::string>& names, const Metadata& source,
              const Gathered& gathered, const std::string& save_id, int num_ranks, bool& visible) {
  TESSERA_ASSIGN_OR_RETURN(Metadata m, OutputMetadata(source, plan, layout, names, gathered, writer,
                                                      options, save_id, num_ranks));
  if (writer.FilesAreTheCheckpoint()) {
    return CommitByRenaming(storage, dst, writer, layout, names, m, options.sync, visible);
  }
  return CommitIndex(storage, dst.path, writer, m, options.sync, visible);
}

}  // namespace

Result<CheckpointFormat> CheckpointFormatFromName(const std::string& name) {
  if (const Format* format = FindFormat(name)) return format->id();
  return InvalidArgument("unknown checkpoint format '" + name + "' (expected one of " +
                         FormatNames() + ")");
}

namespace {

// Steps 1-2: the plan of the output, the same on every rank, its tensors checked against
// what the format stores.
Result<ConvertPlan> PlanOutput(const CheckpointIndex& index, const ConvertOptions& options,
                               const FormatWriter& writer, int num_ranks) {
  ConvertPlanOptions plan_options;
  plan_options.format_name = FormatName(options.to);
  plan_options.keep_objects = writer.StoresObjects();
  plan_options.max_file_bytes = options.max_file_bytes;
  plan_options.one_item_per_file = writer.OneFilePerItem();
  plan_options.key_prefixes = options.keys;
  plan_options.strip_prefix = options.strip_prefix;
  plan_options.dtype = options.dtype;
  plan_options.num_ranks = num_ranks;
  TESSERA_ASSIGN_OR_RETURN(ConvertPlan plan, PlanConversion(index.metadata, plan_options));
  TESSERA_RETURN_IF_ERROR(CheckOutputTensors(plan, writer));
  return plan;
}

// Step 3: the coordinator prepares DST and its marker (PrepareDestination); every rank learns
// the save id, or the coordinator's error. `created` (the coordinator's): DST was created here.
Result<std::string> PrepareAndShareSaveId(Storage& storage, const Destination& dst,
                                          const ConvertOptions& options, Comm& comm,
                                          bool& created) {
  Bytes prepared;
  if (comm.rank() == kCoordinator) {
    const std::string save_id = NewSaveId({});
    Result<bool> made = PrepareDestination(storage, dst, save_id, options.sync);
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
  return save_id;
}

// How each rank writes: its threads and their units (a unit bounds the memory a thread holds;
// half as large when dtypes convert, which needs a source buffer beside the output one).
RankWriteOptions WriteOptionsOf(const ConvertOptions& options, const ConvertPlan& plan) {
  bool any_converted = false;
  for (const OutputTensor& t : plan.tensors) any_converted |= t.dtype != t.source_dtype;
  RankWriteOptions write_options;
  write_options.num_threads = options.num_threads;
  write_options.unit_bytes = std::min(
      options.buffer_bytes / static_cast<uint64_t>(options.num_threads) / (any_converted ? 2 : 1),
      kMaxUnitBytes);
  write_options.sync = options.sync;
  write_options.verify_checksums = options.verify_checksums;
  write_options.progress = options.progress;
  return write_options;
}

// Step 4's message: what rank `r` wrote (its checksums and object lengths), or its error.
Bytes SealWritten(const Result<RankWriteResult>& written) {
  Bytes mine;
  if (written.ok()) {
    ByteWriter out(&mine);
    out.PutVector(written->checksums);
    out.PutVector(written->object_lengths);
  }
  return Seal(written.status(), std::move(mine));
}

// The coordinator's reading of every rank's SealWritten: the first rank's error, else what
// each sent.
Result<Gathered> OpenWritten(const std::vector<Bytes>& sealed, const Comm& comm) {
  Gathered gathered;
  gathered.checksums.resize(sealed.size());
  gathered.object_lengths.resize(sealed.size());
  for (size_t r = 0; r < sealed.size(); ++r) {
    TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> body,
                             Open(sealed[r], SenderName(comm, static_cast<int>(r))));
    ByteReader reader(body);
    TESSERA_RETURN_IF_ERROR(reader.GetVector(&gathered.checksums[r]));
    TESSERA_RETURN_IF_ERROR(reader.GetVector(&gathered.object_lengths[r]));
  }
  return gathered;
}

// What Convert reports: the plan's totals, the files of the output (its index last), and
// what this rank wrote.
ConvertReport MakeReport(const CheckpointIndex& index, const ConvertPlan& plan,
                         const FormatWriter& writer, const std::vector<std::string>& names,
                         const RankWriteResult& written) {
  ConvertReport report;
  report.source_format = index.metadata.format;
  report.tensors = plan.tensors.size();
  report.objects = plan.objects.size();
  report.total_bytes = plan.total_tensor_bytes;
  for (const OutputObject& o : plan.objects) report.total_bytes += o.bytes;
  report.files = names;
  // A numbered index is the first commit of a new directory.
  if (writer.NeedsIndex(names.size())) report.files.push_back(writer.IndexFileName(1));
  report.bytes_written = written.bytes_written;
  report.bytes_read = written.bytes_read;
  report.files_written = written.files_written;
  report.skipped_objects = plan.skipped_objects;
  return report;
}

// Convert from `src` in `source` to `dst` in `output`, a store with positional writes (and
// with rename, for a format whose files are the checkpoint): the files are written into `dst`
// and committed there (the protocol at the top of this file).
Result<ConvertReport> ConvertInto(Storage& source, const std::string& src, Storage& output,
                                  const std::string& dst, const ConvertOptions& options,
                                  const FormatWriter& writer, Comm& comm) {
  const bool coordinator = comm.rank() == kCoordinator;
  TESSERA_ASSIGN_OR_RETURN(const Destination destination, SplitDestination(dst));
  TESSERA_ASSIGN_OR_RETURN(const CheckpointIndex index, ReadAndShareIndex(comm, source, src));
  TESSERA_ASSIGN_OR_RETURN(const ConvertPlan plan, PlanOutput(index, options, writer, comm.size()));
  bool created = false;
  TESSERA_ASSIGN_OR_RETURN(const std::string save_id,
                           PrepareAndShareSaveId(output, destination, options, comm, created));

  // 4. This rank's files, straight into DST; the files of a format whose files are the
  // checkpoint under hidden names until the commit (`names` are the names they end up with).
  Result<OutputLayout> layout = LayOutOutput(plan, index.metadata, writer, save_id);
  std::vector<std::string> names;
  if (layout.ok()) {
    names = layout->names;
    if (writer.FilesAreTheCheckpoint()) {
      for (std::string& name : layout->names) name = HiddenName(name, save_id);
    }
  }
  Result<RankWriteResult> written =
      layout.ok() ? WriteRankFiles(source, output, destination.path, index, src, plan, *layout,
                                   comm.rank(), WriteOptionsOf(options, plan))
                  : Result<RankWriteResult>(layout.status());
  std::vector<Bytes> sealed;
  TESSERA_RETURN_IF_ERROR(comm.Gather(SealWritten(written), &sealed, kCoordinator));

  // 5. The coordinator commits, or removes what was written; everyone learns the outcome.
  Bytes outcome;
  if (coordinator) {
    bool visible = false;
    Status status = [&]() -> Status {
      TESSERA_ASSIGN_OR_RETURN(const Gathered gathered, OpenWritten(sealed, comm));
      return Commit(output, destination, writer, options, plan, *layout, names, index.metadata,
                    gathered, save_id, comm.size(), visible);
    }();
    if (status.ok() || visible) {
      RemoveSaveMarker(output, destination.path, save_id);
    } else {
      RemoveOutput(output, destination, layout.ok() ? layout->names : std::vector<std::string>(),
                   names, save_id, created);
    }
    outcome = Seal(status);
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&outcome, kCoordinator));
  TESSERA_RETURN_IF_ERROR(Open(outcome, "").status());
  return MakeReport(index, plan, writer, names, *written);
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
                                          const ConvertOptions& options, const FormatWriter& writer,
                                          Comm& comm) {
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
  Result<ConvertReport> report =
      ConvertInto(source, src, *local, staged, local_options, writer, comm);
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
  TESSERA_ASSIGN_OR_RETURN(const std::unique_ptr<FormatWriter> writer, WriterFor(options));
  // Paths or URIs (s3://, msc://, file://) where the options name no storage.
  TESSERA_ASSIGN_OR_RETURN(auto source, ResolveStorage(src, options.storage));
  TESSERA_ASSIGN_OR_RETURN(
      auto output,
      ResolveStorage(dst, options.output_storage ? options.output_storage : options.storage));
  // The files are written at offsets in any order, and files that are the checkpoint
  // (Hugging Face) are renamed to their names once complete: into a store without those
  // capabilities (an object store), the conversion is made in a local directory first and then
  // uploaded, its index last.
  const StorageCapabilities caps = output.first->capabilities();
  if (!caps.positional_writes || (writer->FilesAreTheCheckpoint() && !caps.rename)) {
    return ConvertThroughLocal(*source.first, source.second, *output.first, output.second, dst,
                               options, *writer, comm);
  }
  return ConvertInto(*source.first, source.second, *output.first, output.second, options, *writer,
                     comm);
}

Result<ConvertReport> Convert(const std::string& src, const std::string& dst,
                              const ConvertOptions& options) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  return Convert(src, dst, options, *comm);
}

}  // namespace tessera
