// What the files of Pager's implementation share (allocator/pager.cc, pager_jobs.cc,
// pager_host.cc, pager_epochs.cc, pager_crc.cc, pager_unchanged.cc): the stores' records
// and the constants of extents' ranges (the extents' own records: allocator/extent_table.h).
// Not part of Pager's interface: included by those files alone.
#pragma once

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/pager.h"
#include "backing/align.h"

namespace statepager {

constexpr size_t kAddressAlign = 4096;

// An extent's own range in its store: whole file blocks, one at least.
inline size_t file_range_bytes(size_t bytes) {
  return align_up(std::max<size_t>(bytes, 1), kFileAlign);
}

// Bytes nowhere, in a store file or in the host tier: no bucket is moving it.
inline bool at_rest(Residency s) {
  return s == Residency::kZero || s == Residency::kFile || s == Residency::kHost;
}

// A bucket's extents in id order, each once (a bucket may name an extent twice).
inline std::vector<ExtentId> sorted_unique(std::vector<ExtentId> ids) {
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

// What a page-in writes of an extent of `bytes`: them and the rest of their last 4 KiB
// block. Those rounding bytes are the extent's own (the arena hands out kAddressAlign-
// aligned addresses, and every piece of a tensor but the last is a multiple of it),
// mapped with its last byte, and zero in its store range and host range; written, they
// let the fills and copies of neighbouring small extents (a q8 tensor's scales, a norm's
// codes) join into one. StoreTier rounds its page-ins' pieces the same way.
static_assert(kAddressAlign % kFileAlign == 0, "a piece's rounding must be its extent's own");
inline size_t page_in_bytes(size_t bytes) { return align_up(bytes, kFileAlign); }

// Guarded by mu_.
struct Pager::Store {
  std::string name;
  Arena space;       // its ranges, as logical offsets of file_ (see UringFile)
  // The crc32c of what statepager last wrote into a range of it, by the range's offset,
  // where known (see Note [Store checksums]).
  std::unordered_map<uint64_t, uint32_t> crcs;
};

}  // namespace statepager
