// Pool: one address arena, its physical pages, and the table of which page is mapped.
//
// The arena is cut into pages of page_bytes. Each page has a reference count; it is
// mapped while the count is above zero and unmapped (its physical page returned to the
// PagePool) when the count drops to zero. Resident extents hold references on the
// pages they touch, so a page shared by two resident extents is mapped once.
//
// Thread-safety: none; the Pager serializes calls under its lock.
// Errors: construction throws UsageError for options outside the ranges below, naming
// the option, its value and the range, before reserving anything; ref() throws
// OutOfMemoryError at the page budget and leaves every count as it was (all or nothing);
// device errors pass through.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>

#include "allocator/arena.h"
#include "allocator/device.h"
#include "allocator/page_pool.h"

namespace statepager {

struct PoolOptions {
  size_t arena_bytes = size_t(1) << 40;   // address space only: reserving it costs nothing
  size_t page_bytes = size_t(32) << 20;
  size_t budget_bytes = ~size_t(0);       // physical bytes mapped or cached, at most
  size_t keep_bytes = 0;                  // unmapped pages kept for reuse, at most
};

// page_bytes: a positive multiple of the device's granularity, at most kMaxPageBytes (a
// page is created whole: a larger one only costs memory and time per map).
constexpr size_t kMaxPageBytes = size_t(1) << 30;
// arena_bytes: 1 to kMaxArenaBytes, the user address space of x86-64 (rounded up to
// whole pages). budget_bytes: at least one page.
constexpr size_t kMaxArenaBytes = size_t(1) << 47;

class Pool {
 public:
  Pool(Device& device, PoolOptions options);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Address ranges; nothing is mapped by these.
  uintptr_t allocate(size_t bytes, size_t align);
  void free(uintptr_t addr);
  void split(uintptr_t addr, size_t offset) { arena_.split(addr, offset); }
  bool contains(uintptr_t addr, size_t bytes) const;

  // Takes (drops) one reference on every page overlapping [addr, addr + bytes).
  // past_budget: map even beyond the page budget (see PagePool::acquire).
  void ref(uintptr_t addr, size_t bytes, bool past_budget = false);
  void unref(uintptr_t addr, size_t bytes);
  bool is_mapped(uintptr_t addr, size_t bytes) const;

  void trim() { pages_.trim(); }
  Device& device() { return device_; }
  const PagePool& pages() const { return pages_; }
  PagePool& pages() { return pages_; }
  size_t page_bytes() const { return page_bytes_; }
  size_t arena_bytes() const { return arena_.size(); }
  size_t mapped_bytes() const { return table_.size() * page_bytes_; }

 private:
  struct Entry {
    PhysicalPage page;
    uint32_t refs;
  };
  size_t first_page(uintptr_t addr) const { return (addr - arena_.base()) / page_bytes_; }
  size_t end_page(uintptr_t addr, size_t bytes) const;
  void drop(size_t index);

  Device& device_;
  size_t page_bytes_;
  Arena arena_;
  PagePool pages_;
  std::unordered_map<size_t, Entry> table_;  // mapped pages only
};

}  // namespace statepager
