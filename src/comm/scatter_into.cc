// Comm::ScatterInto's default (through Scatter, a copy on each side) and the range helpers that
// the implementations that move bytes once share.
#include <algorithm>
#include <cstring>

#include "tessera/comm.h"

namespace tessera {

uint64_t TotalBytes(std::span<const ConstByteSpan> ranges) {
  uint64_t total = 0;
  for (ConstByteSpan r : ranges) total += r.size();
  return total;
}

uint64_t TotalBytes(std::span<const MutableByteSpan> ranges) {
  uint64_t total = 0;
  for (MutableByteSpan r : ranges) total += r.size();
  return total;
}

void CopyRanges(std::span<const ConstByteSpan> from, std::span<const MutableByteSpan> to) {
  size_t f = 0, t = 0;
  uint64_t f_at = 0, t_at = 0;  // bytes done of from[f] and to[t]
  while (f < from.size() && t < to.size()) {
    const uint64_t n = std::min(from[f].size() - f_at, to[t].size() - t_at);
    if (n > 0) std::memcpy(to[t].data() + t_at, from[f].data() + f_at, n);
    f_at += n;
    t_at += n;
    if (f_at == from[f].size()) ++f, f_at = 0;
    if (t < to.size() && t_at == to[t].size()) ++t, t_at = 0;
  }
}

Status Comm::ScatterInto(std::span<const std::vector<ConstByteSpan>> send,
                         std::span<const MutableByteSpan> receive, uint64_t* received, int root) {
  std::vector<Bytes> packed;
  if (rank() == root) {
    packed.resize(send.size());
    for (size_t r = 0; r < send.size(); ++r) {
      packed[r].resize(TotalBytes(send[r]));
      const MutableByteSpan whole(reinterpret_cast<std::byte*>(packed[r].data()), packed[r].size());
      CopyRanges(send[r], std::span(&whole, 1));
    }
  }
  Bytes message;
  TESSERA_RETURN_IF_ERROR(Scatter(packed, &message, root));
  if (received != nullptr) *received = message.size();
  if (message.size() == TotalBytes(receive)) {
    const ConstByteSpan whole(reinterpret_cast<const std::byte*>(message.data()), message.size());
    CopyRanges(std::span(&whole, 1), receive);
  }
  return Status::Ok();
}

}  // namespace tessera
