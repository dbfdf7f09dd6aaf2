#include "core/thread_priority.h"

#include <algorithm>
#include <cerrno>

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace tessera {

namespace {

// The thread's own id: on Linux, PRIO_PROCESS with a thread id addresses that one thread
// (setpriority(2), "BUGS": a POSIX deviation tessera relies on here on purpose).
id_t ThisThreadId() { return static_cast<id_t>(syscall(SYS_gettid)); }

// The nice value kept per thread, so that a save's threads ask the kernel only on a change.
thread_local int known_nice = -1;  // -1: not read yet

}  // namespace

int ThisThreadNice() {
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, ThisThreadId());
  return errno == 0 ? nice : 0;
}

void SetThisThreadNice(int nice) {
  nice = std::clamp(nice, 0, 19);
  if (known_nice < 0) known_nice = ThisThreadNice();
  if (known_nice == nice) return;
  if (setpriority(PRIO_PROCESS, ThisThreadId(), nice) == 0) known_nice = nice;
}

}  // namespace tessera
