#include "io/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace fsdp::io {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error("cannot " + what + " '" + path + "': " + std::strerror(errno));
}

// Every byte, across short writes and interrupted calls; throws naming `path`.
void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("write", path);
    p += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

bool is_directory(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st{};
  return ::lstat(path.c_str(), &st) == 0;
}

int64_t file_size(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) ? static_cast<int64_t>(st.st_size) : -1;
}

std::vector<std::string> list_directory(const std::string& path) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
  }
  return names;
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  make_directories(parent_of(path));
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) fail("create the directory", path);
}

void remove_tree(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& name : list_directory(path)) remove_tree(path + "/" + name);
    if (::rmdir(path.c_str()) != 0) fail("remove", path);
  } else if (::unlink(path.c_str()) != 0) {
    fail("remove", path);
  }
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail("rename to '" + to + "'", from);
}

void sync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void copy_file(const std::string& from, const std::string& to) {
  const MappedFile in(from);
  OutputFile out(to);
  out.write(in.data(), in.size());
  out.close();
}

void replace_with(const std::string& staged, const std::string& path) {
  if (!is_directory(path) || !is_directory(staged)) {
    rename_path(staged, path);
  } else {
    const std::string old = path + ".old";
    remove_tree(old);  // an interrupted earlier replacement
    rename_path(path, old);
    rename_path(staged, path);
    remove_tree(old);
  }
  sync_directory(parent_of(path));
}

bool publish_new(const std::string& staged, const std::string& path) {
  if (is_directory(path) && list_directory(path).empty()) ::rmdir(path.c_str());  // fails if filled meanwhile
  if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == EEXIST || errno == ENOTEMPTY) return false;
    fail("rename to '" + path + "'", staged);
  }
  sync_directory(parent_of(path));
  return true;
}

std::string parent_of(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

std::string canonical_path(const std::string& path) {
  std::string head = path.empty() ? "." : path, tail;
  char resolved[PATH_MAX];
  while (::realpath(head.c_str(), resolved) == nullptr) {
    const auto slash = head.find_last_of('/');
    const std::string name = slash == std::string::npos ? head : head.substr(slash + 1);
    if (!name.empty() && name != ".") tail = "/" + name + tail;
    if (slash == std::string::npos) {
      head = ".";
    } else {
      head = slash == 0 ? "/" : head.substr(0, slash);
    }
    if (head == "." && ::realpath(".", resolved) == nullptr) return path;  // no working directory
  }
  const std::string base = resolved;
  return base == "/" && !tail.empty() ? tail : base + tail;
}

bool is_within(const std::string& inner, const std::string& outer) {
  const std::string a = canonical_path(inner), b = canonical_path(outer);
  return a == b || (a.size() > b.size() && a.compare(0, b.size(), b) == 0 && (b == "/" || a[b.size()] == '/'));
}

std::unique_ptr<LockedFile> LockedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) fail("open", path);
  struct stat st{};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int saved = errno;
      ::close(fd);
      if (saved == EWOULDBLOCK) return nullptr;
      errno = saved;
      fail("lock", path);
    }
  }
  return std::unique_ptr<LockedFile>(new LockedFile(path, fd));
}

LockedFile::~LockedFile() { ::close(fd_); }

void LockedFile::write(const std::string& bytes) { write_all(fd_, bytes.data(), bytes.size(), path_); }

void LockedFile::rewrite(const std::string& bytes) {
  if (::ftruncate(fd_, 0) != 0) fail("empty", path_);
  write(bytes);  // O_APPEND: from the new end, the start
}

OutputFile::OutputFile(const std::string& path) : path_(path), fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) {
  if (fd_ < 0) fail("create", path);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(const void* data, size_t size) {
  write_all(fd_, data, size, path_);
  // Start the disk on these bytes now rather than at close(): the writer goes on to its next
  // bytes while they are written, and close()'s fsync finds little left to do. A hint only: where
  // the file system refuses it, close() still syncs everything.
  ::sync_file_range(fd_, static_cast<off_t>(written_), static_cast<off_t>(size), SYNC_FILE_RANGE_WRITE);
  written_ += size;
}

void OutputFile::close() {
  const bool synced = ::fsync(fd_) == 0;
  const int fd = fd_;
  fd_ = -1;
  if (!synced || ::close(fd) != 0) fail("write", path_);
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open", path);
  // Closes the descriptor (the mapping, if made, keeps the file) and reports what failed.
  auto close_then_fail_if = [&](bool failed, const char* what) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    if (failed) fail(what, path);
  };
  struct stat st{};
  if (::fstat(fd, &st) != 0) close_then_fail_if(true, "inspect");
  size_ = static_cast<uint64_t>(st.st_size);
  void* mapped = size_ > 0 ? ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
  close_then_fail_if(mapped == MAP_FAILED, "map");
  data_ = static_cast<const uint8_t*>(mapped);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace fsdp::io
