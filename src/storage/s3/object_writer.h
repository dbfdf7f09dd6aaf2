// ObjectWriter: streams one S3 object front to back. Bytes appended fill a part buffer; each
// full part is uploaded by the client's TransferPool while later bytes arrive (a multipart
// upload, started with the first full part). Finish publishes: one PUT when the object never
// filled a part, else the last part and CompleteMultipartUpload. Every failure path aborts the
// multipart upload, so no parts are left behind unless the process dies (then
// S3Client::AbortIncompleteUploads cleans up).
//
// Memory: the part being filled, plus the parts queued or uploading, which count against the
// client's MemoryBudget (Append blocks while the budget is spent).
//
// Thread safety: one thread at a time (S3WritableFile serialises its callers).
#ifndef TESSERA_STORAGE_S3_OBJECT_WRITER_H_
#define TESSERA_STORAGE_S3_OBJECT_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "storage/s3/s3_client.h"
#include "tessera/status.h"

namespace tessera::s3 {

class ObjectWriter {
 public:
  // With `create_only`, publishing fails with kAlreadyExists when the key exists by then
  // (If-None-Match: * on the PUT or the completion).
  ObjectWriter(std::shared_ptr<S3Client> client, std::string bucket, std::string key,
               bool create_only);
  // Aborts unless Finish succeeded.
  ~ObjectWriter();
  ObjectWriter(const ObjectWriter&) = delete;
  ObjectWriter& operator=(const ObjectWriter&) = delete;

  // Appends `data`. Fails with the first error of a part uploaded in the background.
  Status Append(std::span<const std::byte> data);
  // Publishes the object. The writer is done afterwards, whatever the outcome; on failure
  // nothing was published and the upload was aborted.
  Status Finish();
  // Discards everything: waits for the parts in flight, then aborts the upload.
  Status Abort();

  uint64_t size() const { return size_; }
  bool done() const { return done_; }
  // Parts handed to the pool so far.
  int parts_submitted() const { return next_part_ - 1; }

 private:
  struct Tracker;
  Status SubmitPart();
  Status WaitForParts();

  std::shared_ptr<S3Client> client_;
  const std::string bucket_, key_;
  const bool create_only_;
  std::shared_ptr<Tracker> tracker_;
  std::unique_ptr<std::byte[]> buffer_;
  uint64_t capacity_ = 0, filled_ = 0, size_ = 0;
  int next_part_ = 1;
  std::string upload_id_;
  bool done_ = false;
};

}  // namespace tessera::s3

#endif  // TESSERA_STORAGE_S3_OBJECT_WRITER_H_
