// Sharded checkpoints (include/fsdp/sharded_checkpoint.h): each rank writes its rows of every
// sharded tensor as one file, rank 0 writes the metadata (src/checkpoint/checkpoint_format.h) last and
// renames the directory into place; loading reads, for each tensor, the blocks of the saved ranks
// whose rows overlap this rank's, checks each block's checksum, and copies the overlap.
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/version.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <future>
#include <stdexcept>
#include <thread>

#include "checkpoint/checkpoint_format.h"
#include "io/files.h"
#include "runtime/group_state.h"
#include "runtime/runtime.h"
#include "shard/shard_layout.h"

namespace fsdp {
int64_t checkpoint_step(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() < 6 || name.size() > 23 ||
      name.find_first_not_of("0123456789", 5) != std::string::npos)
    return -1;
  return std::stoll(name.substr(5));
}

namespace {

using io::CheckpointError;

constexpr size_t kMaxMetadataBytes = size_t{1} << 30;

std::string system_error(const std::string& what) { return what + ": " + std::strerror(errno); }

at::Tensor on_host(const at::Tensor& t) { return t.detach().to(at::kCPU).contiguous(); }

std::string read_whole(const std::string& path, size_t limit) {
  const int64_t size = io::file_size(path);
  if (size < 0) throw CheckpointError(path + ": missing; not a complete checkpoint (an interrupted save?)");
  if (static_cast<uint64_t>(size) > limit)
    throw CheckpointError(path + ": " + std::to_string(size) + " bytes, more than a metadata file can be");
  std::string bytes(static_cast<size_t>(size), '\0');
  std::ifstream in(path, std::ios::binary);
  if (!in.read(bytes.data(), static_cast<std::streamsize>(size))) throw CheckpointError(path + ": cannot be read");
  return bytes;
}

// Runs `work` on every rank; if it throws anywhere, every rank throws: the failing ones their
// own message, the others one that points at them. No rank is left waiting in a collective.
template <class F>
void on_every_rank(Communicator& comm, const std::string& action, F&& work) {
  std::string error;
  try {
    work();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const int failures = comm.count_ranks(!error.empty());
  if (!error.empty()) throw CheckpointError(error);
  if (failures > 0)
    throw CheckpointError(action + " failed on " + std::to_string(failures) + " other rank(s); their messages say why");
}

Communicator& communicator_of(const CheckpointState& state) {
  if (state.sharded().empty()) throw std::invalid_argument("fsdp: the checkpoint state holds no sharded tensor");
  return *state.sharded().front().comm;
}

// Byte offset of each tensor's block in each saved rank's file, and each file's size.
struct BlockMap {
  std::vector<std::vector<uint64_t>> offset;  // [tensor][rank]
  std::vector<uint64_t> file_size;            // [rank]
};

// Where each saved rank's block of a tensor lies: as placed (tensor parallelism), or its rows
// as fully_shard splits them over the saving ranks.
std::vector<io::BlockPlace> places_of(const io::TensorMeta& t, uint32_t world) {
  if (!t.places.empty()) return t.places;
  const ShardLayout l = ShardLayout::of_shape(t.shape, static_cast<int>(world));
  std::vector<io::BlockPlace> places(world);
  for (uint32_t r = 0; r < world; ++r) {
    const int rank = static_cast<int>(r);
    if (l.local_rows(rank) > 0) places[r].row_runs.emplace_back(l.first_row(rank), l.local_rows(rank));
    places[r].columns = l.row_numel;
  }
  return places;
}

BlockMap block_map(const io::CheckpointMeta& meta) {
  BlockMap map;
  map.file_size.assign(meta.world, 0);
  for (const auto& t : meta.sharded) {
    const auto places = places_of(t, meta.world);
    std::vector<uint64_t> offsets(meta.world);
    for (uint32_t r = 0; r < meta.world; ++r) {
      offsets[r] = map.file_size[r];
      map.file_size[r] += static_cast<uint64_t>(places[r].rows() * places[r].columns) * io::element_size(t.dtype);
    }
    map.offset.push_back(std::move(offsets));
  }
  return map;
}

void require_same(const std::string& file, const std::string& name, const at::Tensor& local,
                  const std::vector<int64_t>& want_shape, const io::TensorMeta& saved) {
  if (saved.shape != want_shape || saved.dtype != static_cast<uint8_t>(local.scalar_type()))
    throw CheckpointError(file + ": '" + name + "' is saved as " + c10::toString(static_cast<c10::ScalarType>(saved.dtype)) +
                          " of shape " + c10::str(at::IntArrayRef(saved.shape)) + ", but this model has " +
                          c10::toString(local.scalar_type()) + " of shape " + c10::str(at::IntArrayRef(want_shape)) +
                          ": a checkpoint of another model or dtype");
}

// A saved rank's file as loading first opened it: later reads (the second pass) take bytes only
// from that same file, since the first pass checked them (savers write new files and rename them
// into place, never rewrite one).
struct FileIdentity {
  bool known = false;
  dev_t device = 0;
  ino_t inode = 0;
  off_t size = 0;
  int64_t modified_ns = 0;
  bool same(const FileIdentity& o) const {
    return device == o.device && inode == o.inode && size == o.size && modified_ns == o.modified_ns;
  }
};

// One saved rank's file, open for reading blocks.
class BlockReader {
 public:
  // Opens `file`: the first opening records `identity`, later ones must find it again.
  BlockReader(const std::string& file, FileIdentity& identity) : file_(file) {
    fd_ = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw CheckpointError(system_error(file));
    struct stat st{};
    const bool inspected = ::fstat(fd_, &st) == 0;
    const FileIdentity now{true, st.st_dev, st.st_ino, st.st_size,
                           static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
    if (inspected && !identity.known) identity = now;
    if (!inspected || !now.same(identity)) {
      ::close(fd_);
      throw CheckpointError(file + ": changed while the checkpoint was being loaded");
    }
  }
  ~BlockReader() { ::close(fd_); }
  void read(void* dst, size_t bytes, uint64_t offset, const std::string& name) const {
    size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd_, static_cast<char*>(dst) + done, bytes - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    if (done != bytes) throw CheckpointError(file_ + ": cannot read '" + name + "'");
  }

 private:
  std::string file_;
  int fd_ = -1;
};

// A saved tensor (its place in the metadata), the elements of it wanted (`place`) and where they
// go: `into`, [place.rows(), place.columns].
struct WantedTensor {
  size_t index = 0;
  io::BlockPlace place;
  at::Tensor into;
};

// One saved rank's whole block of a tensor ([rows, columns]), read so that its checksum can be
// checked, and the parts of it that are wanted: block rows [row, row + into.size(0)) and columns
// [column, column + into.size(1)) go into each `into`.
struct BlockRead {
  const io::TensorMeta* saved = nullptr;
  uint32_t rank = 0;
  uint64_t offset = 0;  // in the rank's file
  int64_t rows = 0, columns = 0;
  struct Copy {
    int64_t row = 0, column = 0;
    at::Tensor into;
  };
  std::vector<Copy> copies;
};

int64_t bytes_of(const BlockRead& b) { return b.rows * b.columns * static_cast<int64_t>(io::element_size(b.saved->dtype)); }

// The bytes a save or load has moved on this rank, told to its CheckpointState::progress.
struct BytesMoved {
  const ByteProgress* progress = nullptr;  // null: told to no one
  int64_t total = 0;
  int64_t done = 0;
  void add(int64_t bytes) {
    done += bytes;
    if (progress && *progress) (*progress)(done, total);
  }
};

std::string shard_file(const std::string& dir, const io::CheckpointMeta& meta, uint32_t rank) {
  return dir + "/" + io::shard_file_name(static_cast<int>(rank), static_cast<int>(meta.world));
}

// The blocks of each wanted tensor that overlap its wanted elements, in order; each file's size is
// checked first.
std::vector<BlockRead> blocks_to_read(const std::string& dir, const io::CheckpointMeta& meta, const BlockMap& blocks,
                                      const std::vector<WantedTensor>& wanted) {
  std::vector<BlockRead> reads;
  for (const WantedTensor& w : wanted) {
    const io::TensorMeta& saved = meta.sharded[w.index];
    const auto places = places_of(saved, meta.world);
    const int64_t first_column = w.place.first_column;
    for (uint32_t r = 0; r < meta.world; ++r) {
      const io::BlockPlace& then = places[r];
      const int64_t column = std::max(first_column, then.first_column);
      const int64_t columns = std::min(first_column + w.place.columns, then.first_column + then.columns) - column;
      if (columns <= 0) continue;
      BlockRead read{&saved, r, blocks.offset[w.index][r], then.rows(), then.columns, {}};
      int64_t into_row = 0;  // of the wanted run in `into`
      for (const auto& [want_first, want_rows] : w.place.row_runs) {
        int64_t block_row = 0;  // of the saved run in the block
        for (const auto& [saved_first, saved_rows] : then.row_runs) {
          const int64_t begin = std::max(want_first, saved_first);
          const int64_t end = std::min(want_first + want_rows, saved_first + saved_rows);
          if (begin < end)
            read.copies.push_back({block_row + begin - saved_first, column - then.first_column,
                                   w.into.narrow(0, into_row + begin - want_first, end - begin)
                                       .narrow(1, column - w.place.first_column, columns)});
          block_row += saved_rows;
        }
        into_row += want_rows;
      }
      if (read.copies.empty()) continue;
      const std::string file = shard_file(dir, meta, r);
      const int64_t size = io::file_size(file);
      if (size < 0 || static_cast<uint64_t>(size) != blocks.file_size[r])
        throw CheckpointError(file + ": " + (size < 0 ? "missing" : std::to_string(size) + " bytes, expected " +
                                                                     std::to_string(blocks.file_size[r])) +
                              "; the checkpoint is incomplete or damaged");
      reads.push_back(std::move(read));
    }
  }
  return reads;
}

// What a pass over the blocks does with each: check its checksum, copy its overlap, or both. A
// load checks everything first (Check) and then copies from files unchanged since (Copy); a
// conversion does both in one pass per tensor.
enum class Pass { Check, Copy, CheckAndCopy };

// Whether a pass reads a block straight into the elements it fills: when it only copies, the block
// is exactly those elements, and they are contiguous host memory (a resume on as many CPU ranks).
bool reads_into_place(const BlockRead& b, Pass pass) {
  if (pass != Pass::Copy || b.copies.size() != 1) return false;
  const BlockRead::Copy& c = b.copies[0];
  return c.row == 0 && c.column == 0 && c.into.size(0) == b.rows && c.into.size(1) == b.columns && c.into.is_cpu() &&
         c.into.is_contiguous();
}

// Loads the blocks `reads` (blocks_to_read's): each read whole, its checksum checked, its overlap
// copied, or both (`pass`), and counted in `moved`. The next block is read on a thread of its own while this one is checked or
// copied, so the disk and the checksum overlap. Blocks not read into place take turns in two
// buffers as large as the largest block: fresh memory for each would be faulted in page by page.
void load_rows(const std::vector<BlockRead>& reads, const std::string& dir, const io::CheckpointMeta& meta,
               std::vector<FileIdentity>& identities, Pass pass, BytesMoved& moved) {
  std::vector<bool> in_place;  // reads_into_place, once per block
  int64_t largest = 0;
  for (const BlockRead& b : reads) {
    in_place.push_back(reads_into_place(b, pass));
    if (!in_place.back()) largest = std::max(largest, bytes_of(b));
  }
  const at::Tensor buffers[2] = {at::empty({largest}, at::kByte), at::empty({largest}, at::kByte)};
  // Only these reads open files (one at a time: each starts after the previous one ended), so
  // `identities` is theirs alone; read i fills buffer i % 2 once block i - 2 is done with.
  const auto read = [&](size_t i) {
    const BlockRead& b = reads[i];
    const at::Tensor block = in_place[i]
                                 ? b.copies[0].into
                                 : buffers[i % 2]
                                       .narrow(0, 0, bytes_of(b))
                                       .view(static_cast<c10::ScalarType>(b.saved->dtype))
                                       .view({b.rows, b.columns});
    const BlockReader reader(shard_file(dir, meta, b.rank), identities[b.rank]);
    reader.read(block.data_ptr(), static_cast<size_t>(bytes_of(b)), b.offset, b.saved->name);
    return block;
  };
  std::future<at::Tensor> next;
  if (!reads.empty()) next = std::async(std::launch::async, read, 0);
  for (size_t i = 0; i < reads.size(); ++i) {
    const at::Tensor block = next.get();
    if (i + 1 < reads.size()) next = std::async(std::launch::async, read, i + 1);
    const BlockRead& b = reads[i];
    if (pass != Pass::Copy && io::crc32(block.data_ptr(), block.nbytes()) != b.saved->block_crcs[b.rank])
      throw CheckpointError(shard_file(dir, meta, b.rank) + ": checksum mismatch in '" + b.saved->name +
                            "': the file is damaged");
    moved.add(bytes_of(b));
    if (pass == Pass::Check) continue;
    if (in_place[i]) {  // written through its pointer: its version counter says it changed (keep_compute_shards)
      block.unsafeGetTensorImpl()->bump_version();
      continue;
    }
    for (const BlockRead::Copy& c : b.copies)
      c.into.copy_(block.narrow(0, c.row, c.into.size(0)).narrow(1, c.column, c.into.size(1)));
  }
}

// Where this rank's elements of a sharded tensor of `state` lie in the saved tensor.
io::BlockPlace place_of(const HeldElements& held) { return {held.row_runs, held.first_column, held.columns}; }

}  // namespace

void CheckpointState::add_sharded(const std::string& name, at::Tensor local, const at::Tensor& like) {
  auto owner = Runtime::get().owner_of(like);
  if (!owner) throw std::invalid_argument("fsdp: '" + name + "' is laid out like a parameter that is not sharded: "
                                          "fully_shard the root module before checkpointing");
  const ShardedParam& p = owner->state->params().sharded()[owner->index];
  if (!local.sizes().equals(p.shard.sizes()))
    throw std::invalid_argument("fsdp: '" + name + "' has shape " + c10::str(local.sizes()) + ", not that of its "
                                "parameter's shard " + c10::str(p.shard.sizes()));
  sharded_.push_back({name, std::move(local), held_elements_of(like), &owner->state->params().comm(),
                      owner->state->params().replicate()});
  const TpPart* part = tp_part_of(like);
  const bool first_part = part && !replica_;
  if (part) {
    tp_ = part->tp.get();
    replica_ = part->replica.get();
    sharded_.back().comm = replica_;
  }
  if (!replica_) return;
  // Under tensor parallelism a replica's ranks save every entry; what the tp ranks hold alike
  // (an entry not over the replica yet), the first of them: this entry, and with the first part
  // every earlier one.
  const auto over_the_replica = [this](Sharded& entry) {
    if (entry.comm == replica_) return;
    entry.comm = replica_;
    entry.saves = tp_->rank() == 0;
  };
  if (first_part)
    for (Sharded& entry : sharded_) over_the_replica(entry);
  else
    over_the_replica(sharded_.back());
}

void CheckpointState::add_replicated(const std::string& name, at::Tensor value) {
  replicated_.emplace_back(name, std::move(value));
}

CheckpointState model_state(torch::nn::Module& root) {
  CheckpointState state;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) state.add_sharded(item.key(), item.value(), item.value());
  return state;
}

bool is_optimizer_state(const std::string& name) {
  return name.rfind(kOptimizerPrefix, 0) == 0 || name.rfind(kAdamPrefix, 0) == 0;
}

std::string checkpoint_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return name;
}

namespace {

// What a save publishes besides the rows: each sharded tensor's name, dtype and shape (and, placed,
// where this rank's block lies in it), the replicated values on the host, the caller's entries (a
// copy: the caller may change them).
struct SaveManifest {
  struct Entry {
    std::string name;
    c10::ScalarType dtype;
    std::vector<int64_t> full_shape;
    io::BlockPlace mine;
  };
  std::vector<Entry> sharded;
  bool placed = false;
  std::vector<std::pair<std::string, at::Tensor>> replicated;
  std::map<std::string, std::string> extra;
};

// What this rank writes of a sharded tensor: its elements, or nothing where another tp rank
// saves the same ones.
at::Tensor block_to_save(const CheckpointState::Sharded& t) {
  return t.saves ? on_host(t.local) : at::empty({0}, at::TensorOptions(t.local.scalar_type()));
}

SaveManifest manifest_of(const CheckpointState& state) {
  SaveManifest m;
  m.placed = state.placed();
  for (const auto& t : state.sharded()) {
    const io::BlockPlace none{{}, 0, t.held.columns};
    m.sharded.push_back({t.name, t.local.scalar_type(), t.held.full_shape, t.saves ? place_of(t.held) : none});
  }
  for (const auto& [name, value] : state.replicated()) m.replicated.emplace_back(name, on_host(value).clone());
  m.extra = state.extra;
  return m;
}

// The save protocol among the ranks of one replica (all ranks without HSDP), in three steps.
// 1. Rank 0 makes DIR.tmp (collective).
void prepare_save(const std::string& dir, Communicator& comm) {
  const std::string tmp = dir + ".tmp", parent = io::parent_of(dir);
  on_every_rank(comm, "saving " + dir, [&] {
    if (comm.rank() != 0) return;
    if (!io::is_directory(parent))
      throw std::runtime_error("cannot save '" + dir + "': the directory '" + parent + "' does not exist");
    io::remove_tree(tmp);  // an interrupted earlier save
    io::make_directories(tmp);
  });
}

// 2. This rank's file: the host rows of each sharded tensor in turn (`rows(i)`); their checksums.
// Local: no collective (an asynchronous save runs it on its own thread, without `moved`).
std::vector<int64_t> write_rows(const std::string& dir, int rank, int world, size_t count,
                                const std::function<at::Tensor(size_t)>& rows, BytesMoved* moved = nullptr) {
  std::vector<int64_t> crcs;
  io::OutputFile out(dir + ".tmp/" + io::shard_file_name(rank, world));
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor host = rows(i);
    // The checksum on a thread of its own while the same bytes are written: both only read them.
    auto crc = std::async(std::launch::async, [&host] { return io::crc32(host.data_ptr(), host.nbytes()); });
    out.write(host.data_ptr(), host.nbytes());
    crcs.push_back(crc.get());
    if (moved) moved->add(static_cast<int64_t>(host.nbytes()));
  }
  out.close();
  return crcs;
}

// Every rank's place of every tensor, on rank 0 (empty elsewhere): [rank][tensor]. Collective.
std::vector<std::vector<io::BlockPlace>> gather_places(const SaveManifest& manifest, Communicator& comm) {
  std::vector<int64_t> mine;  // per tensor: runs, (first, rows) per run, first column, columns
  for (const auto& t : manifest.sharded) {
    mine.push_back(static_cast<int64_t>(t.mine.row_runs.size()));
    for (const auto& [first, rows] : t.mine.row_runs) mine.insert(mine.end(), {first, rows});
    mine.insert(mine.end(), {t.mine.first_column, t.mine.columns});
  }
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(comm.device());
  at::Tensor lengths = at::empty({comm.world_size()}, on_device);
  comm.all_gather(lengths, at::full({1}, static_cast<int64_t>(mine.size()), on_device));
  const int64_t longest = lengths.max().item<int64_t>();
  mine.resize(static_cast<size_t>(longest), 0);
  at::Tensor all = at::empty({comm.world_size() * longest}, on_device);
  comm.all_gather(all, at::tensor(mine, at::kLong).to(comm.device()));
  std::vector<std::vector<io::BlockPlace>> places;
  if (comm.rank() != 0) return places;
  all = all.cpu();
  for (int r = 0; r < comm.world_size(); ++r) {
    const int64_t* at = all.data_ptr<int64_t>() + r * longest;
    places.emplace_back();
    for (size_t i = 0; i < manifest.sharded.size(); ++i) {
      io::BlockPlace place;
      const int64_t runs = *at++;
      for (int64_t k = 0; k < runs; ++k, at += 2) place.row_runs.emplace_back(at[0], at[1]);
      place.first_column = *at++;
      place.columns = *at++;
      places.back().push_back(std::move(place));
    }
  }
  return places;
}

// 3. Every rank's block checksums (and places) reach rank 0, which writes the metadata last and
// publishes (collective).
void publish_save(const std::string& dir, const SaveManifest& manifest, const std::vector<int64_t>& crcs,
                  Communicator& comm) {
  const std::string tmp = dir + ".tmp", parent = io::parent_of(dir);
  const int64_t n = static_cast<int64_t>(manifest.sharded.size());
  at::Tensor local = at::tensor(crcs, at::kLong).to(comm.device());
  at::Tensor all = at::empty({comm.world_size() * n}, local.options());
  if (n > 0) comm.all_gather(all, local);
  all = all.cpu();
  const int64_t* gathered = all.data_ptr<int64_t>();  // [rank][tensor]
  const auto places = manifest.placed ? gather_places(manifest, comm) : std::vector<std::vector<io::BlockPlace>>();
  on_every_rank(comm, "saving " + dir, [&] {
    if (comm.rank() != 0) return;
    io::CheckpointMeta meta;
    meta.library_version = std::string("fsdp.cpp ") + version();
    meta.world = static_cast<uint32_t>(comm.world_size());
    for (int64_t i = 0; i < n; ++i) {
      const auto& t = manifest.sharded[i];
      io::TensorMeta m{t.name, static_cast<uint8_t>(t.dtype), t.full_shape, {}, {}, {}};
      for (int r = 0; r < comm.world_size(); ++r) m.block_crcs.push_back(static_cast<uint32_t>(gathered[r * n + i]));
      for (const auto& of_rank : places) m.places.push_back(of_rank[i]);
      meta.sharded.push_back(std::move(m));
    }
    for (const auto& [name, host] : manifest.replicated)
      meta.replicated.push_back({name, static_cast<uint8_t>(host.scalar_type()), host.sizes().vec(), {}, {},
                                 std::string(static_cast<const char*>(host.data_ptr()), host.nbytes())});
    meta.extra = manifest.extra;
    const std::string bytes = io::encode(meta);
    io::OutputFile out(tmp + "/metadata.bin");
    out.write(bytes.data(), bytes.size());
    out.close();
    io::sync_directory(tmp);
    io::remove_tree(dir);
    io::rename_path(tmp, dir);
    io::sync_directory(parent);
  });
}

void save_shards(const std::string& dir, const CheckpointState& state, Communicator& comm) {
  c10::NoGradGuard no_grad;
  prepare_save(dir, comm);
  std::vector<int64_t> crcs;
  BytesMoved moved{&state.progress};
  for (const auto& t : state.sharded()) moved.total += t.saves ? static_cast<int64_t>(t.local.nbytes()) : 0;
  on_every_rank(comm, "saving " + dir, [&] {  // one tensor on the host at a time
    crcs = write_rows(dir, comm.rank(), comm.world_size(), state.sharded().size(),
                      [&](size_t i) { return block_to_save(state.sharded()[i]); }, &moved);
  });
  publish_save(dir, manifest_of(state), crcs, comm);
}

// HSDP: the replicas hold the same state; the first one writes it, the others learn its outcome
// (`replicate`: the replicas' communicator, null without HSDP).
template <class F>
void on_first_replica(Communicator* replicate, const std::string& dir, F&& work) {
  if (!replicate) return work();
  on_every_rank(*replicate, "saving " + dir, [&] {
    if (replicate->rank() == 0) work();
  });
}

}  // namespace

void save_checkpoint(const std::string& dir, const CheckpointState& state) {
  Communicator& comm = communicator_of(state);
  on_first_replica(state.sharded().front().replicate, dir, [&] { save_shards(dir, state, comm); });
}

struct CheckpointWrite::Writing {
  SaveManifest manifest;
  std::vector<at::Tensor> rows;  // this rank's rows of each sharded tensor, on the host
  std::vector<int64_t> crcs;
  std::exception_ptr error;
  std::thread thread;
};

std::unique_ptr<CheckpointWrite> start_checkpoint_save(const std::string& dir, const CheckpointState& state) {
  Communicator& comm = communicator_of(state);
  std::unique_ptr<CheckpointWrite> write(new CheckpointWrite(dir, state));
  on_first_replica(write->replicate_, dir, [&] {
    c10::NoGradGuard no_grad;
    prepare_save(dir, comm);
    auto w = std::make_unique<CheckpointWrite::Writing>();
    on_every_rank(comm, "saving " + dir, [&] {
      w->manifest = manifest_of(state);
      for (const auto& t : state.sharded()) {
        at::Tensor host = block_to_save(t);
        // A CPU shard's host rows are the shard itself, which the next step changes: copy them.
        w->rows.push_back(host.numel() > 0 && host.data_ptr() == t.local.data_ptr() ? host.clone() : host);
      }
    });
    CheckpointWrite::Writing* raw = w.get();
    const int rank = comm.rank(), world = comm.world_size();
    raw->thread = std::thread([raw, dir, rank, world] {
      try {
        raw->crcs = write_rows(dir, rank, world, raw->rows.size(), [raw](size_t i) { return raw->rows[i]; });
      } catch (...) {
        raw->error = std::current_exception();
      }
      raw->rows.clear();  // the host copy goes as soon as it is on disk
    });
    write->writing_ = std::move(w);
  });
  return write;
}

CheckpointWrite::CheckpointWrite(std::string dir, const CheckpointState& state)
    : dir_(std::move(dir)), comm_(&communicator_of(state)), replicate_(state.sharded().front().replicate) {}

CheckpointWrite::~CheckpointWrite() {
  if (writing_ && writing_->thread.joinable()) writing_->thread.join();  // unpublished: DIR.tmp stays
}

void CheckpointWrite::finish() {
  if (finished_) throw std::logic_error("CheckpointWrite::finish: '" + dir_ + "' was already finished");
  finished_ = true;
  on_first_replica(replicate_, dir_, [&] {
    on_every_rank(*comm_, "saving " + dir_, [&] {
      writing_->thread.join();
      if (writing_->error) std::rethrow_exception(writing_->error);
    });
    publish_save(dir_, writing_->manifest, writing_->crcs, *comm_);
  });
}

namespace {

// The names of the checkpoint's tensors `state` does not hold.
std::vector<std::string> unheld_tensors(const io::CheckpointMeta& meta, const CheckpointState& state) {
  std::set<std::string> held;
  for (const auto& want : state.sharded()) held.insert(want.name);
  for (const auto& [name, value] : state.replicated()) held.insert(name);
  std::vector<std::string> unheld;
  for (const auto* saved : {&meta.sharded, &meta.replicated})
    for (const auto& t : *saved)
      if (!held.count(t.name)) unheld.push_back(t.name);
  return unheld;
}

}  // namespace

std::vector<std::string> load_checkpoint(const std::string& dir, CheckpointState& state, const std::string& leave_out) {
  Communicator& comm = communicator_of(state);
  c10::NoGradGuard no_grad;
  const std::string meta_path = dir + "/metadata.bin";
  io::CheckpointMeta meta;
  BlockMap blocks;
  std::vector<WantedTensor> wanted;  // per sharded tensor of `state`: its place in the metadata, its rows
  std::vector<const io::TensorMeta*> saved_replicated;
  std::vector<FileIdentity> identities;
  std::vector<BlockRead> reads;
  BytesMoved moved{&state.progress};
  std::vector<std::string> left_out;
  // Everything is checked on every rank (names, shapes, dtypes, counts, sizes, every block's
  // checksum) before the first byte is copied: a load that fails leaves the state as it was.
  on_every_rank(comm, "loading " + dir, [&] {
    meta = io::decode(read_whole(meta_path, kMaxMetadataBytes), meta_path);
    blocks = block_map(meta);
    identities.resize(meta.world);
    left_out = unheld_tensors(meta, state);
    for (const auto& name : left_out)
      if (leave_out.empty() || name.rfind(leave_out, 0) != 0)
        throw CheckpointError(meta_path + ": holds '" + name + "', which this model does not (" +
                              std::to_string(meta.sharded.size() + meta.replicated.size()) + " tensors saved, " +
                              std::to_string(state.sharded().size() + state.replicated().size()) +
                              " here): a checkpoint of another model");
    for (const auto& want : state.sharded()) {
      auto it = std::find_if(meta.sharded.begin(), meta.sharded.end(), [&](const auto& t) { return t.name == want.name; });
      if (it == meta.sharded.end()) throw CheckpointError(meta_path + ": has no '" + want.name + "': a checkpoint of another model");
      require_same(meta_path, want.name, want.local, want.held.full_shape, *it);
      wanted.push_back({static_cast<size_t>(it - meta.sharded.begin()), place_of(want.held),
                        want.local.view({want.held.rows(), want.held.columns})});
    }
    for (const auto& [name, value] : state.replicated()) {
      auto it = std::find_if(meta.replicated.begin(), meta.replicated.end(), [&](const auto& t) { return t.name == name; });
      if (it == meta.replicated.end()) throw CheckpointError(meta_path + ": has no '" + name + "'");
      require_same(meta_path, name, value, value.sizes().vec(), *it);
      saved_replicated.push_back(&*it);
    }
    reads = blocks_to_read(dir, meta, blocks, wanted);
    for (const BlockRead& b : reads) moved.total += 2 * bytes_of(b);  // read to check, then to copy
    load_rows(reads, dir, meta, identities, Pass::Check, moved);
  });
  on_every_rank(comm, "loading " + dir, [&] {
    load_rows(reads, dir, meta, identities, Pass::Copy, moved);
    for (size_t i = 0; i < state.replicated().size(); ++i) {
      const at::Tensor& value = state.replicated()[i].second;
      value.copy_(at::from_blob(const_cast<char*>(saved_replicated[i]->bytes.data()), value.sizes(),
                                value.options().device(at::kCPU)));
    }
    state.extra = meta.extra;
  });
  return left_out;
}

void for_each_checkpoint_tensor(const std::string& dir,
                                const std::function<void(const std::string&, const at::Tensor&)>& visit) {
  c10::NoGradGuard no_grad;
  const std::string meta_path = dir + "/metadata.bin";
  const io::CheckpointMeta meta = io::decode(read_whole(meta_path, kMaxMetadataBytes), meta_path);
  const BlockMap blocks = block_map(meta);
  std::vector<FileIdentity> identities(meta.world);
  for (size_t i = 0; i < meta.sharded.size(); ++i) {
    const io::TensorMeta& saved = meta.sharded[i];
    at::Tensor full = at::empty(saved.shape, at::TensorOptions(static_cast<c10::ScalarType>(saved.dtype)));
    const io::BlockPlace whole{{{0, saved.rows()}}, 0, saved.row_numel()};
    BytesMoved unseen;
    load_rows(blocks_to_read(dir, meta, blocks, {{i, whole, full.view({saved.rows(), saved.row_numel()})}}), dir,
              meta, identities, Pass::CheckAndCopy, unseen);
    visit(saved.name, full);
  }
  for (const auto& saved : meta.replicated) {
    at::Tensor value = at::empty(saved.shape, at::TensorOptions(static_cast<c10::ScalarType>(saved.dtype)));
    std::memcpy(value.data_ptr(), saved.bytes.data(), std::min(saved.bytes.size(), value.nbytes()));
    visit(saved.name, value);
  }
}

std::map<std::string, std::string> checkpoint_extra(const std::string& dir) {
  const std::string meta_path = dir + "/metadata.bin";
  return io::decode(read_whole(meta_path, kMaxMetadataBytes), meta_path).extra;
}

std::string newest_checkpoint(const std::string& parent) {
  if (io::exists(parent + "/metadata.bin")) return parent;  // a checkpoint itself
  std::string best;
  int64_t best_step = -1;
  for (const auto& name : io::list_directory(parent)) {
    const int64_t step = checkpoint_step(name);
    if (step > best_step && io::exists(parent + "/" + name + "/metadata.bin")) {
      best = name;
      best_step = step;
    }
  }
  return best.empty() ? "" : parent + "/" + best;
}

}  // namespace fsdp
