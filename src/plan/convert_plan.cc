#include "plan/convert_plan.h"

#include <algorithm>

#include "core/dtype_convert.h"

namespace tessera {
namespace {

bool Selected(const std::string& key, const std::vector<std::string>& prefixes) {
  if (prefixes.empty()) return true;
  return std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return key.starts_with(p); });
}

std::string OutputName(const std::string& key, const std::string& strip) {
  return !strip.empty() && key.starts_with(strip) ? key.substr(strip.size()) : key;
}

// Two selected keys that become the same output name: an error naming both.
template <typename T>
Status CheckUniqueNames(const std::vector<T>& sorted, const std::vector<std::string>& keys,
                        const std::string& strip) {
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].name == sorted[i - 1].name) {
      return InvalidArgument("keys '" + keys[i - 1] + "' and '" + keys[i] + "' both become '" +
                             sorted[i].name + "' once '" + strip + "' is stripped");
    }
  }
  return Status::Ok();
}

// Groups tensors, then objects, into files of at most max_file_bytes (a larger item alone), or
// each item into a file of its own.
void GroupIntoFiles(uint64_t max_file_bytes, bool one_item_per_file, ConvertPlan& plan) {
  auto place = [&](uint64_t bytes, uint32_t& file, uint64_t& offset) {
    // A new file when this item would overflow the current one (an item without bytes never
    // does; one larger than the limit gets a file to itself).
    if (plan.files.empty() || one_item_per_file ||
        (plan.files.back().data_bytes > 0 && bytes > 0 &&
         plan.files.back().data_bytes + bytes > max_file_bytes)) {
      plan.files.emplace_back();
    }
    OutputFile& f = plan.files.back();
    file = static_cast<uint32_t>(plan.files.size() - 1);
    offset = f.data_bytes;
    f.data_bytes += bytes;
  };
  for (uint32_t i = 0; i < plan.tensors.size(); ++i) {
    OutputTensor& t = plan.tensors[i];
    place(t.bytes, t.file, t.offset);
    plan.files[t.file].tensors.push_back(i);
  }
  for (uint32_t i = 0; i < plan.objects.size(); ++i) {
    OutputObject& o = plan.objects[i];
    place(o.bytes, o.file, o.offset);
    plan.files[o.file].objects.push_back(i);
  }
}

// Largest file first, each to the rank with the fewest bytes so far (the lowest on a tie).
void AssignRanks(int num_ranks, std::vector<OutputFile>& files) {
  std::vector<uint32_t> order(files.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return files[a].data_bytes > files[b].data_bytes;
  });
  std::vector<uint64_t> load(static_cast<size_t>(num_ranks), 0);
  for (uint32_t f : order) {
    const size_t r = std::min_element(load.begin(), load.end()) - load.begin();
    files[f].rank = static_cast<int>(r);
    load[r] += files[f].data_bytes;
  }
}

}  // namespace

Result<ConvertPlan> PlanConversion(const Metadata& metadata, const ConvertPlanOptions& options) {
  if (options.dtype && !IsConvertibleFloat(*options.dtype)) {
    return InvalidArgument("the target dtype must be F64, F32, F16 or BF16, not " +
                           std::string(DTypeName(*options.dtype)));
  }
  if (options.max_file_bytes == 0) return InvalidArgument("the largest file size must be > 0");
  if (options.num_ranks < 1) return InvalidArgument("a conversion needs at least one rank");
  ConvertPlan plan;
  std::vector<std::string> tensor_keys, object_keys;  // source keys, parallel after sorting
  for (uint32_t i = 0; i < metadata.tensors.size(); ++i) {
    const TensorInfo& info = metadata.tensors[i];
    if (!Selected(info.key, options.key_prefixes)) continue;
    OutputTensor t;
    t.source = i;
    t.name = OutputName(info.key, options.strip_prefix);
    t.source_dtype = info.dtype;
    t.dtype = options.dtype && IsConvertibleFloat(info.dtype) ? *options.dtype : info.dtype;
    t.shape = info.global_shape;
    t.bytes =
        static_cast<uint64_t>(Box::Whole(info.global_shape).NumElements()) * DTypeSize(t.dtype);
    plan.tensors.push_back(std::move(t));
  }
  for (uint32_t i = 0; i < metadata.objects.size(); ++i) {
    const ObjectInfo& info = metadata.objects[i];
    if (!Selected(info.key, options.key_prefixes)) continue;
    if (!options.keep_objects) {
      plan.skipped_objects.push_back(info.key);
      continue;
    }
    plan.objects.push_back(
        OutputObject{i, OutputName(info.key, options.strip_prefix), info.location.length});
  }
  auto by_name = [](const auto& a, const auto& b) { return a.name < b.name; };
  std::stable_sort(plan.tensors.begin(), plan.tensors.end(), by_name);
  std::stable_sort(plan.objects.begin(), plan.objects.end(), by_name);
  for (const OutputTensor& t : plan.tensors) tensor_keys.push_back(metadata.tensors[t.source].key);
  for (const OutputObject& o : plan.objects) object_keys.push_back(metadata.objects[o.source].key);
  TESSERA_RETURN_IF_ERROR(CheckUniqueNames(plan.tensors, tensor_keys, options.strip_prefix));
  TESSERA_RETURN_IF_ERROR(CheckUniqueNames(plan.objects, object_keys, options.strip_prefix));
  for (size_t i = 0, j = 0; i < plan.tensors.size() && j < plan.objects.size();) {
    if (plan.tensors[i].name == plan.objects[j].name) {
      return InvalidArgument("tensor '" + tensor_keys[i] + "' and object '" + object_keys[j] +
                             "' both become '" + plan.tensors[i].name + "'");
    }
    plan.tensors[i].name < plan.objects[j].name ? ++i : ++j;
  }
  for (size_t i = 0; i < plan.tensors.size() + plan.objects.size(); ++i) {
    const bool tensor = i < plan.tensors.size();
    const std::string& name =
        tensor ? plan.tensors[i].name : plan.objects[i - plan.tensors.size()].name;
    if (name.empty()) {
      return InvalidArgument("key '" +
                             (tensor ? tensor_keys[i] : object_keys[i - plan.tensors.size()]) +
                             "' becomes empty once '" + options.strip_prefix + "' is stripped");
    }
  }
  if (plan.tensors.empty() && plan.objects.empty()) {
    if (!plan.skipped_objects.empty()) {
      std::string list;
      for (size_t i = 0; i < plan.skipped_objects.size() && i < 5; ++i) {
        list += (i ? ", '" : "'") + plan.skipped_objects[i] + "'";
      }
      if (plan.skipped_objects.size() > 5) list += ", ...";
      return InvalidArgument("nothing to export: the keys selected are only objects (" + list +
                             "), which " + options.format_name + " files cannot hold");
    }
    std::string prefixes;
    for (const std::string& p : options.key_prefixes) prefixes += " '" + p + "'";
    return InvalidArgument(options.key_prefixes.empty()
                               ? std::string("the checkpoint holds no tensor and no object")
                               : "no key to export starts with any of the prefixes" + prefixes);
  }
  for (const OutputTensor& t : plan.tensors) plan.total_tensor_bytes += t.bytes;
  GroupIntoFiles(options.max_file_bytes, options.one_item_per_file, plan);
  AssignRanks(options.num_ranks, plan.files);
  return plan;
}

std::vector<ConvertUnit> PlanUnits(const ConvertPlan& plan, int rank, uint64_t unit_bytes,
                                   uint64_t block_bytes) {
  block_bytes = std::max<uint64_t>(block_bytes, 1);
  unit_bytes = std::max(unit_bytes, 4 * block_bytes);
  std::vector<ConvertUnit> units;
  for (uint32_t f = 0; f < plan.files.size(); ++f) {
    if (plan.files[f].rank != rank) continue;
    ConvertUnit unit;
    auto close = [&] {
      if (!unit.pieces.empty()) units.push_back(std::move(unit));
      unit = ConvertUnit();
    };
    for (uint32_t ti : plan.files[f].tensors) {
      const OutputTensor& t = plan.tensors[ti];
      const uint64_t out_size = DTypeSize(t.dtype), src_size = DTypeSize(t.source_dtype);
      const bool converted = t.dtype != t.source_dtype;
      const int64_t count = static_cast<int64_t>(t.bytes / out_size);
      // Elements per cut: a whole number of blocks of output bytes (blocks are multiples of
      // every dtype size when block_bytes is a power of two of at least 8).
      const int64_t step = static_cast<int64_t>(std::max<uint64_t>(block_bytes / out_size, 1));
      for (int64_t begin = 0; begin < count;) {
        if (unit.pieces.empty()) {
          unit.file = f;
          unit.offset = t.offset + static_cast<uint64_t>(begin) * out_size;
        }
        uint64_t fit = (unit_bytes - unit.out_bytes) / out_size;
        if (converted) fit = std::min(fit, (unit_bytes - unit.src_bytes) / src_size);
        int64_t n = std::min<int64_t>(count - begin, static_cast<int64_t>(fit));
        if (n < count - begin) n -= n % step;  // a cut inside the tensor: on a block boundary
        // An empty unit always takes a block (unit_bytes >= 4 blocks >= a block of the widest
        // source); this only guards the loop's progress.
        if (n <= 0 && unit.pieces.empty()) n = std::min<int64_t>(count - begin, step);
        if (n <= 0) {
          close();
          continue;
        }
        UnitPiece piece{ti, begin, begin + n, unit.out_bytes, unit.src_bytes, converted};
        unit.out_bytes += static_cast<uint64_t>(n) * out_size;
        if (converted) unit.src_bytes += static_cast<uint64_t>(n) * src_size;
        unit.pieces.push_back(piece);
        begin += n;
      }
    }
    close();
  }
  return units;
}

}  // namespace tessera
