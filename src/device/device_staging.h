// DeviceStaging: what tessera keeps per device for the copies of saves and loads: a pool of
// pinned host buffers, a stream for the copies of saves (device to host) and one for those of
// loads (host to device), and the event that orders them after a caller's stream.
//
// One per Device, made on first use and kept for the life of the process (For): pinning memory
// costs about as much as copying into it, so every save and load reuses the buffers the earlier
// ones allocated, and memory stays flat from save to save. It refers to its device weakly: a
// Device that goes away (a test's SimulatedDevice) takes its memory with it.
//
// Thread-safe.
#ifndef TESSERA_DEVICE_DEVICE_STAGING_H_
#define TESSERA_DEVICE_DEVICE_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "tessera/device.h"

namespace tessera {

// A pinned host buffer and the event that marks the last copy queued into or out of it.
struct PinnedBuffer {
  std::byte* data = nullptr;
  size_t size = 0;
  DeviceEvent event = 0;
};

class DeviceStaging {
 public:
  // The staging of `device`, made on first use.
  static Result<std::shared_ptr<DeviceStaging>> For(const std::shared_ptr<Device>& device);

  ~DeviceStaging();
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // The copies of saves (to host) and of loads (to device) are queued on these.
  DeviceStream save_stream() const { return save_stream_; }
  DeviceStream load_stream() const { return load_stream_; }

  // Makes the work queued on `stream` from now on wait for the work queued on `after` so far
  // (an event recorded on `after`, waited for on `stream`). Nothing when they are the same.
  Status Order(Device& device, DeviceStream stream, DeviceStream after);

  // `count` (> 0) buffers of `bytes` each for one call: idle ones first, then new ones. When
  // pinned memory runs out, fewer (at least one; an error when not even one can be had). Buffers
  // of another size that are idle are freed first.
  Result<std::vector<PinnedBuffer>> Lease(Device& device, size_t count, size_t bytes);
  // Gives leased buffers back for later calls. Every copy into or out of them must be done
  // (Synchronize of their events).
  void Return(std::vector<PinnedBuffer> buffers);

  // Frees the idle buffers; returns their bytes.
  uint64_t ReleaseIdle(Device& device);

  // Bytes of pinned memory held (leased and idle).
  uint64_t pinned_bytes() const;

 private:
  DeviceStaging(std::weak_ptr<Device> device, DeviceStream save_stream, DeviceStream load_stream,
                DeviceEvent order_event);
  void FreeBuffer(Device& device, const PinnedBuffer& buffer);

  const std::weak_ptr<Device> device_;
  const DeviceStream save_stream_;
  const DeviceStream load_stream_;
  const DeviceEvent order_event_;
  std::mutex order_mu_;  // one Record + Wait pair of order_event_ at a time
  mutable std::mutex mu_;
  std::vector<PinnedBuffer> idle_;
  uint64_t pinned_bytes_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_DEVICE_DEVICE_STAGING_H_
