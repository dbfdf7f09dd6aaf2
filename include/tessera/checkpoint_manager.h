// CheckpointManager: the checkpoints of one training run under one root: save every N steps in
// the background, keep the right ones, resume from the newest one that is whole.
//
//   CheckpointManagerOptions options;
//   options.retention.keep_last = 2;                         // and options.save: as AsyncSave's
//   TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointManager> manager,
//                            CheckpointManager::Open("/ckpt/run1", options));
//   int64_t step = 0;
//   Result<RestoreReport> restored = manager->Restore(state, comm);  // COLLECTIVE
//   if (restored.ok()) step = restored->step;                        // kNotFound: a fresh run
//   else if (restored.status().code() != StatusCode::kNotFound) return restored.status();
//   for (; step < steps; ++step) {
//     ... train one step ...
//     TESSERA_RETURN_IF_ERROR(manager->Save(step + 1, state, comm).status());  // returns at once
//   }
//   TESSERA_RETURN_IF_ERROR(manager->Close());  // the last save committed, or its error
//
// The root (docs/FORMAT.md, section 5): one directory per step, by default "iter_<step>" with the
// step in decimal zero-padded to at least 7 digits (Megatron-LM's names: "iter_0001000"; they sort
// as text up to step 9,999,999, and the manager sorts by number; StepNaming names others), each a
// checkpoint of its own (docs/FORMAT.md) whose user metadata records "step";
// `latest_checkpointed_iteration.txt` (Megatron-LM's tracker: the step in decimal), replaced
// atomically after a commit, never before one. The manager never trusts the tracker: which steps
// exist is decided by IsCommitted on each step directory (checkpoint.h), so a crash at any moment
// leaves LatestStep() naming a checkpoint whose index reads and whose files are all there.
//
// Retention deletes a checkpoint only when a newer one has committed (the newest committed one
// is always kept), never one the user marked (Mark), one being written (the manager's save in
// flight, a save whose in-progress marker names a live process) or one being read: Restore, and
// readers in other processes through Lease(), hold a read lease (a small file in the step
// directory naming host, boot id, pid and start time, like a save's marker); a deletion first
// writes a tombstone and then looks for live leases, a reader first writes its lease and then
// looks for a tombstone, so one of them always sees the other.
//
// Errors of a background save surface in the next call (Save, Wait, Close, Restore) and at
// destruction: the destructor waits for the save in flight, and a failure nobody was told of is
// handed to CheckpointManagerOptions::on_unseen_failure, by default printed to stderr followed by
// std::abort(): a process never ends as if a checkpoint had been saved when it was not. Call
// Close() (or Wait()) before destroying the manager to handle the error yourself.
//
// COLLECTIVE calls (Save, Restore, RestoreWith) are made by every rank of the same `comm`, in
// the same order, with the same step and options; pass the same comm to every call (the
// asynchronous saver lives with it, async_save.h). The other calls are local to the caller and
// may be made by any process (e.g. an evaluation job beside the training run). Retention and
// the tracker are done by rank 0 only, on the manager's background thread once the save
// commits. Thread safety: one thread at a time calls a manager's methods.
#ifndef TESSERA_CHECKPOINT_MANAGER_H_
#define TESSERA_CHECKPOINT_MANAGER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/comm.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"
#include "tessera/storage.h"

namespace tessera {

// How the step directories under a root are named: `prefix`, the step in decimal zero-padded to
// at least `min_digits` digits (more when the step needs them), then `suffix`. The default is
// Megatron-LM's "iter_0001000". One spelling per step: a name padded otherwise ("iter_00001000",
// or "step-007" for "step-{step}") is not a step directory, so no two names mean one step.
struct StepNaming {
  std::string prefix = "iter_";
  int min_digits = 7;  // 0..19
  std::string suffix;

  std::string Name(int64_t step) const;  // "iter_0001000" for step 1000
  // The step `name` stands for; nullopt for any other name.
  std::optional<int64_t> Parse(std::string_view name) const;
  // The pattern ParseStepNaming reads back: "iter_{step:07}", "step-{step}".
  std::string Pattern() const;
};

// The documented presets: a name, its pattern, and who writes such directories.
struct StepNamingPreset {
  const char* name;
  const char* pattern;
  const char* written_by;
};
// "megatron" iter_{step:07} (Megatron-LM, NeMo; the default), "torchtitan" step-{step},
// "huggingface" checkpoint-{step} (transformers' Trainer, accelerate), "step" step{step},
// "global_step" global_step{step} (DeepSpeed, Lightning's DeepSpeed strategy).
std::span<const StepNamingPreset> StepNamingPresets();

// A preset's name ("torchtitan"; "hf" is "huggingface") or a pattern: a directory name with one
// "{step}" (no padding) or "{step:0N}" (at least N digits, N <= 19), e.g. "ckpt_{step:06}". A
// pattern holds no '/', '{' or '}' besides its one placeholder, and no NUL. kInvalidArgument
// naming what is wrong and the presets.
Result<StepNaming> ParseStepNaming(std::string_view preset_or_pattern);

// StepNaming{}.Name / Parse: Megatron-LM's "iter_0001000".
std::string StepDirName(int64_t step);
std::optional<int64_t> ParseStepDirName(std::string_view name);
// The tracker file in the root (Megatron-LM's name and content: the step in decimal).
inline constexpr char kTrackerFileName[] = "latest_checkpointed_iteration.txt";
// User metadata the manager records in every checkpoint it saves (reserved: a caller's
// user_metadata may not set them): the step in decimal (what `tessera ls` shows), and a JSON
// object {"world_size": N, "layout": "...", "per_rank": [names]} describing the per-rank state.
inline constexpr char kStepMetadataKey[] = "step";
inline constexpr char kManagerMetadataKey[] = "tessera.manager";

// What Save does when the previous save is still being written.
enum class WhenSaving {
  kWait,  // wait for it, then save (default)
  kSkip,  // save nothing this time; ManagedSave::skipped says so and why
};

struct RetentionPolicy {
  // Keep the newest `keep_last` committed checkpoints and delete older ones, once a newer one
  // has committed. 0: no retention, every checkpoint is kept (default). Prune() requires >= 1.
  int keep_last = 0;
  // Also keep every checkpoint whose step is a multiple of `keep_every`. 0: none (default).
  int64_t keep_every = 0;
};

struct CheckpointManagerOptions {
  // Where the root is. Default null: the local file system, or the store a root URI names.
  std::shared_ptr<Storage> storage;
  // How each save is made: save.save is SaveOptions (sync, threads, collective or rank-local,
  // user_metadata for every save, ...; format must be kTessera: the step is recorded in the user
  // metadata, which PyTorch DCP cannot hold; storage is this struct's), save.staging and the
  // staging threads as for AsyncSave. save.when_busy is not used: one save is in flight at most.
  // A rank-local save (save.save.collective false) is tagged "step-<step>-<session>", the session
  // 16 hex digits rank 0 draws once per manager and broadcasts in the first Restore or Save (one
  // small collective, the only one a rank-local manager makes), so a step saved again after a
  // restart never meets the parts of the attempt that died.
  AsyncSaveOptions save;
  // Default true: Save returns once the state is staged (AsyncSave) and the checkpoint is written
  // and committed in the background. false: Save returns once committed (tessera::Save).
  bool async = true;
  // Default kWait. With kSkip, a collective manager agrees on skipping with one all-reduce of one
  // integer; a rank-local one cannot agree without messages, so kSkip requires collective saves.
  WhenSaving when_saving = WhenSaving::kWait;
  // Applied by rank 0 after every save that commits, and before the first save of a manager
  // (what a run killed before its retention left; Prune applies its own policy). With
  // rank-local saves rank 0 applies it when its own part commits: a step whose other parts are
  // not there yet does not count as committed, so up to a step or two more than keep_last may
  // stay until the next save's retention (or a Prune).
  RetentionPolicy retention;
  // How the step directories are named (ParseStepNaming reads a preset or a pattern). Default:
  // Megatron-LM's iter_<step>. Every listing (LatestStep, Steps, Restore, Prune) looks at the
  // directories of this naming only; one that finds none, in a root that holds directories named
  // as another preset names steps (or holding a checkpoint), is kInvalidArgument listing them and
  // the naming to pass, not "no committed checkpoint".
  StepNaming step_naming;
  // Replace kTrackerFileName after every commit (rank 0). Default true.
  bool write_tracker = true;
  // The parallel layout of the run, e.g. "tp2,pp1,dp4": recorded with the per-rank state; a
  // restore whose layout differs (both given) is treated like one of another world size.
  // Default empty: not recorded.
  std::string layout;
  // Warnings (a restore that fell back to an older step, a retention that could not delete):
  // one line each. Default null: printed to stderr as "tessera: warning: ...".
  std::function<void(const std::string&)> warn;
  // What the destructor does with a failed save that no call returned to the caller. Default
  // null: prints "tessera: error: ..." to stderr and calls std::abort().
  std::function<void(const Status&)> on_unseen_failure;
};

// What the caller adds to one save besides its state.
struct StepExtras {
  // Merged over CheckpointManagerOptions::save.save.user_metadata (rank 0's is kept).
  std::map<std::string, std::string> user_metadata;
  // State that depends on the world size (a data loader's position, this rank's RNG state): every
  // rank gives its own value for the same names; saved as the objects "per_rank/<name>/rank_<r>",
  // with the world size and layout recorded. Restore gives each rank the value of the same rank,
  // and refuses a world size (or layout) other than the saved one unless told how to map it
  // (RestoreOptions::map_per_rank).
  std::map<std::string, Bytes> per_rank;
};

// The result of one Save.
struct ManagedSave {
  int64_t step = -1;
  std::string path;  // the step directory
  // WhenSaving::kSkip with a save still in flight: nothing was saved; skip_reason says which save
  // was in flight.
  bool skipped = false;
  std::string skip_reason;
  // Asynchronous saves: the save in flight (WaitStaged() before changing tensors staged with
  // StagingMode::kDeferred). Its errors reach the caller through the manager as well.
  std::optional<AsyncSaveHandle> handle;
  // Synchronous saves: the report of the committed save.
  std::optional<SaveReport> report;
};

// Which saved ranks' per-rank values rank `rank` of `world_size` takes, when the checkpoint was
// saved by `saved_world_size` ranks (or under another layout): a list of ranks in
// [0, saved_world_size), in the order RestoreReport::per_rank gives their values.
using PerRankMap = std::function<std::vector<int>(int rank, int world_size, int saved_world_size)>;

struct RestoreOptions {
  // The step to restore. Default nullopt: the newest committed one, falling back to the one
  // before when it fails its checks. A given step never falls back: its failure is the error.
  std::optional<int64_t> step;
  // As for Load (storage is the manager's).
  LoadOptions load;
  // Required to restore per-rank state saved under another world size or layout; default null.
  PerRankMap map_per_rank;
};

// A step newer than the one restored, and why it was not.
struct SkippedStep {
  int64_t step = -1;
  Status reason;
  // True: the step failed its checks (and `warn` was told). False: its directory holds no
  // committed checkpoint (a save that did not finish, or is running) or is being deleted.
  bool failed_checks = false;
};

struct RestoreReport {
  int64_t step = -1;
  std::string path;
  // Newest first: the steps that failed their checks (damaged index, missing or corrupt file, a
  // load that failed on a checksum) and the step directories newer than the restored step that
  // hold no committed checkpoint (a save that did not finish, or is still running). Each failure
  // was also passed to the `warn` option.
  std::vector<SkippedStep> skipped;
  LoadReport load;  // of the load that succeeded (Restore only)
  // The per-rank values this rank took, by name (StepExtras::per_rank): one value (its own
  // rank's) unless map_per_rank gave several.
  std::map<std::string, std::vector<Bytes>> per_rank;
  // The restored checkpoint's user metadata (rank 0's save; "step" and kManagerMetadataKey
  // included).
  std::map<std::string, std::string> user_metadata;
};

// What a step directory holds.
enum class StepState {
  kCommitted,    // a whole checkpoint (IsCommitted)
  kUncommitted,  // no committed checkpoint: a save that did not finish, or that is running
  kDamaged,      // an index that does not read, a file missing, or a failed restore
  kDeleting,     // a deletion is in progress (its tombstone)
};

// "committed", "uncommitted", "damaged", "deleting": the names the CLI's JSON and Python use.
const char* StepStateName(StepState state);

struct StepInfo {
  int64_t step = -1;
  std::string path;
  StepState state = StepState::kUncommitted;
  std::string problem;  // kDamaged: why; kDeleting: whose deletion
  bool marked = false;  // kept whatever the retention (Mark)
};

// One step's fate in a Prune (or the retention after a save).
struct RetentionDecision {
  int64_t step = -1;
  std::string path;
  bool deleted = false;  // deleted, or with dry_run would be
  std::string reason;    // why kept or deleted, e.g. "one of the newest 2 committed"
};

struct PruneReport {
  bool dry_run = false;
  std::vector<RetentionDecision> steps;  // every step directory, ascending
  int deleted = 0;                       // deleted, or with dry_run would be
};

class ReadLease;

class CheckpointManager {
 public:
  // Opens the manager of `root`, creating nothing until the first save. `root` is a directory
  // path for `options.storage`; without one, a local path or a URI (s3://bucket/run,
  // msc://profile/run, file:///run; see ResolveStorage in storage_uri.h). Fails at once, naming
  // what is wrong, when the URI cannot be opened (kInvalidArgument for a malformed one, the
  // store's error otherwise) or options.step_naming is not valid (kInvalidArgument).
  static Result<std::unique_ptr<CheckpointManager>> Open(std::string root,
                                                         CheckpointManagerOptions options = {});
  // Deprecated, kept for one release: use Open. A constructor cannot fail, so a root that
  // cannot be opened, or step names that are not valid, fail every operation with the reason.
  explicit CheckpointManager(std::string root, CheckpointManagerOptions options = {});
  // Waits for the save in flight (and its retention); see the header comment for a failure.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // COLLECTIVE. Saves `state` as the checkpoint of `step` into the root's step directory, in the
  // background unless options.async is false. First, the save in flight: waited for (kWait), or,
  // if still running, this save is skipped (kSkip); then its failure, if nobody was told yet, is
  // returned and nothing is saved. Steps must increase from save to save. A step not newer than a
  // committed checkpoint under the root (e.g. a run that started from scratch, or from an older
  // step, beside newer checkpoints) is refused with kFailedPrecondition naming both: it would
  // fork the run's history and let retention delete good checkpoints. Restore first, or Delete
  // the newer steps; steps whose restore failed in this manager may be saved again.
  Result<ManagedSave> Save(int64_t step, const StateDict& state, Comm& comm,
                           const StepExtras& extras = {});
  // One process: a single-rank communicator the manager owns.
  Result<ManagedSave> Save(int64_t step, const StateDict& state, const StepExtras& extras = {});

  // Waits for the save in flight and its retention; returns its failure if no call returned it
  // yet, else OK. Not collective.
  Status Wait();
  // Wait(), then the manager takes no more saves; the destructor then has nothing to do.
  Status Close();

  // The newest step whose directory holds a committed, whole checkpoint (IsCommitted), or
  // nullopt when there is none. Reads the index of the newest step directories only, down to the
  // first that is committed. Steps whose restore failed in this manager are passed over. A
  // listing, HEAD or index read that the storage fails (kIOError: an object store throttling
  // past its retries, access denied; a timeout) is the error, never a step passed over: these
  // calls, Steps, Restore and Prune do not take a step they could not read for a missing or a
  // damaged one (docs/S3.md, "Retries and errors").
  Result<std::optional<int64_t>> LatestStep();
  // Every step that holds a committed, whole checkpoint, ascending (reads every index).
  Result<std::vector<int64_t>> AllSteps();
  // Every step directory and its state, ascending.
  Result<std::vector<StepInfo>> Steps();
  // The step directory of `step` under the root.
  std::string StepPath(int64_t step) const;
  const std::string& root() const { return root_; }

  // COLLECTIVE. Loads the checkpoint of the newest committed step (or options.step) into
  // `state`. When a step fails its checks (its index is damaged, a file is missing, truncated
  // or corrupt, the load fails on a checksum: kDataLoss), the ranks go on to the step before it;
  // each such failure is passed to `warn` and listed in the report. Other errors (a key the
  // checkpoint lacks, a shape the state does not match, another world size for per-rank state,
  // an I/O error) are returned at once: an older checkpoint would not fix them. kNotFound when the
  // root holds no committed checkpoint (a fresh run); kDataLoss naming each step when every one
  // failed.
  Result<RestoreReport> Restore(StateDict& state, Comm& comm, const RestoreOptions& options = {});
  Result<RestoreReport> Restore(StateDict& state, const RestoreOptions& options = {});

  // Loads one candidate step: COLLECTIVE (every rank is called with the same step), fills the
  // caller's state from the checkpoint at `path` (the step directory under the root as given: a
  // URI when the root is one, so that Load without a storage reaches it), and loads `per_rank` too
  // (objects whose keys are set; the load fills their bytes): a load with strict key checks must
  // include them.
  using StepLoader = std::function<Status(int64_t step, const std::string& path,
                                          std::vector<ShardedObject>& per_rank)>;
  // COLLECTIVE. Restore with the caller's own load (e.g. one that builds its state from each
  // candidate's metadata): the same choice of steps, leases, fallback and report.
  Result<RestoreReport> RestoreWith(Comm& comm, const RestoreOptions& options,
                                    const StepLoader& load);

  // Marks `step` to be kept whatever the retention (a file in its directory; persists), with an
  // optional note; Unmark undoes it. kNotFound when the step directory does not exist.
  Status Mark(int64_t step, const std::string& note = "");
  Status Unmark(int64_t step);

  // A read lease on `step` (which must be committed): kFailedPrecondition when it is being
  // deleted or holds no committed checkpoint, kNotFound when its directory does not exist.
  Result<ReadLease> Lease(int64_t step);

  // Applies `policy` (keep_last >= 1) now: every step directory older than the newest committed
  // checkpoint that the policy does not keep, and that is not marked, leased or being written,
  // is deleted (committed or not). With `dry_run` nothing changes and the report says what would
  // be deleted. Not collective: run it from one process.
  Result<PruneReport> Prune(const RetentionPolicy& policy, bool dry_run = false);
  // Deletes the step directory of `step` (e.g. the newer steps of a history to discard). Refused
  // (kFailedPrecondition) when it is marked, leased or being written.
  Status Delete(int64_t step);

  // The report of the retention after the last save that committed (rank 0), if any.
  std::optional<PruneReport> LastRetention() const;

  struct State;

 private:
  // Open's: `storage` and `storage_root` are where `root` resolved to.
  CheckpointManager(std::string root, std::shared_ptr<Storage> storage, std::string storage_root,
                    CheckpointManagerOptions options);

  const std::string root_;
  std::unique_ptr<State> state_;
};

// A reader's claim on a step directory: while it lives, no manager deletes that checkpoint. Move
// only; releases (removes its lease file) when destroyed.
class ReadLease {
 public:
  ReadLease() = default;
  ReadLease(ReadLease&& other) noexcept;
  ReadLease& operator=(ReadLease&& other) noexcept;
  ReadLease(const ReadLease&) = delete;
  ReadLease& operator=(const ReadLease&) = delete;
  ~ReadLease();

  int64_t step() const { return step_; }
  const std::string& path() const { return path_; }  // the step directory
  bool held() const { return storage_ != nullptr; }
  // Releases now. Idempotent.
  void Release();

 private:
  friend struct CheckpointManager::State;
  std::shared_ptr<Storage> storage_;
  int64_t step_ = -1;
  std::string path_;
  std::string lease_file_;
};

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_MANAGER_H_
