// DeviceUploads: the copies of one load into tensors in device memory (TensorView::device).
//
// The readers put the bytes bound for device memory into pinned buffers (device/
// device_staging.h) through a DeviceSink each, which appends while the destinations are
// contiguous and, once a buffer is full, queues its copy to the device on the device's load
// stream and takes another buffer; so each reader reads (and checks, and converts) the next
// bytes while the last ones are being copied. Runs, checksum units, casts and read sharing are
// the reader's as for host memory: only the last step, putting bytes in place, differs.
//
// The copies start after the work queued on each tensor's stream when the load starts, and
// Finish makes those streams wait for the copies (and waits for them itself).
//
// Thread-safe; a DeviceSink belongs to one thread.
#ifndef TESSERA_CHECKPOINT_DEVICE_UPLOADS_H_
#define TESSERA_CHECKPOINT_DEVICE_UPLOADS_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "device/device_staging.h"
#include "tessera/checkpoint.h"
#include "tessera/metadata.h"
#include "tessera/state_dict.h"

namespace tessera {

class DeviceUploads {
 public:
  // For the tensors of `state` in device memory, which `metadata` indexes (a state key the
  // metadata lacks is skipped). Null when none is. Leases the pinned buffers (enough for
  // `num_threads` readers, each with one buffer filling while the others' copies run) and
  // orders the copies after the tensors' streams.
  static Result<std::unique_ptr<DeviceUploads>> Start(const StateDict& state,
                                                      const Metadata& metadata,
                                                      const DeviceStagingOptions& options,
                                                      int num_threads);
  // Waits for the copies in flight and gives the buffers back.
  ~DeviceUploads();
  DeviceUploads(const DeviceUploads&) = delete;
  DeviceUploads& operator=(const DeviceUploads&) = delete;

  // Whether metadata tensor `tensor` is loaded into device memory.
  bool OnDevice(uint32_t tensor) const {
    return tensor < device_of_.size() && device_of_[tensor] >= 0;
  }
  // The most bytes one DeviceSink::Reserve takes.
  size_t piece_bytes() const { return piece_bytes_; }

  // Copies `n` bytes of the device memory at `src` (of metadata tensor `tensor`'s device) to
  // `host`, after every copy queued so far (read sharing sends what this rank loaded). Blocks.
  Status CopyBack(uint32_t tensor, std::byte* host, const std::byte* src, size_t n);

  // Waits for every copy queued (every sink must be flushed) and makes each tensor's stream
  // wait for them. Returns the first failure of a copy.
  Status Finish();

 private:
  friend class DeviceSink;
  struct Target {
    std::shared_ptr<Device> device;
    std::shared_ptr<DeviceStaging> staging;
    std::vector<DeviceStream> caller_streams;
    std::vector<PinnedBuffer> buffers;
    std::vector<int> free;      // indices into buffers
    std::deque<int> in_flight;  // copies queued, oldest first
  };

  DeviceUploads() = default;
  // A buffer of device `d` to fill: a free one, or the oldest whose copy is done.
  Result<int> Acquire(size_t d);
  // Queues the copy of `n` bytes of buffer `b` to `dst`.
  Status Upload(size_t d, int b, std::byte* dst, size_t n);
  void Release(size_t d, int b);

  std::vector<int> device_of_;  // per metadata tensor: index into targets_, or -1
  std::vector<Target> targets_;
  size_t piece_bytes_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;  // a buffer released
};

// One reader thread's way into device memory: pinned buffers filled in place, then copied.
class DeviceSink {
 public:
  explicit DeviceSink(DeviceUploads* uploads) : uploads_(uploads) {}
  // Flushes; errors are lost (call Flush to see them).
  ~DeviceSink();
  DeviceSink(const DeviceSink&) = delete;
  DeviceSink& operator=(const DeviceSink&) = delete;

  // Host memory for the `n` (<= DeviceUploads::piece_bytes()) bytes bound for `dst`, device
  // memory of metadata tensor `tensor`: the caller fills it before the next call, and the bytes
  // reach `dst` by the next call that cannot append to the same buffer, or by Flush.
  Result<std::byte*> Reserve(uint32_t tensor, std::byte* dst, size_t n);
  // Queues the copy of what the buffer holds.
  Status Flush();

 private:
  DeviceUploads* uploads_;
  int buffer_ = -1;
  size_t device_ = 0;
  std::byte* dst_ = nullptr;  // where the buffer's bytes go
  size_t fill_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_DEVICE_UPLOADS_H_
