// Retention: which step directories of a root to keep and which to delete. The decision is a
// pure function of what is known about each step (PlanRetention), tested apart from the
// storage; Prune gathers the facts and carries the decision out.
#ifndef TESSERA_MANAGER_RETENTION_H_
#define TESSERA_MANAGER_RETENTION_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessera/checkpoint_manager.h"
#include "tessera/storage.h"

namespace tessera::manager {

// What is known about one step directory.
struct StepFacts {
  int64_t step = -1;
  std::string path;
  // nullopt: not examined (its index was not read: an older step whose fate does not depend on
  // it). kCommitted counts toward keep_last only when not `failed`.
  std::optional<StepState> state;
  bool failed = false;     // a restore of this manager failed on it
  bool marked = false;     // Mark
  bool in_flight = false;  // this manager's save in flight
  // A live reader or writer ("being read by ..."), or a live deletion; "" when none known.
  std::string live_user;
};

// The decision for every step (ascending, as `facts`): kept (with why) or deleted. The newest
// committed, not failed, checkpoint and the `keep_last` - 1 before it are kept; so is every
// step that is a multiple of keep_every, marked, in flight, in use, or newer than the newest
// committed checkpoint (a save not finished, or a damaged step); everything else is deleted.
// With no committed checkpoint at all, everything is kept. Requires policy.keep_last >= 1.
std::vector<RetentionDecision> PlanRetention(const std::vector<StepFacts>& facts,
                                             const RetentionPolicy& policy);

// Gathers the facts of every step directory under `root` for `policy`: lists each directory,
// reads the indexes of the newest ones until keep_last committed, not failed, are found, and
// looks for live users of those the plan would delete.
struct RootView {
  std::shared_ptr<Storage> storage;
  std::string root;
  StepNaming naming;
  std::set<int64_t> failed;          // steps a restore of this manager failed on
  std::optional<int64_t> in_flight;  // this manager's save in flight
};
// Step names that are symbolic links are left out and, when `links` is given, added to it.
Result<std::vector<StepFacts>> GatherFacts(const RootView& view, const RetentionPolicy& policy,
                                           std::vector<std::string>* links = nullptr);

// PlanRetention on GatherFacts, then (unless dry_run) the deletions. A deletion that finds a
// reader or writer keeps the step (the decision says who); one that fails otherwise is
// reported through `warn` and keeps the step. Every step directory comes back, ascending.
Result<PruneReport> Prune(const RootView& view, const RetentionPolicy& policy, bool dry_run,
                          bool sync, const std::function<void(const std::string&)>& warn);

}  // namespace tessera::manager

#endif  // TESSERA_MANAGER_RETENTION_H_
