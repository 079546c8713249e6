#include "train/config_file.h"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#if FSDP_WITH_TOML
#include <toml++/toml.h>
#endif

#include "io/files.h"

namespace fsdp::train {

UsageError given_twice(const std::string& path, const std::string& key) {
  return UsageError("--config '" + path + "' gives '" + key + "' twice: give each flag once");
}

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// One JSON value as an entry: objects below a table and arrays are Other (args.cpp names them).
ConfigEntry json_entry(const std::string& table, const std::string& key, const nlohmann::ordered_json& value) {
  ConfigEntry e{table, key, ConfigEntry::Kind::Other, {}};
  if (value.is_string()) {
    e.kind = ConfigEntry::Kind::Text;
    e.value = value.get<std::string>();
  } else if (value.is_boolean()) {
    e.kind = ConfigEntry::Kind::Boolean;
    e.value = value.get<bool>() ? "true" : "false";
  } else if (value.is_number()) {
    e.kind = ConfigEntry::Kind::Number;
    e.value = value.dump();
  }
  return e;
}

std::vector<ConfigEntry> read_json(const std::string& path, std::ifstream& in) {
  // A key given twice in one object is refused, as a flag given twice on the command line:
  // nlohmann keeps the last, so the parser's key events are counted per object.
  std::vector<std::set<std::string>> open_objects;
  std::string twice;
  const auto count_keys = [&](int /*depth*/, nlohmann::ordered_json::parse_event_t event, nlohmann::ordered_json& parsed) {
    using Event = nlohmann::ordered_json::parse_event_t;
    if (event == Event::object_start) open_objects.emplace_back();
    if (event == Event::object_end && !open_objects.empty()) open_objects.pop_back();
    if (event == Event::key && !open_objects.empty() && !open_objects.back().insert(parsed.get<std::string>()).second &&
        twice.empty())
      twice = parsed.get<std::string>();
    return true;
  };
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(in, count_keys, /*allow_exceptions=*/false);
  } catch (const std::exception& e) {  // a read that fails midway
    throw UsageError("--config: cannot read '" + path + "': " + e.what());
  }
  if (!j.is_object())
    throw UsageError("--config: '" + path + "' is not a JSON object of flags and values ({\"steps\": 100, ...})");
  if (!twice.empty()) throw given_twice(path, twice);
  std::vector<ConfigEntry> entries;
  for (const auto& [key, value] : j.items()) {
    if (!value.is_object()) {
      entries.push_back(json_entry("", key, value));
      continue;
    }
    for (const auto& [inner, inner_value] : value.items()) {
      if (inner_value.is_object())
        throw UsageError("--config: '" + path + "': \"" + key + "\": {\"" + inner +
                         "\": {...}} nests too deep: a table holds flags and values");
      entries.push_back(json_entry(key, inner, inner_value));
    }
  }
  return entries;
}

#if FSDP_WITH_TOML
ConfigEntry toml_entry(const std::string& table, const std::string& key, const toml::node& value) {
  ConfigEntry e{table, key, ConfigEntry::Kind::Other, {}};
  if (const auto* s = value.as_string()) {
    e.kind = ConfigEntry::Kind::Text;
    e.value = s->get();
  } else if (const auto* b = value.as_boolean()) {
    e.kind = ConfigEntry::Kind::Boolean;
    e.value = b->get() ? "true" : "false";
  } else if (const auto* i = value.as_integer()) {
    e.kind = ConfigEntry::Kind::Number;
    e.value = std::to_string(i->get());
  } else if (const auto* f = value.as_floating_point()) {
    char text[64];  // the shortest text that reads back as the same double: 3e-3 as 0.003
    const auto end = std::to_chars(text, text + sizeof(text), f->get()).ptr;
    e.kind = ConfigEntry::Kind::Number;
    e.value.assign(text, end);
  }
  return e;
}

std::vector<ConfigEntry> read_toml(const std::string& path, std::ifstream& in) {
  toml::table document;
  try {
    document = toml::parse(in, path);
  } catch (const toml::parse_error& e) {  // toml++ names the line and column; a duplicate key too
    const auto& at = e.source().begin;
    throw UsageError("--config: '" + path + "' line " + std::to_string(at.line) + ", column " +
                     std::to_string(at.column) + ": " + std::string(e.description()));
  }
  std::vector<ConfigEntry> entries;
  for (const auto& [key, value] : document) {  // toml++ keeps a table's keys sorted, not as written
    const std::string name(key.str());
    const auto* table = value.as_table();
    if (!table) {
      entries.push_back(toml_entry("", name, value));
      continue;
    }
    for (const auto& [inner, inner_value] : *table) {
      if (inner_value.is_table())
        throw UsageError("--config: '" + path + "': [" + name + "." + std::string(inner.str()) +
                         "] nests too deep: a table holds flags and values");
      entries.push_back(toml_entry(name, std::string(inner.str()), inner_value));
    }
  }
  return entries;
}
#endif

}  // namespace

bool reads_toml() { return FSDP_WITH_TOML; }

std::vector<ConfigEntry> read_config_file(const std::string& path) {
  if (path.empty()) throw UsageError("--config needs a value");
  const bool toml = ends_with(path, ".toml");
  const char* format = toml ? "TOML" : "JSON";
  if (io::is_directory(path))
    throw UsageError("--config: '" + path + "' is a directory, not a " + std::string(format) + " file of flags");
  if (toml && !reads_toml())
    throw UsageError("--config: '" + path + "' is TOML, which this fsdp-train was built without (toml++ was not "
                     "found: install libtomlplusplus-dev and build again, or give the flags as JSON)");
  std::ifstream in(path);
  if (!in) throw UsageError("--config: cannot read '" + path + "': " + std::strerror(errno));
#if FSDP_WITH_TOML
  if (toml) return read_toml(path, in);
#endif
  return read_json(path, in);
}

}  // namespace fsdp::train
