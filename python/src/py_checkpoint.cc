// Save, Load, AsyncSave, ReadMetadata, Verify, RemoveKeys and the structs they take and
// return. Every call into the library releases the GIL.
#include "py_checkpoint.h"

#include <pybind11/stl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "core/checksum.h"
#include "core/utf8.h"
#include "format/registry.h"
#include "format/tessera/manifest.h"
#include "py_async.h"
#include "py_comm.h"
#include "py_state.h"
#include "py_status.h"
#include "tessera/async_save.h"
#include "tessera/checkpoint.h"
#include "tessera/convert.h"
#include "tessera/remove_keys.h"

namespace py = pybind11;

namespace tessera::python {
namespace {

std::string BoxRepr(const Box& box) { return box.ToString(); }

py::list TextList(const std::vector<std::string>& texts) {
  py::list out;
  for (const std::string& text : texts) out.append(TextToStr(text));
  return out;
}

// Runs `call` (returning a Result) without the GIL and returns its value or throws.
template <typename F>
auto WithoutGil(F&& call) {
  auto result = [&] {
    py::gil_scoped_release release;
    return call();
  }();
  return ValueOrThrow(std::move(result));
}

// A Python progress callable in a C++ options struct (SaveOptions::progress, ...). The library
// calls it from the thread that called the operation, which runs without the GIL: each call
// takes the GIL. The first exception it raises (a KeyboardInterrupt arrives this way, as the
// callable is the only Python code running during the operation) stops further calls and is
// re-raised once the operation returns (RethrowProgressError).
struct PyProgressFn {
  struct State {
    py::object fn;
    std::unique_ptr<py::error_already_set> error;
    // The last copy may go on a thread without the GIL (a copy of the options).
    ~State() {
      py::gil_scoped_acquire gil;
      error.reset();
      fn = py::object();
    }
  };
  std::shared_ptr<State> state;

  void operator()(uint64_t done, uint64_t total) const {
    py::gil_scoped_acquire gil;
    if (state->error) return;
    try {
      state->fn(done, total);
    } catch (py::error_already_set& e) {
      state->error = std::make_unique<py::error_already_set>(std::move(e));
    }
  }
};

std::function<void(uint64_t, uint64_t)> ProgressFromPython(py::object fn) {
  if (fn.is_none()) return nullptr;
  if (!PyCallable_Check(fn.ptr())) {
    throw py::type_error("progress must be a callable progress(done, total), not " +
                         std::string(py::str(py::type::of(fn).attr("__name__"))));
  }
  auto state = std::make_shared<PyProgressFn::State>();
  state->fn = std::move(fn);
  return PyProgressFn{std::move(state)};
}

py::object ProgressToPython(const std::function<void(uint64_t, uint64_t)>& progress) {
  const PyProgressFn* f = progress.target<PyProgressFn>();
  return f ? f->state->fn : py::none();
}

// Re-raises what the progress callable raised during the operation, if anything. Requires the
// GIL.
void RethrowProgressError(const std::function<void(uint64_t, uint64_t)>& progress) {
  const PyProgressFn* f = progress.target<PyProgressFn>();
  if (f == nullptr || !f->state->error) return;
  py::error_already_set error = std::move(*f->state->error);
  f->state->error.reset();
  throw error;
}

// Runs `call` (returning a Result) without the GIL; raises what the progress callable raised,
// else the call's error; returns its value.
template <typename F>
auto WithProgress(const std::function<void(uint64_t, uint64_t)>& progress, F&& call) {
  auto result = [&] {
    py::gil_scoped_release release;
    return call();
  }();
  RethrowProgressError(progress);
  return ValueOrThrow(std::move(result));
}

// format_options of SaveOptions or ConvertOptions as Python sees it: None or a TorchDistOptions.
template <typename Options>
py::object FormatOptionsToPython(const Options& o) {
  const auto* torch_dist = std::get_if<TorchDistOptions>(&o.format_options);
  return torch_dist ? py::cast(*torch_dist) : py::none();
}
template <typename Options>
void FormatOptionsFromPython(Options& o, const py::object& value) {
  if (value.is_none()) {
    o.format_options = std::monostate();
  } else {
    o.format_options = value.cast<TorchDistOptions>();  // TypeError for anything else
  }
}

// The TorchDistOptions of `o` (defaults when it holds none), and the ones to change (placed in
// format_options when it holds none).
template <typename Options>
TorchDistOptions TorchDistOf(const Options& o) {
  const auto* torch_dist = std::get_if<TorchDistOptions>(&o.format_options);
  return torch_dist ? *torch_dist : TorchDistOptions();
}
template <typename Options>
TorchDistOptions& MutableTorchDist(Options& o) {
  if (!std::holds_alternative<TorchDistOptions>(o.format_options)) {
    o.format_options = TorchDistOptions();
  }
  return std::get<TorchDistOptions>(o.format_options);
}

void RegisterOptions(py::module_& m) {
  py::enum_<SyncPolicy>(m, "SyncPolicy")
      .value("FULL", SyncPolicy::kFull)
      .value("NONE", SyncPolicy::kNone);
  py::enum_<KeyPolicy>(m, "KeyPolicy")
      .value("ERROR", KeyPolicy::kError)
      .value("SKIP", KeyPolicy::kSkip);
  py::enum_<ReadSharing>(m, "ReadSharing")
      .value("NONE", ReadSharing::kNone)
      .value("BROADCAST", ReadSharing::kBroadcast)
      .value("ALL_GATHER", ReadSharing::kAllGather)
      .value("READ_ONCE", ReadSharing::kReadOnce)
      .value("AUTO", ReadSharing::kAuto);
  py::enum_<CheckpointFormat>(m, "CheckpointFormat")
      .value("TESSERA", CheckpointFormat::kTessera)
      .value("TORCH_DIST", CheckpointFormat::kTorchDist)
      .value("SAFETENSORS", CheckpointFormat::kSafetensors);
  py::enum_<TorchDistFlavor>(m, "TorchDistFlavor")
      .value("TORCH_2", TorchDistFlavor::kTorch2)
      .value("TORCH_1_13", TorchDistFlavor::kTorch113);
  py::class_<TorchDistOptions>(m, "TorchDistOptions",
                               "Options of the torch_dist format (include/tessera/formats.h).")
      .def(py::init([](TorchDistFlavor flavor,
                       std::map<std::string, std::vector<TorchDistPathElement>> key_paths) {
             return TorchDistOptions{flavor, std::move(key_paths)};
           }),
           py::arg("flavor") = TorchDistFlavor::kTorch2,
           py::arg("key_paths") = std::map<std::string, std::vector<TorchDistPathElement>>())
      .def_readwrite("flavor", &TorchDistOptions::flavor)
      .def_readwrite("key_paths", &TorchDistOptions::key_paths);
  py::enum_<WhenBusy>(m, "WhenBusy")
      .value("WAIT", WhenBusy::kWait)
      .value("QUEUE", WhenBusy::kQueue);
  py::enum_<StagingMode>(m, "StagingMode")
      .value("BLOCKING", StagingMode::kBlocking)
      .value("DEFERRED", StagingMode::kDeferred);

  // Field for field the C++ structs (checkpoint.h documents each default and cost); the
  // Python functions set them from keyword arguments of the same names.
  py::class_<SaveOptions>(m, "SaveOptions")
      .def(py::init<>())
      .def_readwrite("num_io_threads", &SaveOptions::num_io_threads)
      .def_readwrite("sync", &SaveOptions::sync)
      .def_readwrite("balance_writes", &SaveOptions::balance_writes)
      .def_readwrite("user_metadata", &SaveOptions::user_metadata)
      .def_readwrite("remove_stale_files", &SaveOptions::remove_stale_files)
      .def_readwrite("plan_cache", &SaveOptions::plan_cache)
      .def_readwrite("format", &SaveOptions::format)
      .def_property("format_options", &FormatOptionsToPython<SaveOptions>,
                    &FormatOptionsFromPython<SaveOptions>)
      // The Python arguments torch_dist_flavor and torch_dist_key_paths: TorchDistOptions in
      // format_options (never the deprecated C++ fields of the same names).
      .def_property(
          "torch_dist_flavor", [](const SaveOptions& o) { return TorchDistOf(o).flavor; },
          [](SaveOptions& o, TorchDistFlavor v) { MutableTorchDist(o).flavor = v; })
      .def_property(
          "torch_dist_key_paths", [](const SaveOptions& o) { return TorchDistOf(o).key_paths; },
          [](SaveOptions& o, std::map<std::string, std::vector<TorchDistPathElement>> v) {
            MutableTorchDist(o).key_paths = std::move(v);
          })
      .def_readwrite("separate_prefixes", &SaveOptions::separate_prefixes)
      .def_readwrite("collective", &SaveOptions::collective)
      .def_readwrite("save_tag", &SaveOptions::save_tag)
      // DeviceStagingOptions of CUDA tensors, flat (include/tessera/device.h).
      .def_property(
          "pinned_bytes", [](const SaveOptions& o) { return o.device_staging.pinned_bytes; },
          [](SaveOptions& o, uint64_t v) { o.device_staging.pinned_bytes = v; })
      .def_property(
          "device_piece_bytes", [](const SaveOptions& o) { return o.device_staging.piece_bytes; },
          [](SaveOptions& o, uint64_t v) { o.device_staging.piece_bytes = v; })
      .def_property(
          "progress", [](const SaveOptions& o) { return ProgressToPython(o.progress); },
          [](SaveOptions& o, py::object fn) { o.progress = ProgressFromPython(std::move(fn)); });
  py::class_<LoadOptions>(m, "LoadOptions")
      .def(py::init<>())
      .def_readwrite("missing_keys", &LoadOptions::missing_keys)
      .def_readwrite("unexpected_keys", &LoadOptions::unexpected_keys)
      .def_readwrite("verify_checksums", &LoadOptions::verify_checksums)
      .def_readwrite("verify_partial_chunks", &LoadOptions::verify_partial_chunks)
      .def_readwrite("num_io_threads", &LoadOptions::num_io_threads)
      .def_readwrite("cast_dtypes", &LoadOptions::cast_dtypes)
      .def_readwrite("read_sharing", &LoadOptions::read_sharing)
      .def_readwrite("exchange_bytes", &LoadOptions::exchange_bytes)
      .def_property(
          "pinned_bytes", [](const LoadOptions& o) { return o.device_staging.pinned_bytes; },
          [](LoadOptions& o, uint64_t v) { o.device_staging.pinned_bytes = v; })
      .def_property(
          "device_piece_bytes", [](const LoadOptions& o) { return o.device_staging.piece_bytes; },
          [](LoadOptions& o, uint64_t v) { o.device_staging.piece_bytes = v; })
      .def_property(
          "progress", [](const LoadOptions& o) { return ProgressToPython(o.progress); },
          [](LoadOptions& o, py::object fn) { o.progress = ProgressFromPython(std::move(fn)); });
  py::class_<AsyncSaveOptions>(m, "AsyncSaveOptions")
      .def(py::init<>())
      .def_readwrite("save", &AsyncSaveOptions::save)
      .def_readwrite("when_busy", &AsyncSaveOptions::when_busy)
      .def_readwrite("staging", &AsyncSaveOptions::staging)
      .def_readwrite("staging_threads", &AsyncSaveOptions::staging_threads)
      .def_readwrite("staging_piece_bytes", &AsyncSaveOptions::staging_piece_bytes)
      .def_readwrite("check_unchanged_until_staged",
                     &AsyncSaveOptions::check_unchanged_until_staged)
      .def_readwrite("background_nice", &AsyncSaveOptions::background_nice)
      .def_readwrite("staging_budget_bytes", &AsyncSaveOptions::staging_budget_bytes);
}

// ConvertOptions without `to`, `dtype` and `progress`, which _convert takes as arguments
// (a format name, a dtype name, a Python callable).
void RegisterConvert(py::module_& m) {
  py::class_<ConvertOptions>(m, "ConvertOptions")
      .def(py::init<>())
      .def_readwrite("max_file_bytes", &ConvertOptions::max_file_bytes)
      .def_readwrite("keys", &ConvertOptions::keys)
      .def_readwrite("strip_prefix", &ConvertOptions::strip_prefix)
      .def_readwrite("num_threads", &ConvertOptions::num_threads)
      .def_readwrite("buffer_bytes", &ConvertOptions::buffer_bytes)
      .def_readwrite("sync", &ConvertOptions::sync)
      .def_property("format_options", &FormatOptionsToPython<ConvertOptions>,
                    &FormatOptionsFromPython<ConvertOptions>)
      .def_property(
          "torch_dist_flavor", [](const ConvertOptions& o) { return TorchDistOf(o).flavor; },
          [](ConvertOptions& o, TorchDistFlavor v) { MutableTorchDist(o).flavor = v; })
      .def_readwrite("verify_checksums", &ConvertOptions::verify_checksums);
  py::class_<ConvertReport>(m, "ConvertReport", "What tessera.convert wrote.")
      .def_property_readonly(
          "source_format",
          [](const ConvertReport& r) { return CheckpointFormatName(r.source_format); })
      .def_readonly("tensors", &ConvertReport::tensors, "written, by all ranks")
      .def_readonly("objects", &ConvertReport::objects, "written, by all ranks")
      .def_readonly("total_bytes", &ConvertReport::total_bytes, "of the output, all ranks")
      .def_readonly("bytes_written", &ConvertReport::bytes_written, "by this rank")
      .def_readonly("bytes_read", &ConvertReport::bytes_read, "from the source, by this rank")
      .def_property_readonly("files", [](const ConvertReport& r) { return TextList(r.files); })
      .def_readonly("files_written", &ConvertReport::files_written, "by this rank")
      .def_property_readonly("skipped_objects",
                             [](const ConvertReport& r) { return TextList(r.skipped_objects); })
      .def("__repr__", [](const ConvertReport& r) {
        return "ConvertReport(source_format='" +
               std::string(CheckpointFormatName(r.source_format)) +
               "', tensors=" + std::to_string(r.tensors) +
               ", objects=" + std::to_string(r.objects) +
               ", total_bytes=" + std::to_string(r.total_bytes) +
               ", files=" + std::to_string(r.files.size()) +
               ", skipped_objects=" + std::to_string(r.skipped_objects.size()) + ")";
      });
  m.def(
      "_convert",
      [](const std::string& src, const std::string& dst, const std::string& to,
         std::optional<std::string> dtype, const CommHandle* comm, ConvertOptions options,
         py::object progress) {
        options.to = ValueOrThrow(CheckpointFormatFromName(to));
        if (dtype) options.dtype = ValueOrThrow(DTypeFromName(*dtype));
        // Called from this thread while it runs without the GIL; an exception in the callback
        // does not stop the conversion: the first one is raised once it is over.
        std::optional<py::error_already_set> raised;
        if (!progress.is_none()) {
          options.progress = [&](uint64_t done, uint64_t total) {
            py::gil_scoped_acquire gil;
            if (raised) return;
            try {
              progress(done, total);
            } catch (py::error_already_set& e) {
              raised = std::move(e);
            }
          };
        }
        Comm* c = comm ? &comm->get() : nullptr;
        ConvertReport report = WithoutGil(
            [&] { return c ? Convert(src, dst, options, *c) : Convert(src, dst, options); });
        if (raised) throw std::move(*raised);
        return report;
      },
      py::arg("src"), py::arg("dst"), py::arg("to"), py::arg("dtype"), py::arg("comm"),
      py::arg("options"), py::arg("progress"));
}

void RegisterReports(py::module_& m) {
  py::class_<SaveReport>(m, "SaveReport",
                         "What a save wrote (tessera.save, AsyncSaveHandle.wait()).")
      .def_readonly("save_id", &SaveReport::save_id)
      .def_readonly("bytes_written", &SaveReport::bytes_written, "by this rank (data files)")
      .def_readonly("total_bytes", &SaveReport::total_bytes, "by all ranks")
      .def_readonly("files_written", &SaveReport::files_written, "by this rank")
      .def_readonly("plan_seconds", &SaveReport::plan_seconds,
                    "this rank's seconds planning (local plan, agreement, global plan)")
      .def_readonly("write_seconds", &SaveReport::write_seconds,
                    "this rank's seconds writing its data files")
      .def_readonly("commit_seconds", &SaveReport::commit_seconds,
                    "this rank's seconds in the commit (waiting for the others included)")
      .def_readonly("plan_cache_hit", &SaveReport::plan_cache_hit,
                    "the plan of the previous save was reused")
      .def("__repr__", [](const SaveReport& r) {
        return "SaveReport(save_id='" + r.save_id +
               "', bytes_written=" + std::to_string(r.bytes_written) +
               ", total_bytes=" + std::to_string(r.total_bytes) +
               ", files_written=" + std::to_string(r.files_written) +
               ", plan_cache_hit=" + (r.plan_cache_hit ? "True" : "False") + ")";
      });
  // dynamic_attr: tessera.load attaches the loaded state dict as `state_dict`.
  py::class_<LoadReport>(m, "LoadReport",
                         "What a load read (tessera.load); `state_dict` is the state dict loaded.",
                         py::dynamic_attr())
      // Keys of the checkpoint may hold bytes that are not UTF-8 (a corrupt or foreign
      // manifest): escaped, never a UnicodeDecodeError.
      .def_property_readonly("missing_keys",
                             [](const LoadReport& r) { return TextList(r.missing_keys); })
      .def_property_readonly("unexpected_keys",
                             [](const LoadReport& r) { return TextList(r.unexpected_keys); })
      .def_property_readonly("shape_mismatched_keys",
                             [](const LoadReport& r) { return TextList(r.shape_mismatched_keys); })
      .def_readonly("bytes_read", &LoadReport::bytes_read)
      .def_readonly("bytes_needed", &LoadReport::bytes_needed)
      .def_readonly("read_calls", &LoadReport::read_calls)
      .def_readonly("bytes_received", &LoadReport::bytes_received, "from other ranks")
      .def_readonly("bytes_received_in_place", &LoadReport::bytes_received_in_place,
                    "of bytes_received, those placed straight in the destination tensors")
      .def_readonly("bytes_sent", &LoadReport::bytes_sent, "to other ranks")
      .def_readonly("job_bytes_read", &LoadReport::job_bytes_read,
                    "from storage by all ranks (read_sharing='read_once'; else 0)")
      .def_readonly("job_bytes_needed", &LoadReport::job_bytes_needed,
                    "the union of the checkpoint bytes the ranks needed (read_once; else 0)")
      .def_readonly("job_bytes_exchanged", &LoadReport::job_bytes_exchanged,
                    "sent between ranks (read_once; else 0)")
      .def_readonly("checkpoint_bytes", &LoadReport::checkpoint_bytes,
                    "tensor data and objects in the checkpoint")
      .def_readonly("read_sharing", &LoadReport::read_sharing,
                    "how the ranks shared reads (read_sharing='auto' resolved)")
      .def("__repr__", [](const LoadReport& r) {
        return "LoadReport(missing_keys=" + std::to_string(r.missing_keys.size()) +
               ", unexpected_keys=" + std::to_string(r.unexpected_keys.size()) +
               ", shape_mismatched_keys=" + std::to_string(r.shape_mismatched_keys.size()) +
               ", bytes_read=" + std::to_string(r.bytes_read) +
               ", bytes_needed=" + std::to_string(r.bytes_needed) +
               ", read_calls=" + std::to_string(r.read_calls) +
               ", bytes_received=" + std::to_string(r.bytes_received) +
               ", bytes_received_in_place=" + std::to_string(r.bytes_received_in_place) +
               ", bytes_sent=" + std::to_string(r.bytes_sent) +
               ", job_bytes_read=" + std::to_string(r.job_bytes_read) +
               ", job_bytes_needed=" + std::to_string(r.job_bytes_needed) +
               ", job_bytes_exchanged=" + std::to_string(r.job_bytes_exchanged) +
               ", checkpoint_bytes=" + std::to_string(r.checkpoint_bytes) + ")";
      });
  py::class_<VerifyReport>(m, "VerifyReport", "What tessera.verify checked.")
      .def_readonly("chunks_checked", &VerifyReport::chunks_checked)
      .def_readonly("bytes_checked", &VerifyReport::bytes_checked)
      .def_readonly("files_checked", &VerifyReport::files_checked)
      .def_property_readonly(
          "format", [](const VerifyReport& r) { return CheckpointFormatName(r.format); },
          "'tessera', 'torch_dist' or 'safetensors'")
      .def_readonly("checksums", &VerifyReport::checksums,
                    "False when the format has none: only the structure was checked")
      .def("__repr__", [](const VerifyReport& r) {
        return "VerifyReport(chunks_checked=" + std::to_string(r.chunks_checked) +
               ", bytes_checked=" + std::to_string(r.bytes_checked) +
               ", files_checked=" + std::to_string(r.files_checked) + ")";
      });
}

void RegisterRemoveKeysReport(py::module_& m) {
  py::class_<RemoveKeysReport>(
      m, "RemoveKeysReport", "What tessera.remove_keys removed (with dry_run=True: would remove).")
      .def_property_readonly("removed_tensors",
                             [](const RemoveKeysReport& r) { return TextList(r.removed_tensors); })
      .def_property_readonly("removed_objects",
                             [](const RemoveKeysReport& r) { return TextList(r.removed_objects); })
      .def_readonly("matches_per_prefix", &RemoveKeysReport::matches_per_prefix,
                    "keys each prefix matched, in the order given")
      .def_readonly("files_before", &RemoveKeysReport::files_before)
      .def_readonly("files_after", &RemoveKeysReport::files_after)
      .def_readonly("files_dropped", &RemoveKeysReport::files_dropped,
                    "held removed chunks only: deleted, nothing copied")
      .def_readonly("files_rewritten", &RemoveKeysReport::files_rewritten,
                    "held kept and removed chunks: the kept ones copied to a new file")
      .def_readonly("bytes_before", &RemoveKeysReport::bytes_before)
      .def_readonly("bytes_after", &RemoveKeysReport::bytes_after)
      .def_property_readonly(
          "bytes_freed", [](const RemoveKeysReport& r) { return r.bytes_before - r.bytes_after; })
      .def_readonly("bytes_copied", &RemoveKeysReport::bytes_copied)
      .def_readonly("save_id", &RemoveKeysReport::save_id)
      .def_readonly("dry_run", &RemoveKeysReport::dry_run)
      .def("__repr__", [](const RemoveKeysReport& r) {
        return "RemoveKeysReport(removed_tensors=" + std::to_string(r.removed_tensors.size()) +
               ", removed_objects=" + std::to_string(r.removed_objects.size()) +
               ", files_dropped=" + std::to_string(r.files_dropped) +
               ", files_rewritten=" + std::to_string(r.files_rewritten) +
               ", bytes_freed=" + std::to_string(r.bytes_before - r.bytes_after) +
               ", bytes_copied=" + std::to_string(r.bytes_copied) +
               (r.dry_run ? ", dry_run=True)" : ")");
      });
}

void RegisterMetadata(py::module_& m) {
  py::class_<Box>(m, "Box", "A box of a tensor: offsets and sizes.")
      .def_property_readonly("offsets", [](const Box& b) { return b.offsets.ToVector(); })
      .def_property_readonly("sizes", [](const Box& b) { return b.sizes.ToVector(); })
      .def("__repr__", &BoxRepr);
  py::class_<ByteLocation>(m, "ByteLocation", "Where a chunk or object's bytes are.")
      .def_readonly("file_index", &ByteLocation::file_index)
      .def_readonly("offset", &ByteLocation::offset)
      .def_readonly("length", &ByteLocation::length)
      .def_readonly("checksum", &ByteLocation::checksum);
  py::class_<ChunkInfo>(m, "ChunkInfo", "One saved chunk of a tensor: its box and bytes.")
      .def_readonly("box", &ChunkInfo::box)
      .def_readonly("location", &ChunkInfo::location)
      .def("__repr__", [](const ChunkInfo& c) { return "ChunkInfo(" + c.box.ToString() + ")"; });
  py::class_<TensorInfo>(m, "TensorInfo", "A tensor of a checkpoint (Metadata.tensors).")
      .def_readonly("key", &TensorInfo::key)
      .def_property_readonly("dtype",
                             [](const TensorInfo& t) { return std::string(DTypeName(t.dtype)); })
      .def_property_readonly("shape", [](const TensorInfo& t) { return t.global_shape; })
      .def_readonly("chunks", &TensorInfo::chunks)
      .def_readonly("partial", &TensorInfo::partial)
      .def_property_readonly("nbytes",
                             [](const TensorInfo& t) {
                               uint64_t n = 0;
                               for (const ChunkInfo& c : t.chunks) n += c.location.length;
                               return n;
                             })
      .def("__repr__", [](const TensorInfo& t) {
        return "TensorInfo('" + t.key + "', " + std::string(DTypeName(t.dtype)) + ", " +
               ShapeToString(t.global_shape) + ", " + std::to_string(t.chunks.size()) + " chunks)";
      });
  py::class_<ObjectInfo>(m, "ObjectInfo", "An object of a checkpoint (Metadata.objects).")
      .def_readonly("key", &ObjectInfo::key)
      .def_readonly("location", &ObjectInfo::location)
      .def_property_readonly("nbytes", [](const ObjectInfo& o) { return o.location.length; })
      .def_property_readonly(
          "encoding", [](const ObjectInfo& o) { return PythonEncodingName(o.encoding); },
          "what the stored bytes are: 'bytes', 'pickle', 'torch_save' (a torch.save archive, "
          "e.g. a PyTorch DCP byte item) or 'json'")
      .def("__repr__", [](const ObjectInfo& o) {
        return "ObjectInfo('" + o.key + "', " + std::to_string(o.location.length) + " bytes)";
      });
  py::class_<FileInfo>(m, "FileInfo", "A data file of a checkpoint (Metadata.files).")
      .def_readonly("name", &FileInfo::name)
      .def_readonly("size", &FileInfo::size)
      .def("__repr__", [](const FileInfo& f) {
        return "FileInfo('" + f.name + "', " + std::to_string(f.size) + " bytes)";
      });
  py::class_<Metadata>(m, "Metadata", "The manifest of a checkpoint (tessera.read_metadata).")
      .def_readonly("format_version", &Metadata::format_version)
      .def_property_readonly(
          "format", [](const Metadata& m) { return CheckpointFormatName(m.format); },
          "'tessera', 'torch_dist' or 'safetensors' (detected from the files)")
      .def_property_readonly(
          "checksums", [](const Metadata& m) { return m.checksum != ChecksumKind::kNone; },
          "whether the format stores checksums (Hugging Face files and DCP do not)")
      .def_readonly("save_id", &Metadata::save_id)
      .def_readonly("num_ranks", &Metadata::num_ranks)
      .def_readonly("tensors", &Metadata::tensors)
      .def_readonly("objects", &Metadata::objects)
      .def_readonly("files", &Metadata::files)
      .def_readonly("user_metadata", &Metadata::user_metadata)
      .def(
          "find_tensor",
          [](const Metadata& m, const std::string& key) -> std::optional<TensorInfo> {
            const TensorInfo* t = m.FindTensor(key);
            return t ? std::optional<TensorInfo>(*t) : std::nullopt;
          },
          py::arg("key"), "The tensor saved under `key`, or None.")
      .def(
          "find_object",
          [](const Metadata& m, const std::string& key) -> std::optional<ObjectInfo> {
            const ObjectInfo* o = m.FindObject(key);
            return o ? std::optional<ObjectInfo>(*o) : std::nullopt;
          },
          py::arg("key"), "The object saved under `key`, or None.")
      .def_property_readonly("total_tensor_bytes", &Metadata::TotalTensorBytes)
      .def_property_readonly("total_chunks", &Metadata::TotalChunks)
      .def("__repr__", [](const Metadata& m) {
        return "Metadata(save_id='" + m.save_id + "', num_ranks=" + std::to_string(m.num_ranks) +
               ", " + std::to_string(m.tensors.size()) + " tensors, " +
               std::to_string(m.objects.size()) + " objects, " + std::to_string(m.files.size()) +
               " files)";
      });
}

void RegisterAsync(py::module_& m) {
  py::class_<PyAsyncSave>(m, "AsyncSaveHandle",
                          "An asynchronous save in flight (tessera.async_save).")
      .def("wait_staged", &PyAsyncSave::WaitStaged,
           "Blocks until the state is copied into the staging buffers: from then on the caller "
           "may change its tensors (with staging=\"deferred\", call it before the optimizer "
           "step). Raises this rank's staging error (e.g. the check of "
           "check_unchanged_until_staged=True). Returns at once with staging=\"blocking\".")
      .def(
          "staged", [](const PyAsyncSave& h) { return h.handle().Staged(); },
          "True once the copy into the staging buffers is done (non-blocking).")
      .def("wait", &PyAsyncSave::Wait,
           "Blocks until the save is committed and returns its SaveReport, or raises its error "
           "(the same on every rank). Starts with wait_staged().")
      .def("done", &PyAsyncSave::Done, "True once the save is committed or failed.")
      .def(
          "exception",
          [](PyAsyncSave& h) -> py::object {
            std::optional<Status> status = h.handle().TryStatus();
            if (!status || status->ok()) return py::none();
            h.MarkSeen();
            return StatusToException(*status);
          },
          "The exception the save failed with; None while in flight or after success.")
      .def_property_readonly(
          "report", [](const PyAsyncSave& h) { return h.handle().report(); },
          "The SaveReport once committed, else None.")
      .def(
          "_unseen_failure",
          [](PyAsyncSave& h) -> py::object {
            Status status;
            {
              py::gil_scoped_release release;
              status = h.handle().Wait();
            }
            if (status.ok() || h.seen()) return py::none();
            h.MarkSeen();
            return StatusToException(status);
          },
          "Waits; the exception of a failed save that no wait(), wait_staged() or exception() "
          "has shown yet (then marked shown), else None. For the exit hook.")
      .def("__repr__", [](const PyAsyncSave& h) {
        std::optional<Status> status = h.handle().TryStatus();
        if (!status) {
          return std::string("<tessera.AsyncSaveHandle in flight, ") +
                 (h.handle().Staged() ? "staged>" : "staging>");
        }
        return "<tessera.AsyncSaveHandle " + status->ToString() + ">";
      });
}

}  // namespace

void RegisterCheckpoint(py::module_& m) {
  RegisterOptions(m);
  RegisterReports(m);
  RegisterRemoveKeysReport(m);
  RegisterMetadata(m);
  RegisterAsync(m);
  RegisterConvert(m);

  m.def(
      "_format_names",
      [] {
        std::vector<std::string> names;
        for (const Format* format : RegisteredFormats()) names.push_back(format->name());
        return names;
      },
      "The names of the registered checkpoint formats (format/registry.h), in detection order.");
  m.def(
      "_save",
      [](StateBuilder& state, const std::string& path, const CommHandle* comm,
         const SaveOptions& options) {
        Comm* c = comm ? &comm->get() : nullptr;
        return WithProgress(options.progress, [&] {
          return c ? Save(state.dict(), path, *c, options) : Save(state.dict(), path, options);
        });
      },
      py::arg("state"), py::arg("path"), py::arg("comm"), py::arg("options"));
  m.def(
      "_load",
      [](StateBuilder& state, const std::string& path, const CommHandle* comm,
         const LoadOptions& options) {
        Comm* c = comm ? &comm->get() : nullptr;
        return WithProgress(options.progress, [&] {
          return c ? Load(state.dict(), path, *c, options) : Load(state.dict(), path, options);
        });
      },
      py::arg("state"), py::arg("path"), py::arg("comm"), py::arg("options"));
  m.def(
      "_async_save",
      [](py::object state, const std::string& path, const CommHandle& comm,
         const AsyncSaveOptions& options) {
        StateBuilder& builder = state.cast<StateBuilder&>();
        Comm& c = comm.get();
        AsyncSaveHandle handle =
            WithoutGil([&] { return AsyncSave(builder.dict(), path, c, options); });
        const bool deferred = options.staging == StagingMode::kDeferred;
        return std::make_unique<PyAsyncSave>(std::move(handle),
                                             deferred ? std::move(state) : py::none());
      },
      py::arg("state"), py::arg("path"), py::arg("comm"), py::arg("options"));
  m.def(
      "read_metadata",
      [](const std::string& path) {
        Metadata metadata = WithoutGil([&] { return ReadMetadata(path); });
        // Keys and user metadata become Python strs: a manifest holding bytes that are not
        // UTF-8 is a tessera error naming them, not a UnicodeDecodeError on first access.
        ThrowIfError(
            CheckMetadataIsUtf8(metadata, JoinPath(path, CommitName(metadata.commit_seq))));
        return metadata;
      },
      py::arg("path"),
      "Reads and checks the manifest of the checkpoint at `path`: its keys, dtypes, shapes,\n"
      "chunks, files and user metadata.");
  m.def(
      "_checksum",
      [](py::bytes data) {
        const std::string_view bytes(data);
        return Checksum(bytes.data(), bytes.size());
      },
      py::arg("data"), "XXH3-64 (seed 0) of `data`, as the format uses it (for tests).");
  m.def(
      "verify",
      [](const std::string& path, int num_threads, py::object progress) {
        VerifyOptions options{.num_threads = num_threads};
        options.progress = ProgressFromPython(std::move(progress));
        return WithProgress(options.progress, [&] { return Verify(path, options); });
      },
      py::arg("path"), py::arg("num_threads") = VerifyOptions().num_threads,
      py::arg("progress") = py::none(),
      "Re-reads every chunk and object of the checkpoint at `path` and checks checksums, file\n"
      "sizes and exact coverage, `num_threads` data files at once; raises the first problem\n"
      "found (that of the first file, in manifest order, that has one). `progress(done,\n"
      "total)`, if given, is called with the bytes checked.");
  m.def(
      "_finalize",
      [](const std::string& path) {
        Metadata metadata = WithoutGil([&] { return Finalize(path); });
        ThrowIfError(
            CheckMetadataIsUtf8(metadata, JoinPath(path, CommitName(metadata.commit_seq))));
        return metadata;
      },
      py::arg("path"));
  m.def(
      "_remove_keys",
      [](const std::string& path, const std::vector<std::string>& prefixes, bool dry_run,
         SyncPolicy sync, int num_io_threads, py::object progress) {
        RemoveKeysOptions options;
        options.dry_run = dry_run;
        options.sync = sync;
        options.num_io_threads = num_io_threads;
        options.progress = ProgressFromPython(std::move(progress));
        return WithProgress(options.progress, [&] { return RemoveKeys(path, prefixes, options); });
      },
      py::arg("path"), py::arg("prefixes"), py::arg("dry_run"), py::arg("sync"),
      py::arg("num_io_threads"), py::arg("progress"));
}

}  // namespace tessera::python
