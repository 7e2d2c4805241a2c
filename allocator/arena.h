// Arena: allocator of address ranges inside one reservation, from either end.
//
// The arena hands out ranges; it never touches memory. Neighbouring allocations are
// neighbours in the address space, so small tensors share pages. Allocations come from
// either end: first fit from the bottom (ArenaEnd::kLow) or last fit from the top
// (kHigh), so that ranges paged together can be kept apart from ranges that are not
// (Note [Stored forms pack at the arena's top], docs/design.md).
//
// Thread-safety: none; the Pool serializes calls.
// Errors: allocate() throws OutOfMemoryError when no free range is large enough;
// free() of an address that was not allocated throws UsageError, as does split() of one
// or at an offset outside it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

namespace statepager {

enum class ArenaEnd {
  kLow,   // the lowest free range that fits, its start
  kHigh,  // the highest free range that fits, its end
};

class Arena {
 public:
  Arena(uintptr_t base, size_t bytes);

  // Returns the start of a free range of `bytes`, aligned to `align` (a power of two),
  // taken from the `end` of the arena.
  uintptr_t allocate(size_t bytes, size_t align, ArenaEnd end = ArenaEnd::kLow);
  void free(uintptr_t addr);
  // Cuts the allocated range starting at `addr` in two at addr + offset (0 < offset <
  // its length): each part is then freed on its own. UsageError otherwise.
  void split(uintptr_t addr, size_t offset);

  uintptr_t base() const { return base_; }
  size_t size() const { return size_; }
  size_t allocated_bytes() const { return allocated_bytes_; }

 private:
  // Cuts [start, start + bytes) out of the free range `it` holding it.
  void take(std::map<uintptr_t, size_t>::iterator it, uintptr_t start, size_t bytes);

  uintptr_t base_;
  size_t size_;
  size_t allocated_bytes_ = 0;
  std::map<uintptr_t, size_t> free_;  // start -> length, coalesced
  std::map<uintptr_t, size_t> used_;  // start -> length
};

}  // namespace statepager
