// Bytes: an owned run of bytes (an object's value, a message between ranks, a file's contents).
// Its own header so that code that moves bytes need not include the communicator (comm.h).
#ifndef TESSERA_BYTES_H_
#define TESSERA_BYTES_H_

#include <cstdint>
#include <vector>

namespace tessera {

using Bytes = std::vector<uint8_t>;

}  // namespace tessera

#endif  // TESSERA_BYTES_H_
