// --config FILE: a JSON object or a TOML document of fsdp-train's flags, read into entries that
// train/args.cpp checks against its flag table (which knows what each flag takes).
#pragma once

#include <string>
#include <vector>

#include "train/usage_error.h"

namespace fsdp::train {

// One key of a config file: `key = value` at the top level (table empty) or in one table
// ([training] in TOML, {"training": {...}} in JSON). Its value as the command line's word:
// a number as written, true or false for a boolean.
struct ConfigEntry {
  enum class Kind { Text, Number, Boolean, Other };  // Other: an array, a table, a date, null
  std::string table;
  std::string key;
  Kind kind = Kind::Other;
  std::string value;
};

// The entries in the file's order (in TOML each table's keys sorted). FILE.toml is TOML (toml++), any other name JSON. Throws
// UsageError naming the file for one that cannot be read or parsed, a key given twice, or tables
// nested deeper than one level.
std::vector<ConfigEntry> read_config_file(const std::string& path);

// The refusal of a flag the file gives twice: in one table, or at the top and in its table.
UsageError given_twice(const std::string& path, const std::string& key);

// Whether this build reads TOML (toml++ was found when it was configured).
bool reads_toml();

}  // namespace fsdp::train
