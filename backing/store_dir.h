// StoreDir: the directory of a Pager's stores, owned by one Pager at a time.
//
// statepager writes and deletes only what it creates. It takes a directory that
//   - does not exist: it is created (missing parents too, which stay), or
//   - is empty, or
//   - holds a store statepager left there (after a crash, a kill -9, no close()), known
//     by its marker file `.statepager-store` (format line, random id, creating pid,
//     whether statepager made the directory) and
//     holding nothing but statepager's own entries: the marker, `.lock`, the default
//     store's files (state.bin and its stripes state.bin.1 ...) and store subdirectories
//     holding only store files. Those files and subdirectories are deleted: a store
//     never resumes from leftover files (checkpoints do that, through their own files).
// Anything else is refused with UsageError, naming the directory, what is in the way and
// the fix, and nothing is touched: a directory with other entries (one that holds a
// store further down is named as such), a directory inside another store (an ancestor
// holds the marker; both are named), a store directory that is itself a symbolic link
// (the link and its target are named: pass the target), a path that is not a directory.
//
// Paths: the path is made absolute against the working directory and the symbolic links
// among its ancestors are resolved, once, at construction (path()). From then on every
// file is created, opened and removed relative to the directory's descriptor, with
// O_NOFOLLOW, and with O_EXCL where it is created new (store files are opened so by
// UringFile, see store_file()): a later chdir changes nothing, and a symbolic link planted
// in the directory is refused, never followed.
//
// Exclusive: a flock on `.lock` (which holds the holder's pid and nothing else); a second
// StoreDir on the same directory, in this process or another, gets StoreBusyError naming
// the holder's pid. The lock file is a regular file with one link, or refused.
//
// remove() deletes what statepager created: the store files, the store subdirectories,
// the marker, the lock, and the directory itself when statepager made it (this StoreDir,
// or the one that left the store, says the marker); a directory the user gave stays, empty. Entries someone else put there meanwhile stay,
// and with them their directory. The destructor only releases the lock: the files survive
// an exception for inspection, and the next StoreDir on the directory deletes them.
//
// Thread-safety: none; the Pager calls store_file() and remove() under its lock.
// Errors: UsageError (a directory that is not statepager's to take), StoreBusyError,
// StorePermissionError, IoError (backing/errors.h).
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "backing/uring_file.h"

namespace statepager {

class StoreDir {
 public:
  // The marker that makes a directory a statepager store. Checkpoints refuse to be
  // written inside a directory holding it (or below one).
  static constexpr const char* kMarker = ".statepager-store";
  static constexpr const char* kStoreFile = "state.bin";  // the file of each store

  explicit StoreDir(const std::string& path);
  ~StoreDir();
  StoreDir(const StoreDir&) = delete;
  StoreDir& operator=(const StoreDir&) = delete;

  const std::string& path() const { return path_; }  // absolute, ancestors resolved

  // Where the store `name` keeps its file, for UringFile with Options::create_new: the
  // default store ("") in the directory itself, a named store in the subdirectory `name`,
  // created on first call. The descriptor in the Location stays this StoreDir's. `name`
  // must be a plain file name (up to 128 letters, digits, '-', '_', '.'; not starting
  // with '.'): UsageError otherwise.
  UringFile::Location store_file(std::string_view name);

  // Deletes what statepager created (see above); idempotent.
  void remove();

 private:
  void claim(const std::string& path);
  void take_lock();
  void clear_leftovers();
  void release();  // closes every descriptor (the lock too)

  std::string path_;
  std::string leaf_;                  // the directory's name in its parent
  int parent_fd_ = -1;                // the resolved parent directory
  int dir_fd_ = -1;
  int lock_fd_ = -1;
  bool created_ = false;              // statepager made the directory
  bool created_marker_ = false;       // this StoreDir made the marker (a new store)
  std::map<std::string, int> subdirs_;  // store subdirectories made here -> descriptors
};

}  // namespace statepager
