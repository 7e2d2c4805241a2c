// PagePool: physical pages of one size, recycled, under a byte budget.
//
// Steady state creates and releases nothing: a returned page goes to a cache (up to
// keep_bytes) and is handed out again. Pages in use plus cached pages never exceed
// budget_bytes; peak_in_use_bytes() is the high-water mark of pages in use.
//
// Thread-safety: none; the Pool serializes calls.
// Errors: acquire() returns nullopt at the budget (unless told to pass it: memory the
// caller cannot do without, such as a segment PyTorch asked for); the device's OutOfMemoryError and
// DeviceError pass through.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "allocator/device.h"

namespace statepager {

class PagePool {
 public:
  PagePool(Device& device, size_t page_bytes, size_t budget_bytes, size_t keep_bytes);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  std::optional<PhysicalPage> acquire(bool past_budget = false);
  void release(PhysicalPage page);
  void trim();  // returns every cached page to the device
  void set_keep_bytes(size_t keep_bytes) { keep_bytes_ = keep_bytes; }

  size_t page_bytes() const { return page_bytes_; }
  size_t budget_bytes() const { return budget_bytes_; }
  size_t in_use_bytes() const { return in_use_ * page_bytes_; }
  size_t cached_bytes() const { return cache_.size() * page_bytes_; }
  size_t peak_in_use_bytes() const { return peak_in_use_ * page_bytes_; }
  void reset_peak() { peak_in_use_ = in_use_; }

 private:
  Device& device_;
  size_t page_bytes_;
  size_t budget_bytes_;
  size_t keep_bytes_;
  size_t in_use_ = 0;
  size_t peak_in_use_ = 0;
  std::vector<PhysicalPage> cache_;
};

}  // namespace statepager
