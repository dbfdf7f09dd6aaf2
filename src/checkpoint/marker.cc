#include "checkpoint/marker.h"

#include <unistd.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace tessera {
namespace {

// A marker written on another host cannot be checked for liveness; it protects its operation's
// files for this long after it was created. Longer than any save; afterwards the files of a
// save that died on another host become garbage for the next cleanup. (A clock decides only
// what is garbage, never which save is the newer.)
constexpr int64_t kForeignMarkerLifetimeMs = 24ll * 3600 * 1000;
// Markers are a few hundred bytes; a larger file is not one.
constexpr uint64_t kMaxMarkerBytes = 4096;

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string StartTimeOf(int64_t pid) {
  const std::string stat = ReadFirstLine("/proc/" + std::to_string(pid) + "/stat");
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

// "pid:[4026531836]", or "" where /proc has no namespace link.
std::string PidNamespace() {
  char link[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  return n > 0 ? std::string(link, static_cast<size_t>(n)) : std::string();
}

MarkerOwner ThisProcess() {
  MarkerOwner me;
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) me.host = host;
  me.boot_id = ReadFirstLine("/proc/sys/kernel/random/boot_id");
  me.pid = static_cast<int64_t>(getpid());
  me.process_start = StartTimeOf(me.pid);
  me.created_unix_ms = NowUnixMs();
  me.pid_namespace = PidNamespace();
  return me;
}

// The markers this process holds now ("<dir>/<marker name>"), from before they are published to
// after they are removed. A marker naming this process but not held is a leftover of an
// operation of this process that ended (a failure it could not clean up, or a crash of the
// machine simulated in a test): its owner is as good as dead.
std::mutex held_mu;
std::set<std::string>& Held() {
  static std::set<std::string>* held = new std::set<std::string>();  // guarded by held_mu
  return *held;
}

std::string HeldKey(const std::string& dir, const std::string& id) {
  return JoinPath(dir, MarkerName(id));
}

// The "key=value" lines of a marker or an owner record.
std::map<std::string, std::string> ParseFields(std::string_view text) {
  std::map<std::string, std::string> fields;
  std::istringstream lines{std::string(text)};
  for (std::string line; std::getline(lines, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) fields[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return fields;
}

// The owner the fields name; false when they name none.
bool OwnerOfFields(std::map<std::string, std::string>& fields, MarkerOwner* owner) {
  if (!fields.count("host") || !fields.count("pid") || !fields.count("created_unix_ms")) {
    return false;
  }
  owner->host = fields["host"];
  owner->boot_id = fields["boot_id"];
  owner->pid = std::strtoll(fields["pid"].c_str(), nullptr, 10);
  owner->process_start = fields["process_start"];
  owner->created_unix_ms = std::strtoll(fields["created_unix_ms"].c_str(), nullptr, 10);
  owner->pid_namespace = fields["pid_ns"];  // absent in older records
  return true;
}

std::string OwnerRecordOf(const MarkerOwner& owner) {
  return "host=" + owner.host + "\nboot_id=" + owner.boot_id +
         "\npid=" + std::to_string(owner.pid) + "\nprocess_start=" + owner.process_start +
         "\ncreated_unix_ms=" + std::to_string(owner.created_unix_ms) +
         (owner.pid_namespace.empty() ? "" : "\npid_ns=" + owner.pid_namespace) + "\n";
}

Result<MarkerContent> ParseMarker(const std::string& text, const std::string& path) {
  std::map<std::string, std::string> fields = ParseFields(text);
  MarkerContent m;
  if (!text.starts_with("tessera save marker\n") || !OwnerOfFields(fields, &m.owner)) {
    return DataLoss(path + " is not an in-progress marker of tessera");
  }
  m.save_id = fields["save_id"];
  m.attempt = fields["attempt"];
  return m;
}

}  // namespace

Status CreateSaveMarker(Storage& storage, const std::string& dir, const std::string& id,
                        SyncPolicy sync, const std::string& attempt) {
  const MarkerOwner me = ThisProcess();
  const std::string save_id = id.size() > 16 && id[16] == '.' ? id.substr(0, 16) : id;
  std::string text = "tessera save marker\nsave_id=" + save_id + "\n";
  if (!attempt.empty()) text += "attempt=" + attempt + "\n";
  text += OwnerRecordOf(me);
  const std::string key = HeldKey(dir, id);
  {
    std::lock_guard<std::mutex> lock(held_mu);
    if (!Held().insert(key).second) {
      return Status(StatusCode::kAlreadyExists,
                    key +
                        " is held by another thread of this process: the same operation runs "
                        "twice at once");
    }
  }
  const std::span<const std::byte> bytes = std::as_bytes(std::span(text.data(), text.size()));
  Status published = storage
                         .Publish(JoinPath(dir, MarkerName(id)), bytes, PublishMode::kCreateOnly,
                                  sync == SyncPolicy::kFull)
                         .WithContext("writing the in-progress marker of " + id);
  if (!published.ok()) {
    std::lock_guard<std::mutex> lock(held_mu);
    Held().erase(key);
  }
  return published;
}

Result<MarkerContent> ReadSaveMarker(Storage& storage, const std::string& dir,
                                     const std::string& id) {
  const std::string path = JoinPath(dir, MarkerName(id));
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  if (file->size() > kMaxMarkerBytes) {
    return DataLoss(path + " is not an in-progress marker of tessera (" +
                    std::to_string(file->size()) + " bytes)");
  }
  std::string text(file->size(), '\0');
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, text.data(), text.size()));
  return ParseMarker(text, path);
}

bool MarkerHeldHere(const std::string& dir, const std::string& id) {
  std::lock_guard<std::mutex> lock(held_mu);
  return Held().count(HeldKey(dir, id)) > 0;
}

void RemoveSaveMarker(Storage& storage, const std::string& dir, const std::string& id) {
  storage.RemoveIfPresent(JoinPath(dir, MarkerName(id))).IgnoreError();
  std::lock_guard<std::mutex> lock(held_mu);
  Held().erase(HeldKey(dir, id));
}

OwnerState StateOfMarker(const std::string& dir, const std::string& id, const MarkerOwner& owner) {
  const OwnerState state = StateOf(owner);
  if (state == OwnerState::kThisProcess && !MarkerHeldHere(dir, id)) return OwnerState::kDead;
  return state;
}

OwnerState StateOf(const MarkerOwner& owner) {
  const MarkerOwner me = ThisProcess();  // not cached: a forked child is another process
  if (owner.host != me.host) return OwnerState::kUnknowable;
  if (owner.boot_id != me.boot_id) return OwnerState::kDead;  // the machine rebooted since
  // Another pid namespace on the same host and boot (a container sharing the host name): its
  // pids mean other processes here, so nothing can be proved dead.
  if (!owner.pid_namespace.empty() && owner.pid_namespace != me.pid_namespace) {
    return OwnerState::kUnknowable;
  }
  if (owner.pid == me.pid && owner.process_start == me.process_start) {
    return OwnerState::kThisProcess;
  }
  const std::string start = StartTimeOf(owner.pid);
  return !start.empty() && start == owner.process_start ? OwnerState::kAlive : OwnerState::kDead;
}

std::string DescribeOwner(const MarkerOwner& owner) {
  std::string when;
  const std::time_t seconds = static_cast<std::time_t>(owner.created_unix_ms / 1000);
  std::tm utc{};
  char text[32];
  if (gmtime_r(&seconds, &utc) && std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &utc)) {
    when = std::string(", marked ") + text + " UTC";
  }
  // The pid namespace tells apart containers that share the host name (marker.h).
  const std::string ns = owner.pid_namespace.empty() ? "" : ", " + owner.pid_namespace;
  return "process " + std::to_string(owner.pid) + " on host " + owner.host + " (boot " +
         owner.boot_id.substr(0, 8) + ", started at clock tick " + owner.process_start + ns + ")" +
         when;
}

std::string ThisProcessOwnerRecord() { return OwnerRecordOf(ThisProcess()); }

bool OwnerRecordMayBeAlive(std::string_view text) {
  std::map<std::string, std::string> fields = ParseFields(text);
  MarkerOwner owner;
  if (!OwnerOfFields(fields, &owner)) return false;
  switch (StateOf(owner)) {
    case OwnerState::kThisProcess:
    case OwnerState::kAlive:
      return true;
    case OwnerState::kDead:
      return false;
    case OwnerState::kUnknowable:
      return NowUnixMs() - owner.created_unix_ms < kForeignMarkerLifetimeMs;
  }
  return false;
}

std::string DescribeOwnerRecord(std::string_view text) {
  std::map<std::string, std::string> fields = ParseFields(text);
  MarkerOwner owner;
  if (!OwnerOfFields(fields, &owner)) return "an unreadable owner record";
  return DescribeOwner(owner);
}

SaveMarkers FindSaveMarkers(Storage& storage, const std::string& dir,
                            const std::vector<std::string>& names, const std::string& own_id) {
  SaveMarkers markers;
  markers.running.insert(own_id);
  for (const std::string& name : names) {
    const std::string id = MarkerSaveId(name);
    if (id.empty()) continue;
    const std::string marker_id = name.substr(sizeof(kMarkerPrefix) - 1);
    // The caller's own marker, which this process holds: running, with nothing to read (on an
    // object store a read is two requests).
    if (marker_id == own_id && MarkerHeldHere(dir, marker_id)) continue;
    Result<MarkerContent> marker = ReadSaveMarker(storage, dir, marker_id);
    bool running = false;
    if (marker.ok()) {
      switch (StateOfMarker(dir, marker_id, marker->owner)) {
        case OwnerState::kThisProcess:
        case OwnerState::kAlive:
          running = true;
          break;
        case OwnerState::kUnknowable:
          running = NowUnixMs() - marker->owner.created_unix_ms < kForeignMarkerLifetimeMs;
          break;
        case OwnerState::kDead:
          break;
      }
    }
    if (!running) {
      if (marker.ok() || marker.status().code() == StatusCode::kDataLoss) {
        markers.dead_markers.push_back(name);
      }
      continue;
    }
    if (id == own_id) continue;
    markers.running.insert(id);
    ++markers.others_running;
  }
  return markers;
}

}  // namespace tessera
