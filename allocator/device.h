// Device: what the pool needs from a memory system, and nothing more (LevelDB's Env).
//
// Two implementations: HostDevice (mmap reservations, memfd pages; CPU tensors and CI)
// and CudaDevice (CUDA driver VMM: cuMemAddressReserve, cuMemCreate, cuMemMap). Both give
// the same semantics: a reserved range has a stable address and no memory behind it;
// map() puts one physical page at an address; touching an unmapped address is fatal
// (SIGSEGV on the host, an illegal-address error that kills the CUDA context on the GPU).
//
// Copies between device memory and staging (pinned host memory from alloc_staging, or host
// memory registered with register_host) run on two queues, one per direction, in
// submission order. record() returns a fence that
// is_done() reports once every copy queued before it on that queue has finished.
//
// Thread-safety: every method may be called from any thread; implementations serialize
// what they must. Errors: OutOfMemoryError when create_page() finds no memory,
// DeviceError for anything else the driver refuses (backing/errors.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace statepager {

using PhysicalPage = uint64_t;
using Fence = uint64_t;

enum class CopyQueue { kToHost = 0, kToDevice = 1 };

// One copy between device memory at `addr` and host memory at `host` (staging or
// registered); its queue gives the direction.
struct HostCopy {
  uintptr_t addr;
  char* host;
  size_t bytes;
};

// A range of device memory.
struct DeviceRange {
  uintptr_t addr;
  size_t bytes;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual std::string name() const = 0;      // "cpu" or "cuda:N"
  virtual size_t granularity() const = 0;    // page sizes and addresses are multiples of it

  // Address space: reserve() returns `bytes` of address space with nothing mapped.
  virtual uintptr_t reserve(size_t bytes) = 0;
  virtual void unreserve(uintptr_t base, size_t bytes) = 0;

  // Physical pages: create_page() returns one page of `bytes` (OutOfMemoryError if none).
  virtual PhysicalPage create_page(size_t bytes) = 0;
  virtual void release_page(PhysicalPage page, size_t bytes) = 0;

  // Mapping: a whole page at a granularity-aligned address inside a reservation.
  // unmap() must only be called once no queued copy or kernel can still touch the range.
  virtual void map(uintptr_t addr, size_t bytes, PhysicalPage page) = 0;
  virtual void unmap(uintptr_t addr, size_t bytes) = 0;

  // Staging memory: pinned host memory, aligned to 4 KiB, usable by the copy queues.
  virtual void* alloc_staging(size_t bytes) = 0;
  virtual void free_staging(void* ptr, size_t bytes) = 0;

  // Registered host memory: `bytes` at `ptr` (4 KiB-aligned; a file's shared mapping
  // too) become reachable by the copy queues like staging, until unregister_host(ptr)
  // (cuMemHostRegister on CUDA, which pins the pages; the host backend reaches any
  // memory). Returns false, registering nothing, where the device refuses the range.
  virtual bool register_host(void* ptr, size_t bytes) = 0;
  virtual void unregister_host(void* ptr) = 0;

  // Copies and fills, queued in order on their queue.
  virtual void copy_to_host(void* dst, uintptr_t src, size_t bytes) = 0;         // kToHost
  virtual void copy_to_device(uintptr_t dst, const void* src, size_t bytes) = 0; // kToDevice
  virtual void fill_zero(uintptr_t dst, size_t bytes) = 0;                       // kToDevice
  // `n` copies on `queue` (kToHost: device -> host), queued one by one in order. Not
  // cuMemcpyBatchAsync (CUDA 13), though it costs the caller's thread 0.6 us a 1 MiB copy
  // against about 9 us: on the H200's driver (580.159.04) it intermittently corrupted the
  // copy queue's push buffer (Xid 32), breaking the CUDA context mid-step
  // (see Note [Copies are queued one by one] in docs/design.md). A failure
  // leaves the copies before it queued.
  void copy_batch(CopyQueue queue, const HostCopy* copies, size_t n) {
    for (size_t i = 0; i < n; i++) {
      if (queue == CopyQueue::kToHost) {
        copy_to_host(copies[i].host, copies[i].addr, copies[i].bytes);
      } else {
        copy_to_device(copies[i].addr, copies[i].host, copies[i].bytes);
      }
    }
  }

  // The crc32c (backing/crc32c.h's crc32c(0, bytes, n)) of each of `n` ranges of device
  // memory as they are once what is queued on `queue` so far has run, into out[i]
  // (memory from alloc_staging). Returns a fence (release it like record()'s) that is
  // done once out[] holds them; work queued on `queue` later does not wait for them. The
  // ranges must not change until then. Returns nullopt, queuing nothing, where the
  // device cannot (CUDA without the checksum kernel: see set_cuda_checksum_kernel); the
  // caller then checksums a host copy of the bytes itself.
  virtual std::optional<Fence> checksum(CopyQueue queue, const DeviceRange* ranges, size_t n,
                                        uint32_t* out) = 0;

  // Makes later work on `queue` wait for all work queued so far on the caller's stream
  // `stream` (a cudaStream_t as an integer; 0 = the legacy default stream). No-op on host.
  virtual void wait_for_stream(CopyQueue queue, uintptr_t stream) = 0;

  // Fences: record() marks the current end of `queue`; is_done() polls; release_fence()
  // returns it once the caller no longer needs it. wait() blocks until it is done.
  virtual Fence record(CopyQueue queue) = 0;
  // A fence that marks the current end of the caller's stream `stream` (as in
  // wait_for_stream): done once the work queued there so far has run, whatever the copy
  // queues still hold (a discard's unmap waits for the kernels that used its pages, not
  // for page-outs queued before it). Host: done at once.
  virtual Fence record_stream(uintptr_t stream) = 0;
  virtual bool is_done(Fence fence) = 0;
  virtual void wait(Fence fence) = 0;
  virtual void release_fence(Fence fence) = 0;

  // Waits for all work on the device, the caller's streams included (before unmapping
  // memory that kernels may still touch).
  virtual void synchronize() = 0;

  // Bytes of physical memory the device has free (driver's view; host: MemAvailable).
  virtual size_t free_memory() = 0;
};

// The host backend. `granularity` defaults to the OS page size.
std::unique_ptr<Device> make_host_device();

// The CUDA backend for device `ordinal`. Loads libcuda.so.1 at run time, so a build
// without a GPU or driver still loads; throws DeviceError naming the cause when the
// driver or the device is missing.
std::unique_ptr<Device> make_cuda_device(int ordinal);

// The kernel a CUDA device's checksum() queues (kernels/store_crc.h, crc32c_ranges, on the
// stream `stream` of device `ordinal`), given by the Python extension, which links the
// kernels; the C++ core does not (it loads the driver alone). Until it is given,
// checksum() on CUDA returns false. May be called from any thread, at any time.
using ChecksumKernel = void (*)(int ordinal, uintptr_t stream, const DeviceRange* ranges,
                                size_t n, uint32_t* out);
void set_cuda_checksum_kernel(ChecksumKernel kernel);

// True when a CUDA driver and at least one device are present.
bool cuda_available();

}  // namespace statepager
