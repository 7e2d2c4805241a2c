// UringFile: store files driven through one io_uring.
//
// Files: the ring serves up to kMaxFiles logical files: `path` (file 0) and those added
// by add_file(). Offsets are logical: byte x of file r is at r * kRegionBytes + x, so one
// offset names the file and the place in it, and a request lies inside one file.
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
// In RAM allocate() only sets the size: preallocating would zero every page in one
// thread before the writes copy over it. Options::stripe_ram = false keeps a file in RAM
// whole, for a store whose bytes the device copies through a mapping of its files
// (allocator/ram_map.h): there stripes only cut every copy into 1 MiB pieces.
//
// Opening: a file is named by a directory descriptor and a name in it (Location), and
// opened relative to that descriptor with O_NOFOLLOW: a symbolic link in the file's place
// is never followed (IoError, ELOOP). With Options::create_new the files are created new
// (O_EXCL): a name already taken, by a file or a link, is refused (IoError, EEXIST), so
// nothing but a file this ring created is ever written.
//
// Ownership: owns the file descriptors and the ring; buffers stay the caller's and must
// outlive the requests that use them. A Location's directory descriptor is borrowed for
// the call that opens it only.
// Thread-safety: none, except add_file(), file_count(), file_path(), spans(),
// physical_paths(), physical_of(), physical_fd() and punch(), which may be called from any
// thread (add_file() from one at a time) while another submits and reaps (the Pager's I/O
// thread).
// Errors: construction throws UsageError for a queue_depth out of range; construction and
// allocate() throw IoError subclasses (backing/errors.h) naming the file, construction
// IoUringUnavailableError where io_uring is blocked or missing; per-request failures come
// back as Completion::error (an errno value).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace statepager {

class UringFile {
 public:
  static constexpr size_t kAlignment = 4096;
  static constexpr uint64_t kRegionBytes = uint64_t{1} << 48;  // logical offsets per file
  static constexpr unsigned kMaxFiles = 256;

  static constexpr unsigned kMaxQueueDepth = 4096;  // the ring takes 8 pieces per request

  struct Options {
    unsigned queue_depth = 32;  // requests in flight at most: 1 to kMaxQueueDepth
    bool direct_io = true;      // false: always buffered I/O
    bool create_new = false;    // true: every physical file must not exist yet (O_EXCL)
    bool stripe_ram = true;     // false: a file in RAM is one physical file (see Striping)
  };

  // The file `name` in the directory open as `dir_fd`; `dir` is that directory's path,
  // for messages and file_path().
  struct Location {
    int dir_fd = -1;
    std::string dir;
    std::string name;
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

  // Opens the file (and its siblings when striped), creating them if missing (contents
  // kept unless options.create_new, see Opening).
  UringFile(const Location& file, Options options);
  // The same for `path`, relative to its directory (opened for the call).
  UringFile(const std::string& path, Options options);
  // Opens another file the same way on the same ring; returns its index r (see Files).
  // UsageError past kMaxFiles.
  unsigned add_file(const Location& file);
  unsigned add_file(const std::string& path);
  unsigned file_count() const;
  ~UringFile();
  UringFile(const UringFile&) = delete;
  UringFile& operator=(const UringFile&) = delete;

  const std::string& path() const;  // of file 0
  const std::string& file_path(unsigned file) const;  // the path of logical file `file`
  bool direct() const;               // file 0 uses O_DIRECT
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

  // Makes sure the file holding logical byte end - 1 is allocated up to there: fallocate
  // (in RAM of the last page only: it sets the size), or ftruncate where the filesystem
  // does not support it (there a write past `end` by another thread meanwhile could be cut
  // off). Throws NoSpaceError when the space is not there.
  void allocate(uint64_t end);

  uint64_t size(unsigned file = 0) const;  // current size of one logical file

  // Where logical bytes [offset, offset + length) lie: pieces of the physical files, in
  // logical order (one piece when not striped). For copying ranges with other tools.
  std::vector<Span> spans(uint64_t offset, uint64_t length) const;
  // The physical files of every logical file, in file order: each path and, when
  // striped, its siblings.
  std::vector<std::string> physical_paths() const;
  // The physical files of logical file `file`: indices [first, first + count) of
  // physical_paths(), and whether they lie in RAM (tmpfs, ramfs: buffered, striped unless
  // Options::stripe_ram is off).
  struct Physical {
    unsigned first = 0;
    unsigned count = 0;
    bool ram = false;
  };
  Physical physical_of(unsigned file) const;
  // The open descriptor of physical file `index` (physical_paths() order), for mapping
  // it (allocator/ram_map.h); owned by the ring, open while it lives.
  int physical_fd(unsigned index) const;
  void sync();             // fdatasync of every physical file
  // Gives the blocks under logical [offset, offset + length) back to the filesystem
  // (FALLOC_FL_PUNCH_HOLE; the size stays): they read as zeros until written again.
  // Best effort: where the filesystem cannot punch, the blocks stay allocated. May be
  // called from any thread, for a range no request in flight uses.
  void punch(uint64_t offset, uint64_t length);

  // Unlinks the physical files of the logical file `path`, those that exist (best effort).
  static void remove_files(const std::string& path);
  // Whether `entry` names one of the physical files of the logical file `name`: `name`
  // itself or a stripe sibling (`name.1` ... `name.7`).
  static bool is_physical_name(std::string_view entry, std::string_view name);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace statepager
