// Hugging Face LlamaForCausalLM weights in and out: parameter names, config.json, and safetensors
// files, for a Llama that may be sharded (each rank reads only its own rows).
#pragma once

#include <string>
#include <vector>

#include "fsdp/communicator.h"
#include "fsdp/sharded_checkpoint.h"
#include "model/llama.h"

namespace fsdp::model {

// Where a parameter of ours sits in Hugging Face's layout: rows [first_row, first_row + rows) of
// our parameter are the Hugging Face tensor `name`. Most parameters are one tensor; the fused
// projections are several stacked by rows ("blocks.3.attn.wqkv.weight" is q_proj, k_proj and
// v_proj of "model.layers.3.self_attn"; "blocks.3.mlp.w_gate_up.weight" gate_proj and up_proj).
struct HfPart {
  std::string name;
  int64_t first_row = 0;
  int64_t rows = 0;
};
// Throws for a name outside the mapping.
std::vector<HfPart> hf_parts(const std::string& ours, const LlamaConfig& config);

// A directory holding config.json, or a .safetensors file (whose config must come from elsewhere).
bool has_hf_config(const std::string& path);
// The architecture of config.json in `dir` (LlamaForCausalLM fields); throws naming the field
// for what the model cannot represent (biases, RoPE scaling other than Llama 3's, another
// architecture).
LlamaConfig read_hf_config(const std::string& dir);
// The same from the text of a config.json's object; `where` names it in errors.
LlamaConfig llama_config_from_json(const std::string& text, const std::string& where);

// Collective. Loads the weights of a .safetensors file, or of every *.safetensors file in a
// directory, into `model` (sharded or not): each rank reads the rows of its own shards, converted
// to the parameters' dtype. Every parameter must be found with its full shape, and every tensor
// in the files must be a parameter (a tied model may carry lm_head.weight); otherwise an error
// names them. `progress` is told this rank's bytes read as each parameter is filled.
void load_hf_weights(LlamaImpl& model, const std::string& path, const ByteProgress& progress = {});

// Whether an --export PATH names one .safetensors file (else a directory).
bool exports_single_file(const std::string& path);

// How export_hf writes the weights.
struct ExportOptions {
  at::ScalarType dtype = at::kFloat;  // float32 or bfloat16 (what Hugging Face publishes)
  // A directory export splits its weights into files of at most this many bytes (a tensor larger
  // than that gets a file of its own), named model-00001-of-0000N.safetensors with
  // model.safetensors.index.json, as Hugging Face publishes them; one file is model.safetensors.
  int64_t max_file_bytes = int64_t(5) << 30;
  std::string imported_from;  // the directory --init-from read, or ""
  // The writer's name (fsdp-train's run id): the model is staged at PATH.tmp-<writer>, where no
  // other writer's staging is, and an earlier one of this writer is removed first.
  std::string writer = "export";
  // Whether a model already at PATH (or one another writer publishes there meanwhile) is replaced;
  // without it the export is published only where nothing is, else it fails naming where it is left.
  bool replace = false;
  // Told rank 0's bytes written of all the weights' as each tensor is written.
  ByteProgress progress;
};

// The dtype config.json of a Hugging Face directory names ("torch_dtype", or transformers 5's
// "dtype"), float32 where it names none or there is no such directory: --export-dtype's default.
at::ScalarType imported_dtype(const std::string& imported_from);

// Collective. Writes `model`'s weights with Hugging Face names: PATH.safetensors, or a directory
// PATH with config.json and the weight files that transformers' from_pretrained reads. A model
// imported from the directory options.imported_from keeps every field of its config.json
// (torch_dtype says what is written) and its generation_config.json and tokenizer files. Written
// whole as PATH.tmp and then put in PATH's place, replacing what was there. Parameters are
// gathered one at a time; rank 0 writes.
void export_hf(LlamaImpl& model, Communicator& comm, const std::string& path, const ExportOptions& options);

}  // namespace fsdp::model
