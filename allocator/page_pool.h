// PagePool: physical pages of one size, recycled, under a byte budget.
//
// Steady state creates and releases nothing: a returned page goes to a cache (up to
// keep) and is handed out again. Pages in use plus cached pages never exceed
// hbm_budget; peak_in_use_bytes() is the high-water mark of pages in use.
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
  PagePool(Device& device, size_t page_size, size_t hbm_budget, size_t keep);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  std::optional<PhysicalPage> acquire(bool past_budget = false);
  void release(PhysicalPage page);
  void trim();  // returns every cached page to the device
  void set_keep(size_t keep) { keep_ = keep; }

  size_t page_size() const { return page_size_; }
  size_t hbm_budget() const { return hbm_budget_; }
  size_t in_use_bytes() const { return in_use_ * page_size_; }
  size_t cached_bytes() const { return cache_.size() * page_size_; }
  size_t peak_in_use_bytes() const { return peak_in_use_ * page_size_; }
  void reset_peak() { peak_in_use_ = in_use_; }

 private:
  Device& device_;
  size_t page_size_;
  size_t hbm_budget_;
  size_t keep_;
  size_t in_use_ = 0;
  size_t peak_in_use_ = 0;
  std::vector<PhysicalPage> cache_;
};

}  // namespace statepager
