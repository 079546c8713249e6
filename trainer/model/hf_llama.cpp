#include "model/hf_llama.h"

#include <nlohmann/json.hpp>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <stdexcept>
#include <utility>

#include "fsdp/fully_shard.h"
#include "fsdp/tensor_parallel.h"
#include "io/files.h"
#include "model/safetensors.h"

namespace fsdp::model {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string config_path(const std::string& dir) { return dir + "/config.json"; }

std::invalid_argument config_error(const std::string& where, const std::string& why) {
  return std::invalid_argument(where + ": " + why);
}

// DIR/config.json as a JSON object; throws naming the file if it is unreadable or not an object.
nlohmann::json read_config_json(const std::string& dir) {
  const std::string where = "'" + config_path(dir) + "'";
  std::ifstream in(config_path(dir));
  if (!in) throw config_error(where, "cannot be read");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw config_error(where, "is not a JSON object");
  return j;
}

// A JSON file of an export, indented as transformers writes its own.
void write_json(const std::string& path, const nlohmann::json& j) {
  io::OutputFile out(path);
  const std::string text = j.dump(2) + "\n";
  out.write(text.data(), text.size());
  out.close();
}

// The safetensors files of PATH: the file itself, or every *.safetensors in the directory.
std::vector<std::string> weight_files(const std::string& path) {
  if (!io::is_directory(path)) return {path};
  std::vector<std::string> files;
  for (const auto& name : io::list_directory(path))
    if (ends_with(name, ".safetensors")) files.push_back(path + "/" + name);
  if (files.empty()) throw std::invalid_argument("'" + path + "' holds no .safetensors file");
  std::sort(files.begin(), files.end());
  return files;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

struct SizedPart {
  HfPart part;                 // rows resolved (never 0)
  std::vector<int64_t> shape;  // the Hugging Face tensor's shape
};

// The Hugging Face tensors of our parameter `ours`, whose full shape is `full_shape`.
std::vector<SizedPart> sized_parts(const std::string& ours, const LlamaConfig& c,
                                   const std::vector<int64_t>& full_shape) {
  std::vector<SizedPart> sized;
  for (HfPart part : hf_parts(ours, c)) {
    if (part.rows == 0) part.rows = full_shape.at(0);
    auto shape = full_shape;
    shape.at(0) = part.rows;
    sized.push_back({part, shape});
  }
  return sized;
}

// A sharded checkpoint's index (*.safetensors.index.json, "weight_map": tensor -> file) must
// name exactly the tensors the files hold, each in the file that holds it.
void check_weight_index(const std::string& dir, const std::map<std::string, const io::SafetensorsFile*>& where) {
  for (const auto& name : io::list_directory(dir)) {
    if (!ends_with(name, ".safetensors.index.json")) continue;
    const std::string index = dir + "/" + name;
    std::ifstream in(index);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw std::invalid_argument("'" + index + "' has no \"weight_map\" object");
    const auto& map = j["weight_map"];
    for (const auto& [tensor, file] : map.items()) {
      const std::string named = dir + "/" + (file.is_string() ? file.get<std::string>() : file.dump());
      const auto it = where.find(tensor);
      if (it == where.end())
        throw std::invalid_argument("'" + index + "' puts '" + tensor + "' in '" + named +
                                    "', but no .safetensors file in the directory holds it");
      if (it->second->path() != named)
        throw std::invalid_argument("'" + index + "' puts '" + tensor + "' in '" + named + "', but '" +
                                    it->second->path() + "' holds it");
    }
    for (const auto& [tensor, file] : where)
      if (!map.contains(tensor))
        throw std::invalid_argument("'" + file->path() + "' holds '" + tensor + "', which '" + index +
                                    "' does not list: the index and the files disagree");
  }
}

}  // namespace

std::vector<HfPart> hf_parts(const std::string& ours, const LlamaConfig& c) {
  // The rows each part takes of our tensor, known once the config is: all, q's, k's or v's, ffn's.
  enum class Rows { All, Query, KeyValue, Ffn };
  struct Rule {
    std::regex pattern;
    std::vector<std::pair<std::string, Rows>> parts;  // Hugging Face name ($1: the layer), rows
  };
  static const std::string layer = "model.layers.$1.";
  // Compiled once, not for every parameter name.
  static const std::vector<Rule> rules = {
      {std::regex(R"(tok_emb\.weight)"), {{"model.embed_tokens.weight", Rows::All}}},
      {std::regex(R"(norm\.weight)"), {{"model.norm.weight", Rows::All}}},
      {std::regex(R"(head\.weight)"), {{"lm_head.weight", Rows::All}}},
      {std::regex(R"(blocks\.(\d+)\.attn_norm\.weight)"), {{layer + "input_layernorm.weight", Rows::All}}},
      {std::regex(R"(blocks\.(\d+)\.mlp_norm\.weight)"), {{layer + "post_attention_layernorm.weight", Rows::All}}},
      {std::regex(R"(blocks\.(\d+)\.attn\.wqkv\.weight)"),
       {{layer + "self_attn.q_proj.weight", Rows::Query},
        {layer + "self_attn.k_proj.weight", Rows::KeyValue},
        {layer + "self_attn.v_proj.weight", Rows::KeyValue}}},
      {std::regex(R"(blocks\.(\d+)\.attn\.wo\.weight)"), {{layer + "self_attn.o_proj.weight", Rows::All}}},
      {std::regex(R"(blocks\.(\d+)\.mlp\.w_gate_up\.weight)"),
       {{layer + "mlp.gate_proj.weight", Rows::Ffn}, {layer + "mlp.up_proj.weight", Rows::Ffn}}},
      {std::regex(R"(blocks\.(\d+)\.mlp\.w_down\.weight)"), {{layer + "mlp.down_proj.weight", Rows::All}}},
  };
  const auto row_count = [&c](Rows rows) -> int64_t {
    switch (rows) {
      case Rows::Query: return c.n_heads * c.head_dim();
      case Rows::KeyValue: return c.n_kv_heads * c.head_dim();
      case Rows::Ffn: return c.ffn;
      case Rows::All: break;
    }
    return 0;  // 0: all rows
  };
  for (const auto& rule : rules) {
    if (!std::regex_match(ours, rule.pattern)) continue;
    std::vector<HfPart> parts;
    int64_t row = 0;
    for (const auto& [name, rows] : rule.parts) {
      parts.push_back({std::regex_replace(ours, rule.pattern, name), row, row_count(rows)});
      row += row_count(rows);
    }
    return parts;
  }
  throw std::invalid_argument("no Hugging Face name for parameter '" + ours + "'");
}

bool has_hf_config(const std::string& path) { return io::is_directory(path) && io::exists(config_path(path)); }

namespace {

// A config.json's fields as our config; `dir` names them in errors.
LlamaConfig llama_config_from_hf(const nlohmann::json& j, const std::string& dir) {
  auto field = [&](const char* name) -> const nlohmann::json& {
    const auto it = j.find(name);
    if (it == j.end() || !it->is_number()) throw config_error(dir, std::string("no number '") + name + "'");
    return *it;
  };
  if (j.contains("model_type") && j["model_type"] != "llama")
    throw config_error(dir, "model_type " + j["model_type"].dump() + ", not \"llama\"");
  for (const char* bias : {"attention_bias", "mlp_bias"})
    if (j.value(bias, false)) throw config_error(dir, std::string(bias) + " is true: this Llama has no biases");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    throw config_error(dir, "hidden_act " + j["hidden_act"].dump() + ", not \"silu\"");
  LlamaConfig c;
  c.vocab = field("vocab_size").get<int64_t>();
  c.dim = field("hidden_size").get<int64_t>();
  c.n_layers = field("num_hidden_layers").get<int64_t>();
  c.n_heads = field("num_attention_heads").get<int64_t>();
  c.n_kv_heads = j.contains("num_key_value_heads") ? field("num_key_value_heads").get<int64_t>() : c.n_heads;
  c.ffn = field("intermediate_size").get<int64_t>();
  c.max_seq = field("max_position_embeddings").get<int64_t>();
  c.norm_eps = field("rms_norm_eps").get<double>();
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  if (const auto eos = j.find("eos_token_id"); eos != j.end() && !eos->is_null()) {  // one id, or a list
    for (const auto& id : eos->is_array() ? *eos : nlohmann::json::array({*eos})) {
      if (!id.is_number_integer()) throw config_error(dir, "eos_token_id " + eos->dump() + " is not an id or a list of ids");
      c.eos_token_ids.push_back(id.get<int64_t>());
    }
  }
  if (j.contains("head_dim") && !j["head_dim"].is_null() && j["head_dim"] != c.dim / std::max<int64_t>(c.n_heads, 1))
    throw config_error(dir, "head_dim " + j["head_dim"].dump() + " is not hidden_size / num_attention_heads");
  // Rotary base: transformers 5 keeps it in rope_parameters, earlier versions at the top.
  c.rope_theta = j.value("rope_theta", 10000.0);
  for (const char* scaling : {"rope_parameters", "rope_scaling"}) {
    const auto it = j.find(scaling);
    if (it == j.end() || it->is_null()) continue;
    const std::string type = it->value("rope_type", it->value("type", std::string("default")));
    if (type != "default" && type != "llama3")
      throw config_error(dir, std::string(scaling) + " of type '" + type + "' is not supported (default, llama3)");
    c.rope_theta = it->value("rope_theta", c.rope_theta);
    if (type == "llama3") {
      for (const char* needed : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        if (!it->contains(needed)) throw config_error(dir, std::string(scaling) + " of type llama3 has no " + needed);
      c.rope_scaling = {(*it)["factor"].get<double>(), (*it)["low_freq_factor"].get<double>(),
                        (*it)["high_freq_factor"].get<double>(),
                        (*it)["original_max_position_embeddings"].get<int64_t>()};
      if (c.rope_scaling.factor <= 0 || c.rope_scaling.high_freq_factor <= c.rope_scaling.low_freq_factor)
        throw config_error(dir, std::string(scaling) + ": llama3 needs factor > 0 and high_freq_factor > low_freq_factor");
    }
  }
  if (c.vocab < 1 || c.dim < 1 || c.n_layers < 0 || c.n_heads < 1 || c.n_kv_heads < 1 || c.ffn < 1 ||
      c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0)
    throw config_error(dir, "sizes that do not make a Llama (heads must divide hidden_size, kv heads the heads)");
  return c;
}

}  // namespace

LlamaConfig read_hf_config(const std::string& dir) {
  return llama_config_from_hf(read_config_json(dir), "'" + config_path(dir) + "'");
}

LlamaConfig llama_config_from_json(const std::string& text, const std::string& where) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw config_error(where, "is not a JSON object");
  return llama_config_from_hf(j, where);
}


void load_hf_weights(LlamaImpl& model, const std::string& path, const ByteProgress& progress) {
  c10::NoGradGuard no_grad;
  std::vector<std::unique_ptr<io::SafetensorsFile>> files;
  std::map<std::string, const io::SafetensorsFile*> where;
  for (const auto& file : weight_files(path)) {
    files.push_back(std::make_unique<io::SafetensorsFile>(file));
    for (const auto& [name, entry] : files.back()->entries()) {
      const auto [it, first] = where.emplace(name, files.back().get());
      if (!first)
        throw std::invalid_argument("'" + it->second->path() + "' and '" + file + "' both hold '" + name +
                                    "': two sets of weights in one directory (an older export left beside a "
                                    "newer one?); keep one");
    }
  }
  if (io::is_directory(path)) check_weight_index(path, where);
  std::set<std::string> unused;
  for (const auto& [name, file] : where) unused.insert(name);
  std::string missing;
  int64_t read = 0, to_read = 0;
  for (const auto& param : model.parameters()) to_read += static_cast<int64_t>(param.nbytes());
  for (auto& [ours, param] : model.named_parameters().pairs()) {
    const HeldElements held = held_elements_of(param);
    std::vector<at::Tensor> pieces;  // this rank's rows, run by run and part by part
    const auto parts = sized_parts(ours, model.config, held.full_shape);
    std::vector<const io::SafetensorsFile*> holding;  // each part's file; null: missing
    for (const auto& [part, expected] : parts) {
      const auto it = where.find(part.name);
      holding.push_back(it == where.end() ? nullptr : it->second);
      if (!holding.back()) {
        missing += " " + part.name;
        continue;
      }
      unused.erase(part.name);
      const auto& entry = it->second->entries().at(part.name);
      if (entry.shape != expected)
        throw std::invalid_argument("'" + it->second->path() + "': tensor '" + part.name + "' has shape " +
                                    shape_text(entry.shape) + " but the model's " + ours + " needs " +
                                    shape_text(expected) + " (another model size?)");
    }
    for (const auto& [first_row, rows] : held.row_runs) {
      for (size_t k = 0; k < parts.size(); ++k) {
        const HfPart& part = parts[k].part;
        const int64_t first = std::max(first_row, part.first_row);
        const int64_t last = std::min(first_row + rows, part.first_row + part.rows);
        if (!holding[k] || first >= last) continue;
        pieces.push_back(holding[k]->read_rows(part.name, first - part.first_row, last - first, param.scalar_type()));
        if (!pieces.back().isfinite().all().item<bool>())  // else the first step's divergence would blame --lr
          throw std::invalid_argument("'" + holding[k]->path() + "': tensor '" + part.name +
                                      "' holds NaN or infinite values: damaged weights, which no training can start from");
      }
    }
    if (pieces.empty()) continue;
    at::Tensor mine = at::cat(pieces);
    if (held.full_shape.size() == 2) mine = mine.narrow(1, held.first_column, held.columns);  // a part of columns
    param.copy_(mine.reshape(param.sizes()));
    if (progress) progress(read += static_cast<int64_t>(param.nbytes()), to_read);
  }
  // A tied model's head is its embedding. A file that also holds an lm_head.weight of other
  // values was trained untied: tying would drop that head (transformers keeps it). Refused.
  const auto head = where.find("lm_head.weight");
  if (model.config.tie_embeddings && head != where.end()) {
    at::Tensor embedding = model.tok_emb->weight;
    const HeldElements held = held_elements_of(embedding);  // one run: the embedding splits by vocabulary alone
    if (held.rows() > 0 && !at::equal(head->second->read_rows("lm_head.weight", held.row_runs[0].first,
                                                               held.row_runs[0].second, embedding.scalar_type())
                                              .to(embedding.device())
                                              .view(embedding.sizes()),
                                    embedding))
      throw std::invalid_argument("'" + path + "': config.json ties the embeddings (tie_word_embeddings: true) but "
                                  "lm_head.weight holds other values than model.embed_tokens.weight: tying would "
                                  "drop that head. Set tie_word_embeddings to false in config.json to train it as "
                                  "its own matrix, or delete lm_head.weight to tie the head to the embedding");
    unused.erase("lm_head.weight");  // the embedding, saved twice
  }
  if (!missing.empty())
    throw std::invalid_argument("'" + path + "' lacks the model's tensors:" + missing);
  if (!unused.empty())
    throw std::invalid_argument("'" + path + "' holds tensors the model does not have, e.g. '" + *unused.begin() +
                                "' (" + std::to_string(unused.size()) + " in all): another architecture?");
}

bool exports_single_file(const std::string& path) { return ends_with(path, ".safetensors"); }

namespace {

// What a Hugging Face model directory holds beside its config and weights, carried from an
// imported directory to the export unchanged: generation settings and the tokenizer.
const char* const kCompanionFiles[] = {"generation_config.json", "tokenizer.json",   "tokenizer_config.json",
                                       "special_tokens_map.json", "tokenizer.model", "vocab.json",
                                       "merges.txt",              "added_tokens.json", "chat_template.jinja",
                                       "chat_template.json"};

// transformers 5's name for the rotary settings (read back by read_hf_config).
nlohmann::json rope_parameters(const LlamaConfig& c) {
  if (c.rope_scaling.factor <= 0) return {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  return {{"rope_type", "llama3"},
          {"rope_theta", c.rope_theta},
          {"factor", c.rope_scaling.factor},
          {"low_freq_factor", c.rope_scaling.low_freq_factor},
          {"high_freq_factor", c.rope_scaling.high_freq_factor},
          {"original_max_position_embeddings", c.rope_scaling.original_max_seq}};
}

// config.json's name of the dtypes an export writes.
const char* config_dtype_name(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bfloat16" : "float32"; }

// config.json for the export: an imported model's own config with every field passed through
// (training changes no architecture field, and token ids, generation and tokenizer settings are
// the user's), else one written from our config. Either way torch_dtype says what is written.
nlohmann::json export_config(const LlamaConfig& c, const std::string& imported_from, at::ScalarType dtype) {
  nlohmann::json config;
  if (has_hf_config(imported_from)) {
    config = read_config_json(imported_from);
  } else {
    config = {
        {"architectures", {"LlamaForCausalLM"}},
        {"model_type", "llama"},
        {"vocab_size", c.vocab},
        {"hidden_size", c.dim},
        {"intermediate_size", c.ffn},
        {"num_hidden_layers", c.n_layers},
        {"num_attention_heads", c.n_heads},
        {"num_key_value_heads", c.n_kv_heads},
        {"head_dim", c.head_dim()},
        {"max_position_embeddings", c.max_seq},
        {"rms_norm_eps", c.norm_eps},
        {"rope_theta", c.rope_theta},
        {"rope_parameters", rope_parameters(c)},
        {"tie_word_embeddings", c.tie_embeddings},
        {"hidden_act", "silu"},
        {"attention_bias", false},
        {"mlp_bias", false},
    };
  }
  config["torch_dtype"] = config_dtype_name(dtype);  // transformers 4 reads this name, 5 the next
  config["dtype"] = config_dtype_name(dtype);
  return config;
}

int64_t spec_bytes(const io::SafetensorsSpec& spec) {
  int64_t size = int64_t(c10::elementSize(spec.dtype));
  for (int64_t d : spec.shape) size *= d;
  return size;
}

// The weight files of a directory export: consecutive runs of specs of at most max_bytes each
// (a larger tensor alone), as [first, end) ranges.
std::vector<std::pair<size_t, size_t>> split_into_files(const std::vector<io::SafetensorsSpec>& specs,
                                                        int64_t max_bytes) {
  std::vector<std::pair<size_t, size_t>> files;
  int64_t bytes = 0;  // in the last file
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t size = spec_bytes(specs[i]);
    if (files.empty() || (bytes > 0 && bytes + size > max_bytes)) {
      files.emplace_back(i, i);
      bytes = 0;
    }
    files.back().second = i + 1;
    bytes += size;
  }
  return files;
}

// model.safetensors for one file; model-00001-of-00003.safetensors, ... for several.
std::string weight_file_name(size_t index, size_t count) {
  if (count == 1) return "model.safetensors";
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

}  // namespace

at::ScalarType imported_dtype(const std::string& imported_from) {
  if (!has_hf_config(imported_from)) return at::kFloat;
  const nlohmann::json j = read_config_json(imported_from);
  for (const char* key : {"torch_dtype", "dtype"})
    if (j.contains(key) && j[key].is_string() && j[key] == "bfloat16") return at::kBFloat16;
  return at::kFloat;
}

void export_hf(LlamaImpl& model, Communicator& comm, const std::string& path, const ExportOptions& options) {
  const bool lead = comm.rank() == 0;
  const bool single_file = exports_single_file(path);
  // Written whole beside PATH, then put in its place: an existing export is replaced (never mixed),
  // or kept where the export may not replace it.
  const std::string staged = path + ".tmp-" + options.writer;
  const auto& c = model.config;
  const std::string& imported_from = options.imported_from;
  if (lead) {
    io::remove_tree(staged);  // an interrupted earlier export
    if (!single_file) {
      io::make_directories(staged);
      write_json(config_path(staged), export_config(c, imported_from, options.dtype));
      if (has_hf_config(imported_from))
        for (const char* name : kCompanionFiles)
          if (io::exists(imported_from + "/" + name)) io::copy_file(imported_from + "/" + name, staged + "/" + name);
    }
  }
  // One spec per Hugging Face tensor; a fused parameter is gathered once for its parts.
  const auto params = model.named_parameters().pairs();
  struct Source {
    size_t param;
    HfPart part;
  };
  std::vector<io::SafetensorsSpec> specs;
  std::vector<Source> sources;
  for (size_t i = 0; i < params.size(); ++i) {
    for (const auto& [part, shape] : sized_parts(params[i].first, c, held_elements_of(params[i].second).full_shape)) {
      specs.push_back({part.name, options.dtype, shape});
      sources.push_back({i, part});
    }
  }
  at::Tensor full;  // the parameter of the last spec (every rank gathers; rank 0 keeps it)
  size_t full_of = params.size();
  auto gathered = [&](size_t spec) {
    const Source& source = sources[spec];
    if (full_of != source.param) {
      full = full_parameter(model, params[source.param].first).to(at::kCPU, options.dtype).contiguous();
      full_of = source.param;
    }
    return full.narrow(0, source.part.first_row, source.part.rows).contiguous();
  };
  const auto files = single_file ? std::vector<std::pair<size_t, size_t>>{{0, specs.size()}}
                                 : split_into_files(specs, options.max_file_bytes);
  if (!lead) {
    for (size_t i = 0; i < specs.size(); ++i) gathered(i);
    return;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total_bytes = 0, handed = 0;
  for (const auto& spec : specs) total_bytes += spec_bytes(spec);
  for (size_t f = 0; f < files.size(); ++f) {
    const auto [first, end] = files[f];
    const std::string name = weight_file_name(f, files.size());
    const std::vector<io::SafetensorsSpec> part(specs.begin() + first, specs.begin() + end);
    io::write_safetensors(single_file ? staged : staged + "/" + name, part, [&](size_t i) {
      if (options.progress) options.progress(handed, total_bytes);  // the tensors before this one written
      handed += spec_bytes(part[i]);
      return gathered(first + i);
    }, {{"format", "pt"}});
    for (const auto& spec : part) weight_map[spec.name] = name;
  }
  if (options.progress) options.progress(handed, total_bytes);
  if (files.size() > 1) {  // transformers finds the files through the index
    const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    write_json(staged + "/model.safetensors.index.json", index);
  }
  if (options.replace) return io::replace_with(staged, path);
  if (!io::publish_new(staged, path))
    throw std::runtime_error("export: '" + path + "' appeared while this run exported (another run exported there): "
                             "this run's model is left at '" + staged + "'; move it into place, or export again "
                             "with --overwrite-export");
}

}  // namespace fsdp::model
