// ExtentTable: a Pager's extents (allocator/pager.h), by id and by address, and the
// record of each: its state, its ranges in the store files and the host tier, what it
// committed in an open epoch. Internal to the Pager: its interface names ExtentIds alone.
//
// Ownership: the table owns its Extents; a reference stays valid until erase() of its id.
// Thread-safety: none; the Pager guards the table and every Extent with its lock.
// Errors: at() throws UsageError for an id that is not in the table.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "allocator/job.h"

namespace statepager {

// The ranges an extent refers to, as logical offsets: store ranges of the store files
// (UringFile), host ranges above HostTier::kHostBase, so that holds and frees treat both
// alike.
struct ExtentRanges {
  uint64_t store = 0;  // its range in its store: its bytes when FILE
  // Moving to another store (move_to_store() of a FILE extent): its range there, taken on
  // its next page-in or read-ahead (the old range holds its bytes until then).
  std::optional<uint64_t> next_store;
  // Its host range: its bytes when HOST, and while a page-out fills it, a read-ahead
  // fills it, a spill empties it, or a page-in for a read keeps it (Extent::rest).
  std::optional<uint64_t> host;
};

// An extent in an open epoch: what it was at the epoch's begin, its committed state.
struct Committed {
  uint64_t epoch;
  Residency state;      // at rest: kZero, kFile or kHost
  ExtentRanges ranges;  // the committed bytes are ranges.store (kFile) or ranges.host (kHost)
};

// A move of an extent between the tiers by a job that is not its own bucket's: written
// back from its host range to its store range to make room (Pager::choose_spills_locked),
// or read from its store range into its host range (Pager::read_ahead).
enum class TierMove { kSpill, kReadAhead };

// One extent (see allocator/pager.h). A Job carries copies of what the I/O thread needs
// (addresses, ranges).
struct Extent {
  uintptr_t addr;
  size_t bytes;
  size_t file_bytes;  // of its store range (and host range)
  Residency state = Residency::kZero;
  ExtentRanges ranges;
  std::optional<Committed> committed;  // in an open epoch
  // PAGING_OUT being spilled, or PAGING_IN being read ahead; buckets naming it wait.
  std::optional<TierMove> tier_move;
  bool segment = false;  // PyTorch's: stays mapped until PyTorch frees it, even after close
  bool dead = false;     // released while its bucket was in flight: freed when it completes
  uint64_t last_use = 0;  // Pager::use_clock_ at its last page-in, page-out or read-ahead
  // Pager::paged_in_bytes_ when it is expected to be paged in again (its last page-out's
  // reuse_after hint), if known.
  std::optional<uint64_t> next_use;
  Residency restore_from = Residency::kZero;  // its state before a restore (begin_restore)
  ExtentId next_piece = 0;  // create_pieces(): the tensor's next piece (0: none)
  // RESIDENT: where its bytes as paged in for a read also lie at rest, untouched since
  // (see Pager::release_unchanged): kZero (they were zeros), kFile (its store range) or
  // kHost (its host range, kept). None: nowhere else, or not known (paged in not for a
  // read, named by such a page-in since, moved to another store since, or named by a
  // page-out or discard since).
  std::optional<Residency> rest;

  // The ranges it refers to now, and in an epoch also those it committed, each once.
  std::vector<uint64_t> referenced() const {
    std::vector<uint64_t> out;
    auto add = [&](std::optional<uint64_t> r) {
      if (r && std::find(out.begin(), out.end(), *r) == out.end()) out.push_back(*r);
    };
    for (const ExtentRanges* r : {&ranges, committed ? &committed->ranges : nullptr}) {
      if (r == nullptr) continue;
      add(r->store);
      add(r->next_store);
      add(r->host);
    }
    return out;
  }
};

class ExtentTable {
 public:
  using Map = std::unordered_map<ExtentId, std::unique_ptr<Extent>>;

  // Adds `e` under a new id (counting up from 1, never reused), found by its address too.
  ExtentId add(std::unique_ptr<Extent> e);
  void erase(ExtentId id);

  Extent& at(ExtentId id);
  const Extent& at(ExtentId id) const;
  Extent* find(ExtentId id);  // null for an id not in the table
  const Extent* find(ExtentId id) const;
  std::optional<ExtentId> starting_at(uintptr_t addr) const;  // the extent at `addr`, if any

  size_t size() const { return extents_.size(); }
  Map::iterator begin() { return extents_.begin(); }
  Map::iterator end() { return extents_.end(); }
  Map::const_iterator begin() const { return extents_.begin(); }
  Map::const_iterator end() const { return extents_.end(); }

 private:
  Map extents_;
  std::unordered_map<uintptr_t, ExtentId> by_address_;
  ExtentId next_id_ = 1;
};

}  // namespace statepager
