#include "checkpoint/checkpoint_format.h"

#include <c10/core/ScalarType.h>
#include <zlib.h>

#include <cstring>
#include <limits>

namespace fsdp::io {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'C', 'K', 'P', 'T'};
constexpr uint32_t kMaxDims = 64;
constexpr uint32_t kMaxWorld = 1 << 20;

class Writer {
 public:
  template <class T>
  void put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void put_bytes(const std::string& s, bool long_length) {
    long_length ? put<uint64_t>(s.size()) : put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void put_tensor_head(const TensorMeta& t) {
    put_bytes(t.name, false);
    put<uint8_t>(t.dtype);
    put<uint32_t>(static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) put<int64_t>(d);
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

// Every read checks that the bytes are there first; errors name the file and the offset.
class Reader {
 public:
  Reader(const std::string& bytes, size_t end, const std::string& what) : in_(bytes), end_(end), what_(what) {}
  [[noreturn]] void fail(const std::string& why) const {
    throw CheckpointError(what_ + ": " + why + " (at byte " + std::to_string(pos_) + "); the checkpoint is "
                          "damaged or not one written by fsdp.cpp");
  }
  template <class T>
  T get() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string get_bytes(bool long_length) {
    const uint64_t n = long_length ? get<uint64_t>() : get<uint32_t>();
    need(n);
    std::string s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  uint32_t get_count(const char* what) {
    const uint32_t n = get<uint32_t>();
    // Each entry takes at least 4 bytes: a count beyond the rest of the file is a lie.
    if (n > (end_ - pos_) / 4) fail(std::string("claims ") + std::to_string(n) + " " + what);
    return n;
  }
  void get_tensor_head(TensorMeta& t) {
    t.name = get_bytes(false);
    t.dtype = get<uint8_t>();
    if (element_size(t.dtype) == 0) fail("tensor '" + t.name + "' has an unknown dtype code " + std::to_string(t.dtype));
    const uint32_t ndim = get<uint32_t>();
    if (ndim > kMaxDims) fail("tensor '" + t.name + "' claims " + std::to_string(ndim) + " dimensions");
    int64_t numel = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      const int64_t size = get<int64_t>();
      if (size < 0 || (size > 0 && numel > std::numeric_limits<int64_t>::max() / 8 / size))
        fail("tensor '" + t.name + "' has an impossible shape");
      numel *= size;
      t.shape.push_back(size);
    }
  }
  // A saved rank's place in tensor t, every row and column inside it.
  BlockPlace get_place(const TensorMeta& t) {
    BlockPlace place;
    const uint32_t runs = get_count("row runs");
    for (uint32_t i = 0; i < runs; ++i) {
      const int64_t first = get<int64_t>(), rows = get<int64_t>();
      if (first < 0 || rows < 0 || first > t.rows() || rows > t.rows() - first)
        fail("tensor '" + t.name + "' places rows outside its " + std::to_string(t.rows()));
      place.row_runs.emplace_back(first, rows);
    }
    place.first_column = get<int64_t>();
    place.columns = get<int64_t>();
    if (place.first_column < 0 || place.columns < 0 || place.first_column > t.row_numel() ||
        place.columns > t.row_numel() - place.first_column)
      fail("tensor '" + t.name + "' places columns outside its " + std::to_string(t.row_numel()));
    return place;
  }
  size_t pos() const { return pos_; }

 private:
  void need(uint64_t n) const {
    if (n > end_ - pos_) fail("ends early (" + std::to_string(n) + " more bytes expected)");
  }
  const std::string& in_;
  size_t end_, pos_ = 0;
  std::string what_;
};

}  // namespace

// zlib's CRC-32 (the same polynomial, reflection and final xor as the table this replaced, so
// older checkpoints still load), several bytes a step instead of one: ~6x its speed.
uint32_t crc32(const void* data, size_t size, uint32_t crc) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), size));
}

int64_t TensorMeta::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t TensorMeta::rows() const { return shape.empty() ? 1 : shape[0]; }

int64_t TensorMeta::row_numel() const {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}

int64_t BlockPlace::rows() const {
  int64_t n = 0;
  for (const auto& run : row_runs) n += run.second;
  return n;
}

bool BlockPlace::operator==(const BlockPlace& o) const {
  return row_runs == o.row_runs && first_column == o.first_column && columns == o.columns;
}

size_t element_size(uint8_t dtype) {
  switch (static_cast<c10::ScalarType>(dtype)) {
    case c10::kByte: case c10::kChar: case c10::kShort: case c10::kInt: case c10::kLong:
    case c10::kHalf: case c10::kFloat: case c10::kDouble: case c10::kBool: case c10::kBFloat16:
      return c10::elementSize(static_cast<c10::ScalarType>(dtype));
    default:
      return 0;
  }
}

std::string shard_file_name(int rank, int world) {
  return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".bin";
}

std::string encode(const CheckpointMeta& meta) {
  bool placed = false;
  for (const auto& t : meta.sharded) placed |= !t.places.empty();
  Writer w;
  w.bytes().append(kMagic, sizeof(kMagic));
  w.put<uint32_t>(placed ? kCheckpointFormatVersion : 1);
  w.put_bytes(meta.library_version, false);
  w.put<uint32_t>(meta.world);
  w.put<uint32_t>(static_cast<uint32_t>(meta.sharded.size()));
  for (const auto& t : meta.sharded) {
    w.put_tensor_head(t);
    for (uint32_t crc : t.block_crcs) w.put<uint32_t>(crc);
    if (!placed) continue;
    w.put<uint8_t>(t.places.empty() ? 0 : 1);
    for (const BlockPlace& place : t.places) {
      w.put<uint32_t>(static_cast<uint32_t>(place.row_runs.size()));
      for (const auto& [first, rows] : place.row_runs) {
        w.put<int64_t>(first);
        w.put<int64_t>(rows);
      }
      w.put<int64_t>(place.first_column);
      w.put<int64_t>(place.columns);
    }
  }
  w.put<uint32_t>(static_cast<uint32_t>(meta.replicated.size()));
  for (const auto& t : meta.replicated) {
    w.put_tensor_head(t);
    w.put_bytes(t.bytes, true);
  }
  w.put<uint32_t>(static_cast<uint32_t>(meta.extra.size()));
  for (const auto& [key, value] : meta.extra) {
    w.put_bytes(key, false);
    w.put_bytes(value, true);
  }
  w.put<uint32_t>(crc32(w.bytes().data(), w.bytes().size()));
  return std::move(w.bytes());
}

CheckpointMeta decode(const std::string& bytes, const std::string& what) {
  if (bytes.size() < sizeof(kMagic) + 8 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    throw CheckpointError(what + ": not an fsdp.cpp checkpoint metadata file (no FSDPCKPT header)");
  const size_t body = bytes.size() - sizeof(uint32_t);
  uint32_t stored = 0;
  std::memcpy(&stored, bytes.data() + body, sizeof(stored));
  if (crc32(bytes.data(), body) != stored)
    throw CheckpointError(what + ": checksum mismatch: the file is damaged or was cut short");
  Reader r(bytes, body, what);
  r.get<uint64_t>();  // the magic, checked above
  const uint32_t version = r.get<uint32_t>();
  if (version < 1 || version > kCheckpointFormatVersion)
    r.fail("format version " + std::to_string(version) + ", this build reads versions 1 to " +
           std::to_string(kCheckpointFormatVersion));
  CheckpointMeta meta;
  meta.library_version = r.get_bytes(false);
  meta.world = r.get<uint32_t>();
  if (meta.world < 1 || meta.world > kMaxWorld) r.fail("world size " + std::to_string(meta.world));
  meta.sharded.resize(r.get_count("sharded tensors"));
  for (auto& t : meta.sharded) {
    r.get_tensor_head(t);
    if (meta.world > (body - r.pos()) / 4) r.fail("ends early");
    for (uint32_t k = 0; k < meta.world; ++k) t.block_crcs.push_back(r.get<uint32_t>());
    if (version >= 2 && r.get<uint8_t>() != 0) {
      for (uint32_t k = 0; k < meta.world; ++k) t.places.push_back(r.get_place(t));
    }
  }
  meta.replicated.resize(r.get_count("replicated tensors"));
  for (auto& t : meta.replicated) {
    r.get_tensor_head(t);
    t.bytes = r.get_bytes(true);
    if (static_cast<uint64_t>(t.numel()) * element_size(t.dtype) != t.bytes.size())
      r.fail("tensor '" + t.name + "' holds " + std::to_string(t.bytes.size()) + " bytes, not what its shape needs");
  }
  const uint32_t extras = r.get_count("extra entries");
  for (uint32_t i = 0; i < extras; ++i) {
    std::string key = r.get_bytes(false);
    meta.extra[key] = r.get_bytes(true);
  }
  if (r.pos() != body) r.fail("has trailing bytes");
  return meta;
}

}  // namespace fsdp::io
