// The simulated device keeps the promises tests rely on (a separate address space, streams in
// order, events, faults), the per-device staging reuses its pinned memory, and CudaDevice
// fails clearly where there is no CUDA device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "device/device_staging.h"
#include "device/simulated_device.h"
#include "tessera/device.h"
#include "testing/test_util.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<SimulatedDevice> NewSim(std::string name = "sim:0") {
  return std::make_shared<SimulatedDevice>(std::move(name));
}

TEST(SimulatedDeviceTest, CopiesRoundTripThroughPinnedMemory) {
  auto sim = NewSim();
  ASSERT_OK_AND_ASSIGN(void* dev, sim->Allocate(1000));
  ASSERT_OK_AND_ASSIGN(void* pinned, sim->AllocatePinned(1000));
  ASSERT_OK_AND_ASSIGN(DeviceStream s, sim->NewStream());
  ASSERT_OK_AND_ASSIGN(DeviceEvent e, sim->NewEvent());
  std::vector<uint8_t> in = testing::RandomBytes(1000, 7);
  std::memcpy(pinned, in.data(), in.size());
  ASSERT_OK(sim->CopyToDevice(dev, pinned, 1000, s));
  ASSERT_OK(sim->Record(e, s));
  ASSERT_OK(sim->Synchronize(e));  // before it, the copy may not have read `pinned` yet
  std::memset(pinned, 0, 1000);
  ASSERT_OK(sim->CopyToHost(pinned, dev, 1000, s));
  ASSERT_OK(sim->Record(e, s));
  ASSERT_OK(sim->Synchronize(e));
  EXPECT_EQ(std::memcmp(pinned, in.data(), in.size()), 0);
  std::vector<uint8_t> peeked(1000);
  ASSERT_OK(sim->Peek(peeked.data(), dev, 1000));
  EXPECT_EQ(peeked, in);
  SimulatedDevice::Stats stats = sim->stats();
  EXPECT_EQ(stats.copies_to_host, 1u);
  EXPECT_EQ(stats.copies_to_device, 1u);
  EXPECT_EQ(stats.bytes_to_host, 1000u);
  sim->DestroyEvent(e);
  sim->DestroyStream(s);
  sim->FreePinned(pinned);
  sim->Free(dev);
  stats = sim->stats();
  EXPECT_EQ(stats.pinned_bytes, 0u);
  EXPECT_EQ(stats.device_bytes, 0u);
  EXPECT_EQ(stats.streams, 0u);
  EXPECT_EQ(stats.events, 0u);
}

TEST(SimulatedDeviceTest, HostMemoryAsDeviceMemoryFailsNamingIt) {
  auto sim = NewSim();
  ASSERT_OK_AND_ASSIGN(void* pinned, sim->AllocatePinned(64));
  ASSERT_OK_AND_ASSIGN(DeviceStream s, sim->NewStream());
  std::vector<uint8_t> host(64);
  Status st = sim->CopyToHost(pinned, host.data(), 64, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("host memory passed as device memory"));
  // And pageable memory where pinned memory is required.
  ASSERT_OK_AND_ASSIGN(void* dev, sim->Allocate(64));
  st = sim->CopyToHost(host.data(), dev, 64, s);
  EXPECT_THAT(st.message(), HasSubstr("not pinned memory"));
  // A device address read on the host crashes: the address space is not the host's.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH({ std::printf("%d", *static_cast<volatile char*>(dev)); }, "");
  // Freed memory fails, also past the end of an allocation.
  st = sim->CopyToHost(pinned, static_cast<char*>(dev) + 32, 64, s);
  EXPECT_THAT(st.message(), HasSubstr("freed, or past the end"));
  sim->Free(dev);
  st = sim->CopyToHost(pinned, dev, 8, s);
  EXPECT_THAT(st.message(), HasSubstr("freed, or past the end"));
  sim->DestroyStream(s);
  sim->FreePinned(pinned);
}

TEST(SimulatedDeviceTest, StreamWaitsForAnEventOfAnotherStream) {
  auto sim = NewSim();
  ASSERT_OK_AND_ASSIGN(void* dev, sim->Allocate(4));
  ASSERT_OK_AND_ASSIGN(void* pinned, sim->AllocatePinned(4));
  ASSERT_OK_AND_ASSIGN(DeviceStream compute, sim->NewStream());
  ASSERT_OK_AND_ASSIGN(DeviceStream copy, sim->NewStream());
  ASSERT_OK_AND_ASSIGN(DeviceEvent ready, sim->NewEvent());
  ASSERT_OK_AND_ASSIGN(DeviceEvent copied, sim->NewEvent());
  const uint32_t before = 1, after = 2;
  ASSERT_OK(sim->Poke(dev, &before, 4));
  // A slow kernel writes `after`; the copy on the other stream waits for it.
  ASSERT_OK(sim->Launch(compute, std::chrono::milliseconds(50),
                        [&] { ASSERT_OK(sim->Poke(dev, &after, 4)); }));
  ASSERT_OK(sim->Record(ready, compute));
  ASSERT_OK(sim->Wait(copy, ready));
  ASSERT_OK(sim->CopyToHost(pinned, dev, 4, copy));
  ASSERT_OK(sim->Record(copied, copy));
  ASSERT_OK(sim->Synchronize(copied));
  uint32_t got = 0;
  std::memcpy(&got, pinned, 4);
  EXPECT_EQ(got, after);
  // A wait for an event never recorded waits for nothing.
  ASSERT_OK_AND_ASSIGN(DeviceEvent never, sim->NewEvent());
  ASSERT_OK(sim->Wait(copy, never));
  ASSERT_OK(sim->Synchronize(never));
}

TEST(SimulatedDeviceTest, InjectedFaults) {
  auto sim = NewSim();
  ASSERT_OK_AND_ASSIGN(void* dev, sim->Allocate(16));
  ASSERT_OK_AND_ASSIGN(void* pinned, sim->AllocatePinned(16));
  ASSERT_OK_AND_ASSIGN(DeviceStream s, sim->NewStream());
  ASSERT_OK_AND_ASSIGN(DeviceEvent e, sim->NewEvent());
  sim->FailCopy(1, SimulatedDevice::FaultMode::kWhenQueued);
  ASSERT_OK(sim->CopyToHost(pinned, dev, 16, s));  // the 0th
  Status st = sim->CopyToHost(pinned, dev, 16, s);
  EXPECT_THAT(st.message(), HasSubstr("injected failure queueing"));
  sim->FailCopy(0, SimulatedDevice::FaultMode::kWhenRun);
  ASSERT_OK(sim->CopyToDevice(dev, pinned, 16, s));  // queued fine, fails when it runs
  ASSERT_OK(sim->Record(e, s));
  st = sim->Synchronize(e);
  EXPECT_THAT(st.message(), HasSubstr("injected failure of a copy to device"));
  // Reported once: the next mark is clean.
  ASSERT_OK(sim->CopyToDevice(dev, pinned, 16, s));
  ASSERT_OK(sim->Record(e, s));
  EXPECT_OK(sim->Synchronize(e));
}

TEST(DeviceStagingTest, PinnedBuffersAreReusedAndReleased) {
  auto sim = NewSim();
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<DeviceStaging> staging, DeviceStaging::For(sim));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<DeviceStaging> again, DeviceStaging::For(sim));
  EXPECT_EQ(staging, again);
  EXPECT_NE(staging->save_stream(), staging->load_stream());
  for (int i = 0; i < 50; ++i) {
    ASSERT_OK_AND_ASSIGN(std::vector<PinnedBuffer> leased, staging->Lease(*sim, 4, 1 << 16));
    ASSERT_EQ(leased.size(), 4u);
    staging->Return(std::move(leased));
  }
  EXPECT_EQ(sim->stats().pinned_allocations, 4u);
  EXPECT_EQ(sim->stats().pinned_bytes, 4u << 16);
  EXPECT_EQ(staging->pinned_bytes(), 4u << 16);
  // Two leases at once get their own buffers.
  ASSERT_OK_AND_ASSIGN(std::vector<PinnedBuffer> a, staging->Lease(*sim, 3, 1 << 16));
  ASSERT_OK_AND_ASSIGN(std::vector<PinnedBuffer> b, staging->Lease(*sim, 3, 1 << 16));
  EXPECT_EQ(sim->stats().pinned_allocations, 6u);
  staging->Return(std::move(a));
  staging->Return(std::move(b));
  // Another piece size replaces the idle buffers.
  ASSERT_OK_AND_ASSIGN(std::vector<PinnedBuffer> c, staging->Lease(*sim, 2, 1 << 12));
  EXPECT_EQ(sim->stats().pinned_bytes, 2u << 12);
  staging->Return(std::move(c));
  EXPECT_EQ(ReleaseIdlePinnedMemory(*sim), 2u << 12);
  EXPECT_EQ(sim->stats().pinned_bytes, 0u);
  EXPECT_EQ(staging->pinned_bytes(), 0u);
}

TEST(DeviceStagingTest, OrderMakesOneStreamWaitForAnother) {
  auto sim = NewSim();
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<DeviceStaging> staging, DeviceStaging::For(sim));
  ASSERT_OK_AND_ASSIGN(DeviceStream caller, sim->NewStream());
  std::atomic<bool> kernel_done{false};
  ASSERT_OK(sim->Launch(caller, std::chrono::milliseconds(50), [&] { kernel_done = true; }));
  ASSERT_OK(staging->Order(*sim, staging->save_stream(), caller));
  std::atomic<bool> seen{false};
  ASSERT_OK(sim->Launch(staging->save_stream(), std::chrono::microseconds(0),
                        [&] { seen = kernel_done.load(); }));
  ASSERT_OK_AND_ASSIGN(DeviceEvent e, sim->NewEvent());
  ASSERT_OK(sim->Record(e, staging->save_stream()));
  ASSERT_OK(sim->Synchronize(e));
  EXPECT_TRUE(seen);
  sim->DestroyEvent(e);
  sim->DestroyStream(caller);
}

TEST(CudaDeviceTest, ClearErrorsWithoutSuchADevice) {
  EXPECT_EQ(CudaDevice(-1).status().code(), StatusCode::kInvalidArgument);
  Result<std::shared_ptr<Device>> far = CudaDevice(1 << 20);
  ASSERT_FALSE(far.ok());
  EXPECT_EQ(far.status().code(),
            BuiltWithCuda() ? StatusCode::kFailedPrecondition : StatusCode::kUnimplemented);
  EXPECT_THAT(far.status().message(), HasSubstr("CUDA device 1048576"));
}

}  // namespace
}  // namespace tessera
