// tessera ls: the checkpoints under a directory, oldest first.
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "format/checkpoint_index.h"
#include "format/registry.h"
#include "format/tessera/manifest.h"
#include "format/tessera/rank_manifests.h"
#include "tessera/checkpoint.h"
#include "tessera/storage_uri.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/text.h"
#include "tools/uploads.h"

namespace tessera::tools {
namespace {

namespace fs = std::filesystem;

// One checkpoint found.
struct Found {
  std::string path;    // relative to the directory searched; "." for itself
  std::string format;  // CheckpointFormatName
  std::string step;    // user metadata "step"; "" when absent
  uint64_t bytes = 0;  // of its files
  int files = 0;
  int ranks = 0;             // 0: unknown
  int64_t save_time_ms = 0;  // the manifest's, else the newest file's modification time
  bool committed = true;     // false: the files of a save that did not finish
  std::string problem;       // why it could not be read, or ""
  // Rank-local saves (docs/FORMAT.md 4.2): what ls says about their parts, e.g. "rank-local,
  // 4 of 4 parts, not finalized"; "" when the directory holds no rank manifest.
  std::string rank_local;
  // Its format's checkpoints may hold others in subdirectories (Format::NestsCheckpoints).
  bool nests = false;
};

struct Entry {
  std::string name;
  uint64_t size = 0;
  int64_t mtime_ms = 0;
};

int64_t ModifiedMs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000;
}

// Where ls looks: the local file system (through std::filesystem, for modification times and
// to leave symbolic links alone), or another Storage (an object store: S3 through s3:// or
// msc://), whose listing gives names, and a Stat and an open per name their kind and size.
struct Place {
  std::shared_ptr<Storage> storage;
  bool local = true;
};

// The regular files (names, sizes, times) and the subdirectories of `dir`. Symbolic links are
// neither followed nor listed.
void ListLocalDir(const std::string& dir, std::vector<Entry>& files,
                  std::vector<std::string>& subdirs) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end; it.increment(ec)) {
    struct stat st;
    if (lstat(it->path().c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) subdirs.push_back(it->path().string());
    if (S_ISREG(st.st_mode)) {
      files.push_back(
          {it->path().filename().string(), static_cast<uint64_t>(st.st_size), ModifiedMs(st)});
    }
  }
}

// As ListLocalDir, through the Storage (no modification times: a checkpoint's time is then its
// manifest's). A name that vanishes between the listing and its Stat is left out. Any other
// failure (an object store that throttles past its retries, or denies) is the error: a listing
// that failed must not read as "no checkpoints".
Status ListStorageDir(Storage& storage, const std::string& dir, std::vector<Entry>& files,
                      std::vector<std::string>& subdirs) {
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (names.status().code() == StatusCode::kNotFound) return Status::Ok();
  TESSERA_RETURN_IF_ERROR_CTX(names.status(), "listing " + dir);
  for (const std::string& name : *names) {
    const std::string path = JoinPath(dir, name);
    Result<FileType> type = storage.Stat(path);
    if (type.status().code() == StatusCode::kNotFound) continue;
    TESSERA_RETURN_IF_ERROR(type.status());
    if (*type == FileType::kDirectory) subdirs.push_back(path);
    if (*type != FileType::kFile) continue;
    Result<std::unique_ptr<ReadableFile>> file = storage.NewReadableFile(path);
    if (file.status().code() == StatusCode::kNotFound) continue;
    TESSERA_RETURN_IF_ERROR(file.status());
    files.push_back({name, (*file)->size(), 0});
  }
  return Status::Ok();
}

Status ListDir(const Place& place, const std::string& dir, std::vector<Entry>& files,
               std::vector<std::string>& subdirs) {
  if (place.local) {
    ListLocalDir(dir, files, subdirs);
  } else {
    TESSERA_RETURN_IF_ERROR(ListStorageDir(*place.storage, dir, files, subdirs));
  }
  std::sort(files.begin(), files.end(),
            [](const Entry& a, const Entry& b) { return a.name < b.name; });
  return Status::Ok();
}

// Files whose names satisfy `pick`: counted, summed, newest time.
template <typename Pick>
void Tally(const std::vector<Entry>& files, const Pick& pick, Found& found) {
  for (const Entry& e : files) {
    if (!pick(e.name)) continue;
    found.files += 1;
    found.bytes += e.size;
    found.save_time_ms = std::max(found.save_time_ms, e.mtime_ms);
  }
}

bool IsRankManifest(const std::string& n) {
  std::string id;
  int rank = 0;
  return ParseRankManifestName(n, &id, &rank);
}

// Fills `found` from the checkpoint's index; on failure keeps what the listing said and
// records the problem.
void FromMetadata(const Place& place, const std::string& dir, Found& found) {
  Result<Metadata> m = ReadMetadata(dir, place.storage);
  if (!m.ok()) {
    found.problem = m.status().ToString();
    return;
  }
  found.format = CheckpointFormatName(m->format);
  found.files = static_cast<int>(m->files.size());
  found.bytes = 0;
  for (const FileInfo& f : m->files) found.bytes += f.size;
  found.ranks = m->num_ranks;
  if (m->save_time_unix_ms > 0) found.save_time_ms = m->save_time_unix_ms;
  if (auto it = m->user_metadata.find("step"); it != m->user_metadata.end())
    found.step = it->second;
}

// A directory with rank manifests: a complete rank-local save is a committed checkpoint (not yet
// finalized); an incomplete one is uncommitted, and says how many of its parts are there.
void FromRankManifests(const Place& place, const std::string& dir, const std::vector<Entry>& files,
                       Found& found) {
  Storage& storage = *place.storage;
  std::vector<std::string> names;
  for (const Entry& e : files) names.push_back(e.name);
  Result<std::vector<RankManifestSet>> sets = FindRankManifestSets(storage, dir, names);
  Result<CheckpointIndex> index = ReadCheckpointIndex(storage, dir);
  found.format = "tessera";
  auto parts = [](const RankManifestSet& set) {
    return std::to_string(set.names.size()) + " of " +
           (set.header_read ? std::to_string(set.num_ranks) : std::string("?")) + " parts";
  };
  const RankManifestSet* newest = nullptr;  // the newest set, or the one that is the checkpoint
  // `newest` points into `all`, which outlives its uses below.
  const std::vector<RankManifestSet> all = sets.ok() ? *sets : std::vector<RankManifestSet>{};
  for (const RankManifestSet& set : all) {
    if (index.ok() && index->metadata.save_id == set.save_id) {
      newest = &set;
      break;
    }
    if (!newest || set.save_time_unix_ms > newest->save_time_unix_ms) newest = &set;
  }
  if (index.ok()) {
    FromMetadata(place, dir, found);
    if (index->rank_local) {
      found.rank_local = "rank-local, " + parts(*newest) + ", not finalized";
    } else if (newest && newest->save_id != index->metadata.save_id) {
      found.rank_local = "an older or unfinished rank-local save has " + parts(*newest);
    } else if (newest) {
      found.rank_local = "finalized; its rank manifests are left (finalize again removes them)";
    }
    return;
  }
  found.committed = false;
  const Format& tessera = FormatOf(CheckpointFormat::kTessera);
  Tally(
      files,
      [&](const std::string& n) { return tessera.CountsFile(n, DirectoryClaim::kUnfinished); },
      found);
  if (newest) {
    found.rank_local = "rank-local, " + parts(*newest);
    if (newest->header_read) found.ranks = newest->num_ranks;
  }
  if (index.status().code() != StatusCode::kFailedPrecondition) {
    found.problem = index.status().ToString();  // damaged, not merely unfinished
  }
}

// The checkpoint `dir` holds, if any: its format is the one the registry chooses from the
// names (ChooseFormats), as ReadMetadata does.
std::optional<Found> Examine(const Place& place, const std::string& dir,
                             const std::vector<Entry>& files) {
  std::vector<std::string> names;
  for (const Entry& e : files) names.push_back(e.name);  // sorted by ListDir
  const FormatChoice choice = ChooseFormats(names);
  const Format* format = choice.primary();
  if (!format) return std::nullopt;
  const DirectoryClaim claim = choice.primary_claim();
  Found found;
  found.format = format->name();
  found.nests = format->NestsCheckpoints();
  Tally(
      files, [&](const std::string& n) { return format->CountsFile(n, claim); }, found);
  if (claim == DirectoryClaim::kUnfinished) {
    found.committed = false;
  } else if (format->id() == CheckpointFormat::kTessera &&
             std::any_of(names.begin(), names.end(), IsRankManifest)) {
    FromRankManifests(place, dir, files, found);  // what ls says of rank-local saves
  } else {
    FromMetadata(place, dir, found);
  }
  return found;
}

// `dir` (found under `root`) relative to `root`; "." for `root` itself.
std::string RelativePath(const Place& place, const std::string& dir, const std::string& root) {
  if (dir == root) return ".";
  if (place.local) return fs::relative(fs::path(dir), fs::path(root)).string();
  // Keys: `dir` is JoinPath(root, ...), so `root`, a '/', then the rest.
  std::string rest = dir.substr(std::min(dir.size(), root.size()));
  while (rest.starts_with('/')) rest.erase(0, 1);
  return rest;
}

// Every checkpoint under `root`. The subdirectories of a tessera or DCP checkpoint are not
// searched (none of its files lie there). Those of a directory of .safetensors files are: any
// such file makes the directory a Hugging Face checkpoint, a stray one included, and the
// Trainer keeps checkpoint-N/ subdirectories beside its final model (issue 22: a stray file
// once hid every checkpoint below it).
Result<std::vector<Found>> Search(const Place& place, const std::string& root) {
  std::vector<Found> all;
  std::vector<std::string> todo = {root};
  while (!todo.empty()) {
    const std::string dir = std::move(todo.back());
    todo.pop_back();
    std::vector<Entry> files;
    std::vector<std::string> subdirs;
    TESSERA_RETURN_IF_ERROR(ListDir(place, dir, files, subdirs));
    if (std::optional<Found> found = Examine(place, dir, files)) {
      found->path = RelativePath(place, dir, root);
      const bool search_on = found->nests;
      all.push_back(std::move(*found));
      if (!search_on) continue;
    }
    todo.insert(todo.end(), subdirs.begin(), subdirs.end());
  }
  std::sort(all.begin(), all.end(), [](const Found& a, const Found& b) {
    if (a.save_time_ms != b.save_time_ms) return a.save_time_ms < b.save_time_ms;
    return NaturalLess(a.path, b.path);
  });
  return all;
}

std::string State(const Found& f) {
  if (!f.problem.empty()) return "unreadable: " + f.problem;
  if (!f.rank_local.empty()) {
    return (f.committed ? "committed (" : "uncommitted (") + f.rank_local +
           (f.committed ? ")" : "; ranks still saving, or died)");
  }
  return f.committed ? "committed" : "uncommitted (a save that did not finish, or still runs)";
}

using Uploads = std::optional<std::vector<IncompleteUpload>>;

int PrintLsJson(const std::string& dir, const std::vector<Found>& all, const Place& place,
                const Uploads& uploads, const std::string& uploads_error) {
  nlohmann::json list = nlohmann::json::array();
  for (const Found& f : all) {
    nlohmann::json item = {{"path", f.path},
                           {"format", f.format},
                           {"step", f.step.empty() ? nlohmann::json() : nlohmann::json(f.step)},
                           {"bytes", f.bytes},
                           {"files", f.files},
                           {"ranks", f.ranks},
                           {"save_time_unix_ms", f.save_time_ms},
                           {"committed", f.committed}};
    if (!f.problem.empty()) item["error"] = f.problem;
    if (!f.rank_local.empty()) item["rank_local"] = f.rank_local;
    list.push_back(std::move(item));
  }
  nlohmann::json doc{{"dir", dir}, {"checkpoints", list}};
  if (uploads) {  // an object store: its multipart uploads that neither completed nor aborted
    nlohmann::json items = nlohmann::json::array();
    for (const IncompleteUpload& u : *uploads) {
      items.push_back({{"uri", UploadUri(place.storage, u)},
                       {"upload_id", u.upload_id},
                       {"initiated", u.initiated},
                       {"age_seconds", u.age_seconds}});
    }
    doc["incomplete_uploads"] = std::move(items);
  }
  if (!uploads_error.empty()) doc["incomplete_uploads_error"] = uploads_error;
  PrintJson(std::move(doc));
  return 0;
}

// The object store's uploads that neither completed nor aborted, after the table.
void PrintUploads(const std::string& dir, const Place& place, const Uploads& uploads) {
  if (!uploads || uploads->empty()) return;
  std::printf(
      "%zu incomplete multipart upload%s under %s (a save still writing, or one that died; "
      "their parts cost storage: tessera prune --abort-uploads-older-than AGE removes them):\n",
      uploads->size(), uploads->size() == 1 ? "" : "s", Printable(dir).c_str());
  for (const IncompleteUpload& u : *uploads) {
    const std::string age =
        u.age_seconds < 0 ? "age unknown" : "started " + std::to_string(u.age_seconds) + " s ago";
    std::printf("  %s  %s  (%s)\n", Printable(UploadUri(place.storage, u)).c_str(),
                Printable(u.initiated).c_str(), age.c_str());
  }
}

void PrintTable(const std::vector<Found>& all) {
  const size_t width = static_cast<size_t>(std::max(OutputWidth(), 20));
  std::vector<std::vector<std::string>> rows = {
      {"PATH", "FORMAT", "STEP", "BYTES", "FILES", "RANKS", "SAVED", "STATE"}};
  for (const Found& f : all) {
    rows.push_back({Printable(f.path), f.format, f.step.empty() ? "-" : Printable(f.step),
                    FormatBytes(f.bytes), std::to_string(f.files),
                    f.ranks > 0 ? std::to_string(f.ranks) : "-", FormatTime(f.save_time_ms),
                    State(f)});
  }
  std::vector<size_t> w(8, 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) w[c] = std::max(w[c], DisplayWidth(row[c]));
  }
  // On a terminal the path column gives way first (cut in the middle), down to 12 columns; the
  // state, last, is cut at the end of the line. Off a terminal (a pipe, a file, a script) every
  // line is whole: a path cut with "..." cannot be used.
  const bool terminal = isatty(STDOUT_FILENO) == 1;
  size_t others = 0;
  for (size_t c = 1; c < 7; ++c) others += w[c] + 2;
  const size_t state_room = 12;
  if (terminal && w[0] + others + state_room > width) {
    w[0] = std::max<size_t>(12, width > others + state_room ? width - others - state_room : 0);
  }
  const bool right[8] = {false, false, true, true, true, true, false, false};
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string cell = c == 0 ? FitMiddle(row[c], w[0]) : row[c];
      if (c == 7) {
        line += cell;
      } else {
        line += (right[c] ? PadLeft(cell, w[c]) : PadRight(cell, w[c])) + "  ";
      }
    }
    std::printf("%s\n", (terminal ? FitEnd(line, width) : line).c_str());
  }
}

int RunLs(const std::string& dir, bool json) {
  // A path or a URI (s3://bucket/prefix, msc://profile/prefix, file:///dir).
  Result<std::pair<std::shared_ptr<Storage>, std::string>> location = OpenStorage(dir);
  if (!location.ok()) return Fail(location.status());
  // A store with directory sync is a file system (POSIX); one without, an object store.
  const Place place{location->first, location->first->capabilities().directory_sync};
  const std::string& root = location->second;
  if (place.local) {
    struct stat st;
    if (stat(root.c_str(), &st) != 0) {
      return Fail(NotFound("directory " + Printable(dir) + " does not exist"));
    }
    if (!S_ISDIR(st.st_mode)) {
      return Fail(FailedPrecondition(Printable(dir) + " is not a directory"));
    }
  } else {
    // An object store: a prefix. A file of that name is not a directory; a prefix holding no
    // key lists empty (an object store cannot tell an empty directory from a missing one).
    Result<FileType> type = place.storage->Stat(root);
    if (!type.ok()) return Fail(type.status());
    if (*type == FileType::kFile) {
      return Fail(FailedPrecondition(Printable(dir) + " is an object, not a prefix"));
    }
  }
  Result<std::vector<Found>> searched = Search(place, root);
  if (!searched.ok()) return Fail(searched.status().WithContext("ls " + Printable(dir)));
  const std::vector<Found>& all = *searched;
  // The uploads are extra: credentials that may list and read but not list uploads
  // (s3:ListBucketMultipartUploads) still list the checkpoints, with a warning.
  Result<Uploads> uploads = IncompleteUploadsUnder(place.storage, root);
  std::string uploads_error;
  if (!uploads.ok()) {
    uploads_error = uploads.status().ToString();
    std::fprintf(stderr, "tessera: warning: %s\n", Printable(uploads_error).c_str());
    uploads = Uploads();
  }
  if (json) return PrintLsJson(dir, all, place, *uploads, uploads_error);
  if (all.empty()) {
    std::printf("no checkpoints under %s\n", Printable(dir).c_str());
  } else {
    PrintTable(all);
  }
  PrintUploads(dir, place, *uploads);
  return 0;
}

}  // namespace

void AddLsCommand(CLI::App& app, int* exit_code) {
  auto dir = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  CLI::App* ls = app.add_subcommand(
      "ls",
      "List the checkpoints under a directory (tessera, PyTorch DCP, Hugging Face), oldest first");
  ls->add_option("DIR", *dir, "directory searched, with its subdirectories")->required();
  ls->add_flag("--json", *json, "print one JSON document");
  ls->callback([=] { *exit_code = RunLs(*dir, *json); });
}

}  // namespace tessera::tools
