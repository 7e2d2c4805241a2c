#include "backing/store_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "backing/errors.h"

namespace statepager {

// POSIX calls rather than std::filesystem: libtorch exports its own copies of the
// std::filesystem symbols, and in the Python extension ours would bind to them.

namespace {

constexpr const char* kLock = ".lock";
constexpr const char* kFormat = "statepager-store 2";  // the marker's first line
// A marker is read up to this size: 256 stores of 8 files take about 100 KiB.
constexpr size_t kMarkerMaxBytes = size_t(4) << 20;
// A refused directory is searched this deep, in at most this many directories, for a
// store inside it, to name that store in the message.
constexpr int kScanDepth = 2;
constexpr int kScanDirs = 256;
constexpr const char* kChoose = "choose a new or empty directory";

// A descriptor closed when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

std::string join(const std::string& dir, std::string_view name) {
  std::string p = dir == "/" ? "" : dir;
  p += '/';
  p += name;
  return p;
}

std::string parent_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string quoted(std::string_view name) { return "'" + std::string(name) + "'"; }

// A directory in `at`, never through a symbolic link (ELOOP then). -1 and errno on failure.
int open_dir_at(int at, const std::string& name) {
  int fd;
  do {
    fd = ::openat(at, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// The entry names of the directory open as `fd`, sorted, without "." and "..".
std::vector<std::string> list(int fd, const std::string& path) {
  // A descriptor of its own: a dup() would share (and move) the reading position of `fd`.
  Fd own(open_dir_at(fd, "."));
  if (own.get() < 0) throw_io_error(errno, "open directory", path, 0);
  DIR* d = ::fdopendir(own.get());
  if (d == nullptr) throw_io_error(errno, "list directory", path, 0);
  own.release();  // the DIR has it now
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// The file type (S_IFREG, S_IFDIR, S_IFLNK, ...) of `name` in `fd`, 0 when missing.
mode_t type_at(int fd, const std::string& name) {
  struct stat st;
  return ::fstatat(fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 ? st.st_mode & S_IFMT : 0;
}

using Identity = StoreDir::Identity;

std::optional<Identity> identity_at(int fd, const std::string& name, mode_t type) {
  struct stat st;
  if (::fstatat(fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return std::nullopt;
  if ((st.st_mode & S_IFMT) != type) return std::nullopt;
  return Identity{st.st_dev, st.st_ino};
}

Identity identity_of(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_io_error(errno, "fstat", path, 0);
  return {st.st_dev, st.st_ino};
}

// Names a store may have, and so its subdirectory: never hidden, never a path.
bool is_plain_name(std::string_view name) {
  return !name.empty() && name.size() <= 128 && name[0] != '.' &&
         std::all_of(name.begin(), name.end(), [](char c) {
           return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ||
                  c == '.';
         });
}

// Unlinks `name` in `fd` unless it is already gone.
void unlink_at(int fd, const std::string& dir, const std::string& name, int flags) {
  if (::unlinkat(fd, name.c_str(), flags) != 0 && errno != ENOENT) {
    throw_io_error(errno, "remove", join(dir, name), 0);
  }
}

// Removes the empty directory `name` in `fd`; one that someone filled stays.
void remove_dir_at(int fd, const std::string& dir, const std::string& name) {
  if (::unlinkat(fd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT &&
      errno != ENOTEMPTY && errno != EEXIST) {
    throw_io_error(errno, "remove directory", join(dir, name), 0);
  }
}

// Unlinks `name` in `fd` while it is still the entry `id` of type `type`; an entry someone
// put in its place stays.
void unlink_own(int fd, const std::string& dir, const std::string& name, const Identity& id,
                mode_t type) {
  if (identity_at(fd, name, type) != id) return;
  if (type == S_IFDIR) {
    remove_dir_at(fd, dir, name);
  } else {
    unlink_at(fd, dir, name, 0);
  }
}

// The first entry in the store directory `fd` that its marker does not record ("" if none).
// Besides the marker and the lock (regular files) only the recorded files and the recorded
// subdirectories, holding only recorded files, each still the entry recorded (the same
// device and inode): a file of the user's named like a store file is not statepager's.
std::string foreign_entry(int fd, const std::string& path,
                          const std::map<std::string, Identity>& files,
                          const std::map<std::string, Identity>& dirs) {
  auto recorded = [](const std::map<std::string, Identity>& in, const std::string& name,
                     int at, const std::string& entry, mode_t type) {
    auto it = in.find(name);
    return it != in.end() && identity_at(at, entry, type) == it->second;
  };
  for (const std::string& name : list(fd, path)) {
    if (name == StoreDir::kMarker || name == kLock) {
      if (type_at(fd, name) == S_IFREG) continue;
      return name;
    }
    if (recorded(files, name, fd, name, S_IFREG)) continue;
    if (!recorded(dirs, name, fd, name, S_IFDIR)) return name;
    Fd sub(open_dir_at(fd, name));
    if (sub.get() < 0) throw_io_error(errno, "open directory", join(path, name), 0);
    for (const std::string& inner : list(sub.get(), join(path, name))) {
      const std::string rel = name + "/" + inner;
      if (!recorded(files, rel, sub.get(), inner, S_IFREG)) return rel;
    }
  }
  return "";
}

// A store (a directory holding the marker) below the directory `fd`, up to `depth`
// levels down, or "". `budget` bounds the directories looked into.
std::string find_store_below(int fd, const std::string& path, int depth, int* budget) {
  if (depth == 0) return "";
  for (const std::string& name : list(fd, path)) {
    if (*budget <= 0) return "";
    if (type_at(fd, name) != S_IFDIR) continue;
    --*budget;
    Fd sub(open_dir_at(fd, name));
    if (sub.get() < 0) continue;  // unreadable: not ours to judge
    if (type_at(sub.get(), StoreDir::kMarker) != 0) return join(path, name);
    const std::string found = find_store_below(sub.get(), join(path, name), depth - 1, budget);
    if (!found.empty()) return found;
  }
  return "";
}

[[noreturn]] void refuse_not_empty(int fd, const std::string& path,
                                   const std::vector<std::string>& names) {
  std::string held;
  for (size_t i = 0; i < std::min<size_t>(names.size(), 3); ++i) {
    held += (i > 0 ? ", " : "") + quoted(names[i]);
  }
  if (names.size() > 3) held += " and " + std::to_string(names.size() - 3) + " more";
  int budget = kScanDirs;
  const std::string store = find_store_below(fd, path, kScanDepth, &budget);
  throw UsageError("store directory " + path + " is not empty (it holds " + held +
                   ") and is not a statepager store" +
                   (store.empty() ? "" : "; among its contents is the statepager store " + store +
                                             ", in use or left by another run") +
                   ": statepager deletes only what it creates, so it takes a new or empty "
                   "directory, or one holding only a store it left; " + kChoose);
}

struct Marker {
  std::string format;              // the first line; "" when the marker cannot be read
  bool created_directory = false;  // statepager made the directory (remove() deletes it)
  std::map<std::string, Identity> files, dirs;  // what it records statepager created
};

// Reads the marker open as `fd`. Records are "file <name> <dev> <ino>" and
// "dir <name> <dev> <ino>"; other lines are the header.
Marker read_marker(int fd) {
  std::string text;
  char buf[65536];
  for (off_t at = 0; text.size() < kMarkerMaxBytes;) {
    const ssize_t n = ::pread(fd, buf, sizeof(buf), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    at += n;
  }
  Marker m;
  std::istringstream lines(text);
  std::getline(lines, m.format);
  for (std::string line; std::getline(lines, line);) {
    if (line == "directory created") m.created_directory = true;
    std::istringstream fields(line);
    std::string kind, name;
    unsigned long long dev = 0, ino = 0;
    if (!(fields >> kind >> name >> dev >> ino) || (kind != "file" && kind != "dir")) continue;
    (kind == "file" ? m.files : m.dirs)[name] = Identity{static_cast<dev_t>(dev),
                                                         static_cast<ino_t>(ino)};
  }
  return m;
}

void write_all(int fd, const std::string& text, const std::string& path) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::pwrite(fd, text.data() + done, text.size() - done,
                               static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_io_error(n < 0 ? errno : EIO, "write", path, done);
    done += static_cast<size_t>(n);
  }
}

std::string marker_header(bool created_directory) {
  std::random_device random;
  char id[33];
  std::snprintf(id, sizeof(id), "%08x%08x%08x%08x", random(), random(), random(), random());
  return std::string(kFormat) + "\nid " + id + "\npid " + std::to_string(::getpid()) +
         "\ndirectory " + (created_directory ? "created" : "given") + "\n";
}

// Appends `text` to the file open as `fd` with O_APPEND.
void append_all(int fd, const std::string& text, const std::string& path) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_io_error(n < 0 ? errno : EIO, "write", path, done);
    done += static_cast<size_t>(n);
  }
}

// Creates the marker of a new store (its header: format, a random id, this process's pid
// and whether statepager made the directory) and returns its descriptor, open for
// appending; -1 when another process created it first. A marker that cannot be written
// whole (a full disk) is removed again.
int create_marker(int dir_fd, const std::string& dir, bool created_directory) {
  const std::string path = join(dir, StoreDir::kMarker);
  Fd fd(::openat(dir_fd, StoreDir::kMarker,
                 O_RDWR | O_APPEND | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (fd.get() < 0 && errno == EEXIST) return -1;
  if (fd.get() < 0) throw_io_error(errno, "create", path, 0);
  try {
    append_all(fd.get(), marker_header(created_directory), path);
  } catch (...) {
    ::unlinkat(dir_fd, StoreDir::kMarker, 0);
    throw;
  }
  return fd.release();
}

// The pid the holder wrote into the lock file, or "" when it has not written one yet.
std::string read_holder_pid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  std::string pid;
  for (ssize_t i = 0; i < n && buf[i] >= '0' && buf[i] <= '9'; ++i) pid += buf[i];
  return pid;
}

std::string absolute(const std::string& path) {
  if (path.empty()) throw UsageError("store directory: the path is empty; name a directory");
  std::string abs = path;
  if (abs[0] != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) == nullptr) throw_io_error(errno, "getcwd", path, 0);
    abs = join(cwd, path);
  }
  while (abs.size() > 1 && abs.back() == '/') abs.pop_back();
  return abs;
}

std::string real_path(const std::string& path) {
  char* real = ::realpath(path.c_str(), nullptr);
  if (real == nullptr) throw_io_error(errno, "resolve", path, 0);
  std::string resolved = real;
  std::free(real);
  return resolved;
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
}

[[noreturn]] void refuse_symlink(const std::string& path) {
  char target[PATH_MAX] = {};
  const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
  const std::string to = n > 0 ? std::string(target, static_cast<size_t>(n)) : "?";
  throw UsageError("store directory " + path + " is a symbolic link (to " + to +
                   "): statepager takes a directory itself, never through a link; pass the "
                   "directory it points to, or " + kChoose);
}

// Refuses a store at `path` when `dir` (an existing ancestor of it, resolved) or one of
// the ancestors of `dir` is a store.
void refuse_inside_store(const std::string& path, std::string dir) {
  for (;; dir = parent_of(dir)) {
    if (type_at(AT_FDCWD, join(dir, StoreDir::kMarker)) != 0) {
      throw UsageError("store directory " + path + " is inside the statepager store " + dir +
                       " (it holds " + join(dir, StoreDir::kMarker) + "): stores do not nest; " +
                       kChoose + " outside " + dir);
    }
    if (dir == "/") return;
  }
}

// The nearest ancestor of `path` that exists.
std::string existing_ancestor(const std::string& path) {
  std::string dir = parent_of(path);
  while (dir != "/" && ::access(dir.c_str(), F_OK) != 0) dir = parent_of(dir);
  return dir;
}

}  // namespace

StoreDir::StoreDir(const std::string& path) : owner_(::getpid()) {
  try {
    claim(path);
  } catch (...) {
    undo_claim();
    throw;
  }
}

StoreDir::~StoreDir() { release(); }

// A refused or failed claim leaves the directory as it was: what this StoreDir made is
// removed (a store that another process got first stays).
void StoreDir::undo_claim() noexcept {
  if (created_marker_) ::unlinkat(dir_fd_, kMarker, 0);
  if (created_lock_) ::unlinkat(dir_fd_, kLock, 0);
  if (created_) ::unlinkat(parent_fd_, leaf_.c_str(), AT_REMOVEDIR);  // when still empty
  release();
}

void StoreDir::release() {
  for (auto& [name, fd] : subdirs_) ::close(fd);
  subdirs_.clear();
  for (int* fd : {&marker_fd_, &lock_fd_, &dir_fd_, &parent_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void StoreDir::check_owner(const char* what) const {
  if (::getpid() == owner_) return;
  throw UsageError("store directory " + path_ + " belongs to process " +
                   std::to_string(owner_) + ": a forked child (process " +
                   std::to_string(::getpid()) + ") cannot " + what +
                   "; nothing was touched; give the child a store directory of its own");
}

// Resolves the path, makes or checks the directory, locks it and clears what a previous
// run left (see the header).
void StoreDir::claim(const std::string& given) {
  const std::string abs = absolute(given);
  struct stat st;
  bool exists = ::lstat(abs.c_str(), &st) == 0;
  if (exists && S_ISLNK(st.st_mode)) refuse_symlink(abs);
  if (exists && !S_ISDIR(st.st_mode)) {
    throw UsageError("store directory " + abs + " exists and is not a directory: " + kChoose);
  }
  if (!exists && errno != ENOENT) throw_io_error(errno, "open directory", abs, 0);
  if (exists) {
    path_ = real_path(abs);
  } else {
    const std::string leaf = abs.substr(abs.rfind('/') + 1);
    if (leaf == "." || leaf == "..") throw_io_error(ENOENT, "open directory", abs, 0);
    refuse_inside_store(abs, real_path(existing_ancestor(abs)));  // before making any
    make_dirs(parent_of(abs));
    path_ = join(real_path(parent_of(abs)), leaf);
  }
  if (path_ == "/") throw UsageError("store directory /: the root directory is not empty; " +
                                     std::string(kChoose));
  leaf_ = path_.substr(path_.rfind('/') + 1);
  refuse_inside_store(path_, parent_of(path_));

  parent_fd_ = ::open(parent_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (parent_fd_ < 0) throw_io_error(errno, "open directory", parent_of(path_), 0);
  if (!exists) {
    created_ = ::mkdirat(parent_fd_, leaf_.c_str(), 0755) == 0;
    if (!created_ && errno != EEXIST) throw_io_error(errno, "create directory", path_, 0);
  }
  dir_fd_ = open_dir_at(parent_fd_, leaf_);
  if (dir_fd_ < 0 && errno == ELOOP) refuse_symlink(path_);
  if (dir_fd_ < 0) throw_io_error(errno, "open directory", path_, 0);
  identity_ = identity_of(dir_fd_, path_);

  const std::vector<std::string> names = list(dir_fd_, path_);
  const bool marked = std::find(names.begin(), names.end(), kMarker) != names.end();
  if (!marked && !names.empty()) refuse_not_empty(dir_fd_, path_, names);
  // When another process made the marker first, the lock decides between us.
  if (!marked) {
    marker_fd_ = create_marker(dir_fd_, path_, created_);
    created_marker_ = marker_fd_ >= 0;
  }
  take_lock();
  clear_leftovers();
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock_fd_, 0) != 0) throw_io_error(errno, "ftruncate", join(path_, kLock), 0);
  write_all(lock_fd_, pid, join(path_, kLock));
}

void StoreDir::take_lock() {
  const std::string path = join(path_, kLock);
  // O_NONBLOCK: a planted FIFO or device must not hang the open; it is refused below.
  constexpr int kFlags = O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  int opened = ::openat(dir_fd_, kLock, kFlags | O_CREAT | O_EXCL, 0644);
  created_lock_ = opened >= 0;  // a refusal below removes it again (undo_claim)
  if (!created_lock_ && errno == EEXIST) opened = ::openat(dir_fd_, kLock, kFlags);
  Fd fd(opened);
  if (fd.get() < 0 && errno == ELOOP) {
    throw UsageError(path + " is a symbolic link: statepager never opens its files through one "
                     "and touched nothing; remove the link, or " + kChoose);
  }
  if (fd.get() < 0) throw_io_error(errno, "open", path, 0);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw_io_error(errno, "fstat", path, 0);
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1) {
    throw UsageError(path + " is not a regular file of its own (a hard link, a device or a "
                     "FIFO): statepager writes only its own files and touched nothing; remove "
                     "it, or " + kChoose);
  }
  int ret;
  do {
    ret = ::flock(fd.get(), LOCK_EX | LOCK_NB);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0 && errno == EWOULDBLOCK) {
    const std::string pid = read_holder_pid(fd.get());
    throw StoreBusyError("store directory " + path_ + " is in use by " +
                         (pid.empty() ? std::string("another process") : "process " + pid) +
                         ": give each Pager (each rank, each optimizer) its own directory, "
                         "or stop the other process");
  }
  if (ret != 0) throw_io_error(errno, "flock", path, 0);
  lock_fd_ = fd.release();
}

// Under the lock: a store left by an earlier run is cleared when it holds nothing but what
// its marker records statepager created, and refused, untouched, otherwise. The marker of
// a cleared store starts afresh (a new id, this process's pid, no records).
void StoreDir::clear_leftovers() {
  const std::string marker_path = join(path_, kMarker);
  if (marker_fd_ < 0) {
    marker_fd_ = ::openat(dir_fd_, kMarker, O_RDWR | O_APPEND | O_NOFOLLOW | O_NONBLOCK |
                                                O_CLOEXEC);
  }
  struct stat st;
  const bool own_file = marker_fd_ >= 0 && ::fstat(marker_fd_, &st) == 0 &&
                        S_ISREG(st.st_mode) && st.st_nlink == 1;
  const Marker marker = own_file ? read_marker(marker_fd_) : Marker{};
  if (marker.format != kFormat) {
    const std::string found = marker.format.empty()
                                  ? "not a readable file of its own"
                                  : "it begins '" + marker.format.substr(0, 40) + "'";
    throw UsageError("store directory " + path_ + " holds a " + kMarker + " that is not a '" +
                     kFormat + "' marker (" + found + "): another program or another version "
                     "of statepager made it; nothing was touched; " + kChoose);
  }
  const std::string foreign = foreign_entry(dir_fd_, path_, marker.files, marker.dirs);
  if (!foreign.empty()) {
    throw UsageError("store directory " + path_ + " holds a statepager store and also " +
                     quoted(foreign) + ", which statepager did not create (its marker does "
                     "not record it): it deletes only what it creates and touched nothing; "
                     "move " + quoted(foreign) + " out, or " + kChoose);
  }
  if (created_marker_) return;  // a new store: nothing left to clear
  for (const auto& [name, id] : marker.files) {
    const size_t slash = name.find('/');
    if (slash == std::string::npos) {
      unlink_own(dir_fd_, path_, name, id, S_IFREG);
      continue;
    }
    const std::string sub = name.substr(0, slash);
    Fd fd(open_dir_at(dir_fd_, sub));
    if (fd.get() >= 0) unlink_own(fd.get(), join(path_, sub), name.substr(slash + 1), id, S_IFREG);
  }
  for (const auto& [name, id] : marker.dirs) unlink_own(dir_fd_, path_, name, id, S_IFDIR);
  created_ = created_ || marker.created_directory;  // a store left: made by statepager?
  if (::ftruncate(marker_fd_, 0) != 0) throw_io_error(errno, "ftruncate", marker_path, 0);
  append_all(marker_fd_, marker_header(created_), marker_path);
}

void StoreDir::record(const char* kind, const std::string& name, const Identity& id) {
  (std::string(kind) == "file" ? files_ : dirs_)[name] = id;
  append_all(marker_fd_, std::string(kind) + " " + name + " " + std::to_string(id.dev) + " " +
                             std::to_string(id.ino) + "\n", join(path_, kMarker));
}

UringFile::Location StoreDir::store_file(std::string_view name) {
  check_owner("open a store in it");
  if (name.empty()) return {dir_fd_, path_, kStoreFile};
  if (!is_plain_name(name)) {
    throw UsageError("store name '" + std::string(name) + "' is not a plain file name: use up "
                     "to 128 letters, digits, '-', '_' and '.', not starting with '.'");
  }
  const std::string sub(name);
  auto it = subdirs_.find(sub);
  if (it == subdirs_.end()) {
    const std::string path = join(path_, sub);
    if (::mkdirat(dir_fd_, sub.c_str(), 0755) != 0) {
      if (errno == EEXIST) {
        throw IoError(path + " already exists, and this Pager did not create it: statepager "
                      "writes only into what it creates; remove it, or give the Pager a new "
                      "directory", path, 0, EEXIST);
      }
      throw_io_error(errno, "create directory", path, 0);
    }
    const int fd = open_dir_at(dir_fd_, sub);
    if (fd < 0) throw_io_error(errno, "open directory", path, 0);
    it = subdirs_.emplace(sub, fd).first;
    record("dir", sub, identity_of(fd, path));
  }
  return {it->second, join(path_, sub), kStoreFile};
}

void StoreDir::adopt(const UringFile& file) {
  check_owner("record files in it");
  const std::vector<std::string> paths = file.physical_paths();
  const std::string prefix = path_ + "/";
  for (unsigned i = 0; i < paths.size(); ++i) {
    if (paths[i].rfind(prefix, 0) != 0) continue;  // not in this directory
    const std::string name = paths[i].substr(prefix.size());
    if (files_.count(name) == 0) record("file", name, identity_of(file.physical_fd(i), paths[i]));
  }
}

void StoreDir::remove() {
  if (lock_fd_ < 0) return;
  check_owner("remove it");
  for (const auto& [name, id] : files_) {
    const size_t slash = name.find('/');
    if (slash == std::string::npos) {
      unlink_own(dir_fd_, path_, name, id, S_IFREG);
    } else if (auto it = subdirs_.find(name.substr(0, slash)); it != subdirs_.end()) {
      unlink_own(it->second, join(path_, it->first), name.substr(slash + 1), id, S_IFREG);
    }
  }
  for (const auto& [name, id] : dirs_) unlink_own(dir_fd_, path_, name, id, S_IFDIR);
  unlink_own(dir_fd_, path_, kMarker, identity_of(marker_fd_, join(path_, kMarker)), S_IFREG);
  // While still holding the lock.
  unlink_own(dir_fd_, path_, kLock, identity_of(lock_fd_, join(path_, kLock)), S_IFREG);
  if (created_) unlink_own(parent_fd_, parent_of(path_), leaf_, identity_, S_IFDIR);
  files_.clear();
  dirs_.clear();
  release();
}

}  // namespace statepager
