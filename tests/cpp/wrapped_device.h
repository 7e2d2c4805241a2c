// WrappedDevice: the host device with every call passed on, for tests that make some
// calls fail, block or count by overriding them (and calling WrappedDevice's to go on);
// two such: CopyCountingDevice and MapCheckingDevice.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>

#include "allocator/device.h"
#include "backing/errors.h"

namespace statepager {

class WrappedDevice : public Device {
 public:
  std::string name() const override { return host_->name(); }
  size_t granularity() const override { return host_->granularity(); }
  uintptr_t reserve(size_t b) override { return host_->reserve(b); }
  void unreserve(uintptr_t a, size_t b) override { host_->unreserve(a, b); }
  PhysicalPage create_page(size_t b) override { return host_->create_page(b); }
  void release_page(PhysicalPage p, size_t b) override { host_->release_page(p, b); }
  void map(uintptr_t a, size_t b, PhysicalPage p) override { host_->map(a, b, p); }
  void unmap(uintptr_t a, size_t b) override { host_->unmap(a, b); }
  void* alloc_staging(size_t b) override { return host_->alloc_staging(b); }
  void free_staging(void* p, size_t b) override { host_->free_staging(p, b); }
  bool register_host(void* p, size_t b) override { return host_->register_host(p, b); }
  void unregister_host(void* p) override { host_->unregister_host(p); }
  void copy_to_host(void* d, uintptr_t s, size_t b) override { host_->copy_to_host(d, s, b); }
  void copy_to_device(uintptr_t d, const void* s, size_t b) override {
    host_->copy_to_device(d, s, b);
  }
  void fill_zero(uintptr_t d, size_t b) override { host_->fill_zero(d, b); }
  std::optional<Fence> checksum(CopyQueue q, const DeviceRange* r, size_t n,
                                uint32_t* out) override {
    return host_->checksum(q, r, n, out);
  }
  void wait_for_stream(CopyQueue q, uintptr_t s) override { host_->wait_for_stream(q, s); }
  Fence record(CopyQueue q) override { return host_->record(q); }
  Fence record_stream(uintptr_t s) override { return host_->record_stream(s); }
  bool is_done(Fence f) override { return host_->is_done(f); }
  void wait(Fence f) override { host_->wait(f); }
  void release_fence(Fence f) override { host_->release_fence(f); }
  void synchronize() override { host_->synchronize(); }
  size_t free_memory() override { return host_->free_memory(); }

 private:
  std::unique_ptr<Device> host_ = make_host_device();
};

// Counts the copies queued each way, and the zero fills.
class CopyCountingDevice : public WrappedDevice {
 public:
  void copy_to_host(void* d, uintptr_t s, size_t b) override {
    to_host++;
    WrappedDevice::copy_to_host(d, s, b);
  }
  void copy_to_device(uintptr_t d, const void* s, size_t b) override {
    to_device++;
    WrappedDevice::copy_to_device(d, s, b);
  }
  void fill_zero(uintptr_t d, size_t b) override {
    fills++;
    WrappedDevice::fill_zero(d, b);
  }
  int to_host = 0, to_device = 0, fills = 0;
};

// Keeps the books of address space, pages and mappings: unmapping an address that is not
// mapped, or mapping one twice, is a test failure. map() throws for the `fail_at`-th map,
// create_page() while `fail_create`.
class MapCheckingDevice final : public WrappedDevice {
 public:
  uintptr_t reserve(size_t b) override {
    reservations++;
    return WrappedDevice::reserve(b);
  }
  void unreserve(uintptr_t a, size_t b) override {
    reservations--;
    WrappedDevice::unreserve(a, b);
  }
  PhysicalPage create_page(size_t b) override {
    if (fail_create) throw OutOfMemoryError("injected: the device is out of memory");
    pages++;
    return WrappedDevice::create_page(b);
  }
  void release_page(PhysicalPage p, size_t b) override {
    pages--;
    WrappedDevice::release_page(p, b);
  }
  void map(uintptr_t a, size_t b, PhysicalPage p) override {
    if (++maps == fail_at) throw DeviceError("injected: map failed");
    EXPECT_TRUE(mapped.insert(a).second) << "mapped twice";
    WrappedDevice::map(a, b, p);
  }
  void unmap(uintptr_t a, size_t b) override {
    EXPECT_EQ(mapped.erase(a), 1u) << "unmapped an address that was not mapped";
    WrappedDevice::unmap(a, b);
  }
  std::set<uintptr_t> mapped;
  int reservations = 0, pages = 0, maps = 0, fail_at = 0;
  bool fail_create = false;
};

}  // namespace statepager
