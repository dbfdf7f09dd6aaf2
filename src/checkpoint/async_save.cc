// AsyncSave: stage (copy) the state on the caller's thread, save it on a background thread over
// a private communicator. See include/tessera/async_save.h.
#include "tessera/async_save.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

namespace tessera {

struct AsyncSaveHandle::State {
  mutable std::mutex mu;
  mutable std::condition_variable done_cv;
  std::optional<Status> status;
  std::optional<SaveReport> report;

  void Finish(Result<SaveReport> result) {
    std::lock_guard<std::mutex> lock(mu);
    status = result.status();
    if (result.ok()) report = std::move(*result);
    done_cv.notify_all();
  }
};

Status AsyncSaveHandle::Wait() const {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->done_cv.wait(lock, [&] { return state_->status.has_value(); });
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

// One staged copy of a state: its buffers are reused by later saves.
struct StagingSet {
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  std::vector<size_t> capacities;

  // A buffer of at least `n` bytes for entry `i`, reusing what this set already holds.
  std::byte* Get(size_t i, size_t n) {
    if (i >= buffers.size()) {
      buffers.resize(i + 1);
      capacities.resize(i + 1, 0);
    }
    if (capacities[i] < n || capacities[i] > 2 * n + (1 << 20)) {  // grow, or shrink a lot
      buffers[i].reset(new std::byte[std::max<size_t>(n, 1)]);
      capacities[i] = n;
    }
    return buffers[i].get();
  }
  // Drops buffers past the first `n` entries (the state got smaller).
  void Trim(size_t n) {
    if (buffers.size() > n) {
      buffers.resize(n);
      capacities.resize(n);
    }
  }
};

// Copies `n` bytes with up to `threads` threads (large copies only: a thread costs ~50 us).
void ParallelCopy(std::byte* dst, const std::byte* src, size_t n, int threads) {
  constexpr size_t kMinPerThread = 64u << 20;
  const size_t parts = std::max<size_t>(1, std::min<size_t>(threads, n / kMinPerThread));
  if (parts == 1) {
    if (n) std::memcpy(dst, src, n);
    return;
  }
  std::vector<std::thread> workers;
  const size_t step = (n + parts - 1) / parts;
  for (size_t p = 1; p < parts; ++p) {
    const size_t begin = p * step, end = std::min(n, begin + step);
    workers.emplace_back([=] { std::memcpy(dst + begin, src + begin, end - begin); });
  }
  std::memcpy(dst, src, std::min(n, step));
  for (std::thread& t : workers) t.join();
}

// Kept with the caller's Comm (Comm::GetOrCreateAttachment): the private communicator, the
// background thread, the staging sets.
class AsyncSaver {
 public:
  explicit AsyncSaver(Comm& comm) {
    // COLLECTIVE: every rank reaches here on its first AsyncSave.
    Result<std::unique_ptr<Comm>> split = comm.Split(0, comm.rank());
    if (split.ok()) {
      comm_ = std::move(*split);
      worker_ = std::thread([this] { Run(); });
    } else {
      setup_error_ = split.status().WithContext("creating the asynchronous save communicator");
    }
  }

  // Finishes the saves in flight (a destroyed Comm or an exiting process never leaves a
  // half-written manifest: the manifest is the last thing written, atomically).
  ~AsyncSaver() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  // COLLECTIVE over `comm` (the caller's): ranks agree that staging worked before any of them
  // queues the save, so a bad state on one rank fails AsyncSave on all of them, at once.
  Result<AsyncSaveHandle> Submit(const StateDict& state, const std::string& path, Comm& comm,
                                 const AsyncSaveOptions& options) {
    TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, setup_error_));
    // Take a staging set: wait while too many saves are in flight.
    const size_t max_in_flight = options.when_busy == WhenBusy::kWait ? 1 : 2;
    std::unique_ptr<StagingSet> set;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return in_flight_ < max_in_flight; });
      ++in_flight_;
      if (!free_sets_.empty()) {
        set = std::move(free_sets_.back());
        free_sets_.pop_back();
      }
    }
    if (!set) set = std::make_unique<StagingSet>();

    // Stage: copy every tensor and object. This is the only part the caller waits for.
    Job job;
    Status staged = Stage(state, std::max(1, options.save.num_io_threads), *set, job.state);
    staged = AgreeOnStatus(comm, staged);
    if (!staged.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      free_sets_.push_back(std::move(set));
      --in_flight_;
      cv_.notify_all();
      return staged;
    }
    job.staging = std::move(set);
    job.path = path;
    job.options = options.save;
    auto handle_state = std::make_shared<AsyncSaveHandle::State>();
    job.handle = handle_state;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(job));
    }
    cv_.notify_all();
    return AsyncSaveHandle(handle_state);
  }

 private:
  struct Job {
    StateDict state;  // views into `staging`
    std::unique_ptr<StagingSet> staging;
    std::string path;
    SaveOptions options;
    std::shared_ptr<AsyncSaveHandle::State> handle;
  };

  // Copies `state` into `set`; `staged` gets the same entries viewing the copies.
  static Status Stage(const StateDict& state, int copy_threads, StagingSet& set,
                      StateDict& staged) {
    size_t index = 0;
    for (const StateEntry& entry : state.entries()) {
      if (const auto* object = std::get_if<ShardedObject>(&entry)) {
        TESSERA_RETURN_IF_ERROR(staged.Add(*object));
        continue;
      }
      ShardedTensor tensor = std::get<ShardedTensor>(entry);
      TESSERA_RETURN_IF_ERROR(tensor.Validate());
      const size_t n = tensor.data.NumBytes();
      std::byte* buffer = set.Get(index++, n);
      ParallelCopy(buffer, tensor.data.bytes(), n, copy_threads);
      tensor.data.data = buffer;
      TESSERA_RETURN_IF_ERROR(staged.Add(std::move(tensor)));
    }
    set.Trim(index);
    return Status::Ok();
  }

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
      Result<SaveReport> result = Save(job.state, job.path, *comm_, job.options);
      {
        std::lock_guard<std::mutex> lock(mu_);
        free_sets_.push_back(std::move(job.staging));
        --in_flight_;
      }
      cv_.notify_all();
      job.handle->Finish(std::move(result));
    }
  }

  Status setup_error_;
  std::unique_ptr<Comm> comm_;
  std::mutex mu_;
  std::condition_variable cv_;  // queue changes, in-flight count drops, stopping
  std::deque<Job> queue_;
  std::vector<std::unique_ptr<StagingSet>> free_sets_;
  size_t in_flight_ = 0;  // staged and not yet finished
  bool stopping_ = false;
  std::thread worker_;  // last: started after everything it uses exists
};

}  // namespace

Result<AsyncSaveHandle> AsyncSave(const StateDict& state, const std::string& path, Comm& comm,
                                  const AsyncSaveOptions& options) {
  std::shared_ptr<AsyncSaver> saver = comm.GetOrCreateAttachment<AsyncSaver>(
      "tessera.async_saver", [&] { return new AsyncSaver(comm); });
  return saver->Submit(state, path, comm, options);
}

}  // namespace tessera
