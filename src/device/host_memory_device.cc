#include "device/host_memory_device.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace tessera {
namespace {

constexpr size_t kAlignment = 4096;  // a page: what O_DIRECT writers of the buffers need

Result<void*> AlignedAllocate(size_t bytes, const char* what) {
  void* memory = nullptr;
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (bytes == 0 || posix_memalign(&memory, kAlignment, rounded) != 0) {
    return IOErrorFromErrno(std::string("allocating ") + std::to_string(bytes) + " bytes of " +
                                what + " (host memory staging)",
                            ENOMEM);
  }
  return memory;
}

}  // namespace

const std::shared_ptr<Device>& HostMemoryDevice::Get() {
  // Never destroyed: savers and their staging may outlive static destruction's order.
  static const auto* device = new std::shared_ptr<Device>(std::make_shared<HostMemoryDevice>());
  return *device;
}

Result<void*> HostMemoryDevice::AllocatePinned(size_t bytes) {
  return AlignedAllocate(bytes, "staging buffer");
}

void HostMemoryDevice::FreePinned(void* pinned) { std::free(pinned); }

Result<void*> HostMemoryDevice::Allocate(size_t bytes) { return AlignedAllocate(bytes, "memory"); }

void HostMemoryDevice::Free(void* memory) { std::free(memory); }

Status HostMemoryDevice::CopyToHost(void* host, const void* device, size_t n, DeviceStream) {
  if (n != 0) std::memcpy(host, device, n);
  return Status::Ok();
}

Status HostMemoryDevice::CopyToDevice(void* device, const void* host, size_t n, DeviceStream) {
  if (n != 0) std::memcpy(device, host, n);
  return Status::Ok();
}

}  // namespace tessera
