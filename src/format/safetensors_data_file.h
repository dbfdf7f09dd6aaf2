// The DataFileEncoder of a data file that is a safetensors file: its header, then each item's
// bytes raw at the offset its entry gives (tessera's data files and Hugging Face's).
#ifndef TESSERA_FORMAT_SAFETENSORS_DATA_FILE_H_
#define TESSERA_FORMAT_SAFETENSORS_DATA_FILE_H_

#include <memory>
#include <vector>

#include "format/safetensors.h"
#include "tessera/format_writer.h"

namespace tessera {

// `entries` (parallel to the file's items) laid out by LayOutEntries, `header` their encoding.
std::unique_ptr<DataFileEncoder> NewSafetensorsDataFile(std::vector<SafetensorsEntry> entries,
                                                        Bytes header);

}  // namespace tessera

#endif  // TESSERA_FORMAT_SAFETENSORS_DATA_FILE_H_
