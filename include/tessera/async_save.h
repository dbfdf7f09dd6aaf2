// AsyncSave: a save that stalls the caller for at most one copy of the state into host staging
// buffers (kBlocking, the default), or for almost nothing (kDeferred: the copy runs on
// background threads while the caller computes); planning, writing, checksumming and the
// commit run in the background.
//
//   AsyncSaveOptions o;
//   o.staging = StagingMode::kDeferred;
//   Result<AsyncSaveHandle> h = AsyncSave(state, path, comm, o);  // returns at once
//   ... forward and backward passes: read the tensors, do not write them ...
//   Status s = h->WaitStaged();  // the copy is done: the caller may change its tensors again
//   ... optimizer step, more training; `comm` may be used freely throughout ...
//   s = h->Wait();  // or h->Done() to poll: committed, the same status on every rank
//
// What the caller may do when, with the tensors (the memory the state's views point to):
// - kBlocking: AsyncSave returns once every tensor is copied. From then on the caller may
//   change or free them.
// - kDeferred: AsyncSave returns before copying. Until WaitStaged() returns, the caller must
//   neither change nor free them: reading is fine, writing is a data race whose result is an
//   unspecified mix of old and new bytes in the checkpoint (check_unchanged_until_staged
//   detects it, for debugging). Wait(), and destroying the last copy of the handle, first wait
//   as WaitStaged() does, so a handle dropped early never leaves threads reading freed memory.
// The StateDict itself (keys, views, objects) is copied during the call: it may go at once.
//
// Tensors in device memory (TensorView::device) are not copied during the call, whatever the
// staging mode: the call makes tessera's copy stream wait for the work queued on each tensor's
// stream so far (a few microseconds per stream; the copies see the tensors as that work leaves
// them), and the background save copies the bytes this rank writes, in pieces, into pinned
// host buffers as it writes them (SaveOptions::device_staging: the pinned budget and piece
// size). WaitStaged() returns once every piece has left device memory: with a budget at least
// the size of the device state (the default) after one pass of copies, else when all but the
// last budget's worth are written. With kBlocking the call itself waits for that. Until then
// the caller must not change or free those tensors; queueing more work that only reads them is
// fine (forward and backward passes). check_unchanged_until_staged checks host tensors only.
// Under kQueue a device save is copied when the save before it is done.
//
// COLLECTIVE: every rank of `comm` calls AsyncSave with the same path and options, in the same
// order (even where the call fails: the background work of every rank takes part in every save).
// The first AsyncSave on a comm communicates over it (it creates a private communicator split
// from `comm`); later ones do so only with kBlocking (one small all-reduce). The background
// work talks over the private communicator only, so the caller's own collectives on `comm` never
// mix with it.
//
// The checkpoint is committed only when every rank's staging and writes succeeded; a failure on
// any rank fails every rank's handle and leaves no manifest.
//
// Staging buffers and copy threads come from a pool kept with `comm` and reused by later saves:
// memory does not grow from save to save. Destroying `comm` (or exiting) with a save in flight
// waits for it (including its staging, so the tensors must still be valid then).
#ifndef TESSERA_ASYNC_SAVE_H_
#define TESSERA_ASYNC_SAVE_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "tessera/checkpoint.h"
#include "tessera/comm.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"

namespace tessera {

// What AsyncSave does when an earlier async save on the same comm is still in flight (with
// kDeferred too: the call then blocks under kWait, or while two are in flight under kQueue).
enum class WhenBusy {
  kWait,   // wait for it to finish, then stage (default): at most one staged copy in memory
  kQueue,  // stage now into a second set of buffers and queue behind it: at most two copies
};

// When the copy into the staging buffers happens.
enum class StagingMode {
  kBlocking,  // during the AsyncSave call (default): the caller may change its tensors after it
  kDeferred,  // on background threads after the call returns: the caller must leave its
              // tensors unchanged until WaitStaged() returns
};

struct AsyncSaveOptions {
  SaveOptions save;  // as for Save
  WhenBusy when_busy = WhenBusy::kWait;
  StagingMode staging = StagingMode::kBlocking;
  // Threads that copy the state into the staging buffers, in pieces (with kBlocking the
  // caller's thread copies too). Default 4: a single thread copies well below the memory
  // bandwidth; more threads than cores take cores from the caller's compute while it runs
  // (kDeferred). The threads live with `comm`, idle between saves; the pool keeps the largest
  // count asked for. At least 1.
  int staging_threads = 4;
  // The unit of work of the copy threads: a tensor is copied in pieces of this many bytes, and
  // small tensors are grouped up to it. Default 8 MiB: big enough that handing out pieces costs
  // nothing, small enough to spread one big tensor over every thread. At least 4096.
  size_t staging_piece_bytes = size_t{8} << 20;
  // Debugging aid for kDeferred (ignored with kBlocking): checksums (XXH3-64) every piece as it
  // is staged and the caller's source again when WaitStaged() is called; a difference means the
  // caller changed a tensor too early, and fails the save with kFailedPrecondition naming the
  // key, on every rank. A change that lands entirely before its piece is copied is not seen
  // (the checkpoint then holds the changed bytes). Costs one checksum pass over the state in
  // the copy threads and one on the thread calling WaitStaged(), and the background save starts
  // only once WaitStaged() (or Wait(), or the next AsyncSave on the comm) has checked. Default
  // false.
  bool check_unchanged_until_staged = false;
  // The nice value (0-19) of the background work: the copy threads (not the caller's thread,
  // which also copies with kBlocking), the thread that saves, and the I/O threads it starts.
  // Default 10, as Megatron-Core runs its asynchronous writer: on a machine whose cores the
  // training loop keeps busy, the save takes the time the caller leaves idle instead of slowing
  // its steps; the kernel derives the I/O priority from it (best effort, level 6). 0: normal
  // priority. Best effort: making a thread less nice again (a later save asking for
  // less) needs CAP_SYS_NICE.
  int background_nice = 10;
  // The most memory, in bytes, that holds this rank's staged copy of one save (back-pressure
  // instead of an out-of-memory kill on a node whose state does not fit twice). Default 0: no
  // bound; the host tensors are copied whole into staging buffers (kept for the next save), so
  // the caller gets its tensors back as soon as memory bandwidth allows. When the host tensors'
  // bytes exceed a nonzero budget, they are not copied up front: the background save copies them
  // piece by piece into at most `staging_budget_bytes` of buffers, as it writes, and reuses a
  // buffer as soon as its bytes are written, as it does for tensors in device memory
  // (SaveOptions::device_staging). The caller then gets its tensors back (WaitStaged(); with
  // kBlocking, AsyncSave returns) only once all but the last budget's worth of the state has
  // been written: the wait grows with (state - budget) / write speed. A nonzero budget also
  // bounds each device's pinned buffers, where SaveOptions::device_staging.pinned_bytes is 0 or
  // larger, and caps the pieces of that staging at a quarter of the budget (at least 4096 bytes;
  // the buffers, rounded up to whole pieces, are kept for the next save). Cannot be combined
  // with check_unchanged_until_staged when the state exceeds it (the check needs a whole copy).
  uint64_t staging_budget_bytes = 0;
};

// The state of one asynchronous save. Thread-safe; copies share the same save. Destroying the
// last copy waits as WaitStaged() does (not for the commit).
class AsyncSaveHandle {
 public:
  struct State;
  explicit AsyncSaveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // Blocks until the caller may change or free its tensors again: every byte is copied into the
  // staging buffers (and, with check_unchanged_until_staged, the sources were checked against
  // the copies). Returns this rank's staging status: OK, or the error that fails the save
  // (Wait() then fails on every rank). Returns at once with kBlocking. Not collective.
  Status WaitStaged() const;
  // Non-blocking: true once the copy is done (WaitStaged() then does not wait for copies; with
  // check_unchanged_until_staged it still checks, the first time).
  bool Staged() const;
  // Blocks until the save is committed or failed; the same status on every rank. Starts with
  // WaitStaged().
  Status Wait() const;
  // Non-blocking: true once Wait() would return at once.
  bool Done() const;
  // The final status, or nullopt while in flight.
  std::optional<Status> TryStatus() const;
  // Available once done.
  std::optional<SaveReport> report() const;

 private:
  std::shared_ptr<State> state_;
};

// A state or options that are invalid on any rank: with kBlocking, AsyncSave fails at once on
// every rank (it agrees with one small collective over `comm`); with kDeferred the call does no
// communication at all, so it fails at once on the ranks that hold the bad state, and Wait()
// fails on the others. Errors found later (a check of check_unchanged_until_staged, a write)
// come from WaitStaged() (this rank's staging) and Wait() (every rank).
Result<AsyncSaveHandle> AsyncSave(const StateDict& state, const std::string& path, Comm& comm,
                                  const AsyncSaveOptions& options = {});

}  // namespace tessera

#endif  // TESSERA_ASYNC_SAVE_H_
