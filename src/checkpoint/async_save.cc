// AsyncSave: stage (copy) the state with a pool of copy threads, on the caller's time
// (kBlocking) or behind it (kDeferred); save it on a background thread over a private
// communicator. See include/tessera/async_save.h.
#include "tessera/async_save.h"
#include "tessera/storage_uri.h"

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <pthread.h>
#include <unistd.h>

#include "checkpoint/rank_local_save.h"
#include "core/checksum.h"
#include "core/thread_priority.h"
#include "device/device_staging.h"
#include "device/host_memory_device.h"

namespace tessera {

namespace {

// A run of bytes to copy: part (or all) of one tensor's local data.
struct Segment {
  const std::byte* src;
  std::byte* dst;
  size_t size;
  size_t tensor;    // index into AsyncSaveHandle::State::keys
  uint64_t offset;  // of `src` in the tensor's local bytes
};

}  // namespace

// Shared by the handles, the copy threads and the saver's worker thread.
struct AsyncSaveHandle::State {
  // The copy work, set before the state is shared and read-only after (except `checksums`,
  // whose entry i only the thread copying segment i writes, before it decrements
  // pieces_left under `mu`).
  std::vector<std::string> keys;    // of the tensors, for errors
  std::vector<Segment> segments;    // in state order
  std::vector<size_t> piece_begin;  // piece p: segments [piece_begin[p], piece_begin[p+1])
  bool check = false;               // check_unchanged_until_staged, with kDeferred
  int nice = 0;                     // AsyncSaveOptions::background_nice, of the copy threads
  std::vector<uint64_t> checksums;  // per segment, of the staged copy (check only)
  size_t next_piece = 0;            // the next piece to hand out (guarded by the pool)

  // Tensors in device memory are not copied here: the background save copies them (the bytes
  // this rank writes) through pinned buffers as it writes (checkpoint/item_source.h), and
  // reports through DeviceStaged.
  bool device = false;

  mutable std::mutex mu;
  mutable std::condition_variable cv;   // a piece copied, staged, done
  size_t pieces_left = 0;               // not yet copied
  bool checking = false;                // a thread is comparing the sources with the copies
  std::optional<Status> staged;         // host tensors: set once the caller may touch them again
  std::optional<Status> device_staged;  // device tensors: likewise (when `device`)
  std::optional<Status> status;
  std::optional<SaveReport> report;

  size_t NumPieces() const { return piece_begin.size() - 1; }

  // Called by the copy threads. Without the check, the last piece makes the save staged.
  void PieceCopied() {
    std::lock_guard<std::mutex> lock(mu);
    if (--pieces_left == 0 && !check) staged = Status::Ok();
    cv.notify_all();
  }

  // See AsyncSaveHandle::WaitStaged: the host tensors' staging, then the device tensors'.
  Status WaitStaged() {
    Status host = WaitHostStaged();
    if (!device) return host;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return device_staged.has_value(); });
    return host.ok() ? *device_staged : host;
  }

  // With the check, the first caller after the copy compares the sources with the copies;
  // others wait for its verdict.
  Status WaitHostStaged() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return staged.has_value() || (pieces_left == 0 && !checking); });
    if (staged) return *staged;
    checking = true;
    lock.unlock();
    Status result = CheckSources();
    lock.lock();
    checking = false;
    staged = result;
    cv.notify_all();
    return result;
  }

  // Called once by the background save (DeviceStagingOptions::on_staged).
  void DeviceStaged(const Status& result) {
    std::lock_guard<std::mutex> lock(mu);
    if (!device_staged) device_staged = result;
    cv.notify_all();
  }

  // For the saver's worker: waits for the host tensors' staged status without doing the check
  // itself.
  Status WaitStagedByOthers() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return staged.has_value(); });
    return *staged;
  }

  void Finish(Result<SaveReport> result) {
    std::lock_guard<std::mutex> lock(mu);
    status = result.status();
    if (result.ok()) report = std::move(*result);
    cv.notify_all();
  }

 private:
  // Checksums every source segment again; a difference from the staged copy names its tensor.
  Status CheckSources() const {
    std::vector<size_t> changed;  // first changed segment of each changed tensor
    for (size_t i = 0; i < segments.size(); ++i) {
      const Segment& s = segments[i];
      if (!changed.empty() && segments[changed.back()].tensor == s.tensor) continue;
      if (Checksum(s.src, s.size) != checksums[i]) changed.push_back(i);
    }
    if (changed.empty()) return Status::Ok();
    const Segment& first = segments[changed.front()];
    std::string message = "tensor '" + keys[first.tensor] + "' changed before WaitStaged (bytes [" +
                          std::to_string(first.offset) + ", " +
                          std::to_string(first.offset + first.size) +
                          ") of its local data differ from the staged copy)";
    for (size_t i = 1; i < changed.size() && i < 4; ++i) {
      message += i == 1 ? "; so did '" : ", '";
      message += keys[segments[changed[i]].tensor] + "'";
    }
    if (changed.size() > 4) message += " and " + std::to_string(changed.size() - 4) + " more";
    return FailedPrecondition(message +
                              ": with StagingMode::kDeferred the caller must leave its tensors "
                              "unchanged until WaitStaged() returns");
  }
};

Status AsyncSaveHandle::WaitStaged() const { return state_->WaitStaged(); }

bool AsyncSaveHandle::Staged() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pieces_left == 0 && (!state_->device || state_->device_staged.has_value());
}

Status AsyncSaveHandle::Wait() const {
  state_->WaitStaged().IgnoreError();  // the save's status, below, includes it
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->status.has_value(); });
  return *state_->status;
}

bool AsyncSaveHandle::Done() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status.has_value();
}

std::optional<Status> AsyncSaveHandle::TryStatus() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status;
}

std::optional<SaveReport> AsyncSaveHandle::report() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->report;
}

namespace {

using HandleState = AsyncSaveHandle::State;

// One staged copy of a state: its buffers are reused by later saves.
struct StagingSet {
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  std::vector<size_t> capacities;

  // A buffer of at least `n` bytes for tensor `i`, reusing what this set already holds; null
  // when the memory cannot be had.
  std::byte* Get(size_t i, size_t n) {
    if (i >= buffers.size()) {
      buffers.resize(i + 1);
      capacities.resize(i + 1, 0);
    }
    if (!buffers[i] || capacities[i] < n || capacities[i] > 2 * n + (1 << 20)) {  // grow, shrink
      buffers[i].reset();
      capacities[i] = 0;
      buffers[i].reset(new (std::nothrow) std::byte[std::max<size_t>(n, 1)]);
      if (!buffers[i]) return nullptr;
      capacities[i] = n;
    }
    return buffers[i].get();
  }
  // Drops buffers past the first `n` tensors (the state got smaller).
  void Trim(size_t n) {
    if (buffers.size() > n) {
      buffers.resize(n);
      capacities.resize(n);
    }
  }
};

// Threads that copy the pieces of staging work, first submitted first. Kept with the saver,
// idle between saves.
class StagingPool {
 public:
  StagingPool() = default;
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  // Copies everything submitted, then stops the threads.
  ~StagingPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // At least `n` threads from now on.
  void Grow(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    while (threads_.size() < static_cast<size_t>(n)) threads_.emplace_back([this] { Run(); });
  }

  void Submit(std::shared_ptr<HandleState> state) {
    if (state->NumPieces() == 0) return;  // nothing to copy: staged already
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(state));
    }
    cv_.notify_all();
  }

  // Copies pieces on the calling thread (the pool's, in order) until `state` has none left to
  // hand out. Pieces other threads took may still be in progress.
  void Help(const HandleState& state) {
    while (true) {
      std::unique_lock<std::mutex> lock(mu_);
      if (state.next_piece == state.NumPieces()) return;
      Claim claim = Take();
      lock.unlock();
      Copy(claim);
    }
  }

 private:
  struct Claim {
    std::shared_ptr<HandleState> state;
    size_t piece = 0;
  };

  // The next piece in order; requires mu_ held and a non-empty queue.
  Claim Take() {
    Claim claim{queue_.front(), queue_.front()->next_piece++};
    if (claim.state->next_piece == claim.state->NumPieces()) queue_.pop_front();
    return claim;
  }

  static void Copy(const Claim& claim) {
    HandleState& s = *claim.state;
    for (size_t i = s.piece_begin[claim.piece]; i < s.piece_begin[claim.piece + 1]; ++i) {
      const Segment& segment = s.segments[i];
      std::memcpy(segment.dst, segment.src, segment.size);
      if (s.check) s.checksums[i] = Checksum(segment.dst, segment.size);
    }
    s.PieceCopied();
  }

  void Run() {
    while (true) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      Claim claim = Take();
      lock.unlock();
      SetThisThreadNice(claim.state->nice);  // a pool thread: never the caller's (Help)
      Copy(claim);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;                      // work queued, stopping
  std::deque<std::shared_ptr<HandleState>> queue_;  // states with pieces not yet handed out
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// Checks the options AsyncSave adds to SaveOptions.
Status ValidateStagingOptions(const AsyncSaveOptions& options) {
  if (options.staging_threads < 1) {
    return BadOption("AsyncSaveOptions::staging_threads",
                     "must be at least 1, not " + std::to_string(options.staging_threads));
  }
  if (options.background_nice < 0 || options.background_nice > 19) {
    return BadOption("AsyncSaveOptions::background_nice",
                     "must be 0 to 19, not " + std::to_string(options.background_nice));
  }
  if (options.staging_piece_bytes < 4096) {
    return BadOption("AsyncSaveOptions::staging_piece_bytes",
                     "must be at least 4096, not " + std::to_string(options.staging_piece_bytes));
  }
  return Status::Ok();
}

// Cuts the tensors' bytes into pieces of `piece_bytes` (the last one smaller), in order: a big
// tensor spans several pieces, small ones share one.
void CutIntoPieces(size_t piece_bytes, HandleState& s) {
  std::vector<Segment> whole = std::move(s.segments);
  s.segments.clear();
  s.piece_begin = {0};
  size_t fill = 0;  // bytes in the current piece
  for (const Segment& w : whole) {
    for (size_t done = 0; done < w.size;) {
      const size_t n = std::min(w.size - done, piece_bytes - fill);
      s.segments.push_back({w.src + done, w.dst + done, n, w.tensor, w.offset + done});
      done += n;
      fill += n;
      if (fill == piece_bytes) s.piece_begin.push_back(s.segments.size()), fill = 0;
    }
  }
  if (fill > 0) s.piece_begin.push_back(s.segments.size());
  s.pieces_left = s.NumPieces();
  if (s.check) s.checksums.assign(s.segments.size(), 0);
}

// A tensor in device memory stays where it is: the background save copies it. Its copies must
// see the tensor as it is now, so the device's save stream is made to wait, now, for the work
// queued on the caller's stream so far, and the staged view names that stream instead (the
// save then has nothing more to wait for).
Status PrepareDeviceTensor(ShardedTensor& tensor) {
  TensorView& view = tensor.data;
  Result<std::shared_ptr<DeviceStaging>> staging = DeviceStaging::For(view.device);
  TESSERA_RETURN_IF_ERROR_CTX(staging.status(), "tensor '" + tensor.key + "'");
  TESSERA_RETURN_IF_ERROR_CTX(
      (*staging)->Order(*view.device, (*staging)->save_stream(), view.stream),
      "tensor '" + tensor.key + "': ordering its copy after its stream");
  view.stream = (*staging)->save_stream();
  return Status::Ok();
}

// The bytes of the tensors in host memory.
uint64_t HostTensorBytes(const StateDict& state) {
  uint64_t bytes = 0;
  for (const StateEntry& entry : state.entries()) {
    const auto* tensor = std::get_if<ShardedTensor>(&entry);
    if (tensor != nullptr && !tensor->data.on_device()) bytes += tensor->data.NumBytes();
  }
  return bytes;
}

// Whether the host tensors go through the background save's bounded staging (HostMemoryDevice)
// instead of being copied whole now (AsyncSaveOptions::staging_budget_bytes).
Result<bool> StreamHostTensors(const StateDict& state, const AsyncSaveOptions& options) {
  const uint64_t budget = options.staging_budget_bytes;
  if (budget == 0) return false;
  const uint64_t host_bytes = HostTensorBytes(state);
  if (host_bytes <= budget) return false;
  if (options.check_unchanged_until_staged && options.staging == StagingMode::kDeferred) {
    return BadOption("AsyncSaveOptions::check_unchanged_until_staged",
                     "needs a whole staged copy, and staging_budget_bytes (" +
                         std::to_string(budget) + ") is smaller than this rank's " +
                         std::to_string(host_bytes) + " bytes of host tensors");
  }
  return true;
}

// Everything AsyncSave does before copying: checks the state, takes staging buffers from `set`,
// fills `staged` with the same entries viewing them (objects are copied here: they are small;
// tensors in device memory stay where they are, and so do host tensors over a staging budget)
// and `work` with what to copy.
Status Prepare(const StateDict& state, const AsyncSaveOptions& options, StagingSet& set,
               StateDict& staged, HandleState& work) {
  TESSERA_RETURN_IF_ERROR(ValidateStagingOptions(options));
  work.check = options.check_unchanged_until_staged && options.staging == StagingMode::kDeferred;
  work.nice = options.background_nice;
  TESSERA_ASSIGN_OR_RETURN(const bool stream_host, StreamHostTensors(state, options));
  std::set<std::pair<const Device*, DeviceStream>> ordered;  // one wait per caller stream
  for (const StateEntry& entry : state.entries()) {
    if (const auto* object = std::get_if<ShardedObject>(&entry)) {
      TESSERA_RETURN_IF_ERROR(staged.Add(*object));
      continue;
    }
    ShardedTensor tensor = std::get<ShardedTensor>(entry);
    TESSERA_RETURN_IF_ERROR(tensor.Validate());
    if (tensor.data.on_device()) {
      work.device = true;
      if (ordered.insert({tensor.data.device.get(), tensor.data.stream}).second) {
        TESSERA_RETURN_IF_ERROR(PrepareDeviceTensor(tensor));
      } else {
        TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<DeviceStaging> staging,
                                 DeviceStaging::For(tensor.data.device));
        tensor.data.stream = staging->save_stream();
      }
      TESSERA_RETURN_IF_ERROR(staged.Add(std::move(tensor)));
      continue;
    }
    if (stream_host) {
      // The copies are memcpy when the background save queues them: no stream to wait for.
      const std::shared_ptr<Device>& host = HostMemoryDevice::Get();
      TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<DeviceStaging> staging, DeviceStaging::For(host));
      tensor.data.device = host;
      tensor.data.stream = staging->save_stream();
      work.device = true;
      TESSERA_RETURN_IF_ERROR(staged.Add(std::move(tensor)));
      continue;
    }
    const size_t n = tensor.data.NumBytes();
    std::byte* buffer = set.Get(work.keys.size(), n);
    if (buffer == nullptr) {
      return IOErrorFromErrno("tensor '" + tensor.key + "': allocating a staging buffer of " +
                                  std::to_string(n) + " bytes",
                              ENOMEM);
    }
    if (n > 0) work.segments.push_back({tensor.data.bytes(), buffer, n, work.keys.size(), 0});
    work.keys.push_back(tensor.key);
    tensor.data.data = buffer;
    TESSERA_RETURN_IF_ERROR(staged.Add(std::move(tensor)));
  }
  set.Trim(work.keys.size());
  CutIntoPieces(options.staging_piece_bytes, work);
  if (work.pieces_left == 0 && !work.check) work.staged = Status::Ok();
  return Status::Ok();
}

// AsyncSaveOptions::staging_budget_bytes applied to the staging of the background save: at
// most the budget in buffers, in pieces of at most a quarter of it (so that copies and writes
// overlap), at least 4096 bytes each.
void BoundStaging(uint64_t budget, DeviceStagingOptions& staging) {
  if (budget == 0) return;
  if (staging.pinned_bytes == 0 || staging.pinned_bytes > budget) staging.pinned_bytes = budget;
  const uint64_t quarter = std::max<uint64_t>(4096, budget / 4 / 4096 * 4096);
  staging.piece_bytes = std::min(staging.piece_bytes, quarter);
}

// The handles the caller gets share this: when the last one goes, it waits for staging, so no
// copy thread reads the caller's memory after the caller dropped its handle.
class StagingGuard {
 public:
  explicit StagingGuard(std::shared_ptr<HandleState> state) : state_(std::move(state)) {}
  StagingGuard(const StagingGuard&) = delete;
  StagingGuard& operator=(const StagingGuard&) = delete;
  ~StagingGuard() { state_->WaitStaged().IgnoreError(); }  // the status stays in the state

 private:
  std::shared_ptr<HandleState> state_;
};

// Kept with the caller's Comm (Comm::GetOrCreateAttachment): the private communicator, the
// background thread, the staging sets and the copy threads.
class AsyncSaver {
 public:
  // With `collective` false the saver serves rank-local saves (SaveOptions::collective false)
  // and never communicates: no private communicator, no agreement.
  AsyncSaver(Comm& comm, bool collective)
      : collective_(collective), rank_(comm.rank()), num_ranks_(comm.size()) {
    if (!collective_) {
      worker_ = std::thread([this] { Run(); });
      return;
    }
    // COLLECTIVE: every rank reaches here on its first AsyncSave, and agrees on the outcome,
    // so later calls fail alike with no communication.
    Result<std::unique_ptr<Comm>> split = comm.Split(0, comm.rank());
    setup_error_ = AgreeOnStatus(comm, split.status())
                       .WithContext("creating the asynchronous save communicator");
    if (setup_error_.ok()) {
      comm_ = std::move(*split);
      worker_ = std::thread([this] { Run(); });
    }
  }

  // Finishes the saves in flight (a destroyed Comm or an exiting process never leaves a
  // half-written manifest: the manifest is the last thing written, atomically). Their staging
  // first, with its checks: the caller's tensors are still valid (async_save.h).
  ~AsyncSaver() {
    for (const std::shared_ptr<HandleState>& s : Unfinished()) s->WaitStaged().IgnoreError();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  // With kBlocking, COLLECTIVE over `comm` (the caller's): ranks agree that the state and
  // options are good before any of them queues the save, so a bad state on one rank fails
  // AsyncSave on all of them, at once. With kDeferred, no communication at all: a rank whose
  // state is bad fails at once and its peers' saves fail in Wait(); that rank still queues the
  // failed save, so that its background thread takes part in the agreement.
  Result<AsyncSaveHandle> Submit(const StateDict& state, const std::string& path, Comm& comm,
                                 const AsyncSaveOptions& options) {
    TESSERA_RETURN_IF_ERROR(setup_error_);  // the same on every rank
    // Earlier saves waiting for their check (check_unchanged_until_staged) get it now: the
    // caller has moved on, and under kWait this save would otherwise wait for them forever.
    for (const std::shared_ptr<HandleState>& s : Unfinished()) {
      if (s->check) s->WaitStaged().IgnoreError();  // the error is that save's
    }
    std::unique_ptr<StagingSet> set = TakeStagingSet(options.when_busy);
    Job job;
    auto handle_state = std::make_shared<HandleState>();
    Status prepared = Prepare(state, options, *set, job.state, *handle_state);
    const bool blocking = options.staging == StagingMode::kBlocking;
    if (blocking && collective_) prepared = AgreeOnStatus(comm, prepared);
    if (!prepared.ok()) {
      ReturnStagingSet(std::move(set));
      if (!blocking) {
        Job failed;
        failed.handle = FailedState(prepared);
        Queue(std::move(failed));
      }
      return prepared;
    }
    pool_.Grow(options.staging_threads);
    pool_.Submit(handle_state);
    if (blocking) {
      pool_.Help(*handle_state);
      handle_state->WaitHostStaged().IgnoreError();  // cannot fail without the check
    }
    job.staging = std::move(set);
    job.path = path;
    job.nice = options.background_nice;
    job.options = options.save;
    job.handle = handle_state;
    BoundStaging(options.staging_budget_bytes, job.options.device_staging);
    if (handle_state->device) {
      // The background save copies the device tensors; it says when they are copied.
      job.options.device_staging.on_staged =
          [handle_state,
           user = std::move(job.options.device_staging.on_staged)](const Status& status) {
            handle_state->DeviceStaged(status);
            if (user) user(status);
          };
    }
    Queue(std::move(job));
    // kBlocking: the device tensors' copies too, before returning (they run in the background
    // save, which needs the job queued first).
    if (blocking && handle_state->device) handle_state->WaitStaged().IgnoreError();
    auto guard = std::make_shared<StagingGuard>(handle_state);
    // Aliasing: the handles point at the state and own the guard, which owns the state.
    return AsyncSaveHandle(std::shared_ptr<HandleState>(guard, handle_state.get()));
  }

 private:
  struct Job {
    StateDict state;                      // views into `staging`
    std::unique_ptr<StagingSet> staging;  // null for a save that failed before staging
    std::string path;
    SaveOptions options;
    int nice = 0;  // AsyncSaveOptions::background_nice
    std::shared_ptr<HandleState> handle;
  };

  static std::shared_ptr<HandleState> FailedState(const Status& error) {
    auto state = std::make_shared<HandleState>();
    state->piece_begin = {0};
    state->staged = error;
    return state;  // device false: nothing to wait for
  }

  void Queue(Job job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      unfinished_.push_back(job.handle);
      queue_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

  // A staging set, once fewer saves than `when_busy` allows are in flight.
  std::unique_ptr<StagingSet> TakeStagingSet(WhenBusy when_busy) {
    const size_t max_in_flight = when_busy == WhenBusy::kWait ? 1 : 2;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return in_flight_ < max_in_flight; });
    ++in_flight_;
    if (free_sets_.empty()) return std::make_unique<StagingSet>();
    std::unique_ptr<StagingSet> set = std::move(free_sets_.back());
    free_sets_.pop_back();
    return set;
  }

  void ReturnStagingSet(std::unique_ptr<StagingSet> set) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_sets_.push_back(std::move(set));
      --in_flight_;
    }
    cv_.notify_all();
  }

  std::vector<std::shared_ptr<HandleState>> Unfinished() {
    std::lock_guard<std::mutex> lock(mu_);
    return {unfinished_.begin(), unfinished_.end()};
  }

  // COLLECTIVE over comm_ unless rank-local: a bad state or a staging failure on one rank
  // fails the save on all of them.
  Result<SaveReport> SaveJob(const Job& job) {
    if (!collective_) {
      TESSERA_RETURN_IF_ERROR(job.handle->WaitStagedByOthers());
      return SaveRankLocal(job.state, job.path, rank_, num_ranks_, job.options);
    }
    Status staged = AgreeOnStatus(*comm_, job.handle->WaitStagedByOthers());
    if (!staged.ok()) return staged;
    return Save(job.state, job.path, *comm_, job.options);
  }

  // The background thread: one save at a time, in submission order (the same on every rank,
  // which keeps the private communicator's collectives in step).
  void Run() {
    while (true) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      // The I/O threads the save starts inherit it (the failed-before-staging job keeps 0).
      if (job.staging) SetThisThreadNice(job.nice);
      Result<SaveReport> result = SaveJob(job);
      job.state = StateDict();  // views into the staging set, which goes back to the pool
      if (job.staging) ReturnStagingSet(std::move(job.staging));
      job.handle->Finish(std::move(result));
      std::lock_guard<std::mutex> lock(mu_);
      std::erase(unfinished_, job.handle);
    }
  }

  const bool collective_;
  const int rank_;
  const int num_ranks_;
  Status setup_error_;
  std::unique_ptr<Comm> comm_;
  std::mutex mu_;
  std::condition_variable cv_;  // queue changes, in-flight count drops, stopping
  std::deque<Job> queue_;
  std::deque<std::shared_ptr<HandleState>> unfinished_;  // submitted, not yet finished
  std::vector<std::unique_ptr<StagingSet>> free_sets_;
  size_t in_flight_ = 0;  // staged or staging, and not yet finished
  bool stopping_ = false;
  StagingPool pool_;    // destroyed after the worker is joined: it waits for staging
  std::thread worker_;  // last: started after everything it uses exists
};

}  // namespace

namespace {

// Fork safety. A forked child has none of its parent's threads: a saver made before the fork
// (its worker and copy threads, its mutexes and condition variables, the state its handles
// share) must never be joined, waited on or destroyed there, or the child hangs (waiting for a
// thread that does not exist) or aborts (joining one). The child handler keeps every such saver
// alive forever (a leaked reference: its destructor never runs), and savers are attached to a
// Comm under a name with the creating process's pid, so the child's own AsyncSave makes a new
// saver with threads of its own.
std::mutex& SaverRegistryMu() {
  static std::mutex* mu = new std::mutex;  // never destroyed: used by the fork handlers
  return *mu;
}
std::vector<std::weak_ptr<AsyncSaver>>& SaverRegistry() {
  static auto* savers = new std::vector<std::weak_ptr<AsyncSaver>>;
  return *savers;
}
void ForkPrepare() { SaverRegistryMu().lock(); }
void ForkParent() { SaverRegistryMu().unlock(); }
void ForkChild() {
  for (const std::weak_ptr<AsyncSaver>& weak : SaverRegistry()) {
    if (std::shared_ptr<AsyncSaver> saver = weak.lock()) {
      new std::shared_ptr<AsyncSaver>(std::move(saver));  // leaked on purpose (see above)
    }
  }
  SaverRegistry().clear();
  SaverRegistryMu().unlock();  // locked by ForkPrepare in this (the forking) thread
}
void RegisterSaver(const std::shared_ptr<AsyncSaver>& saver) {
  static const bool registered = [] {
    return pthread_atfork(ForkPrepare, ForkParent, ForkChild) == 0;
  }();
  (void)registered;
  std::lock_guard<std::mutex> lock(SaverRegistryMu());
  std::vector<std::weak_ptr<AsyncSaver>>& savers = SaverRegistry();
  std::erase_if(savers, [](const std::weak_ptr<AsyncSaver>& w) { return w.expired(); });
  savers.push_back(saver);
}

}  // namespace

Result<AsyncSaveHandle> AsyncSave(const StateDict& state, const std::string& path, Comm& comm,
                                  const AsyncSaveOptions& options) {
  if (!options.save.storage) {  // a URI (s3://, msc://, file://) or a local path
    TESSERA_ASSIGN_OR_RETURN(auto location, ResolveStorage(path, nullptr));
    AsyncSaveOptions resolved = options;
    resolved.save.storage = location.first;
    return AsyncSave(state, location.second, comm, resolved);
  }
  // Rank-local saves have their own saver, which never communicates (not even to set up).
  const bool collective = options.save.collective;
  // The pid: a forked child makes its own saver (its parent's has no threads there).
  const std::string name =
      std::string(collective ? "tessera.async_saver." : "tessera.async_saver.rank_local.") +
      std::to_string(getpid());
  bool created = false;
  std::shared_ptr<AsyncSaver> saver = comm.GetOrCreateAttachment<AsyncSaver>(name, [&] {
    created = true;
    return new AsyncSaver(comm, collective);
  });
  if (created) RegisterSaver(saver);
  return saver->Submit(state, path, comm, options);
}

}  // namespace tessera
