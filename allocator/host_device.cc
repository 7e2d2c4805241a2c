// HostDevice: the pool's host backend. Reservations are PROT_NONE anonymous mappings;
// a physical page is a memfd of page size; map() places it with MAP_FIXED|MAP_SHARED and
// unmap() puts the PROT_NONE reservation back, so an unmapped address faults exactly as
// an unmapped CUDA address does. Copies are memcpy, complete when they return.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "allocator/device.h"
#include "backing/crc32c.h"
#include "backing/errors.h"

namespace statepager {

namespace {

[[noreturn]] void fail(const char* call) {
  const int err = errno;
  const std::string what = std::string("host device: ") + call + " failed: " + std::strerror(err);
  if (err == ENOMEM) throw OutOfMemoryError(what + " (the host is out of memory)");
  throw DeviceError(what);
}

class HostDevice final : public Device {
 public:
  std::string name() const override { return "cpu"; }
  size_t granularity() const override { return size_t(sysconf(_SC_PAGESIZE)); }

  uintptr_t reserve(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("mmap(reserve)");
    return reinterpret_cast<uintptr_t>(p);
  }

  void unreserve(uintptr_t base, size_t bytes) override {
    munmap(reinterpret_cast<void*>(base), bytes);
  }

  PhysicalPage create_page(size_t bytes) override {
    const int fd = memfd_create("statepager-page", MFD_CLOEXEC);
    if (fd < 0) fail("memfd_create");
    // Allocate the page now, as cuMemCreate does, rather than fault it in 4 KiB at a time.
    if (fallocate(fd, 0, 0, off_t(bytes)) != 0) {
      close(fd);
      fail("fallocate(memfd)");
    }
    return PhysicalPage(fd);
  }

  void release_page(PhysicalPage page, size_t) override { close(int(page)); }

  void map(uintptr_t addr, size_t bytes, PhysicalPage page) override {
    void* p = mmap(reinterpret_cast<void*>(addr), bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, int(page), 0);
    if (p == MAP_FAILED) fail("mmap(map)");
  }

  void unmap(uintptr_t addr, size_t bytes) override {
    void* p = mmap(reinterpret_cast<void*>(addr), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) fail("mmap(unmap)");
  }

  void* alloc_staging(size_t bytes) override {
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!p) throw OutOfMemoryError("host device: no memory for " + std::to_string(bytes) +
                                   " bytes of staging");
    return p;
  }

  void free_staging(void* ptr, size_t) override { std::free(ptr); }

  bool register_host(void*, size_t) override { return true; }
  void unregister_host(void*) override {}

  void copy_to_host(void* dst, uintptr_t src, size_t bytes) override {
    std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  }
  void copy_to_device(uintptr_t dst, const void* src, size_t bytes) override {
    std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  }
  void fill_zero(uintptr_t dst, size_t bytes) override {
    std::memset(reinterpret_cast<void*>(dst), 0, bytes);
  }

  std::optional<Fence> checksum(CopyQueue queue, const DeviceRange* ranges, size_t n,
                                uint32_t* out) override {
    for (size_t i = 0; i < n; i++) {
      out[i] = crc32c(0, reinterpret_cast<const void*>(ranges[i].addr), ranges[i].bytes);
    }
    return record(queue);
  }

  void wait_for_stream(CopyQueue, uintptr_t) override {}
  Fence record(CopyQueue) override { return 0; }
  Fence record_stream(uintptr_t) override { return 0; }
  bool is_done(Fence) override { return true; }
  void wait(Fence) override {}
  void release_fence(Fence) override {}

  void synchronize() override {}

  size_t free_memory() override {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    size_t kib = 0;
    while (meminfo >> key >> kib) {
      if (key == "MemAvailable:") return kib * 1024;
      meminfo.ignore(64, '\n');
    }
    return 0;
  }
};

}  // namespace

std::unique_ptr<Device> make_host_device() { return std::make_unique<HostDevice>(); }

}  // namespace statepager
