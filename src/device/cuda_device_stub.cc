// CudaDevice in a build without CUDA (TESSERA_WITH_CUDA off, or no CUDA toolkit found): every
// call says so. Device tensors of other Device implementations still work.
#include <string>

#include "tessera/device.h"

namespace tessera {

bool BuiltWithCuda() { return false; }

Result<std::shared_ptr<Device>> CudaDevice(int ordinal) {
  if (ordinal < 0) {
    return InvalidArgument("CUDA device ordinal must be at least 0, not " +
                           std::to_string(ordinal));
  }
  return Unimplemented("CUDA device " + std::to_string(ordinal) +
                       ": this tessera was built without CUDA (configure it with "
                       "-DTESSERA_WITH_CUDA=ON where the CUDA toolkit is installed)");
}

}  // namespace tessera
