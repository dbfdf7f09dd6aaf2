// The files a CheckpointManager keeps under its root besides the checkpoints themselves
// (docs/FORMAT.md, section 5): the step directories' names, the tracker file, and the small
// files inside a step directory that say who uses it (a user's mark, read leases, the
// tombstone of a deletion). Everything goes through Storage, so a root on any store works.
#ifndef TESSERA_MANAGER_ROOT_FILES_H_
#define TESSERA_MANAGER_ROOT_FILES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/checkpoint.h"
#include "tessera/checkpoint_manager.h"
#include "tessera/storage.h"

namespace tessera::manager {

// In a step directory: the user's mark (CheckpointManager::Mark), a read lease
// ("tessera.reading.<16 hex digits>"), the tombstone of a deletion in progress.
inline constexpr char kKeepFileName[] = "tessera.keep";
inline constexpr char kLeasePrefix[] = "tessera.reading.";
inline constexpr char kTombstoneFileName[] = "tessera.deleting";

// Every small file goes through Storage::Publish (the commit primitive): readers see the whole
// file or none, never one created but not yet written. ReplaceSmallFile: `text` becomes the
// whole content of `path` atomically (PublishMode::kReplace). CreateSmallFile: `path` created
// with `text` only if it does not exist (kAlreadyExists when it does; of racing creators exactly
// one wins). With `sync`, durable on return (the file and its directory entry).
Status ReplaceSmallFile(Storage& storage, const std::string& path, std::string_view text,
                        bool sync);
Status CreateSmallFile(Storage& storage, const std::string& path, std::string_view text, bool sync);
// The content of a small file (at most 64 KiB; longer is kDataLoss naming it).
Result<std::string> ReadSmallFile(Storage& storage, const std::string& path);

// 16 lowercase hex digits from the kernel's random source.
std::string RandomHex16();

// What a step directory holds, as far as one listing of it tells (no index read).
struct StepDirFiles {
  std::vector<std::string> names;
  bool marked = false;
  bool tombstone = false;
  std::vector<std::string> leases;  // names of the read leases
};
Result<StepDirFiles> ListStepDir(Storage& storage, const std::string& dir);

// A live reader or writer of a step directory, and who it is ("being read by process 12 on
// host h (lease ...)"): "" when there is none. Looks at the read leases and at the in-progress
// markers of saves, RemoveKeys and Finalize (checkpoint/commit.h), whose owners' liveness is
// decided the same way.
std::string LiveUser(Storage& storage, const std::string& dir, const StepDirFiles& files);

// Whether `status` says that the storage could not be read (throttled past its retries, access
// denied, unreachable, timed out: kIOError, kDeadlineExceeded, kAborted) rather than what a
// directory holds. Such an error says nothing about a step: taking it for damage would make
// LatestStep name an older step and the retention delete a good one (object stores under load
// throttle; "0 checkpoints" resumes are the known symptom), so readers of a root fail with it.
bool IsStorageFailure(const Status& status);

// The state of the directory `dir` of step `step`, whose listing is `files`: kDeleting with a
// tombstone; else by IsCommitted (kDamaged with its error, or when the index records another
// step). Fills *metadata for a committed one, and *damage with the error of a damaged one
// (StepInfo::problem is its message), when not null. An error when the storage failed
// (IsStorageFailure), naming the step's directory.
Result<StepInfo> ExamineStep(const std::shared_ptr<Storage>& storage, const std::string& dir,
                             int64_t step, const StepDirFiles& files, Metadata* metadata = nullptr,
                             Status* damage = nullptr);

// The steps of the directories under `root` named by `naming`, ascending ("iter_0000100" ->
// 100; other names are ignored). kNotFound when `root` does not exist; the error of a Stat of a
// step's name that fails otherwise (a step left out would make an older one the latest). A
// step name that is a
// symbolic link is not a step of the root (it may point anywhere, and deleting "its" files would
// delete the target's): it is left out, and its name is added to *links when given.
Result<std::vector<int64_t>> ListStepNumbers(Storage& storage, const std::string& root,
                                             const StepNaming& naming,
                                             std::vector<std::string>* links = nullptr);

// OK when `naming` is one ParseStepNaming accepts (min_digits 0..19; no '/', brace or NUL in
// its prefix or suffix), else kInvalidArgument naming what is wrong.
Status CheckStepNaming(const StepNaming& naming);

// Why a root holds no step directory of `naming`, when that is a mistake: kInvalidArgument when
// `root` is itself a checkpoint, or holds directories named as another preset names steps (the
// error lists them and names the preset to pass), or directories holding a checkpoint under
// names no preset knows (it lists them and asks for a pattern). OK for a root that does not
// exist, is empty, or holds other things only (a fresh run's root beside its logs). Looks at the
// first kMaxExplainedDirs directories only.
inline constexpr int kMaxExplainedDirs = 32;
Status ExplainNoSteps(const std::shared_ptr<Storage>& storage, const std::string& root,
                      const StepNaming& naming);

// ListStepNumbers, and when it finds no step, ExplainNoSteps's error if there is one: what
// every reader of a root (LatestStep, Steps, Restore, Prune) lists with. A Save does not: a new
// run may start in a root that holds other things.
Result<std::vector<int64_t>> ListStepsOfRoot(const std::shared_ptr<Storage>& storage,
                                             const std::string& root, const StepNaming& naming,
                                             std::vector<std::string>* links = nullptr);

// Removes the step directory `dir`: the tombstone first (which hides it from every manager:
// a dir with one is being deleted), then, unless a reader holds a live lease on it or a save
// runs in it (then it removes its tombstone again and returns kFailedPrecondition naming who),
// its files: indexes and every other small file first, data files (*.safetensors, *.distcp)
// last, so a crash part way leaves a directory that is not a checkpoint, and then the
// directory. A tombstone left by a deletion whose owner died is taken over. `dir` must be a
// directory of its own, not a symbolic link (kFailedPrecondition, nothing touched).
Status DeleteStepDir(Storage& storage, const std::string& root, const std::string& dir, bool sync);

}  // namespace tessera::manager

#endif  // TESSERA_MANAGER_ROOT_FILES_H_
