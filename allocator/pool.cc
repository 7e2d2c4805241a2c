#include "allocator/pool.h"

#include <exception>
#include <string>

#include "backing/align.h"
#include "backing/errors.h"

namespace statepager {

namespace {

// The options, once checked against the ranges in pool.h (before anything is reserved).
const PoolOptions& checked(const PoolOptions& o, const Device& device) {
  const size_t grain = device.granularity();
  if (o.page_size == 0 || o.page_size % grain != 0 || o.page_size > kMaxPageBytes) {
    throw UsageError("page_size " + std::to_string(o.page_size) +
                     " is not allowed: it must be a positive multiple of " + device.name() +
                     "'s granularity (" + std::to_string(grain) + " bytes) and at most " +
                     std::to_string(kMaxPageBytes) + " (1 GiB); 32 MiB is a good size");
  }
  if (o.arena_size < o.page_size || o.arena_size > kMaxArenaBytes) {
    throw UsageError("arena_size " + std::to_string(o.arena_size) +
                     " is not allowed: it must be between one page (page_size " +
                     std::to_string(o.page_size) + ", the arena is reserved in whole pages) "
                     "and " + std::to_string(kMaxArenaBytes) +
                     " (128 TiB, the user address space)");
  }
  if (o.hbm_budget < o.page_size) {
    throw UsageError("hbm_budget " + std::to_string(o.hbm_budget) +
                     " is less than one page (page_size " + std::to_string(o.page_size) +
                     "): nothing could be mapped. Raise it, or lower page_size");
  }
  return o;
}

}  // namespace

Pool::Pool(Device& device, PoolOptions options)
    : device_(device),
      page_size_(checked(options, device).page_size),
      arena_(device.reserve(align_up(options.arena_size, options.page_size)),
             align_up(options.arena_size, options.page_size)),
      pages_(device, options.page_size, options.hbm_budget, options.keep) {}

// Never throws: a destructor may run while the device is failing (a CUDA context with a
// sticky error, a driver shutting down at exit); what cannot be returned then is left to
// the process's end.
Pool::~Pool() {
  try {
    for (auto& [index, entry] : table_) {
      if (entry.mapping == nullptr) device_.unmap(address(index), page_size_);
      pages_.release(entry.page);
    }
    table_.clear();
    pages_.trim();
    device_.unreserve(arena_.base(), arena_.size());
  } catch (...) {
  }
}

uintptr_t Pool::allocate(size_t bytes, size_t align, ArenaEnd end) {
  return arena_.allocate(bytes, align, end);
}

void Pool::free(uintptr_t addr) { arena_.free(addr); }

bool Pool::contains(uintptr_t addr, size_t bytes) const {
  return addr >= arena_.base() && addr + bytes <= arena_.base() + arena_.size();
}

size_t Pool::end_page(uintptr_t addr, size_t bytes) const {
  return (addr - arena_.base() + bytes + page_size_ - 1) / page_size_;
}

bool Pool::ref(uintptr_t addr, size_t bytes, bool past_budget) {
  PendingMaps pending;
  if (!ref_begin(addr, bytes, &pending, past_budget)) return false;
  try {
    map_pending(pending);
  } catch (...) {
    unref(addr, bytes);
    throw;
  }
  finish_mapping(pending);
  return true;
}

bool Pool::ref_begin(uintptr_t addr, size_t bytes, PendingMaps* pending, bool past_budget) {
  const size_t first = first_page(addr), end = end_page(addr, bytes), had = pending->size();
  for (size_t i = first; i < end; i++) {
    auto it = table_.find(i);
    if (it != table_.end() && it->second.mapping != nullptr && it->second.mapping != pending) {
      return false;
    }
  }
  for (size_t i = first; i < end; i++) {
    auto it = table_.find(i);
    if (it != table_.end()) {
      it->second.refs++;
      continue;
    }
    std::optional<PhysicalPage> page;
    try {
      page = pages_.acquire(past_budget);  // may throw too: the device out of memory
      if (!page) {
        throw OutOfMemoryError("the pager's page budget (" +
                               std::to_string(pages_.hbm_budget() >> 20) +
                               " MiB) is used up: page out other tensors first, or raise "
                               "the budget");
      }
    } catch (...) {
      for (size_t j = first; j < i; j++) drop(j);  // the pages this call made were not mapped
      pending->resize(had);
      throw;
    }
    table_[i] = Entry{*page, 1, pending};
    pending->push_back(PendingMap{i, address(i), *page});
  }
  return true;
}

void Pool::map_pending(const PendingMaps& pending) {
  size_t mapped = 0;
  try {
    for (; mapped < pending.size(); mapped++) {
      device_.map(pending[mapped].addr, page_size_, pending[mapped].page);
    }
  } catch (...) {
    while (mapped > 0) {
      --mapped;
      try {
        device_.unmap(pending[mapped].addr, page_size_);
      } catch (...) {
      }
    }
    throw;
  }
}

void Pool::finish_mapping(const PendingMaps& pending) {
  for (const PendingMap& p : pending) table_.at(p.index).mapping = nullptr;
}

void Pool::unref(uintptr_t addr, size_t bytes) {
  const size_t first = first_page(addr), end = end_page(addr, bytes);
  std::exception_ptr error;  // the first page's, once every page is dropped
  for (size_t i = first; i < end; i++) {
    try {
      drop(i);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

void Pool::drop(size_t index) {
  auto it = table_.find(index);
  if (it == table_.end()) throw UsageError("Pool::unref: page is not mapped");
  if (--it->second.refs > 0) return;
  // A failed unmap leaves the page in the table, mapped with no reference: a later ref()
  // finds it mapped.
  if (it->second.mapping == nullptr) device_.unmap(address(index), page_size_);
  pages_.release(it->second.page);
  table_.erase(it);
}

bool Pool::is_mapped(uintptr_t addr, size_t bytes) const {
  const size_t first = first_page(addr), end = end_page(addr, bytes);
  for (size_t i = first; i < end; i++) {
    auto it = table_.find(i);
    if (it == table_.end() || it->second.mapping != nullptr) return false;
  }
  return true;
}

}  // namespace statepager
