// Progress of long operations (the `progress` fields of SaveOptions, LoadOptions,
// VerifyOptions, RemoveKeysOptions): workers count bytes from any thread; the thread that
// called the operation hands them to the caller's callback, every kProgressInterval while the
// workers run, and once at the end. So a callback runs on one thread, the caller's, and never
// concurrently with itself (what Python needs to take the GIL, and what a terminal bar needs).
#ifndef TESSERA_CHECKPOINT_PROGRESS_H_
#define TESSERA_CHECKPOINT_PROGRESS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

namespace tessera {

using ProgressCallback = std::function<void(uint64_t done, uint64_t total)>;

// How often the calling thread reports while workers run.
inline constexpr std::chrono::milliseconds kProgressInterval{100};

// Counts the bytes of one operation. Add() is thread-safe; Report(), Finish() and
// ParallelFor() belong to the calling thread.
class ProgressMeter {
 public:
  // `callback` may be empty (nothing is reported; ParallelFor then works on the calling thread
  // too). `total` may be raised later with set_total, before any report.
  ProgressMeter(const ProgressCallback& callback, uint64_t total)
      : callback_(callback), total_(total) {}
  ProgressMeter(const ProgressMeter&) = delete;
  ProgressMeter& operator=(const ProgressMeter&) = delete;

  bool enabled() const { return static_cast<bool>(callback_); }
  void set_total(uint64_t total) { total_ = total; }
  uint64_t total() const { return total_; }
  void Add(uint64_t bytes) { done_.fetch_add(bytes, std::memory_order_relaxed); }
  // Reports the count now (never more than the total, never less than last time).
  void Report();
  // Reports done == total: the operation is over.
  void Finish();

  // Runs work(0) ... work(n - 1) at once, each on its own thread. Without a callback the
  // calling thread runs work(0) itself; with one it starts n threads and reports every
  // kProgressInterval until all have returned. Returns when every work(i) has.
  void ParallelFor(size_t n, const std::function<void(size_t)>& work);

 private:
  ProgressCallback callback_;
  uint64_t total_;
  uint64_t last_reported_ = 0;
  std::atomic<uint64_t> done_{0};
};

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_PROGRESS_H_
