// In-progress markers (docs/FORMAT.md, section 4, step 0): the file "tessera.saving.<id>" a save,
// a RemoveKeys or a Finalize publishes (create-only) before its first file and removes after its
// cleanup. It says who runs the operation (host, boot, process id and start time), so that
// another operation's cleanup can tell a running one (whose files it must keep) from one that
// died (whose files are garbage), and a rank-local rank can tell its own leftover from another
// job's save of the same tag. Each rank of a rank-local save marks "<save_id>.r<rank>".
#ifndef TESSERA_CHECKPOINT_MARKER_H_
#define TESSERA_CHECKPOINT_MARKER_H_

#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "format/tessera/names.h"  // MarkerName, MarkerSaveId
#include "tessera/checkpoint.h"
#include "tessera/storage.h"

namespace tessera {

// Who runs an operation.
struct MarkerOwner {
  std::string host;
  std::string boot_id;  // /proc/sys/kernel/random/boot_id: a reboot makes every owner dead
  int64_t pid = 0;
  std::string process_start;  // field 22 of /proc/<pid>/stat: a reused pid is another process
  int64_t created_unix_ms = 0;
  // The pid namespace (readlink /proc/self/ns/pid, "pid:[4026531836]"). Containers that share
  // the node's host name (Kubernetes hostNetwork, docker --network=host) share its boot id but
  // not its pids: an owner of another namespace is judged like one of another host. Empty in
  // records written before the field existed (judged as before) or where /proc has no ns link.
  std::string pid_namespace;
};

// The owner as this process sees it.
enum class OwnerState {
  kThisProcess,  // this very process (same host, boot, pid and start time)
  kAlive,        // another process of this host and boot, running
  kDead,         // of this host: its process ended, or the host rebooted since
  kUnknowable,   // of another host or pid namespace: its processes cannot be checked from here
};

struct MarkerContent {
  std::string save_id;  // the id the marker protects the files of
  MarkerOwner owner;
  // A rank-local rank's attempt id (its data files carry it, FORMAT.md 1.1); "" otherwise.
  std::string attempt;
};

// Publishes `dir`/tessera.saving.<id> create-only (kAlreadyExists when it exists, or when
// another thread of this process holds it), naming this process as the owner, with `attempt`
// when given. Durable with kFull. The process holds the marker until
// RemoveSaveMarker, which releases it even when the file cannot be removed.
Status CreateSaveMarker(Storage& storage, const std::string& dir, const std::string& id,
                        SyncPolicy sync, const std::string& attempt = "");
// The marker's content: kNotFound when there is none, kDataLoss when it does not parse.
Result<MarkerContent> ReadSaveMarker(Storage& storage, const std::string& dir,
                                     const std::string& id);
void RemoveSaveMarker(Storage& storage, const std::string& dir, const std::string& id);
// Whether this process holds the marker `id` of `dir` now (between CreateSaveMarker and
// RemoveSaveMarker, in any thread).
bool MarkerHeldHere(const std::string& dir, const std::string& id);

OwnerState StateOf(const MarkerOwner& owner);
// StateOf for the marker `id` of `dir`, where a marker naming this process that this process
// does not hold (an operation of this process that ended without removing it) is kDead.
OwnerState StateOfMarker(const std::string& dir, const std::string& id, const MarkerOwner& owner);
// "process 123 on host h (boot 0f..., started at clock tick 456), marked 2026-01-01 10:00:00 UTC"
std::string DescribeOwner(const MarkerOwner& owner);

// An owner record: the "key=value" lines of a marker that name its owner (host, boot id, pid,
// the pid's start time, the time). Other files whose owner must be checked the same way (the
// checkpoint manager's read leases and deletion tombstones) hold one too.
std::string ThisProcessOwnerRecord();
// Whether the owner a record names may still be running: this process, or another running
// process of this host and boot (pid and start time equal), or of another host and younger than
// 24 hours (its processes cannot be checked from here). A record that does not parse: false.
bool OwnerRecordMayBeAlive(std::string_view text);
// DescribeOwner of the record's owner, or "an unreadable owner record".
std::string DescribeOwnerRecord(std::string_view text);

// The in-progress markers found among `names` (the entries of `dir`), for a cleanup: the ids of
// operations that may still be running (marker there, owner alive, or of another host and
// younger than 24 hours; `own_id` always counts as running), how many of those there are
// besides `own_id`, and the markers of those whose owner died. A marker that vanished or does
// not parse
// belongs to no running operation: one that runs publishes its marker whole before anything else
// and removes it only after its commit.
struct SaveMarkers {
  std::set<std::string> running;
  std::vector<std::string> dead_markers;  // names
  int others_running = 0;                 // running operations besides `own_id`
};
SaveMarkers FindSaveMarkers(Storage& storage, const std::string& dir,
                            const std::vector<std::string>& names, const std::string& own_id);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_MARKER_H_
