// plugins/examples/example_json.h: what both C++ examples read from pnmix's JSON: a flat value of
// the file's or engine's description, the config fields of generated.h's CONFIG_FIELDS, the
// --tokens ids and the per-layer state tensor names. Each program passes its own error exit
// (`fail`: print one `error:` line, exit 2), so the messages keep naming what they read.
#ifndef PNMIX_EXAMPLE_JSON_H
#define PNMIX_EXAMPLE_JSON_H

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "pnmix/format.h"
#include "pnmix/params.h"

namespace pnmix_example {

using Fail = void (*)(const std::string&);  // never returns

// One value by key in flat JSON whose keys are unique (pnmix writes such JSON): a string's text
// or a number's digits. `what` names the document in errors.
inline std::string json_value(const std::string& json, const std::string& key, const std::string& what, Fail fail) {
  const std::string quoted = "\"" + key + "\"";
  size_t at = json.find(quoted);
  if (at == std::string::npos) fail(what + " lacks '" + key + "'");
  at = json.find(':', at + quoted.size());
  if (at == std::string::npos) fail(what + ": no value for '" + key + "'");
  ++at;
  while (at < json.size() && std::isspace(static_cast<unsigned char>(json[at]))) ++at;
  if (at < json.size() && json[at] == '"') {
    const size_t end = json.find('"', at + 1);
    if (end == std::string::npos) fail(what + ": unterminated string for '" + key + "'");
    return json.substr(at + 1, end - at - 1);
  }
  size_t end = at;
  while (end < json.size() && std::string(",}] \n\r\t").find(json[end]) == std::string::npos) ++end;
  return json.substr(at, end - at);
}

// pair_layout's code, or -1 for a name that is none (config_error then refuses it).
inline int32_t pair_layout_code(const std::string& name) {
#define PNMIX_X(code, NAME, text) \
  if (name == text) return code;
  PNMIX_PAIR_LAYOUTS(PNMIX_X)
#undef PNMIX_X
  return -1;
}

// Every config field by its CONFIG_FIELDS name (generated.h), checked as FORMAT.md 1.1 says.
inline pnmix_config config_from(const std::string& json, const std::string& what, Fail fail) {
  pnmix_config c{};
#define PNMIX_READ_RATIO(name) c.name = std::atof(json_value(json, #name, what, fail).c_str());
#define PNMIX_READ_INT(name) c.name = std::atoi(json_value(json, #name, what, fail).c_str());
#define PNMIX_READ_LAYOUT(name) c.name = pair_layout_code(json_value(json, #name, what, fail));
#define PNMIX_X(name, kind) PNMIX_READ_##kind(name)
  PNMIX_CONFIG_FIELDS(PNMIX_X)
#undef PNMIX_X
#undef PNMIX_READ_RATIO
#undef PNMIX_READ_INT
#undef PNMIX_READ_LAYOUT
  if (const char* bad = pnmix::config_error(c)) fail(what + ": " + bad);
  return c;
}

// --tokens ID,ID,...: each an id of the vocabulary, at least one.
inline std::vector<int64_t> parse_ids(const std::string& text, int64_t vocab, Fail fail) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    errno = 0;
    const long long id = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno == ERANGE || id < 0 || id >= vocab)
      fail("--tokens: '" + item + "' is not a token id in 0.." + std::to_string(vocab - 1));
    ids.push_back(id);
  }
  if (ids.empty() || text.back() == ',') fail("--tokens needs token ids separated by commas, got '" + text + "'");
  return ids;
}

// An LLM file's per-layer state tensor: past.<layer>.<name> / present.<layer>.<name>.
inline std::string layer_tensor(const char* prefix, int64_t layer, int i) {
  return std::string(prefix) + "." + std::to_string(layer) + "." + pnmix::state_name(i);
}

}  // namespace pnmix_example

#endif  // PNMIX_EXAMPLE_JSON_H
