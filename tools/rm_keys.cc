// tessera rm-keys: RemoveKeys from the command line.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/utf8.h"
#include "tessera/checkpoint.h"
#include "tessera/remove_keys.h"
#include "tools/commands.h"
#include "tools/json_output.h"
#include "tools/progress.h"
#include "tools/text.h"

namespace tessera::tools {
namespace {

// Removed keys listed in text output before "... and N more".
constexpr size_t kListedKeys = 20;

struct RmKeysOptions {
  std::string path;
  std::vector<std::string> prefixes;
  bool dry_run = false;
  bool json = false;
  bool sync = true;
  int io_threads = 2;
  ProgressFlags progress;
};

void PrintReportJson(const RmKeysOptions& o, const RemoveKeysReport& r) {
  nlohmann::json doc;
  doc["path"] = o.path;
  doc["dry_run"] = r.dry_run;
  doc["prefixes"] = nlohmann::json::array();
  for (size_t p = 0; p < o.prefixes.size(); ++p) {
    doc["prefixes"].push_back({{"prefix", o.prefixes[p]}, {"keys", r.matches_per_prefix[p]}});
  }
  doc["removed_tensors"] = r.removed_tensors;
  doc["removed_objects"] = r.removed_objects;
  doc["files_before"] = r.files_before;
  doc["files_after"] = r.files_after;
  doc["files_dropped"] = r.files_dropped;
  doc["files_rewritten"] = r.files_rewritten;
  doc["bytes_before"] = r.bytes_before;
  doc["bytes_after"] = r.bytes_after;
  doc["bytes_freed"] = r.bytes_before - r.bytes_after;
  doc["bytes_copied"] = r.bytes_copied;
  doc["save_id"] = r.save_id;
  PrintJson(std::move(doc));
}

void PrintText(const RmKeysOptions& o, const RemoveKeysReport& r) {
  const size_t width = static_cast<size_t>(std::max(OutputWidth(), 20));
  auto print = [&](const std::string& line) { std::printf("%s\n", FitEnd(line, width).c_str()); };
  const size_t removed = r.removed_tensors.size() + r.removed_objects.size();
  const std::string verb = r.dry_run ? "would remove " : "removed ";
  if (removed == 0) {
    print("nothing to remove: no key of " + Printable(o.path) + " starts with the prefixes given");
    return;
  }
  print(verb + std::to_string(r.removed_tensors.size()) + " tensors and " +
        std::to_string(r.removed_objects.size()) + " objects from " + Printable(o.path) +
        (r.dry_run ? " (dry run: nothing changed)" : ""));
  for (size_t p = 0; p < o.prefixes.size(); ++p) {
    print("  prefix " + Printable(o.prefixes[p]) + ": " + std::to_string(r.matches_per_prefix[p]) +
          " keys" + (r.matches_per_prefix[p] == 0 ? " (matches no key)" : ""));
  }
  std::vector<std::string> keys = r.removed_tensors;
  keys.insert(keys.end(), r.removed_objects.begin(), r.removed_objects.end());
  for (size_t i = 0; i < keys.size() && i < kListedKeys; ++i) {
    for (const std::string& piece : Wrap("    " + Printable(keys[i]), width)) print(piece);
  }
  if (keys.size() > kListedKeys) {
    print("    ... and " + std::to_string(keys.size() - kListedKeys) +
          " more (--json lists them all)");
  }
  const int kept = r.files_before - r.files_dropped - r.files_rewritten;
  print("files: " + std::to_string(r.files_before) + " -> " + std::to_string(r.files_after) + " (" +
        std::to_string(r.files_dropped) + " dropped, " + std::to_string(r.files_rewritten) +
        " rewritten, " + std::to_string(kept) + " untouched); " +
        (r.dry_run ? "would copy " : "copied ") + FormatBytes(r.bytes_copied));
  print("bytes: " + FormatBytes(r.bytes_before) + " -> " + FormatBytes(r.bytes_after) + " (" +
        FormatBytes(r.bytes_before - r.bytes_after) + (r.dry_run ? " would be" : "") + " freed)");
}

int RunRmKeys(const RmKeysOptions& o) {
  // A prefix that matches no key is a mistake (a typo, the wrong checkpoint), not a removal of
  // nothing: refused before anything is removed.
  if (Status s = CheckEveryPrefixMatches(o.path, o.prefixes, "nothing was removed"); !s.ok()) {
    return Fail(s);
  }
  ProgressBar bar("rm-keys", o.dry_run ? ProgressMode::kQuiet : o.progress.Mode());
  RemoveKeysOptions options;
  options.dry_run = o.dry_run;
  options.sync = o.sync ? SyncPolicy::kFull : SyncPolicy::kNone;
  options.num_io_threads = o.io_threads;
  if (bar.active()) options.progress = bar.Callback();
  Result<RemoveKeysReport> report = RemoveKeys(o.path, o.prefixes, options);
  bar.Finish();
  if (!report.ok()) return Fail(report.status());
  if (o.json) {
    PrintReportJson(o, *report);
  } else {
    PrintText(o, *report);
  }
  return 0;
}

}  // namespace

Status CheckEveryPrefixMatches(const std::string& path, const std::vector<std::string>& prefixes,
                               const std::string& consequence) {
  for (const std::string& p : prefixes) {
    if (p.empty() || !IsValidUtf8(p)) return Status::Ok();
  }
  if (prefixes.empty()) return Status::Ok();
  Result<Metadata> m = ReadMetadata(path);
  if (!m.ok()) return Status::Ok();
  std::vector<std::string> keys;
  for (const TensorInfo& t : m->tensors) keys.push_back(t.key);
  for (const ObjectInfo& ob : m->objects) keys.push_back(ob.key);
  for (const std::string& p : prefixes) {
    if (std::any_of(keys.begin(), keys.end(),
                    [&](const std::string& k) { return k.starts_with(p); })) {
      continue;
    }
    std::string hint;
    for (const std::string& c : ClosestNames(p, keys)) {
      hint += (hint.empty() ? " (did you mean '" : " or '") + Printable(c) + "'";
    }
    if (!hint.empty()) hint += "?)";
    return NotFound("no key of " + Printable(path) + " starts with the prefix '" + Printable(p) +
                    "'" + hint + "; " + consequence);
  }
  return Status::Ok();
}

void AddRmKeysCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<RmKeysOptions>();
  CLI::App* cmd = app.add_subcommand(
      "rm-keys",
      "Remove every tensor and object whose key starts with a prefix, and free their bytes "
      "(crash-safe; tessera checkpoints)");
  cmd->add_option("PATH", o->path, "checkpoint directory")->required();
  cmd->add_option("--prefix", o->prefixes, "key prefix to remove, e.g. optimizer. (repeatable)")
      ->required();
  cmd->add_flag("--dry-run", o->dry_run,
                "say what would be removed, copied and freed; change nothing");
  cmd->add_flag("--json", o->json, "print the report as one JSON document");
  auto no_sync = std::make_shared<bool>(false);
  cmd->add_flag("--no-sync", *no_sync, "skip fsync (no durability against a machine crash)");
  cmd->add_option("--io-threads", o->io_threads, "data files rewritten at once")
      ->capture_default_str();
  AddProgressFlags(*cmd, o->progress);
  cmd->callback([=] {
    o->sync = !*no_sync;
    *exit_code = RunRmKeys(*o);
  });
}

// tessera finalize PATH: a rank-local save's rank manifests merged into one manifest.
void AddFinalizeCommand(CLI::App& app, int* exit_code) {
  auto path = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "finalize",
      "Merge the rank manifests of a rank-local save into one committed manifest (atomic) and "
      "remove the files of earlier saves");
  cmd->add_option("PATH", *path, "checkpoint directory")->required();
  cmd->callback([=] {
    Result<Metadata> merged = Finalize(*path);
    if (!merged.ok()) {
      *exit_code = Fail(merged.status());
      return;
    }
    std::printf("finalized %s: save %s of %d ranks (tensors: %zu, objects: %zu, chunks: %llu)\n",
                path->c_str(), merged->save_id.c_str(), merged->num_ranks, merged->tensors.size(),
                merged->objects.size(), static_cast<unsigned long long>(merged->TotalChunks()));
    *exit_code = 0;
  });
}

}  // namespace tessera::tools
