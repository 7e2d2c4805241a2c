#include "backing/file_copy.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>

#include "backing/errors.h"

namespace statepager {

namespace {

constexpr uint64_t kMaxCall = uint64_t(1) << 30;  // bytes per copy_file_range call

// The file pair cannot do this method (as opposed to an I/O error doing it).
bool refused(int err) {
  return err == EOPNOTSUPP || err == ENOTSUP || err == EXDEV || err == EINVAL ||
         err == ENOSYS || err == ENOTTY;
}

[[noreturn]] void throw_short_source(const OpenFile& src, uint64_t at) {
  throw CorruptStoreError(src.path() + " ends at byte " + std::to_string(at) +
                          ", inside the range being copied: the file was cut short outside "
                          "statepager");
}

// Returns false when the filesystems refuse to share blocks.
bool reflink(const OpenFile& src, uint64_t src_offset, const OpenFile& dst, uint64_t dst_offset,
             uint64_t length) {
  file_clone_range range{};
  range.src_fd = src.fd();
  range.src_offset = src_offset;
  range.src_length = length;
  range.dest_offset = dst_offset;
  int ret;
  do {
    ret = ::ioctl(dst.fd(), FICLONERANGE, &range);
  } while (ret != 0 && errno == EINTR);
  if (ret == 0) return true;
  if (refused(errno)) return false;
  throw_io_error(errno, "reflink (FICLONERANGE) from " + src.path(), dst.path(), dst_offset);
}

// Copies what it can; returns the bytes copied before the kernel refused the method.
uint64_t kernel_copy(const OpenFile& src, uint64_t src_offset, const OpenFile& dst,
                     uint64_t dst_offset, uint64_t length) {
  uint64_t done = 0;
  while (done < length) {
    auto in = static_cast<loff_t>(src_offset + done);
    auto out = static_cast<loff_t>(dst_offset + done);
    const ssize_t n = ::copy_file_range(src.fd(), &in, dst.fd(), &out,
                                        std::min(length - done, kMaxCall), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && refused(errno)) return done;
    if (n < 0) {
      throw_io_error(errno, "copy_file_range from " + src.path(), dst.path(), dst_offset + done);
    }
    if (n == 0) throw_short_source(src, src_offset + done);
    done += static_cast<uint64_t>(n);
  }
  return done;
}

// kReadWriteBufferBytes (file_copy.h) stays in a core's L2 cache (1 MiB on the machines
// we measure) between the read that fills it, the crc32c and the write that empties it.
// An 8 MiB buffer spilled it: every byte then crossed memory three times and the copy
// took 2.7 x the CPU time (perf, 1 GiB from an ext4 disk), slower than copy_file_range.
// 512 KiB copied fastest of 128 KiB to 8 MiB; the kernel's readahead keeps the disk busy
// meanwhile (POSIX_FADV_SEQUENTIAL on the source measured no different).
//
// Reads [offset, offset + length) of `src` through a buffer, passing each piece to
// `use(bytes, n, done)` (`done`: bytes of the range before this piece).
template <class Use>
void read_range(const OpenFile& src, uint64_t offset, uint64_t length, Use use) {
  const size_t cap = static_cast<size_t>(std::min<uint64_t>(length, kReadWriteBufferBytes));
  std::unique_ptr<char[]> buf(new char[cap]);
  uint64_t done = 0;
  while (done < length) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(length - done, cap));
    const ssize_t got = ::pread(src.fd(), buf.get(), want, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw_io_error(errno, "read", src.path(), offset + done);
    if (got == 0) throw_short_source(src, offset + done);
    use(buf.get(), static_cast<size_t>(got), done);
    done += static_cast<uint64_t>(got);
  }
}

void read_write(const OpenFile& src, uint64_t src_offset, const OpenFile& dst,
                uint64_t dst_offset, uint64_t length, ChunkCrcs* crcs) {
  read_range(src, src_offset, length, [&](const char* bytes, size_t got, uint64_t done) {
    if (crcs != nullptr) crcs->update(bytes, got);
    write_range(dst, dst_offset + done, bytes, got);
  });
}

}  // namespace

void write_range(const OpenFile& dst, uint64_t dst_offset, const void* buf, uint64_t length) {
  const char* from = static_cast<const char*>(buf);
  for (uint64_t put = 0; put < length;) {
    const ssize_t n = ::pwrite(dst.fd(), from + put, static_cast<size_t>(length - put),
                               static_cast<off_t>(dst_offset + put));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_io_error(errno, "write", dst.path(), dst_offset + put);
    put += static_cast<uint64_t>(n);
  }
}

void read_into(const OpenFile& src, uint64_t src_offset, void* buf, uint64_t length) {
  char* to = static_cast<char*>(buf);
  for (uint64_t got = 0; got < length;) {
    const ssize_t n = ::pread(src.fd(), to + got, static_cast<size_t>(length - got),
                              static_cast<off_t>(src_offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_io_error(errno, "read", src.path(), src_offset + got);
    if (n == 0) throw_short_source(src, src_offset + got);
    got += static_cast<uint64_t>(n);
  }
}

const char* copy_method_name(CopyMethod method) {
  switch (method) {
    case CopyMethod::kReflink: return "reflink";
    case CopyMethod::kCopyFileRange: return "copy_file_range";
    case CopyMethod::kReadWrite: return "read_write";
  }
  return "?";
}

OpenFile::OpenFile(std::string path, Mode mode) : path_(std::move(path)) {
  const int flags = O_NOFOLLOW | O_CLOEXEC | (mode == kRead ? O_RDONLY : O_WRONLY | O_CREAT);
  do {
    fd_ = ::open(path_.c_str(), flags, 0644);
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) throw_io_error(errno, "open", path_, 0);
}

OpenFile::~OpenFile() {
  if (fd_ >= 0) ::close(fd_);
}

OpenFile::OpenFile(OpenFile&& other) noexcept : path_(std::move(other.path_)), fd_(other.fd_) {
  other.fd_ = -1;
}

void OpenFile::sync() const {
  int ret;
  do {
    ret = ::fsync(fd_);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) throw_io_error(errno, "fsync", path_, 0);
}

CopyMethod copy_range(const OpenFile& src, uint64_t src_offset, const OpenFile& dst,
                      uint64_t dst_offset, uint64_t length, CopyMethod first, ChunkCrcs* crcs) {
  if (length == 0) return first;  // FICLONERANGE would read 0 as "to the end of the file"
  if (first == CopyMethod::kReflink) {
    if (reflink(src, src_offset, dst, dst_offset, length)) {
      if (crcs != nullptr) {  // the source: the same blocks now, and open for reading
        read_range(src, src_offset, length,
                   [&](const char* bytes, size_t got, uint64_t) { crcs->update(bytes, got); });
      }
      return CopyMethod::kReflink;
    }
    first = CopyMethod::kCopyFileRange;
  }
  uint64_t done = 0;
  if (first == CopyMethod::kCopyFileRange && crcs == nullptr) {
    done = kernel_copy(src, src_offset, dst, dst_offset, length);
    if (done == length) return CopyMethod::kCopyFileRange;
  }
  read_write(src, src_offset + done, dst, dst_offset + done, length - done, crcs);
  return CopyMethod::kReadWrite;
}

CopyMethod copy_file(const std::string& src_path, const std::string& dst_path, CopyMethod first) {
  const OpenFile src(src_path, OpenFile::kRead);
  const OpenFile dst(dst_path, OpenFile::kWrite);
  if (::ftruncate(dst.fd(), 0) != 0) throw_io_error(errno, "ftruncate", dst_path, 0);
  struct stat st;
  if (::fstat(src.fd(), &st) != 0) throw_io_error(errno, "fstat", src_path, 0);
  const CopyMethod used = copy_range(src, 0, dst, 0, static_cast<uint64_t>(st.st_size), first);
  dst.sync();
  return used;
}

}  // namespace statepager
