// HostMemoryDevice: a Device whose "device memory" is ordinary host memory, and whose copies
// are memcpy, done when they are queued.
//
// Why: AsyncSaveOptions::staging_budget_bytes bounds the memory that holds the staged copy of a
// save. Tensors in device memory already leave it through a bounded set of pinned buffers, each
// reused as soon as its bytes are written (checkpoint/item_source.h). Presenting host tensors
// through this device gives them the same bounded, pipelined staging with no second mechanism:
// the background save copies a host tensor piece by piece into a buffer of the budget, writes
// it, and reuses the buffer; the caller may change its tensors once the last piece is copied.
//
// Copies are synchronous, so streams and events are names only: Record, Wait and Synchronize
// have nothing to wait for. Buffers ("pinned" memory) are 4096-aligned heap memory. Thread-safe.
#ifndef TESSERA_DEVICE_HOST_MEMORY_DEVICE_H_
#define TESSERA_DEVICE_HOST_MEMORY_DEVICE_H_

#include <atomic>
#include <memory>
#include <string>

#include "tessera/device.h"

namespace tessera {

class HostMemoryDevice final : public Device {
 public:
  // The one of this process (its staging buffers are kept and reused from save to save).
  static const std::shared_ptr<Device>& Get();

  std::string name() const override { return "host memory"; }
  Result<void*> AllocatePinned(size_t bytes) override;
  void FreePinned(void* pinned) override;
  Result<void*> Allocate(size_t bytes) override;
  void Free(void* memory) override;
  Result<DeviceStream> NewStream() override { return next_.fetch_add(1) + 1; }
  void DestroyStream(DeviceStream) override {}
  Result<DeviceEvent> NewEvent() override { return next_.fetch_add(1) + 1; }
  void DestroyEvent(DeviceEvent) override {}
  Status CopyToHost(void* host, const void* device, size_t n, DeviceStream stream) override;
  Status CopyToDevice(void* device, const void* host, size_t n, DeviceStream stream) override;
  Status Record(DeviceEvent, DeviceStream) override { return Status::Ok(); }
  Status Wait(DeviceStream, DeviceEvent) override { return Status::Ok(); }
  Status Synchronize(DeviceEvent) override { return Status::Ok(); }

 private:
  std::atomic<uintptr_t> next_{0};
};

}  // namespace tessera

#endif  // TESSERA_DEVICE_HOST_MEMORY_DEVICE_H_
