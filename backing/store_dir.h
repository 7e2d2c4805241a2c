// StoreDir: the directory of a Pager's stores, owned by one Pager at a time.
//
// statepager writes and deletes only what it creates, and what it creates it records in
// the directory's marker file `.statepager-store`: the format line, a random id, the
// creating pid, whether statepager made the directory, then one line per store
// subdirectory and per store file it created, with its device and inode (adopt()). It
// takes a directory that
//   - does not exist: it is created (missing parents too, which stay), or
//   - is empty, or
//   - holds a store statepager left there (after a crash, a kill -9, no close()), known
//     by its marker and holding nothing but what that marker records (the same name and
//     inode), the marker itself and `.lock`. Those files and subdirectories are deleted: a
//     store never resumes from leftover files (checkpoints do that, through their own
//     files).
// Anything else is refused with UsageError, naming the directory, what is in the way and
// the fix, and nothing is touched (a refused StoreDir leaves the directory exactly as it
// was): a directory with other entries (one that holds a store further down is named as
// such), a leftover store holding anything its marker does not record (a user's file
// named like a store file included), a marker of another format, a directory inside
// another store (an ancestor holds the marker; both are named), a store directory that is
// itself a symbolic link (the link and its target are named: pass the target), a path
// that is not a directory. A construction that fails midway (a full disk) removes what it
// created.
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
// remove() deletes what statepager created, each entry only while it is still the one
// created (same device and inode): the recorded store files and subdirectories, the
// marker, the lock, and the directory itself when statepager made it (this StoreDir, or
// the one that left the store, says the marker) and it is still the directory this
// StoreDir holds (a directory someone put in its place stays). A directory the user gave
// stays, empty. Entries someone else put there meanwhile stay, and with them their
// directory. The destructor only closes descriptors: the files survive an exception for
// inspection, and the next StoreDir on the directory deletes them.
//
// Processes: a StoreDir belongs to the process that constructed it. In a forked child
// (which shares its lock's open file description) store_file(), adopt() and remove()
// throw UsageError and touch nothing; the destructor there closes the child's copies of
// the descriptors, which leaves the parent's lock held.
//
// Thread-safety: none; the Pager calls store_file(), adopt() and remove() under its lock.
// Errors: UsageError (a directory that is not statepager's to take), StoreBusyError,
// StorePermissionError, IoError (backing/errors.h).
#pragma once

#include <sys/types.h>

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

  // Records the physical files of `file` (opened at this StoreDir's store_file()
  // locations, created new) as statepager's, in memory and in the marker; files already
  // recorded are skipped. Call it once the files are created (the Pager does after each
  // store opens). IoError when the marker cannot be written (the files stay recorded in
  // memory: remove() deletes them).
  void adopt(const UringFile& file);

  // Deletes what statepager created (see above); idempotent.
  void remove();

  // The device and inode of an entry statepager created.
  struct Identity {
    dev_t dev = 0;
    ino_t ino = 0;
    bool operator==(const Identity&) const = default;
  };

 private:
  void claim(const std::string& path);
  void take_lock();
  void clear_leftovers();
  void record(const char* kind, const std::string& name, const Identity& id);
  void check_owner(const char* what) const;
  void undo_claim() noexcept;
  void release();  // closes every descriptor (the lock too)

  std::string path_;
  std::string leaf_;                  // the directory's name in its parent
  int parent_fd_ = -1;                // the resolved parent directory
  int dir_fd_ = -1;
  int lock_fd_ = -1;
  int marker_fd_ = -1;                // open for appending records
  pid_t owner_;                       // the process that constructed it
  Identity identity_;                 // the directory's, once opened
  bool created_ = false;              // statepager made the directory
  bool created_marker_ = false;       // this StoreDir made the marker (a new store)
  bool created_lock_ = false;         // this StoreDir made `.lock`
  std::map<std::string, int> subdirs_;  // store subdirectories made here -> descriptors
  // What statepager created here, by path relative to the directory ("state.bin.3",
  // "opt0", "opt0/state.bin"): files and subdirectories.
  std::map<std::string, Identity> files_;
  std::map<std::string, Identity> dirs_;
};

}  // namespace statepager
