// Load: the protocol of ../shared/DESIGN.md, "Load protocol".
//
//   1. rank 0 reads the manifest           -> Broadcast; every rank decodes it
//   2. every rank plans its reads (no I/O) -> AllReduce of which keys anyone asked for
//   3. agree that every rank's plan is good, then read, then agree on the outcome
//
// Nothing in the caller's memory is touched unless every rank's request is valid.
#include <algorithm>
#include <map>
#include <thread>

#include "checkpoint/envelope.h"
#include "checkpoint/reader.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "plan/load_plan.h"
#include "tessera/checkpoint.h"

namespace tessera {
namespace {

constexpr int kCoordinator = 0;

}  // namespace

Result<LoadReport> Load(StateDict& state, const std::string& path, Comm& comm,
                        const LoadOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : NewPosixStorage();
  if (options.num_io_threads < 1) {
    return InvalidArgument("LoadOptions::num_io_threads must be at least 1, got " +
                           std::to_string(options.num_io_threads));
  }
  // 1. The manifest, read once and shared.
  Bytes manifest;
  if (comm.rank() == kCoordinator) {
    Result<Bytes> bytes = ReadManifestBytes(*storage, path);
    manifest = bytes.ok() ? Seal(Status::Ok(), std::move(*bytes)) : Seal(bytes.status());
  }
  TESSERA_RETURN_IF_ERROR(comm.Broadcast(&manifest, kCoordinator));
  TESSERA_ASSIGN_OR_RETURN(std::span<const uint8_t> manifest_bytes, Open(manifest, "rank 0"));
  TESSERA_ASSIGN_OR_RETURN(Metadata metadata,
                           DecodeManifest(manifest_bytes, JoinPath(path, kManifestFileName)));
  manifest = Bytes();

  // 2. Plan this rank's reads; learn which keys any rank asked for.
  Result<RankReadPlan> planned =
      PlanRankReads(metadata, state, path, options.missing_keys == KeyPolicy::kSkip);
  const size_t num_keys = metadata.tensors.size() + metadata.objects.size();
  std::vector<int64_t> asked = planned.ok() ? planned->asked : std::vector<int64_t>(num_keys, 0);
  TESSERA_RETURN_IF_ERROR(comm.AllReduce(asked, ReduceOp::kMax));
  LoadReport report;
  Status plan_status = planned.status();
  if (plan_status.ok()) {
    report.missing_keys = planned->missing_keys;
    report.shape_mismatched_keys = planned->shape_mismatched_keys;
    report.bytes_needed = planned->bytes_needed;
    for (size_t k = 0; k < num_keys; ++k) {
      if (asked[k]) continue;
      report.unexpected_keys.push_back(k < metadata.tensors.size()
                                           ? metadata.tensors[k].key
                                           : metadata.objects[k - metadata.tensors.size()].key);
    }
    const auto& unexpected = report.unexpected_keys;
    if (!unexpected.empty() && options.unexpected_keys == KeyPolicy::kError) {
      std::string list;
      for (size_t i = 0; i < unexpected.size() && i < 10; ++i) {
        list += (i ? ", '" : "'") + unexpected[i] + "'";
      }
      if (unexpected.size() > 10) list += ", ... (" + std::to_string(unexpected.size()) + " keys)";
      plan_status =
          InvalidArgument("the checkpoint at " + path + " has keys no rank asked for: " + list +
                          " (set LoadOptions::unexpected_keys = kSkip to ignore)");
    }
  }
  // 3. Read only if every rank's plan is good; then agree on the outcome.
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, plan_status));
  const RankReadPlan& plan = *planned;
  Status read_status = ExecuteReads(*storage, path, metadata, plan.runs, options, report);
  if (read_status.ok()) {
    for (const ObjectRead& read : plan.objects) {
      read_status =
          ReadObject(*storage, path, metadata, *read.info, options, read.destination->data, report);
      if (!read_status.ok()) break;
    }
  }
  TESSERA_RETURN_IF_ERROR(AgreeOnStatus(comm, read_status));
  return report;
}

Result<LoadReport> Load(StateDict& state, const std::string& path, const LoadOptions& options) {
  std::unique_ptr<Comm> comm = NewSingleRankComm();
  return Load(state, path, *comm, options);
}

}  // namespace tessera
