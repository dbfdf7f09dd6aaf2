#include "checkpoint/item_source.h"

#include <algorithm>
#include <set>
#include <utility>

#include "checkpoint/data_files.h"

namespace tessera {
namespace {

const ShardedTensor* TensorOf(const StateDict& state, const LocalItem& item) {
  if (item.kind != ItemKind::kTensor) return nullptr;
  return std::get_if<ShardedTensor>(&state.entries()[item.entry_index]);
}

bool OnDevice(const StateDict& state, const LocalItem& item) {
  const ShardedTensor* tensor = TensorOf(state, item);
  return tensor != nullptr && tensor->data.on_device();
}

}  // namespace

ItemSource::ItemSource(const StateDict& state, const LocalPlan& plan,
                       const std::vector<DataFilePlan>& files, const DeviceStagingOptions& options,
                       int num_writers)
    : state_(state),
      plan_(plan),
      files_(files),
      options_(options),
      num_writers_(static_cast<size_t>(std::max(num_writers, 1))) {}

Result<std::unique_ptr<ItemSource>> ItemSource::Start(const StateDict& state, const LocalPlan& plan,
                                                      const std::vector<DataFilePlan>& files,
                                                      const DeviceStagingOptions& options,
                                                      int num_writers) {
  if (options.piece_bytes < 4096) {
    Status error = InvalidArgument("DeviceStagingOptions::piece_bytes must be at least 4096, not " +
                                   std::to_string(options.piece_bytes));
    if (options.on_staged) options.on_staged(error);
    return error;
  }
  std::unique_ptr<ItemSource> source(new ItemSource(state, plan, files, options, num_writers));
  Status planned = source->Plan();
  if (planned.ok()) planned = source->SetUp();
  if (!planned.ok()) {
    std::lock_guard<std::mutex> lock(source->mu_);
    source->Fail(planned);
    return planned;  // the destructor calls on_staged with the failure
  }
  if (source->pieces_.empty()) {
    source->Staged(Status::Ok());
  } else {
    source->thread_ = std::thread([s = source.get()] { s->Run(); });
  }
  return source;
}

Status ItemSource::Plan() {
  const uint64_t piece_bytes = options_.piece_bytes;
  file_.resize(files_.size());
  for (size_t f = 0; f < files_.size(); ++f) {
    file_[f].begin = file_[f].next_queue = file_[f].reading = pieces_.size();
    bool open = false;
    for (size_t k = 0; k < files_[f].items.size(); ++k) {
      const LocalItem& item = plan_.items[files_[f].items[k]];
      if (!OnDevice(state_, item)) continue;
      const TensorView& view = TensorOf(state_, item)->data;
      uint32_t d = 0;
      while (d < devices_.size() && devices_[d].device != view.device) ++d;
      if (d == devices_.size()) devices_.push_back(DeviceCopies{view.device});
      const std::byte* src = view.bytes() + item.byte_offset;
      for (uint64_t done = 0; done < item.num_bytes;) {
        if (open && (pieces_.back().device != d || pieces_.back().size == piece_bytes)) {
          open = false;
        }
        if (!open) {
          pieces_.push_back(Piece{static_cast<uint32_t>(f), d});
          open = true;
        }
        Piece& piece = pieces_.back();
        const uint64_t n = std::min(item.num_bytes - done, piece_bytes - piece.size);
        piece.segments.push_back(
            Segment{static_cast<uint32_t>(k), done, n, src + done, piece.size});
        piece.size += n;
        done += n;
      }
    }
    file_[f].end = pieces_.size();
  }
  return Status::Ok();
}

Status ItemSource::SetUp() {
  std::vector<size_t> pieces_on(devices_.size(), 0);
  for (const Piece& p : pieces_) ++pieces_on[p.device];
  for (size_t d = 0; d < devices_.size(); ++d) {
    DeviceCopies& copies = devices_[d];
    TESSERA_ASSIGN_OR_RETURN(copies.staging, DeviceStaging::For(copies.device));
    const uint64_t budget = options_.pinned_bytes;
    const size_t count =
        budget == 0 ? pieces_on[d]
                    : std::min<size_t>(pieces_on[d],
                                       std::max<uint64_t>(1, (budget + options_.piece_bytes - 1) /
                                                                 options_.piece_bytes));
    TESSERA_ASSIGN_OR_RETURN(copies.buffers,
                             copies.staging->Lease(*copies.device, count, options_.piece_bytes));
    for (int b = static_cast<int>(copies.buffers.size()); b-- > 0;) copies.free.push_back(b);
  }
  // The copies start after the work the caller queued on its streams so far.
  std::set<std::pair<size_t, DeviceStream>> ordered;
  for (const Piece& piece : pieces_) {
    for (const Segment& s : piece.segments) {
      const LocalItem& item = plan_.items[files_[piece.file].items[s.item]];
      const DeviceStream stream = TensorOf(state_, item)->data.stream;
      if (!ordered.insert({piece.device, stream}).second) continue;
      DeviceCopies& copies = devices_[piece.device];
      TESSERA_RETURN_IF_ERROR(
          copies.staging->Order(*copies.device, copies.staging->save_stream(), stream)
              .WithContext("ordering the copies of key '" + item.key + "' after its stream"));
    }
  }
  return Status::Ok();
}

ItemSource::~ItemSource() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // No copy may still write into a buffer that goes back to the pool.
  for (DeviceCopies& d : devices_) {
    if (!d.staging) continue;
    for (const PinnedBuffer& b : d.buffers) d.device->Synchronize(b.event).IgnoreError();
    d.staging->Return(std::move(d.buffers));
  }
  Status error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    error = error_;
  }
  Staged(error.ok() ? Aborted("the save stopped before its device tensors were copied") : error);
}

void ItemSource::Fail(Status status) {
  if (error_.ok()) error_ = std::move(status);
  cv_.notify_all();
}

void ItemSource::FreePiece(Piece& piece) {
  if (piece.state == PieceState::kDone) return;
  if (piece.buffer >= 0) devices_[piece.device].free.push_back(piece.buffer);
  piece.buffer = -1;
  piece.state = PieceState::kDone;
  cv_.notify_all();
}

bool ItemSource::AllQueuedOrDropped() const {
  for (const FileCopies& f : file_) {
    if (f.next_queue < f.end) return false;
  }
  return true;
}

long ItemSource::Choose() {
  const size_t n = file_.size();
  // Files being written, in turn.
  for (size_t i = 0; i < n; ++i) {
    const size_t f = (round_robin_ + i) % n;
    const FileCopies& file = file_[f];
    if (!file.begun || file.ended || file.next_queue == file.end) continue;
    if (devices_[pieces_[file.next_queue].device].free.empty()) continue;
    round_robin_ = f + 1;
    return static_cast<long>(file.next_queue);
  }
  // Files not yet begun, in the order the writers take them, while buffers are left for every
  // writer.
  for (size_t f = 0; f < n; ++f) {
    const FileCopies& file = file_[f];
    if (file.begun || file.next_queue == file.end) continue;
    if (devices_[pieces_[file.next_queue].device].free.size() > num_writers_) {
      return static_cast<long>(file.next_queue);
    }
  }
  return -1;
}

void ItemSource::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  // Buffers that took a copy; the last copy of each is checked at the end (an earlier one was
  // checked by the writer that read it before the buffer was reused).
  std::vector<std::vector<long>> last_piece(devices_.size());  // per buffer, or -1
  for (size_t d = 0; d < devices_.size(); ++d) {
    last_piece[d].assign(devices_[d].buffers.size(), -1);
  }
  while (!stopping_ && error_.ok() && !AllQueuedOrDropped()) {
    const long chosen = Choose();
    if (chosen < 0) {
      cv_.wait(lock);
      continue;
    }
    Piece& piece = pieces_[chosen];
    DeviceCopies& d = devices_[piece.device];
    piece.buffer = d.free.back();
    d.free.pop_back();
    ++file_[piece.file].next_queue;
    const PinnedBuffer& buffer = d.buffers[piece.buffer];
    lock.unlock();
    Status queued;
    for (const Segment& s : piece.segments) {
      queued = d.device->CopyToHost(buffer.data + s.at, s.src, s.size, d.staging->save_stream());
      if (!queued.ok()) break;
    }
    if (queued.ok()) queued = d.device->Record(buffer.event, d.staging->save_stream());
    lock.lock();
    last_piece[piece.device][piece.buffer] = chosen;  // some copy into it may be in flight
    if (!queued.ok()) {
      Fail(queued.WithContext(Describe(piece)));
      break;
    }
    piece.state = PieceState::kQueued;
    if (file_[piece.file].ended) FreePiece(piece);  // its writer gave up meanwhile
    cv_.notify_all();
  }
  const bool complete = AllQueuedOrDropped();
  Status status = error_;
  lock.unlock();
  // Every copy done, and none failed. No buffer takes another copy now.
  for (size_t d = 0; d < devices_.size(); ++d) {
    for (size_t b = 0; b < last_piece[d].size(); ++b) {
      if (last_piece[d][b] < 0) continue;
      Status done = devices_[d].device->Synchronize(devices_[d].buffers[b].event);
      if (status.ok() && !done.ok()) status = done.WithContext(Describe(pieces_[last_piece[d][b]]));
    }
  }
  if (status.ok() && !complete)
    status = Aborted("the save stopped before its device tensors were copied");
  lock.lock();
  if (!status.ok()) Fail(status);
  lock.unlock();
  Staged(status);
}

std::string ItemSource::Describe(const Piece& piece) const {
  const Segment& first = piece.segments.front();
  const LocalItem& item = plan_.items[files_[piece.file].items[first.item]];
  std::string what = "copying key '" + item.key + "' (box " + item.box.ToString() + ", bytes " +
                     std::to_string(first.offset) + " to " +
                     std::to_string(first.offset + first.size) + ")";
  if (piece.segments.size() > 1) {
    what += " and " + std::to_string(piece.segments.size() - 1) + " more part(s)";
  }
  return what + " from " + devices_[piece.device].device->name() + " to host memory";
}

void ItemSource::Staged(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (staged_called_) return;
    staged_called_ = true;
  }
  if (options_.on_staged) options_.on_staged(status);
}

void ItemSource::BeginFile(size_t f) {
  std::lock_guard<std::mutex> lock(mu_);
  file_[f].begun = true;
  cv_.notify_all();
}

void ItemSource::EndFile(size_t f) {
  std::lock_guard<std::mutex> lock(mu_);
  FileCopies& file = file_[f];
  file.ended = true;
  // Pieces being queued right now (still kWaiting) are freed by Run once queued.
  for (size_t p = file.reading; p < file.next_queue; ++p) {
    if (pieces_[p].state == PieceState::kQueued) FreePiece(pieces_[p]);
  }
  file.reading = file.next_queue = file.end;  // the rest is never copied
  cv_.notify_all();
}

Result<std::span<const std::byte>> ItemSource::Bytes(size_t f, size_t k, uint64_t offset) {
  const LocalItem& item = plan_.items[files_[f].items[k]];
  if (!OnDevice(state_, item)) {
    return std::span<const std::byte>(ItemData(state_, item) + offset, item.num_bytes - offset);
  }
  std::unique_lock<std::mutex> lock(mu_);
  FileCopies& file = file_[f];
  while (true) {
    if (!error_.ok()) return error_;
    if (file.reading == file.end) break;
    Piece& piece = pieces_[file.reading];
    const Segment& s = piece.segments[piece.consumed];
    if (s.item != k || offset < s.offset || offset >= s.offset + s.size) break;
    if (piece.state == PieceState::kWaiting) {
      cv_.wait(lock);
      continue;
    }
    DeviceCopies& d = devices_[piece.device];
    const PinnedBuffer& buffer = d.buffers[piece.buffer];
    lock.unlock();
    Status landed = d.device->Synchronize(buffer.event);  // at once once it has landed
    if (!landed.ok()) {
      lock.lock();
      landed = landed.WithContext(Describe(piece));
      Fail(landed);
      return landed;
    }
    const uint64_t skip = offset - s.offset;
    return std::span<const std::byte>(buffer.data + s.at + skip, s.size - skip);
  }
  return Internal("key '" + item.key + "': the writer of " + files_[f].name + " asked for byte " +
                  std::to_string(offset) + ", which is not the next piece copied for it");
}

void ItemSource::Consumed(size_t f, size_t k, uint64_t end) {
  const LocalItem& item = plan_.items[files_[f].items[k]];
  if (!OnDevice(state_, item)) return;
  std::lock_guard<std::mutex> lock(mu_);
  FileCopies& file = file_[f];
  while (file.reading < file.end) {
    Piece& piece = pieces_[file.reading];
    const Segment& s = piece.segments[piece.consumed];
    if (s.item != k || end < s.offset + s.size) return;
    if (++piece.consumed < piece.segments.size()) continue;
    FreePiece(piece);
    ++file.reading;
  }
}

Status ItemSource::Finish() {
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

Result<std::span<const std::byte>> ItemReader::Next(uint64_t max) {
  if (offset_ >= size_) return std::span<const std::byte>();
  if (offset_ >= window_begin_ + window_.size()) {
    if (offset_ > 0) source_.Consumed(f_, k_, offset_);
    TESSERA_ASSIGN_OR_RETURN(window_, source_.Bytes(f_, k_, offset_));
    window_begin_ = offset_;
    if (window_.empty()) return Internal("an item's bytes ended early");
  }
  const uint64_t n = std::min<uint64_t>(max, window_begin_ + window_.size() - offset_);
  std::span<const std::byte> part = window_.subspan(offset_ - window_begin_, n);
  offset_ += n;
  return part;
}

}  // namespace tessera
