// The safetensors format (Hugging Face): an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw
// little-endian tensor data. Reading memory-maps the file and treats the header as untrusted:
// every offset, size, dtype and shape is checked against the file before any byte is read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/files.h"

namespace fsdp::io {

struct SafetensorsEntry {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

class SafetensorsFile {
 public:
  // Header larger than this is refused (the format's own readers cap it likewise).
  static constexpr uint64_t kMaxHeaderBytes = 100 << 20;

  // Throws std::invalid_argument naming the file and the problem.
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return file_.path(); }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Rows [first_row, first_row + rows) of tensor `name` (along dim 0), copied into a new CPU
  // tensor of `dtype`: only those rows' pages of the file are read.
  at::Tensor read_rows(const std::string& name, int64_t first_row, int64_t rows, at::ScalarType dtype) const;

 private:
  MappedFile file_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Writes `specs` in order; tensor i's contents come from tensor_at(i) (a contiguous CPU tensor of
// the spec's dtype and shape), called once each, so that a large model passes through one tensor
// at a time. Written to PATH.tmp, synced, then renamed: the file appears complete or not at all.
void write_safetensors(const std::string& path, const std::vector<SafetensorsSpec>& specs,
                       const std::function<at::Tensor(size_t)>& tensor_at,
                       const std::map<std::string, std::string>& metadata = {});

// The format's name of a dtype ("F32", "BF16", ...); throws for one it cannot hold.
std::string safetensors_dtype_name(at::ScalarType dtype);

}  // namespace fsdp::io
