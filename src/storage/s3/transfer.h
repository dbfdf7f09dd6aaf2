// The S3 client's workers and memory budget: a fixed pool of threads that run part uploads and
// ranged reads, and a byte budget that bounds the memory held by parts waiting for or being
// uploaded.
//
// Thread safety: both are safe to use from several threads at once.
#ifndef TESSERA_STORAGE_S3_TRANSFER_H_
#define TESSERA_STORAGE_S3_TRANSFER_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tessera::s3 {

// Runs tasks on `threads` threads, in the order submitted. Tasks must not wait for other tasks
// (they are leaves: one request each), so the pool cannot deadlock on itself. The destructor
// runs what is queued, then joins.
class TransferPool {
 public:
  explicit TransferPool(size_t threads);
  ~TransferPool();
  TransferPool(const TransferPool&) = delete;
  TransferPool& operator=(const TransferPool&) = delete;

  void Submit(std::function<void()> task);
  size_t threads() const { return threads_.size(); }

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// Bytes that may be held at once. Acquire blocks until the bytes are free; a request larger
// than the whole budget is granted once nothing else is held (so it cannot wait forever).
class MemoryBudget {
 public:
  explicit MemoryBudget(uint64_t bytes) : capacity_(bytes) {}

  void Acquire(uint64_t n);
  void Release(uint64_t n);
  uint64_t capacity() const { return capacity_; }
  // The most held at once so far (for tests and benchmarks).
  uint64_t peak() const;

 private:
  const uint64_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t held_ = 0;
  uint64_t peak_ = 0;
};

// Counts down to zero; Wait blocks until then.
class Latch {
 public:
  explicit Latch(size_t count) : count_(count) {}
  void CountDown();
  void Wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t count_;
};

}  // namespace tessera::s3

#endif  // TESSERA_STORAGE_S3_TRANSFER_H_
