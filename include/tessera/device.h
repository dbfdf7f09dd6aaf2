// Device: the few operations tessera needs from an accelerator, so that nothing else in the
// library knows CUDA. Tensors in device memory (TensorView::device) are saved by copying them,
// in pieces, into pinned host buffers on a stream of tessera's own, and loaded the other way
// (docs/DESIGN.md, "Device memory").
//
// Streams and events are opaque integers: for CUDA a cudaStream_t or cudaEvent_t cast to
// uintptr_t (0 is the legacy default stream). A caller passes its stream with each device
// tensor (TensorView::stream): the stream on which its own work that writes (before a save) or
// reads (after a load) that memory is ordered. tessera's copies wait for what is queued on it
// when the call starts, and a load makes it wait for the copies into the tensor.
//
// Thread safety: every method may be called from any thread, concurrently.
#ifndef TESSERA_DEVICE_H_
#define TESSERA_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tessera/status.h"

namespace tessera {

using DeviceStream = uintptr_t;
using DeviceEvent = uintptr_t;

class Device {
 public:
  virtual ~Device() = default;

  // For messages: "cuda:0".
  virtual std::string name() const = 0;

  // Page-locked host memory of `bytes` (> 0): copies run from and into it asynchronously, at
  // full speed. Usable with every stream of this device. kIOError when it cannot be had.
  virtual Result<void*> AllocatePinned(size_t bytes) = 0;
  virtual void FreePinned(void* pinned) = 0;
  // Device memory of `bytes` (> 0), for tests, benchmarks and tools: the library itself never
  // allocates any.
  virtual Result<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* device_memory) = 0;

  // A stream whose work waits for no other stream's unless told to (Wait); for CUDA,
  // cudaStreamNonBlocking, so it never waits for the legacy default stream either.
  virtual Result<DeviceStream> NewStream() = 0;
  virtual void DestroyStream(DeviceStream stream) = 0;
  virtual Result<DeviceEvent> NewEvent() = 0;
  virtual void DestroyEvent(DeviceEvent event) = 0;

  // Queue a copy of `n` bytes on `stream` and return. `host` must be pinned memory of this
  // device (AllocatePinned), `device` memory of this device; both must stay valid until the
  // copy is done (Synchronize of an event recorded after it). Errors found while queueing are
  // returned here; errors of the copy itself come from a later Synchronize.
  virtual Status CopyToHost(void* host, const void* device, size_t n, DeviceStream stream) = 0;
  virtual Status CopyToDevice(void* device, const void* host, size_t n, DeviceStream stream) = 0;

  // Marks with `event` the work queued on `stream` so far (replacing the event's earlier mark).
  virtual Status Record(DeviceEvent event, DeviceStream stream) = 0;
  // Work queued on `stream` from now on starts only after the work `event` marks now is done.
  // Does not block the calling thread.
  virtual Status Wait(DeviceStream stream, DeviceEvent event) = 0;
  // Blocks the calling thread until the work `event` marks is done (at once for an event never
  // recorded). Returns the error of that work, if any (a copy that failed).
  virtual Status Synchronize(DeviceEvent event) = 0;
};

// The CUDA device `ordinal` (CUDA's numbering) of this process: made on first use and kept for
// the process's life, so every call with one ordinal returns the same object. It keeps each
// thread's current device as it was (every call sets and restores it). Errors: kUnimplemented
// when this tessera was built without CUDA (CMake option TESSERA_WITH_CUDA);
// kFailedPrecondition, naming the CUDA error, when CUDA finds no driver or no such device;
// kInvalidArgument for a negative ordinal. A program that never calls this never touches CUDA.
Result<std::shared_ptr<Device>> CudaDevice(int ordinal);

// Whether this tessera was built with CUDA (CudaDevice can succeed).
bool BuiltWithCuda();

// How device tensors are staged through pinned host memory (SaveOptions::device_staging,
// LoadOptions::device_staging). Ignored when no tensor is in device memory.
//
// The pinned buffers are kept per device for the life of the process and reused by every later
// save and load (allocating pinned memory costs about as much as copying into it): memory stays
// flat from save to save. ReleaseIdlePinnedMemory gives back what no call is using.
struct DeviceStagingOptions {
  // The most pinned host memory one call holds per device, in bytes (rounded up to whole
  // pieces). A save copies device memory into it as fast as the device allows, and a piece is
  // reused as soon as its bytes are written (checksummed and handed to storage); a state larger
  // than the budget therefore leaves the device only as fast as it is written. Default 0: a save
  // holds enough for all the device bytes this rank writes (one pass of copies, like PyTorch
  // DCP's pinned stager), a load 2 pieces per I/O thread plus 2.
  uint64_t pinned_bytes = 0;
  // The unit of the copies, in bytes: each copy moves one piece (a part of a big tensor, or
  // several small ones) between device memory and one pinned buffer. Default 32 MiB: large
  // enough that a copy runs at the link's full rate, small enough that writing starts soon and
  // that several copies are in flight. At least 4096.
  uint64_t piece_bytes = uint64_t{32} << 20;
  // Save only: called once, from a tessera thread, when every byte of device memory the save
  // reads has been copied to host memory, or when it is known that no more will be (the save
  // failed; the status says why). From then on the caller may change or free its device
  // tensors. Save returns after calling it. Default none.
  std::function<void(const Status& status)> on_staged;
};

// Frees the pinned buffers of `device` that no save or load is using (they are otherwise kept
// for the next one). Returns the bytes freed.
uint64_t ReleaseIdlePinnedMemory(Device& device);

}  // namespace tessera

#endif  // TESSERA_DEVICE_H_
