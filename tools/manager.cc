// tessera latest / tessera prune: the checkpoints of a CheckpointManager's root.
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/utf8.h"
#include "tessera/checkpoint_manager.h"
#include "tessera/storage_uri.h"
#include "tools/commands.h"
#include "tools/text.h"
#include "tools/uploads.h"

namespace tessera::tools {
namespace {

Status CheckJsonText(const std::string& root, const std::string& text) {
  if (IsValidUtf8(root) && IsValidUtf8(text)) return Status::Ok();
  return InvalidArgument("the root " + QuoteBytes(root) +
                         " or a message about it is not valid UTF-8; JSON cannot hold it "
                         "(without --json it is shown escaped)");
}

// The manager of `root` with the step naming the command was given (a preset or a pattern).
Result<std::unique_ptr<CheckpointManager>> OpenRoot(const std::string& root,
                                                    const std::string& step_naming) {
  TESSERA_ASSIGN_OR_RETURN(StepNaming naming, ParseStepNaming(step_naming));
  CheckpointManagerOptions options;
  options.step_naming = std::move(naming);
  return CheckpointManager::Open(root, std::move(options));
}

struct LatestOptions {
  std::string root;
  std::string step_naming = "megatron";
  bool json = false;
  bool step_only = false;
};

// Prints the latest step's directory (or step); the damaged steps newer than it as warnings.
int RunLatest(const LatestOptions& o) {
  Result<std::unique_ptr<CheckpointManager>> manager = OpenRoot(o.root, o.step_naming);
  if (!manager.ok()) return Fail(manager.status());
  Result<std::vector<StepInfo>> steps = (*manager)->Steps();
  if (!steps.ok()) return Fail(steps.status());
  const StepInfo* latest = nullptr;
  for (const StepInfo& info : *steps) {
    if (info.state == StepState::kCommitted) latest = &info;
  }
  if (o.json) {
    nlohmann::json list = nlohmann::json::array();
    for (const StepInfo& info : *steps) {
      if (Status s = CheckJsonText(o.root, info.problem); !s.ok()) return Fail(s);
      nlohmann::json item = {{"step", info.step},
                             {"path", info.path},
                             {"state", StepStateName(info.state)},
                             {"marked", info.marked}};
      if (!info.problem.empty()) item["problem"] = info.problem;
      list.push_back(std::move(item));
    }
    if (Status s = CheckJsonText(o.root, ""); !s.ok()) return Fail(s);
    nlohmann::json doc = {{"root", o.root},
                          {"latest_step", latest ? nlohmann::json(latest->step) : nlohmann::json()},
                          {"path", latest ? nlohmann::json(latest->path) : nlohmann::json()},
                          {"steps", list}};
    std::cout << doc.dump(2) << "\n";
    return latest ? 0 : 1;
  }
  for (const StepInfo& info : *steps) {
    if (latest && info.step < latest->step) continue;
    if (info.state == StepState::kDamaged) {
      std::fprintf(stderr, "tessera: warning: step %lld is damaged: %s\n",
                   static_cast<long long>(info.step), Printable(info.problem).c_str());
    }
  }
  if (!latest) return Fail(NotFound("no committed checkpoint under " + Printable(o.root)));
  if (o.step_only) {
    std::printf("%lld\n", static_cast<long long>(latest->step));
  } else {
    std::printf("%s\n", Printable(latest->path).c_str());
  }
  return 0;
}

struct PruneOptions {
  std::string root;
  std::string step_naming = "megatron";
  int keep_last = 0;
  int64_t keep_every = 0;
  bool dry_run = false;
  bool json = false;
  std::string abort_uploads_older_than;  // a duration; empty: leave uploads alone
};

// What --abort-uploads-older-than did on an object store (nullopt: not asked, or not an
// object store).
struct UploadCleanup {
  int64_t older_than_seconds = 0;
  std::vector<std::pair<std::string, bool>> uploads;  // URI, aborted (else younger: kept)
  int aborted = 0;
};

// Aborts the incomplete multipart uploads under the root older than the option's age (what
// savers that died left: their parts cost storage); younger ones may be a save still running.
Result<std::optional<UploadCleanup>> CleanUploads(const PruneOptions& o, int64_t older_than) {
  if (o.abort_uploads_older_than.empty()) return std::optional<UploadCleanup>();
  UploadCleanup cleanup;
  cleanup.older_than_seconds = older_than;
  TESSERA_ASSIGN_OR_RETURN(auto location, OpenStorage(o.root));
  TESSERA_ASSIGN_OR_RETURN(auto uploads, IncompleteUploadsUnder(location.first, location.second));
  if (!uploads) {
    std::fprintf(stderr, "tessera: %s is not on an object store: no multipart uploads to abort\n",
                 Printable(o.root).c_str());
    return std::optional<UploadCleanup>();
  }
  auto* s3 = dynamic_cast<S3Storage*>(location.first.get());
  for (const IncompleteUpload& u : *uploads) {
    const bool old = u.age_seconds >= cleanup.older_than_seconds;  // -1 (unknown): kept
    if (old && !o.dry_run) {
      TESSERA_RETURN_IF_ERROR_CTX(s3->AbortUpload(u),
                                  "aborting the upload " + UploadUri(location.first, u));
    }
    cleanup.uploads.emplace_back(UploadUri(location.first, u), old);
    cleanup.aborted += old ? 1 : 0;
  }
  return std::optional<UploadCleanup>(std::move(cleanup));
}

int RunPrune(const PruneOptions& o) {
  // The age is checked before anything is deleted.
  int64_t older_than = 0;
  if (!o.abort_uploads_older_than.empty()) {
    Result<int64_t> age =
        ParseDurationSeconds(o.abort_uploads_older_than, "--abort-uploads-older-than");
    if (!age.ok()) return Fail(age.status());
    older_than = *age;
  }
  Result<std::unique_ptr<CheckpointManager>> manager = OpenRoot(o.root, o.step_naming);
  if (!manager.ok()) return Fail(manager.status());
  Result<PruneReport> report =
      (*manager)->Prune({.keep_last = o.keep_last, .keep_every = o.keep_every}, o.dry_run);
  if (!report.ok()) return Fail(report.status());
  Result<std::optional<UploadCleanup>> cleanup = CleanUploads(o, older_than);
  if (!cleanup.ok()) return Fail(cleanup.status());
  if (o.json) {
    nlohmann::json list = nlohmann::json::array();
    for (const RetentionDecision& d : report->steps) {
      if (Status s = CheckJsonText(o.root, d.reason); !s.ok()) return Fail(s);
      list.push_back(
          {{"step", d.step}, {"path", d.path}, {"deleted", d.deleted}, {"reason", d.reason}});
    }
    if (Status s = CheckJsonText(o.root, ""); !s.ok()) return Fail(s);
    nlohmann::json doc = {{"root", o.root},
                          {"dry_run", report->dry_run},
                          {"deleted", report->deleted},
                          {"kept", report->steps.size() - report->deleted},
                          {"steps", list}};
    if (*cleanup) {
      nlohmann::json uploads = nlohmann::json::array();
      for (const auto& [uri, aborted] : (*cleanup)->uploads) {
        uploads.push_back({{"uri", uri}, {"aborted", aborted}});
      }
      doc["incomplete_uploads"] = {{"older_than_seconds", (*cleanup)->older_than_seconds},
                                   {"aborted", (*cleanup)->aborted},
                                   {"uploads", uploads}};
    }
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  const size_t width = static_cast<size_t>(std::max(OutputWidth(), 20));
  const char* deleted = o.dry_run ? "would delete" : "deleted";
  for (const RetentionDecision& d : report->steps) {
    const std::string line = Printable(d.path.substr(d.path.find_last_of('/') + 1)) + "  " +
                             PadRight(d.deleted ? deleted : "kept", 12) + "  " +
                             Printable(d.reason);
    std::printf("%s\n", FitEnd(line, width).c_str());
  }
  std::printf("%s %d of %zu step directories under %s%s\n", o.dry_run ? "would delete" : "deleted",
              report->deleted, report->steps.size(), Printable(o.root).c_str(),
              o.dry_run ? " (dry run: nothing changed)" : "");
  if (*cleanup) {
    for (const auto& [uri, aborted] : (*cleanup)->uploads) {
      std::printf("%s  %s\n", Printable(uri).c_str(),
                  aborted ? (o.dry_run ? "would abort" : "aborted") : "kept (younger)");
    }
    std::printf("%s %d of %zu incomplete multipart uploads started %lld s ago or more\n",
                o.dry_run ? "would abort" : "aborted", (*cleanup)->aborted,
                (*cleanup)->uploads.size(), static_cast<long long>((*cleanup)->older_than_seconds));
  }
  return 0;
}

void AddStepNamingOption(CLI::App* cmd, std::string* step_naming) {
  std::string presets;
  for (const StepNamingPreset& p : StepNamingPresets()) {
    presets += std::string(presets.empty() ? "" : ", ") + p.name + " " + p.pattern;
  }
  cmd->add_option("--step-naming", *step_naming,
                  "how the step directories are named: a preset (" + presets +
                      ") or a pattern such as ckpt_{step:06}")
      ->capture_default_str();
}

}  // namespace

void AddManagerCommands(CLI::App& app, int* exit_code) {
  auto latest = std::make_shared<LatestOptions>();
  CLI::App* cmd = app.add_subcommand(
      "latest",
      "Print the newest committed, whole checkpoint of a CheckpointManager's root (its step "
      "directory); exit status 1 when there is none");
  cmd->add_option("ROOT", latest->root, "the root: one directory per step")->required();
  AddStepNamingOption(cmd, &latest->step_naming);
  cmd->add_flag("--step", latest->step_only, "print the step number instead of the directory");
  cmd->add_flag("--json", latest->json, "print one JSON document (every step directory's state)");
  cmd->callback([=] { *exit_code = RunLatest(*latest); });

  auto prune = std::make_shared<PruneOptions>();
  cmd = app.add_subcommand(
      "prune",
      "Delete the step directories of a CheckpointManager's root that a retention policy does "
      "not keep (never the newest committed, a marked one, or one being read or written)");
  cmd->add_option("ROOT", prune->root, "the root: one directory per step")->required();
  AddStepNamingOption(cmd, &prune->step_naming);
  cmd->add_option("--keep-last", prune->keep_last, "keep the newest N committed checkpoints")
      ->required()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--keep-every", prune->keep_every, "also keep every step that is a multiple of M")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--dry-run", prune->dry_run, "say what would be deleted; change nothing");
  cmd->add_option("--abort-uploads-older-than", prune->abort_uploads_older_than,
                  "on an object store, also abort the multipart uploads under the root started "
                  "this long ago or more (e.g. 24h, 90m, 3600): what savers that died left; "
                  "give an age longer than any running save");
  cmd->add_flag("--json", prune->json, "print the report as one JSON document");
  cmd->callback([=] { *exit_code = RunPrune(*prune); });
}

}  // namespace tessera::tools
