// Typed errors shared by every layer of statepager.
//
// Each error says what failed, on which file or object, and what to do about it.
// The Python module maps each class to a Python exception of the same name
// (see python/module.cc), so callers can catch them precisely.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace statepager {

// Base class of all statepager errors.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call was made with arguments or in a state that cannot work (a caller bug).
class UsageError : public Error {
 public:
  using Error::Error;
};

// An I/O call on a store file failed. `path()` and `offset()` say where.
class IoError : public Error {
 public:
  IoError(const std::string& what, std::string path, uint64_t offset, int err)
      : Error(what), path_(std::move(path)), offset_(offset), errno_(err) {}
  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }
  int error_number() const { return errno_; }

 private:
  std::string path_;
  uint64_t offset_;
  int errno_;
};

// The store's filesystem is full or a file-size limit was hit (ENOSPC, EDQUOT, EFBIG).
class NoSpaceError : public IoError {
 public:
  using IoError::IoError;
};

// The store directory or a file in it may not be accessed (EACCES, EPERM, EROFS).
class StorePermissionError : public IoError {
 public:
  using IoError::IoError;
};

// Bytes at rest are not what was written: a truncated file, a bad checksum,
// a manifest that does not match. Nothing is loaded when this is thrown.
class CorruptStoreError : public Error {
 public:
  using Error::Error;
};

// Another process (or another Pager in this one) holds the store directory.
class StoreBusyError : public Error {
 public:
  using Error::Error;
};

// The page budget or the device's memory is exhausted.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

// The device driver (CUDA) reported an error.
class DeviceError : public Error {
 public:
  using Error::Error;
};

// io_uring cannot be set up: the kernel lacks it (ENOSYS), or a seccomp profile (a
// container's), sysctl kernel.io_uring_disabled or a security module blocks it (EPERM).
class IoUringUnavailableError : public Error {
 public:
  using Error::Error;
};

// Throws IoUringUnavailableError for io_uring_setup's `err` (ENOSYS, EPERM, EACCES),
// naming the cause and the fix; other errors as throw_io_error(err, "io_uring_setup", ...).
[[noreturn]] void throw_io_uring_setup_error(int err, const std::string& path);

// Throws the IoError subclass that fits `err` (an errno value), with a message
// naming the operation, the file, the offset and a suggested fix.
[[noreturn]] void throw_io_error(int err, const std::string& op, const std::string& path,
                                 uint64_t offset);

}  // namespace statepager
