#include "allocator/arena.h"

#include <string>

#include "backing/errors.h"

namespace statepager {

Arena::Arena(uintptr_t base, size_t bytes) : base_(base), size_(bytes) { free_[base] = bytes; }

uintptr_t Arena::allocate(size_t bytes, size_t align, ArenaEnd end) {
  if (bytes == 0) throw UsageError("Arena::allocate: zero bytes");
  const uintptr_t mask = ~(uintptr_t(align) - 1);
  if (end == ArenaEnd::kLow) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      const uintptr_t start = (it->first + align - 1) & mask;
      const uintptr_t stop = it->first + it->second;
      if (start >= stop || bytes > stop - start) continue;  // (start + bytes could wrap)
      take(it, start, bytes);
      return start;
    }
  } else {
    for (auto it = free_.end(); it != free_.begin();) {
      --it;
      const uintptr_t stop = it->first + it->second;
      if (bytes > stop - it->first) continue;
      const uintptr_t start = (stop - bytes) & mask;
      if (start < it->first) continue;
      take(it, start, bytes);
      return start;
    }
  }
  throw OutOfMemoryError("the pager's address arena (" + std::to_string(size_ >> 30) +
                         " GiB) has no free range of " + std::to_string(bytes) +
                         " bytes: create the Pager with a larger arena_size");
}

void Arena::take(std::map<uintptr_t, size_t>::iterator it, uintptr_t start, size_t bytes) {
  const uintptr_t range_start = it->first;
  const uintptr_t stop = it->first + it->second;
  free_.erase(it);
  if (start > range_start) free_[range_start] = start - range_start;
  if (start + bytes < stop) free_[start + bytes] = stop - (start + bytes);
  used_[start] = bytes;
  allocated_bytes_ += bytes;
}

void Arena::free(uintptr_t addr) {
  auto used = used_.find(addr);
  if (used == used_.end()) throw UsageError("Arena::free: address was not allocated here");
  uintptr_t start = addr;
  size_t len = used->second;
  used_.erase(used);
  allocated_bytes_ -= len;
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = len;
}

void Arena::split(uintptr_t addr, size_t offset) {
  auto used = used_.find(addr);
  if (used == used_.end() || offset == 0 || offset >= used->second) {
    throw UsageError("Arena::split: no allocated range to cut at that offset");
  }
  used_[addr + offset] = used->second - offset;
  used->second = offset;
}

}  // namespace statepager
