#include "backing/errors.h"

#include <cerrno>
#include <cstring>

namespace statepager {

void throw_io_error(int err, const std::string& op, const std::string& path, uint64_t offset) {
  std::string what = op + " failed on " + path + " at offset " + std::to_string(offset) + ": " +
                     std::strerror(err);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      throw NoSpaceError(what + " (the store's filesystem is full: free space or point the "
                                "Pager at a larger directory)",
                         path, offset, err);
    case EFBIG:
      throw NoSpaceError(what + " (a file-size limit was hit: raise `ulimit -f` or use a "
                                "filesystem that allows larger files)",
                         path, offset, err);
    case EACCES:
    case EPERM:
    case EROFS:
      throw StorePermissionError(
          what + " (the store directory must be writable by this process)", path, offset, err);
    default:
      throw IoError(what, path, offset, err);
  }
}

}  // namespace statepager
