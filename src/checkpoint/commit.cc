#include "checkpoint/commit.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include "core/utf8.h"
#include "format/manifest.h"
#include "format/rank_manifests.h"

namespace tessera {
namespace {

constexpr char kMarkerPrefix[] = "tessera.saving.";
constexpr char kMarkerTempSuffix[] = ".tmp";
// A marker written on another host cannot be checked for liveness; it protects its save's
// files for this long after it was created. Longer than any save; afterwards the files of a
// save that died on another host become garbage for the next cleanup.
constexpr int64_t kForeignMarkerLifetimeMs = 24ll * 3600 * 1000;

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ReadSmallFile(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Who runs this process: host, boot, pid and the pid's start time (so a reused pid is told
// apart).
struct ProcessIdentity {
  std::string host;
  std::string boot_id;
  int64_t pid = 0;
  std::string start_time;  // field 22 of /proc/<pid>/stat, clock ticks since boot
};

std::string StartTimeOf(int64_t pid) {
  const std::string stat = ReadSmallFile(("/proc/" + std::to_string(pid) + "/stat").c_str());
  // The command name (field 2) is in parentheses and may hold spaces: count after the last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && (fields >> field); ++i) {
    if (i == 22) return field;
  }
  return "";
}

ProcessIdentity ThisProcess() {
  ProcessIdentity me;
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) me.host = host;
  me.boot_id = ReadSmallFile("/proc/sys/kernel/random/boot_id");
  me.pid = static_cast<int64_t>(getpid());
  me.start_time = StartTimeOf(me.pid);
  return me;
}

std::string MarkerName(const std::string& save_id) { return kMarkerPrefix + save_id; }

// The save id a marker name is for, or "" when `name` is not a marker.
// A rank of a rank-local save marks "<save_id>.r<rank>" (the ranks share the save id).
std::string MarkerSaveId(const std::string& name) {
  if (!name.starts_with(kMarkerPrefix) || name.ends_with(kMarkerTempSuffix)) return "";
  std::string id = name.substr(sizeof(kMarkerPrefix) - 1);
  if (id.size() > 16 && id[16] == '.') id.resize(16);
  return id;
}

// The save id in a data file or temporary manifest name, or "".
std::string SaveIdOf(const std::string& name) {
  if (IsTesseraDataFileName(name)) return name.substr(4, 16);  // "tsr-" + 16 hex digits
  if (IsTempManifestName(name)) return name.substr(TempManifestName("").size());
  std::string id;
  int rank = 0;
  const std::string_view committed_name =
      std::string_view(name).substr(0, name.ends_with(".tmp") ? name.size() - 4 : name.size());
  if (ParseRankManifestName(committed_name, &id, &rank)) return id;
  return "";
}

// The fields of an owner record ("key=value" lines).
std::map<std::string, std::string> ParseOwnerRecord(std::string_view text) {
  std::map<std::string, std::string> fields;
  std::istringstream lines{std::string(text)};
  for (std::string line; std::getline(lines, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) fields[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return fields;
}

// Whether the process an owner record names may still be running (see OwnerRecordMayBeAlive).
bool OwnerAlive(std::string_view text, const ProcessIdentity& me) {
  std::map<std::string, std::string> fields = ParseOwnerRecord(text);
  if (!fields.count("host") || !fields.count("pid") || !fields.count("created_unix_ms")) {
    return false;
  }
  if (fields["host"] != me.host) {
    const int64_t created = std::strtoll(fields["created_unix_ms"].c_str(), nullptr, 10);
    return NowUnixMs() - created < kForeignMarkerLifetimeMs;
  }
  if (fields["boot_id"] != me.boot_id) return false;  // the machine rebooted since
  const int64_t pid = std::strtoll(fields["pid"].c_str(), nullptr, 10);
  const std::string start = StartTimeOf(pid);
  return !start.empty() && start == fields["process_start"];
}

// Whether the save that wrote marker `name` may still be running. A marker that cannot be read
// or parsed belongs to no running save: a live save writes its marker whole (under a temporary
// name, then renamed) before anything else.
bool MarkerOwnerAlive(Storage& storage, const std::string& dir, const std::string& name,
                      const ProcessIdentity& me) {
  Result<std::unique_ptr<ReadableFile>> file = storage.NewReadableFile(JoinPath(dir, name));
  if (!file.ok() || (*file)->size() > 4096) return false;
  std::string text((*file)->size(), '\0');
  if (!(*file)->ReadAt(0, text.data(), text.size()).ok()) return false;
  return OwnerAlive(text, me);
}

std::string ParentDir(const std::string& path) {
  size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  size_t slash = path.rfind('/', end);
  if (slash == std::string::npos) return ".";
  size_t parent_end = path.find_last_not_of('/', slash);
  return parent_end == std::string::npos ? "/" : path.substr(0, parent_end + 1);
}

bool IsRankManifestName(const std::string& name) {
  std::string id;
  int rank = 0;
  return ParseRankManifestName(name, &id, &rank);
}

}  // namespace

Status CheckUserMetadata(const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) {
    if (!IsValidUtf8(key)) {
      return InvalidArgument("SaveOptions::user_metadata key " + QuoteBytes(key) +
                             " is not valid UTF-8");
    }
    if (!IsValidUtf8(value)) {
      return InvalidArgument("SaveOptions::user_metadata[" + QuoteBytes(key) +
                             "] = " + QuoteBytes(value) + " is not valid UTF-8");
    }
  }
  return Status::Ok();
}

std::vector<std::string> SortedUnique(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

Status WriteWholeFile(Storage& storage, const std::string& path, const Bytes& bytes, bool sync) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out,
                           storage.NewWritableFile(path, CreateMode::kExclusive));
  TESSERA_RETURN_IF_ERROR(out->WriteAt(0, bytes.data(), bytes.size()));
  if (sync) TESSERA_RETURN_IF_ERROR(out->Sync());
  return out->Close();
}

std::string ThisProcessOwnerRecord() {
  const ProcessIdentity me = ThisProcess();
  return "host=" + me.host + "\nboot_id=" + me.boot_id + "\npid=" + std::to_string(me.pid) +
         "\nprocess_start=" + me.start_time + "\ncreated_unix_ms=" + std::to_string(NowUnixMs()) +
         "\n";
}

bool OwnerRecordMayBeAlive(std::string_view text) { return OwnerAlive(text, ThisProcess()); }

std::string DescribeOwnerRecord(std::string_view text) {
  std::map<std::string, std::string> fields = ParseOwnerRecord(text);
  if (!fields.count("host") || !fields.count("pid")) return "an unreadable owner record";
  return "process " + fields["pid"] + " on host " + fields["host"];
}

SaveMarkers FindSaveMarkers(Storage& storage, const std::string& dir,
                            const std::vector<std::string>& names, const std::string& own_save_id) {
  const ProcessIdentity me = ThisProcess();
  SaveMarkers markers;
  markers.running.insert(own_save_id);
  for (const std::string& name : names) {
    const std::string id = MarkerSaveId(name);
    if (id.empty() || id == own_save_id) continue;
    if (MarkerOwnerAlive(storage, dir, name, me)) {
      markers.running.insert(id);
    } else {
      markers.dead_markers.push_back(name);
    }
  }
  return markers;
}

Status CreateDurableDirs(Storage& storage, const std::string& path, SyncPolicy sync) {
  std::vector<std::string> missing;  // deepest first
  for (std::string dir = path;;) {
    TESSERA_ASSIGN_OR_RETURN(FileType type, storage.Stat(dir));
    if (type == FileType::kDirectory) break;
    if (type == FileType::kFile) {
      return FailedPrecondition("cannot create checkpoint directory " + path + ": " + dir +
                                " is a file");
    }
    missing.push_back(dir);
    std::string parent = ParentDir(dir);
    if (parent == dir) break;
    dir = std::move(parent);
  }
  if (missing.empty()) return Status::Ok();
  TESSERA_RETURN_IF_ERROR_CTX(storage.CreateDirs(path), "creating checkpoint directory");
  if (sync == SyncPolicy::kFull) {
    for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
      TESSERA_RETURN_IF_ERROR(storage.SyncDir(ParentDir(*it)));
    }
  }
  return Status::Ok();
}

std::string NewSaveId(const std::vector<std::string>& existing_names) {
  std::random_device device;  // the kernel's random source, not seeded from anything visible
  while (true) {
    const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
    char id[17];
    std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(bits));
    const std::string marker = MarkerName(id);
    const std::string tagged = "tsr-" + std::string(id);
    const bool used = std::any_of(existing_names.begin(), existing_names.end(), [&](const auto& n) {
      // Any name carrying the id: tessera's files and those of other formats (DCP data files
      // "__0_0.tsr-<id>.distcp").
      return n.find(tagged) != std::string::npos || n.starts_with(marker) || SaveIdOf(n) == id;
    });
    if (!used) return id;
  }
}

Status CreateSaveMarker(Storage& storage, const std::string& dir, const std::string& save_id,
                        SyncPolicy sync) {
  const std::string text =
      "tessera save marker\nsave_id=" + save_id + "\n" + ThisProcessOwnerRecord();
  const std::string name = MarkerName(save_id);
  const std::string temp = JoinPath(dir, name + kMarkerTempSuffix);
  const bool durable = sync == SyncPolicy::kFull;
  TESSERA_RETURN_IF_ERROR_CTX(
      WriteWholeFile(storage, temp, Bytes(text.begin(), text.end()), durable),
      "writing the in-progress marker of save " + save_id);
  TESSERA_RETURN_IF_ERROR(storage.Rename(temp, JoinPath(dir, name)));
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));
  return Status::Ok();
}

void RemoveSaveMarker(Storage& storage, const std::string& dir, const std::string& save_id) {
  storage.Remove(JoinPath(dir, MarkerName(save_id))).IgnoreError();
}

Status CommitManifest(Storage& storage, const std::string& dir, const Metadata& metadata,
                      SyncPolicy sync, bool& renamed) {
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  const Bytes bytes = EncodeManifest(metadata);
  // What the writer writes must pass the reader's validation, or the save would replace a
  // good checkpoint by one nobody can read.
  if (Result<Metadata> check = DecodeManifest(bytes, manifest_path); !check.ok()) {
    return InvalidArgument("the checkpoint would not be readable, nothing was committed: " +
                           check.status().message());
  }
  // Every data file must still be there: another process may have removed them.
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(dir));
  const std::set<std::string> present(names.begin(), names.end());
  for (const FileInfo& f : metadata.files) {
    if (!present.count(f.name)) {
      return DataLoss("data file " + JoinPath(dir, f.name) + " of this save vanished before " +
                      "the commit (removed by another process?); nothing was committed");
    }
  }
  const bool durable = sync == SyncPolicy::kFull;
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));
  const std::string temp = JoinPath(dir, TempManifestName(metadata.save_id));
  TESSERA_RETURN_IF_ERROR(WriteWholeFile(storage, temp, bytes, durable));
  renamed = true;  // from here on the new manifest may be visible, even if Rename reports failure
  TESSERA_RETURN_IF_ERROR(storage.Rename(temp, manifest_path));
  if (durable) TESSERA_RETURN_IF_ERROR(storage.SyncDir(dir));
  // Read it back: the previous files are removed only when the new manifest is really there.
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> back,
                           storage.NewReadableFile(manifest_path));
  Bytes stored(back->size());
  if (stored.size() == bytes.size()) {
    TESSERA_RETURN_IF_ERROR(back->ReadAt(0, stored.data(), stored.size()));
  }
  if (stored == bytes) return Status::Ok();
  // Replaced by another save that committed since: this one committed too, first.
  if (stored.size() != bytes.size()) {
    stored.resize(back->size());
    TESSERA_RETURN_IF_ERROR(back->ReadAt(0, stored.data(), stored.size()));
  }
  Result<Metadata> now = DecodeManifest(stored, manifest_path);
  if (now.ok() && now->save_id != metadata.save_id) return Status::Ok();
  return DataLoss(manifest_path + " does not read back as written (" +
                  std::to_string(back->size()) + " bytes read, " + std::to_string(bytes.size()) +
                  " written): " + (now.ok() ? "the bytes differ" : now.status().message()));
}

void RemoveStaleFiles(Storage& storage, const std::string& dir, const Metadata& committed) {
  // 1. What is there.
  Result<std::vector<std::string>> names = storage.ListDir(dir);
  if (!names.ok()) return;
  // 2. Which saves may still be running.
  const SaveMarkers markers = FindSaveMarkers(storage, dir, *names, committed.save_id);
  // 3. The manifest in place now, read after the markers: a save that committed after our own
  // commit and has already finished is listed there.
  std::set<std::string> live = {};
  for (const FileInfo& f : committed.files) live.insert(f.name);
  Result<Metadata> current = ReadMetadata(dir, std::shared_ptr<Storage>(&storage, [](Storage*) {}));
  if (!current.ok() && current.status().code() != StatusCode::kFailedPrecondition) return;
  if (current.ok()) {
    for (const FileInfo& f : current->files) live.insert(f.name);
  }
  // 4. Remove the rest.
  // The rank manifests of the checkpoint in place (a rank-local save newer than the commit).
  const std::string current_id = current.ok() ? current->save_id : committed.save_id;
  const int64_t current_time =
      current.ok() ? current->save_time_unix_ms : committed.save_time_unix_ms;
  // Rank-local saves newer than the checkpoint in place and not complete yet: their ranks run at
  // their own pace, and those that finished have removed their markers while others have not
  // started. They are kept until a newer checkpoint supersedes them (a Finalize of the previous
  // save, run beside training, must not delete the next save's parts).
  std::set<std::string> pending;
  if (Result<std::vector<RankManifestSet>> sets = FindRankManifestSets(storage, dir, *names);
      sets.ok()) {
    for (const RankManifestSet& set : *sets) {
      if (set.header_read && set.problem.ok() && set.save_time_unix_ms > current_time) {
        pending.insert(set.save_id);
      }
    }
  }
  for (const std::string& name : *names) {
    const std::string id = SaveIdOf(name);
    if (id.empty() || markers.running.count(id) || live.count(name) || pending.count(id)) continue;
    if (id == current_id && IsRankManifestName(name)) continue;
    storage.Remove(JoinPath(dir, name)).IgnoreError();
  }
  for (const std::string& name : markers.dead_markers) {
    storage.Remove(JoinPath(dir, name)).IgnoreError();
  }
}

}  // namespace tessera
