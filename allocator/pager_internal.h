// What the files of Pager's implementation share (allocator/pager.cc, pager_jobs.cc,
// pager_host.cc, pager_epochs.cc): the extent table's records and their constants. Not
// part of Pager's interface: included by those files alone.
#pragma once

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/pager.h"

namespace statepager {

constexpr size_t kFileAlign = UringFile::kAlignment;
constexpr size_t kAddressAlign = 4096;

inline size_t align_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// An extent's own range in its store: whole file blocks, one at least.
inline size_t file_range_bytes(size_t bytes) {
  return align_up(std::max<size_t>(bytes, 1), kFileAlign);
}

constexpr uint64_t kNoOffset = ~uint64_t{0};
constexpr uint64_t kNoUse = ~uint64_t{0};  // Extent::next_use not known

// Bytes nowhere, in a store file or in the host tier: no bucket is moving it.
inline bool at_rest(Residency s) {
  return s == Residency::kZero || s == Residency::kFile || s == Residency::kHost;
}

inline unsigned store_index(uint64_t store_offset) {
  return static_cast<unsigned>(store_offset / UringFile::kRegionBytes);
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

// Guarded by mu_ (a Job carries copies of what the I/O thread needs: addresses, ranges).
struct Pager::Extent {
  uintptr_t addr;
  size_t bytes;
  uint64_t store_offset;                // its range in its store
  size_t file_bytes;
  uint64_t next_offset = kNoOffset;    // a FILE extent's range in the store it moves to
  Residency state = Residency::kZero;
  bool segment = false;  // PyTorch's: stays mapped until PyTorch frees it, even after close
  bool dead = false;     // released while its bucket was in flight: freed when it completes
  // In an open epoch (epoch != 0): what it was at the epoch's begin, its committed state.
  uint64_t epoch = 0;
  Residency committed_state = Residency::kZero;
  uint64_t committed_offset = kNoOffset;  // store_offset then: the committed bytes when FILE
  uint64_t committed_next = kNoOffset;    // next_offset then
  uint64_t host_offset = kNoOffset;       // HOST (or paging out to it): its host range
  uint64_t committed_host = kNoOffset;    // host_offset then
  uint64_t last_use = 0;  // Pager::use_clock_ at its last page-in, page-out or read-ahead
  // Pager::paged_in_bytes_ when it is expected to be paged in again (its last page-out's
  // reuse_after hint), or kNoUse.
  uint64_t next_use = kNoUse;
  bool tier_moving = false;  // being spilled or read ahead (a Job with spills or tier_move)
  Residency restore_from = Residency::kZero;  // its state before a restore (see begin_restore)
  ExtentId next_piece = 0;  // create_pieces(): the tensor's next piece (0: none)
  // RESIDENT: where its bytes as paged in for a read also lie at rest, untouched since
  // (see Pager::release_unchanged): kZero (they were zeros), kFile (its store range),
  // kHost (its host range, kept), or kResident (nowhere else, or not known: paged in
  // not for a read, named by such a page-in since, moved to another store since, or
  // named by a page-out or discard since).
  Residency rest = Residency::kResident;

  // The store ranges it refers to now, and in an epoch also those it committed.
  std::vector<uint64_t> ranges() const {
    std::vector<uint64_t> out;
    for (uint64_t r : {store_offset, next_offset, committed_offset, committed_next, host_offset,
                       committed_host}) {
      if (r != kNoOffset && std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
    }
    return out;
  }
};

}  // namespace statepager
