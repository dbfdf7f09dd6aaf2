#include "tools/json_output.h"

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/utf8.h"

namespace tessera::tools {
namespace {

using json = nlohmann::json;

// `token` as one reference token of a JSON Pointer: '~' is "~0", '/' is "~1".
std::string PointerToken(const std::string& token) {
  std::string out;
  for (char c : token) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// Replaces every string of `doc` that is not UTF-8 and lists it in `replaced`. Iterative: a
// document of any depth costs no stack.
void MakeUtf8(json& doc, json& replaced) {
  auto note = [&](const std::string& pointer, const std::string& original, bool key) {
    const std::string quoted = QuoteBytes(original);
    json entry = {{"pointer", pointer}, {"bytes", quoted.substr(1, quoted.size() - 2)}};
    if (key) entry["key"] = true;
    replaced.push_back(std::move(entry));
  };
  std::vector<std::pair<json*, std::string>> todo = {{&doc, ""}};
  while (!todo.empty()) {
    auto [value, pointer] = std::move(todo.back());
    todo.pop_back();
    if (value->is_string()) {
      const std::string& s = value->get_ref<const std::string&>();
      if (!IsValidUtf8(s)) {
        note(pointer, s, false);
        *value = ReplaceInvalidUtf8(s);
      }
    } else if (value->is_array()) {
      for (size_t i = 0; i < value->size(); ++i) {
        todo.emplace_back(&(*value)[i], pointer + "/" + std::to_string(i));
      }
    } else if (value->is_object()) {
      // Keys that are not UTF-8 are renamed first (a map's keys cannot change in place).
      std::vector<std::string> bad;
      for (auto it = value->begin(); it != value->end(); ++it) {
        if (!IsValidUtf8(it.key())) bad.push_back(it.key());
      }
      for (const std::string& key : bad) {
        std::string name = ReplaceInvalidUtf8(key);
        while (value->contains(name)) name += "\xef\xbf\xbd";  // two keys alike once replaced
        (*value)[name] = std::move((*value)[key]);
        value->erase(key);
        note(pointer + "/" + PointerToken(name), key, true);
      }
      for (auto it = value->begin(); it != value->end(); ++it) {
        todo.emplace_back(&it.value(), pointer + "/" + PointerToken(it.key()));
      }
    }
  }
}

}  // namespace

std::string JsonText(json doc) {
  json replaced = json::array();
  MakeUtf8(doc, replaced);
  if (!replaced.empty() && doc.is_object()) doc["non_utf8"] = std::move(replaced);
  // Every string is UTF-8 now; `replace` only keeps dump() from ever throwing.
  return doc.dump(2, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

void PrintJson(json doc) {
  const std::string text = JsonText(std::move(doc));
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

}  // namespace tessera::tools
