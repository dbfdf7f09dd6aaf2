// tessera bench io: save and load against the hardware, measured in the same run.
//
// R ranks (threads of this process, talking through LocalComm) hold a synthetic Megatron-style
// state (workload::BuildRankState) of about --size bytes under the save layout, by default
// tp=R: every split tensor is cut in R equal parts and every rank writes the same bytes (the
// tiny replicated norms are written once, by rank 0). Each repeat runs these phases:
//
//   save          tessera Save into a fresh checkpoint directory
//   raw_write     the same ranks write the same bytes per rank (each rank's share of the
//                 checkpoint payload, from the same memory) to plain files, one file per I/O
//                 thread, with pwrite; with --sync, fdatasync per file, then fsync of the file
//                 directory and its parent (what a durable save needs at the least)
//   load          tessera Load of that checkpoint under the save layout
//   raw_write_streamed   only with --sync: raw_write with 8 MiB pwrites, each followed by
//                 sync_file_range(SYNC_FILE_RANGE_WRITE) so the disk writes while later bytes
//                 are copied (what tessera's synced save does); the best a durable writer does
//   raw_read      the same ranks pread the raw files back into the load's destination memory
//   reshard_load  tessera Load under another layout with the same rank count
//
// in a fixed order that alternates tessera and raw: even repeats run save, raw_write,
// [raw_write_streamed], load, raw_read, reshard_load; odd repeats run [raw_write_streamed],
// raw_write, save, raw_read, load, reshard_load, so neither side always goes first. Nothing is
// dropped from the page cache (reads are served from it); before each phase, outside the timing,
// syncfs() writes back whatever earlier phases left dirty, so no phase pays for another's writeback
// (--no-flush turns that off). With --drop-caches (root), the page cache is also dropped before
// every read phase, so loads and raw reads come from the disk. Every destination is allocated and
// touched before any timing. A phase is timed on rank 0 from a barrier before it to a barrier after
// it. --warmup repeats (default 1) run first and are reported apart: on this VM the first writes of
// a process land on page-cache pages the guest has not touched yet and run 2-4x slower, for the raw
// baseline as for tessera. Each figure is the best of the --repeat timed samples; every sample is
// reported too. The first repeat (a warm-up one by default) checks every loaded element.
//
// --storage URI (s3://bucket/prefix, msc://profile/path) runs on a storage instead of --dir:
// the checkpoints go there, and the raw baseline writes and reads the same bytes per rank and
// I/O thread as objects through the same client (one PUT or a multipart upload each; ranged
// GETs back). No syncfs and no page cache apply (--sync and --drop-caches are refused); the
// run's prefix is removed at the end. Against moto every client waits on moto, so the ratio
// to the raw baseline is the figure that carries over (docs/PERFORMANCE.md).
//
// --format torch_dist saves a PyTorch DCP checkpoint instead (SaveOptions::format;
// --torch-dist-flavor); --save-only runs the save and raw write phases alone (the comparison
// with DCP's own save_state_dict: bench/peers/compare.py --format torch_dist --save-only).
//
// Memory: getrusage's ru_maxrss covers the whole process, which holds the save, load and
// reshard states at once. What one phase adds on top of the memory it starts with is measured
// too (*_extra_rss_bytes): rank 0 resets the kernel's high-water mark (/proc/self/clear_refs)
// before the phase and reads VmHWM after it.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "checkpoint/envelope.h"
#include "tessera/checkpoint.h"
#include "tessera/local_comm.h"
#include "tessera/storage_uri.h"
#include "tools/bench_io_storage.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/memory.h"
#include "tools/ranks.h"
#include "workload/model_state.h"

namespace tessera::tools {
namespace {

using ::tessera::workload::BuildRankState;
using ::tessera::workload::CheckRankState;
using ::tessera::workload::Layout;
using ::tessera::workload::ModelConfig;
using ::tessera::workload::ParseLayout;
using ::tessera::workload::RankState;
using Clock = std::chrono::steady_clock;

// Largest single pwrite/pread of the raw baseline: PosixStorageOptions' default.
constexpr size_t kRawPiece = 64u << 20;
constexpr size_t kStreamedPiece = 8u << 20;

struct BenchIoOptions {
  int ranks = 2;
  std::string size = "1GiB";
  bool sync = false;
  std::string comm = "local";
  int io_threads = 2;
  int repeat = 3;
  int warmup = 1;
  std::string dir = "/tmp";
  // A storage URI (s3://bucket/prefix, msc://profile/path): the run goes there instead of
  // --dir, the raw baseline writing and reading the same bytes as objects through the same
  // client (StorageRawWrite, StorageRawRead).
  std::string storage;
  std::string save_layout;                // default: tp<ranks>
  std::string reshard_layout;             // default: see DefaultReshardLayout
  bool flush = true;                      // syncfs before each phase, outside the timing
  bool drop_caches = false;               // drop the page cache before each read phase (root)
  bool check = true;                      // check every loaded element in the first repeat
  bool verify_checksums = true;           // LoadOptions::verify_checksums
  std::string format = "tessera";         // SaveOptions::format: tessera or torch_dist
  std::string torch_dist_flavor = "2.x";  // SaveOptions::torch_dist_flavor: 2.x or 1.13
  bool save_only = false;                 // skip load, raw_read and reshard_load
  std::string share_reads = "auto";       // LoadOptions::read_sharing: auto, readonce or none
  std::string exchange_bytes = "64MiB";   // LoadOptions::exchange_bytes
};

// tp<R/2>,dp2 for an even R (a TP change plus a DP split of the moments' flat ranges);
// tp1,dp<R> for an odd R; tp1 for one rank (the same layout: nothing to reshard).
std::string DefaultReshardLayout(int ranks) {
  if (ranks == 1) return "tp1,dp1";
  if (ranks % 2 == 0) return "tp" + std::to_string(ranks / 2) + ",dp2";
  return "tp1,dp" + std::to_string(ranks);
}

// ---- the raw baseline --------------------------------------------------------------------------

// The first `limit` bytes of the state's buffers, in order.
std::vector<Segment> StateSegments(const RankState& state, uint64_t limit) {
  std::vector<Segment> out;
  for (const auto& buffer : state.buffers) {
    if (limit == 0) break;
    const uint64_t n = std::min<uint64_t>(limit, buffer->size());
    if (n == 0) continue;
    out.push_back({reinterpret_cast<std::byte*>(buffer->data()), n});
    limit -= n;
  }
  return out;
}

// Cuts the concatenation of `segments` into `parts` contiguous pieces of about equal bytes.
std::vector<std::vector<Segment>> SplitSegments(const std::vector<Segment>& segments, int parts) {
  uint64_t total = 0;
  for (const Segment& s : segments) total += s.size;
  std::vector<std::vector<Segment>> out(parts);
  size_t i = 0;
  uint64_t used = 0;  // of segments[i]
  for (int p = 0; p < parts; ++p) {
    const uint64_t begin = total * p / parts, end = total * (p + 1) / parts;
    uint64_t want = end - begin;
    while (want > 0 && i < segments.size()) {
      const uint64_t n = std::min(want, segments[i].size - used);
      out[p].push_back({segments[i].data + used, n});
      want -= n;
      used += n;
      if (used == segments[i].size) ++i, used = 0;
    }
  }
  return out;
}

// Touches every page of every buffer, so no timed phase pays for first-touch page faults.
void TouchPages(const RankState& state) {
  const long page = sysconf(_SC_PAGESIZE);
  for (const auto& buffer : state.buffers) {
    volatile uint8_t* p = buffer->data();
    for (size_t i = 0; i < buffer->size(); i += page) p[i] = p[i];
  }
}

Status SyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IOErrorFromErrno("open directory " + path, errno);
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (r != 0) return IOErrorFromErrno("fsync directory " + path, err);
  return Status::Ok();
}

// `streamed`: pieces of kStreamedPiece, each handed to the disk by sync_file_range as soon as
// it is written.
Status RawWriteFile(const std::string& path, const std::vector<Segment>& segments, bool sync,
                    bool streamed = false) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IOErrorFromErrno("open " + path, errno);
  Status status;
  uint64_t offset = 0;
  const uint64_t piece = streamed ? kStreamedPiece : kRawPiece;
  for (const Segment& s : segments) {
    for (uint64_t done = 0; done < s.size && status.ok();) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(piece, s.size - done));
      const ssize_t r = ::pwrite(fd, s.data + done, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) status = IOErrorFromErrno("pwrite " + path, r < 0 ? errno : EIO);
      if (r > 0 && streamed &&
          ::sync_file_range(fd, static_cast<off_t>(offset), r, SYNC_FILE_RANGE_WRITE) != 0) {
        status = IOErrorFromErrno("sync_file_range " + path, errno);
      }
      done += r > 0 ? r : 0;
      offset += r > 0 ? r : 0;
    }
  }
  if (status.ok() && sync && ::fdatasync(fd) != 0) {
    status = IOErrorFromErrno("fdatasync " + path, errno);
  }
  ::close(fd);
  return status;
}

Status RawReadFile(const std::string& path, const std::vector<Segment>& segments) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IOErrorFromErrno("open " + path, errno);
  Status status;
  uint64_t offset = 0;
  for (const Segment& s : segments) {
    for (uint64_t done = 0; done < s.size && status.ok();) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kRawPiece, s.size - done));
      const ssize_t r = ::pread(fd, s.data + done, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) status = IOErrorFromErrno("pread " + path, r < 0 ? errno : EIO);
      done += r > 0 ? r : 0;
      offset += r > 0 ? r : 0;
    }
  }
  ::close(fd);
  return status;
}

// Runs fn(t) for t in [0, n): threads 1..n-1 on new threads, 0 on the calling one (as Save and
// Load do). Returns the first error.
Status RunThreads(int n, const std::function<Status(int)>& fn) {
  std::vector<Status> statuses(n);
  std::vector<std::thread> threads;
  for (int t = 1; t < n; ++t) threads.emplace_back([&, t] { statuses[t] = fn(t); });
  statuses[0] = fn(0);
  for (std::thread& t : threads) t.join();
  for (const Status& s : statuses) TESSERA_RETURN_IF_ERROR(s);
  return Status::Ok();
}

std::string RawFile(const std::string& dir, int rank, int thread) {
  return dir + "/raw-r" + std::to_string(rank) + "-t" + std::to_string(thread) + ".bin";
}

// ---- memory -------------------------------------------------------------------------------------

uint64_t MaxRssBytes() {
  struct rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
}

constexpr const char* kDropCachesPath = "/proc/sys/vm/drop_caches";

// Drops the clean pages of this machine's page cache ("1": page cache only, not dentries and
// inodes). The caller writes back dirty pages first (syncfs), else they stay cached.
bool DropPageCache() {
  std::ofstream out(kDropCachesPath);
  out << "1";
  out.flush();
  return static_cast<bool>(out);
}

// ---- the benchmark ------------------------------------------------------------------------------

enum Phase { kSave, kRawWrite, kRawWriteStreamed, kLoad, kRawRead, kReshard, kNumPhases };
constexpr const char* kPhaseNames[kNumPhases] = {"save", "raw_write", "raw_write_streamed",
                                                 "load", "raw_read",  "reshard_load"};

struct Results {
  std::vector<double> seconds[kNumPhases];
  uint64_t extra_rss[kNumPhases] = {};  // max over samples
  bool rss_tracked = true;
  uint64_t process_peak_rss = 0;  // VmHWM seen before each reset
  uint64_t total_bytes = 0;       // checkpoint payload
  std::vector<uint64_t> written_per_rank, raw_per_rank;
  std::vector<uint64_t> save_held, load_held, reshard_held;
  uint64_t load_bytes_read = 0, load_bytes_needed = 0;
  uint64_t reshard_bytes_read = 0, reshard_bytes_needed = 0;
  // Read calls that reached storage (LoadReport::read_calls), all ranks: on an object store,
  // the loads' GET requests.
  uint64_t load_read_calls = 0, reshard_read_calls = 0;
  // The resharded load's job figures (read_sharing kReadOnce): the union of the bytes the
  // ranks needed, bytes sent between ranks, the checkpoint's bytes.
  uint64_t reshard_union_bytes = 0, reshard_exchanged_bytes = 0, checkpoint_bytes = 0;
  bool reshard_read_once = false;  // what the resharded load did (LoadReport::read_sharing)
  int files_per_rank = 0;
  std::vector<bool> plan_cache_hits;  // of each save sample
  bool checked = false;
};

int RunBenchIo(const BenchIoOptions& options) {
  Result<std::unique_ptr<RankRunner>> runner = RankRunner::Create(options.comm);
  if (!runner.ok()) return Fail(runner.status());
  // Under MPI every process of the world is a rank.
  BenchIoOptions o = options;
  if ((*runner)->fixed_size() > 0) o.ranks = (*runner)->fixed_size();
  if (o.ranks < 1 || o.io_threads < 1 || o.repeat < 1 || o.warmup < 0) {
    return Fail(
        InvalidArgument("bench io needs --ranks, --io-threads and --repeat >= 1, --warmup >= 0"));
  }
  Result<uint64_t> size = ParseSize(o.size);
  if (!size.ok()) return Fail(size.status());
  Result<uint64_t> exchange_bytes = ParseSize(o.exchange_bytes);
  if (!exchange_bytes.ok()) return Fail(exchange_bytes.status().WithContext("--exchange-bytes"));
  const std::string save_text =
      o.save_layout.empty() ? "tp" + std::to_string(o.ranks) : o.save_layout;
  const std::string reshard_text =
      o.reshard_layout.empty() ? DefaultReshardLayout(o.ranks) : o.reshard_layout;
  Result<Layout> save_layout = ParseLayout(save_text);
  if (!save_layout.ok()) return Fail(save_layout.status());
  Result<Layout> reshard_layout = ParseLayout(reshard_text);
  if (!reshard_layout.ok()) return Fail(reshard_layout.status());
  for (const Layout* l : {&*save_layout, &*reshard_layout}) {
    if (l->ranks() != o.ranks) {
      return Fail(InvalidArgument("bench io: layout " + l->ToString() + " has " +
                                  std::to_string(l->ranks()) + " ranks, --ranks is " +
                                  std::to_string(o.ranks)));
    }
  }
  const bool on_storage = !o.storage.empty();
  if (on_storage && (o.sync || o.drop_caches)) {
    return Fail(InvalidArgument(
        "bench io --storage " + o.storage +
        ": --sync and --drop-caches apply to a local --dir (an object store's completed "
        "writes are durable, and it has no page cache here)"));
  }
  // The storage the run's files go to, one per process (the ranks of LocalComm share it).
  std::shared_ptr<Storage> storage;
  std::string storage_base;
  if (on_storage) {
    Result<std::pair<std::shared_ptr<Storage>, std::string>> opened = OpenStorage(o.storage);
    if (!opened.ok()) return Fail(opened.status().WithContext("bench io --storage"));
    std::tie(storage, storage_base) = *opened;
  }
  if (o.drop_caches && !DropPageCache()) {
    return Fail(FailedPrecondition(std::string("bench io --drop-caches: cannot write ") +
                                   kDropCachesPath + ": " + std::strerror(errno) +
                                   " (it needs root)"));
  }
  const ModelConfig config = ModelConfig::ForBytes(*size);

  SaveOptions save_options;
  save_options.num_io_threads = o.io_threads;
  save_options.sync = o.sync ? SyncPolicy::kFull : SyncPolicy::kNone;
  save_options.format =
      o.format == "torch_dist" ? CheckpointFormat::kTorchDist : CheckpointFormat::kTessera;
  if (save_options.format == CheckpointFormat::kTorchDist) {
    save_options.format_options =
        TorchDistOptions{.flavor = o.torch_dist_flavor == "1.13" ? TorchDistFlavor::kTorch113
                                                                 : TorchDistFlavor::kTorch2};
  }
  save_options.storage = storage;  // null: the local file system
  LoadOptions load_options;
  load_options.storage = storage;
  load_options.num_io_threads = o.io_threads;
  load_options.verify_checksums = o.verify_checksums;
  load_options.read_sharing = o.share_reads == "none"       ? ReadSharing::kNone
                              : o.share_reads == "readonce" ? ReadSharing::kReadOnce
                                                            : ReadSharing::kAuto;
  load_options.exchange_bytes = *exchange_bytes;

  Results res;
  res.written_per_rank.assign(o.ranks, 0);
  res.raw_per_rank.assign(o.ranks, 0);
  res.save_held.assign(o.ranks, 0);
  res.load_held.assign(o.ranks, 0);
  res.reshard_held.assign(o.ranks, 0);

  std::string run_dir;
  Status status = (*runner)->Run(o.ranks, [&](Comm& comm, bool) -> Status {
    const int rank = comm.rank();
    const bool lead = rank == 0;
    // A fresh directory for this run, made by rank 0 and shared with the others (under MPI
    // they are other processes), removed at the end whatever happens.
    Bytes dir_message;
    if (lead) {
      Status made;
      std::string made_dir;
      if (on_storage) {
        made_dir = JoinPath(storage_base, NewBenchRunName());  // a prefix: nothing to create
      } else {
        made_dir = o.dir + "/tessera-bench-io-XXXXXX";
        if (::mkdtemp(made_dir.data()) == nullptr) {
          made = IOErrorFromErrno("creating a directory in " + o.dir + " (--dir)", errno);
        }
      }
      dir_message = Seal(made, Bytes(made_dir.begin(), made_dir.end()));
    }
    TESSERA_RETURN_IF_ERROR(comm.Broadcast(&dir_message, 0));
    TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> dir_bytes, Open(dir_message, "rank 0"));
    const std::string run_dir_here(dir_bytes.begin(), dir_bytes.end());
    if (lead) run_dir = run_dir_here;
    // Removes a directory of the run and what it holds (rank 0), outside any timing.
    auto remove_tree = [&](const std::string& dir) {
      if (on_storage) {
        RemoveStorageTree(*storage, dir).IgnoreError();
      } else {
        std::error_code ignored;
        std::filesystem::remove_all(dir, ignored);
      }
    };
    struct Cleanup {
      std::function<void()> remove;
      ~Cleanup() { remove(); }
    } cleanup{[&, lead] {
      if (lead) remove_tree(run_dir_here);
    }};
    // The local directory, for syncfs between phases (none on a storage).
    const int run_dir_fd =
        on_storage ? -1 : ::open(run_dir_here.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (!on_storage && run_dir_fd < 0) return IOErrorFromErrno("open " + run_dir_here, errno);
    struct CloseFd {
      int fd;
      ~CloseFd() {
        if (fd >= 0) ::close(fd);
      }
    } close_fd{run_dir_fd};
    // This rank's figures; summed over the ranks at the end.
    uint64_t written = 0, load_read = 0, load_needed = 0, reshard_read = 0, reshard_needed = 0;
    uint64_t load_calls = 0, reshard_calls = 0;
    uint64_t reshard_union = 0, reshard_exchanged = 0, checkpoint_bytes = 0;
    bool reshard_read_once = false;
    RankState saved = BuildRankState(config, *save_layout, rank, /*fill=*/true);
    RankState loaded = BuildRankState(config, *save_layout, rank, /*fill=*/false);
    RankState resharded = BuildRankState(config, *reshard_layout, rank, /*fill=*/false);
    for (const RankState* s : {&saved, &loaded, &resharded}) TouchPages(*s);
    // Every rank's state is resident before rank 0 takes the first RSS reading: else the first
    // phase's *_extra_rss_bytes would count the other ranks' pages as they are touched.
    TESSERA_RETURN_IF_ERROR(comm.Barrier());

    // Times `body` on rank 0 from a barrier before it to a barrier after it.
    auto timed = [&](Phase phase, const std::function<Status()>& body) -> Status {
      uint64_t rss_before = 0;
      if (lead) {
        if ((o.flush || o.drop_caches) && run_dir_fd >= 0) ::syncfs(run_dir_fd);
        // Checked to work before the first phase (RunBenchIo): a failure here is not expected.
        if (o.drop_caches && (phase == kLoad || phase == kRawRead || phase == kReshard)) {
          DropPageCache();
        }
        res.process_peak_rss = std::max(res.process_peak_rss, ProcStatusBytes("VmHWM"));
        res.rss_tracked = res.rss_tracked && ResetPeakRss();
        rss_before = ProcStatusBytes("VmRSS");
      }
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      const Clock::time_point start = Clock::now();
      TESSERA_RETURN_IF_ERROR_CTX(body(), kPhaseNames[phase]);
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      if (lead) {
        res.seconds[phase].push_back(std::chrono::duration<double>(Clock::now() - start).count());
        const uint64_t peak = ProcStatusBytes("VmHWM");
        res.process_peak_rss = std::max(res.process_peak_rss, peak);
        if (peak > rss_before)
          res.extra_rss[phase] = std::max(res.extra_rss[phase], peak - rss_before);
      }
      return Status::Ok();
    };

    std::vector<Segment> raw_source, raw_destination;
    for (int k = 0; k < o.warmup + o.repeat; ++k) {
      const std::string ckpt = run_dir_here + "/ckpt-" + std::to_string(k);
      const std::string raw = run_dir_here + "/raw-" + std::to_string(k);
      const std::string raw_streamed = raw + "-streamed";
      for (const std::string& dir : {raw, raw_streamed}) {
        if (lead && !on_storage && ::mkdir(dir.c_str(), 0755) != 0) {
          return IOErrorFromErrno("mkdir " + dir, errno);
        }
      }
      auto save = [&]() -> Status {
        return timed(kSave, [&]() -> Status {
          TESSERA_ASSIGN_OR_RETURN(SaveReport report, Save(saved.dict, ckpt, comm, save_options));
          written = report.bytes_written;
          if (lead) res.total_bytes = report.total_bytes;
          if (lead) res.files_per_rank = report.files_written;
          if (lead) res.plan_cache_hits.push_back(report.plan_cache_hit);
          return Status::Ok();
        });
      };
      auto raw_write = [&](Phase phase) -> Status {
        const bool streamed = phase == kRawWriteStreamed;
        const std::string& dir = streamed ? raw_streamed : raw;
        return timed(phase, [&]() -> Status {
          auto parts = SplitSegments(raw_source, o.io_threads);
          TESSERA_RETURN_IF_ERROR(RunThreads(o.io_threads, [&](int t) {
            return on_storage ? StorageRawWrite(*storage, RawFile(dir, rank, t), parts[t])
                              : RawWriteFile(RawFile(dir, rank, t), parts[t], o.sync, streamed);
          }));
          if (!o.sync) return Status::Ok();
          TESSERA_RETURN_IF_ERROR(comm.Barrier());  // every file written before the dir syncs
          if (lead) TESSERA_RETURN_IF_ERROR(SyncPath(dir));
          if (lead) TESSERA_RETURN_IF_ERROR(SyncPath(run_dir_here));
          return Status::Ok();
        });
      };
      auto load = [&](Phase phase, RankState& state) -> Status {
        return timed(phase, [&]() -> Status {
          TESSERA_ASSIGN_OR_RETURN(LoadReport report, Load(state.dict, ckpt, comm, load_options));
          if (k == 0) {
            (phase == kLoad ? load_read : reshard_read) = report.bytes_read;
            (phase == kLoad ? load_needed : reshard_needed) = report.bytes_needed;
            (phase == kLoad ? load_calls : reshard_calls) = report.read_calls;
            if (phase == kReshard && comm.rank() == 0) {  // the same on every rank
              reshard_union = report.job_bytes_needed;
              reshard_exchanged = report.job_bytes_exchanged;
              checkpoint_bytes = report.checkpoint_bytes;
              reshard_read_once = report.read_sharing == ReadSharing::kReadOnce;
            }
          }
          return Status::Ok();
        });
      };
      auto raw_read = [&]() -> Status {
        return timed(kRawRead, [&]() -> Status {
          auto parts = SplitSegments(raw_destination, o.io_threads);
          return RunThreads(o.io_threads, [&](int t) {
            return on_storage ? StorageRawRead(*storage, RawFile(raw, rank, t), parts[t])
                              : RawReadFile(RawFile(raw, rank, t), parts[t]);
          });
        });
      };
      // The raw baseline writes exactly the payload bytes this rank's save writes; it needs
      // one save to know them.
      if (k % 2 == 0) TESSERA_RETURN_IF_ERROR(save());
      if (k == 0) {
        raw_source = StateSegments(saved, written);
        raw_destination = StateSegments(loaded, written);
      }
      if (o.sync && k % 2 == 1) TESSERA_RETURN_IF_ERROR(raw_write(kRawWriteStreamed));
      TESSERA_RETURN_IF_ERROR(raw_write(kRawWrite));
      if (o.sync && k % 2 == 0) TESSERA_RETURN_IF_ERROR(raw_write(kRawWriteStreamed));
      if (k % 2 == 1) TESSERA_RETURN_IF_ERROR(save());
      if (o.save_only) {
        // No read phase: the next repeat starts from an empty directory all the same.
      } else if (k % 2 == 0) {
        TESSERA_RETURN_IF_ERROR(load(kLoad, loaded));
        if (k == 0 && o.check) {
          TESSERA_RETURN_IF_ERROR(
              AgreeOnStatus(comm, CheckRankState(loaded).WithContext("checking the load")));
        }
        TESSERA_RETURN_IF_ERROR(raw_read());
      } else {
        TESSERA_RETURN_IF_ERROR(raw_read());
        TESSERA_RETURN_IF_ERROR(load(kLoad, loaded));
      }
      if (!o.save_only) TESSERA_RETURN_IF_ERROR(load(kReshard, resharded));
      if (k == 0 && o.check && !o.save_only) {
        TESSERA_RETURN_IF_ERROR(
            AgreeOnStatus(comm, CheckRankState(resharded).WithContext("checking the reshard")));
        if (lead) res.checked = true;
      }
      TESSERA_RETURN_IF_ERROR(comm.Barrier());
      if (lead) {  // outside any timing: the next repeat starts from an empty directory
        for (const std::string& dir : {ckpt, raw, raw_streamed}) remove_tree(dir);
      }
    }
    // Per-rank figures, each rank filling its own slots, summed; peak memory, the largest.
    const int n = o.ranks;
    std::vector<int64_t> totals(5 * n + 10, 0);
    totals[5 * n + 8] = static_cast<int64_t>(load_calls);
    totals[5 * n + 9] = static_cast<int64_t>(reshard_calls);
    totals[5 * n + 7] = reshard_read_once ? 1 : 0;
    totals[5 * n + 4] = static_cast<int64_t>(reshard_union);
    totals[5 * n + 5] = static_cast<int64_t>(reshard_exchanged);
    totals[5 * n + 6] = static_cast<int64_t>(checkpoint_bytes);
    totals[0 * n + rank] = static_cast<int64_t>(written);
    totals[1 * n + rank] = static_cast<int64_t>(written);  // the raw baseline's bytes
    totals[2 * n + rank] = static_cast<int64_t>(saved.bytes);
    totals[3 * n + rank] = static_cast<int64_t>(loaded.bytes);
    totals[4 * n + rank] = static_cast<int64_t>(resharded.bytes);
    totals[5 * n + 0] = static_cast<int64_t>(load_read);
    totals[5 * n + 1] = static_cast<int64_t>(load_needed);
    totals[5 * n + 2] = static_cast<int64_t>(reshard_read);
    totals[5 * n + 3] = static_cast<int64_t>(reshard_needed);
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(totals, ReduceOp::kSum));
    std::vector<int64_t> peak = {
        static_cast<int64_t>(std::max(MaxRssBytes(), ProcStatusBytes("VmHWM")))};
    TESSERA_RETURN_IF_ERROR(comm.AllReduce(peak, ReduceOp::kMax));
    if (lead) {
      for (int r = 0; r < n; ++r) {
        res.written_per_rank[r] = totals[0 * n + r];
        res.raw_per_rank[r] = totals[1 * n + r];
        res.save_held[r] = totals[2 * n + r];
        res.load_held[r] = totals[3 * n + r];
        res.reshard_held[r] = totals[4 * n + r];
      }
      res.load_bytes_read = totals[5 * n + 0];
      res.load_bytes_needed = totals[5 * n + 1];
      res.reshard_bytes_read = totals[5 * n + 2];
      res.load_read_calls = totals[5 * n + 8];
      res.reshard_read_calls = totals[5 * n + 9];
      res.reshard_bytes_needed = totals[5 * n + 3];
      res.reshard_union_bytes = totals[5 * n + 4];
      res.reshard_exchanged_bytes = totals[5 * n + 5];
      res.checkpoint_bytes = totals[5 * n + 6];
      res.reshard_read_once = totals[5 * n + 7] != 0;
      res.process_peak_rss = std::max<uint64_t>(res.process_peak_rss, peak[0]);
    }
    return Status::Ok();
  });
  if (!status.ok()) return Fail(status.WithContext("bench io"));
  if (!(*runner)->printer()) return 0;

  // The warm-up samples come first; the figures are the best of the others.
  std::vector<double> warmup_seconds[kNumPhases];
  for (int p = 0; p < kNumPhases; ++p) {
    std::vector<double>& samples = res.seconds[p];
    const auto warm = samples.begin() + std::min<size_t>(o.warmup, samples.size());
    warmup_seconds[p].assign(samples.begin(), warm);  // none for a phase that did not run
    samples.erase(samples.begin(), warm);
  }
  auto best = [&](Phase p) {
    return res.seconds[p].empty() ? 0.0
                                  : *std::min_element(res.seconds[p].begin(), res.seconds[p].end());
  };
  // The median sample (the upper one of an even count): less sensitive than the best to one
  // lucky or unlucky sample on a shared machine.
  auto median = [&](Phase p) {
    std::vector<double> v = res.seconds[p];
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  auto sum = [](const std::vector<uint64_t>& v) {
    uint64_t s = 0;
    for (uint64_t x : v) s += x;
    return s;
  };
  const double save_s = best(kSave), raw_write_s = best(kRawWrite), load_s = best(kLoad),
               raw_read_s = best(kRawRead), reshard_s = best(kReshard);
  const uint64_t raw_bytes = sum(res.raw_per_rank);
  const uint64_t held = sum(res.save_held) + sum(res.load_held) + sum(res.reshard_held);

  nlohmann::json out;
  out["bytes"] = res.total_bytes;
  out["requested_bytes"] = *size;
  out["ranks"] = o.ranks;  // under MPI: processes
  out["comm"] = o.comm;
  out["sync"] = o.sync;
  out["io_threads"] = o.io_threads;
  out["format"] = o.format;
  if (o.format == "torch_dist") out["torch_dist_flavor"] = o.torch_dist_flavor;
  out["save_only"] = o.save_only;
  out["repeat"] = o.repeat;
  out["warmup"] = o.warmup;
  out["verify_checksums"] = o.verify_checksums;
  out["share_reads"] = o.share_reads;
  out["exchange_bytes"] = *exchange_bytes;
  out["save_layout"] = save_layout->ToString();
  out["reshard_layout"] = reshard_layout->ToString();
  out["model"] = {{"hidden", config.hidden},
                  {"ffn", config.ffn},
                  {"vocab", config.vocab},
                  {"layers", config.layers}};
  out["save_seconds"] = save_s;
  out["raw_write_seconds"] = raw_write_s;
  out["save_over_raw"] = raw_write_s / save_s;
  if (o.sync) {
    const double streamed_s = best(kRawWriteStreamed);
    out["raw_write_streamed_seconds"] = streamed_s;
    out["save_over_raw_streamed"] = streamed_s / save_s;
    out["median_save_over_raw_streamed"] = median(kRawWriteStreamed) / median(kSave);
  }
  out["save_gb_per_s"] = res.total_bytes / save_s / 1e9;
  out["raw_write_gb_per_s"] = raw_bytes / raw_write_s / 1e9;
  out["median_save_over_raw"] = median(kRawWrite) / median(kSave);
  if (!o.save_only) {
    out["load_seconds"] = load_s;
    out["raw_read_seconds"] = raw_read_s;
    out["load_over_raw"] = raw_read_s / load_s;
    out["median_load_over_raw"] = median(kRawRead) / median(kLoad);
    out["load_gb_per_s"] = res.load_bytes_read / load_s / 1e9;
    out["raw_read_gb_per_s"] = raw_bytes / raw_read_s / 1e9;
    out["load_bytes_read"] = res.load_bytes_read;
    out["load_read_calls"] = res.load_read_calls;
    out["load_bytes_needed"] = res.load_bytes_needed;
    out["reshard_load_seconds"] = reshard_s;
    out["reshard_load_gb_per_s"] = res.reshard_bytes_read / reshard_s / 1e9;
    out["reshard_bytes_read"] = res.reshard_bytes_read;
    out["reshard_read_calls"] = res.reshard_read_calls;
    out["reshard_bytes_needed"] = res.reshard_bytes_needed;
    out["reshard_bytes_read_over_needed"] = res.reshard_bytes_needed
                                                ? static_cast<double>(res.reshard_bytes_read) /
                                                      static_cast<double>(res.reshard_bytes_needed)
                                                : 0.0;
    // Storage bytes of the whole job against the union of what its ranks needed and against
    // the checkpoint (read_sharing kReadOnce; the union is 0 with --share-reads none).
    out["reshard_union_needed_bytes"] = res.reshard_union_bytes;
    out["reshard_bytes_exchanged"] = res.reshard_exchanged_bytes;
    out["reshard_read_sharing"] = res.reshard_read_once ? "readonce" : "none";
    out["checkpoint_bytes"] = res.checkpoint_bytes;
    out["reshard_read_over_union"] = res.reshard_union_bytes
                                         ? static_cast<double>(res.reshard_bytes_read) /
                                               static_cast<double>(res.reshard_union_bytes)
                                         : 0.0;
    out["reshard_read_over_checkpoint"] = res.checkpoint_bytes
                                              ? static_cast<double>(res.reshard_bytes_read) /
                                                    static_cast<double>(res.checkpoint_bytes)
                                              : 0.0;
  }
  out["raw_bytes"] = raw_bytes;
  out["bytes_written_per_rank"] = res.written_per_rank;
  out["data_files_per_rank"] = res.files_per_rank;
  out["peak_rss_bytes"] =
      std::max(MaxRssBytes(), std::max(res.process_peak_rss, ProcStatusBytes("VmHWM")));
  out["state_bytes_held"] = held;
  out["save_state_bytes"] = sum(res.save_held);
  out["load_state_bytes"] = sum(res.load_held);
  out["reshard_state_bytes"] = sum(res.reshard_held);
  if (res.rss_tracked) {
    out["save_extra_rss_bytes"] = res.extra_rss[kSave];
    out["load_extra_rss_bytes"] = res.extra_rss[kLoad];
    out["reshard_load_extra_rss_bytes"] = res.extra_rss[kReshard];
    out["raw_read_extra_rss_bytes"] = res.extra_rss[kRawRead];
    out["raw_write_extra_rss_bytes"] = res.extra_rss[kRawWrite];
    if (o.sync) out["raw_write_streamed_extra_rss_bytes"] = res.extra_rss[kRawWriteStreamed];
  }
  nlohmann::json samples, warmup_samples;
  for (int p = 0; p < kNumPhases; ++p) {
    samples[kPhaseNames[p]] = res.seconds[p];
    warmup_samples[kPhaseNames[p]] = warmup_seconds[p];
  }
  out["samples_seconds"] = samples;
  out["warmup_samples_seconds"] = warmup_samples;
  out["save_plan_cache_hit_samples"] = res.plan_cache_hits;  // warm-up ones first
  out["phase_order"] =
      "even repeats: save, raw_write, [raw_write_streamed], load, raw_read, reshard_load; odd "
      "repeats: [raw_write_streamed], raw_write, save, raw_read, load, reshard_load";
  out["flush_between_phases"] = o.flush;
  out["page_cache_dropped_before_reads"] = o.drop_caches;
  out["checked"] = res.checked;
  if (on_storage) {
    out["storage"] = o.storage;
    out["dir"] = run_dir + " (in the storage; removed)";
  } else {
    out["dir"] = run_dir + " (removed)";
  }
  PrintJson(std::move(out));
  return 0;
}

}  // namespace

void AddBenchIoCommand(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<BenchIoOptions>();
  auto json = std::make_shared<bool>(true);
  auto no_flush = std::make_shared<bool>(false);
  auto no_check = std::make_shared<bool>(false);
  auto no_verify = std::make_shared<bool>(false);
  CLI::App* io = bench.add_subcommand(
      "io",
      "Save, load and resharded load of a synthetic state by R ranks, against raw "
      "pwrite/pread of the same bytes in the same run");
  io->add_option("--ranks", o->ranks, "ranks (threads of this process)")->capture_default_str();
  io->add_option("--size", o->size, "state size, e.g. 256MiB, 1GiB")->capture_default_str();
  io->add_flag("--sync", o->sync,
               "fdatasync every file and fsync the directory (default: page cache only)");
  io->add_option("--comm", o->comm,
                 "how ranks talk: local (threads of this process) or mpi (one rank per mpirun "
                 "process; --ranks is then the world size)")
      ->check(CLI::IsMember({"local", "mpi"}))
      ->capture_default_str();
  io->add_option("--io-threads", o->io_threads, "I/O threads (and files) per rank")
      ->capture_default_str();
  io->add_option("--repeat", o->repeat, "samples of each phase; the best is reported")
      ->capture_default_str();
  io->add_option("--warmup", o->warmup, "untimed repeats first (reported apart)")
      ->capture_default_str();
  io->add_option("--dir", o->dir, "where the run's temporary directory goes")
      ->capture_default_str();
  io->add_option("--storage", o->storage,
                 "run on a storage URI instead (s3://bucket/prefix, msc://profile/path): the "
                 "checkpoints there, and the raw baseline as objects through the same client");
  io->add_option("--save-layout", o->save_layout, "layout of the save (default tp<ranks>)");
  io->add_option("--reshard-layout", o->reshard_layout,
                 "layout of the resharded load (default tp<ranks/2>,dp2; tp1,dp<ranks> if odd)");
  io->add_flag("--no-flush", *no_flush, "do not syncfs between phases");
  io->add_flag("--drop-caches", o->drop_caches,
               "drop the page cache before every read phase, so reads come from the disk (root; "
               "under MPI, on rank 0's machine)");
  io->add_flag("--no-check", *no_check, "do not check the loaded elements");
  io->add_flag("--no-verify-checksums", *no_verify,
               "load without checking chunk checksums (LoadOptions::verify_checksums = false)");
  io->add_option("--format", o->format,
                 "what the save writes: tessera, or torch_dist (PyTorch DCP; its loads need "
                 "tessera's DCP reader)")
      ->check(CLI::IsMember({"tessera", "torch_dist"}))
      ->capture_default_str();
  io->add_option("--torch-dist-flavor", o->torch_dist_flavor,
                 "class paths of a torch_dist .metadata: 2.x or 1.13")
      ->check(CLI::IsMember({"2.x", "1.13"}))
      ->capture_default_str();
  io->add_option("--share-reads", o->share_reads,
                 "how the loads share reads: auto (readonce, but none on a local filesystem), "
                 "readonce (the job reads each block once; ranks exchange) or none (each rank "
                 "reads its own)")
      ->check(CLI::IsMember({"auto", "readonce", "none"}))
      ->capture_default_str();
  io->add_option("--exchange-bytes", o->exchange_bytes,
                 "exchange memory per rank and round of a read-once load, e.g. 16MiB "
                 "(LoadOptions::exchange_bytes)")
      ->capture_default_str();
  io->add_flag("--save-only", o->save_only,
               "only the save and raw write phases (no load, raw_read, reshard_load)");
  io->add_flag("--json", *json, "print JSON (the only output format)");
  io->callback([=] {
    // CLI11 keeps a reference to *json and writes it at parse time: the callback owns it.
    (void)json;
    o->flush = !*no_flush;
    o->check = !*no_check;
    o->verify_checksums = !*no_verify;
    *exit_code = RunBenchIo(*o);
  });
}

}  // namespace tessera::tools
