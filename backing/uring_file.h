// UringFile: one store file driven through one io_uring.
//
// Opening tries O_DIRECT and probes it with one aligned write; filesystems that refuse
// direct I/O (tmpfs, some FUSE mounts) fall back to buffered I/O, detected, never
// configured. Requests therefore use buffers, offsets and lengths aligned to kAlignment,
// which works in both modes. Short reads and writes are resubmitted until the whole
// request is done; a read that meets the end of the file completes with ENODATA.
//
// Striping: files in RAM (tmpfs, ramfs) are always buffered, and io_uring runs buffered
// writes to one inode in a single worker, where tmpfs also takes the inode lock, so one
// file takes writes at a fraction of memory bandwidth. There the logical file is cut into
// 1 MiB units spread round-robin over 8 physical files, `path` and its siblings `path.1`
// ... `path.7`; a request is split at unit boundaries and completes when all its parts
// have. Deleting the store means deleting every physical file (remove_files()). A unit
// never written nor allocated reads as the end of the file (ENODATA), even below size().
//
// Ownership: owns the file descriptors and the ring; buffers stay the caller's and must
// outlive the requests that use them.
// Thread-safety: none, except spans() and physical_paths(), which read only what is fixed
// at construction and may be called from any thread. One thread submits and reaps (the
// Pager's I/O thread).
// Errors: construction and allocate() throw IoError subclasses (backing/errors.h) naming
// the file; per-request failures come back as Completion::error (an errno value).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace statepager {

class UringFile {
 public:
  static constexpr size_t kAlignment = 4096;

  struct Options {
    unsigned queue_depth = 32;  // requests in flight at most
    bool try_direct = true;     // false: always buffered I/O
  };

  struct Request {
    uint64_t tag = 0;      // returned in the Completion
    bool write = false;
    void* buf = nullptr;   // kAlignment-aligned
    size_t len = 0;        // multiple of kAlignment
    uint64_t offset = 0;   // multiple of kAlignment
    int buf_index = -1;    // index into register_buffers(), or -1
  };

  // A piece of the logical file in one physical file (see spans()).
  struct Span {
    unsigned file = 0;     // index into physical_paths()
    uint64_t offset = 0;   // in that physical file
    uint64_t length = 0;
  };

  struct Completion {
    uint64_t tag = 0;
    int error = 0;         // 0, or the errno of the failure (ENODATA: file too short)
    uint64_t offset = 0;   // where the failure happened (request offset on success)
  };

  // Opens `path` (and its siblings when striped), creating them if missing (contents kept).
  UringFile(std::string path, Options options);
  ~UringFile();
  UringFile(const UringFile&) = delete;
  UringFile& operator=(const UringFile&) = delete;

  const std::string& path() const;
  bool direct() const;
  unsigned queue_depth() const;
  unsigned in_flight() const;

  // Registers buffers for fixed-buffer I/O (Request::buf_index). Call once, before I/O.
  void register_buffers(const std::vector<iovec>& buffers);

  // Submits one request. UsageError when queue_depth requests are already in flight.
  // A failed request reports the failure at its lowest offset.
  void submit(const Request& request);

  // Appends finished requests to `out`; waits up to `timeout_us` for the first one when
  // none is ready (0: poll, negative: wait until one finishes). Returns how many.
  size_t reap(std::vector<Completion>* out, int64_t timeout_us);

  // Makes sure bytes [0, end) of the file are allocated: fallocate, or ftruncate where the
  // filesystem does not support it. Throws NoSpaceError when the space is not there.
  void allocate(uint64_t end);

  uint64_t size() const;   // current logical file size

  // Where logical bytes [offset, offset + length) lie: pieces of the physical files, in
  // logical order (one piece when not striped). For copying ranges with other tools.
  std::vector<Span> spans(uint64_t offset, uint64_t length) const;
  // The physical files: `path` and, when striped, its siblings.
  std::vector<std::string> physical_paths() const;
  void sync();             // fdatasync of every physical file

  // Unlinks the physical files of the logical file `path`, those that exist (best effort).
  static void remove_files(const std::string& path);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace statepager
