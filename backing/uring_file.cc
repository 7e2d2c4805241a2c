#include "backing/uring_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <utility>

#include "backing/align.h"
#include "backing/errors.h"

namespace statepager {

namespace {

// Striping in RAM (see the header). 1 MiB units keep a request of a few MiB on a few
// files; 8 files let 8 io-wq workers write at once, about what memory bandwidth takes.
constexpr uint64_t kStripeBytes = uint64_t{1} << 20;
constexpr unsigned kStripes = 8;

// Physical file k of the logical file `path`: `path` itself, then `path.1`, `path.2`...
std::string stripe_path(const std::string& path, unsigned k) {
  return k == 0 ? path : path + "." + std::to_string(k);
}

bool aligned(uint64_t v) { return v % UringFile::kAlignment == 0; }

std::string join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

// Opens (with `create_new`: creates) the regular file `name` in `dir`, buffered, never
// through a symbolic link.
int open_file(const UringFile::Location& dir, const std::string& name, bool create_new) {
  const std::string path = join(dir.dir, name);
  const int flags = O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | (create_new ? O_EXCL : 0);
  int fd;
  do {
    fd = ::openat(dir.dir_fd, name.c_str(), flags, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && errno == ELOOP) {
    throw IoError(path + " is a symbolic link: statepager never opens its files through one "
                  "(remove it, or give the Pager a new directory)", path, 0, ELOOP);
  }
  if (fd < 0 && errno == EEXIST) {
    throw IoError(path + " already exists (a file or a symbolic link that statepager did not "
                  "create here): it is left alone; give the Pager a new directory", path, 0,
                  EEXIST);
  }
  if (fd < 0) throw_io_error(errno, "open", path, 0);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(path + " is not a regular file: statepager keeps its store in regular files "
                  "only (give the Pager a new directory)", path, 0, EINVAL);
  }
  return fd;
}

// Turns O_DIRECT on or off on an open file. Returns false when the filesystem refuses it.
bool set_direct(int fd, bool on, const std::string& path) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw_io_error(errno, "fcntl", path, 0);
  if (::fcntl(fd, F_SETFL, on ? flags | O_DIRECT : flags & ~O_DIRECT) == 0) return true;
  if (errno != EINVAL) throw_io_error(errno, "fcntl O_DIRECT", path, 0);
  return false;
}

// True for filesystems whose files live in RAM (tmpfs, ramfs): there is no cache for
// O_DIRECT to bypass, and their direct path is slower than the buffered one.
bool in_ram(int dir_fd) {
  struct statfs fs;
  if (::fstatfs(dir_fd, &fs) != 0) return false;
  return fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC;
}

// The directory of a path, open for as long as this object lives, and the path's
// Location in it.
class ParentDir {
 public:
  explicit ParentDir(const std::string& path) {
    const size_t slash = path.find_last_of('/');
    location_.dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
    location_.name = path.substr(slash + 1);  // npos + 1 == 0
    location_.dir_fd = ::open(location_.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (location_.dir_fd < 0) throw_io_error(errno, "open (its directory)", path, 0);
  }
  ~ParentDir() { ::close(location_.dir_fd); }
  ParentDir(const ParentDir&) = delete;
  ParentDir& operator=(const ParentDir&) = delete;
  const UringFile::Location& location() const { return location_; }

 private:
  UringFile::Location location_;
};

// Writes one aligned zero block past the end of the file and truncates it away again.
// Returns 0 or the errno of the write; EINVAL means the filesystem refuses O_DIRECT even
// though open() accepted it.
int probe_direct(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_io_error(errno, "fstat", path, 0);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const uint64_t at = align_up(size, UringFile::kAlignment);
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
  // One per request in flight.
  struct Slot {
    Request req;
    size_t issued = 0;      // bytes handed to pieces so far
    unsigned running = 0;   // pieces in flight
    int error = 0;          // the failure at the lowest offset, if any
    uint64_t error_offset = 0;
  };
  // A part of a request that lies in one stripe unit (the whole request when not
  // striped). The ring's user_data is the piece index. There are as many pieces as SQ
  // entries, so a piece in flight always finds an SQE; requests wait in `waiting` for one.
  struct Piece {
    unsigned slot = 0;
    size_t start = 0;  // offset in the request
    size_t len = 0;
    size_t done = 0;   // bytes transferred so far
  };

  // One logical file: its physical files (fds[k] is stripe_path(path, k)).
  struct File {
    std::string path;
    std::vector<int> fds;
    bool direct = false;
    bool ram = false;
    uint64_t allocated = 0;       // [0, allocated) is known to be allocated by allocate()
    unsigned first_physical = 0;  // index of fds[0] in physical_paths()

    ~File() {
      for (int fd : fds) ::close(fd);
    }
    uint64_t stripes() const { return fds.size(); }

    // Bytes of physical file k that logical [0, end) of this file reaches.
    uint64_t local_end(unsigned k, uint64_t end) const {
      const uint64_t units = end / kStripeBytes;
      uint64_t bytes = (units / stripes() + (k < units % stripes() ? 1 : 0)) * kStripeBytes;
      if (k == units % stripes()) bytes += end % kStripeBytes;
      return bytes;
    }

    // The end of this file implied by physical file k holding `size` bytes.
    uint64_t logical_end(unsigned k, uint64_t size) const {
      if (size == 0) return 0;
      const uint64_t last = size - 1;
      return (last / kStripeBytes * stripes() + k) * kStripeBytes + last % kStripeBytes + 1;
    }

    uint64_t file_size(unsigned k) const {
      struct stat st;
      if (::fstat(fds[k], &st) != 0) throw_io_error(errno, "fstat", stripe_path(path, k), 0);
      return static_cast<uint64_t>(st.st_size);
    }
  };

  // Opens the physical files of one logical file: O_DIRECT when the filesystem takes it,
  // else buffered, striped in RAM (see the header). O_DIRECT is switched on after the
  // open, so that a refusal leaves the one file created, open and usable buffered.
  static std::unique_ptr<File> open(const Location& where, const Options& options) {
    auto f = std::make_unique<File>();
    f->path = join(where.dir, where.name);
    f->ram = in_ram(where.dir_fd);
    f->fds.push_back(open_file(where, where.name, options.create_new));
    if (options.direct_io && !f->ram && set_direct(f->fds[0], true, f->path)) {
      // Other probe failures (ENOSPC, EFBIG) say nothing about O_DIRECT: keep it, and let
      // real requests report them.
      f->direct = probe_direct(f->fds[0], f->path) != EINVAL;
      if (!f->direct) set_direct(f->fds[0], false, f->path);
    }
    if (!f->direct && f->ram && options.stripe_ram) {
      // In RAM nothing but the per-inode serialization of buffered writes (see the header)
      // limits them: stripe.
      for (unsigned k = 1; k < kStripes; ++k) {
        f->fds.push_back(open_file(where, stripe_path(where.name, k), options.create_new));
      }
    }
    return f;
  }

  std::string path;  // of file 0
  Options options;
  // Appended by add_file() while the ring runs, hence a fixed array: no reallocation.
  std::array<std::unique_ptr<File>, kMaxFiles> files;
  std::atomic<unsigned> file_count{0};
  bool ring_ready = false;
  io_uring ring{};
  std::vector<Slot> slots;
  std::vector<unsigned> free_slots;
  std::vector<Piece> pieces;
  std::vector<unsigned> free_pieces;
  std::deque<unsigned> waiting;  // slots with bytes not yet issued, oldest first
  std::vector<iovec> registered;

  ~Impl() {
    if (ring_ready) io_uring_queue_exit(&ring);
  }

  unsigned in_flight() const { return static_cast<unsigned>(slots.size() - free_slots.size()); }

  // The logical file holding logical offset `off` (an offset checked by submit()).
  const File& file_of(uint64_t off) const { return *files[off / kRegionBytes]; }

  struct Place {
    const File* file;
    unsigned stripe;  // index into file->fds
    uint64_t offset;  // in that physical file
  };
  // Where logical byte `off` lies.
  Place locate(uint64_t off) const {
    const File& f = file_of(off);
    const uint64_t unit = off % kRegionBytes / kStripeBytes;
    return {&f, static_cast<unsigned>(unit % f.stripes()),
            unit / f.stripes() * kStripeBytes + off % kStripeBytes};
  }

  // Starts pieces of the waiting requests while there are free pieces.
  void issue() {
    while (!waiting.empty() && !free_pieces.empty()) {
      Slot& s = slots[waiting.front()];
      size_t len = s.req.len - s.issued;
      if (file_of(s.req.offset).stripes() > 1) {
        len = std::min<size_t>(len, kStripeBytes - (s.req.offset + s.issued) % kStripeBytes);
      }
      const unsigned index = free_pieces.back();
      free_pieces.pop_back();
      pieces[index] = Piece{waiting.front(), s.issued, len, 0};
      s.issued += len;
      ++s.running;
      if (s.issued == s.req.len) waiting.pop_front();
      prepare(index);
    }
  }

  // Queues the remainder of the piece. Submission happens in flush().
  void prepare(unsigned index) {
    const Piece& p = pieces[index];
    const Request& req = slots[p.slot].req;
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (sqe == nullptr) {
      // Cannot happen: each piece has at most one SQE and there are as many of both.
      flush();
      sqe = io_uring_get_sqe(&ring);
      if (sqe == nullptr) throw_io_error(EBUSY, "io_uring_get_sqe", path, req.offset);
    }
    char* buf = static_cast<char*>(req.buf) + p.start + p.done;
    // One SQE carries at most 1 GiB (an aligned amount); the rest goes as a short transfer.
    const auto len = static_cast<unsigned>(std::min<size_t>(p.len - p.done, size_t{1} << 30));
    const Place at = locate(req.offset + p.start + p.done);
    const int fd = at.file->fds[at.stripe];
    const uint64_t off = at.offset;
    if (req.buf_index >= 0) {
      // The piece lies inside the request's registered buffer, so fixed I/O still applies.
      if (req.write) {
        io_uring_prep_write_fixed(sqe, fd, buf, len, off, req.buf_index);
      } else {
        io_uring_prep_read_fixed(sqe, fd, buf, len, off, req.buf_index);
      }
    } else if (req.write) {
      io_uring_prep_write(sqe, fd, buf, len, off);
    } else {
      io_uring_prep_read(sqe, fd, buf, len, off);
    }
    io_uring_sqe_set_data64(sqe, index);
    // Buffered I/O is a memcpy in the kernel: hand it to io_uring's worker pool so many
    // requests copy on many cores, instead of one after another in the submitting thread.
    if (!at.file->direct) io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
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

  // Retires a piece (error 0, or its errno and the logical offset where it failed).
  // Returns true when it was the last of its request, which then completes.
  bool end_piece(unsigned index, int error, uint64_t at, std::vector<Completion>* out) {
    const unsigned slot = pieces[index].slot;
    free_pieces.push_back(index);
    Slot& s = slots[slot];
    // Pieces finish in any order; the lowest failure is where a sequential transfer
    // would have stopped (for ENODATA, the end of the data).
    if (error != 0 && (s.error == 0 || at < s.error_offset)) {
      s.error = error;
      s.error_offset = at;
    }
    if (--s.running > 0 || s.issued < s.req.len) return false;
    out->push_back(Completion{s.req.tag, s.error, s.error != 0 ? s.error_offset : s.req.offset});
    free_slots.push_back(slot);
    return true;
  }

  // Applies one CQE result; returns true when a request is finished.
  bool on_result(unsigned index, int res, std::vector<Completion>* out) {
    Piece& p = pieces[index];
    const Request& req = slots[p.slot].req;
    const uint64_t at = req.offset + p.start + p.done;
    if (res == -EAGAIN || res == -EINTR) {
      prepare(index);
      return false;
    }
    if (res < 0) return end_piece(index, -res, at, out);
    // A read of 0 bytes is the end of the file; a write of 0 bytes makes no progress.
    if (res == 0) return end_piece(index, req.write ? EIO : ENODATA, at, out);
    p.done += static_cast<size_t>(res);
    if (p.done >= p.len) return end_piece(index, 0, 0, out);
    if (!req.write && file_of(req.offset).direct && !aligned(p.done)) {
      // O_DIRECT reads stop short only at the end of the file, and the misaligned
      // remainder could not be read directly anyway.
      return end_piece(index, ENODATA, at + static_cast<uint64_t>(res), out);
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
    issue();  // pieces that waited for room
    flush();  // and resubmissions of short transfers
    return finished;
  }
};

UringFile::UringFile(const std::string& path, Options options)
    : UringFile(ParentDir(path).location(), options) {}

UringFile::UringFile(const Location& file, Options options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = options;
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    throw UsageError("UringFile: queue_depth " + std::to_string(options.queue_depth) +
                     " is not allowed: it must be 1 to " + std::to_string(kMaxQueueDepth));
  }
  m.files[0] = Impl::open(file, options);
  m.path = m.files[0]->path;
  m.file_count.store(1, std::memory_order_release);

  // Room for every request to be in several pieces (at most 4096 x 8: the kernel's maximum).
  static_assert(kMaxQueueDepth * kStripes <= 32768);
  const unsigned entries = options.queue_depth * kStripes;
  int ret = io_uring_queue_init(entries, &m.ring, 0);
  if (ret < 0) throw_io_uring_setup_error(-ret, m.path);
  m.ring_ready = true;
  m.slots.resize(options.queue_depth);
  for (unsigned i = options.queue_depth; i > 0; --i) m.free_slots.push_back(i - 1);
  m.pieces.resize(m.ring.sq.ring_entries);
  for (auto i = static_cast<unsigned>(m.pieces.size()); i > 0; --i) m.free_pieces.push_back(i - 1);
}

UringFile::~UringFile() = default;

unsigned UringFile::add_file(const std::string& path) {
  return add_file(ParentDir(path).location());
}

unsigned UringFile::add_file(const Location& file) {
  Impl& m = *impl_;
  const unsigned r = m.file_count.load(std::memory_order_acquire);
  if (r == kMaxFiles) {
    throw UsageError("UringFile: at most " + std::to_string(kMaxFiles) + " files per ring (" +
                     join(file.dir, file.name) + " is one too many)");
  }
  auto f = Impl::open(file, m.options);
  const Impl::File& last = *m.files[r - 1];
  f->first_physical = last.first_physical + static_cast<unsigned>(last.stripes());
  m.files[r] = std::move(f);
  m.file_count.store(r + 1, std::memory_order_release);
  return r;
}

unsigned UringFile::file_count() const {
  return impl_->file_count.load(std::memory_order_acquire);
}

const std::string& UringFile::path() const { return impl_->path; }
const std::string& UringFile::file_path(unsigned file) const {
  if (file >= file_count()) throw UsageError("UringFile: no file " + std::to_string(file));
  return impl_->files[file]->path;
}
bool UringFile::direct() const { return impl_->files[0]->direct; }
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
  if (request.offset / kRegionBytes >= m.file_count.load(std::memory_order_acquire) ||
      (request.offset + request.len - 1) / kRegionBytes != request.offset / kRegionBytes) {
    throw UsageError("UringFile::submit: offset " + std::to_string(request.offset) +
                     " is not inside one file of " + m.path + " (see add_file())");
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
  m.slots[index] = Impl::Slot{request};
  m.waiting.push_back(index);
  m.issue();
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
  if (end == 0) return;
  Impl::File& f = *impl_->files[(end - 1) / kRegionBytes];
  end = (end - 1) % kRegionBytes + 1;
  if (end <= f.allocated) return;
  for (unsigned k = 0; k < f.stripes(); ++k) {
    const uint64_t from = f.local_end(k, f.allocated), to = f.local_end(k, end);
    if (to <= from) continue;
    // In RAM, fallocate of the whole range would zero every page in this one thread before
    // the writes copy over it (writes allocate their own pages): there the last page alone
    // sets the size. fallocate never shrinks a file, as a check-then-ftruncate could when a
    // restore writes past `to` from its own threads meanwhile.
    const uint64_t start = f.ram ? to - std::min<uint64_t>(to - from, kAlignment) : from;
    int ret;
    do {
      ret = ::fallocate(f.fds[k], 0, static_cast<off_t>(start), static_cast<off_t>(to - start));
    } while (ret != 0 && errno == EINTR);
    if (ret == 0) continue;
    const int err = errno;
    const std::string name = stripe_path(f.path, k);
    if (err != EOPNOTSUPP && err != ENOSYS) throw_io_error(err, "fallocate", name, to);
    // No preallocation (ramfs, some network and FUSE filesystems): at least set the size.
    if (to > f.file_size(k) && ::ftruncate(f.fds[k], static_cast<off_t>(to)) != 0) {
      throw_io_error(errno, "ftruncate", name, to);
    }
  }
  f.allocated = end;
}

uint64_t UringFile::size(unsigned file) const {
  const Impl::File& f = *impl_->files.at(file);
  uint64_t end = 0;
  for (unsigned k = 0; k < f.stripes(); ++k) end = std::max(end, f.logical_end(k, f.file_size(k)));
  return end;
}

std::vector<UringFile::Span> UringFile::spans(uint64_t offset, uint64_t length) const {
  const Impl& m = *impl_;
  std::vector<Span> out;
  for (uint64_t at = offset, end = offset + length; at < end;) {
    const Impl::Place p = m.locate(at);
    uint64_t n = end - at;
    if (p.file->stripes() > 1) n = std::min(n, kStripeBytes - at % kStripeBytes);
    const unsigned k = p.file->first_physical + p.stripe;
    if (!out.empty() && out.back().file == k && out.back().offset + out.back().length == p.offset) {
      out.back().length += n;  // one stripe: the whole range is one piece
    } else {
      out.push_back(Span{k, p.offset, n});
    }
    at += n;
  }
  return out;
}

std::vector<std::string> UringFile::physical_paths() const {
  std::vector<std::string> paths;
  for (unsigned r = 0; r < file_count(); ++r) {
    const Impl::File& f = *impl_->files[r];
    for (unsigned k = 0; k < f.stripes(); ++k) paths.push_back(stripe_path(f.path, k));
  }
  return paths;
}

UringFile::Physical UringFile::physical_of(unsigned file) const {
  if (file >= file_count()) throw UsageError("UringFile: no file " + std::to_string(file));
  const Impl::File& f = *impl_->files[file];
  return Physical{f.first_physical, static_cast<unsigned>(f.stripes()), f.ram};
}

int UringFile::physical_fd(unsigned index) const {
  for (unsigned r = 0; r < file_count(); ++r) {
    const Impl::File& f = *impl_->files[r];
    if (index < f.first_physical + f.stripes()) return f.fds.at(index - f.first_physical);
  }
  throw UsageError("UringFile: no physical file " + std::to_string(index));
}

void UringFile::sync() {
  for (unsigned r = 0; r < file_count(); ++r) {
    const Impl::File& f = *impl_->files[r];
    for (unsigned k = 0; k < f.stripes(); ++k) {
      int ret;
      do {
        ret = ::fdatasync(f.fds[k]);
      } while (ret != 0 && errno == EINTR);
      if (ret != 0) throw_io_error(errno, "fdatasync", stripe_path(f.path, k), 0);
    }
  }
}

void UringFile::punch(uint64_t offset, uint64_t length) {
  const Impl& m = *impl_;
  for (uint64_t at = offset, end = offset + length; at < end;) {
    const Impl::Place p = m.locate(at);
    uint64_t n = end - at;
    if (p.file->stripes() > 1) n = std::min(n, kStripeBytes - at % kStripeBytes);
    // A failure leaves the blocks allocated, which loses nothing.
    (void)::fallocate(p.file->fds[p.stripe], FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(p.offset), static_cast<off_t>(n));
    at += n;
  }
}

void UringFile::remove_files(const std::string& path) {
  for (unsigned k = 0; k < kStripes; ++k) ::unlink(stripe_path(path, k).c_str());
}

bool UringFile::is_physical_name(std::string_view entry, std::string_view name) {
  for (unsigned k = 0; k < kStripes; ++k) {
    if (entry == stripe_path(std::string(name), k)) return true;
  }
  return false;
}

}  // namespace statepager
