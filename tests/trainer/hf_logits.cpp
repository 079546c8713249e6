// hf_logits MODEL TOKENS ROWS COLS OUT: loads Hugging Face Llama weights (a directory with
// config.json) into a sharded fsdp.cpp Llama, runs it on ROWS x COLS int64 tokens (raw
// little-endian file TOKENS) and writes the float32 logits raw to OUT (rank 0). Run under
// fsdp-run; tests/trainer/hf_roundtrip.py compares the logits with transformers'.
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "fsdp/fsdp.h"
#include "model/hf_llama.h"
#include "train/memory.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: hf_logits MODEL_DIR TOKENS ROWS COLS OUT\n");
    return 2;
  }
  try {
    auto comm = fsdp::init();
    auto config = fsdp::model::read_hf_config(argv[1]);
    fsdp::model::Llama model(config, fsdp::model::Placement{comm->device(), /*deferred=*/true});
    for (auto& block : model->blocks) fsdp::fully_shard(block);
    fsdp::fully_shard(model);
    fsdp::model::load_hf_weights(*model, argv[1]);
    std::ifstream in(argv[2], std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    const int64_t rows = std::stoll(argv[3]), cols = std::stoll(argv[4]);
    if (static_cast<int64_t>(bytes.size()) != rows * cols * 8) throw std::invalid_argument("token file size");
    auto tokens = at::from_blob(bytes.data(), {rows, cols}, at::kLong).to(comm->device());
    c10::NoGradGuard no_grad;
    auto logits = fsdp::forward(model, tokens).to(at::kCPU, at::kFloat).contiguous();
    if (comm->rank() == 0)
      fsdp::train::write_file(argv[5], std::string(static_cast<const char*>(logits.data_ptr()), logits.nbytes()));
    fsdp::shutdown();
  } catch (const std::exception& e) {
    fsdp::abort_job(std::string("hf_logits: ") + fsdp::error_text(e));
  }
  return 0;
}
