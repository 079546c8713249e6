// File-system operations on POSIX calls. Not std::filesystem: libtorch.so exports its own copies
// of std::filesystem's symbols, built against another libstdc++, and a call from our code can
// bind to them (remove_all on a directory crashed that way).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::io {

bool is_directory(const std::string& path);
bool exists(const std::string& path);
// -1 if the file cannot be inspected.
int64_t file_size(const std::string& path);
// The entries of a directory (no "." or ".."); empty if it cannot be read.
std::vector<std::string> list_directory(const std::string& path);
// Creates `path` and missing parents; throws naming the path on failure.
void make_directories(const std::string& path);
// Removes a file or a directory tree; nothing if absent; throws on failure.
void remove_tree(const std::string& path);
// rename(2); throws on failure.
void rename_path(const std::string& from, const std::string& to);
// fsync of a directory, so that a rename in it is on disk.
void sync_directory(const std::string& path);
// Copies a regular file's bytes to `to` (created or truncated, synced); throws naming the file.
void copy_file(const std::string& from, const std::string& to);
// Puts `staged` (a file or directory written in full) at `path`, replacing what was there: by one
// rename for a file or where nothing was there, else the old directory is renamed aside, the new
// one into place, and the old one removed. Readers see the old or the new, never a mix.
void replace_with(const std::string& staged, const std::string& path);
// Puts `staged` at `path` only where nothing is there (an empty directory counts as nothing), by
// one rename that never replaces (renameat2's RENAME_NOREPLACE): returns false, `staged` left as
// it is, when something appeared at `path` meanwhile (another writer published first).
bool publish_new(const std::string& staged, const std::string& path);
// "a/b" for "a/b/c", "." for "c".
std::string parent_of(const std::string& path);
// `path` made absolute, with symbolic links and "." / ".." resolved as far as it exists (the rest
// appended as written): two names of one place give the same string.
std::string canonical_path(const std::string& path);
// Whether `inner` is `outer` or lies below it (both compared as canonical_path gives them).
bool is_within(const std::string& inner, const std::string& outer);

// A file written through a descriptor, so that it can be fsynced before a rename publishes it.
// write() starts the disk writing what it wrote; close() syncs and closes, throwing naming the
// file; the destructor only closes (an abandoned write).
class OutputFile {
 public:
  explicit OutputFile(const std::string& path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  void write(const void* data, size_t size);
  void close();

 private:
  std::string path_;
  int fd_;
  uint64_t written_ = 0;
};

// A file this process alone writes: opened for appending (created if missing) under flock's
// exclusive lock, which the kernel drops when the process ends, however it ends. Opening never
// empties it (rewrite does, once locked), so a second writer never truncates the first one's file;
// a pipe or a device (/dev/stdout) is not locked. open() returns null when another process holds it.
class LockedFile {
 public:
  static std::unique_ptr<LockedFile> open(const std::string& path);
  ~LockedFile();
  LockedFile(const LockedFile&) = delete;
  LockedFile& operator=(const LockedFile&) = delete;
  // Appends; throws naming the file (a full disk, a size limit).
  void write(const std::string& bytes);
  // Replaces the whole content (a lock file's description of its holder).
  void rewrite(const std::string& bytes);
  const std::string& path() const { return path_; }

 private:
  LockedFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_;
};

// A whole file mapped read-only: the pages a reader touches are loaded, the rest never are.
// Throws naming the file when it cannot be opened or mapped.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace fsdp::io
