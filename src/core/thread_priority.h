// The CPU priority of the calling thread, for tessera's background threads (asynchronous saves).
#ifndef TESSERA_CORE_THREAD_PRIORITY_H_
#define TESSERA_CORE_THREAD_PRIORITY_H_

namespace tessera {

// Sets the calling thread's nice value (Linux: per thread; the threads it starts later inherit
// it) to `nice`, clamped to [0, 19], unless it already is. Best effort: a request to raise the
// priority back (a lower value than the thread has) needs CAP_SYS_NICE and is left undone
// without it, as is any request on a system without per-thread priorities. The I/O priority
// follows: a thread with no I/O priority of its own gets best-effort level (nice + 20) / 5
// from the kernel (ioprio_set(2)), which BFQ honours.
void SetThisThreadNice(int nice);

// The calling thread's nice value (0 where it cannot be read).
int ThisThreadNice();

}  // namespace tessera

#endif  // TESSERA_CORE_THREAD_PRIORITY_H_
