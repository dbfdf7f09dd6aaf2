#include "manager/root_files.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <random>
#include <span>

#include "checkpoint/commit.h"
#include "core/utf8.h"

namespace tessera {

namespace {

constexpr int kMaxStepDigits = 19;  // INT64_MAX has 19 digits

bool AllDigits(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

constexpr StepNamingPreset kStepNamingPresets[] = {
    {"megatron", "iter_{step:07}", "Megatron-LM and NeMo"},
    {"torchtitan", "step-{step}", "torchtitan"},
    {"huggingface", "checkpoint-{step}", "transformers' Trainer and accelerate"},
    {"step", "step{step}", "many training scripts"},
    {"global_step", "global_step{step}", "DeepSpeed"},
};

std::string PresetList() {
  std::string list;
  for (const StepNamingPreset& p : kStepNamingPresets) {
    list += (list.empty() ? "" : ", ") + std::string(p.name) + " (" + p.pattern + ")";
  }
  return list;
}

// The part of a pattern around its placeholder: no '/', braces or NUL.
Status CheckPatternText(std::string_view pattern, std::string_view text) {
  for (char c : text) {
    if (c == '/' || c == '{' || c == '}' || c == '\0') {
      return InvalidArgument("the step-name pattern " + QuoteBytes(pattern) +
                             " holds '/', a brace or NUL besides its one {step} placeholder; a "
                             "pattern names one directory, e.g. \"ckpt_{step:06}\"");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string StepNaming::Name(int64_t step) const {
  std::string digits = std::to_string(step);
  if (static_cast<int>(digits.size()) < min_digits) {
    digits.insert(0, min_digits - digits.size(), '0');
  }
  return prefix + digits + suffix;
}

std::optional<int64_t> StepNaming::Parse(std::string_view name) const {
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix)) {
    return std::nullopt;
  }
  const std::string_view digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > kMaxStepDigits || !AllDigits(digits)) return std::nullopt;
  int64_t step = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  if (Name(step) != name) return std::nullopt;  // one spelling per step
  return step;
}

std::string StepNaming::Pattern() const {
  std::string placeholder = "{step}";
  if (min_digits > 0) {
    placeholder = "{step:0" + std::to_string(min_digits) + "}";
  }
  return prefix + placeholder + suffix;
}

std::span<const StepNamingPreset> StepNamingPresets() { return kStepNamingPresets; }

Result<StepNaming> ParseStepNaming(std::string_view preset_or_pattern) {
  std::string_view pattern = preset_or_pattern;
  for (const StepNamingPreset& p : kStepNamingPresets) {
    if (pattern == p.name) pattern = p.pattern;
  }
  if (pattern == "hf") pattern = "checkpoint-{step}";
  const size_t open = pattern.find("{step");
  const size_t close = open == std::string_view::npos ? open : pattern.find('}', open);
  if (close == std::string_view::npos) {
    return InvalidArgument("the step naming " + QuoteBytes(preset_or_pattern) +
                           " is neither a preset nor a pattern with a {step} placeholder; "
                           "presets: " +
                           PresetList() + "; a pattern looks like \"ckpt_{step:06}\"");
  }
  StepNaming naming;
  naming.prefix = std::string(pattern.substr(0, open));
  naming.suffix = std::string(pattern.substr(close + 1));
  const std::string_view spec = pattern.substr(open + 5, close - open - 5);  // "" or ":0N"
  naming.min_digits = 0;
  if (!spec.empty()) {
    const std::string_view width = spec.substr(std::min<size_t>(spec.size(), 2));
    const bool ok = spec.starts_with(":0") && !width.empty() && width.size() <= 2 &&
                    AllDigits(width) && std::stoi(std::string(width)) <= kMaxStepDigits;
    if (!ok) {
      return InvalidArgument("the step-name pattern " + QuoteBytes(preset_or_pattern) +
                             " has the placeholder " +
                             QuoteBytes(pattern.substr(open, close - open + 1)) +
                             "; write {step} (no padding) or {step:0N}, N from 1 to 19 digits");
    }
    naming.min_digits = std::stoi(std::string(width));
  }
  TESSERA_RETURN_IF_ERROR(CheckPatternText(preset_or_pattern, naming.prefix));
  TESSERA_RETURN_IF_ERROR(CheckPatternText(preset_or_pattern, naming.suffix));
  if (naming.prefix.size() + naming.suffix.size() > 200) {
    return InvalidArgument("the step-name pattern " + QuoteBytes(preset_or_pattern) +
                           " is too long (at most 200 characters around {step})");
  }
  return naming;
}

std::string StepDirName(int64_t step) { return StepNaming{}.Name(step); }

std::optional<int64_t> ParseStepDirName(std::string_view name) { return StepNaming{}.Parse(name); }

namespace manager {

constexpr uint64_t kMaxSmallFile = 64 << 10;

namespace {

std::span<const std::byte> AsBytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

}  // namespace

// Both on the commit primitive (Storage::Publish): the file appears under its name with all of
// its bytes or not at all. A file created empty and then written would let another process
// read it in between: a tombstone without its owner lines looks like a dead deletion's, and a
// second deleter would take over a live one.
Status CreateSmallFile(Storage& storage, const std::string& path, std::string_view text,
                       bool sync) {
  return storage.Publish(path, AsBytes(text), PublishMode::kCreateOnly, sync);
}

Status ReplaceSmallFile(Storage& storage, const std::string& path, std::string_view text,
                        bool sync) {
  return storage.Publish(path, AsBytes(text), PublishMode::kReplace, sync);
}

Result<std::string> ReadSmallFile(Storage& storage, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, storage.NewReadableFile(path));
  if (file->size() > kMaxSmallFile) {
    return DataLoss(path + " is " + std::to_string(file->size()) + " bytes long; at most " +
                    std::to_string(kMaxSmallFile) + " expected");
  }
  std::string text(file->size(), '\0');
  TESSERA_RETURN_IF_ERROR(file->ReadAt(0, text.data(), text.size()));
  return text;
}

std::string RandomHex16() {
  std::random_device device;  // the kernel's random source
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(bits));
  return hex;
}

Result<StepDirFiles> ListStepDir(Storage& storage, const std::string& dir) {
  StepDirFiles files;
  TESSERA_ASSIGN_OR_RETURN(files.names, storage.ListDir(dir));
  for (const std::string& name : files.names) {
    // A small file being published ("tessera.reading.<hex>.tsr-tmp-<hex>") is none yet.
    if (ParsePublishTemporaryName(name, nullptr)) continue;
    if (name == kKeepFileName) files.marked = true;
    if (name == kTombstoneFileName) files.tombstone = true;
    if (name.starts_with(kLeasePrefix)) files.leases.push_back(name);
  }
  return files;
}

std::string LiveUser(Storage& storage, const std::string& dir, const StepDirFiles& files) {
  for (const std::string& lease : files.leases) {
    Result<std::string> text = ReadSmallFile(storage, JoinPath(dir, lease));
    if (text.ok() && OwnerRecordMayBeAlive(*text)) {
      return "being read by " + DescribeOwnerRecord(*text) + " (lease " + lease + ")";
    }
  }
  // The in-progress markers of saves, RemoveKeys and Finalize (format/commit.h): "" is no save
  // of ours, so anything else running is another operation.
  const SaveMarkers markers = FindSaveMarkers(storage, dir, files.names, "");
  for (const std::string& id : markers.running) {
    if (!id.empty()) return "being written by a running save (" + id + ")";
  }
  return "";
}

bool IsStorageFailure(const Status& status) {
  const StatusCode code = status.code();
  return code == StatusCode::kIOError || code == StatusCode::kDeadlineExceeded ||
         code == StatusCode::kAborted;
}

Result<StepInfo> ExamineStep(const std::shared_ptr<Storage>& storage, const std::string& dir,
                             int64_t step, const StepDirFiles& files, Metadata* metadata,
                             Status* damage) {
  StepInfo info;
  info.step = step;
  info.path = dir;
  info.marked = files.marked;
  if (files.tombstone) {
    info.state = StepState::kDeleting;
    Result<std::string> text = ReadSmallFile(*storage, JoinPath(info.path, kTombstoneFileName));
    info.problem = text.ok() && OwnerRecordMayBeAlive(*text)
                       ? "being deleted by " + DescribeOwnerRecord(*text)
                       : "a deletion that did not finish (the next prune finishes it)";
    return info;
  }
  Metadata m;
  Result<bool> committed = IsCommitted(info.path, storage, &m);
  if (IsStorageFailure(committed.status())) {
    return committed.status().WithContext("reading step " + std::to_string(step) + " at " + dir +
                                          " (the storage failed: the step may be whole)");
  }
  if (!committed.ok()) {
    info.state = StepState::kDamaged;
    info.problem = committed.status().message();
    if (damage != nullptr) *damage = committed.status();
    return info;
  }
  if (!*committed) {
    info.state = StepState::kUncommitted;
    return info;
  }
  auto recorded = m.user_metadata.find(kStepMetadataKey);
  if (recorded != m.user_metadata.end() && recorded->second != std::to_string(step)) {
    info.state = StepState::kDamaged;
    info.problem = info.path + " holds the checkpoint of step " + recorded->second +
                   " (its user metadata says so), not of step " + std::to_string(step);
    if (damage != nullptr) *damage = DataLoss(info.problem);
    return info;
  }
  info.state = StepState::kCommitted;
  if (metadata != nullptr) *metadata = std::move(m);
  return info;
}

Result<std::vector<int64_t>> ListStepNumbers(Storage& storage, const std::string& root,
                                             const StepNaming& naming,
                                             std::vector<std::string>* links) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.ListDir(root));
  std::vector<int64_t> steps;
  for (const std::string& name : names) {
    if (std::optional<int64_t> step = naming.Parse(name)) {
      Result<bool> link = storage.IsSymlink(JoinPath(root, name));
      if (!link.ok() || *link) {  // an lstat that fails: not known to be a directory of ours
        if (links != nullptr) links->push_back(name);
        continue;
      }
      // A file of that name is not a step directory; one that vanished since the listing is no
      // step. Any other failure stops the listing: leaving the step out would hide it.
      Result<FileType> type = storage.Stat(JoinPath(root, name));
      if (!type.ok() && type.status().code() != StatusCode::kNotFound) {
        return type.status().WithContext("listing the steps under " + root);
      }
      if (type.ok() && *type == FileType::kDirectory) steps.push_back(*step);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

namespace {

// The names of a listing, quoted, at most a few, for a message.
std::string SomeNames(const std::vector<std::string>& names) {
  constexpr size_t kShown = 4;
  std::string text;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    text += (i ? ", " : "") + QuoteBytes(names[i]);
  }
  if (names.size() > kShown) text += " and " + std::to_string(names.size() - kShown) + " more";
  return text;
}

using PresetNamings = std::vector<std::pair<const StepNamingPreset*, StepNaming>>;

// The presets other than `naming`, parsed once.
PresetNamings OtherPresets(const StepNaming& naming) {
  PresetNamings others;
  for (const StepNamingPreset& p : StepNamingPresets()) {
    Result<StepNaming> other = ParseStepNaming(p.name);
    if (other.ok() && other->Pattern() != naming.Pattern()) others.emplace_back(&p, *other);
  }
  return others;
}

// The preset of `others` that names `name` a step directory, or null.
const StepNamingPreset* PresetNaming(std::string_view name, const PresetNamings& others) {
  for (const auto& [preset, other] : others) {
    if (other.Parse(name)) return preset;
  }
  return nullptr;
}

}  // namespace

Status CheckStepNaming(const StepNaming& naming) {
  if (naming.min_digits < 0 || naming.min_digits > kMaxStepDigits) {
    return InvalidArgument("StepNaming::min_digits is " + std::to_string(naming.min_digits) +
                           "; 0 to 19 digits");
  }
  return ParseStepNaming(naming.Pattern()).status();
}

Status ExplainNoSteps(const std::shared_ptr<Storage>& storage, const std::string& root,
                      const StepNaming& naming) {
  const std::string looked_for =
      "no step directory named " + QuoteBytes(naming.Pattern()) + " under " + QuoteBytes(root);
  Result<bool> itself = IsCommitted(root, storage);
  if (itself.ok() && *itself) {
    return InvalidArgument(looked_for +
                           ": it is itself a checkpoint, not a root of step "
                           "directories; pass the directory above it as the root");
  }
  Result<std::vector<std::string>> names = storage->ListDir(root);
  if (names.status().code() == StatusCode::kNotFound) return Status::Ok();  // a fresh run
  TESSERA_RETURN_IF_ERROR(names.status());
  std::map<const StepNamingPreset*, std::vector<std::string>> by_preset;
  std::vector<std::string> checkpoints;  // directories holding one, under other names
  int examined = 0;
  const PresetNamings others = OtherPresets(naming);
  for (const std::string& name : *names) {
    const std::string path = JoinPath(root, name);
    // Names first (no I/O); a name no preset knows costs a Stat and an IsCommitted, for the
    // first kMaxExplainedDirs of them only.
    const StepNamingPreset* preset = PresetNaming(name, others);
    if (preset == nullptr && examined >= kMaxExplainedDirs) continue;
    Result<FileType> type = storage->Stat(path);
    if (!type.ok() || *type != FileType::kDirectory) continue;
    if (preset != nullptr) {
      by_preset[preset].push_back(name);
    } else {
      ++examined;
      Result<bool> holds = IsCommitted(path, storage);
      if (!holds.ok() || *holds) checkpoints.push_back(name);
    }
  }
  if (!by_preset.empty()) {
    // The preset that names the most of them.
    auto best = std::max_element(
        by_preset.begin(), by_preset.end(),
        [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    const StepNamingPreset& p = *best->first;
    const std::string name = p.name;
    return InvalidArgument(looked_for + "; it holds " + SomeNames(best->second) +
                           ", step directories as " + p.written_by + " name them (" + p.pattern +
                           "): pass the step naming \"" + name + "\" (Python: step_naming=\"" +
                           name + "\"; CLI: --step-naming " + name +
                           "; C++: CheckpointManagerOptions::step_naming)");
  }
  if (!checkpoints.empty()) {
    return InvalidArgument(looked_for +
                           "; it holds checkpoints under other names: " + SomeNames(checkpoints) +
                           ". Pass a step naming that names them: a preset (" + PresetList() +
                           ") or a pattern such as \"ckpt_{step:06}\"");
  }
  return Status::Ok();
}

Result<std::vector<int64_t>> ListStepsOfRoot(const std::shared_ptr<Storage>& storage,
                                             const std::string& root, const StepNaming& naming,
                                             std::vector<std::string>* links) {
  Result<std::vector<int64_t>> steps = ListStepNumbers(*storage, root, naming, links);
  const bool none = steps.ok() ? steps->empty() && (links == nullptr || links->empty())
                               : steps.status().code() == StatusCode::kNotFound;
  if (none) TESSERA_RETURN_IF_ERROR(ExplainNoSteps(storage, root, naming));
  return steps;
}

namespace {

bool IsDataFile(const std::string& name) {
  return name.ends_with(".safetensors") || name.ends_with(".distcp");
}

// Takes the tombstone of `dir`: creates it, or takes over one whose owner died.
Status TakeTombstone(Storage& storage, const std::string& dir, bool sync) {
  const std::string path = JoinPath(dir, kTombstoneFileName);
  const std::string record = "tessera deletion\n" + ThisProcessOwnerRecord();
  Status created = CreateSmallFile(storage, path, record, sync);
  if (created.code() != StatusCode::kAlreadyExists) return created;
  Result<std::string> text = ReadSmallFile(storage, path);
  if (text.ok() && OwnerRecordMayBeAlive(*text)) {
    return FailedPrecondition(dir + " is being deleted by " + DescribeOwnerRecord(*text));
  }
  // The deletion that wrote it died: this one finishes it.
  return ReplaceSmallFile(storage, path, record, sync);
}

}  // namespace

Status DeleteStepDir(Storage& storage, const std::string& root, const std::string& dir, bool sync) {
  TESSERA_ASSIGN_OR_RETURN(bool link, storage.IsSymlink(dir));
  if (link) {
    return FailedPrecondition(dir + " is a symbolic link: tessera deletes nothing through it");
  }
  TESSERA_RETURN_IF_ERROR(TakeTombstone(storage, dir, sync));
  // Readers write their lease before they look for a tombstone; this looks for leases after
  // writing the tombstone: a reader this misses sees the tombstone and backs off.
  TESSERA_ASSIGN_OR_RETURN(StepDirFiles files, ListStepDir(storage, dir));
  const std::string user = LiveUser(storage, dir, files);
  if (!user.empty() || files.marked) {
    storage.Remove(JoinPath(dir, kTombstoneFileName)).IgnoreError();
    return FailedPrecondition(dir + (files.marked ? " is marked to be kept" : " is " + user));
  }
  std::vector<std::string> order;
  for (const std::string& name : files.names) {
    if (name != kTombstoneFileName && !IsDataFile(name)) order.push_back(name);
  }
  for (const std::string& name : files.names) {
    if (IsDataFile(name)) order.push_back(name);
  }
  for (const std::string& name : order) {
    Status removed = storage.Remove(JoinPath(dir, name));
    if (!removed.ok() && removed.code() != StatusCode::kNotFound) {
      return removed.WithContext("deleting " + dir);
    }
  }
  Status removed = storage.Remove(JoinPath(dir, kTombstoneFileName));
  if (!removed.ok() && removed.code() != StatusCode::kNotFound) return removed;
  Status dir_removed = storage.RemoveDir(dir);
  if (!dir_removed.ok() && dir_removed.code() != StatusCode::kNotFound &&
      dir_removed.code() != StatusCode::kUnimplemented) {  // a store without directories
    return dir_removed.WithContext("deleting " + dir);
  }
  if (sync) TESSERA_RETURN_IF_ERROR(storage.SyncDir(root));
  return Status::Ok();
}

}  // namespace manager
}  // namespace tessera
