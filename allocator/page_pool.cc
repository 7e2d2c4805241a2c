#include "allocator/page_pool.h"

#include <algorithm>

namespace statepager {

PagePool::PagePool(Device& device, size_t page_bytes, size_t budget_bytes, size_t keep_bytes)
    : device_(device), page_bytes_(page_bytes), budget_bytes_(budget_bytes), keep_bytes_(keep_bytes) {}

// Never throws (see ~Pool).
PagePool::~PagePool() {
  try {
    trim();
  } catch (...) {
  }
}

std::optional<PhysicalPage> PagePool::acquire(bool past_budget) {
  PhysicalPage page;
  if (!cache_.empty()) {
    page = cache_.back();
    cache_.pop_back();
  } else {
    if (!past_budget && (in_use_ + 1) * page_bytes_ > budget_bytes_) return std::nullopt;
    page = device_.create_page(page_bytes_);
  }
  in_use_++;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  return page;
}

void PagePool::release(PhysicalPage page) {
  in_use_--;
  if ((cache_.size() + 1) * page_bytes_ <= keep_bytes_) {
    cache_.push_back(page);
  } else {
    device_.release_page(page, page_bytes_);
  }
}

void PagePool::trim() {
  for (PhysicalPage page : cache_) device_.release_page(page, page_bytes_);
  cache_.clear();
}

}  // namespace statepager
