// SimulatedDevice: a Device for tests on machines without an accelerator (the test double of
// the device interface, as MemoryStorage is of Storage).
//
// - A separate address space: device addresses lie in a range reserved with no access rights,
//   so host code that dereferences one crashes at once; the bytes live elsewhere. Addresses are
//   never reused, so a copy from freed memory fails too.
// - Copies check their pointers when queued: the device side must lie inside one live device
//   allocation, the host side inside one pinned allocation (AllocatePinned) of this device. A
//   host pointer passed as a device pointer, or pageable memory passed as pinned, fails with an
//   error naming the address.
// - Asynchrony: each stream runs its work in order on a thread of its own, each copy after a
//   latency and at a bandwidth, so copies overlap with the host as on a GPU. Kernels of the
//   caller are simulated with Launch.
// - Faults: the n-th copy from now fails when queued or when it runs (FailCopy); a failure
//   that happens while running is reported by Synchronize of the next event recorded on its
//   stream, as CUDA reports asynchronous errors.
//
// Thread-safe.
#ifndef TESSERA_DEVICE_SIMULATED_DEVICE_H_
#define TESSERA_DEVICE_SIMULATED_DEVICE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "tessera/device.h"

namespace tessera {

struct SimulatedDeviceOptions {
  // Before each copy starts. Default 20 us (a CUDA copy's launch cost is a few us).
  std::chrono::microseconds copy_latency{20};
  // Of each copy, in bytes per second; 0 means instantaneous. Default 4 GB/s.
  double bytes_per_second = 4e9;
  // Reserved address space for device memory, in bytes: the most one device ever allocates
  // (addresses are not reused). Default 64 GiB (reserved, not committed).
  uint64_t address_space_bytes = uint64_t{64} << 30;
};

class SimulatedDevice final : public Device {
 public:
  explicit SimulatedDevice(std::string name = "sim:0", SimulatedDeviceOptions options = {});
  ~SimulatedDevice() override;
  SimulatedDevice(const SimulatedDevice&) = delete;
  SimulatedDevice& operator=(const SimulatedDevice&) = delete;

  std::string name() const override { return name_; }
  Result<void*> AllocatePinned(size_t bytes) override;
  void FreePinned(void* pinned) override;
  Result<void*> Allocate(size_t bytes) override;
  void Free(void* device_memory) override;
  Result<DeviceStream> NewStream() override;
  void DestroyStream(DeviceStream stream) override;
  Result<DeviceEvent> NewEvent() override;
  void DestroyEvent(DeviceEvent event) override;
  Status CopyToHost(void* host, const void* device, size_t n, DeviceStream stream) override;
  Status CopyToDevice(void* device, const void* host, size_t n, DeviceStream stream) override;
  Status Record(DeviceEvent event, DeviceStream stream) override;
  Status Wait(DeviceStream stream, DeviceEvent event) override;
  Status Synchronize(DeviceEvent event) override;

  // ---- for tests ----
  // Queues on `stream` a simulated kernel: after `duration`, `work` runs on the stream's thread
  // (it may read and write device memory with Poke/Peek).
  Status Launch(DeviceStream stream, std::chrono::microseconds duration,
                std::function<void()> work);
  // Host access to device memory, at once and unordered (as a test's setup or check).
  Status Poke(void* device, const void* host, size_t n);
  Status Peek(void* host, const void* device, size_t n) const;

  enum class FaultMode { kWhenQueued, kWhenRun };
  // The `nth` copy queued from now (0: the next one), in either direction, fails.
  void FailCopy(int nth, FaultMode mode);

  struct Stats {
    uint64_t pinned_bytes = 0;        // live
    uint64_t pinned_allocations = 0;  // AllocatePinned calls that succeeded, ever
    uint64_t device_bytes = 0;        // live
    uint64_t copies_to_host = 0;      // queued, ever
    uint64_t copies_to_device = 0;
    uint64_t bytes_to_host = 0;
    uint64_t bytes_to_device = 0;
    uint64_t streams = 0;  // live
    uint64_t events = 0;   // live
  };
  Stats stats() const;

 private:
  struct Allocation {
    size_t size = 0;
    std::unique_ptr<std::byte[]> bytes;  // device allocations only: where the bytes live
  };
  struct Event;
  struct Stream;
  struct Op;

  // The bytes behind device range [p, p + n), or an error naming the address.
  Result<std::byte*> DeviceBytes(const void* p, size_t n) const;  // requires mu_
  Status CheckPinned(const void* p, size_t n) const;              // requires mu_
  Status Queue(DeviceStream stream, Op op);
  Result<Stream*> FindStream(DeviceStream stream);              // requires mu_
  Result<std::shared_ptr<Event>> FindEvent(DeviceEvent event);  // requires mu_
  void RunStream(Stream* stream);
  // Whether the next copy fails, and how (consumes the countdown).
  std::optional<FaultMode> NextCopyFault();  // requires mu_

  const std::string name_;
  const SimulatedDeviceOptions options_;
  std::byte* base_ = nullptr;  // of the reserved address range
  mutable std::mutex mu_;
  uint64_t next_offset_ = 0;                // bump allocation in the reserved range
  std::map<uintptr_t, Allocation> device_;  // by address
  std::map<uintptr_t, size_t> pinned_;      // by address
  std::map<DeviceStream, std::unique_ptr<Stream>> streams_;
  std::map<DeviceEvent, std::shared_ptr<Event>> events_;
  uintptr_t next_handle_ = 1;
  int fault_countdown_ = -1;
  FaultMode fault_mode_ = FaultMode::kWhenQueued;
  Stats stats_;
};

}  // namespace tessera

#endif  // TESSERA_DEVICE_SIMULATED_DEVICE_H_
