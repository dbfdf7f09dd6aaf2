#include "device/simulated_device.h"

#include <sys/mman.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <new>
#include <utility>

namespace tessera {
namespace {

std::string Hex(const void* p) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%" PRIxPTR, reinterpret_cast<uintptr_t>(p));
  return buf;
}

constexpr size_t kAlignment = 256;  // as cudaMalloc's

}  // namespace

struct SimulatedDevice::Event {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // generation of the latest Record
  uint64_t completed = 0;  // the latest generation its stream has reached
  Status error;            // of the copies before the completed generation's mark
};

struct SimulatedDevice::Op {
  enum class Kind { kToHost, kToDevice, kRecord, kWait, kLaunch } kind;
  void* host = nullptr;
  void* device = nullptr;
  size_t n = 0;
  bool fail = false;  // an injected fault when run
  std::shared_ptr<Event> event;
  uint64_t generation = 0;
  std::chrono::microseconds duration{0};
  std::function<void()> work;
};

struct SimulatedDevice::Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> ops;
  bool stopping = false;
  Status pending_error;  // of a copy since the last Record (stream thread only)
  std::thread thread;
};

SimulatedDevice::SimulatedDevice(std::string name, SimulatedDeviceOptions options)
    : name_(std::move(name)), options_(options) {
  void* p = mmap(nullptr, options_.address_space_bytes, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  base_ = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
}

SimulatedDevice::~SimulatedDevice() {
  std::map<DeviceStream, std::unique_ptr<Stream>> streams;
  {
    std::lock_guard<std::mutex> lock(mu_);
    streams.swap(streams_);
  }
  for (auto& [handle, stream] : streams) {
    {
      std::lock_guard<std::mutex> lock(stream->mu);
      stream->stopping = true;
    }
    stream->cv.notify_all();
    stream->thread.join();
  }
  for (auto& [address, size] : pinned_) ::operator delete(reinterpret_cast<void*>(address));
  if (base_) munmap(base_, options_.address_space_bytes);
}

Result<void*> SimulatedDevice::AllocatePinned(size_t bytes) {
  void* p = ::operator new(bytes == 0 ? 1 : bytes, std::nothrow);
  if (!p) return IOError(name_ + ": no memory for " + std::to_string(bytes) + " pinned bytes");
  std::lock_guard<std::mutex> lock(mu_);
  pinned_[reinterpret_cast<uintptr_t>(p)] = bytes;
  stats_.pinned_bytes += bytes;
  stats_.pinned_allocations += 1;
  return p;
}

void SimulatedDevice::FreePinned(void* pinned) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pinned_.find(reinterpret_cast<uintptr_t>(pinned));
    if (it == pinned_.end()) return;
    stats_.pinned_bytes -= it->second;
    pinned_.erase(it);
  }
  ::operator delete(pinned);
}

Result<void*> SimulatedDevice::Allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t size = (std::max<uint64_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  if (!base_ || next_offset_ + size > options_.address_space_bytes) {
    return IOError(name_ + ": out of simulated device memory allocating " + std::to_string(bytes) +
                   " bytes");
  }
  Allocation allocation;
  allocation.size = bytes;
  allocation.bytes.reset(new (std::nothrow) std::byte[std::max<size_t>(bytes, 1)]);
  if (!allocation.bytes)
    return IOError(name_ + ": no memory for " + std::to_string(bytes) + " bytes");
  std::byte* address = base_ + next_offset_;
  next_offset_ += size;
  device_[reinterpret_cast<uintptr_t>(address)] = std::move(allocation);
  stats_.device_bytes += bytes;
  return static_cast<void*>(address);
}

void SimulatedDevice::Free(void* device_memory) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = device_.find(reinterpret_cast<uintptr_t>(device_memory));
  if (it == device_.end()) return;
  stats_.device_bytes -= it->second.size;
  device_.erase(it);
}

Result<std::byte*> SimulatedDevice::DeviceBytes(const void* p, size_t n) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = device_.upper_bound(a);
  if (it != device_.begin()) {
    --it;
    if (a >= it->first && a + n <= it->first + it->second.size) {
      return it->second.bytes.get() + (a - it->first);
    }
  }
  const bool in_range = base_ && p >= base_ && p < base_ + options_.address_space_bytes;
  return InvalidArgument(name_ + ": " + Hex(p) + " (+" + std::to_string(n) + " bytes) is not " +
                         "live device memory of " + name_ +
                         (in_range ? " (freed, or past the end of an allocation)"
                                   : " (host memory passed as device memory?)"));
}

Status SimulatedDevice::CheckPinned(const void* p, size_t n) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = pinned_.upper_bound(a);
  if (it != pinned_.begin()) {
    --it;
    if (a >= it->first && a + n <= it->first + it->second) return Status::Ok();
  }
  return InvalidArgument(name_ + ": " + Hex(p) + " (+" + std::to_string(n) + " bytes) is not " +
                         "pinned memory of " + name_ +
                         " (pageable or device memory passed as "
                         "pinned host memory?)");
}

Result<DeviceStream> SimulatedDevice::NewStream() {
  auto stream = std::make_unique<Stream>();
  Stream* raw = stream.get();
  std::lock_guard<std::mutex> lock(mu_);
  const DeviceStream handle = next_handle_++;
  raw->thread = std::thread([this, raw] { RunStream(raw); });
  streams_[handle] = std::move(stream);
  stats_.streams += 1;
  return handle;
}

void SimulatedDevice::DestroyStream(DeviceStream stream) {
  std::unique_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(stream);
    if (it == streams_.end()) return;
    s = std::move(it->second);
    streams_.erase(it);
    stats_.streams -= 1;
  }
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stopping = true;  // after the work already queued
  }
  s->cv.notify_all();
  s->thread.join();
}

Result<DeviceEvent> SimulatedDevice::NewEvent() {
  std::lock_guard<std::mutex> lock(mu_);
  const DeviceEvent handle = next_handle_++;
  events_[handle] = std::make_shared<Event>();
  stats_.events += 1;
  return handle;
}

void SimulatedDevice::DestroyEvent(DeviceEvent event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.erase(event) > 0) stats_.events -= 1;
}

Result<SimulatedDevice::Stream*> SimulatedDevice::FindStream(DeviceStream stream) {
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    return InvalidArgument(name_ + ": no stream " + std::to_string(stream) +
                           " (a stream of another device, or destroyed)");
  }
  return it->second.get();
}

Result<std::shared_ptr<SimulatedDevice::Event>> SimulatedDevice::FindEvent(DeviceEvent event) {
  auto it = events_.find(event);
  if (it == events_.end()) {
    return InvalidArgument(name_ + ": no event " + std::to_string(event) +
                           " (an event of another device, or destroyed)");
  }
  return it->second;
}

std::optional<SimulatedDevice::FaultMode> SimulatedDevice::NextCopyFault() {
  if (fault_countdown_ < 0) return std::nullopt;
  if (fault_countdown_-- > 0) return std::nullopt;
  return fault_mode_;
}

Status SimulatedDevice::Queue(DeviceStream stream, Op op) {
  Stream* s = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TESSERA_ASSIGN_OR_RETURN(s, FindStream(stream));
    if (op.kind == Op::Kind::kToHost || op.kind == Op::Kind::kToDevice) {
      const bool to_host = op.kind == Op::Kind::kToHost;
      const char* what = to_host ? "copy to host" : "copy to device";
      TESSERA_RETURN_IF_ERROR(DeviceBytes(op.device, op.n).status().WithContext(what));
      TESSERA_RETURN_IF_ERROR(CheckPinned(op.host, op.n).WithContext(what));
      if (std::optional<FaultMode> fault = NextCopyFault()) {
        if (*fault == FaultMode::kWhenQueued) {
          return IOError(name_ + ": injected failure queueing a " + what + " of " +
                         std::to_string(op.n) + " bytes");
        }
        op.fail = true;
      }
      (to_host ? stats_.copies_to_host : stats_.copies_to_device) += 1;
      (to_host ? stats_.bytes_to_host : stats_.bytes_to_device) += op.n;
    }
  }
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->ops.push_back(std::move(op));
  }
  s->cv.notify_all();
  return Status::Ok();
}

Status SimulatedDevice::CopyToHost(void* host, const void* device, size_t n, DeviceStream stream) {
  Op op{Op::Kind::kToHost};
  op.host = host;
  op.device = const_cast<void*>(device);
  op.n = n;
  return Queue(stream, std::move(op));
}

Status SimulatedDevice::CopyToDevice(void* device, const void* host, size_t n,
                                     DeviceStream stream) {
  Op op{Op::Kind::kToDevice};
  op.host = const_cast<void*>(host);
  op.device = device;
  op.n = n;
  return Queue(stream, std::move(op));
}

Status SimulatedDevice::Record(DeviceEvent event, DeviceStream stream) {
  std::shared_ptr<Event> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TESSERA_ASSIGN_OR_RETURN(e, FindEvent(event));
  }
  Op op{Op::Kind::kRecord};
  {
    std::lock_guard<std::mutex> lock(e->mu);
    op.generation = ++e->recorded;
  }
  op.event = std::move(e);
  return Queue(stream, std::move(op));
}

Status SimulatedDevice::Wait(DeviceStream stream, DeviceEvent event) {
  std::shared_ptr<Event> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TESSERA_ASSIGN_OR_RETURN(e, FindEvent(event));
  }
  Op op{Op::Kind::kWait};
  {
    std::lock_guard<std::mutex> lock(e->mu);
    op.generation = e->recorded;
  }
  op.event = std::move(e);
  return Queue(stream, std::move(op));
}

Status SimulatedDevice::Synchronize(DeviceEvent event) {
  std::shared_ptr<Event> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TESSERA_ASSIGN_OR_RETURN(e, FindEvent(event));
  }
  std::unique_lock<std::mutex> lock(e->mu);
  const uint64_t generation = e->recorded;
  e->cv.wait(lock, [&] { return e->completed >= generation; });
  return e->error;
}

Status SimulatedDevice::Launch(DeviceStream stream, std::chrono::microseconds duration,
                               std::function<void()> work) {
  Op op{Op::Kind::kLaunch};
  op.duration = duration;
  op.work = std::move(work);
  return Queue(stream, std::move(op));
}

Status SimulatedDevice::Poke(void* device, const void* host, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  TESSERA_ASSIGN_OR_RETURN(std::byte * bytes, DeviceBytes(device, n));
  if (n > 0) std::memcpy(bytes, host, n);
  return Status::Ok();
}

Status SimulatedDevice::Peek(void* host, const void* device, size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  TESSERA_ASSIGN_OR_RETURN(std::byte * bytes, DeviceBytes(device, n));
  if (n > 0) std::memcpy(host, bytes, n);
  return Status::Ok();
}

void SimulatedDevice::FailCopy(int nth, FaultMode mode) {
  std::lock_guard<std::mutex> lock(mu_);
  fault_countdown_ = nth;
  fault_mode_ = mode;
}

SimulatedDevice::Stats SimulatedDevice::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void SimulatedDevice::RunStream(Stream* s) {
  while (true) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stopping || !s->ops.empty(); });
      if (s->ops.empty()) return;  // stopping, nothing left
      op = std::move(s->ops.front());
      s->ops.pop_front();
    }
    switch (op.kind) {
      case Op::Kind::kToHost:
      case Op::Kind::kToDevice: {
        auto transfer = std::chrono::duration<double>(
            options_.bytes_per_second > 0 ? op.n / options_.bytes_per_second : 0.0);
        std::this_thread::sleep_for(
            options_.copy_latency +
            std::chrono::duration_cast<std::chrono::microseconds>(transfer));
        const bool to_host = op.kind == Op::Kind::kToHost;
        Status status;
        if (op.fail) {
          status = IOError(name_ + ": injected failure of a copy to " +
                           std::string(to_host ? "host" : "device") + " of " +
                           std::to_string(op.n) + " bytes");
        } else {
          // Checked again: the memory may have been freed since the copy was queued.
          std::lock_guard<std::mutex> lock(mu_);
          Result<std::byte*> bytes = DeviceBytes(op.device, op.n);
          status = bytes.status();
          if (status.ok()) status = CheckPinned(op.host, op.n);
          if (status.ok() && op.n > 0) {
            if (to_host) {
              std::memcpy(op.host, *bytes, op.n);
            } else {
              std::memcpy(*bytes, op.host, op.n);
            }
          }
        }
        if (!status.ok() && s->pending_error.ok()) s->pending_error = status;
        break;
      }
      case Op::Kind::kRecord: {
        std::lock_guard<std::mutex> lock(op.event->mu);
        op.event->completed = std::max(op.event->completed, op.generation);
        op.event->error = s->pending_error;
        s->pending_error = Status::Ok();
        op.event->cv.notify_all();
        break;
      }
      case Op::Kind::kWait: {
        std::unique_lock<std::mutex> lock(op.event->mu);
        op.event->cv.wait(lock, [&] { return op.event->completed >= op.generation; });
        break;
      }
      case Op::Kind::kLaunch:
        std::this_thread::sleep_for(op.duration);
        if (op.work) op.work();
        break;
    }
  }
}

}  // namespace tessera
