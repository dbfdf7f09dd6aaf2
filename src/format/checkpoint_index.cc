#include "format/checkpoint_index.h"

#include <algorithm>

#include "format/registry.h"
#include "format/tessera/tessera_format.h"

namespace tessera {
namespace {

// Listings of a directory whose commits keep vanishing under the reader before it gives up.
constexpr int kListAttempts = 4;

// Splits "/a/b/c.safetensors" into ("/a/b", "c.safetensors").
std::pair<std::string, std::string> SplitPath(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return {".", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

// What `format` read, as the engine's index. tessera's own codecs validate what they read
// (each knows its format's rules); an index read by a format registered from outside (the
// public plug-in API: a user's format) is held here to every rule of a tessera manifest
// (CheckAsManifest: sorted unique keys, chunks inside their files and tiling their tensors,
// ...), so that a codec's mistake is an error naming the index (`path`), never a read outside
// a file.
Result<CheckpointIndex> FromFormat(const Format& format, FormatIndex index,
                                   const std::string& path) {
  if (!IsBuiltInFormat(format)) {
    Result<Metadata> checked = CheckAsManifest(
        index.metadata, path + " (as the " + std::string(format.name()) + " format read it)");
    if (!checked.ok()) return checked.status();
    const CheckpointFormat id = index.metadata.format;
    index.metadata = std::move(*checked);
    index.metadata.format = id;
  }
  CheckpointIndex out;
  out.root = std::move(index.root);
  out.metadata = std::move(index.metadata);
  out.rank_local = index.rank_local;
  return out;
}

// The error of a directory no format reads: what would make it a checkpoint, and the
// unfinished save found there, if any.
Status NoCheckpoint(const std::string& path, const Format* unfinished) {
  if (unfinished) {
    return FailedPrecondition(path + " holds no committed checkpoint (no " +
                              std::string(unfinished->commit_description()) +
                              "; the data files of a " + unfinished->name() +
                              " save that did not finish are there)");
  }
  std::string wanted;
  const std::vector<const Format*>& formats = RegisteredFormats();
  for (size_t i = 0; i < formats.size(); ++i) {
    if (i > 0) wanted += i + 1 == formats.size() ? " or " : ", ";
    wanted += formats[i]->commit_description();
  }
  return FailedPrecondition(path + " holds no committed checkpoint (no " + wanted + ")");
}

// The index of the directory `path` whose entries (sorted) are `names`: ChooseFormats says
// which format reads it.
Result<CheckpointIndex> ReadDirectory(Storage& storage, const std::string& path,
                                      const std::vector<std::string>& names) {
  const FormatChoice choice = ChooseFormats(names);
  for (size_t i = 0; i < choice.committed.size(); ++i) {
    Result<FormatIndex> index = choice.committed[i]->ReadIndex(storage, path, names);
    // A format that finds no complete checkpoint of its own gives way to the next one.
    const bool last = i + 1 == choice.committed.size();
    if (index.ok()) return FromFormat(*choice.committed[i], std::move(*index), path);
    if (last || index.status().code() != StatusCode::kFailedPrecondition) return index.status();
  }
  if (choice.data) {
    TESSERA_ASSIGN_OR_RETURN(FormatIndex index, choice.data->ReadIndex(storage, path, names));
    return FromFormat(*choice.data, std::move(index), path);
  }
  return NoCheckpoint(path, choice.unfinished);
}

// The index of the directory `path`, listed as `names`. A numbered manifest or a part listed
// may be gone when read: superseded and removed by the cleanup of a commit made meanwhile. The
// directory is then listed again.
Result<CheckpointIndex> ReadListedDirectory(Storage& storage, const std::string& path,
                                            std::vector<std::string> names) {
  for (int attempt = 1;; ++attempt) {
    if (attempt > 1) {
      TESSERA_ASSIGN_OR_RETURN(names, storage.ListDir(path));
    }
    std::sort(names.begin(), names.end());
    Result<CheckpointIndex> index = ReadDirectory(storage, path, names);
    if (index.ok() || index.status().code() != StatusCode::kNotFound || attempt == kListAttempts) {
      return index;
    }
  }
}

}  // namespace

Result<CheckpointIndex> ReadCheckpointIndex(Storage& storage, const std::string& path) {
  // Where a directory is a key prefix (S3), a listing that names entries says what Stat would,
  // which costs two requests (a HEAD: is it an object? a one-key listing: is it a prefix?).
  // Anything else (an empty listing, an object's path, a failure) takes the path below, whose
  // own requests say which it is, or fail with their error. A name that is both an object and
  // a prefix with keys under it is read as the directory.
  std::vector<std::string> listed;
  if (storage.capabilities().implicit_directories) {
    Result<std::vector<std::string>> names = storage.ListDir(path);
    if (names.ok()) listed = std::move(*names);
  }
  if (!listed.empty()) return ReadListedDirectory(storage, path, std::move(listed));
  TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(path));
  if (type == FileType::kNotFound) {
    return NotFound("checkpoint directory " + path + " does not exist");
  }
  if (type == FileType::kFile) {
    auto [dir, name] = SplitPath(path);
    const Format* format = FormatOfFile(name);
    if (!format) {
      return FailedPrecondition(path +
                                " is a file, not a checkpoint directory (a single file "
                                "must be a .safetensors file)");
    }
    TESSERA_ASSIGN_OR_RETURN(FormatIndex index, format->ReadFileIndex(storage, dir, name));
    return FromFormat(*format, std::move(index), path);
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(path));
  return ReadListedDirectory(storage, path, std::move(names));
}

}  // namespace tessera
