// Resident memory of this process, for the benchmarks (Linux /proc).
#ifndef TESSERA_TOOLS_MEMORY_H_
#define TESSERA_TOOLS_MEMORY_H_

#include <cstdint>

namespace tessera::tools {

// A "VmXXX:  1234 kB" line of /proc/self/status ("VmRSS", "VmHWM"), in bytes; 0 if unknown.
uint64_t ProcStatusBytes(const char* field);
// Resets VmHWM (the peak) to the current RSS. False when the kernel does not allow it.
bool ResetPeakRss();

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_MEMORY_H_
