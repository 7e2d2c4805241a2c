#include "backing/uring_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "backing/errors.h"

namespace statepager {

namespace {

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

bool aligned(uint64_t v) { return v % UringFile::kAlignment == 0; }

int open_file(const std::string& path, bool direct) {
  int flags = O_RDWR | O_CREAT | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0644);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Writes one aligned zero block past the end of the file and truncates it away again.
// True for filesystems whose files live in RAM (tmpfs, ramfs): there is no cache for
// O_DIRECT to bypass, and their direct path is slower than the buffered one.
bool in_ram(const std::string& path) {
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  struct statfs fs;
  if (::statfs(dir.empty() ? "." : dir.c_str(), &fs) != 0) return false;
  return fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC;
}

// Returns 0 or the errno of the write; EINVAL means the filesystem refuses O_DIRECT even
// though open() accepted it.
int probe_direct(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_io_error(errno, "fstat", path, 0);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const uint64_t at = round_up(size, UringFile::kAlignment);
  void* block = std::aligned_alloc(UringFile::kAlignment, UringFile::kAlignment);
  if (block == nullptr) throw std::bad_alloc();
  std::memset(block, 0, UringFile::kAlignment);
  ssize_t n;
  do {
    n = ::pwrite(fd, block, UringFile::kAlignment, static_cast<off_t>(at));
  } while (n < 0 && errno == EINTR);
  const int err = n < 0 ? errno : 0;
  std::free(block);
  if (n > 0 && ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    throw_io_error(errno, "ftruncate", path, size);
  }
  return err;
}

}  // namespace

struct UringFile::Impl {
  // One per request in flight; the ring's user_data is the slot index.
  struct Slot {
    Request req;
    size_t done = 0;  // bytes transferred so far
  };

  std::string path;
  Options options;
  int fd = -1;
  bool direct = false;
  bool ring_ready = false;
  io_uring ring{};
  std::vector<Slot> slots;
  std::vector<unsigned> free_slots;
  std::vector<iovec> registered;
  uint64_t allocated = 0;  // [0, allocated) is known to be allocated by allocate()

  ~Impl() {
    if (ring_ready) io_uring_queue_exit(&ring);
    if (fd >= 0) ::close(fd);
  }

  unsigned in_flight() const { return static_cast<unsigned>(slots.size() - free_slots.size()); }

  // Queues the remainder of the slot's request. Submission happens in flush().
  void prepare(unsigned index) {
    Slot& s = slots[index];
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (sqe == nullptr) {
      // Cannot happen: each slot has at most one SQE and there are queue_depth of both.
      flush();
      sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) throw_io_error(EBUSY, "io_uring_get_sqe", path, s.req.offset);
    }
    char* buf = static_cast<char*>(s.req.buf) + s.done;
    // One SQE carries at most 1 GiB (an aligned amount); the rest goes as a short transfer.
    const auto len = static_cast<unsigned>(std::min<size_t>(s.req.len - s.done, size_t{1} << 30));
    const uint64_t off = s.req.offset + s.done;
    if (s.req.buf_index >= 0) {
      // The remainder lies inside the same registered buffer, so fixed I/O still applies.
      if (s.req.write) {
        io_uring_prep_write_fixed(sqe, fd, buf, len, off, s.req.buf_index);
      } else {
        io_uring_prep_read_fixed(sqe, fd, buf, len, off, s.req.buf_index);
      }
    } else if (s.req.write) {
      io_uring_prep_write(sqe, fd, buf, len, off);
    } else {
      io_uring_prep_read(sqe, fd, buf, len, off);
    }
    io_uring_sqe_set_data64(sqe, index);
    // Buffered I/O is a memcpy in the kernel: hand it to io_uring's worker pool so many
    // requests copy on many cores, instead of one after another in the submitting thread.
    if (!direct) io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
  }

  // Hands queued SQEs to the kernel. Transient refusals leave them queued in the ring;
  // the next flush (every submit() and reap()) passes them on.
  void flush() {
    while (io_uring_sq_ready(&ring) > 0) {
      int ret = io_uring_submit(&ring);
      if (ret >= 0) return;
      if (ret == -EINTR) continue;
      if (ret == -EAGAIN || ret == -EBUSY) return;
      throw_io_error(-ret, "io_uring_submit", path, 0);
    }
  }

  void finish(unsigned index, int error, uint64_t offset, std::vector<Completion>* out) {
    out->push_back(Completion{slots[index].req.tag, error, offset});
    free_slots.push_back(index);
  }

  // Applies one CQE result; returns true when the request is finished.
  bool on_result(unsigned index, int res, std::vector<Completion>* out) {
    Slot& s = slots[index];
    const uint64_t at = s.req.offset + s.done;
    if (res == -EAGAIN || res == -EINTR) {
      prepare(index);
      return false;
    }
    if (res < 0) {
      finish(index, -res, at, out);
      return true;
    }
    if (res == 0) {
      // A read of 0 bytes is the end of the file; a write of 0 bytes makes no progress.
      finish(index, s.req.write ? EIO : ENODATA, at, out);
      return true;
    }
    s.done += static_cast<size_t>(res);
    if (s.done >= s.req.len) {
      finish(index, 0, s.req.offset, out);
      return true;
    }
    if (!s.req.write && direct && !aligned(s.done)) {
      // O_DIRECT reads stop short only at the end of the file, and the misaligned
      // remainder could not be read directly anyway.
      finish(index, ENODATA, s.req.offset + s.done, out);
      return true;
    }
    prepare(index);
    return false;
  }

  size_t drain(std::vector<Completion>* out) {
    size_t finished = 0;
    io_uring_cqe* cqe;
    while (io_uring_peek_cqe(&ring, &cqe) == 0) {
      const auto index = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      if (on_result(index, res, out)) ++finished;
    }
    flush();  // resubmissions of short transfers
    return finished;
  }
};

UringFile::UringFile(std::string path, Options options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = std::move(path);
  m.options = options;
  if (options.queue_depth == 0) throw UsageError("UringFile: queue_depth must be at least 1");

  if (options.try_direct && !in_ram(m.path)) {
    m.fd = open_file(m.path, true);
    if (m.fd < 0 && errno != EINVAL) throw_io_error(errno, "open", m.path, 0);
    if (m.fd >= 0 && probe_direct(m.fd, m.path) == EINVAL) {
      ::close(m.fd);
      m.fd = -1;
    }
    // Other probe failures (ENOSPC, EFBIG) say nothing about O_DIRECT: keep it, and let
    // real requests report them.
    m.direct = m.fd >= 0;
  }
  if (m.fd < 0) {
    m.fd = open_file(m.path, false);
    if (m.fd < 0) throw_io_error(errno, "open", m.path, 0);
  }

  int ret = io_uring_queue_init(options.queue_depth, &m.ring, 0);
  if (ret < 0) throw_io_error(-ret, "io_uring_queue_init", m.path, 0);
  m.ring_ready = true;
  m.slots.resize(options.queue_depth);
  for (unsigned i = options.queue_depth; i > 0; --i) m.free_slots.push_back(i - 1);
}

UringFile::~UringFile() = default;

const std::string& UringFile::path() const { return impl_->path; }
bool UringFile::direct() const { return impl_->direct; }
unsigned UringFile::queue_depth() const { return impl_->options.queue_depth; }
unsigned UringFile::in_flight() const { return impl_->in_flight(); }

void UringFile::register_buffers(const std::vector<iovec>& buffers) {
  Impl& m = *impl_;
  if (!m.registered.empty()) throw UsageError("UringFile::register_buffers: called twice");
  if (buffers.empty()) return;
  const auto count = static_cast<unsigned>(buffers.size());
  int ret = io_uring_register_buffers(&m.ring, buffers.data(), count);
  if (ret < 0) throw_io_error(-ret, "io_uring_register_buffers", m.path, 0);
  m.registered = buffers;
}

void UringFile::submit(const Request& request) {
  Impl& m = *impl_;
  if (m.free_slots.empty()) {
    throw UsageError("UringFile::submit: " + std::to_string(m.options.queue_depth) +
                     " requests already in flight on " + m.path + ": reap() first");
  }
  const auto addr = reinterpret_cast<uintptr_t>(request.buf);
  if (request.len == 0 || !aligned(request.len) || !aligned(request.offset) || !aligned(addr)) {
    throw UsageError("UringFile::submit: buffer, offset and length must be non-zero multiples of " +
                     std::to_string(kAlignment));
  }
  if (request.buf_index >= 0) {
    if (static_cast<size_t>(request.buf_index) >= m.registered.size()) {
      throw UsageError("UringFile::submit: buf_index " + std::to_string(request.buf_index) +
                       " was not registered");
    }
    const iovec& reg = m.registered[static_cast<size_t>(request.buf_index)];
    const auto base = reinterpret_cast<uintptr_t>(reg.iov_base);
    if (addr < base || addr + request.len > base + reg.iov_len) {
      throw UsageError("UringFile::submit: request lies outside registered buffer " +
                       std::to_string(request.buf_index));
    }
  }
  const unsigned index = m.free_slots.back();
  m.free_slots.pop_back();
  m.slots[index] = Impl::Slot{request, 0};
  m.prepare(index);
  m.flush();
}

size_t UringFile::reap(std::vector<Completion>* out, int64_t timeout_us) {
  Impl& m = *impl_;
  size_t n = m.drain(out);
  // Capped at a day so that the deadline cannot overflow.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(std::min<int64_t>(timeout_us, 86400000000));
  // Wait until a request finishes; a CQE may only be a short transfer that was resubmitted.
  while (n == 0 && timeout_us != 0 && m.in_flight() > 0) {
    io_uring_cqe* cqe;
    int ret;
    if (timeout_us < 0) {
      ret = io_uring_wait_cqe(&m.ring, &cqe);
    } else {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      __kernel_timespec ts{};
      ts.tv_sec = left.count() / 1000000000;
      ts.tv_nsec = left.count() % 1000000000;
      ret = io_uring_wait_cqe_timeout(&m.ring, &cqe, &ts);
    }
    if (ret == -ETIME) break;
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN) {
      throw_io_error(-ret, "io_uring_wait_cqe", m.path, 0);
    }
    n += m.drain(out);
  }
  return n;
}

void UringFile::allocate(uint64_t end) {
  Impl& m = *impl_;
  if (end <= m.allocated) return;
  const auto start = static_cast<off_t>(m.allocated);
  int ret;
  do {
    ret = ::fallocate(m.fd, 0, start, static_cast<off_t>(end) - start);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) {
    const int err = errno;
    if (err != EOPNOTSUPP && err != ENOSYS) throw_io_error(err, "fallocate", m.path, end);
    // No preallocation here (some network and FUSE filesystems): at least set the size.
    if (end > size() && ::ftruncate(m.fd, static_cast<off_t>(end)) != 0) {
      throw_io_error(errno, "ftruncate", m.path, end);
    }
  }
  m.allocated = end;
}

uint64_t UringFile::size() const {
  struct stat st;
  if (::fstat(impl_->fd, &st) != 0) throw_io_error(errno, "fstat", impl_->path, 0);
  return static_cast<uint64_t>(st.st_size);
}

void UringFile::sync() {
  int ret;
  do {
    ret = ::fdatasync(impl_->fd);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) throw_io_error(errno, "fdatasync", impl_->path, 0);
}

}  // namespace statepager
