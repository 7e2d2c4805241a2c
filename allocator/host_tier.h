// HostTier: pinned host memory between HBM and the store files.
//
// One allocation of host_budget, made once at construction with Device::alloc_staging
// (cuMemHostAlloc on CUDA, so the copy engines reach it at PCIe speed with no kernel copy;
// plain memory on the host backend, same semantics), handed out as 4 KiB-aligned ranges
// and recycled first-fit like the store's ranges: steady state allocates nothing. A range
// is named by an offset in a logical region of its own, above every store file's
// (kHostBase), so the Pager's range bookkeeping (holds, epochs) treats host and store
// ranges alike; host() turns an offset into memory.
//
// start() queues a bucket's copies on the device's copy queues (device to host on kToHost,
// host to device on kToDevice: dedicated streams on CUDA, both directions at once); the
// Pager records the fence that tells when they are done.
//
// Ownership: borrows the Device (it must outlive the tier); owns the memory, freed by the
// destructor. Thread-safety: none; the Pager calls allocate()/free() under its lock and
// the copies from its I/O thread (host() only reads constants).
// Errors: allocate() returns nullopt when no free range is large enough; construction
// throws what alloc_staging throws (OutOfMemoryError when the memory is not there); the
// copies throw DeviceError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "allocator/arena.h"
#include "allocator/device.h"
#include "allocator/job.h"
#include "backing/uring_file.h"

namespace statepager {

class HostTier {
 public:
  // Above every store file's logical offsets (UringFile: kMaxFiles regions).
  static constexpr uint64_t kHostBase = uint64_t{UringFile::kMaxFiles} * UringFile::kRegionBytes;
  static bool is_host(uint64_t offset) { return offset >= kHostBase; }

  HostTier(Device& device, size_t host_budget);
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // A free range of `bytes` (rounded up to 4 KiB), or nullopt.
  std::optional<uint64_t> allocate(size_t bytes);
  void free(uint64_t offset);
  char* host(uint64_t offset) const { return memory_ + (offset - kHostBase); }

  size_t host_budget() const { return host_budget_; }
  size_t used_bytes() const { return ranges_.allocated_bytes(); }

  // Queues job.host_copies not queued yet: device to host for a page-out, host to device
  // for a page-in.
  void start(Job& job);

 private:
  Device& device_;
  size_t host_budget_;
  char* memory_ = nullptr;
  Arena ranges_;  // logical offsets kHostBase .. kHostBase + host_budget
};

}  // namespace statepager
