#include "checkpoint/device_uploads.h"

#include <algorithm>
#include <cstring>

namespace tessera {

Result<std::unique_ptr<DeviceUploads>> DeviceUploads::Start(const StateDict& state,
                                                            const Metadata& metadata,
                                                            const DeviceStagingOptions& options,
                                                            int num_threads) {
  std::unique_ptr<DeviceUploads> uploads(new DeviceUploads);
  uploads->device_of_.assign(metadata.tensors.size(), -1);
  for (const StateEntry& entry : state.entries()) {
    const auto* tensor = std::get_if<ShardedTensor>(&entry);
    if (!tensor || !tensor->data.on_device()) continue;
    const TensorInfo* info = metadata.FindTensor(tensor->key);
    if (!info) continue;  // a missing key, skipped
    size_t d = 0;
    while (d < uploads->targets_.size() && uploads->targets_[d].device != tensor->data.device) ++d;
    if (d == uploads->targets_.size()) uploads->targets_.push_back(Target{tensor->data.device});
    std::vector<DeviceStream>& streams = uploads->targets_[d].caller_streams;
    if (std::find(streams.begin(), streams.end(), tensor->data.stream) == streams.end()) {
      streams.push_back(tensor->data.stream);
    }
    uploads->device_of_[info - metadata.tensors.data()] = static_cast<int>(d);
  }
  if (uploads->targets_.empty()) return std::unique_ptr<DeviceUploads>();
  if (options.piece_bytes < 4096) {
    return InvalidArgument("DeviceStagingOptions::piece_bytes must be at least 4096, not " +
                           std::to_string(options.piece_bytes));
  }
  uploads->piece_bytes_ = static_cast<size_t>(options.piece_bytes);
  // Each reader fills one buffer while the copies of the others' run; the budget may allow
  // fewer (a reader then waits for a copy to finish).
  const size_t threads = static_cast<size_t>(std::max(num_threads, 1));
  const size_t count =
      options.pinned_bytes == 0
          ? 2 * threads + 2
          : std::max<uint64_t>(
                1, (options.pinned_bytes + options.piece_bytes - 1) / options.piece_bytes);
  for (Target& t : uploads->targets_) {
    TESSERA_ASSIGN_OR_RETURN(t.staging, DeviceStaging::For(t.device));
    TESSERA_ASSIGN_OR_RETURN(t.buffers, t.staging->Lease(*t.device, count, uploads->piece_bytes_));
    for (int b = static_cast<int>(t.buffers.size()); b-- > 0;) t.free.push_back(b);
    // The copies start after the caller's work on the tensors so far (their memory may still
    // be read by it, or be in the middle of a stream-ordered allocation).
    for (DeviceStream stream : t.caller_streams) {
      TESSERA_RETURN_IF_ERROR(t.staging->Order(*t.device, t.staging->load_stream(), stream)
                                  .WithContext("ordering the copies to " + t.device->name() +
                                               " after the caller's stream"));
    }
  }
  return uploads;
}

DeviceUploads::~DeviceUploads() {
  for (Target& t : targets_) {
    if (!t.staging) continue;
    for (const PinnedBuffer& b : t.buffers) t.device->Synchronize(b.event).IgnoreError();
    t.staging->Return(std::move(t.buffers));
  }
}

Result<int> DeviceUploads::Acquire(size_t d) {
  Target& t = targets_[d];
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!t.free.empty()) {
      const int b = t.free.back();
      t.free.pop_back();
      return b;
    }
    if (!t.in_flight.empty()) {
      const int b = t.in_flight.front();
      t.in_flight.pop_front();
      lock.unlock();
      Status done = t.device->Synchronize(t.buffers[b].event);
      if (!done.ok()) {
        Release(d, b);
        return done.WithContext("copying to " + t.device->name());
      }
      return b;
    }
    cv_.wait(lock);  // every buffer is being filled by another reader
  }
}

Status DeviceUploads::Upload(size_t d, int b, std::byte* dst, size_t n) {
  Target& t = targets_[d];
  const PinnedBuffer& buffer = t.buffers[b];
  Status queued = t.device->CopyToDevice(dst, buffer.data, n, t.staging->load_stream());
  if (queued.ok()) queued = t.device->Record(buffer.event, t.staging->load_stream());
  if (!queued.ok()) {
    Release(d, b);
    return queued.WithContext("copying " + std::to_string(n) + " bytes to " + t.device->name());
  }
  std::lock_guard<std::mutex> lock(mu_);
  t.in_flight.push_back(b);
  cv_.notify_all();
  return Status::Ok();
}

void DeviceUploads::Release(size_t d, int b) {
  std::lock_guard<std::mutex> lock(mu_);
  targets_[d].free.push_back(b);
  cv_.notify_all();
}

Status DeviceUploads::CopyBack(uint32_t tensor, std::byte* host, const std::byte* src, size_t n) {
  const size_t d = static_cast<size_t>(device_of_[tensor]);
  Target& t = targets_[d];
  for (size_t done = 0; done < n;) {
    const size_t chunk = std::min(piece_bytes_, n - done);
    TESSERA_ASSIGN_OR_RETURN(const int b, Acquire(d));
    const PinnedBuffer& buffer = t.buffers[b];
    Status copied = t.device->CopyToHost(buffer.data, src + done, chunk, t.staging->load_stream());
    if (copied.ok()) copied = t.device->Record(buffer.event, t.staging->load_stream());
    if (copied.ok()) copied = t.device->Synchronize(buffer.event);
    if (copied.ok()) std::memcpy(host + done, buffer.data, chunk);
    Release(d, b);
    TESSERA_RETURN_IF_ERROR(copied.WithContext("copying " + std::to_string(chunk) +
                                               " loaded bytes back from " + t.device->name()));
    done += chunk;
  }
  return Status::Ok();
}

Status DeviceUploads::Finish() {
  Status first;
  for (size_t d = 0; d < targets_.size(); ++d) {
    Target& t = targets_[d];
    while (true) {
      int b = -1;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (t.in_flight.empty()) break;
        b = t.in_flight.front();
        t.in_flight.pop_front();
      }
      Status done = t.device->Synchronize(t.buffers[b].event);
      if (first.ok() && !done.ok()) first = done.WithContext("copying to " + t.device->name());
      Release(d, b);
    }
    // Work the caller queues on its streams from now on sees the loaded bytes.
    for (DeviceStream stream : t.caller_streams) {
      Status ordered = t.staging->Order(*t.device, stream, t.staging->load_stream());
      if (first.ok() && !ordered.ok()) first = ordered;
    }
  }
  return first;
}

DeviceSink::~DeviceSink() { Flush().IgnoreError(); }

Result<std::byte*> DeviceSink::Reserve(uint32_t tensor, std::byte* dst, size_t n) {
  const size_t d = static_cast<size_t>(uploads_->device_of_[tensor]);
  const size_t capacity = uploads_->piece_bytes_;
  if (n > capacity) {
    return Internal("a part of " + std::to_string(n) + " bytes is larger than a staging piece (" +
                    std::to_string(capacity) + " bytes)");
  }
  if (buffer_ >= 0 && d == device_ && dst == dst_ + fill_ && fill_ + n <= capacity) {
    std::byte* at = uploads_->targets_[d].buffers[buffer_].data + fill_;
    fill_ += n;
    return at;
  }
  TESSERA_RETURN_IF_ERROR(Flush());
  TESSERA_ASSIGN_OR_RETURN(buffer_, uploads_->Acquire(d));
  device_ = d;
  dst_ = dst;
  fill_ = n;
  return uploads_->targets_[d].buffers[buffer_].data;
}

Status DeviceSink::Flush() {
  if (buffer_ < 0) return Status::Ok();
  const int b = buffer_;
  buffer_ = -1;
  if (fill_ == 0) {
    uploads_->Release(device_, b);
    return Status::Ok();
  }
  return uploads_->Upload(device_, b, dst_, fill_);
}

}  // namespace tessera
