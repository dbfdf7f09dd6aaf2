// libFuzzer target: the torch.save zip item reader (tensor and object items) and the CRC-32
// check of every record (Verify's). Any input gives a result or an error; what reads as a
// tensor lies inside the item. Corpus:
// fuzz/corpus/torch_zip/. Run: scripts/fuzz torch_zip.
#include <cstddef>
#include <cstdint>
#include <span>

#include "format/torch_dist/torch_zip.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> item(data, size);
  auto t = tessera::torch_dist::ParseTorchTensorItem(item, "fuzz.item");
  if (t.ok()) {
    if (t->data_offset > size || t->data_size > size - t->data_offset) __builtin_trap();
    if (t->element_size == 0 || t->storage_elements * t->element_size != t->data_size) {
      __builtin_trap();
    }
    if (t->size.size() != t->stride.size()) __builtin_trap();
    auto range = t->ContiguousRange();
    if (range.ok() && range->second > 0 &&
        (range->first < t->data_offset ||
         range->first + range->second > t->data_offset + t->data_size)) {
      __builtin_trap();
    }
  }
  auto o = tessera::torch_dist::ParseTorchObjectItem(item, "fuzz.item");
  if (o.ok() && !o->is_zip && o->data.size() != size) __builtin_trap();
  uint64_t checked = 0;  // records may share bytes: no bound on the sum to check
  (void)tessera::torch_dist::CheckTorchItemRecords(item, "fuzz.item", &checked);
  return 0;
}
