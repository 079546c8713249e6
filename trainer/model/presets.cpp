// LlamaConfig::preset: the presets of trainer/model/presets.json (embedded when fsdp-train is
// built: the generated presets_json.h), each read as a config.json is.
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

#include "model/hf_llama.h"
#include "model/llama.h"
#include "presets_json.h"

namespace fsdp::model {

LlamaConfig LlamaConfig::preset(const std::string& name) {
  static const nlohmann::json presets = nlohmann::json::parse(kPresetsJson);
  if (name == "about" || !presets.contains(name)) {
    std::string known;
    for (const auto& [key, value] : presets.items())
      if (key != "about") known += (known.empty() ? "" : ", ") + key;
    throw std::invalid_argument("unknown model preset '" + name + "' (" + known + ")");
  }
  return llama_config_from_json(presets[name].dump(), "the preset '" + name + "' (trainer/model/presets.json)");
}

}  // namespace fsdp::model
