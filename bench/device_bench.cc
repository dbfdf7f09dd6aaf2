// Copies between CUDA memory and host memory: tessera's pinned staging against a plain
// cudaMemcpyAsync of the same bytes from and into one pinned buffer, in the same run. Prints
// JSON (docs/PERFORMANCE.md). Needs a CUDA GPU; scripts/gpu-check runs it.
//
//   tessera_bench_device [--bytes 4GiB] [--tensors 32] [--piece 32MiB] [--budget 1GiB]
//                        [--threads 4] [--repeat 3] [--device 0]
//
// - plain_d2h / plain_h2d: one cudaMemcpyAsync of all the bytes (one device allocation, one
//   pinned buffer as large), timed on the host to the event that follows it.
// - pool_d2h: the save path's copies (ItemSource) of the same bytes, as `tensors` tensors, into
//   the pinned pool, each piece handed to a reader that only releases it: once with a budget
//   of all the bytes (the default of a save), once with --budget (pieces recycled). Timed to
//   on_staged (every piece has left device memory), the time WaitStaged reports.
// - pool_h2d: the load path's copies (DeviceUploads) of pieces from pinned buffers into the
//   tensors, --threads readers each filling its buffers in turn (without reading storage).
// - async_save: AsyncSave (kDeferred) of the tensors into memory storage without syncs: the
//   call's blocking time, the time to WaitStaged, the time to the commit; then a Load back into
//   device memory, checked bit for bit.
// Each figure is the best of --repeat runs after one warm-up (which allocates the pool).
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/data_files.h"
#include "checkpoint/device_uploads.h"
#include "checkpoint/item_source.h"
#include "core/checksum.h"
#include "format/tessera/tessera_writer.h"
#include "plan/save_plan.h"
#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/device.h"
#include "tessera/memory_storage.h"

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point from) {
  return std::chrono::duration<double>(Clock::now() - from).count();
}

uint64_t ParseBytes(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  const std::string unit = end ? end : "";
  const uint64_t m = unit == "KiB"   ? 1ull << 10
                     : unit == "MiB" ? 1ull << 20
                     : unit == "GiB" ? 1ull << 30
                                     : 1;
  return static_cast<uint64_t>(v * m);
}

struct Args {
  uint64_t bytes = 4ull << 30;
  int tensors = 32;
  uint64_t piece = 32ull << 20;
  uint64_t budget = 1ull << 30;
  int threads = 4;
  int repeat = 3;
  int device = 0;
};

void Die(const Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "tessera_bench_device: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Must(Result<T> r, const char* what) {
  Die(r.status(), what);
  return std::move(*r);
}

struct Fixture {
  std::shared_ptr<Device> device;
  DeviceStream stream = 0;
  DeviceEvent event = 0;
  std::byte* memory = nullptr;  // device: all the tensors, back to back
  std::byte* pinned = nullptr;  // host: as large, for the plain copies
  uint64_t bytes = 0;
  std::vector<uint64_t> offsets, sizes;  // of the tensors

  StateDict State(DeviceStream on) const {
    StateDict state;
    for (size_t i = 0; i < sizes.size(); ++i) {
      char key[32];
      std::snprintf(key, sizeof(key), "t%04zu", i);
      Die(state.Add(ShardedTensor::Whole(
              key, TensorView::OnDevice(device, on, memory + offsets[i], DType::kU8,
                                        {static_cast<int64_t>(sizes[i])}))),
          "state");
    }
    return state;
  }
  void Sync() {
    Die(device->Record(event, stream), "record");
    Die(device->Synchronize(event), "sync");
  }
};

double PlainCopy(Fixture& f, bool to_host) {
  const auto t0 = Clock::now();
  Die(to_host ? f.device->CopyToHost(f.pinned, f.memory, f.bytes, f.stream)
              : f.device->CopyToDevice(f.memory, f.pinned, f.bytes, f.stream),
      "plain copy");
  f.Sync();
  return Seconds(t0);
}

// The save path's copies, each piece released by its reader as soon as it has landed.
double PoolToHost(Fixture& f, uint64_t budget, int threads, uint64_t piece) {
  const StateDict state = f.State(f.stream);
  const LocalPlan plan = Must(BuildLocalPlan(state), "plan");
  std::vector<uint32_t> items(plan.items.size());
  for (size_t i = 0; i < items.size(); ++i) items[i] = static_cast<uint32_t>(i);
  const std::vector<DataFilePlan> files =
      PlanDataFiles(plan, items, threads, {}, *NewTesseraWriter(), "bench", 0);
  DataFileWriteOptions o;
  o.num_threads = threads;
  o.device_staging.pinned_bytes = budget;
  o.device_staging.piece_bytes = piece;
  std::atomic<double> staged{0};
  const auto t0 = Clock::now();
  o.device_staging.on_staged = [&](const Status& s) {
    Die(s, "staging");
    staged = Seconds(t0);
  };
  MemoryStorage unused;
  std::atomic<uint64_t> written{0};
  Die(WriteFilesFromSource(unused, "/bench", state, plan, files, o, written,
                           [&](ItemSource& source, size_t file, uint8_t&) -> Status {
                             for (size_t k = 0; k < files[file].items.size(); ++k) {
                               const uint64_t n = plan.items[files[file].items[k]].num_bytes;
                               ItemReader reader(source, file, k, n);
                               for (uint64_t done = 0; done < n;) {
                                 TESSERA_ASSIGN_OR_RETURN(std::span<const std::byte> part,
                                                          reader.Next(n - done));
                                 done += part.size();
                               }
                             }
                             return Status::Ok();
                           }),
      "pool to host");
  return staged.load();
}

// The load path's copies: `threads` readers each fill pieces of their tensors in turn.
double PoolToDevice(Fixture& f, int threads, uint64_t piece) {
  const StateDict state = f.State(f.stream);
  Metadata metadata;
  for (const StateEntry& e : state.entries()) {
    const ShardedTensor& t = std::get<ShardedTensor>(e);
    metadata.tensors.push_back(TensorInfo{t.key, t.data.dtype, t.data.shape, {}});
  }
  DeviceStagingOptions o;
  o.piece_bytes = piece;
  const auto t0 = Clock::now();
  std::unique_ptr<DeviceUploads> uploads =
      Must(DeviceUploads::Start(state, metadata, o, threads), "uploads");
  std::vector<std::thread> readers;
  for (int r = 0; r < threads; ++r) {
    readers.emplace_back([&, r] {
      DeviceSink sink(uploads.get());
      for (size_t t = r; t < f.sizes.size(); t += threads) {
        for (uint64_t done = 0; done < f.sizes[t];) {
          const uint64_t n = std::min(piece, f.sizes[t] - done);
          Must(sink.Reserve(static_cast<uint32_t>(t), f.memory + f.offsets[t] + done, n),
               "reserve");
          done += n;
        }
      }
      Die(sink.Flush(), "flush");
    });
  }
  for (std::thread& t : readers) t.join();
  Die(uploads->Finish(), "finish");
  return Seconds(t0);
}

uint64_t DeviceChecksum(Fixture& f) {
  Die(f.device->CopyToHost(f.pinned, f.memory, f.bytes, f.stream), "copy back");
  f.Sync();
  return Checksum(f.pinned, f.bytes);
}

struct AsyncFigures {
  double blocking = 1e9, staged = 1e9, committed = 1e9, load = 1e9;
  bool exact = true;
};

void AsyncSaveAndLoad(Fixture& f, AsyncFigures& best, Comm& comm,
                      const std::shared_ptr<MemoryStorage>& storage, uint64_t piece, int threads) {
  const StateDict state = f.State(f.stream);
  AsyncSaveOptions o;
  o.staging = StagingMode::kDeferred;
  o.save.storage = storage;
  o.save.sync = SyncPolicy::kNone;
  o.save.num_io_threads = threads;
  o.save.device_staging.piece_bytes = piece;
  const auto t0 = Clock::now();
  AsyncSaveHandle h = Must(AsyncSave(state, "/bench/ckpt", comm, o), "async save");
  const double blocking = Seconds(t0);
  Die(h.WaitStaged(), "wait staged");
  const double staged = Seconds(t0);
  Die(h.Wait(), "wait");
  const double committed = Seconds(t0);
  best.blocking = std::min(best.blocking, blocking);
  best.staged = std::min(best.staged, staged);
  best.committed = std::min(best.committed, committed);
  // Load back over a cleared copy, checked bit for bit.
  const uint64_t want = DeviceChecksum(f);
  std::memset(f.pinned, 0, f.bytes);
  Die(f.device->CopyToDevice(f.memory, f.pinned, f.bytes, f.stream), "clear");
  f.Sync();
  StateDict into = f.State(f.stream);
  LoadOptions lo;
  lo.storage = storage;
  lo.num_io_threads = threads;
  lo.device_staging.piece_bytes = piece;
  const auto t1 = Clock::now();
  Must(Load(into, "/bench/ckpt", lo), "load");
  best.load = std::min(best.load, Seconds(t1));
  best.exact = best.exact && DeviceChecksum(f) == want;
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--bytes")
      a.bytes = ParseBytes(v);
    else if (k == "--tensors")
      a.tensors = std::atoi(v.c_str());
    else if (k == "--piece")
      a.piece = ParseBytes(v);
    else if (k == "--budget")
      a.budget = ParseBytes(v);
    else if (k == "--threads")
      a.threads = std::atoi(v.c_str());
    else if (k == "--repeat")
      a.repeat = std::atoi(v.c_str());
    else if (k == "--device")
      a.device = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "tessera_bench_device: unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  Fixture f;
  f.device = Must(CudaDevice(a.device), "CUDA device");
  f.stream = Must(f.device->NewStream(), "stream");
  f.event = Must(f.device->NewEvent(), "event");
  f.bytes = a.bytes;
  f.memory = static_cast<std::byte*>(Must(f.device->Allocate(f.bytes), "device memory"));
  f.pinned = static_cast<std::byte*>(Must(f.device->AllocatePinned(f.bytes), "pinned memory"));
  // Tensors of unequal sizes (multiples of 256 bytes), as a model's are.
  std::vector<uint64_t> weights;
  uint64_t total = 0;
  for (int i = 0; i < a.tensors; ++i) total += weights.emplace_back(1 + i % 7);
  uint64_t at = 0;
  for (int i = 0; i < a.tensors; ++i) {
    const uint64_t n = i + 1 == a.tensors ? f.bytes - at : f.bytes * weights[i] / total / 256 * 256;
    f.offsets.push_back(at);
    f.sizes.push_back(n);
    at += n;
  }
  for (uint64_t i = 0; i < f.bytes; i += 8) {
    const uint64_t v = i * 0x9e3779b97f4a7c15ull;
    std::memcpy(f.pinned + i, &v, std::min<uint64_t>(8, f.bytes - i));
  }
  PlainCopy(f, false);

  double plain_d2h = 1e9, plain_h2d = 1e9, pool_d2h = 1e9, pool_d2h_budget = 1e9, pool_h2d = 1e9;
  for (int r = 0; r <= a.repeat; ++r) {  // run 0 warms up
    const double d2h = PlainCopy(f, true), h2d = PlainCopy(f, false);
    const double full = PoolToHost(f, 0, a.threads, a.piece);
    const double budgeted = PoolToHost(f, a.budget, a.threads, a.piece);
    const double up = PoolToDevice(f, a.threads, a.piece);
    if (r == 0) continue;
    plain_d2h = std::min(plain_d2h, d2h);
    plain_h2d = std::min(plain_h2d, h2d);
    pool_d2h = std::min(pool_d2h, full);
    pool_d2h_budget = std::min(pool_d2h_budget, budgeted);
    pool_h2d = std::min(pool_h2d, up);
  }
  // Restore the pattern (PoolToDevice copied arbitrary pinned bytes in).
  PlainCopy(f, false);
  AsyncFigures async;
  {
    std::unique_ptr<Comm> comm = NewSingleRankComm();
    auto storage = std::make_shared<MemoryStorage>();
    for (int r = 0; r <= a.repeat; ++r) {
      AsyncFigures run;
      AsyncSaveAndLoad(f, r == 0 ? run : async, *comm, storage, a.piece, a.threads);
      if (r == 0) async.exact = run.exact;
    }
  }
  const double gib = static_cast<double>(f.bytes) / (1ull << 30);
  std::printf(
      "{\n"
      "  \"device\": \"%s\",\n"
      "  \"bytes\": %llu,\n  \"tensors\": %d,\n  \"piece_bytes\": %llu,\n"
      "  \"budget_bytes\": %llu,\n  \"threads\": %d,\n  \"repeat\": %d,\n"
      "  \"plain_d2h_seconds\": %.6f,\n  \"plain_d2h_gib_per_s\": %.3f,\n"
      "  \"pool_d2h_seconds\": %.6f,\n  \"pool_d2h_gib_per_s\": %.3f,\n"
      "  \"pool_d2h_rate_over_plain\": %.3f,\n"
      "  \"pool_d2h_budget_seconds\": %.6f,\n  \"pool_d2h_budget_rate_over_plain\": %.3f,\n"
      "  \"plain_h2d_seconds\": %.6f,\n  \"plain_h2d_gib_per_s\": %.3f,\n"
      "  \"pool_h2d_seconds\": %.6f,\n  \"pool_h2d_gib_per_s\": %.3f,\n"
      "  \"pool_h2d_rate_over_plain\": %.3f,\n"
      "  \"async_save_blocking_seconds\": %.6f,\n"
      "  \"async_save_blocking_over_plain_d2h\": %.4f,\n"
      "  \"async_save_wait_staged_seconds\": %.6f,\n"
      "  \"async_save_committed_seconds\": %.6f,\n"
      "  \"load_seconds\": %.6f,\n  \"load_bit_exact\": %s,\n"
      "  \"synced\": false\n"
      "}\n",
      f.device->name().c_str(), static_cast<unsigned long long>(f.bytes), a.tensors,
      static_cast<unsigned long long>(a.piece), static_cast<unsigned long long>(a.budget),
      a.threads, a.repeat, plain_d2h, gib / plain_d2h, pool_d2h, gib / pool_d2h,
      plain_d2h / pool_d2h, pool_d2h_budget, plain_d2h / pool_d2h_budget, plain_h2d,
      gib / plain_h2d, pool_h2d, gib / pool_h2d, plain_h2d / pool_h2d, async.blocking,
      async.blocking / plain_d2h, async.staged, async.committed, async.load,
      async.exact ? "true" : "false");
  f.device->FreePinned(f.pinned);
  f.device->Free(f.memory);
  return async.exact ? 0 : 1;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) { return tessera::Main(argc, argv); }
