// A user's own Storage and Comm runner put through tessera's conformance suites, from the
// installed headers (tessera/testing/): how a store or a communicator written outside tessera
// checks that it does what tessera relies on. And the Format suite on a format of the registry,
// as a user's own format (tessera/format.h) runs it, with .register_for_test = true.
#include <tessera/format_registry.h>
#include <tessera/local_comm.h>
#include <tessera/memory_storage.h>
#include <tessera/storage_wrapper.h>
#include <tessera/testing/comm_suite.h>
#include <tessera/testing/format_suite.h>
#include <tessera/testing/storage_suite.h>

#include <atomic>
#include <memory>
#include <string>

namespace {

// The user's store: a decorator that counts what reaches an in-memory store.
class CountingStorage : public tessera::StorageWrapper {
 public:
  using StorageWrapper::NewWritableFile;
  using StorageWrapper::StorageWrapper;
  tessera::Result<std::unique_ptr<tessera::WritableFile>> NewWritableFile(
      const std::string& path, tessera::CreateMode mode) override {
    ++created;
    return StorageWrapper::NewWritableFile(path, mode);
  }
  std::atomic<int> created{0};
};

tessera::Result<std::unique_ptr<tessera::testing::StorageSuiteEnv>> MakeCountingEnv() {
  auto memory = std::make_shared<tessera::MemoryStorage>();
  TESSERA_RETURN_IF_ERROR(memory->CreateDirs("/user/root"));
  return std::unique_ptr<tessera::testing::StorageSuiteEnv>(
      new tessera::testing::SimpleStorageSuiteEnv(std::make_shared<CountingStorage>(memory),
                                                  "/user/root"));
}

// The user's runner: three ranks as three threads over LocalComm.
class ThreeThreads : public tessera::testing::CommSuiteRunner {
 public:
  int size() const override { return 3; }
  void Run(const std::function<void(tessera::Comm&)>& rank_body) override {
    tessera::RunLocalRanks(3, [&](tessera::Comm& comm) {
      rank_body(comm);
      return tessera::Status::Ok();
    });
  }
};

}  // namespace

TESSERA_INSTANTIATE_STORAGE_SUITE(Counting, MakeCountingEnv,
                                  (tessera::StorageCapabilities{.rename = true,
                                                                .positional_writes = true,
                                                                .directory_sync = true,
                                                                .conditional_create = true}));
TESSERA_INSTANTIATE_COMM_SUITE(ThreeThreads, std::make_shared<ThreeThreads>(),
                               tessera::testing::CommSuiteTraits{});
// tessera's own format, whose manifest carries a checksum.
TESSERA_INSTANTIATE_FORMAT_SUITE(Tessera, *tessera::FindFormat("tessera"), .index_checksum = true);
