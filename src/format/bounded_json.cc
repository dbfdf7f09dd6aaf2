#include "format/bounded_json.h"

#include <string>

namespace tessera {

Result<nlohmann::json> ParseBoundedJson(std::string_view text, std::string_view source) {
  using json = nlohmann::json;
  bool too_deep = false;
  // `depth` is the number of containers around the one starting. Discarding a container
  // (returning false) keeps the parser from building it or anything inside it; the parser
  // itself keeps one pointer per open level on a heap stack, never recursing.
  const json::parser_callback_t bound = [&too_deep](int depth, json::parse_event_t event, json&) {
    const bool opens =
        event == json::parse_event_t::object_start || event == json::parse_event_t::array_start;
    if (opens && depth >= kMaxJsonDepth) too_deep = true;
    return !too_deep;
  };
  json doc = json::parse(text.begin(), text.end(), bound, /*allow_exceptions=*/false);
  if (too_deep) {
    return DataLoss(std::string(source) + ": JSON nested more than " +
                    std::to_string(kMaxJsonDepth) + " levels deep");
  }
  if (doc.is_discarded()) return DataLoss(std::string(source) + ": invalid JSON");
  return doc;
}

}  // namespace tessera
