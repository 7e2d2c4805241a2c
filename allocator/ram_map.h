// RamMap: the store's files in RAM, mapped for the device's own copies.
//
// On a RAM filesystem (tmpfs, ramfs) the store's files are host memory already, yet a
// page-in or page-out through io_uring has the kernel copy every byte on the CPU, between
// them and the pinned staging: on the H200 machine 12 of its 16 cores for about 15 GB/s
// each way (see Note [A store in RAM is mapped] in docs/design.md). RamMap maps the physical files
// (MAP_SHARED), populates their pages and registers them with the device
// (Device::register_host), so that StoreTier's device copies reach the files' pages
// directly: no staging, no request, no CPU copy.
//
// grow(file) maps what a logical file's physical files hold past what is mapped of them
// (whole 4 KiB pages, one mapping per growth); resolve() turns a logical range into the
// memory of those mappings. What it keeps true:
// - Nothing is mapped past a file's end, and a file cut short from outside is told:
//   grow() throws CorruptStoreError when a physical file is shorter than its mappings (a
//   read through io_uring would meet ENODATA there).
// - A registered page never leaves its file: punch() does nothing to a logical file with
//   mappings (a punched page stays pinned for the device but is gone from the file, so
//   later reads of the file would miss what the device wrote).
// - Where mmap, populating (ENOSPC: a full filesystem) or registering fails, that
//   physical file is mapped no further: resolve() answers false for its unmapped bytes
//   and the caller goes through io_uring, which reports a full filesystem cleanly.
//
// A file cut short between grow()'s check and a copy is not told (the device then writes
// pages the file no longer holds, and the CPU's zeroing of padding faults): only a change
// made outside statepager, while it runs, can do that.
//
// Ownership: borrows the Device and the UringFile, which must outlive it; owns its
// mappings, unregistered and unmapped by the destructor.
// Thread-safety: grow() and resolve() from one thread (the Pager's I/O thread), punch()
// and mapped_bytes() from any; mu_ guards the mappings' bookkeeping, not the slow part of
// a growth (mmap, populate, register), during which punch() treats the file as mapped.
// Errors: grow() throws CorruptStoreError (above), IoError when fstat fails.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "allocator/device.h"
#include "backing/uring_file.h"

namespace statepager {

class RamMap {
 public:
  RamMap(Device& device, UringFile& file);
  ~RamMap();
  RamMap(const RamMap&) = delete;
  RamMap& operator=(const RamMap&) = delete;

  // Maps logical file `file`'s physical files up to their current ends (files not in RAM:
  // nothing to do).
  void grow(unsigned file);

  // Memory of mapped store bytes, in logical order.
  struct Piece {
    char* host;
    size_t bytes;
    const char* mapping;  // the start of the mapping holding it: one registration each
  };
  // Appends the memory of logical store bytes [offset, offset + bytes) to *out and
  // returns true when all of it is mapped; otherwise returns false, *out unchanged.
  bool resolve(uint64_t offset, size_t bytes, std::vector<Piece>* out) const;

  // UringFile::punch() of logical [offset, offset + length), unless its file has
  // mappings (see above).
  void punch(uint64_t offset, uint64_t length);

  uint64_t mapped_bytes() const;  // of every file, now

 private:
  struct Mapping {
    uint64_t offset;  // in the physical file
    uint64_t bytes;
    char* host;
  };
  struct Physical {
    int fd = -1;  // the ring's (UringFile::physical_fd)
    std::string path;
    std::vector<Mapping> maps;  // contiguous from offset 0, in order
    uint64_t end = 0;           // bytes mapped: [0, end)
    bool stopped = false;       // a mapping failed: no more
    bool growing = false;       // grow() is mapping more of it (without mu_)
  };
  Physical& physical_locked(unsigned index);
  void grow_one(unsigned index);

  Device& device_;
  UringFile& file_;
  mutable std::mutex mu_;
  std::vector<Physical> physical_;  // by physical file index; guarded by mu_
};

}  // namespace statepager
