#include "backing/errors.h"

#include <cerrno>
#include <cstring>
#include <fstream>

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

void throw_io_uring_setup_error(int err, const std::string& path) {
  if (err != ENOSYS && err != EPERM && err != EACCES) throw_io_error(err, "io_uring_setup", path, 0);
  std::string sysctl;  // kernel.io_uring_disabled (Linux 6.6+): 0 allowed, 1 group only, 2 off
  std::ifstream("/proc/sys/kernel/io_uring_disabled") >> sysctl;
  std::string what = "io_uring is " +
                     std::string(err == ENOSYS ? "not available" : "blocked") +
                     " for this process (io_uring_setup: " + std::strerror(err) +
                     "), so the store at " + path + " cannot be driven. Not a problem of the "
                     "directory: ";
  if (!sysctl.empty() && sysctl != "0") {
    what += "sysctl kernel.io_uring_disabled is " + sysctl +
            " (set it to 0, or 1 with this user in kernel.io_uring_group), or ";
  }
  what += "a seccomp profile blocks it (Docker 25+ and other container runtimes do by "
          "default: run with a profile that allows io_uring_setup, io_uring_enter and "
          "io_uring_register, e.g. --security-opt seccomp=<profile>)";
  if (err == ENOSYS) what += ", or the kernel has no io_uring (statepager needs Linux 5.10+)";
  throw IoUringUnavailableError(what + ". `statepager doctor` checks this.");
}

}  // namespace statepager
