#include "allocator/page_pool.h"

#include <algorithm>

namespace statepager {

PagePool::PagePool(Device& device, size_t page_size, size_t hbm_budget, size_t keep)
    : device_(device), page_size_(page_size), hbm_budget_(hbm_budget), keep_(keep) {}

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
    if (!past_budget && (in_use_ + 1) * page_size_ > hbm_budget_) return std::nullopt;
    page = device_.create_page(page_size_);
  }
  in_use_++;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  return page;
}

void PagePool::release(PhysicalPage page) {
  in_use_--;
  if ((cache_.size() + 1) * page_size_ <= keep_) {
    cache_.push_back(page);
  } else {
    device_.release_page(page, page_size_);
  }
}

void PagePool::trim() {
  for (PhysicalPage page : cache_) device_.release_page(page, page_size_);
  cache_.clear();
}

}  // namespace statepager
