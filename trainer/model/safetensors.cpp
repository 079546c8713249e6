#include "model/safetensors.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/safe_numerics.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <stdexcept>

namespace fsdp::io {
namespace {

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return names;
}

std::invalid_argument bad(const std::string& path, const std::string& why) {
  return std::invalid_argument("safetensors file '" + path + "': " + why);
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

// One entry of the header, every field checked; `data_bytes` is the size of the data section.
SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& j,
                             uint64_t data_bytes) {
  auto fail = [&](const std::string& why) { return bad(path, "tensor '" + name + "': " + why); };
  if (!j.is_object()) throw fail("its header entry is not an object");
  SafetensorsEntry e;
  const auto dtype = j.find("dtype");
  if (dtype == j.end() || !dtype->is_string()) throw fail("no dtype");
  const auto& names = dtype_names();
  const auto known = std::find_if(names.begin(), names.end(), [&](const auto& n) { return n.first == *dtype; });
  if (known == names.end()) throw fail("unsupported dtype '" + dtype->get<std::string>() + "'");
  e.dtype = known->second;
  const auto shape = j.find("shape");
  if (shape == j.end() || !shape->is_array() || shape->size() > 8) throw fail("no shape (an array of at most 8 sizes)");
  uint64_t numel = 1;
  for (const auto& d : *shape) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 40)) throw fail("a size that is not a count");
    e.shape.push_back(d.get<int64_t>());
    if (c10::mul_overflows(numel, d.get<uint64_t>(), &numel)) throw fail("a shape whose element count overflows");
  }
  const auto offsets = j.find("data_offsets");
  if (offsets == j.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned())
    throw fail("no data_offsets [begin, end]");
  e.begin = (*offsets)[0].get<uint64_t>();
  e.end = (*offsets)[1].get<uint64_t>();
  if (e.begin > e.end || e.end > data_bytes)
    throw fail("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
               "] outside the file's " + std::to_string(data_bytes) + " data bytes (a truncated file?)");
  uint64_t bytes = 0;
  if (c10::mul_overflows(numel, uint64_t(c10::elementSize(e.dtype)), &bytes) || bytes != e.end - e.begin)
    throw fail("shape and dtype make " + std::to_string(bytes) + " bytes but data_offsets hold " +
               std::to_string(e.end - e.begin));
  return e;
}

// nlohmann's parser recurses once per nesting level: a crafted header of nested brackets could
// exhaust the stack. A safetensors header nests three levels; anything past 32 is refused first.
bool nests_deeper_than(const char* text, uint64_t n, int limit) {
  int depth = 0;
  bool in_string = false;
  for (uint64_t i = 0; i < n; ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

}  // namespace

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& [name, type] : dtype_names())
    if (type == dtype) return name;
  throw std::invalid_argument(std::string("safetensors cannot hold dtype ") + c10::toString(dtype));
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");
  const uint64_t size = file_.size();
  if (size < 8) throw bad(path, std::to_string(size) + " bytes, shorter than the 8-byte header length");
  const uint64_t header_bytes = read_le64(file_.data());
  if (header_bytes > kMaxHeaderBytes)
    throw bad(path, "a header of " + std::to_string(header_bytes) + " bytes, over the " +
                        std::to_string(kMaxHeaderBytes) + "-byte limit (not a safetensors file?)");
  if (header_bytes > size - 8)
    throw bad(path, "the header claims " + std::to_string(header_bytes) + " bytes but the file has " +
                        std::to_string(size - 8) + " after the length (a truncated file?)");
  data_start_ = 8 + header_bytes;
  const char* text = reinterpret_cast<const char*>(file_.data() + 8);
  if (nests_deeper_than(text, header_bytes, 32)) throw bad(path, "the header nests deeper than 32 levels");
  const nlohmann::json header = nlohmann::json::parse(text, text + header_bytes, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) throw bad(path, "the header is not valid JSON");
  if (!header.is_object()) throw bad(path, "the header is not a JSON object");
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw bad(path, "__metadata__ is not an object");
      for (const auto& [key, text_value] : value.items()) {
        if (!text_value.is_string()) throw bad(path, "__metadata__ value '" + key + "' is not a string");
        metadata_[key] = text_value.get<std::string>();
      }
      continue;
    }
    entries_.emplace(name, parse_entry(path, name, value, size - data_start_));
  }
  // No two tensors may share bytes: a file that aliases them is malformed (or crafted).
  std::vector<std::pair<uint64_t, const std::string*>> starts;
  for (const auto& [name, e] : entries_)
    if (e.end > e.begin) starts.emplace_back(e.begin, &name);
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i)
    if (entries_.at(*starts[i - 1].second).end > starts[i].first)
      throw bad(path, "tensors '" + *starts[i - 1].second + "' and '" + *starts[i].second + "' overlap");
}

at::Tensor SafetensorsFile::read_rows(const std::string& name, int64_t first_row, int64_t rows,
                                      at::ScalarType dtype) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) throw bad(path(), "no tensor '" + name + "'");
  const SafetensorsEntry& e = it->second;
  std::vector<int64_t> shape = e.shape.empty() ? std::vector<int64_t>{1} : e.shape;
  if (first_row < 0 || rows < 0 || first_row + rows > shape[0])
    throw bad(path(), "rows [" + std::to_string(first_row) + ", " + std::to_string(first_row + rows) +
                          ") of '" + name + "', which has " + std::to_string(shape[0]));
  int64_t row_numel = 1;
  for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
  shape[0] = rows;
  const uint64_t offset = data_start_ + e.begin + uint64_t(first_row * row_numel) * c10::elementSize(e.dtype);
  // A read-only view of the mapping; the copy into `dtype` is the only read of these pages.
  const at::Tensor mapped = at::from_blob(const_cast<uint8_t*>(file_.data() + offset), shape,
                                          at::TensorOptions().dtype(e.dtype));
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
  out.copy_(mapped);
  return e.shape.empty() ? out.reshape({}) : out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsSpec>& specs,
                       const std::function<at::Tensor(size_t)>& tensor_at,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<uint64_t> sizes;
  for (const auto& s : specs) {
    uint64_t bytes = c10::elementSize(s.dtype);
    for (int64_t d : s.shape) bytes *= static_cast<uint64_t>(d);
    header[s.name] = {{"dtype", safetensors_dtype_name(s.dtype)}, {"shape", s.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as the format's writers do
  const std::string tmp = path + ".tmp";
  try {
    OutputFile out(tmp);
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));
    out.write(length, 8);
    out.write(text.data(), text.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      const at::Tensor t = tensor_at(i);
      if (t.scalar_type() != specs[i].dtype || !t.is_contiguous() || t.device().type() != c10::kCPU ||
          static_cast<uint64_t>(t.nbytes()) != sizes[i])
        throw std::invalid_argument("write_safetensors: tensor '" + specs[i].name +
                                    "' is not a contiguous CPU tensor of its spec's dtype and shape");
      out.write(t.data_ptr(), t.nbytes());
    }
    out.close();
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  rename_path(tmp, path);
  sync_directory(parent_of(path));
}

}  // namespace fsdp::io
