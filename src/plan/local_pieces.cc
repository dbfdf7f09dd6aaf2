#include "plan/local_pieces.h"

#include <algorithm>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "core/tiling.h"
#include "plan/flat_range.h"

namespace tessera {

std::string DescribePiece(const ShardedTensor& tensor) {
  std::string out = "local box " + tensor.LocalBox().ToString();
  if (tensor.flat_range) {
    out += " flat range [" + std::to_string(tensor.flat_range->begin) + ", " +
           std::to_string(tensor.flat_range->end) + ")";
  }
  return out;
}

namespace {

// The pieces of one key, as element boxes (a flat range gives up to 2N-1) and the entry each
// comes from.
Status CheckKey(const StateDict& state, const std::vector<size_t>& indices) {
  std::vector<Box> boxes;
  std::vector<size_t> entry_of_box;
  const ShardedTensor* first = nullptr;
  for (size_t i : indices) {
    const auto* tensor = std::get_if<ShardedTensor>(&state.entries()[i]);
    if (tensor == nullptr) continue;  // an object: StateDict::Add allows no other entry
    if (first == nullptr) first = tensor;
    TESSERA_RETURN_IF_ERROR(tensor->Validate());
    const Box local = tensor->LocalBox();
    if (!tensor->flat_range) {
      if (local.empty()) continue;
      boxes.push_back(local);
      entry_of_box.push_back(i);
      continue;
    }
    for (FlatPiece& piece :
         FlatRangeToBoxes(local, tensor->flat_range->begin, tensor->flat_range->end)) {
      boxes.push_back(std::move(piece.box));
      entry_of_box.push_back(i);
    }
  }
  if (boxes.size() < 2) return Status::Ok();
  // Boxes are inside the global shape (Validate), and boxes of one entry never overlap each
  // other (a flat range's boxes are disjoint), so a failure names two different entries.
  const std::optional<BoxCheckFailure> failure =
      CheckTiling(boxes, first->global_shape, /*require_coverage=*/false);
  if (!failure) return Status::Ok();
  if (failure->second < 0) {
    return InvalidArgument("tensor '" + first->key + "': " + failure->message);
  }
  // Named in the order they were added, whatever order the check met them in.
  const size_t first_entry = std::min(entry_of_box[failure->first], entry_of_box[failure->second]);
  const size_t second_entry = std::max(entry_of_box[failure->first], entry_of_box[failure->second]);
  const auto& a = std::get<ShardedTensor>(state.entries()[first_entry]);
  const auto& b = std::get<ShardedTensor>(state.entries()[second_entry]);
  const std::optional<Box> common = Intersect(boxes[failure->first], boxes[failure->second]);
  return InvalidArgument("tensor '" + first->key +
                         "': this rank holds pieces of it that overlap: " + DescribePiece(a) +
                         " and " + DescribePiece(b) + " share the elements " +
                         (common ? common->ToString() : std::string("?")) +
                         " (pieces of one tensor on one rank must be disjoint; a copy held by "
                         "another rank is a replica, with its own replica id)");
}

}  // namespace

Status CheckLocalPiecesDisjoint(const StateDict& state) {
  if (state.num_keys() == state.size()) return Status::Ok();  // one piece per key
  std::unordered_set<std::string_view> checked;
  for (const StateEntry& entry : state.entries()) {
    const auto* tensor = std::get_if<ShardedTensor>(&entry);
    if (tensor == nullptr || state.CountOf(tensor->key) < 2) continue;
    if (!checked.insert(tensor->key).second) continue;
    TESSERA_RETURN_IF_ERROR(CheckKey(state, state.IndicesOf(tensor->key)));
  }
  return Status::Ok();
}

}  // namespace tessera
