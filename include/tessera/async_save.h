// AsyncSave: a save that stalls the caller only for one copy of the state into host staging
// buffers; planning, writing, checksumming and the commit run in the background.
//
//   Result<AsyncSaveHandle> h = AsyncSave(state, path, comm, options);  // returns once staged
//   ... train: the caller may change its tensors and use `comm` freely ...
//   Status s = h->Wait();  // or h->Done() to poll
//
// COLLECTIVE: every rank of `comm` calls AsyncSave with the same path and options, in the same
// order. The background work talks over a private communicator split from `comm` on the first
// AsyncSave, so the caller's own collectives on `comm` never mix with it.
//
// The checkpoint is committed only when every rank's writes succeeded; a failure on any rank
// fails every rank's handle and leaves no manifest.
//
// Staging buffers come from a pool kept with `comm` and reused by later saves: memory does not
// grow from save to save. Destroying `comm` (or exiting) with a save in flight waits for it.
#ifndef TESSERA_ASYNC_SAVE_H_
#define TESSERA_ASYNC_SAVE_H_

#include <memory>
#include <optional>
#include <string>

#include "tessera/checkpoint.h"
#include "tessera/comm.h"
#include "tessera/state_dict.h"
#include "tessera/status.h"

namespace tessera {

// What AsyncSave does when an earlier async save on the same comm is still in flight.
enum class WhenBusy {
  kWait,   // wait for it to finish, then stage (default): at most one staged copy in memory
  kQueue,  // stage now into a second set of buffers and queue behind it: at most two copies
};

struct AsyncSaveOptions {
  SaveOptions save;  // as for Save
  WhenBusy when_busy = WhenBusy::kWait;
};

// The state of one asynchronous save. Thread-safe; copies share the same save.
class AsyncSaveHandle {
 public:
  struct State;
  explicit AsyncSaveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // Blocks until the save is committed or failed; the same status on every rank.
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

Result<AsyncSaveHandle> AsyncSave(const StateDict& state, const std::string& path, Comm& comm,
                                  const AsyncSaveOptions& options = {});

}  // namespace tessera

#endif  // TESSERA_ASYNC_SAVE_H_
