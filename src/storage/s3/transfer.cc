#include "storage/s3/transfer.h"

#include <algorithm>

namespace tessera::s3 {

TransferPool::TransferPool(size_t threads) {
  threads = std::max<size_t>(1, threads);
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

TransferPool::~TransferPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void TransferPool::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void TransferPool::Run() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void MemoryBudget::Acquire(uint64_t n) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return held_ == 0 || held_ + n <= capacity_; });
  held_ += n;
  peak_ = std::max(peak_, held_);
}

void MemoryBudget::Release(uint64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_ -= std::min(held_, n);
  }
  cv_.notify_all();
}

uint64_t MemoryBudget::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

void Latch::CountDown() {
  std::lock_guard<std::mutex> lock(mu_);
  if (count_ > 0 && --count_ == 0) cv_.notify_all();
}

void Latch::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return count_ == 0; });
}

}  // namespace tessera::s3
