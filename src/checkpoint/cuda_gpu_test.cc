// Saves from and loads into the memory of a real CUDA device (device 0). Built with CUDA,
// run by scripts/gpu-check on a machine with a GPU (ctest label gpu with TESSERA_GPU_TESTS);
// the same paths run everywhere against the simulated device (device_test.cc).
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "device/device_staging.h"
#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/memory_storage.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Resident memory of this process, in bytes (pinned memory counts).
uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::shared_ptr<Device>> device = CudaDevice(0);
    ASSERT_OK(device);
    device_ = *device;
    ASSERT_EQ(cudaStreamCreate(&caller_), cudaSuccess);
    storage_ = std::make_shared<MemoryStorage>();
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    if (caller_) cudaStreamDestroy(caller_);
  }
  DeviceStream caller() const { return reinterpret_cast<DeviceStream>(caller_); }

  // Device memory holding `bytes` (filled synchronously).
  std::byte* Upload(const std::vector<uint8_t>& bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes.size(), 1)), cudaSuccess);
    allocations_.push_back(p);
    EXPECT_EQ(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    return static_cast<std::byte*>(p);
  }
  std::vector<uint8_t> Download(const void* p, size_t n) {
    std::vector<uint8_t> out(n);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  std::vector<uint8_t> LoadToHost(const std::string& path, const std::string& key, size_t n) {
    std::vector<uint8_t> got(n);
    StateDict s;
    EXPECT_OK(s.Add(
        ShardedTensor::Whole(key, TensorView(got.data(), DType::kU8, {static_cast<int64_t>(n)}))));
    LoadOptions o;
    o.storage = storage_;
    o.unexpected_keys = KeyPolicy::kSkip;
    EXPECT_OK(Load(s, path, o));
    return got;
  }
  TensorView View(void* p, size_t n, DeviceStream stream) {
    return TensorView::OnDevice(device_, stream, p, DType::kU8, {static_cast<int64_t>(n)});
  }

  std::shared_ptr<Device> device_;
  cudaStream_t caller_ = nullptr;
  std::shared_ptr<MemoryStorage> storage_;
  std::vector<void*> allocations_;
};

TEST_F(CudaTest, TheSameDeviceEveryTimeAndTheThreadsDeviceKept) {
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Device> again, CudaDevice(0));
  EXPECT_EQ(again, device_);
  EXPECT_EQ(device_->name(), "cuda:0");
  int current = -1;
  ASSERT_OK_AND_ASSIGN(void* p, device_->AllocatePinned(4096));
  device_->FreePinned(p);
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0);
}

TEST_F(CudaTest, SaveWithABudgetSmallerThanTheState) {
  std::vector<std::vector<uint8_t>> want;
  StateDict state;
  const std::vector<size_t> sizes = {0, 1, 4095, 4 << 20, (9 << 20) + 3, 33 << 20};
  for (size_t i = 0; i < sizes.size(); ++i) {
    want.push_back(testing::RandomBytes(sizes[i], 10 + i));
    std::byte* p = Upload(want.back());
    ASSERT_OK(
        state.Add(ShardedTensor::Whole("t" + std::to_string(i), View(p, sizes[i], caller()))));
  }
  SaveOptions o;
  o.storage = storage_;
  o.device_staging.piece_bytes = 4 << 20;
  o.device_staging.pinned_bytes = 12 << 20;
  ASSERT_OK(Save(state, "/mem/budget", o));
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(LoadToHost("/mem/budget", "t" + std::to_string(i), sizes[i]), want[i]) << i;
  }
  ASSERT_OK(Verify("/mem/budget", storage_));
}

TEST_F(CudaTest, DeferredAsyncSaveSeesTheCallersQueuedWorkAndTheCallerMayFreeAfterWaitStaged) {
  const size_t n = 256 << 20;
  const std::vector<uint8_t> old_bytes(n, 1);
  const std::vector<uint8_t> new_bytes = testing::RandomBytes(n, 3);
  std::byte* tensor = Upload(old_bytes);
  std::byte* source = Upload(new_bytes);
  for (cudaStream_t stream : {caller_, static_cast<cudaStream_t>(nullptr)}) {  // and the legacy one
    ASSERT_EQ(cudaMemcpy(tensor, old_bytes.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    // Queued, not done, when AsyncSave is called.
    ASSERT_EQ(cudaMemcpyAsync(tensor, source, n, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    StateDict state;
    ASSERT_OK(state.Add(
        ShardedTensor::Whole("t", View(tensor, n, reinterpret_cast<DeviceStream>(stream)))));
    std::unique_ptr<Comm> comm = NewSingleRankComm();
    AsyncSaveOptions o;
    o.save.storage = storage_;
    o.staging = StagingMode::kDeferred;
    o.save.device_staging.pinned_bytes = 64 << 20;  // a quarter of the state
    ASSERT_OK_AND_ASSIGN(AsyncSaveHandle h, AsyncSave(state, "/mem/async", *comm, o));
    ASSERT_OK(h.WaitStaged());
    // Overwritten at once: nothing reads the tensor any more.
    ASSERT_EQ(cudaMemsetAsync(tensor, 0, n, stream), cudaSuccess);
    ASSERT_OK(h.Wait());
    EXPECT_EQ(LoadToHost("/mem/async", "t", n), new_bytes);
  }
  // And freed right after WaitStaged.
  std::byte* freed = Upload(new_bytes);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("t", View(freed, n, caller()))));
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  AsyncSaveOptions o;
  o.save.storage = storage_;
  o.staging = StagingMode::kDeferred;
  ASSERT_OK_AND_ASSIGN(AsyncSaveHandle h, AsyncSave(state, "/mem/freed", *comm, o));
  ASSERT_OK(h.WaitStaged());
  ASSERT_EQ(cudaFree(freed), cudaSuccess);
  allocations_.erase(std::find(allocations_.begin(), allocations_.end(), freed));
  ASSERT_OK(h.Wait());
  EXPECT_EQ(LoadToHost("/mem/freed", "t", n), new_bytes);
}

TEST_F(CudaTest, LoadIntoCudaMemoryReshardedAndConverted) {
  const int64_t rows = 512, cols = 1000;
  std::vector<float> whole(rows * cols);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i) * 0.25f;
  StateDict saved;
  ASSERT_OK(
      saved.Add(ShardedTensor::Whole("w", TensorView(whole.data(), DType::kF32, {rows, cols}))));
  SaveOptions so;
  so.storage = storage_;
  ASSERT_OK(Save(saved, "/mem/reshard", so));
  const Box box({100, 17}, {300, 900});
  std::byte* dst = Upload(std::vector<uint8_t>(box.NumElements() * 8, 0xEE));
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Shard(
      "w", TensorView::OnDevice(device_, caller(), dst, DType::kF64, box.sizes.ToVector()),
      {rows, cols}, box.offsets)));
  LoadOptions lo;
  lo.storage = storage_;
  lo.cast_dtypes = true;
  lo.device_staging.piece_bytes = 1 << 20;
  ASSERT_OK(Load(state, "/mem/reshard", lo));
  // Work queued on the caller's stream after Load sees the loaded bytes.
  std::vector<double> got(box.NumElements());
  ASSERT_EQ(cudaMemcpyAsync(got.data(), dst, got.size() * 8, cudaMemcpyDeviceToHost, caller_),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(caller_), cudaSuccess);
  for (int64_t i = 0; i < box.sizes[0]; ++i) {
    for (int64_t j = 0; j < box.sizes[1]; ++j) {
      ASSERT_EQ(got[i * box.sizes[1] + j], whole[(box.offsets[0] + i) * cols + box.offsets[1] + j]);
    }
  }
}

TEST_F(CudaTest, PinnedMemoryStaysFlatOverManySaves) {
  const size_t n = 48 << 20;
  const std::vector<uint8_t> bytes = testing::RandomBytes(n, 9);
  std::byte* p = Upload(bytes);
  StateDict state;
  ASSERT_OK(state.Add(ShardedTensor::Whole("t", View(p, n, caller()))));
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<DeviceStaging> staging, DeviceStaging::For(device_));
  uint64_t pinned_after_first = 0, resident_after_first = 0;
  for (int i = 0; i < 100; ++i) {
    AsyncSaveOptions o;
    o.save.storage = storage_;
    o.save.sync = SyncPolicy::kNone;
    o.staging = StagingMode::kDeferred;
    ASSERT_OK_AND_ASSIGN(AsyncSaveHandle h, AsyncSave(state, "/mem/flat", *comm, o));
    ASSERT_OK(h.Wait());
    if (i == 1) {
      pinned_after_first = staging->pinned_bytes();
      resident_after_first = ResidentBytes();
    }
  }
  EXPECT_EQ(staging->pinned_bytes(), pinned_after_first);
  EXPECT_LT(ResidentBytes(), resident_after_first + (64 << 20));
  EXPECT_EQ(LoadToHost("/mem/flat", "t", n), bytes);
}

}  // namespace
}  // namespace tessera
