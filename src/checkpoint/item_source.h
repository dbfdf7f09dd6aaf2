// ItemSource: where the data file writers of a save get the bytes of the items they write.
//
// Host items are read in place. Items of tensors in device memory (TensorView::device) are
// copied, in pieces, into pinned host buffers (device/device_staging.h) on the device's copy
// stream, which first waits for the work queued on the caller's stream; a writer checksums and
// writes a piece as soon as it has landed, while later pieces are still being copied, and its
// buffer takes the next piece as soon as it is written. The copies run ahead of the writers as
// far as the pinned budget allows (DeviceStagingOptions::pinned_bytes), in the order the writers
// need them:
//
// - Each file's device bytes are cut into pieces of at most piece_bytes (a big item spans
//   several, small items share one), and a file's pieces are copied in the file's order.
// - Files being written come first, in turn. A file not yet begun is copied ahead only while
//   more buffers are free than there are writer threads; so the pieces in the buffers are always
//   the next ones some writer needs, and every writer can go on (no deadlock for any budget of at
//   least one piece).
//
// Once every piece has left device memory (its copy is done), or no more will be copied (a
// failure), DeviceStagingOptions::on_staged is called, from the copying thread.
//
// Thread-safe: one writer thread per file, as WriteFilesInParallel runs them.
#ifndef TESSERA_CHECKPOINT_ITEM_SOURCE_H_
#define TESSERA_CHECKPOINT_ITEM_SOURCE_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "device/device_staging.h"
#include "plan/save_plan.h"
#include "tessera/device.h"
#include "tessera/state_dict.h"

namespace tessera {

struct DataFilePlan;

class ItemSource {
 public:
  // Plans the pieces of `files` (items of `plan`, bytes in `state`) and starts copying. With no
  // device item, copies nothing and calls options.on_staged at once. `num_writers`: the writer
  // threads. Everything passed must outlive the source.
  static Result<std::unique_ptr<ItemSource>> Start(const StateDict& state, const LocalPlan& plan,
                                                   const std::vector<DataFilePlan>& files,
                                                   const DeviceStagingOptions& options,
                                                   int num_writers);
  // Stops copying, waits for the copies in flight, gives the buffers back and, when it was not
  // yet called, calls on_staged with the staging's failure or kAborted.
  ~ItemSource();
  ItemSource(const ItemSource&) = delete;
  ItemSource& operator=(const ItemSource&) = delete;

  // The writer of file `f` starts it, and ends it (whether it succeeded or not: after a failure
  // the rest of the file's pieces are not copied).
  void BeginFile(size_t f);
  void EndFile(size_t f);

  // Bytes of item `k` (an index into files[f].items) of file `f` from byte `offset` of the item:
  // host memory holding at least one of them (none when the item ends there), valid until
  // Consumed moves past them. Blocks until they have landed. Items are read in file order, each
  // from its first byte to its last.
  Result<std::span<const std::byte>> Bytes(size_t f, size_t k, uint64_t offset);
  // The writer of file `f` is done with the bytes of item `k` before `end`.
  void Consumed(size_t f, size_t k, uint64_t end);

  // Waits until every piece has been copied and consumed, or the copying failed; returns the
  // staging's status (OK when nothing was on a device).
  Status Finish();

 private:
  struct Segment {
    uint32_t item = 0;    // index into files[f].items
    uint64_t offset = 0;  // in the item's bytes
    uint64_t size = 0;
    const std::byte* src = nullptr;  // device memory
    uint64_t at = 0;                 // in the piece's buffer
  };
  enum class PieceState { kWaiting, kQueued, kDone };
  struct Piece {
    uint32_t file = 0;
    uint32_t device = 0;  // index into devices_
    std::vector<Segment> segments;
    uint64_t size = 0;
    PieceState state = PieceState::kWaiting;
    int buffer = -1;      // index into its device's buffers
    size_t consumed = 0;  // segments the writer is done with
  };
  struct DeviceCopies {
    std::shared_ptr<Device> device;
    std::shared_ptr<DeviceStaging> staging;
    std::vector<PinnedBuffer> buffers;
    std::vector<int> free;  // indices into buffers
  };
  struct FileCopies {
    size_t begin = 0, end = 0;  // its pieces: [begin, end) of pieces_
    size_t next_queue = 0;      // the next of its pieces to copy
    size_t reading = 0;         // the piece its writer reads next
    bool begun = false, ended = false;
  };

  ItemSource(const StateDict& state, const LocalPlan& plan, const std::vector<DataFilePlan>& files,
             const DeviceStagingOptions& options, int num_writers);
  Status Plan();
  Status SetUp();
  void Run();
  // The next piece to copy, or -1; requires mu_.
  long Choose();
  bool AllQueuedOrDropped() const;  // requires mu_
  void Fail(Status status);         // requires mu_
  void FreePiece(Piece& piece);     // requires mu_
  void Staged(const Status& status);
  // "copying key 'w' (box ..., bytes a to b) from cuda:0 to host memory", for errors.
  std::string Describe(const Piece& piece) const;

  const StateDict& state_;
  const LocalPlan& plan_;
  const std::vector<DataFilePlan>& files_;
  const DeviceStagingOptions options_;
  const size_t num_writers_;

  std::vector<Piece> pieces_;
  std::vector<FileCopies> file_;
  std::vector<DeviceCopies> devices_;

  std::mutex mu_;
  std::condition_variable cv_;  // a piece queued or consumed, a file begun or ended, a failure
  Status error_;                // the first failure of a copy
  bool stopping_ = false;
  size_t round_robin_ = 0;
  bool staged_called_ = false;  // guarded by mu_
  std::thread thread_;
};

// One item's bytes through an ItemSource, front to back, in parts the caller sizes.
class ItemReader {
 public:
  ItemReader(ItemSource& source, size_t f, size_t k, uint64_t size)
      : source_(source), f_(f), k_(k), size_(size) {}
  // Hands the last part back.
  ~ItemReader() {
    if (offset_ > 0) source_.Consumed(f_, k_, offset_);
  }
  ItemReader(const ItemReader&) = delete;
  ItemReader& operator=(const ItemReader&) = delete;

  // The next at most `max` (> 0) bytes: at least one while any are left. Valid until the next
  // call (which hands them back).
  Result<std::span<const std::byte>> Next(uint64_t max);

 private:
  ItemSource& source_;
  const size_t f_, k_;
  const uint64_t size_;
  uint64_t offset_ = 0;  // bytes handed out
  std::span<const std::byte> window_;
  uint64_t window_begin_ = 0;  // the item's byte window_ starts at
};

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_ITEM_SOURCE_H_
