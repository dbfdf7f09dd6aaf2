#include "storage/s3/object_writer.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>

namespace tessera::s3 {

// What the part uploads report back; shared with the pool's tasks, which may outlive a
// writer that is being destroyed only until Abort has waited for them.
struct ObjectWriter::Tracker {
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0;
  bool cancelled = false;  // queued parts are skipped
  Status first_error;
  std::map<int, CompletedPart> parts;
};

ObjectWriter::ObjectWriter(std::shared_ptr<S3Client> client, std::string bucket, std::string key,
                           bool create_only)
    : client_(std::move(client)),
      bucket_(std::move(bucket)),
      key_(std::move(key)),
      create_only_(create_only),
      tracker_(std::make_shared<Tracker>()) {}

ObjectWriter::~ObjectWriter() {
  if (!done_) Abort().IgnoreError();
}

Status ObjectWriter::Append(std::span<const std::byte> data) {
  if (done_) {
    return FailedPrecondition(S3Client::Uri(bucket_, key_) + " was already published or aborted");
  }
  {
    std::lock_guard<std::mutex> lock(tracker_->mu);
    TESSERA_RETURN_IF_ERROR(tracker_->first_error);
  }
  while (!data.empty()) {
    if (!buffer_) {
      capacity_ = client_->PartBytes(next_part_);
      buffer_ = std::make_unique_for_overwrite<std::byte[]>(capacity_);
      filled_ = 0;
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(data.size(), capacity_ - filled_));
    std::memcpy(buffer_.get() + filled_, data.data(), n);
    filled_ += n;
    size_ += n;
    data = data.subspan(n);
    if (filled_ == capacity_) TESSERA_RETURN_IF_ERROR(SubmitPart());
  }
  return Status::Ok();
}

Status ObjectWriter::SubmitPart() {
  if (upload_id_.empty()) {
    TESSERA_ASSIGN_OR_RETURN(upload_id_, client_->CreateMultipartUpload(bucket_, key_));
  }
  if (next_part_ > kMaxParts) {
    return OutOfRange(S3Client::Uri(bucket_, key_) + ": more than " + std::to_string(kMaxParts) +
                      " parts (raise the part size)");
  }
  const int number = next_part_++;
  const uint64_t length = filled_;
  const uint64_t offset = size_ - filled_;
  client_->budget().Acquire(length);  // blocks while the budget is spent
  std::shared_ptr<std::byte[]> bytes(buffer_.release());
  filled_ = 0;
  {
    std::lock_guard<std::mutex> lock(tracker_->mu);
    ++tracker_->in_flight;
  }
  client_->pool().Submit([client = client_, tracker = tracker_, bucket = bucket_, key = key_,
                          upload_id = upload_id_, number, bytes, length, offset] {
    bool skip;
    {
      std::lock_guard<std::mutex> lock(tracker->mu);
      skip = tracker->cancelled || !tracker->first_error.ok();
    }
    Result<CompletedPart> part =
        skip ? Result<CompletedPart>(Aborted("part " + std::to_string(number) + " not sent"))
             : client->UploadPart(bucket, key, upload_id, number,
                                  std::span<const std::byte>(bytes.get(), length), offset);
    client->budget().Release(length);
    std::lock_guard<std::mutex> lock(tracker->mu);
    if (part.ok()) {
      tracker->parts[number] = std::move(*part);
    } else if (tracker->first_error.ok() && !skip) {
      tracker->first_error = part.status();
    }
    --tracker->in_flight;
    tracker->cv.notify_all();
  });
  return Status::Ok();
}

Status ObjectWriter::WaitForParts() {
  std::unique_lock<std::mutex> lock(tracker_->mu);
  tracker_->cv.wait(lock, [&] { return tracker_->in_flight == 0; });
  return tracker_->first_error;
}

Status ObjectWriter::Finish() {
  if (done_) {
    return FailedPrecondition(S3Client::Uri(bucket_, key_) + " was already published or aborted");
  }
  Status status;
  if (upload_id_.empty()) {
    // Never filled a part: one PUT.
    status = client_->PutObject(bucket_, key_, std::span<const std::byte>(buffer_.get(), filled_),
                                create_only_);
    buffer_.reset();
    done_ = true;
    return status;
  }
  if (filled_ > 0) status = SubmitPart();
  const Status parts = WaitForParts();
  if (status.ok()) status = parts;
  if (status.ok()) {
    std::vector<CompletedPart> list;
    {
      std::lock_guard<std::mutex> lock(tracker_->mu);
      for (auto& [number, part] : tracker_->parts) list.push_back(part);
    }
    status = client_->CompleteMultipartUpload(bucket_, key_, upload_id_, list, create_only_, size_);
    if (status.ok()) {
      done_ = true;
      return status;
    }
  }
  // Not published: leave no parts behind.
  Abort().IgnoreError();
  return status;
}

Status ObjectWriter::Abort() {
  buffer_.reset();
  {
    std::lock_guard<std::mutex> lock(tracker_->mu);
    tracker_->cancelled = true;
  }
  WaitForParts().IgnoreError();
  done_ = true;
  if (upload_id_.empty()) return Status::Ok();
  Status s = client_->AbortMultipartUpload(bucket_, key_, upload_id_);
  upload_id_.clear();
  return s;
}

}  // namespace tessera::s3
