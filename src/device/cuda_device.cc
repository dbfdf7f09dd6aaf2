// Device for CUDA, through the runtime API only (no kernels): built when TESSERA_WITH_CUDA is
// on (CMakeLists.txt), against the static CUDA runtime, which loads the driver (libcuda.so.1)
// on its first call. A program that never calls CudaDevice never makes one, so it runs on a
// machine without a GPU or a driver.
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

#include "tessera/device.h"

namespace tessera {
namespace {

// "cudaMemcpyAsync (device to host, 33554432 bytes) on cuda:0: cudaErrorInvalidValue: invalid
// argument".
Status CudaError(cudaError_t error, const std::string& what) {
  return IOError(what + ": " + cudaGetErrorName(error) + ": " + cudaGetErrorString(error));
}

// Makes `ordinal` the calling thread's current device for the scope, and restores the one the
// thread had (the caller's framework relies on it: torch reads it back, it does not cache it).
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    int previous = -1;
    if (cudaGetDevice(&previous) == cudaSuccess && previous == ordinal) return;
    status_ = cudaSetDevice(ordinal);
    if (status_ == cudaSuccess && previous >= 0) previous_ = previous;
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;  // the device to restore; -1 when nothing was changed
  cudaError_t status_ = cudaSuccess;
};

class CudaDeviceImpl final : public Device {
 public:
  explicit CudaDeviceImpl(int ordinal)
      : ordinal_(ordinal), name_("cuda:" + std::to_string(ordinal)) {}

  std::string name() const override { return name_; }

  Result<void*> AllocatePinned(size_t bytes) override {
    DeviceScope scope(ordinal_);
    void* p = nullptr;
    // Portable: pinned for every device's context, not only this one's.
    const cudaError_t e =
        Checked(scope, [&] { return cudaHostAlloc(&p, bytes, cudaHostAllocPortable); });
    if (e != cudaSuccess) {
      return CudaError(e,
                       "cudaHostAlloc of " + std::to_string(bytes) + " pinned bytes for " + name_);
    }
    return p;
  }
  void FreePinned(void* pinned) override {
    DeviceScope scope(ordinal_);
    cudaFreeHost(pinned);
  }
  Result<void*> Allocate(size_t bytes) override {
    DeviceScope scope(ordinal_);
    void* p = nullptr;
    const cudaError_t e = Checked(scope, [&] { return cudaMalloc(&p, bytes); });
    if (e != cudaSuccess) {
      return CudaError(e, "cudaMalloc of " + std::to_string(bytes) + " bytes on " + name_);
    }
    return p;
  }
  void Free(void* device_memory) override {
    DeviceScope scope(ordinal_);
    cudaFree(device_memory);
  }

  Result<DeviceStream> NewStream() override {
    DeviceScope scope(ordinal_);
    cudaStream_t s = nullptr;
    const cudaError_t e =
        Checked(scope, [&] { return cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); });
    if (e != cudaSuccess) return CudaError(e, "cudaStreamCreateWithFlags on " + name_);
    return reinterpret_cast<DeviceStream>(s);
  }
  void DestroyStream(DeviceStream stream) override {
    DeviceScope scope(ordinal_);
    cudaStreamDestroy(AsStream(stream));
  }
  Result<DeviceEvent> NewEvent() override {
    DeviceScope scope(ordinal_);
    cudaEvent_t ev = nullptr;
    // Blocking sync: a thread that waits for a copy sleeps instead of spinning on a core the
    // caller's training needs. No timing: cheaper to record.
    const cudaError_t e = Checked(scope, [&] {
      return cudaEventCreateWithFlags(&ev, cudaEventBlockingSync | cudaEventDisableTiming);
    });
    if (e != cudaSuccess) return CudaError(e, "cudaEventCreateWithFlags on " + name_);
    return reinterpret_cast<DeviceEvent>(ev);
  }
  void DestroyEvent(DeviceEvent event) override {
    DeviceScope scope(ordinal_);
    cudaEventDestroy(AsEvent(event));
  }

  Status CopyToHost(void* host, const void* device, size_t n, DeviceStream stream) override {
    DeviceScope scope(ordinal_);
    const cudaError_t e = Checked(scope, [&] {
      return cudaMemcpyAsync(host, device, n, cudaMemcpyDeviceToHost, AsStream(stream));
    });
    if (e == cudaSuccess) return Status::Ok();
    return CudaError(
        e, "cudaMemcpyAsync (device to host, " + std::to_string(n) + " bytes) on " + name_);
  }
  Status CopyToDevice(void* device, const void* host, size_t n, DeviceStream stream) override {
    DeviceScope scope(ordinal_);
    const cudaError_t e = Checked(scope, [&] {
      return cudaMemcpyAsync(device, host, n, cudaMemcpyHostToDevice, AsStream(stream));
    });
    if (e == cudaSuccess) return Status::Ok();
    return CudaError(
        e, "cudaMemcpyAsync (host to device, " + std::to_string(n) + " bytes) on " + name_);
  }
  Status Record(DeviceEvent event, DeviceStream stream) override {
    DeviceScope scope(ordinal_);
    const cudaError_t e =
        Checked(scope, [&] { return cudaEventRecord(AsEvent(event), AsStream(stream)); });
    return e == cudaSuccess ? Status::Ok() : CudaError(e, "cudaEventRecord on " + name_);
  }
  Status Wait(DeviceStream stream, DeviceEvent event) override {
    DeviceScope scope(ordinal_);
    const cudaError_t e =
        Checked(scope, [&] { return cudaStreamWaitEvent(AsStream(stream), AsEvent(event), 0); });
    return e == cudaSuccess ? Status::Ok() : CudaError(e, "cudaStreamWaitEvent on " + name_);
  }
  Status Synchronize(DeviceEvent event) override {
    DeviceScope scope(ordinal_);
    const cudaError_t e = Checked(scope, [&] { return cudaEventSynchronize(AsEvent(event)); });
    return e == cudaSuccess ? Status::Ok() : CudaError(e, "cudaEventSynchronize on " + name_);
  }

 private:
  static cudaStream_t AsStream(DeviceStream s) { return reinterpret_cast<cudaStream_t>(s); }
  static cudaEvent_t AsEvent(DeviceEvent e) { return reinterpret_cast<cudaEvent_t>(e); }

  // The call's error, or the scope's when the device could not be made current.
  template <typename Call>
  static cudaError_t Checked(const DeviceScope& scope, Call&& call) {
    return scope.status() != cudaSuccess ? scope.status() : call();
  }

  const int ordinal_;
  const std::string name_;
};

}  // namespace

bool BuiltWithCuda() { return true; }

Result<std::shared_ptr<Device>> CudaDevice(int ordinal) {
  if (ordinal < 0) {
    return InvalidArgument("CUDA device ordinal must be at least 0, not " +
                           std::to_string(ordinal));
  }
  // Leaked on purpose: the devices outlive every static destructor that might still use them,
  // and CUDA may already be unloaded at exit.
  static std::mutex* mu = new std::mutex;
  static auto* devices = new std::vector<std::shared_ptr<Device>>;
  std::lock_guard<std::mutex> lock(*mu);
  if (static_cast<size_t>(ordinal) < devices->size() && (*devices)[ordinal]) {
    return (*devices)[ordinal];
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return FailedPrecondition(std::string("CUDA device ") + std::to_string(ordinal) +
                              ": CUDA finds no usable GPU (cudaGetDeviceCount: " +
                              cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")");
  }
  if (ordinal >= count) {
    return FailedPrecondition("CUDA device " + std::to_string(ordinal) + ": this machine has " +
                              std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s"));
  }
  if (devices->size() <= static_cast<size_t>(ordinal)) devices->resize(ordinal + 1);
  (*devices)[ordinal] = std::make_shared<CudaDeviceImpl>(ordinal);
  return (*devices)[ordinal];
}

}  // namespace tessera
