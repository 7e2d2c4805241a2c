// Pool: one address arena, its physical pages, and the table of which page is mapped.
//
// The arena is cut into pages of page_size. Each page has a reference count; it is
// mapped while the count is above zero and unmapped (its physical page returned to the
// PagePool) when the count drops to zero. Resident extents hold references on the
// pages they touch, so a page shared by two resident extents is mapped once.
//
// Mapping outside the caller's lock: ref_begin() takes the references and the physical
// pages and lists the pages still to map (PendingMaps); map_pending() maps them, touching
// no Pool state, so the caller may drop its lock around it (cuMemSetAccess can take a
// millisecond a page while a device-to-host copy runs, and the Pager's I/O thread needs
// that lock); finish_mapping() marks them mapped. Until then those pages are the caller's
// alone: another ref_begin() or ref() of a range touching one returns false, taking
// nothing (wait for finish_mapping and retry); unref() of them only counts down, and
// the last unref of one never mapped releases it without unmapping (how a failed
// map_pending is undone: unref every range that ref_begin took).
//
// Thread-safety: none, but map_pending(); the Pager serializes calls under its lock.
// Errors: construction throws UsageError for options outside the ranges below, naming
// the option, its value and the range, before reserving anything; ref() and ref_begin()
// throw OutOfMemoryError at the page budget and leave every count as it was (all or
// nothing); device errors pass through (a failed map_pending() unmaps what it mapped).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "allocator/arena.h"
#include "allocator/device.h"
#include "allocator/page_pool.h"

namespace statepager {

struct PoolOptions {
  size_t arena_size = size_t(1) << 40;  // address space only: reserving it costs nothing
  size_t page_size = size_t(32) << 20;
  size_t hbm_budget = ~size_t(0);       // physical bytes mapped or cached, at most
  size_t keep = 0;                      // unmapped pages kept for reuse, at most
};

// page_size: a positive multiple of the device's granularity, at most kMaxPageBytes (a
// page is created whole: a larger one only costs memory and time per map).
constexpr size_t kMaxPageBytes = size_t(1) << 30;
// arena_size: one page to kMaxArenaBytes, the user address space of x86-64 (rounded up
// to whole pages). hbm_budget: at least one page.
constexpr size_t kMaxArenaBytes = size_t(1) << 47;

class Pool {
 public:
  Pool(Device& device, PoolOptions options);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Address ranges; nothing is mapped by these.
  uintptr_t allocate(size_t bytes, size_t align, ArenaEnd end = ArenaEnd::kLow);
  void free(uintptr_t addr);
  void split(uintptr_t addr, size_t offset) { arena_.split(addr, offset); }
  bool contains(uintptr_t addr, size_t bytes) const;

  // A page ref_begin() took and that is still to be mapped.
  struct PendingMap {
    size_t index;  // page number in the arena
    uintptr_t addr;
    PhysicalPage page;
  };
  using PendingMaps = std::vector<PendingMap>;

  // Takes (drops) one reference on every page overlapping [addr, addr + bytes), mapping
  // the pages that were not. false: a page is being mapped by another caller (see the
  // class comment), nothing taken. past_budget: map even beyond the page budget (see
  // PagePool::acquire).
  [[nodiscard]] bool ref(uintptr_t addr, size_t bytes, bool past_budget = false);
  // Every page is dropped even when an unmap fails (the device's error is rethrown
  // after; that page stays in the table, mapped, for a later ref()).
  void unref(uintptr_t addr, size_t bytes);

  // ref() without the mapping: the pages to map are appended to *pending (one caller's
  // ranges may share pages: those already in it just get a reference). false as ref().
  [[nodiscard]] bool ref_begin(uintptr_t addr, size_t bytes, PendingMaps* pending,
                               bool past_budget = false);
  // Maps the pending pages (device calls only: no lock needed). On failure unmaps what it
  // mapped and rethrows.
  void map_pending(const PendingMaps& pending);
  // The pending pages are mapped: anyone may reference them now.
  void finish_mapping(const PendingMaps& pending);
  bool is_mapped(uintptr_t addr, size_t bytes) const;

  void trim() { pages_.trim(); }
  Device& device() { return device_; }
  const PagePool& pages() const { return pages_; }
  PagePool& pages() { return pages_; }
  size_t page_size() const { return page_size_; }
  size_t arena_size() const { return arena_.size(); }
  size_t mapped_bytes() const { return table_.size() * page_size_; }  // or being mapped

 private:
  struct Entry {
    PhysicalPage page;
    uint32_t refs;
    const PendingMaps* mapping = nullptr;  // the ref_begin() caller's, until mapped
  };
  size_t first_page(uintptr_t addr) const { return (addr - arena_.base()) / page_size_; }
  uintptr_t address(size_t index) const { return arena_.base() + index * page_size_; }
  size_t end_page(uintptr_t addr, size_t bytes) const;
  void drop(size_t index);

  Device& device_;
  size_t page_size_;
  Arena arena_;
  PagePool pages_;
  std::unordered_map<size_t, Entry> table_;  // referenced pages (mapped, or being mapped)
};

}  // namespace statepager
