#include "checkpoint/progress.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace tessera {

void ProgressMeter::Report() {
  if (!callback_) return;
  const uint64_t done =
      std::max(last_reported_, std::min(done_.load(std::memory_order_relaxed), total_));
  last_reported_ = done;
  callback_(done, total_);
}

void ProgressMeter::Finish() {
  if (!callback_) return;
  last_reported_ = total_;
  callback_(total_, total_);
}

void ProgressMeter::ParallelFor(size_t n, const std::function<void(size_t)>& work) {
  if (n == 0) return;
  Report();  // where the work starts: a bar's clock and total
  if (!callback_) {
    std::vector<std::thread> threads;
    for (size_t i = 1; i < n; ++i) threads.emplace_back(work, i);
    work(0);
    for (std::thread& t : threads) t.join();
    return;
  }
  std::mutex mutex;
  std::condition_variable all_done;
  size_t finished = 0;
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      work(i);
      std::lock_guard<std::mutex> lock(mutex);
      if (++finished == n) all_done.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    while (!all_done.wait_for(lock, kProgressInterval, [&] { return finished == n; })) {
      lock.unlock();  // the callback may take its time; the workers must not wait for it
      Report();
      lock.lock();
    }
  }
  for (std::thread& t : threads) t.join();
  Report();
}

}  // namespace tessera
