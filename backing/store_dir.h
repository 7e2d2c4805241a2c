// StoreDir: a directory owned by exactly one Pager at a time.
//
// Construction creates the directory (and its parents), takes an exclusive flock on
// <dir>/.lock, and wipes every other entry: a live store never resumes from leftover
// files (checkpoints do that, through their own files). A second StoreDir on the same
// directory, in this process or another, is refused with StoreBusyError naming the
// holder's pid. remove() deletes the directory; the destructor only releases the lock,
// so state survives an exception for inspection and is wiped by the next start.
//
// Thread-safety: none needed; the object is immutable after construction except remove().
// Errors: StoreBusyError, StorePermissionError, IoError (backing/errors.h).
#pragma once

#include <string>
#include <string_view>

namespace statepager {

class StoreDir {
 public:
  explicit StoreDir(std::string path);
  ~StoreDir();
  StoreDir(const StoreDir&) = delete;
  StoreDir& operator=(const StoreDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(std::string_view name) const;  // path_ + "/" + name
  // Creates path_ + "/" + name and returns its path. `name` must be a plain file name
  // (letters, digits, '-', '_', '.'; not starting with '.'): UsageError otherwise.
  std::string subdirectory(std::string_view name) const;

  // Deletes every file in the directory and the directory itself (clean exit).
  void remove();

 private:
  std::string path_;
  int lock_fd_ = -1;
};

}  // namespace statepager
