// CheckpointManager (include/tessera/checkpoint_manager.h): saves through AsyncSave into step
// directories, a background thread per save that waits for its commit and then (rank 0) writes
// the tracker and applies the retention, and restores with read leases and fallback.
#include "tessera/checkpoint_manager.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "checkpoint/commit.h"
#include "core/utf8.h"
#include "manager/per_rank.h"
#include "manager/retention.h"
#include "manager/root_files.h"
#include "tessera/storage_uri.h"

namespace tessera {

using manager::ManagerRecord;
using manager::StepDirFiles;

// ---- ReadLease ---------------------------------------------------------------------------

ReadLease::ReadLease(ReadLease&& other) noexcept { *this = std::move(other); }

ReadLease& ReadLease::operator=(ReadLease&& other) noexcept {
  if (this != &other) {
    Release();
    storage_ = std::move(other.storage_);
    step_ = other.step_;
    path_ = std::move(other.path_);
    lease_file_ = std::move(other.lease_file_);
    other.storage_ = nullptr;
  }
  return *this;
}

ReadLease::~ReadLease() { Release(); }

void ReadLease::Release() {
  if (!storage_) return;
  storage_->Remove(lease_file_).IgnoreError();  // a lease left behind dies with its process
  storage_ = nullptr;
}

// ---- State ---------------------------------------------------------------------------------

struct CheckpointManager::State {
  CheckpointManagerOptions options;
  std::shared_ptr<Storage> storage;
  std::string root;
  bool sync = true;
  std::unique_ptr<Comm> own_comm;  // for the overloads without a Comm
  std::string session;             // rank-local tags; "" until the ranks agreed on one
  int64_t last_step = -1;          // of the last Save
  bool checked_root = false;       // Save checked that no committed step lies ahead
  bool closed = false;

  // Shared with the background thread.
  mutable std::mutex mu;
  std::map<int64_t, std::string> failed;  // steps a restore failed on, and why
  std::optional<int64_t> in_flight;       // the step being saved in the background
  bool finished = true;                   // the background thread is done with it
  std::thread finisher;
  std::optional<Status> unseen;  // a failure no call has returned yet
  std::optional<PruneReport> last_retention;

  void Warn(const std::string& message) const {
    if (options.warn) {
      options.warn(message);
    } else {
      std::fprintf(stderr, "tessera: warning: %s\n", message.c_str());
    }
  }

  std::string StepPath(int64_t step) const {
    return JoinPath(root, options.step_naming.Name(step));
  }

  // A lease on `step`, and the checkpoint's metadata, once it is known committed.
  Result<ReadLease> TakeLease(int64_t step, Metadata* metadata);

  std::set<int64_t> FailedSteps() const {
    std::lock_guard<std::mutex> lock(mu);
    std::set<int64_t> steps;
    for (const auto& [step, why] : failed) steps.insert(step);
    return steps;
  }

  // Waits for the background thread of the last save.
  void Join() {
    if (finisher.joinable()) finisher.join();
    std::lock_guard<std::mutex> lock(mu);
    in_flight.reset();
  }

  // The failure no call has returned yet, once: the caller is told now.
  Status TakeUnseen() {
    std::lock_guard<std::mutex> lock(mu);
    if (!unseen) return Status::Ok();
    Status status = *unseen;
    unseen.reset();
    return status;
  }

  Result<std::optional<int64_t>> Latest() const {
    Result<std::vector<int64_t>> steps =
        manager::ListStepsOfRoot(storage, root, options.step_naming);
    if (steps.status().code() == StatusCode::kNotFound) return std::optional<int64_t>();
    TESSERA_RETURN_IF_ERROR(steps.status());
    const std::set<int64_t> bad = FailedSteps();
    for (auto it = steps->rbegin(); it != steps->rend(); ++it) {
      if (bad.count(*it)) continue;
      Result<StepDirFiles> files = manager::ListStepDir(*storage, StepPath(*it));
      if (files.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
      // Any other failure stops: the step may be whole, and an older one is not the latest.
      TESSERA_RETURN_IF_ERROR(files.status());
      TESSERA_ASSIGN_OR_RETURN(const StepInfo info,
                               manager::ExamineStep(storage, StepPath(*it), *it, *files));
      if (info.state == StepState::kCommitted) return std::optional<int64_t>(*it);
    }
    return std::optional<int64_t>();
  }

  // After a save of `step` committed: a step whose restore had failed holds the new checkpoint
  // now; then, on rank 0, the tracker and the retention.
  void AfterCommit(int64_t step, bool rank0) {
    {
      std::lock_guard<std::mutex> lock(mu);
      failed.erase(step);
    }
    if (!rank0) return;
    if (options.write_tracker) {
      // The tracker names what LatestStep names now: a committed step, written after its
      // commit. Nothing reads it back; it is for Megatron-LM and for people.
      Result<std::optional<int64_t>> latest = Latest();
      if (latest.ok() && latest->has_value()) {
        const std::string path = JoinPath(root, kTrackerFileName);
        const std::string text = std::to_string(**latest);
        Result<std::string> current = manager::ReadSmallFile(*storage, path);
        if (!current.ok() || *current != text) {
          Status written = manager::ReplaceSmallFile(*storage, path, text, sync);
          if (!written.ok())
            Warn("could not write the tracker " + path + ": " + written.ToString());
        }
      } else if (!latest.ok()) {
        Warn("after the save of step " + std::to_string(step) +
             ", listing the root failed: " + latest.status().ToString());
      }
    }
    ApplyRetention("after the save of step " + std::to_string(step));
  }

  // The retention policy on the root (rank 0); a failure is a warning that names `when`.
  void ApplyRetention(const std::string& when) {
    if (options.retention.keep_last < 1) return;
    manager::RootView view{storage, root, options.step_naming, FailedSteps(), std::nullopt};
    Result<PruneReport> pruned = manager::Prune(view, options.retention, /*dry_run=*/false, sync,
                                                [this](const std::string& m) { Warn(m); });
    if (!pruned.ok()) {
      Warn("the retention " + when + " failed: " + pruned.status().ToString());
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    last_retention = std::move(*pruned);
  }
};

namespace {

Status CheckOptions(const CheckpointManagerOptions& options) {
  const SaveOptions& save = options.save.save;
  if (save.format != CheckpointFormat::kTessera) {
    return InvalidArgument(
        "CheckpointManager saves in tessera's format only (the step is recorded in the user "
        "metadata, which a PyTorch DCP checkpoint cannot hold)");
  }
  if (options.when_saving == WhenSaving::kSkip && !save.collective) {
    return InvalidArgument(
        "WhenSaving::kSkip needs collective saves: the ranks of a rank-local save cannot agree "
        "on skipping without a message (use kWait)");
  }
  if (options.retention.keep_last < 0 || options.retention.keep_every < 0) {
    return InvalidArgument("RetentionPolicy::keep_last and keep_every must be >= 0");
  }
  for (const char* key : {kStepMetadataKey, kManagerMetadataKey}) {
    if (save.user_metadata.count(key)) {
      return InvalidArgument(std::string("user_metadata key '") + key +
                             "' is reserved: the manager records it");
    }
  }
  return Status::Ok();
}

// Rank 0 draws 16 hex digits and every rank gets them: the session of rank-local tags.
Result<std::string> AgreeOnSession(Comm& comm) {
  std::string session = comm.rank() == 0 ? manager::RandomHex16() : "";
  Bytes bytes(session.begin(), session.end());
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&bytes, 0));
  return std::string(bytes.begin(), bytes.end());
}

// A restore's failures that an older checkpoint may not have: damaged, missing or truncated
// bytes (kDataLoss). Anything else would fail the same on an older step: a caller's mistake (a
// key the checkpoint lacks is kNotFound, a shape kInvalidArgument), an I/O error of the store.
bool FallsBack(const Status& status) { return status.code() == StatusCode::kDataLoss; }

Bytes ToBytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

// The storage of the deprecated constructor's root when it could not be opened (a
// constructor cannot fail; Open reports the error instead): every call returns why, so every
// operation of the manager fails with it.
class UnopenedStorage : public Storage {
 public:
  explicit UnopenedStorage(Status why) : why_(std::move(why)) {}
  using Storage::NewWritableFile;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string&, CreateMode) override {
    return why_;
  }
  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string&) override {
    return why_;
  }
  Status CreateDirs(const std::string&) override { return why_; }
  Result<FileType> Stat(const std::string&) override { return why_; }
  Result<std::vector<std::string>> ListDir(const std::string&) override { return why_; }
  Status Rename(const std::string&, const std::string&) override { return why_; }
  Status Remove(const std::string&) override { return why_; }
  Status SyncDir(const std::string&) override { return why_; }
  Status Publish(const std::string&, std::span<const std::byte>, PublishMode, bool) override {
    return why_;
  }

 private:
  const Status why_;
};

}  // namespace

// ---- construction ------------------------------------------------------------------------------

Result<std::unique_ptr<CheckpointManager>> CheckpointManager::Open(
    std::string root, CheckpointManagerOptions options) {
  TESSERA_RETURN_IF_ERROR(manager::CheckStepNaming(options.step_naming));
  // A root URI (s3://, msc://, file://) or a local path, where the options name no storage.
  TESSERA_ASSIGN_OR_RETURN(auto location, ResolveStorage(root, options.storage));
  return std::unique_ptr<CheckpointManager>(new CheckpointManager(
      std::move(root), std::move(location.first), std::move(location.second), std::move(options)));
}

CheckpointManager::CheckpointManager(std::string root, std::shared_ptr<Storage> storage,
                                     std::string storage_root, CheckpointManagerOptions options)
    : root_(std::move(root)), state_(std::make_unique<State>()) {
  State& s = *state_;
  s.storage = std::move(storage);
  s.root = std::move(storage_root);
  s.sync = options.save.save.sync == SyncPolicy::kFull;
  s.options = std::move(options);
  s.options.save.save.storage = s.storage;
}

namespace {

// Where the deprecated constructor's root is: what Open would open, else a storage failing
// with Open's error.
std::pair<std::shared_ptr<Storage>, std::string> ResolveOrUnopened(
    const std::string& root, const CheckpointManagerOptions& options) {
  if (Status naming = manager::CheckStepNaming(options.step_naming); !naming.ok()) {
    return {std::make_shared<UnopenedStorage>(naming), root};
  }
  Result<std::pair<std::shared_ptr<Storage>, std::string>> location =
      ResolveStorage(root, options.storage);
  if (!location.ok()) return {std::make_shared<UnopenedStorage>(location.status()), root};
  return std::move(*location);
}

}  // namespace

CheckpointManager::CheckpointManager(std::string root, CheckpointManagerOptions options)
    : CheckpointManager(root, nullptr, "", std::move(options)) {
  auto [storage, storage_root] = ResolveOrUnopened(root_, state_->options);
  state_->storage = storage;
  state_->root = std::move(storage_root);
  state_->options.save.save.storage = std::move(storage);
}

CheckpointManager::~CheckpointManager() {
  State& s = *state_;
  s.Join();
  Status unseen = s.TakeUnseen();
  if (unseen.ok()) return;
  if (s.options.on_unseen_failure) {
    s.options.on_unseen_failure(unseen);
    return;
  }
  std::fprintf(stderr,
               "tessera: error: a checkpoint save failed and the CheckpointManager of %s was "
               "destroyed without Wait() or Close() having returned the error: %s\n",
               root_.c_str(), unseen.ToString().c_str());
  std::fflush(stderr);
  std::abort();
}

// The root as given (a URI stays a URI), so that the path works without the storage.
std::string CheckpointManager::StepPath(int64_t step) const {
  return JoinPath(root_, state_->options.step_naming.Name(step));
}

// ---- saving ------------------------------------------------------------------------------------

Result<ManagedSave> CheckpointManager::Save(int64_t step, const StateDict& state,
                                            const StepExtras& extras) {
  if (!state_->own_comm) state_->own_comm = NewSingleRankComm();
  return Save(step, state, *state_->own_comm, extras);
}

namespace {

// kFailedPrecondition when a committed checkpoint of `step` or a later step is under the root
// (other than steps whose restore failed here).
Status CheckNothingAhead(CheckpointManager::State& s, int64_t step) {
  Result<std::vector<int64_t>> steps =
      manager::ListStepNumbers(*s.storage, s.root, s.options.step_naming);
  if (steps.status().code() == StatusCode::kNotFound) return Status::Ok();
  TESSERA_RETURN_IF_ERROR(steps.status());
  const std::set<int64_t> bad = s.FailedSteps();
  for (auto it = steps->rbegin(); it != steps->rend() && *it >= step; ++it) {
    if (bad.count(*it)) continue;
    Result<StepDirFiles> files = manager::ListStepDir(*s.storage, s.StepPath(*it));
    if (files.status().code() == StatusCode::kNotFound) continue;
    TESSERA_RETURN_IF_ERROR(files.status());
    TESSERA_ASSIGN_OR_RETURN(const StepInfo info,
                             manager::ExamineStep(s.storage, s.StepPath(*it), *it, *files));
    if (info.state != StepState::kCommitted) continue;
    return FailedPrecondition(
        "cannot save step " + std::to_string(step) + " into " + s.root +
        ": it already holds a committed checkpoint of step " + std::to_string(*it) +
        ". A run that starts from scratch or from an older step would fork the history and "
        "its retention would delete good checkpoints: Restore the latest first, or Delete the "
        "steps from " +
        std::to_string(step) + " on to discard them");
  }
  return Status::Ok();
}

}  // namespace

Result<ManagedSave> CheckpointManager::Save(int64_t step, const StateDict& state, Comm& comm,
                                            const StepExtras& extras) {
  State& s = *state_;
  if (s.closed) return FailedPrecondition("the CheckpointManager of " + root_ + " is closed");
  TESSERA_RETURN_IF_ERROR(CheckOptions(s.options));
  if (step < 0) return InvalidArgument("step must be >= 0, not " + std::to_string(step));
  if (step <= s.last_step) {
    return InvalidArgument("steps must increase from save to save: step " + std::to_string(step) +
                           " after step " + std::to_string(s.last_step));
  }
  const bool collective = s.options.save.save.collective;
  // `inner` is the step directory in the storage; out.path as the root was given (a URI stays
  // a URI).
  const std::string inner = s.StepPath(step);
  ManagedSave out{.step = step, .path = StepPath(step)};

  // The save in flight: skipped for (every rank agrees), or waited for.
  std::optional<int64_t> previous;
  bool busy = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    previous = s.in_flight;
    busy = previous.has_value() && !s.finished;
  }
  if (previous && s.options.when_saving == WhenSaving::kSkip) {
    int64_t any_busy = busy ? 1 : 0;
    if (comm.size() > 1) TESSERA_RETURN_IF_ERROR(comm.AllReduce({&any_busy, 1}, ReduceOp::kMax));
    if (any_busy) {
      out.skipped = true;
      out.skip_reason = "the save of step " + std::to_string(*previous) + " is still being written";
      return out;
    }
  }
  s.Join();
  TESSERA_RETURN_IF_ERROR(
      s.TakeUnseen().WithContext("nothing was saved for step " + std::to_string(step)));

  if (!s.checked_root) {
    // Rank 0 looks (every rank of a rank-local save: they may not talk); all agree.
    Status ahead = comm.rank() == 0 || !collective ? CheckNothingAhead(s, step) : Status::Ok();
    if (collective) ahead = AgreeOnStatus(comm, ahead);
    TESSERA_RETURN_IF_ERROR(ahead);
    s.checked_root = true;
    // A run killed between a commit and its retention left more than keep_last checkpoints;
    // a run killed like that at every restart would leave more each time. The first save
    // applies the policy before it writes (every step it could delete is older than this one).
    if (comm.rank() == 0)
      s.ApplyRetention("before the first save (step " + std::to_string(step) + ")");
  }
  if (!collective && s.session.empty()) {
    TESSERA_ASSIGN_OR_RETURN(s.session, AgreeOnSession(comm));
  }

  // What is saved: the state, this rank's per-rank values, the step and the record.
  StateDict to_save = state;
  // The record is JSON in the user metadata (UTF-8): a layout that is not UTF-8 is the caller's
  // mistake, named here, not an exception from the JSON writer.
  if (!IsValidUtf8(s.options.layout)) {
    return InvalidArgument("CheckpointManagerOptions::layout " + QuoteBytes(s.options.layout) +
                           " is not valid UTF-8");
  }
  ManagerRecord record{.world_size = comm.size(), .layout = s.options.layout};
  for (const auto& [name, value] : extras.per_rank) {
    record.per_rank.push_back(name);
    TESSERA_RETURN_IF_ERROR(
        to_save.Add(ShardedObject{.key = manager::PerRankKey(name, comm.rank()), .data = value}));
  }
  AsyncSaveOptions options = s.options.save;
  SaveOptions& save = options.save;
  for (const auto& [key, value] : extras.user_metadata) {
    if (key == kStepMetadataKey || key == kManagerMetadataKey) {
      return InvalidArgument("user_metadata key '" + key + "' is reserved: the manager records it");
    }
    save.user_metadata[key] = value;
  }
  save.user_metadata[kStepMetadataKey] = std::to_string(step);
  save.user_metadata[kManagerMetadataKey] = manager::EncodeRecord(record);
  if (!collective) save.save_tag = "step-" + std::to_string(step) + "-" + s.session;

  if (!s.options.async) {
    TESSERA_ASSIGN_OR_RETURN(SaveReport report, tessera::Save(to_save, inner, comm, save));
    s.last_step = step;
    s.AfterCommit(step, comm.rank() == 0);
    out.report = std::move(report);
    return out;
  }
  TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle handle, AsyncSave(to_save, inner, comm, options));
  s.last_step = step;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.in_flight = step;
    s.finished = false;
  }
  const bool rank0 = comm.rank() == 0;
  const std::string path = out.path;
  s.finisher = std::thread([&s, handle, step, rank0, path] {
    Status status = handle.Wait();
    if (status.ok()) s.AfterCommit(step, rank0);
    std::lock_guard<std::mutex> lock(s.mu);
    if (!status.ok()) {
      s.unseen = status.WithContext("the save of step " + std::to_string(step) + " into " + path +
                                    " failed");
    }
    s.finished = true;
  });
  out.handle = std::move(handle);
  return out;
}

Status CheckpointManager::Wait() {
  state_->Join();
  return state_->TakeUnseen();
}

Status CheckpointManager::Close() {
  Status status = Wait();
  state_->closed = true;
  return status;
}

std::optional<PruneReport> CheckpointManager::LastRetention() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->last_retention;
}

// ---- listing -----------------------------------------------------------------------------------

Result<std::optional<int64_t>> CheckpointManager::LatestStep() { return state_->Latest(); }

Result<std::vector<StepInfo>> CheckpointManager::Steps() {
  State& s = *state_;
  std::vector<StepInfo> out;
  Result<std::vector<int64_t>> steps =
      manager::ListStepsOfRoot(s.storage, s.root, s.options.step_naming);
  if (steps.status().code() == StatusCode::kNotFound) return out;
  TESSERA_RETURN_IF_ERROR(steps.status());
  std::map<int64_t, std::string> failed;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    failed = s.failed;
  }
  for (int64_t step : *steps) {
    Result<StepDirFiles> files = manager::ListStepDir(*s.storage, s.StepPath(step));
    if (files.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
    TESSERA_RETURN_IF_ERROR(files.status());
    TESSERA_ASSIGN_OR_RETURN(StepInfo info,
                             manager::ExamineStep(s.storage, s.StepPath(step), step, *files));
    info.path = StepPath(step);  // as the root was given (a URI stays a URI)
    if (auto it = failed.find(step); it != failed.end() && info.state == StepState::kCommitted) {
      info.state = StepState::kDamaged;
      info.problem = "its restore failed: " + it->second;
    }
    out.push_back(std::move(info));
  }
  return out;
}

Result<std::vector<int64_t>> CheckpointManager::AllSteps() {
  TESSERA_ASSIGN_OR_RETURN(std::vector<StepInfo> steps, Steps());
  std::vector<int64_t> out;
  for (const StepInfo& info : steps) {
    if (info.state == StepState::kCommitted) out.push_back(info.step);
  }
  return out;
}

// ---- leases, marks, deletion -----------------------------------------------------------------

namespace {}  // namespace

Result<ReadLease> CheckpointManager::State::TakeLease(int64_t step, Metadata* metadata) {
  State& s = *this;
  ReadLease lease;
  const std::string dir = s.StepPath(step);
  const std::string file = JoinPath(dir, manager::kLeasePrefix + manager::RandomHex16());
  const std::string record =
      "tessera read lease\nstep=" + std::to_string(step) + "\n" + ThisProcessOwnerRecord();
  // Not synced: a lease matters only while its process lives, and a crash ends both.
  Status created = manager::CreateSmallFile(*s.storage, file, record, /*sync=*/false);
  if (created.code() == StatusCode::kNotFound) {
    return NotFound("step " + std::to_string(step) + " has no directory under " + s.root);
  }
  TESSERA_RETURN_IF_ERROR(created);
  lease.storage_ = s.storage;
  lease.step_ = step;
  lease.path_ = dir;
  lease.lease_file_ = file;
  // After the lease: a deletion that started before it shows its tombstone now.
  TESSERA_ASSIGN_OR_RETURN(StepDirFiles files, manager::ListStepDir(*s.storage, dir));
  Status damage;
  TESSERA_ASSIGN_OR_RETURN(const StepInfo info,
                           manager::ExamineStep(s.storage, dir, step, files, metadata, &damage));
  switch (info.state) {
    case StepState::kCommitted:
      return lease;
    case StepState::kDeleting:
      return FailedPrecondition("step " + std::to_string(step) + " is " + info.problem);
    case StepState::kUncommitted:
      return FailedPrecondition(dir + " holds no committed checkpoint");
    case StepState::kDamaged:
      return damage;
  }
  return Internal("unreachable");
}

Result<ReadLease> CheckpointManager::Lease(int64_t step) {
  return state_->TakeLease(step, nullptr);
}

Status CheckpointManager::Mark(int64_t step, const std::string& note) {
  State& s = *state_;
  const std::string dir = s.StepPath(step);
  TESSERA_ASSIGN_OR_RETURN(FileType type, s.storage->Stat(dir));
  if (type != FileType::kDirectory) {
    return NotFound("step " + std::to_string(step) + " has no directory under " + root_);
  }
  Status created = manager::CreateSmallFile(*s.storage, JoinPath(dir, manager::kKeepFileName),
                                            "tessera keep\nnote=" + note + "\n", s.sync);
  return created.code() == StatusCode::kAlreadyExists ? Status::Ok() : created;
}

Status CheckpointManager::Unmark(int64_t step) {
  State& s = *state_;
  Status removed = s.storage->Remove(JoinPath(s.StepPath(step), manager::kKeepFileName));
  if (removed.code() == StatusCode::kNotFound) return Status::Ok();
  TESSERA_RETURN_IF_ERROR(removed);
  if (s.sync) TESSERA_RETURN_IF_ERROR(s.storage->SyncDir(s.StepPath(step)));
  return Status::Ok();
}

Status CheckpointManager::Delete(int64_t step) {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.in_flight == step && !s.finished) {
      return FailedPrecondition("step " + std::to_string(step) + " is being saved");
    }
  }
  const std::string dir = s.StepPath(step);
  TESSERA_ASSIGN_OR_RETURN(FileType type, s.storage->Stat(dir));
  if (type != FileType::kDirectory) {
    return NotFound("step " + std::to_string(step) + " has no directory under " + root_);
  }
  TESSERA_RETURN_IF_ERROR(manager::DeleteStepDir(*s.storage, s.root, dir, s.sync));
  std::lock_guard<std::mutex> lock(s.mu);
  s.failed.erase(step);
  return Status::Ok();
}

Result<PruneReport> CheckpointManager::Prune(const RetentionPolicy& policy, bool dry_run) {
  State& s = *state_;
  // The store's own path of the root (s.root), never the root as given: for a URI root
  // (s3://, file://) the store knows no such path, found no step and reported "0 of 0".
  manager::RootView view{s.storage, s.root, s.options.step_naming, s.FailedSteps(), std::nullopt};
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.finished) view.in_flight = s.in_flight;
  }
  TESSERA_ASSIGN_OR_RETURN(
      PruneReport report,
      manager::Prune(view, policy, dry_run, s.sync, [&s](const std::string& m) { s.Warn(m); }));
  // The report names each step as the caller spells the root (a URI stays a URI).
  for (RetentionDecision& d : report.steps) d.path = StepPath(d.step);
  return report;
}

// ---- restoring ---------------------------------------------------------------------------------

namespace {

// What rank 0 tells every rank about the step to try next (or that there is none).
struct Candidate {
  int64_t step = -1;  // -1: none left
  Status error;       // with step -1: why nothing can be restored
  std::map<std::string, std::string> user_metadata;
  std::vector<SkippedStep> skipped;  // passed over by rank 0 before this one
  std::string session;
  int32_t saved_ranks = 0;  // Metadata::num_ranks of the step (0: the format does not say)
};

Bytes EncodeCandidate(const Candidate& c) {
  nlohmann::json skipped = nlohmann::json::array();
  for (const SkippedStep& k : c.skipped) {
    skipped.push_back(
        {k.step, static_cast<int>(k.reason.code()), k.reason.message(), k.failed_checks});
  }
  nlohmann::json j = {{"step", c.step},
                      {"code", static_cast<int>(c.error.code())},
                      {"message", c.error.message()},
                      {"user_metadata", c.user_metadata},
                      {"skipped", skipped},
                      {"session", c.session},
                      {"saved_ranks", c.saved_ranks}};
  // Replace: user metadata is UTF-8 (the manifest reader checks), messages may quote bytes.
  return ToBytes(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

Result<Candidate> DecodeCandidate(const Bytes& bytes) {
  nlohmann::json j = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
  if (j.is_discarded()) return Internal("malformed restore candidate from rank 0");
  Candidate c;
  c.step = j["step"].get<int64_t>();
  const int code = j["code"].get<int>();
  if (code != 0) c.error = Status(static_cast<StatusCode>(code), j["message"].get<std::string>());
  c.user_metadata = j["user_metadata"].get<std::map<std::string, std::string>>();
  for (const nlohmann::json& k : j["skipped"]) {
    c.skipped.push_back({k[0].get<int64_t>(),
                         Status(static_cast<StatusCode>(k[1].get<int>()), k[2].get<std::string>()),
                         k[3].get<bool>()});
  }
  c.session = j["session"].get<std::string>();
  c.saved_ranks = j["saved_ranks"].get<int32_t>();
  return c;
}

// Rank 0's pick: the next step to try, below `below` (nullopt: no bound, so that every step up
// to INT64_MAX is a candidate), or `wanted` only, with a lease on it. Steps passed over go to
// `skipped` (failures are warned about by the caller).
Candidate PickCandidate(CheckpointManager::State& s, std::optional<int64_t> wanted,
                        std::optional<int64_t> below, std::optional<ReadLease>& lease) {
  Candidate c;
  std::vector<int64_t> steps;
  if (wanted) {
    if (!below || *wanted < *below) steps.push_back(*wanted);
  } else {
    Result<std::vector<int64_t>> listed =
        manager::ListStepsOfRoot(s.storage, s.root, s.options.step_naming);
    if (!listed.ok() && listed.status().code() != StatusCode::kNotFound) {
      c.error = listed.status();
      return c;
    }
    if (listed.ok()) steps = *listed;
  }
  const std::set<int64_t> bad = s.FailedSteps();
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (below && *it >= *below) continue;
    if (bad.count(*it) && !wanted) continue;  // reported when it failed
    Metadata metadata;
    Result<ReadLease> taken = s.TakeLease(*it, &metadata);
    if (taken.ok()) {
      lease = std::move(*taken);
      c.step = *it;
      c.user_metadata = std::move(metadata.user_metadata);
      c.saved_ranks = metadata.num_ranks;
      return c;
    }
    if (wanted) {
      c.error = taken.status().WithContext("cannot restore step " + std::to_string(*it));
      return c;
    }
    // No commit, a deletion, a directory gone: no checkpoint at all. A damaged index or a
    // missing file: a checkpoint that failed its checks. Anything else (the store failed) stops.
    const StatusCode code = taken.status().code();
    if (code != StatusCode::kFailedPrecondition && code != StatusCode::kNotFound &&
        !FallsBack(taken.status())) {
      c.error = taken.status().WithContext("looking at step " + std::to_string(*it));
      return c;
    }
    c.skipped.push_back({*it, taken.status(), FallsBack(taken.status())});
  }
  if (wanted && c.error.ok()) {
    c.error = NotFound("step " + std::to_string(*wanted) + " has no directory under " + s.root);
  }
  return c;
}

// The error when nothing could be restored: kNotFound for a root with no checkpoint, kDataLoss
// naming every step that failed its checks.
Status NothingRestored(const std::string& root, const std::vector<SkippedStep>& skipped) {
  std::string failures;
  for (const SkippedStep& k : skipped) {
    if (!k.failed_checks) continue;
    failures += (failures.empty() ? "" : "; ") + std::string("step ") + std::to_string(k.step) +
                ": " + k.reason.ToString();
  }
  if (failures.empty()) return NotFound("no committed checkpoint under " + root);
  return DataLoss("no checkpoint under " + root + " could be restored: " + failures);
}

}  // namespace

Result<RestoreReport> CheckpointManager::Restore(StateDict& state, const RestoreOptions& options) {
  if (!state_->own_comm) state_->own_comm = NewSingleRankComm();
  return Restore(state, *state_->own_comm, options);
}

Result<RestoreReport> CheckpointManager::Restore(StateDict& state, Comm& comm,
                                                 const RestoreOptions& options) {
  LoadReport load_report;
  LoadOptions load_options = options.load;
  load_options.storage = state_->storage;
  StepLoader loader = [&](int64_t step, const std::string&, std::vector<ShardedObject>& per_rank) {
    StateDict work = state;  // views of the caller's tensors; objects are copied back below
    for (const ShardedObject& object : per_rank) TESSERA_RETURN_IF_ERROR(work.Add(object));
    // The step directory in the manager's storage.
    TESSERA_ASSIGN_OR_RETURN(load_report, Load(work, state_->StepPath(step), comm, load_options));
    for (StateEntry& entry : state.entries()) {
      if (auto* object = std::get_if<ShardedObject>(&entry)) {
        *object = std::get<ShardedObject>(*work.Find(object->key));
      }
    }
    for (ShardedObject& object : per_rank) {
      object = std::get<ShardedObject>(*work.Find(object.key));
    }
    return Status::Ok();
  };
  TESSERA_ASSIGN_OR_RETURN(RestoreReport report, RestoreWith(comm, options, loader));
  report.load = std::move(load_report);
  return report;
}

Result<RestoreReport> CheckpointManager::RestoreWith(Comm& comm, const RestoreOptions& options,
                                                     const StepLoader& load) {
  State& s = *state_;
  s.Join();
  TESSERA_RETURN_IF_ERROR(s.TakeUnseen().WithContext("nothing was restored"));
  RestoreReport report;
  std::optional<int64_t> below;  // none yet: the newest step may be INT64_MAX
  while (true) {
    std::optional<ReadLease> lease;  // rank 0's, held until every rank has loaded
    Candidate candidate;
    if (comm.rank() == 0) {
      candidate = PickCandidate(s, options.step, below, lease);
      candidate.session = s.session.empty() ? manager::RandomHex16() : s.session;
    }
    Bytes message = comm.rank() == 0 ? EncodeCandidate(candidate) : Bytes();
    if (comm.size() > 1) {
      TESSERA_RETURN_IF_ERROR(comm.Broadcast(&message, 0));
      TESSERA_ASSIGN_OR_RETURN(candidate, DecodeCandidate(message));
    }
    if (s.session.empty()) s.session = candidate.session;  // rank-local tags from now on
    for (const SkippedStep& k : candidate.skipped) {
      if (comm.rank() == 0 && k.failed_checks) {
        s.Warn("step " + std::to_string(k.step) + " of " + root_ +
               " is not restored: " + k.reason.ToString());
      }
      report.skipped.push_back(k);
    }
    if (candidate.step < 0) {
      if (!candidate.error.ok()) return candidate.error;
      return NothingRestored(root_, report.skipped);
    }
    const int64_t step = candidate.step;
    const std::string path = StepPath(step);  // as the root was given
    // Per-rank state: this rank's values, and whether the world size allows them.
    auto record_it = candidate.user_metadata.find(kManagerMetadataKey);
    Result<ManagerRecord> record =
        manager::DecodeRecord(record_it == candidate.user_metadata.end() ? "" : record_it->second,
                              step, candidate.saved_ranks);
    Result<manager::PerRankPlan> plan =
        record.ok() ? manager::PlanPerRank(*record, comm.size(), s.options.layout,
                                           options.map_per_rank, step)
                    : Result<manager::PerRankPlan>(record.status());
    std::vector<ShardedObject> per_rank;
    if (plan.ok()) {
      for (const auto& item : plan->load[comm.rank()]) {
        per_rank.push_back({.key = manager::PerRankKey(item.name, item.saved_rank)});
      }
    }
    Status status = AgreeOnStatus(comm, plan.status());
    // The caller's loader gets the path under the root as given (a URI stays a URI: it may
    // load without the storage).
    if (status.ok()) status = AgreeOnStatus(comm, load(step, path, per_rank));
    lease.reset();
    if (status.ok()) {
      report.step = step;
      report.path = path;
      report.user_metadata = std::move(candidate.user_metadata);
      for (size_t i = 0; i < per_rank.size(); ++i) {
        const auto& item = plan->load[comm.rank()][i];
        if (!item.dropped) report.per_rank[item.name].push_back(std::move(per_rank[i].data));
      }
      return report;
    }
    if (options.step || !FallsBack(status) || !plan.ok()) {
      return status.WithContext("restoring step " + std::to_string(step) + " from " + path);
    }
    if (comm.rank() == 0) {
      s.Warn("step " + std::to_string(step) + " of " + root_ +
             " failed its checks; trying the step before it: " + status.ToString());
    }
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.failed[step] = status.ToString();
    }
    report.skipped.push_back({step, status, true});
    below = step;
  }
}

const char* StepStateName(StepState state) {
  switch (state) {
    case StepState::kCommitted:
      return "committed";
    case StepState::kUncommitted:
      return "uncommitted";
    case StepState::kDamaged:
      return "damaged";
    case StepState::kDeleting:
      return "deleting";
  }
  return "?";
}

}  // namespace tessera
