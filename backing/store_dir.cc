#include "backing/store_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <vector>

#include "backing/errors.h"

namespace statepager {

// POSIX calls rather than std::filesystem: libtorch exports its own copies of the
// std::filesystem symbols, and in the Python extension ours would bind to them.

namespace {

constexpr const char* kLockName = ".lock";

// The pid the holder wrote into the lock file, or "" when it has not written one yet.
std::string read_holder_pid(int fd) {
  char buf[32] = {};
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  std::string pid;
  for (ssize_t i = 0; i < n && buf[i] >= '0' && buf[i] <= '9'; ++i) pid += buf[i];
  return pid;
}

void write_pid(int fd, const std::string& path) {
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0) throw_io_error(errno, "ftruncate", path, 0);
  const ssize_t n = ::pwrite(fd, pid.data(), pid.size(), 0);
  if (n < 0) throw_io_error(errno, "write", path, 0);
  if (static_cast<size_t>(n) != pid.size()) throw_io_error(EIO, "write", path, 0);
}

int remove_entry(const char* path, const struct stat*, int, FTW*) {
  return ::remove(path) == 0 ? 0 : errno;
}

// Deletes `path` and everything below it; a missing path is fine.
void remove_tree(const std::string& path) {
  const int err = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (err != 0 && errno != ENOENT) throw_io_error(err > 0 ? err : errno, "remove", path, 0);
}

// mkdir -p
void make_dirs(const std::string& path) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      throw_io_error(errno, "create directory", prefix, 0);
    }
    if (slash == std::string::npos) break;
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw_io_error(errno, "create directory", path, 0);
  if (!S_ISDIR(st.st_mode)) throw_io_error(ENOTDIR, "create directory", path, 0);
}

// Deletes every entry of `dir` except `keep`.
void wipe(const std::string& dir, const std::string& keep) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw_io_error(errno, "list directory", dir, 0);
  std::vector<std::string> entries;  // collected first: removing while reading may skip some
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != ".." && name != keep) entries.push_back(dir + "/" + name);
  }
  ::closedir(d);
  for (const std::string& entry : entries) remove_tree(entry);
}

}  // namespace

StoreDir::StoreDir(std::string path) : path_(std::move(path)) {
  make_dirs(path_);

  const std::string lock_path = file(kLockName);
  do {
    lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  } while (lock_fd_ < 0 && errno == EINTR);
  if (lock_fd_ < 0) throw_io_error(errno, "open", lock_path, 0);

  // The destructor does not run when the constructor throws: release the lock here.
  try {
    int ret;
    do {
      ret = ::flock(lock_fd_, LOCK_EX | LOCK_NB);
    } while (ret != 0 && errno == EINTR);
    if (ret != 0 && errno == EWOULDBLOCK) {
      const std::string pid = read_holder_pid(lock_fd_);
      throw StoreBusyError("store directory " + path_ + " is in use by " +
                           (pid.empty() ? std::string("another process") : "process " + pid) +
                           ": give each Pager (each rank, each optimizer) its own directory, "
                           "or stop the other process");
    }
    if (ret != 0) throw_io_error(errno, "flock", lock_path, 0);
    write_pid(lock_fd_, lock_path);
    wipe(path_, kLockName);
  } catch (...) {
    ::close(lock_fd_);
    lock_fd_ = -1;
    throw;
  }
}

StoreDir::~StoreDir() {
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

std::string StoreDir::file(std::string_view name) const {
  std::string p = path_;
  p += '/';
  p += name;
  return p;
}

std::string StoreDir::subdirectory(std::string_view name) const {
  const bool plain = !name.empty() && name.size() <= 128 && name[0] != '.' &&
                     std::all_of(name.begin(), name.end(), [](char c) {
                       return std::isalnum(static_cast<unsigned char>(c)) || c == '-' ||
                              c == '_' || c == '.';
                     });
  if (!plain) {
    throw UsageError("store name '" + std::string(name) + "' is not a plain file name: use up "
                     "to 128 letters, digits, '-', '_' and '.', not starting with '.'");
  }
  const std::string path = file(name);
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    throw_io_error(errno, "create directory", path, 0);
  }
  return path;
}

void StoreDir::remove() {
  if (lock_fd_ < 0) return;
  // Everything, .lock included, goes while we still hold the lock.
  remove_tree(path_);
  ::close(lock_fd_);
  lock_fd_ = -1;
}

}  // namespace statepager
