#include "format/registry.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "format/huggingface/hf_format.h"
#include "format/tessera/tessera_format.h"
#include "format/torch_dist/dcp_format.h"

namespace tessera {

namespace {

// tessera's own codecs, in detection order: formats with commit files first (tessera before
// DCP: a tessera directory never holds .metadata, and rank manifests beside a DCP checkpoint
// are tessera's), then the format whose data files alone are a checkpoint.
const std::vector<const Format*>& BuiltIn() {
  static const std::vector<const Format*> formats = {
      &TesseraFormat(),
      &TorchDistFormat(),
      &HuggingFaceFormat(),
  };
  return formats;
}

// The table: the built-in codecs, then what ScopedFormatRegistration appends (and removes),
// for tests.
std::vector<const Format*>& Table() {
  static std::vector<const Format*> formats = BuiltIn();
  return formats;
}

}  // namespace

const std::vector<const Format*>& RegisteredFormats() { return Table(); }

bool IsBuiltInFormat(const Format& format) {
  return std::find(BuiltIn().begin(), BuiltIn().end(), &format) != BuiltIn().end();
}

ScopedFormatRegistration::ScopedFormatRegistration(const Format& format) : format_(&format) {
  if (FindFormat(format.id()) != nullptr || FindFormat(format.name()) != nullptr) {
    std::fprintf(stderr, "ScopedFormatRegistration: format %s (id %d) is already registered\n",
                 format.name(), static_cast<int>(format.id()));
    std::abort();
  }
  Table().push_back(format_);
}

ScopedFormatRegistration::~ScopedFormatRegistration() { std::erase(Table(), format_); }

const Format* FindFormat(CheckpointFormat id) {
  for (const Format* format : RegisteredFormats()) {
    if (format->id() == id) return format;
  }
  return nullptr;
}

const Format& FormatOf(CheckpointFormat id) {
  const Format* format = FindFormat(id);
  return format ? *format : *RegisteredFormats().front();
}

const Format* FindFormat(std::string_view name) {
  for (const Format* format : RegisteredFormats()) {
    if (name == format->name()) return format;
  }
  return nullptr;
}

const char* FormatName(CheckpointFormat id) {
  const Format* format = FindFormat(id);
  return format ? format->name() : CheckpointFormatName(id);
}

std::string FormatNames() {
  std::string names;
  for (const Format* format : RegisteredFormats()) {
    if (!names.empty()) names += ", ";
    names += format->name();
  }
  return names;
}

const Format* FormatChoice::primary() const {
  if (!committed.empty()) return committed.front();
  return unfinished ? unfinished : data;
}

DirectoryClaim FormatChoice::primary_claim() const {
  if (!committed.empty()) return DirectoryClaim::kCommitted;
  if (unfinished) return DirectoryClaim::kUnfinished;
  return data ? DirectoryClaim::kData : DirectoryClaim::kNone;
}

FormatChoice ChooseFormats(const std::vector<std::string>& sorted_names) {
  FormatChoice choice;
  for (const Format* format : RegisteredFormats()) {
    switch (format->Claim(sorted_names)) {
      case DirectoryClaim::kCommitted:
        choice.committed.push_back(format);
        break;
      case DirectoryClaim::kUnfinished:
        if (!choice.unfinished) choice.unfinished = format;
        break;
      case DirectoryClaim::kData:
        if (!choice.data) choice.data = format;
        break;
      case DirectoryClaim::kNone:
        break;
    }
  }
  if (choice.unfinished) choice.data = nullptr;  // leftovers are not another format's data
  return choice;
}

const Format* FormatOfFile(std::string_view file_name) {
  for (const Format* format : RegisteredFormats()) {
    if (format->ClaimsFile(file_name)) return format;
  }
  return nullptr;
}

}  // namespace tessera
