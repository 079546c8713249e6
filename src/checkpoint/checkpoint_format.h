// The bytes of a sharded checkpoint's metadata, and the checksum of every byte it covers. No
// tensors here: the format is plain data so that the reader, which takes untrusted input, can be
// tested (and fuzzed) on its own.
//
// A checkpoint is a directory:
//   metadata.bin        this format, written last, by rank 0
//   shard-R-of-W.bin    rank R's rows of every sharded tensor, one block per tensor, in the
//                       metadata's order, raw little-endian elements
// metadata.bin:
//   "FSDPCKPT" | u32 format version | string library version | u32 world size
//   u32 n, then per sharded tensor: string name | u8 dtype | u32 ndim | i64 dims[ndim]
//                                   | per rank: u32 crc32 of its block
//                                   | version 2 only: u8 placed; if 1, per rank: u32 runs
//                                     | per run: i64 first row, i64 rows | i64 first column
//                                     | i64 columns (BlockPlace)
//   u32 n, then per replicated tensor (the same on every rank): name | dtype | ndim | dims
//                                   | u64 byte count | bytes
//   u32 n, then per extra entry: string key | u64 byte count | bytes
//   u32 crc32 of everything before it
// Strings are a u32 length and the bytes. A tensor's rows are split over the ranks as fully_shard
// splits them (ShardLayout: dim 0, ceil(rows / world) per rank), so block offsets follow from the
// shapes and need not be stored; unless the tensor is placed (version 2: tensor parallelism),
// each rank's block then being the rows and columns its BlockPlace says. A file without placed
// tensors is written as version 1, which every reader since takes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp::io {

constexpr uint32_t kCheckpointFormatVersion = 2;  // the newest this build reads and writes

// A checkpoint that cannot be used: says which file and what is wrong.
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The CRC-32 (IEEE 802.3, zlib's) of `size` bytes, continuing `crc` (that of the bytes before).
uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);

// Where a saved rank's block lies in its tensor: the tensor's rows `row_runs` (runs of consecutive
// rows, in the block's order), columns [first_column, first_column + columns) of each (a row of
// a tensor of more than two dimensions is its elements); the block is those elements, row-major.
struct BlockPlace {
  std::vector<std::pair<int64_t, int64_t>> row_runs;  // (first row, rows)
  int64_t first_column = 0, columns = 0;
  int64_t rows() const;
  bool operator==(const BlockPlace& o) const;
};

struct TensorMeta {
  std::string name;
  uint8_t dtype = 0;  // c10::ScalarType
  std::vector<int64_t> shape;
  std::vector<uint32_t> block_crcs;  // sharded: one per rank
  std::vector<BlockPlace> places;    // sharded and placed: one per rank (else empty: ShardLayout's rows)
  std::string bytes;                 // replicated: the data
  int64_t numel() const;
  int64_t rows() const;       // shape[0] (1 for a 0-dim tensor)
  int64_t row_numel() const;  // elements of one row
};

struct CheckpointMeta {
  std::string library_version;
  uint32_t world = 1;
  std::vector<TensorMeta> sharded, replicated;
  std::map<std::string, std::string> extra;
};

std::string encode(const CheckpointMeta& meta);
// Throws CheckpointError naming `what` (the file) for anything malformed: wrong magic or version,
// truncation, a length beyond the data, a bad checksum, an unknown dtype, negative or
// overflowing shapes. Allocates nothing larger than the input.
CheckpointMeta decode(const std::string& bytes, const std::string& what);

// Bytes of one element of a dtype code the format accepts; 0 for any other code.
size_t element_size(uint8_t dtype);
std::string shard_file_name(int rank, int world);

}  // namespace fsdp::io
