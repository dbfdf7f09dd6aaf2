#include "checkpoint/data_files.h"

#include "checkpoint/item_source.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/checksum.h"

namespace tessera {
namespace {

// kWritePiece (data_files.h): bytes written and then checksummed per WriteAt: small enough that
// the bytes the kernel just copied into the page cache are still in the CPU's cache when the
// hash reads them. Hashing after the write, not before, lets the kernel's copy (not the hash)
// pull them from memory, which it does faster (build/tessera_bench_io_patterns,
// page_cache_write_seconds: 1 GiB by 4 threads, 0.145 s hashed after, 0.168 s hashed before,
// 0.123 s not hashed).
//
// kWritebackStep (data_files.h): with SyncPolicy::kFull, every this many bytes written to a data
// file are handed to WritableFile::StartWriteback, so the device writes while the rest is being
// copied instead of all at the final fdatasync (tessera_bench_io_patterns,
// synced_write_seconds: 1 GiB by 4 threads, 0.44 s against 0.55 s for 64 MiB pwrites and one
// fdatasync per file).

// How often the calling thread reports progress while the writers work.
constexpr auto kProgressInterval = std::chrono::milliseconds(100);

// Index of the group of `key`: 1 + the index of its longest prefix in `prefixes`, or 0.
size_t GroupOf(const std::string& key, const std::vector<std::string>& prefixes) {
  size_t group = 0, longest = 0;
  for (size_t p = 0; p < prefixes.size(); ++p) {
    if (key.starts_with(prefixes[p]) && (group == 0 || prefixes[p].size() > longest)) {
      group = p + 1;
      longest = prefixes[p].size();
    }
  }
  return group;
}

// The manifest's order: tensors by key and box, then objects by key.
bool InManifestOrder(const LocalItem& a, const LocalItem& b) {
  if (a.kind != b.kind) return a.kind == ItemKind::kTensor;
  if (a.key != b.key) return a.key < b.key;
  return a.box < b.box;
}

// What one file's writer reports.
struct FileResult {
  std::vector<WrittenItem> items;             // `file` fields are the file's index
  std::vector<std::vector<uint64_t>> blocks;  // per item: checksums of its blocks after the first
  uint64_t size = 0;                          // the file's size
};

// The items of `file` as its format's codec sees them.
std::vector<ItemToWrite> ItemsOf(const LocalPlan& plan, const DataFilePlan& file) {
  std::vector<ItemToWrite> items;
  items.reserve(file.items.size());
  for (uint32_t i : file.items) {
    const LocalItem& item = plan.items[i];
    items.push_back(ItemToWrite{item.key, item.kind == ItemKind::kObject, item.dtype,
                                item.global_shape.ToVector(), item.box, item.num_bytes,
                                item.object_encoding});
  }
  return items;
}

// Writes one item's bytes through its codec's ItemWriter in pieces, checksumming each piece
// just after writing it, while it is in cache (with `checksums`): one checksum per block of
// `block_bytes` for tensor chunks, one for all of an object's bytes. With kFull, hands every
// kWritebackStep written to the device. Returns the item's stored length; `digests` gets the
// checksum of each block.
Result<uint64_t> WriteItem(WritableFile& out, ItemWriter& writer, const LocalItem& item,
                           ItemReader& data, bool checksums, uint64_t block_bytes, bool durable,
                           uint64_t& writeback_begin, std::atomic<uint64_t>& written,
                           std::vector<uint64_t>& digests) {
  // Objects: one block of any length.
  const uint64_t block =
      item.kind == ItemKind::kObject || block_bytes == 0 ? ~uint64_t{0} : block_bytes;
  // The end of the block that starts at `from`.
  auto block_end_from = [&](uint64_t from) {
    return item.num_bytes - from <= block ? item.num_bytes : from + block;
  };
  ChecksumStream checksum;
  uint64_t done = 0, block_end = block_end_from(0);
  while (true) {
    size_t n = static_cast<size_t>(std::min(kWritePiece, block_end - done));
    if (n > 0) {
      // A device item's bytes come a piece at a time: n may shrink to the piece's end.
      TESSERA_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, data.Next(n));
      n = bytes.size();
      TESSERA_RETURN_IF_ERROR(writer.Append(bytes.data(), n));
      if (checksums) checksum.Update(bytes.data(), n);
      written.fetch_add(n, std::memory_order_relaxed);
    }
    done += n;
    const uint64_t end = writer.position();
    if (durable && end - writeback_begin >= kWritebackStep) {
      TESSERA_RETURN_IF_ERROR(out.StartWriteback(writeback_begin, end - writeback_begin));
      writeback_begin = end;
    }
    if (done < block_end) continue;
    if (checksums) digests.push_back(checksum.Digest());
    checksum.Reset();
    if (done == item.num_bytes) break;
    block_end = block_end_from(done);
  }
  return writer.Finish();
}

// Writes one data file: the header its codec laid out, then every item where the codec places
// it, framed by the codec's ItemWriter.
Status WriteDataFile(Storage& storage, const std::string& dir, ItemSource& source,
                     const LocalPlan& plan, uint32_t file_index, const DataFilePlan& file,
                     const DataFileEncoder& layout, bool checksums,
                     const DataFileWriteOptions& options, std::atomic<uint64_t>& written,
                     FileResult& result, uint8_t& created) {
  const std::string path = JoinPath(dir, file.name);
  // Created exclusively: a name that exists (a planted link) is an error, never a target. The
  // name carries this save's fresh id, so a store may find a taken name only at Close.
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out,
                           storage.NewWritableFile(path, CreateMode::kExclusiveNewName));
  created = 1;
  const Bytes& header = layout.header();
  if (!header.empty()) TESSERA_RETURN_IF_ERROR(out->WriteAt(0, header.data(), header.size()));
  const bool durable = options.sync == SyncPolicy::kFull;
  uint64_t writeback_begin = 0;  // with kFull, bytes before it were handed to StartWriteback
  uint64_t end = header.size();
  for (size_t k = 0; k < file.items.size(); ++k) {
    const LocalItem& item = plan.items[file.items[k]];
    const uint64_t at = layout.ItemOffset(k, end);
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ItemWriter> writer, layout.BeginItem(*out, k, at));
    ItemReader data(source, file_index, k, item.num_bytes);
    std::vector<uint64_t> digests;
    TESSERA_ASSIGN_OR_RETURN(const uint64_t length, WriteItem(*out, *writer, item, data, checksums,
                                                              options.checksum_block_bytes, durable,
                                                              writeback_begin, written, digests));
    const uint64_t first = digests.empty() ? 0 : digests.front();
    result.items.push_back(WrittenItem{file.items[k], file_index, at, length, first});
    result.blocks.emplace_back(digests.empty() ? digests.end() : digests.begin() + 1,
                               digests.end());
    end = at + length;
  }
  result.size = end;
  if (durable) TESSERA_RETURN_IF_ERROR(out->Sync());
  const Status closed = out->Close();
  // The name was someone else's all along: the object there is theirs, not ours to remove.
  if (closed.code() == StatusCode::kAlreadyExists) created = 0;
  return closed;
}

}  // namespace

const std::byte* ItemData(const StateDict& state, const LocalItem& item) {
  const StateEntry& entry = state.entries()[item.entry_index];
  if (const auto* object = std::get_if<ShardedObject>(&entry)) {
    return reinterpret_cast<const std::byte*>(object->data.data());
  }
  return std::get<ShardedTensor>(entry).data.bytes() + item.byte_offset;
}

int SaveIoThreads(int requested, const Storage& storage) {
  if (requested >= 1) return requested;
  return storage.capabilities().positional_writes ? 2 : 1;
}

std::vector<DataFilePlan> PlanDataFiles(const LocalPlan& plan, const std::vector<uint32_t>& items,
                                        int files_per_group,
                                        const std::vector<std::string>& separate_prefixes,
                                        const FormatWriter& writer, const std::string& save_id,
                                        int rank, const std::string& attempt) {
  std::vector<std::vector<uint32_t>> groups(1 + separate_prefixes.size());
  for (uint32_t i : items) groups[GroupOf(plan.items[i].key, separate_prefixes)].push_back(i);
  std::vector<DataFilePlan> files;
  for (std::vector<uint32_t>& group : groups) {
    if (group.empty()) continue;
    if (writer.OneFilePerItem()) {
      for (uint32_t i : group) files.push_back(DataFilePlan{"", {i}});
      continue;
    }
    const size_t count =
        static_cast<size_t>(std::max(1, std::min<int>(files_per_group, group.size())));
    std::stable_sort(group.begin(), group.end(), [&](uint32_t a, uint32_t b) {
      return plan.items[a].num_bytes > plan.items[b].num_bytes;
    });
    const size_t first = files.size();
    files.resize(first + count);
    std::vector<uint64_t> load(count, 0);
    for (uint32_t i : group) {
      const size_t f = std::min_element(load.begin(), load.end()) - load.begin();
      files[first + f].items.push_back(i);
      load[f] += plan.items[i].num_bytes;
    }
  }
  for (size_t f = 0; f < files.size(); ++f) {
    files[f].name = writer.DataFileName(save_id, rank, static_cast<int>(f), attempt);
    // Items under kSmallItemBytes first, then the rest, each in the manifest's order.
    std::sort(files[f].items.begin(), files[f].items.end(), [&](uint32_t a, uint32_t b) {
      const bool a_small = plan.items[a].num_bytes < kSmallItemBytes;
      const bool b_small = plan.items[b].num_bytes < kSmallItemBytes;
      if (a_small != b_small) return a_small;
      return InManifestOrder(plan.items[a], plan.items[b]);
    });
  }
  return files;
}

Status WriteFilesInParallel(Storage& storage, const std::string& dir,
                            const std::vector<DataFilePlan>& files,
                            const DataFileWriteOptions& options, std::atomic<uint64_t>& written,
                            const std::function<Status(size_t f, uint8_t& created)>& write_file) {
  std::vector<Status> statuses(files.size());
  std::vector<uint8_t> created(files.size(), 0);  // bytes, not vector<bool>: one per thread
  std::atomic<size_t> next{0};
  std::atomic<size_t> finished{0};
  std::mutex mutex;
  std::condition_variable all_done;
  auto work = [&] {
    for (size_t f; (f = next.fetch_add(1)) < files.size();) {
      statuses[f] = write_file(f, created[f]);
      if (finished.fetch_add(1) + 1 == files.size()) {
        std::lock_guard<std::mutex> lock(mutex);
        all_done.notify_all();
      }
    }
  };
  // With a progress callback the calling thread only reports; otherwise it writes too.
  const bool report = static_cast<bool>(options.on_progress);
  const size_t helpers =
      std::min<size_t>(static_cast<size_t>(std::max(options.num_threads, 1)), files.size()) -
      (report || files.empty() ? 0 : 1);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < helpers; ++t) threads.emplace_back(work);
  if (report) {
    std::unique_lock<std::mutex> lock(mutex);
    while (!all_done.wait_for(lock, kProgressInterval,
                              [&] { return finished.load() == files.size(); })) {
      options.on_progress(written.load());
    }
  } else {
    work();
  }
  for (std::thread& t : threads) t.join();
  if (report) options.on_progress(written.load());
  for (size_t f = 0; f < files.size(); ++f) {
    if (!statuses[f].ok()) {
      // Leave nothing behind (no index will refer to these files), but only what this save
      // created: a name that was already taken belongs to someone else.
      for (size_t g = 0; g < files.size(); ++g) {
        if (created[g]) storage.Remove(JoinPath(dir, files[g].name)).IgnoreError();
      }
      return statuses[f].WithContext("writing " + JoinPath(dir, files[f].name));
    }
  }
  return Status::Ok();
}

Status WriteFilesFromSource(
    Storage& storage, const std::string& dir, const StateDict& state, const LocalPlan& plan,
    const std::vector<DataFilePlan>& files, const DataFileWriteOptions& options,
    std::atomic<uint64_t>& written,
    const std::function<Status(ItemSource& source, size_t f, uint8_t& created)>& write_file) {
  TESSERA_ASSIGN_OR_RETURN(
      std::unique_ptr<ItemSource> source,
      ItemSource::Start(state, plan, files, options.device_staging, options.num_threads));
  Status status =
      WriteFilesInParallel(storage, dir, files, options, written, [&](size_t f, uint8_t& created) {
        source->BeginFile(f);
        Status s = write_file(*source, f, created);
        source->EndFile(f);
        return s;
      });
  Status staged = source->Finish();
  if (status.ok() && !staged.ok()) {
    // Every writer got its bytes, so this cannot happen; nothing refers to the files either way.
    for (const DataFilePlan& f : files) storage.Remove(JoinPath(dir, f.name)).IgnoreError();
    return staged;
  }
  return status;
}

Result<WriteResult> WriteDataFiles(Storage& storage, const std::string& dir, const StateDict& state,
                                   const LocalPlan& plan, const std::vector<DataFilePlan>& files,
                                   const FormatWriter& writer, const std::string& save_id,
                                   const DataFileWriteOptions& options) {
  // Every file laid out before any is written: what the codec refuses costs nothing to undo.
  std::vector<std::unique_ptr<DataFileEncoder>> layouts(files.size());
  for (size_t f = 0; f < files.size(); ++f) {
    TESSERA_ASSIGN_OR_RETURN(layouts[f], writer.NewDataFile(ItemsOf(plan, files[f]), save_id));
  }
  const bool checksums = writer.EngineChecksums();
  std::vector<FileResult> results(files.size());
  std::atomic<uint64_t> written{0};
  TESSERA_RETURN_IF_ERROR(WriteFilesFromSource(
      storage, dir, state, plan, files, options, written,
      [&](ItemSource& source, size_t f, uint8_t& created) {
        return WriteDataFile(storage, dir, source, plan, static_cast<uint32_t>(f), files[f],
                             *layouts[f], checksums, options, written, results[f], created);
      }));
  WriteResult result;
  for (size_t f = 0; f < files.size(); ++f) {
    result.files.push_back(FileInfo{files[f].name, results[f].size});
    for (size_t k = 0; k < results[f].items.size(); ++k) {
      WrittenItem item = results[f].items[k];
      const std::vector<uint64_t>& blocks = results[f].blocks[k];
      item.first_block = result.block_checksums.size();
      item.num_blocks = blocks.size();
      result.block_checksums.insert(result.block_checksums.end(), blocks.begin(), blocks.end());
      result.items.push_back(item);
    }
  }
  return result;
}

}  // namespace tessera
