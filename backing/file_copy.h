// Copying byte ranges between files by the cheapest means the two files allow.
//
// In order of preference:
//   reflink          ioctl FICLONERANGE: the destination shares the source's blocks and no
//                    bytes move (btrfs, XFS with reflink, bcachefs; same filesystem only);
//   copy_file_range  the kernel copies without a round trip through user memory (server
//                    side on NFS; a page-cache copy on ext4 and tmpfs);
//   read_write       pread/pwrite through a buffer, which works between any two files.
// A method that the pair of files refuses (EOPNOTSUPP, EXDEV, EINVAL, ENOSYS, ENOTTY) is
// given up for the next one; copy_range() returns the method that did the copy, and the
// caller passes it to the next call, so refused methods are tried once, not per range.
// Reflink needs block-aligned ranges (4 KiB covers the usual block sizes); an unaligned
// range simply falls through to copy_file_range.
//
// Checksums at copy speed: given a ChunkCrcs (backing/crc32c.h), copy_range() checksums
// the range in the same pass as it copies it. Bytes that move are checksummed in the
// buffer between read and write, so copy_file_range (whose bytes never reach user memory)
// is skipped for read_write; a reflink moves no bytes, so its range is read once
// afterwards (unavoidable: nothing else has seen the bytes). The buffer is small enough
// to stay in a core's L2 cache through read, crc32c and write: with it the checksummed
// copy keeps up with copy_file_range plus a second read (see Note [Checkpoint checksums
// in the copy] in docs/design.md).
//
// Ownership: OpenFile owns its descriptor. Thread-safety: calls keep no shared state;
// copies into disjoint ranges of the same files may run on several threads at once.
// Errors: IoError subclasses (backing/errors.h) naming the file and offset; a source that
// ends inside the range is a CorruptStoreError (the file was cut short).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "backing/crc32c.h"

namespace statepager {

enum class CopyMethod { kReflink, kCopyFileRange, kReadWrite };

// Bytes read_write moves per read and write (the tests copy around its multiples).
constexpr size_t kReadWriteBufferBytes = size_t(512) << 10;

// Extents a save (StoreSnapshot::copy_to) or a load (restore_extents) copies at once
// (backing/parallel.h). A copy through memory (read, crc32c, write) is bound by one core:
// a 1 GiB save to /dev/shm on a 2-core machine took 0.88 s with one, 0.49 s with two and
// 0.41 s with four (bench ckpt, medians of 4); on its virtio disk the three were within
// the disk's noise.
constexpr unsigned kCopyThreads = 4;

// The method the threads of one parallel copy share: each extent's copy starts with what
// the others came to (a filesystem that refuses reflink refuses it for every extent), and
// the copy as a whole reports the last resort any came to. Thread-safe.
class SharedCopyMethod {
 public:
  CopyMethod first() const {
    const std::lock_guard lock(mu_);
    return method_;
  }
  void came_to(CopyMethod used) {  // the enum runs from best to last resort
    const std::lock_guard lock(mu_);
    method_ = std::max(method_, used);
  }

 private:
  mutable std::mutex mu_;
  CopyMethod method_ = CopyMethod::kReflink;  // guarded by mu_
};

// "reflink", "copy_file_range" or "read_write".
const char* copy_method_name(CopyMethod method);

// A file opened for copying from (kRead) or into (kWrite: created when missing, contents
// kept). Buffered, never O_DIRECT, so ranges and buffers need no alignment. A symbolic
// link as the file itself is never followed (IoError, ELOOP): a link planted in a store
// or checkpoint directory cannot redirect a write.
class OpenFile {
 public:
  enum Mode { kRead, kWrite };
  OpenFile(std::string path, Mode mode);
  ~OpenFile();
  OpenFile(OpenFile&& other) noexcept;
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  OpenFile& operator=(OpenFile&&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  void sync() const;  // fsync: data and size are durable

 private:
  std::string path_;
  int fd_ = -1;
};

// Copies `length` bytes at `src_offset` of `src` to `dst_offset` of `dst`, trying `first`
// and then the methods after it. Returns the method that copied the last of the bytes.
// With `crcs`, the range's bytes are also fed to it, in order (see above).
CopyMethod copy_range(const OpenFile& src, uint64_t src_offset, const OpenFile& dst,
                      uint64_t dst_offset, uint64_t length,
                      CopyMethod first = CopyMethod::kReflink, ChunkCrcs* crcs = nullptr);

// Writes `length` bytes of memory at `dst_offset` of `dst` (pwrite until done).
void write_range(const OpenFile& dst, uint64_t dst_offset, const void* buf, uint64_t length);

// Reads `length` bytes at `src_offset` of `src` into memory `buf` (pread until done); a
// source that ends inside the range is a CorruptStoreError.
void read_into(const OpenFile& src, uint64_t src_offset, void* buf, uint64_t length);

// Copies the whole file `src` to `dst` (created, or truncated first) and fsyncs it.
CopyMethod copy_file(const std::string& src, const std::string& dst,
                     CopyMethod first = CopyMethod::kReflink);

}  // namespace statepager
