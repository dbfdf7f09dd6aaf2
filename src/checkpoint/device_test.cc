// Saves from and loads into device memory, against the simulated device (device/
// simulated_device.h): its memory is a separate address space, so any byte tessera touched on
// the host instead of copying it would crash or fail these tests; its copies take time on
// streams of their own, so the overlap and the ordering are exercised as on a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "device/device_staging.h"
#include "device/simulated_device.h"
#include "format/tessera/manifest.h"
#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/fault_injecting_storage.h"
#include "tessera/local_comm.h"
#include "tessera/memory_storage.h"
#include "testing/commits.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Device memory holding known bytes.
struct DeviceBuffer {
  std::shared_ptr<SimulatedDevice> sim;
  void* ptr = nullptr;
  std::vector<uint8_t> want;  // what it holds

  DeviceBuffer(std::shared_ptr<SimulatedDevice> device, size_t bytes, uint64_t seed)
      : sim(std::move(device)), want(testing::RandomBytes(bytes, seed)) {
    ptr = sim->Allocate(bytes).value();
    EXPECT_OK(sim->Poke(ptr, want.data(), bytes));
  }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> got(want.size());
    EXPECT_OK(sim->Peek(got.data(), ptr, got.size()));
    return got;
  }
  void Clear() {
    std::vector<uint8_t> zeros(want.size(), 0);
    EXPECT_OK(sim->Poke(ptr, zeros.data(), zeros.size()));
  }
  TensorView View(DType dtype, Shape shape, DeviceStream stream) const {
    return TensorView::OnDevice(sim, stream, ptr, dtype, std::move(shape));
  }
};

class DeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sim_ = std::make_shared<SimulatedDevice>();
    stream_ = sim_->NewStream().value();
    storage_ = std::make_shared<MemoryStorage>();
  }
  SaveOptions Saving(uint64_t piece = 64 << 10, uint64_t budget = 0) const {
    SaveOptions o;
    o.storage = storage_;
    o.device_staging.piece_bytes = piece;
    o.device_staging.pinned_bytes = budget;
    return o;
  }
  LoadOptions Loading(uint64_t piece = 64 << 10, uint64_t budget = 0) const {
    LoadOptions o;
    o.storage = storage_;
    o.device_staging.piece_bytes = piece;
    o.device_staging.pinned_bytes = budget;
    return o;
  }
  // Loads key `key` (F32, `n` elements) whole into host memory.
  std::vector<uint8_t> LoadToHost(const std::string& path, const std::string& key, size_t bytes,
                                  DType dtype = DType::kU8) {
    std::vector<uint8_t> got(bytes);
    StateDict s;
    EXPECT_OK(s.Add(ShardedTensor::Whole(
        key, TensorView(got.data(), dtype, {static_cast<int64_t>(bytes / DTypeSize(dtype))}))));
    LoadOptions o;
    o.storage = storage_;
    o.unexpected_keys = KeyPolicy::kSkip;
    EXPECT_OK(Load(s, path, o));
    return got;
  }

  std::shared_ptr<SimulatedDevice> sim_;
  DeviceStream stream_ = 0;
  std::shared_ptr<MemoryStorage> storage_;
};

// Sizes around the piece size (64 KiB): empty, tiny, one short of a piece, pieces and a bit.
const std::vector<size_t> kSizes = {0, 3, 65535, 65536, 3 * 65536 + 17, 1 << 20};

TEST_F(DeviceTest, SaveFromDeviceWithABudgetSmallerThanTheState) {
  std::vector<DeviceBuffer> buffers;
  for (size_t i = 0; i < kSizes.size(); ++i) buffers.emplace_back(sim_, kSizes[i], 100 + i);
  std::vector<uint8_t> host = testing::RandomBytes(5000, 9);
  StateDict state;
  for (size_t i = 0; i < buffers.size(); ++i) {
    ASSERT_OK(state.Add(ShardedTensor::Whole(
        "d" + std::to_string(i),
        buffers[i].View(DType::kU8, {static_cast<int64_t>(kSizes[i])}, stream_))));
  }
  ASSERT_OK(state.Add(ShardedTensor::Whole("h", TensorView(host.data(), DType::kU8, {5000}))));
  ASSERT_OK(state.Add(ShardedObject{"o", {1, 2, 3}}));
  for (int threads : {1, 3}) {
    // 3 pieces of pinned memory for about 22 pieces of device bytes.
    SaveOptions o = Saving(64 << 10, 3 * (64 << 10));
    o.num_io_threads = threads;
    std::atomic<int> staged_calls{0};
    o.device_staging.on_staged = [&](const Status& s) {
      EXPECT_OK(s);
      ++staged_calls;
    };
    const std::string path = "/mem/budget" + std::to_string(threads);
    ASSERT_OK_AND_ASSIGN(SaveReport report, Save(state, path, o));
    EXPECT_EQ(staged_calls.load(), 1);
    EXPECT_LE(sim_->stats().pinned_bytes, 3u * (64 << 10));
    for (size_t i = 0; i < buffers.size(); ++i) {
      EXPECT_EQ(LoadToHost(path, "d" + std::to_string(i), kSizes[i]), buffers[i].want) << i;
    }
    EXPECT_EQ(LoadToHost(path, "h", 5000), host);
    ASSERT_OK_AND_ASSIGN(VerifyReport verified, Verify(path, storage_));
    EXPECT_GT(verified.bytes_checked, 0u);
  }
  // Only device bytes crossed, each once per save.
  size_t device_bytes = 0;
  for (size_t n : kSizes) device_bytes += n;
  EXPECT_EQ(sim_->stats().bytes_to_host, 2 * device_bytes);
}

TEST_F(DeviceTest, SaveWaitsForTheCallersStream) {
  DeviceBuffer t(sim_, 1 << 18, 1);
  // The caller's last kernel, still running when Save is called, writes new values.
  const std::vector<uint8_t> next = testing::RandomBytes(1 << 18, 2);
  ASSERT_OK(sim_->Launch(stream_, std::chrono::milliseconds(30),
                         [&] { ASSERT_OK(sim_->Poke(t.ptr, next.data(), next.size())); }));
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("t", t.View(DType::kU8, {1 << 18}, stream_))));
  ASSERT_OK(Save(state, "/mem/ordered", Saving()));
  EXPECT_EQ(LoadToHost("/mem/ordered", "t", 1 << 18), next);
}

TEST_F(DeviceTest, TorchDistAndRankLocalSavesFromDevice) {
  DeviceBuffer t(sim_, 300000, 3);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("t", t.View(DType::kF32, {75000}, stream_))));
  SaveOptions dcp = Saving();
  dcp.format = CheckpointFormat::kTorchDist;
  ASSERT_OK(Save(state, "/mem/dcp", dcp));
  EXPECT_EQ(LoadToHost("/mem/dcp", "t", 300000, DType::kF32), t.want);
  SaveOptions local = Saving(64 << 10, 64 << 10);
  local.collective = false;
  local.save_tag = "step-1";
  ASSERT_OK(Save(state, "/mem/local", local));
  EXPECT_EQ(LoadToHost("/mem/local", "t", 300000, DType::kF32), t.want);
}

TEST_F(DeviceTest, OnlyTheWritersReplicasLeaveTheDevice) {
  // Two ranks hold the same replicated tensor; only the main replica's rank copies it.
  std::vector<std::shared_ptr<SimulatedDevice>> sims = {std::make_shared<SimulatedDevice>("a"),
                                                        std::make_shared<SimulatedDevice>("b")};
  std::vector<DeviceBuffer> t = {DeviceBuffer(sims[0], 200000, 5),
                                 DeviceBuffer(sims[1], 200000, 5)};
  ASSERT_OK(FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
    const int r = comm.rank();
    StateDict state;
    TESSERA_ASSIGN_OR_RETURN(DeviceStream s, sims[r]->NewStream());
    TESSERA_RETURN_IF_ERROR(state.Add(
        ShardedTensor::Shard("t", t[r].View(DType::kU8, {200000}, s), {200000}, {0}, {r})));
    return Save(state, "/mem/replicas", comm, Saving()).status();
  })));
  EXPECT_EQ(sims[0]->stats().bytes_to_host, 200000u);
  EXPECT_EQ(sims[1]->stats().bytes_to_host, 0u);
  EXPECT_EQ(LoadToHost("/mem/replicas", "t", 200000), t[0].want);
}

TEST_F(DeviceTest, FailedCopyFailsTheSaveAndLeavesNoCheckpoint) {
  DeviceBuffer t(sim_, 1 << 20, 7);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("t", t.View(DType::kU8, {1 << 20}, stream_))));
  for (auto mode :
       {SimulatedDevice::FaultMode::kWhenQueued, SimulatedDevice::FaultMode::kWhenRun}) {
    sim_->FailCopy(5, mode);
    Status staged;
    SaveOptions o = Saving(64 << 10, 4 * (64 << 10));
    o.device_staging.on_staged = [&](const Status& s) { staged = s; };
    Result<SaveReport> saved = Save(state, "/mem/failed", o);
    ASSERT_FALSE(saved.ok());
    EXPECT_THAT(saved.status().message(), HasSubstr("injected failure"));
    EXPECT_THAT(saved.status().message(), HasSubstr("key 't'"));
    EXPECT_FALSE(staged.ok());
    EXPECT_FALSE(ReadMetadata("/mem/failed", storage_).ok());
    ASSERT_OK_AND_ASSIGN(std::vector<std::string> left, storage_->ListDir("/mem/failed"));
    EXPECT_THAT(left, ::testing::IsEmpty());
  }
  // The device and the pool are fine afterwards.
  ASSERT_OK(Save(state, "/mem/failed", Saving(64 << 10, 4 * (64 << 10))));
  EXPECT_EQ(LoadToHost("/mem/failed", "t", 1 << 20), t.want);
}

TEST_F(DeviceTest, HostMemoryPassedAsDeviceMemoryFailsNamingTheKey) {
  std::vector<uint8_t> host(1000, 1);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole(
      "wrong", TensorView::OnDevice(sim_, stream_, host.data(), DType::kU8, {1000}))));
  Result<SaveReport> saved = Save(state, "/mem/wrong", Saving());
  ASSERT_FALSE(saved.ok());
  EXPECT_THAT(saved.status().message(), HasSubstr("key 'wrong'"));
  EXPECT_THAT(saved.status().message(), HasSubstr("host memory passed as device memory"));
  // Loading into it fails too, and leaves the host bytes alone.
  ASSERT_OK(state.Add(ShardedTensor::Whole("h", TensorView(host.data(), DType::kU8, {1000}))));
  StateDict plain;
  ASSERT_OK(plain.Add(ShardedTensor::Whole("wrong", TensorView(host.data(), DType::kU8, {1000}))));
  ASSERT_OK(Save(plain, "/mem/plain", Saving()));
  StateDict into;
  ASSERT_OK(into.Add(ShardedTensor::Whole(
      "wrong", TensorView::OnDevice(sim_, stream_, host.data(), DType::kU8, {1000}))));
  Result<LoadReport> loaded = Load(into, "/mem/plain", Loading());
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(loaded.status().message(), HasSubstr("host memory passed as device memory"));
}

TEST_F(DeviceTest, LoadIntoDeviceMemoryResharded) {
  // A [64, 1000] F32 tensor saved whole from host memory, loaded into device memory in other
  // boxes.
  const int64_t rows = 64, cols = 1000;
  std::vector<float> whole(rows * cols);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i) * 0.5f;
  StateDict saved;
  ASSERT_OK(
      saved.Add(ShardedTensor::Whole("w", TensorView(whole.data(), DType::kF32, {rows, cols}))));
  ASSERT_OK(Save(saved, "/mem/reshard", Saving()));
  struct Case {
    Box box;
    std::optional<FlatRange> flat;
  };
  const std::vector<Case> cases = {
      {Box({0, 0}, {rows, cols}), std::nullopt},        // whole
      {Box({5, 0}, {30, cols}), std::nullopt},          // rows
      {Box({3, 100}, {20, 333}), std::nullopt},         // a sub-box: a run per row
      {Box({8, 0}, {16, cols}), FlatRange{777, 9999}},  // a distributed optimizer's shard
  };
  for (uint64_t budget : {uint64_t{0}, uint64_t{64 << 10}}) {
    for (const Case& c : cases) {
      const int64_t n = c.flat ? c.flat->end - c.flat->begin : c.box.NumElements();
      DeviceBuffer dst(sim_, n * 4, 11);
      dst.Clear();
      StateDict state;
      ShardedTensor t =
          c.flat ? ShardedTensor::FlatShard("w", dst.View(DType::kF32, {n}, stream_), {rows, cols},
                                            c.box.offsets, c.box.sizes, c.flat->begin)
                 : ShardedTensor::Shard("w", dst.View(DType::kF32, c.box.sizes.ToVector(), stream_),
                                        {rows, cols}, c.box.offsets);
      ASSERT_OK(state.Add(std::move(t)));
      ASSERT_OK(Load(state, "/mem/reshard", Loading(64 << 10, budget)));
      std::vector<float> want;
      for (int64_t i = 0; i < c.box.sizes[0]; ++i) {
        for (int64_t j = 0; j < c.box.sizes[1]; ++j) {
          want.push_back(whole[(c.box.offsets[0] + i) * cols + c.box.offsets[1] + j]);
        }
      }
      if (c.flat)
        want = std::vector<float>(want.begin() + c.flat->begin, want.begin() + c.flat->end);
      std::vector<uint8_t> got = dst.Read();
      ASSERT_EQ(got.size(), want.size() * 4);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << c.box.ToString();
    }
  }
  EXPECT_LE(sim_->stats().pinned_bytes, 6u * (64 << 10));  // the pool, not the tensors
}

TEST_F(DeviceTest, LoadIntoDeviceConvertsAndOrdersTheCallersStream) {
  std::vector<float> values(10000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 1.0f + static_cast<float>(i);
  StateDict saved;
  ASSERT_OK(saved.Add(ShardedTensor::Whole("v", TensorView(values.data(), DType::kF32, {10000}))));
  ASSERT_OK(Save(saved, "/mem/cast", Saving()));
  DeviceBuffer dst(sim_, 10000 * 8, 1);
  // The caller's earlier kernel writes the tensor; the load must land after it.
  std::vector<uint8_t> junk(10000 * 8, 0xEE);
  ASSERT_OK(sim_->Launch(stream_, std::chrono::milliseconds(30),
                         [&] { ASSERT_OK(sim_->Poke(dst.ptr, junk.data(), junk.size())); }));
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("v", dst.View(DType::kF64, {10000}, stream_))));
  LoadOptions o = Loading(4096);  // converted parts of 512 elements
  o.cast_dtypes = true;
  ASSERT_OK(Load(state, "/mem/cast", o));
  // And the caller's later work sees the loaded values: a kernel queued after Load reads them.
  std::vector<double> seen(10000);
  ASSERT_OK(sim_->Launch(stream_, std::chrono::microseconds(0),
                         [&] { ASSERT_OK(sim_->Peek(seen.data(), dst.ptr, 80000)); }));
  ASSERT_OK_AND_ASSIGN(DeviceEvent e, sim_->NewEvent());
  ASSERT_OK(sim_->Record(e, stream_));
  ASSERT_OK(sim_->Synchronize(e));
  for (size_t i = 0; i < values.size(); ++i)
    ASSERT_EQ(seen[i], static_cast<double>(values[i])) << i;
}

TEST_F(DeviceTest, FailedCopyToTheDeviceFailsTheLoad) {
  std::vector<uint8_t> bytes = testing::RandomBytes(1 << 20, 23);
  StateDict saved;
  ASSERT_OK(saved.Add(ShardedTensor::Whole("x", TensorView(bytes.data(), DType::kU8, {1 << 20}))));
  ASSERT_OK(Save(saved, "/mem/load_failed", Saving()));
  DeviceBuffer dst(sim_, 1 << 20, 24);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("x", dst.View(DType::kU8, {1 << 20}, stream_))));
  for (auto mode :
       {SimulatedDevice::FaultMode::kWhenQueued, SimulatedDevice::FaultMode::kWhenRun}) {
    sim_->FailCopy(3, mode);
    Result<LoadReport> loaded = Load(state, "/mem/load_failed", Loading(64 << 10, 2 * (64 << 10)));
    ASSERT_FALSE(loaded.ok());
    EXPECT_THAT(loaded.status().message(), HasSubstr("injected failure"));
  }
  const uint64_t pinned = sim_->stats().pinned_bytes;
  ASSERT_OK(Load(state, "/mem/load_failed", Loading(64 << 10, 2 * (64 << 10))));
  EXPECT_EQ(dst.Read(), bytes);
  EXPECT_EQ(sim_->stats().pinned_bytes, pinned);  // the failed loads gave their buffers back
}

TEST_F(DeviceTest, ReadSharingIntoDeviceMemory) {
  std::vector<uint8_t> bytes = testing::RandomBytes(3 << 20, 21);
  StateDict saved;
  ASSERT_OK(saved.Add(ShardedTensor::Whole("x", TensorView(bytes.data(), DType::kU8, {3 << 20}))));
  ASSERT_OK(Save(saved, "/mem/shared", Saving()));
  for (ReadSharing sharing :
       {ReadSharing::kAllGather, ReadSharing::kBroadcast, ReadSharing::kReadOnce}) {
    std::vector<std::shared_ptr<SimulatedDevice>> sims;
    for (int r = 0; r < 3; ++r)
      sims.push_back(std::make_shared<SimulatedDevice>("sim:" + std::to_string(r)));
    std::vector<DeviceBuffer> dst;
    for (int r = 0; r < 3; ++r) {
      dst.emplace_back(sims[r], 3 << 20, 40 + r);
      dst.back().Clear();
    }
    std::vector<LoadReport> reports(3);
    ASSERT_OK(FirstError(RunLocalRanks(3, [&](Comm& comm) -> Status {
      const int r = comm.rank();
      TESSERA_ASSIGN_OR_RETURN(DeviceStream s, sims[r]->NewStream());
      StateDict state;
      TESSERA_RETURN_IF_ERROR(
          state.Add(ShardedTensor::Whole("x", dst[r].View(DType::kU8, {3 << 20}, s))));
      LoadOptions o = Loading(256 << 10);
      o.read_sharing = sharing;
      o.exchange_bytes = 1 << 20;
      TESSERA_ASSIGN_OR_RETURN(reports[r], Load(state, "/mem/shared", comm, o));
      return Status::Ok();
    })));
    uint64_t read = 0;
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(dst[r].Read(), bytes) << r;
      read += reports[r].bytes_read;
    }
    EXPECT_LT(read, 2u * (3 << 20) + (1 << 20));  // about one read of it between the three
  }
}

TEST_F(DeviceTest, PermutedChunkIntoDeviceMemory) {
  // M is 4 x 6 stored transposed (ChunkInfo::storage_order {1, 0}).
  std::vector<float> transposed(24);
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 6; ++j) transposed[j * 4 + i] = 10.0f * i + j;
  }
  StateDict saved;
  ASSERT_OK(
      saved.Add(ShardedTensor::Whole("m", TensorView(transposed.data(), DType::kF32, {6, 4}))));
  ASSERT_OK(Save(saved, "/mem/perm", Saving()));
  ASSERT_OK_AND_ASSIGN(Metadata m, ReadMetadata("/mem/perm", storage_));
  m.tensors[0].global_shape = {4, 6};
  m.tensors[0].chunks[0].box = Box({0, 0}, {4, 6});
  m.tensors[0].chunks[0].storage_order = {1, 0};
  const Bytes manifest = EncodeManifest(m);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> out,
                       storage_->NewWritableFile(testing::CommitPath(*storage_, "/mem/perm"),
                                                 CreateMode::kTruncate));
  ASSERT_OK(out->WriteAt(0, manifest.data(), manifest.size()));
  ASSERT_OK(out->Close());
  for (const Box& box : {Box({0, 0}, {4, 6}), Box({1, 2}, {2, 3})}) {
    DeviceBuffer dst(sim_, box.NumElements() * 4, 3);
    StateDict state;
    ASSERT_OK(state.Add(ShardedTensor::Shard(
        "m", dst.View(DType::kF32, box.sizes.ToVector(), stream_), {4, 6}, box.offsets)));
    ASSERT_OK(Load(state, "/mem/perm", Loading(4096)));
    std::vector<float> want;
    for (int64_t i = 0; i < box.sizes[0]; ++i) {
      for (int64_t j = 0; j < box.sizes[1]; ++j) {
        want.push_back(10.0f * (box.offsets[0] + i) + (box.offsets[1] + j));
      }
    }
    std::vector<uint8_t> got = dst.Read();
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << box.ToString();
  }
}

// ---- AsyncSave ----

AsyncSaveOptions Deferred(const SaveOptions& save) {
  AsyncSaveOptions o;
  o.save = save;
  o.staging = StagingMode::kDeferred;
  return o;
}

TEST_F(DeviceTest, DeferredAsyncSaveReturnsAtOnceAndTheCallerMayFreeAfterWaitStaged) {
  auto t = std::make_unique<DeviceBuffer>(sim_, 1 << 20, 31);
  std::vector<uint8_t> host = testing::RandomBytes(1000, 32);
  // The caller's backward pass is still running when it saves: the copies wait for it.
  const std::vector<uint8_t> next = testing::RandomBytes(1 << 20, 33);
  std::atomic<bool> kernel_done{false};
  ASSERT_OK(sim_->Launch(stream_, std::chrono::milliseconds(300), [&] {
    ASSERT_OK(sim_->Poke(t->ptr, next.data(), next.size()));
    kernel_done = true;
  }));
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("t", t->View(DType::kU8, {1 << 20}, stream_))));
  ASSERT_OK(state.Add(ShardedTensor::Whole("h", TensorView(host.data(), DType::kU8, {1000}))));
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  // Pinned memory for 2 of the 16 pieces: pieces are reused as soon as they are written.
  ASSERT_OK_AND_ASSIGN(AsyncSaveHandle h, AsyncSave(state, "/mem/async", *comm,
                                                    Deferred(Saving(64 << 10, 128 << 10))));
  EXPECT_FALSE(kernel_done.load());  // returned without waiting for the device
  EXPECT_FALSE(h.Staged());
  ASSERT_OK(h.WaitStaged());
  EXPECT_TRUE(kernel_done.load());
  EXPECT_TRUE(h.Staged());
  // Nothing reads the tensor any more: freeing it (a copy from freed memory would fail) and
  // changing the host tensor do not touch the checkpoint.
  sim_->Free(t->ptr);
  std::fill(host.begin(), host.end(), 0);
  ASSERT_OK(h.Wait());
  EXPECT_EQ(LoadToHost("/mem/async", "t", 1 << 20), next);
  EXPECT_EQ(LoadToHost("/mem/async", "h", 1000), testing::RandomBytes(1000, 32));
}

TEST_F(DeviceTest, BlockingAsyncSaveCopiesDeviceTensorsBeforeReturning) {
  DeviceBuffer t(sim_, 500000, 41);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("t", t.View(DType::kU8, {500000}, stream_))));
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  AsyncSaveOptions o;
  o.save = Saving(64 << 10, 64 << 10);
  ASSERT_OK_AND_ASSIGN(AsyncSaveHandle h, AsyncSave(state, "/mem/blocking", *comm, o));
  EXPECT_TRUE(h.Staged());
  t.Clear();  // allowed once AsyncSave returned
  ASSERT_OK(h.Wait());
  EXPECT_EQ(LoadToHost("/mem/blocking", "t", 500000), t.want);
}

TEST_F(DeviceTest, MemoryStaysFlatOverManySaves) {
  std::vector<DeviceBuffer> buffers;
  for (int i = 0; i < 3; ++i) buffers.emplace_back(sim_, 100000 + 7 * i, 50 + i);
  StateDict state;
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(state.Add(ShardedTensor::Whole(
        "t" + std::to_string(i), buffers[i].View(DType::kU8, {100000 + 7 * i}, stream_))));
  }
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  SimulatedDevice::Stats first;
  for (int save = 0; save < 200; ++save) {
    // A budget smaller than the state on odd saves, the whole state on even ones.
    AsyncSaveOptions o = Deferred(Saving(64 << 10, save % 2 ? 64 << 10 : 0));
    ASSERT_OK_AND_ASSIGN(AsyncSaveHandle h, AsyncSave(state, "/mem/flat", *comm, o));
    ASSERT_OK(h.WaitStaged());
    ASSERT_OK(h.Wait());
    if (save == 1) first = sim_->stats();
  }
  const SimulatedDevice::Stats last = sim_->stats();
  EXPECT_EQ(last.pinned_allocations, first.pinned_allocations);
  EXPECT_EQ(last.pinned_bytes, first.pinned_bytes);
  EXPECT_LE(last.pinned_bytes, 6u * (64 << 10));  // 2 files: 4 + 2 pieces
  EXPECT_EQ(last.events, first.events);
  EXPECT_EQ(last.streams, first.streams);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(LoadToHost("/mem/flat", "t" + std::to_string(i), 100000 + 7 * i), buffers[i].want);
  }
}

TEST_F(DeviceTest, AsyncSaveOfTwoRanksAndAFailedCopyFailsOnEveryRank) {
  std::vector<std::shared_ptr<SimulatedDevice>> sims = {std::make_shared<SimulatedDevice>("a"),
                                                        std::make_shared<SimulatedDevice>("b")};
  std::vector<DeviceBuffer> t = {DeviceBuffer(sims[0], 400000, 61),
                                 DeviceBuffer(sims[1], 400000, 62)};
  std::vector<Status> staged(2), done(2);
  auto run = [&](const std::string& path) {
    return FirstError(RunLocalRanks(2, [&](Comm& comm) -> Status {
      const int r = comm.rank();
      TESSERA_ASSIGN_OR_RETURN(DeviceStream s, sims[r]->NewStream());
      StateDict state;
      TESSERA_RETURN_IF_ERROR(state.Add(
          ShardedTensor::Shard("t", t[r].View(DType::kU8, {400000}, s), {800000}, {400000 * r})));
      // A budget of 2 pieces for 7 per rank.
      TESSERA_ASSIGN_OR_RETURN(AsyncSaveHandle h,
                               AsyncSave(state, path, comm, Deferred(Saving(64 << 10, 128 << 10))));
      staged[r] = h.WaitStaged();
      done[r] = h.Wait();
      return Status::Ok();
    }));
  };
  // Both ranks' halves, written as they are copied.
  ASSERT_OK(run("/mem/async_ok"));
  for (const Status& s : staged) EXPECT_OK(s);
  for (const Status& s : done) EXPECT_OK(s);
  std::vector<uint8_t> both = t[0].want;
  both.insert(both.end(), t[1].want.begin(), t[1].want.end());
  EXPECT_EQ(LoadToHost("/mem/async_ok", "t", 800000), both);
  // The third copy of rank 1 fails: its staging fails, and the save on both ranks.
  sims[1]->FailCopy(2, SimulatedDevice::FaultMode::kWhenRun);
  ASSERT_OK(run("/mem/async_failed"));
  EXPECT_OK(staged[0]);
  EXPECT_THAT(staged[1].message(), HasSubstr("injected failure"));
  for (const Status& s : done) EXPECT_THAT(s.message(), HasSubstr("injected failure"));
  EXPECT_FALSE(ReadMetadata("/mem/async_failed", storage_).ok());
}

}  // namespace
}  // namespace tessera
