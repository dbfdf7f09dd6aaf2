#include "manager/retention.h"

#include <algorithm>

#include "manager/root_files.h"

namespace tessera::manager {
namespace {

bool CountsAsCommitted(const StepFacts& f) { return f.state == StepState::kCommitted && !f.failed; }

// Why a step the policy does not keep must stay anyway, or "".
std::string Protection(const StepFacts& f) {
  if (f.marked) return "marked to be kept";
  if (f.in_flight) return "being saved by this manager";
  if (!f.live_user.empty()) return f.live_user;
  return "";
}

}  // namespace

std::vector<RetentionDecision> PlanRetention(const std::vector<StepFacts>& facts,
                                             const RetentionPolicy& policy) {
  // The newest committed steps, newest first: the first keep_last are kept.
  std::vector<int64_t> newest;
  for (auto it = facts.rbegin(); it != facts.rend(); ++it) {
    if (CountsAsCommitted(*it)) newest.push_back(it->step);
  }
  const std::string last = "one of the newest " + std::to_string(policy.keep_last) + " committed";
  std::vector<RetentionDecision> decisions;
  for (const StepFacts& f : facts) {
    RetentionDecision d{.step = f.step, .path = f.path};
    const auto rank = std::find(newest.begin(), newest.end(), f.step) - newest.begin();
    const std::string protection = Protection(f);
    if (newest.empty()) {
      d.reason = "no committed checkpoint under the root: nothing is deleted";
    } else if (f.step > newest.front()) {
      d.reason = f.failed ? "newer than the newest committed checkpoint (its restore failed)"
                 : f.state == StepState::kDamaged
                     ? "newer than the newest committed checkpoint (damaged)"
                     : "newer than the newest committed checkpoint (a save not finished, "
                       "or running)";
    } else if (rank < static_cast<int64_t>(newest.size()) && rank < policy.keep_last) {
      d.reason = rank == 0 ? "the newest committed" : last;
    } else if (policy.keep_every > 0 && f.step % policy.keep_every == 0) {
      d.reason = "a multiple of " + std::to_string(policy.keep_every);
    } else if (!protection.empty()) {
      d.reason = protection;
    } else {
      d.deleted = true;
      const bool behind_kept = static_cast<int64_t>(newest.size()) >= policy.keep_last &&
                               f.step < newest[policy.keep_last - 1];
      d.reason = f.failed ? "older than the newest committed checkpoint (its restore failed)"
                 : f.state == StepState::kUncommitted
                     ? "not committed, older than the newest committed checkpoint"
                 : behind_kept
                     ? "older than the newest " + std::to_string(policy.keep_last) + " committed"
                     : "older than the newest committed checkpoint";
    }
    decisions.push_back(std::move(d));
  }
  return decisions;
}

Result<std::vector<StepFacts>> GatherFacts(const RootView& view, const RetentionPolicy& policy,
                                           std::vector<std::string>* links) {
  Storage& storage = *view.storage;
  Result<std::vector<int64_t>> steps = ListStepsOfRoot(view.storage, view.root, view.naming, links);
  if (steps.status().code() == StatusCode::kNotFound) return std::vector<StepFacts>{};
  TESSERA_RETURN_IF_ERROR(steps.status());
  std::vector<StepFacts> facts(steps->size());
  int found = 0;  // committed, not failed, from the newest down
  for (size_t i = steps->size(); i-- > 0;) {
    StepFacts& f = facts[i];
    f.step = (*steps)[i];
    f.path = JoinPath(view.root, view.naming.Name(f.step));
    f.failed = view.failed.count(f.step) != 0;
    f.in_flight = view.in_flight == f.step;
    Result<StepDirFiles> files = ListStepDir(storage, f.path);
    if (files.status().code() == StatusCode::kNotFound) {
      f.state = StepState::kUncommitted;  // deleted meanwhile
      continue;
    }
    TESSERA_RETURN_IF_ERROR(files.status());
    f.marked = files->marked;
    // Older steps need no index read once keep_last committed ones are found: the plan deletes
    // or keeps them whatever they hold.
    if (found < policy.keep_last || files->tombstone) {
      TESSERA_ASSIGN_OR_RETURN(const StepInfo info,
                               ExamineStep(view.storage, f.path, f.step, *files));
      f.state = info.state;
      if (info.state == StepState::kDeleting && info.problem.starts_with("being deleted")) {
        f.live_user = info.problem;
      }
      if (CountsAsCommitted(f)) ++found;
    }
  }
  // Who uses the steps the plan would delete (Prune checks again, under its tombstone).
  const std::vector<RetentionDecision> plan = PlanRetention(facts, policy);
  for (size_t i = 0; i < facts.size(); ++i) {
    if (!plan[i].deleted || !facts[i].live_user.empty()) continue;
    Result<StepDirFiles> files = ListStepDir(storage, facts[i].path);
    if (files.ok()) facts[i].live_user = LiveUser(storage, facts[i].path, *files);
  }
  return facts;
}

Result<PruneReport> Prune(const RootView& view, const RetentionPolicy& policy, bool dry_run,
                          bool sync, const std::function<void(const std::string&)>& warn) {
  if (policy.keep_last < 1) {
    return InvalidArgument(
        "retention must keep at least the newest checkpoint (keep_last >= 1, "
        "not " +
        std::to_string(policy.keep_last) + ")");
  }
  if (policy.keep_every < 0) {
    return InvalidArgument("keep_every must be >= 0, not " + std::to_string(policy.keep_every));
  }
  std::vector<std::string> links;
  TESSERA_ASSIGN_OR_RETURN(std::vector<StepFacts> facts, GatherFacts(view, policy, &links));
  for (const std::string& name : links) {
    if (warn) {
      warn(JoinPath(view.root, name) +
           " is a symbolic link (or could not be examined), not a step directory of the root: "
           "left alone");
    }
  }
  PruneReport report;
  report.dry_run = dry_run;
  report.steps = PlanRetention(facts, policy);
  for (RetentionDecision& d : report.steps) {
    if (!d.deleted) continue;
    if (!dry_run) {
      Status deleted = DeleteStepDir(*view.storage, view.root, d.path, sync);
      if (!deleted.ok()) {
        d.deleted = false;
        d.reason = "kept: " + deleted.message();
        if (deleted.code() != StatusCode::kFailedPrecondition && warn) {
          warn("could not delete step " + std::to_string(d.step) + ": " + deleted.ToString());
        }
        continue;
      }
    }
    ++report.deleted;
  }
  return report;
}

}  // namespace tessera::manager
