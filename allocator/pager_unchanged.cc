// Pager's reads (allocator/pager.h, release_unchanged): where a resident extent's bytes
// also lie at rest (Extent::rest), set by its page-in and forgotten by any page-out, and
// the page-out that returns unchanged extents there without writing them.
#include "allocator/pager.h"
#include "allocator/pager_internal.h"

namespace statepager {

Ticket Pager::release_unchanged(const std::vector<ExtentId>& bucket, uintptr_t stream,
                                uint64_t reuse_after) {
  return submit(std::make_shared<Job>(JobKind::kReleaseUnchanged), bucket, stream,
                reuse_after);
}

// A page-in completed: e's bytes came from `before`. For a read, they stay there: zeros,
// its store range (unless the extent moves to another store on this page-in: its new
// range holds nothing yet), its host range (kept).
void Pager::paged_in_locked(Extent& e, Residency before, bool for_read) {
  const bool keep_host = for_read && before == Residency::kHost;
  const bool moved = e.ranges.next_store.has_value();
  if (!for_read || (before == Residency::kFile && moved)) {
    e.rest.reset();
  } else {
    e.rest = before;
  }
  finish_move_locked(e);
  if (!keep_host) drop_host_locked(e);
}

// Resident e may be written (by the caller of a page-in not for a read, or in place by a
// page-out): what lay at rest is no longer known to be its bytes; a host range kept for
// it goes. Of an extent at rest, `rest` means nothing (a discard takes those too).
void Pager::forget_rest_locked(Extent& e) {
  if (e.state != Residency::kResident) return;
  if (e.rest == Residency::kHost) drop_host_locked(e);
  e.rest.reset();
}

// Of a release_unchanged() bucket's extents (job.extents, resident), those with bytes at
// rest leave job.extents for job.returned; the others stay, to be written.
void Pager::return_unchanged_locked(Job& job) {
  std::vector<ExtentId> written;
  for (ExtentId id : job.extents) {
    const Extent& e = extents_.at(id);
    if (!e.rest) {
      written.push_back(id);
    } else {
      job.returned.push_back(id);
      job.returned_to.push_back(*e.rest);
    }
  }
  job.extents = std::move(written);
}

}  // namespace statepager
