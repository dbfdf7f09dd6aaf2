// Storage's default capabilities and Publish (include/tessera/storage.h).
#include "tessera/storage.h"

namespace tessera {

StorageCapabilities Storage::capabilities() const { return StorageCapabilities{}; }

Status Storage::Publish(const std::string& path, std::span<const std::byte> bytes, PublishMode mode,
                        bool sync) {
  (void)bytes;
  (void)mode;
  (void)sync;
  return Unimplemented("Publish is not supported by this storage (publishing " + path + ")");
}

}  // namespace tessera
