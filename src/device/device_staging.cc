#include "device/device_staging.h"

#include <algorithm>
#include <map>

namespace tessera {
namespace {

struct Registry {
  std::mutex mu;
  std::map<const Device*, std::shared_ptr<DeviceStaging>> stagings;
  std::map<const Device*, std::weak_ptr<Device>> owners;  // to tell a reused address apart
};

// Leaked on purpose: CUDA may be unloaded before static destructors run at exit, and freeing
// pinned memory then would fail.
Registry& GlobalRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

// The staging of `device` if there is one; requires the registry's lock.
std::shared_ptr<DeviceStaging> FindLocked(Registry& r, const Device* device) {
  auto it = r.stagings.find(device);
  if (it == r.stagings.end()) return nullptr;
  std::shared_ptr<Device> owner = r.owners[device].lock();
  if (owner.get() != device) {  // a dead device whose address was reused
    r.stagings.erase(it);
    r.owners.erase(device);
    return nullptr;
  }
  return it->second;
}

}  // namespace

Result<std::shared_ptr<DeviceStaging>> DeviceStaging::For(const std::shared_ptr<Device>& device) {
  Registry& r = GlobalRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (std::shared_ptr<DeviceStaging> found = FindLocked(r, device.get())) return found;
  // Forget the stagings of devices that went away (their memory went with them).
  for (auto it = r.owners.begin(); it != r.owners.end();) {
    if (it->second.expired()) {
      r.stagings.erase(it->first);
      it = r.owners.erase(it);
    } else {
      ++it;
    }
  }
  TESSERA_ASSIGN_OR_RETURN(DeviceStream save_stream, device->NewStream());
  Result<DeviceStream> load_stream = device->NewStream();
  Result<DeviceEvent> order_event =
      load_stream.ok() ? device->NewEvent() : Result<DeviceEvent>(load_stream.status());
  if (!order_event.ok()) {
    device->DestroyStream(save_stream);
    if (load_stream.ok()) device->DestroyStream(*load_stream);
    return order_event.status().WithContext("setting up the copies of " + device->name());
  }
  std::shared_ptr<DeviceStaging> staging(
      new DeviceStaging(device, save_stream, *load_stream, *order_event));
  r.stagings[device.get()] = staging;
  r.owners[device.get()] = device;
  return staging;
}

DeviceStaging::DeviceStaging(std::weak_ptr<Device> device, DeviceStream save_stream,
                             DeviceStream load_stream, DeviceEvent order_event)
    : device_(std::move(device)),
      save_stream_(save_stream),
      load_stream_(load_stream),
      order_event_(order_event) {}

DeviceStaging::~DeviceStaging() {
  std::shared_ptr<Device> device = device_.lock();
  if (!device) return;  // its memory, streams and events went with it
  for (const PinnedBuffer& b : idle_) FreeBuffer(*device, b);
  device->DestroyEvent(order_event_);
  device->DestroyStream(save_stream_);
  device->DestroyStream(load_stream_);
}

Status DeviceStaging::Order(Device& device, DeviceStream stream, DeviceStream after) {
  if (stream == after) return Status::Ok();
  std::lock_guard<std::mutex> lock(order_mu_);
  TESSERA_RETURN_IF_ERROR(device.Record(order_event_, after));
  return device.Wait(stream, order_event_);
}

void DeviceStaging::FreeBuffer(Device& device, const PinnedBuffer& buffer) {
  device.DestroyEvent(buffer.event);
  device.FreePinned(buffer.data);
}

Result<std::vector<PinnedBuffer>> DeviceStaging::Lease(Device& device, size_t count, size_t bytes) {
  std::vector<PinnedBuffer> leased;
  std::vector<PinnedBuffer> other_sizes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = idle_.begin(); it != idle_.end();) {
      if (it->size == bytes && leased.size() < count) {
        leased.push_back(*it);
        it = idle_.erase(it);
      } else if (it->size != bytes) {
        other_sizes.push_back(*it);
        pinned_bytes_ -= it->size;
        it = idle_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const PinnedBuffer& b : other_sizes) FreeBuffer(device, b);
  Status failure;
  while (leased.size() < count) {
    Result<void*> memory = device.AllocatePinned(bytes);
    if (!memory.ok()) {
      failure = memory.status();
      break;
    }
    Result<DeviceEvent> event = device.NewEvent();
    if (!event.ok()) {
      device.FreePinned(*memory);
      failure = event.status();
      break;
    }
    leased.push_back(PinnedBuffer{static_cast<std::byte*>(*memory), bytes, *event});
    std::lock_guard<std::mutex> lock(mu_);
    pinned_bytes_ += bytes;
  }
  if (leased.empty()) {
    return failure.WithContext("pinned staging memory for " + device.name() + " (" +
                               std::to_string(count) + " pieces of " + std::to_string(bytes) +
                               " bytes asked for)");
  }
  return leased;
}

void DeviceStaging::Return(std::vector<PinnedBuffer> buffers) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_.insert(idle_.end(), buffers.begin(), buffers.end());
}

uint64_t DeviceStaging::ReleaseIdle(Device& device) {
  std::vector<PinnedBuffer> idle;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle.swap(idle_);
    for (const PinnedBuffer& b : idle) bytes += b.size;
    pinned_bytes_ -= bytes;
  }
  for (const PinnedBuffer& b : idle) FreeBuffer(device, b);
  return bytes;
}

uint64_t DeviceStaging::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_bytes_;
}

uint64_t ReleaseIdlePinnedMemory(Device& device) {
  std::shared_ptr<DeviceStaging> staging;
  {
    Registry& r = GlobalRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    staging = FindLocked(r, &device);
  }
  return staging ? staging->ReleaseIdle(device) : 0;
}

}  // namespace tessera
